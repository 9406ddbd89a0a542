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

from ...finite import to_json
from ...progress import Progress
from ..outputs import output_folder, replace_pair
from .collect import collect
from .render import render_html
from .sections import SCHEMA_VERSION, Report

REPORT_FILES = ("index.html", "report.json")

__all__ = ["SCHEMA_VERSION", "Report", "collect", "render_html", "write_report"]


def write_report(
    ckpt: Path | str,
    out: Path | str,
    *,
    progress: Progress | None = None,
    overwrite: bool = False,
    **options: Any,
) -> Report:
    """Analyse checkpoint ``ckpt`` and write ``out/index.html`` and ``out/report.json``.

    ``out`` is checked first (a folder that can be written, holding no ``index.html`` or
    ``report.json`` that qkov did not write, unless ``overwrite``), so a bad output location
    fails before the analysis. The two files are replaced as one pair when the analysis is done
    (:func:`~qkov.apps.outputs.replace_pair`: checked again at that moment; a kill leaves the
    previous report or the new one, never half of each). ``options`` go to :func:`collect`.
    Returns the report.
    """
    with output_folder(Path(out), REPORT_FILES, overwrite=overwrite, what="report") as folder:
        report = collect(ckpt, progress=progress, **options)
        files = {"index.html": render_html(report), "report.json": to_json(report.to_dict(), indent=1)}
        replace_pair(folder, files, overwrite=overwrite, what="report")
    return report
