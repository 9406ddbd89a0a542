"""Where a model came from and what its source does not record: what ``qkov info`` and the
report's model card say about a model qkov did not train.

A qkov checkpoint written by ``qkov train`` carries its training record; one written by
``qkov import`` records ``training.imported_from`` (the format and path it was read from, the
Hugging Face family, any warning of the import) and nothing about how it was trained. A Hugging
Face directory, a TransformerLens file or a Hub name read directly is imported on the fly: its
origin is the source itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..io.checkpoint import read_config
from ..io.sources import hf_model_type, source_kind

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
