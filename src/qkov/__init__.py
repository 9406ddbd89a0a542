"""qkov: transformer circuits (Elhage et al., 2021) and induction heads (Olsson et al., 2022) as tested software.

Submodules: ``qkov.circuits`` (QK/OV, composition, copying), ``qkov.paths`` (path expansion),
``qkov.heads`` (detectors and roles), ``qkov.trigrams`` (skip-trigram tables),
``qkov.factored`` (low-rank products), ``qkov.weights`` (the canonical weights view),
``qkov.interop`` (import from / export to TransformerLens and Hugging Face GPT-2).
"""

from .checkpoint import load, save_checkpoint
from .config import ModelConfig
from .data import Corpus, load_corpus
from .errors import QkovError
from .heads import InductionProbe, induction_probe, repeated_random_tokens
from .model import ForwardOutput, Transformer
from .train import TrainConfig, train
from .weights import Weights

__all__ = [
    "Corpus",
    "ForwardOutput",
    "InductionProbe",
    "ModelConfig",
    "QkovError",
    "TrainConfig",
    "Transformer",
    "Weights",
    "induction_probe",
    "load",
    "load_corpus",
    "repeated_random_tokens",
    "save_checkpoint",
    "train",
]

__version__ = "0.1.0"
