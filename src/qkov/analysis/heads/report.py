"""Head detectors measured on behaviour, thresholds, and the roles they assign [F, I].

Pattern-based scores take patterns ``[n_layers, batch, n_heads, query, key]`` from natural
text and return ``[n_layers, n_heads]``; [I]'s repeated-token scores (:mod:`qkov.analysis.heads.repeated`)
run the model on :func:`qkov.analysis.heads.probes.prefix_matching_tokens`; weight-based scores come from
:mod:`qkov.analysis.circuits`. :func:`head_report` computes all of them for one model and
assigns roles from :data:`THRESHOLDS`. Every pass is :func:`qkov.analysis.forward.tracer.trace` on a
:class:`~qkov.weights.WeightSource`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ...device import check_fits, memory_budget, tune_allocator_for
from ...errors import QkovError
from ...expect import token_ids
from ...finite import finite
from ...weights.convert import SourceLike, as_source, source_bos
from ...weights.parts import WeightSource
from ..circuits.copying import check_diag_k, copying_scores
from .probes import NOT_TEXT, ICLScore, icl_left_out, icl_score, prefix_matching_tokens
from .repeated import RepeatPass
from ...progress import Progress
from ..shown import Shown
from ..forward.cache import Trace
from .pattern_scores import TEXT_CHUNK_BYTES, chunk_size, sequence_bytes, text_scores
from ..shown import TEXT, num, register, table

__all__ = [
    "assign_roles",
    "head_report",
    "HeadReport",
    "heads_text",
    "memory_neurons",
    "POSITIONAL_NA",
    "ROLES",
    "SCORE_COLUMNS",
    "THRESHOLDS",
]

# =========================================================================== detectors


def memory_neurons(source: SourceLike, threshold: float = -0.5) -> list[dict[str, float]]:
    """MLP neurons whose input and output weights point in nearly opposite directions ([F]).

    ``cos(W_in[:, n], W_out[n, :]) < threshold``: the neuron reads a direction and writes its
    negation (it deletes what it reads). Empty for attention-only models.
    """
    source = as_source(source, where="qkov.memory_neurons")
    out = []
    for l in range(source.cfg.n_layers):
        mlp = source.mlp(l)
        if mlp is None:
            return []
        cos = torch.nn.functional.cosine_similarity(mlp.W_in.T, mlp.W_out, dim=-1)  # [M]
        out += [{"layer": l, "neuron": int(n), "cosine": float(cos[n])} for n in torch.nonzero(cos < threshold)[:, 0]]
    return out


# ---------------------------------------------------------------------- thresholds
# Roles are assigned from these thresholds. Each sits far above what untrained heads score
# (benchmarks/null_scores.py: 8 seeds x 8 heads of the default shape on validation text;
# mean / max shown), so a role means trained structure, not chance.
THRESHOLDS: dict[str, float] = {
    "copying": 0.5,  # eigenvalue copying score; untrained -0.01 / 0.10 (min -0.11)
    "previous_token": 0.3,  # mean A[i, i-1] on text; untrained 0.02 / 0.02
    "induction": 0.3,  # prefix-matching score ([I]'s procedure); untrained 0.03 / 0.03 ...
    "induction_copying": 0.5,  # ... and rank copying above this; untrained 0.01 / 0.13 (std 0.05)
    "sink": 0.3,  # mean attention to position 0 (Gu et al. 2024's criterion); untrained 0.02 / 0.02
    "positional": 0.5,  # share of the score variance over keys explained by position alone; untrained 0.27 / 0.29
    "memory_eigen": -0.5,  # residual-space OV eigen score below this (untrained 0.00, min -0.12) ...
    "memory_self": 0.3,  # ... and mean attention to the current token above this (untrained 0.02)
}
POSITIONAL_NA = (
    "not applicable: the model has no positional embedding ({} positions), so no part of an attention score "
    "is position alone (qkov circuits shows a rotary head's offset profile instead)"
)
"""Why the positional score is left out (n/a) on a model without ``W_pos``."""
ROLES = ("copying", "positional", "previous-token", "induction", "sink", "memory-management")
SCORE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("prev", "previous_token"),
    ("self", "self_attention"),
    ("sink", "sink"),
    ("pos", "positional_fraction"),
    ("prefix", "prefix_matching"),
    ("induct", "induction"),
    ("dup", "duplicate_token"),
    ("copy[I]", "copying"),
    ("copy rank", "copying_rank"),
    ("eig", "eigen_copying"),
    ("res eig", "residual_eigen"),
)
"""The per-head scores tables show, as (column label, score name): the CLI's table and the
report page both read this list (the report carries it in its JSON)."""


@dataclass(repr=False)
class HeadReport(Shown):
    """Every per-head score, ``[n_layers, n_heads]`` each, and the roles assigned from them."""

    scores: dict[str, Tensor]
    roles: list[list[list[str]]]  # [layer][head] -> roles
    icl: ICLScore | None
    memory_neurons: list[dict[str, float]]
    thresholds: dict[str, float]
    diag_tokens: int | None = None  # tokens the diag_top<k> rate was measured on (d_vocab: exact)
    copying_queries: tuple[int, int] | None = None  # (read, all) repeated queries of the copying scores
    left_out: dict[str, str] = field(default_factory=dict)  # score -> why it was not measured (its value: None)

    def rows(self) -> list[dict[str, object]]:
        L, H = next(iter(self.scores.values())).shape
        out = []
        for l in range(L):
            for h in range(H):
                row: dict[str, object] = {"head": f"{l}.{h}", "layer": l, "index": h}
                row.update({k: finite(v[l, h]) for k, v in self.scores.items()})  # a NaN (does not apply): None
                row["roles"] = self.roles[l][h]
                out.append(row)
        return out

    def to_dict(self) -> dict[str, object]:
        return {
            "heads": self.rows(),
            "icl": None if self.icl is None else vars(self.icl),
            "memory_neurons": self.memory_neurons,
            "thresholds": self.thresholds,
            "diag_tokens": self.diag_tokens,
            "copying_queries": None if self.copying_queries is None else list(self.copying_queries),
            "left_out": dict(self.left_out),
        }


def _not_measured(source: WeightSource, icl_on: Tensor, icl: bool) -> dict[str, str]:
    """The scores a head report leaves out, and why: the ICL score on tokens that are not text or too
    short; the positional score on a model without ``W_pos`` (it splits W_pos's part from the
    attention score: there is nothing to split)."""
    cfg = source.cfg
    reason = icl_left_out(icl_on.shape[1], cfg.n_ctx) if icl else NOT_TEXT
    out = {} if reason is None else {"icl": reason}
    if source.pos() is None:
        out["positional_fraction"] = POSITIONAL_NA.format(cfg.positional)
    return out


def assign_roles(scores: dict[str, Tensor], thresholds: dict[str, float] = THRESHOLDS) -> list[list[list[str]]]:
    """Roles per head from the scores (several may apply); see :data:`THRESHOLDS`."""
    L, H = scores["eigen_copying"].shape
    roles: list[list[list[str]]] = []
    for l in range(L):
        layer = []
        for h in range(H):
            r = []
            if scores["eigen_copying"][l, h] > thresholds["copying"]:
                r.append("copying")
            if scores["positional_fraction"][l, h] > thresholds["positional"]:
                r.append("positional")
            if scores["previous_token"][l, h] > thresholds["previous_token"]:
                r.append("previous-token")
            # [I]: prefix matching AND copying, both measured on the repeated tokens
            if (
                scores["prefix_matching"][l, h] > thresholds["induction"]
                and scores["copying_rank"][l, h] > thresholds["induction_copying"]
            ):
                r.append("induction")
            if scores["sink"][l, h] > thresholds["sink"]:
                r.append("sink")
            if (
                scores["residual_eigen"][l, h] < thresholds["memory_eigen"]
                and scores["self_attention"][l, h] > thresholds["memory_self"]
            ):
                r.append("memory-management")
            layer.append(r)
        roles.append(layer)
    return roles


def head_report(
    source: SourceLike,
    text: Tensor,
    *,
    bos: int | None = None,
    frequencies: np.ndarray | None = None,
    seed: int = 0,
    diag_k: int | None = 5,
    diag_sample: int | None = None,
    thresholds: dict[str, float] = THRESHOLDS,
    icl_text: Tensor | None = None,
    icl: bool = True,
    icl_curve: bool = True,
    progress: Progress | None = None,
    recording: Trace | None = None,
) -> HeadReport:
    """Every detector on one model: ``text [B, T]`` is natural (validation) text.

    Natural text gives previous-token, self-attention, sink (and value-weighted sink) and positional scores
    and the ICL score and curve (on ``icl_text`` when given: the score compares two windows of 10 positions,
    so it wants hundreds of examples); [I]'s repeated random tokens (seeded, start token ``bos``, drawn away
    from the most and least frequent ids when ``frequencies`` are given) give prefix matching, induction,
    duplicate-token and copying; the weights give the eigenvalue copying scores and the diagonal top-k rate
    (exact up to 8192 tokens, else estimated on ``diag_sample`` tokens:
    :func:`~qkov.analysis.circuits.copying.copying_scores`). ``icl=False`` leaves the ICL score out (for text
    without structure, such as random tokens), and so does text shorter than the score reads
    (:func:`~qkov.analysis.heads.probes.icl_left_out`); the report's ``left_out`` says why (``{"icl": reason}``).
    ``icl_curve=False``: no per-position curve (``icl.loss_by_position`` empty), the same score to float32
    rounding, unembedding only its 20 positions (GPT-2-small shape: ~3 s of ~25; the CLI's table mode).
    The text scores are streamed (:func:`~qkov.analysis.heads.pattern_scores.text_scores`); ``progress`` is
    ticked through the text, the ICL examples and the copying scores. ``source``: a model, weights source or
    path (:func:`~qkov.weights.as_source`); ``bos=None``: its start token. ``recording``: a pass already made
    over the leading sequences of ``text`` that cached :func:`~qkov.analysis.heads.pattern_scores.text_sites`
    (the report's one recorded run of the text): the text scores read those sequences from it."""
    source = as_source(source, where="qkov.head_report")
    bos = source_bos("qkov.head_report", source, bos)
    cfg = source.cfg
    text = token_ids("qkov.head_report", text, cfg, "text").to(source.device)
    if icl_text is not None:
        icl_text = token_ids("qkov.head_report", icl_text, cfg, "icl_text").to(source.device)
    if cfg.n_layers == 0:
        raise QkovError("heads: the model has no attention layers")
    if diag_k:
        check_diag_k(diag_k, cfg.d_vocab)  # before any work
    have, _ = memory_budget(source.device)
    chunk = chunk_size(source, text.shape[1], TEXT_CHUNK_BYTES if have is None else min(TEXT_CHUNK_BYTES, have))
    what = f"heads: scoring one layer's attention on {text.shape[1]}-token text"
    check_fits(chunk * sequence_bytes(source, text.shape[1]), source.device, what, "analyse shorter sequences")
    tune_allocator_for(source)  # the passes below make the same large buffers again and again
    on_text = text_scores(source, text, chunk=chunk, progress=progress, recording=recording)
    length = min(25, (cfg.n_ctx - 1) // 4)
    rep = prefix_matching_tokens(source, length=length, seed=seed, bos=bos, frequencies=frequencies)
    repeat = RepeatPass(source, rep, length)  # reads the W_O W_U the copying scores form: handed over
    copying = copying_scores(
        source, diag_k=diag_k, diag_sample=diag_sample, seed=seed, progress=progress, on_head=repeat.copying
    ).heads
    rs = repeat.scores()
    L, H = cfg.n_layers, cfg.n_heads
    scores = {
        **on_text,
        "prefix_matching": rs.prefix_matching,
        "induction": rs.induction_attention,
        "duplicate_token": rs.duplicate,
        "copying": rs.copying,
        "copying_rank": rs.copying_rank,
        "eigen_copying": torch.tensor([c.eigen_score for c in copying]).reshape(L, H),
        "residual_eigen": torch.tensor([c.residual_eigen_score for c in copying]).reshape(L, H),
    }
    if diag_k:
        scores[f"diag_top{diag_k}"] = torch.tensor([c.diag_topk_rate for c in copying]).reshape(L, H)
    scores = {k: v.detach().float().cpu() for k, v in scores.items()}
    icl_on = text if icl_text is None else icl_text  # ICL compares two narrow windows: it needs many examples
    left_out = _not_measured(source, icl_on, icl)
    if "positional_fraction" in left_out:
        scores["positional_fraction"] = torch.full((L, H), float("nan"))
    icl_result = None if "icl" in left_out else icl_score(source, icl_on, progress=progress, curve=icl_curve)
    roles = assign_roles(scores, thresholds)
    n_diag = copying[0].diag_tokens if copying else None
    neurons = memory_neurons(source)
    return HeadReport(scores, roles, icl_result, neurons, dict(thresholds), n_diag, rs.copying_queries, left_out)


@register(TEXT, HeadReport)
def heads_text(rep: HeadReport) -> str:
    rows = rep.rows()
    cols = [(label, name) for label, name in SCORE_COLUMNS if name in rep.scores]
    body = [[r["head"], *(num(r[n], 2) for _, n in cols), ",".join(r["roles"]) or "-"] for r in rows]  # type: ignore[arg-type]
    icl = "" if rep.icl is None else f"; ICL score {num(rep.icl.score)} (token {rep.icl.late} - token {rep.icl.early})"
    icl += "".join(f"; {name} score left out: {why}" for name, why in rep.left_out.items())
    title = f"HeadReport: {len(rows)} heads{icl}; memory-management neurons: {len(rep.memory_neurons)}"
    return title + "\n" + table(["head", *(c.replace(" ", "_") for c, _ in cols), "roles"], body)
