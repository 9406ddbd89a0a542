"""Runs you can trust: a run directory is qkov's or refused, one writer at a time, every state a
kill or a full disk leaves is recoverable, and a resumed run's log equals the uninterrupted one's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import qkov
from qkov import QkovError
from qkov.training import rundir
from qkov.training.data import is_val_file, load_corpus
from qkov.training.state import load_state, make_optimizer

from helpers import TINY, tiny_train, train_flags

# two checkpoints of five writes each, and three snapshots (steps 0 and 5 before the first
# checkpoint, 15 between the two), each new name recorded in the manifest first (one write before
# each snapshot, one before the first checkpoint for its five files): 17 atomic writes
#   1 record snap 0, 2 snap 0, 3 record snap 5, 4 snap 5, 5 record the checkpoint's five files,
#   6-10 state, metrics, tokenizer, model, config, 11 record snap 15, 12 snap 15, 13-17 the checkpoint
SHORT = dict(steps=20, ckpt_interval=10, eval_interval=10, snapshots="0,5,15")


def _cli(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "qkov", *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=600,
    )


def _one_line_error(res: subprocess.CompletedProcess[str], pattern: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qkov: error:"), res.stderr
    assert "Traceback" not in res.stderr
    assert re.search(pattern, lines[0]), lines[0]


def _rows(out: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock throughput (which no two runs share)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]


def _same_run(a: Path, b: Path) -> None:
    """Weights, optimizer state (every tensor of the training state) and log equal."""
    sa, sb = load_file(str(a / "train_state.safetensors")), load_file(str(b / "train_state.safetensors"))
    assert sa.keys() == sb.keys()
    differ = [k for k in sa if not torch.equal(sa[k], sb[k])]
    worst = max(((sa[k].double() - sb[k].double()).abs().max().item(), k) for k in differ) if differ else None
    assert not differ, (len(differ), differ[:4], "largest difference", worst, _rows(a)[-2:], _rows(b)[-2:])
    ma, mb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    assert _rows(a) == _rows(b)
    assert not [p.name for p in b.iterdir() if p.name.endswith(".tmp")]
    snaps_a, snaps_b = sorted((a / "snapshots").glob("*")), sorted((b / "snapshots").glob("*"))
    assert [p.name for p in snaps_a] == [p.name for p in snaps_b]  # no temporaries, none missing
    for pa, pb in zip(snaps_a, snaps_b):
        ta, tb = load_file(str(pa)), load_file(str(pb))
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), pa.name


# ------------------------------------------------------------------ 1. a directory is qkov's or refused
def test_a_directory_that_is_not_a_run_is_never_overwritten(tmp_path: Path, small_corpus: Path) -> None:
    mine = tmp_path / "u"
    mine.mkdir()
    (mine / "config.json").write_text('{"my": 1}')
    (mine / "metrics.jsonl").write_text("m\n")
    with pytest.raises(QkovError, match="not a qkov run.*config.json"):
        qkov.train(mine, TINY, tiny_train(small_corpus, steps=5), device="cpu")
    assert (mine / "config.json").read_text() == '{"my": 1}' and (mine / "metrics.jsonl").read_text() == "m\n"
    assert sorted(p.name for p in mine.iterdir()) == ["config.json", "metrics.jsonl"]  # no lock left either
    (tmp_path / "notes.txt").write_text("keep")
    with pytest.raises(QkovError, match="is a file"):
        qkov.train(tmp_path / "notes.txt", TINY, tiny_train(small_corpus, steps=5), device="cpu")
    assert (tmp_path / "notes.txt").read_text() == "keep"
    assert rundir.inspect(tmp_path / "absent") == "free" and rundir.inspect(mine) == "foreign"


# ------------------------------------------------------------------ 2. no stuck runs
def test_a_state_without_config_json_resumes_and_a_run_without_state_restarts(
    tmp_path: Path, small_corpus: Path
) -> None:
    tc = tiny_train(small_corpus, steps=20, ckpt_interval=10)
    full = tmp_path / "full"
    qkov.train(full, TINY, tc, device="cpu")
    # a kill between the first state write and config.json: the state alone is enough to resume
    cut = tmp_path / "cut"
    qkov.train(cut, TINY, tc, device="cpu", stop_after=10)
    for name in ("config.json", "model.safetensors", "metrics.jsonl", "tokenizer.json"):
        (cut / name).unlink()
    assert rundir.inspect(cut) == "resumable"
    qkov.train(cut, device="cpu", resume=True)
    _same_run(full, cut)
    # a kill during the first state write: the lock and a temporary; a plain start takes over
    fresh = tmp_path / "fresh"
    qkov.train(fresh, TINY, tc, device="cpu", stop_after=10)
    for name in ("train_state.safetensors", "config.json", "model.safetensors", "metrics.jsonl", "tokenizer.json"):
        (fresh / name).unlink()
    (fresh / ".train_state.safetensors.x1y2z3.tmp").write_bytes(b"half a file")
    assert rundir.inspect(fresh) == "restartable"
    with pytest.raises(QkovError, match="no complete training state"):
        qkov.train(fresh, device="cpu", resume=True)
    qkov.train(fresh, TINY, tc, device="cpu")
    _same_run(full, fresh)
    assert not list(fresh.glob(".*.tmp")), "the killed write's temporary is cleaned on the next start"
    # a model without a training state (imported, or its state deleted) is analysed, never trained over
    (fresh / "train_state.safetensors").unlink()
    before = {p.name: p.read_bytes() for p in fresh.iterdir() if p.is_file()}
    assert rundir.inspect(fresh) == "checkpoint"
    for resume in (False, True):
        with pytest.raises(QkovError, match="(without|but no) a? ?training state"):
            qkov.train(fresh, TINY, tc, device="cpu", resume=resume)
    assert {p.name: p.read_bytes() for p in fresh.iterdir() if p.is_file()} == before


# ------------------------------------------------------------------ 3. one writer
def test_a_second_writer_gets_a_one_line_error(tmp_path: Path, small_corpus: Path) -> None:
    out = tmp_path / "locked"
    with rundir.lock(out):
        res = _cli("train", *train_flags(corpus=small_corpus, steps=5), "--out", out)
        assert sorted(p.name for p in out.iterdir()) == [".qkov.lock"]  # the refused writer wrote nothing
    _one_line_error(res, rf"is being written by qkov process {os.getpid()}")
    assert not out.exists(), "a lock that guarded nothing goes with its directory"
    # the lock is released when its holder ends, however it ends: the next writer proceeds
    assert _cli("train", *train_flags(corpus=small_corpus, steps=5), "--out", out).returncode == 0


def test_two_trainings_into_one_directory_exactly_one_proceeds(tmp_path: Path, small_corpus: Path) -> None:
    qkov.train(tmp_path / "warm", TINY, tiny_train(small_corpus, steps=1), device="cpu")  # corpus cache built
    out = tmp_path / "race"
    cmd = [sys.executable, "-m", "qkov", "train", *train_flags(corpus=small_corpus, steps=300), "--out", str(out)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=600), p.stderr.read()) for p in procs]  # type: ignore[union-attr]
    codes = sorted(rc for rc, _ in results)
    assert codes == [0, 2], results
    loser = next(err for rc, err in results if rc == 2)
    assert "being written by qkov process" in loser or "already holds a run" in loser, loser
    assert len(loser.strip().splitlines()) == 1
    assert json.loads((out / "config.json").read_text())["training"]["step"] == 300


# ------------------------------------------------------------------ 4. one-line errors, exit 2
def test_user_mistakes_in_training_are_one_line_errors(tmp_path: Path, small_corpus: Path) -> None:
    def train(*extra: object, out: Path = tmp_path / "x") -> subprocess.CompletedProcess[str]:
        return _cli("train", *train_flags(corpus=small_corpus, steps=5), *extra, "--out", out)

    _one_line_error(train("--ctx", "1"), "n_ctx must be an integer >= 2")
    _one_line_error(train("--seed", "-1"), r"seed must be an integer in \[0, 2\^63\)")
    _one_line_error(train("--seed", "99999999999999999999999"), "seed must be an integer")
    (tmp_path / "afile").write_text("keep")
    _one_line_error(train(out=tmp_path / "afile"), "is a file")
    _one_line_error(train("--vocab", "50000"), r"reaches only \d+ tokens.*ask for at most")
    assert not (tmp_path / "x").exists(), "a refused run leaves no directory"
    ids = np.random.default_rng(0).integers(1, 200, size=20_000).astype(np.int32)
    np.save(tmp_path / "ids.npy", ids)
    (tmp_path / "tokenizer.json").write_text("this is not a tokenizer")
    _one_line_error(
        _cli("train", *train_flags(corpus=tmp_path / "ids.npy", vocab=256), "--out", tmp_path / "y"),
        "tokenizer.json.*beside the token file is not a tokenizer",
    )


def test_a_pickled_torch_file_gets_qkovs_own_refusal(tmp_path: Path) -> None:
    torch.save({"embed.W_E": torch.zeros(2, 2), "obj": Path("x")}, tmp_path / "evil.pt")
    res = _cli("import", tmp_path / "evil.pt", "--out", tmp_path / "imp")
    _one_line_error(res, "holds Python objects beyond tensors.*qkov never does")
    assert "weights_only=False" not in res.stderr and not (tmp_path / "imp").exists()


def test_resume_reads_the_state_not_an_edited_config_json(tmp_path: Path, small_corpus: Path) -> None:
    tc = tiny_train(small_corpus, steps=20, ckpt_interval=10)
    full, cut = tmp_path / "full", tmp_path / "cut"
    qkov.train(full, TINY, tc, device="cpu")
    qkov.train(cut, TINY, tc, device="cpu", stop_after=10)
    cfg = json.loads((cut / "config.json").read_text())
    cfg["model"]["d_model"] = 48
    (cut / "config.json").write_text(json.dumps(cfg))
    qkov.train(cut, device="cpu", resume=True)  # the state holds the configs it was trained with
    _same_run(full, cut)
    # a state that does not fit its model (say, written by an older qkov beside an edited config)
    other = qkov.Transformer(TINY.replace(d_model=48), seed=0)
    with pytest.raises(QkovError, match="does not fit the run's model config"):
        load_state(cut / "train_state.safetensors", other, make_optimizer(other, 1e-3, (0.9, 0.99), 0.0))


def test_a_full_disk_is_a_one_line_error_and_keeps_the_last_checkpoint(tmp_path: Path, small_corpus: Path) -> None:
    flags = train_flags(corpus=small_corpus, **SHORT)
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert _cli("train", *flags, "--out", full).returncode == 0
    res = _cli("train", *flags, "--out", cut, env={"QKOV_FAULT": "enospc:14"})  # the 2nd checkpoint's log
    _one_line_error(res, r"cannot write .*metrics.jsonl.*No space left on device \(the previous version")
    assert not [p.name for p in cut.iterdir() if p.name.endswith(".tmp")]
    assert qkov.load(cut) is not None
    # the state of the second checkpoint was written before the disk filled; resume redoes the rest
    res = _cli("train", "--resume", "--out", cut, "--quiet")
    assert res.returncode == 0, res.stderr
    _same_run(full, cut)
    # a disk full at the very first write leaves nothing behind
    res = _cli("train", *flags, "--out", tmp_path / "none", env={"QKOV_FAULT": "enospc:1"})
    _one_line_error(res, r"cannot write .*\.qkov-manifest\.json.*No space left on device")  # recording snapshot 0
    assert not (tmp_path / "none").exists()


# ------------------------------------------------------------------ 5. a corpus too small to split by file
def test_a_one_file_corpus_whose_name_hashes_into_validation_still_trains(tmp_path: Path, small_corpus: Path) -> None:
    name = next(f"module{i}.py" for i in range(1000) if is_val_file(f"module{i}.py", 0.05))
    one = tmp_path / "one"
    one.mkdir()
    (one / name).write_text("".join((small_corpus / n).read_text() for n in ("abc.py", "bisect.py", "copy.py")))
    corpus = load_corpus(str(one), vocab_size=300, val_fraction=0.05)
    assert corpus.train.size > 10 * corpus.val.size > 0
    assert corpus.stats["split"] == "one file: its last 5% is validation"
    # several files that all hash into validation: one is moved to training
    many = tmp_path / "many"
    many.mkdir()
    names = [f"module{i}.py" for i in range(3000) if is_val_file(f"module{i}.py", 0.05)][:2]
    for n, src in zip(names, ("abc.py", "copy.py")):
        (many / n).write_text((small_corpus / src).read_text())
    corpus = load_corpus(str(many), vocab_size=300, val_fraction=0.05)
    assert corpus.train.size > 0 and corpus.val.size > 0
    assert corpus.stats["split"] == f"the last file ({max(names)}) moved to training"  # files in name order
    qkov.train(tmp_path / "run", TINY, tiny_train(one, steps=3), device="cpu")


# ------------------------------------------------------------------ 6. the log resumes exactly
@pytest.mark.parametrize("ckpt_interval", [20, 25])
def test_a_resumed_log_equals_the_uninterrupted_one(tmp_path: Path, small_corpus: Path, ckpt_interval: int) -> None:
    """Resumed at a log row (20: the log file lost, as a kill between the state and log writes
    leaves it) and inside a log window (25: the loss of steps 21-25 must count in row 30)."""
    tc = tiny_train(small_corpus, steps=40, ckpt_interval=ckpt_interval, log_interval=10)
    full, cut = tmp_path / "full", tmp_path / "cut"
    qkov.train(full, TINY, tc, device="cpu")
    qkov.train(cut, TINY, tc, device="cpu", stop_after=ckpt_interval)
    if ckpt_interval == 20:
        (cut / "metrics.jsonl").write_text("")
    qkov.train(cut, device="cpu", resume=True)
    _same_run(full, cut)
    assert [r["step"] for r in _rows(cut) if "train_loss" in r] == [10, 20, 30, 40]


def _which_side(full: Path, flags: list[str], again: Path) -> str:
    """For a resume that is not exact: does the uninterrupted run repeat itself, and on what machine."""
    _cli("train", *flags, "--out", again)
    try:
        _same_run(full, again)
        side = "the uninterrupted run repeats itself bit for bit, so the killed or resumed run is the odd one"
    except AssertionError:
        side = "the uninterrupted run does not repeat itself: training is not reproducible here, resume aside"
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "unknown")
    return f"{side} (cpu {cpu}, torch {torch.__version__}; benchmarks/bench_kills.py measures the rate)"


def test_a_kill_at_any_write_is_recoverable_and_exact(tmp_path: Path, small_corpus: Path) -> None:
    """Kill the run at every atomic write (during the first checkpoint and between all its writes);
    resume (or restart a run with no complete state): always the uninterrupted run, bit for bit."""
    flags = train_flags(corpus=small_corpus, **SHORT)
    full = tmp_path / "full"
    assert _cli("train", *flags, "--out", full).returncode == 0  # also fills the corpus cache
    kill = 0
    while True:
        kill += 1
        out = tmp_path / f"k{kill}"
        res = _cli("train", *flags, "--out", out, env={"QKOV_FAULT": f"kill:{kill}"})
        if res.returncode == 0:
            break
        assert res.returncode == 137, (kill, res.returncode, res.stderr[-2000:])
        kind = rundir.inspect(out)
        assert kind in ("resumable", "restartable"), (kill, kind, sorted(p.name for p in out.iterdir()))
        again = ("--resume", "--out", out) if kind == "resumable" else (*flags, "--out", out)
        res = _cli("train", *again)
        assert res.returncode == 0, (kill, kind, res.stderr[-2000:])
        try:
            _same_run(full, out)
        except AssertionError as exc:
            why = _which_side(full, flags, tmp_path / "full-again")
            raise AssertionError(f"killed at write {kill} ({kind}): {exc}; {why}") from None
    assert kill == 18, "17 kill points: two checkpoints of five writes, three snapshots, four manifest writes (SHORT)"
