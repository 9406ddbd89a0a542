"""The report's schema: one dataclass per section, each owning its JSON form (``to_dict`` /
``from_dict``). ``report.json``, the page's script, the tour's claims and the command-line
tables all read these fields; ``report.json`` carries :data:`SCHEMA_VERSION`.

A section a model cannot have (heads of a 0-layer model, composition of a 1-layer model) is
:class:`Absent` (``{"absent": why}`` in JSON). Numbers are stored as the page shows them (rounded
where :mod:`qkov.apps.report.collect` says so)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar, Union

from ...analysis.causal.composition import CompositionPaths
from ...analysis.paths.summary import PathSummary
from ...errors import QkovError
from .card import Card
from .card import _build, _plain
from .causal_sections import CircuitSection, PatchingSection

__all__ = [
    "Absent",
    "AttentionSection",
    "BigramRow",
    "CompositionKind",
    "CompositionSection",
    "EigenHead",
    "EigenSection",
    "HeadRow",
    "HeadsSection",
    "HeadTrigrams",
    "ICLSection",
    "ICLSummary",
    "Maybe",
    "Pair",
    "RepeatCurves",
    "Report",
    "SCHEMA_VERSION",
    "TrigramRow",
    "TrigramsSection",
]

SCHEMA_VERSION = 4  # 1: qkov 0.1 ("qkov_report": 1); 2: typed sections, heads "columns"; 3: causal, patching; 4: circuit


@dataclass
class Absent:
    """A section the model cannot have, and why."""

    absent: str

    def to_dict(self) -> dict[str, Any]:
        return {"absent": self.absent}


T = TypeVar("T")
Maybe = Union[T, Absent]


def _maybe(data: dict[str, Any], build: Any) -> Any:
    return Absent(data["absent"]) if "absent" in data else build(data)


# ----------------------------------------------------------------------- heads
@dataclass
class ICLSummary:
    """The in-context-learning score: loss at token ``late`` minus loss at token ``early``."""

    score: float
    early: int
    late: int


@dataclass
class HeadRow:
    """One head's scores (names as in :data:`qkov.analysis.heads.report.SCORE_COLUMNS`) and roles."""

    head: str
    layer: int
    index: int
    scores: dict[str, Any]
    roles: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"head": self.head, "layer": self.layer, "index": self.index, **self.scores, "roles": self.roles}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HeadRow":
        scores = {k: v for k, v in d.items() if k not in ("head", "layer", "index", "roles")}
        return cls(d["head"], d["layer"], d["index"], scores, list(d["roles"]))


@dataclass
class HeadsSection:
    """Every head's scores and roles, the thresholds behind the roles, the ICL score, the count of
    memory-management neurons, and the columns a table of the scores shows (label, score name)."""

    rows: list[HeadRow]
    thresholds: dict[str, float]
    memory_neurons: int
    icl: ICLSummary | None
    columns: list[list[str]]
    diag_tokens: int | None = None  # tokens the own-in-top-k rate was measured on (d_vocab: exact)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": [r.to_dict() for r in self.rows],
            "thresholds": self.thresholds,
            "memory_neurons": self.memory_neurons,
            "icl": None if self.icl is None else _plain(self.icl),
            "columns": self.columns,
            "diag_tokens": self.diag_tokens,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HeadsSection":
        icl = None if d.get("icl") is None else _build(ICLSummary, d["icl"])
        rows = [HeadRow.from_dict(r) for r in d["rows"]]
        return cls(rows, d["thresholds"], d["memory_neurons"], icl, d.get("columns", []), d.get("diag_tokens"))


@dataclass
class EigenHead:
    """One head's OV eigenvalues, divided by the largest modulus (``scale``), and its copying score."""

    head: str
    scale: float | None
    re: list[Any]
    im: list[Any]
    score: float | None


