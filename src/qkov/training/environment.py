"""What a bit-exact resume depends on besides the saved state, recorded in the state and checked at
resume (docs/runs.md, "Same seed, same bits: what is promised").

The state holds every number the run computed; a resumed process continues it bit for bit only if it
also computes the same way: the same libraries (torch and the MKL it carries, numpy, which draws the
batch order), the same kind of processor (MKL's code branch, torch's vector instructions), the same
thread count and processes, the same device and precision, and MKL in its reproducible mode with its
vector-math kernels settled (:mod:`qkov.device`). :func:`record` describes this process;
:func:`differences` names what changed between two records.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..device import _CBWR_ALL, _mkl_cnr_functions

__all__ = ["differences", "record"]

LABELS = {
    "torch": "torch",
    "mkl": "MKL",
    "numpy": "numpy",
    "cpu": "processor",
    "cpu_capability": "torch's vector instructions",
    "mkl_branch": "MKL's code branch",
    "mkl_reproducible": "MKL's reproducible mode",
    "threads": "threads",
    "world": "processes",
    "device": "device",
    "cuda": "CUDA",
    "precision": "precision",
}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mkl() -> tuple[str | None, int | None, bool | None]:
    """MKL's version, the code branch it picked for this processor, and whether its reproducible mode is on."""
    if not torch.backends.mkl.is_available():
        return None, None, None
    found = re.search(r"Math Kernel Library Version (\S+)", torch.__config__.show())
    version = found.group(1) if found else "unknown"
    branch = None
    try:
        fn = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")).mkl_serv_cbwr_get_auto_branch
        fn.restype = ctypes.c_int
        branch = int(fn())
    except (OSError, AttributeError):
        pass
    funcs = _mkl_cnr_functions()
    cnr = None if funcs is None else funcs[0](_CBWR_ALL) != 1
    return version, branch, cnr


def record(device: torch.device, world: int, precision: str) -> dict[str, Any]:
    """This process's computing environment, as a training state keeps it (JSON)."""
    mkl, branch, cnr = _mkl()
    rec: dict[str, Any] = {
        "torch": torch.__version__,
        "mkl": mkl,
        "numpy": np.__version__,
        "device": str(device.type),
        "precision": precision,
        "world": world,
    }
    if device.type == "cpu":
        rec.update(
            cpu=_cpu_name(),
            cpu_capability=torch.backends.cpu.get_cpu_capability(),
            mkl_branch=branch,
            mkl_reproducible=cnr,
            threads=torch.get_num_threads(),
        )
    elif device.type == "cuda":
        rec.update(cpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    rec["host_cpus"] = os.cpu_count()
    return rec


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between the environment a state was written in and this one, in words
    (``"threads 2, now 4"``); empty when nothing the promise depends on changed."""
    out = []
    for key, label in LABELS.items():
        if key in saved and saved.get(key) != now.get(key):
            out.append(f"{label} {saved[key]!r}, now {now.get(key)!r}")
    return out
