"""The one exception type for user mistakes (bad input, bad files, bad options).

A :class:`QkovError` says what is wrong in the library's own words; it never names a
command-line flag. When the user can fix it by supplying something (a text to analyse,
``resume=True``), ``hint`` names that thing with a library word from :data:`HINTS`, and
the command line turns it into its own advice ("pass --text FILE"). The CLI prints a
:class:`QkovError` as one line and exits with status 2; anything else is a bug and keeps
its traceback. A :class:`QkovWarning` reports a choice made for the user (a start token put in
place of one that does not exist) without stopping.
"""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["check_choice", "check_int", "HINTS", "QkovError", "QkovWarning"]

HINTS: tuple[str, ...] = ("text", "resume", "out", "config", "overwrite", "batch", "memory", "size")
"""What a hint may name: ``text`` (something to analyse), ``resume`` (continue the run that
is there), ``out`` (another output location), ``config`` (a config for a weights file that carries
none), ``overwrite`` (permission to replace a file qkov did not write), ``batch`` (fewer sequences at once),
``memory`` (a larger memory budget, where more is free), ``size`` (a smaller model, context or batch to
train)."""


class QkovError(Exception):
    """A problem with the user's input: a bad path, file, option or shape.

    Args:
        message: what is wrong, in one line.
        hint: what the user could supply to fix it (one of :data:`HINTS`), or ``None``.
    """

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        if hint is not None and hint not in HINTS:
            raise ValueError(f"unknown hint {hint!r}")
        super().__init__(message)
        self.hint = hint


class QkovWarning(UserWarning):
    """Something qkov did on the user's behalf that they should know about (a choice made where the
    input was inconsistent), in one line; the command line prints it as ``qkov: warning: ...``."""


def check_choice(where: str, name: str, value: Any, choices: Iterable[str]) -> None:
    """Raise ``"<where>: <name> must be one of ..."`` unless ``value`` is one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise QkovError(f"{where}: {name} must be one of {', '.join(choices)}, got {value!r}")


def check_int(where: str, name: str, value: Any, *, minimum: int = 1) -> None:
    """Raise unless ``value`` is an integer (not a bool) of at least ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise QkovError(f"{where}: {name} must be {what}, got {value!r}")
