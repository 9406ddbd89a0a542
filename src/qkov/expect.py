"""What the library's entry points expect of their arguments, checked in one place.

Each public function that takes a model, a weights source, token ids or a path calls one of
these first, so a wrong argument is a one-line :class:`~qkov.QkovError` that names the
function, what it expected, what it got, and what to pass instead, rather than an
``AttributeError`` from deep inside:

* :func:`expect_model` — a qkov :class:`~qkov.Transformer` (what ``Weights.from_model`` reads);
* :func:`expect_source` — a weights source (:class:`~qkov.Weights` or
  :class:`~qkov.LazyCheckpoint`: what :meth:`Weights.from_source` reads);
* :func:`refuse_source` — the refusal of what an analysis cannot read: the analyses accept a
  model, a weights source or a path and convert it once (:func:`qkov.weights.as_source`); anything
  else is a :class:`SourceTypeError` listing what can be passed;
* :func:`expect_tokens` — token ids (a tensor, array or nested list of integers);
  :func:`token_ids` also checks them against the model and returns them as ``[batch, seq]``;
* :func:`expect_path` / :func:`expect_paths` — a path (``str`` or ``os.PathLike``), or a list of them.

The checks here only refuse; the one conversion (model or path to the default view) is
:func:`qkov.weights.as_source`, which sits after ``io`` in the dependency order.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import QkovError
from .model.config import ModelConfig
from .model.tokens import check_tokens
from .model.transformer import Transformer

__all__ = [
    "describe",
    "expect_model",
    "expect_path",
    "expect_paths",
    "expect_source",
    "expect_tokens",
    "float_dtype",
    "is_source",
    "refuse_source",
    "SOURCE_KINDS",
    "SourceTypeError",
    "token_ids",
]

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


class SourceTypeError(QkovError, TypeError):
    """What an analysis was given cannot be read as weights: a :class:`QkovError` (one line at the
    command line) that is also a ``TypeError`` (the argument's type is wrong)."""


SOURCE_KINDS = (
    "a model (qkov.Transformer, what qkov.load returns), a weights view (qkov.Weights), "
    "a qkov.LazyCheckpoint or a path (str or pathlib.Path)"
)


def refuse_source(where: str, value: Any) -> None:
    """Raise :class:`SourceTypeError`: ``value`` is none of the things an analysis can read."""
    advice = _foreign_model_advice(value)
    tail = f": {advice}" if advice else ""
    raise SourceTypeError(f"{where} expects {SOURCE_KINDS}; got {describe(value)}{tail}")


def is_source(value: Any) -> bool:
    """Whether ``value`` has the :class:`~qkov.weights.WeightSource` parts (a module never has)."""
    return _is_source(value)


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


def token_ids(
    where: str, value: Any, cfg: ModelConfig, name: str = "tokens", *, keep: int | None = None
) -> torch.Tensor:
    """``value`` as ``[batch, seq]`` token ids of a model with config ``cfg`` (a ``[seq]`` tensor or list
    gains its batch axis), checked (:func:`~qkov.model.tokens.check_tokens`): refused in one line naming
    ``where`` and ``name`` when it is not ids, not one or two axes, empty, longer than the context or out
    of the vocabulary. ``keep``: only the first ``keep`` positions are used (and checked)."""
    expect_tokens(where, value, name)
    try:
        ids = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    except (TypeError, ValueError, RuntimeError):
        raise QkovError(f"{where}: {name} must be token ids of equal-length sequences; got {describe(value)}") from None
    if keep is not None and ids.ndim == 2:
        ids = ids[:, :keep]
    try:
        return check_tokens(ids, cfg)
    except QkovError as exc:
        raise QkovError(f"{where}: {name}{str(exc).removeprefix('tokens')}") from None


def float_dtype(where: str, value: Any, name: str = "dtype") -> torch.dtype:
    """``value`` as a floating-point ``torch.dtype`` (a dtype, or its name: ``"float32"``,
    ``"torch.bfloat16"``); anything else is refused in one line."""
    found = getattr(torch, value.removeprefix("torch."), None) if isinstance(value, str) else value
    if isinstance(found, torch.dtype) and found.is_floating_point:
        return found
    raise QkovError(
        f"{where}: {name} must be a floating-point torch dtype (torch.float32, torch.float64, torch.bfloat16 or "
        f"torch.float16); got {value!r}"
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
