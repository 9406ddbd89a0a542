"""A causal result: one metric value per intervention, along named axes of any kind.

:class:`PatchResult` holds ``values`` shaped by ``axes`` (any names: ``layer``, ``head``, ``pos``,
``edge``, ``step``, ...), a label per index of each axis, and the contrast it was measured on (the
metric on the clean and corrupted runs, the direction, the metric's name). Every surface shows any
such result the same way: its text (:func:`result_text`), the command line's grid or largest
effects, the report's and the notebook's heatmap (the first axis as rows, the last as columns).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ...errors import QkovError
from ..shown import TEXT, Shown, register

__all__ = ["agreement", "by_direction", "largest", "PatchResult", "result_text"]


def by_direction(direction: str, clean: Any, corrupted: Any) -> tuple[Any, Any]:
    """``(clean, corrupted)`` in the order ``(base, source)``: denoising patches the corrupted run with
    clean values, noising the clean run with corrupted ones. The same call turns ``(base, source)`` back
    into ``(clean, corrupted)``. The one place the direction decides which run is which."""
    return (corrupted, clean) if direction == "denoise" else (clean, corrupted)


@dataclass(repr=False)
class PatchResult(Shown):
    """``values`` (one metric value per intervention, shaped by ``axes``; NaN where nothing was
    done), ``labels`` (one string per index of each axis; missing axes are labelled ``0, 1, ...``),
    the metric on the ``clean`` and ``corrupted`` runs, and what was done: ``method`` (its name:
    ``activation``, ``attribution``, ``path``, or any other) and ``site`` (what it patched)."""

    method: str
    site: str
    axes: tuple[str, ...]
    values: Tensor
    clean: float
    corrupted: float
    direction: str
    metric: str
    labels: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.axes = tuple(self.axes)
        if len(set(self.axes)) != len(self.axes) or self.values.ndim != len(self.axes):
            raise QkovError(
                f"{self.method} result: values of shape {list(self.values.shape)} need one distinct axis name per "
                f"dimension, got {list(self.axes)}"
            )
        for axis, n in zip(self.axes, self.values.shape):
            got = self.labels.setdefault(axis, [str(i) for i in range(n)])
            if len(got) != n:
                raise QkovError(f"{self.method} result: axis {axis} has {n} entries and {len(got)} labels")

    @property
    def base(self) -> float:
        """The metric with nothing patched: the corrupted run when denoising, the clean one when noising."""
        return by_direction(self.direction, self.clean, self.corrupted)[0]

    @property
    def target(self) -> float:
        """The source recording's metric: what a patch that moves the metric all the way reaches."""
        return by_direction(self.direction, self.clean, self.corrupted)[1]

    def normalized(self) -> Tensor:
        """``(value - base) / (target - base)``: 0 where the patch changes nothing, 1 where it moves the
        metric all the way from the base recording's value to the source recording's."""
        gap = self.target - self.base
        if gap == 0:
            raise QkovError("normalized: the clean and corrupted runs give the same metric; nothing to recover")
        return (self.values - self.base) / gap

    def at(self, **where: Any) -> float:
        """The value at one index of every axis, each given by its label or its integer index:
        ``r.at(layer=1, head=0)``, ``r.at(edge="0.1 -> 1.0<k>")``."""
        if set(where) != set(self.axes):
            axes = ", ".join(self.axes)
            raise QkovError(f"{self.method} result: give one index per axis ({axes}), got {sorted(where)}")
        index = []
        for axis in self.axes:
            key, labels = where[axis], self.labels[axis]
            if str(key) in labels:
                index.append(labels.index(str(key)))
            elif isinstance(key, int) and 0 <= key < len(labels):
                index.append(key)
            else:
                raise QkovError(f"{self.method} result: axis {axis} has no {key!r}")
        return float(self.values[tuple(index)])

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "site": self.site,
            "axes": list(self.axes),
            "direction": self.direction,
            "metric": self.metric,
            "clean": self.clean,
            "corrupted": self.corrupted,
            "values": _nan_to_none(self.values.tolist()),
            "normalized": _nan_to_none(self.normalized().tolist()) if self.target != self.base else None,
            "labels": self.labels,
        }


def _cell(r: PatchResult, index: tuple[int, ...]) -> str:
    return ", ".join(f"{a} {r.labels[a][i]}" for a, i in zip(r.axes, index))


def largest(r: PatchResult, k: int = 8) -> list[tuple[str, float, float]]:
    """The ``k`` patches that move the metric most: ``(where, value, normalized)``."""
    effect = (r.values - r.base).abs().nan_to_num(-1.0)
    flat = effect.flatten().argsort(descending=True)[:k]
    gap = r.target - r.base
    rows = []
    for i in flat.tolist():
        index = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), r.values.shape))
        v = float(r.values[index])
        if v != v:
            continue
        rows.append((_cell(r, index), v, (v - r.base) / gap if gap else float("nan")))
    return rows


@register(TEXT, PatchResult)
def result_text(r: PatchResult, k: int = 6) -> str:
    """A header and the ``k`` largest effects."""
    lines = [
        f"{r.method} patching of {r.site} by {' x '.join(r.axes)} ({r.direction}; {r.metric}: "
        f"clean {r.clean:.4g}, corrupted {r.corrupted:.4g})"
    ]
    for where, v, n in largest(r, k):
        lines.append(f"  {where:40s} {v:10.4g}   {n:+7.1%} of the way")
    return "\n".join(lines)


def agreement(a: PatchResult, b: PatchResult) -> float:
    """The Pearson correlation of two results' values over the patches both have (NaN-free)."""
    x, y = a.values.flatten().double(), b.values.flatten().double()
    if x.shape != y.shape:
        raise QkovError("agreement: the two results patch different things")
    ok = ~(x.isnan() | y.isnan())
    x, y = x[ok] - x[ok].mean(), y[ok] - y[ok].mean()
    den = float(x.norm() * y.norm())
    return float((x * y).sum()) / den if den > 0 else float("nan")


def _nan_to_none(x: Any) -> Any:
    if isinstance(x, list):
        return [_nan_to_none(v) for v in x]
    return None if x != x else x
