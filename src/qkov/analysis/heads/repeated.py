"""[I]'s scores on repeated random tokens: prefix matching, induction, duplicate-token, and the two
copying scores read through each head's direct logits (:func:`repeat_scores`; :func:`qkov.analysis.heads.report.head_report`
runs them beside the weight-based copying scores and shares their ``W_O W_U`` products).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...errors import QkovError
from ...weights.convert import SourceLike, as_source
from ...weights.parts import WeightSource
from ... import ranks
from ..forward.tracer import trace
from .probes import induction_attention
from ..sampling import seeded_subset
from ..budget import item, pass_bytes

__all__ = ["COPYING_LOGITS", "copying_queries", "earlier_same", "repeat_bytes", "repeat_scores", "RepeatPass", "RepeatScores"]

COPYING_LOGITS = 2**24  # logits per head the copying scores read at most (beyond: sampled queries)
COPYING_CHUNK_BYTES = 4 * 2**20  # the copying scores' logits are made and read this many bytes of rows at a time


@dataclass
class RepeatScores:
    """Scores on repeated random tokens, each ``[n_layers, n_heads]``. ``induction_attention`` is the
    measure :attr:`~qkov.analysis.heads.probes.InductionProbe.induction_attention` reads; the *induction role*
    reads ``prefix_matching`` and ``copying_rank`` (:data:`THRESHOLDS`)."""

    prefix_matching: Tensor  # attention to the tokens after the current token's earlier occurrences
    induction_attention: Tensor  # attention to the token after the most recent earlier occurrence
    duplicate: Tensor  # attention to the current token's earlier occurrences
    copying: Tensor  # [I] copying score in [-1, 1] (share of the raise on attended tokens)
    copying_rank: Tensor  # where the head's logits rank the token it attends to most, in [-1, 1]
    copying_queries: tuple[int, int] = (0, 0)  # (queries the copying scores read, repeated queries in all)


def repeat_scores(source: SourceLike, tokens: Tensor, length: int) -> RepeatScores:
    """Prefix matching, induction, duplicate-token and [I]'s copying score on ``tokens`` from
    :func:`~qkov.analysis.heads.probes.prefix_matching_tokens` (blocks of ``length`` after one start token).

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
    scoring = RepeatPass(source, tokens, length)
    W_O: dict[int, Tensor] = {}
    for u in scoring.units():
        l, h = divmod(u, source.cfg.n_heads)
        if l not in W_O:
            W_O[l] = source.attention(l).W_O  # [H, E, D]
        scoring.copying(l, h, W_O[l][h] @ scoring.W_U)
    return scoring.scores()


