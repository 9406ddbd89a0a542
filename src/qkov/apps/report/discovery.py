"""The report's circuit section: the model's induction circuit, found automatically from behaviour
(:mod:`qkov.analysis.discovery`), checked by running it, and drawn.

* **the task**: the built-in induction task (:func:`~qkov.analysis.discovery.builtin.induction_task`,
  seeded: ``HALF`` random tokens, then all but the last repeated; the answer is the token after the
  repeat, the corrupted prompt breaks the prefix match) with the logit difference as its metric;
* **the scores**: EAP of every edge of the model's graph under the corrupted ablation;
* **the faithfulness curve** at MIB's edge fractions (top-n circuits by importance and by ``|score|``, dead
  ends pruned, run with every other edge ablated), CPR and CMD;
* **the circuit**: the smallest of the curve's circuits by ``|score|`` whose faithfulness reaches
  :data:`~qkov.analysis.discovery.discover.TARGET` (0.8): MIB's grid, coarser than the search of
  ``qkov circuit`` and :func:`~qkov.analysis.discovery.find_circuit`, which would run some 40 more circuits;
* **the top edges** by ``|EAP score|``, each also patched exactly (ablated alone and measured).

**Cost.** Running a circuit costs one masked copy of the prompts per circuit; the curve runs 20 of them.
The section takes as many prompt pairs (at most :data:`PAIRS`, at least :data:`MIN_PAIRS`) as keep those
20 copies within :data:`CURVE_BYTES` (:func:`~qkov.analysis.discovery.evaluate.copy_bytes`): all
:data:`PAIRS` on the tour's models, 2 at GPT-2-small shape. :func:`section_task` gives the same task again
(the explorer patches single edges on it).
"""

from __future__ import annotations

from ...analysis.discovery.ablations import as_ablation
from ...analysis.discovery.builtin import induction_task
from ...analysis.discovery.circuit import prune, top_n
from ...analysis.discovery.discover import TARGET
from ...analysis.discovery.evaluate import Evaluator, copy_bytes
from ...analysis.discovery.faithfulness import MIB_FRACTIONS, faithfulness_curve
from ...analysis.discovery.graph import graph_of
from ...analysis.discovery.layout import circuit_layout, drawn_edges
from ...analysis.discovery.score import edge_scores
from ...analysis.discovery.task import Task
from ...errors import QkovError
from ...finite import json_safe, rounded
from ...progress import Progress, tick
from ...weights.convert import SourceLike, as_source
from ...weights.parts import WeightSource
from .causal_sections import CircuitEdge, CircuitSection
from .sections import Absent

__all__ = ["circuit_section", "CURVE_BYTES", "CURVE_CIRCUITS", "HALF", "MIN_PAIRS", "PAIRS", "section_task", "TOP_EDGES"]

PAIRS = 32  # prompt pairs at most
MIN_PAIRS = 2  # ... and at least
HALF = 6  # random tokens before the repeat (prompts of 2 * HALF tokens with the start token)
TOP_EDGES = 10  # edges in the section's table, each patched exactly
CURVE_CIRCUITS = 2 * len(MIB_FRACTIONS)  # the curve's circuits: top-n by importance and by |score| at each fraction
CURVE_BYTES = 384 << 20  # the curve's CURVE_CIRCUITS masked copies of the prompts fit this
DIGITS = 4
WHERE = "the report's circuit section"


def section_task(source: WeightSource, *, pairs: int | None = None, half: int = HALF, seed: int = 0) -> Task:
    """The section's induction task on ``source``: ``pairs`` prompt pairs (default: as many as the cost
    rule of the module docstring allows) of ``half`` random tokens and their repeat."""
    if pairs is None:
        T = 2 * half + 1  # the longest a prompt can be (with a start token)
        one = CURVE_CIRCUITS * copy_bytes(source, graph_of(source.cfg), 1, T)
        pairs = max(MIN_PAIRS, min(PAIRS, CURVE_BYTES // one))
    return induction_task(source, pairs, half=half, seed=seed)


def circuit_section(
    source: SourceLike,
    *,
    pairs: int | None = None,
    half: int = HALF,
    seed: int = 0,
    top: int = TOP_EDGES,
    target: float = TARGET,
    progress: Progress | None = None,
) -> CircuitSection | Absent:
    """The circuit section of ``source`` (a weights view, a model or a checkpoint path; see the module
    docstring); :class:`Absent` for a model without heads or without the tokens the task needs."""
    w = as_source(source, where=WHERE)
    if w.cfg.n_layers == 0:
        return Absent("a 0-layer model has no heads: its graph is one edge, the input into the logits")
    try:
        task = section_task(w, pairs=pairs, half=half, seed=seed)
    except QkovError as exc:
        return Absent(str(exc))
    g = graph_of(w.cfg)
    scores = edge_scores(w, task, method="eap", progress=progress)
    tick(progress, WHERE, 1, 3)
    ev = Evaluator(w, g, task, as_ablation(w, g, task, "corrupted"))
    curve = faithfulness_curve(ev, scores, progress=progress)
    tick(progress, WHERE, 2, 3)
    f = curve.absolute.faithfulness
    reach = [i for i, v in enumerate(f) if v >= target]
    i = reach[0] if reach else len(f) - 1
    circuit = prune(top_n(scores, int(curve.fractions[i] * g.n_edges), absolute=True))
    ranked = [name for name, _ in scores.top(top)]
    exact = edge_scores(w, task, method="exact", edges=ranked, progress=progress)
    tick(progress, WHERE, 3, 3)
    kept = set(circuit.names)
    rows = [
        CircuitEdge(name, rounded(scores.at_edge(name), DIGITS), rounded(exact.at_edge(name), DIGITS), name in kept)
        for name in ranked
    ]
    on, score = drawn_edges(scores, circuit)
    return CircuitSection(
        task.describe(), len(task), int(task.lengths.max()), scores.method, scores.ablation, g.summary(), g.n_edges,
        scores.metric, rounded(scores.clean, DIGITS), rounded(scores.corrupted, DIGITS), target, circuit.names,
        rounded(f[i], DIGITS), json_safe(curve.to_dict(), DIGITS), rows, circuit_layout(g, on, score),
    )  # fmt: skip
