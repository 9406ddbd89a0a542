"""QK and OV circuits, virtual weights, composition and copying scores, bandwidth, write-space overlap.

Row convention throughout (SPEC.md): activations are rows, ``x @ W``. Per head
``W_QK = W_Q @ W_K^T`` and ``W_OV = W_V @ W_O`` (both ``[d_model, d_model]``, rank <=
d_head). Full circuits are indexed ``[query or source token, key or output token]``:

* full OV ``W_E @ W_OV @ W_U`` — ``[source token attended to, output logit]``;
* full QK ``W_E @ W_QK @ W_E^T`` — ``[query (destination) token, key (source) token]``;
* positional QK ``W_pos @ W_QK @ W_pos^T`` — ``[query position, key position]``, and
  the two cross terms ``[query token, key position]`` / ``[query position, key token]``.

Everything stays factored (:class:`qkov.factored.LowRank`): nothing ``d_vocab x
d_vocab`` is built unless asked. Per-head circuits are returned one head at a time
(``full_ov(w, layer, head)``) so that a 50k-vocabulary model never holds all heads'
``[d_vocab, d_head]`` factors at once.
"""

from __future__ import annotations

import functools

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from .errors import QkovError
from .factored import DEFAULT_MAX_BYTES, LowRank, serial_linalg
from .weights import Weights

CompositionKind = Literal["q", "k", "v"]


def _check_head(w: Weights, layer: int, head: int) -> None:
    if not (0 <= layer < w.n_layers and 0 <= head < w.n_heads):
        raise QkovError(f"no head {layer}.{head}: the model has {w.n_layers} layers x {w.n_heads} heads")


# --------------------------------------------------------------------- circuits
def qk(w: Weights) -> LowRank:
    """``W_QK = W_Q @ W_K^T`` for every head: ``[n_layers, n_heads, d_model, d_model]``."""
    return LowRank(w.W_Q, w.W_K.transpose(-1, -2))


def ov(w: Weights) -> LowRank:
    """``W_OV = W_V @ W_O`` for every head: ``[n_layers, n_heads, d_model, d_model]``."""
    return LowRank(w.W_V, w.W_O)


def full_ov(w: Weights, layer: int, head: int) -> LowRank:
    """``W_E @ W_OV @ W_U``: ``[d_vocab (source token), d_vocab (output logit)]``."""
    _check_head(w, layer, head)
    return LowRank(w.W_E @ w.W_V[layer, head], w.W_O[layer, head] @ w.W_U)


def full_qk(w: Weights, layer: int, head: int) -> LowRank:
    """``W_E @ W_QK @ W_E^T``: ``[d_vocab (query token), d_vocab (key token)]`` (token part of the score)."""
    _check_head(w, layer, head)
    return LowRank(w.W_E @ w.W_Q[layer, head], (w.W_E @ w.W_K[layer, head]).T)


def _positions(w: Weights) -> Tensor:
    if w.W_pos is None:
        raise QkovError("this model has no positional embedding")
    return w.W_pos


def positional_qk(w: Weights, layer: int, head: int) -> LowRank:
    """``W_pos @ W_QK @ W_pos^T``: ``[query position, key position]``."""
    _check_head(w, layer, head)
    P = _positions(w)
    return LowRank(P @ w.W_Q[layer, head], (P @ w.W_K[layer, head]).T)


def token_position_qk(w: Weights, layer: int, head: int) -> tuple[LowRank, LowRank]:
    """Cross terms ``[query token, key position]`` and ``[query position, key token]``.

    With positions p and tokens e, the score ``(e_q + p_i) W_QK (e_k + p_j)^T`` is
    token-token + token-position + position-token + position-position.
    """
    _check_head(w, layer, head)
    P = _positions(w)
    Q, K = w.W_Q[layer, head], w.W_K[layer, head]
    return LowRank(w.W_E @ Q, (P @ K).T), LowRank(P @ Q, (w.W_E @ K).T)


# ---------------------------------------------------------------- virtual weights
Component = tuple  # ("embed",) ("pos",) ("head", l, h) ("mlp", l) ("q"|"k"|"v", l, h) ("unembed",)


def _order(kind: str, layer: int) -> float:
    return {"embed": -1.0, "pos": -1.0, "head": 2 * layer, "mlp": 2 * layer + 1, "unembed": math.inf}.get(
        kind, 2 * layer
    )


