"""The measures of a series of snapshots: one model's measures per snapshot, and the series read
for [I]'s phase change (the app that finds and loads the snapshots is :mod:`qkov.apps.dynamics`).

:func:`measure` takes one snapshot's weights and a fixed :class:`Sample` (the same tokens for
every snapshot) and returns a flat record: validation loss and per-token losses, the ICL score,
every head's previous-token / prefix-matching / induction / eigenvalue-copying score, the
strongest K-composition pair, and the loss on the first and second copy of repeated random tokens
(:func:`~qkov.analysis.heads.probes.induction_probe`, the probe training logs).

:func:`read_series` reads a list of records (ordered by tokens) with :mod:`qkov.analysis.series.phase`:
the windows where the induction score, the previous-token score and the in-context-learning
improvement rise fastest, the loss bump, and the per-token-loss trajectory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from ...device import check_fits
from ...weights.parts import WeightSource
from ...weights.view import Weights
from . import phase
from ..causal.ablation import Chunks, ablation_budget
from ..circuits.composition import composition_bytes
from ..circuits.copying import copying_bytes
from ..heads.repeated import repeat_bytes
from ..circuits.copying import copying_scores
from ..circuits.composition import DEFAULT_WRITER_BYTES, composition_scores
from ..forward.tiled_nll import pass_nll
from ..forward.tracer import trace
from ..heads.entries import EntryWatch
from ..heads.repeated import repeat_scores
from ..heads.probes import icl_left_out, icl_score, induction_probe, prefix_matching_tokens
from ..circuits.rotary import resolve_offsets

__all__ = [
    "measure",
    "measure_budget",
    "MIN_RISE",
    "PER_TOKEN_SEQUENCES",
    "previous_token_on_text",
    "read_series",
    "Sample",
    "SeriesReading",
    "text_pass",
]

PER_TOKEN_SEQUENCES = 8  # sequences whose per-token losses each record keeps (the trajectory's sample)
# the smallest rise that counts as a change (the phase change of the default 2-layer run:
# induction score 0.01 -> 0.45, previous-token 0.2 -> 0.9, in-context improvement 0 -> 0.13 nats)
MIN_RISE = {"induction": 0.1, "previous_token": 0.1, "icl": 0.05}


@dataclass
class Sample:
    """The tokens every snapshot is measured on: natural ``text [B, T]`` (loss, per-token loss,
    previous-token scores; ``None`` without natural text), ``icl_text [N, T]`` (the ICL score), and
    the seed and start token of the repeated random tokens (drawn, as the report draws them, away
    from the most and least frequent tokens when the training ``frequencies`` are known)."""

    text: Tensor | None
    icl_text: Tensor | None
    bos: int | None = None  # None: the start token of the weights measured
    seed: int = 0
    source: str = ""
    frequencies: np.ndarray | None = None  # training token counts: the repeated tokens avoid the extremes


def _r(x: float, digits: int = 5) -> float:
    return round(float(x), digits)


def _grid(t: Tensor) -> list[list[float]]:
    return [[_r(v, 4) for v in row] for row in t.tolist()]


def measure_budget(w: Weights, sample: Sample) -> Chunks:
    """How :func:`measure` splits its forward passes to fit the memory budget
    (:func:`qkov.device.memory_budget`): the text pass (losses and previous-token scores) and the ICL
    passes as an ablation's (:func:`~qkov.analysis.causal.ablation.ablation_budget`). Refuses (one
    line, before any work) what cannot be split and does not fit: the probes of repeated tokens, the
    copying and K-composition scores."""
    cfg = w.cfg
    text, icl = sample.text, sample.icl_text
    chunks = ablation_budget(w, text, icl, "zero", bos=sample.bos, seed=sample.seed, where="dynamics")
    if cfg.n_layers == 0:
        return chunks
    length = min(25, (cfg.n_ctx - 1) // 4)
    offsets = resolve_offsets(cfg, None)
    need = max(
        repeat_bytes(w, 10, 1 + 4 * length),  # prefix_matching_tokens: 10 examples of 4 repeats
        copying_bytes(w, diag=False, rows=None, chunk_rows=0),
        composition_bytes(w, 1, writer_bytes=DEFAULT_WRITER_BYTES, offsets=1 if offsets is None else len(offsets)),
    )
    what = "dynamics: the repeated-token, copying and composition scores of one snapshot"
    check_fits(need, w.device, what, "analyse a smaller model", hint="memory")
    return chunks


@torch.no_grad()
def measure(w: Weights, sample: Sample) -> dict[str, Any]:
    """Every measure of one snapshot (see the module docstring) as a JSON-ready dict; its forward
    passes split to fit the memory budget (:func:`measure_budget`, checked before any work)."""
    cfg = w.cfg
    chunks = measure_budget(w, sample)
    rec: dict[str, Any] = {"val_loss": None, "per_token_loss": None, "icl": None, "icl_improvement": None}
    previous = None
    if sample.text is not None:  # one pass: the losses, and the previous-token scores of the first sequences
        nll, previous = text_pass(w, sample.text, scored=PER_TOKEN_SEQUENCES, chunk=chunks.text)  # [B, T-1]
        rec["val_loss"] = _r(nll.mean())
        rec["per_token_loss"] = [_r(v, 3) for v in nll[:PER_TOKEN_SEQUENCES].flatten().tolist()]
    if sample.icl_text is not None and icl_left_out(sample.icl_text.shape[1], cfg.n_ctx) is None:
        rec["icl"] = _r(icl_score(w, sample.icl_text, curve=False, chunk=chunks.icl).score)
        # how much better late tokens are predicted than token 50: max(0, -icl). A model that
        # predicts late tokens *worse* (a positive ICL score, as a 1-layer model does mid-training)
        # improves nothing in context: 0, not a negative number whose return to zero would look
        # like in-context learning appearing
        rec["icl_improvement"] = _r(max(0.0, -rec["icl"]))
    probe = induction_probe(w, bos=sample.bos, seed=sample.seed)
    rec["repeat_first"], rec["repeat_second"] = _r(probe.loss_by_copy[0]), _r(probe.loss_by_copy[1])
    if cfg.n_layers == 0:
        rec.update(induction=None, previous_token=None, heads=None, k_composition=None)
        return rec
    # a 1-layer model's heads cannot be induction heads; its best head still gets the same measure
    readers = probe.induction_attention[1:] if cfg.n_layers >= 2 else probe.induction_attention
    rec["induction"] = _r(readers.max())
    length = min(25, (cfg.n_ctx - 1) // 4)
    rep = prefix_matching_tokens(
        w, length=length, seed=sample.seed, bos=sample.bos, frequencies=sample.frequencies
    )
    rs = repeat_scores(w, rep, length)
    heads = {"prefix_matching": rs.prefix_matching, "induction": rs.induction_attention, "copying_rank": rs.copying_rank}
    if previous is not None:
        heads["previous_token"] = previous
    copying = copying_scores(w, diag_k=None).heads
    heads["eigen_copying"] = torch.tensor([c.eigen_score for c in copying]).reshape(cfg.n_layers, cfg.n_heads)
    rec["heads"] = {k: _grid(v.float()) for k, v in heads.items()}
    rec["previous_token"] = _r(heads["previous_token"][0].max()) if "previous_token" in heads else None
    rec["k_composition"] = _strongest_k(w, sample.text) if cfg.n_layers >= 2 else None
    return rec


def text_pass(
    w: WeightSource, text: Tensor, *, scored: int | None = None, chunk: int | None = None, losses: bool = True
) -> tuple[Tensor | None, Tensor]:
    """One forward over ``text [B, T]``, ``chunk`` sequences at a time (default all): the next-token
    losses ``[B, T-1]`` (from the final stream, a tile of logits at a time:
    :func:`~qkov.analysis.forward.tiled_nll.tiled_nll`; ``None`` with ``losses=False``: nothing is unembedded)
    and each head's
    previous-token score on the first ``scored`` sequences (default all), ``[n_layers, n_heads]``
    (float64): the mean over those sequences and queries ``i >= 1`` of ``A[i, i-1]``, read at those
    entries alone from the attention kernel's log-sum-exp
    (:class:`~qkov.analysis.heads.entries.EntryWatch`): no ``[T, T]`` pattern is formed, and the
    attention runs fused. Equal to the recorded patterns' mean to float rounding (tested)."""
    B, T = text.shape
    scored = B if scored is None else min(scored, B)
    chunk = chunk or B
    total = torch.zeros(w.cfg.n_layers, w.cfg.n_heads, dtype=torch.float64, device=w.device)
    queries = torch.arange(1, T)
    rows = 0  # sequences of this chunk that are scored

    def diagonal(layer: int, entries: Tensor) -> None:  # entries [b, H, T-1]
        total[layer] += entries[:rows].double().sum((0, 2))

    watch = EntryWatch(w.cfg.n_layers, queries, queries - 1, diagonal).edits()
    parts = []
    for start in range(0, B, chunk):
        part = text[start : start + chunk]
        rows = max(0, min(len(part), scored - start))
        edits = watch if rows else None
        if not losses and not rows:
            continue
        if losses:  # from the final stream a tile of logits at a time: the [b, T, V] logits are never formed
            parts.append(pass_nll(w, part, edits=edits))
        else:
            trace(w, part, edits=edits, logits=False)
    nll = (parts[0] if len(parts) == 1 else torch.cat(parts)) if losses else None
    return nll, total / (scored * (T - 1))


