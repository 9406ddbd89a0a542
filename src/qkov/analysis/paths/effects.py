"""Term effects: how much the loss rises when one path term is removed from the logits.

:func:`term_effects` measures it for every order-1 head term and the kept virtual-head terms of an
:class:`~qkov.analysis.paths.expansion.Expansion`, at every position or at a seeded sample of them
when their logits would exceed :data:`EFFECT_LOGITS`; it returns :class:`TermEffects`.

A path term's logits at a few positions, read through its last head's ``d_head`` values.

A term that ends in head ``h`` of layer ``l`` (an order-1 term, or a virtual head ``l1.h1 -> l.h``)
is ``y @ W_O[h]`` with ``y = A_h @ (read(x_in) @ W_V[h])`` (``A_h`` the frozen pattern, ``x_in``
the stream term the head reads: the direct path, or the writer's term). Its logits at position
``(b, t)`` are ``read(y W_O[h]) @ W_U``; the frozen final read centres (a projection of each row)
and divides by the position's divisor, both linear, so they equal ``(y @ read(W_O[h])) @ W_U / s``:
one ``[d_head, d_vocab]`` product per head (made for all heads of a layer at once,
:func:`head_unembed`) and ``d_head``-wide rows per position instead of
``d_model``-wide ones (about 3.6x fewer operations for GPT-2 small's term effects). A test checks
them against the term's own logits (:meth:`qkov.analysis.paths.expansion.Expansion.logits_of`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...weights.parts import WeightSource
from ..forward.cache import Trace
from ..forward.frozen import frozen_gate, frozen_values, read
from ..shown import Shown
from ... import ranks
from .importance import lm_loss, loss, rms
from ...progress import Progress, tick
from ..sampling import seeded_subset
from .expansion import Expansion
from ..shown import TEXT, num, register, table

__all__ = [
    "EFFECT_LOGITS",
    "effect_positions",
    "GRAM_COLUMNS",
    "head_read",
    "head_unembed",
    "head_values",
    "SampledTerms",
    "term_effects",
    "term_effects_text",
    "term_logits",
    "TermEffect",
    "TermEffects",
    "unembed_gram",
]


def head_read(source: WeightSource, layer: int) -> Tensor:
    """``[H, E, D]``: each head's ``W_O`` as the final normalisation reads it (centred where it centres;
    its divisor applied per position later)."""
    W_O = source.attention(layer).W_O  # [H, E, D]
    H, E, D = W_O.shape
    if source.norm != "none":
        W_O = read(W_O, source.norm, torch.ones(H, E, 1, dtype=W_O.dtype, device=W_O.device))
    return W_O


def head_unembed(source: WeightSource, layer: int, R: Tensor | None = None) -> Tensor:
    """``[H, E, V]``: each head's :func:`head_read` (``R``, if made already) times ``W_U``: one product for
    the layer."""
    R = head_read(source, layer) if R is None else R
    H, E, D = R.shape
    return (R.reshape(H * E, D) @ source.unembed().W_U).view(H, E, -1)


def head_values(
    source: WeightSource, recording: Trace, key: tuple[int, ...], x_in: Tensor, b: Tensor, t: Tensor, v: Tensor | None = None
) -> Tensor:
    """``y / s`` ``[n, E]`` at positions ``(b[i], t[i])``: what head ``layer, head = key[-2:]`` reads
    from ``x_in [B, T, D]`` and mixes by its frozen pattern, over the final divisor (see the module
    docstring); its logits are ``y / s @ head_unembed(source, layer)[head]``. ``v``: the head's
    values of ``x_in`` ``[B, T, E]``, if made already. Only the pattern rows at the positions are used."""
    layer, head = key[-2], key[-1]
    if v is None:
        v = frozen_values(source, recording, layer, x_in, heads=[head])[:, 0]
    pattern = recording["pattern", layer]
    y = v.new_empty(len(b), v.shape[-1])
    for seq in b.unique().tolist():  # [n, T] rows of one sequence's pattern, then its values
        at = (b == seq).nonzero()[:, 0]
        y[at] = pattern[seq, head, t[at]] @ v[seq]
    g = frozen_gate(recording, layer, [head])  # [B, 1, T, G]: a gated head's write is scaled by its query's gate
    if g is not None:
        y = y * g[b, 0, t]
    scale = recording.divisor("final")
    return y if scale is None else y / scale[b, t]


def term_logits(
    source: WeightSource,
    recording: Trace,
    key: tuple[int, ...],
    x_in: Tensor,
    b: Tensor,
    t: Tensor,
    unembedded: Tensor | None = None,
) -> Tensor:
    """Logits ``[n, 1, V]`` (no ``b_U``) at positions ``(b[i], t[i])`` of the term that head
    ``layer, head = key[-2:]`` writes for the stream term ``x_in [B, T, D]`` alone (the term
    :func:`~qkov.analysis.forward.frozen.head_terms` gives), the recording's patterns and divisors frozen.
    ``unembedded``: :func:`head_unembed` of the layer, if made already (terms ending in one layer share it)."""
    P = head_unembed(source, key[-2]) if unembedded is None else unembedded
    return (head_values(source, recording, key, x_in, b, t) @ P[key[-1]])[:, None]


class SampledTerms:
    """The model's logits at sampled positions with one term's logits taken out, term after term:
    ``full [n, V]`` minus :func:`term_logits` in one fused product into one reused ``[n, V]``
    buffer, and the term's root mean square logit from ``y^T y`` and ``P P^T`` (float64, ``[E, E]``)
    instead of from its ``[n, V]`` logits. Give the terms ending in one layer one after another:
    the layer's :func:`head_unembed` is kept until the next layer's is needed."""

    def __init__(self, source: WeightSource, recording: Trace, b: Tensor, t: Tensor, full: Tensor) -> None:
        self.source, self.recording, self.b, self.t, self.full = source, recording, b, t, full
        self.buffer = torch.empty_like(full)
        self.layer: int | None = None
        self.UU: Tensor | None = None  # W_U W_U^T (float64), made with the first layer's Gram matrices
        self.values: tuple[int, Tensor, Tensor] | None = None  # (layer, x_in, [B, H, T, E]) of the last order-1 term

    def without(self, key: tuple[int, ...], x_in: Tensor) -> tuple[Tensor, float]:
        """``full - term logits`` ``[n, V]`` (the shared buffer: overwritten by the next call) and
        the term's root mean square logit, for the term of :func:`term_logits`."""
        if key[-2] != self.layer:
            self.P = None  # free the last layer's before making the next
            R = head_read(self.source, key[-2])
            self.P = head_unembed(self.source, key[-2], R)
            if self.UU is None:
                self.UU = unembed_gram(self.source.unembed().W_U)
            self.gram, self.layer = _gram(R, self.UU), key[-2]  # [H, E, E]
        layer = key[-2]
        if len(key) == 2 and (self.values is None or self.values[0] != layer or self.values[1] is not x_in):
            v = frozen_values(self.source, self.recording, layer, x_in)  # order-1 terms of a layer read one x_in: every head's values at once
            self.values = (layer, x_in, v)
        v = self.values[2][:, key[-1]] if len(key) == 2 else None  # type: ignore[index]
        y = head_values(self.source, self.recording, key, x_in, self.b, self.t, v)
        z = torch.addmm(self.full, y, self.P[key[-1]], alpha=-1, out=self.buffer)
        yd = y.double()
        square = float(((yd.T @ yd) * self.gram[key[-1]]).sum().clamp_min(0))
        return z, math.sqrt(square / z.numel())


