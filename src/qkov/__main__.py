"""``python -m qkov`` runs the command line (also what ``torchrun -m qkov`` starts)."""

import sys

from .apps.cli import main

__all__: list[str] = []

sys.exit(main())
