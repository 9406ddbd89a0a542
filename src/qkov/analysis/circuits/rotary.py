"""QK circuits of rotary heads: the score as a function of the offset between query and key.

A rotary head (Pythia, Llama, Mistral, Qwen2) has no single ``W_QK``: a query at position ``i``
and a key at ``j`` score ``q R_delta k^T / sqrt(d_head)`` with ``delta = i - j`` and ``R_delta``
the relative rotation (:func:`qkov.model.rotary.relative_rotation`). So each head has one QK
circuit per offset, ``W_QK(delta) = W_Q R_delta W_K^T``, still of rank ``d_head`` and still
factored: nothing ``d_vocab x d_vocab`` is built.

* :func:`offset_qk` — the direct-path score table ``[query token, key token]`` at one offset:
  each embedding row through the layer's normalisation (its divisor computed from the row
  itself), ``W_Q``/``W_K`` and their biases, the rotation and the ``1/sqrt(d_head)`` scale.
  For a layer-0 head it is exactly the model's pre-softmax score of any query/key pair at that
  offset (tested against the forward); for later heads it is the direct path's part.
* :func:`offset_profile` — the positional part of a head from its weights alone: the mean of
  :func:`offset_qk` over all (query token, key token) pairs, i.e. the expected score at offset
  ``delta`` of two independent uniformly drawn tokens, for every offset. A previous-token head
  peaks at ``delta = 1``.
* :func:`default_offsets` — the stated offset set the offset-averaged analyses use (Q- and
  K-composition of rotary models, the QK side of skip-trigrams): 0, 1, 2, 4, ... up to the
  context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...errors import QkovError
from ...model import rotary
from ...model.config import ModelConfig
from ...model.ops import normalize
from ...weights.parts import WeightSource, check_head
from ...weights.convert import SourceLike, as_source
from .factored import LowRank
from .vocab import embed_product

__all__ = [
    "check_offsets",
    "default_offsets",
    "MAX_DEFAULT_OFFSET",
    "mean_input",
    "offset_profile",
    "offset_qk",
    "OffsetProfiles",
    "profiles",
    "resolve_offsets",
    "rotations",
]

MAX_DEFAULT_OFFSET = 1024


def default_offsets(n_ctx: int, largest: int = MAX_DEFAULT_OFFSET) -> list[int]:
    """``[0, 1, 2, 4, 8, ...]`` up to ``min(n_ctx - 1, largest)``: near offsets densely, far ones
    sparsely (a previous-token head lives at 1, an induction head's key anywhere before the query)."""
    top = min(n_ctx - 1, largest)
    out, d = [0], 1
    while d <= top:
        out.append(d)
        d *= 2
    return out


def check_offsets(n_ctx: int, offsets: list[int]) -> list[int]:
    """Offsets as a list of ints in ``0 .. n_ctx - 1`` (a query never sees a later key), or a one-line error."""
    out = [int(d) for d in offsets]
    bad = [d for d in out if not 0 <= d < n_ctx]
    if not out or bad:
        raise QkovError(f"offsets must lie in 0 .. {n_ctx - 1} (a query sees only earlier keys), got {bad or 'none'}")
    return out


def _rotary_source(source: WeightSource) -> None:
    if source.cfg.positional != "rotary":
        raise QkovError(
            "offset QK circuits are for rotary models; this model's QK circuit does not depend on the offset"
        )


def _read_rows(source: WeightSource, rows: Tensor) -> Tensor:
    """Embedding rows ``[n, D]`` as a first-layer reader sees them: normalised row by row."""
    if source.norm == "none":
        return rows
    if source.norm in ("layernorm", "rmsnorm"):
        raise QkovError("offset QK circuits need a weights view with the normalisation folded (fold_ln=True)")
    return normalize(rows, source.norm, source.cfg.ln_eps)[0]


def offset_qk(source: WeightSource, layer: int, head: int, delta: int) -> LowRank:
    """The direct-path score table of head ``layer.head`` at offset ``delta`` (query ``delta``
    positions after the key): ``[d_vocab (query token), d_vocab (key token)]``, factored as
    ``(x W_Q + b_Q) R_delta / sqrt(d_head)`` times ``(x W_K + b_K)^T`` with ``x`` the normalised
    embedding rows. Exactly the pre-softmax score for a layer-0 head."""
    _rotary_source(source)
    check_head(source.cfg, layer, head)
    (delta,) = check_offsets(source.cfg.n_ctx, [delta])
    att = source.attention(layer, head)
    read = lambda rows: _read_rows(source, rows)  # noqa: E731
    q, k = embed_product(source, torch.cat([att.W_Q[0], att.W_K[0]], -1), rows=read).split(att.W_Q.shape[-1], -1)
    q, k = q + att.b_Q[0], k + att.b_K[0]
    R = rotary.relative_rotation(source.cfg, delta, dtype=q.dtype).to(q.device)
    return LowRank(q @ R / math.sqrt(source.cfg.d_head), k.T)


def mean_input(source: WeightSource, block: int = 4096) -> Tensor:
    """The mean over the vocabulary of the normalised embedding rows ``[D]`` (read in blocks of
    ``block`` rows from a streamed source)."""
    V = source.cfg.d_vocab
    if source.in_memory:
        return _read_rows(source, source.embed()).mean(0)
    total = None
    for lo in range(0, V, block):
        part = _read_rows(source, source.embed(slice(lo, min(V, lo + block)))).sum(0)
        total = part if total is None else total + part
    assert total is not None
    return total / V


def offset_profile(
    source: WeightSource,
    layer: int,
    head: int | None = None,
    offsets: list[int] | None = None,
    *,
    mean_x: Tensor | None = None,
) -> Tensor:
    """The positional part of rotary heads from their weights alone: for each offset, the mean of
    :func:`offset_qk` over every (query token, key token) pair, i.e. ``mean_a(q_a) R_delta
    mean_b(k_b)^T / sqrt(d_head)``. ``offsets`` default ``0 .. min(n_ctx - 1, 64)``. Returns
    ``[n_heads, n_offsets]`` (or ``[n_offsets]`` for one ``head``)."""
    _rotary_source(source)
    cfg = source.cfg
    check_head(cfg, layer, head)
    offsets = check_offsets(cfg.n_ctx, offsets if offsets is not None else list(range(min(cfg.n_ctx, 65))))
    att = source.attention(layer, head)
    if mean_x is None:
        mean_x = mean_input(source)  # [D]: the mean of the normalised rows
    q = mean_x @ att.W_Q + att.b_Q  # [h, E]
    k = mean_x @ att.W_K + att.b_K
    R = rotary.relative_rotation(cfg, torch.tensor(offsets), dtype=q.dtype).to(q.device)  # [n, E, E]
    out = torch.einsum("he,nef,hf->hn", q, R, k) / math.sqrt(cfg.d_head)
    return out[0] if head is not None else out


def resolve_offsets(cfg: ModelConfig, offsets: list[int] | None) -> list[int] | None:
    """The offset set an offset-averaged analysis uses: ``offsets`` checked, or
    :func:`default_offsets`; ``None`` for a model without rotary positions (where giving offsets
    is an error)."""
    if cfg.positional != "rotary":
        if offsets is not None:
            raise QkovError("offsets apply to rotary models only")
        return None
    return check_offsets(cfg.n_ctx, offsets if offsets is not None else default_offsets(cfg.n_ctx))


def rotations(source: WeightSource, offsets: list[int] | None) -> Tensor | None:
    """``R_delta [n, E, E]`` for the offsets :func:`resolve_offsets` gives, in the source's dtype,
    or ``None`` for a model without rotary positions."""
    used = resolve_offsets(source.cfg, offsets)
    if used is None:
        return None
    return rotary.relative_rotation(source.cfg, torch.tensor(used), dtype=source.dtype).to(source.device)


@dataclass
class OffsetProfiles:
    """Every head's weights-only offset profile (:func:`offset_profile`) over ``offsets``:
    ``scores [L, H, n]``, and per head the preferred offset and how far its score stands above the
    median over offsets (in score units: logits before the softmax)."""

    offsets: list[int]
    scores: Tensor

    @property
    def peak(self) -> Tensor:
        """``[L, H]`` the offset each head prefers most."""
        return torch.tensor(self.offsets)[self.scores.argmax(-1)]

    @property
    def height(self) -> Tensor:
        """``[L, H]`` the best score minus the median score over the offsets."""
        return self.scores.max(-1).values - self.scores.median(-1).values

    def to_dict(self) -> dict[str, Any]:
        L, H = self.scores.shape[:2]
        heads = [
            {"head": f"{l}.{h}", "peak_offset": int(self.peak[l, h]), "height": float(self.height[l, h])}
            for l in range(L)
            for h in range(H)
        ]
        return {"offsets": self.offsets, "heads": heads, "scores": self.scores.tolist()}


def profiles(source: SourceLike, offsets: list[int] | None = None) -> OffsetProfiles:
    """:func:`offset_profile` of every head (offsets default ``0 .. min(n_ctx - 1, 64)``)."""
    source = as_source(source, where="qkov.rotary_circuits.profiles")
    _rotary_source(source)
    cfg = source.cfg
    offsets = check_offsets(cfg.n_ctx, offsets if offsets is not None else list(range(min(cfg.n_ctx, 65))))
    mean_x = mean_input(source)
    scores = torch.stack([offset_profile(source, l, offsets=offsets, mean_x=mean_x) for l in range(cfg.n_layers)])
    return OffsetProfiles(offsets, scores.float().cpu())
