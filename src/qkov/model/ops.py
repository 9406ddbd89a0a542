"""The operations every forward pass shares, each defined once: the embedding and where positions
enter, the per-head projections and grouped-query expansion, causal mask, attention pattern,
activations and the MLP, normalisation, next-token loss.

The training model (:mod:`qkov.model.transformer`) and the analysis forward
(:mod:`qkov.analysis.forward`) both call these, so the two passes cannot drift apart: adding an
architecture feature to the block is one edit here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend

__all__ = [
    "activation",
    "attention_scores",
    "causal_attention",
    "causal_mask",
    "centre",
    "embed",
    "expand_kv",
    "live_bias",
    "masked_scores",
    "mlp_hidden",
    "mlp_output",
    "mlp_preactivation",
    "next_token_loss",
    "next_token_nll",
    "norm_scale",
    "normalize",
    "positions",
    "project_heads",
    "query_key_stream",
    "score_divisor",
    "stream_start",
    "write_heads",
]


# ------------------------------------------------------------------ the block's pieces
def embed(tokens: Tensor, W_E: Tensor, W_pos: Tensor | None, offset: int = 0) -> tuple[Tensor, Tensor | None]:
    """The token embedding ``W_E[tokens]`` and the positions ``W_pos[offset : offset + seq]`` (``None``
    without learned positions) of ``tokens [batch, seq]`` standing at positions ``offset ..``:
    ``[batch, seq, d_model]`` and ``[seq, d_model]``."""
    return F.embedding(tokens, W_E), positions(W_pos, offset, tokens.shape[-1])


def positions(W_pos: Tensor | None, offset: int, seq: int) -> Tensor | None:
    """The learned positions ``W_pos[offset : offset + seq]`` of ``seq`` tokens standing after
    ``offset`` earlier ones: ``[seq, d_model]`` (``None`` without learned positions)."""
    return None if W_pos is None else W_pos[offset : offset + seq]


def stream_start(embedded: Tensor, pos: Tensor | None, positional: str) -> Tensor:
    """The residual stream before the first block: the embedding, plus the positions for
    ``standard`` positions (shortformer positions never enter the stream; rotary ones act on q, k)."""
    return embedded + pos if positional == "standard" else embedded  # type: ignore[operator]


def query_key_stream(x: Tensor, pos: Tensor | None, positional: str) -> Tensor:
    """The stream the queries and keys read, before normalisation: ``x`` plus the positions for
    ``shortformer`` positions (as the paper: positions enter the query/key input only), else ``x``."""
    return x + pos if positional == "shortformer" else x  # type: ignore[operator]


def project_heads(x: Tensor, W: Tensor, b: Tensor | None = None) -> Tensor:
    """``x [..., seq, d_model]`` through per-head ``W [heads, d_model, d_head]`` (plus ``b [heads,
    d_head]``) -> ``[..., heads, seq, d_head]``, as one matrix product."""
    h, d, e = W.shape
    out = x @ W.permute(1, 0, 2).reshape(d, h * e)
    out = out.view(*x.shape[:-1], h, e).transpose(-3, -2)
    return out if b is None else out + b[:, None, :]


def write_heads(z: Tensor, W_O: Tensor, b_O: Tensor | None = None) -> Tensor:
    """Concatenate-then-project ``z [batch, heads, seq, d_head]`` through ``W_O [heads, d_head,
    d_model]`` (plus ``b_O``) -> ``[batch, seq, d_model]``: the sum over heads of ``z[:, h] @ W_O[h]``."""
    h, e, d = W_O.shape
    out = z.transpose(-3, -2).reshape(*z.shape[:-3], z.shape[-2], h * e) @ W_O.reshape(h * e, d)
    return out if b_O is None else out + b_O


def live_bias(b: Tensor | None) -> Tensor | None:
    """``b``, or ``None`` for a bias of zeros on the CPU that needs no gradient: a weights view holds
    zeros for the biases a model does not have, and adding them changes no value (``x + 0 == x``) but
    costs a pass over an activation. On an accelerator the check would wait for the device: not made."""
    if b is None or b.device.type != "cpu" or b.requires_grad or bool(b.any()):
        return b
    return None


def expand_kv(x: Tensor, group: int, dim: int = 0) -> Tensor:
    """Grouped-query attention: key/value heads along ``dim`` repeated for the ``group`` query heads
    that read each (query head ``h`` reads key/value head ``h // group``); ``x`` itself when ``group == 1``."""
    return x if group == 1 else x.repeat_interleave(group, dim=dim)


def mlp_preactivation(
    x: Tensor, W_in: Tensor, b_in: Tensor | None, W_gate: Tensor | None = None, b_gate: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """An MLP's pre-activations ``[..., d_mlp]`` from its (normalised) input ``x [..., d_model]``:
    ``(x @ W_in + b_in, None)``, or for a gated MLP ``(x @ W_gate + b_gate, x @ W_in + b_in)``: the
    activation's input and the linear factor it multiplies."""
    linear = x @ W_in if b_in is None else x @ W_in + b_in
    if W_gate is None:
        return linear, None
    return (x @ W_gate if b_gate is None else x @ W_gate + b_gate), linear


def mlp_hidden(act_fn: str, pre: Tensor, linear: Tensor | None) -> Tensor:
    """The hidden activations ``act(pre)``, times ``linear`` for a gated MLP (Llama's SwiGLU)."""
    return activation(act_fn, pre) if linear is None else activation(act_fn, pre) * linear


def mlp_output(hidden: Tensor, W_out: Tensor, b_out: Tensor | None) -> Tensor:
    """What the MLP writes: ``hidden @ W_out + b_out``."""
    return hidden @ W_out if b_out is None else hidden @ W_out + b_out


# ------------------------------------------------------------------ attention
def causal_mask(seq: int, device: torch.device | str | None = None) -> Tensor:
    """``[seq, seq]`` booleans, ``True`` where a query may **not** see a key (keys after the query)."""
    return torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)


def score_divisor(d_head: int) -> float:
    """What attention divides ``q . k`` by: ``sqrt(d_head)``. The fused attention of the training model
    and of the analysis forward scales by its inverse, the explicit scores divide by it: one definition."""
    return math.sqrt(d_head)


def attention_scores(q: Tensor, k: Tensor) -> Tensor:
    """Pre-softmax scores ``q k^T / sqrt(d_head)``: ``q [..., query, d_head]``, ``k [..., key, d_head]`` ->
    ``[..., query, key]`` (not masked)."""
    return (q @ k.transpose(-1, -2)).div_(score_divisor(q.shape[-1]))  # in place on the fresh product: one tensor


def causal_attention(q: Tensor, k: Tensor, v: Tensor, *, lse: bool = False) -> tuple[Tensor, Tensor | None]:
    """Causal attention without its ``[..., T, T]`` pattern: ``q, k, v [B, H, T, E]`` (keys and values
    expanded to the query heads) -> ``z [B, H, T, E]`` (``softmax(q k^T / sqrt(E)) v``, keys after each
    query masked) and, with ``lse``, each query's log-sum-exp of its masked scores ``[B, H, T]`` (float32
    or wider), so that ``pattern[..., i, j] = exp(score[i, j] - lse[i])`` (``None`` without ``lse``).

    The fused kernel of ``scaled_dot_product_attention``; on the CPU, where that kernel is flash
    attention, the log-sum-exp is the one it computes on the way (the same ``z`` bit for bit, no pattern
    formed). Elsewhere it is computed from the scores."""
    scale = 1.0 / score_divisor(q.shape[-1])
    if lse and q.device.type == "cpu" and _cpu_flash(q, k, v, scale):
        return tuple(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale))  # type: ignore[return-value]
    z = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if not lse:
        return z, None
    wide = torch.promote_types(q.dtype, torch.float32)
    return z, torch.logsumexp(masked_scores(attention_scores(q, k).to(wide), inplace=True), dim=-1)


