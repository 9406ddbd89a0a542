"""The analysis forward: one pass over any :class:`~qkov.weights.WeightSource`, written once, that
can read and write every activation by name.

``trace(source, tokens, cache=[...], edits={...}, grad=False)`` computes the logits and passes
every activation through a named site (:mod:`qkov.analysis.forward.sites`: ``embed``, ``resid_pre.1``,
``pattern.0``, ``z.1``, ``head_out.1``, ``mlp_hidden.0``, ``final``, ``logits``, ...). ``cache``
names the sites to keep (names, tuples, globs or TransformerLens hook names); ``edits`` replaces
a site's value by a tensor or a function of it (:mod:`qkov.analysis.forward.edits`); ``grad=True`` runs it
differentiably (cached activations keep their ``.grad`` after a backward pass). It returns a
:class:`~qkov.analysis.forward.cache.Trace` (the recorded pass) that indexes like TransformerLens' cache.

The block itself is :class:`qkov.model.block.BlockPass`, the one body the training model
(:class:`qkov.Transformer`) runs too; this module gives it the sites as hook points (a test checks the
two passes against each other and against an independent reference). What a site does not need is not
computed: with nothing asked of a layer's scores, patterns or per-head outputs, attention runs fused; a
pattern replaced by a tensor skips the queries and keys; an MLP output replaced by a tensor skips the
MLP. With logits asked at a few ``positions`` and nothing reading the last layer (no cached site there,
no gradient, no start at the final stream, and no edit there but of its input stream, its keys and values,
of ``z`` by functions marked :func:`~qkov.analysis.forward.edits.per_position`, and of its queries, ``z``, MLP
input and output and output stream by functions marked :func:`~qkov.analysis.forward.edits.at_rows`, which
take those sites at the positions alone), that layer's keys and values still run at every position but its
queries, attention, output, MLP and stream only at those positions; the scores that read a few positions
(the ICL score) and circuit evaluation then skip most of it, with the same values (tested).
With no logits asked (``logits=False``, or ``positions`` empty) the pass stops as soon as every site
cached or edited has been computed: a recording of layer 5's pattern runs layers 0-4 and layer 5's
attention up to its pattern, no MLP after it, no final normalisation, no unembedding (the values are
the full pass's; tested); the ``final`` site asked without logits is the final normalisation's output, and
nothing is unembedded (:func:`~qkov.analysis.forward.tiled_nll.pass_nll` reads the loss from it a tile at a
time). A bias of zeros (what a weights view holds for a model without one) is not added
(:func:`qkov.model.ops.live_bias`). A streamed source (a memory-mapped
:class:`~qkov.weights.LazyCheckpoint`) is read as the pass goes: one layer's weights at a time, the embedding
rows of the tokens present only, the unembedding a block of columns at a time (:func:`embedded`), so the pass
holds one layer and never ``W_E`` or ``W_U`` whole (the values are the in-memory view's; tested). Differentiably
(``grad=True``) too: each block then runs under activation checkpointing (:func:`torch.utils.checkpoint.checkpoint`),
so the backward pass re-reads the block's weights and replays it (its sites are neither cached nor counted
again, its edits are applied again: an edit function must give the same value for the same input), and the
unembedding's backward reads ``W_U`` a block of columns at a time again (:class:`_StreamedUnembed`): a
gradient through a model larger than memory holds one layer's weights at a time, not the model (the
gradients are the in-memory view's; tested).

Shapes: ``B`` batch, ``T`` positions, ``L`` layers, ``H`` heads, ``D`` d_model, ``E`` d_head, ``V`` d_vocab.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ...errors import QkovError
from ...expect import expect_tokens
from ...model import rotary
from ...model.block import BlockPass
from ...model.bus import make_pass
from ...model.ops import embed, live_bias, norm_scale, normalize, positions, stream_start
from ...model.tokens import check_tokens
from ...weights.parts import VOCAB_BLOCK, WeightSource
from ...weights.convert import SourceLike, as_source
from .cache import Trace
from .edits import AT_ROWS, PER_POSITION, Edit, Edits
from .sites import Address, Sites

__all__ = ["embedded", "flops_per_token", "ROW_SITES", "trace", "vocab_blocks"]

ROW_SITES = ("q", "z", "mlp_input", "mlp_out", "resid_post")  # last-layer sites an at_rows edit may take at the positions


def flops_per_token(cfg: Any) -> int:
    """Floating-point operations of one token through the model (matrix products, attention over a
    full context, the unembedding): what sizes the default batches of the analyses."""
    L, D, HE, M, V, T = cfg.n_layers, cfg.d_model, cfg.n_heads * cfg.d_head, cfg.d_mlp or 0, cfg.d_vocab, cfg.n_ctx
    return 2 * (L * (4 * D * HE + 2 * D * M + T * HE) + D * V)


# ------------------------------------------------------------------ the pass
class _Enough(Exception):
    """Raised inside a pass that needs no logits once its last cached or edited site is computed."""


class _Store:
    """The cache being filled: every site asked for, kinds asked at every layer kept in one
    ``[L, ...]`` buffer (so stacking them later copies nothing) unless gradients are wanted."""

    def __init__(self, wanted: set[tuple[str, int | None]], stacked: set[str], n_layers: int, grad: bool) -> None:
        self.wanted, self.stacked, self.L, self.grad = wanted, stacked, n_layers, grad
        self.items: dict[str, Tensor] = {}
        self.buffers: dict[str, Tensor] = {}

    def put(self, kind: str, layer: int | None, value: Tensor) -> None:
        name = Address(kind, layer).name
        if self.grad:
            if value.requires_grad and not value.is_leaf:
                value.retain_grad()
        elif kind in self.stacked and layer is not None:
            if kind not in self.buffers:
                self.buffers[kind] = value.new_empty(self.L, *value.shape)
            self.buffers[kind][layer] = value
            value = self.buffers[kind][layer]
        self.items[name] = value


class _Pass(BlockPass):
    """One analysis forward in progress: the block body (:class:`~qkov.model.block.BlockPass`) over a
    weights source, its hook points the sites (edited, then cached)."""

    def __init__(self, source: WeightSource, edits: Edits, store: _Store, grad: bool) -> None:
        super().__init__(source.cfg, source.norm)
        self.source, self.edits, self.store, self.grad = source, edits, store, grad
        self.pending: set[tuple[str, int | None]] | None = None  # with no logits: the sites still to compute
        self.replaying = False  # a checkpointed block recomputed in the backward pass: its sites are not kept again
        self.streamed = not source.in_memory  # each read copies from disk: read once, never held whole
        self.vocab: Tensor | None = None  # the vocabulary entries the logits hold (None: every one)

    def stop_when_done(self, start_at: tuple[int, Tensor] | None) -> None:
        """Stop the pass (:class:`_Enough`) once every site cached or edited has been computed (none: after
        the embedding); sites before ``start_at``'s layer are never computed, so they are not waited for."""
        first = 0 if start_at is None else start_at[0]
        sites = set(self.store.wanted) | set(self.edits.by_site)
        self.pending = {(k, l) for k, l in sites if (l is None or l >= first) and not (k == "embed" and start_at)}

    # ------------------------------------------------------------------ the hook points: sites
    def active(self, kind: str, layer: int | None) -> bool:
        return (kind, layer) in self.edits or (kind, layer) in self.store.wanted

    def written(self, kind: str, layer: int | None) -> bool:
        return (kind, layer) in self.edits

    def fixed(self, kind: str, layer: int | None) -> Tensor | None:
        return self.edits.fixed((kind, layer))

    def at(self, kind: str, layer: int | None, value: Tensor) -> Tensor:
        """``value`` through site ``kind.layer``: edited, then cached."""
        site = (kind, layer)
        if site in self.edits:
            value = self.edits.apply(site, value)
        if self.replaying:
            return value
        if site in self.store.wanted:
            self.store.put(kind, layer, value)
        if self.pending is not None:
            self.pending.discard(site)
            if not self.pending:
                raise _Enough
        return value

    def normed(self, prefix: str, layer: int | None, x: Tensor, w: Tensor | None, b: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """``x`` normalised at ``{prefix}_scale`` / ``{prefix}_in`` (``final_scale`` / ``final``), the
        divisor through its own site (so it can be read or frozen): the normalised stream and the divisor."""
        name = "final" if prefix == "final" else f"{prefix}_in"
        if self.source.norm == "none":
            return self.at(name, layer, x), None
        s = self.edits.fixed((f"{prefix}_scale", layer))
        s = self.at(f"{prefix}_scale", layer, norm_scale(x, self.source.norm, self.cfg.ln_eps) if s is None else s)
        out = normalize(x, self.source.norm, self.cfg.ln_eps, scale=s, w=w, b=b)[0]
        return self.at(name, layer, out), s

    def attention_weights(self, layer: int) -> Any:
        return self.source.attention(layer, expand_kv=False)

    def mlp_weights(self, layer: int) -> Any:
        return self.source.mlp(layer)

    # ------------------------------------------------------------------ the ends
    def start(self, tokens: Tensor, start_at: tuple[int, Tensor] | None) -> tuple[int, Tensor | None]:
        """Embed ``tokens`` (or take the stream given by ``start_at``); set the positions (after the
        :attr:`past`'s, when there is one)."""
        B, T = tokens.shape
        f = 0 if self.past is None else self.past[0].shape[2]  # positions after the past's
        pos = positions(self.source.pos(), f, T)
        if pos is not None:
            pos = pos.expand(B, T, -1)
            if self.grad and not pos.requires_grad:
                pos = pos.clone().requires_grad_()
            self.pos = pos = self.at("pos", None, pos)
        if self.cfg.positional == "rotary":
            cos, sin = rotary.tables(self.cfg, f + T, self.source.device, self.source.dtype)
            self.turn = (cos[f:], sin[f:])
        if start_at is not None:  # the embedding is not read
            return start_at[0], start_at[1]
        emb = embedded(self.source, tokens)
        if self.grad and not emb.requires_grad:
            emb = emb.requires_grad_()
        x = stream_start(self.at("embed", None, emb), pos, self.cfg.positional)
        if self.cfg.residual != "sum":  # a routed model: the stream goes through its bus
            self.bus = make_pass(self.cfg, self.source.bus, self.at)  # type: ignore[attr-defined]
            self.bus.start(x)
        return 0, x

    def logits(self, x: Tensor, positions: Tensor | None) -> Tensor:
        V = self.cfg.d_vocab
        if positions is not None and len(positions) == 0:  # a metric that reads no logits: unembed nothing
            if self.pending and ("final", None) in self.pending:  # but the final stream is asked: normalise
                unemb = self.source.unembed(cols=slice(0, min(V, 1)))
                self.normed("final", None, x, unemb.ln_w, unemb.ln_b)  # the last site asked: the pass ends here
            return x.new_zeros(x.shape[0], 0, V if self.vocab is None else len(self.vocab))
        unemb = self.source.unembed(cols=slice(0, min(V, VOCAB_BLOCK)) if self.streamed else None)
        x = x if positions is None else x[:, positions.to(x.device)]
        final = self.normed("final", None, x, unemb.ln_w, unemb.ln_b)[0]
        if self.vocab is not None:
            return self._vocab_logits(final, unemb, self.vocab)
        if self.streamed and self.grad and final.requires_grad:  # its backward reads W_U by blocks again
            return self.at("logits", None, _StreamedUnembed.apply(final, self, unemb))
        if self.streamed:  # the unembedding a block of columns at a time: W_U is never held whole
            return self.at("logits", None, self._streamed_logits(final, unemb))
        logits = final @ unemb.W_U
        b_U = live_bias(unemb.b_U)
        if b_U is not None:  # in place on the fresh product (the same bits): the logits are the largest tensor
            logits = logits + b_U if self.grad else logits.add_(b_U)
        return self.at("logits", None, logits)

    def _streamed_logits(self, final: Tensor, first: Any) -> Tensor:
        """``final [B, P, D] @ W_U + b_U`` read from a streamed source :data:`VOCAB_BLOCK` columns at a time
        (``first``: the first block, already read), into one ``[B, P, V]`` tensor."""
        V, parts = self.cfg.d_vocab, []
        logits = None if self.grad else final.new_empty(*final.shape[:-1], V)
        for cols in vocab_blocks(V):
            part = first if cols.start == 0 else self.source.unembed(cols=cols)
            block = final @ part.W_U
            b_U = live_bias(part.b_U)
            block = block if b_U is None else block + b_U
            if logits is None:
                parts.append(block)
            else:
                logits[..., cols] = block
        return torch.cat(parts, -1) if logits is None else logits

    def _vocab_logits(self, final: Tensor, first: Any, vocab: Tensor) -> Tensor:
        """``final [B, P, D] @ W_U[:, vocab] + b_U[vocab]``, ``[B, P, C]``: the columns ``vocab`` alone (``first``:
        the whole unembedding of a source in memory, else its first block of columns, already read; a streamed
        source reads only the blocks that hold an entry asked)."""
        if not len(vocab):
            return final.new_zeros(*final.shape[:-1], 0)
        if not self.streamed:
            blocks = [(torch.arange(len(vocab), device=vocab.device), first, vocab)]
        else:
            blocks = []
            for cols in vocab_blocks(self.cfg.d_vocab):
                inside = ((vocab >= cols.start) & (vocab < cols.stop)).nonzero()[:, 0]
                if len(inside):
                    part = first if cols.start == 0 else self.source.unembed(cols=cols)
                    blocks.append((inside, part, vocab[inside] - cols.start))
        parts = []
        for _, part, idx in blocks:
            idx = idx.to(part.W_U.device)
            out = final @ part.W_U.index_select(1, idx)
            b_U = live_bias(part.b_U)
            parts.append(out if b_U is None else out + b_U.index_select(0, idx))
        logits = torch.cat(parts, -1)
        if self.streamed:  # the blocks' entries back in the order asked
            order = torch.cat([inside for inside, _, _ in blocks]).to(logits.device)
            logits = logits.index_select(-1, torch.argsort(order))
        return logits

    def block_held(self, l: int, x: Tensor, rows: Tensor | None) -> Tensor:
        """:meth:`block`; on a streamed source with gradients, checkpointed: the backward pass recomputes the
        block from ``x`` (re-reading its weights) instead of keeping what it saved, its weights among them."""
        if not (self.grad and self.streamed and self.bus is None and self.pending is None and torch.is_grad_enabled()):
            return self.block(l, x, rows)
        calls = [0]

        def run(x: Tensor) -> Tensor:
            self.replaying, calls[0] = calls[0] > 0, calls[0] + 1
            try:
                return self.block(l, x, rows)
            finally:
                self.replaying = False

        return checkpoint(run, x, use_reentrant=False)

    def query_rows(self, positions: Tensor | None, T: int, *, start_at: Any) -> Tensor | None:
        """The positions ``[P]`` (in ``0 .. T-1``) where the last layer needs its queries, or ``None``
        when the whole last layer must run (see the module docstring)."""
        L = self.cfg.n_layers
        if positions is None or L == 0 or self.grad or self.bus is not None or (start_at is not None and start_at[0] >= L):
            return None
        if positions.dim() != 1 or not 0 < len(positions) < T or positions.is_floating_point() or positions.dtype == torch.bool:
            return None
        if any(layer == L - 1 for _, layer in self.store.wanted):
            return None
        for (kind, layer), edits in self.edits.by_site.items():  # at the last layer: its input, keys, values, ...
            if layer != L - 1 or kind in ("resid_pre", "k", "v"):
                continue
            if all(getattr(e, AT_ROWS, False) for _, e in edits) and kind in ROW_SITES:
                continue  # ... functions that take the site at the positions
            if kind != "z" or not all(getattr(e, PER_POSITION, False) for _, e in edits):  # ... per-position z
                return None
        return positions.to(self.source.device).remainder(T)


class _StreamedUnembed(torch.autograd.Function):
    """``final [B, P, D] @ W_U + b_U`` of a streamed source, differentiable in ``final`` only, saving no
    weights: the forward and the backward each read ``W_U`` a block of columns at a time."""

    @staticmethod
    def forward(ctx: Any, final: Tensor, state: _Pass, first: Any) -> Tensor:  # type: ignore[override]
        ctx.state = state
        with torch.no_grad():
            return state._streamed_logits(final, first)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        state = ctx.state
        out = None
        for cols in vocab_blocks(state.cfg.d_vocab):
            part = grad[..., cols] @ state.source.unembed(cols=cols).W_U.T
            out = part if out is None else out.add_(part)
        return out, None, None


def vocab_blocks(V: int) -> Iterable[slice]:
    """The vocabulary's columns, :data:`VOCAB_BLOCK` at a time: how a streamed source's ``W_U`` is read."""
    return (slice(lo, min(V, lo + VOCAB_BLOCK)) for lo in range(0, V, VOCAB_BLOCK))


def embedded(source: WeightSource, tokens: Tensor) -> Tensor:
    """The token embedding ``W_E[tokens]`` ``[B, T, D]`` of ``tokens [B, T]``. A streamed source (not
    ``in_memory``) reads only the rows of the ids present, each run of consecutive ids as one block:
    ``W_E`` is never held whole."""
    if getattr(source, "in_memory", True):
        return embed(tokens, source.embed(), None)[0]
    ids, inverse = tokens.unique(return_inverse=True)  # sorted
    runs, start = [], 0
    values = ids.tolist()
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[i - 1] + 1:
            runs.append(source.embed(slice(values[start], values[i - 1] + 1)))
            start = i
    return embed(inverse, torch.cat(runs), None)[0]


def trace(
    source: SourceLike,
    tokens: Tensor,
    *,
    cache: Iterable[Any] | str = (),
    edits: Mapping[Any, Edit] | None = None,
    grad: bool = False,
    positions: Tensor | None = None,
    start_at: tuple[int, Tensor] | None = None,
    stream: str | None = None,
    logits: bool = True,
    past: tuple[Tensor, Tensor] | None = None,
    vocab: Tensor | None = None,
) -> Trace:
    """Run the model of ``source`` on ``tokens [B, T]`` (or ``[T]``); see the module docstring.

    ``source``: a model, weights source or path, read once (:func:`~qkov.weights.as_source`).

    Which stream the sites hold: a model or path is read into the default view, which for a
    LayerNorm model centres the writers (as TransformerLens' processed default does; the logits, every
    attention pattern and every normalised input are unchanged), so ``embed``, ``pos``, ``resid_pre/mid/post``,
    ``attn_out``, ``head_out`` and ``mlp_out`` are the model's own values minus their mean over
    ``d_model``. ``stream="model"`` gives the model's own stream (``transformers``' hidden states,
    an unprocessed TransformerLens model; tested against ``output_hidden_states``).

    Args:
        cache: sites to keep (names, ``(kind, layer)`` tuples, globs such as ``"pattern.*"``, a
            per-layer kind alone for every layer (``"pattern"``), TransformerLens hook names); read
            them from the result, ``out["pattern", 1]`` or ``out.stack("pattern")``.
        edits: ``{site: tensor | fn(value, site)}``: what to write at a site (:mod:`qkov.analysis.forward.edits`);
            a function that returns its value unchanged observes the site without keeping it.
        grad: run differentiably (else under ``torch.no_grad``); cached activations that
            require grad keep their gradient after a backward pass.
        positions: ``[P]`` positions: the logits, the final sites (``Trace.logits [B, P, V]``) and, when
            nothing reads the last layer, its queries are computed there only (scores at a few positions).
        start_at: ``(layer, stream [B, T, D])``: start at that layer's ``resid_pre`` (``n_layers``:
            the final stream, the only start a routed model has: ``resid_final``) with the given stream;
            earlier sites are not computed.
        stream: ``None`` (the source as given; a model or path in the default view) or ``"model"``:
            a model or path read with its writers uncentred (``Weights.from_model(m,
            center_writing=False)``); a weights view given must then be uncentred already.
        logits: ``False``: compute no logits (``Trace.logits`` is ``[B, 0, V]``; ``positions`` empty
            means the same) and stop the pass as soon as every site cached or edited has been
            computed (nothing after the last of them runs).
        past: ``(keys, values)``, each ``[L, B, f, K, E]`` (as the ``k`` and ``v`` sites hold them, rotated):
            every layer's keys and values of ``f`` positions before ``tokens``, which then stand at positions
            ``f ..`` (a pass over a suffix of sequences whose first ``f`` positions a run has computed;
            every site holds the suffix; no scores, pattern or ``lse`` are asked). Given for ``B / r``
            sequences (``r`` dividing ``B``), the batch's ``r`` blocks of sequences all read them.
        vocab: ``[C]`` vocabulary ids: the logits at those entries alone, ``Trace.logits [B, P, C]`` in that
            order (a metric that reads a few logits, :meth:`~qkov.analysis.causal.metrics.Metric.narrowed`,
            unembeds ``C`` columns instead of the vocabulary); the ``logits`` site is then neither cached nor
            edited.
    Returns:
        :class:`~qkov.analysis.forward.cache.Trace`.
    """
    source = as_source(source, where="qkov.trace", stream=stream)
    expect_tokens("qkov.trace", tokens)
    cfg = source.cfg
    tokens = check_tokens(tokens, cfg).to(source.device)
    sites = Sites(cfg, source.norm)
    asked = sites.resolve_all(cache)
    ed = Edits(sites, edits, device=source.device, dtype=source.dtype)
    ed.check_shapes(*tokens.shape)
    _check_start(start_at, tokens, cfg, source)
    if positions is not None and len(positions) and not bool(((positions >= -tokens.shape[1]) & (positions < tokens.shape[1])).all()):
        raise QkovError(f"positions: every position must be in -{tokens.shape[1]}..{tokens.shape[1] - 1}")
    if not logits or (positions is not None and len(positions) == 0):
        positions = torch.zeros(0, dtype=torch.long)
    _check_past(past, tokens, cfg, asked, ed)
    vocab = _check_vocab(vocab, cfg, asked, ed, source.device)
    store = _Store({a.site for a in asked}, _whole_kinds(asked, cfg.n_layers), cfg.n_layers, grad)
    state = _Pass(source, ed, store, grad)
    state.past, state.vocab = past, vocab
    with torch.enable_grad() if grad else torch.no_grad():  # grad=True whatever the caller's mode
        out = _run(state, tokens, positions, start_at)
    return Trace(tokens, out, store.items, source, positions, dict(store.buffers))


def _run(state: _Pass, tokens: Tensor, positions: Tensor | None, start_at: tuple[int, Tensor] | None) -> Tensor:
    """The pass itself: the logits ``[B, P, V]`` (``[B, 0, V]`` when ``positions`` is empty: then it stops
    once every site cached or edited is computed)."""
    L = state.cfg.n_layers
    C = state.cfg.d_vocab if state.vocab is None else len(state.vocab)
    none = torch.zeros(tokens.shape[0], 0, C, dtype=state.source.dtype, device=state.source.device)
    if positions is not None and len(positions) == 0:
        state.stop_when_done(start_at)
        if not state.pending:
            return none
    try:
        first, x = state.start(tokens, start_at)
        rows = state.query_rows(positions, tokens.shape[1], start_at=start_at)
        for l in range(first, L):  # the last layer at the positions alone when nothing reads it
            x = state.block_held(l, x, rows if l == L - 1 else None)
        if state.bus is not None:  # a routed model's final stream: the bus's final read
            x = state.at("resid_final", None, state.bus.final())
        return state.logits(x, positions if rows is None else None)  # type: ignore[arg-type]
    except _Enough:  # every site asked for is there: nothing after it is read
        return none


def _whole_kinds(asked: list[Address], n_layers: int) -> set[str]:
    """Kinds asked for at every layer (kept in one buffer)."""
    by_kind: dict[str, set[int]] = {}
    for a in asked:
        if a.layer is not None:
            by_kind.setdefault(a.kind, set()).add(a.layer)
    varying = ("route_attn", "route_mlp")  # AttnRes: one more source per layer, no common buffer shape
    return {k for k, ls in by_kind.items() if len(ls) == n_layers and k not in varying}


def _check_vocab(vocab: Tensor | None, cfg: Any, asked: list[Address], ed: Edits, device: Any) -> Tensor | None:
    if vocab is None:
        return None
    ids = torch.as_tensor(vocab)
    if ids.ndim != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise QkovError(f"vocab: expected a 1-D tensor of vocabulary ids, got {ids.dtype} of shape {list(ids.shape)}")
    if len(ids) and not bool(((ids >= 0) & (ids < cfg.d_vocab)).all()):
        raise QkovError(f"vocab: every id must be in 0..{cfg.d_vocab - 1}")
    if any(a.kind == "logits" for a in asked) or any(k == "logits" for k, _ in ed.by_site):
        raise QkovError("vocab: the logits site holds the whole vocabulary; cache or edit it without vocab=")
    return ids.to(device=device, dtype=torch.long)


def _check_past(past: tuple[Tensor, Tensor] | None, tokens: Tensor, cfg: Any, asked: list[Address], ed: Edits) -> None:
    if past is None:
        return
    if cfg.residual != "sum":
        raise QkovError(f"past: a model with residual {cfg.residual!r} runs whole sequences")
    (B, T), (keys, values) = tokens.shape, past
    n = keys.shape[1] if keys.ndim == 5 and keys.shape[1] and B % keys.shape[1] == 0 else B
    want = (cfg.n_layers, n, keys.shape[2] if keys.ndim == 5 else -1, cfg.kv_heads, cfg.d_head)
    if tuple(keys.shape) != want or tuple(values.shape) != want:
        raise QkovError(f"past: expected keys and values of shape {list(want)}, got {list(keys.shape)}, {list(values.shape)}")
    if keys.shape[2] + T > cfg.n_ctx:
        raise QkovError(f"past: {keys.shape[2]} positions before {T} tokens exceed the context of {cfg.n_ctx}")
    whole = ("scores", "pattern", "lse")
    if any(a.kind in whole for a in asked) or any(k in whole for k, _ in ed.by_site):
        raise QkovError("past: a pass over a suffix forms no scores, pattern or lse")


def _check_start(start_at: tuple[int, Tensor] | None, tokens: Tensor, cfg: Any, source: Any) -> None:
    if start_at is None:
        return
    (layer, x), (B, T) = start_at, tokens.shape
    if cfg.residual != "sum" and layer != cfg.n_layers:  # after the final read only the unembedding runs
        raise QkovError(
            f"start_at: a model with residual {cfg.residual!r} has no single stream to start from before its final "
            f"read (layer {cfg.n_layers}, the final stream resid_final)"
        )
    if not (isinstance(layer, int) and 0 <= layer <= cfg.n_layers):
        raise QkovError(f"start_at: layer must be in 0..{cfg.n_layers}, got {layer!r}")
    if tuple(x.shape) != (B, T, cfg.d_model):
        raise QkovError(f"start_at: expected a stream of shape [{B}, {T}, {cfg.d_model}], got {list(x.shape)}")
    if x.device != source.device or x.dtype != source.dtype:
        raise QkovError("start_at: the stream must be on the source's device and dtype")
