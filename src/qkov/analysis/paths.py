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

:func:`term_importance` (:mod:`qkov.analysis.importance`) is the paper's procedure (zero every
head's output under frozen patterns, then repeatedly let each head add the output it computed on
the previous run). :func:`qkov.analysis.qk_split.qk_split` expands a head's pre-softmax scores the same way.

The recorded run is :func:`qkov.analysis.forward.trace`; the expansion applies its layer pieces
(:func:`~qkov.analysis.forward.read`, :func:`~qkov.analysis.forward.project`,
:func:`~qkov.analysis.forward.head_writes`) to single stream terms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..device import check_fits
from ..weights.parts import WeightSource
from ..weights.convert import SourceLike, as_source
from .budget import expansion_bytes as expansion_bytes  # the memory plan of summarize, kept here by name
from .forward import Trace, flops_per_token
from .frozen import head_terms, read
from . import split
from .head_logits import SampledTerms
from .importance import TermImportance, frozen_run, heads_write, lm_loss, loss, rms, term_importance
from .progress import Progress, tick
from .sampling import seeded_subset
from .shown import Shown
from .term_results import TermEffect, TermEffects
from .virtual import VirtualCoverage, materialize, select_virtual, virtual_keys

VIRTUAL_AUTO_MAX = 1024  # virtual heads materialised by default (GPT-2 small has 9,504; 1,024 take ~10 s there)
BATCH_TOKENS = 2048  # tokens the default batch holds at most (8 sequences of 256, 2 of 1024)
RUN_FLOPS = 3 * 10**11  # one forward pass over the default paths batch costs at most this (term importance runs L + 1)
EFFECT_LOGITS = 2**24  # logits per term effect: above it, effects are measured on a seeded sample of positions


