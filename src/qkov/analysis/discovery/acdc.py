"""An ACDC-style pruning pass: refine a circuit by trying each of its edges for removal (Conmy et al. 2023).

Starting from a circuit (a found one, or every edge), visit its edges in reverse topological order --
receivers from the logits back to the input, each receiver's senders from the latest to the earliest
(the graph's edge numbering reversed: deterministic, unlike a set's order) -- and remove an edge when
doing so raises ``KL(clean || circuit)`` of the next-token distribution by less than ``tau``:
``KL(without e) - KL(current) < tau`` (a drop in KL always removes it). The circuit is run with the rest
ablated (:mod:`.evaluate`). The pass stops after ``max_seconds`` if given; the edges not yet visited stay.

Each pass of the model tries several edges at once (each removed alone from the current circuit); the
trials after the first removal are stale and run again, so the number tried per pass grows while
edges are kept and shrinks when they are removed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import QkovError
from ...progress import Progress, tick
from ..shown import TEXT, Shown, register
from .circuit import Circuit
from .evaluate import Evaluator

__all__ = ["acdc_prune", "AcdcResult", "acdc_text"]


@dataclass(repr=False)
class AcdcResult(Shown):
    """The pruned ``circuit``, how many edges it started with and how many were ``removed``, how many of
    the ``total`` were ``visited``, the final ``kl``, ``tau``, whether the pass ``finished`` and its ``seconds``."""

    circuit: Circuit
    start: int
    removed: int
    visited: int
    total: int
    kl: float
    tau: float
    finished: bool
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "edges": self.circuit.n_edges, "start": self.start, "removed": self.removed, "visited": self.visited,
            "total": self.total, "kl": self.kl, "tau": self.tau, "finished": self.finished, "seconds": self.seconds,
            "circuit": self.circuit.names,
        }  # fmt: skip


@register(TEXT, AcdcResult)
def acdc_text(r: AcdcResult) -> str:
    end = "finished" if r.finished else f"stopped after {r.visited} of {r.total} edges (time limit)"
    return (
        f"ACDC pass (tau {r.tau:g}): {r.start} -> {r.circuit.n_edges} edges, KL(clean || circuit) {r.kl:.4g}; "
        f"{end} in {r.seconds:.1f} s"
    )


def acdc_prune(
    ev: Evaluator,
    start: Circuit,
    *,
    tau: float,
    max_seconds: float | None = None,
    progress: Progress | None = None,
) -> AcdcResult:
    """Prune ``start`` with ``ev`` (an evaluator whose task's metric is ``kl``); see the module docstring."""
    if ev.task.metric != "kl":
        raise QkovError("ACDC pruning: the evaluator's metric must be kl (KL of the clean run to the circuit's)")
    if ev.variant != "ablate-complement":
        raise QkovError("ACDC pruning: the circuit runs with its complement ablated")
    if start.per_position:
        raise QkovError("ACDC pruning: per-position circuits are not supported")
    if not tau >= 0:
        raise QkovError(f"ACDC pruning: tau must be a non-negative number, got {tau!r}")
    t0 = time.perf_counter()
    current = start.edges.clone()
    order = current.nonzero()[:, 0].flip(0).tolist()  # reverse topological
    kl = float(ev.metrics(current[None])[0])
    i, k, removed = 0, 1, 0
    while i < len(order):
        if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
            break
        trial = order[i : i + k]
        masks = current[None].repeat(len(trial), 1)
        masks[torch.arange(len(trial)), torch.tensor(trial)] = False
        got = ev.metrics(masks).tolist()
        hit = next((j for j, v in enumerate(got) if v - kl < tau), None)
        if hit is None:
            i += len(trial)
            k = min(2 * k, 64)
        else:
            current[trial[hit]] = False
            kl, removed = got[hit], removed + 1
            i += hit + 1
            k = max(1, hit)
        tick(progress, "acdc: edges", i, len(order))
    circuit = Circuit(start.graph, current, f"{start.how}, ACDC tau {tau:g}" if start.how else f"ACDC tau {tau:g}")
    return AcdcResult(
        circuit, start.n_edges, removed, i, len(order), kl, tau, i >= len(order), time.perf_counter() - t0
    )
