"""Q-, K- and V-composition scores of every pair of heads [F], and their random-matrix baseline.

In the row convention (docs/conventions.md), for a writer head 1 in an earlier layer and a
reader head 2:

* Q: ``||W_OV1 W_QK2||_F / (||W_OV1||_F ||W_QK2||_F)``
* K: the same with ``W_QK2^T``
* V: the same with ``W_OV2``

The paper's formula, transposed. Every norm is taken through ``d_head``-sized factors
(:meth:`LowRank.row_factor`, :meth:`LowRank.col_factor`): a writer enters as ``S @ W_O``
(``S^T S = W_V^T W_V``, ``[d_head, d_model]``), a reader as ``A @ M`` with ``A`` its stream-side
matrix (``W_Q``, ``W_K`` or ``W_V``, ``[d_model, d_head]``) and ``M = R S_B^T`` a ``[d_head, d_head]``
factor (``R`` a rotary head's relative rotation, else the identity). All pairs of two layers cost
one ``[H r, D] @ [D, U r]`` product, ``U`` the distinct stream-side matrices (one per key/value
head for K and V under grouped-query attention), then per offset only ``d_head``-sized products.

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
from dataclasses import field

import torch
from torch import Tensor

from ...errors import QkovError
from ...model.bus import attention_point, route_coefficients, static_routes
from ...model.ops import expand_kv
from ..forward.frozen import sites_of
from ..forward.sites import ROUTE_KINDS
from ..forward.tracer import trace
from ...weights.parts import AttentionWeights, WeightSource
from ...weights.convert import SourceLike, as_source
from .factored import LowRank, gram_sqrt
from ...progress import Progress, tick
from ... import ranks
from .rotary import resolve_offsets, rotations
from ..shown import Shown
from ..shown import TEXT, num, register, table
from ..budget import item, layer_read_bytes

__all__ = [
    "Baseline",
    "Composition",
    "composition_baseline",
    "composition_bytes",
    "composition_raw",
    "composition_scores",
    "composition_scores_text",
    "composition_text",
    "CompositionKind",
    "CompositionScores",
    "DEFAULT_WRITER_BYTES",
    "KINDS",
    "PRODUCT_BYTES",
    "reader_matrix",
    "routing_reach",
]

CompositionKind = Literal["q", "k", "v"]
KINDS: tuple[str, ...] = ("q", "k", "v")
DEFAULT_WRITER_BYTES = 512 << 20  # writer factors held per pass over a streamed source (8B shape: 8 layers)
PRODUCT_BYTES = 64 << 20  # the [writers H d_head, H d_head] product of one block of writer layers


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
    matmul_dtype: torch.dtype | None = None,
) -> dict[str, Tensor]:
    """Raw composition scores ``{kind: [L, H, L, H]}`` (writer layer, writer head, reader layer,
    reader head) for ``kinds`` (e.g. ``"k"`` or ``"qkv"``). Entries whose reader layer is not
    strictly after the writer layer are NaN.

    ``matmul_dtype``: the dtype of the one large product per pair of layers (default: the
    source's). ``torch.bfloat16`` runs it about 5x faster on CPUs with bfloat16 matrix units
    (AMX) and moves scores by about 1e-5 (measured at Llama-3-8B shape); everything else stays
    in the source's dtype.

    Rotary models: a Q- or K-composition score is the mean, over the offset set ``offsets``
    (default :func:`~qkov.analysis.circuits.rotary.default_offsets`), of the score against the
    reader's QK circuit at that offset, ``W_Q R_delta W_K^T``; V-composition has no offset.

    Under a split (:mod:`qkov.ranks`) each rank computes its share of the products (one
    per block of writer layers and reader layer) and every rank returns all the scores."""
    kinds = _kinds(kinds)
    Rs = rotations(source, offsets)
    cfg = source.cfg
    group_size = cfg.n_heads // cfg.kv_heads
    L, H, D, E = cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head
    opts: dict[str, Any] = dict(dtype=source.dtype, device=source.device)
    out = {k: torch.full((L, H, L, H), float("nan"), **opts) for k in kinds}
    if L < 2:
        return out
    ov_norm = torch.zeros(L, H, **opts)
    item = torch.empty(0, dtype=source.dtype).element_size()
    block = L - 1 if source.in_memory else max(1, min(L - 1, max_bytes // (H * E * D * item)))
    group = max(1, PRODUCT_BYTES // (H * E * H * E * item))  # writer layers per product
    starts = range(0, L - 1, block)
    total, done = sum(L - a for a in starts), 0
    sp = ranks.current()  # a unit: one product, writer layers lo .. hi-1 x reader layer l2 (every kind)
    where = _units(L, block, group)  # unit -> (lo, hi, l2), numbered alike on every rank
    mine = [u for u in range(len(where)) if sp.mine(u, len(where))]
    parts: dict[int, dict[str, Tensor]] = {}  # this rank's units: kind -> [hi - lo, H, H]
    for a in starts:
        b = min(L - 1, a + block)  # writers a .. b-1 held; readers a+1 .. L-1 stream past
        here = [u for u in mine if a <= where[u][0] < b]  # this rank's units of this block
        rows = torch.empty((b - a) * H, E, D, **opts) if here else None  # writer layer a + i at rows[i H : ..]
        for l2 in range(a, L):
            units = [u for u in here if where[u][2] == l2]
            if here and (l2 < b or units):  # a rank reads only the layers its units need
                att = source.attention(l2, expand_kv=False)  # grouped K/V once per key/value head
            if here and l2 < b:
                ov = LowRank(expand_kv(att.W_V, group_size), att.W_O)
                rows[(l2 - a) * H : (l2 - a + 1) * H] = ov.row_factor()  # type: ignore[index]
                ov_norm[l2] = ov.norm()
            for kind in kinds if units else ():
                X, Ms, r_norms = _reader_parts(att, kind, None if kind == "v" else Rs, group_size)
                MM = _gram(Ms, X.shape[0])
                for u in units:
                    lo, hi, _ = where[u]
                    # the costly product once per reader layer: writer factors x the reader's stream side
                    left = rows[(lo - a) * H : (hi - a) * H].reshape(-1, D)  # type: ignore[index]
                    right = X.permute(1, 0, 2).reshape(D, -1)
                    if matmul_dtype is not None:
                        left, right = left.to(matmul_dtype), right.to(matmul_dtype)
                    P = (left @ right).to(source.dtype)
                    num = _offset_norms(P.view((hi - lo) * H, E, X.shape[0], E), Ms, MM).view(len(Ms), hi - lo, H, H)
                    norms = ov_norm[lo:hi, :, None] * r_norms[:, None, None, :]  # [offsets, layers, H, H]
                    parts.setdefault(u, {})[kind] = (num / norms).mean(0)
            done += 1
            tick(progress, "composition", done, total)
    for (lo, hi, l2), got in zip(where, sp.gather(parts, len(where))):  # every unit, in unit order
        for kind, scores in got.items():
            out[kind][lo:hi, :, l2, :] = scores
    return out


def _units(L: int, block: int, group: int) -> list[tuple[int, int, int]]:
    """The products of :func:`composition_raw`, in the order one process computes them: ``(lo, hi,
    l2)``, writer layers ``lo .. hi-1`` (``group`` at most, inside one block of ``block``) x reader ``l2``."""
    out = []
    for a in range(0, L - 1, block):
        b = min(L - 1, a + block)
        out += [(lo, min(b, l2, lo + group), l2) for l2 in range(a + 1, L) for lo in range(a, min(b, l2), group)]
    return out


def _offset_norms(P: Tensor, Ms: Tensor, MM: Tensor | None) -> Tensor:
    """``||P[w, :, h // g] @ Ms[o, h]||_F`` ``[offsets, writers, heads]`` for ``P [writers, E, U, E]``
    (``U`` distinct reader-side matrices, each shared by ``g = H / U`` consecutive reader heads).

    Distinct matrices for every head and one factor: the product itself. Otherwise through each
    pair's ``E x E`` Gram matrix, ``||P M||^2 = <P^T P, M M^T>``: formed once per distinct matrix
    (a grouped-query group shares it) and reused by every head of the group and every offset;
    the inner product runs in float64 (two positive semi-definite matrices: it cancels when the
    norm is small). ``MM``: :func:`_gram` of ``Ms`` (``None``: the direct product)."""
    n, _, U, E = P.shape
    O, H = Ms.shape[:2]
    if MM is None:
        return torch.einsum("nrhe,hef->nrhf", P, Ms[0]).square_().sum((1, 3)).sqrt()[None]
    C = torch.einsum("nrue,nruf->nuef", P, P).double().reshape(n, U, E * E)
    sq = torch.einsum("nuk,oujk->onuj", C, MM.reshape(O, U, H // U, E * E)).reshape(O, n, H)
    return sq.clamp_min(0).sqrt().to(P.dtype)


def _gram(Ms: Tensor, distinct: int) -> Tensor | None:
    """``M M^T`` in float64 for :func:`_offset_norms`, or ``None`` where the direct product is
    as cheap (one factor per head and a distinct reader-side matrix for every head)."""
    if len(Ms) == 1 and distinct == Ms.shape[1]:
        return None
    return Ms.double() @ Ms.double().transpose(-1, -2)


def _reader_parts(att: AttentionWeights, kind: str, Rs: Tensor | None, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """A layer's reader side of ``kind``-composition split as ``col_factor_h = X[h // g] @ M_h``
    (``att`` read with ``expand_kv=False``: ``W_K, W_V`` once per key/value head):
    ``X [U, D, E]`` the distinct stream-side matrices (``W_Q``; for K and V one per key/value head,
    shared by the ``g = H / U`` heads of a grouped-query group), ``Ms [n, H, E, E]`` the small
    per-head right factors (one per offset of ``Rs``, else one) and ``r_norms [n, H]`` the reader
    norms. So the ``[.., D] @ [D, ..]`` product runs once per distinct matrix, not per offset
    and head (see :meth:`LowRank.col_factor`: ``col = A gram_sqrt(B B^T)^T``).

    Everything offset-dependent goes through ``d_head``-sized Gram matrices: for
    ``W_QK(R) = W_Q R W_K^T``, ``S`` depends only on the unrotated side and
    ``||W_QK(R)||_F^2 = <R^T (W_Q^T W_Q) R, W_K^T W_K>``."""
    if kind == "v":  # ||W_V W_O||^2 = <W_V^T W_V, W_O W_O^T>
        GO = att.W_O @ att.W_O.transpose(-1, -2)
        GV = expand_kv(att.W_V.transpose(-1, -2) @ att.W_V, group)
        norm = (GV * GO).sum((-1, -2)).clamp_min(0).sqrt()
        return att.W_V, gram_sqrt(GO).transpose(-1, -2)[None], norm[None]
    GQ = att.W_Q.transpose(-1, -2) @ att.W_Q  # [H, E, E]
    GK = expand_kv(att.W_K.transpose(-1, -2) @ att.W_K, group)
    E = GQ.shape[-1]
    turns = torch.eye(E, dtype=GQ.dtype, device=GQ.device)[None] if Rs is None else Rs
    # ||W_Q R W_K^T||^2 = <R^T G_Q R, G_K>, the same for K-composition (the transpose)
    norms = torch.einsum("ofe,hfg,ogk,hek->oh", turns, GQ, turns, GK).clamp_min(0).sqrt()
    if kind == "q":
        S = gram_sqrt(GK).transpose(-1, -2)  # B = W_K^T: B B^T = G_K
        return att.W_Q, turns[:, None] @ S[None], norms
    S = gram_sqrt(GQ).transpose(-1, -2)  # K: A = W_K R^T, B = W_Q^T
    return att.W_K, turns.transpose(-1, -2)[:, None] @ S[None], norms


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


def _skip_normals(g: torch.Generator, numel: int) -> None:
    """Move ``g`` on as ``torch.randn(numel)`` in float64 would, through as many uniform draws (a multiple of 16)."""
    if numel % 16:
        torch.randn(numel, generator=g, dtype=torch.float64)
    else:
        torch.empty(numel, dtype=torch.float64).uniform_(generator=g)


def _seeded_normals(
    g: torch.Generator, shapes: list[tuple[int, ...]], max_bytes: int = 64 * 2**20
) -> Iterator[list[Tensor]]:
    """Yield blocks of samples ``[lo:hi]`` of float64 ``torch.randn(shape)`` tensors drawn from ``g`` one
    after another, holding one block of each (under ``max_bytes``) instead of all of them.

    The values are those of drawing each tensor whole: the generator's state is recorded at
    each block boundary in a first pass, then restored per block. Drawing in blocks gives the
    same stream when a block holds a multiple of 16 values (torch fills normals 16 at a time),
    so other shapes are drawn whole. The first pass only moves the generator on: by as many
    uniform float64 draws as the normals would take (torch makes its normals from that many
    uniforms, 16 at a time; ~3x cheaper than the normals), checked at the end against where the
    second pass's own normals leave the generator (a mismatch raises instead of a wrong sample).
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
            _skip_normals(g, min(block, n - lo) * math.prod(shape[1:]))
    end = g.get_state()
    for i, lo in enumerate(range(0, n, block)):
        parts = []
        for shape, st in zip(shapes, states):
            g.set_state(st[i])
            parts.append(torch.randn((min(block, n - lo), *shape[1:]), generator=g, dtype=torch.float64))
        yield parts
    if not torch.equal(g.get_state(), end):  # the last block drawn ends where the first pass ended
        raise QkovError("composition baseline: this torch draws normals unlike uniforms; the seeded sample is off")


@dataclass(repr=False)
class Composition(Shown):
    """Composition scores of one kind, labelled. ``adjusted = raw - baseline.mean`` (the paper's default)."""

    kind: str
    raw: Tensor  # [L, H, L, H]
    baseline: Baseline
    offsets: list[int] | None = None  # rotary Q/K: the offsets the score is averaged over
    reach: Tensor | None = None  # [L, L] routed models: how much of layer l1's output reaches layer l2's input

    @property
    def adjusted(self) -> Tensor:
        """``raw - baseline.mean``; with :attr:`reach`, times the writer layer's reach into the reader's input."""
        out = self.raw - self.baseline.mean
        return out if self.reach is None else out * self.reach[:, None, :, None].to(out.dtype)

    def pairs(self, *, sort_by: str = "adjusted") -> list[dict[str, Any]]:
        """Every valid (writer, reader) pair as a dict, strongest first."""
        L, H = self.raw.shape[:2]
        rows = []
        for l1 in range(L):
            for h1 in range(H):
                for l2 in range(l1 + 1, L):
                    for h2 in range(H):
                        r = float(self.raw[l1, h1, l2, h2])
                        reach = 1.0 if self.reach is None else float(self.reach[l1, l2])
                        row = {"writer": f"{l1}.{h1}", "reader": f"{l2}.{h2}", "raw": r, "adjusted": (r - self.baseline.mean) * reach}
                        rows.append(row if self.reach is None else {**row, "reach": reach})
        rows.sort(key=lambda d: -d[sort_by])
        return rows

    def to_dict(self) -> dict[str, Any]:
        out = {"kind": self.kind, "baseline": vars(self.baseline), "pairs": self.pairs()}
        if self.offsets is not None:
            out["offsets"] = self.offsets
        return out


def composition_scores(
    source: SourceLike,
    kinds: str | Sequence[str] = KINDS,
    *,
    baseline_samples: int = 256,
    seed: int = 0,
    max_bytes: int = DEFAULT_WRITER_BYTES,
    progress: Progress | None = None,
    offsets: list[int] | None = None,
    matmul_dtype: torch.dtype | None = None,
    routing: Tensor | str | None = None,
) -> CompositionScores:
    """Raw scores for every pair of heads in increasing layers, plus the random-matrix baseline,
    for each of ``kinds`` (``{kind: Composition}``). ``offsets``: rotary models only, see
    :func:`composition_raw` (the baseline is unchanged: a rotation leaves Gaussian factors Gaussian).
    ``routing`` (a routed model, :mod:`qkov.model.bus`): weight each pair by how much of the writer's layer
    reaches the reader's input (:func:`routing_reach`): ``"static"`` (static hyper-connections: from the
    weights alone) or tokens ``[B, T]`` (the mean coefficient over that text); ``None``: the weights alone."""
    source = as_source(source, where="qkov.composition_scores")
    if isinstance(routing, str) and routing != "static":
        raise QkovError(f"composition: routing is 'static', tokens or None, got {routing!r}")
    reach = None if routing is None else routing_reach(source, None if isinstance(routing, str) else routing)
    raw = composition_raw(
        source, kinds, max_bytes=max_bytes, progress=progress, offsets=offsets, matmul_dtype=matmul_dtype
    )
    d, e = source.cfg.d_model, source.cfg.d_head
    used = resolve_offsets(source.cfg, offsets)
    return CompositionScores(
        {
            k: Composition(
                k,
                r,
                composition_baseline(d, e, k, samples=baseline_samples, seed=seed),
                used if k != "v" else None,  # type: ignore[arg-type]
                reach,
            )
            for k, r in raw.items()
        }
    )


def routing_reach(source: WeightSource, tokens: Tensor | None = None) -> Tensor:
    """``[L, L]``: how much of layer ``l1``'s output (its attention, with its MLP in a parallel block) the input
    of layer ``l2``'s attention holds, for ``l1 < l2`` (zeros elsewhere), in a routed model: the routing
    coefficient (:func:`qkov.model.bus.route_coefficients`) averaged over the positions of ``tokens [B, T]``,
    or, ``tokens=None``, the static hyper-connections' own (the same for every text)."""
    cfg = source.cfg
    if cfg.residual == "sum":
        raise QkovError("composition: routing weights apply to a routed model (residual other than sum)")
    if tokens is None:
        routes = static_routes(cfg, source.bus)  # type: ignore[attr-defined]
        if routes is None:
            raise QkovError(f"composition: the routing of residual {cfg.residual_text} depends on the text: give tokens")
    else:
        routes = trace(source, tokens, cache=sites_of(source, ROUTE_KINDS)).cache
    C = route_coefficients(cfg, routes).mean(dim=(-2, -1))  # [P, J]
    L = cfg.n_layers
    reach = C.new_zeros(L, L)
    for l1 in range(L):
        for l2 in range(l1 + 1, L):
            reach[l1, l2] = C[attention_point(cfg, l2), 1 + attention_point(cfg, l1)]
    return reach


@dataclass(repr=False, eq=False)
class CompositionScores(Shown):
    """What :func:`~qkov.analysis.circuits.composition.composition_scores` returns: ``kinds``, one
    :class:`~qkov.analysis.circuits.composition.Composition` per kind asked for (``"q"``, ``"k"``, ``"v"``), also
    read as ``.q``, ``.k``, ``.v`` (``None`` when that kind was not asked for). ``keys()``, ``values()``,
    ``items()``, ``len``, ``in`` and iteration go over ``kinds``."""

    kinds: dict[str, Any] = field(default_factory=dict)

    @property
    def q(self) -> Any:
        return self.kinds.get("q")

    @property
    def k(self) -> Any:
        return self.kinds.get("k")

    @property
    def v(self) -> Any:
        return self.kinds.get("v")

    def keys(self) -> Any:
        return self.kinds.keys()

    def values(self) -> Any:
        return self.kinds.values()

    def items(self) -> Any:
        return self.kinds.items()

    def __len__(self) -> int:
        return len(self.kinds)

    def __iter__(self) -> Iterator[str]:
        return iter(self.kinds)

    def __contains__(self, kind: object) -> bool:
        return kind in self.kinds

    def to_dict(self) -> dict[str, Any]:
        return {kind: c.to_dict() for kind, c in self.kinds.items()}


@register(TEXT, Composition)
def composition_text(c: Composition) -> str:
    L, H = c.raw.shape[:2]
    pairs = c.pairs()
    rows = [[p["writer"], p["reader"], num(p["adjusted"]), num(p["raw"])] for p in pairs]
    off = "" if c.offsets is None else f", mean over offsets {c.offsets}"
    title = (
        f"{c.kind.upper()}-composition of {L} layers x {H} heads: raw [L, H, L, H], "
        f"baseline {num(c.baseline.mean)} +- {num(c.baseline.std)}{off}; pairs, strongest first:"
    )
    return title + "\n" + table(["writer", "reader", "adjusted", "raw"], rows)


@register(TEXT, CompositionScores)
def composition_scores_text(scores: CompositionScores) -> str:
    return "\n\n".join(composition_text(c) for c in scores.values()) or "CompositionScores: none"


def composition_bytes(source: WeightSource, kinds: int, *, writer_bytes: int, offsets: int = 1) -> int:
    """Peak of :func:`~qkov.analysis.circuits.composition.composition_scores` of ``kinds`` kinds: the
    ``[L, H, L, H]`` scores, the writer factors of a block of layers (every layer in memory; under
    ``writer_bytes`` for a streamed source), the product of a group of writer layers with one
    reader layer (and its float64 Gram matrices for rotary offsets or grouped-query heads), and
    the random-matrix baseline's sample blocks."""
    c, it = source.cfg, item(source)
    L, H, D, E = c.n_layers, c.n_heads, c.d_model, c.d_head
    out = (kinds * L * L * H * H + L * H) * it
    if L < 2:
        return out
    block = L - 1 if source.in_memory else max(1, min(L - 1, writer_bytes // (H * E * D * it)))
    group = min(block, max(1, PRODUCT_BYTES // (H * E * H * E * it)))
    product = group * H * E * H * E * it
    gram = 8 * group * H * H * E * E + 8 * offsets * H * E * E if (offsets > 1 or c.kv_heads < H) else 0
    raw = out + block * H * E * D * it + layer_read_bytes(source) + 2 * product + gram
    per_sample = 4 * D * E * 8  # the baseline's four float64 factors of one sample
    samples = 256 if (D * E) % 16 else min(256, max(1, (64 << 20) // per_sample))
    return max(raw, out + 2 * samples * per_sample)
