"""What ``qkov explore`` computes once per model and keeps on disk (the heads table): where it lives,
how a model is recognised, and how an entry is read back without trusting it.

The folder is ``explore`` in qkov's cache (beside the token cache: ``$QKOV_CACHE``, else
``$XDG_CACHE_HOME/qkov``, else ``~/.cache/qkov``), never beside the user's files; ``--cache-dir`` names another and ``--no-cache`` keeps nothing. One file per model and
analysis, named by a fingerprint of what the result depends on: the weights' content (every tensor's
name, dtype, shape and bytes), the tokens analysed, the analysis' options and qkov's version. So a
retrained or edited model, or another qkov, never reads a stale entry. Files are written atomically
(:mod:`qkov.io.atomic`); one that does not parse, or that was written for another key, is recomputed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from ...errors import QkovError
from ...io.atomic import atomic_write_text
from ...training.data import default_cache_dir as qkov_cache_dir
from ...version import __version__

__all__ = ["default_cache_dir", "entry_key", "entry_path", "FORMAT", "read_entry", "tensors_fingerprint", "write_entry"]

FORMAT = 1
"""The layout of an entry; a file of another format is recomputed."""


def default_cache_dir() -> Path:
    """``explore`` in qkov's cache folder (:func:`qkov.training.data.default_cache_dir`: ``$QKOV_CACHE``, else
    ``$XDG_CACHE_HOME/qkov``, else ``~/.cache/qkov``); not created here."""
    return qkov_cache_dir() / "explore"


def tensors_fingerprint(tensors: dict[str, torch.Tensor]) -> str:
    """A sha256 over every tensor's name, dtype, shape and bytes (in name order): equal for equal weights,
    whatever file they came from. ~0.3 s per 500 MB (GPT-2 small in float32)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def entry_key(kind: str, fingerprint: str, inputs: torch.Tensor, options: dict[str, Any]) -> str:
    """The key of one entry: the analysis ``kind``, the weights' fingerprint, the token ids analysed and the
    options (JSON), and qkov's version."""
    h = hashlib.sha256()
    h.update(f"{kind}|{fingerprint}|{__version__}|{FORMAT}|".encode())
    h.update(json.dumps(options, sort_keys=True).encode())
    h.update(inputs.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()


def entry_path(cache_dir: Path, kind: str, key: str) -> Path:
    return Path(cache_dir) / f"{kind}-{key[:32]}.json"


def read_entry(path: Path, key: str) -> dict[str, Any] | None:
    """The result stored at ``path`` for ``key``; ``None`` when there is none, or the file is unreadable,
    corrupt, of another format or written for another key (the caller recomputes and overwrites it)."""
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    ok = isinstance(stored, dict) and stored.get("format") == FORMAT and stored.get("key") == key
    result = stored.get("result") if ok else None
    return result if isinstance(result, dict) else None


def write_entry(path: Path, key: str, result: dict[str, Any]) -> None:
    """Store ``result`` (JSON-ready) for ``key`` at ``path``, atomically (the folder is made if missing).

    Raises:
        QkovError: the folder cannot be made or written (one line, from :mod:`qkov.io.atomic`).
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise QkovError(f"cannot make the cache folder {str(path.parent)!r} ({exc.strerror})") from None
    text = json.dumps({"format": FORMAT, "key": key, "result": result}, allow_nan=False)
    atomic_write_text(path, text)
