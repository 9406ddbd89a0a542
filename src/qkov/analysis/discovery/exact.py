"""Exact edge patching: each edge ablated alone on the clean prompts, measured; the reference that
attribution approximates.

Ablating ``s -> r`` changes receiver ``r``'s input alone, ``x_r -> x_r + (a~_s - a_s)``, and the pass runs
on from ``r``: its score is ``m(edge ablated) - m(clean)`` (Hanna et al. 2024's ``get_scores_exact``).
Nothing before ``r``'s layer changes, so each patched pass starts there from the clean run's stream,
and one pass carries many edges into the same layer, one patched copy of the prompts each:

* into a head's query, key or value input: that head's query (key, value) is recomputed from its own
  patched input, ``normalise(x + delta_s) W + b`` (rotated; shortformer positions added); the layer's
  attention output is the base run's plus ``(z' - z) W_O`` of the heads that read it, ``z'`` their
  attention with it (:func:`skips_attention`: the rest of the attention is not run again; the last layer,
  a model with gated heads or a routed stream, and one streamed from disk write it into the copy's ``q`` /
  ``k`` / ``v`` instead, the other heads reading the stream as it is);
* into an MLP: its own input copy ``mlp_input`` gets ``delta_s``;
* into the logits: the final stream gets ``delta_s``, and only the unembedding runs.

Per-position edges (``s -> r`` at position ``t``) patch ``delta_s`` at ``t`` only.

Under the ``corrupted`` ablation no patch changes the positions before the first where a clean and its
corrupted prompt differ (:func:`~.ablations.shared_prefix`): the passes run the positions from there on,
after the clean run's keys and values. The last layer runs its queries, output and MLP at the metric's
positions only (its edits take those positions: :func:`~qkov.analysis.forward.edits.at_rows`). A metric that
reads a few logits (a logit difference) has them unembedded alone
(:meth:`~qkov.analysis.causal.metrics.Metric.narrowed`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from ...model.block import BlockPass
from ...progress import Progress, tick
from ...weights.parts import WeightSource
from ..causal.contrast import Contrast
from ..forward.address import HEAD, MLP, Address
from ..forward.cache import final_stream
from ..forward.edits import at_rows
from .ablations import Ablation, sender_sites, shared_prefix
from .graph import Graph
from .head_inputs import HeadProjector, project_heads_of
from .senders import change_of, from_position, replacement_of, run_senders
from .task import AnswerMetric, TaskBatch

__all__ = ["exact_batch"]

WHERE = "exact edge patching"


def exact_batch(
    source: WeightSource,
    graph: Graph,
    b: TaskBatch,
    metric: AnswerMetric,
    ablation: Ablation,
    scores: Tensor,
    *,
    weight: float,
    edges: Tensor,
    max_bytes: int,
    progress: Progress | None = None,
) -> tuple[float, float]:
    """Add ``weight * (m(edge ablated) - m(clean))`` of one batch to ``scores [E]`` (``[T, E]`` per
    position) for every edge in ``edges`` (edge numbers); returns the batch's clean and corrupted metric."""
    L = graph.cfg.n_layers
    c = Contrast.of(source, b.clean, b.corrupted, metric=metric, direction="noise", where=WHERE)
    f = shared_prefix(c, ablation)  # no patch changes the positions before f: the passes run from f on
    T = b.clean.shape[1]
    units = [(int(e), t) for e in edges.tolist() for t in (range(f, T) if scores.ndim == 2 else [None])]
    layer_of = [_layer(graph, int(graph.dst[e])) for e, _ in units]
    kv = ["k.*", "v.*"] if f else []
    attn = [f"attn_out.{l}" for l in sorted(set(layer_of)) if skips_attention(c, l)]  # those passes read the base's
    c.record(sender_sites(graph), base_only=[f"resid_pre.{l}" for l in range(L)] + [f"resid_post.{L - 1}", *kv, *attn])
    base = c.base_recording
    assert base is not None
    before = from_position(run_senders(base, graph), f)  # each sender's change formed when a pass needs it
    rep = from_position(replacement_of(ablation, c.source_recording, source, graph), f)
    change = lambda s: change_of(source, graph, s, before, rep)  # noqa: E731
    past = (base.stack("k")[:, :, :f].contiguous(), base.stack("v")[:, :, :f].contiguous()) if f else None
    K_max = c.copies(max_bytes, extra=graph.cfg.d_model * T * b.clean.shape[0] * 4)
    done = 0
    for l in sorted(set(layer_of)):
        mine = [u for u, ul in zip(units, layer_of) if ul == l]
        for lo in range(0, len(mine), K_max):
            chunk = mine[lo : lo + K_max]
            got = _measure(c, graph, change, chunk, l, past) - c.clean_value
            for (e, t), v in zip(chunk, got.tolist()):
                if t is None:
                    scores[e] += weight * v
                else:
                    scores[t, e] += weight * v
            done += len(chunk)
            tick(progress, WHERE, done, len(units))
    return c.clean_value, c.corrupted_value


