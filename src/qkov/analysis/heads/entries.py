"""Attention at a few (query, key) entries without the pattern.

A score that reads a handful of entries per query (the previous-token score reads ``A[i, i-1]``, the
induction score the entry after a token's previous occurrence) needs none of the ``[B, H, T, T]``
pattern: entry ``(i, j)`` is ``exp(q_i . k_j / sqrt(d_head) - lse_i)``, where ``lse_i`` is the
log-sum-exp of query ``i``'s scores, which the fused attention kernel computes on its way (the
``lse`` site of :func:`~qkov.analysis.forward.tracer.trace`). :func:`attention_entries` forms the
entries from a layer's ``q``, ``k`` and ``lse``; :class:`EntryWatch` hands them on as the forward
computes each layer, keeping nothing (edits that observe and change nothing, as
:class:`~qkov.analysis.heads.pattern_scores.LayerWatch` does for whole patterns).

The entries equal the pattern's to float rounding: the kernel's ``lse`` is accumulated blockwise in
the working precision, so in float32 an entry differs from the softmax's by a few parts in 10^6 of
itself at most (the scores' size times float32's epsilon, through ``exp``); in float64 by ~1e-15.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import Tensor

from ...model.ops import expand_kv, score_divisor
from ..forward.sites import Address

__all__ = ["attention_entries", "edits_attention", "EntryWatch"]


def attention_entries(q: Tensor, k: Tensor, lse: Tensor, queries: Tensor, keys: Tensor) -> Tensor:
    """The attention pattern at the entries ``(queries[n], keys[n])``, ``[B, H, N]``, from one layer's
    queries ``q [B, T, H, E]``, keys ``k [B, T, K, E]`` (the ``q`` and ``k`` sites' layouts, grouped-query
    keys shared as the forward shares them) and log-sum-exps ``lse [B, H, T]``; ``queries``, ``keys``
    ``[N]`` positions. An entry whose key comes after its query is 0, as in the pattern. Computed in
    ``lse``'s precision (float32 or wider)."""
    group = q.shape[2] // k.shape[2]
    wide = lse.dtype
    qs = _at(q, 1, queries).to(wide)  # [B, N, H, E]
    ks = expand_kv(_at(k, 1, keys), group, dim=2).to(wide)  # [B, N, H, E]
    scores = (qs * ks).sum(-1) / score_divisor(q.shape[-1])  # [B, N, H]
    out = (scores.transpose(1, 2) - _at(lse, 2, queries)).exp()  # [B, H, N]
    return out.masked_fill((keys > queries).to(out.device), 0.0)


def _at(x: Tensor, dim: int, positions: Tensor) -> Tensor:
    """``x`` at ``positions`` along ``dim``: a view when they are consecutive (the previous-token
    entries' ``1 .. T-1`` and ``0 .. T-2``), else a gathered copy."""
    n = len(positions)
    if n > 1 and bool((positions.diff() == 1).all()):
        return x.narrow(dim, int(positions[0]), n)
    return x.index_select(dim, positions.to(x.device))


class EntryWatch:
    """Edits that hand each layer's attention at the entries ``(queries[n], keys[n])`` to
    ``callback(layer, entries [B, H, N])`` as the forward computes that layer, and change nothing: they
    observe the layer's ``q`` and ``k`` and, at its ``lse``, form the entries (:func:`attention_entries`)
    and drop what they kept. No pattern is formed: with nothing else asking for the scores or the
    pattern, the attention runs fused."""

    def __init__(self, n_layers: int, queries: Tensor, keys: Tensor, callback: Callable[[int, Tensor], None]) -> None:
        self.n_layers, self.queries, self.keys, self.callback = n_layers, queries, keys, callback
        self.seen: dict[str, Tensor] = {}

    def keep(self, value: Tensor, site: Address) -> None:
        self.seen[site.kind] = value

    def lse(self, value: Tensor, site: Address) -> None:
        q, k = self.seen.pop("q"), self.seen.pop("k")
        queries, keys = self.queries.to(value.device), self.keys.to(value.device)
        self.callback(site.layer, attention_entries(q, k, value, queries, keys))  # type: ignore[arg-type]

    def edits(self) -> dict[Any, Any]:
        """``{site: observer}`` for :func:`~qkov.analysis.forward.tracer.trace`'s ``edits``: one address per
        layer, so they join a caller's string- or tuple-keyed edits without replacing them; put them
        after those (``{**theirs, **watch.edits()}``) so they observe the edited values."""
        out: dict[Any, Any] = {}
        for l in range(self.n_layers):
            out |= {Address("q", l): self.keep, Address("k", l): self.keep, Address("lse", l): self.lse}
        return out


def edits_attention(sites: Any, edits: Any) -> bool:
    """Whether ``edits`` (site keys as ``trace`` takes them, resolved by ``sites``, a
    :class:`~qkov.analysis.forward.sites.Sites`) write the scores, their log-sum-exp or the pattern: the
    entries :class:`EntryWatch` forms from ``q``, ``k`` and ``lse`` would then not be the pattern the
    edited pass attends with, and a caller reads the pattern instead. (Edits of ``q`` or ``k``, and of
    anything before them, are seen by the watch as the kernel sees them, when its edits come after.)"""
    return any(a.kind in ("scores", "lse", "pattern") for key in (edits or {}) for a in sites.resolve(key))
