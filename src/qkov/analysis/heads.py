"""Head detectors measured on behaviour, thresholds, and the roles they assign [F, I].

Pattern-based scores take patterns ``[n_layers, batch, n_heads, query, key]`` from natural
text and return ``[n_layers, n_heads]``; [I]'s repeated-token scores run the model on
:func:`qkov.analysis.probes.prefix_matching_tokens`; weight-based scores come from
:mod:`qkov.analysis.circuits`. :func:`head_report` computes all of them for one model and
assigns roles from :data:`THRESHOLDS`. Every run is :func:`qkov.analysis.forward.trace` on a
:class:`~qkov.weights.WeightSource`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ..deprecated import renamed_property
from ..device import check_fits, memory_budget
from ..errors import QkovError
from ..weights.convert import SourceLike, as_source, source_bos
from .budget import COPYING_LOGITS as COPYING_LOGITS
from . import split
from .circuits import check_diag_k, copying_scores
from .forward import trace
from .probes import NOT_TEXT, ICLScore, icl_left_out, icl_score, induction_attention, prefix_matching_tokens
from .progress import Progress
from .sampling import seeded_subset
from .shown import Shown
from .text_scores import TEXT_CHUNK_BYTES, chunk_size, sequence_bytes, text_scores
from .text_scores import positional_fraction as positional_fraction
from .text_scores import previous_token_scores as previous_token_scores
from .text_scores import self_attention_scores as self_attention_scores
from .text_scores import sink_scores as sink_scores
from .text_scores import value_weighted_sink_scores as value_weighted_sink_scores

# =========================================================================== detectors


@dataclass
class RepeatScores:
    """Scores on repeated random tokens, each ``[n_layers, n_heads]``. ``induction_attention`` is the
    measure :attr:`~qkov.analysis.probes.InductionProbe.induction_attention` reads; the *induction role*
    reads ``prefix_matching`` and ``copying_rank`` (:data:`THRESHOLDS`)."""

    prefix_matching: Tensor  # attention to the tokens after the current token's earlier occurrences
    induction_attention: Tensor  # attention to the token after the most recent earlier occurrence
    duplicate: Tensor  # attention to the current token's earlier occurrences
    copying: Tensor  # [I] copying score in [-1, 1] (share of the raise on attended tokens)
    copying_rank: Tensor  # where the head's logits rank the token it attends to most, in [-1, 1]
    copying_queries: tuple[int, int] = (0, 0)  # (queries the copying scores read, repeated queries in all)

    induction = renamed_property("induction", "induction_attention", "RepeatScores")


def repeat_scores(source: SourceLike, tokens: Tensor, length: int) -> RepeatScores:
    """Prefix matching, induction, duplicate-token and [I]'s copying score on ``tokens`` from
    :func:`~qkov.analysis.probes.prefix_matching_tokens` (blocks of ``length`` after one start token).

    Prefix matching is the attention from each repeated token to the positions right after
    *all* its earlier occurrences, summed (one earlier copy in the second block, three in the
    fourth), averaged over queries; induction is the attention to the position after the most
    recent occurrence only.

    Rank copying (the measure the induction role uses): at each repeated query, the token at
    the position the head attends to most is placed among all tokens by the head's direct logits
    (its output ``@ W_U``): the fraction of the other tokens it beats (ties count half), averaged
    over queries and rescaled to [-1, 1]. 1: the head always raises what it attends to above every
    other token; 0: chance (a random or silent head: a constant logit row scores exactly 0); -1: it
    always pushes it below every other token. Unlike the share below, it does not fade when a head
    also lifts many related tokens a little. Both read full-vocabulary logits per head and query: above
    :data:`COPYING_LOGITS` of them (GPT-2's vocabulary) a seeded sample of the queries is read
    (:func:`copying_queries`; ``copying_queries`` says how many).

    Copying ([I]): each head's output at a repeated query is mapped to logits by the direct
    path (``@ W_U``, LayerNorm folded), the mean over the vocabulary is subtracted, then
    ReLU; ``share`` is the part of that raise, summed over all repeated queries, that falls
    on the tokens the head attends to (positions with at least half of the query's largest
    attention weight). It is rescaled to [-1, 1] around chance (``chance`` = attended tokens /
    vocabulary, the share of a head raising tokens at random): ``(share - chance) / (1 - chance)``
    above chance, ``(share - chance) / chance`` below. +1: the head raises only what it attends
    to; 0: no more than chance; -1: it raises everything but what it attends to. A trained
    induction head that also lifts hundreds of related tokens a little scores small but positive.
    """
    source = as_source(source, where="qkov.repeat_scores")
    r = trace(source, tokens, record=("patterns",), cache="z.*")
    P = r.patterns  # [L, B, H, T, T]
    assert P is not None
    L, B, H, T, _ = P.shape
    queries = torch.arange(1 + length, T, device=P.device)
    pm = torch.zeros(L, H, dtype=P.dtype, device=P.device)
    dup = torch.zeros_like(pm)
    for q in queries.tolist():
        earlier = torch.arange((q - 1) % length + 1, q, length, device=P.device)  # same token, earlier
        pm += P[..., q, earlier + 1].sum(-1).mean(1)
        dup += P[..., q, earlier].sum(-1).mean(1)
    pm /= len(queries)
    dup /= len(queries)
    W_U = source.unembed().W_U
    copy, rank = torch.zeros_like(pm), torch.zeros_like(pm)
    read_q = copying_queries(queries, B, W_U.shape[-1], COPYING_LOGITS)
    sp, parts, work, W_O = split.current(), {}, None, {}  # a unit: one head, number l * H + h
    for u in (u for u in range(L * H) if sp.mine(u, L * H)):
        l, h = divmod(u, H)
        if l not in W_O:
            W_O[l] = source.attention(l).W_O  # [H, E, D]
        A, z = P[l, :, h][:, read_q], r["z", l][:, read_q]  # [B, Q, T], [B, Q, H, E]
        if work is None:  # the [B, Q, V] logits and two more, reused by every head (no page faults per head)
            work = torch.empty(3, *A.shape[:2], W_U.shape[-1], dtype=W_U.dtype, device=W_U.device)
        # the head's output z_h @ W_O[h] read by W_U, as z_h @ (W_O[h] @ W_U): d_head wide, not d_model
        logits = torch.matmul(z[:, :, h], W_O[l][h] @ W_U, out=work[0])  # [B, Q, V]
        parts[u] = _copying_in(A, logits, r.tokens, work[1], work[2])
    for u, (c, k) in enumerate(sp.gather(parts, L * H)):
        copy[u // H, u % H], rank[u // H, u % H] = c, k
    induction = induction_attention(P, length)
    counts = (len(read_q), len(queries))
    return RepeatScores(pm, induction, dup, copying=copy, copying_rank=rank, copying_queries=counts)


def copying_queries(queries: Tensor, batch: int, vocab: int, max_logits: int = COPYING_LOGITS) -> Tensor:
    """The repeated queries the copying scores read: all of them when their ``[batch, queries, vocab]``
    logits hold at most ``max_logits`` entries per head, else a seeded sample (sorted) that fits."""
    most = max(1, max_logits // (batch * vocab))
    if len(queries) <= most:
        return queries
    pick = seeded_subset(len(queries), most)
    return queries[pick.to(queries.device)]


def _copying(A: Tensor, logits: Tensor, tokens: Tensor) -> tuple[float, float]:
    """[I]'s share-of-raise copying score and the rank copying score of one head (see
    :func:`repeat_scores`): ``A [B, Q, T]`` attention of the queries, ``logits [B, Q, V]`` the
    head's direct logits there, ``tokens [B, T]``."""
    idx = tokens[:, None, :].expand(-1, A.shape[1], -1)
    raise_ = torch.relu(logits - logits.mean(-1, keepdim=True))
    attended = A >= 0.5 * A.amax(-1, keepdim=True)  # [B, Q, T] positions
    mask = torch.zeros_like(raise_)  # 1 for tokens at attended positions (repeats OR-ed by amax)
    mask.scatter_reduce_(-1, idx, attended.to(raise_.dtype), reduce="amax")
    share = float((raise_ * mask).sum() / raise_.sum().clamp_min(1e-30))  # over all queries
    chance = float(mask.sum(-1).mean()) / mask.shape[-1]  # a head raising tokens at random
    share_score = (share - chance) / (1 - chance) if share >= chance else (share - chance) / chance
    # rank: the token at the most-attended position, placed among all tokens by the head's logits
    top = tokens.gather(-1, A.argmax(-1))  # [B, Q]
    own = logits.gather(-1, top[..., None])  # [B, Q, 1]
    below, tied = (logits < own).sum(-1), (logits == own).sum(-1) - 1  # ties count half
    percentile = (below + 0.5 * tied) / (logits.shape[-1] - 1)
    return share_score, float(2 * percentile.double().mean() - 1)


