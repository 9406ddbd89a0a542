"""One entry point for every model source: :func:`load_any` (what ``qkov import`` and the analyses read).

A source is, in this order: a qkov checkpoint directory (``config.json`` with a ``model``
section); a Hugging Face directory (``config.json`` with a ``model_type``: GPT-2, GPT-NeoX,
Llama, Mistral, Qwen2); a
TransformerLens state-dict file (``.pt``, ``.pth``, ``.safetensors``); or, when no such
path exists, a Hugging Face Hub name such as ``gpt2`` or ``openai-community/gpt2``, fetched
(safetensors, config and tokenizer only) when a network exists, or from the local Hugging
Face cache; offline and uncached it fails with one clear message.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from ..errors import QkovError
from ..expect import expect_path
from ..model.transformer import Transformer
from .checkpoint import load as load_checkpoint
from .hf import load_hf
from .tl import load_tl

__all__ = ["fetch_hub", "hf_model_type", "load", "load_any", "source_kind", "TL_SUFFIXES"]

_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
TL_SUFFIXES = (".pt", ".pth", ".safetensors")


def source_kind(source: Path | str) -> str:
    """``"qkov"``, ``"hf"`` (GPT-2 directory), ``"tl"`` (TransformerLens file) or ``"hub"`` (a name to fetch)."""
    path = Path(source)
    if path.is_dir():
        try:
            data = json.loads((path / "config.json").read_text())
        except FileNotFoundError:
            raise QkovError(
                f"{str(path)!r} has no config.json: not a qkov checkpoint nor a Hugging Face model"
            ) from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise QkovError(f"{str(path)!r}: config.json is not valid JSON ({exc})") from None
        except RecursionError:  # brackets nested deeper than Python's parser follows
            raise QkovError(f"{str(path)!r}: config.json is nested too deeply to be a config") from None
        if isinstance(data, dict) and "model" in data:
            return "qkov"
        if isinstance(data, dict) and "model_type" in data:
            return "hf"
        raise QkovError(f"{str(path)!r}: config.json is neither a qkov checkpoint's nor a Hugging Face model's")
    if path.is_file():
        if path.suffix in TL_SUFFIXES:
            return "tl"
        raise QkovError(
            f"{str(path)!r}: expected a checkpoint directory, a Hugging Face model directory or a "
            f"TransformerLens file ({', '.join(TL_SUFFIXES)})"
        )
    if _HUB_NAME.match(str(source)) and not str(source).endswith(TL_SUFFIXES):
        return "hub"
    raise QkovError(f"{str(source)!r} does not exist")


def hf_model_type(path: Path | str) -> str | None:
    """The ``model_type`` of a Hugging Face directory's ``config.json`` (``None`` if it has none)."""
    try:
        data = json.loads((Path(path) / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None
    kind = data.get("model_type") if isinstance(data, dict) else None
    return kind if isinstance(kind, str) else None


def fetch_hub(name: str, revision: str | None = None) -> Path:
    """Download (or find in the local cache) a Hub model's config, safetensors and tokenizer -> its
    directory; ``revision``: a branch, tag or commit (Pythia names its checkpoints ``step1000``, ...)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise QkovError(
            f"{name!r} is not a local path; fetching it from the Hugging Face Hub needs "
            "huggingface_hub (pip install 'qkov[hf]')"
        ) from None
    patterns = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json"]
    try:
        pinned = {} if revision is None else {"revision": revision}
        return Path(snapshot_download(name, allow_patterns=patterns, **pinned))
    except Exception as exc:  # offline, unknown repo, gated, ...: one line, whatever the cause
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        what = f"{name!r}" if revision is None else f"revision {revision!r} of {name!r}"
        raise QkovError(
            f"{what} is not a local checkpoint, model directory or file, and fetching it from the "
            f"Hugging Face Hub failed (no network, or no such revision?): {type(exc).__name__}: {first[:200]}"
        ) from None


def load_any(
    source: Path | str,
    *,
    config: dict[str, Any] | Path | str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Transformer:
    """Load any supported source (see the module docstring) as a qkov :class:`~qkov.Transformer` (eval
    mode, on ``device``); :func:`load` is the same under the name most code uses.

    ``config`` is the TransformerLens config for a TransformerLens file that carries none.
    """
    expect_path("qkov.load_any", source)
    kind = source_kind(source)
    if config is not None and kind != "tl":
        raise QkovError("a separate config applies to TransformerLens files only")
    if kind == "qkov":
        return load_checkpoint(source, dtype=dtype, device=device)
    if kind == "hf":
        model = load_hf(source, dtype=dtype)
    elif kind == "tl":
        model = load_tl(source, config, dtype=dtype)
    else:
        model = load_hf(fetch_hub(str(source)), dtype=dtype)
    return model if torch.device(device) == torch.device("cpu") else model.to(device)


def load(
    source: Path | str,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    config: dict[str, Any] | Path | str | None = None,
) -> Transformer:
    """``qkov.load``: any source qkov reads (a qkov checkpoint, a Hugging Face directory or Hub name, a
    TransformerLens file) as a :class:`~qkov.Transformer` in eval mode on ``device``, with its tokenizer
    (``model.tokenizer``, ``model.codec``) and start token (``model.bos_token_id``). A qkov checkpoint
    alone: :func:`qkov.io.checkpoint.load`."""
    expect_path("qkov.load", source)
    return load_any(source, config=config, dtype=dtype, device=device)
