"""Patched passes compute only what a patch can change: a patch that writes the base run's own value is not
run (its metric is the base run's), and the positions before a patch's first change take their logits from
the base recording (attention is causal) instead of being unembedded again. The results equal one patch at a
time with every position unembedded (a metric over every position, both directions), and equal the sweeps
with every copy run whole; the work saved is counted."""

from __future__ import annotations

import itertools

import pytest
import torch

from qkov import Transformer, Weights
from qkov.analysis.causal import patching as Pt
from qkov.analysis.causal.contrast import Contrast, copy_bytes
from qkov.analysis.causal.metrics import Loss
from qkov.analysis.causal.path_patch import path_patching

from helpers import LN_MLP, perturb_non_matrices, one_patch

GPT2_LIKE = LN_MLP.replace(positional="standard", act_fn="gelu_new")


def _setup():  # type: ignore[no-untyped-def]
    m = perturb_non_matrices(Transformer(GPT2_LIKE, seed=2).double().eval(), 0.2)
    w = Weights.from_model(m, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(1, GPT2_LIKE.d_vocab, (2, 10), generator=g)
    corrupted = clean.clone()
    corrupted[:, 4:6] = torch.randint(1, GPT2_LIKE.d_vocab, (2, 2), generator=g)  # positions 0-3 the same
    return w, clean, corrupted


@pytest.fixture
def every_copy_whole(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A switch: run every copy, alone, from the first position (the plain procedure)."""

    def plain(self, firsts, K):  # type: ignore[no-untyped-def]
        return [(0, [i]) for i in range(len(firsts))]

    return lambda: monkeypatch.setattr(Contrast, "passes", plain)


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_sweeps_with_a_metric_over_every_position_equal_one_patch_at_a_time(direction: str) -> None:
    w, clean, corrupted = _setup()
    base, src = (corrupted, clean) if direction == "denoise" else (clean, corrupted)
    metric = Loss(tokens=clean)
    cases = [
        ("resid_pre", ("layer", "pos"), lambda p: (p,)),
        ("head_out", ("layer", "head"), lambda h: (slice(None), h)),
        ("z", ("layer", "pos", "head"), lambda p, h: (p, h)),
        ("pattern", ("layer", "head", "pos"), lambda h, p: (h, p)),
    ]
    for kind, axes, index in cases:
        budget = 3 * copy_bytes(w, clean, None)  # three copies a pass
        got = Pt.activation_patching(w, clean, corrupted, site=kind, axes=axes, metric=metric, direction=direction, max_bytes=budget)
        for cell in itertools.product(*(range(n) for n in got.values.shape)):
            want = one_patch(w, base, src, kind, cell[0], index(*cell[1:]), metric)
            assert got.values[cell] == pytest.approx(want, abs=1e-10), (kind, cell)
        assert (got.values - got.base).abs().max() > 1e-6


@pytest.mark.parametrize("receivers", ["1.0", "logits"])
def test_the_work_saved_changes_no_number(receivers: str, monkeypatch: pytest.MonkeyPatch, every_copy_whole) -> None:  # type: ignore[no-untyped-def]
    w, clean, corrupted = _setup()
    rows: list[int] = []  # positions unembedded, per sequence of each pass
    real = Contrast.measure

    def counted(self, K, *a, **k):  # type: ignore[no-untyped-def]
        rows.append(K * (self.base.shape[1] - k.get("since", 0)))
        return real(self, K, *a, **k)

    monkeypatch.setattr(Contrast, "measure", counted)
    runs = lambda: [  # noqa: E731
        Pt.activation_patching(w, clean, corrupted, site="resid_pre").values,
        Pt.activation_patching(w, clean, corrupted, site="head_out").values,
        path_patching(w, clean, corrupted, receivers=receivers).values,
    ]
    fast, saved = runs(), list(rows)
    rows.clear()
    every_copy_whole()
    whole = runs()
    for a, b in zip(fast, whole):
        assert torch.allclose(a, b, atol=1e-10, equal_nan=True)
    L, H, T = w.cfg.n_layers, w.cfg.n_heads, clean.shape[1]
    senders = H * (L if receivers == "logits" else 1)
    assert sum(rows) == T * (L * T + L * H + senders)  # the plain procedure: every copy, every position
    # resid_pre: positions 0-3 equal in both runs at every layer (never run), the others from their own position
    assert sum(saved) < 0.6 * sum(rows)
