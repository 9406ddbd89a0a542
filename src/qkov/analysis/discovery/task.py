"""A task: clean and corrupted prompt pairs, the answers, and the metric a circuit is found for.

A :class:`Task` holds ``N`` prompt pairs as token ids (each clean prompt and its corrupted twin have
the same length; pairs of different lengths are kept right-padded with their ``lengths`` and run in
groups of one length), the ``answers`` and ``wrong`` answers of each prompt (token ids, the same
number for every prompt) and the metric, measured at each prompt's last token:

* ``logit-diff``: the mean logit of the answers minus the mean logit of the wrong answers (AutoCircuit's
  ``avg_diff``; one answer and one wrong answer: Wang et al.'s logit difference);
* ``prob``: the mean probability of the answers;
* ``loss``: the mean ``-log p`` of the answers;
* ``kl``: ``KL(p_clean || p)``, the divergence of the run's next-token distribution from the clean
  run's (Conmy et al.'s ACDC criterion; 0 on the clean run, where its gradient vanishes too).

Each is a :class:`~qkov.analysis.causal.metrics.Metric` (:class:`AnswerMetric`): the mean over the
prompts of a batch, differentiable, so every patching and attribution method takes it as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterator

import torch
from torch import Tensor

from ...errors import QkovError
from ..causal.metrics import computes_as, Metric, narrow_ids
from ..forward.cache import Trace

__all__ = ["AnswerMetric", "METRICS", "Task", "TaskBatch"]

METRICS = ("logit-diff", "prob", "loss", "kl")
_NAMES = {
    "logit-diff": "logit diff (answers - wrong answers)",
    "prob": "probability of the answers",
    "loss": "loss of the answers",
    "kl": "KL(clean || run) of the next token",
}


@dataclass(kw_only=True)
class AnswerMetric(Metric):
    """A task's metric on a batch of ``B`` prompts: ``kind`` (one of :data:`METRICS`), ``answers
    [B, A]`` and ``wrong [B, W]`` token ids, ``reference [B, V]`` the clean run's log-probabilities
    (for ``kl``), read at ``position`` (default the last token)."""

    kind: str
    answers: Tensor
    wrong: Tensor
    reference: Tensor | None = None
    position: int = -1

    def __post_init__(self) -> None:
        if self.kind not in METRICS:
            raise QkovError(f"metric: expected one of {', '.join(METRICS)}, got {self.kind!r}")
        if self.kind == "logit-diff" and self.wrong.shape[1] == 0:
            raise QkovError("metric logit-diff: the task gives no wrong answers (use prob, loss or kl)")
        self.name = _NAMES[self.kind]
        self.positions = [self.position]

    @property
    def higher_is_better(self) -> bool:
        """Whether the clean run's behaviour is a high value (logit difference, probability)."""
        return self.kind in ("logit-diff", "prob")

    def per_prompt(self, out: Trace) -> Tensor:
        """``[B]`` the metric of each prompt of the run ``out``."""
        logits = _wide(out.logits_at(self.position))  # [B, V]
        dev = logits.device
        if self.kind == "logit-diff":
            pick = lambda ids: logits.gather(-1, ids.to(dev)).mean(-1)  # noqa: E731
            return pick(self.answers) - pick(self.wrong)
        logp = logits.log_softmax(-1)
        if self.kind == "prob":
            return logp.gather(-1, self.answers.to(dev)).exp().mean(-1)
        if self.kind == "loss":
            return -logp.gather(-1, self.answers.to(dev)).mean(-1)
        if self.reference is None:
            raise QkovError("metric kl: no clean run to compare with (AnswerMetric.with_reference)")
        ref = self.reference.to(dev)
        return (ref.exp() * (ref - logp)).sum(-1)

    def __call__(self, out: Trace) -> Tensor:
        return self.per_prompt(out).mean()

    def narrowed(self) -> tuple[Tensor, AnswerMetric] | None:
        """A logit difference reads its answers' and wrong answers' logits alone: those ids, and this metric on
        logits holding only them (:meth:`~qkov.analysis.causal.metrics.Metric.narrowed`); the other kinds take a
        softmax over the vocabulary (``None``)."""
        if self.kind != "logit-diff" or not computes_as(self, AnswerMetric, "__call__", "per_prompt"):
            return None
        vocab, (answers, wrong) = narrow_ids(self.answers, self.wrong)
        return vocab, replace(self, answers=answers, wrong=wrong)

    def with_reference(self, clean: Trace) -> AnswerMetric:
        """This metric with the clean run ``clean``'s next-token log-probabilities as the reference of ``kl``."""
        ref = _wide(clean.logits_at(self.position)).log_softmax(-1).detach()
        return replace(self, reference=ref)


@dataclass
class TaskBatch:
    """Prompts of one length from a task: ``clean`` and ``corrupted`` ``[B, T]``, the ``rows`` of the
    task they are (``[B]``), and the task's metric on them (:class:`AnswerMetric`)."""

    clean: Tensor
    corrupted: Tensor
    rows: Tensor
    metric: AnswerMetric


