"""Every number of a qkov report, computed from a checkpoint into a :class:`Report`.

The report page draws only what :func:`collect` returns (it is also written as
``report.json``), so each figure is backed by a number a test or a user can read. The
sections and their JSON are defined in :mod:`qkov.apps.report.sections`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from ... import ranks
from ...analysis.circuits import trigrams
from ...analysis.circuits.copying import DIAG_EXACT_MAX, check_diag_k, eigen_copying_score, ov_eigenvalues
from ...analysis.circuits.report import bandwidth
from ...analysis.circuits.qk_ov import full_ov
from ...analysis.circuits.composition import Composition, composition_scores
from ...analysis.forward.cache import Trace
from ...analysis.forward.frozen import frozen_recording
from ...analysis.forward.tracer import trace
from ...analysis.heads.pattern_scores import text_sites
from ...analysis.heads.report import SCORE_COLUMNS, HeadReport, head_report
from ...analysis.paths.summary import PathSummary, summarize
from ...analysis.paths.expansion import default_batch, paths_batch
from ...analysis.paths.effects import TermEffect
from ...analysis.heads.probes import NOT_TEXT, InductionProbe, default_icl_examples, icl_left_out, icl_score, induction_probe
from ...device import pick_device
from ...errors import QkovError
from ...finite import rounded, rounded_array
from ...io.checkpoint import checkpoint_info, read_metrics
from ...io.sources import load_any, source_kind
from ...model.tokens import token_decoder
from ...model.transformer import Transformer
from ...progress import Progress
from ...weights.view import Weights
from ..inputs import AnalysisInput, analysis_inputs
from ..origin import UNKNOWN, parameter_count, source_origin
from .discovery import circuit_section
from .interventions import causal_section, patching_section, read_patching
from .card import Card, Curve, TrainingRecord
from .sections import (
    Absent,
    AttentionSection,
    BigramRow,
    CompositionKind,
    CompositionSection,
    EigenHead,
    EigenSection,
    HeadRow,
    HeadsSection,
    HeadTrigrams,
    ICLSection,
    ICLSummary,
    Pair,
    RepeatCurves,
    Report,
    TrigramRow,
    TrigramsSection,
)

__all__ = [
    "attention_section",
    "bigram_rows",
    "collect",
    "composition_section",
    "Decode",
    "DIGITS",
    "heads_section",
    "repeat_curves",
    "text_recording",
    "TRIGRAM_HEADS",
    "trigram_rows",
]

Decode = Callable[[int], str]

TRIGRAM_HEADS = 4  # layer-0 heads with a skip-trigram table above a vocabulary of DIAG_EXACT_MAX


DIGITS = 4  # significant digits of report.json's numbers (keeps it small)


def _rl(values: Any, digits: int = DIGITS) -> Any:
    """A (nested) list of numbers as rounded floats (NaN/inf: ``None``)."""
    if isinstance(values, (list, tuple)):
        return [_rl(v, digits) for v in values]
    return rounded(values, digits)


def _rd(d: dict[str, Any]) -> dict[str, Any]:
    """A dict with its float values rounded to :data:`DIGITS`."""
    return {k: (rounded(v, DIGITS) if isinstance(v, float) else v) for k, v in d.items()}


@contextmanager
def _stage(timings: dict[str, float], name: str, progress: Progress | None) -> Iterator[None]:
    """One stage of the report, timed: ``progress(name, 0, 1)`` when it starts, ``(name, 1, 1)`` when it ends."""
    if progress is not None:
        progress(name, 0, 1)
    t0 = time.perf_counter()
    yield
    timings[name] = round(time.perf_counter() - t0, 3)
    if progress is not None:
        progress(name, 1, 1)


# ---------------------------------------------------------------------- sections
def _card(ckpt: Path, model: Transformer, w: Weights) -> Card:
    kind, origin = source_kind(ckpt), source_origin(ckpt)
    record, metrics = None, []
    if kind == "qkov" and origin is None:  # trained by qkov: its record (an imported one has none)
        info = checkpoint_info(ckpt, model)
        record = TrainingRecord(**{k: v for k, v in info.items() if k not in ("path", "model", "parameters")})
        metrics = read_metrics(ckpt)
    evals = [m for m in metrics if "val_loss" in m]
    logs = [m for m in metrics if "train_loss" in m and "val_loss" not in m]
    logs = logs[:: max(1, len(logs) // 250)]  # a readable curve, not every logged step
    curve = Curve(
        tokens=[m.get("tokens") for m in evals],
        val_loss=_rl([m["val_loss"] for m in evals]),
        induction=_rl([m.get("induction_score", float("nan")) for m in evals]),
        train_tokens=[m.get("tokens") for m in logs],
        train_loss=_rl([m["train_loss"] for m in logs]),
    )
    bw = [b.to_dict() for b in bandwidth(model.cfg)]
    view = {"fold_ln": w.norm == "folded", "center_writing": w.centered_writing, "center_unembed": w.centered_unembed}
    source = None if origin is None else str(origin.get("format", kind))
    card = Card(str(ckpt), model.cfg.to_dict(), parameter_count(ckpt, model), curve, bw, record, source, view)
    if origin is not None:
        card.origin, card.unknown = origin, list(UNKNOWN)
    return card


def _heads(
    w: Weights,
    bos: int,
    text: torch.Tensor,
    inputs: AnalysisInput,
    icl_text: torch.Tensor,
    diag: tuple[int, int | None],
    recording: Trace | None = None,
) -> tuple[HeadsSection, list[float] | None, dict[str, str]]:
    freqs, natural = inputs.frequencies, inputs.natural
    k, sample = diag
    rep = head_report(
        w, text, bos=bos, frequencies=freqs, icl_text=icl_text, diag_k=k or None, diag_sample=sample, icl=natural,
        recording=recording,
    )
    return heads_section(rep), None if rep.icl is None else rep.icl.loss_by_position, rep.left_out


def heads_section(rep: HeadReport) -> HeadsSection:
    """The heads section of a head report (scores rounded as the page shows them)."""
    rows = [HeadRow.from_dict(_rd(row)) for row in rep.rows()]
    icl = None if rep.icl is None else ICLSummary(rep.icl.score, rep.icl.early, rep.icl.late)
    columns = [list(c) for c in SCORE_COLUMNS]
    return HeadsSection(rows, rep.thresholds, len(rep.memory_neurons), icl, columns, rep.diag_tokens)


def _eigenvalues(w: Weights) -> EigenSection:
    ev = ov_eigenvalues(w)  # [L, H, d_head] complex
    score = eigen_copying_score(ev)
    out = []
    for l in range(ev.shape[0]):
        for h in range(ev.shape[1]):
            e = ev[l, h]
            scale = float(e.abs().max()) or 1.0
            re, im = _rl((e.real / scale).tolist(), 3), _rl((e.imag / scale).tolist(), 3)
            out.append(EigenHead(f"{l}.{h}", rounded(scale, DIGITS), re, im, rounded(score[l, h], DIGITS)))
    return EigenSection(out)


def _composition(w: Weights) -> CompositionSection | Absent:
    if w.cfg.n_layers < 2:
        return Absent("composition needs at least two layers" if w.cfg.n_layers else "a 0-layer model has no heads")
    return composition_section(composition_scores(w, "qkv"))


def composition_section(scores: Mapping[str, Composition]) -> CompositionSection:
    """Heatmaps ``[writer][reader]`` (every head of layers ``0..L-2`` by every head of ``1..L-1``)
    and the 10 strongest pairs of each kind of ``scores`` (``{kind: Composition}``, L >= 2)."""
    L, H = next(iter(scores.values())).raw.shape[:2]
    writers = [f"{l}.{h}" for l in range(L - 1) for h in range(H)]
    readers = [f"{l}.{h}" for l in range(1, L) for h in range(H)]
    # a cell (writer, reader) only means something when the writer's layer is earlier
    wl = torch.tensor([l for l in range(L - 1) for _ in range(H)])
    rl = torch.tensor([l for l in range(1, L) for _ in range(H)])
    valid = wl[:, None] < rl[None, :]
    kinds = {}
    for kind, c in scores.items():
        rawm = c.raw.cpu()[: L - 1].reshape((L - 1) * H, L, H)[:, 1:].reshape((L - 1) * H, (L - 1) * H)
        rawm = torch.where(valid, rawm, torch.full_like(rawm, float("nan")))
        kinds[kind] = CompositionKind(
            writers=writers,
            readers=readers,
            raw=_rl(rawm.tolist()),
            adjusted=_rl((rawm - c.baseline.mean).tolist()),
            baseline_mean=rounded(c.baseline.mean, DIGITS),
            baseline_std=rounded(c.baseline.std, DIGITS),
            top=[Pair(**_rd(p)) for p in c.pairs()[:10]],
            offsets=c.offsets,
        )
    return CompositionSection(kinds)


def text_recording(w: Weights, text: torch.Tensor) -> Trace:
    """The report's one recorded run of its text: the pass over the sequences the path expansion reads
    (the first :func:`~qkov.analysis.paths.expansion.paths_batch` of ``text [B, T]``), caching the union of
    what the sections that read them need: the expansion's frozen sites
    (:func:`~qkov.analysis.forward.frozen.frozen_sites`) and the heads' text-score sites
    (:func:`~qkov.analysis.heads.pattern_scores.text_sites`). The heads' text scores and the paths section read
    it instead of running the text again."""
    return frozen_recording(w, text[: paths_batch(w.cfg, len(text))], cache=tuple(text_sites(w)))


def _paths(w: Weights, tokens: torch.Tensor, top: int, recording: Trace | None = None) -> PathSummary:
    s = summarize(w, tokens[: paths_batch(w.cfg, len(tokens))], top_virtual=top, recording=recording)
    kept = lambda effects: [TermEffect(e.name, rounded(e.loss_change, DIGITS), rounded(e.size, DIGITS)) for e in effects]  # noqa: E731
    effects = kept(s.singles), kept(s.virtual)
    return PathSummary(s.shape, s.reconstruction_error, s.importance, *effects, s.coverage, s.effect_positions)


def attention_section(w: Weights, tokens: torch.Tensor, decode: Decode) -> AttentionSection:
    """The viewer's section: every head's pattern on ``tokens [seq]`` (one sequence).

    Its own pass, not a corner of the report's :func:`text_recording` (attention is causal, so the values are
    the same, but not always to the last bit: at GPT-2-small size a few rounded entries would move)."""
    pat = trace(w, tokens[None], cache="pattern.*", logits=False).stack("pattern")[:, 0].float().cpu()  # [L, H, T, T]
    T, (L, H) = tokens.shape[0], pat.shape[:2]
    # lower triangle only, row by row: row q has q+1 entries
    r = rounded_array(pat.numpy(), 3)  # 3 significant digits (JSON writes a NaN as null)
    rows = [[[r[l, h, q, : q + 1].tolist() for q in range(T)] for h in range(H)] for l in range(L)]
    return AttentionSection(tokens.tolist(), [decode(int(t)) for t in tokens], rows)


def _repeat_losses(w: Weights, bos: int, length: int, batch: int, seed: int) -> RepeatCurves:
    """Per-position loss on random tokens repeated twice: the first copy is unpredictable,
    the second can be copied from context (induction)."""
    return repeat_curves(induction_probe(w, bos=bos, length=length, repeats=2, batch=batch, seed=seed))


def repeat_curves(probe: InductionProbe) -> RepeatCurves:
    """The loss curves of the first two copies of a probe's repeated tokens."""
    n, nll = probe.length, probe.loss_by_position
    # token j of copy r sits at position 1 + r*n + j and is predicted at position r*n + j
    return RepeatCurves(n, _rl(nll[0:n]), _rl(nll[n : 2 * n]), probe.loss_by_copy[0], probe.loss_by_copy[1])


