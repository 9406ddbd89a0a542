"""Where a model came from and what its source does not record: what ``qkov info`` and the
report's model card say about a model qkov did not train.

A qkov checkpoint written by ``qkov train`` carries its training record; one written by
``qkov import`` records ``training.imported_from`` (the format and path it was read from, the
Hugging Face family, any warning of the import) and nothing about how it was trained. A Hugging
Face directory, a TransformerLens file or a Hub name read directly is imported on the fly: its
origin is the source itself.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..io.checkpoint import read_config
from ..io.hf_store import shard_paths
from ..io.sources import hf_model_type, source_kind
from ..io.tensorfile import TensorFile
from ..model.transformer import Transformer
from ..weights.lazy import LazyCheckpoint

__all__ = ["describe_origin", "FORMATS", "parameter_count", "source_origin", "UNKNOWN"]

FORMATS = {
    "qkov": "qkov checkpoint",
    "hf": "Hugging Face directory",
    "tl": "TransformerLens file",
    "hub": "Hugging Face Hub model",
}
"""What each :func:`~qkov.io.sources.source_kind` is called in outputs."""

UNKNOWN = ("training history (steps, tokens, corpus, train and validation loss): the source records none",)
"""What an imported model's source does not say (``unknown`` in ``qkov info --json`` and the card)."""


def source_origin(source: Path | str) -> dict[str, Any] | None:
    """``None`` for a model ``qkov train`` wrote; else where it came from: ``{"format": "hf" | "tl"
    | "hub", "path": ..., "family": model_type (Hugging Face), "warnings": [...] (when the import
    warned)}`` (for a qkov checkpoint written by ``qkov import``, what the import recorded)."""
    kind = source_kind(source)
    if kind == "qkov":
        origin = read_config(Path(source)).get("training", {}).get("imported_from")
        return None if origin is None else dict(origin)
    out: dict[str, Any] = {"format": kind, "path": str(source)}
    family = hf_model_type(source) if kind == "hf" else None
    if family is not None:
        out["family"] = family
    return out


def describe_origin(origin: dict[str, Any]) -> str:
    """One line: ``Hugging Face directory (llama) /path/to/dir``."""
    what = FORMATS.get(str(origin.get("format")), str(origin.get("format")))
    family = f" ({origin['family']})" if origin.get("family") else ""
    return f"{what}{family} {origin.get('path')}"


def _stored_parameters(path: Path) -> int:
    """The weights a Hugging Face directory stores, from its safetensors headers (``transformers``'
    ``num_parameters()`` of the same model: a tied unembedding counted once, no biases the family lacks)."""
    return sum(math.prod(f.shape(name)) for f in map(TensorFile, shard_paths(path)) for name in f.entries)


def parameter_count(source: Path | str, model: Transformer | LazyCheckpoint) -> int:
    """The parameters of the model of ``source``, as ``qkov info`` and the report's card state them: for a
    Hugging Face directory what it stores (:func:`_stored_parameters`; qkov's form of it adds zero biases
    and an untied copy of a tied unembedding, which are not the model's), else the parameters of
    ``model`` (loaded, or a :class:`~qkov.weights.lazy.LazyCheckpoint`: its tensors, from the headers)."""
    if source_kind(source) == "hf":
        return _stored_parameters(Path(source))
    if isinstance(model, LazyCheckpoint):
        return sum(math.prod(model.file.shape(name)) for name in model.file.entries)
    return model.num_parameters()