@dataclass
class Task:
    """``N`` prompt pairs (see the module docstring): ``clean`` and ``corrupted`` ``[N, T]`` (right-padded
    to the longest, ``lengths [N]``), ``answers [N, A]``, ``wrong [N, W]`` token ids, the ``metric``
    (one of :data:`METRICS`), a ``name`` and, optionally, the prompts as text (``texts``)."""

    name: str
    clean: Tensor
    corrupted: Tensor
    answers: Tensor
    wrong: Tensor
    metric: str = "logit-diff"
    lengths: Tensor | None = None
    texts: list[str] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.clean, self.corrupted = _ids(self.clean, "clean"), _ids(self.corrupted, "corrupted")
        self.answers, self.wrong = _ids(self.answers, "answers", 2), _ids(self.wrong, "wrong answers", 2)
        N = self.clean.shape[0]
        if self.clean.shape != self.corrupted.shape:
            raise QkovError(
                f"task {self.name}: the clean and corrupted prompts must pair up with equal lengths, got shapes "
                f"{list(self.clean.shape)} and {list(self.corrupted.shape)}"
            )
        if N == 0:
            raise QkovError(f"task {self.name}: no prompts")
        if self.answers.shape[0] != N or self.wrong.shape[0] != N or self.answers.shape[1] == 0:
            raise QkovError(
                f"task {self.name}: every one of the {N} prompts needs its answers (got answers for "
                f"{self.answers.shape[0]}, wrong answers for {self.wrong.shape[0]})"
            )
        if self.lengths is None:
            self.lengths = torch.full((N,), self.clean.shape[1], dtype=torch.long)
        self.lengths = torch.as_tensor(self.lengths, dtype=torch.long)
        if (
            self.lengths.shape != (N,)
            or bool((self.lengths < 1).any())
            or bool((self.lengths > self.clean.shape[1]).any())
        ):
            raise QkovError(f"task {self.name}: lengths must give each prompt's token count (1..{self.clean.shape[1]})")
        AnswerMetric(kind=self.metric, answers=self.answers[:1], wrong=self.wrong[:1])  # checks the metric

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return int(self.clean.shape[0])

    @property
    def one_length(self) -> int | None:
        """The prompts' length when they all have one, else ``None``."""
        ls = self.lengths.unique()  # type: ignore[union-attr]
        return int(ls[0]) if len(ls) == 1 else None

    def single_length(self, why: str) -> int:
        """The prompts' one length; a one-line error (saying ``why`` it is needed) when they differ."""
        T = self.one_length
        if T is None:
            ls = self.lengths.unique().tolist()  # type: ignore[union-attr]
            raise QkovError(
                f"task {self.name}: {why} needs prompts of one length, and they have {len(ls)} lengths "
                f"({ls[0]}..{ls[-1]} tokens); keep prompts of one length (a span schema to align them is not supported)"
            )
        return T

    def check(self, cfg: Any) -> Task:
        """``self`` when every id is in the model's vocabulary and every prompt fits its context."""
        V = cfg.d_vocab
        for what, t in (
            ("prompt", self.clean),
            ("prompt", self.corrupted),
            ("answer", self.answers),
            ("answer", self.wrong),
        ):
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= V):
                raise QkovError(f"task {self.name}: a {what} token id is outside the model's vocabulary of {V}")
        if self.clean.shape[1] > cfg.n_ctx:
            raise QkovError(
                f"task {self.name}: prompts of {self.clean.shape[1]} tokens exceed the context of {cfg.n_ctx}"
            )
        return self

    def answer_metric(self, rows: Tensor) -> AnswerMetric:
        """The task's metric on the prompts ``rows``."""
        return AnswerMetric(kind=self.metric, answers=self.answers[rows], wrong=self.wrong[rows])

    def batches(self, size: int) -> Iterator[TaskBatch]:
        """The prompts in batches of at most ``size``, each of one length (in order of first appearance),
        the prompts of a length shared evenly between its batches."""
        lengths = self.lengths  # type: ignore[union-attr]
        for T in dict.fromkeys(lengths.tolist()):
            rows = (lengths == T).nonzero()[:, 0]
            for r in rows.tensor_split(-(-len(rows) // max(1, size))):
                yield TaskBatch(self.clean[r, :T], self.corrupted[r, :T], r, self.answer_metric(r))

    def take(self, n: int) -> Task:
        """The first ``n`` prompt pairs."""
        return replace(
            self, clean=self.clean[:n], corrupted=self.corrupted[:n], answers=self.answers[:n], wrong=self.wrong[:n],
            lengths=self.lengths[:n], texts=None if self.texts is None else self.texts[:n],  # type: ignore[index]
        )  # fmt: skip

    def with_metric(self, metric: str) -> Task:
        """The same prompts measured by ``metric`` (one of :data:`METRICS`)."""
        return replace(self, metric=metric)

    def describe(self) -> str:
        """One line: the prompts, their lengths and the metric."""
        ls = self.lengths.unique().tolist()  # type: ignore[union-attr]
        span = f"{ls[0]} tokens" if len(ls) == 1 else f"{ls[0]}..{ls[-1]} tokens"
        return f"{self.name}: {len(self)} prompt pairs of {span}; metric {_NAMES[self.metric]}"


def _wide(x: Tensor) -> Tensor:
    """``x`` in float32 at least (half-precision logits are measured in float32)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _ids(t: Any, what: str, dims: int = 2) -> Tensor:
    try:
        x = torch.as_tensor(t)
    except (TypeError, ValueError, RuntimeError):
        raise QkovError(f"task: {what} must be token ids") from None
    if x.numel() == 0:
        x = x.long()
    if x.ndim == 1 and dims == 2 and what.endswith("answers"):
        x = x[:, None]
    if x.ndim != dims or x.dtype.is_floating_point or x.dtype == torch.bool:
        raise QkovError(f"task: {what} must be integer token ids of shape [prompts, n], got {list(x.shape)} {x.dtype}")
    return x.long()
