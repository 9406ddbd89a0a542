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
import torch.nn.functional as F
from torch import Tensor

from ...model import rotary
from ...model.ops import normalize, query_key_stream
from ...weights.parts import WeightSource

__all__ = ["project_heads_of"]


def project_heads_of(
    source: WeightSource, layer: int, kind: str, slots: Sequence[int], xs: Tensor, *, fused: bool = False
) -> Tensor:
    """``[n, B, T, E]``: the ``kind`` (``q``, ``k`` or ``v``) of head ``slots[i]`` of ``layer`` (a key/value
    head for ``k``, ``v``) computed from its own input ``xs[i]`` (``xs [n, B, T, D]``), or from one input
    ``xs [B, T, D]`` they all read (normalised once). ``fused``: normalise with torch's fused kernels."""
    cfg, att = source.cfg, source.attention(layer, expand_kv=False)
    T = xs.shape[-2]
    if kind != "v":
        pos = source.pos()
        xs = query_key_stream(xs, None if pos is None else pos[:T], cfg.positional)
    normed = _fused(xs, source.norm, cfg.ln_eps, att.ln_w, att.ln_b) if fused else normalize(
        xs, source.norm, cfg.ln_eps, w=att.ln_w, b=att.ln_b
    )[0]
    idx = torch.as_tensor(list(slots), device=xs.device, dtype=torch.long)
    W, bias = {"q": (att.W_Q, att.b_Q), "k": (att.W_K, att.b_K), "v": (att.W_V, att.b_V)}[kind]
    shared = "btd" if normed.ndim == 3 else "nbtd"
    out = torch.einsum(f"{shared},nde->nbte", normed, W[idx]) + bias[idx][:, None, None]
    if kind != "v" and cfg.positional == "rotary":
        cos, sin = rotary.tables(cfg, T, xs.device, xs.dtype)
        out = rotary.rotate(out, cos, sin)
    return out


def _fused(x: Tensor, kind: str, eps: float, w: Tensor | None, b: Tensor | None) -> Tensor:
    """:func:`~qkov.model.ops.normalize` of ``x [..., D]`` by torch's fused kernels."""
    D = (x.shape[-1],)
    if kind == "none":
        return x
    if kind in ("layernorm", "folded"):
        return F.layer_norm(x, D, w if kind == "layernorm" else None, b if kind == "layernorm" else None, eps)
    return F.rms_norm(x, D, w if kind == "rmsnorm" else None, eps)
