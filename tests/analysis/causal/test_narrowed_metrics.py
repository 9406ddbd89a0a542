"""A metric that reads a few logits (a logit difference) narrows to them: on logits holding only those entries
it gives the value it gives on the whole logits, and a patched pass measured through it (its logits unembedded
at those entries alone) equals the pass unembedded whole; a metric over a softmax does not narrow."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

import qkov.analysis.causal.contrast as contrast
from qkov import Transformer, Weights
from qkov.analysis.causal import patching as Pt
from qkov.analysis.causal.contrast import Contrast
from qkov.analysis.causal.metrics import LogitDiff, Loss, Metric, Prob
from qkov.analysis.discovery.task import AnswerMetric
from qkov.analysis.forward.cache import Trace

from helpers import LN_MLP, perturb_non_matrices

V = 40


def _logits(B: int = 3, T: int = 5) -> Trace:
    g = torch.Generator().manual_seed(0)
    return Trace(torch.zeros(B, T, dtype=torch.long), torch.randn(B, T, V, generator=g, dtype=torch.float64))


def _narrow(metric, out: Trace) -> torch.Tensor:  # type: ignore[no-untyped-def]
    got = metric.narrowed()
    assert got is not None
    vocab, small = got
    assert torch.equal(vocab, torch.unique(vocab)) and len(vocab) < V  # sorted, each once
    return small(Trace(out.tokens, out.logits[..., vocab]))


@pytest.mark.parametrize(
    "metric",
    [
        LogitDiff(7, 3),
        LogitDiff(torch.tensor([5, 39, 5]), torch.tensor([0, 5, 12]), position=2),
        AnswerMetric(kind="logit-diff", answers=torch.tensor([[4, 9], [9, 1], [30, 30]]), wrong=torch.tensor([[1], [2], [4]])),
    ],
    ids=["one-id", "per-sequence", "answer-metric"],
)
def test_a_logit_difference_on_its_entries_alone_is_the_same_value(metric) -> None:  # type: ignore[no-untyped-def]
    out = _logits()
    assert float((_narrow(metric, out) - metric(out)).abs()) < 1e-15


def test_a_subclass_that_computes_its_own_value_does_not_narrow() -> None:
    class Doubled(LogitDiff):
        def __call__(self, out: Trace) -> torch.Tensor:
            return 2 * super().__call__(out)

    class Renamed(AnswerMetric):
        def per_prompt(self, out: Trace) -> torch.Tensor:
            return -super().per_prompt(out)

    assert Doubled(7, 3).narrowed() is None
    assert Renamed(kind="logit-diff", answers=torch.tensor([[4]]), wrong=torch.tensor([[1]])).narrowed() is None


def test_a_metric_over_a_softmax_does_not_narrow() -> None:
    toks = torch.zeros(3, 5, dtype=torch.long)
    answers, wrong = torch.tensor([[4], [9], [30]]), torch.tensor([[1], [2], [4]])
    for metric in (Loss(tokens=toks), Prob(4), *(AnswerMetric(kind=k, answers=answers, wrong=wrong) for k in ("prob", "loss", "kl"))):
        assert metric.narrowed() is None, metric


@dataclass(kw_only=True)
class TwoPlaces(Metric):
    """A user's metric that narrows: a logit difference summed over two positions (patches between them take
    the base run's logits at the first)."""

    diff: LogitDiff

    def __post_init__(self) -> None:
        self.positions = [4, -1]

    def __call__(self, out: Trace) -> torch.Tensor:
        return sum(replace(self.diff, position=p)(out) for p in self.positions)  # type: ignore[return-value]

    def narrowed(self) -> tuple[torch.Tensor, Metric] | None:
        vocab, small = self.diff.narrowed()  # type: ignore[misc]
        return vocab, replace(self, diff=small)


@pytest.mark.parametrize("direction", ["denoise", "noise"])
@pytest.mark.parametrize("two", [False, True])
def test_patched_passes_unembed_the_metric_entries_alone_and_measure_the_same(
    direction: str, two: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = LN_MLP.replace(positional="standard", act_fn="gelu_new")
    w = Weights.from_model(perturb_non_matrices(Transformer(cfg, seed=2).double().eval(), 0.2), dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(1, cfg.d_vocab, (2, 10), generator=g)
    corrupted = clean.clone()
    corrupted[:, 3:6] = torch.randint(1, cfg.d_vocab, (2, 3), generator=g)
    metric = LogitDiff(torch.tensor([3, 8]), torch.tensor([8, 1]))
    metric = TwoPlaces(diff=metric) if two else metric
    asked: list[object] = []
    real = contrast.trace
    monkeypatch.setattr(contrast, "trace", lambda *a, **k: asked.append(k.get("vocab")) or real(*a, **k))

    def sweep() -> torch.Tensor:
        got = Pt.activation_patching(  # a pass per patch: one after position 4 reads the base run's logits there
            w, clean, corrupted, site="resid_pre", metric=metric, direction=direction, max_bytes=1
        )
        return got.values

    narrowed = sweep()
    vocabs = [v for v in asked if v is not None]
    assert vocabs and all(v.tolist() == [1, 3, 8] for v in vocabs)  # type: ignore[attr-defined]
    monkeypatch.setattr(Contrast, "_narrowed", lambda self, edits=None: None)
    asked.clear()
    whole = sweep()
    assert not any(v is not None for v in asked)
    assert (narrowed - whole).abs().max() < 1e-12 and narrowed.abs().max() > 1e-3


def test_a_pass_that_edits_the_logits_unembeds_them_whole() -> None:
    cfg = LN_MLP
    w = Weights.from_model(perturb_non_matrices(Transformer(cfg, seed=2).double().eval(), 0.2), dtype=torch.float64)
    toks = torch.randint(1, cfg.d_vocab, (2, 8), generator=torch.Generator().manual_seed(3))
    c = Contrast.of(w, toks, toks.flip(0), metric=LogitDiff(3, 8)).record()
    doubled = c.measure(1, {"logits": lambda v, site: 2 * v})
    assert abs(float(doubled[0]) - 2 * c.base_value) < 1e-12 and abs(c.base_value) > 1e-3
