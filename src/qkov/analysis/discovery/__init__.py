"""Circuit discovery: the circuit of a task, found from edge scores and checked by running it.

:mod:`.graph` the model's graph (senders, receivers, edges; the count rule) and :mod:`.names` the
spellings other tools use; :mod:`.task` prompt pairs, answers and metrics, :mod:`.builtin` and
:mod:`.ioi_words` the tasks that need no download, :mod:`.formats` task, ground-truth and MIB files;
:mod:`.ablations` what an ablated edge carries; :mod:`.senders` every sender's output and replacement,
kept compactly; :mod:`.grads` receiver gradients and their products with sender changes; :mod:`.attribution`
EAP, EAP-IG and integrated edge gradients; :mod:`.exact` exact edge patching; :mod:`.score` every edge's
score by one method and :mod:`.scores` the result; :mod:`.circuit` circuits and how to choose them;
:mod:`.evaluate` circuits run with the rest ablated, :mod:`.masked` the pass that runs them;
:mod:`.faithfulness` faithfulness and its curve (CPR, CMD); :mod:`.layout` where a circuit's nodes and edges sit
when drawn; :mod:`.roc` ROC AUC against a known circuit;
:mod:`.acdc` an ACDC-style pruning pass; :mod:`.discover` all of it in one call; :mod:`.sweep` edge
attribution as a sweep of the patching study. docs/discovery.md has
the definitions and their sources.
"""

from __future__ import annotations

from .graph import edge_count, EDGE_COUNT_RULE, Graph, graph_of
from .names import mib_name, to_qkov
from .task import AnswerMetric, METRICS, Task, TaskBatch
from .builtin import BUILT_IN_TASKS, induction_task, ioi_task
from .ablations import Ablation, ABLATIONS, make_ablation
from .scores import EdgeScores
from .circuit import Circuit, greedy, prune, threshold, top_n
from .layout import circuit_layout, CircuitLayout, COLOURS, drawn_edges, INPUT_NAMES
from .evaluate import circuit_metrics, Evaluator, VARIANTS
from .score import edge_scores, METHODS, STEPS
from .faithfulness import area, CircuitFaithfulness, FaithfulnessCurve, faithfulness_curve, MIB_FRACTIONS
from .roc import auc, circuit_roc, Roc, roc_points
from .acdc import acdc_prune, AcdcResult
from .formats import load_task, mib_graph, read_ground_truth
from .discover import CircuitDiscovery, evaluate_circuit, find_circuit, TARGET
from .sweep import contrast_edge_scores, EDGE_SWEEP  # registers edge attribution as a sweep of the patching study

__all__ = [
    "edge_count",
    "EDGE_COUNT_RULE",
    "Graph",
    "graph_of",
    "mib_name",
    "to_qkov",
    "AnswerMetric",
    "METRICS",
    "Task",
    "TaskBatch",
    "BUILT_IN_TASKS",
    "induction_task",
    "ioi_task",
    "Ablation",
    "ABLATIONS",
    "make_ablation",
    "EdgeScores",
    "Circuit",
    "greedy",
    "prune",
    "threshold",
    "top_n",
    "circuit_layout",
    "CircuitLayout",
    "COLOURS",
    "drawn_edges",
    "INPUT_NAMES",
    "circuit_metrics",
    "Evaluator",
    "VARIANTS",
    "edge_scores",
    "METHODS",
    "STEPS",
    "area",
    "CircuitFaithfulness",
    "FaithfulnessCurve",
    "faithfulness_curve",
    "MIB_FRACTIONS",
    "auc",
    "circuit_roc",
    "Roc",
    "roc_points",
    "acdc_prune",
    "AcdcResult",
    "load_task",
    "mib_graph",
    "read_ground_truth",
    "CircuitDiscovery",
    "evaluate_circuit",
    "find_circuit",
    "TARGET",
    "contrast_edge_scores",
    "EDGE_SWEEP",
]
