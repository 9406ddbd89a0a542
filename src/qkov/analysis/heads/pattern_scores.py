"""Head scores from attention on natural text, streamed layer by layer and batch by batch.

Each score is a mean over sequences and queries (or a ratio of such sums), so it can be
accumulated: :func:`text_scores` runs the analysis forward on ``chunk`` sequences at a time and
scores each layer's attention as the forward computes it (edits that read the ``pattern``, ``v``,
``qk_in`` and divisor sites and change nothing: :class:`LayerWatch`), never holding the
``[layers, batch, heads, T, T]`` patterns (4.8 GB for GPT-2 small on 8 sequences of 1024
tokens). The functions on whole pattern stacks below are the definitions; a test checks that
the streamed scores equal them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from ...errors import QkovError
from ...expect import token_ids
from ...model.ops import expand_kv, score_divisor
from ...weights.parts import WeightSource
from ...weights.convert import SourceLike, as_source
from ... import ranks
from ..forward.cache import Trace
from ..forward.tracer import trace
from ..forward.frozen import read
from ..forward.sites import Address, Sites
from ...progress import Progress, tick

__all__ = [
    "chunk_size",
    "LayerView",
    "LayerWatch",
    "positional_fraction",
    "previous_token_scores",
    "self_attention_scores",
    "sequence_bytes",
    "sink_scores",
    "TEXT_CHUNK_BYTES",
    "text_scores",
    "text_sites",
    "value_weighted_sink_scores",
]

TEXT_CHUNK_BYTES = 512 * 2**20  # what one chunk of sequences may take at its peak (sequence_bytes)


def previous_token_scores(patterns: Tensor) -> Tensor:
    """Mean attention ``A[i, i-1]`` over queries ``i >= 1`` (use natural text). ``[L, B, H, T, T] -> [L, H]``."""
    return patterns.diagonal(offset=-1, dim1=-2, dim2=-1).mean(dim=(1, 3))


def self_attention_scores(patterns: Tensor) -> Tensor:
    """Mean attention to the current token ``A[i, i]`` over queries ``i >= 1``."""
    return patterns.diagonal(offset=0, dim1=-2, dim2=-1)[..., 1:].mean(dim=(1, 3))


def sink_scores(patterns: Tensor) -> Tensor:
    """Mean attention to position 0 over queries ``i >= 1`` (Gu et al.: a sink head above 0.3)."""
    return patterns[..., 1:, 0].mean(dim=(1, 3))


def value_weighted_sink_scores(patterns: Tensor, value_norms: Tensor) -> Tensor:
    """Share of a head's value-weighted attention ``A[i, j] * ||v_j W_O||`` that goes to position 0.

    ``value_norms [n_layers, batch, n_heads, key]``. A sink that reads a near-zero value
    (a "do nothing" default) scores low here even when its attention to position 0 is high.
    """
    weighted = patterns[..., 1:, :] * value_norms[..., None, :]
    return weighted[..., 0].sum(dim=(1, 3)) / weighted.sum(dim=(1, 3, 4)).clamp_min(1e-30)


def _positional_layer(
    source: WeightSource, layer: int, x: Tensor, scale: Tensor | None, scores: Tensor | None = None
) -> Tensor:
    """:func:`positional_fraction` of one layer's heads, summed (not averaged) over the batch: ``[H]``.

    ``x [B, T, D]``: the layer's query/key input, ``scale [B, T, 1]`` its divisor. ``scores [B, H, T, T]``:
    the layer's attention scores as the forward made them (``q k^T / sqrt(d_head)``, any values after
    each query), which this overwrites (the pass that made them has read them); made here from ``x`` when
    not given."""
    B, T, _ = x.shape
    counts = torch.arange(1, T + 1, device=source.device, dtype=x.dtype)  # keys a query sees

    def var_k(s: Tensor) -> Tensor:  # [T, T] (overwritten) -> variance over allowed keys, queries >= 1
        # centred first: a query's scores often share a large offset (a key bias, a common direction of
        # the keys), and the one-pass mean(s^2) - mean(s)^2 then loses every digit of the variance in
        # float32 (measured: fractions 20% to 70x off on a trained 2-layer model)
        s = s.tril_()  # the keys after each query: 0 (tril_ is ~12x faster than masked_fill_ here)
        s -= s.sum(-1, keepdim=True) / counts[:, None]
        return (torch.linalg.vector_norm(s.tril_(), dim=-1).square_() / counts)[1:]

    att = source.attention(layer)
    p = read(source.pos()[:T].expand(B, T, -1), source.norm, scale)  # type: ignore[index]  # [B, T, D]
    divisor = score_divisor(att.W_Q.shape[-1]) ** 2  # var(q . k) = var(score) * divisor
    out = torch.zeros(source.cfg.n_heads, dtype=source.dtype, device=source.device)
    for b in range(B):  # a head at a time: its [T, T] passes stay in cache (all heads at once ran slower)
        pq, pk = torch.matmul(p[b], att.W_Q), torch.matmul(p[b], att.W_K)  # [H, T, E]
        if scores is None:
            q = torch.matmul(x[b], att.W_Q) + att.b_Q[:, None]
            k = torch.matmul(x[b], att.W_K) + att.b_K[:, None]
        for h in range(len(out)):
            real = var_k(q[h] @ k[h].T) if scores is None else var_k(scores[b, h]) * divisor
            out[h] += (var_k(pq[h] @ pk[h].T) / real.clamp_min(1e-30)).clamp(0, 1).mean()
    return out


def positional_fraction(source: WeightSource, r: Trace) -> Tensor:
    """How much of each head's attention score varies with position alone.

    ``Var_k(pos-pos term) / Var_k(real score)`` over allowed keys, averaged over queries
    (clipped to [0, 1]), where the pos-pos term is ``p_q W_QK p_k`` with ``p`` the positional
    part of the query/key input (``W_pos`` for shortformer and standard positions, read through
    the recording's frozen normalisation: centred and divided, or only divided in a rotated ``scale``
    view) and the real score uses the recording's actual input. ``r`` must have cached ``qk_in`` (and the
    normalisation divisors, ``attn_scale``/``qk_scale``, for a normalised model). 0 for models without
    positions. ``[n_layers, n_heads]``.
    """
    c = source.cfg
    out = torch.zeros(c.n_layers, c.n_heads, dtype=source.dtype, device=source.device)
    if source.pos() is None:
        return out
    B = r.tokens.shape[0]
    for l in range(c.n_layers):
        out[l] = _positional_layer(source, l, r["qk_in", l], r.divisor("attn_qk", l)) / B
    return out


@dataclass
class LayerView:
    """One layer's attention on a pass, as :class:`LayerWatch` hands it on: ``pattern [B, H, T, T]``,
    ``values [B, H, T, E]`` (``b_V`` included, per query head), ``qk_input [B, T, D]`` (normalised) and its
    divisor ``qk_scale [B, T, 1]`` (``None`` without normalisation), and, on a live pass of a model with
    positions, its ``scores [B, H, T, T]`` (``q k^T / sqrt(d_head)``; the callback may overwrite them: the
    pass has read them)."""

    layer: int
    pattern: Tensor
    values: Tensor | None
    qk_input: Tensor | None
    qk_scale: Tensor | None
    scores: Tensor | None = None


class LayerWatch:
    """Edits that watch each layer's attention as the forward computes it and change nothing: at
    ``pattern.l`` the callback gets that layer's :class:`LayerView` (with the ``v``, ``qk_in`` and divisor
    sites of the layer when ``full``, and on a live pass of a model with positions its scores, which the
    positional fraction reads instead of forming them again), and nothing is kept after it returns."""

    def __init__(self, source: WeightSource, callback: Callable[[LayerView], None], *, full: bool = True) -> None:
        self.callback, self.full, self.seen = callback, full, {}
        self.group = source.cfg.n_heads // source.cfg.kv_heads
        kinds = {k.name for k in Sites(source.cfg, source.norm).kinds}
        self.scale = "qk_scale" if "qk_scale" in kinds else ("attn_scale" if "attn_scale" in kinds else None)
        self.watch_scores = full and source.pos() is not None  # the positional fraction reads the real scores

    def keep(self, value: Tensor, site: Address) -> None:
        self.seen[site.kind] = value

    def pattern(self, value: Tensor, site: Address) -> None:
        seen, layer = self.seen, int(site.layer)  # type: ignore[arg-type]
        got = (seen.pop(k, None) for k in ("v", "qk_in", self.scale, "scores"))
        self.callback(self.view(layer, value, *got))

    def view(
        self,
        layer: int,
        pattern: Tensor,
        v: Tensor | None,
        qk_in: Tensor | None,
        scale: Tensor | None,
        scores: Tensor | None = None,
    ) -> LayerView:
        """The :class:`LayerView` of one layer from its sites (``v [B, T, kv_heads, E]`` as the pass writes it)."""
        values = None if v is None else expand_kv(v.transpose(1, 2), self.group, dim=1)
        return LayerView(layer, pattern, values, qk_in, scale, scores)

    def sites(self) -> list[str]:
        """What a recording must cache for :meth:`replay` (``cache=`` names): the sites :meth:`edits` watches
        but the scores (the positional fraction forms them from ``qk_in`` then: a recording keeps no second
        ``[B, H, T, T]`` per layer)."""
        return [f"{kind}.*" for kind in self.edits() if kind != "scores"]

    def replay(self, recording: Trace) -> None:
        """Hand on each layer of a recording that cached :meth:`sites`, as the pass would have."""
        for l in range(recording.source.cfg.n_layers):
            got = lambda kind: recording[kind, l] if self.full and kind is not None else None  # noqa: E731
            self.callback(self.view(l, recording["pattern", l], got("v"), got("qk_in"), got(self.scale)))

    def edits(self) -> dict[Any, Any]:
        out: dict[Any, Any] = {"pattern": self.pattern}
        if self.full:
            out |= {"v": self.keep, "qk_in": self.keep}
            if self.scale is not None:
                out[self.scale] = self.keep
            if self.watch_scores:
                out["scores"] = self.keep
        return out


def sequence_bytes(source: WeightSource, seq: int) -> int:
    """Memory one sequence of ``seq`` tokens takes at the peak of one layer's scoring, an upper bound: four
    ``[heads, seq, seq]`` (the scores, the pattern, room for the softmax's and the column sums' temporaries;
    the positional fraction adds two ``[seq, seq]``), and its ``[seq, d_vocab]`` logits at the end of the pass."""
    c = source.cfg
    return (c.n_heads * seq * (4 * seq + c.d_model) + seq * c.d_vocab) * (torch.finfo(source.dtype).bits // 8)


def chunk_size(source: WeightSource, seq: int, max_bytes: int = TEXT_CHUNK_BYTES) -> int:
    """Sequences of ``seq`` tokens scored at once: as many as :func:`sequence_bytes` fits in
    ``max_bytes`` (at least one)."""
    return max(1, max_bytes // sequence_bytes(source, seq))


class _Sums:
    """Running sums of the text scores over chunks (the :class:`LayerWatch` callback of the forward)."""

    def __init__(self, source: WeightSource) -> None:
        c = source.cfg
        self.source = source
        z = lambda: torch.zeros(c.n_layers, c.n_heads, dtype=torch.float64, device=source.device)  # noqa: E731
        self.sums = {k: z() for k in ("previous_token", "self_attention", "sink", "vw_num", "vw_den", "positional")}
        self.queries = 0  # sequences x (T - 1) queries seen
        self.sequences = 0
        self.grams: dict[int, Tensor] = {}  # per layer, made when its attention is first seen (see gram)

    def __call__(self, view: LayerView) -> None:
        l, P = view.layer, view.pattern  # [b, H, T, T]
        s = self.sums
        s["previous_token"][l] += P.diagonal(offset=-1, dim1=-2, dim2=-1).sum((0, 2)).double()
        s["self_attention"][l] += P.diagonal(dim1=-2, dim2=-1)[..., 1:].sum((0, 2)).double()
        s["sink"][l] += P[..., 1:, 0].sum((0, 2)).double()
        v = view.values.double()  # [b, H, T, E]
        norms = ((v @ self.gram(l)) * v).sum(-1).clamp_min_(0.0).sqrt_()  # [b, H, T]: ||v_j W_O||
        # sum_i>=1 sum_j A[i, j] ||v_j W_O|| = sum_j (sum_i>=1 A[i, j]) ||v_j W_O||: no [T, T] product formed
        s["vw_num"][l] += (P[..., 1:, 0].sum(-1).double() * norms[..., 0]).sum(0)
        s["vw_den"][l] += (P[..., 1:, :].sum(-2).double() * norms).sum((0, 2))
        if self.source.pos() is not None:
            got = _positional_layer(self.source, l, view.qk_input, view.qk_scale, view.scores)
            s["positional"][l] += got.double()

    def gram(self, layer: int) -> Tensor:
        """``W_O W_O^T`` ``[H, E, E]`` of the layer in float64: ``||v W_O||^2 = v (W_O W_O^T) v^T``, so the value
        norms are ``d_head``-wide products instead of ``[b, H, T, d_model]`` head outputs."""
        if layer not in self.grams:
            W_O = self.source.attention(layer).W_O.double()
            self.grams[layer] = W_O @ W_O.transpose(-1, -2)
        return self.grams[layer]

    def scores(self) -> dict[str, Tensor]:
        s, q, n = self.sums, self.queries, self.sequences
        return {
            "previous_token": s["previous_token"] / q,
            "self_attention": s["self_attention"] / q,
            "sink": s["sink"] / q,
            "sink_value_weighted": s["vw_num"] / s["vw_den"].clamp_min(1e-30),
            "positional_fraction": s["positional"] / n,
        }


def text_sites(source: WeightSource) -> list[str]:
    """The sites (``cache=`` names) a recording must keep for :func:`text_scores` to read it instead of
    running its leading sequences: every layer's ``pattern``, ``v``, ``qk_in`` and the query/key divisor."""
    return LayerWatch(as_source(source, where="qkov.text_sites"), lambda view: None).sites()


