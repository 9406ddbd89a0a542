"""The report's model card: architecture, parameters, and the training record of a model qkov
trained, or, for one it did not (imported, or read from a Hugging Face directory, a
TransformerLens file or the Hub), where it came from and what its source does not record."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = ["Card", "Curve", "TrainingRecord"]

T = TypeVar("T")


def _plain(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _build(cls: type[T], data: dict[str, Any]) -> T:
    """``cls(**data)`` for the fields ``cls`` has (extra keys ignored)."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class Curve:
    """The training curve from ``metrics.jsonl``: evaluations (tokens, validation loss, induction
    score) and a thinned train-loss series."""

    tokens: list[Any] = field(default_factory=list)
    val_loss: list[Any] = field(default_factory=list)
    induction: list[Any] = field(default_factory=list)
    train_tokens: list[Any] = field(default_factory=list)
    train_loss: list[Any] = field(default_factory=list)


@dataclass
class TrainingRecord:
    """How a qkov checkpoint was trained (:func:`qkov.io.checkpoint.checkpoint_info`)."""

    steps: int | None = None
    steps_planned: int | None = None
    complete: bool = False
    tokens: int | None = None
    train_loss: float | None = None
    val_loss: float | None = None
    induction_score: float | None = None
    wall_s: float | None = None
    device: str | None = None
    corpus: str | None = None
    tokenizer: bool = False
    training: dict[str, Any] = field(default_factory=dict)
    imported_from: dict[str, Any] | None = None


@dataclass
class Card:
    """The model card: architecture, parameters, and the training record (a model ``qkov train``
    wrote) or, for any other, the format it came from (``source``: ``hf``, ``tl``, ``hub``),
    ``origin`` (:func:`qkov.apps.origin.source_origin`: format, path, family, import warnings) and
    what its source does not record (``unknown``)."""

    path: str
    model: dict[str, Any]
    parameters: int
    curve: Curve
    bandwidth: list[dict[str, Any]]
    record: TrainingRecord | None = None
    source: str | None = None
    # what the analyses read: {"fold_ln", "center_writing", "center_unembed"} of the weights view
    view: dict[str, bool] = field(default_factory=dict)
    origin: dict[str, Any] | None = None
    unknown: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"path": self.path, "model": self.model, "parameters": self.parameters}
        if self.record is not None:
            d.update(_plain(self.record))
        if self.source is not None:
            d.update(source=self.source, origin=self.origin, unknown=self.unknown)
        return {**d, "curve": _plain(self.curve), "bandwidth": self.bandwidth, "view": self.view}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Card":
        record = None if "source" in d else _build(TrainingRecord, d)
        curve = _build(Curve, d["curve"])
        card = cls(d["path"], d["model"], d["parameters"], curve, d["bandwidth"], record, d.get("source"), d["view"])
        card.origin, card.unknown = d.get("origin"), list(d.get("unknown") or [])
        return card
