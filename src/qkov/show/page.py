"""The HTML every notebook display is made of: the report's stylesheet (scoped to the display),
its script and the plotly.js bundle, carried once per notebook, then one element per display
that the report's script draws into.

The first display of a kernel session carries the assets (plotly.js, ~4.6 MB, from the installed
``plotly`` package: nothing is fetched, so displays work offline and in an exported page); later
displays rely on them being on the page. After clearing that output, restart the kernel or show
:func:`qkov.show.init` to carry them again. Each display holds its plain-text form, which stays
visible where scripts do not run (an untrusted notebook, a static viewer).
"""

from __future__ import annotations

import html
import re
import uuid
from typing import Any

from ..apps.report.render import plotly_js, script_code, script_json, static

__all__ = ["assets", "MISSING", "mounted", "page", "reset", "SCOPE", "take_assets", "text_only"]

SCOPE = "qkov-nb"  # class of every display's root element; the report's CSS applies below it only
_state = {"sent": False}
MISSING = (
    "qkov's script is not on this page (the output that carried it was cleared): restart the kernel and "
    "run the notebook again, or show qkov.show.init() first."
)


def _scoped_css(css: str, scope: str = "." + SCOPE) -> str:
    """``css`` with every selector moved under ``scope`` (``:root``, ``html`` and ``body`` become
    ``scope`` itself), so that the report's page styles never restyle the notebook around them."""

    def one(sel: str) -> str:
        sel = sel.strip()
        if sel in (":root", "html", "body"):
            return scope
        return f"{scope} {sel}"

    def rule(m: re.Match[str]) -> str:
        return ", ".join(one(s) for s in m.group(1).split(",")) + " {" + m.group(2) + "}"

    return re.sub(r"([^{}]+?)\s*\{([^{}]*)\}", rule, css)


def assets() -> str:
    """The style and scripts every display needs (once per page). plotly.js is wrapped so that it
    defines ``window.Plotly`` also where an AMD loader is on the page (the classic notebook)."""
    bundle = "if (!window.Plotly) (function () { var define, module, exports;\n" + plotly_js() + "\n})();"
    css = _scoped_css(static("report.css")) + f"\n.{SCOPE} pre.qkov-text {{ font-size: 12px; }}"
    return (
        f'<style data-qkov="css">{css}</style>\n'
        f'<script data-qkov="plotly">{script_code(bundle)}</script>\n'
        f'<script data-qkov="report">{script_code(static("report.js"))}</script>\n'
    )


def take_assets(force: bool = False) -> str:
    """:func:`assets` the first time in this session (or after :func:`reset`, or ``force``), else ``""``."""
    if _state["sent"] and not force:
        return ""
    _state["sent"] = True
    return assets()


def reset() -> None:
    """The next display carries the assets again."""
    _state["sent"] = False


def _new_id() -> str:
    """A fresh element id: displays (and the viewer's controls) never clash on one page."""
    return "qkov-" + uuid.uuid4().hex[:12]


def mounted(section: str, data: dict[str, Any], text: str, *, title: str = "", opts: dict | None = None) -> str:
    """One display: an element holding ``text`` that the report's renderer ``section`` replaces
    with its drawing of ``data`` (the report JSON's keys the renderer reads)."""
    uid = _new_id()
    spec = {"section": section, "data": data, "title": title, "opts": opts or {}}
    script = (
        f'(function () {{ var root = document.getElementById("{uid}");'
        f' if (window.qkovReport) window.qkovReport.mount("{uid}");'
        f' else {{ root.dataset.rendered = "missing"; var p = document.createElement("p");'
        f" p.textContent = {script_json(MISSING)}; root.append(p); }} }})();"
    )
    return (
        f'<div class="{SCOPE}" id="{uid}"><pre class="qkov-text">{html.escape(text)}</pre></div>\n'
        f'<script type="application/json" id="{uid}-data">{script_json(spec)}</script>\n'
        f"<script>{script}</script>\n"
    )


def page(*parts: str) -> str:
    """Displays joined, led by the assets when this is the session's first."""
    return take_assets() + "".join(parts)


def text_only(text: str) -> str:
    """A display with nothing to draw: its text, in the display's style."""
    return f'<div class="{SCOPE}"><pre class="qkov-text">{html.escape(text)}</pre></div>'
