"""The ``qkov dynamics`` page: one self-contained HTML file drawn from the result's JSON.

The same stack as the report (:func:`qkov.apps.report.render.render_template`): plotly.js from the
installed package, the report's CSS and its script library (``window.qkovReport``, whose helpers
the page's own script uses), no network. Each section is marked ``data-rendered="ok"`` or shows
its error.
"""

from __future__ import annotations

from typing import Any

from ..report.render import render_template

__all__ = ["render_dynamics"]


def render_dynamics(result: dict[str, Any], *, title: str | None = None) -> str:
    """The page of a :func:`qkov.apps.dynamics.study.dynamics` result (one string of HTML)."""
    title = title or f"qkov dynamics: {result.get('description', '')}"
    return render_template("dynamics.html", result, ("report.js", "dynamics.js"), title)
