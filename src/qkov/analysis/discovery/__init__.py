"""Circuit discovery: the circuit of a task, found from edge scores and checked by running it.

:mod:`.graph` the model's graph (senders, receivers, edges; the count rule); :mod:`.task` prompt pairs,
answers and metrics; :mod:`.ablations` what an ablated edge carries; :mod:`.grads` receiver gradients
and their products with sender changes; :mod:`.attribution` EAP, EAP-IG and integrated edge gradients;
:mod:`.exact` exact edge patching; :mod:`.score` every edge's score by one method (:func:`edge_scores`);
:mod:`.scores` the result; :mod:`.evaluate` circuits run with the rest ablated. docs/discovery.md has the
definitions and their sources.
"""

from __future__ import annotations

from .graph import edge_count, EDGE_COUNT_RULE, Graph, graph_of
from .task import AnswerMetric, METRICS, Task, TaskBatch
from .ablations import Ablation, ABLATIONS, make_ablation
from .scores import EdgeScores
from .evaluate import circuit_metrics, VARIANTS
from .score import edge_scores, METHODS, STEPS

__all__ = [
    "edge_count",
    "EDGE_COUNT_RULE",
    "Graph",
    "graph_of",
    "AnswerMetric",
    "METRICS",
    "Task",
    "TaskBatch",
    "Ablation",
    "ABLATIONS",
    "make_ablation",
    "EdgeScores",
    "circuit_metrics",
    "VARIANTS",
    "edge_scores",
    "METHODS",
    "STEPS",
]
