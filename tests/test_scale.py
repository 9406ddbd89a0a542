"""Defaults that scale: the copying rate sampled (with its error) above 8192 tokens, path
analyses sized and refused before they exhaust memory, virtual heads streamed, progress on
long work, and ranges validated before any work."""

from __future__ import annotations

import io
import math

import pytest
import torch
from rich.console import Console

from qkov import ModelConfig, QkovError, Transformer
from qkov.analysis import circuits as C
from qkov.analysis import paths as P
from qkov.analysis.heads import head_report
from qkov.apps.cli import main
from qkov.apps.progress import TrainProgress
from qkov.weights import Weights

from test_circuits import identity_model


def _random_weights(d_vocab: int, seed: int = 0) -> Weights:
    cfg = ModelConfig(n_layers=2, n_heads=2, d_model=16, d_head=4, d_vocab=d_vocab, n_ctx=8)
    return Weights.from_model(Transformer(cfg, seed=seed))


def _exact_rates(w: Weights, k: int, rows: torch.Tensor | None = None) -> list[float]:
    """The own-logit-in-top-k rate from the materialised W_E W_OV W_U, rows restricted after."""
    out = []
    for l in range(w.cfg.n_layers):
        for h in range(w.cfg.n_heads):
            full = (w.W_E.double() @ w.W_V[l, h].double() @ w.W_O[l, h].double() @ w.W_U.double()).float()
            idx = torch.arange(full.shape[0]) if rows is None else rows
            diag = full[idx, idx]
            rank = (full[idx] >= diag[:, None]).sum(-1) - 1
            out.append(float((rank < k).float().mean()))
    return out


def test_diag_k_must_lie_below_the_vocabulary(capsys: pytest.CaptureFixture[str]) -> None:
    w = identity_model(10, 3, +1.0)
    for bad in (10, 11, 0):
        with pytest.raises(QkovError, match=r"diag_k must be an integer from 1 to 9"):
            C.check_diag_k(bad, 10)
    with pytest.raises(QkovError, match="diag_k"):
        C.copying_scores(w, diag_k=10)
    with pytest.raises(QkovError, match="diag_k"):
        C.analyse(w, diag_k=50)
    with pytest.raises(QkovError, match="diag_k"):
        head_report(w, torch.zeros(1, 4, dtype=torch.long), diag_k=10)
    # the largest k allowed: the 7 all-zero rows tie everywhere, and ties count against
    assert C.copying_scores(w, diag_k=9)[0].diag_topk_rate == pytest.approx(0.3)


def test_the_rate_is_exact_up_to_8192_tokens_and_sampled_above() -> None:
    assert C.diag_tokens(8192) is None
    rows = C.diag_tokens(50257)
    assert rows is not None and len(rows) == C.DIAG_SAMPLE == 1024
    assert torch.equal(rows, rows.unique()) and int(rows.max()) < 50257  # sorted, no repeats
    assert torch.equal(rows, C.diag_tokens(50257)) and not torch.equal(rows, C.diag_tokens(50257, seed=1))
    assert C.diag_tokens(100, 100) is None and len(C.diag_tokens(100, 7)) == 7  # type: ignore[arg-type]
    w = _random_weights(9000)
    heads = C.copying_scores(w, diag_k=5)
    rows = C.diag_tokens(9000)
    assert rows is not None
    expected = _exact_rates(w, 5, rows)
    assert [h.diag_topk_rate for h in heads] == pytest.approx(expected, abs=1e-12)
    assert all(h.diag_tokens == 1024 and h.diag_stderr is not None and h.diag_stderr > 0 for h in heads)
    exact = C.copying_scores(_random_weights(300), diag_k=5)
    assert all(h.diag_tokens == 300 and h.diag_stderr == 0.0 for h in exact)


def test_a_sampled_rate_lands_within_its_error_of_the_exact_one() -> None:
    """A hand-built head with a known rate: W_OV copies the first 600 of 3000 tokens (rate 0.2)."""
    d = 3000
    cfg = ModelConfig(n_layers=1, n_heads=1, d_model=d, d_head=600, d_vocab=d, n_ctx=4)
    m = Transformer(cfg, seed=0)
    with torch.no_grad():
        m.W_E.copy_(torch.eye(d))
        m.W_U.copy_(torch.eye(d))
        proj = torch.eye(d)[:, :600]
        m.blocks[0].attn.W_V.copy_(proj[None] * 3)
        m.blocks[0].attn.W_O.copy_(proj.T[None])
    w = Weights.from_model(m)
    assert C.copying_scores(w, diag_k=1)[0].diag_topk_rate == pytest.approx(0.2)
    misses = 0
    for seed in range(20):
        h = C.copying_scores(w, diag_k=1, diag_sample=300, seed=seed)[0]
        assert h.diag_tokens == 300 and h.diag_stderr == pytest.approx(
            math.sqrt(0.2 * 0.8 / 300 * 2700 / 2999), rel=0.1
        )
        misses += abs(h.diag_topk_rate - 0.2) > 2 * h.diag_stderr  # type: ignore[operator]
    assert misses <= 4, "about 5% of samples should land beyond two standard errors"


