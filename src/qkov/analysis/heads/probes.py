"""Behavioural probes of in-context learning [I]: repeated random tokens and the ICL score.

Two token sets, for two jobs:

* :func:`induction_probe_tokens` — the quick probe that training runs at every evaluation
  (:func:`induction_probe`): the start token, then ``length`` ids drawn uniformly (with
  replacement) and repeated; the score is the best layer-1+ head's attention to the token
  after the previous occurrence, and the loss on each copy shows the copying.
* :func:`prefix_matching_tokens` — [I]'s procedure for the prefix-matching score (used by
  :func:`qkov.analysis.heads.report.head_report`): 25 *distinct* tokens per example (away from the
  most and least frequent ids when token frequencies are given), repeated 4 times, 10 examples.

:func:`icl_score` is [I]'s in-context-learning score on natural text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch
from torch import Tensor

from ...errors import QkovError, check_int
from ...expect import token_ids
from ...weights.convert import SourceLike, as_source, vocab_and_bos
from ...model.ops import next_token_nll
from ...model.tokens import left_out_tokens
from ...model.transformer import Transformer
from ... import ranks
from ...progress import Progress, tick
from ..forward.cache import Trace
from ..forward.sites import Sites
from ..forward.tiled_nll import pass_nll
from ..forward.tracer import flops_per_token, trace
from .entries import EntryWatch, edits_attention
from ..shown import Shown
from ..shown import TEXT, num, register, table

__all__ = [
    "default_icl_examples",
    "ICL_FLOPS",
    "ICL_LATE",
    "icl_chunk",
    "icl_left_out",
    "icl_score",
    "ICL_SHORTEST",
    "ICL_TOKENS",
    "icl_windows",
    "ICLScore",
    "induction_attention",
    "induction_entries",
    "induction_probe",
    "induction_probe_tokens",
    "InductionProbe",
    "LOGIT_BYTES",
    "NOT_TEXT",
    "PASS_BYTES",
    "prefix_matching_tokens",
    "probe_text",
    "random_ids",
    "token_pool",
]


def token_pool(vocab: Any, d_vocab: int, bos: int, *, low: int = 0, ordinary: bool = True) -> Tensor | None:
    """The ids a random-token probe draws from, ``[n]`` ascending, or ``None`` for the whole range
    ``[low, d_vocab)`` (a bare vocabulary size, a model without a tokenizer, or ``ordinary=False``).

    With a tokenizer: the ids in ``[low, d_vocab)`` that are ordinary text tokens
    (:func:`~qkov.model.tokens.left_out_tokens`: not the start token, a special token, a byte-fallback
    piece or an id past the tokenizer's vocabulary). Random bytes and special tokens make no text a
    model has seen: on a SentencePiece model with byte fallback, a probe over them measures losses far
    above uniform, not copying."""
    if not ordinary or isinstance(vocab, int) or getattr(vocab, "tokenizer", None) is None:
        return None
    out = torch.ones(d_vocab, dtype=torch.bool)
    out[:low] = False
    out[list(left_out_tokens(vocab, d_vocab)[0])] = False
    out[bos] = False
    pool = out.nonzero().squeeze(-1)
    if pool.numel() == 0:
        raise QkovError("no ordinary tokens to draw random tokens from (pass ordinary=False to use every id)")
    return pool


def _holder(where: str, vocab: Any) -> Any:
    """``vocab`` read once: a vocabulary size as it is, a model as it is, anything else as a source."""
    if isinstance(vocab, int) or isinstance(vocab, Transformer):
        return vocab
    return as_source(vocab, where=where)


def random_ids(pool: Tensor | None, low: int, high: int, shape: tuple[int, ...], gen: torch.Generator) -> Tensor:
    """Ids drawn uniformly with replacement from ``pool`` (``None``: from ``[low, high)``). A pool that is
    one contiguous range draws exactly as ``torch.randint`` over that range (qkov's own tokenizers:
    only the start token is special, so their probes are the same draws as before pools existed)."""
    if pool is None:
        return torch.randint(low, high, shape, generator=gen)
    first, last = int(pool[0]), int(pool[-1])
    if last - first + 1 == pool.numel():
        return torch.randint(first, last + 1, shape, generator=gen)
    return pool[torch.randint(0, pool.numel(), shape, generator=gen)]


def induction_probe_tokens(
    vocab: Any,
    *,
    length: int = 50,
    repeats: int = 2,
    batch: int = 8,
    seed: int = 0,
    bos: int | None = None,
    low: int = 1,
    ordinary: bool = True,
) -> Tensor:
    """``[batch, 1 + length * repeats]``: the start token, then ``length`` uniformly random ids repeated.

    ``vocab``: the model (a :class:`~qkov.Transformer`, weights source or path: its ``d_vocab``
    and start token) or a vocabulary size (then ``bos`` is required). ``bos=None``: the model's
    start token. Ids are drawn uniformly from ``[low, d_vocab)`` with replacement with a seeded
    generator (``low=1`` keeps id 0, the start token of qkov's own tokenizers, out); for a model
    with a tokenizer, from its ordinary text tokens only (:func:`token_pool`; ``ordinary=False``:
    every id in the range).
    """
    vocab = _holder("qkov.induction_probe_tokens", vocab)
    d_vocab, bos = vocab_and_bos("qkov.induction_probe_tokens", vocab, bos)
    gen = torch.Generator().manual_seed(seed)
    pool = token_pool(vocab, d_vocab, bos, low=low, ordinary=ordinary)
    block = random_ids(pool, low, d_vocab, (batch, length), gen)
    body = block.repeat(1, repeats)
    return torch.cat([torch.full((batch, 1), bos, dtype=torch.long), body], dim=1)


def prefix_matching_tokens(
    vocab: Any,
    *,
    length: int = 25,
    repeats: int = 4,
    examples: int = 10,
    seed: int = 0,
    bos: int | None = None,
    frequencies: np.ndarray | None = None,
    drop_top: float = 0.05,
    drop_bottom: float = 0.2,
    ordinary: bool = True,
) -> Tensor:
    """[I]'s probe: ``[examples, 1 + length * repeats]`` — the start token, then random tokens repeated.

    Tokens are drawn without replacement within a block, from the vocabulary minus the start
    token (for a model with a tokenizer, its ordinary text tokens: :func:`token_pool`), the
    ``drop_top`` most frequent and the ``drop_bottom`` least frequent ids when
    ``frequencies`` (counts per id, e.g. from the training split) are given. ``vocab``, ``bos`` and
    ``ordinary`` as :func:`induction_probe_tokens`'s.
    """
    vocab = _holder("qkov.prefix_matching_tokens", vocab)
    d_vocab, bos = vocab_and_bos("qkov.prefix_matching_tokens", vocab, bos)
    chosen = token_pool(vocab, d_vocab, bos, ordinary=ordinary)
    pool = np.arange(d_vocab) if chosen is None else chosen.numpy()
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


def induction_entries(seq: int, period: int, *, first: int = 1) -> tuple[Tensor, Tensor]:
    """The (query, key) entries the induction score reads in sequences of ``seq`` tokens whose
    repeated block starts at position ``first`` and repeats every ``period`` positions: every query
    ``q >= first + period`` and the key ``q - period + 1`` after the query token's previous occurrence,
    ``([N], [N])``."""
    q = torch.arange(first + period, seq)
    k = q - period + 1
    return q, k


def induction_attention(patterns: Tensor, period: int, *, first: int = 1) -> Tensor:
    """Mean attention from each repeated token to the token after its previous occurrence.

    Args:
        patterns: ``[n_layers, batch, n_heads, seq, seq]`` with the repeated block
            starting at position ``first`` and repeating every ``period`` positions.
    Returns:
        ``[n_layers, n_heads]``: for every query ``q >= first + period``, the attention
        paid to key ``q - period + 1`` (:func:`induction_entries`), averaged over queries and batch.
    """
    q, k = (x.to(patterns.device) for x in induction_entries(patterns.shape[-1], period, first=first))
    return patterns[..., q, k].mean(dim=(1, 3))  # [layers, batch, heads, n_queries] -> [layers, heads]


@dataclass(repr=False)
class InductionProbe(Shown):
    """Each head's induction attention and the loss on each copy of repeated random tokens.

    ``induction_attention [n_layers, n_heads]``: the mean attention from each token of a later copy
    to the token after its previous occurrence (:func:`induction_attention`), the measure
    :attr:`~qkov.analysis.heads.repeated.RepeatScores.induction_attention` also reads (there on the head
    detectors' four blocks of 25 tokens, here on ``repeats`` copies of ``length``)."""

    induction_attention: Tensor  # [n_layers, n_heads]
    loss_by_copy: list[float]  # mean next-token loss on copy 1, copy 2, ...
    loss_by_position: list[float]  # mean loss at each position i (predicting token i + 1), over the batch
    length: int  # tokens per copy

    @property
    def best(self) -> float:
        """Largest score among heads in layers >= 1 (0.0 for models with fewer than 2 layers)."""
        if self.induction_attention.shape[0] < 2:
            return 0.0
        return float(self.induction_attention[1:].max())

    @property
    def best_head(self) -> tuple[int, int] | None:
        if self.induction_attention.shape[0] < 2:
            return None
        flat = int(self.induction_attention[1:].argmax())
        return 1 + flat // self.induction_attention.shape[1], flat % self.induction_attention.shape[1]


def induction_probe(
    source: SourceLike,
    *,
    bos: int | None = None,
    length: int = 50,
    repeats: int = 2,
    batch: int = 8,
    seed: int = 0,
    edits: Mapping[Any, Any] | None = None,
) -> InductionProbe:
    """Run the model (with ``edits``, see :func:`~qkov.analysis.forward.tracer.trace`) on
    :func:`induction_probe_tokens`; score every head's induction attention.

    ``source``: a model, weights source or path (:func:`~qkov.weights.as_source`); ``bos=None``:
    its start token."""
    source = as_source(source, where="qkov.induction_probe")
    cfg = source.cfg
    for name, value in (("length", length), ("repeats", repeats), ("batch", batch)):
        check_int("qkov.induction_probe", name, value)
    length = min(length, (cfg.n_ctx - 1) // repeats)
    if length < 2:
        raise QkovError(
            f"qkov.induction_probe: a context of {cfg.n_ctx} tokens holds no {repeats} copies of 2 or more tokens"
        )
    tokens = induction_probe_tokens(source, length=length, repeats=repeats, batch=batch, seed=seed, bos=bos)
    r, scores = _induction_pass(source, tokens, length, edits)
    nll = next_token_nll(r.logits, r.tokens)  # [batch, seq-1]; position i predicts token i+1
    losses = []
    for copy in range(repeats):
        # predictions of the tokens of this copy (positions 1 + copy*length .. ), skipping the first of each copy
        lo = copy * length + 1
        losses.append(float(nll[:, lo : lo + length - 1].mean()))
    curve = nll.mean(0).cpu().tolist()
    return InductionProbe(induction_attention=scores.float().cpu(), loss_by_copy=losses, loss_by_position=curve, length=length)


def _induction_pass(
    source: Any, tokens: Tensor, length: int, edits: Mapping[Any, Any] | None
) -> tuple[Trace, Tensor]:
    """One pass over repeated tokens (copies of ``length`` after a start token) and
    :func:`induction_attention` of every head, ``[n_layers, n_heads]``: read at its entries alone from
    the attention kernel's log-sum-exp (:class:`~qkov.analysis.heads.entries.EntryWatch`, no pattern
    formed), or from the recorded patterns when ``edits`` write the scores or the pattern."""
    cfg = source.cfg
    found = torch.zeros(cfg.n_layers, cfg.n_heads, dtype=source.dtype, device=source.device)

    def take(layer: int, entries: Tensor) -> None:  # [B, H, N]
        found[layer] = entries.mean(dim=(0, 2))

    watch = EntryWatch(cfg.n_layers, *induction_entries(tokens.shape[1], length), take).edits()
    if edits_attention(Sites(cfg, source.norm), edits) or set(edits or {}) & set(watch):
        r = trace(source, tokens, cache="pattern.*", edits=edits)
        return r, induction_attention(r.stack("pattern"), length)
    return trace(source, tokens, edits={**(edits or {}), **watch}), found


@dataclass
class ICLScore:
    """In-context learning ([I]): loss at a late token minus loss at token 50, and the whole curve."""

    score: float
    early: int
    late: int
    loss_by_position: list[float]  # mean loss predicting token i+1 at position i


ICL_TOKENS = 65536  # tokens the default ICL examples hold at most (256 of 256)
ICL_FLOPS = 2 * 10**12  # ... and what their forward passes cost at most (16 examples for GPT-2 small)
ICL_LATE = 500  # [I]'s late position: an example is read up to it, no further
LOGIT_BYTES = 256 * 2**20  # logits held at once while the ICL score's windows are unembedded
PASS_BYTES = 4 * 2**20
"""What one activation of a default ICL chunk takes at most (``[chunk, T, widest]``): blocks this small
are reused by the C allocator from one pass to the next, where larger ones (above its 32 MiB ceiling)
are mapped afresh and page-faulted in every pass (measured: 1.5x the time of the whole score on 256
examples of 256 tokens of a 2-layer model, the same numbers either way)."""


def icl_chunk(cfg: Any, T: int, width: int, item: int) -> int:
    """Examples of ``T`` tokens one ICL pass runs by default when it unembeds ``width`` positions each
    with ``item``-byte numbers (``0``: it holds no logits, its losses tiled): as many as keep their
    ``[chunk, width, d_vocab]`` logits within :data:`LOGIT_BYTES` and their widest activation (``d_model``,
    ``n_heads x d_head`` or ``d_mlp`` per position) within :data:`PASS_BYTES`; at least one. Chunking
    changes no number: every example's losses are its own."""
    widest = max(cfg.d_model, cfg.n_heads * cfg.d_head, cfg.d_mlp or 0)
    passes = PASS_BYTES // (T * widest * item)
    return max(1, passes if width == 0 else min(LOGIT_BYTES // (width * cfg.d_vocab * item), passes))


def default_icl_examples(cfg: Any, most: int = 256) -> int:
    """Examples the ICL score takes by default: ``most``, or fewer so that they hold at most
    :data:`ICL_TOKENS` tokens and their forward passes cost at most :data:`ICL_FLOPS` (never fewer
    than 16, unless ``most`` is). Each is read up to position :data:`ICL_LATE` + 1 (the whole context if shorter)."""
    per_example = min(cfg.n_ctx, ICL_LATE + 2)
    affordable = min(ICL_TOKENS // per_example, ICL_FLOPS // (flops_per_token(cfg) * per_example))
    return min(most, max(16, affordable))


ICL_SHORTEST = 61  # the fewest tokens a sequence needs for the score: the early window (45 .. 54) and later ones


NOT_TEXT = "the tokens are not natural text (random tokens have no context to learn from)"
"""Why the ICL score is left out on seeded random tokens."""


def icl_left_out(seq: int, n_ctx: int) -> str | None:
    """Why the ICL score is left out on sequences of ``seq`` tokens of a model with context
    ``n_ctx``, or ``None`` when it is measured. It is measured only on sequences as long as it reads
    on the model's own context (``min(n_ctx, ICL_LATE + 2)`` tokens: the loss up to token 500, or
    the context's last predicted position), so one model's score means the same on any input: on a
    shorter text its late position would move, and the number would not compare. Every analysis
    that reports the score (heads, ablate, dynamics, report, path patching) uses this rule."""
    need = max(ICL_SHORTEST, min(n_ctx, ICL_LATE + 2))
    if n_ctx < ICL_SHORTEST:
        return f"needs sequences of at least {ICL_SHORTEST} tokens (loss at token 50 vs later); the context is {n_ctx}"
    if seq < need:
        return (
            f"needs sequences of at least {need} tokens (loss at token {need - 2} minus at token 50); "
            f"the text has {seq}"
        )
    return None


def icl_windows(seq: int, early: int = 50, late: int = ICL_LATE, window: int = 10) -> tuple[int, int, Tensor, Tensor]:
    """The ICL score's positions in examples of ``seq`` tokens: ``(early, late, early_at, late_at)``,
    ``late`` capped at the last predicting position, each side ``window`` positions (see :func:`icl_score`)."""
    late = min(late, seq - 2)
    early = min(early, late)
    lo = max(0, early - window // 2)
    return early, late, torch.arange(lo, min(lo + window, seq - 1)), torch.arange(max(0, late - window + 1), late + 1)


def icl_score(
    source: SourceLike,
    examples: Tensor,
    *,
    early: int = 50,
    late: int = ICL_LATE,
    window: int = 10,
    chunk: int | None = None,
    progress: Progress | None = None,
    curve: bool = True,
    edits: Mapping[Any, Any] | None = None,
    keep: list[Tensor] | None = None,
    start: tuple[int, list[Tensor]] | None = None,
) -> ICLScore:
    """Loss at token ``late`` minus loss at token ``early``, over ``examples [B, T]`` of validation text.

    [I] compares single positions over very many examples; with the few hundred examples a
    laptop run uses, one position's mean loss is noisy (measured: +-0.15 nats over 256
    examples), so each side averages ``window`` positions (``late - window + 1 .. late`` and
    ``early - window // 2 ..``). [I] uses 512-token examples (late = 500); a shorter context
    uses its last predicted position (``T - 2``); positions after ``late`` are not run, and the
    returned curve ends there. Negative = later tokens are predicted
    better (the model learns in context). Examples run ``chunk`` at a time (default
    :func:`icl_chunk`: each activation within :data:`PASS_BYTES`; the curve's losses come from
    :func:`~qkov.analysis.forward.tiled_nll.pass_nll`, a few MiB of logits at a time). ``curve=False``
    unembeds only the positions of the two windows (the same score, ~T/20 times less unembedding;
    ``loss_by_position`` is then empty; their logits within :data:`LOGIT_BYTES`). ``edits`` apply to every forward pass
    (:func:`~qkov.analysis.forward.tracer.trace`); chunks are as even as they can be, so no chunk of a
    resample ablation holds a single sequence. ``keep``: a list that receives each chunk's stream entering every
    layer (``[n_layers, chunk, T, d_model]``); ``start``: ``(layer, streams)``, each chunk's pass from ``layer`` on,
    from its stream there in ``streams`` (kept by a run with the same ``chunk``; for edits of that layer and later).
    """
    source = as_source(source, where="qkov.icl_score")
    # nothing after the late position enters the score
    examples = token_ids("qkov.icl_score", examples, source.cfg, "examples", keep=late + 2).to(source.device)
    T = examples.shape[1]
    early, late, early_at, late_at = icl_windows(T, early, late, window)
    if late <= early:
        raise QkovError(
            f"qkov.icl_score: examples of {T} tokens are too short: the score compares the loss at an early and a "
            f"late position, here both {late}"
        )
    at = None if curve else torch.cat([early_at, late_at]).unique()  # sorted
    width = 0 if at is None else len(at)  # the curve's losses are tiled: no [T, d_vocab] logits held
    if chunk is None:
        chunk = icl_chunk(source.cfg, T, width, torch.finfo(source.dtype).bits // 8)
    parts: dict[int, Tensor] = {}
    N = examples.shape[0]
    bounds = torch.linspace(0, N, -(-N // chunk) + 1).round().long().tolist()
    sp = ranks.current()  # a unit: one chunk of examples
    ran = 0  # chunks this rank has run: the index of their kept streams
    for u, (i, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        if not sp.mine(u, len(bounds) - 1):
            continue
        ex = examples[i:stop]
        start_at = None if start is None or not start[0] else (start[0], start[1][ran][start[0]])
        ran += 1
        if at is None:
            parts[u] = pass_nll(source, ex, edits=edits, start_at=start_at, keep=keep)
        else:  # position p predicts token p + 1
            run = trace(source, ex, positions=at, edits=edits, start_at=start_at, cache=[] if keep is None else ["resid_pre.*"])
            if keep is not None:
                keep.append(run.stack("resid_pre"))
            logits = run.logits
            logp = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32).log_softmax(-1)
            parts[u] = -logp.gather(-1, ex[:, at.to(ex.device) + 1, None])[..., 0]
        tick(progress, "heads: in-context learning", stop, N)
    mean = torch.cat(sp.gather(parts, len(bounds) - 1)).mean(0)  # [T-1], or [len(at)]
    index = {int(p): k for k, p in enumerate(at)} if at is not None else None
    pick = (lambda ps: mean[ps]) if index is None else (lambda ps: mean[[index[int(p)] for p in ps]])  # noqa: E731
    score = pick(late_at).mean() - pick(early_at).mean()
    curve_list = mean.tolist() if at is None else []
    return ICLScore(float(score), early, late, curve_list)


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