class RepeatPass:
    """One pass of :func:`repeat_scores` on repeated tokens: its attention scores at once, its copying
    scores head by head as each head's ``W_O[h] @ W_U`` ``[d_head, d_vocab]`` is handed to
    :meth:`copying` (:func:`head_report` hands it the products the weight-based copying scores form,
    so each is formed once)."""

    def __init__(self, source: WeightSource, tokens: Tensor, length: int) -> None:
        r = trace(source, tokens, cache=["pattern.*", "z.*"], logits=False)
        P = r.stack("pattern")  # [L, B, H, T, T]
        L, B, H, T, _ = P.shape
        queries = torch.arange(1 + length, T, device=P.device)
        pm = torch.zeros(L, H, dtype=P.dtype, device=P.device)
        dup = torch.zeros_like(pm)
        for q in queries.tolist():
            earlier = torch.arange((q - 1) % length + 1, q, length, device=P.device)  # same token, earlier
            pm += P[..., q, earlier + 1].sum(-1).mean(1)
            dup += P[..., q, earlier].sum(-1).mean(1)
        self.pm, self.dup, self.induction = pm / len(queries), dup / len(queries), induction_attention(P, length)
        self.W_U = source.unembed().W_U
        self.read_q = copying_queries(queries, B, self.W_U.shape[-1], COPYING_LOGITS)
        self.counts = (len(self.read_q), len(queries))
        self.recording, self.P, self.shape = r, P, (L, H)
        self.parts: dict[int, tuple[float, float]] = {}
        self.work: Tensor | None = None
        self.earlier: Tensor | None = None  # which earlier keys hold the same token, shared by every head
        self.split = ranks.current()  # a unit: one head, number l * H + h

    def units(self) -> list[int]:
        """The heads (``l * H + h``) this rank scores."""
        L, H = self.shape
        return [u for u in range(L * H) if self.split.mine(u, L * H)]

    def copying(self, l: int, h: int, OU: Tensor) -> None:
        """Head ``l.h``'s copying scores from ``OU = W_O[h] @ W_U`` (``[d_head, d_vocab]``)."""
        A, z = self.P[l, :, h][:, self.read_q], self.recording["z", l][:, self.read_q]  # [B, Q, T], [B, Q, H, E]
        if self.work is None:  # two blocks of logit rows, reused by every head (no page faults per head)
            self.work = copying_work(OU)
        if self.earlier is None:
            self.earlier = earlier_same(self.recording.tokens, OU.dtype)
        parts = _copying_in(A, z[:, :, h], OU, self.recording.tokens, self.work, self.earlier)
        self.parts[l * self.shape[1] + h] = parts

    def scores(self) -> RepeatScores:
        """The scores, once every head of :meth:`units` has had :meth:`copying`."""
        L, H = self.shape
        missing = set(self.units()) - set(self.parts)
        if missing:
            raise QkovError(f"repeat scores: no copying product for {len(missing)} heads")
        copy, rank = torch.zeros_like(self.pm), torch.zeros_like(self.pm)
        for u, (c, k) in enumerate(self.split.gather(self.parts, L * H)):
            copy[u // H, u % H], rank[u // H, u % H] = c, k
        return RepeatScores(
            self.pm, self.induction, self.dup, copying=copy, copying_rank=rank, copying_queries=self.counts
        )


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


def earlier_same(tokens: Tensor, dtype: torch.dtype) -> Tensor:
    """``[B, T, T]``: 1 where key ``j' < j`` holds the same token as key ``j`` (else 0), in ``dtype``."""
    same = tokens[:, :, None] == tokens[:, None, :]
    before = torch.ones(same.shape[1:], dtype=torch.bool, device=tokens.device).triu(1)  # j' < j
    return (same & before).to(dtype)


def copying_work(OU: Tensor) -> Tensor:
    """Scratch for :func:`_copying_in`: two blocks ``[2, rows, d_vocab]`` of :data:`COPYING_CHUNK_BYTES` each."""
    V = OU.shape[-1]
    rows = max(1, COPYING_CHUNK_BYTES // (V * OU.element_size()))
    return torch.empty(2, rows, V, dtype=OU.dtype, device=OU.device)


def _copying_in(
    A: Tensor, z: Tensor, OU: Tensor, tokens: Tensor, work: Tensor | None = None, earlier: Tensor | None = None
) -> tuple[float, float]:
    """:func:`_copying` (the definition) of the logits ``z @ OU`` (``z [B, Q, E]`` the head's outputs at
    the queries before ``W_O``, ``OU = W_O[h] @ W_U [E, V]``: the product d_head wide, not d_model),
    made a block of query rows at a time in ``work`` (:func:`copying_work`) and read there while the
    block is in cache (the whole ``[B, Q, V]`` would be read from memory six times over), with passes
    fewer than the definition: the share sums the raise at each attended token once (a gather, not a
    vocabulary-wide mask), and the rank reads ``sum sign(own - logits) = below - above`` (exact:
    integers), so ``below + tied / 2 = (V + sum) / 2`` with the token itself among the ties.
    ``earlier``: :func:`earlier_same` of ``tokens`` in the logits' dtype (made here when not given)."""
    B, Q, T = A.shape
    V = OU.shape[-1]
    work = copying_work(OU) if work is None else work
    attended = A >= 0.5 * A.amax(-1, keepdim=True)  # [B, Q, T] positions
    earlier = earlier_same(tokens, OU.dtype) if earlier is None else earlier
    # an earlier attended key holds j's token: a count of 0/1 products, exact in floating point
    seen = torch.bmm(attended.to(earlier.dtype), earlier) > 0
    first = (attended & ~seen).reshape(B * Q, T)  # each attended token once
    at = tokens[:, None, :].expand(-1, Q, -1).reshape(B * Q, T)  # the token at each key
    top = tokens.gather(-1, A.argmax(-1)).reshape(B * Q, 1)  # the token at the most-attended key
    rows = z.reshape(B * Q, -1)
    num = torch.zeros((), dtype=torch.float64, device=OU.device)
    total = torch.zeros_like(num)
    balance = OU.new_empty(B * Q)  # below - above, per query
    for lo in range(0, B * Q, work.shape[1]):
        hi = min(B * Q, lo + work.shape[1])
        logits = torch.matmul(rows[lo:hi], OU, out=work[0, : hi - lo])
        raise_ = torch.sub(logits, logits.mean(-1, keepdim=True), out=work[1, : hi - lo]).relu_()
        total += raise_.sum()
        num += (raise_.gather(-1, at[lo:hi]) * first[lo:hi]).sum()
        own = logits.gather(-1, top[lo:hi])
        torch.sum(torch.sub(own, logits, out=work[1, : hi - lo]).sign_(), -1, out=balance[lo:hi])
    share = float(num / total.clamp_min(1e-30))
    chance = float(first.sum(-1).to(OU.dtype).mean()) / V
    share_score = (share - chance) / (1 - chance) if share >= chance else (share - chance) / chance
    percentile = (0.5 * (V + balance) - 0.5) / (V - 1)
    return share_score, float(2 * percentile.double().mean() - 1)


def repeat_bytes(source: WeightSource, batch: int, seq: int) -> int:
    """Peak of :func:`~qkov.analysis.heads.repeated.repeat_scores` on ``[batch, seq]`` repeated tokens: the
    pass with every layer's pattern and per-head output, and the copying scores' two blocks of logit
    rows (:func:`copying_work`)."""
    c, it = source.cfg, item(source)
    outputs = c.n_layers * batch * c.n_heads * seq * c.d_model * it
    logits = 2 * max(COPYING_CHUNK_BYTES, c.d_vocab * it)
    return pass_bytes(source, batch, seq, cached_patterns=True) + outputs + logits
