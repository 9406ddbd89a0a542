"""``qkov report``: the paper's analysis of one checkpoint as an offline HTML page + JSON.

>>> from qkov.apps.report import write_report
>>> write_report("runs/qkov-2l", "runs/qkov-2l/report")   # doctest: +SKIP

writes ``index.html`` (self-contained: opens from disk, no network) and ``report.json``
(every number in the page). :func:`collect` computes the numbers into a :class:`Report`
(typed sections: :mod:`qkov.apps.report.sections`), :func:`render_html` draws them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...errors import QkovError
from ...io.atomic import atomic_write_text
from .collect import Progress, collect
from .render import render_html, to_json
from .sections import SCHEMA_VERSION, Report

__all__ = ["SCHEMA_VERSION", "Report", "collect", "render_html", "write_report"]


def write_report(ckpt: Path | str, out: Path | str, *, progress: Progress | None = None, **options: Any) -> Report:
    """Analyse checkpoint ``ckpt`` and write ``out/index.html`` and ``out/report.json``.

    Both files are written atomically (a crash leaves the previous report or none).
    ``options`` go to :func:`collect`. Returns the report.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise QkovError(f"report: {str(out)!r} exists and is not a directory")
    report = collect(ckpt, progress=progress, **options)
    page = render_html(report)
    try:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "report.json", to_json(report.to_dict(), indent=1))
        atomic_write_text(out / "index.html", page)
    except OSError as exc:
        raise QkovError(f"report: cannot write to {str(out)!r} ({exc.strerror})") from None
    return report
