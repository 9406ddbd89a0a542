"""Circuit discovery in ``qkov explore``: the model's induction circuit found from behaviour, and one edge
patched exactly.

* ``circuit`` {} — the report's circuit section (:func:`qkov.apps.report.discovery.circuit_section`) on the
  explorer's weights: EAP over every edge of the model's graph on the built-in induction task, the circuit's
  layout (nodes by layer, edge width by score, q/k/v coloured), its faithfulness curve with CPR and CMD and
  the top edges with their exact patching scores. Computed once per model and kept in memory.
* ``circuit_edge`` {edge} — one edge (its written form, ``"0.3 -> 1.1<k>"``, or its number) ablated alone
  on the same task (:func:`~qkov.apps.report.discovery.section_task`) and measured: exact edge patching,
  ``m(edge ablated) - m(clean)`` (:func:`qkov.edge_scores` with ``method="exact"``), beside its EAP score
  when the circuit view has it.
"""

from __future__ import annotations

from typing import Any

from ...analysis.discovery.graph import graph_of
from ...analysis.discovery.score import edge_scores
from ...analysis.discovery.task import Task
from ...errors import QkovError
from ...finite import json_safe
from ...progress import Progress
from ..report.discovery import circuit_section, section_task
from ..report.sections import Absent
from .context import BadRequest, Explorer
from .views_card import r6

__all__ = ["circuit", "circuit_edge"]


def _section(ex: Explorer, progress: Progress) -> Any:
    """The circuit section of the explorer's model, computed once and kept in ``ex.extra``."""
    if "circuit" not in ex.extra:
        found = circuit_section(ex.weights, progress=progress)
        if isinstance(found, Absent):
            raise BadRequest(f"circuit: {found.absent}")
        ex.extra["circuit"] = found
    return ex.extra["circuit"]


def _task(ex: Explorer) -> Task:
    """The section's task (seeded: the same prompts as the ``circuit`` view), made once and kept."""
    if "circuit_task" not in ex.extra:
        ex.extra["circuit_task"] = section_task(ex.weights)
    return ex.extra["circuit_task"]


def circuit(ex: Explorer, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """The induction circuit found by EAP, its layout, faithfulness curve and top edges."""
    if ex.cfg.n_layers == 0:
        raise BadRequest("circuit: a 0-layer model has no heads")
    return json_safe(_section(ex, progress).to_dict())  # type: ignore[no-any-return]


def circuit_edge(ex: Explorer, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """Exact patching of the one edge ``args["edge"]`` on the circuit view's task: 400 when malformed, 404 for
    an edge the model's graph lacks."""
    if ex.cfg.n_layers == 0:
        raise BadRequest("circuit: a 0-layer model has no heads")
    g = graph_of(ex.cfg)
    value = args.get("edge")
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value < g.n_edges:
            raise BadRequest(f"'edge' {value} is not an edge number (0 .. {g.n_edges - 1})", status=404)
        number = value
    elif isinstance(value, str) and value.strip():
        try:
            number = g.index(value, "'edge'")
        except QkovError as exc:
            raise BadRequest(str(exc), status=404) from None
    else:
        raise BadRequest(f"'edge' must be an edge like \"0.1 -> 1.0<k>\" or its number, got {value!r}")
    task = _task(ex)
    exact = edge_scores(ex.weights, task, method="exact", edges=[number], progress=progress)
    name = g.names[number]
    known = ex.extra.get("circuit")
    eap = None
    if known is not None:
        eap = next((e["score"] for e in known.layout.edges if e["edge"] == number), None)
        eap = next((e.score for e in known.top if e.edge == name), eap)
    return {
        "edge": name,
        "number": number,
        "exact": r6(exact.at_edge(number)),
        "eap": r6(eap) if eap is not None else None,
        "metric": exact.metric,
        "clean": r6(exact.clean),
        "ablated": r6(exact.clean + exact.at_edge(number)),
        "task": task.describe(),
    }
