"""qkov in a notebook: rich displays of analysis results and the report's attention viewer.

>>> import qkov
>>> model = qkov.load("runs/qkov-2l")                       # doctest: +SKIP
>>> qkov.show.attention(model, "def f(self):\\n    return self", layer=1, head=2)   # doctest: +SKIP

Every result of :mod:`qkov.analysis` that a user holds (a head report, composition and copying
scores, top-k entries, skip-trigrams, a path summary, the induction probe) shows itself as the
report's drawing of it when it is the last expression of a cell (``_repr_html_``), and as a short
table when printed (``repr``). Drawings use the report's own script, stylesheet and plotly.js,
carried once per notebook (:mod:`qkov.show.page`): no network, and an exported notebook
(``jupyter nbconvert --to html``) keeps them working.
"""

from __future__ import annotations

from . import displays as displays  # registers the results' HTML forms
from . import study_displays as study_displays  # ... and those of the studies (dynamics, ablation)
from . import discovery_displays as discovery_displays  # ... and circuit discovery's
from .page import take_assets
from .viewer import AttentionView, attention

__all__ = ["AttentionView", "attention", "init"]


class _Assets:
    """What :func:`init` returns: carries the assets when displayed."""

    def _repr_html_(self) -> str:
        return take_assets(force=True)

    def __repr__(self) -> str:
        return "qkov.show assets (the report's style and scripts, for the displays below)"


def init() -> _Assets:
    """Carry qkov's style and scripts again: display the result (the last expression of a cell)
    when the output that carried them was cleared in this kernel session."""
    return _Assets()
