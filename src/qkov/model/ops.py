"""The operations every forward pass shares, each defined once: causal mask, activations,
normalisation, attention pattern, next-token loss.

The training model (:mod:`qkov.model.transformer`) and the analysis forward
(:mod:`qkov.analysis.forward`) both call these, so the two passes cannot drift apart.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_mask(seq: int, device: torch.device | str | None = None) -> Tensor:
    """``[seq, seq]`` booleans, ``True`` where a query may **not** see a key (keys after the query)."""
    return torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)


def attention_scores(q: Tensor, k: Tensor) -> Tensor:
    """Pre-softmax scores ``q k^T / sqrt(d_head)``: ``q [..., query, d_head]``, ``k [..., key, d_head]`` ->
    ``[..., query, key]`` (not masked)."""
    return (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])


def attention_pattern(scores: Tensor) -> Tensor:
    """Causal softmax of ``scores [..., query, key]`` over keys: each query's row sums to one over
    the keys at or before it, and is zero after it."""
    seq = scores.shape[-1]
    return torch.softmax(scores.masked_fill(causal_mask(seq, scores.device), float("-inf")), dim=-1)


def activation(name: str, x: Tensor) -> Tensor:
    """The MLP non-linearity ``name`` (one of :data:`qkov.model.config.ACTIVATION_CHOICES`)."""
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_new":  # GPT-2's tanh approximation
        return F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu(x)
    if name == "silu":  # x * sigmoid(x), the gate of Llama-family MLPs
        return F.silu(x)
    raise ValueError(f"unknown activation {name!r}")


def centre(x: Tensor) -> Tensor:
    """``x`` minus its mean over the last (``d_model``) dimension."""
    return x - x.mean(dim=-1, keepdim=True)


def norm_scale(x: Tensor, kind: str, eps: float) -> Tensor:
    """The divisor a normalisation applies to ``x [..., d_model]``, ``[..., 1]``.

    LayerNorm (``layernorm``, ``folded``): ``sqrt(var(x) + eps)``; RMS (``rmsnorm``, ``scale``):
    ``sqrt(mean(x^2) + eps)``.
    """
    if kind in ("scale", "rmsnorm"):
        return torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return torch.sqrt(x.var(dim=-1, unbiased=False, keepdim=True) + eps)


def normalize(
    x: Tensor,
    kind: str,
    eps: float,
    *,
    scale: Tensor | None = None,
    w: Tensor | None = None,
    b: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Normalise ``x [..., d_model]`` as a weights view says (see :class:`qkov.weights.Weights`).

    ``kind``: ``none`` (identity), ``layernorm`` (centre, divide, then gain ``w`` and bias
    ``b``), ``folded`` (centre and divide: the gain and bias live in the readers), ``rmsnorm``
    (divide by the RMS, then gain ``w``: no centring, no bias), ``scale`` (divide by the RMS: a
    folded RMSNorm, or a folded, centred and rotated LayerNorm view). ``scale`` given (``[..., 1]``)
    freezes the divisor instead of computing it from ``x``. Returns the normalised stream and
    the divisor used (``None`` for ``none``).
    """
    if kind == "none":
        return x, None
    s = norm_scale(x, kind, eps) if scale is None else scale
    out = (x if kind in ("scale", "rmsnorm") else centre(x)) / s
    if kind == "layernorm":
        out = out * w + b
    elif kind == "rmsnorm":
        out = out * w
    return out, s


def next_token_nll(logits: Tensor, tokens: Tensor, *, dtype: torch.dtype | None = None) -> Tensor:
    """Per-position next-token loss ``[batch, seq - 1]``: position ``i`` predicting token ``i + 1``.

    ``logits [batch, seq, d_vocab]``, ``tokens [batch, seq]``. Computed in ``dtype`` (default:
    float32, or float64 for float64 logits).
    """
    if dtype is None:
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logp = torch.log_softmax(logits[:, :-1].to(dtype), dim=-1)
    return -logp.gather(-1, tokens[:, 1:, None].to(logp.device))[..., 0]


def next_token_loss(logits: Tensor, tokens: Tensor, *, dtype: torch.dtype | None = None) -> Tensor:
    """Mean of :func:`next_token_nll`: the language-model loss (a scalar tensor, in nats)."""
    return next_token_nll(logits, tokens, dtype=dtype).mean()
