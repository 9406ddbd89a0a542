"""Atomic writes leave nothing of their own behind: not on success, not on failure, and after a
kill only a temporary folder that :func:`remove_stale_temporaries` removes with everything the
writer put in it (safetensors' ``save_file`` makes a temporary of its own beside the file it is
given)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qkov import QkovError
from qkov.io.atomic import atomic_write, atomic_write_text, remove_stale_temporaries, temporaries


def _own_temporary(tmp: str) -> None:
    """A writer's private temporary beside the file it was given, as safetensors makes one."""
    Path(tmp).with_name(".tmpAbC123").write_bytes(b"half a tensor")


def test_a_write_leaves_only_its_target(tmp_path: Path) -> None:
    def writer(tmp: str) -> None:
        _own_temporary(tmp)
        save_file({"w": torch.arange(6.0)}, tmp)

    atomic_write(tmp_path / "m.safetensors", writer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]
    assert torch.equal(load_file(tmp_path / "m.safetensors")["w"], torch.arange(6.0))


def test_a_failed_write_leaves_the_old_file_and_nothing_else(tmp_path: Path) -> None:
    atomic_write_text(tmp_path / "a.txt", "old")

    def writer(tmp: str) -> None:
        _own_temporary(tmp)
        Path(tmp).write_text("new, half")
        raise OSError(28, os.strerror(28))

    with pytest.raises(QkovError, match="previous version of the file is kept"):
        atomic_write(tmp_path / "a.txt", writer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]
    assert (tmp_path / "a.txt").read_text() == "old"


def test_a_kill_inside_the_writer_leaves_one_folder_that_cleanup_removes_whole(tmp_path: Path) -> None:
    script = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from qkov.io.atomic import atomic_write\n"
        "def writer(tmp):\n"
        "    Path(tmp).with_name('.tmpAbC123').write_bytes(b'half a tensor')\n"
        "    os._exit(137)\n"
        "atomic_write(Path(sys.argv[1]) / 'snapshots' / 'step-1.safetensors', writer)\n"
    )
    res = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True)
    assert res.returncode == 137, res.stderr
    left = list((tmp_path / "snapshots").iterdir())
    assert len(left) == 1 and left[0].is_dir() and left[0].name.startswith(".step-1.safetensors.")
    assert temporaries(tmp_path / "snapshots" / "step-1.safetensors") == left
    gone = remove_stale_temporaries(tmp_path, ["snapshots/step-1.safetensors"])
    assert gone == left
    assert list((tmp_path / "snapshots").iterdir()) == []


def test_a_bare_temporary_file_from_before_is_removed_too(tmp_path: Path) -> None:
    old = tmp_path / ".m.safetensors.x1y2z3.tmp"
    old.write_bytes(b"from qkov 1.0")
    assert remove_stale_temporaries(tmp_path, ["m.safetensors"]) == [old]
    assert not old.exists()
