"""The report's causal sections: the induction circuit's composition paths, patched
(:mod:`qkov.analysis.causal.composition`), and a patching study of a clean/corrupted pair when
the report is given one (:mod:`qkov.analysis.causal.studies`: every registered sweep on by default)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ...analysis.causal.composition import composition_paths
from ...analysis.causal.studies import PatchStudy, patch_study
from ...analysis.forward.address import as_head
from ...errors import QkovError
from ...model.transformer import Transformer
from ...weights.view import Weights
from ..inputs import PatchingInputs, patching_inputs
from .causal_sections import PatchingSection
from .sections import Absent, CompositionSection, HeadsSection

__all__ = ["causal_section", "circuit_heads", "patching_section", "read_patching"]


def circuit_heads(heads: HeadsSection | Absent, comp: CompositionSection | Absent) -> tuple[str, str] | str:
    """``(writer, reader)``: the induction head with the highest prefix matching, and the previous-token
    head in an earlier layer it K-composes with most; or why there is none."""
    if isinstance(heads, Absent) or isinstance(comp, Absent) or "k" not in comp.kinds:
        return "no induction circuit: the model has fewer than two layers"
    induction = sorted((r for r in heads.rows if "induction" in r.roles), key=lambda r: -r.scores["prefix_matching"])
    if not induction:
        return "no induction head was found (see the heads section)"
    reader = induction[0]
    k = comp.kinds["k"]
    col = k.readers.index(reader.head)
    prev = [r for r in heads.rows if "previous-token" in r.roles and r.layer < reader.layer]
    if not prev:
        return f"the induction head {reader.head} has no previous-token head in an earlier layer"

    def score(head: str) -> float:
        v = k.adjusted[k.writers.index(head)][col] if head in k.writers else None
        return -math.inf if v is None else float(v)

    writer = max(prev, key=lambda r: score(r.head))
    return writer.head, reader.head


def causal_section(w: Weights, heads: Any, comp: Any, text: torch.Tensor | None, bos: int, seed: int) -> Any:
    """The composition paths of the report's induction circuit (``Absent`` without one)."""
    pair = circuit_heads(heads, comp)
    if isinstance(pair, str):
        return Absent(pair)
    writer, reader = (as_head(h, w.cfg, "report") for h in pair)
    return composition_paths(w, writer, reader, text=text, bos=bos, seed=seed).rounded()


def read_patching(
    model: Transformer, clean: Path | None, corrupted: Path | None, metric: str | None, device: Any
) -> PatchingInputs | None:
    """The report's patching inputs (``None`` when no pair is given; one-line errors for half a pair)."""
    if clean is None and corrupted is None:
        return None
    if clean is None or corrupted is None:
        raise QkovError("report: patching needs both a clean and a corrupted input")
    return patching_inputs(model, clean, corrupted, metric, device)


def patching_section(w: Weights, given: PatchingInputs | None) -> Any:
    """Patching of the pair (:func:`~qkov.analysis.causal.studies.patch_study` with its defaults: every
    registered sweep on by default; built in: the residual stream by layer and position, head outputs,
    attribution); ``Absent`` without one."""
    if given is None:
        return Absent("no clean/corrupted pair given (qkov report --clean FILE --corrupted FILE)")
    if w.cfg.n_layers == 0:
        return Absent("a 0-layer model has nothing to patch")
    study: PatchStudy = patch_study(w, given.clean, given.corrupted, metric=given.metric, decode=given.decode)
    return PatchingSection(*given.names, **study.to_dict())
