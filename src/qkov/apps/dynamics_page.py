"""The ``qkov dynamics`` page: one self-contained HTML file drawn from the result's JSON.

The same stack as the report (:mod:`qkov.apps.report.render`): plotly.js from the installed
package, the report's CSS, a script that draws each section from the embedded JSON and marks it
``data-rendered="ok"`` (or shows its error), no network.
"""

from __future__ import annotations

import html
import re
from typing import Any

from ..version import __version__
from .report.render import _script_safe, _static, plotly_js, to_json


def render_dynamics(result: dict[str, Any], *, title: str | None = None) -> str:
    """The page of a :func:`qkov.apps.dynamics.dynamics` result (one string of HTML)."""
    title = title or f"qkov dynamics: {result.get('description', '')}"
    parts = {
        "CSS": _static("report.css"),
        "DATA": _script_safe(to_json(result)),
        "JS": _script_safe(_static("dynamics.js")),
        "TITLE": html.escape(title),
        "VERSION": html.escape(__version__),
        "PLOTLY": _script_safe(plotly_js()),
    }
    page = _static("dynamics.html")
    return re.sub(r"__(CSS|DATA|JS|TITLE|VERSION|PLOTLY)__", lambda m: parts[m.group(1)], page)