def _copying_in(A: Tensor, logits: Tensor, tokens: Tensor, raise_: Tensor, sign: Tensor) -> tuple[float, float]:
    """:func:`_copying` (the definition) computed in two given ``[B, Q, V]`` buffers, with two
    passes fewer over the vocabulary: the share sums the raise at each attended token once (a
    gather, not a vocabulary-wide mask), and the rank reads ``sum sign(own - logits) = below - above``
    (exact: integers), so ``below + tied / 2 = (V + sum) / 2`` with the token itself among the ties."""
    V = logits.shape[-1]
    torch.sub(logits, logits.mean(-1, keepdim=True), out=raise_).relu_()
    attended = A >= 0.5 * A.amax(-1, keepdim=True)  # [B, Q, T] positions
    same = tokens[:, :, None] == tokens[:, None, :]  # [B, T, T]: keys j' and j hold the same token
    before = torch.ones(same.shape[1:], dtype=torch.bool, device=A.device).triu(1)  # j' < j
    seen = (attended[..., None] & (same & before)[:, None]).any(-2)  # an earlier attended key holds j's token
    first = attended & ~seen  # each attended token once
    num = (raise_.gather(-1, tokens[:, None, :].expand(-1, A.shape[1], -1)) * first).sum()
    share = float(num / raise_.sum().clamp_min(1e-30))
    chance = float(first.sum(-1).to(raise_.dtype).mean()) / V
    share_score = (share - chance) / (1 - chance) if share >= chance else (share - chance) / chance
    own = logits.gather(-1, tokens.gather(-1, A.argmax(-1))[..., None])  # [B, Q, 1]
    balance = torch.sub(own, logits, out=sign).sign_().sum(-1)  # below - above
    percentile = (0.5 * (V + balance) - 0.5) / (V - 1)
    return share_score, float(2 * percentile.double().mean() - 1)


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
                row.update({k: float(v[l, h]) for k, v in self.scores.items()})
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
    progress: Progress | None = None,
) -> HeadReport:
    """Every detector on one model: ``text [B, T]`` is natural (validation) text.

    Natural text gives previous-token, self-attention, sink (and value-weighted sink)
    and positional scores and the ICL curve (on ``icl_text`` when given: the score compares
    two windows of 10 positions, so it wants hundreds of examples); [I]'s repeated random tokens (seeded,
    start token ``bos``, drawn away from the most and least frequent ids when ``frequencies``
    are given) give prefix matching, induction, duplicate-token and copying; the weights give
    the eigenvalue copying scores and the diagonal top-k rate (exact up to 8192 tokens, else
    estimated on ``diag_sample`` tokens: :func:`~qkov.analysis.circuits.copying_scores`).
    ``icl=False`` leaves the ICL score out (for text without structure, such as random tokens), and
    so does text shorter than the score reads (:func:`~qkov.analysis.probes.icl_left_out`); the
    report's ``left_out`` says why (``{"icl": reason}``). The other scores take any length.
    The text scores are streamed (:func:`~qkov.analysis.text_scores.text_scores`); ``progress``
    is ticked through the text, the ICL examples and the copying scores. ``source``: a model,
    weights source or path (:func:`~qkov.weights.as_source`); ``bos=None``: its start token.
    """
    source = as_source(source, where="qkov.head_report")
    bos = source_bos("qkov.head_report", source, bos)
    cfg = source.cfg
    if cfg.n_layers == 0:
        raise QkovError("heads: the model has no attention layers")
    if diag_k:
        check_diag_k(diag_k, cfg.d_vocab)  # before any work
    have, _ = memory_budget(source.device)
    chunk = chunk_size(source, text.shape[1], TEXT_CHUNK_BYTES if have is None else min(TEXT_CHUNK_BYTES, have))
    check_fits(
        chunk * sequence_bytes(source, text.shape[1]),
        source.device,
        f"heads: scoring one layer's attention on {text.shape[1]}-token text",
        "analyse shorter sequences",
    )
    on_text = text_scores(source, text, chunk=chunk, progress=progress)
    length = min(25, (cfg.n_ctx - 1) // 4)
    rep = prefix_matching_tokens(cfg.d_vocab, length=length, seed=seed, bos=bos, frequencies=frequencies)
    rs = repeat_scores(source, rep, length)
    copying = copying_scores(source, diag_k=diag_k, diag_sample=diag_sample, seed=seed, progress=progress).heads
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
    left_out = {} if icl else {"icl": NOT_TEXT}
    reason = icl_left_out(icl_on.shape[1], cfg.n_ctx) if icl else None
    if reason is not None:
        left_out["icl"] = reason
    icl_result = None if left_out else icl_score(source, icl_on, progress=progress)
    roles = assign_roles(scores, thresholds)
    n_diag = copying[0].diag_tokens if copying else None
    neurons = memory_neurons(source)
    return HeadReport(scores, roles, icl_result, neurons, dict(thresholds), n_diag, rs.copying_queries, left_out)
