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
from .head_inputs import project_heads_of
from .task import AnswerMetric, Task, TaskBatch

__all__ = [
    "circuit_metrics", "copy_bytes", "edge_weights", "Evaluator", "fully_ablated", "masked_pass", "ready_metric", "VARIANTS"
]

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


def fully_ablated(contrast: Contrast, graph: Graph, replacement: Tensor) -> dict[tuple[int, str], Tensor]:
    """``{(layer, kind): [B, T, n, E]}``: every head's query, key and value with every edge into it ablated,
    from its input ``x_base + sum_{s -> r} (replacement_s - a_s(base))`` (the base run cached the senders
    and ``resid_pre``): what a head outside the circuit reads, whatever the circuit, computed once."""
    w, recording = contrast.weights, contrast.base_recording
    rep = replacement.to(device=w.device, dtype=w.dtype)
    delta = rep - sender_values(recording, w, graph)  # type: ignore[arg-type]
    out: dict[tuple[int, str], Tensor] = {}
    for l in range(graph.cfg.n_layers):
        x = recording["resid_pre", l] + delta[: graph.before(graph.attention_receivers(l).start)].sum(0)  # type: ignore[index]
        for kind in "qkv":
            n = graph.cfg.n_heads if kind == "q" else graph.cfg.kv_heads
            out[l, kind] = project_heads_of(w, l, kind, range(n), x).permute(1, 2, 0, 3)
    return out


class _MaskedPass:
    """One masked pass (see :func:`masked_pass`): the edits, and what they record as the pass runs."""

    def __init__(self, contrast: Contrast, graph: Graph, replacement: Tensor, W: Tensor, ablated: dict) -> None:
        w = contrast.weights
        self.c, self.g, self.ablated = contrast, graph, ablated
        self.K, (self.B, self.T) = W.shape[0], contrast.base.shape
        self.W = W.to(device=w.device, dtype=w.dtype)
        self.rep = replacement.to(device=w.device, dtype=w.dtype)
        self.pos = W.ndim == 4
        self.diff = torch.empty(
            self.K, len(graph.senders), self.B, self.T, graph.cfg.d_model, dtype=w.dtype, device=w.device
        )
        self.cur: dict[int, Tensor] = {}

    def weights(self, r0: int, r: int) -> Tensor:
        """``[K, n, r]`` (``[K, n, r, T]``): the weights of receivers ``r0 .. r0+r`` over their senders."""
        return self.W[:, : self.g.before(r0), r0 : r0 + r]

    def change(self, k: int, r0: int, r: int, which: Tensor | None = None) -> Tensor:
        """``[r, B, T, D]``: copy ``k``'s change into receivers ``r0 .. r0+r`` (all with the same senders),
        or into those of them ``which`` picks."""
        n = self.g.before(r0)
        Wk = self.W[k, :n, r0 : r0 + r]
        Wk = Wk if which is None else Wk[:, which]
        return torch.einsum("sbtd,srt->rbtd" if self.pos else "sbtd,sr->rbtd", self.diff[k, :n], Wk)

    def observe(self, lo: int, n: int, layer: int | None = None):  # type: ignore[no-untyped-def]
        def fn(value: Tensor, site: Address) -> Tensor:
            if site.kind == "resid_pre":
                self.cur[site.layer] = value.view(self.K, self.B, self.T, -1)  # type: ignore[index]
                if site.layer != 0:
                    return value
            v = value.view(self.K, self.B, self.T, n, -1)  # n senders: a layer's heads, or one
            self.diff[:, lo : lo + n] = self.rep[lo : lo + n].unsqueeze(0) - v.permute(0, 3, 1, 2, 4)
            return value

        return fn

    def head_kind(self, l: int, kind: str, start: int, n: int):  # type: ignore[no-untyped-def]
        """The edit of ``kind.l`` (``[K*B, T, n, E]``): heads with every edge in ablated read their fully
        ablated value, heads with some computed from their own input, the rest untouched."""
        Wl = self.weights(start, n).flatten(3) if self.pos else self.weights(start, n)[..., None]
        one = (Wl == 1).all(1).all(-1)  # [K, n]
        some = ~one & (Wl != 0).any(1).any(-1)
        if not bool((one | some).any()):
            return None

        def fn(value: Tensor, site: Address) -> Tensor:
            out = value.clone(memory_format=torch.contiguous_format)
            view = out.view(self.K, self.B, self.T, n, -1)
            for k in range(self.K):
                full, part = one[k].nonzero()[:, 0], some[k].nonzero()[:, 0]
                if len(full):
                    view[k][:, :, full] = self.ablated[l, kind][:, :, full].to(view)
                if len(part):
                    x = self.cur[l][k][None] + self.change(k, start, n, part)
                    view[k][:, :, part] = project_heads_of(self.c.weights, l, kind, part.tolist(), x).permute(
                        1, 2, 0, 3
                    )
            return out

        return fn

    def stream(self, r: int):  # type: ignore[no-untyped-def]
        """The edit of an MLP's input copy or of the final stream (receiver ``r``), or ``None``."""
        if not bool((self.weights(r, 1) != 0).any()):
            return None

        def fn(value: Tensor, site: Address) -> Tensor:
            add = torch.stack([self.change(k, r, 1)[0] for k in range(self.K)])
            return (value.view(self.K, self.B, self.T, -1) + add).view(value.shape)

        return fn

    def edits(self) -> dict[str, Any]:
        g, cfg, H = self.g, self.g.cfg, self.g.cfg.n_heads
        edits: dict[str, Any] = {"resid_pre.0": self.observe(0, 1)}
        for l in range(cfg.n_layers):
            if l:
                edits[f"resid_pre.{l}"] = self.observe(0, 0)
            edits[f"head_out.{l}"] = self.observe(g.head_sender(l), H)
            r0 = g.attention_receivers(l).start
            for kind, off, n in (("q", 0, H), ("k", H, cfg.kv_heads), ("v", H + cfg.kv_heads, cfg.kv_heads)):
                fn = self.head_kind(l, kind, r0 + off, n)
                if fn is not None:
                    edits[f"{kind}.{l}"] = fn
            if g.mlp:
                edits[f"mlp_out.{l}"] = self.observe(g.mlp_sender(l), 1)
                fn = self.stream(g.mlp_receiver(l))
                if fn is not None:
                    edits[f"mlp_input.{l}"] = fn
        fn = self.stream(g.logits_receiver)
        if fn is not None:
            edits[f"resid_post.{cfg.n_layers - 1}"] = fn
        return edits


