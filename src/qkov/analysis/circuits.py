"""QK and OV circuits, virtual weights, copying scores, bandwidth, write-space overlap.

Row convention throughout (docs/conventions.md): activations are rows, ``x @ W``. Per head
``W_QK = W_Q @ W_K^T`` and ``W_OV = W_V @ W_O`` (both ``[d_model, d_model]``, rank <=
d_head). Full circuits are indexed ``[query or source token, key or output token]``:

* full OV ``W_E @ W_OV @ W_U`` — ``[source token attended to, output logit]``;
* full QK ``W_E @ W_QK @ W_E^T`` — ``[query (destination) token, key (source) token]``;
* positional QK ``W_pos @ W_QK @ W_pos^T`` — ``[query position, key position]``, and
  the two cross terms ``[query token, key position]`` / ``[query position, key token]``.

Every function reads a :class:`~qkov.weights.WeightSource`, so the same code serves the
in-memory view and a memory-mapped checkpoint: per-layer work reads one layer at a time,
and nothing ``d_vocab x d_vocab`` is built (:class:`~qkov.analysis.factored.LowRank`).
Composition scores live in :mod:`qkov.analysis.composition`, the bandwidth audit and write-space
overlap in :mod:`qkov.analysis.bandwidth` (both re-exported here); :func:`circuits_report` gathers them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from ..deprecated import module_getattr
from ..errors import QkovError
from ..weights.parts import AttentionWeights, WeightSource, check_head
from ..weights.convert import SourceLike, as_source
from .bandwidth import LayerBandwidth as LayerBandwidth, WriteOverlap as WriteOverlap
from .bandwidth import bandwidth, write_overlap as write_overlap
from .budget import circuits_budget as circuits_budget
from .composition import DEFAULT_WRITER_BYTES, Composition, composition_scores
from .factored import DEFAULT_MAX_BYTES, LowRank, eigenvalues
from . import split
from .progress import Progress, tick
from .rotary_circuits import OffsetProfiles, profiles, resolve_offsets
from .diagonal import DIAG_EXACT_MAX as DIAG_EXACT_MAX, DIAG_SAMPLE as DIAG_SAMPLE
from .diagonal import check_diag_k as check_diag_k, diag_tokens as diag_tokens, rate_stderr as rate_stderr
from .shown import CopyingScores, Shown
from .vocab import VOCAB_BLOCK, embed_product, unembed_product


# --------------------------------------------------------------------- circuits
def _positions(source: WeightSource) -> Tensor:
    pos = source.pos()
    if pos is None:
        raise QkovError("this model has no positional embedding")
    return pos


def _not_rotary(source: WeightSource) -> None:
    if source.cfg.positional == "rotary":
        raise QkovError(
            "rotary positions: a head's QK circuit depends on the offset between query and key; "
            "use qkov.analysis.rotary_circuits.offset_qk (one offset) or offset_profile"
        )


def qk(source: SourceLike) -> LowRank:
    """``W_QK = W_Q @ W_K^T`` for every head: ``[n_layers, n_heads, d_model, d_model]`` (not for
    rotary models: see :mod:`qkov.analysis.rotary_circuits`)."""
    source = as_source(source, where="qkov.qk")
    _not_rotary(source)
    atts = [source.attention(l) for l in range(source.cfg.n_layers)]
    return LowRank(torch.stack([a.W_Q for a in atts]), torch.stack([a.W_K for a in atts]).transpose(-1, -2))


def ov(source: SourceLike) -> LowRank:
    """``W_OV = W_V @ W_O`` for every head: ``[n_layers, n_heads, d_model, d_model]``."""
    source = as_source(source, where="qkov.ov")
    atts = [source.attention(l) for l in range(source.cfg.n_layers)]
    return LowRank(torch.stack([a.W_V for a in atts]), torch.stack([a.W_O for a in atts]))


def full_ov(source: SourceLike, layer: int, head: int) -> LowRank:
    """``W_E @ W_OV @ W_U``: ``[d_vocab (source token), d_vocab (output logit)]``."""
    source = as_source(source, where="qkov.full_ov")
    att = source.attention(layer, head)
    return LowRank(embed_product(source, att.W_V[0]), unembed_product(source, att.W_O[0]))


def full_qk(source: SourceLike, layer: int, head: int) -> LowRank:
    """``W_E @ W_QK @ W_E^T``: ``[d_vocab (query token), d_vocab (key token)]`` (token part of the score)."""
    source = as_source(source, where="qkov.full_qk")
    _not_rotary(source)
    att = source.attention(layer, head)
    EQ, EK = embed_product(source, torch.cat([att.W_Q[0], att.W_K[0]], -1)).split(att.W_Q.shape[-1], -1)
    return LowRank(EQ, EK.T)


def positional_qk(source: SourceLike, layer: int, head: int) -> LowRank:
    """``W_pos @ W_QK @ W_pos^T``: ``[query position, key position]``."""
    source = as_source(source, where="qkov.positional_qk")
    att = source.attention(layer, head)
    P = _positions(source)
    return LowRank(P @ att.W_Q[0], (P @ att.W_K[0]).T)


def token_position_qk(source: SourceLike, layer: int, head: int) -> tuple[LowRank, LowRank]:
    """Cross terms ``[query token, key position]`` and ``[query position, key token]``.

    With positions p and tokens e, the score ``(e_q + p_i) W_QK (e_k + p_j)^T`` is
    token-token + token-position + position-token + position-position.
    """
    source = as_source(source, where="qkov.token_position_qk")
    att = source.attention(layer, head)
    P, W_E = _positions(source), source.embed()
    Q, K = att.W_Q[0], att.W_K[0]
    return LowRank(W_E @ Q, (P @ K).T), LowRank(P @ Q, (W_E @ K).T)


# ---------------------------------------------------------------- virtual weights
Component = tuple  # ("embed",) ("pos",) ("head", l, h) ("mlp", l) ("q"|"k"|"v", l, h) ("unembed",)


def _order(kind: str, index: tuple, parallel: bool = False) -> float:
    """Where a component sits in the model: embeddings first, layer l's attention at 2l, its MLP
    at 2l + 1 (at 2l too in a parallel block: it reads the stream attention reads), the
    unembedding last."""
    layer = index[0] if index else 0
    mlp = 2 * layer + (0 if parallel else 1)
    return {"embed": -1.0, "pos": -1.0, "mlp": mlp, "unembed": math.inf}.get(kind, 2 * layer)


def virtual_weights(source: SourceLike, writer: Component, reader: Component) -> LowRank:
    """The virtual weight ``writer_out @ reader_in`` between two components through the stream.

    Writers: ``("embed",)`` (W_E), ``("pos",)`` (W_pos), ``("head", l, h)`` (W_O),
    ``("mlp", l)`` (W_out). Readers: ``("q"|"k"|"v", l, h)`` (W_Q/W_K/W_V), ``("mlp", l)``
    (W_in), ``("unembed",)`` (W_U). The reader must come later in the model than the
    writer, and in a shortformer model positions reach only the query and key readers (they
    never enter the stream). Returned factored, ``[writer dims, reader dims]`` with inner
    ``d_model``; only the two components involved are read.
    """
    source = as_source(source, where="qkov.virtual_weights")
    wk, *wi = writer
    rk, *ri = reader
    if wk not in ("embed", "pos", "head", "mlp"):
        raise QkovError(f"unknown writer {writer!r}")
    if rk not in ("q", "k", "v", "mlp", "unembed"):
        raise QkovError(f"unknown reader {reader!r}")
    if wk == "head":
        check_head(source.cfg, *wi)
    if rk in ("q", "k", "v"):
        check_head(source.cfg, *ri)
    if wk == "mlp" or rk == "mlp":
        if source.cfg.d_mlp is None:
            raise QkovError("this model has no MLP")
        check_head(source.cfg, (wi if wk == "mlp" else ri)[0])
    par = source.cfg.parallel
    if _order(wk, tuple(wi), par) >= _order(rk, tuple(ri), par):
        raise QkovError(f"{reader!r} does not come after {writer!r}: no virtual weight")
    if wk == "pos" and rk not in ("q", "k") and source.cfg.positional == "shortformer":
        raise QkovError(f"shortformer positions enter only the query/key input: no virtual weight to {reader!r}")
    if wk == "embed":
        out = source.embed()
    elif wk == "pos":
        out = _positions(source)
    elif wk == "head":
        out = source.attention(wi[0], wi[1]).W_O[0]
    else:
        out = source.mlp(wi[0]).W_out  # type: ignore[union-attr]
    if rk in ("q", "k", "v"):
        inp = getattr(source.attention(ri[0], ri[1]), f"W_{rk.upper()}")[0]
    elif rk == "mlp":
        inp = source.mlp(ri[0]).W_in  # type: ignore[union-attr]
    else:
        inp = source.unembed().W_U
    return LowRank(out, inp)


# ----------------------------------------------------------------------- copying
def unembed_embed(source: SourceLike, *, block: int = VOCAB_BLOCK) -> Tensor:
    """``W_U @ W_E [d_model, d_model]``: one product in memory; for a streamed source, summed
    over blocks of ``block`` tokens so that neither matrix is held whole."""
    source = as_source(source, where="qkov.unembed_embed")
    if source.in_memory:
        return source.unembed().W_U @ source.embed()
    V, D = source.cfg.d_vocab, source.cfg.d_model
    G = torch.zeros(D, D, device=source.device, dtype=source.dtype)
    for lo in range(0, V, block):
        rows = slice(lo, min(V, lo + block))
        G += source.unembed(cols=rows).W_U @ source.embed(rows)
    return G


def eigen_copying_score(eigenvalues: Tensor) -> Tensor:
    """``sum(lambda) / sum(|lambda|)`` over the last dim: in [-1, 1], ~0 for random matrices [I]."""
    return eigenvalues.sum(-1).real / eigenvalues.abs().sum(-1).clamp_min(1e-30)


def ov_eigenvalues(source: SourceLike, *, G: Tensor | None = None) -> Tensor:
    """Eigenvalues of every head's full OV circuit ``W_E W_OV W_U``: complex ``[L, H, d_head]``.

    The non-zero eigenvalues of ``W_E W_V W_O W_U`` are those of its ``d_head x d_head`` twin
    ``W_O (W_U W_E) W_V`` (:meth:`LowRank.eigenvalues` of ``W_V @ (W_O G)``); ``G = W_U W_E``
    is computed once (or given).
    """
    source = as_source(source, where="qkov.ov_eigenvalues")
    G = unembed_embed(source) if G is None else G
    return _eigenvalues(source, [LowRank(a.W_V, a.W_O @ G).twin() for a in _layers(source)])


def residual_ov_eigenvalues(source: SourceLike) -> Tensor:
    """Eigenvalues of every head's ``W_OV`` in the residual stream (``W_O W_V``): ``[L, H, d_head]``."""
    source = as_source(source, where="qkov.residual_ov_eigenvalues")
    return _eigenvalues(source, [LowRank(a.W_V, a.W_O).twin() for a in _layers(source)])


