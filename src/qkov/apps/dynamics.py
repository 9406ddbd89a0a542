"""Deprecated: the old path of :mod:`qkov.apps.dynamics_study` (removed in 1.1); importing it warns and gives that module."""

from __future__ import annotations

import sys

from ..deprecated import warn_renamed
from . import dynamics_study

warn_renamed("qkov.apps.dynamics", "qkov.apps.dynamics_study")
sys.modules[__name__] = dynamics_study
