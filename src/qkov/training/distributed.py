"""Running under ``torchrun``: process-group setup and the few collectives training needs.

``torchrun --nproc_per_node N -m qkov train ...`` starts N processes with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` (and the rendezvous variables) in their environment.
:func:`setup` reads them, joins the process group (NCCL on GPUs, gloo on CPUs) and picks
each rank's device. Without those variables everything here is a no-op for one process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import QkovError


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def from_env() -> DistInfo:
    """The torchrun environment of this process (one process when unset)."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    except ValueError:
        raise QkovError("distributed: RANK/WORLD_SIZE/LOCAL_RANK must be integers") from None
    return DistInfo(rank, world, local_rank, local_world)


def setup(device: torch.device) -> tuple[DistInfo, torch.device]:
    """Join the process group if launched by torchrun; return this rank's info and device."""
    info = from_env()
    if not info.enabled:
        return info, device
    if device.type == "cuda":
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return info, device


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def mean_across(info: DistInfo, value: float, device: torch.device) -> float:
    """The mean of ``value`` over all ranks (``value`` itself for one process)."""
    if not info.enabled:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t) / info.world


def teardown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()
