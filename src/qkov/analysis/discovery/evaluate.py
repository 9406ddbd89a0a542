"""Running a circuit: the model with every edge outside it ablated, many circuits per forward pass.

A circuit ``C`` (a set of edges) runs on the **clean** prompts with every edge outside it carrying its
ablated value (:mod:`.ablations`), measured from the *current* pass::

    x_r -> x_r + sum_{s -> r not in C} (a~_s - a_s(current pass))

so an ablation propagates downstream (Hanna et al. 2024's ``evaluate_graph``; AutoCircuit's
``TREE_PATCH``; MIB). Three variants (:data:`VARIANTS`; Miller et al. 2024 show how much the choice
matters):

* ``ablate-complement`` (the default): as above; ``m(C)`` says whether the circuit suffices;
* ``ablate-circuit``: the circuit's own edges ablated, the rest kept: whether the circuit is necessary;
* ``patch-in``: the **corrupted** prompts with the circuit's edges given the clean run's values,
  ``x_r -> x_r + sum_{s -> r in C} (a_s(clean) - a_s(current pass))`` (AutoCircuit's ``EDGE_PATCH``,
  its default); it needs the ``corrupted`` ablation.

**Faithfulness** normalises a circuit's metric by the full model and the empty circuit (MIB; Hanna et
al.): ``f(C) = (m(C) - m(empty)) / (m(full) - m(empty))``, with ``m(full)`` the clean run and
``m(empty)`` every edge ablated: the corrupted run for the ``corrupted`` ablation, the fully ablated run
for ``zero`` and the means (not the corrupted run: :func:`circuit_metrics` computes it).

Each pass runs ``K`` circuits as ``K`` copies of a batch of prompts (:mod:`.masked`): the senders'
changes are recorded as the pass makes them and each layer's receivers read theirs through one matrix
product per copy. A pass starts at the first layer one of its circuits changes; a circuit that changes
nothing is not run (its metric is the base run's), nor, under the ``corrupted`` ablation, one that
gives every edge its source run's value (its metric is the source run's: the corrupted run, or the clean
one for ``patch-in``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...device import tune_allocator_for
from ...errors import QkovError
from ...progress import Progress, tick
from ...weights.parts import WeightSource
from ..causal.contrast import Contrast
from ..forward.tracer import trace
from .ablations import Ablation, sender_sites, shared_prefix, stream_sites
from .graph import Graph
from .masked import first_layers, MaskedPass, Prepared
from .senders import ablated_heads, ablated_streams, from_position, replacement_of, run_senders
from .task import AnswerMetric, Task, TaskBatch

__all__ = [
    "circuit_metrics", "copy_bytes", "edge_weights", "Evaluator", "gather_bytes", "prepare", "ready_metric", "VARIANTS",
]  # fmt: skip

VARIANTS = ("ablate-complement", "ablate-circuit", "patch-in")
WHERE = "circuit evaluation"


def ready_metric(source: WeightSource, b: TaskBatch) -> AnswerMetric:
    """The batch's metric, with the clean run as its reference when it is ``kl``."""
    if b.metric.kind != "kl":
        return b.metric
    recording = trace(source, b.clean, positions=b.metric.logit_positions(b.clean.shape[1]))
    return b.metric.with_reference(recording)


def edge_weights(graph: Graph, flat: Tensor) -> Tensor:
    """Per-edge weights ``[K, E]`` (or ``[K, T, E]``) as dense ``[K, S, R]`` (``[K, S, R, T]``) matrices."""
    K, S, R = flat.shape[0], len(graph.senders), len(graph.receivers)
    if flat.ndim == 2:
        W = flat.new_zeros(K, S, R)
        W[:, graph.src, graph.dst] = flat
        return W
    T = flat.shape[1]
    W = flat.new_zeros(K, S, R, T)
    W[:, graph.src, graph.dst] = flat.transpose(1, 2)  # [K, E, T]
    return W