@dataclass
class EigenSection:
    heads: list[EigenHead]

    def to_dict(self) -> dict[str, Any]:
        return {"heads": [_plain(h) for h in self.heads]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EigenSection":
        return cls([_build(EigenHead, h) for h in d["heads"]])


# ----------------------------------------------------------------- composition
@dataclass
class Pair:
    writer: str
    reader: str
    raw: float | None
    adjusted: float | None


@dataclass
class CompositionKind:
    """One kind's heatmap (``raw``/``adjusted`` ``[writers][readers]``, NaN -> null where the
    reader is not later) with its baseline, and the strongest pairs."""

    writers: list[str]
    readers: list[str]
    raw: list[list[Any]]
    adjusted: list[list[Any]]
    baseline_mean: float | None
    baseline_std: float | None
    top: list[Pair]
    offsets: list[int] | None = None  # rotary Q/K: the query-key offsets the scores are averaged over

    def to_dict(self) -> dict[str, Any]:
        return {**_plain(self), "top": [_plain(p) for p in self.top]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CompositionKind":
        return _build(cls, {**d, "top": [_build(Pair, p) for p in d["top"]]})


@dataclass
class CompositionSection:
    kinds: dict[str, CompositionKind]  # "q", "k", "v"

    def to_dict(self) -> dict[str, Any]:
        return {k: v.to_dict() for k, v in self.kinds.items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CompositionSection":
        return cls({k: CompositionKind.from_dict(v) for k, v in d.items()})


# ------------------------------------------------------- attention, ICL, trigrams
@dataclass
class AttentionSection:
    """The viewer's text (``ids``, ``tokens``) and patterns ``[layer][head][query]`` (row ``q`` has
    ``q + 1`` entries: the lower triangle)."""

    ids: list[int]
    tokens: list[str]
    patterns: list[Any]

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AttentionSection":
        return _build(cls, d)


@dataclass
class RepeatCurves:
    """Loss at each token of the 1st and 2nd copy of ``length`` random tokens repeated twice."""

    length: int
    first: list[Any]
    second: list[Any]
    first_mean: float
    second_mean: float


@dataclass
class ICLSection:
    """Validation loss by position, the ICL score (when there is one) and the repeated-token curves."""

    loss_by_position: list[Any] | None
    repeat: RepeatCurves
    score: float | None = None
    early: int | None = None
    late: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"loss_by_position": self.loss_by_position}
        if self.score is not None:
            d.update(score=self.score, early=self.early, late=self.late)
        return {**d, "repeat": _plain(self.repeat)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ICLSection":
        return cls(
            d["loss_by_position"], _build(RepeatCurves, d["repeat"]), d.get("score"), d.get("early"), d.get("late")
        )


@dataclass
class TrigramRow:
    """A skip-trigram ``source ... destination -> output`` with its centred QK and OV parts."""

    source: int
    destination: int
    output: int
    qk: float | None
    ov: float | None
    score: float | None
    source_str: str
    destination_str: str
    output_str: str


@dataclass
class BigramRow:
    token: int
    next: int
    logit: float | None
    token_str: str
    next_str: str


@dataclass
class HeadTrigrams:
    head: str
    rows: list[TrigramRow]


@dataclass
class TrigramsSection:
    """Skip-trigram tables of the layer-0 heads, and the direct path's bigrams."""

    heads: list[HeadTrigrams]
    bigrams: list[BigramRow]
    note: str | None = None  # set when only some layer-0 heads have tables (large vocabularies)

    def to_dict(self) -> dict[str, Any]:
        return {
            "heads": [{"head": h.head, "rows": [_plain(r) for r in h.rows]} for h in self.heads],
            "bigrams": [_plain(b) for b in self.bigrams],
            "note": self.note,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrigramsSection":
        heads = [HeadTrigrams(h["head"], [_build(TrigramRow, r) for r in h["rows"]]) for h in d["heads"]]
        return cls(heads, [_build(BigramRow, b) for b in d["bigrams"]], d.get("note"))


# ---------------------------------------------------------------------- report
@dataclass
class Report:
    """Every number of one model's report."""

    path: str
    name: str
    card: Card
    heads: Maybe[HeadsSection]
    eigenvalues: Maybe[EigenSection]
    composition: Maybe[CompositionSection]
    paths: PathSummary
    attention: Maybe[AttentionSection]
    icl: ICLSection
    trigrams: TrigramsSection
    timings: dict[str, float] = field(default_factory=dict)
    inputs: str = ""  # the tokens the behavioural sections ran on
    causal: Maybe[CompositionPaths] = field(default_factory=lambda: Absent("not computed"))
    patching: Maybe[PatchingSection] = field(default_factory=lambda: Absent("no clean/corrupted pair given"))
    circuit: Maybe[CircuitSection] = field(default_factory=lambda: Absent("not computed"))
    left_out: dict[str, str] = field(default_factory=dict)  # score ("icl") -> why the text does not give it
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "path": self.path,
            "name": self.name,
            "inputs": self.inputs,
            "left_out": self.left_out,
            "card": self.card.to_dict(),
            "heads": self.heads.to_dict(),
            "eigenvalues": self.eigenvalues.to_dict(),
            "composition": self.composition.to_dict(),
            "paths": self.paths.to_dict(),
            "attention": self.attention.to_dict(),
            "icl": self.icl.to_dict(),
            "trigrams": self.trigrams.to_dict(),
            **{k: getattr(self, k).to_dict() for k in ("causal", "patching", "circuit")},
            "timings": self.timings,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Report":
        """A report from its JSON form (``report.json`` of this schema version)."""
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise QkovError(f"report.json has schema version {version!r}; this qkov reads version {SCHEMA_VERSION}")
        return cls(
            path=d["path"],
            name=d["name"],
            card=Card.from_dict(d["card"]),
            heads=_maybe(d["heads"], HeadsSection.from_dict),
            eigenvalues=_maybe(d["eigenvalues"], EigenSection.from_dict),
            composition=_maybe(d["composition"], CompositionSection.from_dict),
            paths=PathSummary.from_dict(d["paths"]),
            attention=_maybe(d["attention"], AttentionSection.from_dict),
            icl=ICLSection.from_dict(d["icl"]),
            trigrams=TrigramsSection.from_dict(d["trigrams"]),
            timings=d.get("timings", {}),
            inputs=d["inputs"],
            causal=_maybe(d["causal"], CompositionPaths.from_dict),
            patching=_maybe(d["patching"], PatchingSection.from_dict),
            circuit=_maybe(d["circuit"], CircuitSection.from_dict),
            left_out=d.get("left_out", {}),
        )
