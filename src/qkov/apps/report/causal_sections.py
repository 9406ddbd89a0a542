"""The report's causal sections' schema: the induction circuit's composition paths, patched, and a
patching study of a clean/corrupted pair (computed by :mod:`qkov.apps.report.interventions`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CausalSection:
    """:class:`~qkov.analysis.causal_composition.CompositionPaths` of the report's induction head
    and the previous-token head it K-composes with most."""

    writer: str
    reader: str
    prefix_clean: float
    prefix_corrupted: float
    prefix_removed: dict[str, float]
    icl_clean: float | None = None
    icl_removed: dict[str, float] | None = None
    repeat_length: int = 0
    icl_examples: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CausalSection":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass
class PatchingSection:
    """A :class:`~qkov.analysis.patch_study.PatchStudy` as JSON, with the inputs it ran on."""

    clean: str
    corrupted: str
    results: list[dict[str, Any]] = field(default_factory=list)
    agreement: dict[str, float] = field(default_factory=dict)
    tokens: list[str] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PatchingSection":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})
