"""How well edge scores recover a known circuit: ROC curves and their area, edge by edge and node by node.

Rank the edges by score (``|score|`` by default). At each count ``n``, the edges ranked at least as high
as the ``n``-th are "found": ``TPR = found and true / true`` and ``FPR = found and not true / not true``
(Conmy et al. 2023, ACDC; Syed et al. 2023; AutoCircuit). The curve starts at ``(0, 0)``, ends at
``(1, 1)``, and its area (trapezoids) is the AUC. ``grid="exact"`` takes every count, so the area is the
probability that a true edge outranks a false one (ties counted half); ``grid="log"`` takes AutoCircuit's
counts for large graphs (1-9, 10-90 by 10, 100-900 by 100, ...), whose area approximates it.

Node level: a node (a head or an MLP; the input and the logits are in every circuit and are left out)
ranks as its best-ranked edge (sent or received), and the true nodes are those an edge of the true
circuit touches (or the nodes given).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import Tensor

from ...errors import QkovError
from ..forward.address import Address
from ..shown import TEXT, Shown, register
from .circuit import Circuit
from .graph import Graph
from .scores import EdgeScores

__all__ = ["auc", "circuit_roc", "GRIDS", "log_counts", "Roc", "roc_points", "roc_text"]

GRIDS = ("exact", "log")


def log_counts(n: int) -> list[int]:
    """AutoCircuit's edge counts for a graph of ``n`` edges: 0, 1-9, 10-90 by 10, 100-900 by 100, ..., ``n``."""
    return [0, *[k for k in range(1, n) if k % 10 ** int(math.floor(math.log10(k))) == 0], n]


def roc_points(ranking: Tensor, truth: Tensor, grid: str = "exact") -> list[tuple[float, float]]:
    """``[(FPR, TPR)]`` of ``ranking [n]`` (higher first) against ``truth [n]`` (booleans), from
    ``(0, 0)`` to ``(1, 1)``; see the module docstring."""
    if grid not in GRIDS:
        raise QkovError(f"ROC: the grid is one of {', '.join(GRIDS)}, got {grid!r}")
    truth = truth.bool().flatten()
    r = ranking.flatten().double().nan_to_num(float("-inf"))
    P, N = int(truth.sum()), int((~truth).sum())
    if P == 0 or N == 0:
        raise QkovError("ROC: the true circuit must have some of the edges and leave some out")
    order = torch.argsort(r, descending=True, stable=True)
    sr, st = r[order], truth[order]
    tp, fp = st.cumsum(0), (~st).cumsum(0)
    if grid == "exact":
        ends = torch.cat([(sr[1:] != sr[:-1]).nonzero()[:, 0], torch.tensor([len(sr) - 1])])  # last of each tie group
    else:
        counts = [c for c in log_counts(len(sr)) if c > 0]
        # a count inside a tie group takes the whole group, as AutoCircuit's threshold does
        ends = torch.tensor([int((sr >= sr[c - 1]).sum()) - 1 for c in counts])
    pts = [(0.0, 0.0)] + [(float(fp[i]) / N, float(tp[i]) / P) for i in ends.tolist()] + [(1.0, 1.0)]
    return pts


def auc(points: list[tuple[float, float]]) -> float:
    """The trapezoid area under ROC ``points`` (sorted by FPR, then TPR)."""
    p = sorted(points)
    return float(sum((x2 - x1) * (y1 + y2) / 2 for (x1, y1), (x2, y2) in zip(p, p[1:])))


@dataclass(repr=False)
class Roc(Shown):
    """Edge- and node-level ROC of edge scores against a true circuit: the AUCs, the points, how many
    true edges and nodes there are, the ``grid``."""

    edge_auc: float | None
    node_auc: float
    edge_points: list[tuple[float, float]]
    node_points: list[tuple[float, float]]
    true_edges: int
    true_nodes: int
    grid: str = "exact"

    def to_dict(self) -> dict[str, Any]:
        return {
            "edge_auc": self.edge_auc, "node_auc": self.node_auc, "true_edges": self.true_edges,
            "true_nodes": self.true_nodes, "grid": self.grid, "edge_points": self.edge_points,
            "node_points": self.node_points,
        }  # fmt: skip


@register(TEXT, Roc)
def roc_text(r: Roc) -> str:
    edge = "" if r.edge_auc is None else f"edge ROC AUC {r.edge_auc:.4f} ({r.true_edges} true edges); "
    return f"{edge}node ROC AUC {r.node_auc:.4f} ({r.true_nodes} true heads and MLPs)"


def _nodes(graph: Graph) -> Tensor:
    """``[nodes]``: the heads and MLPs (not the input, not the logits)."""
    keep = torch.ones(len(graph.nodes), dtype=torch.bool)
    keep[0] = keep[-1] = False
    return keep


def node_ranking(graph: Graph, ranking: Tensor) -> Tensor:
    """``[nodes]``: each node's best edge ranking (sent or received)."""
    s, r = graph.edge_nodes
    out = torch.full((len(graph.nodes),), float("-inf"), dtype=torch.float64)
    val = ranking.double().nan_to_num(float("-inf"))
    out.scatter_reduce_(0, s, val, "amax")
    out.scatter_reduce_(0, r, val, "amax")
    return out


def circuit_roc(
    scores: EdgeScores, truth: Circuit | Iterable[Any], *, absolute: bool = True, grid: str = "exact"
) -> Roc:
    """ROC of ``scores`` against the true circuit ``truth`` (a :class:`Circuit`, or edges or nodes as
    written: ``0.1 -> 1.0<k>``, ``1.0``, ``mlp.0``); per-position scores rank each edge by its best
    position. A one-line error for an edge or node the model lacks."""
    g = scores.graph
    assert g is not None
    ranking = scores.ranking(absolute)
    if scores.per_position:
        ranking = ranking.nan_to_num(float("-inf")).amax(0)
    edges, nodes = _truth(g, truth)
    keep = _nodes(g)
    node_truth = nodes if edges is None else Circuit(g, edges).node_mask
    node_pts = roc_points(node_ranking(g, ranking)[keep], node_truth[keep], grid)
    edge_pts = [] if edges is None else roc_points(ranking, edges, grid)
    return Roc(
        None if edges is None else auc(edge_pts), auc(node_pts), edge_pts, node_pts,
        0 if edges is None else int(edges.sum()), int(node_truth[keep].sum()), grid,
    )  # fmt: skip


def _truth(g: Graph, truth: Circuit | Iterable[Any]) -> tuple[Tensor | None, Tensor]:
    """The true edges (``None`` when only nodes are given) and nodes, as masks."""
    if isinstance(truth, Circuit):
        return truth.union, truth.node_mask
    edges = torch.zeros(g.n_edges, dtype=torch.bool)
    nodes = torch.zeros(len(g.nodes), dtype=torch.bool)
    any_edge = any_node = False
    for item in truth:
        a = item if isinstance(item, Address) else Address.parse(str(item), "ground truth")
        if a.is_edge:
            edges[g.index(a, "ground truth")] = True
            any_edge = True
        else:
            nodes[g.node_index(a, "ground truth")] = True
            any_node = True
    if any_edge and any_node:
        raise QkovError("ground truth: give edges or nodes, not both")
    if not (any_edge or any_node):
        raise QkovError("ground truth: no edges or nodes given")
    return (edges if any_edge else None), nodes