def previous_token_on_text(w: WeightSource, text: Tensor, *, chunk: int | None = None) -> Tensor:
    """Each head's previous-token score on ``text [B, T]``, ``[n_layers, n_heads]`` (float64): the
    ``previous_token`` of :func:`~qkov.analysis.heads.pattern_scores.text_scores` (to float rounding)
    without its other scores, which dynamics does not read, and without any pattern
    (:func:`text_pass` without its losses)."""
    return text_pass(w, text, chunk=chunk, losses=False)[1]


def _strongest_k(w: Weights, text: Tensor | None) -> dict[str, Any]:
    """The strongest K-composition pair; for a routed model (:mod:`qkov.model.bus`) each pair weighted by how
    much of the writer reaches the reader's input, the mean coefficient over ``text`` (the weights alone
    without a text, as for the plain sum)."""
    routing = text[:PER_TOKEN_SEQUENCES] if w.cfg.residual != "sum" and text is not None else None
    comp = composition_scores(w, "k", routing=routing).kinds["k"]
    top = comp.pairs()[0]
    return {"writer": top["writer"], "reader": top["reader"], "adjusted": _r(top["adjusted"]), "raw": _r(top["raw"])}


@dataclass
class SeriesReading:
    """What a series of records says: windows per metric, the loss bump, the trajectory."""

    windows: dict[str, phase.Window | None]
    bump: phase.Bump | None
    trajectory: phase.Trajectory | None
    together: bool | None  # the previous-token and ICL windows overlap the induction window

    def to_dict(self) -> dict[str, Any]:
        return {
            "windows": {k: None if v is None else v.to_dict() for k, v in self.windows.items()},
            "bump": None if self.bump is None else self.bump.to_dict(),
            "trajectory": None if self.trajectory is None else self.trajectory.to_dict(),
            "together": self.together,
            "method": {"share": phase.SHARE, "sharpness": phase.SHARPNESS, "min_rise": MIN_RISE},
        }