def _layers(source: WeightSource) -> Iterator[AttentionWeights]:
    """Every layer's attention, read one at a time."""
    return map(source.attention, range(source.cfg.n_layers))


def _eigenvalues(source: WeightSource, twins: list[Tensor]) -> Tensor:
    """Eigenvalues ``[L, H, d_head]`` of every layer's ``[H, d_head, d_head]`` twins, in one solve."""
    c = source.cfg
    if not twins:
        dtype = torch.complex64 if source.dtype == torch.float32 else torch.complex128
        return torch.zeros(0, c.n_heads, c.d_head, dtype=dtype, device=source.device)
    return eigenvalues(torch.stack(twins))


def diagonal_topk_rate(
    source: WeightSource,
    layer: int,
    head: int,
    k: int = 5,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    tokens: Tensor | None = None,
) -> float:
    """Fraction of tokens whose own logit is in the top ``k`` of their full-OV row, exactly.

    Over the whole vocabulary, or the rows ``tokens`` (each against every column), in row chunks.
    """
    check_diag_k(k, source.cfg.d_vocab)
    f = full_ov(source, layer, head)
    if tokens is not None:
        f = LowRank(f.A[tokens], f.B)
    return float((f.diag_rank(max_bytes=max_bytes, cols=tokens) < k).float().mean())


