"""What :func:`~qkov.analysis.paths.term_effects` returns: one :class:`TermEffect` per removed term,
gathered in :class:`TermEffects` (a dataclass with ``to_dict()``; before qkov 1.0 a bare pair of lists,
which it still unpacks as, with a :class:`DeprecationWarning`, until 1.1)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Iterator

from .shown import Shown


@dataclass
class TermEffect:
    name: str  # "0.3" or "0.3->1.2"
    loss_change: float  # loss without the term minus the full loss (nats; positive = the term helps)
    size: float  # RMS of the term's logits

    def to_dict(self) -> dict[str, Any]:
        return vars(self).copy()


@dataclass(repr=False)
class TermEffects(Shown):
    """Every single-head term and the largest virtual-head terms, each by loss change (largest first);
    its text form is registered by :mod:`qkov.analysis.reprs`."""

    singles: list[TermEffect]
    virtual: list[TermEffect]

    def to_dict(self) -> dict[str, Any]:
        singles, virtual = [e.to_dict() for e in self.singles], [e.to_dict() for e in self.virtual]
        return {"single_head_terms": singles, "virtual_head_terms": virtual}

    def __iter__(self) -> Iterator[list[TermEffect]]:
        """``singles, virtual = term_effects(...)``, the pre-1.0 form (deprecated)."""
        warnings.warn(
            "unpacking term_effects(...) as a pair is deprecated: read .singles and .virtual "
            "(the pair is accepted until qkov 1.1)",
            DeprecationWarning,
            stacklevel=2,
        )
        return iter((self.singles, self.virtual))
