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

Each pass runs ``K`` circuits as ``K`` copies of a batch of prompts; the observers record every sender's
output in the pass and each receiver's edit adds its masked sum, one matrix product per receiver layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...errors import QkovError
from ...progress import Progress, tick
from ...weights.parts import WeightSource
from ..causal.contrast import Contrast
from ..forward.address import Address
from ..forward.tracer import trace
from .ablations import Ablation, sender_sites, sender_values
from .graph import Graph
from .task import AnswerMetric, Task, TaskBatch

__all__ = ["circuit_metrics", "edge_weights", "Evaluator", "masked_pass", "ready_metric", "VARIANTS"]

VARIANTS = ("ablate-complement", "ablate-circuit", "patch-in")
WHERE = "circuit evaluation"


def ready_metric(source: WeightSource, b: TaskBatch) -> AnswerMetric:
    """The batch's metric, with the clean run as its reference when it is ``kl``."""
    if b.metric.kind != "kl":
        return b.metric
    run = trace(source, b.clean, positions=b.metric.logit_positions(b.clean.shape[1]))
    return b.metric.with_reference(run)


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


def masked_pass(contrast: Contrast, graph: Graph, replacement: Tensor, W: Tensor) -> Tensor:
    """The metric ``[K]`` of ``K`` copies of the contrast's base prompts, in copy ``k`` every edge ``e``
    carrying ``W[k, e]`` of the way from its sender's current output to ``replacement`` (``[S, B, T, D]``,
    or broadcasting to it): ``x_r -> x_r + sum_s W[k, s, r] (replacement_s - a_s(current))``. ``W`` is
    dense (:func:`edge_weights`)."""
    w = contrast.weights
    K = W.shape[0]
    B, T = contrast.base.shape
    cfg, H = graph.cfg, graph.cfg.n_heads
    pos = W.ndim == 4
    diff = torch.empty(K, len(graph.senders), B, T, cfg.d_model, dtype=w.dtype, device=w.device)
    W = W.to(device=w.device, dtype=w.dtype)
    rep = replacement.to(device=w.device, dtype=w.dtype)
    added: dict[int, Tensor] = {}

    def sum_into(r0: int, r: int) -> Tensor:  # [K, B, T, r, D]: the change of receivers r0 .. r0+r
        n = graph.before(r0)
        if pos:
            return torch.einsum("ksbtd,ksrt->kbtrd", diff[:, :n], W[:, :n, r0 : r0 + r])
        return torch.einsum("ksbtd,ksr->kbtrd", diff[:, :n], W[:, :n, r0 : r0 + r])

    def observe(lo: int, n: int):  # type: ignore[no-untyped-def]
        def fn(value: Tensor, site: Address) -> Tensor:
            v = value.view(K, B, T, n, cfg.d_model)  # [K, B, T, n, D]: n senders (a layer's heads, or one)
            diff[:, lo : lo + n] = rep[lo : lo + n].unsqueeze(0) - v.permute(0, 3, 1, 2, 4)
            return value

        return fn

    def receive(l: int, kind: str):  # type: ignore[no-untyped-def]
        rs = graph.attention_receivers(l)
        off = {"q": 0, "k": H, "v": H + cfg.kv_heads}[kind]
        n = H if kind == "q" else cfg.kv_heads

        def fn(value: Tensor, site: Address) -> Tensor:
            if l not in added:
                added[l] = sum_into(rs.start, len(rs))
            v = value.view(K, B, T, n, cfg.d_model) + added[l][:, :, :, off : off + n]
            if kind == "v":
                del added[l]
            return v.view(value.shape)

        return fn

    def stream(r: int):  # type: ignore[no-untyped-def]
        def fn(value: Tensor, site: Address) -> Tensor:
            return (value.view(K, B, T, cfg.d_model) + sum_into(r, 1)[:, :, :, 0]).view(value.shape)

        return fn

    edits: dict[Any, Any] = {"resid_pre.0": observe(0, 1)}
    for l in range(cfg.n_layers):
        edits[f"head_out.{l}"] = observe(graph.head_sender(l), H)
        for kind in "qkv":
            edits[f"{kind}_input.{l}"] = receive(l, kind)
        if graph.mlp:
            edits[f"mlp_out.{l}"] = observe(graph.mlp_sender(l), 1)
            edits[f"mlp_input.{l}"] = stream(graph.mlp_receiver(l))
    edits[f"resid_post.{cfg.n_layers - 1}"] = stream(graph.logits_receiver)
    return contrast.measure(K, edits)


def copy_bytes(source: WeightSource, graph: Graph, B: int, T: int) -> int:
    """Memory one copy of a masked pass takes: every sender's change and the per-head input copies."""
    c = source.cfg
    per_token = c.d_model * (len(graph.senders) + 4 * (c.n_heads + 2 * c.kv_heads) + 16) + 4 * c.n_heads * T
    return B * T * per_token * torch.empty(0, dtype=source.dtype).element_size()


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
        self.max_bytes = max_bytes
        self.parts: list[tuple[float, Contrast, Tensor]] = []
        self.clean = self.corrupted = 0.0
        for b in task.batches(batch):
            weight = len(b.rows) / len(task)
            direction = "denoise" if variant == "patch-in" else "noise"
            c = Contrast.of(
                source, b.clean, b.corrupted, metric=ready_metric(source, b), direction=direction, where=WHERE
            )
            c.run(sender_sites(graph) if ablation.kind == "corrupted" else ())
            self.clean += weight * c.clean_value
            self.corrupted += weight * c.corrupted_value
            self.parts.append((weight, c, _replacement(c, graph, ablation)))
            c.base_run = c.source_run = None  # the replacement is all a masked pass reads of them

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
        done, work = 0, len(self.parts) * circuits.shape[0]
        for weight, c, rep in self.parts:
            B, T = c.base.shape
            K_max = max(1, self.max_bytes // copy_bytes(self.source, self.graph, B, T))
            for lo in range(0, circuits.shape[0], K_max):
                W = edge_weights(self.graph, flat[lo : lo + K_max])
                total[lo : lo + K_max] += weight * masked_pass(c, self.graph, rep, W).double().cpu()
                done += W.shape[0]
                tick(progress, WHERE, done, work)
        return total

    @property
    def full(self) -> float:
        """The metric with every edge as in the clean run (``patch-in``: every edge patched in): the clean run."""
        return self.clean

    def nothing_kept(self) -> float:
        """The metric with every edge ablated (``m(empty)``): one more pass (the corrupted run for patch-in)."""
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


def _replacement(c: Contrast, graph: Graph, ablation: Ablation) -> Tensor:
    """What an ablated edge carries, ``[S, B, T, D]`` or broadcasting to it: the source run's senders
    (the corrupted run, or the clean one for patch-in), zeros or the means."""
    if ablation.kind == "corrupted":
        return sender_values(c.source_run, c.weights, graph)  # type: ignore[arg-type]
    D = c.weights.cfg.d_model
    if ablation.kind == "zero":
        return torch.zeros(len(graph.senders), 1, 1, D, dtype=c.weights.dtype, device=c.weights.device)
    m = ablation.means.to(device=c.weights.device, dtype=c.weights.dtype)  # type: ignore[union-attr]
    return m[:, None, None] if m.ndim == 2 else m[:, None]