def _icl(w: Weights, bos: int, seed: int, curve: list[float] | None, info: ICLSummary | None) -> ICLSection:
    """The ICL section: the text's loss curve and score (when there is one) and the repeat curves."""
    repeat = _repeat_losses(w, bos, min(100, (w.cfg.n_ctx - 1) // 2), batch=16, seed=seed)
    curve_r = None if curve is None else _rl(curve)
    return ICLSection(curve_r, repeat, *(() if info is None else (info.score, info.early, info.late)))


def _trigram_heads(w: Weights) -> tuple[list[int], str | None]:
    """The layer-0 heads that get a skip-trigram table: all of them, or above a vocabulary of
    :data:`~qkov.analysis.circuits.copying.DIAG_EXACT_MAX` tokens (~5 s per head at GPT-2's) the
    :data:`TRIGRAM_HEADS` with the largest full OV circuits (Frobenius norm), and a note saying so."""
    H = w.cfg.n_heads if w.cfg.n_layers >= 1 else 0
    if w.cfg.d_vocab <= DIAG_EXACT_MAX or H <= TRIGRAM_HEADS:
        return list(range(H)), None
    norms = torch.stack([full_ov(w, 0, h).norm() for h in range(H)])
    chosen = sorted(norms.argsort(descending=True)[:TRIGRAM_HEADS].tolist())
    note = (
        f"Tables of {TRIGRAM_HEADS} of the {H} layer-0 heads (those with the largest full OV circuits: each table "
        f"searches the whole {w.cfg.d_vocab:,}-token vocabulary); qkov trigrams --head 0.H shows any other."
    )
    return chosen, note


def _trigrams(w: Weights, decode: Decode, bos: int, top: int) -> TrigramsSection:
    chosen, note = _trigram_heads(w)
    sp = ranks.current()  # a unit: one head's table
    mine = [i for i in range(len(chosen)) if sp.mine(i, len(chosen))]
    parts = {i: trigrams.skip_trigrams(w, 0, chosen[i], top=top).trigrams for i in mine}
    heads = [HeadTrigrams(f"0.{h}", trigram_rows(tri, decode)) for h, tri in zip(chosen, sp.gather(parts, len(chosen)))]
    return TrigramsSection(heads, bigram_rows(trigrams.bigrams(w, top=top).bigrams, decode), note)


def trigram_rows(tri: list[trigrams.SkipTrigram], decode: Decode) -> list[TrigramRow]:
    return [TrigramRow(**_rd(t.to_dict(decode))) for t in tri]


def bigram_rows(bi: list[trigrams.Bigram], decode: Decode) -> list[BigramRow]:
    return [BigramRow(**_rd(b.to_dict(decode))) for b in bi]


def _inputs(
    ckpt: Path, model: Transformer, tokens: torch.Tensor | Path | None, text: Path | None, rows: int, seed: int
) -> AnalysisInput:
    if not isinstance(tokens, torch.Tensor):
        return analysis_inputs(ckpt, model, text=text, tokens=tokens, batch=rows, want_corpus=True, seed=seed)
    if tokens.ndim != 2 or tokens.shape[1] > model.cfg.n_ctx:
        raise QkovError(f"report: tokens must be [batch, <= {model.cfg.n_ctx}], got {list(tokens.shape)}")
    return AnalysisInput(tokens.long(), None, "token ids given by the caller")


def _icl_without_heads(w: Weights, ids: torch.Tensor, natural: bool) -> tuple[Any, ICLSummary | None, dict[str, str]]:
    """The ICL curve of a 0-layer model (natural text as long as the score reads only:
    :func:`~qkov.analysis.heads.probes.icl_left_out`), or why it is left out."""
    reason = NOT_TEXT if not natural else icl_left_out(ids.shape[1], w.cfg.n_ctx)
    if reason is not None:
        return None, None, {"icl": reason}
    icl = icl_score(w, ids)
    return icl.loss_by_position, ICLSummary(icl.score, icl.early, icl.late), {}


def collect(
    ckpt: Path | str,
    *,
    config: Path | None = None,
    batch: int | None = None,
    icl_examples: int | None = None,
    viewer_tokens: int = 128,
    top: int = 20,
    seed: int = 0,
    device: str = "auto",
    text: Path | None = None,
    tokens: torch.Tensor | Path | None = None,
    diag_k: int = 5,
    diag_sample: int | None = None,
    clean: Path | None = None,
    corrupted: Path | None = None,
    metric: str | None = None,
    progress: Progress | None = None,
) -> Report:
    """Compute every number of the report of checkpoint ``ckpt``.

    Args:
        ckpt: a qkov checkpoint, or any source :func:`qkov.io.load_any` reads (a
            Hugging Face directory, a TransformerLens file with ``config``, a Hub name).
        batch: sequences (of ``n_ctx`` tokens) for the pattern-based head scores and the path
            expansion (at most 2048 tokens of them); default :func:`~qkov.analysis.paths.expansion.default_batch`.
        icl_examples: sequences for the ICL curve; default :func:`~qkov.analysis.heads.probes.default_icl_examples`.
        viewer_tokens: tokens of validation text shown in the attention viewer.
        top: rows of each skip-trigram / bigram / term table.
        text: a text file to analyse instead of the training corpus's validation split.
        tokens: token ids to analyse instead (for models without a corpus or tokenizer): a
            ``[B, n_ctx]`` tensor or a token file (:func:`qkov.apps.inputs.read_token_file`); the
            first ``batch`` rows serve the paths and head scores, all of them the ICL curve. With
            none of these and no corpus, seeded random tokens (no ICL score; the report says so).
        diag_k: k of the heads' "own logit in the top k of its OV row" rate; 0 skips it.
        diag_sample: tokens that rate is measured on: ``None`` = all up to a vocabulary of 8192
            (exact), else a seeded sample of 1024 with its standard error
            (:func:`qkov.analysis.circuits.copying.copying_scores`).
        clean: the clean text or token file of a patching section (as ``qkov patch`` reads it).
        corrupted: its corrupted counterpart, of the same length in tokens.
        metric: what the patching section measures (``loss``, ``logit-diff:A,B``, ``prob:T``).
        progress: ``progress(stage, done, total)`` (:class:`qkov.progress.Progress`) as each stage starts and ends.
    Raises:
        QkovError: the checkpoint or a given file cannot be read.
    """
    ckpt = Path(ckpt)
    dev = pick_device(device)
    timings: dict[str, float] = {}
    t_start = time.perf_counter()
    with _stage(timings, "load", progress):
        model = load_any(ckpt, config=config).to(dev).eval()
        batch = batch or default_batch(model.cfg.n_ctx)
        icl_examples = icl_examples or default_icl_examples(model.cfg)
        if diag_k:
            check_diag_k(diag_k, model.cfg.d_vocab)  # before the long work
        inputs = _inputs(ckpt, model, tokens, text, max(batch, icl_examples), seed)
        pair = read_patching(model, clean, corrupted, metric, dev)  # bad input fails before the work
        text_ids = inputs.tokens.to(dev)
        w = Weights.from_model(model, device=dev)  # the default view: TransformerLens's processed weights
    decode, bos = token_decoder(model.tokenizer), model.bos_token_id
    with _stage(timings, "model card", progress):
        card = _card(ckpt, model, w)
    del model  # the view holds what the analyses read (GPT-2 small: 0.65 GB less at the peak)
    opts = dict(batch=batch, icl_examples=icl_examples, viewer_tokens=viewer_tokens, top=top, seed=seed)
    sections = _sections(w, text_ids, inputs, decode, bos, pair, (diag_k, diag_sample), timings, progress, **opts)
    timings["total"] = round(time.perf_counter() - t_start, 3)
    return Report(str(ckpt), ckpt.name, card, timings=timings, inputs=inputs.source, **sections)


def _sections(
    w: Weights,
    text_ids: torch.Tensor,
    inputs: AnalysisInput,
    decode: Decode,
    bos: int,
    pair: Any,
    diag: tuple[int, int | None],
    timings: dict[str, float],
    progress: Progress | None,
    *,
    batch: int,
    icl_examples: int,
    viewer_tokens: int,
    top: int,
    seed: int,
) -> dict[str, Any]:
    """Every section after the card, by :class:`Report` field, each timed as its own stage."""
    L = w.cfg.n_layers
    heads: Any = Absent("a 0-layer model has no attention heads")
    eigen: Any = heads
    recording = None  # the one recorded run of the text (text_recording), made by the first section to read it
    if L >= 1:
        with _stage(timings, "heads", progress):
            recording = text_recording(w, text_ids[:batch])
            text, icl_text = text_ids[:batch], text_ids[:icl_examples]
            heads, icl_curve, left_out = _heads(w, bos, text, inputs, icl_text, diag, recording)
            icl_info = heads.icl
        with _stage(timings, "OV eigenvalues", progress):
            eigen = _eigenvalues(w)
    else:
        icl_curve, icl_info, left_out = _icl_without_heads(w, text_ids[:icl_examples], inputs.natural)
    with _stage(timings, "composition", progress):
        composition = _composition(w)
    with _stage(timings, "paths", progress):
        paths = _paths(w, text_ids[:batch], top, recording)
        del recording  # the last section that reads it
    with _stage(timings, "attention", progress):
        viewer = text_ids[0, : min(viewer_tokens, w.cfg.n_ctx)]
        attention: Any = attention_section(w, viewer, decode) if L >= 1 else Absent("a 0-layer model has no attention")
    with _stage(timings, "in-context learning", progress):
        icl_section = _icl(w, bos, seed, icl_curve, icl_info)
    with _stage(timings, "skip-trigrams", progress):
        tri = _trigrams(w, decode, bos, top)
    with _stage(timings, "composition paths (path patching)", progress):
        icl_text = text_ids[:icl_examples] if inputs.natural else None
        causal = causal_section(w, heads, composition, icl_text, bos, seed)
    with _stage(timings, "patching", progress):
        patching = patching_section(w, pair)
    with _stage(timings, "circuit (found by EAP)", progress):
        circuit = circuit_section(w, seed=seed)
    return dict(
        heads=heads, eigenvalues=eigen, composition=composition, paths=paths, attention=attention, icl=icl_section,
        trigrams=tri, causal=causal, patching=patching, circuit=circuit, left_out=left_out,
    )  # fmt: skip
