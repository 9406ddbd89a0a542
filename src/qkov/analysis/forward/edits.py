"""Edits: what ``trace(..., edits={site: value})`` writes into the forward, resolved against a model's
sites (:mod:`qkov.analysis.forward.sites`) before any work.

An edit's value is either a tensor, which replaces the site's value (it must broadcast to the
site's shape: ``[1, T, D]`` for every sequence of a batch, ``[D]`` for every position...), or a
function ``fn(value, site) -> tensor | None`` called with the site's value and its
:class:`~qkov.analysis.forward.sites.Address` (TransformerLens hook functions, ``fn(activation, hook)``,
have this form): it returns the new value, of the same shape, or ``None`` after editing ``value``
in place. A head's address (``"z.0.3"``) edits that head's slice only. Several edits of one site
apply in the order given. The value an edit returns is what flows on and what a cache records.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Union

import torch
from torch import Tensor

from ...errors import QkovError
from .sites import BY_NAME, Address, Sites

__all__ = ["AT_ROWS", "at_rows", "Edit", "EditFn", "Edits", "PER_POSITION", "per_position", "Site"]

EditFn = Callable[[Tensor, Address], Union[Tensor, None]]

PER_POSITION = "qkov_per_position"  # the attribute that marks an edit function as acting on each position alone
AT_ROWS = "qkov_at_rows"  # the attribute that marks an edit function as taking a last-layer site at the pass's positions


def per_position(edit: Callable[[Tensor, Any], Tensor]) -> Callable[[Tensor, Any], Tensor]:
    """Mark the function ``edit`` (of a ``z`` site) as acting on each position alone: its output at a
    position depends on the inputs at that position only, not on the others or on how many there
    are. The last layer of a pass asked for a few positions then still runs at those only with it
    (:func:`~qkov.analysis.forward.tracer.trace`). The ablations of every position
    (:func:`~qkov.analysis.causal.ablation.ablation_edits`) are marked."""
    setattr(edit, PER_POSITION, True)
    return edit


def at_rows(edit: Callable[[Tensor, Any], Tensor]) -> Callable[[Tensor, Any], Tensor]:
    """Mark the function ``edit`` (of a last-layer ``q``, ``z``, ``mlp_input``, ``mlp_out`` or ``resid_post``
    site) as taking that site at the pass's logit ``positions`` alone: in a pass asked for a few positions
    its value then holds those positions only, in the order given and taken modulo the sequence length
    (``[B, P, ...]`` instead of ``[B, T, ...]``), and the last layer still runs at those positions only
    (:func:`~qkov.analysis.forward.tracer.trace`). The function tells the two apart by the value's length."""
    setattr(edit, AT_ROWS, True)
    return edit


Edit = Union[Tensor, EditFn]
Site = tuple[str, Union[int, None]]


class Edits:
    """Edits by site, checked against the model's sites; applied by the forward at each site."""

    def __init__(self, sites: Sites, edits: Mapping[Any, Edit] | None, *, device: Any, dtype: torch.dtype) -> None:
        self.by_site: dict[Site, list[tuple[Address, Edit]]] = {}
        self.sites, self.device, self.dtype = sites, device, dtype
        self.update(edits)

    def update(self, edits: Mapping[Any, Edit] | None) -> None:
        """Add ``{key: edit}`` (keys resolved to sites; a glob edits every site it names)."""
        for key, value in (edits or {}).items():
            if not (isinstance(value, Tensor) or callable(value)):
                raise QkovError(f"edit of {key!r}: give a tensor or a function (value, site) -> tensor")
            for address in self.sites.resolve(key):
                self.add(address, value)

    def add(self, address: Address, value: Edit) -> None:
        """One more edit at ``address`` (after those already there)."""
        if isinstance(value, Tensor):
            value = value.to(device=self.device, dtype=self.dtype) if value.is_floating_point() else value
        self.by_site.setdefault(address.site, []).append((address, value))

    def __contains__(self, site: Site) -> bool:
        return site in self.by_site

    def fixed(self, site: Site) -> Tensor | None:
        """The tensor that replaces the whole site when that is its only edit (the forward can then
        skip computing what only this site needs), else ``None``."""
        edits = self.by_site.get(site)
        if edits and len(edits) == 1 and edits[0][0].head is None and isinstance(edits[0][1], Tensor):
            return edits[0][1]
        return None

    def check_shapes(self, batch: int, seq: int) -> None:
        """Refuse, before any work, a tensor edit that does not broadcast to its site's shape on
        ``batch`` sequences of ``seq`` tokens (the forward may use such a value without computing the
        site, so the check cannot wait for it)."""
        for address, value in (e for edits in self.by_site.values() for e in edits):
            if not isinstance(value, Tensor):
                continue
            shape = list(self.sites.shape(address.kind, batch, seq, address.layer))
            if address.head is not None:
                del shape[BY_NAME[address.kind].head_dim]  # type: ignore[arg-type]
            if not _broadcasts(value.shape, torch.Size(shape)):
                raise QkovError(
                    f"edit of {address.name}: expected a tensor of shape {shape} (or one that broadcasts to it), "
                    f"got {list(value.shape)}"
                )

    def apply(self, site: Site, value: Tensor) -> Tensor:
        """``value`` after every edit of ``site``."""
        for address, edit in self.by_site.get(site, ()):
            if address.head is None:
                value = _one(address, edit, value)
            else:
                dim = BY_NAME[address.kind].head_dim
                assert dim is not None
                new = _one(address, edit, value.select(dim, address.head))
                value = value.clone()
                value.select(dim, address.head).copy_(new)
        return value


def _one(address: Address, edit: Edit, value: Tensor) -> Tensor:
    """One edit of ``value`` (a whole site or one head's slice of it)."""
    if isinstance(edit, Tensor):
        if _broadcasts(edit.shape, value.shape):
            return edit.expand(value.shape)
        raise QkovError(
            f"edit of {address.name}: expected a tensor of shape {list(value.shape)} (or one that broadcasts "
            f"to it), got {list(edit.shape)}"
        )
    out = edit(value, address)
    if out is None:
        return value
    if not isinstance(out, Tensor):
        raise QkovError(f"edit of {address.name}: the function returned {type(out).__name__}, not a tensor or None")
    if out.shape != value.shape:
        raise QkovError(
            f"edit of {address.name}: the function returned shape {list(out.shape)}; the site has {list(value.shape)}"
        )
    return out


def _broadcasts(given: torch.Size, to: torch.Size) -> bool:
    try:
        return torch.broadcast_shapes(given, to) == to
    except RuntimeError:
        return False
