"""One snapshot's measures: the text pass (losses and previous-token scores in one forward, read at
the entries ``A[i, i-1]`` from the attention kernel's log-sum-exp, no pattern formed) equal to the
plain forward's losses and to the patterns' scores, written out independently in float64 (float32 to
1e-6: means of entries each a few float32 ulps of the scores from the softmax's)."""

from __future__ import annotations

import pytest
import torch

from qkov import Weights, trace
from qkov.analysis.heads.pattern_scores import previous_token_scores, text_scores
from qkov.analysis.series.measures import previous_token_on_text, text_pass
from qkov.model.ops import next_token_nll

from hand_built import CTX, V, hand_built
from reference import reference_forward


def _views() -> tuple[Weights, Weights]:
    """The hand-built model (head 0.0 attends to the previous token, 0.1 to position 0) in float32 and float64."""
    return Weights.from_model(hand_built()), Weights.from_model(hand_built().double(), dtype=torch.float64)


def _text(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, V, (n, CTX), generator=torch.Generator().manual_seed(seed))


def test_one_text_pass_gives_the_forwards_losses_and_the_patterns_previous_token_scores() -> None:
    w, w64 = _views()
    text = _text(6, seed=4)
    patterns = reference_forward(w64, text)[1]  # [L, B, H, T, T]
    nll, prev = text_pass(w, text, scored=4, chunk=3)  # chunks of 3: the second holds one scored sequence
    assert nll is not None and torch.equal(nll, next_token_nll(trace(w, text).logits, text))  # the plain forward
    assert prev.dtype == torch.float64 and prev.shape == (2, 2)
    assert (prev - previous_token_scores(patterns[:, :4])).abs().max() < 1e-6  # the first 4 sequences alone
    assert prev[0, 0] > 0.99 and prev[0, 1] < 0.1  # heads differ: not a comparison of constants
    none, every = text_pass(w, text, losses=False)
    assert none is None and (every - previous_token_scores(patterns)).abs().max() < 1e-6


@pytest.mark.parametrize("chunk", [None, 3])
def test_previous_token_alone_equals_the_text_scores_and_the_patterns(chunk: int | None) -> None:
    """The previous-token scores dynamics reads equal the text scores' (which read the whole patterns)
    and the float64 patterns' mean ``A[i, i-1]``."""
    w, w64 = _views()
    text = _text(8, seed=2)
    got = previous_token_on_text(w, text, chunk=chunk)
    assert got.dtype == torch.float64 and got.shape == (w.cfg.n_layers, w.cfg.n_heads)
    assert (got - text_scores(w, text, chunk=chunk)["previous_token"]).abs().max() < 1e-6
    assert (got - previous_token_scores(reference_forward(w64, text)[1])).abs().max() < 1e-6
    assert got.max() > 0.9 and got.min() < 0.5  # heads differ: the comparison is not between constants
