"""Numbers JSON can carry, written once: a NaN or an infinity is ``None`` (``null``), never the
``NaN``/``Infinity`` that strict JSON parsers refuse (a score that does not apply is NaN in a tensor
and ``null`` in every JSON output: the report, the explorer, the command line).

* :func:`finite` — a float, or ``None`` when it is not finite;
* :func:`rounded` — the same, to some significant digits (keeps JSON small);
* :func:`json_safe` — a nested structure with every float through them;
* :func:`to_json` — strict JSON text of it.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["finite", "json_safe", "rounded", "to_json"]


def finite(x: float | None) -> float | None:
    """``x`` as a float; ``None`` when it is ``None``, NaN or infinite."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def rounded(x: float | None, digits: int) -> float | None:
    """``x`` to ``digits`` significant digits; ``None`` when it is ``None``, NaN or infinite."""
    x = finite(x)
    return None if x is None else float(f"{x:.{digits}g}")


def json_safe(obj: Any, digits: int | None = None) -> Any:
    """``obj`` ready for strict JSON, recursively: every float :func:`finite` (or :func:`rounded` to
    ``digits``), dict keys as strings, tuples as lists; anything else unchanged."""
    if isinstance(obj, float):
        return finite(obj) if digits is None else rounded(obj, digits)
    if isinstance(obj, dict):
        return {str(k): json_safe(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v, digits) for v in obj]
    return obj


def to_json(obj: Any, *, indent: int | None = None, compact: bool = False) -> str:
    """Strict JSON text of :func:`json_safe` ``(obj)`` (``compact``: no spaces after separators)."""
    separators = (",", ":") if compact else None
    return json.dumps(json_safe(obj), indent=indent, separators=separators, allow_nan=False, ensure_ascii=False)
