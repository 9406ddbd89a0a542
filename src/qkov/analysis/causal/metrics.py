"""What a patching experiment measures: a number per run, from its logits (and, for some, its
cached activations).

A metric is any callable ``metric(logits [B, T, V]) -> scalar tensor`` (TransformerLens' patching
metrics port as they are), or a :class:`Metric`: ``metric(out)`` of a whole
:class:`~qkov.analysis.forward.cache.Trace`, naming the sites it reads (``reads``, cached in every
patched run) and the positions whose logits it needs (``positions``; the others are never
unembedded). Every built-in metric is a mean over the batch and differentiable, so attribution
patching can take its gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from ...errors import QkovError
from ...model.ops import next_token_nll
from ...model.tokens import TextCodec
from ..forward.cache import Trace

__all__ = ["as_metric", "Attention", "ICLWindows", "LogitDiff", "Loss", "Metric", "OfLogits", "parse_metric", "Prob"]


@dataclass(kw_only=True)
class Metric:
    """Base class: ``name`` (how results label it), ``reads`` (sites to cache), ``positions``
    (logit positions needed, absolute or negative from the end; ``None``: all). These are keywords
    only, so a metric's own fields come first: ``LogitDiff(correct, incorrect)``."""

    name: str = "metric"
    reads: tuple[str, ...] = ()
    positions: Sequence[int] | None = None

    def __call__(self, out: Trace) -> Tensor:  # pragma: no cover - subclasses
        raise NotImplementedError

    def position_terms(self, logits: Tensor, positions: Tensor, tokens: Tensor) -> Tensor | None:
        """For a metric that is a sum over positions (mean over the batch): each position's term, ``[N, P]``,
        from the logits ``[N, P, V]`` at ``positions [P]`` of runs of ``tokens [N, T]``, so that the metric of
        a run is its terms over every position it reads summed, then averaged over the batch. ``None``: the metric
        is not such a sum (the default). A patched pass then takes the terms of the positions before its first
        change from the base run instead of unembedding them again
        (:meth:`~qkov.analysis.causal.contrast.Contrast.measure`)."""
        return None

    def narrowed(self) -> tuple[Tensor, Metric] | None:
        """``(vocab [C], metric)`` when the metric reads the logits of a few vocabulary entries alone (no
        softmax over them, no site): those entries, sorted, and the same metric on logits that hold only them in
        that order (``[..., C]``: a patched pass then unembeds ``C`` columns, :func:`~qkov.analysis.forward.tracer.trace`'s
        ``vocab``). ``None`` (the default): it reads the whole vocabulary. The ids must have been checked against
        the vocabulary (the metric once evaluated on whole logits)."""
        return None

    def logit_positions(self, seq: int) -> Tensor | None:
        """The positions to unembed in a sequence of ``seq`` tokens (``None``: every one)."""
        if self.positions is None:
            return None
        return torch.tensor(sorted({p % seq for p in self.positions}), dtype=torch.long)


@dataclass
class OfLogits(Metric):
    """A plain function of the logits ``[B, T, V]`` (every position unembedded), as TransformerLens takes."""

    fn: Callable[[Tensor], Tensor] | None = None

    def __call__(self, out: Trace) -> Tensor:
        return torch.as_tensor(self.fn(out.logits))  # type: ignore[misc]


@dataclass
class LogitDiff(Metric):
    """``logit[correct] - logit[incorrect]`` at ``position`` (default the last), mean over the batch.
    ``correct`` / ``incorrect``: one id, or one per sequence (``LogitDiff(317, 326)``)."""

    correct: Any
    incorrect: Any
    position: int = -1

    def __post_init__(self) -> None:
        _check_ids("LogitDiff", correct=self.correct, incorrect=self.incorrect)
        if self.name == "metric":
            self.name = f"logit diff {_ids(self.correct)} - {_ids(self.incorrect)}"
        self.positions = [self.position]

    def __call__(self, out: Trace) -> Tensor:
        logits = out.logits_at(self.position)  # [B, V]
        pick = lambda t: logits.gather(-1, _column(t, logits))[:, 0]  # noqa: E731
        return (pick(self.correct) - pick(self.incorrect)).mean()

    def narrowed(self) -> tuple[Tensor, Metric] | None:
        """The correct and incorrect ids, and this difference on logits holding those alone (not for a subclass
        that computes its value another way: it says for itself)."""
        if not computes_as(self, LogitDiff, "__call__"):
            return None
        vocab, (correct, incorrect) = narrow_ids(self.correct, self.incorrect)
        return vocab, replace(self, correct=correct, incorrect=incorrect)


@dataclass
class Prob(Metric):
    """The probability of ``token`` at ``position`` (default the last), mean over the batch."""

    token: Any
    position: int = -1

    def __post_init__(self) -> None:
        _check_ids("Prob", token=self.token)
        if self.name == "metric":
            self.name = f"prob {_ids(self.token)}"
        self.positions = [self.position]

    def __call__(self, out: Trace) -> Tensor:
        logits = out.logits_at(self.position).float()
        return logits.softmax(-1).gather(-1, _column(self.token, logits))[:, 0].mean()


