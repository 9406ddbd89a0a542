"""How faithful a circuit is, and the faithfulness curve of a set of edge scores (MIB).

**Faithfulness** of a circuit ``C`` (Hanna et al. 2024; Mueller et al. 2025, MIB):
``f(C) = (m(C) - m(empty)) / (m(full) - m(empty))``, with ``m(full)`` the clean run and ``m(empty)`` the
model with every edge ablated (:mod:`.evaluate`; for the ``corrupted`` ablation the corrupted run).
1 means the circuit alone reproduces the clean behaviour, 0 that it does no better than nothing.

**The faithfulness curve** (MIB): the top-``n`` circuit at each fraction ``p`` of the edges
(:data:`MIB_FRACTIONS`, 0.1 % to 100 %; ``n = int(p |E|)``), dead ends pruned, and ``f`` of each.
**CPR** is the area under it, over ``p`` (trapezoids; higher is better; a perfect curve scores 0.999
over ``[0.001, 1]``), with circuits chosen by importance (signed: MIB's ``absolute=False``); **CMD** the
area between ``|1 - f|`` and 0, with circuits chosen by ``|score|`` (lower is better).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ...errors import QkovError
from ...progress import Progress
from ..shown import TEXT, Shown, register
from .circuit import Circuit, prune, top_n
from .evaluate import Evaluator
from .scores import EdgeScores

__all__ = [
    "area",
    "CircuitFaithfulness",
    "curve_text",
    "evaluate",
    "FaithfulnessCurve",
    "faithfulness_curve",
    "faithfulness_text",
    "MIB_FRACTIONS",
    "smallest_faithful",
]

MIB_FRACTIONS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def area(x: Sequence[float], y: Sequence[float]) -> float:
    """The trapezoid area under ``y`` over ``x``."""
    return float(sum((x[i + 1] - x[i]) * (y[i] + y[i + 1]) / 2 for i in range(len(x) - 1)))


@dataclass(repr=False)
class CircuitFaithfulness(Shown):
    """Circuits run on a task: ``edges`` (each circuit's edge count), ``values`` (the metric with each),
    ``full`` and ``empty`` (the metric of the full model and of every edge ablated), the ``variant`` and
    ``ablation``, the ``metric``'s name."""

    edges: list[int]
    values: list[float]
    full: float
    empty: float
    variant: str
    ablation: str
    metric: str

    @property
    def faithfulness(self) -> list[float]:
        gap = self.full - self.empty
        return [(v - self.empty) / gap if gap else float("nan") for v in self.values]

    def to_dict(self) -> dict[str, Any]:
        return {
            "edges": self.edges, "values": self.values, "faithfulness": self.faithfulness, "full": self.full,
            "empty": self.empty, "variant": self.variant, "ablation": self.ablation, "metric": self.metric,
        }  # fmt: skip


@register(TEXT, CircuitFaithfulness)
def faithfulness_text(r: CircuitFaithfulness) -> str:
    lines = [
        f"{r.metric}: full model {r.full:.4g}, every edge ablated {r.empty:.4g} ({r.ablation} ablation, {r.variant})"
    ]
    for n, v, f in zip(r.edges, r.values, r.faithfulness):
        lines.append(f"  {n:7d} edges  {v:10.4g}  faithfulness {f:.3f}")
    return "\n".join(lines)


def evaluate(ev: Evaluator, circuits: Sequence[Circuit], progress: Progress | None = None) -> CircuitFaithfulness:
    """Run ``circuits`` with ``ev`` (one evaluator: its prompts, ablation and variant)."""
    if not circuits:
        raise QkovError("circuit evaluation: no circuits given")
    values = ev.metrics(torch.stack([c.edges for c in circuits]), progress).tolist()
    name = ev.parts[0][1].contrast.metric.name if ev.parts else ""
    return CircuitFaithfulness(
        [c.n_edges for c in circuits], values, ev.full, ev.nothing_kept(), ev.variant, ev.ablation.kind, name
    )


@dataclass(repr=False)
class FaithfulnessCurve(Shown):
    """The faithfulness curve (see the module docstring): at each of ``fractions``, the pruned top-n
    circuits' edge counts and faithfulness, by importance (``signed``) and by ``|score|`` (``absolute``);
    ``cpr`` and ``cmd``."""

    fractions: list[float]
    signed: CircuitFaithfulness
    absolute: CircuitFaithfulness
    method: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def cpr(self) -> float:
        return area(self.fractions, self.signed.faithfulness)

    @property
    def cmd(self) -> float:
        return area(self.fractions, [abs(1 - f) for f in self.absolute.faithfulness])

    def to_dict(self) -> dict[str, Any]:
        return {
            "fractions": self.fractions, "cpr": self.cpr, "cmd": self.cmd, "method": self.method,
            "signed": self.signed.to_dict(), "absolute": self.absolute.to_dict(),
        }  # fmt: skip


@register(TEXT, FaithfulnessCurve)
def curve_text(c: FaithfulnessCurve) -> str:
    lines = [
        f"faithfulness curve of {c.method} scores ({c.signed.ablation} ablation, {c.signed.variant}): "
        f"CPR {c.cpr:.3f} (higher is better), CMD {c.cmd:.3f} (lower is better)",
        "  fraction   edges  faithfulness (by importance)   edges  faithfulness (by |score|)",
    ]
    for p, n1, f1, n2, f2 in zip(
        c.fractions, c.signed.edges, c.signed.faithfulness, c.absolute.edges, c.absolute.faithfulness
    ):
        lines.append(f"  {p:8.3%} {n1:7d}  {f1:12.3f}                  {n2:7d}  {f2:12.3f}")
    return "\n".join(lines)


def faithfulness_curve(
    ev: Evaluator,
    scores: EdgeScores,
    *,
    fractions: Sequence[float] = MIB_FRACTIONS,
    pruned: bool = True,
    progress: Progress | None = None,
) -> FaithfulnessCurve:
    """The faithfulness curve of ``scores`` on ``ev``'s prompts (see the module docstring)."""
    fr = sorted(float(p) for p in fractions)
    if not fr or fr[0] < 0 or fr[-1] > 1:
        raise QkovError("faithfulness curve: fractions must be in [0, 1]")
    total = scores.values.numel()
    pick = [_circuit(scores, int(p * total), absolute, pruned) for absolute in (False, True) for p in fr]
    both = evaluate(ev, pick, progress)
    k = len(fr)

    def half(lo: int) -> CircuitFaithfulness:
        e, v = both.edges[lo : lo + k], both.values[lo : lo + k]
        return CircuitFaithfulness(e, v, both.full, both.empty, both.variant, both.ablation, both.metric)

    return FaithfulnessCurve(fr, half(0), half(k), scores.method)


def _circuit(scores: EdgeScores, n: int, absolute: bool, pruned: bool) -> Circuit:
    c = top_n(scores, n, absolute=absolute)
    return prune(c) if pruned else c


def smallest_faithful(ev: Evaluator, scores: EdgeScores, target: float, *, absolute: bool = True,
                      pruned: bool = True, rounds: int = 3, per_round: int = 12,
                      progress: Progress | None = None) -> tuple[Circuit, CircuitFaithfulness]:  # fmt: skip
    """The smallest top-n circuit (on a refined grid of ``n``) whose faithfulness reaches ``target``:
    ``per_round`` sizes per pass, ``rounds`` passes narrowing the interval; the largest circuit when none does."""
    total = scores.values.numel()
    lo, hi = 0, total
    best: tuple[Circuit, CircuitFaithfulness] | None = None
    for r in range(rounds):
        grid = sorted({max(lo, min(hi, n)) for n in _grid(lo, hi, per_round, geometric=r == 0)})
        cs = [_circuit(scores, n, absolute, pruned) for n in grid]
        got = evaluate(ev, cs, progress)
        ok = [i for i, f in enumerate(got.faithfulness) if f >= target]
        if not ok:
            if best is None:
                i = len(cs) - 1
                best = (cs[i], _one(got, i))
            break
        i = ok[0]
        best = (cs[i], _one(got, i))
        lo, hi = (grid[i - 1] if i else lo), grid[i]
        if hi - lo <= 1:
            break
    assert best is not None
    return best


def _grid(lo: int, hi: int, k: int, geometric: bool) -> list[int]:
    if geometric:
        pts = torch.logspace(0, torch.log10(torch.tensor(float(max(hi, 1)))), k)
        return [lo, *[int(round(float(p))) for p in pts], hi]
    return [int(round(lo + (hi - lo) * i / (k - 1))) for i in range(k)]


def _one(r: CircuitFaithfulness, i: int) -> CircuitFaithfulness:
    return CircuitFaithfulness([r.edges[i]], [r.values[i]], r.full, r.empty, r.variant, r.ablation, r.metric)
