"""Deprecated: the old path of :mod:`qkov.show.study_displays` (removed in 1.1); importing it warns and gives that module."""

from __future__ import annotations

import sys

from ..deprecated import warn_renamed
from . import study_displays

warn_renamed("qkov.show.dynamics", "qkov.show.study_displays")
sys.modules[__name__] = study_displays
