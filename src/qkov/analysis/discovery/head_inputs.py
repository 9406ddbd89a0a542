"""A head's query, key or value computed from an input of its own.

When an edge into a head is patched, that head alone reads a changed stream: its query (key, value) is
``normalise(x) W + b`` of its own input ``x`` (shortformer positions added for queries and keys, rotary
positions applied), while the other heads read the stream as it is. :func:`project_heads_of` computes it
for a few heads at once, so a patched pass can write it into the ``q`` / ``k`` / ``v`` site instead of
giving every head its own copy of the stream (what the ``q_input`` sites do, ``H`` times a layer's
stream). Tested against those sites through exact edge patching and circuit evaluation.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from ...model import rotary
from ...model.ops import normalize, query_key_stream
from ...weights.parts import WeightSource

__all__ = ["project_all_heads", "project_heads_of"]


def project_heads_of(source: WeightSource, layer: int, kind: str, slots: Sequence[int], xs: Tensor) -> Tensor:
    """``[n, B, T, E]``: the ``kind`` (``q``, ``k`` or ``v``) of head ``slots[i]`` of ``layer`` (a key/value
    head for ``k``, ``v``) computed from its own input ``xs[i]`` (``xs [n, B, T, D]``)."""
    cfg, att = source.cfg, source.attention(layer, expand_kv=False)
    T = xs.shape[2]
    if kind != "v":
        pos = source.pos()
        xs = query_key_stream(xs, None if pos is None else pos[:T], cfg.positional)
    normed = normalize(xs, source.norm, cfg.ln_eps, w=att.ln_w, b=att.ln_b)[0]
    idx = torch.as_tensor(list(slots), device=xs.device, dtype=torch.long)
    W, bias = {"q": (att.W_Q, att.b_Q), "k": (att.W_K, att.b_K), "v": (att.W_V, att.b_V)}[kind]
    out = torch.einsum("nbtd,nde->nbte", normed, W[idx]) + bias[idx][:, None, None]
    if kind != "v" and cfg.positional == "rotary":
        cos, sin = rotary.tables(cfg, T, xs.device, xs.dtype)
        out = rotary.rotate(out, cos, sin)
    return out


def project_all_heads(source: WeightSource, layer: int, kind: str, x: Tensor) -> Tensor:
    """``[B, T, n, E]``: every head's ``kind`` (``q``, ``k`` or ``v``; ``n`` heads, or key/value heads) of
    ``layer`` computed from the one input ``x [B, T, D]``, normalised once."""
    cfg, att = source.cfg, source.attention(layer, expand_kv=False)
    T = x.shape[1]
    if kind != "v":
        pos = source.pos()
        x = query_key_stream(x, None if pos is None else pos[:T], cfg.positional)
    normed = normalize(x, source.norm, cfg.ln_eps, w=att.ln_w, b=att.ln_b)[0]
    W, bias = {"q": (att.W_Q, att.b_Q), "k": (att.W_K, att.b_K), "v": (att.W_V, att.b_V)}[kind]
    out = torch.einsum("btd,nde->bnte", normed, W) + bias[None, :, None]
    if kind != "v" and cfg.positional == "rotary":
        cos, sin = rotary.tables(cfg, T, x.device, x.dtype)
        out = rotary.rotate(out, cos, sin)
    return out.transpose(1, 2)
