"""QK and OV circuits and virtual weights.

Row convention throughout (docs/conventions.md): activations are rows, ``x @ W``. Per head
``W_QK = W_Q @ W_K^T`` and ``W_OV = W_V @ W_O`` (both ``[d_model, d_model]``, rank <=
d_head). Full circuits are indexed ``[query or source token, key or output token]``:

* full OV ``W_E @ W_OV @ W_U`` — ``[source token attended to, output logit]``;
* full QK ``W_E @ W_QK @ W_E^T`` — ``[query (destination) token, key (source) token]``;
* positional QK ``W_pos @ W_QK @ W_pos^T`` — ``[query position, key position]``, and
  the two cross terms ``[query token, key position]`` / ``[query position, key token]``.

Gated attention (``cfg.gate``; docs/architectures.md): a head's write at a query is scaled by its
input-dependent gate ``g`` in ``(0, 1)``, so the OV circuits here are the ungated ``W_V W_O``, exact
only with the gate frozen at 1; the OV circuit a query applies is ``g W_OV`` (headwise) or
``W_V diag(g) W_O`` (elementwise): :func:`qkov.analysis.heads.gates.effective_ov`. The QK circuits are
unaffected (the gate acts after the softmax).

Every function reads a :class:`~qkov.weights.WeightSource`, so the same code serves the
in-memory view and a memory-mapped checkpoint: per-layer work reads one layer at a time,
and nothing ``d_vocab x d_vocab`` is built (:class:`~qkov.analysis.circuits.factored.LowRank`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ...errors import QkovError
from ...weights.parts import WeightSource, check_head
from ...weights.convert import SourceLike, as_source
from .factored import LowRank
from .vocab import VOCAB_BLOCK, embed_product, unembed_product

__all__ = [
    "Component",
    "full_ov",
    "full_qk",
    "ov",
    "positional_qk",
    "qk",
    "token_position_qk",
    "unembed_embed",
    "virtual_weights",
]


def _positions(source: WeightSource) -> Tensor:
    pos = source.pos()
    if pos is None:
        raise QkovError("this model has no positional embedding")
    return pos


def _not_rotary(source: WeightSource) -> None:
    if source.cfg.positional == "rotary":
        raise QkovError(
            "rotary positions: a head's QK circuit depends on the offset between query and key; "
            "use qkov.analysis.circuits.rotary.offset_qk (one offset) or offset_profile"
        )


def qk(source: SourceLike) -> LowRank:
    """``W_QK = W_Q @ W_K^T`` for every head: ``[n_layers, n_heads, d_model, d_model]`` (not for
    rotary models: see :mod:`qkov.analysis.circuits.rotary`)."""
    source = as_source(source, where="qkov.qk")
    _not_rotary(source)
    atts = [source.attention(l) for l in range(source.cfg.n_layers)]
    return LowRank(torch.stack([a.W_Q for a in atts]), torch.stack([a.W_K for a in atts]).transpose(-1, -2))


def ov(source: SourceLike) -> LowRank:
    """``W_OV = W_V @ W_O`` for every head: ``[n_layers, n_heads, d_model, d_model]``."""
    source = as_source(source, where="qkov.ov")
    atts = [source.attention(l) for l in range(source.cfg.n_layers)]
    return LowRank(torch.stack([a.W_V for a in atts]), torch.stack([a.W_O for a in atts]))


def full_ov(source: SourceLike, layer: int, head: int) -> LowRank:
    """``W_E @ W_OV @ W_U``: ``[d_vocab (source token), d_vocab (output logit)]``."""
    source = as_source(source, where="qkov.full_ov")
    att = source.attention(layer, head)
    return LowRank(embed_product(source, att.W_V[0]), unembed_product(source, att.W_O[0]))


def full_qk(source: SourceLike, layer: int, head: int) -> LowRank:
    """``W_E @ W_QK @ W_E^T``: ``[d_vocab (query token), d_vocab (key token)]`` (token part of the score)."""
    source = as_source(source, where="qkov.full_qk")
    _not_rotary(source)
    att = source.attention(layer, head)
    EQ, EK = embed_product(source, torch.cat([att.W_Q[0], att.W_K[0]], -1)).split(att.W_Q.shape[-1], -1)
    return LowRank(EQ, EK.T)


def positional_qk(source: SourceLike, layer: int, head: int) -> LowRank:
    """``W_pos @ W_QK @ W_pos^T``: ``[query position, key position]``."""
    source = as_source(source, where="qkov.positional_qk")
    att = source.attention(layer, head)
    P = _positions(source)
    return LowRank(P @ att.W_Q[0], (P @ att.W_K[0]).T)


def token_position_qk(source: SourceLike, layer: int, head: int) -> tuple[LowRank, LowRank]:
    """Cross terms ``[query token, key position]`` and ``[query position, key token]``.

    With positions p and tokens e, the score ``(e_q + p_i) W_QK (e_k + p_j)^T`` is
    token-token + token-position + position-token + position-position.
    """
    source = as_source(source, where="qkov.token_position_qk")
    att = source.attention(layer, head)
    P, W_E = _positions(source), source.embed()
    Q, K = att.W_Q[0], att.W_K[0]
    return LowRank(W_E @ Q, (P @ K).T), LowRank(P @ Q, (W_E @ K).T)


Component = tuple  # ("embed",) ("pos",) ("head", l, h) ("mlp", l) ("q"|"k"|"v", l, h) ("unembed",)


def _order(kind: str, index: tuple, parallel: bool = False) -> float:
    """Where a component sits in the model: embeddings first, layer l's attention at 2l, its MLP
    at 2l + 1 (at 2l too in a parallel block: it reads the stream attention reads), the
    unembedding last."""
    layer = index[0] if index else 0
    mlp = 2 * layer + (0 if parallel else 1)
    return {"embed": -1.0, "pos": -1.0, "mlp": mlp, "unembed": math.inf}.get(kind, 2 * layer)


def virtual_weights(source: SourceLike, writer: Component, reader: Component) -> LowRank:
    """The virtual weight ``writer_out @ reader_in`` between two components through the stream.

    Writers: ``("embed",)`` (W_E), ``("pos",)`` (W_pos), ``("head", l, h)`` (W_O),
    ``("mlp", l)`` (W_out). Readers: ``("q"|"k"|"v", l, h)`` (W_Q/W_K/W_V), ``("mlp", l)``
    (W_in), ``("unembed",)`` (W_U). The reader must come later in the model than the
    writer, and in a shortformer model positions reach only the query and key readers (they
    never enter the stream). Returned factored, ``[writer dims, reader dims]`` with inner
    ``d_model``; only the two components involved are read.
    """
    source = as_source(source, where="qkov.virtual_weights")
    wk, *wi = writer
    rk, *ri = reader
    if wk not in ("embed", "pos", "head", "mlp"):
        raise QkovError(f"unknown writer {writer!r}")
    if rk not in ("q", "k", "v", "mlp", "unembed"):
        raise QkovError(f"unknown reader {reader!r}")
    if wk == "head":
        check_head(source.cfg, *wi)
    if rk in ("q", "k", "v"):
        check_head(source.cfg, *ri)
    if wk == "mlp" or rk == "mlp":
        if source.cfg.d_mlp is None:
            raise QkovError("this model has no MLP")
        check_head(source.cfg, (wi if wk == "mlp" else ri)[0])
    par = source.cfg.parallel
    if _order(wk, tuple(wi), par) >= _order(rk, tuple(ri), par):
        raise QkovError(f"{reader!r} does not come after {writer!r}: no virtual weight")
    if wk == "pos" and rk not in ("q", "k") and source.cfg.positional == "shortformer":
        raise QkovError(f"shortformer positions enter only the query/key input: no virtual weight to {reader!r}")
    if wk == "embed":
        out = source.embed()
    elif wk == "pos":
        out = _positions(source)
    elif wk == "head":
        out = source.attention(wi[0], wi[1]).W_O[0]
    else:
        out = source.mlp(wi[0]).W_out  # type: ignore[union-attr]
    if rk in ("q", "k", "v"):
        inp = getattr(source.attention(ri[0], ri[1]), f"W_{rk.upper()}")[0]
    elif rk == "mlp":
        inp = source.mlp(ri[0]).W_in  # type: ignore[union-attr]
    else:
        inp = source.unembed().W_U
    return LowRank(out, inp)


def unembed_embed(source: SourceLike, *, block: int = VOCAB_BLOCK) -> Tensor:
    """``W_U @ W_E [d_model, d_model]``: one product in memory; for a streamed source, summed
    over blocks of ``block`` tokens so that neither matrix is held whole."""
    source = as_source(source, where="qkov.unembed_embed")
    if source.in_memory:
        return source.unembed().W_U @ source.embed()
    V, D = source.cfg.d_vocab, source.cfg.d_model
    G = torch.zeros(D, D, device=source.device, dtype=source.dtype)
    for lo in range(0, V, block):
        rows = slice(lo, min(V, lo + block))
        G += source.unembed(cols=rows).W_U @ source.embed(rows)
    return G
