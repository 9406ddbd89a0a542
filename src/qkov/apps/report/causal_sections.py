"""The report's patching section's schema: a patching study of a clean/corrupted pair (computed by
:mod:`qkov.apps.report.interventions`). The causal section is
:class:`~qkov.analysis.causal.composition.CompositionPaths` itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["PatchingSection"]


@dataclass
class PatchingSection:
    """A :class:`~qkov.analysis.causal.studies.PatchStudy` as JSON, with the inputs it ran on."""

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
