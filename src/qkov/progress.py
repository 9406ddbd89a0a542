"""The one progress protocol: every library function that reports progress calls
``progress(what, done, total)``, and never prints.

``what`` names the stage of work (``"paths: orders"``, ``"heads"``, ``"corpus: tokenising"``);
``done`` of ``total`` units of it are finished (``done == 0`` when it starts, ``done == total``
when it ends). Training reports through it too (:func:`qkov.train`: the corpus' stages, then
``("train", step, steps)``). The command line passes a display that draws a bar per stage
(:class:`qkov.apps.progress.StageProgress`, :class:`~qkov.apps.progress.TrainProgress`); ``print``
works too.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["Progress", "tick"]


class Progress(Protocol):
    """``progress(what, done, total)``: ``done`` of ``total`` units of the stage ``what`` are finished."""

    def __call__(self, what: str, done: int, total: int, /) -> None: ...


def tick(progress: Progress | None, what: str, done: int, total: int) -> None:
    """Call ``progress`` if there is one."""
    if progress is not None:
        progress(what, done, total)
