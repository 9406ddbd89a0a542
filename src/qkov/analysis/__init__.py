"""Taking a model apart, from its weights (through a :class:`~qkov.weights.WeightSource`) and from its
behaviour (through the one analysis forward, :func:`trace`).

One sub-package per concept, each importing only the ones before it (tests/test_layout.py checks it):

* support, at this level: :mod:`.shown` (how results show themselves: text here, rich HTML registered
  by :mod:`qkov.show`), :mod:`.budget` (memory plans: one pass, chunk sizes) and :mod:`.sampling`
  (seeded samples);
* :mod:`.forward` — the analysis forward: sites, edits, the recorded pass (:class:`Trace`), frozen recordings,
  TransformerLens' ``run_with_cache`` / ``run_with_hooks``;
* :mod:`.circuits` — from the weights alone: QK/OV circuits, copying, composition, rotary circuits,
  skip-trigrams and bigrams, the weights-only report;
* :mod:`.paths` and :mod:`.heads` (neither imports the other) — the exact path expansion with term
  importance and effects; what each head does on behaviour (probes, repeated-token and text scores, roles);
* :mod:`.causal` — interventions: metrics, ablation, activation / attribution / path patching, studies;
* :mod:`.series` — a series of snapshots: its measures and the induction-head phase change.
"""

from __future__ import annotations

from .circuits.factored import LowRank
from .forward import lens as lens  # registers the model's run_with_cache and run_with_hooks (qkov.model.registry)
from .forward.cache import Trace
from .forward.tracer import trace

__all__ = ["LowRank", "Trace", "trace"]
