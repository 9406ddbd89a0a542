"""A patching study: the sweeps a researcher runs first on a clean/corrupted pair, in one call.

:func:`patch_study` runs activation patching of the residual stream by (layer, position) and of
every head's output by (layer, head) (or the sites asked for), attribution patching of the same
head outputs with its agreement to the actual patching, and path patching when receivers are
given. ``qkov patch``, the report's patching section and the notebook display all show a
:class:`PatchStudy`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from torch import Tensor

from ...weights.convert import SourceLike, as_source
from .metrics import as_metric
from .patching import PatchResult, activation_patching, agreement, attribution_patching, default_axes, result_text
from .path_patch import path_patching
from ...progress import Progress
from ..shown import TEXT, Shown, register
from ..forward.sites import Sites
from ..forward.sites import Head

__all__ = [ "patch_study", "PatchStudy", "patch_study_text"]


@dataclass(repr=False)
class PatchStudy(Shown):
    """Every result, the attribution/actual agreement per site (Pearson r over the patches), and the
    clean tokens as strings (the position labels)."""

    results: list[PatchResult]
    agreement: dict[str, float] = field(default_factory=dict)
    tokens: list[str] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"results": [r.to_dict() for r in self.results], "agreement": self.agreement, "tokens": self.tokens}

    def result(self, method: str, site: str) -> PatchResult | None:
        return next((r for r in self.results if r.method == method and r.site == site), None)


def patch_study(
    source: SourceLike,
    clean: Tensor,
    corrupted: Tensor,
    *,
    metric: Any = None,
    sites: Sequence[str] = ("resid_pre", "head_out"),
    by_pos: bool = False,
    receivers: Sequence[Head] | str | None = None,
    input: str = "k",
    direction: str = "denoise",
    attribution: bool = True,
    decode: Callable[[int], str] | None = None,
    progress: Progress | None = None,
) -> PatchStudy:
    """Activation patching of each of ``sites`` (head sites by (layer, head), or by (layer, position,
    head) with ``by_pos``), attribution patching of the head sites, and path patching into
    ``receivers``' ``input`` when given. ``decode`` turns the clean tokens into position labels."""
    source = as_source(source, where="qkov.patch_study")
    m = as_metric(metric, clean)
    out = PatchStudy([])
    kinds = [Sites(source.cfg, source.norm).resolve((s, 0))[0].kind for s in sites]
    for kind in kinds:
        axes = default_axes(kind)
        if by_pos and "head" in axes:
            axes = ("layer", "pos", "head")
        act = activation_patching(source, clean, corrupted, site=kind, axes=axes, metric=m, direction=direction, progress=progress)
        out.results.append(act)
        if attribution and "head" in axes:
            att = attribution_patching(source, clean, corrupted, site=kind, axes=axes, metric=m, direction=direction)
            out.results.append(att)
            out.agreement[kind] = agreement(act, att)
    if receivers is not None:
        out.results.append(
            path_patching(source, clean, corrupted, receivers=receivers, input=input, metric=m, direction=direction, progress=progress)
        )
    if decode is not None:
        out.tokens = [decode(int(t)) for t in clean[0].tolist()]
        for r in out.results:
            if "pos" in r.labels:
                r.labels["pos"] = [f"{i} {tok!r}" for i, tok in enumerate(out.tokens)]
    return out


@register(TEXT, PatchStudy)
def patch_study_text(s: PatchStudy) -> str:
    lines = []
    for r in s.results:
        lines.append(result_text(r))
        if r.method == "attribution" and r.site in s.agreement:
            lines.append(f"  agreement with activation patching: r = {s.agreement[r.site]:.3f}")
    return "\n".join(lines)
