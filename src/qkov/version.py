"""The version of qkov."""

__version__ = "0.1.0"
