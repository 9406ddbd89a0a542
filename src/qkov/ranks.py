"""The ranks of a ``torchrun`` launch (one description, :class:`Ranks`), and an analysis split over
them with results equal to one process's.

:class:`Ranks` is this process among the others: its rank of ``world`` (and its local rank on this
machine), read from torchrun's environment (:meth:`Ranks.from_env`; training joins the process group
with it, :mod:`qkov.training.distributed`) or from the process group joined (:meth:`Ranks.from_group`,
with a CPU group the analyses' results travel over).

An analysis that splits its work (composition: pairs of layers; copying: heads; text scores and path
terms: sequences) numbers its units of work the same way whatever the number of ranks, computes on
each rank only the units :meth:`Ranks.mine` gives it (rank ``r`` of ``world`` takes the ``r``-th of
``world`` contiguous runs of the ``n`` units, as even as they can be), each exactly as one process
computes it, and :meth:`Ranks.gather` brings every unit's result to every rank in unit order.
Whatever combines the units then runs on every rank in that fixed order, so any number of ranks
returns the numbers of one process (not only close ones).

The ranks in force are set by :func:`over` (a context variable: nothing to pass down the call
chain); outside it, :func:`current` is one process and nothing is split. The commands enter it
under torchrun (``apps/ranks.py: ranks``, which joins the process group of
:mod:`qkov.training.distributed`); in a script of your own launched by torchrun, join the group
and call the analyses inside ``with over(Ranks.from_group()):``.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, TypeVar

import torch
import torch.distributed as dist

from .errors import QkovError

__all__ = ["GATHER_TIMEOUT", "Ranks", "current", "over"]

GATHER_TIMEOUT = timedelta(hours=24)  # how long a rank that finished waits for the others at a gather
T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """This process among the ranks of a launch: rank ``rank`` of ``world``, local rank ``local_rank``
    of the ``local_world`` ranks on this machine (one process: 0 of 1). ``group``: the CPU (gloo)
    process group an analysis's results travel over (:meth:`from_group`; ``None`` otherwise)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    group: Any = None

    @property
    def enabled(self) -> bool:
        """More than one rank."""
        return self.world > 1

    @property
    def main(self) -> bool:
        """Rank 0: the one that prints and writes."""
        return self.rank == 0

    @property
    def threads(self) -> int:
        """The CPU threads each rank on this machine computes on: its cores shared out over the
        ``local_world`` ranks (one process: every core)."""
        return max(1, (os.cpu_count() or 1) // self.local_world)

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
            raise RuntimeError(f"ranks: units {missing[:5]} were computed by no rank")
        return [_to(merged[i], device) for i in range(n)]

    @classmethod
    def from_env(cls) -> "Ranks":
        """The ranks torchrun's environment describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
        ``LOCAL_WORLD_SIZE``); one process when they are unset."""
        try:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            rank = int(os.environ.get("RANK", "0"))
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        except ValueError:
            raise QkovError("distributed: RANK/WORLD_SIZE/LOCAL_RANK must be integers") from None
        return cls(rank, world, local_rank, local_world)

    @classmethod
    def from_group(cls) -> "Ranks":
        """The ranks of the process group this process has joined, with a CPU (gloo) group for the
        analyses' gathers (one process when none)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls()
        env = cls.from_env()
        group = dist.new_group(backend="gloo", timeout=GATHER_TIMEOUT)  # CPU collectives, long waits allowed
        return cls(dist.get_rank(), dist.get_world_size(), env.local_rank, env.local_world, group)


_CURRENT: contextvars.ContextVar[Ranks] = contextvars.ContextVar("qkov_ranks", default=Ranks())


def current() -> Ranks:
    """The ranks in force (:func:`over`); one process outside it."""
    return _CURRENT.get()


@contextlib.contextmanager
def over(ranks: Ranks) -> Iterator[Ranks]:
    """Split every analysis called inside over ``ranks``."""
    token = _CURRENT.set(ranks)
    try:
        yield ranks
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
