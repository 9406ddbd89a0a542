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

from ...device import tune_cpu_allocator
from ...errors import QkovError
from ...progress import Progress, tick
from ...weights.parts import WeightSource
from ..causal.contrast import Contrast
from ..forward.address import Address
from ..forward.tracer import trace
from .ablations import Ablation, ablated_inputs, sender_sites, sender_values, stream_sites
from .graph import Graph
from .head_inputs import project_heads_of
from .task import AnswerMetric, Task, TaskBatch

__all__ = [
    "circuit_metrics", "copy_bytes", "edge_weights", "Evaluator", "fully_ablated", "gather_bytes", "masked_pass",
    "ready_metric", "VARIANTS",
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


def fully_ablated(
    contrast: Contrast, graph: Graph, replacement: Tensor
) -> tuple[dict[str, Tensor], dict[tuple[int, str], Tensor]]:
    """What a receiver with every edge into it ablated reads, whatever the circuit, computed once from
    the base run (which cached the senders and the streams): each receiver group's input ``x_base + sum_{s
    -> r} (replacement_s - a_s(base))`` (``{"attn.l", "mlp.l", "logits"}: [B, T, D]``; it is ``sum_s
    replacement_s`` plus the biases no edge carries, the same in every pass) and every head's query, key
    and value from it (``{(layer, kind): [B, T, n, E]}``)."""
    w, recording = contrast.weights, contrast.base_recording
    rep = replacement.to(device=w.device, dtype=w.dtype)
    streams = ablated_inputs(recording, graph, rep - sender_values(recording, w, graph))  # type: ignore[arg-type]
    heads: dict[tuple[int, str], Tensor] = {}
    for l in range(graph.cfg.n_layers):
        for kind in "qkv":
            n = graph.cfg.n_heads if kind == "q" else graph.cfg.kv_heads
            heads[l, kind] = project_heads_of(w, l, kind, range(n), streams[f"attn.{l}"]).permute(1, 2, 0, 3)
    return streams, heads


class _MaskedPass:
    """One masked pass (see :func:`masked_pass`): the edits, and what they read as the pass runs.

    A receiver ``r`` of copy ``k`` reads ``x_r + sum_s W[s, r] (rep_s - a_s)``, which is also
    ``x_r(all ablated) + sum_s (W[s, r] - 1) (rep_s - a_s)`` (the first term the same in every pass):
    each receiver takes whichever form has fewer senders with a non-zero coefficient, so a receiver
    with almost every edge kept or almost every edge ablated costs little, and one with no coefficient
    left is the stream as it is or its precomputed fully ablated input. The senders some receiver reads
    write ``rep_s - a_s`` into one buffer as the pass makes them (``[K, N, B, T, D]``, in sender order);
    a layer's query, key and value inputs are then one matrix product per copy over it."""

    def __init__(self, contrast: Contrast, graph: Graph, replacement: Tensor, W: Tensor, ablated: tuple) -> None:
        w = contrast.weights
        self.c, self.g = contrast, graph
        self.streams, self.ablated = ablated
        self.K, (self.B, self.T) = W.shape[0], contrast.base.shape
        self.W = W.to(device=w.device, dtype=w.dtype)
        self.rep = replacement.to(device=w.device, dtype=w.dtype)
        self.pos = W.ndim == 4
        S, R, dev = len(graph.senders), len(graph.receivers), self.W.device
        self.fan = torch.tensor([graph.before(r) for r in range(R)], device=dev)  # senders into each receiver
        nz, no = self.W != 0, self.W != 1
        if self.pos:  # a sender counts when its coefficient is non-zero at any position
            nz, no = nz.any(-1), no.any(-1)
        no &= torch.arange(S, device=dev)[:, None] < self.fan  # [S, R]: only real edges
        self.ii = no.sum(1) < nz.sum(1)  # [K, R]: read from the fully ablated input
        self.active = torch.where(self.ii[:, None], no, nz)  # [K, S, R]: the senders each receiver reads
        self.some = self.active.any(1)  # [K, R]: computed from the senders' changes
        self.full = self.ii & ~self.some  # [K, R]: the fully ablated input
        needed = self.active.any(2).any(0)  # [S]
        self.order = needed.nonzero()[:, 0]  # the senders in the buffer, in sender order
        self.slot = torch.cumsum(needed, 0) - 1  # [S]: each needed sender's row
        self.diff = torch.empty(
            self.K, len(self.order), self.B, self.T, graph.cfg.d_model, dtype=w.dtype, device=w.device
        )
        self.cur: dict[int, Tensor] = {}
        self.done: dict[int, dict[str, list]] = {}

    def needed(self, lo: int, n: int) -> list[int]:
        """Which of senders ``lo .. lo+n`` some receiver reads (offsets from ``lo``)."""
        return [int(s) - lo for s in self.order.tolist() if lo <= s < lo + n]

    # ------------------------------------------------------------------ what receivers read
    def inputs(self, k: int, rs: Tensor, base: dict[bool, Tensor]) -> tuple[Tensor, Tensor]:
        """The inputs of copy ``k``'s receivers ``rs`` (all with the same senders, each computed: ``some``),
        each from its base (``base[False]`` the stream as it is, ``base[True]`` the fully ablated input):
        ``(receivers [r], inputs [r, B, T, D])``, the receivers reordered (those from the stream first)."""
        n = int(self.fan[rs[0]])
        rows = int(self.slot[n - 1]) + 1 if n else 0  # the buffer's rows of senders before the receivers
        senders = self.order[:rows]
        use = self.active[k][senders][:, rs].any(1)  # [rows]
        if 2 * int(use.sum()) < rows:  # few senders: gather them
            pick = use.nonzero()[:, 0]
            D, senders = self.diff[k, pick], senders[pick]
        else:
            D = self.diff[k, :rows]
        ii = self.ii[k, rs]
        rs = torch.cat([rs[~ii], rs[ii]])
        ii = self.ii[k, rs]
        C = self.W[k][senders][:, rs]
        C = torch.where(ii[:, None] if self.pos else ii, C - 1, C)
        out = D.new_empty(len(rs), *D.shape[1:])
        flat, lo = D.reshape(len(senders), -1), 0
        for mode in (False, True):
            hi = lo + int((ii == mode).sum())
            if hi > lo:
                if self.pos:
                    out[lo:hi] = torch.einsum("ubtd,urt->rbtd", D, C[:, lo:hi]) + base[mode]
                else:
                    torch.addmm(base[mode].reshape(1, -1), C[:, lo:hi].T, flat, out=out[lo:hi].view(hi - lo, -1))
            lo = hi
        return rs, out

    def layer_heads(self, l: int) -> dict[str, list]:
        """Per kind, ``(k, heads [n], new [n, B, T, E])`` for every copy: the heads of layer ``l`` whose
        input is not the stream as it is. Computed at the layer's first edited kind, kept for the others."""
        if l in self.done:
            return self.done[l]
        cfg, r0 = self.g.cfg, self.g.attention_receivers(l).start
        H, kv = cfg.n_heads, cfg.kv_heads
        kinds = (("q", 0, H), ("k", H, kv), ("v", H + kv, kv))
        out: dict[str, list] = {kind: [] for kind, _, _ in kinds}
        R = H + 2 * kv
        for k in range(self.K):
            some = self.some[k, r0 : r0 + R].nonzero()[:, 0]
            full = self.full[k, r0 : r0 + R]
            x = None
            if len(some):
                base = {False: self.cur[l].view(self.K, self.B, self.T, -1)[k], True: self.streams[f"attn.{l}"]}
                some, x = self.inputs(k, some + r0, base)
                some = some - r0
            for kind, off, n in kinds:
                f = full[off : off + n].nonzero()[:, 0]
                if len(f):
                    out[kind].append((k, f, self.ablated[l, kind][:, :, f].permute(2, 0, 1, 3)))
                mine = ((some >= off) & (some < off + n)).nonzero()[:, 0]
                if len(mine):
                    slots = some[mine] - off
                    new = project_heads_of(self.c.weights, l, kind, slots.tolist(), x[mine], fused=True)  # type: ignore[index]
                    out[kind].append((k, slots, new))
        self.done = {l: out}
        return out

    # ------------------------------------------------------------------ the edits
    def observe(self, lo: int, n: int):  # type: ignore[no-untyped-def]
        """Senders ``lo .. lo+n`` (the input, a layer's heads or an MLP): write the change of those some
        receiver reads into the buffer; keep the streams (``resid_pre``) the receivers start from."""
        mine = self.needed(lo, n)
        rows = self.slot[[lo + i for i in mine]].tolist()
        idx = torch.tensor(mine, device=self.W.device)

        def fn(value: Tensor, site: Address) -> Tensor:
            if site.kind == "resid_pre":
                self.cur[site.layer] = value  # type: ignore[index]
                if site.layer != 0:
                    return value
            if mine:
                v = value.view(self.K, self.B, self.T, n, -1)[:, :, :, idx].permute(0, 3, 1, 2, 4)
                torch.sub(self.rep[lo + idx].unsqueeze(0), v, out=self.diff[:, rows[0] : rows[-1] + 1])
            return value

        return fn

    def head_kind(self, l: int, kind: str, start: int, n: int):  # type: ignore[no-untyped-def]
        """The edit of ``kind.l`` (``[K*B, T, n, E]``): heads with every edge in ablated read their fully
        ablated value, heads with some computed from their own input, the rest untouched."""
        if not bool((self.some | self.full)[:, start : start + n].any()):
            return None

        def fn(value: Tensor, site: Address) -> Tensor:
            out = value.clone(memory_format=torch.contiguous_format)
            view = out.view(self.K, self.B, self.T, n, -1)
            for k, heads, new in self.layer_heads(l)[kind]:
                view[k][:, :, heads] = new.permute(1, 2, 0, 3).to(view)
            return out

        return fn

    def stream(self, r: int, name: str):  # type: ignore[no-untyped-def]
        """The edit of an MLP's input copy or of the final stream (receiver ``r``, its fully ablated input
        ``streams[name]``), or ``None``."""
        if not bool((self.some | self.full)[:, r].any()):
            return None
        rs = torch.tensor([r], device=self.W.device)

        def fn(value: Tensor, site: Address) -> Tensor:
            out = value.clone()
            view = out.view(self.K, self.B, self.T, -1)
            for k in range(self.K):
                if self.full[k, r]:
                    view[k] = self.streams[name]
                elif self.some[k, r]:
                    view[k] = self.inputs(k, rs, {False: view[k], True: self.streams[name]})[1][0]
            return out

        return fn

    def edits(self) -> dict[str, Any]:
        g, cfg, H = self.g, self.g.cfg, self.g.cfg.n_heads
        edits: dict[str, Any] = {"resid_pre.0": self.observe(0, 1)}
        for l in range(cfg.n_layers):
            if l:
                edits[f"resid_pre.{l}"] = self.observe(0, 0)
            if self.needed(g.head_sender(l), H):
                edits[f"head_out.{l}"] = self.observe(g.head_sender(l), H)
            r0 = g.attention_receivers(l).start
            for kind, off, n in (("q", 0, H), ("k", H, cfg.kv_heads), ("v", H + cfg.kv_heads, cfg.kv_heads)):
                fn = self.head_kind(l, kind, r0 + off, n)
                if fn is not None:
                    edits[f"{kind}.{l}"] = fn
            if g.mlp:
                if self.needed(g.mlp_sender(l), 1):
                    edits[f"mlp_out.{l}"] = self.observe(g.mlp_sender(l), 1)
                fn = self.stream(g.mlp_receiver(l), f"mlp.{l}")
                if fn is not None:
                    edits[f"mlp_input.{l}"] = fn
        fn = self.stream(g.logits_receiver, "logits")
        if fn is not None:
            edits[f"resid_post.{cfg.n_layers - 1}"] = fn
        return edits


def masked_pass(
    contrast: Contrast, graph: Graph, replacement: Tensor, W: Tensor, ablated: tuple | None = None
) -> Tensor:
    """The metric ``[K]`` of ``K`` copies of the contrast's base prompts, in copy ``k`` every edge ``e``
    carrying ``W[k, e]`` of the way from its sender's current output to ``replacement`` (``[S, B, T, D]``,
    or broadcasting to it): ``x_r -> x_r + sum_s W[k, s, r] (replacement_s - a_s(current))``. ``W`` is
    dense (:func:`edge_weights`). ``ablated``: :func:`fully_ablated` of the contrast (computed when not
    given; its base recording must then still be there)."""
    if ablated is None:
        ablated = fully_ablated(contrast, graph, replacement)
    return contrast.measure(W.shape[0], _MaskedPass(contrast, graph, replacement, W, ablated).edits())


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
        tune_cpu_allocator()  # each pass's buffers reused, not faulted in afresh
        self.max_bytes = max_bytes
        self.parts: list[tuple[float, Contrast, Tensor, dict]] = []
        self.clean = self.corrupted = 0.0
        for b in task.batches(batch):
            weight = len(b.rows) / len(task)
            direction = "denoise" if variant == "patch-in" else "noise"
            c = Contrast.of(
                source, b.clean, b.corrupted, metric=ready_metric(source, b), direction=direction, where=WHERE
            )
            c.record([*sender_sites(graph), *stream_sites(graph)])
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
            room = self.max_bytes - gather_bytes(self.source, self.graph, B, T)
            K_max = max(1, room // copy_bytes(self.source, self.graph, B, T))
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
