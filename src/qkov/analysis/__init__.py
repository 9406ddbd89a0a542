"""Taking a model apart, from its weights (through a :class:`~qkov.weights.WeightSource`) and
from its behaviour (through the one analysis forward, :func:`forward.trace`).

* :mod:`~qkov.analysis.factored` — :class:`LowRank`: factored products, never materialised.
* :mod:`~qkov.analysis.forward` — the analysis forward: records patterns, normalisation
  divisors, per-head values and outputs, MLP outputs; runs with any of them frozen.
* :mod:`~qkov.analysis.circuits` — QK/OV circuits, virtual weights, copying scores, bandwidth.
* :mod:`~qkov.analysis.composition` — Q/K/V composition scores and their random baseline.
* :mod:`~qkov.analysis.paths` — path expansion, term importance, term effects;
  :mod:`~qkov.analysis.qk_split` — the QK side of the expansion.
* :mod:`~qkov.analysis.probes` — repeated random tokens, the induction probe, the ICL score.
* :mod:`~qkov.analysis.heads` — head detectors, thresholds and roles.
* :mod:`~qkov.analysis.trigrams` — skip-trigram and bigram tables.
* :mod:`~qkov.analysis.shown` / :mod:`~qkov.analysis.reprs` — how results show themselves
  (text here; rich HTML registered by :mod:`qkov.show`).
* :mod:`~qkov.analysis.lens` — TransformerLens' ``run_with_cache`` and ``run_with_hooks`` on the
  analysis forward (registered as the model's methods).
"""

from . import reprs as reprs  # registers the results' text forms
from . import lens as lens  # registers the model's run_with_cache and run_with_hooks (qkov.model.registry)
from ..deprecated import module_getattr
from .factored import LowRank
from .forward import Trace, trace

__getattr__ = module_getattr(
    __name__, {"run": ("qkov.analysis.trace", lambda: trace), "Run": ("qkov.analysis.Trace", lambda: Trace)}
)

__all__ = ["LowRank", "Trace", "trace"]
