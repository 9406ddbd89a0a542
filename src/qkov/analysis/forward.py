"""The analysis forward: one pass over any :class:`~qkov.weights.WeightSource`, written once, that
can read and write every activation by name.

``trace(source, tokens, cache=[...], edits={...}, grad=False)`` computes the logits and passes
every activation through a named site (:mod:`qkov.analysis.sites`: ``embed``, ``resid_pre.1``,
``pattern.0``, ``z.1``, ``head_out.1``, ``mlp_hidden.0``, ``final``, ``logits``, ...). ``cache``
names the sites to keep (names, tuples, globs or TransformerLens hook names); ``edits`` replaces
a site's value by a tensor or a function of it (:mod:`qkov.analysis.edits`); ``grad=True`` runs it
differentiably (cached activations keep their ``.grad`` after a backward pass). It returns a
:class:`~qkov.analysis.activations.Trace` (the recorded pass) that indexes like TransformerLens' cache.
(Until 1.0 these were ``run`` and ``Run``; in qkov a *run* is a training run, :mod:`qkov.training.rundir`.)

What a site does not need is not computed: with nothing asked of a layer's scores, patterns or per-head
outputs, attention runs fused; a pattern replaced by a tensor skips the queries and keys; an MLP output
replaced by a tensor skips the MLP; with logits asked at a few ``positions`` and nothing asked of the last
layer, that layer runs its queries there only (:mod:`qkov.analysis.forward_fast`). The older modes are uses of the same
sites: ``patterns=`` (replace every pattern), ``frozen=`` (replace patterns, normalisation divisors and MLP
outputs by those of a previous run), ``head_outputs=`` (each head writes a given output; its live one is
still recorded), ``record=`` (cache by the older names) and ``observe=`` (each layer's attention handed to a
callback and dropped). The training model (:class:`qkov.Transformer`) runs the same block pieces
(:mod:`qkov.model.ops`); a test checks the two against each other and against an independent reference.

Shapes: ``B`` batch, ``T`` positions, ``L`` layers, ``H`` heads, ``D`` d_model, ``E`` d_head, ``V`` d_vocab.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from ..deprecated import module_getattr
from ..errors import QkovError
from ..expect import expect_tokens
from ..model import rotary
from ..model.ops import (
    attention_scores,
    embed,
    expand_kv,
    masked_scores,
    mlp_hidden,
    mlp_output,
    mlp_preactivation,
    norm_scale,
    normalize,
    project_heads,
    query_key_stream,
    stream_start,
    write_heads,
)
from ..model.tokens import check_tokens
from ..weights.parts import AttentionWeights, WeightSource
from ..weights.convert import SourceLike, as_source
from .activations import Scales, Trace
from .edits import Edit, Edits
from .forward_fast import last_block, live_bias, plus_bias, query_rows
from .legacy import legacy_edits, legacy_kinds
from .sites import Address, Sites

RECORDABLE: tuple[str, ...] = ("patterns", "scales", "values", "head_outputs", "mlp_outputs", "qk_inputs")
"""The older ``record=`` names (see :class:`~qkov.analysis.activations.Trace` for their layouts)."""
__all__ = ["RECORDABLE", "LayerView", "Scales", "Trace", "flops_per_token", "head_terms", "project", "read", "trace"]


@dataclass
class LayerView:
    """One layer's attention on a run, as :func:`trace` hands it to ``observe``: ``pattern [B, H, T, T]``,
    ``values [B, H, T, E]`` (``b_V`` included), ``qk_input [B, T, D]`` (normalised) and its
    divisor ``qk_scale [B, T, 1]`` (``None`` without normalisation)."""

    layer: int
    pattern: Tensor
    values: Tensor
    qk_input: Tensor
    qk_scale: Tensor | None


def flops_per_token(cfg: Any) -> int:
    """Floating-point operations of one token through the model (matrix products, attention over a
    full context, the unembedding): what sizes the default batches of the analyses."""
    L, D, HE, M, V, T = cfg.n_layers, cfg.d_model, cfg.n_heads * cfg.d_head, cfg.d_mlp or 0, cfg.d_vocab, cfg.n_ctx
    return 2 * (L * (4 * D * HE + 2 * D * M + T * HE) + D * V)


# ------------------------------------------------------------------ layer pieces (path expansion)
def project(x: Tensor, W: Tensor, b: Tensor | None = None) -> Tensor:
    """``x [B, T, D]`` through per-head ``W [H, D, E]`` (plus ``b [H, E]``) -> ``[B, H, T, E]``."""
    return project_heads(x, W, b)


def head_writes(pattern: Tensor, v: Tensor, W_O: Tensor) -> Tensor:
    """Each head's output ``[B, H, T, D]``: ``pattern [B, H, T, T] @ v [B, H, T, E] @ W_O [H, E, D]``."""
    return torch.einsum("bhte,hed->bhtd", pattern @ v, W_O)