def masked_pass(
    contrast: Contrast, graph: Graph, replacement: Tensor, W: Tensor, ablated: dict | None = None
) -> Tensor:
    """The metric ``[K]`` of ``K`` copies of the contrast's base prompts, in copy ``k`` every edge ``e``
    carrying ``W[k, e]`` of the way from its sender's current output to ``replacement`` (``[S, B, T, D]``,
    or broadcasting to it): ``x_r -> x_r + sum_s W[k, s, r] (replacement_s - a_s(current))``. ``W`` is
    dense (:func:`edge_weights`). A head whose every edge in carries weight 1 reads ``ablated`` (its
    fully ablated query, key or value, :func:`fully_ablated`; computed when not given); a head with some
    weight its own input; a head with none the stream as it is."""
    if ablated is None:
        ablated = fully_ablated(contrast, graph, replacement)
    return contrast.measure(W.shape[0], _MaskedPass(contrast, graph, replacement, W, ablated).edits())


def copy_bytes(source: WeightSource, graph: Graph, B: int, T: int) -> int:
    """Memory one copy of a masked pass takes: every sender's change and the inputs of heads computed apart."""
    c = source.cfg
    per_token = c.d_model * (len(graph.senders) + 3 * (c.n_heads + 2 * c.kv_heads) + 16) + 4 * c.n_heads * T
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
        self.parts: list[tuple[float, Contrast, Tensor, dict]] = []
        self.clean = self.corrupted = 0.0
        for b in task.batches(batch):
            weight = len(b.rows) / len(task)
            direction = "denoise" if variant == "patch-in" else "noise"
            c = Contrast.of(
                source, b.clean, b.corrupted, metric=ready_metric(source, b), direction=direction, where=WHERE
            )
            c.record([*sender_sites(graph), "resid_pre.*"])
            self.clean += weight * c.clean_value
            self.corrupted += weight * c.corrupted_value
            rep = _replacement(c, graph, ablation)
            self.parts.append((weight, c, rep, fully_ablated(c, graph, rep)))
            c.base_recording = c.source_recording = None  # what a masked pass reads of them is kept

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
        for weight, c, rep, ablated in self.parts:
            B, T = c.base.shape
            K_max = max(1, self.max_bytes // copy_bytes(self.source, self.graph, B, T))
            for lo in range(0, circuits.shape[0], K_max):
                W = edge_weights(self.graph, flat[lo : lo + K_max])
                total[lo : lo + K_max] += weight * masked_pass(c, self.graph, rep, W, ablated).double().cpu()
                done += W.shape[0]
                tick(progress, WHERE, done, work)
        return total

    @property
    def full(self) -> float:
        """The metric with every edge as in the clean run (``patch-in``: every edge patched in): the clean recording."""
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
        return sender_values(c.source_recording, c.weights, graph)  # type: ignore[arg-type]
    D = c.weights.cfg.d_model
    if ablation.kind == "zero":
        return torch.zeros(len(graph.senders), 1, 1, D, dtype=c.weights.dtype, device=c.weights.device)
    m = ablation.means.to(device=c.weights.device, dtype=c.weights.dtype)  # type: ignore[union-attr]
    return m[:, None, None] if m.ndim == 2 else m[:, None]
