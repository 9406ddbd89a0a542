"""A run directory is qkov's by what qkov recorded in it (its manifest), not by file names: the
user's files are never replaced or deleted, runs written before the manifest still resume, and a
kill between the manifest and the file it records recovers."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import qkov
from qkov import QkovError
from qkov.io.manifest import MANIFEST_FILE
from qkov.training import rundir

from helpers import TINY, tiny_train, train_flags
from test_runs import SHORT, _cli, _one_line_error, _same_run


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _manifest(folder: Path) -> list[str]:
    return json.loads((folder / MANIFEST_FILE).read_text())["files"]


def _train(out: Path, corpus: Path, **opts: object) -> subprocess.CompletedProcess[str]:
    return _cli("train", *train_flags(corpus=corpus, steps=5, **opts), "--out", out)


# ------------------------------------------------------------------ the cases 1-3
USER_FILES = {
    "tokenizer.json": {"tokenizer.json": '{"my":"tok"}\n'},  # case 1
    "metrics.jsonl": {"metrics.jsonl": '{"log":1}\n'},  # case 2
    "snapshots": {"snapshots/photo.jpg": "x\n", "snapshots/README": "y\n"},  # case 3
}


@pytest.mark.parametrize("case", list(USER_FILES), ids=["case1-tokenizer", "case2-metrics", "case3-snapshots"])
def test_a_directory_of_user_files_with_qkovs_names_is_refused_untouched(
    tmp_path: Path, small_corpus: Path, case: str
) -> None:
    d = tmp_path / "d"
    for rel, text in USER_FILES[case].items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    before = _tree(d)
    res = _train(d, small_corpus)
    _one_line_error(res, rf"holds files that are not a qkov run \(.*{case.split('/')[0]}.*\).*new or empty directory")
    assert _tree(d) == before, "the user's files are unchanged"
    assert sorted(p.name for p in d.iterdir()) == sorted({rel.split("/")[0] for rel in USER_FILES[case]})


# ------------------------------------------------------------------ the full-disk message
def test_a_full_disk_on_a_first_write_says_nothing_was_written(tmp_path: Path, small_corpus: Path) -> None:
    flags = train_flags(corpus=small_corpus, **SHORT)
    assert _cli("train", *flags, "--out", tmp_path / "warm").returncode == 0  # the corpus cache: no writes later
    # write 1 records the first snapshot's name in the manifest, write 2 is the snapshot itself
    res = _cli("train", *flags, "--out", tmp_path / "a", env={"QKOV_FAULT": "enospc:2"})
    _one_line_error(res, r"cannot write .*step-00000000\.safetensors.*No space left on device \(nothing was written\)$")
    assert "previous version" not in res.stderr
    assert not (tmp_path / "a").exists(), "a run that wrote nothing leaves nothing"
    # a file that existed (the second checkpoint's log, write 14) is kept, and the message says so
    res = _cli("train", *flags, "--out", tmp_path / "b", env={"QKOV_FAULT": "enospc:14"})
    _one_line_error(res, r"cannot write .*metrics\.jsonl.*No space left.*\(the previous version of the file is kept\)$")


# ------------------------------------------------------------------ what is foreign stays untouched
def test_a_directory_qkov_did_not_create_is_refused_unless_empty(tmp_path: Path, small_corpus: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    _one_line_error(_train(d, small_corpus), r"holds files that are not a qkov run \(notes\.txt\)")
    assert _tree(d) == {"notes.txt": b"mine"} and sorted(p.name for p in d.iterdir()) == ["notes.txt"]
    # a start killed before its first state by a qkov without manifests (the lock and a snapshot):
    # nothing proves those files are qkov's, so the directory is never cleared
    old = tmp_path / "old"
    qkov.train(old, TINY, tiny_train(small_corpus, steps=10, ckpt_interval=10), device="cpu")
    for name in ("train_state.safetensors", "model.safetensors", "config.json", "metrics.jsonl", MANIFEST_FILE):
        (old / name).unlink()
    before = _tree(old)
    assert rundir.inspect(old) == "foreign"
    _one_line_error(_train(old, small_corpus), "not a qkov run")
    with pytest.raises(QkovError, match="not a qkov run"):
        rundir.clear(old)
    assert _tree(old) == before
    # a manifest that lists anything but the names qkov writes (a way out of the directory) is not qkov's
    (tmp_path / "victim.txt").write_text("keep")
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    escape = {"format": "qkov-manifest", "version": 1, "files": ["../victim.txt"]}
    (hostile / MANIFEST_FILE).write_text(json.dumps(escape))
    assert rundir.inspect(hostile) == "foreign"
    with pytest.raises(QkovError, match=r"not a qkov run \(\.qkov-manifest\.json\)"):
        qkov.train(hostile, TINY, tiny_train(small_corpus, steps=5), device="cpu")
    with pytest.raises(QkovError, match="not cleared"):
        rundir.clear(hostile)
    assert (tmp_path / "victim.txt").read_text() == "keep"
    # save_checkpoint never replaces a file it did not write
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"my": 1}')
    with pytest.raises(QkovError, match=r"holds files qkov did not write \(config\.json\)"):
        qkov.save_checkpoint(qkov.Transformer(TINY, seed=0), mine)
    assert _tree(mine) == {"config.json": b'{"my": 1}'}


def test_a_users_file_inside_a_run_is_kept_and_never_replaced(tmp_path: Path, small_corpus: Path) -> None:
    tc = tiny_train(small_corpus, steps=20, ckpt_interval=10, snapshots=(0, 15))
    full, cut = tmp_path / "full", tmp_path / "cut"
    qkov.train(full, TINY, tc, device="cpu")
    qkov.train(cut, TINY, tc, device="cpu", stop_after=10)
    (cut / "notes.txt").write_text("mine")
    (cut / "snapshots" / "photo.jpg").write_text("x")
    assert rundir.inspect(cut) == "resumable"
    qkov.train(cut, device="cpu", resume=True)
    assert (cut / "notes.txt").read_text() == "mine" and (cut / "snapshots" / "photo.jpg").read_text() == "x"
    assert "notes.txt" not in _manifest(cut)
    # a file at a name the run is about to write, that qkov did not write: refused before any step
    again = tmp_path / "again"
    qkov.train(again, TINY, tc, device="cpu", stop_after=10)
    (again / "snapshots" / "step-00000015.safetensors").write_text("not qkov's")
    with pytest.raises(QkovError, match=r"step-00000015\.safetensors. is not a file qkov wrote"):
        qkov.train(again, device="cpu", resume=True)
    assert (again / "snapshots" / "step-00000015.safetensors").read_text() == "not qkov's"
    # save_checkpoint into its own checkpoint again: its files are recorded, so replaced
    ck = tmp_path / "ck"
    qkov.save_checkpoint(qkov.Transformer(TINY, seed=0), ck)
    qkov.save_checkpoint(qkov.Transformer(TINY, seed=1), ck)
    assert sorted(_manifest(ck)) == ["config.json", "model.safetensors"]
    # ... but not a tokenizer.json the user put beside it (this checkpoint never wrote one)
    (ck / "tokenizer.json").write_text('{"my":"tok"}')
    with_tokenizer = qkov.load(full)
    with pytest.raises(QkovError, match=r"tokenizer\.json.*a file qkov did not write is there"):
        qkov.save_checkpoint(with_tokenizer, ck)
    assert (ck / "tokenizer.json").read_text() == '{"my":"tok"}'
    assert sorted(_manifest(ck)) == ["config.json", "model.safetensors"], "nothing recorded for a refused write"


# ------------------------------------------------------------------ runs written before the manifest
def test_a_run_written_before_the_manifest_is_analysed_resumed_and_adopted(tmp_path: Path, small_corpus: Path) -> None:
    flags = train_flags(corpus=small_corpus, **SHORT)
    full, old = tmp_path / "full", tmp_path / "old"
    assert _cli("train", *flags, "--out", full).returncode == 0
    killed = _cli("train", *flags, "--out", old, env={"QKOV_FAULT": "kill:12"})  # during the snapshot of step 15
    assert killed.returncode == 137, killed.stderr
    (old / MANIFEST_FILE).unlink()  # what a qkov without manifests left
    (old / "snapshots" / "notes.txt").write_text("mine")  # old qkov never read this folder's other files
    assert rundir.inspect(old) == "resumable"
    assert not (old / MANIFEST_FILE).exists(), "inspecting writes nothing"
    res = _cli("info", old, "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["steps"] == 10, res.stderr
    res = _cli("report", old, "--device", "cpu")  # into old/report, a folder the old rule knew
    assert res.returncode == 0 and (old / "report" / "index.html").is_file(), res.stderr
    report = _tree(old / "report")
    assert rundir.inspect(old) == "resumable"
    res = _cli("train", "--resume", "--out", old, "--quiet")
    assert res.returncode == 0, res.stderr
    assert (old / "snapshots" / "notes.txt").read_text() == "mine" and _tree(old / "report") == report
    (old / "snapshots" / "notes.txt").unlink()
    _same_run(full, old)
    # adopted: the manifest lists exactly qkov's files (the ones whose content proved them qkov's)
    snaps = [f"snapshots/{p.name}" for p in sorted((old / "snapshots").iterdir())]
    assert sorted(_manifest(old)) == sorted(
        ["config.json", "metrics.jsonl", "model.safetensors", "tokenizer.json", "train_state.safetensors", *snaps]
    )
    # an old checkpoint (no state, no manifest) is still analysed, and never trained over
    (old / MANIFEST_FILE).unlink()
    (old / "train_state.safetensors").unlink()
    assert rundir.inspect(old) == "checkpoint"
    assert _cli("info", old).returncode == 0
    _one_line_error(_train(old, small_corpus), "without a training state")


# ------------------------------------------------------------------ a kill between the manifest and the file
def test_a_kill_between_the_manifest_and_its_file_recovers(tmp_path: Path, small_corpus: Path) -> None:
    flags = train_flags(corpus=small_corpus, **SHORT)
    full = tmp_path / "full"
    assert _cli("train", *flags, "--out", full).returncode == 0
    # write 2: the first snapshot, just recorded; write 6: the first state, recorded with the checkpoint's files
    for kill, name in ((2, "snapshots/step-00000000.safetensors"), (6, "train_state.safetensors")):
        out = tmp_path / f"k{kill}"
        res = _cli("train", *flags, "--out", out, env={"QKOV_FAULT": f"kill:{kill}"})
        assert res.returncode == 137, res.stderr
        target = out / name
        assert name in _manifest(out) and not target.exists()
        assert list(target.parent.glob(f".{target.name}.*.tmp")), "the killed write's temporary"
        assert rundir.inspect(out) == "restartable"
        res = _cli("train", *flags, "--out", out)
        assert res.returncode == 0, res.stderr
        _same_run(full, out)
        assert not list(target.parent.glob(".*.tmp"))