def head_terms(source: WeightSource, run: Trace, layer: int, x: Tensor, heads: list[int] | None = None) -> Tensor:
    """What each head of ``layer`` (or only ``heads``) writes for one stream term ``x [B, T, D]``
    alone, with the run's patterns and normalisation divisors frozen, no biases: ``[h, B, T, D]``."""
    att = source.attention(layer)
    pattern = run.patterns[layer]  # type: ignore[index]
    W_V, W_O = att.W_V, att.W_O
    if heads is not None:
        pattern, W_V, W_O = pattern[:, heads], W_V[heads], W_O[heads]
    v = project(read(x, source.norm, run.divisor("attn_v", layer)), W_V)
    return head_writes(pattern, v, W_O).transpose(0, 1)


def read(x: Tensor, norm: str, scale: Tensor | None) -> Tensor:
    """A reader's (linear) view of a stream term ``x [B, T, D]`` with the normalisation's divisor
    frozen at ``scale [B, T, 1]``: centred and divided (``folded``), divided (``scale``), or
    ``x`` itself (``none``). Summed over terms, it gives the real normalised input."""
    if norm == "layernorm":
        raise QkovError("a frozen read needs a weights view with LayerNorm folded (fold_ln=True)")
    return normalize(x, norm, 0.0, scale=scale)[0] if scale is not None else x


# ------------------------------------------------------------------ the pass
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


