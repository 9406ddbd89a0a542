"""The schemas of the report's causal sections: a patching study of a clean/corrupted pair (computed by
:mod:`qkov.apps.report.interventions`) and the induction circuit found from behaviour (computed by
:mod:`qkov.apps.report.discovery`). The composition-paths section is
:class:`~qkov.analysis.causal.composition.CompositionPaths` itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...analysis.discovery.layout import CircuitLayout
from .card import _build, _plain

__all__ = ["CircuitEdge", "CircuitSection", "PatchingSection"]


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


@dataclass
class CircuitEdge:
    """One of the top edges: its written form, EAP score and exact patching score (each ``m(edge
    ablated) - m(clean)``), and whether the section's circuit holds it."""

    edge: str
    score: float | None
    exact: float | None
    in_circuit: bool


@dataclass
class CircuitSection:
    """The induction circuit found by EAP (see the module docstring): the ``task`` described, its
    ``pairs`` and prompt length ``tokens``, the ``method`` and ``ablation``, the ``graph`` (its summary and
    ``n_edges``), the ``metric`` with nothing ablated (``clean``) and everything ablated (``ablated``), the
    faithfulness ``target``, the ``circuit`` (edges as written) and its ``faithfulness``, the ``curve``
    (:meth:`~qkov.analysis.discovery.faithfulness.FaithfulnessCurve.to_dict`, rounded), the ``top``
    edges and the circuit's drawing (``layout``)."""

    task: str
    pairs: int
    tokens: int
    method: str
    ablation: str
    graph: str
    n_edges: int
    metric: str
    clean: float | None
    ablated: float | None
    target: float
    circuit: list[str]
    faithfulness: float | None
    curve: dict[str, Any]
    top: list[CircuitEdge]
    layout: CircuitLayout

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in vars(self).items() if k not in ("top", "layout")}
        return {**d, "top": [_plain(e) for e in self.top], "layout": self.layout.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CircuitSection":
        top = [_build(CircuitEdge, e) for e in d["top"]]
        return _build(cls, {**d, "top": top, "layout": CircuitLayout.from_dict(d["layout"])})
