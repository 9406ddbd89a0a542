"""Path expansion: logits as an exact sum of direct, single-head and virtual-head paths.

Run the model once and freeze what makes it non-linear: every head's attention
pattern, every normalisation's divisor (``sqrt(var + eps)`` per position, or the RMS in a
rotated ``scale`` view) and every MLP's output. With
those frozen, the residual stream is linear in its sources and splits exactly into

* order 0 — the direct path: the token embedding (plus ``W_pos`` for standard positions);
* order k — paths through k heads in strictly increasing layers (order 1: one term per
  head, the skip-trigram terms; order 2: the virtual attention heads, pattern
  ``A2 @ A1`` and OV ``W_OV1 @ W_OV2`` in the row convention);
* ``bias`` — everything that starts at a bias (``b_V``, ``b_O``), through any heads after it
  (folded LayerNorm biases live in ``b_Q/b_K/b_V`` and ``b_in``; ``b_U`` is added once, to the
  logits);
* ``mlp`` — everything that starts at an MLP's (frozen) output, through any later heads.

The stream is carried order by order (each layer maps order k to order k+1), so cost
grows linearly with depth instead of enumerating ``(heads+1)^layers`` paths.

What is exact: for attention-only models without LayerNorm the expansion reproduces the
logits up to float error, and with patterns frozen the logits are *linear* in the
one-hot tokens, so this is the model, not an approximation. With LayerNorm, each LN is
``centre(x) / s`` with the divisor ``s`` frozen at the value of the real forward pass (the
gain and bias are folded into the weights that read it): the terms still sum exactly to
the logits, but a term's size depends on frozen divisors set by all the other terms, so
terms through different LayerNorms are not directly comparable ([F]; docs/conventions.md).
With MLPs, MLP outputs are frozen sources, not expanded.

:func:`term_importance` is the paper's procedure (zero every head's output under frozen
patterns, then repeatedly let each head add the output it computed on the previous run).
:func:`qkov.analysis.qk_split.qk_split` expands a head's pre-softmax scores the same way.

Every run here is :func:`qkov.analysis.forward.run`; the expansion applies its layer pieces
(:func:`~qkov.analysis.forward.read`, :func:`~qkov.analysis.forward.project`,
:func:`~qkov.analysis.forward.head_writes`) to single stream terms.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..device import check_fits
from ..errors import QkovError
from ..model.ops import next_token_loss
from ..weights.parts import WeightSource
from .forward import Run, head_writes, project, read, run
from .progress import Progress, tick

FROZEN = ("patterns", "scales", "mlp_outputs")  # what a run must record to be frozen
VIRTUAL_AUTO_MAX = 1024  # virtual-head pairs expanded by default (GPT-2 small has 9,504: hours on a CPU)
BATCH_TOKENS = 2048  # tokens the default batch holds at most (8 sequences of 256, 2 of 1024)


def default_batch(n_ctx: int, most: int = 8) -> int:
    """Sequences of ``n_ctx`` tokens a path analysis takes by default: ``most``, or fewer so the
    batch holds at most :data:`BATCH_TOKENS` tokens (every term is ``[batch, n_ctx, d_model]``)."""
    return max(1, min(most, BATCH_TOKENS // n_ctx))


def virtual_pairs(source: WeightSource) -> int:
    """Virtual heads: pairs of heads in strictly increasing layers, ``H^2 L (L-1) / 2``."""
    L, H = source.cfg.n_layers, source.cfg.n_heads
    return H * H * L * (L - 1) // 2


def check_linear(source: WeightSource) -> None:
    """Path analyses need reads that are linear once the normalisation divisor is frozen."""
    if source.norm == "layernorm":
        raise QkovError("paths: use a weights view with LayerNorm folded (fold_ln=True)")


def frozen_run(source: WeightSource, tokens: Tensor, *, record: tuple[str, ...] = ()) -> Run:
    """A real forward pass recording what the expansion freezes (patterns, normalisation divisors,
    MLP outputs), plus ``record``."""
    check_linear(source)
    return run(source, tokens, record=FROZEN + record)


def loss(logits: Tensor, tokens: Tensor) -> float:
    """Mean next-token loss in nats, computed in float64 (term differences are small)."""
    return float(next_token_loss(logits, tokens, dtype=torch.float64))


# -------------------------------------------------------------------- expansion
def _head_terms(source: WeightSource, r: Run, l: int, x: Tensor) -> Tensor:
    """Per-head output ``[H, B, T, D]`` of layer ``l`` for a stream term ``x [B, T, D]`` (no biases)."""
    att = source.attention(l)
    v = project(read(x, source.norm, r.divisor("attn_v", l)), att.W_V)
    return head_writes(r.patterns[l], v, att.W_O).transpose(0, 1)  # type: ignore[index]


@dataclass
class Expansion:
    """Logits split by path. Residual-stream terms are kept (``[B, T, D]``); logits on demand.

    ``orders[k]`` is the final-stream contribution of all paths through exactly k heads;
    ``heads[(l, h)]`` the order-1 term of one head; ``virtual[(l1, h1, l2, h2)]`` one
    order-2 term (only when asked for); ``bias`` and ``mlp`` as in the module docstring.
    """

    run: Run
    source: WeightSource
    orders: list[Tensor]
    bias: Tensor
    mlp: Tensor
    heads: dict[tuple[int, int], Tensor]
    virtual: dict[tuple[int, int, int, int], Tensor]

    def logits_of(self, resid: Tensor) -> Tensor:
        """``[B, T, V]`` logits of one stream term (the final LN scale frozen; no b_U)."""
        return read(resid, self.source.norm, self.run.divisor("final")) @ self.source.unembed().W_U

    def order_logits(self) -> list[Tensor]:
        return [self.logits_of(t) for t in self.orders]

    def bias_logits(self) -> Tensor:
        return self.logits_of(self.bias) + self.source.unembed().b_U

    def total_logits(self) -> Tensor:
        """The sum of every term's logits: equals the model's logits."""
        total = sum(self.orders, torch.zeros_like(self.bias)) + self.bias + self.mlp
        return self.logits_of(total) + self.source.unembed().b_U

    def reconstruction_error(self) -> float:
        return float((self.total_logits() - self.run.logits).abs().max())


def expand(
    source: WeightSource,
    tokens: Tensor,
    *,
    max_order: int | None = None,
    per_head: bool = True,
    virtual_heads: bool = False,
    keep_virtual: int | None = None,
    progress: Progress | None = None,
) -> Expansion:
    """Split the logits of ``tokens [B, T]`` by path order (see the module docstring).

    Args:
        max_order: keep orders above this summed into the last one kept (default: all,
            ``n_layers``).
        per_head: also keep each head's order-1 term ``[B, T, D]``.
        virtual_heads: also keep order-2 terms (pairs in increasing layers): every one, or
            with ``keep_virtual`` only that many of the largest (by mean square in the
            residual stream), never holding more than those at once.
        progress: ticked once per layer.
    """
    cfg = source.cfg
    r = frozen_run(source, tokens)
    T = r.tokens.shape[1]
    x0 = source.embed()[r.tokens]
    if cfg.positional == "standard":
        x0 = x0 + source.pos()[:T]  # type: ignore[index]
    L = cfg.n_layers
    orders: list[Tensor] = [x0] + [torch.zeros_like(x0) for _ in range(L)]
    bias = torch.zeros_like(x0)
    mlp = torch.zeros_like(x0)
    heads: dict[tuple[int, int], Tensor] = {}
    virtual: dict[tuple[int, int, int, int], Tensor] = {}
    kept: list[tuple[float, tuple[int, int, int, int]]] = []  # min-heap of (size, key) when keep_virtual
    first_order: dict[tuple[int, int], Tensor] = {}  # order-1 terms, for virtual heads
    for l in range(L):
        att = source.attention(l)
        # bias of this layer: b_V through the (row-stochastic) pattern, plus b_O
        new_bias = torch.einsum("he,hed->d", att.b_V, att.W_O) + att.b_O
        bias_through = _head_terms(source, r, l, bias).sum(0)
        mlp_through = _head_terms(source, r, l, mlp).sum(0)
        # carry the stream order by order, highest first so each order is read before it grows
        for k in range(l, -1, -1):
            if float(orders[k].abs().max()) == 0.0 and k > 0:
                continue
            outs = _head_terms(source, r, l, orders[k])  # [H, B, T, D]
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
                    outs = _head_terms(source, r, l, term)
                    for h2 in range(cfg.n_heads):
                        _keep(virtual, kept, keep_virtual, (l1, h1, l, h2), outs[h2])
        bias = bias + bias_through + new_bias
        mlp = mlp + mlp_through
        if r.mlp_outputs is not None:
            mlp = mlp + r.mlp_outputs[l]
        tick(progress, "paths: expansion", l + 1, L)
    if max_order is not None and max_order < L:
        tail = sum(orders[max_order + 1 :], torch.zeros_like(x0))
        orders = orders[: max_order + 1]
        orders[-1] = orders[-1] + tail
    return Expansion(r, source, orders, bias, mlp, heads, virtual)


def _keep(
    virtual: dict[tuple[int, int, int, int], Tensor],
    kept: list[tuple[float, tuple[int, int, int, int]]],
    most: int | None,
    key: tuple[int, int, int, int],
    term: Tensor,
) -> None:
    """Add a virtual-head term, keeping only the ``most`` largest (``None``: all)."""
    if most is None:
        virtual[key] = term
        return
    if most <= 0:
        return
    size = float(term.pow(2).mean())
    if len(kept) < most:
        heapq.heappush(kept, (size, key))
        virtual[key] = term.clone()  # a view of a larger block would keep the block alive
    elif size > kept[0][0]:
        _, gone = heapq.heapreplace(kept, (size, key))
        del virtual[gone]
        virtual[key] = term.clone()


# ------------------------------------------------------------------ term importance
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


def term_importance(source: WeightSource, tokens: Tensor, *, progress: Progress | None = None) -> TermImportance:
    """The paper's procedure ([F]; docs/conventions.md, "Term importance"), literally.

    Run 0 is the real forward pass, which fixes the patterns, normalisation divisors and MLP
    outputs. Run 1: all of those frozen, every head's output replaced by zeros. Run n: each
    head adds the output it computed on run n-1. After ``n_layers + 1`` runs every order is in
    and the logits equal the model's. Order n first enters on run n+1.
    """
    real = frozen_run(source, tokens)
    toks = real.tokens
    c = source.cfg
    B, T = toks.shape
    outputs = real.logits.new_zeros(c.n_layers, B, c.n_heads, T, c.d_model)
    losses = []
    for i in range(c.n_layers + 1):
        r = run(source, toks, record=("head_outputs",), frozen=real, head_outputs=outputs)
        losses.append(loss(r.logits, toks))
        outputs = r.head_outputs  # type: ignore[assignment]
        tick(progress, "paths: term importance", i + 1, c.n_layers + 1)
    return TermImportance(losses, loss(real.logits, toks), math.log(c.d_vocab))


@dataclass
class TermEffect:
    name: str  # "0.3" or "0.3->1.2"
    loss_change: float  # loss without the term minus the full loss (nats; positive = the term helps)
    size: float  # RMS of the term's logits

    def to_dict(self) -> dict[str, Any]:
        return vars(self).copy()


def term_effects(
    exp: Expansion, *, top_virtual: int = 10, progress: Progress | None = None
) -> tuple[list[TermEffect], list[TermEffect]]:
    """Loss change from removing each order-1 term, and each of the ``top_virtual`` largest order-2 terms.

    Logits are built one term at a time (never ``[B, T, V]`` for all terms at once).
    """
    toks = exp.run.tokens
    full = exp.total_logits()
    base = loss(full, toks)
    sized = sorted(exp.virtual.items(), key=lambda kv: -float(kv[1].pow(2).mean()))[:top_virtual]
    n = len(exp.heads) + len(sized)
    singles, virtual = [], []
    for (l, h), term in exp.heads.items():
        tl = exp.logits_of(term)
        singles.append(TermEffect(f"{l}.{h}", loss(full - tl, toks) - base, float(tl.pow(2).mean().sqrt())))
        tick(progress, "paths: term effects", len(singles), n)
    for (l1, h1, l2, h2), term in sized:
        tl = exp.logits_of(term)
        virtual.append(
            TermEffect(f"{l1}.{h1}->{l2}.{h2}", loss(full - tl, toks) - base, float(tl.pow(2).mean().sqrt()))
        )
        tick(progress, "paths: term effects", len(singles) + len(virtual), n)
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
    virtual_pairs: int = 0  # virtual heads the model has
    virtual_expanded: bool = True  # False: too many to expand by default, ``virtual`` is empty

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.shape,
            "reconstruction_max_abs_error": self.reconstruction_error,
            "term_importance": self.importance.to_dict(),
            "single_head_terms": [e.to_dict() for e in self.singles],
            "virtual_head_terms": [e.to_dict() for e in self.virtual],
            "virtual_pairs": self.virtual_pairs,
            "virtual_expanded": self.virtual_expanded,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PathSummary":
        """The summary from its :meth:`to_dict` form."""
        ti = d["term_importance"]
        importance = TermImportance(ti["run_losses"], ti["full_loss"], ti["uniform_loss"])
        singles = [TermEffect(e["name"], e["loss_change"], e["size"]) for e in d["single_head_terms"]]
        virtual = [TermEffect(e["name"], e["loss_change"], e["size"]) for e in d["virtual_head_terms"]]
        pairs, expanded = d.get("virtual_pairs", 0), d.get("virtual_expanded", True)
        return cls(d["tokens"], d["reconstruction_max_abs_error"], importance, singles, virtual, pairs, expanded)


def expansion_bytes(source: WeightSource, batch: int, seq: int, *, virtual: int = 0) -> int:
    """Memory :func:`summarize` holds at its peak, about: every head's term and the orders
    (``[batch, seq, d_model]`` each), ``virtual`` kept virtual-head terms, the frozen patterns,
    the per-head outputs of term importance and three ``[batch, seq, d_vocab]`` logits."""
    c = source.cfg
    size = torch.finfo(source.dtype).bits // 8
    term = batch * seq * c.d_model
    terms = (c.n_layers + 4 + 3 * c.n_layers * c.n_heads + virtual + 2 * c.n_heads) * term
    patterns = c.n_layers * batch * c.n_heads * seq * seq
    return (terms + patterns + 3 * batch * seq * c.d_vocab) * size


@torch.no_grad()
def summarize(
    source: WeightSource,
    tokens: Tensor,
    *,
    top_virtual: int = 10,
    virtual: bool | None = None,
    progress: Progress | None = None,
) -> PathSummary:
    """Expand ``tokens [B, T]``, run the paper's term importance and measure the effect of each
    single-head and the ``top_virtual`` largest virtual-head terms.

    ``virtual``: expand virtual heads (pairs of heads in increasing layers); ``None`` does so
    when the model has at most :data:`VIRTUAL_AUTO_MAX` of them (GPT-2 small has 9,504: each
    costs a pass of its reader layer over the batch). Only the ``top_virtual`` largest are
    held. Refuses (one-line :class:`QkovError`) a batch whose terms would not fit in free
    memory (:func:`expansion_bytes`), before any work.
    """
    pairs = virtual_pairs(source)
    do_virtual = pairs > 0 and (pairs <= VIRTUAL_AUTO_MAX if virtual is None else virtual)
    B, T = tokens.shape
    need = expansion_bytes(source, B, T, virtual=top_virtual if do_virtual else 0)
    check_fits(need, source.device, f"paths: the expansion of {B} x {T} tokens", "analyse fewer sequences")
    importance = term_importance(source, tokens, progress=progress)
    exp = expand(source, tokens, virtual_heads=do_virtual, keep_virtual=top_virtual, progress=progress)
    singles, virt = term_effects(exp, top_virtual=top_virtual, progress=progress)
    return PathSummary(list(tokens.shape), exp.reconstruction_error(), importance, singles, virt, pairs, do_virtual)
