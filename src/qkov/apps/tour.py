"""``qkov tour``: train the paper's 0-, 1- and 2-layer attention-only models, report on
each, and set the paper's claims beside what was measured on them.

Each model lives in ``OUT/qkov-<n>l`` (a finished run is reused, an interrupted one is
resumed, a missing one is trained), its report in ``OUT/qkov-<n>l/report``, and the
comparison page in ``OUT/index.html`` (with every number in ``OUT/tour.json``).
:func:`claims` derives the claims table from the reports' data alone, so it can be
checked on any set of reports.
"""

from __future__ import annotations

import html
import json
import math
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
from ..version import __version__
from .outputs import output_folder, replace_pair, settle
from .progress import TrainProgress
from .report import write_report
from .report.render import to_json
from .claims import Claim, claims, head_rows
from .dynamics import SCHEMA_VERSION as DYNAMICS_SCHEMA
from .dynamics import DYNAMICS_FILES, write_dynamics
from .phase_section import phase_claims, phase_html
from .report.sections import Report, TrainingRecord

LAYERS: tuple[int, ...] = (0, 1, 2)


# ------------------------------------------------------------------------- page
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


def _cell(v: Any, spec: str = "") -> str:
    if v is None:
        return "–"
    return html.escape(format(v, spec) if spec else str(v))


