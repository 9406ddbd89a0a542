"""The speed of ``torch.matmul`` on given shapes: the machine's limit the benchmarks compare against.

Each product writes into an output allocated once (a fresh output per call adds page faults that
are not the product's), and the shapes run back to back for at least ``seconds`` and two rounds.
"""

from __future__ import annotations

import time


def matmul_rate(shapes: list[tuple[int, int, int, int]], dtype_name: str = "float32", seconds: float = 1.0) -> float:
    """FLOP/s of ``[b, m, k] @ [b, k, n]`` for every ``(b, m, k, n)`` of ``shapes``, back to back."""
    import torch

    dtype, g = getattr(torch, dtype_name), torch.Generator().manual_seed(0)
    ops = []
    for b, m, k, n in shapes:
        x, y = (torch.randn(b, *s, generator=g).to(dtype) for s in ((m, k), (k, n)))
        ops.append((x, y, torch.matmul(x, y)))  # also the warm-up
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or reps < 2:
        for x, y, out in ops:
            torch.matmul(x, y, out=out)
        reps += 1
    return reps * sum(2 * b * m * k * n for b, m, k, n in shapes) / (time.perf_counter() - t0)
