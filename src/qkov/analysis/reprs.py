"""Plain-text ``repr`` of analysis results: a title line and a table of at most
:data:`~qkov.analysis.shown.MAX_ROWS` rows (then "... N more"), so that printing a result in a
terminal or a notebook fits one screen. Registered in :data:`~qkov.analysis.shown.TEXT`."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from .circuits import CircuitsReport
from .composition import Composition
from .factored import TopK
from .heads import SCORE_COLUMNS, HeadReport
from .paths import PathSummary
from .probes import InductionProbe
from .term_results import TermEffects
from .shown import (
    MAX_ROWS,
    TEXT,
    Bigrams,
    CompositionScores,
    CopyingScores,
    SkipTrigrams,
    decoder,
    more,
    register,
)


def num(v: Any, digits: int = 3) -> str:
    """``v`` with ``digits`` decimals; ``n/a`` for None/NaN (a score that does not apply)."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    return f"{float(v):.{digits}f}"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], total: int | None = None) -> str:
    """Columns padded to their widest cell (first column left, others right), at most
    :data:`MAX_ROWS` rows of ``rows``; ``total`` rows exist (default ``len(rows)``)."""
    cells = [list(map(str, header))] + [list(map(str, r)) for r in rows[:MAX_ROWS]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    note = more(len(rows) if total is None else total)
    return "\n".join(lines + ([note] if note else []))


def token(decode: Callable[[int], str] | None, i: int) -> str:
    """``id`` or ``id 'string'`` when a decoder was given."""
    return str(i) if decode is None else f"{i} {decode(i)!r}"


@register(TEXT, HeadReport)
def heads_text(rep: HeadReport) -> str:
    rows = rep.rows()
    cols = [(label, name) for label, name in SCORE_COLUMNS if name in rep.scores]
    body = [[r["head"], *(num(r[n], 2) for _, n in cols), ",".join(r["roles"]) or "-"] for r in rows]  # type: ignore[arg-type]
    icl = "" if rep.icl is None else f"; ICL score {num(rep.icl.score)} (token {rep.icl.late} - token {rep.icl.early})"
    icl += "".join(f"; {name} score left out: {why}" for name, why in rep.left_out.items())
    title = f"HeadReport: {len(rows)} heads{icl}; memory-management neurons: {len(rep.memory_neurons)}"
    return title + "\n" + table(["head", *(c.replace(" ", "_") for c, _ in cols), "roles"], body)


@register(TEXT, Composition)
def composition_text(c: Composition) -> str:
    L, H = c.raw.shape[:2]
    pairs = c.pairs()
    rows = [[p["writer"], p["reader"], num(p["adjusted"]), num(p["raw"])] for p in pairs]
    off = "" if c.offsets is None else f", mean over offsets {c.offsets}"
    title = (
        f"{c.kind.upper()}-composition of {L} layers x {H} heads: raw [L, H, L, H], "
        f"baseline {num(c.baseline.mean)} +- {num(c.baseline.std)}{off}; pairs, strongest first:"
    )
    return title + "\n" + table(["writer", "reader", "adjusted", "raw"], rows)


@register(TEXT, CompositionScores)
def composition_scores_text(scores: CompositionScores) -> str:
    return "\n\n".join(composition_text(c) for c in scores.values()) or "CompositionScores: none"


@register(TEXT, CopyingScores)
def copying_text(scores: CopyingScores) -> str:
    k = scores.k or "k"
    cells = lambda c: [c.layer, c.head, num(c.eigen_score), num(c.diag_topk_rate), num(c.residual_eigen_score)]  # noqa: E731
    rows = [cells(c) for c in scores.heads]
    title = f"copying scores of {len(scores.heads)} heads (eigen: full OV circuit; residual: W_OV in the stream):"
    return title + "\n" + table(["layer", "head", "eigen", f"own in top {k}", "residual eigen"], rows)


@register(TEXT, CircuitsReport)
def circuits_text(rep: CircuitsReport) -> str:
    parts = [copying_text(CopyingScores(rep.copying)), *(composition_text(c) for c in rep.composition.values())]
    return "CircuitsReport\n" + "\n\n".join(parts)


@register(TEXT, TopK)
def topk_text(t: TopK) -> str:
    decode, k = decoder(t), t.values.shape[-1]
    values, rows, cols = (x.reshape(-1, k)[0].tolist() for x in (t.values, t.rows, t.cols))
    batch = tuple(t.values.shape[:-1])
    where = f" (first of batch {list(batch)})" if batch else ""
    body = [[i, token(decode, r), token(decode, c), num(v, 4)] for i, (v, r, c) in enumerate(zip(values, rows, cols))]
    return f"TopK: the {k} largest entries{where}:\n" + table(["#", "row", "col", "value"], body)


@register(TEXT, SkipTrigrams)
def trigrams_text(tri: SkipTrigrams) -> str:
    d = decoder(tri)
    rows = [
        [token(d, t.source), token(d, t.destination), token(d, t.output), num(t.qk), num(t.ov), num(t.score)]
        for t in tri.trigrams
    ]
    title = f"skip-trigrams of head {tri.head}: [source] ... [destination] -> [output], strongest first"
    return title + "\n" + table(["source", "destination", "output", "qk", "ov", "score"], rows)


@register(TEXT, Bigrams)
def bigrams_text(bi: Bigrams) -> str:
    d = decoder(bi)
    rows = [[token(d, b.token), token(d, b.next), num(b.logit)] for b in bi.bigrams]
    return "bigrams of the direct path W_E W_U (centred logits):\n" + table(["token", "next", "logit"], rows)


@register(TEXT, PathSummary)
def paths_text(p: PathSummary) -> str:
    ti = p.importance
    runs = ["uniform", *(["direct path"] + [f"orders 0..{i}" for i in range(1, len(ti.run_losses))])]
    losses = [ti.uniform_loss, *ti.run_losses]
    terms = lambda effects: [[e.name, num(e.loss_change, 4), num(e.size)] for e in effects]  # noqa: E731
    lines = [
        f"PathSummary on {p.shape[0]} x {p.shape[1]} tokens: the terms sum to the logits to "
        f"{p.reconstruction_error:.2e} (max |difference|); model loss {num(ti.full_loss)} nats",
        "loss by run:  " + "  ".join(f"{r} {num(v)}" for r, v in zip(runs, losses)),
        "marginal loss reduction by order:  " + "  ".join(num(v) for v in ti.marginal_by_order),
        "single-head terms (loss increase when removed):",
        table(["term", "loss_change", "rms_logit"], terms(p.singles)),
    ]
    if p.virtual:
        lines.append("virtual-head terms:")
        lines.append(table(["term", "loss_change", "rms_logit"], terms(p.virtual)))
    return "\n".join(lines)


@register(TEXT, TermEffects)
def term_effects_text(t: TermEffects) -> str:
    terms = lambda effects: [[e.name, num(e.loss_change, 4), num(e.size)] for e in effects]  # noqa: E731
    lines = ["TermEffects: single-head terms (loss increase when removed):"]
    lines.append(table(["term", "loss_change", "rms_logit"], terms(t.singles)))
    if t.virtual:
        lines += ["virtual-head terms:", table(["term", "loss_change", "rms_logit"], terms(t.virtual))]
    return "\n".join(lines)


@register(TEXT, InductionProbe)
def probe_text(p: InductionProbe) -> str:
    L, H = p.induction_attention.shape
    best = "none (fewer than 2 layers)" if p.best_head is None else f"{p.best_head[0]}.{p.best_head[1]} ({num(p.best)})"
    rows = [[l, *(num(float(v)) for v in p.induction_attention[l])] for l in range(L)]
    copies = ", ".join(f"copy {i + 1}: {num(v)}" for i, v in enumerate(p.loss_by_copy))
    return (
        f"InductionProbe: {p.length} random tokens per copy; loss {copies} nats; best induction head {best}\n"
        + table(["layer", *(f"head {h}" for h in range(H))], rows)
    )