@dataclass
class HeadCopying:
    """One head's copying scores: eigenvalue score of its full OV circuit, the share of tokens
    whose own logit is in the top k of their OV row (``None`` when skipped) with the number of
    tokens it was measured on and its standard error (0 when exact: all tokens), and the
    eigenvalue score of ``W_OV`` in the residual stream (negative: the head deletes what it reads)."""

    layer: int
    head: int
    eigen_score: float
    diag_topk_rate: float | None
    residual_eigen_score: float
    diag_tokens: int | None = None
    diag_stderr: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**vars(self), "head": f"{self.layer}.{self.head}"}


def copying_scores(
    source: SourceLike,
    *,
    diag_k: int | None = 5,
    diag_sample: int | None = None,
    seed: int = 0,
    max_bytes: int = DEFAULT_MAX_BYTES,
    progress: Progress | None = None,
    on_head: Callable[[int, int, Tensor], None] | None = None,
) -> CopyingScores:
    """Per head: eigenvalue copying score of the full OV circuit, the diagonal top-``diag_k``
    rate (``None``/0 skips it) and the residual-space score.

    The rate compares each token's own logit with its whole row (``d_vocab`` entries): exact over
    every token up to :data:`DIAG_EXACT_MAX` tokens, else estimated on :data:`DIAG_SAMPLE`
    seeded tokens (``diag_sample`` sets the count; see :func:`diag_tokens`), with its standard
    error in :attr:`HeadCopying.diag_stderr`. The exact rate costs ``d_vocab^2 d_head`` per
    head: at GPT-2's 50,257 tokens, minutes per head on a laptop CPU.

    One layer's attention is held at a time. Without ``diag_k`` a streamed source never holds
    ``W_E`` or ``W_U`` whole (:func:`unembed_embed`); the diagonal rate needs every column of each
    full OV circuit, so both are then read once and held.

    ``on_head(layer, head, W_O[head] @ W_U)``: called with each head's ``[d_head, d_vocab]`` output
    read by the unembedding, in head order (this rank's heads under torchrun), for a caller that needs
    the same product (:func:`qkov.analysis.heads.head_report`'s repeated-token copying): formed once.
    """
    source = as_source(source, where="qkov.copying_scores")
    V = source.cfg.d_vocab
    rows = None
    if diag_k:
        check_diag_k(diag_k, V)
        rows = diag_tokens(V, diag_sample, seed=seed)
        W_E, W_U = source.embed(), source.unembed().W_U
        G = W_U @ W_E
        E_rows = W_E if rows is None else W_E[rows.to(W_E.device)]
    else:
        G = unembed_embed(source)
        W_U = source.unembed().W_U if on_head is not None else None
    n = V if rows is None else len(rows)
    L, H = source.cfg.n_layers, source.cfg.n_heads
    sp = split.current()  # a unit: one head, number layer * H + head
    twins, rates, mine = [], [], []
    for layer in range(L):
        heads = [h for h in range(H) if sp.mine(layer * H + h, L * H)]
        att = source.attention(layer) if heads else None  # a rank reads only the layers it has heads in
        for head in heads:
            A, B = att.W_V[head], att.W_O[head]  # type: ignore[union-attr]
            twins += [LowRank(A, B @ G).twin(), LowRank(A, B).twin()]  # full OV, then residual
            OU = B @ W_U if diag_k or on_head is not None else None  # type: ignore[operator]  # [E, V]
            if diag_k:
                f = LowRank(E_rows @ A, OU)  # type: ignore[arg-type]
                cols = None if rows is None else rows.to(W_E.device)
                rates.append(float((f.diag_rank(max_bytes=max_bytes, cols=cols) < diag_k).float().mean()))
            if on_head is not None:
                on_head(layer, head, OU)  # type: ignore[arg-type]
            del OU
            mine.append(layer * H + head)
        tick(progress, "copying", layer + 1, L)
    scores = eigen_copying_score(eigenvalues(torch.stack(twins))).tolist() if twins else []  # one solve
    parts = {u: (scores[2 * i], scores[2 * i + 1], rates[i] if diag_k else None) for i, u in enumerate(mine)}
    got = sp.gather(parts, L * H)  # (eigen, residual eigen, rate) of every head, in head order

    def head(l: int, h: int) -> HeadCopying:
        eig, res, rate = got[l * H + h]
        err = None if rate is None else rate_stderr(rate, n, V)
        return HeadCopying(l, h, eig, rate, res, n if diag_k else None, err)

    return CopyingScores([head(l, h) for l in range(L) for h in range(H)], diag_k or None)