def _cpu_flash(q: Tensor, k: Tensor, v: Tensor, scale: float) -> bool:
    """Whether ``scaled_dot_product_attention`` runs these on the CPU's flash kernel (which also gives
    the log-sum-exp)."""
    if not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return False
    return torch._fused_sdp_choice(q, k, v, is_causal=True, scale=scale) == int(SDPBackend.FLASH_ATTENTION)


def masked_scores(scores: Tensor, *, inplace: bool = False) -> Tensor:
    """``scores [..., query, key]`` with every key after its query set to ``-inf`` (``inplace``: in
    ``scores`` itself, for scores nothing else holds)."""
    mask = causal_mask(scores.shape[-1], scores.device)
    return scores.masked_fill_(mask, float("-inf")) if inplace else scores.masked_fill(mask, float("-inf"))


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
    c = centre(x)  # the variance in two passes: torch's var (one-pass, Welford) is ~6x slower on a CPU
    return torch.sqrt((c * c).mean(-1, keepdim=True) + eps)


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
    # the whole (contiguous) tensor, then the slice: each row's numbers are the same, and the kernel
    # neither copies the strided slice nor waits on it (twice as fast on [16, 256, 1024] logits)
    logp = torch.log_softmax(logits.to(dtype), dim=-1)[:, :-1]
    return -logp.gather(-1, tokens[:, 1:, None].to(logp.device))[..., 0]


def next_token_loss(logits: Tensor, tokens: Tensor, *, dtype: torch.dtype | None = None) -> Tensor:
    """Mean of :func:`next_token_nll`: the language-model loss (a scalar tensor, in nats)."""
    return next_token_nll(logits, tokens, dtype=dtype).mean()
