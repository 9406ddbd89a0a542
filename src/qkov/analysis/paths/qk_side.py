"""The QK side of the path expansion: one head's pre-softmax scores split by where its query
and key inputs came from ([F], "Two-Layer Attention-Only Transformers").

With the real recording's normalisation divisors frozen, a head's query and key inputs are sums
of stream components: the direct path (token embedding, plus positions where they enter the
query/key input), each earlier head's output, and everything else (biases, MLP outputs).
The bilinear score then splits into direct x direct, Q-composition (query from an earlier
head), K-composition (key from an earlier head), both, and the rest. Everything is read off
one :func:`qkov.analysis.forward.tracer.trace` that recorded each head's output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ...model.bus import require_sum_residual
from ...model import rotary
from ...weights.parts import WeightSource, check_head
from ...weights.convert import SourceLike, as_source
from ..forward.cache import Trace
from ..forward.frozen import read
from ..forward.frozen import frozen_recording

__all__ = ["expand_qk", "QKExpansion"]


@dataclass
class QKExpansion:
    """Pre-softmax scores of one head split by where its query and key inputs came from.

    Components of the stream at the head's layer: ``direct`` (embedding, and positions
    for the query/key input), each earlier head's output, and ``other`` (biases, MLP
    outputs). Score terms ``[B, T, T]`` (pre-softmax, scaled by 1/sqrt(d_head), unmasked):
    ``direct`` (direct query x direct key), ``q_comp[i]`` (query from earlier head i x
    direct key), ``k_comp[i]`` (direct query x key from earlier head i), ``qk_comp``
    (both from earlier heads, summed over pairs; :meth:`qk_pair` / :meth:`qk_pairs` give each
    pair ``(i, j)``: query from head i, key from head j), ``other`` (everything involving biases
    or MLPs). Their sum is the real score matrix.
    """

    layer: int
    head: int
    earlier: list[str]
    direct: Tensor
    q_comp: Tensor  # [n_earlier, B, T, T]
    k_comp: Tensor  # [n_earlier, B, T, T]
    qk_comp: Tensor
    other: Tensor
    scores: Tensor  # the real scores, for reference
    q_heads: Tensor  # [n_earlier, B, T, d_head]: the query part each earlier head's output gives
    k_heads: Tensor  # [n_earlier, B, T, d_head]: the key part

    def total(self) -> Tensor:
        return self.direct + self.q_comp.sum(0) + self.k_comp.sum(0) + self.qk_comp + self.other

    def qk_pair(self, i: int, j: int) -> Tensor:
        """``[B, T, T]``: the score term with the query from earlier head ``i`` and the key from
        earlier head ``j`` (``earlier[i]``, ``earlier[j]``); summed over all pairs it is ``qk_comp``."""
        return (self.q_heads[i] @ self.k_heads[j].transpose(-1, -2)) / math.sqrt(self.q_heads.shape[-1])

    def qk_pairs(self) -> Tensor:
        """Every pair's term ``[n_earlier (query head), n_earlier (key head), B, T, T]``."""
        q, k = self.q_heads[:, None], self.k_heads[None]
        return (q @ k.transpose(-1, -2)) / math.sqrt(self.q_heads.shape[-1])


def _components(
    source: WeightSource, tokens: Tensor, layer: int
) -> tuple[Tensor, list[Tensor], list[str], Tensor, Trace]:
    """The stream at ``layer``'s query/key input as direct + per-head outputs + other, and the recording."""
    cfg = source.cfg
    r = frozen_recording(source, tokens, cache=("head_out.*",))
    T = r.tokens.shape[1]
    direct = source.embed()[r.tokens]
    if cfg.positional in ("standard", "shortformer"):
        direct = direct + source.pos()[:T]  # type: ignore[index]  # shortformer: positions enter the query/key input only
    other = torch.zeros_like(direct)  # the stream's bias/MLP part
    comps: list[Tensor] = []
    labels: list[str] = []
    for l in range(layer):
        att = source.attention(l)
        # each head's output on the real recording; b_V moves to `other` (patterns are row-stochastic,
        # so a head's b_V contributes exactly b_V @ W_O at every position)
        b_v = torch.einsum("he,hed->hd", att.b_V, att.W_O)  # [H, D]
        for h in range(cfg.n_heads):
            comps.append(r["head_out", l][:, :, h] - b_v[h])  # head_out [B, T, H, D]
            labels.append(f"{l}.{h}")
        other = other + b_v.sum(0) + att.b_O
        if cfg.d_mlp is not None:
            other = other + r["mlp_out", l]
    return direct, comps, labels, other, r


def expand_qk(source: SourceLike, tokens: Tensor, layer: int, head: int) -> QKExpansion:
    """Expand head ``layer.head``'s attention scores over earlier heads (Q-, K-, Q-and-K-composition)."""
    source = as_source(source, where="qkov.expand_qk")
    require_sum_residual(source.cfg, "the QK expansion")
    check_head(source.cfg, layer, head)
    direct, comps, labels, other, r = _components(source, tokens, layer)
    att = source.attention(layer, head)
    scale_qk = r.divisor("attn_qk", layer)

    def proj(x: Tensor, W: Tensor) -> Tensor:
        return read(x, source.norm, scale_qk) @ W

    WQ, WK = att.W_Q[0], att.W_K[0]
    scale = 1 / math.sqrt(source.cfg.d_head)
    qd, kd = proj(direct, WQ), proj(direct, WK)
    qo, ko = proj(other, WQ) + att.b_Q[0], proj(other, WK) + att.b_K[0]
    qh = torch.stack([proj(c, WQ) for c in comps]) if comps else qd.new_zeros(0, *qd.shape)
    kh = torch.stack([proj(c, WK) for c in comps]) if comps else kd.new_zeros(0, *kd.shape)
    if source.cfg.positional == "rotary":  # rotation is linear: each part turns by its position
        cos, sin = rotary.tables(source.cfg, qd.shape[-2], qd.device, qd.dtype)
        qd, kd, qo, ko, qh, kh = (rotary.rotate(x, cos, sin) for x in (qd, kd, qo, ko, qh, kh))

    def s(a: Tensor, b: Tensor) -> Tensor:
        return (a @ b.transpose(-1, -2)) * scale

    q_all_heads, k_all_heads = qh.sum(0), kh.sum(0)
    q_real, k_real = qd + q_all_heads + qo, kd + k_all_heads + ko
    empty = qd.new_zeros(0, *s(qd, kd).shape)
    return QKExpansion(
        layer=layer,
        head=head,
        earlier=labels,
        direct=s(qd, kd),
        q_comp=torch.stack([s(q, kd) for q in qh]) if comps else empty,
        k_comp=torch.stack([s(qd, k) for k in kh]) if comps else empty,
        qk_comp=s(q_all_heads, k_all_heads),
        other=s(qo, k_real) + s(q_real - qo, ko),
        scores=s(q_real, k_real),
        q_heads=qh,
        k_heads=kh,
    )
