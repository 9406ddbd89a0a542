"""A patching study: the sweeps a researcher runs first on a clean/corrupted pair, in one call.

:func:`patch_study` runs every registered sweep (:data:`~qkov.analysis.causal.registry.SWEEPS`)
whose options ask for it, in registration order. The built-in ones: activation patching of the
residual stream by (layer, position) and of every head's output by (layer, head) (or the sites asked
for), attribution patching of the same head outputs with its agreement to the actual patching, and
path patching when receivers are given. The sweeps that say what they read (:class:`~qkov.analysis.causal.registry.Needs`)
share one recording of the base run and one of the source run, made before the first sweep with every site
they read. ``qkov patch``, the report's patching section, the
explorer's ``patch`` view and the notebook display all show a :class:`PatchStudy`.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

from torch import Tensor

from ...errors import QkovError
from ...progress import Progress
from ...weights.convert import SourceLike, as_source
from ..shown import TEXT, Shown, register
from .contrast import Contrast
from .path_patch import PATH_SWEEP
from .patching import ACTIVATION_SWEEP, ATTRIBUTION_SWEEP
from .registry import SWEEPS, StudyRun, register_sweep, study_options
from .result import PatchResult, result_text

__all__ = ["BUILT_IN", "patch_study", "PatchStudy", "patch_study_text"]

BUILT_IN = (ACTIVATION_SWEEP, ATTRIBUTION_SWEEP, PATH_SWEEP)
"""The built-in sweeps, registered here in the order a study runs and shows them."""
for _sweep in BUILT_IN:
    register_sweep(_sweep)


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
    direction: str = "denoise",
    decode: Callable[[int], str] | None = None,
    progress: Progress | None = None,
    **options: Any,
) -> PatchStudy:
    """Every registered sweep its ``options`` ask for, on one contrast. The built-in options:
    ``sites`` (default ``("resid_pre", "head_out")``: activation patching of each, head sites by
    (layer, head), or by (layer, position, head) with ``by_pos=True``), ``attribution`` (default
    ``True``: attribution patching of the head sites and its agreement), ``receivers`` (heads or
    ``"logits"``: path patching into their ``input``, default ``"k"``); a registered sweep adds its
    own. ``decode`` turns the clean tokens into position labels."""
    source = as_source(source, where="qkov.patch_study")
    known = study_options()
    unknown = sorted(set(options) - set(known))
    if unknown:
        names = ", ".join(known)
        raise TypeError(f"patch_study() got an unexpected keyword argument {unknown[0]!r} (options: {names})")
    values = {name: opt.default for name, opt in known.items()}
    values |= {name: None if v is None else known[name].value(v) for name, v in options.items()}
    contrast = Contrast.of(source, clean, corrupted, metric=metric, direction=direction, where="patch study")
    asked = [s for s in SWEEPS.values() if s.when(values)]
    if not asked:
        raise QkovError(f"patch study: nothing to patch: none of the sweeps ({', '.join(SWEEPS)}) is asked for")
    study = StudyRun(contrast, values, progress=progress)
    needs = [s.needs(study) for s in asked if s.needs is not None]
    if needs:  # one base and one source run for every sweep that reads them
        union = functools.reduce(operator.or_, needs)
        contrast.record(union.cache, base_only=union.base_only, grad=union.grad)
    for sweep in asked:
        study.results += sweep.run(study)
    out = PatchStudy(study.results, study.agreement)
    if decode is not None:
        out.tokens = [decode(int(t)) for t in contrast.clean[0].tolist()]
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
