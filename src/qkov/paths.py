"""Path expansion: logits as an exact sum of direct, single-head and virtual-head paths.

Run the model once and freeze what makes it non-linear: every head's attention
pattern, every LayerNorm's scale (1/std per position) and every MLP's output. With
those frozen, the residual stream is linear in its sources and splits exactly into

* order 0 — the direct path: the token embedding (plus ``W_pos`` for standard positions);
* order k — paths through k heads in strictly increasing layers (order 1: one term per
  head, the skip-trigram terms; order 2: the virtual attention heads, pattern
  ``A2 @ A1`` and OV ``W_OV1 @ W_OV2`` in the row convention);
* ``bias`` — everything that starts at a bias (``b_V``, ``b_O``, ``b_U``, folded LayerNorm
  biases), through any heads after it;
* ``mlp`` — everything that starts at an MLP's (frozen) output, through any later heads.

The stream is carried order by order (each layer maps order k to order k+1), so cost
grows linearly with depth instead of enumerating ``(heads+1)^layers`` paths.

What is exact: for attention-only models without LayerNorm the expansion reproduces the
logits up to float error, and with patterns frozen the logits are *linear* in the
one-hot tokens, so this is the model, not an approximation. With LayerNorm, each LN is
``centre(x) / std(x)`` with ``std`` frozen at the value of the real forward pass (the
gain and bias are folded into the weights that read it): the terms still sum exactly to
the logits, but a term's size depends on frozen scales set by all the other terms, so
terms through different LayerNorms are not directly comparable (SPEC.md). With MLPs,
MLP outputs are frozen sources, not expanded.

:func:`term_importance` is the paper's procedure (zero every head's output under frozen
patterns, then repeatedly let each head add the output it computed on the previous run).
:func:`qk_split` expands a head's pre-softmax scores into direct, Q-, K- and Q-and-K-
composition terms per earlier head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import QkovError
from .weights import Weights, forward


# ------------------------------------------------------------------- frozen run
@dataclass
class FrozenRun:
    """What a real forward pass fixes: patterns ``[L, B, H, T, T]``, LN stds, MLP outputs."""

    tokens: Tensor  # [B, T]
    logits: Tensor  # [B, T, V]
    patterns: Tensor  # [L, B, H, T, T]
    ln1_std: Tensor | None  # [L, 2, B, T, 1] (value input, query/key input) or None
    ln2_std: Tensor | None  # [L, B, T, 1]
    lnf_std: Tensor | None  # [B, T, 1]
    mlp_out: Tensor | None  # [L, B, T, D]
    values: Tensor | None = None  # [L, B, H, T, d_head] (only when asked: keep_values=True)
    qk_inputs: Tensor | None = None  # [L, B, T, D] each layer's (normalised) query/key input (keep_values)


def _std(x: Tensor, eps: float) -> Tensor:
    return torch.sqrt(x.var(dim=-1, unbiased=False, keepdim=True) + eps)


def _centre(x: Tensor) -> Tensor:
    return x - x.mean(dim=-1, keepdim=True)


def _act(cfg_act: str, x: Tensor) -> Tensor:
    if cfg_act == "relu":
        return F.relu(x)
    return F.gelu(x, approximate="tanh" if cfg_act == "gelu_new" else "none")


def frozen_run(w: Weights, tokens: Tensor, *, keep_values: bool = False) -> FrozenRun:
    """Run the model from a weights view and record everything the expansion freezes.

    LayerNorm models must come folded (``Weights.from_model(..., fold_ln=True)``).
    """
    if w.norm not in ("none", "folded"):
        raise QkovError("paths: use a weights view with LayerNorm folded (fold_ln=True)")
    cfg = w.cfg
    tokens = tokens if tokens.ndim == 2 else tokens[None]
    B, T = tokens.shape
    ln = w.norm == "folded"
    eps = cfg.ln_eps
    x = w.W_E[tokens]
    pos = w.W_pos[:T] if w.W_pos is not None else None
    if cfg.positional == "standard":
        x = x + pos
    mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
    pats, s1, s2, mlps, vals, qks = [], [], [], [], [], []
    for l in range(cfg.n_layers):
        qk_raw = x + pos if cfg.positional == "shortformer" else x
        if ln:
            sv, sq = _std(x, eps), _std(qk_raw, eps)
            s1.append(torch.stack([sv, sq]))
            v_in, qk_in = _centre(x) / sv, _centre(qk_raw) / sq
        else:
            v_in, qk_in = x, qk_raw
        q = torch.einsum("btd,hde->bhte", qk_in, w.W_Q[l]) + w.b_Q[l][:, None]
        k = torch.einsum("btd,hde->bhte", qk_in, w.W_K[l]) + w.b_K[l][:, None]
        v = torch.einsum("btd,hde->bhte", v_in, w.W_V[l]) + w.b_V[l][:, None]
        s = (q @ k.transpose(-1, -2)) / math.sqrt(cfg.d_head)
        p = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1)
        pats.append(p)
        if keep_values:
            vals.append(v)
            qks.append(qk_in)
        x = x + torch.einsum("bhte,hed->btd", p @ v, w.W_O[l]) + w.b_O[l]
        if w.W_in is not None:
            assert w.b_in is not None and w.W_out is not None and w.b_out is not None
            if ln:
                st = _std(x, eps)
                s2.append(st)
                m_in = _centre(x) / st
            else:
                m_in = x
            out = _act(cfg.act_fn, m_in @ w.W_in[l] + w.b_in[l]) @ w.W_out[l] + w.b_out[l]
            mlps.append(out)
            x = x + out
    sf = _std(x, eps) if ln else None
    final = _centre(x) / sf if sf is not None else x
    logits = final @ w.W_U + w.b_U
    empty = x.new_zeros(0, B, cfg.n_heads, T, T)
    return FrozenRun(
        tokens=tokens,
        logits=logits,
        patterns=torch.stack(pats) if pats else empty,
        ln1_std=torch.stack(s1) if s1 else None,
        ln2_std=torch.stack(s2) if s2 else None,
        lnf_std=sf,
        mlp_out=torch.stack(mlps) if mlps else None,
        values=torch.stack(vals) if vals else None,
        qk_inputs=torch.stack(qks) if qks else None,
    )


# -------------------------------------------------------------------- expansion
def _read(w: Weights, run: FrozenRun, l: int, x: Tensor, which: int) -> Tensor:
    """A linear reader's view of a stream term: centred and divided by the frozen LN std."""
    if run.ln1_std is None:
        return x
    return _centre(x) / run.ln1_std[l, which]


