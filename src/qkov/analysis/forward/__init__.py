"""The analysis forward: one pass of the block body (:mod:`qkov.model.block`) over any weights
source, every activation through a named site that can be read or written.

Order inside: :mod:`.address` (:class:`Address`: a site, a head, an edge; the one head parser) <
:mod:`.sites` (the declarative table of site kinds) < :mod:`.edits`
(what a pass writes) < :mod:`.cache` (:class:`Trace`, what it recorded, and the residual stream
taken apart on it) < :mod:`.tracer` (:func:`trace`, the pass) < :mod:`.tiled_nll` (the next-token loss from
the final stream a tile of logits at a time, :func:`pass_nll`) and :mod:`.frozen` (a pass held at
another's patterns, divisors and MLP outputs: what the path expansion freezes) and :mod:`.lens`
(TransformerLens' ``run_with_cache`` / ``run_with_hooks`` on it).
"""

from __future__ import annotations

from .address import Address, as_head, HEAD, HeadLike, INPUTS, no_head, not_a_head, parse_heads
from .sites import BY_NAME, COPIES, Kind, KINDS, Sites, HEAD_INPUTS
from .edits import AT_ROWS, at_rows, Edit, EditFn, Edits, PER_POSITION, per_position, Site
from .cache import accumulated, by_component, by_head, final_stream, Stack, Trace
from .tracer import flops_per_token, trace
from .tiled_nll import pass_nll, tiled_nll
from .frozen import check_linear, frozen_edits, frozen_gate, frozen_sites, frozen_values, gated, head_terms, head_writes, read, sites_of
from .lens import (
    cached_sites,
    hook_edits,
    HookFn,
    HookPoint,
    NamesFilter,
    output,
    prepare,
    RETURN_TYPES,
    run_with_cache,
    run_with_hooks,
)

__all__ = [
    "Address",
    "as_head",
    "HEAD",
    "HeadLike",
    "INPUTS",
    "no_head",
    "not_a_head",
    "parse_heads",
    "BY_NAME",
    "Kind",
    "KINDS",
    "Sites",
    "HEAD_INPUTS",
    "COPIES",
    "Edit",
    "EditFn",
    "Edits",
    "PER_POSITION",
    "AT_ROWS",
    "at_rows",
    "per_position",
    "Site",
    "accumulated",
    "by_component",
    "by_head",
    "final_stream",
    "Stack",
    "Trace",
    "flops_per_token",
    "trace",
    "pass_nll",
    "tiled_nll",
    "check_linear",
    "frozen_edits",
    "frozen_gate",
    "frozen_sites",
    "frozen_values",
    "gated",
    "head_terms",
    "head_writes",
    "read",
    "sites_of",
    "cached_sites",
    "hook_edits",
    "HookFn",
    "HookPoint",
    "NamesFilter",
    "output",
    "prepare",
    "RETURN_TYPES",
    "run_with_cache",
    "run_with_hooks",
]
