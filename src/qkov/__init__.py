"""qkov: transformer circuits (Elhage et al., 2021) and induction heads (Olsson et al., 2022) as tested software.

The flow, one package per step (each imports only the ones before it):

* :mod:`qkov.model` — what a transformer is: :class:`ModelConfig`, the shared operations, the
  training model :class:`Transformer`.
* :mod:`qkov.io` — checkpoints on disk (no pickle), TransformerLens and Hugging Face import/export.
* :mod:`qkov.weights` — the one interface analyses read weights through: the in-memory
  :class:`Weights` view and the memory-mapped :class:`LazyCheckpoint`.
* :mod:`qkov.analysis` — circuits, composition, paths, heads, probes, trigrams, and the one
  analysis forward :func:`run`, which reads and writes every activation by name (ablation,
  activation, path and attribution patching are built on it).
* :mod:`qkov.training` — corpora, tokenizer, the training loop (which tracks the induction probe).
* :mod:`qkov.apps` — the report, the tour and the command line.
* :mod:`qkov.show` — notebooks: rich displays of analysis results, the inline attention viewer.
"""

from .analysis.ablation import ablation_edits, ablation_study
from .analysis.factored import LowRank
from .analysis.forward import Run, run
from .analysis.patch_study import patch_study
from .analysis.patching import activation_patching, attribution_patching
from .analysis.path_patching import path_patching
from .analysis.probes import InductionProbe, induction_probe, induction_probe_tokens, prefix_matching_tokens
from .apps.dynamics import dynamics
from .errors import QkovError
from .io.checkpoint import load, save_checkpoint
from .io.sources import load_any
from .model.config import ModelConfig
from .model.transformer import Transformer
from .training.config import TrainConfig
from .training.data import Corpus, load_corpus
from .training.loop import train
from .version import __version__
from .weights.lazy import LazyCheckpoint
from .weights.view import Weights
from . import show  # last: registers the notebook displays of analysis results

__all__ = [
    "Corpus",
    "InductionProbe",
    "LazyCheckpoint",
    "LowRank",
    "ModelConfig",
    "QkovError",
    "Run",
    "TrainConfig",
    "Transformer",
    "Weights",
    "__version__",
    "ablation_edits",
    "ablation_study",
    "activation_patching",
    "attribution_patching",
    "dynamics",
    "induction_probe",
    "induction_probe_tokens",
    "load",
    "load_any",
    "load_corpus",
    "patch_study",
    "path_patching",
    "prefix_matching_tokens",
    "run",
    "save_checkpoint",
    "show",
    "train",
]