def _head_outputs(w: Weights, run: FrozenRun, l: int, x: Tensor) -> Tensor:
    """Per-head output ``[H, B, T, D]`` of layer ``l`` for a stream term ``x [B, T, D]`` (no biases)."""
    v = torch.einsum("btd,hde->bhte", _read(w, run, l, x, 0), w.W_V[l])
    z = run.patterns[l] @ v  # [B, H, T, E]
    return torch.einsum("bhte,hed->hbtd", z, w.W_O[l])


def _unembed(w: Weights, run: FrozenRun, x: Tensor) -> Tensor:
    if run.lnf_std is not None:
        x = _centre(x) / run.lnf_std
    return x @ w.W_U


@dataclass
class Expansion:
    """Logits split by path. Residual-stream terms are kept (``[B, T, D]``); logits on demand.

    ``orders[k]`` is the final-stream contribution of all paths through exactly k heads;
    ``heads[(l, h)]`` the order-1 term of one head; ``virtual[(l1, h1, l2, h2)]`` one
    order-2 term (only when asked for); ``bias`` and ``mlp`` as in the module docstring.
    """

    run: FrozenRun
    weights: Weights
    orders: list[Tensor]
    bias: Tensor
    mlp: Tensor
    heads: dict[tuple[int, int], Tensor]
    virtual: dict[tuple[int, int, int, int], Tensor]

    def logits_of(self, resid: Tensor) -> Tensor:
        """``[B, T, V]`` logits of one stream term (the final LN scale frozen; no b_U)."""
        return _unembed(self.weights, self.run, resid)

    def order_logits(self) -> list[Tensor]:
        return [self.logits_of(t) for t in self.orders]

    def bias_logits(self) -> Tensor:
        return self.logits_of(self.bias) + self.weights.b_U

    def total_logits(self) -> Tensor:
        """The sum of every term's logits: equals the model's logits."""
        total = sum(self.orders, torch.zeros_like(self.bias)) + self.bias + self.mlp
        return self.logits_of(total) + self.weights.b_U

    def reconstruction_error(self) -> float:
        return float((self.total_logits() - self.run.logits).abs().max())


