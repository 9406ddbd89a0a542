"""A folder held open by descriptor: its names read, linked, swapped and removed without ever
following a symbolic link, under an exclusive lock.

Everything is relative to the folder's descriptor, so a link swapped in for the folder (or for a
name in it) after it was opened is never written through. :func:`exchange` swaps two names in one
step (Linux ``renameat2`` with ``RENAME_EXCHANGE``); where the system or file system cannot
(other systems, NFS, FAT), it says so and the caller falls back to a plain rename.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import os
import stat
import sys
from pathlib import Path
from typing import Any

__all__ = ["create", "exchange", "held", "kind", "open_locked", "read", "RENAMEAT2", "sha256", "unlink", "UNSUPPORTED"]

# what a file system says when it cannot exchange names or make hard links
UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.EPERM, errno.EXDEV, errno.EOPNOTSUPP, errno.ENOTSUP}
_RENAME_EXCHANGE = 2


def _renameat2() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a C library without it (glibc before 2.28)
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


RENAMEAT2 = _renameat2()


def exchange(dfd: int, a: str, b: str) -> bool:
    """Swap the names ``a`` and ``b`` in the folder ``dfd`` in one step; ``False`` where it cannot.

    Raises:
        OSError: any other failure (a name missing, the disk...).
    """
    if RENAMEAT2 is None:
        return False
    if RENAMEAT2(dfd, os.fsencode(a), dfd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), b)


def kind(dfd: int, name: str) -> str:
    """What ``name`` is: ``absent``, ``file``, ``link`` or ``other`` (a folder, a device...)."""
    try:
        mode = os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return "absent"
    return "file" if stat.S_ISREG(mode) else "link" if stat.S_ISLNK(mode) else "other"


def read(dfd: int, name: str) -> bytes | None:
    """The content of the plain file ``name`` (``None``: absent, a link or not a plain file)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            return None
        return fh.read()


def sha256(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()


def create(dfd: int, name: str, data: bytes) -> None:
    """Write a new file ``name`` (never an existing one, never through a link) and ``fsync`` it."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666, dir_fd=dfd)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:  # a full disk, an interrupt: the part written is removed, not left to fill it
        unlink(dfd, name)
        raise


def unlink(dfd: int, name: str) -> None:
    """Remove ``name`` if it is there."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dfd)


def held(dfd: int, folder: Path) -> Path:
    """A path to the folder ``dfd`` holds, for code that takes paths: ``/proc/self/fd/N`` on Linux
    (the opened folder itself, even if a link were swapped in for its name since), else ``folder``."""
    path = Path(f"/proc/self/fd/{dfd}")
    return path if path.is_dir() else folder


def open_locked(folder: Path) -> int:
    """The folder's descriptor, opened without following a link, under an exclusive ``flock``
    (one holder at a time; closing the descriptor releases it, and so does the holder's death).

    Raises:
        OSError: the folder is a link (``ELOOP``), missing, or not a folder.
    """
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        fcntl.flock(dfd, fcntl.LOCK_EX)
    except BaseException:
        os.close(dfd)
        raise
    return dfd
