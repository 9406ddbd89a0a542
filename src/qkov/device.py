"""Where to compute: the one place a device name becomes a ``torch.device``."""

from __future__ import annotations

import torch

from .errors import QkovError


def pick_device(name: str | torch.device = "auto") -> torch.device:
    """``auto`` -> ``cuda`` if a CUDA GPU is available, else ``cpu``; otherwise the named device.

    Raises:
        QkovError: the name is unknown, or names a device this machine does not have.
    """
    if isinstance(name, torch.device):
        name = str(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise QkovError(f"device: unknown device {name!r} (use auto, cpu, cuda or cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise QkovError("device: cuda requested but no CUDA GPU is available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise QkovError(f"device: {name} requested but only {torch.cuda.device_count()} CUDA GPU(s) are visible")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise QkovError(f"device: unsupported device {name!r}")
    return dev
