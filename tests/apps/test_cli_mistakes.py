"""User mistakes the fault probe of issue 40 turned into tracebacks, each now one line (exit 2), and a
closed pipe that ends the command quietly: a model file of integers, a config nested past Python's
parser, a model too large to train, the reader of ``--json`` going away."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import qkov
from qkov import ModelConfig, Transformer
from qkov.apps.cli import EXIT_BROKEN_PIPE
from qkov.apps.cli.common import out_of_memory_line

from helpers import ROOT, run_main

CFG = ModelConfig(n_layers=1, n_heads=2, d_model=16, d_head=8, n_ctx=16, d_vocab=32)
READERS = ("info", "circuits", "heads")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mistakes") / "ckpt"
    qkov.save_checkpoint(Transformer(CFG, seed=0), path)
    return path


def _one_line(rc: int, err: str) -> None:
    assert rc == 2 and "Traceback" not in err, err
    assert err.startswith("qkov: error: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("command", READERS)
def test_a_model_file_of_integers_is_one_line(ckpt: Path, tmp_path: Path, command: str, capsys) -> None:
    bad = tmp_path / "ints"
    bad.mkdir()
    for f in ckpt.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    with safe_open(str(ckpt / "model.safetensors"), "pt") as fh:
        meta = fh.metadata()
    tensors = load_file(str(ckpt / "model.safetensors"))
    save_file({k: v.to(torch.int32) for k, v in tensors.items()}, str(bad / "model.safetensors"), metadata=meta)
    rc, _, err = run_main(capsys, command, bad)
    _one_line(rc, err)
    assert "int32" in err and "floating point" in err


@pytest.mark.parametrize("command", READERS)
def test_a_config_nested_past_the_parser_is_one_line(tmp_path: Path, command: str, capsys) -> None:
    bad = tmp_path / "nested"
    bad.mkdir()
    (bad / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    rc, _, err = run_main(capsys, command, bad)
    _one_line(rc, err)
    assert "nested too deeply" in err


def test_a_model_too_large_to_train_is_refused_at_once_in_one_line(tmp_path: Path, capsys) -> None:
    flags = "--layers 100000 --d-model 1024 --d-head 256 --heads 4 --steps 5 --device cpu".split()
    t0 = time.perf_counter()
    rc, _, err = run_main(capsys, "train", *flags, "--out", tmp_path / "d")
    _one_line(rc, err)
    assert time.perf_counter() - t0 < 30  # refused from the shapes, nothing allocated
    assert "419,432,759,296 parameters" in err and "--layers" in err and "--max-memory" not in err, err
    assert not (tmp_path / "d").exists()


def test_the_training_estimate_covers_what_a_step_keeps_for_its_backward() -> None:
    """The activation estimate against the tensors autograd actually keeps (summed by storage), for
    models with and without normalisation and MLPs: never below, at most twice."""
    from qkov.training.footprint import activation_floats
    from qkov.training.losses import model_loss

    for cfg in (
        ModelConfig(n_layers=2, n_heads=4, d_model=64, d_head=16, n_ctx=128, d_vocab=512),
        ModelConfig(
            n_layers=3, n_heads=2, d_model=32, d_head=8, n_ctx=64, d_vocab=300, normalization="layernorm", d_mlp=128
        ),
        ModelConfig(
            n_layers=2,
            n_heads=4,
            d_model=32,
            d_head=8,
            n_ctx=64,
            d_vocab=256,
            normalization="rmsnorm",
            d_mlp=64,
            gated_mlp=True,
            positional="rotary",
            n_kv_heads=2,
        ),
    ):
        model = Transformer(cfg, seed=0)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        kept: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                kept[s.data_ptr()] = s.nbytes()
            return t

        tokens = torch.randint(0, cfg.d_vocab, (4, cfg.n_ctx))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model_loss(model, tokens).backward()
        measured = sum(kept.values()) / 4
        estimate = activation_floats(cfg, 4)
        assert measured <= estimate <= 2 * measured, (cfg.describe(), measured, estimate)


def test_an_allocation_that_fails_in_train_names_trains_flags() -> None:
    exc = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 bytes."
    )
    train, heads = out_of_memory_line(exc, "train"), out_of_memory_line(exc, "heads")
    assert train is not None and heads is not None
    assert "--max-memory" not in train and "--batch" in train and "1.0 TiB" in train
    assert "--max-memory" in heads


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly(ckpt: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "qkov", "heads", str(ckpt), "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader goes away before the output comes (`| head -1` after its line)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=600) == EXIT_BROKEN_PIPE
    assert err == "", err
