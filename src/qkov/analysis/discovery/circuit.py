"""A circuit: a set of edges of a model's graph, and the ways to choose one from edge scores.

A :class:`Circuit` is a boolean per edge (``[E]``; ``[T, E]`` for per-position edges). Choosing one
from scores (:class:`~.scores.EdgeScores`, ranked by ``|score|`` or, with ``absolute=False``, by
importance: positive carries the clean behaviour):

* :func:`top_n` -- the ``n`` edges ranked first (exactly ``n``: ties go to the lower edge number, as a
  stable sort orders them; Hanna et al.'s ``apply_topn``);
* :func:`threshold` -- every edge ranked at least ``tau`` (``apply_threshold``);
* :func:`greedy` -- grown from the logits: ``n`` times, the best-ranked edge into a node already in the
  circuit (its sender joins; ``apply_greedy``), so the circuit is connected to the logits as it grows;
* :func:`prune` -- dead ends removed: repeatedly, every node that receives no edge of the circuit (the
  input excepted) or sends none (the logits excepted), with its edges (``Graph.prune``). Under the
  corrupted ablation this never changes the circuit's metric (a node whose inputs are all ablated
  outputs its corrupted value, and an edge into a node that sends nothing reaches nothing).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import Tensor

from ...errors import QkovError
from ..shown import TEXT, Shown, register
from .graph import Graph
from .scores import EdgeScores

__all__ = ["Circuit", "circuit_text", "greedy", "prune", "threshold", "top_n"]


@dataclass(repr=False)
class Circuit(Shown):
    """``edges [E]`` (``[T, E]`` per position) booleans over ``graph``'s edges; ``how`` it was chosen."""

    graph: Graph
    edges: Tensor
    how: str = ""

    def __post_init__(self) -> None:
        self.edges = torch.as_tensor(self.edges).bool().cpu()
        if self.edges.shape[-1] != self.graph.n_edges or self.edges.ndim not in (1, 2):
            raise QkovError(
                f"circuit: expected one boolean per edge ({self.graph.n_edges}), got shape {list(self.edges.shape)}"
            )

    @classmethod
    def of(cls, graph: Graph, edges: Iterable[Any], how: str = "given") -> Circuit:
        """The circuit of ``edges`` (written forms or edge numbers); a one-line error for an edge the graph lacks."""
        mask = torch.zeros(graph.n_edges, dtype=torch.bool)
        for e in edges:
            mask[e if isinstance(e, int) else graph.index(e, "circuit")] = True
        return cls(graph, mask, how)

    @property
    def per_position(self) -> bool:
        return self.edges.ndim == 2

    @property
    def n_edges(self) -> int:
        return int(self.edges.sum())

    def __len__(self) -> int:
        return self.n_edges

    @property
    def union(self) -> Tensor:
        """``[E]``: the edges in the circuit at any position."""
        return self.edges.any(0) if self.per_position else self.edges

    @property
    def names(self) -> list[str]:
        """The written form of every edge in the circuit (at any position), in edge order."""
        return [self.graph.names[i] for i in self.union.nonzero()[:, 0].tolist()]

    @property
    def node_mask(self) -> Tensor:
        """``[nodes]``: the nodes an edge of the circuit touches (``graph.nodes`` order)."""
        s, r = self.graph.edge_nodes
        mask = torch.zeros(len(self.graph.nodes), dtype=torch.bool)
        on = self.union
        mask[s[on]] = True
        mask[r[on]] = True
        return mask

    @property
    def nodes(self) -> list[str]:
        return [self.graph.nodes[i].name for i in self.node_mask.nonzero()[:, 0].tolist()]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": "qkov circuit", "how": self.how, "n_edges": self.n_edges, "edges": self.names}
        out["nodes"] = self.nodes
        if self.per_position:
            out["positions"] = {
                self.graph.names[e]: self.edges[:, e].nonzero()[:, 0].tolist()
                for e in self.union.nonzero()[:, 0].tolist()
            }
        return out


