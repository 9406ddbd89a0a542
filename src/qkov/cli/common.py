"""Shared pieces of the command line: the one-line-error parser and option types."""

from __future__ import annotations

import argparse
import math
import sys
from typing import NoReturn


EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``qkov: error: ...``) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        raise SystemExit(EXIT_USAGE)


def _int_at_least(lo: int, what: str):  # type: ignore[no-untyped-def]
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_nonneg_int = _int_at_least(0, "an integer >= 0")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _token_count(text: str) -> int:
    """``20M``, ``500k``, ``1.5e6`` -> an integer token count."""
    t = text.strip().lower()
    scale = 1
    if t and t[-1] in "kmb":
        scale = {"k": 10**3, "m": 10**6, "b": 10**9}[t[-1]]
        t = t[:-1]
    try:
        value = float(t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count like 8M or 500k, got {text!r}") from None
    if not (value >= 1 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive token count, got {text!r}")
    return int(value)


def console():  # -> rich.console.Console
    """A console for tables: the terminal's width, or 160 columns when output is piped."""
    from rich.console import Console

    con = Console()
    return con if con.is_terminal else Console(width=160)
