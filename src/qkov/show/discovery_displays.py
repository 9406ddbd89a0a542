"""Notebook displays of circuit discovery: a :class:`~qkov.analysis.discovery.CircuitDiscovery` (the circuit
drawn as a graph, its faithfulness curve, its edges), :class:`~qkov.analysis.discovery.EdgeScores` (the top
edges) and a :class:`~qkov.analysis.discovery.FaithfulnessCurve`. Static HTML and SVG: nothing to run.

The drawing is the circuit's layout (:mod:`qkov.analysis.discovery.layout`: nodes by where they sit in the
forward pass, the input at the bottom and the logits at the top; edge width by ``|score|``; queries blue,
keys green, values orange, MLPs and the logits grey). Hovering an edge shows its name and score.
"""

from __future__ import annotations

import html
import math

from ..analysis.discovery.discover import CircuitDiscovery
from ..analysis.discovery.faithfulness import FaithfulnessCurve
from ..analysis.discovery.graph import Graph
from ..analysis.discovery.layout import CircuitLayout, circuit_layout, drawn_edges
from ..analysis.discovery.scores import EdgeScores
from ..analysis.shown import HTML, register
from .page import page

__all__ = ["circuit_svg", "curve_html", "curve_svg", "discovery_html", "edge_scores_html", "layout_svg"]


def _table(head: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def layout_svg(lay: CircuitLayout) -> str:
    """An SVG of a circuit's layout (:func:`~qkov.analysis.discovery.layout.circuit_layout`); each edge's
    line carries its edge number (``data-edge``)."""
    parts = []
    for e in lay.edges:
        title = html.escape(f"{e['name']}: {e['score']:+.4g}")
        parts.append(
            f'<line x1="{e["x1"]}" y1="{e["y1"]}" x2="{e["x2"]}" y2="{e["y2"]}" stroke="{e["colour"]}" '
            f'stroke-width="{e["width"]}" stroke-opacity="0.8" data-edge="{e["edge"]}"><title>{title}</title></line>'
        )
    for n in lay.nodes:
        x, y, label, half = n["x"], n["y"], n["label"], n["half"]
        parts.append(
            f'<rect x="{x - half:.1f}" y="{y - 9}" width="{2 * half:.1f}" height="18" rx="9" fill="white" stroke="#333"/>'
            f'<text x="{x}" y="{y + 3:.1f}" font-size="8" text-anchor="middle">{html.escape(label)}</text>'
        )
    legend = "".join(
        f'<text x="{24 + 90 * k}" y="{lay.height - 6}" font-size="10" fill="{c}">{html.escape(name)}</text>'
        for k, (name, c) in enumerate(lay.legend)
    )
    body = "".join(parts) + legend
    return f'<svg width="{lay.width}" height="{lay.height}" xmlns="http://www.w3.org/2000/svg">{body}</svg>'


def circuit_svg(g: Graph, on: list[int], score: list[float]) -> str:
    """An SVG of the edges ``on`` of ``g`` (edge numbers), each with its ``score``."""
    return layout_svg(circuit_layout(g, on, score))


def curve_svg(c: FaithfulnessCurve) -> str:
    """The faithfulness curve (by importance and by |score|) over the edge fraction, log-scaled."""
    w, h, pad = 360, 180, 30
    xs = [math.log10(max(p, 1e-4)) for p in c.fractions]
    lo, hi = min(xs), max(xs)
    fs = [*c.signed.faithfulness, *c.absolute.faithfulness]
    ylo, yhi = min(0.0, *fs), max(1.0, *fs)
    X = lambda v: pad + (v - lo) / ((hi - lo) or 1) * (w - 2 * pad)  # noqa: E731
    Y = lambda v: h - pad - (v - ylo) / ((yhi - ylo) or 1) * (h - 2 * pad)  # noqa: E731
    lines = []
    for f, colour, name in (
        (c.signed.faithfulness, "#1f77b4", "by importance"),
        (c.absolute.faithfulness, "#d62728", "by |score|"),
    ):
        pts = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in zip(xs, f))
        lines.append(
            f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="2"><title>{name}</title></polyline>'
        )
    axis = (
        f'<line x1="{pad}" y1="{Y(1):.1f}" x2="{w - pad}" y2="{Y(1):.1f}" stroke="#aaa" stroke-dasharray="3"/>'
        f'<text x="{pad}" y="{h - 8}" font-size="10">{100 * c.fractions[0]:g}% of edges</text>'
        f'<text x="{w - pad}" y="{h - 8}" font-size="10" text-anchor="end">100%</text>'
        f'<text x="4" y="{Y(1) + 3:.1f}" font-size="10">1</text>'
    )
    return f'<svg width="{w}" height="{h}" xmlns="http://www.w3.org/2000/svg">{axis}{"".join(lines)}</svg>'


@register(HTML, FaithfulnessCurve)
def curve_html(c: FaithfulnessCurve) -> str:
    rows = [
        [f"{100 * p:g}%", str(n1), f"{f1:.3f}", str(n2), f"{f2:.3f}"]
        for p, n1, f1, n2, f2 in zip(
            c.fractions, c.signed.edges, c.signed.faithfulness, c.absolute.edges, c.absolute.faithfulness
        )
    ]
    head = f"<h3>faithfulness curve: CPR {c.cpr:.3f}, CMD {c.cmd:.3f}</h3>"
    table = _table(["edges", "by importance", "faithfulness", "by |score|", "faithfulness"], rows)
    return page(f"<div class='qkov-nb'>{head}{curve_svg(c)}{table}</div>")


@register(HTML, EdgeScores)
def edge_scores_html(s: EdgeScores, k: int = 20) -> str:
    rows = [[name, f"{v:+.4g}"] for name, v in s.top(k)]
    head = f"<h3>{html.escape(s.method)} scores: {s.values.shape[-1]:,} edges ({html.escape(s.ablation)} ablation)</h3>"
    note = f"<p>{html.escape(s.metric)}: clean {s.clean:.4g}, every edge ablated {s.corrupted:.4g}</p>"
    return page(f"<div class='qkov-nb'>{head}{note}{_table(['edge', 'score'], rows)}</div>")


@register(HTML, CircuitDiscovery)
def discovery_html(d: CircuitDiscovery, k: int = 24) -> str:
    f, s, g = d.faithfulness, d.scores, d.scores.graph
    assert g is not None
    on, score = drawn_edges(s, d.circuit)
    parts = [
        f"<h3>{html.escape(d.task)}</h3>",
        f"<p>{html.escape(g.summary())}</p>",
        f"<p>{html.escape(s.method)} ({html.escape(s.ablation)} ablation): circuit of {d.circuit.n_edges} edges; "
        f"{html.escape(f.metric)} {f.values[0]:.4g} (full model {f.full:.4g}, every edge ablated {f.empty:.4g}): "
        f"<b>faithfulness {f.faithfulness[0]:.3f}</b></p>",
        circuit_svg(g, on, score),
    ]
    if d.curve is not None:
        parts += [f"<p>faithfulness curve: CPR {d.curve.cpr:.3f}, CMD {d.curve.cmd:.3f}</p>", curve_svg(d.curve)]
    if d.roc is not None:
        edge = "" if d.roc.edge_auc is None else f"edge {d.roc.edge_auc:.4f}, "
        parts.append(f"<p>ROC AUC against the ground truth: {edge}node {d.roc.node_auc:.4f}</p>")
    parts.append(_table(["edge", "score"], [[g.names[i], f"{v:+.4g}"] for i, v in zip(on[:k], score[:k])]))
    return page(f"<div class='qkov-nb'>{''.join(parts)}</div>")