@dataclass
class Loss(Metric):
    """The next-token loss of ``tokens [B, T]`` (the clean run's, by default in patching) predicted
    from the run's logits, mean over the batch and positions (``positions``: only those predicting)."""

    tokens: Tensor | None = None
    at: Sequence[int] | None = None

    def __post_init__(self) -> None:
        self.name = "loss on the clean tokens" if self.at is None else f"loss at {len(self.at)} positions"
        self.positions = None if self.at is None else list(self.at)

    def __call__(self, out: Trace) -> Tensor:
        toks = out.tokens if self.tokens is None else self.tokens
        toks = toks.to(out.logits.device)
        if self.at is None:
            return next_token_nll(out.logits, toks).mean()
        T = toks.shape[1]
        at = torch.tensor(sorted({p % T for p in self.at}))
        if bool((at >= T - 1).any()):
            raise QkovError("loss: the last position predicts no token; choose earlier positions")
        logp = out.logits_at(at).float().log_softmax(-1)
        return -logp.gather(-1, toks[:, at + 1, None])[..., 0].mean()

    def position_terms(self, logits: Tensor, positions: Tensor, tokens: Tensor) -> Tensor:
        """Each position's next-token loss divided by the number of positions the loss averages (0 at the
        positions it does not read): ``[N, P]``, in float64 (each loss computed in the dtype :meth:`__call__` uses)."""
        N, T = tokens.shape
        toks = (tokens if self.tokens is None else self.tokens).to(logits.device)
        toks = toks.repeat(N // toks.shape[0], 1) if toks.shape[0] != N else toks
        read = torch.arange(T - 1) if self.at is None else torch.tensor(sorted({p % T for p in self.at}))
        weight = torch.zeros(T, dtype=torch.float64)
        weight[read] = 1.0 / len(read)
        pos = positions.cpu()
        out = torch.zeros(N, len(pos), dtype=torch.float64, device=logits.device)
        keep = (weight[pos] > 0).nonzero()[:, 0]  # the positions the loss reads (never the last)
        if len(keep):
            lo, hi = int(keep[0]), int(keep[-1]) + 1
            where = slice(lo, hi) if hi - lo == len(keep) else keep.to(logits.device)  # a slice copies nothing
            at = pos[keep]
            wide = logits.dtype == torch.float64 and self.at is None  # as __call__ (chosen positions: float32)
            dtype = torch.float64 if wide else torch.float32
            logp = logits[:, where].to(dtype).log_softmax(-1)
            nll = -logp.gather(-1, toks[:, at.to(logits.device) + 1, None])[..., 0]
            out[:, where] = nll.double() * weight[at].to(logits.device)
        return out


@dataclass
class Attention(Metric):
    """Mean attention of head ``layer.head`` from each query in ``queries`` to the key ``offset``
    positions before it (``offset = period - 1`` is induction's prefix matching on tokens repeating
    every ``period``: the token after the previous occurrence). Reads the pattern, no logits."""

    layer: int = 0
    head: int = 0
    queries: Sequence[int] = field(default_factory=list)
    offset: int = 0

    def __post_init__(self) -> None:
        self.name = f"attention of {self.layer}.{self.head} to query - {self.offset}"
        self.reads, self.positions = (f"pattern.{self.layer}",), []

    def __call__(self, out: Trace) -> Tensor:
        q = torch.as_tensor(list(self.queries), dtype=torch.long)
        if len(q) == 0 or bool((q - self.offset < 0).any()):
            raise QkovError(f"attention metric: every query must be at least {self.offset} positions in")
        p = out["pattern", self.layer][:, self.head]  # [B, T, T]
        return p[:, q, q - self.offset].mean()


@dataclass
class ICLWindows(Metric):
    """The in-context-learning score's form on a run of ``tokens`` (the clean ones by default): the
    mean loss at positions ``late`` minus the mean loss at positions ``early`` (each predicting the
    next token), mean over the batch; negative when later tokens are predicted better."""

    early: Sequence[int] = field(default_factory=list)
    late: Sequence[int] = field(default_factory=list)
    tokens: Tensor | None = None

    def __post_init__(self) -> None:
        self.name = f"ICL: loss at {len(self.late)} late minus {len(self.early)} early positions"
        self.positions = sorted({*self.early, *self.late})

    def __call__(self, out: Trace) -> Tensor:
        toks = (out.tokens if self.tokens is None else self.tokens).to(out.logits.device)

        def loss(at: Sequence[int]) -> Tensor:
            idx = torch.tensor(list(at))
            logp = out.logits_at(idx).float().log_softmax(-1)
            return -logp.gather(-1, toks[:, idx + 1, None])[..., 0].mean()

        return loss(self.late) - loss(self.early)


def as_metric(metric: Any, clean: Tensor) -> Metric:
    """``metric`` as a :class:`Metric`: ``None`` -> the loss on the clean tokens; a plain function of
    the logits -> :class:`OfLogits`."""
    if metric is None:
        return Loss(tokens=clean)
    if isinstance(metric, Metric):
        return metric
    if callable(metric):
        return OfLogits(name=getattr(metric, "__name__", "metric"), fn=metric)
    raise QkovError(f"metric: expected a function of the logits or a qkov Metric, got {type(metric).__name__}")


def _column(t: Any, logits: Tensor) -> Tensor:
    """Token ids ``t`` (one, or one per sequence) as a ``[B, 1]`` index into ``logits [B, V]``."""
    ids = torch.as_tensor(t, device=logits.device, dtype=torch.long).reshape(-1, 1)
    if ids.shape[0] not in (1, logits.shape[0]):
        raise QkovError(f"metric: give one token id or one per sequence ({logits.shape[0]}), got {ids.shape[0]}")
    if bool(((ids < 0) | (ids >= logits.shape[-1])).any()):
        raise QkovError(f"metric: token ids must be in 0..{logits.shape[-1] - 1}")
    return ids.expand(logits.shape[0], 1)


def computes_as(metric: Metric, cls: type, *methods: str) -> bool:
    """Whether ``metric`` computes its value with ``cls``'s own ``methods`` (none overridden by a subclass): what
    a class's :meth:`Metric.narrowed` asks before narrowing, since a subclass computing its value another way
    says for itself."""
    return all(getattr(type(metric), m) is getattr(cls, m) for m in methods)


def narrow_ids(*ids: Any) -> tuple[Tensor, list[Tensor]]:
    """The distinct token ids among ``ids`` (each an id or a tensor of ids), sorted, ``[C]``, and each of ``ids``
    as positions in them (the same shape): how a metric reads logits that hold only those entries."""
    given = [torch.as_tensor(t, dtype=torch.long) for t in ids]
    vocab = torch.unique(torch.cat([t.reshape(-1).cpu() for t in given]))
    return vocab, [torch.searchsorted(vocab.to(t.device), t) for t in given]


def _check_ids(what: str, **given: Any) -> None:
    """Refuse what cannot be token ids (a string, a float), naming the argument."""
    for name, t in given.items():
        try:
            ids = torch.as_tensor(t)
        except (TypeError, ValueError, RuntimeError):
            ids = None
        if ids is None or ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.numel() == 0 or ids.ndim > 1:
            hint = " (a word: model.to_single_token(word))" if isinstance(t, str) else ""
            raise QkovError(f"{what}: {name} must be a token id or one id per sequence, got {t!r}{hint}")


def _ids(t: Any) -> str:
    t = torch.as_tensor(t).reshape(-1).tolist()
    return str(t[0]) if len(t) == 1 else f"[{len(t)} ids]"


def parse_metric(spec: str | None, clean: Tensor, codec: TextCodec | None, d_vocab: int) -> Metric:
    """A metric from its written form: ``loss`` (default: the loss on the clean tokens),
    ``logit-diff:A,B`` (logit of A minus logit of B at the last position), ``prob:T``. Each token is
    an integer id, or a word the model's ``codec`` resolves to one token with or without its leading
    space (:meth:`~qkov.model.tokens.TextCodec.single_token`: ``logit-diff: Tim, Lily`` and
    ``logit-diff:Tim,Lily`` both find ``▁Tim`` / ``ĠTim``); the metric's name shows what each became."""
    if spec is None or spec == "loss":
        return Loss(tokens=clean)
    kind, _, rest = spec.partition(":")
    tokens = [_token(t, codec, d_vocab) for t in rest.split(",")] if rest else []
    ids = [i for i, _ in tokens]
    if kind == "logit-diff" and len(tokens) == 2:
        return LogitDiff(*ids, name=f"logit diff {tokens[0][1]} - {tokens[1][1]}")
    if kind == "prob" and len(tokens) == 1:
        return Prob(ids[0], name=f"prob {tokens[0][1]}")
    raise QkovError(f"metric {spec!r}: expected loss, logit-diff:A,B or prob:T")


def _token(text: str, codec: TextCodec | None, d_vocab: int) -> tuple[int, str]:
    """``(id, label)`` of one token of a written metric: an id as given, or a word's one token."""
    if text.strip().lstrip("-").isdigit():
        i = int(text)
        if not 0 <= i < d_vocab:
            raise QkovError(f"metric: token id {i} out of range [0, {d_vocab})")
        return i, str(i) if codec is None else f"{codec.token_str(i)!r} ({i})"
    if codec is None:
        raise QkovError(f"metric: {text!r} is not a token id, and the model has no tokenizer to read it")
    try:
        i = codec.single_token(text)
    except QkovError as exc:
        raise QkovError(f"metric: {exc}") from None
    if not 0 <= i < d_vocab:
        raise QkovError(f"metric: {text!r} is token {i}, outside the model's vocabulary of {d_vocab}")
    return i, f"{codec.token_str(i)!r} ({i})"
