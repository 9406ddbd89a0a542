"""An independent reference forward for the tests: the model written head by head with einsum,
straight from the formulas in docs/conventions.md, sharing no code with qkov's forwards.

It reads a :class:`qkov.weights.Weights` view's stacked tensors directly (any ``norm``:
``none``, ``layernorm``, ``folded``, ``scale``), so it checks that folding, centring and rotation
keep the model's function, and it is the oracle the analysis forward and the training model
are compared with.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from qkov.weights import Weights


def _norm(x: Tensor, kind: str, eps: float, w: Tensor | None = None, b: Tensor | None = None) -> Tensor:
    if kind == "none":
        return x
    if kind == "scale":
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    out = (x - mu) / torch.sqrt(var + eps)
    return out * w + b if kind == "layernorm" else out


def _act(name: str, x: Tensor) -> Tensor:
    if name == "relu":
        return x.clamp_min(0)
    if name == "gelu_new":
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def reference_forward(w: Weights, tokens: Tensor, *, patterns: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Logits ``[B, T, V]`` and patterns ``[L, B, H, T, T]`` (the given frozen ones, if any)."""
    cfg = w.cfg
    tokens = tokens if tokens.ndim == 2 else tokens[None]
    T = tokens.shape[1]
    x = w.W_E[tokens]
    pos = w.W_pos[:T] if w.W_pos is not None else None
    if cfg.positional == "standard":
        x = x + pos
    later = torch.arange(T)[None, :] > torch.arange(T)[:, None]  # key after query
    kept = []
    for l in range(cfg.n_layers):
        ln1 = (w.ln1_w[l], w.ln1_b[l]) if w.norm == "layernorm" else (None, None)
        v_in = _norm(x, w.norm, cfg.ln_eps, *ln1)
        qk_in = _norm(x + pos, w.norm, cfg.ln_eps, *ln1) if cfg.positional == "shortformer" else v_in
        q = torch.einsum("btd,hde->bhte", qk_in, w.W_Q[l]) + w.b_Q[l][:, None]
        k = torch.einsum("btd,hde->bhte", qk_in, w.W_K[l]) + w.b_K[l][:, None]
        v = torch.einsum("btd,hde->bhte", v_in, w.W_V[l]) + w.b_V[l][:, None]
        if patterns is None:
            s = torch.einsum("bhqe,bhke->bhqk", q, k) / math.sqrt(cfg.d_head)
            p = torch.softmax(s.masked_fill(later, float("-inf")), dim=-1)
        else:
            p = patterns[l]
        kept.append(p)
        x = x + torch.einsum("bhqk,bhke,hed->bqd", p, v, w.W_O[l]) + w.b_O[l]
        if w.W_in is not None:
            ln2 = (w.ln2_w[l], w.ln2_b[l]) if w.norm == "layernorm" else (None, None)
            pre = _norm(x, w.norm, cfg.ln_eps, *ln2) @ w.W_in[l] + w.b_in[l]
            x = x + _act(cfg.act_fn, pre) @ w.W_out[l] + w.b_out[l]
    lnf = (w.lnf_w, w.lnf_b) if w.norm == "layernorm" else (None, None)
    logits = _norm(x, w.norm, cfg.ln_eps, *lnf) @ w.W_U + w.b_U
    B, H = tokens.shape[0], cfg.n_heads
    return logits, torch.stack(kept) if kept else logits.new_zeros(0, B, H, T, T)


def reference_loss(logits: Tensor, tokens: Tensor) -> float:
    """Mean next-token cross-entropy in float64, written out: ``logsumexp - logit of the next token``."""
    lg = logits[:, :-1].double()
    target = tokens[:, 1:]
    picked = torch.gather(lg, -1, target[..., None])[..., 0]
    return float((torch.logsumexp(lg, dim=-1) - picked).mean())
