"""Training: the loss falls, same seed gives the same run, resume (also after SIGKILL) is exact."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import qkov
from helpers import TINY, tiny_train, train_flags
from qkov import ModelConfig, QkovError, TrainConfig
from qkov.model.ops import next_token_loss
from qkov.training.config import lr_at
from qkov.training.losses import _CrossEntropy, _UnembedCrossEntropy, model_loss


def test_fused_loss_matches_cross_entropy_and_its_gradient() -> None:
    logits = torch.randn(20, 11, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 11, (20,))
    ours = _CrossEntropy.apply(logits, target)
    ref = torch.nn.functional.cross_entropy(logits, target)
    assert abs(float(ours.detach()) - float(ref.detach())) < 1e-12
    assert torch.autograd.gradcheck(lambda x: _CrossEntropy.apply(x, target), (logits,))
    model = qkov.Transformer(TINY, seed=0)
    toks = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        assert abs(float(model_loss(model, toks)) - float(next_token_loss(model(toks), toks))) < 1e-5


@pytest.mark.parametrize("bias", [False, True])
def test_fused_unembed_loss_matches_reference_gradients(bias: bool) -> None:
    cfg = ModelConfig(
        n_layers=1,
        n_heads=2,
        d_model=16,
        d_head=8,
        d_vocab=50,
        n_ctx=40,
        bias=bias,
        normalization="layernorm" if bias else "none",
    )
    m = qkov.Transformer(cfg, seed=0).double()
    toks = torch.randint(0, 50, (3, 40))  # 117 rows, one chunk; many chunks are checked below
    ours = model_loss(m, toks)
    g1 = torch.autograd.grad(ours, list(m.parameters()))
    logits = m(toks)
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 50), toks[:, 1:].reshape(-1))  # float64
    g2 = torch.autograd.grad(ref, list(m.parameters()))
    assert abs(float(ours.detach()) - float(ref.detach())) < 1e-12
    assert all((a - b).abs().max() < 1e-12 for a, b in zip(g1, g2))
    # chunking: many small chunks give the same loss and gradients
    x = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    W = torch.randn(16, 50, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 50, (37,))
    a = torch.autograd.grad(3.0 * _UnembedCrossEntropy.apply(x, W, None, t, 5), (x, W))
    b = torch.autograd.grad(3.0 * torch.nn.functional.cross_entropy(x @ W, t), (x, W))
    assert all((p - q).abs().max() < 1e-12 for p, q in zip(a, b))


@pytest.mark.parametrize("loss", ["fused", "one-pass"])
def test_a_confidently_wrong_prediction_has_a_finite_loss(loss: str) -> None:
    """A target whose logit lies far below the largest (its exp underflows in float32: ~104 nats) costs that
    many nats, not inf: the loss is torch's cross-entropy, its gradient too (a training run once stopped as
    "diverged" on such a step while its model was fine)."""
    t = torch.tensor([3, 0, 1])
    base = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    base[0, 3] -= 150.0  # the target 150 nats below the rest
    base[2, 1] -= 300.0
    want_x = base.clone().requires_grad_()
    want = torch.nn.functional.cross_entropy(want_x, t)
    (gw,) = torch.autograd.grad(want, want_x)
    if loss == "fused":  # x @ W with W the identity: the logits themselves
        x = base.clone().requires_grad_()
        got = _UnembedCrossEntropy.apply(x, torch.eye(6), None, t, 2)
    else:
        x = base.clone().requires_grad_()
        got = _CrossEntropy.apply(x, t)
    (g,) = torch.autograd.grad(got, x)
    assert torch.isfinite(got) and float(got) > 140 / 3
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    assert torch.allclose(g, gw, atol=1e-7)


def test_schedules() -> None:
    tc = TrainConfig(steps=100, lr=1.0, warmup=10, schedule="wsd", decay_frac=0.2, min_lr_frac=0.1)
    assert lr_at(0, tc) == pytest.approx(0.1) and lr_at(9, tc) == pytest.approx(1.0)
    assert lr_at(50, tc) == 1.0 and lr_at(80, tc) == 1.0
    assert lr_at(99, tc) == pytest.approx(0.1 + 0.9 * (1 / 20), abs=1e-9)
    cos = TrainConfig(steps=100, lr=1.0, warmup=10, schedule="cosine", min_lr_frac=0.0)
    assert lr_at(55, cos) == pytest.approx(0.5)
    assert lr_at(50, TrainConfig(steps=100, lr=1.0, warmup=10, schedule="constant")) == 1.0


def test_training_lowers_loss_and_writes_a_checkpoint(tmp_path: Path, small_corpus: Path) -> None:
    events: list[dict] = []
    heard: list[tuple[str, int, int]] = []
    out = tmp_path / "run"
    model = qkov.train(
        out, TINY, tiny_train(small_corpus), device="cpu", callback=events.append, progress=lambda *a: heard.append(a)
    )
    # progress goes through the one protocol: the corpus' stages, then the steps (0 when it starts, then each)
    steps = [a for a in heard if a[0] == "train"]
    assert steps == [("train", i, 40) for i in range(41)]
    assert heard[0][0].startswith("corpus: ") and all(0 <= d <= n for _, d, n in heard)
    assert {e["event"] for e in events} == {"start", "log", "eval", "checkpoint", "done"}  # the event log
    evals = [e for e in events if e["event"] == "eval"]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.5
    assert evals[0]["val_loss"] < math.log(300) + 0.5
    for name in ("model.safetensors", "config.json", "tokenizer.json", "metrics.jsonl", "train_state.safetensors"):
        assert (out / name).is_file(), name
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")], "temporary files left behind"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows and rows[-1]["step"] == 40
    loaded = qkov.load(out)
    assert loaded.tokenizer is not None and loaded.bos_token_id == 0
    toks = loaded.to_tokens("def f(x):\n    return x")
    assert toks[0, 0] == 0
    with torch.no_grad():
        assert torch.allclose(loaded(toks), model(toks), atol=1e-6)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["training"]["step"] == 40 and cfg["training"]["tokens"] == 40 * 4 * 32


def test_same_seed_same_run_and_resume_is_exact(tmp_path: Path, small_corpus: Path) -> None:
    tc = tiny_train(small_corpus)
    a = qkov.train(tmp_path / "a", TINY, tc, device="cpu")
    b = qkov.train(tmp_path / "b", TINY, tc, device="cpu")
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    # stop at step 20, then resume: identical weights and metrics to the uninterrupted run
    qkov.train(tmp_path / "c", TINY, tc, device="cpu", stop_after=20)
    assert json.loads((tmp_path / "c" / "config.json").read_text())["training"]["step"] == 20
    c = qkov.train(tmp_path / "c", device="cpu", resume=True)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))
    ma = (tmp_path / "a" / "metrics.jsonl").read_text()
    mc = (tmp_path / "c" / "metrics.jsonl").read_text()
    strip = lambda text: [{k: v for k, v in json.loads(r).items() if k != "tokens_per_s"} for r in text.splitlines()]  # noqa: E731
    assert strip(ma) == strip(mc)


def test_refuses_to_overwrite_and_to_resume_nothing(tmp_path: Path, small_corpus: Path) -> None:
    tc = tiny_train(small_corpus, steps=5)
    qkov.train(tmp_path / "r", TINY, tc, device="cpu")
    with pytest.raises(QkovError, match="already holds a run"):
        qkov.train(tmp_path / "r", TINY, tc, device="cpu")
    with pytest.raises(QkovError, match="nothing to resume"):
        qkov.train(tmp_path / "empty", device="cpu", resume=True)
    with pytest.raises(QkovError, match="differ"):
        qkov.train(tmp_path / "r", TINY.replace(n_heads=4), None, device="cpu", resume=True)


def test_zero_and_one_layer_models_train(tmp_path: Path, small_corpus: Path) -> None:
    for layers in (0, 1):
        m = qkov.train(
            tmp_path / f"l{layers}", TINY.replace(n_layers=layers), tiny_train(small_corpus, steps=10), device="cpu"
        )
        assert m.cfg.n_layers == layers
        assert qkov.load(tmp_path / f"l{layers}").cfg.n_layers == layers


def test_unavailable_device_is_a_user_error(tmp_path: Path, small_corpus: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(QkovError, match="cuda"):
        qkov.train(tmp_path / "x", TINY, tiny_train(small_corpus), device="cuda")
    with pytest.raises(QkovError, match="device"):
        qkov.train(tmp_path / "x", TINY, tiny_train(small_corpus), device="tpu9")


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "qkov", *args]


def test_sigkill_mid_run_then_resume_matches_uninterrupted(tmp_path: Path, small_corpus: Path) -> None:
    env = {**os.environ, "QKOV_CACHE": str(tmp_path / "cache")}
    flags = train_flags(steps=400, ckpt_interval=20, eval_interval=100, corpus=small_corpus)
    full = tmp_path / "full"
    subprocess.run(_cli("train", *flags, "--out", str(full)), env=env, check=True, capture_output=True)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        _cli("train", *flags, "--out", str(killed)),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    state = killed / "train_state.safetensors"
    deadline = time.time() + 120
    while time.time() < deadline:
        cfg = killed / "config.json"
        if state.exists() and cfg.exists() and json.loads(cfg.read_text())["training"].get("step", 0) >= 60:
            break
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    step_at_kill = json.loads((killed / "config.json").read_text())["training"]["step"]
    assert 0 < step_at_kill < 400, "the kill should land mid-run"
    # nothing corrupt: every file parses
    load_file(str(state))
    qkov.load(killed)
    for line in (killed / "metrics.jsonl").read_text().splitlines():
        json.loads(line)
    res = subprocess.run(
        _cli("train", "--resume", "--out", str(killed), "--quiet"), env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    a, b = qkov.load(full), qkov.load(killed)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    ia = json.loads((full / "config.json").read_text())["training"]
    ib = json.loads((killed / "config.json").read_text())["training"]
    assert ib["step"] == 400 and ia["val_loss"] == ib["val_loss"]
