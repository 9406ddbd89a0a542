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

A gated model's attention gates are frozen too (each head's write at query ``t`` is its mixed values
times the recorded gate, then ``W_O``): the sum stays exact (docs/architectures.md).

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

:func:`term_importance` (:mod:`qkov.analysis.paths.importance`) is the paper's procedure (zero every
head's output under frozen patterns, then repeatedly let each head add the output it computed on
the previous run). :func:`qkov.analysis.paths.qk_side.expand_qk` expands a head's pre-softmax scores the same way.

A routed model (``residual`` other than ``sum``) expands through its frozen routes
(:mod:`qkov.analysis.paths.routed`): the same terms, each path carrying its routing coefficients.

The recording is :func:`qkov.analysis.forward.tracer.trace`; the expansion applies its layer pieces
(:func:`~qkov.analysis.forward.frozen.read`, :func:`~qkov.analysis.forward.tracer.project`,
:func:`~qkov.analysis.forward.frozen.head_writes`) to single stream terms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...weights.parts import WeightSource
from ...weights.convert import SourceLike, as_source
from ..forward.cache import Trace
from ..forward.tracer import flops_per_token
from ..forward.frozen import frozen_gate, head_terms, read
from .importance import heads_write
from ..forward.frozen import frozen_recording
from ...progress import Progress, tick
from .virtual import materialize, virtual_keys
from .routed import expand_routed
from ...errors import QkovError

__all__ = [
    "BATCH_TOKENS",
    "default_batch",
    "expand",
    "Expansion",
    "paths_batch",
    "PASS_FLOPS",
    "VIRTUAL_AUTO_MAX",
    "virtual_pairs",
]

VIRTUAL_AUTO_MAX = 1024  # virtual heads materialised by default (GPT-2 small has 9,504; 1,024 take ~10 s there)
BATCH_TOKENS = 2048  # tokens the default batch holds at most (8 sequences of 256, 2 of 1024)
PASS_FLOPS = 3 * 10**11  # one forward pass over the default paths batch costs at most this (term importance runs L + 1)


def default_batch(n_ctx: int, most: int = 8) -> int:
    """Sequences of ``n_ctx`` tokens a pattern analysis takes by default: ``most``, or fewer so the
    batch holds at most :data:`BATCH_TOKENS` tokens."""
    return max(1, min(most, BATCH_TOKENS // n_ctx))


def paths_batch(cfg: Any, most: int = 8) -> int:
    """Sequences of ``n_ctx`` tokens the path analysis takes by default: :func:`default_batch`, or
    fewer so that one forward pass costs at most :data:`PASS_FLOPS` (but at least one sequence):
    8 of 256 tokens for the default models, 1 of 1024 for GPT-2 small."""
    tokens = min(BATCH_TOKENS, max(cfg.n_ctx, PASS_FLOPS // flops_per_token(cfg)))
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
    ``direct``: the direct path the heads read (from :func:`expand`; :func:`~qkov.analysis.paths.effects.term_logits`).
    """

    recording: Trace
    source: WeightSource
    orders: list[Tensor]
    bias: Tensor
    mlp: Tensor
    heads: dict[tuple[int, int], Tensor]
    virtual: dict[tuple[int, int, int, int], Tensor]
    direct: Tensor | None = None

    def logits_of(self, resid: Tensor) -> Tensor:
        """``[B, T, V]`` logits of one stream term (the final LN scale frozen; no b_U)."""
        return read(resid, self.source.norm, self.recording.divisor("final")) @ self.source.unembed().W_U

    def order_logits(self) -> list[Tensor]:
        return [self.logits_of(t) for t in self.orders]

    def bias_logits(self) -> Tensor:
        return self.logits_of(self.bias) + self.source.unembed().b_U

    def total_logits(self) -> Tensor:
        """The sum of every term's logits: equals the model's logits."""
        total = sum(self.orders, torch.zeros_like(self.bias)) + self.bias + self.mlp
        return self.logits_of(total) + self.source.unembed().b_U

    def reconstruction_error(self) -> float:
        return float((self.total_logits() - self.recording.logits).abs().max())


def expand(
    source: SourceLike,
    tokens: Tensor,
    *,
    max_order: int | None = None,
    per_head: bool = True,
    virtual_heads: bool = False,
    keep_virtual: int | None = None,
    progress: Progress | None = None,
    recording: Trace | None = None,
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
        recording: the :func:`frozen_recording` of ``tokens``, if made already.
    """
    source = as_source(source, where="qkov.expand")
    cfg = source.cfg
    r = frozen_recording(source, tokens) if recording is None else recording
    T = r.tokens.shape[1]
    x0 = source.embed()[r.tokens]
    if cfg.positional == "standard":
        x0 = x0 + source.pos()[:T]  # type: ignore[index]
    L = cfg.n_layers
    if cfg.residual != "sum":  # the routes frozen: every path carries its routing coefficients
        if virtual_heads:
            raise QkovError(f"paths: virtual-head terms need the additive residual stream, not residual {cfg.residual!r}")
        orders, bias, mlp, heads = expand_routed(source, r, x0, per_head=per_head, progress=progress)
        return Expansion(r, source, _cap(orders, max_order), bias, mlp, heads, {}, None)
    orders: list[Tensor] = [x0] + [torch.zeros_like(x0) for _ in range(L)]
    bias = torch.zeros_like(x0)
    mlp = torch.zeros_like(x0)
    heads: dict[tuple[int, int], Tensor] = {}
    for l in range(L):
        att = source.attention(l)
        # bias of this layer: b_V through the (row-stochastic) pattern, plus b_O; gated: times each query's gate
        g = frozen_gate(r, l)
        if g is None:
            new_bias = torch.einsum("he,hed->d", att.b_V, att.W_O) + att.b_O
        else:
            new_bias = torch.einsum("bhte,hed->btd", att.b_V[None, :, None] * g, att.W_O) + att.b_O
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
    return Expansion(r, source, _cap(orders, max_order), bias, mlp, heads, virtual, x0)


def _cap(orders: list[Tensor], max_order: int | None) -> list[Tensor]:
    """``orders`` with those above ``max_order`` summed into the last one kept."""
    if max_order is None or max_order >= len(orders) - 1:
        return orders
    tail = sum(orders[max_order + 1 :], torch.zeros_like(orders[0]))
    orders = orders[: max_order + 1]
    orders[-1] = orders[-1] + tail
    return orders


# ------------------------------------------------------------------ term effects


