"""An analysis command under ``torchrun``: join the process group, split the work, speak on rank 0 only.

``torchrun --nproc-per-node N -m qkov circuits MODEL --json`` starts N processes; :func:`ranks` joins
them into one process group (:func:`qkov.training.distributed.setup`: gloo on CPUs, NCCL on GPUs),
gives each rank its share of the cores, and puts the ranks in force (:func:`qkov.ranks.over`)
for the analyses called inside it. Every rank gets every result; the command prints and writes on
rank 0 alone (``Ranks.main``) and the others exit 0 having written nothing. Without torchrun's
variables it is one process and changes nothing. A group already joined (a script of one's own that
runs several commands: ``qkov.apps.cli.main``) is used as it is and left joined.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..ranks import Ranks, over
from ..training import distributed

__all__ = ["rank_device", "ranks"]


def rank_device(device: torch.device) -> torch.device:
    """This rank's device: under torchrun a CUDA device is the rank's own (``LOCAL_RANK``); else ``device``."""
    env = Ranks.from_env()
    return torch.device("cuda", env.local_rank) if env.enabled and device.type == "cuda" else device


@contextlib.contextmanager
def ranks(device: torch.device) -> Iterator[tuple[Ranks, torch.device]]:
    """The ranks of this launch, in force, and this rank's device (``device`` itself for one process).
    Ranks that share a machine share its cores: with as many ranks as cores, each computes on one thread."""
    if not Ranks.from_env().enabled:
        yield Ranks(), device
        return
    joined = distributed.joining()  # a script that joined the group itself keeps it
    env, device = distributed.setup(device)
    torch.set_num_threads(env.threads)
    try:
        with over(Ranks.from_group()) as these:
            yield these, device
    finally:
        if joined:
            distributed.teardown(env)
