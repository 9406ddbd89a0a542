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

__all__ = ["HeadProjector", "project_heads_of"]


class HeadProjector:
    """Queries, keys or values of heads of ``layer``, each from an input of its own: row ``i`` is the
    ``kinds[i]`` (``q``, ``k`` or ``v``; one kind for every row) of head ``slots[i]`` (a key/value head for
    ``k``, ``v``), queries and keys before values. The weights are picked once and applied to any number of
    inputs (a pass's chunks of tokens). ``fused``: normalise with torch's fused kernels."""

    def __init__(
        self, source: WeightSource, layer: int, kinds: str | Sequence[str], slots: Sequence[int] | Tensor,
        *, fused: bool = False,
    ) -> None:  # fmt: skip
        cfg, att = source.cfg, source.attention(layer, expand_kv=False)
        slots = slots.tolist() if isinstance(slots, Tensor) else list(slots)
        kinds = [kinds] * len(slots) if isinstance(kinds, str) else list(kinds)
        self.source, self.cfg, self.fused, self.ln = source, cfg, fused, (att.ln_w, att.ln_b)
        self.n_qk = sum(k != "v" for k in kinds)  # the rows that read the positions
        assert "v" not in kinds[: self.n_qk], "queries and keys come before values"
        by = {"q": (att.W_Q, att.b_Q), "k": (att.W_K, att.b_K), "v": (att.W_V, att.b_V)}
        self.W = torch.stack([by[k][0][h] for k, h in zip(kinds, slots)]) if slots else att.W_Q[:0]
        live = all(by[k][1] is not None for k in set(kinds))
        self.bias = torch.stack([by[k][1][h] for k, h in zip(kinds, slots)]) if live and slots else None  # type: ignore[index]

    def __call__(self, xs: Tensor, positions: Tensor | None = None, *, shared: bool = False) -> Tensor:
        """``[n, ..., P, E]`` from inputs ``xs [n, ..., P, D]`` (``shared``: one input ``[..., P, D]`` every
        head reads, normalised once; one kind) at ``positions [P]`` (default ``0 .. P-1``)."""
        cfg, P, n, k = self.cfg, xs.shape[-2], self.W.shape[0], self.n_qk
        pos = self.source.pos() if k else None
        if pos is not None:
            pos = pos[:P] if positions is None else pos[positions]
            qk = query_key_stream(xs if shared or k == n else xs[:k], pos, cfg.positional)
            xs = qk if shared or k == n else torch.cat([qk, xs[k:]])
        w, b = self.ln
        normed = _fused(xs, self.source.norm, cfg.ln_eps, w, b) if self.fused else normalize(
            xs, self.source.norm, cfg.ln_eps, w=w, b=b
        )[0]
        D, E = self.W.shape[1:]
        lead = normed.shape[:-1] if shared else normed.shape[1:-1]
        if shared:
            out = (normed.reshape(-1, D) @ self.W.permute(1, 0, 2).reshape(D, n * E)).view(-1, n, E).transpose(0, 1)
        else:
            out = torch.bmm(normed.reshape(n, -1, D), self.W)
        out = out.reshape(n, *lead, E)
        if self.bias is not None:
            out = out + self.bias.view(n, *[1] * len(lead), E)
        if k and cfg.positional == "rotary":
            last = P if positions is None else int(positions.max()) + 1
            cos, sin = rotary.tables(cfg, last, xs.device, xs.dtype)
            if positions is not None:
                cos, sin = cos[positions], sin[positions]
            out = rotary.rotate(out, cos, sin) if k == n else torch.cat([rotary.rotate(out[:k], cos, sin), out[k:]])
        return out


def project_heads_of(
    source: WeightSource,
    layer: int,
    kind: str,
    slots: Sequence[int] | Tensor,
    xs: Tensor,
    *,
    fused: bool = False,
    positions: Tensor | None = None,
) -> Tensor:
    """``[n, B, T, E]``: the ``kind`` (``q``, ``k`` or ``v``) of head ``slots[i]`` of ``layer`` (a key/value
    head for ``k``, ``v``) computed from its own input ``xs[i]`` (``xs [n, B, T, D]``), or from one input
    ``xs [B, T, D]`` they all read (normalised once). ``fused``: normalise with torch's fused kernels.
    ``positions [T]``: the positions ``xs`` holds (default ``0 .. T-1``), for the positional terms."""
    return HeadProjector(source, layer, kind, slots, fused=fused)(xs, positions, shared=xs.ndim == 3)


def _fused(x: Tensor, kind: str, eps: float, w: Tensor | None, b: Tensor | None) -> Tensor:
    """:func:`~qkov.model.ops.normalize` of ``x [..., D]`` by torch's fused kernels."""
    D = (x.shape[-1],)
    if kind == "none":
        return x
    if kind in ("layernorm", "folded"):
        return F.layer_norm(x, D, w if kind == "layernorm" else None, b if kind == "layernorm" else None, eps)
    return F.rms_norm(x, D, w if kind == "rmsnorm" else None, eps)
