"""A training run's directory: what it holds, who writes it, and what a failed start leaves.

A directory is recognised by what qkov recorded in it, its manifest ``.qkov-manifest.json``
(:mod:`qkov.io.manifest`): every file qkov writes into a run has its name recorded there first,
and a file not listed is the user's, never replaced or deleted. A directory is then

* **free** — it does not exist, or is empty: a new run starts there;
* **qkov's** — it has a manifest, and is

  - *resumable*: its recorded training state is there (written first at every checkpoint, so a
    kill anywhere after the first state write leaves one);
  - *a checkpoint*: a recorded model or config but no training state (imported, or its state
    deleted): it is analysed, never trained over;
  - *restartable*: neither (a run killed before its first state write was complete; also a
    directory holding only the lock ``.qkov.lock`` and temporaries of the manifest, as a kill
    before the manifest's first write leaves): a new run starts over it, removing the recorded
    files of the earlier start and nothing else;

  other files beside a manifest (the user's notes, the ``report`` folder ``qkov report`` writes)
  change nothing: they are left alone;
* **foreign** — a file, an unreadable manifest, or a directory qkov did not create (no manifest,
  not empty): refused, never written into.

**Runs written before the manifest** (by an earlier qkov): a directory without a manifest
whose every entry carries one of qkov's names (the run files, the lock, ``report/``,
``snapshots/``, ``dynamics/``, temporaries of run files) and whose ``train_state.safetensors``
is a qkov training state by its content is *resumable*; ``qkov train --resume`` adopts it: it
writes the manifest listing exactly the qkov-named files whose content is qkov's (see
:mod:`qkov.io.manifest`), then continues. Without a training state but with a model or config
that is qkov's it is a *checkpoint* (analysed, never trained over). Anything else without a
manifest is foreign: in particular a directory without a training state and without a manifest
is never cleared, whatever its files are named.

:func:`lock` makes one process the directory's only writer: an exclusive ``flock`` on
``.qkov.lock`` holding the owner's pid. The operating system releases it when the owner dies,
however it dies, so a lock left by a killed run is taken over without asking. :func:`begin`,
under the lock, prepares the directory for a run's writes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path
from typing import Iterator

from ..errors import QkovError
from ..io import manifest
from ..io.manifest import LOCK_FILE, MANIFEST_FILE, RUN_FILES, SNAPSHOT_DIR, SNAPSHOT_NAME
from ..io.checkpoint import CONFIG_FILE, MODEL_FILE, STATE_FILE

__all__ = ["LOCK_FILE", "MANIFEST_FILE", "RUN_FILES", "begin", "clear", "foreign_entries", "inspect", "lock"]


def _legacy_kind(path: Path) -> str:
    """The kind of a directory written before the manifest (see the module docstring)."""
    if not all(manifest.legacy_name(e) for e in path.iterdir()):
        return "foreign"
    if manifest.is_qkovs(path / STATE_FILE):
        return "resumable"
    if manifest.is_qkovs(path / MODEL_FILE) or manifest.is_qkovs(path / CONFIG_FILE):
        return "checkpoint"
    return "foreign"


def inspect(path: Path) -> str:
    """``free``, ``resumable``, ``checkpoint``, ``restartable`` or ``foreign``; see the module docstring.
    Reads only: it never writes the manifest, even of a run it would adopt."""
    if not path.exists():
        return "free"
    if not path.is_dir():
        return "foreign"
    try:
        files = manifest.recorded(path)
    except QkovError:
        return "foreign"
    if files is None:
        if manifest.bare(path):
            return "restartable" if any(path.iterdir()) else "free"
        return _legacy_kind(path)
    if STATE_FILE in files and (path / STATE_FILE).is_file():
        return "resumable"
    if any(n in files and (path / n).is_file() for n in (MODEL_FILE, CONFIG_FILE)):
        return "checkpoint"
    return "restartable"


def foreign_entries(path: Path) -> list[str]:
    """What makes a foreign ``path`` foreign (for the error message): its own name when it is a
    file, the manifest when that is unreadable, else its entries (those without qkov's names first)."""
    if not path.is_dir():
        return [path.name]
    try:
        manifest.recorded(path)
    except QkovError:
        return [MANIFEST_FILE]
    return manifest.others(path)


def clear(path: Path) -> None:
    """Remove the recorded files of a start that never wrote its first training state, and the
    temporaries of its killed writes; nothing the manifest does not list (the lock, the user's
    files and the ``report`` folder stay). Refuses any other directory."""
    if inspect(path) not in ("free", "restartable"):
        raise QkovError(f"{str(path)!r} holds a qkov run or checkpoint, or is not a qkov run: it is not cleared")
    if not path.is_dir():
        return
    manifest.remove_temporaries(path)
    files = manifest.recorded(path)
    if not files:
        return
    for name in files:
        target = path / name
        if target.parent.is_symlink():  # a folder turned into a link since: what it points to is not the run's
            continue
        try:
            target.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:  # before the manifest forgets it: a file left unlisted would be the user's
            raise QkovError(f"cannot remove {str(target)!r} of the earlier start ({exc.strerror})") from None
    with contextlib.suppress(OSError):  # only when empty: a folder holding the user's files stays
        (path / SNAPSHOT_DIR).rmdir()
    manifest.write(path, [])  # after the files: a kill in between leaves recorded names, absent


def _in_the_way(path: Path, files: set[str]) -> list[str]:
    """Files at names a run writes (its run files and snapshots) that ``files`` (qkov's) does not list."""
    names = list(RUN_FILES)
    snaps = path / SNAPSHOT_DIR
    if snaps.is_dir():
        names += [f"{SNAPSHOT_DIR}/{p.name}" for p in sorted(snaps.iterdir()) if SNAPSHOT_NAME.match(p.name)]
    return [n for n in names if n not in files and manifest.occupied(path, n)]


def begin(path: Path, *, resume: bool) -> None:
    """Make ``path`` (held under :func:`lock`) ready for a run's writes: a new run clears what an
    earlier start that never completed a state left (:func:`clear`); a resumed run written before
    the manifest is adopted (its manifest written). Nothing else is recorded here: each write
    records its own name first.

    Raises:
        QkovError: a file qkov did not write is at a name the run writes (nothing is changed).
    """
    files = manifest.recorded(path) if path.is_dir() else set()
    legacy = files is None and not manifest.bare(path)
    if legacy:
        files = manifest.legacy_files(path)
        if files is None:
            raise QkovError(f"{str(path)!r} is not a qkov run: it is not written into")
    blocked = _in_the_way(path, files or set())
    if blocked:
        raise QkovError(
            f"{str(path / blocked[0])!r} is not a file qkov wrote, and this run would write it; move it away"
        )
    if not resume:
        clear(path)
    elif legacy:
        manifest.adopt(path)


def _nothing_written(path: Path) -> bool:
    """Only the lock and a manifest, and at most an empty snapshot folder (a first write that failed)."""
    names = {e.name for e in path.iterdir() if not e.name.endswith(".tmp")}
    snaps = path / SNAPSHOT_DIR
    return names <= {LOCK_FILE, MANIFEST_FILE, SNAPSHOT_DIR} and not (snaps.is_dir() and any(snaps.iterdir()))


@contextlib.contextmanager
def lock(path: Path) -> Iterator[None]:
    """Hold ``path``'s lock for the block (creating ``path``); a second writer gets a one-line error.

    The lock file stays (removing it would let a waiting process lock an unlinked file while a
    third creates a new one), except when this block created ``path`` and wrote nothing else
    into it: then ``path`` goes too (a run that failed before writing anything leaves no trace).
    Taking the lock removes the temporaries of killed writes of the manifest and its files.
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
        with contextlib.suppress(QkovError):  # an unreadable manifest: the directory is refused later
            manifest.remove_temporaries(path)
        yield
    finally:
        if created and _nothing_written(path):
            shutil.rmtree(path, ignore_errors=True)
        fh.close()  # releases the flock

