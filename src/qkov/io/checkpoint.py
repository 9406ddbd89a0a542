"""Checkpoints: a directory of ``model.safetensors``, ``config.json``, ``tokenizer.json``, ``metrics.jsonl``.

No pickle anywhere: weights are safetensors, everything else JSON. Every file is
written atomically. ``config.json`` holds ``{"model": ModelConfig, "tokenizer":
{...}, "training": {...}}``.

:func:`save_checkpoint` writes only into a directory qkov keeps a manifest in (or an empty one,
where it starts the manifest; or one written by a qkov from before manifests, which it adopts),
and records each file's name there before writing it: it never replaces a file it did not
write (:mod:`qkov.io.manifest`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from ..errors import QkovError
from ..expect import expect_model, expect_path
from ..model.config import ModelConfig
from ..model.transformer import Transformer
from . import manifest
from .atomic import atomic_write, atomic_write_text
from .manifest import CONFIG_FILE, METRICS_FILE, MODEL_FILE, STATE_FILE, TOKENIZER_FILE
from .plausible import check_shapes, file_shapes

__all__ = [
    "CONFIG_FILE",
    "METRICS_FILE",
    "MODEL_FILE",
    "STATE_FILE",
    "TOKENIZER_FILE",
    "checkpoint_files",
    "checkpoint_info",
    "load",
    "load_state",
    "read_config",
    "read_metrics",
    "read_tokenizer",
    "save_checkpoint",
    "save_tensors",
    "training_record",
]


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Atomically write ``tensors`` (made contiguous, detached, on CPU) as safetensors."""
    flat = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    atomic_write(path, lambda tmp: save_file(flat, tmp, metadata=metadata))


def read_config(path: Path | str) -> dict[str, Any]:
    """Read ``config.json`` of a checkpoint directory."""
    path = Path(path)
    cfg_path = path / CONFIG_FILE
    if not path.exists():
        raise QkovError(f"checkpoint {str(path)!r} does not exist")
    if not path.is_dir():
        raise QkovError(f"checkpoint {str(path)!r} is not a directory")
    if not cfg_path.is_file():
        raise QkovError(f"checkpoint {str(path)!r} has no {CONFIG_FILE}")
    try:
        data = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise QkovError(f"checkpoint {str(path)!r}: {CONFIG_FILE} is not valid JSON ({exc})") from None
    except RecursionError:
        raise QkovError(f"checkpoint {str(path)!r}: {CONFIG_FILE} is nested too deeply to be a config") from None
    if isinstance(data, dict) and "model" not in data and "model_type" in data:
        raise QkovError(
            f"{str(path)!r} is a Hugging Face model directory (model_type {data['model_type']!r}), not a qkov "
            "checkpoint: load it with qkov.load(path) (or qkov.io.load_hf)"
        )
    if not isinstance(data, dict) or "model" not in data:
        raise QkovError(f"checkpoint {str(path)!r}: {CONFIG_FILE} has no 'model' section")
    return data


def save_checkpoint(
    model: Transformer,
    path: Path | str,
    *,
    training: dict[str, Any] | None = None,
    tokenizer_json: str | None = None,
) -> None:
    """Write the model's weights and config (and tokenizer, if given) into ``path``: ``(model, path)``,
    the order of :func:`~qkov.io.save_tl` and :func:`~qkov.io.save_hf`.

    Raises:
        QkovError: ``path`` holds files qkov did not write (or one is at a name it would write),
            or ``path`` / ``model`` are not a path and a qkov :class:`~qkov.Transformer`.
    """
    expect_model("qkov.save_checkpoint", model)
    expect_path("qkov.save_checkpoint", path)
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise QkovError(f"{str(path)!r} exists and is not a directory")
    if tokenizer_json is None and model.tokenizer is not None:
        tokenizer_json = model.tokenizer.to_str()
    if path.is_dir() and manifest.recorded(path) is None and not manifest.bare(path):
        manifest.adopt(path)  # written by a qkov from before manifests (or refused, untouched)
    manifest.record(path, checkpoint_files(tokenizer_json is not None))
    if tokenizer_json is not None:
        atomic_write_text(path / TOKENIZER_FILE, tokenizer_json)
    save_tensors(path / MODEL_FILE, dict(model.state_dict()), metadata={"format": "qkov"})
    config = {
        "model": model.cfg.to_dict(),
        "tokenizer": {
            "bos_token_id": model.bos_token_id,
            "default_prepend_bos": bool(getattr(model, "default_prepend_bos", True)),
            "file": TOKENIZER_FILE if tokenizer_json else None,
        },
        "training": training or {},
    }
    atomic_write_text(path / CONFIG_FILE, json.dumps(config, indent=2))


def checkpoint_files(with_tokenizer: bool) -> list[str]:
    """The names :func:`save_checkpoint` writes (in its order)."""
    return [*([TOKENIZER_FILE] if with_tokenizer else []), MODEL_FILE, CONFIG_FILE]


