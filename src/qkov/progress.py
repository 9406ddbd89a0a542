"""The one progress protocol: every library function that reports progress calls
``progress(what, done, total)``, and never prints.

``what`` names the stage of work (``"paths: orders"``, ``"heads"``, ``"corpus: tokenising"``);
``done`` of ``total`` units of it are finished (``done == 0`` when it starts, ``done == total``
when it ends). The command line passes a display that draws a bar per stage
(:class:`qkov.apps.progress.StageProgress`); ``print`` works too.

Until 1.0 the report and :func:`qkov.load_corpus` called a one-argument ``progress(message)``:
:func:`as_progress` still accepts such a callback for one release (with a ``DeprecationWarning``)
and calls it once per stage.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Protocol

from .deprecated import warn_renamed


class Progress(Protocol):
    """``progress(what, done, total)``: ``done`` of ``total`` units of the stage ``what`` are finished."""

    def __call__(self, what: str, done: int, total: int, /) -> None: ...


def tick(progress: Progress | None, what: str, done: int, total: int) -> None:
    """Call ``progress`` if there is one."""
    if progress is not None:
        progress(what, done, total)


def _takes_one(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` takes exactly one positional argument (the old form), by its signature."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read (some builtins): take it for the new form
        return False
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) == 1


class _OneArgument:
    """An old one-argument callback seen through the protocol: called with ``what`` once per stage."""

    def __init__(self, fn: Callable[[str], Any]) -> None:
        self.fn, self.last = fn, None

    def __call__(self, what: str, done: int, total: int) -> None:
        if what != self.last:
            self.last = what
            self.fn(what)


def as_progress(progress: Any, where: str) -> Progress | None:
    """``progress`` as a :class:`Progress`: ``None`` and three-argument callables unchanged; a
    one-argument callable (the form before 1.0) wrapped, with a ``DeprecationWarning``."""
    if progress is None or not _takes_one(progress):
        return progress
    warn_renamed(f"a one-argument progress callback to {where}", "progress(what, done, total)")
    return _OneArgument(progress)
