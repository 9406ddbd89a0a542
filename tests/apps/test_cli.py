"""The command line: train/info round trip, --help everywhere, one-line errors with exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qkov
from qkov import ModelConfig
from qkov.apps.cli import main

from helpers import train_flags

SMALL = train_flags(heads=4, d_model=64, ctx=128, vocab=512, batch=8, steps=60, quiet=None)


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "qkov", *args], capture_output=True, text=True, cwd=cwd, env={**os.environ}, timeout=600
    )


def test_small_flags_train_in_seconds_and_info_reads_back(tmp_path: Path, small_corpus: Path) -> None:
    out = tmp_path / "small"
    res = run_cli("train", *SMALL, "--corpus", str(small_corpus), "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "val loss" in res.stderr  # progress lines (not a terminal: plain lines)
    assert "validation loss" in res.stdout  # the info table at the end
    info = run_cli("info", str(out), "--json")
    assert info.returncode == 0, info.stderr
    data = json.loads(info.stdout)
    assert data["model"]["n_layers"] == 2 and data["model"]["d_vocab"] == 512
    assert data["steps"] == 60 and data["complete"] is True
    assert data["tokens"] == 60 * 8 * 128
    assert data["parameters"] == qkov.load(out).num_parameters()
    assert 0 < data["val_loss"] < 7 and 0 < data["train_loss"] < 7
    table = run_cli("info", str(out))
    assert table.returncode == 0 and "parameters" in table.stdout


def test_token_budget_sets_steps(tmp_path: Path, small_corpus: Path) -> None:
    assert (
        main(
            [
                "train",
                *train_flags(
                    layers=0,
                    heads=None,
                    d_model=16,
                    d_head=None,
                    steps=None,
                    tokens="1k",
                    corpus=small_corpus,
                    out=tmp_path / "t",
                ),
            ]
        )
        == 0
    )
    cfg = json.loads((tmp_path / "t" / "config.json").read_text())
    assert cfg["training"]["config"]["steps"] == 8  # ceil(1000 / (4 * 32))


@pytest.mark.parametrize("cmd", [[], ["train"], ["info"]])
def test_help(cmd: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*cmd, "--help"])
    assert exc.value.code == 0
    assert "usage" in capsys.readouterr().out


def _one_line_error(res: subprocess.CompletedProcess[str], needle: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1 and errors[0] == lines[-1], res.stderr  # progress may precede; the error is one line
    assert "Traceback" not in res.stderr
    assert needle in errors[0], errors[0]


def test_user_errors_are_one_line_exit_2(tmp_path: Path, small_corpus: Path) -> None:
    _one_line_error(run_cli("info", str(tmp_path / "missing")), "does not exist")
    bad = tmp_path / "bad"
    bad.mkdir()
    _one_line_error(run_cli("info", str(bad)), "config.json")
    (bad / "config.json").write_text("{not json")
    _one_line_error(run_cli("info", str(bad)), "not valid JSON")
    _one_line_error(run_cli("train", "--positional", "alibi"), "invalid choice")
    _one_line_error(run_cli("train", "--layers", "-1"), "integer >= 0")
    _one_line_error(run_cli("train", "--lr", "abc"), "positive number")
    _one_line_error(run_cli("train", "--corpus", str(tmp_path / "nope"), "--out", str(tmp_path / "o")), "corpus")
    empty = tmp_path / "emptycorpus"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    _one_line_error(run_cli("train", "--corpus", str(empty), "--out", str(tmp_path / "o2")), "no non-empty")
    assert not (tmp_path / "o2").exists(), "nothing half-written for a bad corpus"
    _one_line_error(run_cli("train", "--resume", "--out", str(tmp_path / "none")), "nothing to resume")
    _one_line_error(run_cli("nonsense"), "invalid choice")


def _save_tiny(path: Path) -> qkov.Transformer:
    model = qkov.Transformer(ModelConfig(n_layers=1, n_heads=2, d_model=8, d_head=4, d_vocab=20, n_ctx=8), seed=0)
    qkov.save_checkpoint(model, path)
    return model


def test_corrupt_and_mismatched_checkpoints(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    _save_tiny(ck)
    assert run_cli("info", str(ck)).returncode == 0
    weights = (ck / "model.safetensors").read_bytes()
    (ck / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    _one_line_error(run_cli("info", str(ck)), "corrupt")
    (ck / "model.safetensors").write_bytes(weights)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["model"]["d_model"] = 16
    (ck / "config.json").write_text(json.dumps(cfg))
    _one_line_error(run_cli("info", str(ck)), "shape")
    cfg["model"]["d_model"] = 8
    cfg["model"]["positional"] = "weird"
    (ck / "config.json").write_text(json.dumps(cfg))
    _one_line_error(run_cli("info", str(ck)), "positional")
    (ck / "model.safetensors").unlink()
    cfg["model"]["positional"] = "shortformer"
    (ck / "config.json").write_text(json.dumps(cfg))
    _one_line_error(run_cli("info", str(ck)), "model.safetensors")


def test_checkpoint_round_trip_without_pickle(tmp_path: Path) -> None:
    model = _save_tiny(tmp_path / "ck")
    loaded = qkov.load(tmp_path / "ck")
    assert loaded.tokenizer is None
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), loaded.parameters()))
    # the weights file is safetensors, not a pickle
    assert (tmp_path / "ck" / "model.safetensors").read_bytes()[8:9] == b"{"


def test_resume_with_conflicting_flags_is_refused(tmp_path: Path, small_corpus: Path) -> None:
    out = tmp_path / "r"
    assert main(["train", *train_flags(layers=1, d_model=16, d_head=8, steps=4, corpus=small_corpus, out=out)]) == 0
    res = run_cli("train", "--resume", "--out", str(out), "--heads", "4")
    _one_line_error(res, "n_heads")


def test_resume_of_a_run_saved_before_a_model_option_existed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run whose saved config predates ``gate`` (no such key) has the default, ``none``: ``--gate none``
    continues it, ``--gate headwise`` is refused."""
    from qkov.apps.cli import train_cmds

    old = {k: v for k, v in ModelConfig().to_dict().items() if k not in ("gate", "loop", "residual")}
    monkeypatch.setattr(train_cmds, "saved_configs", lambda out: (old, {}))
    train_cmds._check_resume_flags(tmp_path, {"gate": "none", "loop": 1}, {})
    with pytest.raises(qkov.QkovError, match="gate='none', not 'headwise'"):
        train_cmds._check_resume_flags(tmp_path, {"gate": "headwise"}, {})


