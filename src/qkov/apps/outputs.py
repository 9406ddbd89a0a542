"""Output folders of the analysis commands (report, dynamics, tour): checked before any work,
written as one pair, never over a file qkov did not write, never through a symbolic link.

**Whose file.** Every page qkov writes carries ``<meta name="generator" content="qkov ...">``
and every JSON file a ``schema_version`` (reports, dynamics) or ``claims`` (the tour) key; a
file of the same name without its mark is the user's, and is replaced only when asked
(``overwrite=True``). :func:`output_folder` checks before the work; :func:`replace_pair` checks
again at the moment each file is replaced (a page the user saves there during a ten-minute
analysis is kept).

**Links.** The output folder and the files in it must not be symbolic links (nor anything but a
plain file): such an output is refused, with ``overwrite`` too, so qkov never writes into a
folder a link points at. The folders above the output folder are the user's path and are
followed (a ``runs`` that links to a bigger disk works). The writes go through the folder's
descriptor, opened without following a link (:mod:`qkov.io.dirfd`), so a link swapped in for the
folder or a file after the checks is not followed either.

**A pair, replaced as one.** :func:`replace_pair` writes a page and its JSON so that no kill
leaves the page of one write beside the data of another:

1. lock the folder (an exclusive ``flock`` on the folder itself: one writer at a time; the
   operating system releases it however the holder dies);
2. finish what a killed writer left (:func:`settle`, below) and delete the temporaries of
   killed writes (``.<name>.<random>.tmp``);
3. write every new file to a temporary beside its target, ``fsync``;
4. write the journal ``.qkov-write.json`` atomically: each file's temporary and ``sha256``;
5. swap each temporary into place (the JSON last), checking ownership at that moment;
6. look at what each swap displaced: if any is not qkov's (and not ``overwrite``), swap
   everything back, delete the temporaries and refuse with a one-line error;
7. delete the displaced files, then the journal.

A kill before (4) leaves the old pair whole, and temporaries the next writer deletes. A kill
after (4) leaves the journal, and the next writer, or any qkov reader of the folder (which calls
:func:`settle` first), rolls the write forward from it (or back, if (6) had begun to undo it). A journal rather than a versioned folder
switched by one rename: the outputs keep being plain files at their own names (a user opens,
links to and copies ``OUT/index.html``), and a directory cannot be renamed over a non-empty one,
so the switch would need ``index.html`` to be a link, which this module refuses to write through.

**A write id.** Each page carries ``<meta name="qkov-write" content="ID">``, ID a digest of the
JSON written with it, so a page beside JSON of another write (a kill between the swaps that no one
has settled yet, a hand edit) is detectable: :func:`pair_id` returns ``None`` for it. The JSON
carries no extra key (its content is its id): a key would make two writes of the same result
differ, and ``report.json``'s schema belongs to the report's typed sections.

**The moment of replacement.** On Linux each swap is an atomic exchange (``renameat2``
``RENAME_EXCHANGE``): the new file takes the name, and the file that held the name at that
instant moves to the temporary's name, where qkov checks it and exchanges it back if it is not
qkov's. So no check-then-replace window is left: a user's file saved at any moment before the
swap, in place (``echo ... > index.html``, which empties the file as it opens it) or by a
rename, is what the check reads; a writer opening the name after the swap writes into the new
file, which is then the user's. A name that is absent is taken with ``link()``, which fails if a
file appeared meanwhile. What remains: a writer that opened the old file before the swap without
emptying it (appending to qkov's page) and writes after the check loses those bytes; and where
the file system cannot exchange names (NFS, FAT, other systems), the check is made immediately
before a plain rename, so a file that replaces the target in those microseconds is lost, and a
refused second file cannot bring back the first's previous version (it is removed instead).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import tempfile
from pathlib import Path
from typing import Any, Iterator

from ..errors import QkovError
from ..io import dirfd as fs
from ..io.atomic import atomic_write_text, remove_stale_temporaries

__all__ = [
    "GENERATOR",
    "JOURNAL",
    "JSON_MARKS",
    "output_folder",
    "pair_id",
    "replace_pair",
    "settle",
    "WRITE_ID",
    "written_by_qkov",
]

GENERATOR = '<meta name="generator" content="qkov'
WRITE_ID = '<meta name="qkov-write" content="'
JSON_MARKS = ("schema_version", "claims")
JOURNAL = ".qkov-write.json"


def _ours(name: str, data: bytes | None) -> bool:
    """Whether ``data``, the content of a file called ``name``, is qkov's (see the module docstring)."""
    if data is None:
        return False
    if name.endswith(".html"):
        return GENERATOR.encode() in data[:4096]
    if name.endswith(".json"):
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return False
        return isinstance(obj, dict) and any(k in obj for k in JSON_MARKS)
    return False


