"""Head detectors measured on behaviour (token ids in, scores out).

So far: the repeated-random-tokens induction score that training tracks to see
induction heads form (Olsson et al., 2022). Scores come back as ``[n_layers,
n_heads]`` tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .errors import QkovError
from .model import Transformer

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

    from .paths import FrozenRun
    from .weights import Weights


def repeated_random_tokens(
    d_vocab: int,
    *,
    length: int = 50,
    repeats: int = 2,
    batch: int = 8,
    seed: int = 0,
    bos: int = 0,
    low: int = 1,
) -> Tensor:
    """``[batch, 1 + length * repeats]``: the start token, then ``length`` random ids repeated.

    Ids are drawn uniformly from ``[low, d_vocab)`` (so the start token, id 0 in
    qkov's tokenizers, is never drawn) with a seeded generator.
    """
    gen = torch.Generator().manual_seed(seed)
    block = torch.randint(low, d_vocab, (batch, length), generator=gen)
    body = block.repeat(1, repeats)
    return torch.cat([torch.full((batch, 1), bos, dtype=torch.long), body], dim=1)


def induction_attention(patterns: Tensor, period: int, *, first: int = 1) -> Tensor:
    """Mean attention from each repeated token to the token after its previous occurrence.

    Args:
        patterns: ``[n_layers, batch, n_heads, seq, seq]`` with the repeated block
            starting at position ``first`` and repeating every ``period`` positions.
    Returns:
        ``[n_layers, n_heads]``: for every query ``q >= first + period``, the attention
        paid to key ``q - period + 1``, averaged over queries and batch.
    """
    seq = patterns.shape[-1]
    q = torch.arange(first + period, seq, device=patterns.device)
    k = q - period + 1
    picked = patterns[..., q, k]  # [layers, batch, heads, n_queries]
    return picked.mean(dim=(1, 3))


@dataclass
class InductionProbe:
    """Induction score per head and the loss on each copy of repeated random tokens."""

    scores: Tensor  # [n_layers, n_heads]
    loss_by_copy: list[float]  # mean next-token loss on copy 1, copy 2, ...
    loss_by_position: list[float]  # mean loss at each position i (predicting token i + 1), over the batch
    length: int  # tokens per copy

    @property
    def best(self) -> float:
        """Largest score among heads in layers >= 1 (0.0 for models with fewer than 2 layers)."""
        if self.scores.shape[0] < 2:
            return 0.0
        return float(self.scores[1:].max())

    @property
    def best_head(self) -> tuple[int, int] | None:
        if self.scores.shape[0] < 2:
            return None
        flat = int(self.scores[1:].argmax())
        return 1 + flat // self.scores.shape[1], flat % self.scores.shape[1]


@torch.no_grad()
def induction_probe(
    model: Transformer,
    *,
    length: int = 50,
    repeats: int = 2,
    batch: int = 8,
    seed: int = 0,
) -> InductionProbe:
    """Run ``model`` on repeated random tokens; score every head's induction attention."""
    length = min(length, (model.cfg.n_ctx - 1) // repeats)
    tokens = repeated_random_tokens(
        model.cfg.d_vocab, length=length, repeats=repeats, batch=batch, seed=seed, bos=model.bos_token_id
    )
    out = model.run(tokens, return_patterns=True)
    assert out.patterns is not None
    scores = induction_attention(out.patterns, length)
    logp = torch.log_softmax(out.logits[:, :-1].float(), dim=-1)
    target = tokens[:, 1:].to(logp.device)
    nll = -logp.gather(-1, target[..., None])[..., 0]  # [batch, seq-1]; position i predicts token i+1
    losses = []
    for r in range(repeats):
        # predictions of the tokens of copy r (positions 1 + r*length .. ), skipping the first of each copy
        lo = r * length + 1
        losses.append(float(nll[:, lo : lo + length - 1].mean()))
    curve = nll.float().mean(0).cpu().tolist()
    return InductionProbe(scores=scores.float().cpu(), loss_by_copy=losses, loss_by_position=curve, length=length)


# =========================================================================== detectors
# Pattern-based scores take patterns [n_layers, batch, n_heads, query, key] and return
# [n_layers, n_heads]. The behavioural procedures of Olsson et al. (2022) follow.


def previous_token_scores(patterns: Tensor) -> Tensor:
    """Mean attention ``A[i, i-1]`` over queries ``i >= 1`` (use natural text)."""
    return patterns.diagonal(offset=-1, dim1=-2, dim2=-1).mean(dim=(1, 3))


def self_attention_scores(patterns: Tensor) -> Tensor:
    """Mean attention to the current token ``A[i, i]`` over queries ``i >= 1``."""
    return patterns.diagonal(offset=0, dim1=-2, dim2=-1)[..., 1:].mean(dim=(1, 3))


def sink_scores(patterns: Tensor) -> Tensor:
    """Mean attention to position 0 over queries ``i >= 1`` (Gu et al.: a sink head above 0.3)."""
    return patterns[..., 1:, 0].mean(dim=(1, 3))


def value_weighted_sink_scores(patterns: Tensor, value_norms: Tensor) -> Tensor:
    """Share of a head's value-weighted attention ``A[i, j] * ||v_j W_O||`` that goes to position 0.

    ``value_norms [n_layers, batch, n_heads, key]``. A sink that reads a near-zero value
    (a "do nothing" default) scores low here even when its attention to position 0 is high.
    """
    weighted = patterns[..., 1:, :] * value_norms[..., None, :]
    return weighted[..., 0].sum(dim=(1, 3)) / weighted.sum(dim=(1, 3, 4)).clamp_min(1e-30)


def sample_repeat_tokens(
    d_vocab: int,
    *,
    length: int = 25,
    repeats: int = 4,
    examples: int = 10,
    seed: int = 0,
    bos: int = 0,
    frequencies: "np.ndarray | None" = None,
    drop_top: float = 0.05,
    drop_bottom: float = 0.2,
) -> Tensor:
    """[I]'s probe: ``[examples, 1 + length * repeats]`` — the start token, then random tokens repeated.

    Tokens are drawn (without replacement within a block) from the vocabulary minus the
    start token, the ``drop_top`` most frequent and the ``drop_bottom`` least frequent ids
    when ``frequencies`` (counts per id, e.g. from the training split) are given.
    """
    import numpy as np

    pool = np.arange(d_vocab)
    pool = pool[pool != bos]
    if frequencies is not None:
        freq = np.asarray(frequencies, dtype=np.float64)[pool]
        order = np.argsort(freq, kind="stable")  # ascending
        lo, hi = int(len(order) * drop_bottom), int(len(order) * (1 - drop_top))
        pool = np.sort(pool[order[lo:hi]])
    if len(pool) < length:
        raise QkovError(f"only {len(pool)} tokens to sample {length} distinct ones from")
    rng = np.random.default_rng(seed)
    blocks = np.stack([rng.choice(pool, size=length, replace=False) for _ in range(examples)])
    body = np.tile(blocks, (1, repeats))
    out = np.concatenate([np.full((examples, 1), bos), body], axis=1)
    return torch.from_numpy(out).long()


@dataclass
class RepeatScores:
    """Scores on repeated random tokens, each ``[n_layers, n_heads]``."""

    prefix_matching: Tensor  # attention to the tokens after the current token's earlier occurrences
    induction: Tensor  # attention to the token after the most recent earlier occurrence
    duplicate: Tensor  # attention to the current token's earlier occurrences
    copying: Tensor  # [I] copying score in [-1, 1]


def repeat_scores(w: "Weights", tokens: Tensor, length: int) -> RepeatScores:
    """Prefix matching, induction, duplicate-token and [I]'s copying score on ``tokens`` from
    :func:`sample_repeat_tokens` (block of ``length`` after one start token).

    Copying ([I]): each head's output at a repeated query is mapped to logits by the direct
    path (``@ W_U``, LayerNorm folded), the mean over the vocabulary is subtracted, then
    ReLU; ``share`` is the part of that raise, summed over all repeated queries, that falls
    on the tokens the head attends to (positions with at least half of the query's largest
    attention weight). It is rescaled
    to [-1, 1] around chance (``chance`` = attended tokens / vocabulary, the share of a head
    raising tokens at random): ``(share - chance) / (1 - chance)`` above chance, ``(share -
    chance) / chance`` below. +1: the head raises only what it attends to; 0: no more than
    chance; -1: it raises everything but what it attends to. A trained induction head that
    also lifts hundreds of related tokens a little scores small but positive.
    """
    from .paths import frozen_run

    run = frozen_run(w, tokens, keep_values=True)
    P = run.patterns  # [L, B, H, T, T]
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
    induction = induction_attention(P, length)
    assert run.values is not None
    copy = torch.zeros_like(pm)
    toks = run.tokens
    for l in range(L):
        for h in range(H):
            A = P[l, :, h][:, queries]  # [B, Q, T]
            out = (A @ run.values[l, :, h]) @ w.W_O[l, h]  # [B, Q, D]
            raise_ = torch.relu((out @ w.W_U) - (out @ w.W_U).mean(-1, keepdim=True))  # [B, Q, V]
            attended = A >= 0.5 * A.amax(-1, keepdim=True)  # [B, Q, T] positions
            idx = toks[:, None, :].expand(-1, len(queries), -1)
            mask = torch.zeros_like(raise_)  # 1 for tokens at attended positions (repeats OR-ed by amax)
            mask.scatter_reduce_(-1, idx, attended.to(raise_.dtype), reduce="amax")
            share = float((raise_ * mask).sum() / raise_.sum().clamp_min(1e-30))  # over all queries
            chance = float(mask.sum(-1).mean()) / mask.shape[-1]  # a head raising tokens at random
            copy[l, h] = (share - chance) / (1 - chance) if share >= chance else (share - chance) / chance
    return RepeatScores(prefix_matching=pm, induction=induction, duplicate=dup, copying=copy)


@dataclass
class ICLScore:
    """In-context learning ([I]): loss at a late token minus loss at token 50, and the whole curve."""

    score: float
    early: int
    late: int
    loss_by_position: list[float]  # mean loss predicting token i+1 at position i


@torch.no_grad()
def icl_score(model: Transformer, examples: Tensor, *, early: int = 50, late: int = 500, window: int = 10) -> ICLScore:
    """Loss at token ``late`` minus loss at token ``early``, over ``examples [B, T]`` of validation text.

    [I] compares single positions over very many examples; with the few hundred examples a
    laptop run uses, one position's mean loss is noisy (measured: +-0.15 nats over 256
    examples), so each side averages ``window`` positions (``late - window + 1 .. late`` and
    ``early - window // 2 ..``). [I] uses 512-token examples (late = 500); a shorter context
    uses its last predicted position (``T - 2``). Negative = later tokens are predicted
    better (the model learns in context).
    """
    T = examples.shape[1]
    late = min(late, T - 2)
    early = min(early, late)
    chunks = []
    for i in range(0, examples.shape[0], 32):
        toks = examples[i : i + 32]
        lp = torch.log_softmax(model(toks)[:, :-1].float(), dim=-1)
        chunks.append(-lp.gather(-1, toks[:, 1:, None].to(lp.device))[..., 0])
    curve = torch.cat(chunks).mean(0)  # [T-1]
    lo = max(0, early - window // 2)
    score = curve[max(0, late - window + 1) : late + 1].mean() - curve[lo : lo + window].mean()
    return ICLScore(float(score), early, late, curve.tolist())


def memory_neurons(w: "Weights", threshold: float = -0.5) -> list[dict[str, float]]:
    """MLP neurons whose input and output weights point in nearly opposite directions ([F]).

    ``cos(W_in[:, n], W_out[n, :]) < threshold``: the neuron reads a direction and writes its
    negation (it deletes what it reads). Empty for attention-only models.
    """
    if w.W_in is None or w.W_out is None:
        return []
    cos = torch.nn.functional.cosine_similarity(w.W_in.transpose(1, 2), w.W_out, dim=-1)  # [L, M]
    hits = torch.nonzero(cos < threshold)
    return [{"layer": int(l), "neuron": int(n), "cosine": float(cos[l, n])} for l, n in hits]


def positional_fraction(w: "Weights", run: "FrozenRun") -> Tensor:
    """How much of each head's attention score varies with position alone.

    ``Var_k(pos-pos term) / Var_k(real score)`` over allowed keys, averaged over queries
    (clipped to [0, 1]), where the pos-pos term is ``p_q W_QK p_k`` with ``p`` the positional
    part of the query/key input (``W_pos`` for shortformer and standard positions,
    LayerNorm-scaled as in the run) and the real score uses the run's actual input. Needs
    ``frozen_run(..., keep_values=True)``. 0 for models without positions. ``[n_layers, n_heads]``.
    """
    L, H = w.n_layers, w.n_heads
    if w.W_pos is None or run.qk_inputs is None:
        return torch.zeros(L, H, dtype=w.W_E.dtype, device=w.W_E.device)
    T = run.tokens.shape[1]
    mask = torch.ones(T, T, dtype=torch.bool, device=w.W_E.device).tril()
    counts = mask.sum(-1)

    def var_k(s: Tensor) -> Tensor:  # [..., T, T] -> variance over allowed keys, mean over queries >= 1
        s = s.masked_fill(~mask, 0.0)
        mean = s.sum(-1) / counts
        return (s.pow(2).sum(-1) / counts - mean.pow(2)).clamp_min(0)[..., 1:]

    out = torch.zeros(L, H, dtype=w.W_E.dtype, device=w.W_E.device)
    for l in range(L):
        pos = w.W_pos[:T]
        if run.ln1_std is not None:
            pos = (pos - pos.mean(-1, keepdim=True)) / run.ln1_std[l, 1]  # [B, T, D]
        x = run.qk_inputs[l]
        for h in range(H):
            Q, K = w.W_Q[l, h], w.W_K[l, h]
            real = (x @ Q + w.b_Q[l, h]) @ (x @ K + w.b_K[l, h]).transpose(-1, -2)
            pp = (pos @ Q) @ (pos @ K).transpose(-1, -2)
            vr, vp = var_k(real), var_k(pp)
            out[l, h] = (vp / vr.clamp_min(1e-30)).clamp(0, 1).mean()
    return out


# ---------------------------------------------------------------------- thresholds
# Roles are assigned from these thresholds. Each sits far above what untrained heads score
# (benchmarks/null_scores.py: 8 seeds x 8 heads of the default shape on validation text;
# mean / max shown), so a role means trained structure, not chance.
THRESHOLDS: dict[str, float] = {
    "copying": 0.5,  # eigenvalue copying score; untrained -0.01 / 0.10 (min -0.11)
    "previous_token": 0.3,  # mean A[i, i-1] on text; untrained 0.02 / 0.02
    "induction": 0.3,  # prefix-matching score ([I]'s procedure, the issue's 0.3); untrained 0.03 / 0.03
    "sink": 0.3,  # mean attention to position 0 (Gu et al. 2024's criterion); untrained 0.02 / 0.02
    "positional": 0.5,  # share of the score variance over keys explained by position alone; untrained 0.27 / 0.29
    "memory_eigen": -0.5,  # residual-space OV eigen score below this (untrained 0.00, min -0.12) ...
    "memory_self": 0.3,  # ... and mean attention to the current token above this (untrained 0.02)
}
ROLES = ("copying", "positional", "previous-token", "induction", "sink", "memory-management")


@dataclass
class HeadReport:
    """Every per-head score, ``[n_layers, n_heads]`` each, and the roles assigned from them."""

    scores: dict[str, Tensor]
    roles: list[list[list[str]]]  # [layer][head] -> roles
    icl: ICLScore | None
    memory_neurons: list[dict[str, float]]
    thresholds: dict[str, float]

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
            # prefix matching + an OV circuit that copies (the weight-based sign: the behavioural [I]
            # copying score is reported too, but broad logit shifts make it noisy in small models)
            if scores["prefix_matching"][l, h] > thresholds["induction"] and scores["eigen_copying"][l, h] > 0:
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


@torch.no_grad()
def head_report(
    model: Transformer,
    text: Tensor,
    *,
    frequencies: "np.ndarray | None" = None,
    seed: int = 0,
    diag_k: int | None = 5,
    thresholds: dict[str, float] = THRESHOLDS,
    icl_text: Tensor | None = None,
) -> HeadReport:
    """Every detector on one model: ``text [B, T]`` is natural (validation) text.

    Natural text gives previous-token, self-attention, sink (and value-weighted sink)
    and positional scores and the ICL curve (on ``icl_text`` when given: the score compares
    single positions, so it wants hundreds of examples); [I]'s repeated random tokens (seeded, drawn
    away from the most and least frequent ids when ``frequencies`` are given) give
    prefix matching, induction, duplicate-token and copying; the weights give the
    eigenvalue copying scores and the diagonal top-k rate.
    """
    from . import circuits as C
    from .paths import frozen_run
    from .weights import Weights

    if model.cfg.n_layers == 0:
        raise QkovError("heads: the model has no attention layers")
    w = Weights.from_model(model)
    run = frozen_run(w, text.to(w.W_E.device), keep_values=True)
    assert run.values is not None
    value_norms = torch.einsum("lbhte,lhed->lbhtd", run.values, w.W_O).norm(dim=-1)
    length = min(25, (model.cfg.n_ctx - 1) // 4)
    rep = sample_repeat_tokens(
        model.cfg.d_vocab, length=length, seed=seed, bos=model.bos_token_id, frequencies=frequencies
    )
    rs = repeat_scores(w, rep.to(w.W_E.device), length)
    copying = C.copying_scores(w, diag_k=diag_k)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    scores = {
        "previous_token": previous_token_scores(run.patterns),
        "self_attention": self_attention_scores(run.patterns),
        "sink": sink_scores(run.patterns),
        "sink_value_weighted": value_weighted_sink_scores(run.patterns, value_norms),
        "positional_fraction": positional_fraction(w, run),
        "prefix_matching": rs.prefix_matching,
        "induction": rs.induction,
        "duplicate_token": rs.duplicate,
        "copying": rs.copying,
        "eigen_copying": torch.tensor([c.eigen_score for c in copying]).reshape(L, H),
        "residual_eigen": torch.tensor([c.residual_eigen_score for c in copying]).reshape(L, H),
    }
    if diag_k:
        scores[f"diag_top{diag_k}"] = torch.tensor([c.diag_topk_rate for c in copying]).reshape(L, H)
    scores = {k: v.detach().float().cpu() for k, v in scores.items()}
    icl_on = text if icl_text is None else icl_text  # ICL needs many examples: one position each
    icl = icl_score(model, icl_on.to(w.W_E.device)) if icl_on.shape[1] > 60 else None
    return HeadReport(scores, assign_roles(scores, thresholds), icl, memory_neurons(w), dict(thresholds))
