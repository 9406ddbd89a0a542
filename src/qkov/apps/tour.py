"""``qkov tour``: train the paper's 0-, 1- and 2-layer attention-only models, report on
each, and set the paper's claims beside what was measured on them.

Each model lives in ``OUT/qkov-<n>l`` (a finished run is reused, an interrupted one is
resumed, a missing one is trained), its report in ``OUT/qkov-<n>l/report``, and the
comparison page in ``OUT/index.html`` (with every number in ``OUT/tour.json``).
:func:`claims` derives the claims table from the reports' data alone, so it can be
checked on any set of reports.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Sequence

from ..device import pick_device
from ..errors import QkovError
from ..io.checkpoint import read_config
from ..model.config import ModelConfig
from ..training.config import TrainConfig
from ..training import rundir, snapshots
from ..training.loop import train
from .outputs import output_folder, read_pair, replace_pair
from .progress import TrainProgress
from .report import write_report
from ..finite import to_json
from .report.render import render_template
from .claims import Claim, claims, head_rows
from .dynamics.study import DYNAMICS_FILES, SCHEMA_VERSION as DYNAMICS_SCHEMA, write_dynamics
from .dynamics.phase import phase_charts, phase_claims
from .report.card import TrainingRecord
from .report.sections import Absent, Report

__all__ = ["earlier_dynamics", "LAYERS", "render_tour", "run_state", "run_tour", "TITLE"]

LAYERS: tuple[int, ...] = (0, 1, 2)


# ------------------------------------------------------------------------- page
TITLE = "qkov tour: the paper's attention-only models, trained here"


def _model_row(n: int, rep: Report) -> dict[str, Any]:
    record = rep.card.record or TrainingRecord()
    rows = head_rows(rep)
    return {
        "layers": n,
        "report": f"qkov-{n}l/report/index.html",
        "parameters": rep.card.parameters,
        "tokens": record.tokens,
        "val_loss": record.val_loss,
        "icl": rep.icl.score,
        "repeat_first": rep.icl.repeat.first_mean,
        "repeat_second": rep.icl.repeat.second_mean,
        "max_prefix_matching": max((r.scores["prefix_matching"] for r in rows), default=None),
        "copying_heads": sum("copying" in r.roles for r in rows),
        "heads": len(rows),
        "wall_s": record.wall_s,
    }


def _page_data(
    models: list[dict[str, Any]],
    table: list[Claim],
    meta: dict[str, Any],
    curves: dict[str, list[float]] | None = None,
    phase: dict[str, Any] | None = None,
    circuit: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What the comparison page shows (its embedded JSON): the model rows, the claims (without
    their values: those are in ``tour.json``), the run's facts, the loss-by-position curves, the
    phase-change charts (:func:`~qkov.apps.dynamics.phase.phase_charts`) and the 2-layer report's circuit
    section (``None``: no 2-layer model)."""
    return {
        "models": models,
        "claims": [{"claim": c.claim, "measured": c.measured, "holds": c.holds, "rule": c.rule} for c in table],
        "meta": meta,
        "curves": curves or {},
        "phase": phase or {"icl_top": 0.2, "runs": []},
        "circuit": circuit,
    }


def render_tour(
    models: list[dict[str, Any]],
    table: list[Claim],
    meta: dict[str, Any],
    curves: dict[str, list[float]] | None = None,
    phase: dict[str, Any] | None = None,
    circuit: dict[str, Any] | None = None,
) -> str:
    """The comparison page: the models side by side (each linking to its report), the models' loss
    by token position, the phase-change charts (linking to the dynamics pages), the 2-layer model's induction
    circuit found from behaviour (its graph, faithfulness curve, CPR and CMD) and the claims table.
    Drawn as the report is (:func:`~qkov.apps.report.render.render_template`): its stylesheet, its
    script library and plotly.js, the data of :func:`_page_data` embedded; opens with no network."""
    data = _page_data(models, table, meta, curves, phase, circuit)
    return render_template("tour.html", data, ("report.js", "tour.js"), TITLE)


# --------------------------------------------------------------------------- run
def run_state(ckpt: Path, what: str = "tour") -> str:
    """Where the run in ``ckpt`` stands: ``done``, ``partial`` (resumable) or ``new`` (nothing there, or a start that never wrote a state)."""
    kind = rundir.inspect(ckpt)
    if kind in ("resumable", "checkpoint") and (ckpt / "config.json").is_file():
        tr = read_config(ckpt).get("training", {})
        if tr.get("step") is not None and tr.get("step") == tr.get("config", {}).get("steps"):
            return "done"
    if kind == "resumable":
        return "partial"
    if kind in ("free", "restartable"):
        return "new"
    raise QkovError(f"{what}: {str(ckpt)!r} holds neither a finished nor a resumable qkov run; move it away", hint="out")


