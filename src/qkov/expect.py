"""What the library's entry points expect of their arguments, checked in one place.

Each public function that takes a model, a weights source, token ids or a path calls one of
these first, so a wrong argument is a one-line :class:`~qkov.QkovError` that names the
function, what it expected, what it got, and what to pass instead, rather than an
``AttributeError`` from deep inside:

* :func:`expect_model` — a qkov :class:`~qkov.Transformer` (what ``Weights.from_model`` reads);
* :func:`expect_source` — a weights source (:class:`~qkov.Weights` or
  :class:`~qkov.LazyCheckpoint`: what the analyses read);
* :func:`expect_tokens` — token ids (a tensor, array or nested list of integers);
* :func:`expect_path` / :func:`expect_paths` — a path (``str`` or ``os.PathLike``), or a list of them.

The checks only refuse: nothing is converted (a model is never turned into a view, nor a path
loaded, behind the caller's back).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import QkovError
from .model.config import ModelConfig
from .model.transformer import Transformer

_SOURCE_PARTS = ("attention", "embed", "unembed", "pos", "mlp", "norm", "device", "dtype")


def describe(value: Any) -> str:
    """A short description of ``value`` for an error: ``None``, ``a str ('runs/x')``, ``a Transformer``,
    ``a transformers GPT2LMHeadModel``, ``a torch.nn Linear``."""
    if value is None:
        return "None"
    if isinstance(value, (str, Path)):
        return f"a {type(value).__name__} ({str(value)[:80]!r})"
    kind = type(value)
    module = kind.__module__.split(".")[0]
    if module in ("transformers", "transformer_lens"):
        return f"a {module} {kind.__name__}"
    if module == "torch" and isinstance(value, torch.nn.Module):
        return f"a torch.nn {kind.__name__}"
    name = kind.__name__
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"


def _foreign_model_advice(value: Any) -> str | None:
    """How to bring another library's model into qkov, or ``None`` when ``value`` is not one."""
    module = type(value).__module__.split(".")[0]
    if module == "transformers":
        return (
            "convert it first with qkov.io.from_hf(model) (GPT-2), or save it and read the directory with qkov.load_any"
        )
    if module == "transformer_lens":
        return "convert it first with qkov.io.from_hooked(model)"
    return None


def _is_source(value: Any) -> bool:
    if isinstance(value, torch.nn.Module):  # a module (qkov's Transformer included) is never a view
        return False
    return isinstance(getattr(value, "cfg", None), ModelConfig) and all(hasattr(value, n) for n in _SOURCE_PARTS)


def expect_source(where: str, value: Any) -> None:
    """Refuse (one-line :class:`QkovError`) anything but a weights source (``qkov.Weights`` or
    ``qkov.LazyCheckpoint``, or another object with the :class:`~qkov.weights.WeightSource` parts)."""
    if _is_source(value):
        return
    if isinstance(value, Transformer):
        advice = "pass qkov.Weights.from_model(model)"
    elif isinstance(value, (str, Path)):
        advice = "open it first: qkov.Weights.from_model(qkov.load_any(path)), or qkov.LazyCheckpoint(path)"
    else:
        advice = _foreign_model_advice(value) or "build one with qkov.Weights.from_model(model)"
    raise QkovError(
        f"{where} expects a weights view (qkov.Weights) or a LazyCheckpoint; got {describe(value)}: {advice}"
    )


def expect_model(where: str, value: Any) -> None:
    """Refuse (one-line :class:`QkovError`) anything but a qkov :class:`~qkov.Transformer`."""
    if isinstance(value, Transformer):
        return
    if _is_source(value):
        advice = "it is already a weights source: pass it to the analyses as it is"
        if not getattr(value, "in_memory", True):
            advice += ", or read it into memory with qkov.Weights.from_source(source)"
    elif isinstance(value, (str, Path)):
        advice = "load it first: qkov.load_any(path)"
    else:
        advice = (
            _foreign_model_advice(value) or "build one with qkov.Transformer(cfg) or load one with qkov.load_any(path)"
        )
    raise QkovError(f"{where} expects a qkov model (qkov.Transformer); got {describe(value)}: {advice}")


def expect_tokens(where: str, value: Any, name: str = "tokens") -> None:
    """Refuse what cannot hold token ids (ids themselves are checked against the model by the
    forward: :func:`~qkov.model.tokens.check_tokens`)."""
    if isinstance(value, (torch.Tensor, np.ndarray, list, tuple)):
        return
    raise QkovError(
        f"{where}: {name} must be token ids (a tensor [batch, seq] or [seq], an array or a list of integers); "
        f"got {describe(value)}"
    )


def expect_path(where: str, value: Any, name: str = "path") -> None:
    """Refuse a ``path`` that is not a ``str`` or ``os.PathLike``."""
    if isinstance(value, (str, os.PathLike)):
        return
    if isinstance(value, torch.nn.Module) or _is_source(value):
        advice = ": it is already loaded" if _is_source(value) or hasattr(value, "cfg") else ""
        raise QkovError(f"{where}: {name} must be a path (str or pathlib.Path); got {describe(value)}{advice}")
    raise QkovError(f"{where}: {name} must be a path (str or pathlib.Path); got {describe(value)}")


def expect_paths(where: str, value: Any, name: str = "sources") -> None:
    """Refuse anything but a non-string sequence of paths (a lone string would read as its characters)."""
    if isinstance(value, (str, os.PathLike)):
        raise QkovError(f"{where}: {name} must be a list of paths; got {describe(value)}: pass [{str(value)[:60]!r}]")
    if not isinstance(value, (list, tuple)):
        raise QkovError(f"{where}: {name} must be a list of paths; got {describe(value)}")
    for item in value:
        expect_path(where, item, f"each of {name}")