def expand(
    w: Weights,
    tokens: Tensor,
    *,
    max_order: int | None = None,
    per_head: bool = True,
    virtual_heads: bool = False,
) -> Expansion:
    """Split the logits of ``tokens [B, T]`` by path order (see the module docstring).

    Args:
        max_order: keep orders above this summed into the last one kept (default: all,
            ``n_layers``).
        per_head: also keep each head's order-1 term ``[B, T, D]``.
        virtual_heads: also keep every order-2 term (pairs in increasing layers).
    """
    cfg = w.cfg
    run = frozen_run(w, tokens)
    toks = run.tokens
    T = toks.shape[1]
    x0 = w.W_E[toks]
    if cfg.positional == "standard":
        x0 = x0 + w.W_pos[:T]  # type: ignore[index]
    L = cfg.n_layers
    orders: list[Tensor] = [x0] + [torch.zeros_like(x0) for _ in range(L)]
    bias = torch.zeros_like(x0)
    mlp = torch.zeros_like(x0)
    heads: dict[tuple[int, int], Tensor] = {}
    virtual: dict[tuple[int, int, int, int], Tensor] = {}
    first_order: dict[tuple[int, int], Tensor] = {}  # order-1 terms, for virtual heads
    for l in range(L):
        # bias of this layer: b_V through the (row-stochastic) pattern, plus b_O
        b_v = torch.einsum("he,hed->d", w.b_V[l], w.W_O[l])
        new_bias = b_v + w.b_O[l]
        bias_through = _head_outputs(w, run, l, bias).sum(0)
        mlp_through = _head_outputs(w, run, l, mlp).sum(0)
        # carry the stream order by order, highest first so each order is read before it grows
        for k in range(l, -1, -1):
            if float(orders[k].abs().max()) == 0.0 and k > 0:
                continue
            outs = _head_outputs(w, run, l, orders[k])  # [H, B, T, D]
            if k == 0:
                for h in range(cfg.n_heads):
                    if per_head:
                        heads[(l, h)] = outs[h]
                    if virtual_heads:
                        first_order[(l, h)] = outs[h]
            orders[k + 1] = orders[k + 1] + outs.sum(0)
        if virtual_heads:
            for (l1, h1), term in first_order.items():
                if l1 < l:
                    outs = _head_outputs(w, run, l, term)
                    for h2 in range(cfg.n_heads):
                        virtual[(l1, h1, l, h2)] = outs[h2]
        bias = bias + bias_through + new_bias
        mlp = mlp + mlp_through
        if run.mlp_out is not None:
            mlp = mlp + run.mlp_out[l]
    if max_order is not None and max_order < L:
        tail = sum(orders[max_order + 1 :], torch.zeros_like(x0))
        orders = orders[: max_order + 1]
        orders[-1] = orders[-1] + tail
    return Expansion(run, w, orders, bias, mlp, heads, virtual)


# ------------------------------------------------------------------ term importance
def _loss(logits: Tensor, tokens: Tensor) -> float:
    lp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    return float(-lp.gather(-1, tokens[:, 1:, None]).mean())


def run_with_head_outputs(w: Weights, run: FrozenRun, head_out: Tensor | None) -> tuple[Tensor, Tensor]:
    """One run of the paper's procedure: patterns (and LN scales, MLP outputs) frozen.

    Each head *adds* ``head_out [L, H, B, T, D]`` (zeros when ``None``) to the stream
    instead of its live output; returns the logits and the outputs every head computed
    on this run (from the stream this run produced), for the next run.
    """
    cfg = w.cfg
    toks = run.tokens
    T = toks.shape[1]
    x = w.W_E[toks]
    if cfg.positional == "standard":
        x = x + w.W_pos[:T]  # type: ignore[index]
    computed = []
    for l in range(cfg.n_layers):
        v = torch.einsum("btd,hde->bhte", _read(w, run, l, x, 0), w.W_V[l]) + w.b_V[l][:, None]
        live = torch.einsum("bhte,hed->hbtd", run.patterns[l] @ v, w.W_O[l])  # [H, B, T, D]
        computed.append(live)
        if head_out is not None:
            x = x + head_out[l].sum(0)
        x = x + w.b_O[l]
        if run.mlp_out is not None:
            x = x + run.mlp_out[l]
    logits = _unembed(w, run, x) + w.b_U
    return logits, torch.stack(computed) if computed else x.new_zeros(0)


