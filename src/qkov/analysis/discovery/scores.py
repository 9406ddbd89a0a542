"""Edge scores: one number per edge of a model's graph (per edge and position, for per-position edges).

An :class:`EdgeScores` is a :class:`~qkov.analysis.causal.result.PatchResult` with an ``edge`` axis (and a
``pos`` axis before it for per-position edges): its ``values`` are the metric with each edge ablated
(estimated by attribution, measured by exact patching), its ``clean`` value the metric with nothing
ablated and its ``corrupted`` value the metric with *every* edge ablated (``m(empty)``: the corrupted
run for the ``corrupted`` ablation). So every surface that shows a patching result shows it, and
``normalized()`` is the fraction of the way from the clean run to the fully ablated one.

:attr:`EdgeScores.scores` is the change itself, ``m(edge ablated) - m(clean)``, in the sign exact
patching has; :attr:`EdgeScores.importance` turns it so that positive means the edge carries the clean
behaviour (its ablation moves the metric toward ``m(empty)``), whatever the metric's direction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...errors import QkovError
from ..causal.result import PatchResult
from ..shown import TEXT, register
from .graph import Graph

__all__ = ["EdgeScores", "edge_scores_text"]


@dataclass(repr=False)
class EdgeScores(PatchResult):
    """Scores of every edge (see the module docstring); ``graph`` the model's graph, ``ablation`` what
    an ablated edge carries, ``steps`` the integration steps (``None`` for a method without), ``prompts``
    how many prompt pairs were averaged over, ``higher_is_better`` the metric's direction."""

    graph: Graph | None = None
    ablation: str = "corrupted"
    steps: int | None = None
    prompts: int = 0
    higher_is_better: bool = True

    @property
    def per_position(self) -> bool:
        return self.axes == ("pos", "edge")

    @property
    def scores(self) -> Tensor:
        """``[E]`` (``[T, E]`` per position): ``m(edge ablated) - m(clean)`` (when denoising, from a
        patching study: ``m(edge patched) - m(corrupted)``)."""
        return self.values - self.base

    @property
    def importance(self) -> Tensor:
        """The scores signed so that positive carries the clean behaviour: ``scores`` times the sign of
        ``m(empty) - m(clean)`` (when that is 0, by the metric's direction)."""
        gap = self.target - self.base
        sign = (1.0 if gap > 0 else -1.0) if gap == gap and gap != 0 else (-1.0 if self.higher_is_better else 1.0)
        return self.scores * sign

    def ranking(self, absolute: bool = True) -> Tensor:
        """``[E]`` (``[T, E]``) the number ranked by: ``|scores|``, or ``importance`` (``absolute=False``)."""
        return self.scores.abs() if absolute else self.importance

    def at_edge(self, edge: Any, pos: int | None = None) -> float:
        """The score (the change) of one edge (``"0.1 -> 1.0<k>"``), at position ``pos`` per position."""
        i = self.graph.index(edge) if not isinstance(edge, int) else edge  # type: ignore[union-attr]
        if self.per_position:
            if pos is None:
                raise QkovError("per-position scores: give the position (pos=)")
            return float(self.scores[pos, i])
        return float(self.scores[i])

    def top(self, k: int = 10, absolute: bool = True) -> list[tuple[str, float]]:
        """The ``k`` edges ranked first (by :meth:`ranking`), with their score; per position, an edge at
        a position is written ``EDGE @ POS``."""
        r = self.ranking(absolute)
        flat = r.flatten()
        order = torch.argsort(flat, descending=True, stable=True)[:k]
        E = self.values.shape[-1]
        names = self.labels["edge"]
        out = []
        for i in order.tolist():
            pos, e = divmod(i, E)
            name = names[e] if not self.per_position else f"{names[e]} @ {pos}"
            out.append((name, float(self.scores.flatten()[i])))
        return out

    def to_dict(self) -> dict[str, Any]:
        """The scores as JSON: every edge's score (a list over positions per position), and what made them."""
        s = self.scores.double()
        names = self.labels["edge"]
        edges = {n: (s[:, i].tolist() if self.per_position else float(s[i])) for i, n in enumerate(names)}
        return {
            "format": "qkov edge scores",
            "method": self.method,
            "ablation": self.ablation,
            "metric": self.metric,
            "steps": self.steps,
            "prompts": self.prompts,
            "clean": self.clean,
            "ablated": self.corrupted,
            "direction": self.direction,
            "per_position": self.per_position,
            "graph": None if self.graph is None else self.graph.summary(),
            "scores": "m(edge ablated) - m(clean)",
            "edges": edges,
        }


@register(TEXT, EdgeScores)
def edge_scores_text(r: EdgeScores, k: int = 10) -> str:
    """A header and the ``k`` edges with the largest scores."""
    steps = "" if r.steps is None else f", {r.steps} steps"
    lines = [
        f"{r.method} scores of {r.values.shape[-1]:,} edges{' x positions' if r.per_position else ''} ({r.ablation} "
        f"ablation{steps}; {r.prompts} prompt pairs; {r.metric}: clean {r.clean:.4g}, "
        f"all edges ablated {r.corrupted:.4g})"
    ]
    for name, v in r.top(k):
        lines.append(f"  {name:32s} {v:+10.4g}")
    return "\n".join(lines)
