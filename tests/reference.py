"""An independent reference forward for the tests: the model written head by head with einsum,
straight from the formulas in docs/conventions.md, sharing no code with qkov's forwards.

It reads a :class:`qkov.weights.Weights` view's stacked tensors directly (any ``norm``:
``none``, ``layernorm``, ``rmsnorm``, ``folded``, ``scale``), so it checks that folding, centring and rotation
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
    if kind in ("scale", "rmsnorm"):
        out = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
        return out * w if kind == "rmsnorm" else out
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    out = (x - mu) / torch.sqrt(var + eps)
    return out * w + b if kind == "layernorm" else out


def _act(name: str, x: Tensor) -> Tensor:
    if name == "relu":
        return x.clamp_min(0)
    if name == "silu":
        return x / (1 + torch.exp(-x))
    if name == "gelu_new":
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def _rotate(x: Tensor, cfg, base_pos: int = 0) -> Tensor:  # type: ignore[no-untyped-def]
    """Rotary positions as complex multiplication: dims ``m`` and ``m + r/2`` are the real and
    imaginary parts of one number, turned by ``e^{i p w_m}``; float32 angles as the families define them."""
    r = cfg.rotary_dim or cfg.d_head
    inv = 1.0 / (float(cfg.rotary_base) ** (torch.arange(0, r, 2).float() / r))
    sc = cfg.rope_scaling
    if sc is not None and sc["rope_type"] == "linear":
        inv = inv / sc["factor"]
    elif sc is not None:  # llama3, written out per frequency (float32 scalars, as the family computes it)
        out = []
        orig, lo_f, hi_f, fac = (
            sc[k] for k in ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor", "factor")
        )
        for f in inv:
            wl = 2 * math.pi / f
            if wl < orig / hi_f:
                out.append(f)
            elif wl > orig / lo_f:
                out.append(f / fac)
            else:
                t = (orig / wl - lo_f) / (hi_f - lo_f)
                out.append((1 - t) * f / fac + t * f)
        inv = torch.stack(out)
    T = x.shape[-2]
    ang = torch.arange(base_pos, base_pos + T).float()[:, None] * inv  # [T, r/2] float32
    turn = torch.complex(ang.cos().double(), ang.sin().double())  # float32 cos/sin, as defined
    z = torch.complex(x[..., : r // 2].double(), x[..., r // 2 : r].double()) * turn
    return torch.cat([z.real.to(x.dtype), z.imag.to(x.dtype), x[..., r:]], dim=-1)


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
        ln1 = _gain_bias(w, "ln1", l)
        v_in = _norm(x, w.norm, cfg.ln_eps, *ln1)
        qk_in = _norm(x + pos, w.norm, cfg.ln_eps, *ln1) if cfg.positional == "shortformer" else v_in
        kv = torch.arange(cfg.n_heads) // (cfg.n_heads // (cfg.n_kv_heads or cfg.n_heads))  # each query head's kv head
        q = torch.einsum("btd,hde->bhte", qk_in, w.W_Q[l]) + w.b_Q[l][:, None]
        k = torch.einsum("btd,hde->bhte", qk_in, w.W_K[l][kv]) + w.b_K[l][kv][:, None]
        v = torch.einsum("btd,hde->bhte", v_in, w.W_V[l][kv]) + w.b_V[l][kv][:, None]
        if cfg.positional == "rotary":
            q, k = _rotate(q, cfg), _rotate(k, cfg)
        if patterns is None:
            s = torch.einsum("bhqe,bhke->bhqk", q, k) / math.sqrt(cfg.d_head)
            p = torch.softmax(s.masked_fill(later, float("-inf")), dim=-1)
        else:
            p = patterns[l]
        kept.append(p)
        block_in = x
        x = x + torch.einsum("bhqk,bhke,hed->bqd", p, v, w.W_O[l]) + w.b_O[l]
        if w.W_in is not None:
            m_in = _norm(block_in if cfg.parallel else x, w.norm, cfg.ln_eps, *_gain_bias(w, "ln2", l))
            pre = m_in @ w.W_in[l] + w.b_in[l]
            hidden = (
                _act(cfg.act_fn, m_in @ w.W_gate[l] + w.b_gate[l]) * pre if cfg.gated_mlp else _act(cfg.act_fn, pre)
            )
            x = x + hidden @ w.W_out[l] + w.b_out[l]
    lnf = _gain_bias(w, "lnf", None)
    logits = _norm(x, w.norm, cfg.ln_eps, *lnf) @ w.W_U + w.b_U
    B, H = tokens.shape[0], cfg.n_heads
    return logits, torch.stack(kept) if kept else logits.new_zeros(0, B, H, T, T)


def _gain_bias(w: Weights, name: str, layer: int | None) -> tuple[Tensor | None, Tensor | None]:
    """An unfolded normalisation's gain and bias (``None`` where the view has none)."""
    if w.norm not in ("layernorm", "rmsnorm"):
        return None, None
    g, b = getattr(w, f"{name}_w"), getattr(w, f"{name}_b")
    if layer is not None:
        g, b = g[layer], (None if b is None else b[layer])
    return g, b


def reference_loss(logits: Tensor, tokens: Tensor) -> float:
    """Mean next-token cross-entropy in float64, written out: ``logsumexp - logit of the next token``."""
    lg = logits[:, :-1].double()
    target = tokens[:, 1:]
    picked = torch.gather(lg, -1, target[..., None])[..., 0]
    return float((torch.logsumexp(lg, dim=-1) - picked).mean())