def read_series(records: Sequence[dict[str, Any]], *, until: float | None = None) -> SeriesReading:
    """Read ``records`` (each with ``tokens`` and the fields of :func:`measure`, ordered by tokens);
    ``until``: the loss bump ignores snapshots after these tokens (a learning-rate decay)."""
    t = [r["tokens"] for r in records]

    def series(key: str, sign: float = 1.0) -> list[float | None]:
        return [None if r.get(key) is None else sign * r[key] for r in records]

    windows = {
        "induction": phase.rise_window(t, series("induction"), min_rise=MIN_RISE["induction"]),
        "previous_token": phase.rise_window(t, series("previous_token"), min_rise=MIN_RISE["previous_token"]),
        "icl": phase.rise_window(t, series("icl_improvement"), min_rise=MIN_RISE["icl"]),
    }
    ind = windows["induction"]
    bump = phase.loss_bump(t, series("val_loss"), ind, until=until) if ind is not None else None
    per_token = [r["per_token_loss"] for r in records if r.get("per_token_loss") is not None]
    traj = phase.pca_trajectory(per_token) if len(per_token) == len(records) else None
    together = None
    if ind is not None:
        others = [windows["previous_token"], windows["icl"]]
        together = all(o is not None and o.overlaps(ind) for o in others)
    return SeriesReading(windows, bump, traj, together)