def svg_curves(series: dict[str, list[float]], *, title: str, width: int = 640, height: int = 320) -> str:
    """A small static line chart (log x axis: token index 1..n; y: loss) as inline SVG."""
    colors = ("#8a8f99", "#3056d3", "#d3562f", "#2a9d5b", "#9b59b6")
    pts = {k: v for k, v in series.items() if v}
    if not pts:
        return ""
    ys = [y for v in pts.values() for y in v if y is not None]
    lo, hi = min(ys), max(ys)
    n = max(len(v) for v in pts.values())
    L, R, T, B = 50, 130, 30, 40
    fx = lambda i: L + (width - L - R) * math.log(i + 1) / math.log(n)  # noqa: E731
    fy = lambda y: T + (height - T - B) * (hi - y) / ((hi - lo) or 1.0)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-size="12">']
    parts.append(f'<text x="{width / 2 - R / 2}" y="18" text-anchor="middle">{html.escape(title)}</text>')
    parts.append(f'<line x1="{L}" y1="{height - B}" x2="{width - R}" y2="{height - B}" stroke="#999"/>')
    parts.append(f'<line x1="{L}" y1="{T}" x2="{L}" y2="{height - B}" stroke="#999"/>')
    for tick in (1, 10, 100, 1000):
        if tick <= n:
            x = fx(tick - 1)
            parts.append(f'<text x="{x:.1f}" y="{height - B + 15}" text-anchor="middle">{tick}</text>')
    for frac in (0.0, 0.5, 1.0):
        y = lo + frac * (hi - lo)
        parts.append(f'<text x="{L - 6}" y="{fy(y) + 4:.1f}" text-anchor="end">{y:.1f}</text>')
    parts.append(f'<text x="{(L + width - R) / 2}" y="{height - 6}" text-anchor="middle">token index</text>')
    for k, (name, v) in enumerate(pts.items()):
        c = colors[k % len(colors)]
        d = " ".join(f"{fx(i):.1f},{fy(y):.1f}" for i, y in enumerate(v) if y is not None)
        parts.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.5" points="{d}"/>')
        parts.append(f'<text x="{width - R + 8}" y="{T + 16 * k + 10}" fill="{c}">{html.escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def render_page(
    models: list[dict[str, Any]],
    table: list[Claim],
    meta: dict[str, Any],
    curves: dict[str, list[float]] | None = None,
    phase: str = "",
) -> str:
    """The comparison page: the models side by side, the claims table, the models' loss by
    token position and the phase-change curves (static SVG), links to each report."""
    verdict = {True: "agrees", False: "differs", None: "compare"}
    model_rows = "\n".join(
        f"<tr><td><a href='{html.escape(m['report'])}'>{m['layers']}-layer</a></td>"
        f"<td>{_cell(m['parameters'], ',')}</td><td>{_cell(m['tokens'], ',')}</td>"
        f"<td>{_cell(m['val_loss'], '.4f')}</td><td>{_cell(m['icl'], '+.3f')}</td>"
        f"<td>{_cell(m['repeat_first'], '.2f')} / {_cell(m['repeat_second'], '.2f')}</td>"
        f"<td>{_cell(m['max_prefix_matching'], '.3f')}</td>"
        f"<td>{m['copying_heads']} / {m['heads']}</td><td>{_cell(m['wall_s'], '.0f')}</td></tr>"
        for m in models
    )
    claim_rows = "\n".join(
        f"<tr><td class='l'>{html.escape(c.claim)}</td><td class='l'>{html.escape(c.measured)}</td>"
        f"<td class='{verdict[c.holds]}'>{verdict[c.holds]}</td><td class='l rule'>{html.escape(c.rule)}</td></tr>"
        for c in table
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="generator" content="qkov {__version__}"><title>qkov tour</title>
<style>
body {{ font: 14px/1.45 system-ui, sans-serif; margin: 24px 32px; color: #1d2330; max-width: 1300px; }}
table {{ border-collapse: collapse; margin: 8px 0 20px; }}
th, td {{ border-bottom: 1px solid #d9dde5; padding: 4px 10px; text-align: right; vertical-align: top; }}
th {{ background: #f2f4f8; }} td.l, th.l {{ text-align: left; max-width: 620px; }}
td:first-child {{ white-space: nowrap; }}
td.agrees {{ color: #1a7f37; font-weight: 600; }} td.differs {{ color: #b00020; font-weight: 600; }}
td.compare {{ color: #5b6475; }} .note {{ color: #5b6475; max-width: 900px; }}
</style></head><body>
<h1>qkov tour: the paper's attention-only models, trained here</h1>
<p class="note">Trained on {html.escape(str(meta.get("corpus", "the built-in corpus")))} with qkov's default
settings on {html.escape(str(meta.get("device", "")))}; this run of the tour took {meta.get("seconds", 0):.0f} s
(models already trained in its directory are reused; training times are in the table). Each model links to its full
report. Numbers are in <code>tour.json</code>.</p>
<h2>Models</h2>
<table><tr><th>model</th><th>parameters</th><th>tokens</th><th>validation loss</th><th>ICL score (nats)</th>
<th>repeated tokens: loss 1st / 2nd copy</th><th>max prefix matching</th><th>copying heads</th><th>training s</th></tr>
{model_rows}
</table>
<h2>Loss by token position</h2>
<p class="note">Mean loss on validation text at each token index: models with induction heads keep improving
late in the context (the in-context-learning score is the drop from token 50 to the last tokens).</p>
{svg_curves(curves or {}, title="validation loss by token position")}
<h2>The phase change</h2>
<p class="note">Every snapshot the runs kept, measured on the same tokens (<code>qkov dynamics</code>): the
best induction score and the best previous-token score of layer 0 (attention, 0 to 1) and the in-context
improvement (max(0, minus the ICL score), in nats, one scale for both charts); the shaded band is the window
where the induction score rises fastest.</p>
{phase or "<p class='note'>No snapshots: the runs kept none.</p>"}
<h2>The paper's claims, measured here</h2>
<table><tr><th class="l">claim (paper)</th><th class="l">measured here</th><th></th>
<th class="l">verdict rule (against the paper's number)</th></tr>
{claim_rows}
</table>
</body></html>
"""


# --------------------------------------------------------------------------- run
def _state(ckpt: Path) -> str:
    """``done``, ``partial`` (resumable) or ``new`` (nothing there, or a start that never wrote a state)."""
    kind = rundir.inspect(ckpt)
    if kind in ("resumable", "checkpoint") and (ckpt / "config.json").is_file():
        tr = read_config(ckpt).get("training", {})
        if tr.get("step") is not None and tr.get("step") == tr.get("config", {}).get("steps"):
            return "done"
    if kind == "resumable":
        return "partial"
    if kind in ("free", "restartable"):
        return "new"
    raise QkovError(f"tour: {str(ckpt)!r} holds neither a finished nor a resumable qkov run; move it away", hint="out")


def _earlier_dynamics(ckpt: Path) -> dict[str, Any] | None:
    """The dynamics a previous tour wrote for exactly the snapshots ``ckpt`` holds now, if any."""
    try:
        settle(ckpt / "dynamics", DYNAMICS_FILES)  # a write killed between its two files is finished first
        data = json.loads((ckpt / "dynamics" / "dynamics.json").read_text())
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
        earlier = _earlier_dynamics(ckpt)
        if earlier is not None:
            say(f"[{n}-layer] reusing the dynamics of these snapshots in {ckpt / 'dynamics'}")
            found[n] = earlier
            continue
        t0 = time.perf_counter()
        found[n] = write_dynamics(ckpt / "dynamics", [ckpt], device=str(dev))
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
        state = _state(ckpt)
        if state == "done":
            say(f"[{n}-layer] reusing the finished run in {ckpt}")
        else:
            say(f"[{n}-layer] {'resuming' if state == 'partial' else 'training'} in {ckpt}")
            with TrainProgress(quiet=quiet) as progress:
                if state == "partial":
                    train(ckpt, device=str(dev), resume=True, callback=progress)
                else:
                    train(ckpt, ModelConfig(n_layers=n), TrainConfig(**train_over), device=str(dev), callback=progress)
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
    page = render_page(models, table, meta, curves, phase_html(dyn))
    replace_pair(out, {"index.html": page, "tour.json": to_json(body, indent=1)}, overwrite=False, what="tour")
    return table, models