@dataclass
class TermImportance:
    """Loss (nats) after each run of the paper's procedure and the marginal loss of each order."""

    run_losses: list[float]  # run 1 (heads zeroed) .. run L+1 (everything)
    full_loss: float  # the model's own loss
    uniform_loss: float  # log(d_vocab)

    @property
    def marginal_by_order(self) -> list[float]:
        """Order 0 = uniform - run 1 (the direct path); order n = run n - run n+1."""
        out = [self.uniform_loss - self.run_losses[0]]
        out += [self.run_losses[i] - self.run_losses[i + 1] for i in range(len(self.run_losses) - 1)]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_losses": self.run_losses,
            "full_loss": self.full_loss,
            "uniform_loss": self.uniform_loss,
            "marginal_by_order": self.marginal_by_order,
        }


def term_importance(w: Weights, tokens: Tensor) -> TermImportance:
    """The paper's procedure ([F], SPEC.md "Path expansion"), literally.

    Run 1: patterns frozen, every head's output replaced by zeros. Run n: each head adds
    the output it computed on run n-1. After ``n_layers + 1`` runs every order is in and
    the logits equal the model's. Order n first enters on run n+1.
    """
    run = frozen_run(w, tokens)
    toks = run.tokens
    losses = []
    head_out: Tensor | None = None
    for _ in range(w.cfg.n_layers + 1):
        logits, computed = run_with_head_outputs(w, run, head_out)
        losses.append(_loss(logits, toks))
        head_out = computed
    return TermImportance(losses, _loss(run.logits, toks), math.log(w.cfg.d_vocab))


@dataclass
class TermEffect:
    name: str  # "0.3" or "0.3->1.2"
    loss_change: float  # loss without the term minus the full loss (nats; positive = the term helps)
    size: float  # RMS of the term's logits

    def to_dict(self) -> dict[str, Any]:
        return vars(self).copy()


def term_effects(exp: Expansion, *, top_virtual: int = 10) -> tuple[list[TermEffect], list[TermEffect]]:
    """Loss change from removing each order-1 term, and each of the ``top_virtual`` largest order-2 terms.

    Logits are built one term at a time (never ``[B, T, V]`` for all terms at once).
    """
    toks = exp.run.tokens
    full = exp.total_logits()
    base = _loss(full, toks)
    singles = []
    for (l, h), term in exp.heads.items():
        tl = exp.logits_of(term)
        singles.append(TermEffect(f"{l}.{h}", _loss(full - tl, toks) - base, float(tl.pow(2).mean().sqrt())))
    sized = sorted(exp.virtual.items(), key=lambda kv: -float(kv[1].pow(2).mean()))[:top_virtual]
    virtual = []
    for (l1, h1, l2, h2), term in sized:
        tl = exp.logits_of(term)
        virtual.append(
            TermEffect(f"{l1}.{h1}->{l2}.{h2}", _loss(full - tl, toks) - base, float(tl.pow(2).mean().sqrt()))
        )
    singles.sort(key=lambda e: -e.loss_change)
    virtual.sort(key=lambda e: -e.loss_change)
    return singles, virtual


@dataclass
class PathSummary:
    """What ``qkov paths`` and the report show: exactness, term importance, the terms that matter."""

    shape: list[int]  # [batch, seq] of the tokens
    reconstruction_error: float  # max |sum of all terms - the model's logits|
    importance: TermImportance
    singles: list[TermEffect]  # every single-head term, by loss change
    virtual: list[TermEffect]  # the largest virtual-head terms, by loss change

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.shape,
            "reconstruction_max_abs_error": self.reconstruction_error,
            "term_importance": self.importance.to_dict(),
            "single_head_terms": [e.to_dict() for e in self.singles],
            "virtual_head_terms": [e.to_dict() for e in self.virtual],
        }


@torch.no_grad()
def summarize(w: Weights, tokens: Tensor, *, top_virtual: int = 10) -> PathSummary:
    """Expand ``tokens [B, T]`` (virtual heads from 2 layers on), run the paper's term importance
    and measure the effect of each single-head and the ``top_virtual`` largest virtual-head terms."""
    exp = expand(w, tokens, virtual_heads=w.cfg.n_layers >= 2)
    singles, virtual = term_effects(exp, top_virtual=top_virtual)
    return PathSummary(list(tokens.shape), exp.reconstruction_error(), term_importance(w, tokens), singles, virtual)