def written_by_qkov(path: Path) -> bool:
    """Whether ``path`` is a page or JSON file qkov wrote (a link never is; see the module docstring)."""
    try:
        if path.is_symlink():
            return False
        return _ours(path.name, path.read_bytes())
    except OSError:
        return False


def _link_error(what: str, path: Path) -> QkovError:
    return QkovError(f"{what}: {str(path)!r} is a symbolic link; qkov does not write through links", hint="out")


@contextlib.contextmanager
def output_folder(out: Path, names: tuple[str, ...], *, overwrite: bool, what: str) -> Iterator[Path]:
    """Check ``out`` can take the files ``names`` before the work in the block starts.

    Refuses a link or a file where the folder should be, a link among ``names``, a file among
    them that qkov did not write (unless ``overwrite``) and a folder that cannot be written
    (found by writing a probe file). A folder this creates is removed again if the block fails
    before writing into it. The files are written in the block with :func:`replace_pair`,
    which checks them again.
    """
    if out.is_symlink():
        raise _link_error(what, out)
    if out.exists() and not out.is_dir():
        raise QkovError(f"{what}: the output {str(out)!r} exists and is not a directory", hint="out")
    for name in names:
        target = out / name
        if target.is_symlink():
            raise _link_error(what, target)
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


class _Refused(Exception):
    """A target that is not qkov's (or not a plain file), found while replacing; carries the error."""

    def __init__(self, error: QkovError) -> None:
        super().__init__(str(error))
        self.error = error


@contextlib.contextmanager
def _locked(folder: Path, what: str) -> Iterator[int]:
    """The output folder's descriptor, locked, for the block (a link is refused, by the open itself)."""
    try:
        dfd = fs.open_locked(folder)
    except OSError as exc:
        if folder.is_symlink():
            raise _link_error(what, folder) from None
        raise QkovError(f"{what}: cannot write to {str(folder)!r} ({exc.strerror})", hint="out") from None
    try:
        yield dfd
    finally:
        os.close(dfd)  # releases the lock


# --------------------------------------------------------------------------- one write, as a journal
def _journal(dfd: int) -> dict[str, Any] | None:
    data = fs.read(dfd, JOURNAL)
    try:
        journal = None if data is None else json.loads(data)
    except (ValueError, UnicodeDecodeError):
        journal = None  # cannot happen (written atomically); treated as no journal
    return journal if isinstance(journal, dict) and isinstance(journal.get("files"), dict) else None


def _save_journal(folder: Path, dfd: int, journal: dict[str, Any]) -> None:
    atomic_write_text(fs.held(dfd, folder) / JOURNAL, json.dumps(journal, indent=1))
    os.fsync(dfd)


def _refusal(folder: Path, name: str, kind: str, what: str) -> _Refused:
    """The error for a target found, when the files are replaced, to be a link, not a file or not qkov's."""
    target = folder / name
    if kind == "link":
        return _Refused(_link_error(what, target))
    if kind == "other":
        return _Refused(QkovError(f"{what}: {str(target)!r} is not a plain file and is not replaced", hint="out"))
    return _Refused(
        QkovError(
            f"{what}: {str(target)!r} was not written by qkov (it changed while the {what} was being made): "
            "nothing was replaced",
            hint="overwrite",
        )
    )


