"""The weights-only report of a model (``qkov circuits``): copying scores, Q/K/V composition, the
residual stream's bandwidth and the overlap of what heads write, sized to the memory budget.

[F] reads the residual stream as a bus of ``d_model`` dimensions that every head and MLP writes into:
:func:`bandwidth` counts, per layer, the dimensions written against the stream's; :func:`write_overlap`
how much the heads' write spaces overlap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ...weights.parts import WeightSource
from ...weights.convert import SourceLike, as_source
from .composition import DEFAULT_WRITER_BYTES, Composition, composition_scores
from .factored import DEFAULT_MAX_BYTES
from ...progress import Progress
from .rotary import OffsetProfiles, profiles, resolve_offsets
from .copying import check_diag_k, diag_tokens
from .copying import CopyingScores
from ..shown import Shown
from ...model.config import ModelConfig
from .factored import serial_linalg
from ...device import check_fits, memory_budget
from .factored import CACHE_BYTES
from .copying import HeadCopying, copying_bytes, copying_scores, copying_text
from .composition import composition_bytes, composition_text
from ..shown import TEXT, register
from ..budget import item, rows_per_chunk

__all__ = [
    "bandwidth",
    "circuits_budget",
    "circuits_report",
    "circuits_text",
    "CircuitsReport",
    "LayerBandwidth",
    "write_overlap",
    "WriteOverlap",
]


@dataclass
class LayerBandwidth:
    layer: int
    own: int  # this layer's computational dimensions: n_heads * d_head + d_mlp
    before: int  # sum over earlier layers
    after: int  # sum over later layers
    d_model: int

    def to_dict(self) -> dict[str, Any]:
        return {**vars(self), "before_ratio": self.before / self.d_model, "after_ratio": self.after / self.d_model}


def bandwidth(cfg: ModelConfig) -> list[LayerBandwidth]:
    """Computational dimensions that communicate through the ``d_model``-wide stream, per layer."""
    own = cfg.n_heads * cfg.d_head + (cfg.d_mlp or 0)
    return [
        LayerBandwidth(layer=l, own=own, before=own * l, after=own * (cfg.n_layers - 1 - l), d_model=cfg.d_model)
        for l in range(cfg.n_layers)
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


def write_overlap(source: SourceLike) -> WriteOverlap:
    """Principal angles between every pair of heads' write subspaces in the residual stream."""
    source = as_source(source, where="qkov.write_overlap")
    c = source.cfg
    W_O = torch.stack([source.attention(l).W_O for l in range(c.n_layers)])
    L, H, E, D = W_O.shape
    flat = W_O.reshape(L * H, E, D).transpose(-1, -2)  # [n, D, E] columns span the write space
    with serial_linalg():
        q, _ = torch.linalg.qr(flat)
        cos = torch.linalg.svdvals(torch.einsum("ade,bdf->abef", q, q))  # [n, n, E]
    labels = [f"{l}.{h}" for l in range(L) for h in range(H)]
    return WriteOverlap(labels, cos.pow(2).mean(-1), cos, random_expectation=min(1.0, E / D))


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


@register(TEXT, CircuitsReport)
def circuits_text(rep: CircuitsReport) -> str:
    parts = [copying_text(CopyingScores(rep.copying)), *(composition_text(c) for c in rep.composition.values())]
    return "CircuitsReport\n" + "\n\n".join(parts)


def circuits_budget(
    source: WeightSource,
    *,
    diag_k: int | None,
    rows: int | None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    writer_bytes: int = DEFAULT_WRITER_BYTES,
    offsets: list[int] | None = None,
) -> tuple[int, int]:
    """The chunk bounds :func:`~qkov.analysis.circuits.report.circuits_report` uses (``rows``: the tokens whose
    own-logit rate is measured, ``None`` for all), ``(max_bytes, writer_bytes)``: the ones given when
    the copying scores (:func:`~qkov.analysis.circuits.copying.copying_bytes`) and composition
    (:func:`~qkov.analysis.circuits.composition.composition_bytes`) fit the memory budget
    (:func:`qkov.device.memory_budget`) with them, else smaller ones that fit. Refuses (one-line
    :class:`QkovError`) when one row of a full OV circuit and one writer layer do not fit."""
    c, it = source.cfg, item(source)
    V = c.d_vocab
    n = V if rows is None else rows
    offs = resolve_offsets(c, offsets)
    spots = 1 if offs is None else len(offs)
    layer = c.n_heads * c.d_head * c.d_model * it  # one layer's writer factors

    def need(chunk: int, writers: int) -> int:
        copy = copying_bytes(
            source, diag=bool(diag_k), rows=None if rows is None else n, chunk_rows=rows_per_chunk(source, n, V, chunk)
        )
        return max(copy, composition_bytes(source, 3, writer_bytes=writers, offsets=spots))

    least = need(1, layer)
    check_fits(
        least,
        source.device,
        "circuits: scoring copying and composition",
        "skip the own-logit rate (diag_k=0) or measure it on fewer tokens (diag_sample)",
        hint="memory",
    )
    have, _ = memory_budget(source.device)
    chunk, writers = min(max_bytes, CACHE_BYTES), writer_bytes
    if have is None or need(chunk, writers) <= have:
        return max_bytes, writer_bytes
    spare = have - least  # each step runs alone: either may take all of it
    row = V * it
    return min(chunk, row * (1 + spare // (row + V))), min(writers, layer * (1 + spare // layer))
