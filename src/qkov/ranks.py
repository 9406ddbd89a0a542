"""Splitting an analysis over the ranks of a ``torchrun`` launch, with results equal to one process's.

An analysis that splits (composition: pairs of layers; copying: heads; text scores and path terms:
sequences) numbers its units of work the same way whatever the number of ranks, computes on each
rank only the units :meth:`Split.mine` gives it (rank ``r`` of ``world`` takes the ``r``-th of
``world`` contiguous runs of the ``n`` units, as even as they can be), each exactly as one process
computes it, and :meth:`Split.gather` brings every unit's result to every rank in unit order.
Whatever combines the units then runs on every rank in that fixed order, so any number of ranks
returns the numbers of one process (not only close ones).

The split in force is set by :func:`over` (a context variable: nothing to pass down the call
chain); outside it, :func:`current` is one process and nothing is split. The commands enter it
under torchrun (``apps/cli/common.py: ranks``, which joins the process group of
:mod:`qkov.training.distributed`); in a script of your own launched by torchrun, join the group
and call the analyses inside ``with over(Split.from_group()):``.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, TypeVar

import torch
import torch.distributed as dist

GATHER_TIMEOUT = timedelta(hours=24)  # how long a rank that finished waits for the others at a gather
T = TypeVar("T")


@dataclass(frozen=True)
class Split:
    """This process's share of the work: rank ``rank`` of ``world`` (one process: 0 of 1).
    ``group``: the CPU (gloo) process group the results travel over."""

    rank: int = 0
    world: int = 1
    group: Any = None

    @property
    def enabled(self) -> bool:
        """More than one rank."""
        return self.world > 1

    @property
    def main(self) -> bool:
        """Rank 0: the one that prints and writes."""
        return self.rank == 0

    def mine(self, unit: int, n: int) -> bool:
        """Whether unit number ``unit`` of ``n`` (counted from 0, the same on every rank) is this rank's:
        rank ``r`` takes the ``r``-th of ``world`` contiguous runs of units, as even as they can be
        (neighbouring units share their inputs: a run of pairs of layers reads few layers)."""
        return self.rank * n // self.world <= unit < (self.rank + 1) * n // self.world

    def gather(self, parts: dict[int, T], n: int) -> list[T]:
        """Every unit's result, in unit order ``0 .. n - 1``, on every rank, from each rank's
        ``parts`` (unit -> result, its own units only). Tensors travel as CPU copies and come back on
        the device they left."""
        if not self.enabled:
            return [parts[i] for i in range(n)]
        device = _device_of(parts)
        boxes: list[Any] = [None] * self.world
        dist.all_gather_object(boxes, _to(parts, torch.device("cpu")), group=self.group)
        merged: dict[int, Any] = {k: v for box in boxes for k, v in box.items()}
        missing = [i for i in range(n) if i not in merged]
        if missing:  # a unit no rank computed: a bug in the caller's numbering, never a silent hole
            raise RuntimeError(f"split: units {missing[:5]} were computed by no rank")
        return [_to(merged[i], device) for i in range(n)]

    @classmethod
    def from_group(cls) -> "Split":
        """The split of the process group this process has joined (one process when none)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls()
        group = dist.new_group(backend="gloo", timeout=GATHER_TIMEOUT)  # CPU collectives, long waits allowed
        return cls(dist.get_rank(), dist.get_world_size(), group)


_CURRENT: contextvars.ContextVar[Split] = contextvars.ContextVar("qkov_split", default=Split())


def current() -> Split:
    """The split in force (:func:`over`); one process outside it."""
    return _CURRENT.get()


@contextlib.contextmanager
def over(split: Split) -> Iterator[Split]:
    """Split every analysis called inside over ``split``'s ranks."""
    token = _CURRENT.set(split)
    try:
        yield split
    finally:
        _CURRENT.reset(token)


def _device_of(obj: Any) -> torch.device:
    if isinstance(obj, torch.Tensor):
        return obj.device
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for x in items:
        d = _device_of(x)
        if d.type != "cpu":
            return d
    return torch.device("cpu")


def _to(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor in it (through dicts, lists and tuples) moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(v, device) for v in obj)
    return obj
