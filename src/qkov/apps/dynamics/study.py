"""The dynamics study behind ``qkov dynamics``: find and load every snapshot of a series, measure
each (:mod:`qkov.analysis.series.measures`), read the phase change, ablate its heads.

:func:`dynamics` returns a :class:`DynamicsResult` (``to_dict()`` is its JSON); :func:`write_dynamics`
also writes that JSON beside an offline HTML page. Under ``torchrun`` the snapshots are split over
the ranks (rank ``r`` measures snapshots ``r, r + world, ...``), rank 0 gathers the records, reads
the series, ablates and writes, and every rank returns the result, which equals one process's.
"""

from __future__ import annotations

import time
from datetime import timedelta
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ...analysis.causal import ablation as Ab
from ...analysis.causal.ablation import AblationStudy
from ...analysis.budget import Planned
from ...analysis.series.measures import Sample, SeriesReading, measure, measure_budget, read_series
from ...analysis.heads.report import THRESHOLDS
from ...analysis.shown import TEXT, Shown, register
from ...device import pick_device
from ...errors import QkovError
from ...finite import to_json
from ...expect import expect_paths
from ...model.config import ModelConfig
from ...model.transformer import Transformer
from ...progress import Progress
from ...ranks import Ranks
from ...training import distributed
from ...version import __version__
from ...weights.view import Weights
from .page import render_dynamics
from ..inputs import sample_for
from ..outputs import output_folder, replace_pair
from .series import Series, series

__all__ = [
    "dynamics",
    "DYNAMICS_FILES",
    "dynamics_text",
    "DynamicsResult",
    "induction_heads",
    "measure_series",
    "SCHEMA_VERSION",
    "SHARE_TIMEOUT",
    "write_dynamics",
]

SCHEMA_VERSION = 1
DYNAMICS_FILES = ("index.html", "dynamics.json")
SHARE_TIMEOUT = timedelta(hours=6)  # how long the other ranks wait for rank 0's reading and ablation