def _layer(graph: Graph, r: int) -> int:
    """The layer a patched pass into receiver ``r`` starts at (``n_layers`` for the logits)."""
    a = graph.receivers[r]
    return graph.cfg.n_layers if a.kind == "logits" else a.layer  # type: ignore[return-value]


def _change(graph: Graph, change: Callable[[int], Tensor], chunk: list[tuple[int, int | None]], f: int) -> Tensor:
    """``[K, B, T - f, D]``: each unit's sender change (at its position only, per position) from position ``f`` on."""
    d = torch.stack([change(int(graph.src[e])) for e, _ in chunk])
    for k, (_, t) in enumerate(chunk):
        if t is not None:
            keep = torch.zeros(d.shape[2], 1, dtype=d.dtype, device=d.device)
            keep[t - f] = 1
            d[k] *= keep
    return d


def _measure(
    c: Contrast, graph: Graph, change: Callable[[int], Tensor], chunk: list[tuple[int, int | None]], l: int,
    past: tuple[Tensor, Tensor] | None,
) -> Tensor:  # fmt: skip
    """The metric of each unit of ``chunk`` (all into receivers of layer ``l``) in one pass over the positions
    from ``f`` on (``past``: the base run's keys and values before them; ``None``: ``f`` = 0); the last
    layer at the metric's positions."""
    K, L, f = len(chunk), graph.cfg.n_layers, 0 if past is None else past[0].shape[2]
    d = _change(graph, change, chunk, f)
    base = c.base_recording
    assert base is not None
    B, T = c.base.shape
    rows = None if c.positions is None else c.positions.to(d.device) - f
    if l == L:  # into the logits: the final stream plus the change, then the unembedding
        stream = (final_stream(base)[:, f:][None] + d).reshape(K * B, *d.shape[2:])
        return c.measure(K, start=L, stream=stream, since=f, past=past)
    x = base["resid_pre", l][:, f:]
    receivers = [graph.receivers[int(graph.dst[e])] for e, _ in chunk]
    edits: dict[Any, Any] = {}
    made: list[tuple[list[int], list[int], str, Tensor]] = []
    for kind in "qkv":
        ks = [k for k, r in enumerate(receivers) if r.kind == HEAD and r.input == kind]
        if ks:
            slots = [r.input_site(graph.cfg).head for r in (receivers[k] for k in ks)]
            new = project_heads_of(c.weights, l, kind, slots, x[None] + d[ks], positions=torch.arange(f, T))
            made.append((ks, slots, kind, new))
    if skips_attention(c, l):  # the layer's attention: the base run's, plus the patched heads' change
        edits[f"attn_out.{l}"] = _attention_out(c, l, x, made, K, past).view(K * B, T - f, -1)
    else:
        for ks, slots, kind, new in made:
            edits[f"{kind}.{l}"] = _write(K, B, ks, slots, new, rows)
    ms = [k for k, r in enumerate(receivers) if r.kind == MLP]
    if ms:
        edits[f"mlp_input.{l}"] = _add(K, B, ms, d[ms], rows)
    start = min(l, c.reads_from)
    stream = base["resid_pre", start][:, f:].repeat(K, 1, 1) if f else None
    return c.measure(K, edits, start=start, stream=stream, since=f, past=past)


def skips_attention(c: Contrast, l: int) -> bool:
    """Whether a pass into receivers of layer ``l`` takes that layer's attention output from the base run
    (recorded as ``attn_out``) plus the change of the heads a patch reaches, instead of running the attention
    again on every copy: a layer before the last (which runs at the metric's positions) of a model whose heads
    are plain attention (one residual stream, no gate), for a metric that reads no site (one inside that
    attention would be left as the base run's), held in memory (a streamed model would read the layer's attention
    weights from disk four times a pass instead of once: about what the skip saves)."""
    cfg = c.weights.cfg
    plain = cfg.residual == "sum" and cfg.gate == "none" and not c.metric.reads
    return l < cfg.n_layers - 1 and plain and c.weights.in_memory


