"""Atomic file writes: write to a temporary file in a private folder beside the target, fsync, rename.

A reader (or a process killed mid-write) sees either the old file or the new one, never half
of one. A write that fails (a full disk, a read-only folder) removes its temporary file, leaves
the old file as it was (or no file, when there was none), and raises a one-line
:class:`~qkov.QkovError` that says which.

Each write gets a private temporary folder ``.<name>.<random>.tmp/`` beside its target and the
writer fills ``<that folder>/<name>``, which is renamed onto the target; the folder is then
removed. The folder, not a bare file, because a writer may make temporaries of its own beside the
file it is given (safetensors' ``save_file`` writes ``.tmpXXXXXX`` and renames it): inside the
folder they are ours to clean. A process killed mid-write leaves the folder behind, which
:func:`remove_stale_temporaries` removes (a bare ``.<name>.<random>.tmp`` file, left by qkov
before 1.1, is removed as well).

Fault injection, for tests only: ``QKOV_FAULT=kill:N`` ends the process (``os._exit(137)``, as
abruptly as SIGKILL) when the N-th atomic write of the process has filled its temporary file,
before the rename; ``QKOV_FAULT=enospc:N`` makes the N-th write fail as a full disk does.
"""

from __future__ import annotations

import errno
import glob
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterable

from ..errors import QkovError

__all__ = [
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_text",
    "remove_stale_temporaries",
    "remove_temporary",
    "temporaries",
]

_writes = 0  # atomic writes in this process (the fault-injection counter)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fault() -> None:
    """The test-only fault hook (see the module docstring)."""
    global _writes
    _writes += 1
    spec = os.environ.get("QKOV_FAULT")
    if not spec:
        return
    kind, _, at = spec.partition(":")
    if at.isdigit() and int(at) == _writes:
        if kind == "kill":
            os._exit(137)
        if kind == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _disk_error(path: Path, exc: BaseException) -> QkovError | None:
    """A one-line error for a write the file system refused (``None``: not such an error); it says
    that the previous version of ``path`` is kept only when there is one (a failed write never
    touches its target, so whether it exists now is whether it existed before)."""
    text = str(exc)
    if isinstance(exc, OSError):
        reason = exc.strerror or text
    elif "No space left" in text or "StorageFull" in text or "code: 28" in text:  # safetensors' own IO errors
        reason = os.strerror(errno.ENOSPC)
    else:
        return None
    kept = "the previous version of the file is kept" if os.path.lexists(path) else "nothing was written"
    return QkovError(f"cannot write {str(path)!r}: {reason} ({kept})")


def remove_temporary(tmp: Path | str) -> bool:
    """Delete one temporary a killed write left (its folder and all in it, or a bare file); return
    whether there was one."""
    tmp = Path(tmp)
    try:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp)
        else:
            tmp.unlink()
    except FileNotFoundError:
        return False
    return True


def atomic_write(path: Path | str, writer: Callable[[str], None]) -> None:
    """Call ``writer(tmp_path)`` to fill a temporary file, then rename it onto ``path``.

    ``tmp_path`` lies in a folder of its own (see the module docstring), so whatever else the
    writer puts beside it is removed with the folder, also when the write fails.

    Raises:
        QkovError: the file system refused the write (full disk, no permission); nothing changed.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        folder = tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise QkovError(f"cannot write {str(path)!r}: {exc.strerror}") from None
    tmp = os.path.join(folder, path.name)
    try:
        writer(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # give the mode a plain open() would
        _fault()
        os.replace(tmp, path)
    except BaseException as exc:
        shutil.rmtree(folder, ignore_errors=True)
        error = _disk_error(path, exc) if isinstance(exc, Exception) else None
        if error is not None:
            raise error from None
        raise
    shutil.rmtree(folder, ignore_errors=True)  # empty now, unless the writer left something of its own


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "wb") as fh:
            fh.write(data)

    atomic_write(path, write)


def atomic_write_text(path: Path | str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def temporaries(path: Path) -> list[Path]:
    """The temporaries (folders, or bare files from before 1.1) that killed writes of ``path`` left
    beside it."""
    if not path.parent.is_dir():
        return []
    return sorted(path.parent.glob(f".{glob.escape(path.name)}.*.tmp"))


def remove_stale_temporaries(folder: Path, names: Iterable[str]) -> list[Path]:
    """Delete the temporaries killed writes of ``names`` (paths relative to ``folder``, such as
    ``snapshots/step-00000000.safetensors``) left in ``folder``; return them."""
    return [tmp for name in names for tmp in temporaries(folder / name) if remove_temporary(tmp)]
