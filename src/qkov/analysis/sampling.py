"""Seeded samples: which rows, positions or queries an estimate reads when reading all would cost too much."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["seeded_subset"]


def seeded_subset(n: int, k: int, seed: int = 0) -> Tensor:
    """``k`` distinct indices of ``range(n)`` drawn without replacement (CPU generator seeded with
    ``seed``), sorted: the same sample on every machine and device."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k].sort().values