def virtual_weights(w: Weights, writer: Component, reader: Component) -> LowRank:
    """The virtual weight ``writer_out @ reader_in`` between two components through the stream.

    Writers: ``("embed",)`` (W_E), ``("pos",)`` (W_pos), ``("head", l, h)`` (W_O),
    ``("mlp", l)`` (W_out). Readers: ``("q"|"k"|"v", l, h)`` (W_Q/W_K/W_V), ``("mlp", l)``
    (W_in), ``("unembed",)`` (W_U). The reader must come later in the model than the
    writer. Returned factored, ``[writer dims, reader dims]`` with inner ``d_model``.
    """
    wk, *wi = writer
    rk, *ri = reader
    if wk == "embed":
        out = w.W_E
    elif wk == "pos":
        out = _positions(w)
    elif wk == "head":
        _check_head(w, *wi)
        out = w.W_O[wi[0], wi[1]]
    elif wk == "mlp":
        if w.W_out is None:
            raise QkovError("this model has no MLP")
        out = w.W_out[wi[0]]
    else:
        raise QkovError(f"unknown writer {writer!r}")
    if rk in ("q", "k", "v"):
        _check_head(w, *ri)
        inp = {"q": w.W_Q, "k": w.W_K, "v": w.W_V}[rk][ri[0], ri[1]]
        r_order = 2 * ri[0]
    elif rk == "mlp":
        if w.W_in is None:
            raise QkovError("this model has no MLP")
        inp = w.W_in[ri[0]]
        r_order = 2 * ri[0] + 1
    elif rk == "unembed":
        inp = w.W_U
        r_order = math.inf
    else:
        raise QkovError(f"unknown reader {reader!r}")
    if _order(wk, wi[0] if wi else 0) >= r_order:
        raise QkovError(f"{reader!r} does not come after {writer!r}: no virtual weight")
    return LowRank(out, inp)


# ------------------------------------------------------------------ composition
def _gram_sqrt(G: Tensor) -> Tensor:
    """``S`` with ``S^T S = G`` for a PSD Gram matrix ``G [..., r, r]`` (via eigh; safe when singular)."""
    with serial_linalg():
        evals, evecs = torch.linalg.eigh(G)
    return evals.clamp_min(0).sqrt()[..., :, None] * evecs.transpose(-1, -2)


def _absorb_left(A: Tensor, B: Tensor) -> Tensor:
    """``S_A @ B`` with ``S_A^T S_A = A^T A``: then ``||A @ B @ X||_F = ||S_A @ B @ X||_F`` for any ``X``."""
    return _gram_sqrt(A.transpose(-1, -2) @ A) @ B


def _absorb_right(A: Tensor, B: Tensor) -> Tensor:
    """``A @ S_B^T`` with ``S_B^T S_B = B B^T``: then ``||X @ A @ B||_F = ||X @ A @ S_B^T||_F``."""
    return A @ _gram_sqrt(B @ B.transpose(-1, -2)).transpose(-1, -2)


def _pair_norms(left_A: Tensor, left_B: Tensor, right_A: Tensor, right_B: Tensor) -> Tensor:
    """``||(left_A left_B)(right_A right_B)||_F`` for all pairs, through small factors only.

    Left factors ``[H1, m, r1]``/``[H1, r1, D]``, right ``[H2, D, r2]``/``[H2, r2, n]`` ->
    ``[H1, H2]``. The outer factors' triangular parts are absorbed (QR), leaving
    ``||R_A left_B right_A R_B^T||_F``: one ``[H1 r1, D] @ [D, H2 r2]`` product for all pairs.
    """
    return _absorbed_pair_norms(_absorb_left(left_A, left_B), _absorb_right(right_A, right_B))


def _absorbed_pair_norms(lb: Tensor, ra: Tensor) -> Tensor:
    """``||lb[i] @ ra[j]||_F`` for all ``i, j``: ``lb [H1, r1, D]``, ``ra [H2, D, r2]`` -> ``[H1, H2]``."""
    h1, r1, d = lb.shape
    h2, _, r2 = ra.shape
    M = lb.reshape(h1 * r1, d) @ ra.permute(1, 0, 2).reshape(d, h2 * r2)
    return M.square_().reshape(h1, r1, h2, r2).sum(dim=(1, 3)).sqrt()


def _composition_factors(w: Weights, kind: CompositionKind) -> tuple[Tensor, Tensor]:
    """Right-hand factors ``(A [L, H, D, r], B [L, H, r, D])`` of the reader matrix for ``kind``."""
    if kind == "q":  # OV1 @ QK2
        return w.W_Q, w.W_K.transpose(-1, -2)
    if kind == "k":  # OV1 @ QK2^T
        return w.W_K, w.W_Q.transpose(-1, -2)
    if kind == "v":  # OV1 @ OV2
        return w.W_V, w.W_O
    raise QkovError(f"composition kind must be q, k or v, got {kind!r}")


