"""Deprecated: the old path of :mod:`qkov.analysis.snapshot_measures` (removed in 1.1); importing it warns and gives that module."""

from __future__ import annotations

import sys

from ..deprecated import warn_renamed
from . import snapshot_measures

warn_renamed("qkov.analysis.dynamics", "qkov.analysis.snapshot_measures")
sys.modules[__name__] = snapshot_measures
