"""Running under ``torchrun``: process-group setup and the few collectives training needs.

``torchrun --nproc_per_node N -m qkov train ...`` starts N processes with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` (and the rendezvous variables) in their environment.
:func:`setup` reads them (:meth:`qkov.ranks.Ranks.from_env`), joins the process group (NCCL on
GPUs, gloo on CPUs) and picks each rank's device. Without those variables everything here is a
no-op for one process.

Whoever joins the group leaves it (:func:`joining` before :func:`setup`, :func:`teardown` at the
end): a script launched by torchrun that joined the group itself (``dist.init_process_group``) may
call :func:`qkov.train` and the analyses several times, and the group stays joined (gloo cannot join
again under torchrun's store once it has been left).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..ranks import Ranks

__all__ = ["barrier", "joining", "mean_across", "setup", "teardown"]


def joining() -> bool:
    """Whether :func:`setup` will join the process group here: launched by torchrun and no group joined
    yet. The caller for which it is true leaves the group when done (:func:`teardown`); otherwise not."""
    return Ranks.from_env().enabled and not dist.is_initialized()


def setup(device: torch.device) -> tuple[Ranks, torch.device]:
    """Join the process group if launched by torchrun; return this process's ranks and device."""
    ranks = Ranks.from_env()
    if not ranks.enabled:
        return ranks, device
    if device.type == "cuda":
        device = torch.device("cuda", ranks.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return ranks, device


def barrier(ranks: Ranks) -> None:
    """Wait for every rank (nothing for one process)."""
    if ranks.enabled:
        dist.barrier()


def mean_across(ranks: Ranks, value: float, device: torch.device) -> float:
    """The mean of ``value`` over all ranks (``value`` itself for one process)."""
    if not ranks.enabled:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t) / ranks.world


def teardown(ranks: Ranks) -> None:
    """Leave the process group (nothing for one process)."""
    if ranks.enabled and dist.is_initialized():
        dist.destroy_process_group()
