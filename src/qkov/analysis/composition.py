"""Q-, K- and V-composition scores of every pair of heads [F], and their random-matrix baseline.

In the row convention (docs/conventions.md), for a writer head 1 in an earlier layer and a
reader head 2:

* Q: ``||W_OV1 W_QK2||_F / (||W_OV1||_F ||W_QK2||_F)``
* K: the same with ``W_QK2^T``
* V: the same with ``W_OV2``

The paper's formula, transposed. Every norm is taken through ``d_head``-sized factors
(:meth:`LowRank.row_factor`, :meth:`LowRank.col_factor`, :func:`pair_norms`): a writer enters
as ``S @ W_O`` (``S^T S = W_V^T W_V``, ``[d_head, d_model]``), a reader as ``A @ S_B^T``
(``[d_model, d_head]``), and all pairs of two layers cost one ``[H r, D] @ [D, H r]`` product.

Reads go layer by layer through a :class:`~qkov.weights.WeightSource`: the writer factors of a
block of layers are held (at most ``max_bytes``, at least one layer; every layer at once for
an in-memory source) while later layers stream past, one at a time. MLP weights, ``W_E`` and
``W_U`` are never read.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Sequence

import torch
from torch import Tensor

from ..errors import QkovError
from ..weights.parts import AttentionWeights, WeightSource
from .factored import LowRank, pair_norms
from .progress import Progress, tick
from .rotary_circuits import check_offsets, default_offsets, rotations

CompositionKind = Literal["q", "k", "v"]
KINDS: tuple[str, ...] = ("q", "k", "v")
DEFAULT_WRITER_BYTES = 1 << 30  # writer factors held per pass over a streamed source
PRODUCT_BYTES = 64 << 20  # the [writers H d_head, H d_head] product of one pair_norms call


def _kinds(kinds: str | Sequence[str]) -> tuple[str, ...]:
    """``"k"``, ``"qkv"`` or ``("q", "v")`` -> a tuple of kinds, each checked."""
    out = tuple(kinds)
    for kind in out:
        if kind not in KINDS:
            raise QkovError(f"composition kind must be q, k or v, got {kind!r}")
    return out


def reader_matrix(att: AttentionWeights, kind: str, R: Tensor | None = None) -> LowRank:
    """The reader side of ``kind``-composition for every head of a layer: ``W_QK`` (q), ``W_QK^T``
    (k) or ``W_OV`` (v), ``[h, d_model, d_model]`` factored. A rotary head's QK circuit at one
    offset puts its relative rotation ``R [d_head, d_head]`` between the factors: ``W_Q R W_K^T``."""
    if kind == "q":
        return LowRank(att.W_Q if R is None else att.W_Q @ R, att.W_K.transpose(-1, -2))
    if kind == "k":
        return LowRank(att.W_K if R is None else att.W_K @ R.T, att.W_Q.transpose(-1, -2))
    return LowRank(att.W_V, att.W_O)


def composition_raw(
    source: WeightSource,
    kinds: str | Sequence[str] = KINDS,
    *,
    max_bytes: int = DEFAULT_WRITER_BYTES,
    progress: Progress | None = None,
    offsets: list[int] | None = None,
) -> dict[str, Tensor]:
    """Raw composition scores ``{kind: [L, H, L, H]}`` (writer layer, writer head, reader layer,
    reader head) for ``kinds`` (e.g. ``"k"`` or ``"qkv"``). Entries whose reader layer is not
    strictly after the writer layer are NaN.

    Rotary models: a Q- or K-composition score is the mean, over the offset set ``offsets``
    (default :func:`~qkov.analysis.rotary_circuits.default_offsets`), of the score against the
    reader's QK circuit at that offset, ``W_Q R_delta W_K^T``; V-composition has no offset."""
    kinds = _kinds(kinds)
    Rs = rotations(source, offsets)
    cfg = source.cfg
    L, H, D, E = cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head
    opts: dict[str, Any] = dict(dtype=source.dtype, device=source.device)
    out = {k: torch.full((L, H, L, H), float("nan"), **opts) for k in kinds}
    if L < 2:
        return out
    ov_norm = torch.zeros(L, H, **opts)
    item = torch.empty(0, dtype=source.dtype).element_size()
    block = L - 1 if source.in_memory else max(1, min(L - 1, max_bytes // (H * E * D * item)))
    group = max(1, PRODUCT_BYTES // (H * E * H * E * item))  # writer layers per pair_norms product
    starts = range(0, L - 1, block)
    total, done = sum(L - a for a in starts), 0
    for a in starts:
        b = min(L - 1, a + block)  # writers a .. b-1 held; readers a+1 .. L-1 stream past
        rows = torch.empty((b - a) * H, E, D, **opts)  # writer layer a + i at rows[i H : (i + 1) H]
        for l2 in range(a, L):
            att = source.attention(l2)
            if l2 < b:
                ov = LowRank(att.W_V, att.W_O)
                rows[(l2 - a) * H : (l2 - a + 1) * H] = ov.row_factor()
                ov_norm[l2] = ov.norm()
            for kind in kinds if l2 > a else ():
                turns = [None] if Rs is None or kind == "v" else list(Rs)
                for lo in range(a, min(b, l2), group):  # writer layers lo .. hi-1, before this reader
                    out[kind][lo : min(b, l2, lo + group), :, l2, :] = 0.0
                for R in turns:
                    reader = reader_matrix(att, kind, R)
                    cols, r_norm = reader.col_factor(), reader.norm()
                    for lo in range(a, min(b, l2), group):
                        hi = min(b, l2, lo + group)
                        num = pair_norms(rows[(lo - a) * H : (hi - a) * H], cols).reshape(hi - lo, H, H)
                        score = num / (ov_norm[lo:hi, :, None] * r_norm[None, None])
                        out[kind][lo:hi, :, l2, :] += score / len(turns)
            done += 1
            tick(progress, "composition", done, total)
    return out


@dataclass(frozen=True)
class Baseline:
    """Composition scores of random matrices of the same shapes: ``mean`` and ``std`` over ``samples`` pairs."""

    mean: float
    std: float
    samples: int
    method: str = "seeded sample: i.i.d. Gaussian W_Q, W_K, W_V, W_O of the model's shapes"


@functools.lru_cache(maxsize=32)
def composition_baseline(
    d_model: int, d_head: int, kind: CompositionKind, *, samples: int = 256, seed: int = 0
) -> Baseline:
    """The expected composition score of random weights of the same shapes (seeded sample).

    Scores are scale-free, so i.i.d. standard Gaussian factors stand in for "random
    matrices". The mean is close to ``1/sqrt(d_model)`` (the paper's figure) whatever
    the rank, but the spread grows as ``d_head`` shrinks; sampling gives both, so a
    score can be read as "k standard deviations above chance". Sample ``i`` pairs writer
    ``i`` with reader ``i`` only.
    """
    _kinds(kind)
    n = samples
    shape_in, shape_out = (n, d_model, d_head), (n, d_head, d_model)
    shapes = [shape_in, shape_out, shape_in, shape_in if kind != "v" else shape_out]  # V1, O1, A, B (or RB)
    scores = []
    for V1, O1, A, B in _seeded_normals(torch.Generator().manual_seed(seed), shapes):
        writer, reader = LowRank(V1, O1), LowRank(A, B.transpose(-1, -2) if kind != "v" else B)
        num = torch.linalg.matrix_norm(writer.row_factor() @ reader.col_factor())
        scores.append(num / (writer.norm() * reader.norm()))
    s = torch.cat(scores)
    return Baseline(mean=float(s.mean()), std=float(s.std()), samples=n)


def _seeded_normals(
    g: torch.Generator, shapes: list[tuple[int, ...]], max_bytes: int = 64 * 2**20
) -> Iterator[list[Tensor]]:
    """Yield blocks of samples ``[lo:hi]`` of float64 ``torch.randn(shape)`` tensors drawn from ``g`` one
    after another, holding one block of each (under ``max_bytes``) instead of all of them.

    The values are those of drawing each tensor whole: the generator's state is recorded at
    each block boundary in a first pass, then restored per block. Drawing in blocks gives the
    same stream when a block holds a multiple of 16 values (torch fills normals 16 at a time),
    so other shapes are drawn whole.
    """
    n, per_sample = shapes[0][0], sum(math.prod(s[1:]) for s in shapes)
    block = max(1, min(n, max_bytes // (8 * per_sample)))
    if any(math.prod(s[1:]) % 16 for s in shapes):
        block = n
    states: list[list[Tensor]] = []
    for shape in shapes:  # pass 1: the state before each block of each tensor
        states.append([])
        for lo in range(0, n, block):
            states[-1].append(g.get_state())
            torch.randn((min(block, n - lo), *shape[1:]), generator=g, dtype=torch.float64)
    for i, lo in enumerate(range(0, n, block)):
        parts = []
        for shape, st in zip(shapes, states):
            g.set_state(st[i])
            parts.append(torch.randn((min(block, n - lo), *shape[1:]), generator=g, dtype=torch.float64))
        yield parts


@dataclass
class Composition:
    """Composition scores of one kind, labelled. ``adjusted = raw - baseline.mean`` (the paper's default)."""

    kind: str
    raw: Tensor  # [L, H, L, H]
    baseline: Baseline
    offsets: list[int] | None = None  # rotary Q/K: the offsets the score is averaged over

    @property
    def adjusted(self) -> Tensor:
        return self.raw - self.baseline.mean

    def pairs(self, *, sort_by: str = "adjusted") -> list[dict[str, Any]]:
        """Every valid (writer, reader) pair as a dict, strongest first."""
        L, H = self.raw.shape[:2]
        rows = []
        for l1 in range(L):
            for h1 in range(H):
                for l2 in range(l1 + 1, L):
                    for h2 in range(H):
                        r = float(self.raw[l1, h1, l2, h2])
                        rows.append(
                            {
                                "writer": f"{l1}.{h1}",
                                "reader": f"{l2}.{h2}",
                                "raw": r,
                                "adjusted": r - self.baseline.mean,
                            }
                        )
        rows.sort(key=lambda d: -d[sort_by])
        return rows

    def to_dict(self) -> dict[str, Any]:
        out = {"kind": self.kind, "baseline": vars(self.baseline), "pairs": self.pairs()}
        if self.offsets is not None:
            out["offsets"] = self.offsets
        return out


def composition_scores(
    source: WeightSource,
    kinds: str | Sequence[str] = KINDS,
    *,
    baseline_samples: int = 256,
    seed: int = 0,
    max_bytes: int = DEFAULT_WRITER_BYTES,
    progress: Progress | None = None,
    offsets: list[int] | None = None,
) -> dict[str, Composition]:
    """Raw scores for every pair of heads in increasing layers, plus the random-matrix baseline,
    for each of ``kinds`` (``{kind: Composition}``). ``offsets``: rotary models only, see
    :func:`composition_raw` (the baseline is unchanged: a rotation leaves Gaussian factors Gaussian)."""
    raw = composition_raw(source, kinds, max_bytes=max_bytes, progress=progress, offsets=offsets)
    d, e = source.cfg.d_model, source.cfg.d_head
    used = None
    if source.cfg.positional == "rotary":
        used = check_offsets(source.cfg.n_ctx, offsets if offsets is not None else default_offsets(source.cfg.n_ctx))
    return {
        k: Composition(
            k,
            r,
            composition_baseline(d, e, k, samples=baseline_samples, seed=seed),
            used if k != "v" else None,  # type: ignore[arg-type]
        )
        for k, r in raw.items()
    }