def default_batch(n_ctx: int, most: int = 8) -> int:
    """Sequences of ``n_ctx`` tokens a pattern analysis takes by default: ``most``, or fewer so the
    batch holds at most :data:`BATCH_TOKENS` tokens."""
    return max(1, min(most, BATCH_TOKENS // n_ctx))


def paths_batch(cfg: Any, most: int = 8) -> int:
    """Sequences of ``n_ctx`` tokens the path analysis takes by default: :func:`default_batch`, or
    fewer so that one forward pass costs at most :data:`RUN_FLOPS` (but at least one sequence):
    8 of 256 tokens for the default models, 1 of 1024 for GPT-2 small."""
    tokens = min(BATCH_TOKENS, max(cfg.n_ctx, RUN_FLOPS // flops_per_token(cfg)))
    return max(1, min(most, tokens // cfg.n_ctx))


def virtual_pairs(source: WeightSource) -> int:
    """Virtual heads: pairs of heads in strictly increasing layers, ``H^2 L (L-1) / 2``."""
    L, H = source.cfg.n_layers, source.cfg.n_heads
    return H * H * L * (L - 1) // 2


# -------------------------------------------------------------------- expansion
@dataclass
class Expansion:
    """Logits split by path. Residual-stream terms are kept (``[B, T, D]``); logits on demand.

    ``orders[k]`` is the final-stream contribution of all paths through exactly k heads;
    ``heads[(l, h)]`` the order-1 term of one head; ``virtual[(l1, h1, l2, h2)]`` one
    order-2 term (only when asked for); ``bias`` and ``mlp`` as in the module docstring.
    ``direct``: the direct path the heads read (from :func:`expand`; :func:`~qkov.analysis.head_logits.term_logits`).
    """

    run: Trace
    source: WeightSource
    orders: list[Tensor]
    bias: Tensor
    mlp: Tensor
    heads: dict[tuple[int, int], Tensor]
    virtual: dict[tuple[int, int, int, int], Tensor]
    direct: Tensor | None = None

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
    source: SourceLike,
    tokens: Tensor,
    *,
    max_order: int | None = None,
    per_head: bool = True,
    virtual_heads: bool = False,
    keep_virtual: int | None = None,
    progress: Progress | None = None,
    run: Trace | None = None,
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
        run: the :func:`frozen_run` of ``tokens``, if made already.
    """
    source = as_source(source, where="qkov.expand")
    cfg = source.cfg
    r = frozen_run(source, tokens) if run is None else run
    T = r.tokens.shape[1]
    x0 = source.embed()[r.tokens]
    if cfg.positional == "standard":
        x0 = x0 + source.pos()[:T]  # type: ignore[index]
    L = cfg.n_layers
    orders: list[Tensor] = [x0] + [torch.zeros_like(x0) for _ in range(L)]
    bias = torch.zeros_like(x0)
    mlp = torch.zeros_like(x0)
    heads: dict[tuple[int, int], Tensor] = {}
    for l in range(L):
        att = source.attention(l)
        # bias of this layer: b_V through the (row-stochastic) pattern, plus b_O
        new_bias = torch.einsum("he,hed->d", att.b_V, att.W_O) + att.b_O
        bias_through = heads_write(source, r, l, bias, value_bias=False)  # each sum: no [H, B, T, D]
        mlp_through = heads_write(source, r, l, mlp, value_bias=False)
        # carry the stream order by order, highest first so each order is read before it grows
        for k in range(l, -1, -1):
            if float(orders[k].abs().max()) == 0.0 and k > 0:
                continue
            if k == 0 and (per_head or virtual_heads):
                outs = head_terms(source, r, l, orders[k])  # [H, B, T, D]
                heads.update({(l, h): outs[h] for h in range(cfg.n_heads)})
                orders[k + 1] = orders[k + 1] + outs.sum(0)
            else:  # only the sum over heads is kept
                orders[k + 1] = orders[k + 1] + heads_write(source, r, l, orders[k], value_bias=False)
        bias = bias + bias_through + new_bias
        mlp = mlp + mlp_through
        if cfg.d_mlp is not None:
            mlp = mlp + r["mlp_out", l]
        tick(progress, "paths: expansion", l + 1, L)
    virtual: dict[tuple[int, int, int, int], Tensor] = {}
    if virtual_heads:
        virtual = materialize(source, r, heads, virtual_keys(cfg), keep=keep_virtual, progress=progress)[0]
    if not per_head:
        heads = {}
    if max_order is not None and max_order < L:
        tail = sum(orders[max_order + 1 :], torch.zeros_like(x0))
        orders = orders[: max_order + 1]
        orders[-1] = orders[-1] + tail
    return Expansion(r, source, orders, bias, mlp, heads, virtual, x0)


# ------------------------------------------------------------------ term effects
def effect_positions(exp: Expansion, max_logits: int = EFFECT_LOGITS) -> Tensor | None:
    """The ``(b, t)`` positions term effects are measured on: ``None`` (every position) when their
    logits hold at most ``max_logits`` entries, else a seeded sample of ``max_logits // d_vocab``
    (at least 64) positions that have a next token, as ``[n, 2]``."""
    B, T = exp.run.tokens.shape
    V = exp.source.cfg.d_vocab
    n = B * (T - 1)
    if n * V <= max_logits:
        return None
    pick = seeded_subset(n, max(64, max_logits // V))
    return torch.stack([pick // (T - 1), pick % (T - 1)], 1).to(exp.run.tokens.device)


def term_effects(
    exp: Expansion, *, top_virtual: int = 10, positions: Tensor | None = None, progress: Progress | None = None
) -> TermEffects:
    """Loss change from removing each order-1 term, and each of the ``top_virtual`` largest order-2
    terms: a :class:`TermEffects` (``.singles``, ``.virtual``; it still unpacks as the pre-1.0 pair).

    Logits are built one term at a time (never ``[B, T, V]`` for all terms at once), at every
    position, or at ``positions [n, 2]`` (``(b, t)`` pairs, :func:`effect_positions`) only.
    """
    toks = exp.run.tokens
    at: Any = exp.logits_of
    lossf: Any = lambda lg: loss(lg, toks)  # noqa: E731
    if positions is not None:
        b, t = positions[:, 0], positions[:, 1]
        scale, W_U, target = exp.run.divisor("final"), exp.source.unembed().W_U, toks[b, t + 1]

        def at(x: Tensor) -> Tensor:  # [n, 1, V] at the sampled positions
            return read(x[b, t][:, None], exp.source.norm, None if scale is None else scale[b, t][:, None]) @ W_U

        lossf = lambda lg: lm_loss(lg[:, 0], target, overwrite=True)  # noqa: E731

    full = at(sum(exp.orders, torch.zeros_like(exp.bias)) + exp.bias + exp.mlp) + exp.source.unembed().b_U
    base = lossf(full.clone())
    sized = sorted(exp.virtual.items(), key=lambda kv: -float(kv[1].pow(2).mean()))[:top_virtual]
    keys = list(exp.heads) + [key for key, _ in sized]
    names = [f"{l}.{h}" for l, h in exp.heads] + [f"{l1}.{h1}->{l2}.{h2}" for (l1, h1, l2, h2), _ in sized]
    terms = list(exp.heads.values()) + [term for _, term in sized]
    through = None if positions is None or exp.direct is None else SampledTerms(exp.source, exp.run, b, t, full[:, 0])

    def without(key: tuple[int, ...], x: Tensor) -> tuple[Tensor, float]:  # the logits less the term's; its size
        x_in = exp.direct if len(key) == 2 else exp.heads.get(key[:2])
        if through is None or x_in is None:
            tl = at(x)
            size = rms(tl)
            return torch.sub(full, tl, out=tl), size
        z, size = through.without(key, x_in)  # sampled: through the term's last head
        return z[:, None], size

    sp, parts = split.current(), {}  # a unit: one term; a rank's terms taken by the layer they end in
    mine = sorted((u for u in range(len(terms)) if sp.mine(u, len(terms))), key=lambda u: keys[u][-2])
    for i, u in enumerate(mine):
        z, size = without(keys[u], terms[u])
        parts[u] = TermEffect(names[u], lossf(z) - base, size)
        tick(progress, "paths: term effects", i + 1, len(mine))
    effects = sp.gather(parts, len(terms))
    singles, virtual = effects[: len(exp.heads)], effects[len(exp.heads) :]
    singles.sort(key=lambda e: -e.loss_change)
    virtual.sort(key=lambda e: -e.loss_change)
    return TermEffects(singles, virtual)


@dataclass(repr=False)
class PathSummary(Shown):
    """What ``qkov paths`` and the report show: exactness, term importance, the terms that matter."""

    shape: list[int]  # [batch, seq] of the tokens
    reconstruction_error: float  # max |sum of all terms - the model's logits|
    importance: TermImportance
    singles: list[TermEffect]  # every single-head term, by loss change
    virtual: list[TermEffect]  # the largest virtual-head terms, by loss change
    coverage: VirtualCoverage | None = None  # which virtual heads were materialised; None: none were
    effect_positions: int | None = None  # positions the term effects were measured on (None: every one)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.shape,
            "reconstruction_max_abs_error": self.reconstruction_error,
            "term_importance": self.importance.to_dict(),
            "single_head_terms": [e.to_dict() for e in self.singles],
            "virtual_head_terms": [e.to_dict() for e in self.virtual],
            "virtual_coverage": None if self.coverage is None else self.coverage.to_dict(),
            "effect_positions": self.effect_positions,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PathSummary":
        """The summary from its :meth:`to_dict` form."""
        ti = d["term_importance"]
        importance = TermImportance(ti["run_losses"], ti["full_loss"], ti["uniform_loss"])
        singles = [TermEffect(e["name"], e["loss_change"], e["size"]) for e in d["single_head_terms"]]
        virtual = [TermEffect(e["name"], e["loss_change"], e["size"]) for e in d["virtual_head_terms"]]
        cover = d.get("virtual_coverage")
        coverage = None if cover is None else VirtualCoverage.from_dict(cover)
        shape, err, sampled = d["tokens"], d["reconstruction_max_abs_error"], d.get("effect_positions")
        return cls(shape, err, importance, singles, virtual, coverage, sampled)


@torch.no_grad()
def summarize(
    source: WeightSource,
    tokens: Tensor,
    *,
    top_virtual: int = 10,
    virtual_terms: int | None = VIRTUAL_AUTO_MAX,
    progress: Progress | None = None,
) -> PathSummary:
    """Expand ``tokens [B, T]``, run the paper's term importance and measure the effect of each
    single-head and the ``top_virtual`` largest virtual-head terms (on every position, or on a
    seeded sample of them when their logits would exceed :data:`EFFECT_LOGITS`: 333 positions at
    GPT-2's vocabulary; :attr:`PathSummary.effect_positions` says which).

    ``virtual_terms``: how many virtual heads (pairs of heads in increasing layers, each a pass
    of its reader head over the batch) to materialise: all of them when the model has at most
    that many (``None``: always all), else that many chosen by an upper bound on their size
    (:mod:`qkov.analysis.virtual`), with the share of the order-2 term they explain stated in
    :attr:`PathSummary.coverage`; 0 materialises none. Only the ``top_virtual`` largest are held.
    Refuses (one-line :class:`QkovError`) a batch whose terms would not fit in free memory
    (:func:`expansion_bytes`), before any work.
    """
    do_virtual = virtual_pairs(source) > 0 and virtual_terms != 0
    tokens = tokens[None] if tokens.ndim == 1 else tokens
    B, T = tokens.shape
    need = expansion_bytes(source, B, T, virtual=top_virtual + 1 if do_virtual else 0)
    check_fits(
        need, source.device, f"paths: the expansion of {B} x {T} tokens", "analyse fewer sequences", hint="batch"
    )
    real = frozen_run(source, tokens)  # one recorded run serves term importance and the expansion
    importance = term_importance(source, tokens, progress=progress, run=real)
    exp = expand(source, tokens, progress=progress, run=real)
    coverage = None
    if do_virtual:
        exp.virtual, coverage = select_virtual(
            source, exp.run, exp.heads, exp.orders[2], most=virtual_terms, keep=top_virtual, progress=progress
        )
    positions = effect_positions(exp)
    effects = term_effects(exp, top_virtual=top_virtual, positions=positions, progress=progress)
    singles, virt = effects.singles, effects.virtual
    sampled = None if positions is None else len(positions)
    return PathSummary(list(tokens.shape), exp.reconstruction_error(), importance, singles, virt, coverage, sampled)
