"""Weight-only snapshots of a run, for the analysis of training dynamics (``qkov dynamics``).

A run keeps its model's weights at chosen steps in ``OUT/snapshots/step-<step>.safetensors``
(no optimizer state: 1.7 MB each for the default model). The default schedule takes about 40
steps spaced evenly in ``log(step + steps/10)``: dense at the start (step 0, the initial
weights, then every ~0.6% of the run), never sparser than ~6% of the run at the end, so a change
in the middle of training (where the default 2-layer model forms its induction heads) is seen
by several snapshots. Each file is written atomically, its name recorded in the run's manifest
first (:mod:`qkov.io.manifest`); a resumed run rewrites the snapshots after its last training
state (they are a pure function of the state, so they come out equal). Only recorded snapshots
are ever deleted: another file in the folder, even one named like a snapshot, is left alone.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ..errors import QkovError
from ..io import manifest
from ..io.atomic import remove_stale_temporaries
from ..io.checkpoint import save_tensors
from ..io.manifest import SNAPSHOT_DIR, SNAPSHOT_NAME

__all__ = [
    "DEFAULT_SNAPSHOTS",
    "drop_after",
    "listing",
    "meta",
    "name_for",
    "parse_spec",
    "path_for",
    "read",
    "schedule",
    "write",
]

DEFAULT_SNAPSHOTS = 40


def schedule(steps: int, spec: int | tuple[int, ...]) -> list[int]:
    """The steps a run of ``steps`` steps snapshots: ``spec`` is a count (0 = none) or explicit steps.

    A count ``n`` gives up to ``n`` distinct steps evenly spaced in ``log(step + steps/10)``
    from 0 to ``steps`` (both included; fewer when the run has fewer steps).
    """
    if isinstance(spec, tuple):
        return sorted({s for s in spec if 0 <= s <= steps})
    if spec <= 0:
        return []
    if spec == 1:
        return [steps]
    c = max(1.0, steps / 10)
    lo, hi = math.log(c), math.log(steps + c)
    points = {int(round(math.exp(lo + (hi - lo) * i / (spec - 1)) - c)) for i in range(spec)}
    return sorted({min(steps, max(0, p)) for p in points} | {0, steps})


def parse_spec(text: str) -> int | tuple[int, ...]:
    """``"40"`` -> 40 snapshots, ``"none"`` -> 0, ``"0,500,1000"`` -> those steps."""
    text = text.strip().lower()
    if text in ("none", "0", "off"):
        return 0
    try:
        if "," in text:
            steps = tuple(sorted({int(s) for s in text.split(",") if s.strip()}))
            if not steps or min(steps) < 0:
                raise ValueError
            return steps
        n = int(text)
        if n < 0:
            raise ValueError
        return n
    except ValueError:
        raise QkovError(
            f"snapshots: expected a count, 'none' or comma-separated steps (e.g. 0,100,1000), got {text!r}"
        ) from None


def name_for(step: int) -> str:
    """The snapshot of ``step``'s path relative to the run directory (as the manifest records it)."""
    return f"{SNAPSHOT_DIR}/step-{step:08d}.safetensors"


def path_for(out: Path, step: int) -> Path:
    return out / name_for(step)


def write(out: Path, model: torch.nn.Module, step: int, tokens: int) -> None:
    """Atomically write ``model``'s weights as the snapshot of ``step`` (``tokens`` seen so far),
    recording its name in the run's manifest first.

    Raises:
        QkovError: a file qkov did not write is at the snapshot's path (it is left as it is).
    """
    manifest.record(out, [name_for(step)])
    (out / SNAPSHOT_DIR).mkdir(parents=True, exist_ok=True)
    meta = {"format": "qkov-snapshot", "step": str(step), "tokens": str(tokens)}
    save_tensors(path_for(out, step), dict(model.state_dict()), metadata=meta)


def listing(out: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every snapshot in run directory ``out``, by step."""
    folder = out / SNAPSHOT_DIR
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := SNAPSHOT_NAME.match(p.name))]
    return sorted(found)


def drop_after(out: Path, step: int) -> None:
    """Remove the recorded snapshots later than ``step`` (a resumed run writes them again) and the
    temporary files of killed snapshot writes; nothing the manifest does not list."""
    if (out / SNAPSHOT_DIR).is_symlink():  # what the link points to is not the run's
        return
    ours = sorted(n for n in manifest.recorded(out) or () if n.startswith(f"{SNAPSHOT_DIR}/"))
    remove_stale_temporaries(out, ours)
    for name in ours:
        m = SNAPSHOT_NAME.match(name.split("/", 1)[1])
        if m and int(m.group(1)) > step:
            (out / name).unlink(missing_ok=True)


def _open(path: Path, with_tensors: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()} if with_tensors else {}
    except (SafetensorError, OSError) as exc:
        raise QkovError(f"snapshot {str(path)!r} cannot be read ({exc})") from None
    if meta.get("format") != "qkov-snapshot":
        raise QkovError(f"{str(path)!r} is not a qkov snapshot")
    return tensors, {"step": int(meta["step"]), "tokens": int(meta["tokens"])}


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The weights and metadata (``step``, ``tokens``) of one snapshot file."""
    return _open(path, True)


def meta(path: Path) -> dict[str, Any]:
    """The metadata (``step``, ``tokens``) of one snapshot file, without reading its weights."""
    return _open(path, False)[1]
