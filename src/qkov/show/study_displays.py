"""Notebook displays of the studies: a :class:`~qkov.apps.dynamics.DynamicsResult`
(the windows table, the detector curves as static SVG with the window shaded, the ablation line)
and an :class:`~qkov.analysis.causal.ablation.AblationStudy` (its table). Static HTML: nothing to run."""

from __future__ import annotations

import html

from ..analysis.causal.ablation import AblationStudy, Measures
from ..analysis.shown import HTML, register
from ..apps.dynamics import DynamicsResult, svg_dynamics
from .page import page

__all__ = ["ablation_html", "dynamics_html", "NAMES"]

NAMES = {"induction": "induction score", "previous_token": "previous-token score", "icl": "in-context improvement"}


def _table(head: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def _f(v: float | None, spec: str) -> str:
    return "–" if v is None else format(v, spec)


@register(HTML, DynamicsResult)
def dynamics_html(r: DynamicsResult) -> str:
    rows = []
    for key, name in NAMES.items():
        w = r.reading.windows.get(key)
        rows.append(
            [name, "no window"] + ["–"] * 3
            if w is None
            else [name, f"{w.start:,.0f}", f"{w.end:,.0f}", f"{w.rise:.3f}", f"{w.sharpness:.1f}"]
        )
    parts = [
        f"<h3>dynamics of {html.escape(r.description)}: {len(r.snapshots)} snapshots</h3>",
        _table(["metric", f"window start ({r.axis})", "end", "rise", "sharpness"], rows),
    ]
    if r.axis == "tokens":
        parts.append(svg_dynamics(r.to_dict(), title="detectors over training (induction window shaded)"))
    ab = r.ablation
    if ab is not None:
        parts.append(
            f"<p>ablating {html.escape(', '.join(ab.heads))} ({ab.mode}): "
            f"{_f(ab.icl_removed(), '.0%')} of the in-context improvement removed "
            f"(random heads: median {_f(ab.random_icl_removed('median'), '.0%')}, "
            f"mean {_f(ab.random_icl_removed(), '.0%')})</p>"
        )
    return page(f"<div class='qkov-nb'>{''.join(parts)}</div>")


@register(HTML, AblationStudy)
def ablation_html(s: AblationStudy) -> str:
    def row(name: str, m: Measures) -> list[str]:
        return [name, _f(m.loss, ".4f"), _f(m.icl, "+.4f"), _f(m.repeat_first, ".3f"), _f(m.repeat_second, ".3f")]

    rows = [row("intact", s.intact), row("ablated", s.ablated)]
    rows += [row(f"random {', '.join(h)}", m) for h, m in zip(s.random_heads, s.random)]
    head = ["model", "loss", "ICL score", "repeated: 1st copy", "2nd copy"]
    note = f"{_f(s.icl_removed(), '.0%')} of the in-context improvement removed"
    title = f"<h3>ablating {html.escape(', '.join(s.heads))} ({s.mode})</h3>"
    return page(f"<div class='qkov-nb'>{title}{_table(head, rows)}<p>{note}</p></div>")
