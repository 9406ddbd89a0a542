"""The analysis forward's older modes, as uses of its sites: ``record=`` names become kinds to
cache at every layer; ``patterns=``, ``frozen=`` and ``head_outputs=`` become edits
(:mod:`qkov.analysis.edits`) of the patterns, the normalisation divisors, the MLP outputs and
the heads' outputs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from torch import Tensor

from ..errors import QkovError
from .edits import Edits
from .sites import RECORD_LEGACY, Address, Sites

if TYPE_CHECKING:  # pragma: no cover
    from .activations import Trace


def legacy_kinds(record: Iterable[str], sites: Sites) -> list[str]:
    """The site kinds the older ``record=`` names stand for (those this model has)."""
    if isinstance(record, str):
        record = [record]
    want = list(dict.fromkeys(record))
    unknown = [r for r in want if r not in RECORD_LEGACY]
    if unknown:
        raise QkovError(f"run: cannot record {', '.join(unknown)} (choose from {', '.join(RECORD_LEGACY)})")
    have = {k.name for k in sites.kinds}
    return [k for r in want for k in RECORD_LEGACY[r] if k in have]


def legacy_edits(
    ed: Edits,
    tokens: Tensor,
    *,
    patterns: Tensor | None,
    frozen: "Trace | None",
    head_outputs: Tensor | None,
) -> dict[int, Tensor] | None:
    """Add the edits ``patterns=``, ``frozen=`` and ``head_outputs=`` stand for to ``ed``; returns
    the dict the heads' live outputs are kept in under ``head_outputs=`` (else ``None``)."""
    cfg = ed.sites.cfg
    if patterns is not None and frozen is not None:
        raise QkovError("run: give frozen patterns or a frozen run, not both")
    if frozen is not None:
        patterns = _frozen(ed, frozen)
    if patterns is not None:
        patterns = _check_patterns(patterns, cfg, tokens)
        for l in range(cfg.n_layers):
            ed.add(Address("pattern", l), patterns[l])
    if head_outputs is None:
        return None
    live: dict[int, Tensor] = {}
    for l in range(cfg.n_layers):
        ed.add(Address("head_out", l), _override(live, l, head_outputs[l].transpose(1, 2)))
    return live


def _override(live: dict[int, Tensor], layer: int, given: Tensor):  # type: ignore[no-untyped-def]
    def write_given(value: Tensor, site: Address) -> Tensor:
        live[layer] = value
        return given.to(value)

    return write_given


def _frozen(ed: Edits, frozen: "Trace") -> Tensor:
    """Edits fixing a previous run's divisors and MLP outputs; returns its patterns."""
    cfg, norm = ed.sites.cfg, ed.sites.norm
    if frozen.patterns is None or (norm != "none" and frozen.scales is None):
        raise QkovError("run: a frozen run must have recorded its patterns and scales")
    if cfg.d_mlp is not None and frozen.mlp_outputs is None:
        raise QkovError("run: a frozen run of a model with MLPs must have recorded mlp_outputs")
    have = {k.name for k in ed.sites.kinds}
    s = frozen.scales
    for l in range(cfg.n_layers):
        if s is not None:
            ed.add(Address("attn_scale", l), s.attn_v[l])
            if "qk_scale" in have:
                ed.add(Address("qk_scale", l), s.attn_qk[l])
            if s.mlp is not None:
                ed.add(Address("mlp_scale", l), s.mlp[l])
        if frozen.mlp_outputs is not None:
            ed.add(Address("mlp_out", l), frozen.mlp_outputs[l])
    if s is not None:
        ed.add(Address("final_scale"), s.final)
    return frozen.patterns


def _check_patterns(patterns: Tensor, cfg: object, tokens: Tensor) -> Tensor:
    L, H = cfg.n_layers, cfg.n_heads  # type: ignore[attr-defined]
    b, t = tokens.shape
    if patterns.ndim == 4:
        patterns = patterns[:, None]
    if patterns.ndim != 5 or patterns.shape[0] != L or patterns.shape[2] != H or patterns.shape[3:] != (t, t) or patterns.shape[1] not in (1, b):
        raise QkovError(f"patterns: expected shape [{L}, {b}, {H}, {t}, {t}], got {tuple(patterns.shape)}")
    return patterns