# ------------------------------------------------------------------ everything
@dataclass(repr=False)
class CircuitsReport(Shown):
    """What ``qkov circuits`` shows: per-head copying, Q/K/V composition, the bandwidth audit."""

    copying: list[HeadCopying]
    composition: dict[str, Composition] = field(default_factory=dict)
    bandwidth: list[LayerBandwidth] = field(default_factory=list)
    offsets: OffsetProfiles | None = None  # rotary models: each head's weights-only offset profile

    def to_dict(self) -> dict[str, Any]:
        out = {
            "copying": [c.to_dict() for c in self.copying],
            "composition": {k: v.to_dict() for k, v in self.composition.items()},
            "bandwidth": [b.to_dict() for b in self.bandwidth],
        }
        if self.offsets is not None:
            out["offset_profiles"] = self.offsets.to_dict()
        return out


def circuits_report(
    source: SourceLike,
    *,
    diag_k: int | None = 5,
    diag_sample: int | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    writer_bytes: int = DEFAULT_WRITER_BYTES,
    progress: Progress | None = None,
    offsets: list[int] | None = None,
    matmul_dtype: torch.dtype | None = None,
) -> CircuitsReport:
    """Copying scores (``diag_k``/``diag_sample``: :func:`copying_scores`), Q/K/V composition
    (with baselines), the bandwidth audit of a source, and for a rotary model every head's offset
    profile (``offsets``: the offset set of Q/K composition; ``matmul_dtype``: see :func:`composition_raw`).
    Chunked steps shrink to fit the memory budget (:func:`circuits_budget`), and work whose smallest
    chunks would not fit is refused before it starts."""
    source = as_source(source, where="qkov.circuits.circuits_report")
    if diag_k:
        check_diag_k(diag_k, source.cfg.d_vocab)  # before any work
    rotary = resolve_offsets(source.cfg, offsets) is not None  # checks the offsets before any work
    rows = diag_tokens(source.cfg.d_vocab, diag_sample) if diag_k else None
    n_rows = None if rows is None else len(rows)
    max_bytes, writer_bytes = circuits_budget(
        source, diag_k=diag_k, rows=n_rows, max_bytes=max_bytes, writer_bytes=writer_bytes, offsets=offsets
    )
    return CircuitsReport(
        copying=copying_scores(
            source, diag_k=diag_k, diag_sample=diag_sample, max_bytes=max_bytes, progress=progress
        ).heads,
        composition=composition_scores(
            source, "qkv", max_bytes=writer_bytes, progress=progress, offsets=offsets, matmul_dtype=matmul_dtype
        ).kinds,
        bandwidth=bandwidth(source.cfg),
        offsets=profiles(source) if rotary else None,
    )


__getattr__ = module_getattr(__name__, {"analyse": ("qkov.analysis.circuits.circuits_report", lambda: circuits_report)})