def _take(folder: Path, dfd: int, name: str, temp: str, *, overwrite: bool, what: str) -> None:
    """Put the temporary ``temp`` in ``name``'s place if ``name`` holds nothing or qkov's file."""
    while True:
        kind = fs.kind(dfd, name)
        if kind == "absent":
            try:
                os.link(temp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
            except FileExistsError:
                continue  # a file appeared since: look at it
            except OSError as exc:  # a file system without hard links: the plain rename
                if exc.errno not in fs.UNSUPPORTED:
                    raise
                os.replace(temp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                return
            os.unlink(temp, dir_fd=dfd)
            return
        if kind != "file" or not (overwrite or _ours(name, fs.read(dfd, name))):
            raise _refusal(folder, name, kind, what)
        if not fs.exchange(dfd, temp, name):  # what was displaced is now at `temp`, checked later
            os.replace(temp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        return


def _undo(folder: Path, dfd: int, journal: dict[str, Any]) -> None:
    """Put back what the journal's write displaced, remove what it added, delete the journal."""
    for name, entry in reversed(list(journal["files"].items())):
        temp, new = entry["temp"], entry["sha256"]
        held = fs.sha256(fs.read(dfd, temp)) if fs.kind(dfd, temp) != "absent" else None
        if fs.sha256(fs.read(dfd, name)) == new:
            if held is not None and held != new:  # `temp` holds what the swap displaced: swap back
                if not fs.exchange(dfd, temp, name):
                    os.replace(temp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            else:
                fs.unlink(dfd, name)  # the name was free (or its old file cannot be brought back)
        if fs.kind(dfd, temp) != "absent":
            if fs.sha256(fs.read(dfd, temp)) == new:
                fs.unlink(dfd, temp)
            else:  # not what this write made, so not ours to delete: keep it in sight
                os.replace(temp, f"{name}.{journal['id']}.kept", src_dir_fd=dfd, dst_dir_fd=dfd)
    fs.unlink(dfd, JOURNAL)
    os.fsync(dfd)


def _complete(folder: Path, dfd: int, journal: dict[str, Any]) -> None:
    """Roll the journal's write forward (or, if it was being undone, back); raise :class:`_Refused`
    after undoing it if a target, or what a swap displaced, is not qkov's."""
    overwrite, what = bool(journal.get("overwrite")), str(journal.get("what", "output"))
    files: dict[str, dict[str, str]] = journal["files"]
    if journal.get("undo"):
        _undo(folder, dfd, journal)
        return
    try:
        for name, entry in files.items():
            new = entry["sha256"]
            if fs.sha256(fs.read(dfd, name)) != new and fs.sha256(fs.read(dfd, entry["temp"])) == new:
                _take(folder, dfd, name, entry["temp"], overwrite=overwrite, what=what)
        for name, entry in files.items():
            displaced = entry["temp"]
            kind = fs.kind(dfd, displaced)
            if kind == "absent" or overwrite or fs.sha256(fs.read(dfd, displaced)) == entry["sha256"]:
                continue
            if kind != "file" or not _ours(name, fs.read(dfd, displaced)):
                raise _refusal(folder, name, "file", what)
    except _Refused:
        _save_journal(folder, dfd, {**journal, "undo": True})  # a kill from here on is rolled back
        _undo(folder, dfd, journal)
        raise
    os.fsync(dfd)
    for entry in files.values():
        fs.unlink(dfd, entry["temp"])  # what the swaps displaced: qkov's old files
    fs.unlink(dfd, JOURNAL)
    os.fsync(dfd)


def _settle_locked(folder: Path, dfd: int, names: tuple[str, ...]) -> None:
    journal = _journal(dfd)
    if journal is not None:
        with contextlib.suppress(_Refused):  # undone: the user's file is back where it was
            _complete(folder, dfd, journal)
    remove_stale_temporaries(fs.held(dfd, folder), (*names, JOURNAL))


def settle(folder: Path | str, names: tuple[str, ...]) -> None:
    """Finish a pair write that was killed in ``folder`` (files ``names``) and delete the
    temporaries killed writes left; a qkov reader of an output folder calls this first.

    Raises:
        QkovError: the folder is a link, or cannot be written.
    """
    folder = Path(folder)
    if not folder.is_dir() and not folder.is_symlink():
        return
    with _locked(folder, "output") as dfd:
        try:
            _settle_locked(folder, dfd, names)
        except (OSError, QkovError) as exc:
            raise QkovError(f"cannot write to {str(folder)!r} ({_reason(exc)})") from None


def _stamped(files: dict[str, str]) -> tuple[str, dict[str, bytes]]:
    """The write id and each file's bytes, pages first, each page carrying the id."""
    data = {n: t.encode("utf-8") for n, t in files.items() if not n.endswith(".html")}
    wid = _pair_digest(data)
    pages = {}
    for name, text in files.items():
        if name.endswith(".html"):
            at = text.find(GENERATOR)
            if at < 0:
                raise ValueError(f"{name}: a page without qkov's generator tag")
            end = text.index(">", at) + 1
            pages[name] = (text[:end] + f'{WRITE_ID}{wid}">' + text[end:]).encode("utf-8")
    return wid, {**pages, **data}


def _pair_digest(data: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for name in sorted(data):
        h.update(name.encode() + b"\0" + hashlib.sha256(data[name]).digest())
    return h.hexdigest()[:16]


def pair_id(folder: Path | str, names: tuple[str, ...]) -> str | None:
    """The write id of the files ``names`` in ``folder`` if they are one write's (each page's
    id equals the digest of the JSON beside it), else ``None``."""
    folder = Path(folder)
    try:
        data = {n: (folder / n).read_bytes() for n in names}
    except OSError:
        return None
    wid = _pair_digest({n: b for n, b in data.items() if not n.endswith(".html")})
    for name, page in data.items():
        if name.endswith(".html") and f'{WRITE_ID}{wid}">'.encode() not in page[:8192]:
            return None
    return wid


def read_pair(folder: Path | str, names: tuple[str, ...], name: str) -> Any:
    """The JSON file ``name`` of the pair ``names`` in ``folder``, read as qkov's readers read it: a
    write killed between its swaps is finished first (:func:`settle`), and a page and JSON of
    different writes that nothing can settle (a hand edit, a copy) are refused.

    Raises:
        QkovError: the folder cannot be settled, the file cannot be read or is not JSON, or the
            pair is mixed.
    """
    folder = Path(folder)
    settle(folder, names)
    path = folder / name
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        raise QkovError(f"cannot read {str(path)!r} ({type(exc).__name__}: {exc})") from None
    if pair_id(folder, names) is None:
        raise QkovError(
            f"{str(folder)!r}: the page and {name} are from different writes (a file was edited or copied "
            "in): write them again"
        )
    return data


def replace_pair(folder: Path | str, files: dict[str, str], *, overwrite: bool, what: str) -> str:
    """Replace the files ``{name: text}`` in ``folder`` as one write (see the module docstring);
    return its write id.

    Raises:
        QkovError: the folder or a file is a link; a file is not qkov's (and not ``overwrite``),
            found at the moment of replacement: then nothing is replaced and no temporary is left;
            or the file system refused a write (nothing replaced).
    """
    folder = Path(folder)
    wid, data = _stamped(files)
    names = tuple(data)
    with _locked(folder, what) as dfd:
        journal: dict[str, Any] = {"id": wid, "what": what, "overwrite": overwrite, "files": {}}
        saved = False
        try:
            _settle_locked(folder, dfd, names)
            for name in names:
                kind = fs.kind(dfd, name)
                if kind != "absent" and (kind != "file" or not (overwrite or _ours(name, fs.read(dfd, name)))):
                    raise _refusal(folder, name, kind, what)
            for name, body in data.items():
                temp = f".{name}.{wid}-{secrets.token_hex(4)}.tmp"
                journal["files"][name] = {"temp": temp, "sha256": fs.sha256(body)}
                fs.create(dfd, temp, body)
            _save_journal(folder, dfd, journal)
            saved = True
            _complete(folder, dfd, journal)
        except _Refused as refused:  # found before the swaps, or after them and undone
            _drop(dfd, journal)
            raise refused.error from None
        except BaseException as exc:  # a refused write (a full disk), an interrupt: undo what was done
            with contextlib.suppress(OSError, QkovError):
                if saved and fs.kind(dfd, JOURNAL) != "absent":
                    _undo(folder, dfd, journal)
            _drop(dfd, journal, swapped=saved)
            if isinstance(exc, (OSError, QkovError)):
                raise QkovError(f"{what}: cannot write to {str(folder)!r} ({_reason(exc)}); nothing was replaced") from None
            raise
    return wid


def _reason(exc: BaseException) -> str:
    """Why a write failed: an OSError's reason, also behind the QkovError of an atomic write."""
    cause = exc if isinstance(exc, OSError) else exc.__context__
    return getattr(cause, "strerror", None) or str(exc)


def _drop(dfd: int, journal: dict[str, Any], *, swapped: bool = True) -> None:
    """Delete a failed write's temporaries, unless its journal is still in place (then its files
    are complete and the next writer rolls it forward). Before any swap (``swapped=False``) every
    temporary is this write's own, complete or cut short by the failure (a full disk): all go. After
    one, a temporary may hold what a swap displaced, and only this write's own content is deleted."""
    if fs.kind(dfd, JOURNAL) != "absent":
        return
    for entry in journal["files"].values():
        with contextlib.suppress(OSError):
            if not swapped or fs.sha256(fs.read(dfd, entry["temp"])) in (None, entry["sha256"]):
                fs.unlink(dfd, entry["temp"])
