"""An analysis command under ``torchrun``: join the process group, split the work, speak on rank 0 only.

``torchrun --nproc-per-node N -m qkov circuits MODEL --json`` starts N processes; :func:`ranks` joins
them into one process group (:func:`qkov.training.distributed.setup`: gloo on CPUs, NCCL on GPUs),
gives each rank its share of the cores, and puts the split in force (:func:`qkov.ranks.over`)
for the analyses called inside it. Every rank gets every result; the command prints and writes on
rank 0 alone (``Split.main``) and the others exit 0 having written nothing. Without torchrun's
variables it is one process and changes nothing. A group already joined (a script of one's own that
runs several commands: ``qkov.apps.cli.main``) is used as it is and left joined.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
import torch.distributed as dist

from ..ranks import Split, over
from ..training import distributed


def rank_device(device: torch.device) -> torch.device:
    """This rank's device: under torchrun a CUDA device is the rank's own (``LOCAL_RANK``); else ``device``."""
    info = distributed.from_env()
    return torch.device("cuda", info.local_rank) if info.enabled and device.type == "cuda" else device


@contextlib.contextmanager
def ranks(device: torch.device) -> Iterator[tuple[Split, torch.device]]:
    """The split of this launch and this rank's device (``device`` itself for one process). Ranks
    that share a machine share its cores: with as many ranks as cores, each computes on one thread."""
    info = distributed.from_env()
    if not info.enabled:
        yield Split(), device
        return
    joined = not dist.is_initialized()  # a script that joined the group itself keeps it
    info, device = distributed.setup(device)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // info.local_world))
    try:
        with over(Split.from_group()) as split:
            yield split, device
    finally:
        if joined:
            distributed.teardown(info)
