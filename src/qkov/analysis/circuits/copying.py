"""Copying: how much each head's OV circuit copies the token it attends to.

[F] reads copying off the eigenvalues of the full OV circuit ``W_E W_OV W_U`` (positive eigenvalues:
the head raises the logit of what it attends to); :func:`copying_scores` gives that score per head,
the same on ``W_OV`` in the stream, and the rate at which a source token's own logit is in the top
``k`` of its row of the full OV circuit (exact up to :data:`DIAG_EXACT_MAX` tokens, else on a seeded
sample of :data:`DIAG_SAMPLE` tokens with its standard error).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator
from typing import ClassVar

import torch
from torch import Tensor

from ...errors import QkovError
from ...weights.parts import AttentionWeights, WeightSource
from ...weights.convert import SourceLike, as_source
from .factored import DEFAULT_MAX_BYTES, LowRank, eigenvalues
from ... import ranks
from ...progress import Progress, tick
from ..shown import Shown
from .vocab import VOCAB_BLOCK
from ..sampling import seeded_subset
from .qk_ov import full_ov, unembed_embed
from ..shown import TEXT, Items, num, register, table
from ..budget import item, layer_read_bytes

__all__ = [
    "check_diag_k",
    "copying_bytes",
    "copying_scores",
    "copying_text",
    "CopyingScores",
    "DIAG_EXACT_MAX",
    "DIAG_SAMPLE",
    "diag_tokens",
    "diagonal_topk_rate",
    "eigen_copying_score",
    "HeadCopying",
    "ov_eigenvalues",
    "rate_stderr",
    "residual_ov_eigenvalues",
]


DIAG_EXACT_MAX = 8192  # vocabularies up to this size get the exact own-logit-in-top-k rate
READ_OUT_BYTES = 256 * 2**20  # copying_scores reads out (W_O[h] @ W_U) this many bytes of heads at once
DIAG_SAMPLE = 1024  # tokens the rate is estimated on above it (standard error <= 0.016)


def check_diag_k(k: int, d_vocab: int) -> None:
    """Refuse a ``diag_k`` that is not from 1 to ``d_vocab - 1`` (one-line :class:`QkovError`)."""
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k < d_vocab:
        raise QkovError(
            f"diag_k must be an integer from 1 to {d_vocab - 1}, below the vocabulary ({d_vocab} tokens): "
            f"the top {d_vocab} of a row holds every token; got {k!r}"
        )


def diag_tokens(d_vocab: int, sample: int | None = None, *, seed: int = 0) -> Tensor | None:
    """The tokens (rows) the own-logit-in-top-k rate is measured on: ``None`` for all of them.

    ``sample=None`` chooses: every token up to :data:`DIAG_EXACT_MAX`, else :data:`DIAG_SAMPLE`
    tokens drawn without replacement (seeded, sorted). A ``sample`` of at least ``d_vocab`` means all.
    """
    if sample is None:
        sample = d_vocab if d_vocab <= DIAG_EXACT_MAX else DIAG_SAMPLE
    if not isinstance(sample, int) or isinstance(sample, bool) or sample < 1:
        raise QkovError(f"diag_sample must be a positive number of tokens, got {sample!r}")
    if sample >= d_vocab:
        return None
    return seeded_subset(d_vocab, sample, seed)


def rate_stderr(rate: float, n: int, population: int) -> float:
    """Standard error of a rate measured on ``n`` of ``population`` tokens drawn without
    replacement: binomial with the finite-population correction, 0 when ``n`` is all of them.
    The rate is shrunk to ``(x + 2) / (n + 4)`` first (Agresti-Coull), so a rate of 0 or 1
    seen on a sample still gets the uncertainty it has (about 0.14 points at n = 1024)."""
    if n >= population:
        return 0.0
    p = (rate * n + 2) / (n + 4)
    return math.sqrt(p * (1 - p) / n * (population - n) / max(1, population - 1))


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
    return float(f.diag_in_top(k, max_bytes=max_bytes, cols=tokens).float().mean())


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
    the same product (:func:`qkov.analysis.heads.report.head_report`'s repeated-token copying): formed once.
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
    sp = ranks.current()  # a unit: one head, number layer * H + head
    reads_out = bool(diag_k) or on_head is not None
    group = max(1, READ_OUT_BYTES // (source.cfg.d_head * V * item(source)))  # heads read out at once
    twins, rates, mine = [], [], []
    for layer in range(L):
        heads = [h for h in range(H) if sp.mine(layer * H + h, L * H)]
        att = source.attention(layer) if heads else None  # a rank reads only the layers it has heads in
        # the layer's heads read by the unembedding a group at a time (READ_OUT_BYTES), in one product
        # ([g E, D] @ [D, V]): a head alone has d_head rows, too few to run it near the CPU's peak
        OUs: Tensor | None = None
        for i, head in enumerate(heads):
            A, B = att.W_V[head], att.W_O[head]  # type: ignore[union-attr]
            twins += [LowRank(A, B @ G).twin(), LowRank(A, B).twin()]  # full OV, then residual
            if reads_out and i % group == 0:
                OUs = None
                OUs = _read_out(att.W_O[heads[i : i + group]], W_U)  # type: ignore[union-attr, arg-type]
            OU = OUs[i % group] if reads_out else None  # type: ignore[index]  # [E, V]
            if diag_k:
                f = LowRank(E_rows @ A, OU)  # type: ignore[arg-type]
                cols = None if rows is None else rows.to(W_E.device)
                rates.append(float(f.diag_in_top(diag_k, max_bytes=max_bytes, cols=cols).float().mean()))
            if on_head is not None:
                on_head(layer, head, OU)  # type: ignore[arg-type]
            del OU
            mine.append(layer * H + head)
        del OUs
        tick(progress, "copying", layer + 1, L)
    scores = eigen_copying_score(eigenvalues(torch.stack(twins))).tolist() if twins else []  # one solve
    parts = {u: (scores[2 * i], scores[2 * i + 1], rates[i] if diag_k else None) for i, u in enumerate(mine)}
    got = sp.gather(parts, L * H)  # (eigen, residual eigen, rate) of every head, in head order

    def head(l: int, h: int) -> HeadCopying:
        eig, res, rate = got[l * H + h]
        err = None if rate is None else rate_stderr(rate, n, V)
        return HeadCopying(l, h, eig, rate, res, n if diag_k else None, err)

    return CopyingScores([head(l, h) for l in range(L) for h in range(H)], diag_k or None)


def _read_out(W_O: Tensor, W_U: Tensor) -> Tensor:
    """``W_O[h] @ W_U`` of each head: ``W_O [H, E, D]``, ``W_U [D, V]`` -> ``[H, E, V]``, as one product."""
    H, E, D = W_O.shape
    return (W_O.reshape(H * E, D) @ W_U).view(H, E, -1)


@dataclass(repr=False, eq=False)
class CopyingScores(Items, Shown):
    """What :func:`~qkov.analysis.circuits.copying.copying_scores` returns: ``heads``, one
    :class:`~qkov.analysis.circuits.copying.HeadCopying` per head in layer-major order, and ``k``, the top-k of
    the diagonal rate (``None`` when it was skipped)."""

    ITEMS: ClassVar[str] = "heads"
    heads: list[Any] = field(default_factory=list)
    k: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"k": self.k, "heads": [c.to_dict() for c in self.heads]}


@register(TEXT, CopyingScores)
def copying_text(scores: CopyingScores) -> str:
    k = scores.k or "k"
    cells = lambda c: [c.layer, c.head, num(c.eigen_score), num(c.diag_topk_rate), num(c.residual_eigen_score)]  # noqa: E731
    rows = [cells(c) for c in scores.heads]
    title = f"copying scores of {len(scores.heads)} heads (eigen: full OV circuit; residual: W_OV in the stream):"
    return title + "\n" + table(["layer", "head", "eigen", f"own in top {k}", "residual eigen"], rows)


def copying_bytes(source: WeightSource, *, diag: bool, rows: int | None, chunk_rows: int) -> int:
    """Peak of :func:`~qkov.analysis.circuits.copying.copying_scores`: ``G = W_U W_E``, one layer's ``W_O G``
    and attention read, every head's twins and eigenvalues; with the diagonal rate (``diag``) also
    ``W_E`` and ``W_U`` read whole (a streamed source), the sampled rows (``rows`` of them, ``None``:
    every token), one head's full-OV factors and a chunk of ``chunk_rows`` rows of its full OV
    circuit with their comparisons."""
    c, it = source.cfg, item(source)
    V, D, H, E, L = c.d_vocab, c.d_model, c.n_heads, c.d_head, c.n_layers
    elems = D * D + H * E * D + 2 * L * H * E * E + 4 * L * H * E
    extra = 0
    if diag:
        n = V if rows is None else rows
        elems += (0 if source.in_memory else 2 * V * D) + (0 if rows is None else n * D)
        group = min(H, max(1, READ_OUT_BYTES // (E * V * it)))  # heads read by W_U at once
        elems += n * E + group * E * V + chunk_rows * V
        extra = chunk_rows * V  # the comparison with the diagonal (bool)
    elif not source.in_memory:
        elems += 2 * VOCAB_BLOCK * D  # W_U W_E summed over blocks of the vocabulary
    return elems * it + extra + layer_read_bytes(source)