GRAM_COLUMNS = 4096  # columns of W_U converted to float64 at a time by :func:`unembed_gram`


def unembed_gram(W_U: Tensor) -> Tensor:
    """``W_U W_U^T`` ``[D, D]`` in float64 for ``W_U [D, V]``, summed over column blocks of
    :data:`GRAM_COLUMNS` (no float64 copy of the whole ``W_U``: 0.3 GB at GPT-2's vocabulary)."""
    D, V = W_U.shape
    out = torch.zeros(D, D, dtype=torch.float64, device=W_U.device)
    for lo in range(0, V, GRAM_COLUMNS):
        block = W_U[:, lo : lo + GRAM_COLUMNS].double()
        out.addmm_(block, block.T)
    return out


def _gram(R: Tensor, UU: Tensor) -> Tensor:
    """``P P^T`` ``[H, E, E]`` in float64 for ``P = R W_U`` (:func:`head_unembed`), from ``R [H, E, D]`` and
    ``UU =`` :func:`unembed_gram`: ``R UU R^T``, the vocabulary summed once for every layer (forming each
    layer's ``P`` in float64 cost ~0.25 s per layer at GPT-2 shape; this ~0.01 s)."""
    Rd = R.double()
    return Rd @ UU @ Rd.transpose(1, 2)


