"""Call forms of the analyses that changed in qkov 1.0, still accepted (with a
:class:`DeprecationWarning`) until 1.1: each function here sorts a call's arguments into the new
order, so the analysis itself has one signature."""

from __future__ import annotations

import warnings
from typing import Any

from torch import Tensor

from ...errors import QkovError

__all__ = ["ablation_args"]


def ablation_args(text: Any, heads: Any, named: dict[str, Any]) -> tuple[Any, Any]:
    """``(text, heads)`` of an :func:`ablation_study` call: ``text`` and ``heads`` positional or named,
    or in the pre-1.0 order ``ablation_study(w, heads, text=...)`` (with a :class:`DeprecationWarning`)."""
    if "heads" in named:
        if heads is not None:
            raise TypeError("qkov.ablation_study got heads twice (positional and named)")
        heads = named.pop("heads")
    if "text" in named:
        if heads is None and text is not None and not isinstance(text, Tensor):  # (w, heads, text=...)
            warnings.warn(
                "qkov.ablation_study(source, heads, text=...) is deprecated: pass the text second, "
                "ablation_study(source, text, heads); the old order is accepted until qkov 1.1",
                DeprecationWarning,
                stacklevel=3,
            )
            text, heads = named.pop("text"), text
        elif text is None:
            text = named.pop("text")
    if named:
        raise TypeError(f"qkov.ablation_study got an unexpected keyword argument {next(iter(named))!r}")
    if heads is None:
        raise QkovError("qkov.ablation_study: which heads? ablation_study(source, text, heads=[(layer, head), ...])")
    return text, heads
