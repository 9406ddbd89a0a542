"""The dynamics study behind ``qkov dynamics``: find and load every snapshot of a series, measure
each (:mod:`qkov.analysis.snapshot_measures`), read the phase change, ablate its heads.

:func:`dynamics` returns one JSON-ready dict; :func:`write_dynamics` also writes it beside an
offline HTML page. Under ``torchrun`` the snapshots are split over the ranks (rank ``r`` measures
snapshots ``r, r + world, ...``) and rank 0 gathers the records, reads the series and writes:
the result equals one process's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..analysis import ablation as Ab
from ..analysis.budget import Planned
from ..analysis.snapshot_measures import Sample, measure, measure_budget, read_series
from ..analysis.heads import THRESHOLDS
from ..analysis.probes import default_icl_examples
from ..analysis.shown import TEXT, Shown, register
from ..device import pick_device
from ..errors import QkovError
from ..expect import expect_paths
from ..model.transformer import Transformer
from ..progress import Progress
from ..training import distributed
from ..version import __version__
from ..weights.view import Weights
from .dynamics_page import render_dynamics
from .inputs import analysis_inputs
from .outputs import output_folder, replace_pair
from .report.render import to_json
from .series import Series, series

SCHEMA_VERSION = 1
DYNAMICS_FILES = ("index.html", "dynamics.json")
TEXT_SEQUENCES = 16  # validation sequences for the loss, per-token losses and previous-token scores


class DynamicsResult(Shown, dict):
    """What :func:`dynamics` returns: the JSON-ready dict (its keys are documented there), which
    prints as a short summary and draws itself in a notebook (:mod:`qkov.show`)."""


@register(TEXT, DynamicsResult)
def dynamics_text(r: DynamicsResult) -> str:
    lines = [f"dynamics of {r['description']}: {len(r['snapshots'])} snapshots ({r['axis']}); {r['sample']}"]
    for key, name in (("induction", "induction"), ("previous_token", "previous-token"), ("icl", "in-context")):
        w = r["reading"]["windows"][key]
        where = "no window" if w is None else f"{w['start']:,.0f} - {w['end']:,.0f} (rise {w['rise']:.3f})"
        lines.append(f"  {name:15s} window: {where}")
    ab = r.get("ablation")
    if ab is not None and ab["icl_removed"] is not None:
        pct = lambda v: "-" if v is None else format(v, ".0%")  # noqa: E731
        lines.append(
            f"  ablating {', '.join(ab['heads'])} ({ab['mode']}) removes {pct(ab['icl_removed'])} of the in-context "
            f"improvement; random heads {pct(ab.get('random_icl_removed_median'))} (median), "
            f"{pct(ab['random_icl_removed'])} (mean)"
        )
    return "\n".join(lines)


def sample_for(origin: Path, model: Transformer, *, text: Path | None, tokens: Path | None, seed: int) -> Sample:
    """The fixed tokens ``model`` (loaded from ``origin``) is measured on: the validation text of
    the corpus ``origin`` records (or a given text / token file); with none, seeded random tokens,
    on which loss, ICL and previous-token scores are left out. Serves dynamics and ablate."""
    n_icl = default_icl_examples(model.cfg)
    inp = analysis_inputs(
        origin, model, text=text, tokens=tokens, batch=max(TEXT_SEQUENCES, n_icl), want_corpus=True, seed=seed
    )
    bos, freqs = model.bos_token_id, inp.frequencies
    if not inp.natural:
        return Sample(None, None, bos, seed, inp.source + " (loss, ICL and previous-token left out)", freqs)
    ids = inp.tokens
    return Sample(ids[:TEXT_SEQUENCES], ids[:n_icl], bos, seed, inp.source, freqs)


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
    s: Series, sample: Sample, device: torch.device, info: distributed.DistInfo, progress: Progress | None = None
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
) -> DynamicsResult | None:
    """Measure and read the series ``sources`` name (:func:`qkov.apps.series.series`); returns the
    result on rank 0 (``None`` on other ranks under torchrun). ``mode``/``draws``: the ablation
    of the last snapshot's induction heads (``"mean"`` or ``"zero"``; random sets of as many heads)."""
    expect_paths("qkov.dynamics", sources)
    if mode not in Ab.MODES:
        raise QkovError(f"dynamics: mode must be one of {', '.join(Ab.MODES)}, got {mode!r}")
    t0 = time.perf_counter()
    s = series(sources, revisions=revisions, tokens_per_step=tokens_per_step)
    info, dev = distributed.setup(pick_device(device))
    try:
        last = _load(s, len(s.entries) - 1, dev)
        sample = sample_for(s.origin, last, text=text, tokens=tokens, seed=seed)
        sample = Sample(*(x.to(dev) if isinstance(x, torch.Tensor) else x for x in vars(sample).values()))
        planned = Planned(s.cfg, torch.float32, dev)  # every snapshot's view: refused before the first if it cannot fit
        measure_budget(planned, sample)  # type: ignore[arg-type]
        Ab.ablation_budget(planned, sample.text, sample.icl_text, mode, bos=sample.bos, seed=seed, where="dynamics")  # type: ignore[arg-type]
        records = measure_series(s, sample, dev, info, progress)
    finally:
        distributed.teardown(info)
    if records is None:
        return None
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
        {
            "schema_version": SCHEMA_VERSION,
            "generator": f"qkov {__version__}",
            "sources": [str(x) for x in sources] + ([f"revisions: {', '.join(revisions)}"] if revisions else []),
            "model": s.cfg.to_dict(),
            "description": s.cfg.describe(),
            "axis": s.axis,
            "sample": sample.source,
            "left_out": Ab.measures_left_out(s.cfg.n_ctx, sample.text, sample.icl_text),  # measure -> why it is null
            "snapshots": records,
            "reading": reading.to_dict(),
            "induction_heads": [f"{l}.{h}" for l, h in heads],
            "ablation": None if study is None else study.to_dict(),
            "timings": {"measure_s": round(t_measure, 2), "total_s": round(time.perf_counter() - t0, 2)},
        }
    )


def write_dynamics(out: Path, sources: Sequence[str | Path], *, overwrite: bool = False, **options: Any) -> Any:
    """Check ``out`` first (as the report does), run :func:`dynamics`, write ``out/dynamics.json`` and
    the page ``out/index.html`` (as one pair, :func:`~qkov.apps.outputs.replace_pair`; rank 0 only).
    Returns the result (``None`` off rank 0)."""
    if not distributed.from_env().main:
        return dynamics(sources, **options)
    with output_folder(out, DYNAMICS_FILES, overwrite=overwrite, what="dynamics") as folder:
        result = dynamics(sources, **options)
        if result is not None:
            files = {"index.html": render_dynamics(result), "dynamics.json": to_json(result, indent=1)}
            replace_pair(folder, files, overwrite=overwrite, what="dynamics")
    return result