@register(TEXT, Circuit)
def circuit_text(c: Circuit, k: int = 12) -> str:
    heads = sum(1 for n in c.nodes if n[0].isdigit())
    lines = [f"circuit of {c.n_edges} edges, {heads} heads ({c.how})"]
    lines += [f"  {n}" for n in c.names[:k]]
    if len(c.names) > k:
        lines.append(f"  ... {len(c.names) - k} more")
    return "\n".join(lines)


def _ranking(scores: EdgeScores | Tensor, absolute: bool) -> Tensor:
    if isinstance(scores, EdgeScores):
        r = scores.ranking(absolute)
    else:
        r = scores.abs() if absolute else scores
    if bool(r.isnan().any()):
        r = r.nan_to_num(float("-inf"))  # an edge not measured ranks last
    return r


def top_n(scores: EdgeScores, n: int, *, absolute: bool = True) -> Circuit:
    """The ``n`` edges (edge-positions, per position) ranked first; see the module docstring."""
    r = _ranking(scores, absolute)
    flat = r.flatten()
    if not 0 <= n <= flat.numel():
        raise QkovError(f"top-n circuit: n must be in 0..{flat.numel()}, got {n}")
    mask = torch.zeros(flat.numel(), dtype=torch.bool)
    mask[torch.argsort(flat, descending=True, stable=True)[:n]] = True
    return Circuit(scores.graph, mask.view(r.shape), f"top {n} by {'|score|' if absolute else 'importance'}")  # type: ignore[arg-type]


def threshold(scores: EdgeScores, tau: float, *, absolute: bool = True) -> Circuit:
    """Every edge ranked at least ``tau``."""
    return Circuit(
        scores.graph, _ranking(scores, absolute) >= tau, f"{'|score|' if absolute else 'importance'} >= {tau:g}"
    )  # type: ignore[arg-type]


def _into(graph: Graph, node: int) -> list[int]:
    """The edges into node ``node`` (a head's q/k/v inputs, an MLP's input; none into the input)."""
    rs = (graph.receiver_node == node).nonzero()[:, 0].tolist()
    return [e for r in rs for e in range(int(graph.first_edge[r]), int(graph.first_edge[r + 1]))]


def greedy(scores: EdgeScores, n: int, *, absolute: bool = True) -> Circuit:
    """``n`` edges grown from the logits; see the module docstring."""
    g = scores.graph
    assert g is not None
    if scores.per_position:
        raise QkovError("greedy circuit: grown from edge scores, not per-position ones")
    r = _ranking(scores, absolute).tolist()
    logits = len(g.nodes) - 1
    have = {logits}
    heap = [(-r[e], e) for e in _into(g, logits)]
    heapq.heapify(heap)
    mask = torch.zeros(g.n_edges, dtype=torch.bool)
    while heap and int(mask.sum()) < n:
        _, e = heapq.heappop(heap)
        mask[e] = True
        s = int(g.src[e])
        if s not in have:
            have.add(s)
            for e2 in _into(g, s):
                heapq.heappush(heap, (-r[e2], e2))
    return Circuit(g, mask, f"greedy {n} by {'|score|' if absolute else 'importance'}")


def prune(circuit: Circuit) -> Circuit:
    """The circuit without its dead ends (see the module docstring); per-position circuits are pruned
    on their edges at any position, an edge position kept where its edge is."""
    g = circuit.graph
    s_node, r_node = g.edge_nodes
    on = circuit.union.clone()
    N, logits = len(g.nodes), len(g.nodes) - 1
    while True:
        has_in = torch.zeros(N, dtype=torch.bool)
        has_out = torch.zeros(N, dtype=torch.bool)
        has_in[r_node[on]] = True
        has_out[s_node[on]] = True
        has_in[0] = True  # the input needs no edge in
        has_out[logits] = True
        alive = has_in & has_out
        keep = on & alive[s_node] & alive[r_node]
        if torch.equal(keep, on):
            break
        on = keep
    edges = circuit.edges & on if circuit.per_position else on
    return Circuit(g, edges, f"{circuit.how}, pruned" if circuit.how else "pruned")
