"""Positions an intervention applies at, written once for sequences of any length.

A spec is ``None`` (every position), an int, a ``slice``, a list of ints, or text as the command
line takes it: comma-separated items, each ``i`` or ``a:b`` (Python's meaning: ``-1`` the last
token, ``50:`` from 50 to the end, ``:-10`` all but the last 10). Slices are clipped to each
sequence, as Python clips them; a single index beyond a sequence is an error.
"""

from __future__ import annotations

from typing import Any, Sequence, Union

import torch
from torch import Tensor

from ...errors import QkovError

__all__ = ["describe_positions", "parse_positions", "PositionSpec", "resolve_positions"]

PositionSpec = Union[None, int, slice, Sequence[Union[int, slice]], str]


def parse_positions(text: str, n_ctx: int | None = None) -> list[int | slice]:
    """``"0,5:10,-1"`` -> ``[0, slice(5, 10), -1]``; indices beyond ``n_ctx`` (the model's context) refused."""
    items: list[int | slice] = []
    for part in (p.strip() for p in text.split(",")):
        try:
            if ":" in part:
                lo, hi, *step = part.split(":")
                if step:
                    raise ValueError
                items.append(slice(int(lo) if lo.strip() else None, int(hi) if hi.strip() else None))
            else:
                items.append(int(part))
        except ValueError:
            raise QkovError(f"positions: {part!r} is not a position; write I or A:B, comma-separated, e.g. 0,50:") from None
    if not items:
        raise QkovError("positions: none given")
    for i in items:
        if isinstance(i, int) and n_ctx is not None and not -n_ctx <= i < n_ctx:
            raise QkovError(f"positions: {i} is out of range for the model's context of {n_ctx} tokens")
    return items


def resolve_positions(spec: PositionSpec, seq: int, device: Any = None) -> Tensor | None:
    """The positions ``[P]`` (sorted, unique) ``spec`` picks in a sequence of ``seq`` tokens;
    ``None`` for every position."""
    if spec is None:
        return None
    if isinstance(spec, str):
        spec = parse_positions(spec)
    items = [spec] if isinstance(spec, (int, slice)) else list(spec)
    picked: set[int] = set()
    for item in items:
        if isinstance(item, slice):
            picked.update(range(seq)[item])
        elif isinstance(item, int) and not isinstance(item, bool):
            if not -seq <= item < seq:
                raise QkovError(f"positions: {item} is out of range for a sequence of {seq} tokens")
            picked.add(item % seq)
        else:
            raise QkovError(f"positions: {item!r} is not an int or a slice")
    return torch.tensor(sorted(picked), dtype=torch.long, device=device)


def describe_positions(spec: PositionSpec) -> str:
    """The spec as the command line writes it (``"all"`` for every position)."""
    if spec is None:
        return "all"
    if isinstance(spec, str):
        return spec
    items = [spec] if isinstance(spec, (int, slice)) else list(spec)

    def one(i: int | slice) -> str:
        if isinstance(i, slice):
            return f"{'' if i.start is None else i.start}:{'' if i.stop is None else i.stop}"
        return str(i)

    return ",".join(one(i) for i in items)
