"""Exact edge patching: each edge ablated alone on the clean prompts, measured; the reference that
attribution approximates.

Ablating ``s -> r`` changes receiver ``r``'s input alone, ``x_r -> x_r + (a~_s - a_s)``, and the pass runs
on from ``r``: its score is ``m(edge ablated) - m(clean)`` (Hanna et al. 2024's ``get_scores_exact``).
Nothing before ``r``'s layer changes, so each patched pass starts there from the clean run's stream,
and one pass carries many edges into the same layer, one patched copy of the prompts each:

* into a head's query, key or value input: that head's query (key, value) is recomputed from its own
  patched input, ``normalise(x + delta_s) W + b`` (rotated; shortformer positions added), and written
  into the copy's ``q`` / ``k`` / ``v`` (the other heads read the stream as it is);
* into an MLP: its own input copy ``mlp_input`` gets ``delta_s``;
* into the logits: the final stream gets ``delta_s``, and only the unembedding runs.

Per-position edges (``s -> r`` at position ``t``) patch ``delta_s`` at ``t`` only.

Under the ``corrupted`` ablation no patch changes the positions before the first where a clean and its
corrupted prompt differ (:func:`~.ablations.shared_prefix`): the passes run the positions from there on,
after the clean run's keys and values. The last layer runs its queries, output and MLP at the metric's
positions only (its edits take those positions: :func:`~qkov.analysis.forward.edits.at_rows`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from ...progress import Progress, tick
from ...weights.parts import WeightSource
from ..causal.contrast import Contrast
from ..forward.address import HEAD, MLP, Address
from ..forward.cache import final_stream
from ..forward.edits import at_rows
from .ablations import Ablation, sender_sites, shared_prefix
from .graph import Graph
from .head_inputs import project_heads_of
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
    kv = ["k.*", "v.*"] if f else []
    c.record(sender_sites(graph), base_only=[f"resid_pre.{l}" for l in range(L)] + [f"resid_post.{L - 1}", *kv])
    base = c.base_recording
    assert base is not None
    before = from_position(run_senders(base, graph), f)  # each sender's change formed when a pass needs it
    rep = from_position(replacement_of(ablation, c.source_recording, source, graph), f)
    change = lambda s: change_of(source, graph, s, before, rep)  # noqa: E731
    past = (base.stack("k")[:, :, :f].contiguous(), base.stack("v")[:, :, :f].contiguous()) if f else None
    T = b.clean.shape[1]
    units = [(int(e), t) for e in edges.tolist() for t in (range(f, T) if scores.ndim == 2 else [None])]
    layer_of = [_layer(graph, int(graph.dst[e])) for e, _ in units]
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
    for kind in "qkv":
        ks = [k for k, r in enumerate(receivers) if r.kind == HEAD and r.input == kind]
        if ks:
            slots = [r.input_site(graph.cfg).head for r in (receivers[k] for k in ks)]
            new = project_heads_of(c.weights, l, kind, slots, x[None] + d[ks], positions=torch.arange(f, T))
            edits[f"{kind}.{l}"] = _write(K, B, ks, slots, new, rows)
    ms = [k for k, r in enumerate(receivers) if r.kind == MLP]
    if ms:
        edits[f"mlp_input.{l}"] = _add(K, B, ms, d[ms], rows)
    start = min(l, c.reads_from)
    stream = base["resid_pre", start][:, f:].repeat(K, 1, 1) if f else None
    return c.measure(K, edits, start=start, stream=stream, since=f, past=past)


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