def earlier_dynamics(ckpt: Path) -> dict[str, Any] | None:
    """The dynamics a previous tour wrote for exactly the snapshots ``ckpt`` holds now, if any."""
    try:
        # a write killed between its two files is finished first; a mixed pair is not read
        data = read_pair(ckpt / "dynamics", DYNAMICS_FILES, "dynamics.json")
        labels = [s["label"] for s in data["snapshots"]]
    except (OSError, ValueError, KeyError, TypeError, QkovError):
        return None
    now = [f"step {step}" for step, _ in snapshots.listing(ckpt)]
    return data if labels == now and data.get("schema_version") == DYNAMICS_SCHEMA else None


def _dynamics(out: Path, layers: list[int], dev: Any, say: Callable[[str], None]) -> dict[int, dict[str, Any]]:
    """``qkov dynamics`` of each run that kept snapshots, written to ``qkov-<n>l/dynamics``."""
    found: dict[int, dict[str, Any]] = {}
    for n in layers:
        ckpt = out / f"qkov-{n}l"
        if not (ckpt / "snapshots").is_dir():
            say(f"[{n}-layer] no snapshots (a run trained before qkov kept them): no dynamics")
            continue
        earlier = earlier_dynamics(ckpt)
        if earlier is not None:
            say(f"[{n}-layer] reusing the dynamics of these snapshots in {ckpt / 'dynamics'}")
            found[n] = earlier
            continue
        t0 = time.perf_counter()
        found[n] = write_dynamics(ckpt / "dynamics", [ckpt], device=str(dev)).to_dict()
        say(f"[{n}-layer] dynamics -> {ckpt / 'dynamics' / 'index.html'} in {time.perf_counter() - t0:.0f} s")
    return found


def run_tour(
    out: Path | str,
    *,
    layers: Sequence[int] = LAYERS,
    device: str = "auto",
    steps: int | None = None,
    corpus: str | None = None,
    quiet: bool = False,
    say: Callable[[str], None] = print,
) -> tuple[list[Claim], list[dict[str, Any]]]:
    """Train (or reuse) one model per entry of ``layers`` in ``out``, report on each, write the
    comparison page; return the claims table and the per-model summary rows."""
    out = Path(out)
    with output_folder(out, ("index.html", "tour.json"), overwrite=False, what="tour"):
        pass  # checked before hours of training, not after
    dev = pick_device(device)
    t0 = time.perf_counter()
    reports: dict[int, Report] = {}
    train_over: dict[str, Any] = {}
    if steps is not None:
        train_over["steps"] = steps
    if corpus is not None:
        train_over["corpus"] = corpus
    for n in layers:
        ckpt = out / f"qkov-{n}l"
        state = run_state(ckpt)
        if state == "done":
            say(f"[{n}-layer] reusing the finished run in {ckpt}")
        else:
            say(f"[{n}-layer] {'resuming' if state == 'partial' else 'training'} in {ckpt}")
            with TrainProgress(quiet=quiet) as progress:
                if state == "partial":
                    train(ckpt, device=str(dev), resume=True, callback=progress.event, progress=progress)
                else:
                    train(
                        ckpt, ModelConfig(n_layers=n), TrainConfig(**train_over), device=str(dev),
                        callback=progress.event, progress=progress,
                    )
        say(f"[{n}-layer] report -> {ckpt / 'report' / 'index.html'}")
        t_rep = time.perf_counter()
        reports[n] = write_report(ckpt, ckpt / "report", device=str(dev))
        say(f"[{n}-layer] report written in {time.perf_counter() - t_rep:.0f} s")
    dyn = _dynamics(out, [n for n in layers if n >= 1], dev, say)
    table = claims(reports) + phase_claims(dyn.get(2), dyn.get(1))
    models = [_model_row(n, reports[n]) for n in layers]
    meta = {
        "device": str(dev),
        "corpus": (reports[layers[0]].card.record or TrainingRecord()).corpus if layers else None,
        "seconds": time.perf_counter() - t0,
    }
    curves = {f"{n}-layer": reports[n].icl.loss_by_position or [] for n in layers}
    summary = {n: {"reading": d["reading"], "ablation": d["ablation"]} for n, d in dyn.items()}
    body = {"models": models, "claims": [c.to_dict() for c in table], "dynamics": summary, **meta}
    two = reports[2].circuit if 2 in reports else None
    circuit = None if two is None or isinstance(two, Absent) else two.to_dict()
    page = render_tour(models, table, meta, curves, phase_charts(dyn), circuit)
    replace_pair(out, {"index.html": page, "tour.json": to_json(body, indent=1)}, overwrite=False, what="tour")
    return table, models

