"""How to train: :class:`TrainConfig` and the learning-rate schedule."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ..errors import QkovError, check_choice, check_int

__all__ = ["lr_at", "PRECISIONS", "SCHEDULES", "TrainConfig"]

SCHEDULES = ("wsd", "cosine", "constant")
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class TrainConfig:
    """How to train. Defaults were chosen by measurement (docs/training.md, "The defaults")."""

    steps: int = 5000
    batch: int = 16
    lr: float = 1e-2
    warmup: int = 100
    schedule: str = "wsd"
    decay_frac: float = 0.2
    min_lr_frac: float = 0.1
    weight_decay: float = 0.05
    beta1: float = 0.9
    beta2: float = 0.98
    grad_clip: float = 1.0
    seed: int = 0
    corpus: str = "stdlib"
    val_fraction: float = 0.05
    eval_interval: int = 100
    eval_examples: int = 32
    ckpt_interval: int = 500
    log_interval: int = 10
    # fp32 by default: bf16 matrix products were measured to delay induction heads on the
    # default model (none by 12.3M tokens vs 10.2M in fp32, val loss 2.73 vs 2.48 there).
    precision: str = "fp32"
    # weight-only snapshots for `qkov dynamics`: a count (spaced by training.snapshots.schedule),
    # 0 for none, or explicit steps
    snapshots: int | tuple[int, ...] = 40

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "eval_interval", "eval_examples", "ckpt_interval", "log_interval"):
            check_int("train", name, getattr(self, name))
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63:
            raise QkovError(f"train: seed must be an integer in [0, 2^63), got {self.seed!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise QkovError(f"train: lr must be a positive number, got {self.lr!r}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise QkovError(f"train: weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.warmup < 0:
            raise QkovError(f"train: warmup must be >= 0, got {self.warmup}")
        check_choice("train", "precision", self.precision, PRECISIONS)
        check_choice("train", "schedule", self.schedule, SCHEDULES)
        snaps = self.snapshots
        if isinstance(snaps, list):
            object.__setattr__(self, "snapshots", snaps := tuple(snaps))
        ok_count = isinstance(snaps, int) and not isinstance(snaps, bool) and snaps >= 0
        ok_steps = isinstance(snaps, tuple) and all(isinstance(s, int) and s >= 0 for s in snaps)
        if not (ok_count or ok_steps):
            raise QkovError(f"train: snapshots must be a count >= 0 or a list of steps >= 0, got {snaps!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def lr_at(step: int, tc: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warm-up, then cosine or constant."""
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    if tc.schedule == "constant":
        return tc.lr
    floor = tc.lr * tc.min_lr_frac
    if tc.schedule == "wsd":  # warm-up, stable, then linear decay over the last decay_frac of the run
        start = max(tc.warmup, int(tc.steps * (1 - tc.decay_frac)))
        if step < start:
            return tc.lr
        progress = min(1.0, (step - start) / max(1, tc.steps - start))
        return tc.lr + (floor - tc.lr) * progress
    span = max(1, tc.steps - tc.warmup)
    progress = min(1.0, (step - tc.warmup) / span)
    return floor + (tc.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