@dataclass(repr=False)
class DynamicsResult(Shown):
    """What :func:`dynamics` returns: the series' records and what they say. ``to_dict()`` is the JSON
    (``dynamics.json``, ``qkov dynamics --json``); the result prints as a short summary and draws
    itself in a notebook (:mod:`qkov.show`)."""

    sources: list[str]  # the sources as given (and "revisions: ..." when revisions were named)
    model: ModelConfig  # the architecture every snapshot shares
    axis: str  # "tokens" or "steps": what the records' ``at`` counts
    sample: str  # the tokens every snapshot was measured on, in words
    left_out: dict[str, str]  # measure -> why it is null in every record
    snapshots: list[dict[str, Any]]  # one record per snapshot, in training order (:func:`measure`'s fields)
    reading: SeriesReading  # the windows, the loss bump, the trajectory
    induction_heads: list[str]  # the last snapshot's induction heads, "layer.head"
    ablation: AblationStudy | None  # ablating those heads in the last snapshot (None without any)
    timings: dict[str, float] = field(default_factory=dict)  # "measure_s", "total_s"
    schema_version: int = SCHEMA_VERSION
    generator: str = f"qkov {__version__}"

    @property
    def description(self) -> str:
        """The architecture in words (``model.describe()``)."""
        return self.model.describe()

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (the keys and order of ``dynamics.json``)."""
        return {
            "schema_version": self.schema_version,
            "generator": self.generator,
            "sources": list(self.sources),
            "model": self.model.to_dict(),
            "description": self.description,
            "axis": self.axis,
            "sample": self.sample,
            "left_out": self.left_out,
            "snapshots": self.snapshots,
            "reading": self.reading.to_dict(),
            "induction_heads": list(self.induction_heads),
            "ablation": None if self.ablation is None else self.ablation.to_dict(),
            "timings": self.timings,
        }


def _pct(v: float | None) -> str:
    return "-" if v is None else format(v, ".0%")


@register(TEXT, DynamicsResult)
def dynamics_text(r: DynamicsResult) -> str:
    lines = [f"dynamics of {r.description}: {len(r.snapshots)} snapshots ({r.axis}); {r.sample}"]
    for key, name in (("induction", "induction"), ("previous_token", "previous-token"), ("icl", "in-context")):
        w = r.reading.windows.get(key)
        where = "no window" if w is None else f"{w.start:,.0f} - {w.end:,.0f} (rise {w.rise:.3f})"
        lines.append(f"  {name:15s} window: {where}")
    ab = r.ablation
    if ab is not None and ab.icl_removed() is not None:
        lines.append(
            f"  ablating {', '.join(ab.heads)} ({ab.mode}) removes {_pct(ab.icl_removed())} of the in-context "
            f"improvement; random heads {_pct(ab.random_icl_removed('median'))} (median), "
            f"{_pct(ab.random_icl_removed())} (mean)"
        )
    return "\n".join(lines)


def _load(s: Series, i: int, device: torch.device) -> Transformer:
    model = s.load(s.entries[i])
    if model.cfg != s.cfg:
        raise QkovError(
            f"dynamics: {s.entries[i].label} is a different architecture ({model.cfg.describe()}) from the series "
            f"({s.cfg.describe()})"
        )
    return model.to(device)


def _record(s: Series, i: int, sample: Sample, device: torch.device) -> dict[str, Any]:
    e = s.entries[i]
    t0 = time.perf_counter()
    rec = {"label": e.label, "step": e.step, "tokens": e.tokens, "at": s.position(e)}
    rec.update(measure(Weights.from_model(_load(s, i, device)), sample))
    rec["seconds"] = round(time.perf_counter() - t0, 3)
    return rec


def measure_series(
    s: Series, sample: Sample, device: torch.device, info: Ranks, progress: Progress | None = None
) -> list[dict[str, Any]] | None:
    """Every entry's record, in order, on rank 0 (``None`` on the other ranks)."""
    mine = list(range(info.rank, len(s.entries), info.world))
    out: dict[int, dict[str, Any]] = {}
    for n, i in enumerate(mine):
        out[i] = _record(s, i, sample, device)
        if progress is not None and info.main:  # rank 0 speaks for all: the ranks advance together
            progress("dynamics: snapshots", min(len(s.entries), (n + 1) * info.world), len(s.entries))
    if not info.enabled:
        return [out[i] for i in range(len(s.entries))]
    gathered: list[Any] = [None] * info.world if info.main else []
    dist.gather_object(out, gathered if info.main else None, dst=0)
    if not info.main:
        return None
    merged = {k: v for part in gathered for k, v in part.items()}
    return [merged[i] for i in range(len(s.entries))]


def induction_heads(record: dict[str, Any], thresholds: dict[str, float] = THRESHOLDS) -> list[tuple[int, int]]:
    """The heads of layers >= 1 that the report's rule calls induction heads (prefix matching above
    ``thresholds["induction"]`` and rank copying above ``thresholds["induction_copying"]``)."""
    heads = record.get("heads") or {}
    pm, cr = heads.get("prefix_matching"), heads.get("copying_rank")
    if not pm or len(pm) < 2:
        return []
    return [
        (l, h)
        for l in range(1, len(pm))
        for h in range(len(pm[l]))
        if pm[l][h] > thresholds["induction"] and cr[l][h] > thresholds["induction_copying"]
    ]


def _until(s: Series) -> float | None:
    """Tokens where a wsd run's learning-rate decay starts (the loss bends there for another reason)."""
    tr = s.training
    if s.axis != "tokens" or tr.get("schedule", "wsd") != "wsd" or "steps" not in tr:
        return None
    start = int(tr["steps"] * (1 - tr.get("decay_frac", 0.2)))
    e = s.entries[-1]
    per_step = (e.tokens or 0) / e.step if e.step else None
    return None if per_step is None else start * per_step


