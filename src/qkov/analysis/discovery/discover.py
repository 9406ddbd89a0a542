"""Finding a task's circuit in one call: score every edge, choose a circuit, check it.

:func:`find_circuit` runs the pieces in order: edge scores by one method (:func:`~.score.edge_scores`),
a circuit chosen from them (top-n, threshold, greedy growth, or the smallest top-n circuit reaching a
faithfulness; dead ends pruned), the circuit run with the rest ablated (its faithfulness), the
faithfulness curve at MIB's fractions with CPR and CMD, edge- and node-level ROC AUC against a
ground-truth circuit when one is given, and an ACDC-style pruning pass when asked. The result, a
:class:`CircuitDiscovery`, shows itself as text, as JSON (``to_dict``) and in a notebook.
:func:`evaluate_circuit` runs given circuits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from ...errors import QkovError
from ...progress import Progress, tick
from ...weights.convert import SourceLike, as_source
from ..shown import TEXT, Shown, register
from .ablations import as_ablation
from .acdc import AcdcResult, acdc_prune
from .circuit import Circuit, greedy, prune, threshold, top_n
from .evaluate import Evaluator
from .faithfulness import (
    CircuitFaithfulness,
    FaithfulnessCurve,
    MIB_FRACTIONS,
    evaluate,
    faithfulness_curve,
    smallest_faithful,
)
from .formats import load_task
from .graph import graph_of
from .layout import drawn_edges
from .roc import Roc, circuit_roc
from .score import edge_scores
from .scores import EdgeScores
from .task import Task

__all__ = ["CircuitDiscovery", "discovery_text", "evaluate_circuit", "find_circuit", "TARGET"]

TARGET = 0.8  # the faithfulness a circuit must reach when neither a size nor a target is given
WHERE = "circuit discovery"


@dataclass(repr=False)
class CircuitDiscovery(Shown):
    """What :func:`find_circuit` found: the ``task`` (described), the ``scores``, the ``circuit``, its
    ``faithfulness``, the ``curve`` (or ``None``), the ``roc`` against a ground truth (or ``None``) and the
    ``acdc`` pass (or ``None``)."""

    task: str
    scores: EdgeScores
    circuit: Circuit
    faithfulness: CircuitFaithfulness
    curve: FaithfulnessCurve | None = None
    roc: Roc | None = None
    acdc: AcdcResult | None = None

    def to_dict(self) -> dict[str, Any]:
        f = self.faithfulness
        return {
            "task": self.task,
            "graph": self.scores.graph.summary() if self.scores.graph else None,
            "method": self.scores.method,
            "ablation": self.scores.ablation,
            "circuit": {**self.circuit.to_dict(), "metric": f.values[0], "faithfulness": f.faithfulness[0],
                        "full": f.full, "empty": f.empty, "variant": f.variant},
            "curve": None if self.curve is None else self.curve.to_dict(),
            "roc": None if self.roc is None else self.roc.to_dict(),
            "acdc": None if self.acdc is None else self.acdc.to_dict(),
            "scores": self.scores.to_dict(),
        }  # fmt: skip


@register(TEXT, CircuitDiscovery)
def discovery_text(d: CircuitDiscovery, k: int = 12) -> str:
    f = d.faithfulness
    g = d.scores.graph
    lines = [
        d.task,
        g.summary() if g is not None else "",
        f"{d.scores.method} ({d.scores.ablation} ablation): circuit of {d.circuit.n_edges} edges ({d.circuit.how}); "
        f"{f.metric} {f.values[0]:.4g} (full model {f.full:.4g}, every edge ablated {f.empty:.4g}): "
        f"faithfulness {f.faithfulness[0]:.3f}",
    ]
    if d.curve is not None:
        lines.append(f"faithfulness curve: CPR {d.curve.cpr:.3f}, CMD {d.curve.cmd:.3f}")
    if d.roc is not None:
        lines.append(TEXT[type(d.roc)](d.roc))
    if d.acdc is not None:
        lines.append(TEXT[type(d.acdc)](d.acdc))
    lines.append("edges of the circuit, by |score|:")
    chosen, score = drawn_edges(d.scores, d.circuit)
    for i, v in zip(chosen[:k], score):
        lines.append(f"  {g.names[i]:32s} {v:+10.4g}")  # type: ignore[union-attr]
    if len(chosen) > k:
        lines.append(f"  ... {len(chosen) - k} more")
    return "\n".join(line for line in lines if line)


def _choose(ev: Evaluator, scores: EdgeScores, edges: int | None, target: float | None, tau: float | None,
            how: str, absolute: bool, progress: Progress | None) -> tuple[Circuit, CircuitFaithfulness]:  # fmt: skip
    """The circuit the options ask for, dead ends pruned, and its faithfulness."""
    given = [x is not None for x in (edges, target, tau)]
    if sum(given) > 1:
        raise QkovError(f"{WHERE}: give a circuit size, a faithfulness to reach or a threshold, not several")
    if how not in ("top", "greedy"):
        raise QkovError(f"{WHERE}: circuits are chosen top or greedy, got {how!r}")
    if how == "greedy" and edges is None:
        raise QkovError(f"{WHERE}: a circuit grown greedily needs its size (edges=N)")
    if target is not None or not any(given):
        target = TARGET if target is None else target
        if not 0 < target <= 1.5:
            raise QkovError(f"{WHERE}: the faithfulness to reach must be in (0, 1.5], got {target}")
        return smallest_faithful(ev, scores, target, absolute=absolute, progress=progress)
    if tau is not None:
        c = threshold(scores, tau, absolute=absolute)
    else:
        total = scores.values.numel()
        if not 0 < edges <= total:  # type: ignore[operator]
            raise QkovError(f"{WHERE}: the circuit size must be in 1..{total} edges, got {edges}")
        c = greedy(scores, edges, absolute=absolute) if how == "greedy" else top_n(scores, edges, absolute=absolute)  # type: ignore[arg-type]
    c = prune(c)
    if c.n_edges == 0:
        raise QkovError(
            f"{WHERE}: the circuit is empty after pruning its dead ends (no edge reaches the logits); "
            "ask for more edges"
        )
    return c, evaluate(ev, [c], progress)


def find_circuit(
    source: SourceLike,
    task: Any,
    *,
    method: str = "eap",
    ablation: str = "corrupted",
    steps: int | None = None,
    edges: int | None = None,
    faithfulness: float | None = None,
    threshold: float | None = None,
    how: str = "top",
    absolute: bool = True,
    per_position: bool = False,
    variant: str = "ablate-complement",
    curve: bool = True,
    fractions: Sequence[float] = MIB_FRACTIONS,
    ground_truth: Circuit | Iterable[Any] | None = None,
    acdc_tau: float | None = None,
    acdc_seconds: float | None = None,
    batch: int | None = None,
    progress: Progress | None = None,
) -> CircuitDiscovery:
    """The circuit of ``task`` in ``source`` (see the module docstring). ``task``: a :class:`~.task.Task`,
    a built-in name (``induction``, ``ioi``) or a task file (:func:`~.formats.load_task`). The circuit:
    ``edges`` (top-n, or ``how="greedy"``), ``faithfulness`` (the smallest top-n circuit reaching it;
    the default, :data:`TARGET`) or ``threshold``, ranked by ``|score|`` (``absolute``) or importance.
    ``variant``: how circuits run (:data:`~.evaluate.VARIANTS`). ``ground_truth``: a circuit, or edges or
    nodes as written, for ROC AUC. ``acdc_tau``: refine the circuit by an ACDC pass (``acdc_seconds``
    bounds it)."""
    w = as_source(source, where="qkov.find_circuit")
    if acdc_tau is not None and per_position:
        raise QkovError("ACDC pruning: per-position circuits are not supported")
    t = task if isinstance(task, Task) else load_task(task, w)
    g = graph_of(w.cfg)
    abl = as_ablation(w, g, t.check(w.cfg), ablation, progress=progress)
    scores = edge_scores(
        w, t, method=method, ablation=abl, steps=steps, per_position=per_position, batch=batch, progress=progress
    )
    tick(progress, WHERE, 1, 4)
    ev = Evaluator(w, g, t, abl, variant=variant, batch=batch or 32)
    circuit, faith = _choose(ev, scores, edges, faithfulness, threshold, how, absolute, progress)
    tick(progress, WHERE, 2, 4)
    found = CircuitDiscovery(t.describe(), scores, circuit, faith)
    if curve:
        found.curve = faithfulness_curve(ev, scores, fractions=fractions, progress=progress)
    tick(progress, WHERE, 3, 4)
    if ground_truth is not None:
        found.roc = circuit_roc(scores, ground_truth)
    if acdc_tau is not None:
        kl = Evaluator(w, g, t.with_metric("kl"), abl, batch=batch or 32)
        found.acdc = acdc_prune(kl, circuit, tau=acdc_tau, max_seconds=acdc_seconds, progress=progress)
    tick(progress, WHERE, 4, 4)
    return found


def evaluate_circuit(
    source: SourceLike,
    task: Any,
    circuits: Circuit | Sequence[Circuit] | Iterable[str],
    *,
    ablation: str = "corrupted",
    variant: str = "ablate-complement",
    batch: int = 32,
    progress: Progress | None = None,
) -> CircuitFaithfulness:
    """Run ``circuits`` (:class:`~.circuit.Circuit` s, or one circuit's edges as written) on ``task`` with
    the rest ablated (``variant``): each one's metric and faithfulness. A one-line error for an empty circuit."""
    w = as_source(source, where="qkov.evaluate_circuit")
    t = task if isinstance(task, Task) else load_task(task, w)
    g = graph_of(w.cfg)
    if isinstance(circuits, Circuit):
        cs = [circuits]
    else:
        items = list(circuits)
        cs = items if items and all(isinstance(c, Circuit) for c in items) else [Circuit.of(g, items)]
    for c in cs:
        if c.n_edges == 0:
            raise QkovError("circuit evaluation: the circuit is empty (give at least one edge)")
        if c.graph.n_edges != g.n_edges:
            raise QkovError("circuit evaluation: the circuit is of another model's graph")
    ev = Evaluator(w, g, t.check(w.cfg), as_ablation(w, g, t, ablation), variant=variant, batch=batch)
    return evaluate(ev, cs, progress)