def composition_raw(w: Weights, kind: CompositionKind) -> Tensor:
    """Raw composition scores ``[L, H, L, H]`` (writer layer, writer head, reader layer, reader head).

    The paper's formula in the row convention: Q ``||W_OV1 W_QK2|| / (||W_OV1|| ||W_QK2||)``,
    K the same with ``W_QK2^T``, V with ``W_OV2`` (Frobenius norms). Entries whose reader
    layer is not strictly after the writer layer are NaN.
    """
    L, H = w.n_layers, w.n_heads
    out = torch.full((L, H, L, H), float("nan"), dtype=w.W_E.dtype, device=w.W_E.device)
    if L < 2:
        return out
    RA, RB = _composition_factors(w, kind)
    ov_norm = LowRank(w.W_V, w.W_O).norm()  # [L, H]
    r_norm = LowRank(RA, RB).norm()
    left = _absorb_left(w.W_V, w.W_O)  # [L, H, r, D]
    right = _absorb_right(RA, RB)  # [L, H, D, r]
    for l1 in range(L - 1):  # all later layers' heads at once: one matrix product per writer layer
        later = L - 1 - l1
        right_l = right[l1 + 1 :].reshape(later * H, *right.shape[2:])
        num = _absorbed_pair_norms(left[l1], right_l).reshape(H, later, H)
        den = ov_norm[l1][:, None, None] * r_norm[l1 + 1 :][None]
        out[l1, :, l1 + 1 :, :] = num / den
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
    score can be read as "k standard deviations above chance".
    """
    n = samples
    shape_in, shape_out = (n, d_model, d_head), (n, d_head, d_model)
    shapes = [shape_in, shape_out, shape_in, shape_in if kind != "v" else shape_out]  # V1, O1, A, B (or RB)
    scores = []
    for V1, O1, A, B in _seeded_normals(torch.Generator().manual_seed(seed), shapes):
        RB = B.transpose(-1, -2) if kind != "v" else B
        # sample i pairs writer i with reader i only: ||S_V1 O1 A S_RB^T||_F, batched over the block
        num = torch.linalg.matrix_norm(_absorb_left(V1, O1) @ _absorb_right(A, RB))
        scores.append(num / (LowRank(V1, O1).norm() * LowRank(A, RB).norm()))
    s = torch.cat(scores)
    return Baseline(mean=float(s.mean()), std=float(s.std()), samples=n)


def _seeded_normals(g: torch.Generator, shapes: list[tuple[int, ...]], max_bytes: int = 64 * 2**20) -> Any:
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
    states = []
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
        return {"kind": self.kind, "baseline": vars(self.baseline), "pairs": self.pairs()}


def composition_scores(w: Weights, kind: CompositionKind, *, baseline_samples: int = 256, seed: int = 0) -> Composition:
    """Raw scores for every pair of heads in increasing layers, plus the random-matrix baseline."""
    return Composition(
        kind=kind,
        raw=composition_raw(w, kind),
        baseline=composition_baseline(w.cfg.d_model, w.cfg.d_head, kind, samples=baseline_samples, seed=seed),
    )


# ----------------------------------------------------------------------- copying
def ov_eigenvalues(w: Weights) -> Tensor:
    """Eigenvalues of every head's full OV circuit ``W_E W_OV W_U``: complex ``[L, H, d_head]``.

    Through the ``d_head x d_head`` twin ``W_O (W_U W_E) W_V``; ``W_U W_E`` is computed once.
    """
    G = w.W_U @ w.W_E  # [d_model, d_model]
    small = w.W_O @ G @ w.W_V  # [L, H, d_head, d_head]
    with serial_linalg():
        return torch.linalg.eigvals(small)


def eigen_copying_score(eigenvalues: Tensor) -> Tensor:
    """``sum(lambda) / sum(|lambda|)`` over the last dim: in [-1, 1], ~0 for random matrices [I]."""
    return eigenvalues.sum(-1).real / eigenvalues.abs().sum(-1).clamp_min(1e-30)


def residual_ov_eigenvalues(w: Weights) -> Tensor:
    """Eigenvalues of every head's ``W_OV`` in the residual stream (``W_O W_V``, ``[L, H, d_head]``)."""
    small = w.W_O @ w.W_V
    with serial_linalg():
        return torch.linalg.eigvals(small)


