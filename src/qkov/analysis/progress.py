"""How a long analysis reports its progress without printing: a callback ``(stage, done, total)``.

The library calls it after each unit of work (a layer, a pass); the command line passes a
display that draws a bar (:class:`qkov.apps.progress.StageProgress`).
"""

from __future__ import annotations

from typing import Callable

Progress = Callable[[str, int, int], None]
"""``progress(stage, done, total)``: ``done`` of ``total`` units of ``stage`` are finished."""


def tick(progress: Progress | None, stage: str, done: int, total: int) -> None:
    """Call ``progress`` if there is one."""
    if progress is not None:
        progress(stage, done, total)
