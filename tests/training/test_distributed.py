"""qkov train under torchrun: 2 CPU processes with gloo match one process with the same global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import qkov
from qkov import ModelConfig, TrainConfig

from helpers import torchrun, train_flags

FLAGS = train_flags(steps=30, ckpt_interval=10, eval_interval=10)


def _torchrun(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return torchrun(["train", *args], env)


def _losses(path: Path) -> list[float]:
    return [
        r["train_loss"] for r in map(json.loads, (path / "metrics.jsonl").read_text().splitlines()) if "train_loss" in r
    ]


def test_two_ranks_match_one_process_and_resume_across_world_sizes(tmp_path: Path, small_corpus: Path) -> None:
    env = {**os.environ, "QKOV_CACHE": str(tmp_path / "cache")}
    flags = [*FLAGS, "--corpus", str(small_corpus)]
    single = tmp_path / "single"
    subprocess.run(
        [sys.executable, "-m", "qkov", "train", *flags, "--out", str(single)], env=env, check=True, capture_output=True
    )
    ddp = tmp_path / "ddp"
    res = _torchrun([*flags, "--out", str(ddp)], env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("qkov checkpoint") == 1  # only rank 0 prints the summary
    a, b = _losses(single), _losses(ddp)
    assert len(a) == len(b) == 3
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, (a, b)  # float reduction order differs, nothing else
    m1, m2 = qkov.load(single), qkov.load(ddp)  # the 2-rank checkpoint loads in one process
    assert all(torch.allclose(p, q, atol=1e-4) for p, q in zip(m1.parameters(), m2.parameters()))
    assert not [p for p in ddp.iterdir() if p.name.endswith(".tmp")]

    # resume with a different number of ranks: 1 process to step 10, then 2 ranks to the end
    part = tmp_path / "part"
    cfg = ModelConfig(n_layers=2, n_heads=2, d_model=32, d_head=16, d_vocab=300, n_ctx=32)
    tc = TrainConfig(steps=30, batch=4, corpus=str(small_corpus), ckpt_interval=10, eval_interval=10)
    saved = os.environ.get("QKOV_CACHE")
    os.environ["QKOV_CACHE"] = env["QKOV_CACHE"]
    try:
        qkov.train(part, cfg, tc, device="cpu", stop_after=10)
    finally:
        if saved is not None:
            os.environ["QKOV_CACHE"] = saved
    res = _torchrun(["--resume", "--out", str(part), "--device", "cpu", "--quiet"], env)
    assert res.returncode == 0, res.stderr[-3000:]
    m3 = qkov.load(part)
    assert json.loads((part / "config.json").read_text())["training"]["step"] == 30
    assert all(torch.allclose(p, q, atol=1e-4) for p, q in zip(m1.parameters(), m3.parameters()))


def test_uneven_global_batch_is_refused(tmp_path: Path, small_corpus: Path) -> None:
    env = {**os.environ, "QKOV_CACHE": str(tmp_path / "cache")}
    flags = train_flags(steps=30, ckpt_interval=10, eval_interval=10, batch=3)  # --batch 3 over 2 ranks
    res = _torchrun([*flags, "--corpus", str(small_corpus), "--out", str(tmp_path / "x")], env)
    assert res.returncode != 0
    # each rank says it in one line (torchrun then adds its own report of the failed children)
    assert "qkov: error: train: the global batch (3) must divide evenly over 2 ranks" in res.stderr