def _recorded_rows(recording: Trace, text: Tensor, need: list[str]) -> int:
    """How many leading sequences of ``text`` the recording ran (it must hold them and ``need``)."""
    n, T = recording.tokens.shape
    if T != text.shape[1] or n > text.shape[0] or not torch.equal(recording.tokens.to(text.device), text[:n]):
        raise QkovError("qkov.text_scores: the recording must be a pass over the leading sequences of the text")
    missing = [s for s in need if s.removesuffix(".*") + ".0" not in recording]
    if missing:
        raise QkovError(f"qkov.text_scores: the recording must have cached {', '.join(need)}; {missing[0]} is missing")
    return n


@torch.no_grad()
def text_scores(
    source: SourceLike,
    text: Tensor,
    *,
    chunk: int | None = None,
    progress: Progress | None = None,
    recording: Trace | None = None,
) -> dict[str, Tensor]:
    """Previous-token, self-attention, sink, value-weighted sink and positional scores of every head
    on ``text [B, T]`` (natural text), ``[n_layers, n_heads]`` each (float64), streamed: ``chunk``
    sequences at a time (default :func:`chunk_size`), one layer's attention at a time.

    ``recording``: a pass already made over the first ``n`` sequences of ``text`` (``[n, T]``) that cached
    :func:`text_sites` (the report's one recorded run of its text, shared with the path expansion): those
    sequences are read from it, as one chunk, and only the rest run (the same values: tested).
    Raises:
        QkovError: the recording is not of the leading sequences of ``text``, or lacks a site.
    """
    source = as_source(source, where="qkov.text_scores")
    text = token_ids("qkov.text_scores", text, source.cfg, "text").to(source.device)
    B, T = text.shape
    chunk = chunk or chunk_size(source, T)
    sums = _Sums(source)
    watcher = LayerWatch(source, sums)
    watch = watcher.edits()
    done = 0 if recording is None else _recorded_rows(recording, text, watcher.sites())
    none = torch.zeros(0, dtype=torch.long)  # the scores read no logits: nothing is unembedded
    bounds = ([(0, done)] if done else []) + [(i, min(i + chunk, B)) for i in range(done, B, chunk)]
    sp, parts = ranks.current(), {}  # a unit: one chunk of sequences (the recorded ones: the first)
    for u, (start, stop) in enumerate(bounds):
        if not sp.mine(u, len(bounds)):
            continue
        sums.sums = {k: torch.zeros_like(v) for k, v in sums.sums.items()}  # this chunk's sums alone
        if recording is not None and start == 0:
            watcher.replay(recording)
        else:
            trace(source, text[start:stop], edits=watch, positions=none)
        parts[u] = sums.sums
        tick(progress, "heads: attention on text", stop, B)
    sums.sums = {k: torch.zeros_like(v) for k, v in sums.sums.items()}
    for got in sp.gather(parts, len(bounds)):  # added in chunk order, whatever the number of ranks
        for k, v in got.items():
            sums.sums[k] += v
    sums.sequences, sums.queries = B, B * (T - 1)
    return sums.scores()
