"""Every edge's score on a task by one method: :func:`edge_scores`.

The methods (:data:`METHODS`): attribution, every edge from a few passes (``eap``, ``eap-ig``,
``eap-ig-activations``, ``ieg``: :mod:`.attribution`), and ``exact`` edge patching, one patched copy per
edge (:mod:`.exact`; all edges on a small model, a chosen subset on a large one). All give
``m(edge ablated) - m(clean)`` averaged over the task's prompt pairs, as an
:class:`~.scores.EdgeScores`; per-position edges (Haklay et al. 2025: one edge per sender, receiver and
position, the sender at a position feeding the receiver at the same one) give ``[T, E]``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from ...device import tune_allocator_for
from ...errors import QkovError
from ...progress import Progress, tick
from ...weights.convert import SourceLike, as_source
from .ablations import as_ablation
from .attribution import ATTRIBUTION, attribution_batch, batch_size
from .evaluate import circuit_metrics, ready_metric
from .exact import exact_batch
from .graph import graph_of
from .scores import EdgeScores
from .task import Task

__all__ = ["edge_scores", "METHODS", "STEPS"]

METHODS = (*ATTRIBUTION, "exact")
STEPS = 5  # integration steps of the IG methods unless given (MIB's EAP-IG default is 5 too)


def edge_scores(
    source: SourceLike,
    task: Task,
    *,
    method: str = "eap",
    ablation: Any = "corrupted",
    steps: int | None = None,
    per_position: bool = False,
    edges: Sequence[Any] | Tensor | None = None,
    means_over: str = "corrupted",
    batch: int | None = None,
    max_bytes: int = 2 << 30,
    progress: Progress | None = None,
) -> EdgeScores:
    """Score every edge of ``source``'s graph on ``task`` by ``method`` (:data:`METHODS`) under
    ``ablation`` (``corrupted``, ``zero``, ``mean``, ``mean-position``; means over the task's
    ``means_over`` prompts). ``steps``: the IG methods' integration steps (default :data:`STEPS`).
    ``per_position``: one edge per position (prompts of one length). ``edges``: for ``exact``, the edges
    to patch (numbers or written forms; the others are NaN). ``batch``: prompt pairs per pass (default:
    what fits ``max_bytes``)."""
    w = as_source(source, where="qkov.edge_scores")
    tune_allocator_for(w)
    graph = graph_of(w.cfg)
    if not isinstance(task, Task):
        raise QkovError(f"edge scores: expected a qkov Task, got {type(task).__name__} (load one with load_task)")
    task.check(w.cfg)
    if method not in METHODS:
        raise QkovError(f"edge scores: the method is one of {', '.join(METHODS)}, got {method!r}")
    if method == "eap" and task.metric == "kl":
        raise QkovError(
            "edge scores: eap with the KL metric is 0 (its gradient vanishes at the clean run); use eap-ig or exact"
        )
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        raise QkovError(f"edge scores: steps must be a positive integer, got {steps!r}")
    m = steps or STEPS
    T = task.single_length("per-position edges") if per_position else max(task.lengths.tolist())  # type: ignore[union-attr]
    abl = as_ablation(w, graph, task, ablation, over=means_over, progress=progress)
    S, R, E = len(graph.senders), len(graph.receivers), graph.n_edges
    exact = method == "exact"
    subset = _edges(graph, edges) if exact else None
    shape = ((T,) if per_position else ()) + ((E,) if exact else (S, R))
    acc = torch.zeros(shape, dtype=torch.float64, device=w.device)
    size = batch or (32 if exact else batch_size(w, graph, T, max_bytes))
    batches = list(task.batches(size))
    clean = corrupted = 0.0
    for i, b in enumerate(batches):
        weight = len(b.rows) / len(task)
        metric = ready_metric(w, b)
        if exact:
            got = exact_batch(
                w, graph, b, metric, abl, acc, weight=weight, edges=subset, max_bytes=max_bytes // 8, progress=progress
            )  # type: ignore[arg-type]
        else:
            got = attribution_batch(method, w, graph, b, metric, abl, acc, weight=weight, steps=m)
        clean += weight * got[0]
        corrupted += weight * got[1]
        tick(progress, f"edge scores: {method}", i + 1, len(batches))
    flat = acc if exact else acc[..., graph.src, graph.dst]
    if exact and len(subset) < E:  # type: ignore[arg-type]
        left = torch.ones(E, dtype=torch.bool)
        left[subset] = False  # type: ignore[index]
        flat[..., left.to(flat.device)] = float("nan")
    empty = corrupted if abl.kind == "corrupted" else _empty(w, graph, task, abl, size)
    axes = ("pos", "edge") if per_position else ("edge",)
    labels = {"edge": list(graph.names), **({"pos": [str(t) for t in range(T)]} if per_position else {})}
    return EdgeScores(
        method, "edges", axes, (clean + flat).cpu(), clean, empty, "noise", _metric_name(task), labels,
        graph=graph, ablation=abl.kind, steps=m if method in ATTRIBUTION[1:] else None, prompts=len(task),
        higher_is_better=task.metric in ("logit-diff", "prob"),
    )  # fmt: skip


def _edges(graph: Any, edges: Sequence[Any] | Tensor | None) -> Tensor:
    """Edge numbers from numbers, written forms or ``None`` (every edge)."""
    if edges is None:
        return torch.arange(graph.n_edges)
    if isinstance(edges, Tensor):
        idx = edges.long().flatten()
    else:
        idx = torch.tensor([e if isinstance(e, int) else graph.index(e) for e in edges], dtype=torch.long)
    if idx.numel() == 0:
        raise QkovError("exact edge patching: no edges given")
    if int(idx.min()) < 0 or int(idx.max()) >= graph.n_edges:
        raise QkovError(f"exact edge patching: edge numbers are 0..{graph.n_edges - 1}")
    return idx.unique()


def _empty(w: Any, graph: Any, task: Task, abl: Any, size: int) -> float:
    """``m(empty)``: the metric with every edge ablated."""
    none = torch.zeros(1, graph.n_edges, dtype=torch.bool)
    return float(circuit_metrics(w, graph, task, none, abl, batch=size)[0][0])


def _metric_name(task: Task) -> str:
    return task.answer_metric(torch.arange(1)).name