def diagonal_topk_rate(
    w: Weights, layer: int, head: int, k: int = 5, *, max_bytes: int = DEFAULT_MAX_BYTES, tokens: Tensor | None = None
) -> float:
    """Fraction of tokens whose own logit is in the top ``k`` of their full-OV row, exactly.

    Over the whole vocabulary (or the rows ``tokens``), in row chunks of ``max_bytes``.
    """
    f = full_ov(w, layer, head)
    if tokens is not None:
        f = LowRank(f.A[tokens], f.B[:, tokens])
    ranks = f.diag_rank(max_bytes=max_bytes)
    return float((ranks < k).float().mean())


@dataclass
class HeadCopying:
    layer: int
    head: int
    eigen_score: float
    diag_topk_rate: float | None
    residual_eigen_score: float

    def to_dict(self) -> dict[str, Any]:
        return {**vars(self), "head": f"{self.layer}.{self.head}"}


def copying_scores(w: Weights, *, diag_k: int | None = 5, max_bytes: int = DEFAULT_MAX_BYTES) -> list[HeadCopying]:
    """Per head: eigenvalue copying score of the full OV circuit, diagonal top-k rate, residual-space score."""
    eig = eigen_copying_score(ov_eigenvalues(w))
    res = eigen_copying_score(residual_ov_eigenvalues(w))
    out = []
    for layer in range(w.n_layers):
        for head in range(w.n_heads):
            rate = diagonal_topk_rate(w, layer, head, diag_k, max_bytes=max_bytes) if diag_k else None
            out.append(HeadCopying(layer, head, float(eig[layer, head]), rate, float(res[layer, head])))
    return out


# ------------------------------------------------------------- residual stream
@dataclass
class LayerBandwidth:
    layer: int
    own: int  # this layer's computational dimensions: n_heads * d_head + d_mlp
    before: int  # sum over earlier layers
    after: int  # sum over later layers
    d_model: int

    def to_dict(self) -> dict[str, Any]:
        return {**vars(self), "before_ratio": self.before / self.d_model, "after_ratio": self.after / self.d_model}


def bandwidth(w: Weights) -> list[LayerBandwidth]:
    """Computational dimensions that communicate through the ``d_model``-wide stream, per layer."""
    c = w.cfg
    own = c.n_heads * c.d_head + (c.d_mlp or 0)
    return [
        LayerBandwidth(layer=l, own=own, before=own * l, after=own * (c.n_layers - 1 - l), d_model=c.d_model)
        for l in range(c.n_layers)
    ]


@dataclass
class WriteOverlap:
    """Overlap of heads' write spaces (row spaces of ``W_O``): mean squared cosine of principal angles."""

    labels: list[str]
    overlap: Tensor  # [n, n], 1 on the diagonal; d_head / d_model expected for random subspaces
    cosines: Tensor  # [n, n, d_head] principal-angle cosines, largest first
    random_expectation: float

    def to_dict(self) -> dict[str, Any]:
        return {"labels": self.labels, "overlap": self.overlap.tolist(), "random_expectation": self.random_expectation}


def write_overlap(w: Weights) -> WriteOverlap:
    """Principal angles between every pair of heads' write subspaces in the residual stream."""
    L, H, E, D = w.W_O.shape
    flat = w.W_O.reshape(L * H, E, D).transpose(-1, -2)  # [n, D, E] columns span the write space
    with serial_linalg():
        q, _ = torch.linalg.qr(flat)
    inner = torch.einsum("ade,bdf->abef", q, q)
    with serial_linalg():
        cos = torch.linalg.svdvals(inner)  # [n, n, E]
    overlap = cos.pow(2).mean(-1)
    labels = [f"{l}.{h}" for l in range(L) for h in range(H)]
    return WriteOverlap(labels, overlap, cos, random_expectation=min(1.0, E / D))


# ------------------------------------------------------------------ everything
@dataclass
class CircuitsReport:
    copying: list[HeadCopying]
    composition: dict[str, Composition] = field(default_factory=dict)
    bandwidth: list[LayerBandwidth] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "copying": [c.to_dict() for c in self.copying],
            "composition": {k: v.to_dict() for k, v in self.composition.items()},
            "bandwidth": [b.to_dict() for b in self.bandwidth],
        }


def analyse(w: Weights, *, diag_k: int | None = 5, max_bytes: int = DEFAULT_MAX_BYTES) -> CircuitsReport:
    """Copying scores, Q/K/V composition (with baselines) and the bandwidth audit of a weights view."""
    return CircuitsReport(
        copying=copying_scores(w, diag_k=diag_k, max_bytes=max_bytes),
        composition={k: composition_scores(w, k) for k in ("q", "k", "v")},  # type: ignore[misc]
        bandwidth=bandwidth(w),
    )
