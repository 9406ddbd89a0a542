"""Virtual attention heads at any depth: which order-2 path terms to materialise, and what they cover.

A virtual head ``l1.h1 -> l2.h2`` is the order-2 path through head ``h1`` of layer ``l1`` and
then, through its values, head ``h2`` of a later layer ``l2`` (its pattern frozen). A model of
``L`` layers of ``H`` heads has ``H^2 L (L-1) / 2`` of them (9,504 in GPT-2 small), and each costs
a pass of its reader head over the batch. Where that is cheap every one is materialised; elsewhere
the ones to materialise are chosen by a cheap upper bound on each term's size. Each row of a
frozen pattern ``A2`` is a convex combination (it sums to one), so by Jensen's inequality

    ||A2 Z||_F^2 = sum_i ||sum_j A2[i, j] z_j||^2  <=  sum_j c_j ||z_j||^2,     c_j = sum_i A2[i, j]

and with ``z_j = centre(y_j) / s_j @ W_V2 W_O2`` (``y_j`` the order-1 term of ``h1`` at key
position ``j``, ``s_j`` the reader's frozen normalisation divisor; centring is a projection and
only shrinks)

    ||term||_F^2  <=  sigma_max(W_V2 W_O2)^2 * sum_j c_j ||y_j||^2 / s_j^2

summed over sequences. It costs one ``[positions]`` product per pair. A gated reader multiplies each
row by its frozen gate, in ``(0, 1)``: a headwise gate only shrinks the term, so the bound holds as it
is; an elementwise one makes the reader's OV ``W_V2 diag(g) W_O2``, bounded by
``sigma_max(W_V2) sigma_max(W_O2)``, which replaces ``sigma_max(W_V2 W_O2)`` there. What was left out is then
stated exactly, not guessed: :class:`VirtualCoverage` holds the share of the order-2 term (the sum
of *all* virtual heads, which the expansion carries exactly) that the materialised ones explain,
and the largest bound among those left out, so no term that was not materialised can be larger.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...model.bus import require_sum_residual
from ...errors import QkovError
from ...finite import finite
from ...model.config import ModelConfig
from ...weights.parts import WeightSource
from ..circuits.factored import LowRank
from ..forward.cache import Trace
from ..forward.frozen import frozen_gate, frozen_values
from ...progress import Progress, tick

__all__ = ["Key", "materialize", "select_virtual", "virtual_bounds", "virtual_keys", "VirtualCoverage"]

Key = tuple[int, int, int, int]  # (l1, h1, l2, h2): writer head, then reader head in a later layer


def virtual_keys(cfg: ModelConfig) -> list[Key]:
    """Every virtual head of a model, writer layer first."""
    L, H = cfg.n_layers, cfg.n_heads
    return [(l1, h1, l2, h2) for l1 in range(L) for h1 in range(H) for l2 in range(l1 + 1, L) for h2 in range(H)]


@torch.no_grad()
def virtual_bounds(source: WeightSource, recording: Trace, first_order: dict[tuple[int, int], Tensor]) -> dict[Key, float]:
    """The upper bound of the module docstring on ``||term||_F`` of every virtual head.

    ``recording``: the frozen recording (patterns and normalisation divisors recorded); ``first_order``:
    each head's order-1 term ``[B, T, D]``.
    """
    cfg = source.cfg
    # [B, T] squared norms, summed in float64 without a float64 copy of each term
    y2 = {key: torch.linalg.vector_norm(y, dim=-1, dtype=torch.float64).square() for key, y in first_order.items()}
    bounds: dict[Key, float] = {}
    for l2 in range(1, cfg.n_layers):
        att = source.attention(l2)
        sigma = LowRank(att.W_V.double(), att.W_O.double()).svd()[1][:, 0]  # [H] largest singular value of W_OV
        if getattr(cfg, "gate", "none") == "elementwise":  # W_V diag(g) W_O, 0 < g < 1: bounded by |W_V| |W_O|
            sigma = torch.linalg.matrix_norm(att.W_V.double(), 2) * torch.linalg.matrix_norm(att.W_O.double(), 2)
        col = recording["pattern", l2].double().sum(-2)  # [B, H, T]: how much attention each key position receives
        scale = recording.divisor("attn_v", l2)
        if scale is not None:
            col = col / scale[..., 0].double().pow(2)[:, None]  # the reader divides each position by its s
        for (l1, h1), norms in y2.items():
            if l1 < l2:
                per_head = torch.einsum("bht,bt->h", col, norms).clamp_min(0).sqrt() * sigma  # [H]
                for h2, b in enumerate(per_head.tolist()):
                    bounds[(l1, h1, l2, h2)] = b
    return bounds


@torch.no_grad()
def materialize(
    source: WeightSource,
    recording: Trace,
    first_order: dict[tuple[int, int], Tensor],
    keys: list[Key],
    *,
    keep: int | None = None,
    progress: Progress | None = None,
) -> tuple[dict[Key, Tensor], Tensor, float]:
    """The terms ``[B, T, D]`` of the virtual heads ``keys``: every one, or with ``keep`` only that
    many of the largest (by mean square); the sum of all of them; and the largest Frobenius norm
    among them.

    A term is ``z @ W_O2`` with ``z = A2 @ (read(y1) @ W_V2)`` ``[B, T, E]``; its size is read from
    ``z`` (``||z W_O||_F^2 = sum(z^T z * W_O W_O^T)``, in float64), so only the terms kept are
    formed ``d_model`` wide, and the sum of all of them is one ``W_O`` product per reader head.
    The values of each writer are made for all its readers in a layer at once, and each reader's
    pattern is applied to the values of all its writers at once."""
    require_sum_residual(source.cfg, "virtual-head terms")
    by_layer: dict[int, dict[tuple[int, int], list[int]]] = defaultdict(lambda: defaultdict(list))
    for l1, h1, l2, h2 in keys:
        by_layer[l2][(l1, h1)].append(h2)
    total = torch.zeros_like(next(iter(first_order.values())))
    heap: list[tuple[float, Key]] = []
    zs: dict[Key, Tensor] = {}
    largest, done, readers_total = 0.0, 0, sum(len({h for hs in w.values() for h in hs}) for w in by_layer.values())
    for l2, writers in sorted(by_layer.items()):
        att = source.attention(l2)
        gram = att.W_O.double() @ att.W_O.double().transpose(1, 2)  # [H, E, E]
        values: dict[int, list[tuple[Key, Tensor]]] = defaultdict(list)  # reader -> its writers' values
        for (l1, h1), readers in writers.items():
            v = frozen_values(source, recording, l2, first_order[(l1, h1)], heads=readers)
            for h2, vh in zip(readers, v.unbind(1)):
                values[h2].append(((l1, h1, l2, h2), vh))  # [B, T, E]
        for h2, vals in sorted(values.items()):
            z = recording["pattern", l2][:, h2] @ torch.cat([vh for _, vh in vals], -1)  # [B, T, n E]
            z = z.view(*z.shape[:2], len(vals), -1)  # [B, T, n, E]
            g = frozen_gate(recording, l2, [h2])  # a gated reader: [B, 1, T, G], the gate of its query
            if g is not None:
                z = z * g[:, 0, :, None]
            zd = z.double()
            sq = torch.einsum("btne,ef,btnf->n", zd, gram[h2], zd).clamp_min(0)  # squared Frobenius norms
            total += z.sum(2) @ att.W_O[h2]
            largest = max(largest, math.sqrt(float(sq.max())))
            for (key, _), size, zk in zip(vals, (sq / total.numel()).tolist(), z.unbind(2)):
                _keep_largest(zs, heap, keep, key, zk, size)
            done += 1
            tick(progress, "paths: virtual heads", done, readers_total)
    order = {k: i for i, k in enumerate(keys)}
    terms = {}
    for key in sorted(zs, key=order.__getitem__):
        l2, h2 = key[2], key[3]
        terms[key] = zs.pop(key) @ source.attention(l2).W_O[h2]
    return terms, total, largest


def _keep_largest(
    terms: dict[Key, Tensor], heap: list[tuple[float, Key]], most: int | None, key: Key, term: Tensor, size: float
) -> None:
    """Add a term of mean square ``size``, keeping only the ``most`` largest (``None``: all)."""
    if most is None:
        terms[key] = term
        return
    if most <= 0:
        return
    if len(heap) < most:
        heapq.heappush(heap, (size, key))
        terms[key] = term.clone()  # a view of a larger block would keep the block alive
    elif size > heap[0][0]:
        _, gone = heapq.heapreplace(heap, (size, key))
        del terms[gone]
        terms[key] = term.clone()


@dataclass
class VirtualCoverage:
    """How much of the order-2 term (every virtual head) the materialised virtual heads hold.

    ``explained``: ``1 - ||order2 - sum(materialised)||^2 / ||order2||^2`` (1 when all are
    materialised, up to float error); ``left_bound``: the largest upper bound among the heads left
    out, over the Frobenius norm of the largest materialised term (no term left out is larger
    than that multiple of it; 0 when none is left out).
    """

    pairs: int
    materialised: int
    explained: float
    left_bound: float

    @property
    def exact(self) -> bool:
        return self.materialised == self.pairs

    def to_dict(self) -> dict[str, Any]:
        return {
            "pairs": self.pairs,
            "materialised": self.materialised,
            "explained": self.explained,
            "left_bound": finite(self.left_bound),  # JSON has no inf
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "VirtualCoverage":
        bound = d["left_bound"]
        return cls(d["pairs"], d["materialised"], d["explained"], math.inf if bound is None else bound)


@torch.no_grad()
def select_virtual(
    source: WeightSource,
    recording: Trace,
    first_order: dict[tuple[int, int], Tensor],
    order2: Tensor,
    *,
    most: int | None,
    keep: int | None,
    progress: Progress | None = None,
) -> tuple[dict[Key, Tensor], VirtualCoverage]:
    """Materialise every virtual head (``most`` is ``None`` or at least their number) or the
    ``most`` with the largest bounds; keep the ``keep`` largest terms; state the coverage
    against ``order2``, the exact order-2 term of the expansion."""
    require_sum_residual(source.cfg, "virtual-head terms")
    keys = virtual_keys(source.cfg)
    if most is not None and most < 0:
        raise QkovError(f"virtual heads: the number to materialise must be >= 0 or None, got {most}")
    left: list[float] = []
    if most is not None and most < len(keys):
        bounds = virtual_bounds(source, recording, first_order)
        ranked = sorted(keys, key=lambda k: -bounds[k])
        keys, left = ranked[:most], [bounds[k] for k in ranked[most : most + 1]]
    terms, total, largest = materialize(source, recording, first_order, keys, keep=keep, progress=progress)
    whole = float(order2.double().pow(2).sum())
    explained = 1.0 - float((order2 - total).double().pow(2).sum()) / whole if whole > 0 else 1.0
    ratio = (left[0] / largest if largest > 0 else math.inf) if left else 0.0
    return terms, VirtualCoverage(len(virtual_keys(source.cfg)), len(keys), explained, ratio)
