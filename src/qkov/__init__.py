"""qkov: transformer circuits (Elhage et al., 2021) and induction heads (Olsson et al., 2022) as tested software.

The flow, one package per step (each imports only the ones before it):

* :mod:`qkov.model` — what a transformer is: :class:`ModelConfig`, the shared operations, the
  training model :class:`Transformer`.
* :mod:`qkov.io` — checkpoints on disk (no pickle), TransformerLens and Hugging Face import/export.
* :mod:`qkov.weights` — the one interface analyses read weights through: the in-memory
  :class:`Weights` view and the memory-mapped :class:`LazyCheckpoint`.
* :mod:`qkov.analysis` — circuits, composition, paths, heads, probes, trigrams, and the one
  analysis forward :func:`trace` (a recorded forward pass, :class:`Trace`), which reads and writes
  every activation by name (ablation, activation, path and attribution patching are built on it,
  and circuit discovery: :func:`find_circuit`, :func:`edge_scores`).
* :mod:`qkov.training` — corpora, tokenizer, the training loop (which tracks the induction probe).
* :mod:`qkov.apps` — the report, the tour, the dynamics study and the command line.
* :mod:`qkov.show` — notebooks: rich displays of analysis results, the inline attention viewer.

``import qkov`` loads the library (model to training); the app and notebook layers load on first use
(``qkov.dynamics``, ``qkov.show``, or the first rich display of a result in a notebook).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .analysis import shown as _shown
from .analysis.causal.ablation import ablation_edits, ablation_study
from .analysis.causal.composition import composition_paths
from .analysis.circuits.copying import copying_scores, ov_eigenvalues
from .analysis.circuits.qk_ov import full_ov, full_qk, ov, positional_qk, qk, virtual_weights
from .analysis.circuits.composition import composition_scores
from .analysis.circuits.factored import LowRank
from .analysis.forward.cache import Trace
from .analysis.forward.tracer import trace
from .analysis.heads.report import head_report
from .analysis.causal.studies import patch_study
from .analysis.causal.patching import activation_patching, attribution_patching
from .analysis.causal.path_patch import path_patching
from .analysis.discovery.discover import evaluate_circuit, find_circuit
from .analysis.discovery.formats import load_task
from .analysis.discovery.score import edge_scores
from .analysis.paths.expansion import expand
from .analysis.paths.effects import term_effects
from .analysis.paths.importance import term_importance
from .analysis.heads.probes import InductionProbe, icl_score, induction_probe, induction_probe_tokens, prefix_matching_tokens
from .analysis.heads.pattern_scores import text_scores
from .analysis.heads.gates import GateStats, effective_ov, gate_stats
from .analysis.circuits.trigrams import bigrams, skip_trigrams
from .errors import QkovError
from .io.checkpoint import save_checkpoint
from .io.sources import load, load_any
from .model.config import ModelConfig
from .model.transformer import Transformer
from .progress import Progress
from .training.config import TrainConfig
from .training.data import Corpus, load_corpus
from .training.loop import train
from .version import __version__
from .weights.convert import as_source
from .weights.lazy import LazyCheckpoint
from .weights.view import Weights

# The app and notebook layers, loaded on first use: public name -> (module, attribute; None: the module).
_LAZY: dict[str, tuple[str, str | None]] = {
    "dynamics": (".apps.dynamics", "dynamics"),
    "show": (".show", None),
}

if TYPE_CHECKING:  # what static analysers and IDEs see of the lazy names
    from . import show as show
    from .apps.dynamics import dynamics as dynamics


def __getattr__(name: str) -> Any:
    """Load a lazy name (:data:`_LAZY`) on first use."""
    if name in _LAZY:
        module, attribute = _LAZY[name]
        loaded = importlib.import_module(module, __name__)
        value = loaded if attribute is None else getattr(loaded, attribute)
        globals()[name] = value  # once: later uses are plain attribute reads
        return value
    raise AttributeError(f"module 'qkov' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


# the notebook displays register themselves when a result is first displayed
_shown.LOADERS.append(lambda: importlib.import_module(".show", __name__))

__all__ = [
    "Corpus",
    "InductionProbe",
    "GateStats",
    "LazyCheckpoint",
    "LowRank",
    "ModelConfig",
    "Progress",
    "QkovError",
    "Trace",
    "TrainConfig",
    "Transformer",
    "Weights",
    "__version__",
    "ablation_edits",
    "ablation_study",
    "activation_patching",
    "as_source",
    "attribution_patching",
    "bigrams",
    "composition_paths",
    "composition_scores",
    "copying_scores",
    "dynamics",
    "edge_scores",
    "evaluate_circuit",
    "effective_ov",
    "expand",
    "find_circuit",
    "full_ov",
    "full_qk",
    "gate_stats",
    "head_report",
    "icl_score",
    "induction_probe",
    "induction_probe_tokens",
    "load",
    "load_any",
    "load_corpus",
    "load_task",
    "ov",
    "ov_eigenvalues",
    "patch_study",
    "path_patching",
    "positional_qk",
    "prefix_matching_tokens",
    "qk",
    "save_checkpoint",
    "show",
    "skip_trigrams",
    "term_effects",
    "term_importance",
    "text_scores",
    "trace",
    "train",
    "virtual_weights",
]