class _Pass:
    """One forward pass in progress: the source, its sites' edits and cache, the positions."""

    def __init__(self, source: WeightSource, edits: Edits, store: _Store, observe: Any, grad: bool) -> None:
        self.source, self.cfg, self.edits, self.store = source, source.cfg, edits, store
        self.observe, self.grad = observe, grad
        self.group = self.cfg.n_heads // self.cfg.kv_heads
        self.pos: Tensor | None = None
        self.turn: tuple[Tensor, Tensor] | None = None

    # ------------------------------------------------------------------ sites
    def active(self, kind: str, layer: int | None) -> bool:
        return (kind, layer) in self.edits or (kind, layer) in self.store.wanted

    def at(self, kind: str, layer: int | None, value: Tensor) -> Tensor:
        """``value`` through site ``kind.layer``: edited, then cached."""
        site = (kind, layer)
        if site in self.edits:
            value = self.edits.apply(site, value)
        if site in self.store.wanted:
            self.store.put(kind, layer, value)
        return value

    def at_heads(self, kind: str, layer: int, x: Tensor) -> Tensor:
        """A ``[B, H, T, E]`` tensor through a site with TransformerLens' ``[B, T, H, E]`` layout."""
        return self.at(kind, layer, x.transpose(1, 2)).transpose(1, 2) if self.active(kind, layer) else x

    def normed(self, prefix: str, layer: int | None, x: Tensor, w: Tensor | None, b: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """``x`` normalised at ``{prefix}_scale`` / ``{prefix}_in`` (``final_scale`` / ``final``):
        the normalised stream and the divisor used."""
        name = "final" if prefix == "final" else f"{prefix}_in"
        if self.source.norm == "none":
            return self.at(name, layer, x), None
        s = self.edits.fixed((f"{prefix}_scale", layer))
        s = self.at(f"{prefix}_scale", layer, norm_scale(x, self.source.norm, self.cfg.ln_eps) if s is None else s)
        out = normalize(x, self.source.norm, self.cfg.ln_eps, scale=s, w=w, b=b)[0]
        return self.at(name, layer, out), s

    # ------------------------------------------------------------------ attention
    def head_input(self, kind: str, l: int, x: Tensor, normed: Tensor, W: Tensor, b: Tensor, ln: Any) -> Tensor:
        """Queries, keys or values ``[B, n, T, E]``; through the per-head input site ``{kind}_input``
        when that site is used: each head's own copy of the stream ``x`` (shortformer positions added
        after the site, for queries and keys), normalised on its own."""
        if not self.active(f"{kind}_input", l):
            return project_heads(normed, W, live_bias(b))
        split = x[:, :, None, :].expand(-1, -1, W.shape[0], -1)
        if (f"{kind}_input", l) in self.edits:  # an edit may write in place: each head its own memory
            split = split.clone()
        split = self.at(f"{kind}_input", l, split)
        if kind != "v":
            split = query_key_stream(split, None if self.pos is None else self.pos[:, :, None], self.cfg.positional)
        split = normalize(split, self.source.norm, self.cfg.ln_eps, w=ln[0], b=ln[1])[0]
        return torch.einsum("btnd,nde->bnte", split, W) + b[:, None]

    def queries_keys(self, l: int, att: AttentionWeights, x: Tensor, qk_in: Tensor) -> tuple[Tensor | None, ...]:
        """Queries ``[B, H, T, E]`` and keys ``[B, K, T, E]`` (rotated); ``None`` when the pattern is
        replaced by a tensor and nothing asks for them."""
        needs = ("q_input", "k_input", "q", "k", "scores")
        if self.edits.fixed(("pattern", l)) is not None and not any(self.active(k, l) for k in needs):
            return None, None
        ln = (att.ln_w, att.ln_b)
        q = self.head_input("q", l, x, qk_in, att.W_Q, att.b_Q, ln)
        k = self.head_input("k", l, x, qk_in, att.W_K, att.b_K, ln)
        if self.turn is not None:
            q, k = rotary.rotate(q, *self.turn), rotary.rotate(k, *self.turn)
        return self.at_heads("q", l, q), self.at_heads("k", l, k)

    def attend(self, l: int, q: Tensor | None, k: Tensor | None, v: Tensor) -> tuple[Tensor, Tensor | None]:
        """``z [B, H, T, E]`` and the pattern (``None`` when attention ran fused)."""
        v = expand_kv(v, self.group, dim=1)
        if not (self.observe or self.active("scores", l) or self.active("pattern", l)):
            return F.scaled_dot_product_attention(q, expand_kv(k, self.group, dim=1), v, is_causal=True), None  # type: ignore[arg-type]
        if q is None:
            B, H, T = v.shape[0], self.cfg.n_heads, v.shape[2]
            pattern = self.edits.fixed(("pattern", l)).expand(B, H, T, T)  # type: ignore[union-attr]
        else:
            fresh = attention_scores(q, expand_kv(k, self.group, dim=1))  # type: ignore[arg-type]  # nothing else holds it
            pattern = torch.softmax(self.at("scores", l, masked_scores(fresh, inplace=True)), dim=-1)
        pattern = self.at("pattern", l, pattern)
        return pattern @ v, pattern

    def attention(self, l: int, x: Tensor) -> Tensor:
        """Layer ``l``'s attention output ``[B, T, D]`` (``b_O`` included) for the stream ``x``."""
        att = self.source.attention(l, expand_kv=False)
        v_in, v_scale = self.normed("attn", l, x, att.ln_w, att.ln_b)
        qk_src = query_key_stream(x, self.pos, self.cfg.positional)
        if qk_src is x:
            qk_in, qk_scale = self.at("qk_in", l, v_in), v_scale
        else:
            qk_in, qk_scale = self.normed("qk", l, qk_src, att.ln_w, att.ln_b)
        v = self.at_heads("v", l, self.head_input("v", l, x, v_in, att.W_V, att.b_V, (att.ln_w, att.ln_b)))
        q, k = self.queries_keys(l, att, x, qk_in)
        z, pattern = self.attend(l, q, k, v)
        z = self.at_heads("z", l, z)
        if self.observe is not None:
            self.observe(LayerView(l, pattern, expand_kv(v, self.group, dim=1), qk_in, qk_scale))  # type: ignore[arg-type]
        if self.active("head_out", l):
            per_head = self.at("head_out", l, torch.einsum("bhte,hed->bthd", z, att.W_O))
            out = per_head.sum(2) + att.b_O
        else:
            out = write_heads(z, att.W_O, live_bias(att.b_O))
        return self.at("attn_out", l, out)

    # ------------------------------------------------------------------ MLP, blocks, logits
    def mlp(self, l: int, x: Tensor) -> Tensor | None:
        """Layer ``l``'s MLP output for the stream ``x`` it reads (``None`` without an MLP)."""
        mlp = self.source.mlp(l)
        if mlp is None:
            return None
        inside = ("mlp_scale", "mlp_in", "mlp_pre", "mlp_linear", "mlp_hidden")
        out = self.edits.fixed(("mlp_out", l))
        if out is None or any(self.active(k, l) for k in inside):
            m_in = self.normed("mlp", l, x, mlp.ln_w, mlp.ln_b)[0]
            pre, linear = mlp_preactivation(m_in, mlp.W_in, live_bias(mlp.b_in), mlp.W_gate, live_bias(mlp.b_gate))
            pre = self.at("mlp_pre", l, pre)
            linear = None if linear is None else self.at("mlp_linear", l, linear)
            hidden = self.at("mlp_hidden", l, mlp_hidden(self.cfg.act_fn, pre, linear))
            out = mlp_output(hidden, mlp.W_out, live_bias(mlp.b_out))
        return self.at("mlp_out", l, out)

    def block(self, l: int, x: Tensor) -> Tensor:
        x = self.at("resid_pre", l, x)
        a = self.attention(l, x)
        if self.cfg.parallel:  # attention and MLP both read the block's input
            m = self.mlp(l, x)
            x = x + a if m is None else x + a + m
        else:
            x = x + a
            if self.cfg.d_mlp is not None:
                x = self.at("resid_mid", l, x)
                x = x + self.mlp(l, x)  # type: ignore[operator]
        return self.at("resid_post", l, x)

    def start(self, tokens: Tensor, start_at: tuple[int, Tensor] | None) -> tuple[int, Tensor | None]:
        """Embed ``tokens`` (or take the stream given by ``start_at``); set the positions."""
        B, T = tokens.shape
        emb, pos = embed(tokens, self.source.embed(), self.source.pos())
        if pos is not None:
            pos = pos.expand(B, T, -1)
            if self.grad and not pos.requires_grad:
                pos = pos.clone().requires_grad_()
            self.pos = pos = self.at("pos", None, pos)
        if self.cfg.positional == "rotary":
            self.turn = rotary.tables(self.cfg, T, self.source.device, self.source.dtype)
        if start_at is not None:
            return start_at[0], start_at[1]
        if self.grad and not emb.requires_grad:
            emb = emb.requires_grad_()
        return 0, stream_start(self.at("embed", None, emb), pos, self.cfg.positional)

    def logits(self, x: Tensor, positions: Tensor | None) -> Tensor:
        if positions is not None and len(positions) == 0:  # a metric that reads no logits: unembed nothing
            return x.new_zeros(x.shape[0], 0, self.cfg.d_vocab)
        unemb = self.source.unembed()
        x = x if positions is None else x[:, positions.to(x.device)]
        final = self.normed("final", None, x, unemb.ln_w, unemb.ln_b)[0]
        return self.at("logits", None, plus_bias(final @ unemb.W_U, unemb.b_U))


def trace(
    source: SourceLike,
    tokens: Tensor,
    *,
    cache: Iterable[Any] | str = (),
    edits: Mapping[Any, Edit] | None = None,
    grad: bool = False,
    positions: Tensor | None = None,
    start_at: tuple[int, Tensor] | None = None,
    record: Iterable[str] = (),
    patterns: Tensor | None = None,
    frozen: Trace | None = None,
    head_outputs: Tensor | None = None,
    observe: Callable[[LayerView], None] | None = None,
    stream: str | None = None,
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
            them from the result, ``out["pattern", 1]``.
        edits: ``{site: tensor | fn(value, site)}``: what to write at a site (:mod:`qkov.analysis.edits`).
        grad: run differentiably (else under ``torch.no_grad``); cached activations that
            require grad keep their gradient after a backward pass.
        positions: ``[P]`` positions: the logits, the final sites (``Trace.logits [B, P, V]``) and, when
            nothing reads the last layer, its queries are computed there only (scores at a few positions).
        start_at: ``(layer, stream [B, T, D])``: start at that layer's ``resid_pre`` (``n_layers``:
            the final stream) with the given stream; earlier sites are not computed.
        record: the older names of :data:`RECORDABLE` to cache (at every layer).
        patterns: attention patterns ``[L, B, H, T, T]`` (or ``[L, H, T, T]``) replacing the model's own.
        frozen: a previous run of the same tokens that recorded ``patterns`` and ``scales`` (and
            ``mlp_outputs`` for a model with MLPs): its patterns, divisors and MLP outputs
            replace the computed ones, so the logits are linear in the one-hot tokens.
        head_outputs: ``[L, B, H, T, D]``: each head adds this instead of its live output (the
            live output is still recorded under ``head_outputs``); ``b_O`` is added as usual.
        observe: called with each layer's :class:`LayerView` as soon as it is computed.
        stream: ``None`` (the source as given; a model or path in the default view) or ``"model"``:
            a model or path read with its writers uncentred (``Weights.from_model(m,
            center_writing=False)``); a weights view given must then be uncentred already.
    Returns:
        :class:`~qkov.analysis.activations.Trace`.
    """
    source = as_source(source, where="qkov.trace", stream=stream)
    expect_tokens("qkov.trace", tokens)
    cfg = source.cfg
    tokens = check_tokens(tokens, cfg).to(source.device)
    sites = Sites(cfg, source.norm)
    kinds = legacy_kinds(record, sites)
    asked = sites.resolve_all(cache)
    wanted = {a.site for a in asked} | {(k, l) for k in kinds for l in _layers(sites, k)}
    stacked = set(kinds) | _whole_kinds(asked, cfg.n_layers)
    ed = Edits(sites, None, device=source.device, dtype=source.dtype)
    live = legacy_edits(ed, tokens, patterns=patterns, frozen=frozen, head_outputs=head_outputs)
    ed.update(edits)
    _check_start(start_at, tokens, cfg, source)
    if positions is not None and len(positions) and not bool(((positions >= -tokens.shape[1]) & (positions < tokens.shape[1])).all()):
        raise QkovError(f"positions: every position must be in -{tokens.shape[1]}..{tokens.shape[1] - 1}")
    state = _Pass(source, ed, _Store(wanted, stacked, cfg.n_layers, grad), observe, grad)
    with contextlib.nullcontext() if grad else torch.no_grad():
        first, x = state.start(tokens, start_at)
        rows = query_rows(state, positions, tokens.shape[1], start_at=start_at, observe=observe, grad=grad)
        for l in range(first, cfg.n_layers):  # the last layer at the positions alone when nothing reads it
            x = state.block(l, x) if rows is None or l < cfg.n_layers - 1 else last_block(state, l, x, rows)
        logits = state.logits(x, positions if rows is None else None)  # type: ignore[arg-type]
    out = Trace(tokens, logits, state.store.items, source, positions, dict(state.store.buffers))
    if live is not None and "head_out" in kinds:  # head_outputs=: the live outputs, not the ones written
        out.cache.update({f"head_out.{l}": v for l, v in live.items()})
        out.stacks.pop("head_out", None)
    return out


def _layers(sites: Sites, kind: str) -> list[int | None]:
    """The layers a kind has sites at (``[None]`` for a global kind)."""
    per = {k.name: k.per_layer for k in sites.kinds}
    return list(range(sites.cfg.n_layers)) if per[kind] else [None]


def _whole_kinds(asked: list[Address], n_layers: int) -> set[str]:
    """Kinds asked for at every layer (kept in one buffer)."""
    by_kind: dict[str, set[int]] = {}
    for a in asked:
        if a.layer is not None:
            by_kind.setdefault(a.kind, set()).add(a.layer)
    return {k for k, ls in by_kind.items() if len(ls) == n_layers}


def _check_start(start_at: tuple[int, Tensor] | None, tokens: Tensor, cfg: Any, source: Any) -> None:
    if start_at is None:
        return
    (layer, x), (B, T) = start_at, tokens.shape
    if not (isinstance(layer, int) and 0 <= layer <= cfg.n_layers):
        raise QkovError(f"start_at: layer must be in 0..{cfg.n_layers}, got {layer!r}")
    if tuple(x.shape) != (B, T, cfg.d_model):
        raise QkovError(f"start_at: expected a stream of shape [{B}, {T}, {cfg.d_model}], got {list(x.shape)}")
    if x.device != source.device or x.dtype != source.dtype:
        raise QkovError("start_at: the stream must be on the source's device and dtype")


_OLD = {"run": ("qkov.analysis.forward.trace", lambda: trace), "Run": ("qkov.analysis.forward.Trace", lambda: Trace)}
__getattr__ = module_getattr(__name__, _OLD)