# ------------------------------------------------------------------------ QK side
@dataclass
class QKSplit:
    """Pre-softmax scores of one head split by where its query and key inputs came from.

    Components of the stream at the head's layer: ``direct`` (embedding, and positions
    for the query/key input), each earlier head's output, and ``other`` (biases, MLP
    outputs). Score terms ``[B, T, T]`` (pre-softmax, scaled by 1/sqrt(d_head), unmasked):
    ``direct`` (direct query x direct key), ``q_comp[i]`` (query from earlier head i x
    direct key), ``k_comp[i]`` (direct query x key from earlier head i), ``qk_comp``
    (both from earlier heads, summed over pairs), ``other`` (everything involving biases
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

    def total(self) -> Tensor:
        return self.direct + self.q_comp.sum(0) + self.k_comp.sum(0) + self.qk_comp + self.other


def qk_split(w: Weights, tokens: Tensor, layer: int, head: int) -> QKSplit:
    """Expand head ``layer.head``'s attention scores over earlier heads (Q-, K-, Q-and-K-composition)."""
    if not (0 <= layer < w.n_layers and 0 <= head < w.n_heads):
        raise QkovError(f"no head {layer}.{head}: the model has {w.n_layers} layers x {w.n_heads} heads")
    cfg = w.cfg
    run = frozen_run(w, tokens, keep_values=True)
    assert run.values is not None
    toks = run.tokens
    T = toks.shape[1]
    direct = w.W_E[toks]
    if cfg.positional in ("standard", "shortformer"):
        direct = direct + w.W_pos[:T]  # type: ignore[index]  # shortformer: positions enter the query/key input only
    labels: list[str] = []
    other = torch.zeros_like(direct)  # the stream's bias/MLP part
    comps: list[Tensor] = []
    for l in range(layer):
        # each head's output on the real run, from the values it recorded; b_V moves to `other`
        # (patterns are row-stochastic, so a head's b_V contributes exactly b_V @ W_O at every position)
        outs = torch.einsum("bhte,hed->hbtd", run.patterns[l] @ run.values[l], w.W_O[l])
        b_v = torch.einsum("he,hed->hd", w.b_V[l], w.W_O[l])  # [H, D]
        for h in range(cfg.n_heads):
            comps.append(outs[h] - b_v[h])
            labels.append(f"{l}.{h}")
        other = other + b_v.sum(0) + w.b_O[l]
        if run.mlp_out is not None:
            other = other + run.mlp_out[l]

    def proj(x: Tensor, W: Tensor) -> Tensor:
        if run.ln1_std is not None:
            x = _centre(x) / run.ln1_std[layer, 1]
        return x @ W

    WQ, WK = w.W_Q[layer, head], w.W_K[layer, head]
    scale = 1 / math.sqrt(cfg.d_head)
    qd, kd = proj(direct, WQ), proj(direct, WK)
    qo, ko = proj(other, WQ) + w.b_Q[layer, head], proj(other, WK) + w.b_K[layer, head]
    qh = torch.stack([proj(c, WQ) for c in comps]) if comps else qd.new_zeros(0, *qd.shape)
    kh = torch.stack([proj(c, WK) for c in comps]) if comps else kd.new_zeros(0, *kd.shape)

    def s(a: Tensor, b: Tensor) -> Tensor:
        return (a @ b.transpose(-1, -2)) * scale

    q_all_heads, k_all_heads = qh.sum(0), kh.sum(0)
    q_real, k_real = qd + q_all_heads + qo, kd + k_all_heads + ko
    split = QKSplit(
        layer=layer,
        head=head,
        earlier=labels,
        direct=s(qd, kd),
        q_comp=torch.stack([s(q, kd) for q in qh]) if comps else qd.new_zeros(0, *s(qd, kd).shape),
        k_comp=torch.stack([s(qd, k) for k in kh]) if comps else qd.new_zeros(0, *s(qd, kd).shape),
        qk_comp=s(q_all_heads, k_all_heads),
        other=s(qo, k_real) + s(q_real - qo, ko),
        scores=s(q_real, k_real),
    )
    return split


__all__ = [
    "Expansion",
    "FrozenRun",
    "QKSplit",
    "TermEffect",
    "TermImportance",
    "expand",
    "forward",
    "frozen_run",
    "qk_split",
    "run_with_head_outputs",
    "term_effects",
    "term_importance",
]
