"""Output folders: ``report -o`` and the tour never overwrite a file qkov did not write, and a bad
output location is an error before any analysis, leaving nothing behind."""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path

import pytest

from qkov import QkovError
from qkov.apps.outputs import output_folder, written_by_qkov
from qkov.apps.report import write_report
from qkov.io.checkpoint import save_checkpoint

from test_heads import hand_built
from helpers import run_main


@pytest.fixture(scope="module")
def hand(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hand") / "ckpt"
    save_checkpoint(path, hand_built())
    return path


def test_report_never_overwrites_a_page_it_did_not_write(hand: Path, tmp_path: Path, capsys) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text("<html>my page</html>")
    rc, out, err = run_main(capsys, "report", hand, "-o", site, "--batch", 2, "--icl-examples", 2)
    assert rc == 2 and out == ""
    assert err.strip().count("\n") == 0 and "was not written by qkov" in err and "pass --force" in err
    assert "…" not in err, "refused before any analysis stage started"
    assert (site / "index.html").read_text() == "<html>my page</html>" and not (site / "report.json").exists()
    rc, _, err = run_main(capsys, "report", hand, "-o", site, "--batch", 2, "--icl-examples", 2, "--force", "--quiet")
    assert rc == 0, err
    assert written_by_qkov(site / "index.html") and written_by_qkov(site / "report.json")
    # qkov's own report is replaced without asking
    rc, _, err = run_main(capsys, "report", hand, "-o", site, "--batch", 2, "--icl-examples", 2, "--quiet")
    assert rc == 0, err
    # a report.json that is not qkov's is refused too
    (site / "report.json").write_text(json.dumps({"mine": True}))
    with pytest.raises(QkovError, match="report.json.*not written by qkov"):
        write_report(hand, site, batch=2, icl_examples=2)
    assert json.loads((site / "report.json").read_text()) == {"mine": True}


def test_a_bad_output_location_fails_before_the_analysis_and_leaves_nothing(hand: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "afile").write_text("x")
    rc, _, err = run_main(capsys, "report", hand, "-o", tmp_path / "afile", "--batch", 2)
    assert rc == 2 and "exists and is not a directory" in err and "…" not in err
    rc, _, err = run_main(capsys, "report", hand, "-o", tmp_path / "afile" / "sub", "--batch", 2)
    assert rc == 2 and "cannot write to" in err and "…" not in err
    # an analysis that fails after the folder was made removes the folder it made
    rc, _, err = run_main(capsys, "report", hand, "-o", tmp_path / "new", "--tokens", tmp_path / "missing.npy")
    assert rc == 2 and not (tmp_path / "new").exists()
    assert (tmp_path / "afile").read_text() == "x"


def test_an_unwritable_folder_is_found_by_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe write fails as a read-only file system makes it fail (this suite runs as root,
    for whom permission bits do not stop a write); the folder the check made goes again."""

    def read_only(*_a: object, **_k: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(QkovError, match="cannot write to .*Read-only file system"):
        with output_folder(tmp_path / "ro", ("index.html",), overwrite=False, what="report"):
            pass
    assert not (tmp_path / "ro").exists()


def test_the_tour_refuses_a_page_it_did_not_write_before_training(tmp_path: Path, capsys) -> None:
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "index.html").write_text("mine")
    rc, _, err = run_main(capsys, "tour", "--out", tmp_path / "t", "--layers", "0", "--steps", "1")
    assert rc == 2 and "index.html" in err and "not written by qkov" in err
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["index.html"], "nothing trained"
    assert written_by_qkov(tmp_path / "t" / "index.html") is False
