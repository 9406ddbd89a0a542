"""The analyses' progress callbacks: the package-wide protocol :class:`qkov.progress.Progress`
``(what, done, total)``, imported here where the analyses have always found it."""

from __future__ import annotations

from ..progress import Progress, tick

__all__ = ["Progress", "tick"]
