"""Rich HTML of analysis results, drawn by the report's own renderers: each result becomes the
JSON of the report section that shows it (built by :mod:`qkov.apps.report.collect`'s converters,
the ones the report uses) and mounts that renderer. Registered in
:data:`qkov.analysis.shown.HTML`, so a notebook shows these for every result."""

from __future__ import annotations

from typing import Any

from ..analysis.causal.composition import CompositionPaths
from ..analysis.circuits.report import CircuitsReport
from ..analysis.circuits.composition import Composition
from ..analysis.circuits.factored import TopK
from ..analysis.heads.report import HeadReport
from ..analysis.causal.studies import PatchStudy
from ..analysis.causal.result import PatchResult
from ..analysis.paths.summary import PathSummary
from ..analysis.heads.probes import InductionProbe
from ..analysis.shown import HTML, MAX_ROWS, decoder, register
from ..analysis.circuits.trigrams import Bigrams, SkipTrigrams
from ..analysis.circuits.composition import CompositionScores
from ..analysis.circuits.copying import CopyingScores
from ..apps.report.collect import bigram_rows, composition_section, heads_section, repeat_curves, trigram_rows
from ..model.tokens import token_decoder
from .page import mounted, page, text_only

__all__ = [
    "bigrams_html",
    "circuits_html",
    "composition_html",
    "composition_paths_html",
    "composition_scores_html",
    "copying_html",
    "heads_html",
    "HTML_ROWS",
    "patch_result_html",
    "patch_study_html",
    "paths_html",
    "probe_html",
    "topk_html",
    "trigrams_html",
]

HTML_ROWS = 48  # rows an HTML table shows before "... N more"


@register(HTML, HeadReport)
def heads_html(rep: HeadReport) -> str:
    data = {
        "heads": {**heads_section(rep).to_dict(), "max_rows": HTML_ROWS},
        "eigenvalues": {"absent": "not part of a head report"},
        "card": {"model": {"d_vocab": rep.diag_tokens or 0}},
    }
    return page(mounted("heads", data, repr(rep), title="Heads"))


def _composition(scores: dict[str, Composition], text: str) -> str:
    first = next(iter(scores.values()), None)
    if first is None or first.raw.shape[0] < 2:
        return text_only(text)  # no pair of layers: nothing to draw
    return mounted("composition", {"composition": composition_section(scores).to_dict()}, text, title="Composition")


@register(HTML, Composition)
def composition_html(c: Composition) -> str:
    return page(_composition({c.kind: c}, repr(c)))


@register(HTML, CompositionScores)
def composition_scores_html(scores: CompositionScores) -> str:
    return page(_composition(dict(scores.kinds), repr(scores)))


def _copying(scores: list[Any], k: int | None) -> str:
    heads = [{**c.to_dict(), "head": f"{c.layer}.{c.head}"} for c in scores[:HTML_ROWS]]
    data = {"copying": {"k": k, "heads": heads, "more": max(0, len(scores) - HTML_ROWS)}}
    return mounted("copying", data, repr(CopyingScores(scores, k)), title="Copying")


@register(HTML, CopyingScores)
def copying_html(scores: CopyingScores) -> str:
    return page(_copying(scores.heads, scores.k))


@register(HTML, CircuitsReport)
def circuits_html(rep: CircuitsReport) -> str:
    comp = _composition(dict(rep.composition), "\n\n".join(repr(c) for c in rep.composition.values()))
    return page(_copying(rep.copying, None), comp)


@register(HTML, TopK)
def topk_html(t: TopK) -> str:
    k = t.values.shape[-1]
    values, rows, cols = (x.reshape(-1, k)[0].tolist() for x in (t.values, t.rows, t.cols))
    d = decoder(t)
    entries = []
    for v, r, c in list(zip(values, rows, cols))[:HTML_ROWS]:
        e: dict[str, Any] = {"row": r, "col": c, "value": v}
        if d is not None:
            e.update(row_str=d(r), col_str=d(c))
        entries.append(e)
    batch = list(t.values.shape[:-1])
    what = "the matrix" + (" (first of the batch)" if batch else "")
    data = {"topk": {"k": k, "what": what, "batch": batch, "entries": entries, "more": max(0, k - HTML_ROWS)}}
    return page(mounted("topk", data, repr(t), title="Top-k entries"))


def _decode(obj: Any) -> Any:
    return decoder(obj) or token_decoder(None)


@register(HTML, SkipTrigrams)
def trigrams_html(tri: SkipTrigrams) -> str:
    rows = trigram_rows(tri.trigrams[: MAX_ROWS * 4], _decode(tri))
    section = {"heads": [{"head": tri.head, "rows": [vars(r) for r in rows]}], "bigrams": [], "note": None}
    return page(mounted("trigrams", {"trigrams": section}, repr(tri), title="Skip-trigrams"))


@register(HTML, Bigrams)
def bigrams_html(bi: Bigrams) -> str:
    rows = bigram_rows(bi.bigrams[: MAX_ROWS * 4], _decode(bi))
    section = {"heads": [], "bigrams": [vars(b) for b in rows], "note": None}
    return page(mounted("trigrams", {"trigrams": section}, repr(bi), title="Bigrams"))


@register(HTML, PathSummary)
def paths_html(p: PathSummary) -> str:
    return page(mounted("paths", {"paths": p.to_dict()}, repr(p), title="Paths"))


@register(HTML, InductionProbe)
def probe_html(p: InductionProbe) -> str:
    if len(p.loss_by_copy) < 2:
        return text_only(repr(p))
    best = None if p.best_head is None else f"{p.best_head[0]}.{p.best_head[1]}"
    curves = vars(repeat_curves(p))
    data = {"probe": {"scores": p.induction_attention.tolist(), "best_head": best, "best": p.best, "repeat": curves}}
    return page(mounted("probe", data, repr(p), title="Induction probe"))


@register(HTML, PatchStudy)
def patch_study_html(s: PatchStudy) -> str:
    return page(mounted("patching", {"patching": s.to_dict()}, repr(s), title="Patching"))


@register(HTML, PatchResult)
def patch_result_html(r: PatchResult) -> str:
    return page(mounted("patching", {"patching": {"results": [r.to_dict()]}}, repr(r), title="Patching"))


@register(HTML, CompositionPaths)
def composition_paths_html(c: CompositionPaths) -> str:
    return page(mounted("causal", {"causal": c.to_dict()}, repr(c), title="Composition, patched"))