def dynamics(
    sources: Sequence[str | Path],
    *,
    revisions: Sequence[str] | None = None,
    tokens_per_step: int | None = None,
    text: Path | None = None,
    tokens: Path | None = None,
    mode: str = "mean",
    draws: int = 5,
    seed: int = 0,
    device: str = "auto",
    progress: Progress | None = None,
) -> DynamicsResult:
    """Measure and read the series ``sources`` name (:func:`qkov.apps.dynamics.series.series`). ``mode``/``draws``:
    the ablation of the last snapshot's induction heads (``"mean"`` or ``"zero"``; random sets of as
    many heads). Under torchrun every rank returns the same result: rank 0 reads the gathered records,
    ablates, and sends the result to the others."""
    expect_paths("qkov.dynamics", sources)
    if mode not in Ab.MODES:
        raise QkovError(f"dynamics: mode must be one of {', '.join(Ab.MODES)}, got {mode!r}")
    t0 = time.perf_counter()
    s = series(sources, revisions=revisions, tokens_per_step=tokens_per_step)
    joined = distributed.joining()  # a group a script joined itself stays joined
    info, dev = distributed.setup(pick_device(device))
    try:
        # the result travels over its own CPU group, whose timeout allows for rank 0's ablation
        share = dist.new_group(backend="gloo", timeout=SHARE_TIMEOUT) if info.enabled else None
        last = _load(s, len(s.entries) - 1, dev)
        sample = sample_for(s.origin, last, text=text, tokens=tokens, seed=seed)
        sample = Sample(*(x.to(dev) if isinstance(x, torch.Tensor) else x for x in vars(sample).values()))
        planned = Planned(s.cfg, torch.float32, dev)  # every snapshot's view: refused before the first if it cannot fit
        measure_budget(planned, sample)  # type: ignore[arg-type]
        Ab.ablation_budget(planned, sample.text, sample.icl_text, mode, bos=sample.bos, seed=seed, where="dynamics")  # type: ignore[arg-type]
        records = measure_series(s, sample, dev, info, progress)
        result = None
        if records is not None:
            sources_ = [str(x) for x in sources] + ([f"revisions: {', '.join(revisions)}"] if revisions else [])
            result = _study(s, sources_, records, last, sample, mode=mode, draws=draws, seed=seed, t0=t0)
        if share is not None:
            box = [result]
            dist.broadcast_object_list(box, src=0, group=share)
            result = box[0]
    finally:
        if joined:
            distributed.teardown(info)
    assert result is not None
    return result


def _study(
    s: Series,
    sources: list[str],
    records: list[dict[str, Any]],
    last: Transformer,
    sample: Sample,
    *,
    mode: str,
    draws: int,
    seed: int,
    t0: float,
) -> DynamicsResult:
    """Read the series' records and ablate the last snapshot's induction heads (rank 0's part)."""
    t_measure = time.perf_counter() - t0
    reading = read_series(records, until=_until(s))
    study = None
    heads = induction_heads(records[-1])
    if heads:
        w = Weights.from_model(last)
        study = Ab.ablation_study(
            w, sample.text, heads, icl_text=sample.icl_text, mode=mode, draws=draws, bos=sample.bos, seed=seed
        )
    return DynamicsResult(
        sources=sources,
        model=s.cfg,
        axis=s.axis,
        sample=sample.source,
        left_out=Ab.measures_left_out(s.cfg.n_ctx, sample.text, sample.icl_text),
        snapshots=records,
        reading=reading,
        induction_heads=[f"{l}.{h}" for l, h in heads],
        ablation=study,
        timings={"measure_s": round(t_measure, 2), "total_s": round(time.perf_counter() - t0, 2)},
    )


def write_dynamics(
    out: Path, sources: Sequence[str | Path], *, overwrite: bool = False, **options: Any
) -> DynamicsResult:
    """Check ``out`` first (as the report does), run :func:`dynamics`, write ``out/dynamics.json`` and
    the page ``out/index.html`` (as one pair, :func:`~qkov.apps.outputs.replace_pair`; rank 0 only).
    Returns the result (on every rank under torchrun)."""
    if not Ranks.from_env().main:
        return dynamics(sources, **options)
    with output_folder(out, DYNAMICS_FILES, overwrite=overwrite, what="dynamics") as folder:
        result = dynamics(sources, **options)
        data = result.to_dict()
        files = {"index.html": render_dynamics(data), "dynamics.json": to_json(data, indent=1)}
        replace_pair(folder, files, overwrite=overwrite, what="dynamics")
    return result
