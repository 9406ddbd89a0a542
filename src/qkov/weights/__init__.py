"""Weights as analyses read them: one interface (:class:`WeightSource`), two implementations —
the in-memory canonical view (:class:`Weights`: LayerNorm folding, centring, rotation) and a
checkpoint memory-mapped from disk (:class:`LazyCheckpoint`)."""

from .convert import SourceLike, as_source, source_bos, source_tokenizer, vocab_and_bos
from .lazy import AUTO_LAZY_BYTES, LazyCheckpoint
from .parts import NORMS, AttentionWeights, MLPWeights, Unembedding, WeightSource, check_head, fold_reader
from .view import Weights

__all__ = [
    "AUTO_LAZY_BYTES",
    "AttentionWeights",
    "SourceLike",
    "LazyCheckpoint",
    "MLPWeights",
    "NORMS",
    "Unembedding",
    "WeightSource",
    "Weights",
    "as_source",
    "check_head",
    "fold_reader",
    "source_bos",
    "source_tokenizer",
    "vocab_and_bos",
]
