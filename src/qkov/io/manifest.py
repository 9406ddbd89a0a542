"""Which files in a directory are qkov's: the manifest ``.qkov-manifest.json`` it keeps there.

qkov recognises the directories it writes (training runs, checkpoints) by what it recorded in
them, never by file names alone. The manifest is a JSON file
``{"format": "qkov-manifest", "version": 1, "files": [...]}`` listing the paths (relative,
``/``-separated) of the files qkov wrote there, or was about to write when it was stopped.

* **Recorded first.** A name is added to the manifest (rewritten atomically) before its first
  write, so a process killed at any moment leaves no qkov file unrecorded: at worst a recorded
  name whose file is absent, or present only as the temporary of the killed write. The names a
  write already recorded cost nothing more (the manifest is read, not written).
* **Only free names.** A name is recorded only when nothing is at its path: a file qkov did not
  write is never recorded, so never replaced and never deleted.
* **Only in qkov's own directories.** The manifest is created only in a directory that holds
  nothing but qkov's lock (``.qkov.lock``) and temporaries of the manifest itself; any other
  directory is refused (except one written before qkov kept a manifest: see below).
* The temporaries ``.<name>.<random>.tmp`` of a recorded name (left by killed writes) are qkov's.
* **Names, not sizes or hashes.** A name is recorded before its file exists, so there is nothing
  to measure then; recording sizes after every write would double the writes of a checkpoint,
  and hashes would read every (possibly 100 MB) file again at each checkpoint. Within a run,
  qkov writes recorded names only under the run's lock; where a file's origin must be proved
  (a directory without a manifest) its content proves it, below.

**Directories written before the manifest** (by an earlier qkov) are *adopted*
(:func:`adopt`) when every entry carries one of the names qkov gave its files (see
:func:`legacy_name`) and a training state, a model or a config among them proves qkov's by its
content. The manifest then lists exactly the qkov-named files whose content is qkov's: a
training state (safetensors whose metadata holds ``step`` and ``extra``), a model (safetensors
with ``format: qkov``), a ``config.json`` with a ``model`` section, a ``tokenizer.json`` that
loads, a ``metrics.jsonl`` of JSON rows with a ``step``, and snapshots
(``snapshots/step-<n>.safetensors`` with ``format: qkov-snapshot``). Any other file stays
unlisted: foreign, never replaced or deleted.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable

from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer

from ..errors import QkovError
from .atomic import atomic_write_text, remove_stale_temporaries, remove_temporary

MANIFEST_FILE = ".qkov-manifest.json"
LOCK_FILE = ".qkov.lock"
MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
METRICS_FILE = "metrics.jsonl"
STATE_FILE = "train_state.safetensors"
SNAPSHOT_DIR = "snapshots"
RUN_FILES = (STATE_FILE, MODEL_FILE, CONFIG_FILE, TOKENIZER_FILE, METRICS_FILE)
LEGACY_FOLDERS = ("report", SNAPSHOT_DIR, "dynamics")
SNAPSHOT_NAME = re.compile(r"^step-(\d+)\.safetensors$")
_FORMAT, _VERSION = "qkov-manifest", 1


def _is_manifest_temporary(name: str) -> bool:
    return name.startswith(f".{MANIFEST_FILE}.") and name.endswith(".tmp")


def recorded(folder: Path) -> set[str] | None:
    """The names recorded in ``folder``'s manifest; ``None`` when there is no manifest.

    Raises:
        QkovError: the manifest cannot be read or is not qkov's.
    """
    path = folder / MANIFEST_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise QkovError(f"{str(path)!r} is not a qkov manifest ({type(exc).__name__}): move it away") from None
    files = data.get("files") if isinstance(data, dict) and data.get("format") == _FORMAT else None
    if not isinstance(files, list) or not all(isinstance(f, str) and writable_name(f) for f in files):
        raise QkovError(f"{str(path)!r} is not a qkov manifest: move it away")
    return set(files)


def writable_name(name: str) -> bool:
    """``name`` is one qkov writes into a run or checkpoint: a run file or ``snapshots/step-<n>.safetensors``
    (a manifest listing anything else, ``../`` or an absolute path say, is not qkov's)."""
    folder, _, base = name.rpartition("/")
    return (not folder and name in RUN_FILES) or (folder == SNAPSHOT_DIR and bool(SNAPSHOT_NAME.match(base)))


def write(folder: Path, names: Iterable[str]) -> None:
    """Atomically make ``names`` the manifest of ``folder`` (whatever it listed before)."""
    body = {"format": _FORMAT, "version": _VERSION, "files": sorted(set(names))}
    atomic_write_text(folder / MANIFEST_FILE, json.dumps(body, indent=1) + "\n")


def bare(folder: Path) -> bool:
    """``folder`` holds nothing but qkov's lock and temporaries of its manifest (or nothing at all)."""
    return all(e.name == LOCK_FILE or _is_manifest_temporary(e.name) for e in folder.iterdir())


def others(folder: Path) -> list[str]:
    """The entries of a directory without a manifest, other than the lock and manifest temporaries
    (those without one of qkov's names first): what a refusal names."""
    names = [e for e in folder.iterdir() if e.name != LOCK_FILE and not _is_manifest_temporary(e.name)]
    return [e.name for e in sorted(names, key=lambda e: (legacy_name(e), e.name))]


def occupied(folder: Path, name: str) -> bool:
    """Something (a file, a folder, a link, even a dangling one) is at ``folder / name``."""
    path = folder / name
    return path.exists() or path.is_symlink()


def record(folder: Path, names: Iterable[str]) -> None:
    """Record ``names`` as qkov's in ``folder`` before writing them (creating ``folder`` and its
    manifest when needed); names already recorded cost no write.

    Raises:
        QkovError: ``folder`` has no manifest and holds other files, or something qkov did not
            write is at one of the new names (nothing is recorded then).
    """
    folder = Path(folder)
    files = recorded(folder) if folder.is_dir() else None
    if files is None:
        if folder.is_dir() and not bare(folder):
            listed = ", ".join(others(folder)[:3])
            raise QkovError(
                f"{str(folder)!r} holds files qkov did not write ({listed}): qkov writes only into a "
                "directory it created, or an empty one"
            )
        files = set()
    new = [n for n in dict.fromkeys(names) if n not in files]
    if not new:
        return
    if not all(writable_name(n) for n in new):  # pragma: no cover - a programming error
        raise ValueError(f"not a name qkov writes: {new}")
    linked = [n for n in new if (folder / n).parent.is_symlink()]
    if linked:
        raise QkovError(f"{str((folder / linked[0]).parent)!r} is a link: qkov does not write through links")
    taken = [n for n in new if occupied(folder, n)]
    if taken:
        raise QkovError(
            f"cannot write {str(folder / taken[0])!r}: a file qkov did not write is there, and qkov never "
            "replaces one; move it away"
        )
    folder.mkdir(parents=True, exist_ok=True)
    write(folder, files | set(new))


def remove_temporaries(folder: Path) -> None:
    """Delete the temporaries killed writes of ``folder``'s manifest and recorded files left."""
    for tmp in folder.glob(f".{MANIFEST_FILE}.*.tmp"):
        remove_temporary(tmp)
    files = recorded(folder)
    if files:  # not through a folder turned into a link: what it points to is not the run's
        remove_stale_temporaries(folder, [n for n in files if not (folder / n).parent.is_symlink()])


# --------------------------------------------------------------------------- before the manifest
def legacy_name(entry: Path) -> bool:
    """``entry`` carries a name qkov gave what it wrote before it kept a manifest: a run file, the
    lock, the ``report``, ``snapshots`` or ``dynamics`` folder, or a temporary of a run file."""
    name = entry.name
    if name.startswith(".") and name.endswith(".tmp"):
        return any(name.startswith(f".{n}.") for n in RUN_FILES)
    if entry.is_symlink():
        return False
    if name == LOCK_FILE:
        return entry.is_file()
    return (name in RUN_FILES and entry.is_file()) or (name in LEGACY_FOLDERS and entry.is_dir())


def _safetensors_meta(path: Path) -> dict[str, str] | None:
    try:
        with safe_open(str(path), framework="pt") as fh:
            return fh.metadata() or {}
    except (SafetensorError, OSError, ValueError):
        return None


def is_qkovs(path: Path) -> bool:
    """``path``'s content is that of the qkov file its name says it is (read cheaply: safetensors
    headers, JSON; a tokenizer is loaded). Unknown names are never qkov's."""
    if not path.is_file() or path.is_symlink():
        return False
    name = path.name
    if name.endswith(".safetensors"):
        meta = _safetensors_meta(path)
        if meta is None:
            return False
        if name == STATE_FILE:
            return "step" in meta and "extra" in meta
        if name == MODEL_FILE:
            return meta.get("format") == "qkov"
        return bool(SNAPSHOT_NAME.match(name)) and meta.get("format") == "qkov-snapshot"
    try:
        text = path.read_text()
        if name == CONFIG_FILE:
            data = json.loads(text)
            return isinstance(data, dict) and isinstance(data.get("model"), dict)
        if name == METRICS_FILE:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
            return all(isinstance(r, dict) and "step" in r for r in rows)
        if name == TOKENIZER_FILE:
            Tokenizer.from_str(text)
            return True
    except Exception:  # noqa: BLE001 - any failure to parse means: not qkov's (tokenizers raises its own type)
        return False
    return False


def legacy_files(folder: Path) -> set[str] | None:
    """The files qkov wrote in ``folder``, a directory without a manifest, proved by name and
    content; ``None`` when ``folder`` is not recognisably qkov's (an entry without one of qkov's
    names, or no training state, model or config that proves qkov's)."""
    entries = list(folder.iterdir())
    if not all(legacy_name(e) for e in entries):
        return None
    found = {n for n in RUN_FILES if is_qkovs(folder / n)}
    if not found & {STATE_FILE, MODEL_FILE, CONFIG_FILE}:
        return None
    snaps = folder / SNAPSHOT_DIR
    if snaps.is_dir():
        found |= {f"{SNAPSHOT_DIR}/{p.name}" for p in snaps.iterdir() if is_qkovs(p)}
    return found


def adopt(folder: Path) -> set[str]:
    """Write the manifest of ``folder``, a directory written before qkov kept one, listing
    :func:`legacy_files`; remove the temporaries of its killed writes (of qkov's names, in qkov's
    pattern); return the names listed.

    Raises:
        QkovError: ``folder`` is not recognisably qkov's (it is left untouched).
    """
    files = legacy_files(folder)
    if files is None:
        listed = ", ".join(others(folder)[:3])
        raise QkovError(
            f"{str(folder)!r} holds files qkov did not write ({listed}): qkov writes only into a "
            "directory it created, or an empty one"
        )
    write(folder, files)
    remove_stale_temporaries(folder, RUN_FILES)
    snaps = folder / SNAPSHOT_DIR
    for tmp in snaps.glob(".step-*.safetensors.*.tmp") if snaps.is_dir() else ():
        remove_temporary(tmp)
    return files


__all__ = [
    "LOCK_FILE",
    "MANIFEST_FILE",
    "RUN_FILES",
    "SNAPSHOT_DIR",
    "adopt",
    "bare",
    "is_qkovs",
    "legacy_files",
    "occupied",
    "others",
    "record",
    "recorded",
    "remove_temporaries",
    "write",
]
