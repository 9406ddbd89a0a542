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


def free_memory(device: torch.device) -> int | None:
    """Bytes a new allocation can take on ``device`` now: free GPU memory, or the kernel's
    ``MemAvailable`` (Linux) for the CPU; ``None`` where it cannot be known."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits(need: int, device: torch.device, what: str, advice: str) -> None:
    """Refuse, before the work starts, work that needs more memory than ``device`` has free.

    Raises:
        QkovError: ``need`` bytes exceed what :func:`free_memory` reports.
    """
    free = free_memory(device)
    if free is not None and need > free:
        raise QkovError(f"{what} needs about {_size(need)}, more than the {_size(free)} free: {advice}")


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"