def test_circuits_says_when_the_rate_is_an_estimate(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from qkov.io.checkpoint import save_checkpoint

    cfg = ModelConfig(n_layers=2, n_heads=2, d_model=16, d_head=4, d_vocab=9000, n_ctx=8)
    save_checkpoint(tmp_path / "big", Transformer(cfg, seed=0))
    assert main(["circuits", str(tmp_path / "big")]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the caption wraps at the terminal's width
    assert "estimated on a seeded sample of 1,024 of 9,000 tokens" in out and "±" in out
    assert main(["circuits", str(tmp_path / "big"), "--diag-k", "9000"]) == 2
    assert "diag_k must be an integer from 1 to 8999" in capsys.readouterr().err


# ------------------------------------------------------------------ paths
def test_virtual_heads_are_streamed_keeping_only_the_largest() -> None:
    cfg = ModelConfig(n_layers=3, n_heads=3, d_model=24, d_head=8, d_vocab=40, n_ctx=10)
    w = Weights.from_model(Transformer(cfg, seed=1).double(), dtype=torch.float64)
    tokens = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(0))
    every = P.expand(w, tokens, virtual_heads=True)
    kept = P.expand(w, tokens, virtual_heads=True, keep_virtual=5)
    largest = sorted(every.virtual, key=lambda k: -float(every.virtual[k].pow(2).mean()))[:5]
    assert sorted(kept.virtual) == sorted(largest)
    assert all(torch.equal(kept.virtual[k], every.virtual[k]) for k in largest)
    assert P.virtual_pairs(w) == 27 == len(every.virtual)
    full = P.summarize(w, tokens, top_virtual=5)
    assert full.virtual_expanded and len(full.virtual) == 5
    off = P.summarize(w, tokens, top_virtual=5, virtual=False)
    assert not off.virtual_expanded and off.virtual == [] and off.virtual_pairs == 27
    assert off.importance.run_losses == full.importance.run_losses


def test_virtual_heads_are_off_by_default_when_there_are_too_many(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _random_weights(40)
    monkeypatch.setattr(P, "VIRTUAL_AUTO_MAX", 3)  # this model has 4 pairs
    s = P.summarize(w, torch.zeros(1, 8, dtype=torch.long))
    assert not s.virtual_expanded and s.virtual_pairs == 4 and s.to_dict()["virtual_expanded"] is False
    assert P.summarize(w, torch.zeros(1, 8, dtype=torch.long), virtual=True).virtual_expanded


def test_paths_refuses_what_would_not_fit_before_any_work(
    monkeypatch: pytest.MonkeyPatch, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    import qkov.device as D
    from qkov.io.checkpoint import save_checkpoint

    w = _random_weights(40)
    need = P.expansion_bytes(w, 1, 8, virtual=10)  # its 4 virtual heads are expanded, the 10 largest kept
    monkeypatch.setattr(D, "free_memory", lambda _dev: need - 1)
    with pytest.raises(
        QkovError, match=r"paths: the expansion of 1 x 8 tokens needs about 0\.02 MiB, more than .* free: analyse fewer"
    ):
        P.summarize(w, torch.zeros(1, 8, dtype=torch.long))
    save_checkpoint(tmp_path / "m", Transformer(w.cfg, seed=0))
    assert main(["paths", str(tmp_path / "m"), "--batch", "1"]) == 2
    assert "analyse fewer sequences" in capsys.readouterr().err
    monkeypatch.setattr(D, "free_memory", lambda _dev: need)
    P.summarize(w, torch.zeros(1, 8, dtype=torch.long))  # exactly enough


def test_the_default_batch_holds_at_most_2048_tokens() -> None:
    assert [P.default_batch(n) for n in (8, 32, 256, 512, 1024, 2048, 4096)] == [8, 8, 8, 4, 2, 1, 1]


def test_the_gpt2_small_estimate_is_a_few_gib() -> None:
    """GPT-2 small's default paths batch (2 x 1024 tokens) is sized at a few GiB, not the 24+ GiB
    that holding its 9,504 virtual heads took."""

    class Shape:
        cfg = ModelConfig(n_layers=12, n_heads=12, d_model=768, d_head=64, d_vocab=50257, n_ctx=1024)
        dtype = torch.float32

    gib = P.expansion_bytes(Shape(), P.default_batch(1024), 1024, virtual=10) / 2**30  # type: ignore[arg-type]
    assert 2 < gib < 6


# ------------------------------------------------------------------ training progress
def test_a_slow_first_step_says_how_long_the_run_will_take() -> None:
    buf = io.StringIO()
    with TrainProgress(console=Console(file=buf, force_terminal=False)) as progress:
        progress({"event": "step", "step": 1, "steps": 101, "seconds": 30.0})
        progress({"event": "step", "step": 2, "steps": 101, "seconds": 30.0})
    assert buf.getvalue().count("the first step took 30.0 s: about 50 min for the 100 steps left") == 1
    quick = io.StringIO()
    with TrainProgress(console=Console(file=quick, force_terminal=False)) as progress:
        progress({"event": "step", "step": 1, "steps": 101, "seconds": 0.01})
    assert quick.getvalue() == ""