def copy_bytes(source: WeightSource, graph: Graph, B: int, T: int) -> int:
    """Memory one copy of a masked pass takes: every sender's change, the pass's activations, its head
    outputs and the queries, keys and values of heads computed apart (a layer's computed inputs are
    made one copy at a time: :func:`gather_bytes`)."""
    c = source.cfg
    n = len(graph.senders) + c.n_heads + 16
    per_token = c.d_model * n + 3 * c.d_head * (c.n_heads + 2 * c.kv_heads) + 4 * c.n_heads * T
    return B * T * per_token * torch.empty(0, dtype=source.dtype).element_size()


def gather_bytes(source: WeightSource, graph: Graph, B: int, T: int) -> int:
    """The most one copy's gathered senders and computed inputs take at once (half the senders, and a
    layer's head inputs)."""
    c = source.cfg
    n = len(graph.senders) // 2 + c.n_heads + 2 * c.kv_heads
    return n * B * T * c.d_model * torch.empty(0, dtype=source.dtype).element_size()


class Evaluator:
    """A task's prompts made ready to run circuits on, batch by batch (each batch's two runs and
    replacement values computed once): :meth:`metrics` runs any number of circuits. ``variant``: one of
    :data:`VARIANTS`; ``clean`` and ``corrupted``: the metric on the clean and corrupted runs (prompt means)."""

    def __init__(
        self,
        source: WeightSource,
        graph: Graph,
        task: Task,
        ablation: Ablation,
        *,
        variant: str = "ablate-complement",
        batch: int = 32,
        max_bytes: int = 1 << 30,
    ) -> None:
        if variant not in VARIANTS:
            raise QkovError(f"{WHERE}: the variant is one of {', '.join(VARIANTS)}, got {variant!r}")
        if variant == "patch-in" and ablation.kind != "corrupted":
            raise QkovError(
                f"{WHERE}: patch-in restores the circuit on the corrupted run; it needs the corrupted ablation"
            )
        self.source, self.graph, self.task, self.ablation, self.variant = source, graph, task, ablation, variant
        tune_allocator_for(source)
        self.max_bytes = max_bytes
        self.parts: list[tuple[float, Prepared]] = []
        self.clean = self.corrupted = 0.0
        for b in task.batches(batch):
            weight = len(b.rows) / len(task)
            direction = "denoise" if variant == "patch-in" else "noise"
            c = Contrast.of(
                source, b.clean, b.corrupted, metric=ready_metric(source, b), direction=direction, where=WHERE
            )
            self.parts.append((weight, prepare(c, graph, ablation)))
            self.clean += weight * c.clean_value
            self.corrupted += weight * c.corrupted_value

    def metrics(self, circuits: Tensor, progress: Progress | None = None) -> Tensor:
        """``[K]`` the metric (prompt mean) with each circuit of ``circuits`` (``[K, E]`` booleans, or
        ``[K, T, E]`` per position) run as the variant says."""
        if circuits.ndim == 3:
            self.task.single_length("a per-position circuit")
        unique, back = circuits.flatten(1).unique(dim=0, return_inverse=True)  # a circuit asked twice runs once
        if len(unique) < len(circuits):
            return self.metrics(unique.view(-1, *circuits.shape[1:]), progress)[back]
        keep = circuits.to(torch.float64)
        flat = keep if self.variant != "ablate-complement" else 1.0 - keep
        total = torch.zeros(circuits.shape[0], dtype=torch.float64)
        L = self.graph.cfg.n_layers
        firsts = first_layers(self.graph, flat)  # the first layer each circuit changes (L: none)
        if self.ablation.kind == "corrupted":  # every edge from the source run: the source run itself
            firsts[(flat == 1).flatten(1).all(1)] = L + 1
        done, work = 0, len(self.parts) * circuits.shape[0]
        for weight, p in self.parts:
            B, T = p.contrast.base.shape
            room = self.max_bytes - gather_bytes(self.source, self.graph, B, T)
            K_max = max(1, room // copy_bytes(self.source, self.graph, B, T))
            total[firsts == L] += weight * p.contrast.base_value  # nothing changed: the base run
            source = p.contrast.swap(p.contrast.clean_value, p.contrast.corrupted_value)[1]
            total[firsts == L + 1] += weight * source
            order = sorted((i for i in range(len(firsts)) if firsts[i] < L), key=lambda i: (int(firsts[i]), i))
            for lo in range(0, len(order), K_max):
                pick = torch.tensor(order[lo : lo + K_max])
                W = edge_weights(self.graph, flat[pick])
                total[pick] += weight * MaskedPass(p, self.graph, W, int(firsts[pick[0]])).run().double().cpu()
                done += len(pick)
                tick(progress, WHERE, done, work)
        return total

    @property
    def full(self) -> float:
        """The metric with every edge as in the clean run (``patch-in``: every edge patched in): the clean recording."""
        return self.clean

    def nothing_kept(self) -> float:
        """The metric with every edge ablated (``m(empty)``): the corrupted run under the ``corrupted``
        ablation (and for patch-in), else one more pass."""
        E = self.graph.n_edges
        if self.variant == "patch-in":
            return self.corrupted
        none = (
            torch.zeros(1, E, dtype=torch.bool)
            if self.variant == "ablate-complement"
            else torch.ones(1, E, dtype=torch.bool)
        )
        return float(self.metrics(none)[0])


def circuit_metrics(
    source: WeightSource,
    graph: Graph,
    task: Task,
    circuits: Tensor,
    ablation: Ablation,
    *,
    variant: str = "ablate-complement",
    batch: int = 32,
    max_bytes: int = 1 << 30,
    progress: Progress | None = None,
) -> tuple[Tensor, float, float]:
    """The task's metric with each circuit of ``circuits`` (``[K, E]`` booleans, or ``[K, T, E]`` per
    position) run as ``variant`` says (:data:`VARIANTS`), averaged over the prompts: ``(values [K],
    m(clean), m(corrupted run))``."""
    ev = Evaluator(source, graph, task, ablation, variant=variant, batch=batch, max_bytes=max_bytes)
    return ev.metrics(circuits, progress), ev.clean, ev.corrupted


def prepare(c: Contrast, graph: Graph, ablation: Ablation) -> Prepared:
    """Record the contrast's two runs and keep what masked passes on it read (:class:`~.masked.Prepared`):
    the senders of the base run and their replacements, the base run's layer inputs, and what a receiver
    with every edge ablated reads, from the first position a pass can change on (:func:`shared_prefix`;
    the base run's keys and values before it). The recordings themselves are let go."""
    f = shared_prefix(c, ablation)
    c.record([*sender_sites(graph), *stream_sites(graph)], base_only=["k.*", "v.*"] if f else [])
    base, src = c.base_recording, c.source_recording
    assert base is not None
    w = c.weights
    before = run_senders(base, graph)
    rep = replacement_of(ablation, src if ablation.kind == "corrupted" else None, w, graph)
    streams = ablated_streams(base, before, rep, w, graph)
    heads = ablated_heads(w, graph, streams)
    resid = torch.stack([base["resid_pre", l] for l in range(graph.cfg.n_layers)])
    past = (base.stack("k")[:, :, :f].contiguous(), base.stack("v")[:, :, :f].contiguous()) if f else None
    c.base_recording = c.source_recording = None  # what a masked pass reads of them is kept
    cut = lambda x: x[:, f:].contiguous()  # noqa: E731
    return Prepared(
        c, from_position(rep, f), from_position(before, f), resid[:, :, f:].contiguous(),
        {n: cut(x) for n, x in streams.items()}, {n: cut(x) for n, x in heads.items()}, f, past,
    )  # fmt: skip