@dataclass
class TermEffect:
    name: str  # "0.3" or "0.3->1.2"
    loss_change: float  # loss without the term minus the full loss (nats; positive = the term helps)
    size: float  # RMS of the term's logits

    def to_dict(self) -> dict[str, Any]:
        return vars(self).copy()


@dataclass(repr=False)
class TermEffects(Shown):
    """Every single-head term and the largest virtual-head terms, each by loss change (largest first);
    its text form is registered by :mod:`qkov.analysis.shown`."""

    singles: list[TermEffect]
    virtual: list[TermEffect]

    def to_dict(self) -> dict[str, Any]:
        singles, virtual = [e.to_dict() for e in self.singles], [e.to_dict() for e in self.virtual]
        return {"single_head_terms": singles, "virtual_head_terms": virtual}


EFFECT_LOGITS = 2**24  # logits per term effect: above it, effects are measured on a seeded sample of positions


def effect_positions(exp: Expansion, max_logits: int = EFFECT_LOGITS) -> Tensor | None:
    """The ``(b, t)`` positions term effects are measured on: ``None`` (every position) when their
    logits hold at most ``max_logits`` entries, else a seeded sample of ``max_logits // d_vocab``
    (at least 64) positions that have a next token, as ``[n, 2]``."""
    B, T = exp.recording.tokens.shape
    V = exp.source.cfg.d_vocab
    n = B * (T - 1)
    if n * V <= max_logits:
        return None
    pick = seeded_subset(n, max(64, max_logits // V))
    return torch.stack([pick // (T - 1), pick % (T - 1)], 1).to(exp.recording.tokens.device)


def term_effects(
    exp: Expansion, *, top_virtual: int = 10, positions: Tensor | None = None, progress: Progress | None = None
) -> TermEffects:
    """Loss change from removing each order-1 term, and each of the ``top_virtual`` largest order-2
    terms: a :class:`TermEffects` (``.singles``, ``.virtual``).

    Logits are built one term at a time (never ``[B, T, V]`` for all terms at once), at every
    position, or at ``positions [n, 2]`` (``(b, t)`` pairs, :func:`effect_positions`) only.
    """
    toks = exp.recording.tokens
    at: Any = exp.logits_of
    lossf: Any = lambda lg: loss(lg, toks)  # noqa: E731
    if positions is not None:
        b, t = positions[:, 0], positions[:, 1]
        scale, W_U, target = exp.recording.divisor("final"), exp.source.unembed().W_U, toks[b, t + 1]

        def at(x: Tensor) -> Tensor:  # [n, 1, V] at the sampled positions
            return read(x[b, t][:, None], exp.source.norm, None if scale is None else scale[b, t][:, None]) @ W_U

        lossf = lambda lg: lm_loss(lg[:, 0], target, overwrite=True)  # noqa: E731

    full = at(sum(exp.orders, torch.zeros_like(exp.bias)) + exp.bias + exp.mlp) + exp.source.unembed().b_U
    base = lossf(full.clone())
    sized = sorted(exp.virtual.items(), key=lambda kv: -float(kv[1].pow(2).mean()))[:top_virtual]
    keys = list(exp.heads) + [key for key, _ in sized]
    names = [f"{l}.{h}" for l, h in exp.heads] + [f"{l1}.{h1}->{l2}.{h2}" for (l1, h1, l2, h2), _ in sized]
    terms = list(exp.heads.values()) + [term for _, term in sized]
    through = None if positions is None or exp.direct is None else SampledTerms(exp.source, exp.recording, b, t, full[:, 0])

    def without(key: tuple[int, ...], x: Tensor) -> tuple[Tensor, float]:  # the logits less the term's; its size
        x_in = exp.direct if len(key) == 2 else exp.heads.get(key[:2])
        if through is None or x_in is None:
            tl = at(x)
            size = rms(tl)
            return torch.sub(full, tl, out=tl), size
        z, size = through.without(key, x_in)  # sampled: through the term's last head
        return z[:, None], size

    sp, parts = ranks.current(), {}  # a unit: one term; a rank's terms taken by the layer they end in
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


@register(TEXT, TermEffects)
def term_effects_text(t: TermEffects) -> str:
    terms = lambda effects: [[e.name, num(e.loss_change, 4), num(e.size)] for e in effects]  # noqa: E731
    lines = ["TermEffects: single-head terms (loss increase when removed):"]
    lines.append(table(["term", "loss_change", "rms_logit"], terms(t.singles)))
    if t.virtual:
        lines += ["virtual-head terms:", table(["term", "loss_change", "rms_logit"], terms(t.virtual))]
    return "\n".join(lines)
