"""Turn a :class:`~qkov.apps.report.sections.Report` into one self-contained HTML page.

The page carries its own copy of plotly.js (from the installed ``plotly`` package), its
CSS and script, and the report's numbers as embedded JSON: it opens from disk with no
network. Non-finite numbers become ``null`` so the JSON is strict.

Text inside a ``<script>`` element is not HTML-escaped, so two functions make it safe there:
:func:`script_json` for data (JSON that stays valid JSON for every input) and :func:`script_code`
for code (the page's scripts and the plotly bundle). Every qkov page embeds through them.
"""

from __future__ import annotations

import html
import re
from functools import lru_cache
from importlib import resources
from typing import Any

from ...errors import QkovError
from ...finite import to_json
from ...version import __version__
from .sections import Report

__all__ = ["plotly_js", "render_html", "render_template", "script_code", "script_json", "static"]


@lru_cache(maxsize=1)
def plotly_js() -> str:
    """The plotly.js bundle shipped inside the Python ``plotly`` package."""
    try:
        from plotly.offline import get_plotlyjs  # optional-looking heavy import: only when a page is drawn
    except ImportError:  # pragma: no cover - plotly is a core dependency
        raise QkovError("report: the 'plotly' package is missing (pip install plotly)") from None
    return get_plotlyjs()


def static(name: str, package: str = "qkov.apps.report") -> str:
    """The text of ``static/name`` in ``package`` (the report's by default); a name the package does not
    hold is read from the report's static folder, so another page can reuse the report's assets."""
    folder = resources.files(package).joinpath("static")
    if package != "qkov.apps.report" and not folder.joinpath(name).is_file():
        folder = resources.files("qkov.apps.report").joinpath("static")
    return folder.joinpath(name).read_text(encoding="utf-8")


# inside JSON text these characters occur only within strings, where \uXXXX stands for any of them
_JSON_ESCAPES = {ord(c): f"\\u{ord(c):04x}" for c in "<>&\u2028\u2029"}


def script_json(data: Any) -> str:
    """``data`` as strict JSON text that can sit verbatim inside any ``<script>`` element.

    ``<``, ``>``, ``&``, U+2028 and U+2029 are written as ``\\uXXXX`` escapes: the text holds no
    ``</script``, no ``<!--`` and no ``<script`` (nothing can end the element or change how HTML
    reads it), and ``JSON.parse`` (or ``json.loads``) of it gives back ``data`` for every input,
    strings of any content included. The text is also a valid JavaScript expression."""
    return to_json(data).translate(_JSON_ESCAPES)


_SCRIPT_BREAKERS = re.compile(r"<(?=/script|!--)", re.IGNORECASE)


def script_code(code: str) -> str:
    """JavaScript ``code`` that cannot end the ``<script>`` element it sits in.

    ``</script`` (any case) becomes ``<\\/script`` and ``<!--`` becomes ``<\\!--``; with no
    ``<!--`` the HTML parser never enters the state in which a later ``<script`` keeps the element
    open. Inside a string, template or regular-expression literal the added backslash leaves the
    value as it was, and that is where such text sits in qkov's scripts and the plotly bundle, if at
    all (code using ``<!--`` as a comment, or in a regular expression with the ``u`` flag, would
    have to be written otherwise). Data goes through :func:`script_json` instead."""
    return _SCRIPT_BREAKERS.sub(lambda m: "<\\", code)


def render_template(
    template: str,
    data: dict[str, Any],
    scripts: tuple[str, ...],
    title: str,
    *,
    package: str = "qkov.apps.report",
    styles: tuple[str, ...] = ("report.css",),
    nonce: str | None = None,
) -> str:
    """A self-contained page: the static ``template`` with the report's CSS, plotly.js, ``data`` as
    embedded JSON (:func:`script_json`, read by the page's script with ``JSON.parse``) and the
    static ``scripts`` (in order, :func:`script_code`) filled in.

    ``package``: whose ``static`` folder the template, scripts and ``styles`` are read from first (then
    the report's, :func:`static`); ``nonce``: put as ``nonce="..."`` on the template's own ``<script>``
    and ``<style>`` tags, for a page served with a Content-Security-Policy that names it."""
    parts = {
        "CSS": "\n".join(static(name, package) for name in styles),
        "DATA": script_json(data),
        "JS": script_code("\n".join(static(name, package) for name in scripts)),
        "TITLE": html.escape(title),
        "VERSION": html.escape(__version__),
        "PLOTLY": script_code(plotly_js()),
    }
    # one pass over the template, so nothing inserted is ever scanned for placeholders
    page = static(template, package)
    if nonce is not None:  # the template's tags only, before anything is inserted
        if not re.fullmatch(r"[A-Za-z0-9+/=_-]+", nonce):
            raise QkovError(f"a nonce is base64 text, got {nonce!r}")
        page = re.sub(r"<(script|style)(?=[\s>])", lambda m: f'<{m.group(1)} nonce="{nonce}"', page)
    return re.sub(r"__(CSS|DATA|JS|TITLE|VERSION|PLOTLY)__", lambda m: parts[m.group(1)], page)


def render_html(report: Report, *, title: str | None = None) -> str:
    """The report page for ``report`` (one string of HTML, self-contained)."""
    return render_template("template.html", report.to_dict(), ("report.js",), title or f"qkov report: {report.name}")