def test_circuits_command(tmp_path: Path) -> None:
    model = qkov.Transformer(ModelConfig(n_layers=2, n_heads=3, d_model=16, d_head=4, d_vocab=40, n_ctx=8), seed=1)
    with torch.no_grad():  # plant a K-composition: head 1.2's keys read what head 0.1 writes
        model.blocks[1].attn.W_K[2].copy_(model.blocks[0].attn.W_O[1].T * 3)
    qkov.save_checkpoint(model, tmp_path / "ck")
    res = run_cli("circuits", str(tmp_path / "ck"), "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert [c["head"] for c in data["copying"]] == ["0.0", "0.1", "0.2", "1.0", "1.1", "1.2"]
    assert all(-1 <= c["eigen_score"] <= 1 and 0 <= c["diag_topk_rate"] <= 1 for c in data["copying"])
    top_k = data["composition"]["k"]["pairs"][0]
    assert (top_k["writer"], top_k["reader"]) == ("0.1", "1.2")
    assert len(data["composition"]["q"]["pairs"]) == 9
    assert data["composition"]["v"]["baseline"]["samples"] > 0
    assert [b["before"] for b in data["bandwidth"]] == [0, 12]
    table = run_cli("circuits", str(tmp_path / "ck"), "--top", "2")
    assert table.returncode == 0 and "K-composition" in table.stdout and "copying" in table.stdout
    zero = tmp_path / "zero"
    qkov.save_checkpoint(qkov.Transformer(ModelConfig(n_layers=0, d_model=8, d_vocab=10, n_ctx=4), seed=0), zero)
    _one_line_error(run_cli("circuits", str(zero)), "no attention layers")


def test_paths_command(tmp_path: Path, small_corpus: Path) -> None:
    out = tmp_path / "m"
    assert main(["train", *train_flags(corpus=small_corpus, out=out)]) == 0
    res = run_cli("paths", str(out), "--json", "--batch", "4")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["tokens"] == [4, 32]
    assert data["reconstruction_max_abs_error"] < 1e-4
    ti = data["term_importance"]
    assert len(ti["run_losses"]) == 3 and len(ti["marginal_by_order"]) == 3
    assert abs(ti["run_losses"][-1] - ti["full_loss"]) < 1e-4
    assert sorted(e["name"] for e in data["single_head_terms"]) == ["0.0", "0.1", "1.0", "1.1"]
    assert len(data["virtual_head_terms"]) == 4
    text = tmp_path / "t.py"
    text.write_text("def f(self):\n    return self.x\n" * 40)
    res = run_cli("paths", str(out), "--text", str(text), "--batch", "2")
    assert res.returncode == 0 and "term importance" in res.stdout
    _one_line_error(run_cli("paths", str(out), "--text", str(tmp_path / "missing.txt")), "cannot read")


def test_heads_and_trigrams_commands(tmp_path: Path, small_corpus: Path) -> None:
    out = tmp_path / "m"
    assert main(["train", *train_flags(layers=1, ctx=128, corpus=small_corpus, out=out)]) == 0
    res = run_cli("heads", str(out), "--json", "--batch", "2")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert [r["head"] for r in data["heads"]] == ["0.0", "0.1"]
    for key in ("previous_token", "prefix_matching", "copying", "eigen_copying", "sink", "roles", "diag_top5"):
        assert key in data["heads"][0]
    assert data["icl"]["late"] == 126 and len(data["icl"]["loss_by_position"]) == 127
    assert data["thresholds"]["induction"] == 0.3
    assert run_cli("heads", str(out), "--batch", "2").returncode == 0
    res = run_cli("trigrams", str(out), "--head", "0.1", "--json", "--top", "5")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert len(data["trigrams"]) == 5 and len(data["bigrams"]) == 5
    assert all(t["score"] > 0 and t["source_str"] for t in data["trigrams"])
    res = run_cli("trigrams", str(out), "--head", "0.0", "--source", "e", "--top", "3")
    assert res.returncode == 0, res.stderr
    assert "top outputs" in res.stdout and "skip-trigrams" in res.stdout
    _one_line_error(run_cli("trigrams", str(out), "--head", "3.0"), "layers")
    _one_line_error(run_cli("trigrams", str(out), "--head", "x"), "LAYER.HEAD")
    _one_line_error(run_cli("trigrams", str(out), "--head", "0.0", "--source", "def foo(self, x)"), "one token")
