"""A series of snapshots read as one: the measures of each snapshot (:mod:`.measures`) and the
induction-head phase change found from them by stated methods (:mod:`.phase`).
"""

from __future__ import annotations

from .phase import Bump, loss_bump, pca_trajectory, rise_window, SHARE, SHARPNESS, smooth, Trajectory, Window
from .measures import (
    measure,
    measure_budget,
    MIN_RISE,
    PER_TOKEN_SEQUENCES,
    previous_token_on_text,
    read_series,
    Sample,
    SeriesReading,
    text_pass,
)

__all__ = [
    "Bump",
    "loss_bump",
    "pca_trajectory",
    "rise_window",
    "SHARE",
    "SHARPNESS",
    "smooth",
    "Trajectory",
    "Window",
    "measure",
    "measure_budget",
    "MIN_RISE",
    "PER_TOKEN_SEQUENCES",
    "previous_token_on_text",
    "read_series",
    "Sample",
    "SeriesReading",
    "text_pass",
]