def _attention_out(
    c: Contrast, l: int, x: Tensor, made: list[tuple[list[int], list[int], str, Tensor]], K: int,
    past: tuple[Tensor, Tensor] | None,
) -> Tensor:  # fmt: skip
    """``[K, B, P, D]``: layer ``l``'s attention output in each copy, for the base stream ``x [B, P, D]`` (positions
    ``f ..``, after ``past``'s): the base run's, plus ``(z' - z) W_O`` of the query heads that read a patched head
    input, ``z'`` their attention with the patched queries, keys or values (``made``: per kind the copies, their
    slots and the patched ``[n, B, P, E]``), the other two as in the base run and ``z`` with all three as there
    (one kernel call for both, so the two differ by the patch and the projections' rounding alone)."""
    cfg, base = c.weights.cfg, c.base_recording
    assert base is not None
    B, P, _ = x.shape
    f = 0 if past is None else past[0].shape[2]
    at, group = torch.arange(f, f + P, device=x.device), cfg.n_heads // cfg.kv_heads
    out = base["attn_out", l][:, f:].repeat(K, 1, 1).view(K, B, P, -1)
    if not made:
        return out
    heads_of = lambda kind, slot: [slot] if kind == "q" else list(range(slot * group, (slot + 1) * group))  # noqa: E731
    # key (i = 0) or value (1) head g at every position: [B, f + P, E], the past's before the pass's own
    whole = lambda i, g, now: now if past is None else torch.cat([past[i][l][:, :, g], now], 1)  # noqa: E731
    qs = sorted({h for _, slots, kind, _ in made for s in slots for h in heads_of(kind, s)})
    kvs = sorted({h // group for h in qs})
    q0 = dict(zip(qs, HeadProjector(c.weights, l, "q", qs)(x, at, shared=True)))  # each [B, P, E]
    kv0 = {kind: dict(zip(kvs, HeadProjector(c.weights, l, kind, kvs)(x, at, shared=True))) for kind in "kv"}
    base_kv = {g: [whole(i, g, kv0[s][g]) for i, s in enumerate("kv")] for g in kvs}  # after the past, once each
    W_O = c.weights.attention(l, expand_kv=False).W_O  # [H, E, D]
    for ks, slots, kind, new in made:
        for k, slot, patched in zip(ks, slots, new):
            hs = heads_of(kind, slot)
            g = hs[0] // group
            q = torch.stack([patched if kind == "q" else q0[h] for h in hs], 1)  # [B, n, P, E]
            key, val = (whole(i, g, patched) if kind == s else base_kv[g][i] for i, s in enumerate("kv"))
            n_heads = lambda t: t[:, :, None].expand(-1, -1, len(hs), -1, -1).flatten(0, 1)  # noqa: E731
            both = BlockPass.offset_attention(
                torch.stack([q, torch.stack([q0[h] for h in hs], 1)]).flatten(0, 1),
                n_heads(torch.stack([key, base_kv[g][0]])), n_heads(torch.stack([val, base_kv[g][1]])), at,
            ).unflatten(0, (2, B))  # [2, B, n, P, E]: patched, base
            out[k] += torch.einsum("bnpe,ned->bpd", both[0] - both[1], W_O[hs])
    return out


def _write(K: int, B: int, ks: list[int], slots: list[int], new: Tensor, rows: Tensor | None):  # type: ignore[no-untyped-def]
    """An edit of a ``q``/``k``/``v`` site ``[K*B, T, n, E]``: copy ``ks[i]``'s head ``slots[i]`` becomes
    ``new[i]`` (``[n, B, T, E]``; at ``rows`` only when the site holds the last layer's positions)."""
    kt, st = torch.tensor(ks), torch.tensor(slots)

    def write(value: Tensor, site: Address) -> Tensor:
        got = new if value.shape[1] == new.shape[2] else new.index_select(2, rows)  # type: ignore[arg-type]
        out = value.clone(memory_format=torch.contiguous_format)
        out.view(K, B, *value.shape[1:])[kt, :, :, st] = got.to(value)
        return out

    return at_rows(write)


def _add(K: int, B: int, ks: list[int], d: Tensor, rows: Tensor | None):  # type: ignore[no-untyped-def]
    """An edit of ``mlp_input`` ``[K*B, T, D]``: copy ``ks[i]`` gets ``d[i]`` added (at ``rows`` only when the
    site holds the last layer's positions)."""
    kt = torch.tensor(ks)

    def add(value: Tensor, site: Address) -> Tensor:
        got = d if value.shape[1] == d.shape[2] else d.index_select(2, rows)  # type: ignore[arg-type]
        out = value.clone()
        out.view(K, B, *value.shape[1:])[kt] += got.to(value)
        return out

    return at_rows(add)
