"""Torch files (``.pt``/``.pth``) read without unpickling code.

``torch.load(weights_only=True)`` refuses anything beyond tensors and plain containers; torch's
own refusal is a long message that advises loading with ``weights_only=False``, advice qkov
never takes. :func:`read_torch_file` turns it into qkov's one-line error and keeps torch's
warnings out of the output.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import torch

from ..errors import QkovError

__all__ = ["read_torch_file"]


def _load_error(path: Path, what: str, exc: Exception) -> QkovError:
    text = str(exc)
    if "Unsupported global" in text:  # a pickled class or function: building it would run code
        return QkovError(
            f"{what} {str(path)!r} holds Python objects beyond tensors: loading it would run pickled "
            "code, which qkov never does; save the state dict alone, or as .safetensors"
        )
    found = re.search(r"Unsupported operand[^\n]*", text)
    reason = found.group(0) if found else (text.splitlines()[0] if text else type(exc).__name__)
    return QkovError(f"{what} {str(path)!r} is unreadable: not a torch file, or damaged ({reason})")


def read_torch_file(path: Path, what: str) -> Any:
    """The tensors and containers in a torch file, on the CPU; ``what`` names it in errors.

    Raises:
        QkovError: the file holds pickled objects beyond tensors, or is not a torch file.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError ...
        raise _load_error(path, what, exc) from None
