"""Output folders of the analysis commands: checked before any work, never overwriting a
file qkov did not write.

Every page qkov writes carries ``<meta name="generator" content="qkov ...">`` and every JSON
file a ``schema_version`` (reports) or ``claims`` (the tour) key; a file of the same name
without its mark is the user's, and is overwritten only when asked (``overwrite=True``).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Iterator

from ..errors import QkovError

GENERATOR = '<meta name="generator" content="qkov'
JSON_MARKS = ("schema_version", "claims")


def written_by_qkov(path: Path) -> bool:
    """Whether ``path`` is a page or JSON file qkov wrote (see the module docstring)."""
    try:
        if path.suffix == ".html":
            with open(path, "rb") as fh:
                return GENERATOR.encode() in fh.read(4096)
        if path.suffix == ".json":
            data = json.loads(path.read_text())
            return isinstance(data, dict) and any(k in data for k in JSON_MARKS)
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return False


@contextlib.contextmanager
def output_folder(out: Path, names: tuple[str, ...], *, overwrite: bool, what: str) -> Iterator[Path]:
    """Check ``out`` can take the files ``names`` before the work in the block starts.

    Refuses a file where the folder should be, a file among ``names`` that qkov did not write
    (unless ``overwrite``) and a folder that cannot be written (found by writing a probe file).
    A folder this creates is removed again if the block fails before writing into it.
    """
    if out.exists() and not out.is_dir():
        raise QkovError(f"{what}: the output {str(out)!r} exists and is not a directory", hint="out")
    for name in names:
        target = out / name
        if target.exists() and not overwrite and not written_by_qkov(target):
            raise QkovError(f"{what}: {str(target)!r} was not written by qkov and is not overwritten", hint="overwrite")
    created = not out.exists()
    try:
        try:
            out.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".qkov-probe.", dir=out)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise QkovError(f"{what}: cannot write to {str(out)!r} ({exc.strerror})", hint="out") from None
        yield out
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()  # only if still empty
        raise