def load(path: Path | str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Transformer:
    """Load a checkpoint directory -> a :class:`Transformer` in eval mode.

    ``model.tokenizer`` is the checkpoint's tokenizer (``tokenizers.Tokenizer``) or
    ``None``; ``model.bos_token_id`` its start token.
    """
    expect_path("qkov.load", path)
    path = Path(path)
    data = read_config(path)
    cfg = ModelConfig.from_dict(data["model"])
    weights_path = path / MODEL_FILE
    check_weights_header(cfg, path)  # before the model of the config is allocated
    model = Transformer(cfg, init=False)  # every parameter is loaded next (load_state checks)
    try:
        state = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise QkovError(f"checkpoint {str(path)!r}: {MODEL_FILE} is corrupt ({exc})") from None
    load_state(model, state, where=str(weights_path), assign=True)  # the file's tensors, not copies of them
    tok_info = data.get("tokenizer") or {}
    model.bos_token_id = int(tok_info.get("bos_token_id", 0))
    model.default_prepend_bos = bool(tok_info.get("default_prepend_bos", True))
    model.tokenizer = read_tokenizer(path / TOKENIZER_FILE, where=f"checkpoint {str(path)!r}")
    return model.to(device=device, dtype=dtype).eval()


def check_weights_header(cfg: ModelConfig, path: Path) -> None:
    """Refuse a checkpoint whose ``config.json`` does not describe its ``model.safetensors``,
    from the file's header alone (nothing is read or allocated): :func:`~qkov.io.plausible.check_shapes`."""
    weights_path = path / MODEL_FILE
    if not weights_path.is_file():
        raise QkovError(f"checkpoint {str(path)!r} has no {MODEL_FILE}")
    check_shapes(cfg, file_shapes(weights_path, f"checkpoint {str(path)!r}"), str(weights_path))


def read_tokenizer(path: Path, *, where: str) -> Tokenizer | None:
    """The ``tokenizers`` tokenizer in ``path``, or ``None`` when there is no such file."""
    if not path.is_file():
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own Exception type
        raise QkovError(f"{where}: {path.name} is corrupt ({exc})") from None


def load_state(model: Transformer, state: dict[str, torch.Tensor], *, where: str, assign: bool = False) -> None:
    """Copy ``state`` into ``model``, naming any missing, unexpected or mis-shaped tensor, or one
    holding NaN or infinity; ``assign`` makes ``state``'s tensors the parameters instead of copying
    them (no copy at all when they are views of a memory-mapped file, strided or not; for tensors
    that are nothing else's, as a freshly read file's are)."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise QkovError(f"{where}: missing weight(s) {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    if unexpected:
        raise QkovError(
            f"{where}: unexpected weight(s) {', '.join(unexpected[:4])}{' ...' if len(unexpected) > 4 else ''}"
        )
    for name, tensor in state.items():
        if not tensor.is_floating_point():
            kind = str(tensor.dtype).removeprefix("torch.")
            raise QkovError(f"{where}: {name} holds {kind} values; weights are floating point")
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise QkovError(
                f"{where}: {name} has shape {tuple(tensor.shape)} but the config implies {tuple(expected[name].shape)}"
            )
        if not _finite(tensor):
            raise QkovError(f"{where}: {name} holds NaN or infinite values")
    model.load_state_dict(state, assign=assign)


def _finite(t: torch.Tensor) -> bool:
    """No NaN or infinity in ``t``: one pass in memory order, nothing allocated (its min and max
    are finite; ``aminmax`` propagates NaN), where ``isfinite(t).all()`` writes a mask as large as ``t``."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    order = sorted(range(t.ndim), key=lambda d: -t.stride(d))  # a strided view read in memory order
    lo, hi = torch.aminmax(t.permute(order))
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def read_metrics(path: Path | str) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl`` (an unreadable trailing line is ignored)."""
    p = Path(path) / METRICS_FILE
    rows: list[dict[str, Any]] = []
    if not p.is_file():
        return rows
    for line in p.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except (json.JSONDecodeError, RecursionError):
            continue
    return rows


def checkpoint_info(path: Path | str, model: Transformer) -> dict[str, Any]:
    """What a checkpoint is, as a JSON-ready dict: config, parameters, how far it trained, its
    final losses and induction score, where it came from (``imported_from``) and whether it
    carries a tokenizer. ``model`` is the checkpoint's model (already loaded)."""
    path = Path(path)
    head = {"path": str(path), "model": model.cfg.to_dict(), "parameters": model.num_parameters()}
    return {**head, **training_record(path), "tokenizer": model.tokenizer is not None}


def training_record(path: Path | str) -> dict[str, Any]:
    """A checkpoint's training record from its ``config.json`` alone (what
    :func:`checkpoint_info` adds to the model's description): steps, tokens, final losses and
    induction score, wall time, device, corpus, the training config and ``imported_from``."""
    data = read_config(Path(path))
    tr = data.get("training", {})
    cfg = tr.get("config", {})
    return {
        "steps": tr.get("step"),
        "steps_planned": cfg.get("steps"),
        "complete": tr.get("step") is not None and tr.get("step") == cfg.get("steps"),
        "tokens": tr.get("tokens"),
        "train_loss": tr.get("train_loss"),
        "val_loss": tr.get("val_loss"),
        "induction_score": tr.get("induction_score"),
        "wall_s": tr.get("wall_s"),
        "device": tr.get("device"),
        "corpus": tr.get("corpus"),
        "training": cfg,
        "imported_from": tr.get("imported_from"),
    }
