"""A training run's directory: what it holds, who writes it, and what a failed start leaves.

A directory is a qkov run, refused, or free:

* **free** — it does not exist, or is empty: a new run starts there;
* **qkov's** — it holds only qkov's files (``train_state.safetensors``, ``model.safetensors``,
  ``config.json`` with a ``model`` section, ``tokenizer.json``, ``metrics.jsonl``, the lock, the
  ``report``, ``snapshots`` and ``dynamics`` folders and the temporary files of killed writes), and then it is

  - *resumable*: it holds a training state (written first at every checkpoint, so a kill
    anywhere after the first state write leaves one);
  - *a checkpoint*: a model but no training state (imported, or its state deleted): it is
    analysed, never trained over;
  - *restartable*: neither (a run killed before its first state write was complete): a new
    run starts over it;
* **foreign** — anything else (other files, a ``config.json`` that is not qkov's, or a file
  where a directory should be): refused, never overwritten.

:func:`lock` makes one process the directory's only writer: an exclusive ``flock`` on
``.qkov.lock`` holding the owner's pid. The operating system releases it when the owner dies,
however it dies, so a lock left by a killed run is taken over without asking.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

from ..errors import QkovError
from ..io.atomic import remove_stale_temporaries
from ..io.checkpoint import CONFIG_FILE, METRICS_FILE, MODEL_FILE, STATE_FILE, TOKENIZER_FILE

LOCK_FILE = ".qkov.lock"
RUN_FILES = (STATE_FILE, MODEL_FILE, CONFIG_FILE, TOKENIZER_FILE, METRICS_FILE)
FOLDERS = ("report", "snapshots", "dynamics")
OURS = {*RUN_FILES, LOCK_FILE, *FOLDERS}


def _is_ours(entry: Path) -> bool:
    if entry.name.startswith(".") and entry.name.endswith(".tmp"):
        return any(entry.name.startswith(f".{name}.") for name in RUN_FILES)
    if entry.name not in OURS:
        return False
    if entry.name == CONFIG_FILE:
        try:
            return "model" in json.loads(entry.read_text())
        except (OSError, ValueError, TypeError):
            return False
    return entry.is_dir() == (entry.name in FOLDERS)


def inspect(path: Path) -> str:
    """``free``, ``resumable``, ``checkpoint``, ``restartable`` or ``foreign``; see the module docstring."""
    if not path.exists():
        return "free"
    if not path.is_dir():
        return "foreign"
    entries = list(path.iterdir())
    if not entries:
        return "free"
    if not all(_is_ours(e) for e in entries):
        return "foreign"
    if (path / STATE_FILE).is_file():
        return "resumable"
    if (path / MODEL_FILE).exists() or (path / CONFIG_FILE).exists():
        return "checkpoint"
    return "restartable"


def foreign_entries(path: Path) -> list[str]:
    """The names in ``path`` that are not qkov's (for the error message)."""
    if not path.is_dir():
        return [path.name]
    return sorted(e.name for e in path.iterdir() if not _is_ours(e))


def clear(path: Path) -> None:
    """Remove the run files and snapshots of a start that never wrote its first training state (the
    lock and the ``report`` folder stay); refuses any other directory."""
    if inspect(path) not in ("free", "restartable"):
        raise QkovError(f"{str(path)!r} holds a qkov run or checkpoint: it is not cleared")
    for name in RUN_FILES:
        with contextlib.suppress(FileNotFoundError):
            (path / name).unlink()
    shutil.rmtree(path / "snapshots", ignore_errors=True)


def _nothing_written(path: Path) -> bool:
    """Only the lock, and at most an empty snapshot folder (a first write that failed)."""
    names = {e.name for e in path.iterdir()}
    snaps = path / "snapshots"
    return names <= {LOCK_FILE, "snapshots"} and not (snaps.is_dir() and any(snaps.iterdir()))


@contextlib.contextmanager
def lock(path: Path) -> Iterator[None]:
    """Hold ``path``'s lock for the block (creating ``path``); a second writer gets a one-line error.

    The lock file stays (removing it would let a waiting process lock an unlinked file while a
    third creates a new one), except when this block created ``path`` and wrote nothing else
    into it: then ``path`` goes too (a run that failed before writing anything leaves no trace).
    """
    created = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
        fh = open(path / LOCK_FILE, "a+")
    except OSError as exc:
        raise QkovError(f"cannot create the run directory {str(path)!r} ({exc.strerror})") from None
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.seek(0)
            owner = fh.read().strip() or "another process"
            raise QkovError(
                f"{str(path)!r} is being written by qkov process {owner}: wait for it, or choose another directory"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        remove_stale_temporaries(path, RUN_FILES)
        yield
    finally:
        if created and _nothing_written(path):
            shutil.rmtree(path, ignore_errors=True)
        fh.close()  # releases the flock
