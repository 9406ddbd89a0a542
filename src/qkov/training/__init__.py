"""From text to a trained model: corpora and the tokenizer (:mod:`~qkov.training.data`), the
training loss (:mod:`~qkov.training.losses`), the loop with exact resume
(:mod:`~qkov.training.loop`, :mod:`~qkov.training.state`) and torchrun support
(:mod:`~qkov.training.distributed`). Training tracks induction heads with the analysis
probe :func:`qkov.analysis.heads.probes.induction_probe`."""

from .config import TrainConfig
from .data import Corpus, load_corpus
from .loop import train

__all__ = ["Corpus", "TrainConfig", "load_corpus", "train"]
