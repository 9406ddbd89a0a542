"""A series of snapshots of one model, from any of the places they live.

* a qkov run directory with snapshots (``qkov train`` keeps them in ``RUN/snapshots``);
* checkpoints: several paths, or a glob (anything the analyses read: qkov checkpoints, Hugging
  Face directories, TransformerLens files), ordered by the tokens (or step) each records;
* a Hugging Face Hub name with revisions (Pythia's ``step1000``, ...), fetched or found in the
  local Hugging Face cache.

Every entry must describe the same architecture. The step of a checkpoint that records none is
read from its name (``step1000``, ``step-00001000``); tokens are ``step x tokens_per_step`` when
that is known (a qkov run knows it; for other series give it).
"""

from __future__ import annotations

import glob as globlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ...errors import QkovError
from ...io.checkpoint import read_config, read_tokenizer
from ...io.hf import hf_config
from ...io.manifest import SNAPSHOT_DIR
from ...io.sources import fetch_hub, load_any, source_kind
from ...model.config import ModelConfig
from ...model.transformer import Transformer
from ...training import snapshots as snaps

__all__ = ["Entry", "Series", "series"]

_STEP = re.compile(r"step[-_]?0*(\d+)", re.I)


@dataclass
class Entry:
    """One snapshot: where its weights are and when in training it was taken."""

    label: str
    path: Path
    step: int | None
    tokens: int | None
    snapshot: bool = False  # a weight-only snapshot file of a qkov run (else a checkpoint)


@dataclass
class Series:
    """Snapshots of one architecture, in training order, and what they came from."""

    entries: list[Entry]
    cfg: ModelConfig
    origin: Path  # the run or checkpoint that gives the tokenizer and the corpus
    run: Path | None = None  # the qkov run directory, when the series is its snapshots
    training: dict[str, Any] = field(default_factory=dict)  # the run's training config
    bos: int | None = None  # the run's start token (None: each model's own) and tokenizer (read once;
    # snapshots hold weights only)
    tokenizer: Any = None

    @property
    def axis(self) -> str:
        return "tokens" if all(e.tokens is not None for e in self.entries) else "step"

    def position(self, e: Entry) -> float:
        value = e.tokens if self.axis == "tokens" else e.step
        return float(value if value is not None else self.entries.index(e))

    def load(self, e: Entry) -> Transformer:
        """The model of entry ``e`` (CPU, eval mode, with the series' tokenizer)."""
        if not e.snapshot:
            return load_any(e.path)
        tensors, _ = snaps.read(e.path)
        model = Transformer(self.cfg, init=False)  # no random init: strict loading sets every parameter
        try:
            model.load_state_dict(tensors)
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()[-1].strip()
            raise QkovError(f"snapshot {str(e.path)!r} does not fit the run's model config ({first})") from None
        if self.bos is not None:
            model.bos_token_id = self.bos
        model.tokenizer = self.tokenizer
        return model.eval()


def _config_of(path: Path) -> ModelConfig | None:
    """The architecture a source describes, read without its weights (``None``: only by loading)."""
    kind = source_kind(path)
    if kind == "qkov":
        return ModelConfig.from_dict(read_config(path)["model"])
    if kind == "hf":
        return hf_config(json.loads((path / "config.json").read_text()))
    return None


def _step_of(path: Path, name: str) -> tuple[int | None, int | None]:
    if source_kind(path) == "qkov":
        tr = read_config(path).get("training") or {}
        if tr.get("step") is not None:
            return int(tr["step"]), tr.get("tokens")
    m = _STEP.search(name)
    return (int(m.group(1)) if m else None), None


def _from_run(run: Path) -> Series:
    found = snaps.listing(run)
    if not found:
        raise QkovError(
            f"{str(run)!r} holds no snapshots ({SNAPSHOT_DIR}/): train with snapshots (the default), "
            "or give a list of checkpoints"
        )
    data = read_config(run)
    cfg = ModelConfig.from_dict(data["model"])
    training = (data.get("training") or {}).get("config") or {}
    entries = [Entry(f"step {step}", path, step, snaps.meta(path)["tokens"], snapshot=True) for step, path in found]
    bos = int((data.get("tokenizer") or {}).get("bos_token_id", 0))
    tokenizer = read_tokenizer(run / "tokenizer.json", where=f"run {str(run)!r}")
    return Series(entries, cfg, run, run, training, bos, tokenizer)


def _expand(sources: Sequence[str]) -> list[Path]:
    paths: list[Path] = []
    for s in sources:
        if any(c in s for c in "*?[") and not Path(s).exists():
            hits = sorted(globlib.glob(s))
            if not hits:
                raise QkovError(f"dynamics: the pattern {s!r} matches nothing")
            paths.extend(Path(h) for h in hits)
        else:
            paths.append(Path(s))
    return paths


def _checkpoints(paths: list[Path], labels: list[str], tokens_per_step: int | None) -> Series:
    entries, cfg = [], None
    for path, label in zip(paths, labels):
        if source_kind(path) == "hub":
            raise QkovError(f"dynamics: {str(path)!r} does not exist (a Hub name needs revisions)")
        this = _config_of(path)
        if this is not None and cfg is not None and this != cfg:
            raise QkovError(
                f"dynamics: {str(path)!r} is a different architecture ({this.describe()}) from the first "
                f"snapshot ({cfg.describe()}); a series is one model over training"
            )
        cfg = cfg or this
        step, tokens = _step_of(path, label)
        if tokens is None and step is not None and tokens_per_step:
            tokens = step * tokens_per_step
        entries.append(Entry(label, path, step, tokens))
    if cfg is None:  # TransformerLens files only: read the first one to learn the architecture
        cfg = load_any(paths[0]).cfg
    known = [e for e in entries if e.step is not None or e.tokens is not None]
    if len(known) == len(entries):
        entries.sort(key=lambda e: (e.tokens if e.tokens is not None else 0, e.step or 0))
    return Series(entries, cfg, entries[-1].path)


def series(
    sources: Sequence[str | Path], *, revisions: Sequence[str] | None = None, tokens_per_step: int | None = None
) -> Series:
    """The series ``sources`` name (see the module docstring).

    Raises:
        QkovError: no snapshots, a pattern that matches nothing, mixed architectures, a revision
            that cannot be found, fewer than two snapshots.
    """
    names = [str(s) for s in sources]
    if not names:
        raise QkovError("dynamics: no source given")
    if revisions:
        if len(names) != 1:
            raise QkovError("dynamics: revisions apply to one Hugging Face Hub name")
        paths = [fetch_hub(names[0], r) for r in revisions]
        out = _checkpoints(paths, list(revisions), tokens_per_step)
    elif len(names) == 1 and Path(names[0]).is_dir() and source_kind(names[0]) == "qkov":
        out = _from_run(Path(names[0]))
    else:
        paths = _expand(names)
        for p in paths:
            if not p.exists():
                raise QkovError(f"dynamics: {str(p)!r} does not exist")
        out = _checkpoints(paths, [p.name for p in paths], tokens_per_step)
    if len(out.entries) < 2:
        raise QkovError(f"dynamics: a series needs at least two snapshots, found {len(out.entries)}")
    return out
