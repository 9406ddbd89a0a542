"""The version of qkov (the one place it is set: pyproject.toml reads it from here)."""

__all__ = ["__version__"]

__version__ = "1.1.0"
"""The release, as ``qkov --version`` prints it and the package's metadata records it."""
