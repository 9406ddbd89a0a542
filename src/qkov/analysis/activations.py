"""What one analysis forward returns: :class:`Trace`, the logits and the cached activations.

``out = trace(source, tokens, cache=["pattern.*", "resid_pre.*"])`` indexes like TransformerLens'
cache: ``out["pattern", 1]``, ``out["blocks.1.attn.hook_pattern"]``, ``out["z.0.3"]`` (head 3 of
``z.0``), ``out.stack("pattern")`` (every layer, ``[L, ...]``). The residual-stream decompositions
(:meth:`Trace.accumulated_resid`, :meth:`Trace.decompose_resid`, :meth:`Trace.stack_head_results`)
return a :class:`~qkov.analysis.decompose.Stack` that projects itself onto a direction or a
logit difference.

:meth:`Trace.divisor` reads the normalisation divisor a reader used (what a frozen read needs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import Tensor

from ..errors import QkovError
from .decompose import Stack, accumulated, by_component, by_head
from .sites import BY_NAME, Address, Sites


@dataclass(repr=False)
class Trace:
    """One forward pass: ``tokens [B, T]``, ``logits [B, T, V]`` (``[B, P, V]`` when the run was
    asked for ``positions``) and ``cache``, the activations asked for by site name."""

    tokens: Tensor
    logits: Tensor
    cache: dict[str, Tensor] = field(default_factory=dict)
    source: Any = None
    positions: Tensor | None = None  # where the logits (and final sites) were computed; None: everywhere
    stacks: dict[str, Tensor] = field(default_factory=dict)  # kind -> [L, ...] when cached at every layer

    # ------------------------------------------------------------------ the cache
    def _sites(self) -> Sites:
        return Sites(self.source.cfg, self.source.norm)

    def address(self, key: Any) -> Address:
        found = self._sites().resolve(key)
        if len(found) != 1:
            kinds = sorted({a.kind for a in found})
            how = f"out[{kinds[0]!r}, layer] or out.stack({kinds[0]!r})" if len(kinds) == 1 else "stack()"
            raise QkovError(f"{key!r} names {len(found)} sites; index one at a time ({how})")
        return found[0]

    def __getitem__(self, key: Any) -> Tensor:
        a = self.address(key)
        name = Address(a.kind, a.layer).name
        if name not in self.cache:
            raise QkovError(f"{name} was not cached: trace(..., cache=[{name!r}]) (cached: {self._cached()})")
        value = self.cache[name]
        dim = BY_NAME[a.kind].head_dim
        return value if a.head is None or dim is None else value.select(dim, a.head)

    def _cached(self) -> str:
        names = list(self.cache)
        return ", ".join(names[:8]) + (" ..." if len(names) > 8 else "") if names else "nothing"

    def __contains__(self, key: Any) -> bool:
        try:
            a = self.address(key)
        except QkovError:
            return False
        return Address(a.kind, a.layer).name in self.cache

    def __iter__(self) -> Iterator[str]:
        return iter(self.cache)

    def __len__(self) -> int:
        return len(self.cache)

    def keys(self) -> list[str]:
        return list(self.cache)

    def items(self) -> list[tuple[str, Tensor]]:
        return list(self.cache.items())

    def __repr__(self) -> str:
        return f"Trace(tokens {list(self.tokens.shape)}, logits {list(self.logits.shape)}, cached: {self._cached()})"

    def stack(self, kind: str) -> Tensor:
        """A per-layer kind cached at every layer, stacked: ``[L, ...]`` (a view when the run kept it
        in one buffer)."""
        if kind in self.stacks:
            return self.stacks[kind]
        L = self.source.cfg.n_layers
        if L == 0:
            return self.logits.new_zeros(0, *self._sites().shape(kind, *self.tokens.shape))
        return torch.stack([self[(kind, l)] for l in range(L)])

    def select(self, index: Any) -> "Trace":
        """The run of some sequences only (``index`` along the batch: an int, slice or index tensor)."""
        pick = (lambda t: t[index : index + 1]) if isinstance(index, int) else (lambda t: t[index])  # noqa: E731
        cache = {name: pick(value) for name, value in self.cache.items()}
        return Trace(pick(self.tokens), pick(self.logits), cache, self.source, self.positions)

    def logits_at(self, positions: Tensor | list[int] | int) -> Tensor:
        """The logits at ``positions`` (absolute; negative from the end of the sequence), whether or not
        the run unembedded only some positions: ``[B, len(positions), V]`` (``[B, V]`` for an int)."""
        one = isinstance(positions, int)
        T = self.tokens.shape[1]
        want = positions.cpu() if isinstance(positions, Tensor) else torch.tensor([positions] if one else list(positions))
        want = torch.where(want < 0, want + T, want)
        if self.positions is None:
            out = self.logits[:, want.to(self.logits.device)]
        else:
            where = {int(p): i for i, p in enumerate(self.positions.tolist())}
            missing = [int(p) for p in want.tolist() if int(p) not in where]
            if missing:
                raise QkovError(f"the run computed logits at positions {sorted(where)} only, not {missing}")
            out = self.logits[:, [where[int(p)] for p in want.tolist()]]
        return out[:, 0] if one else out

    # ------------------------------------------------------------------ decompositions
    def accumulated_resid(self, layer: int | None = None, *, incl_mid: bool = False) -> Stack:
        """The residual stream as it accumulates: ``resid_pre`` of every layer before ``layer`` (all
        of them, then the final stream, for ``None``), with ``resid_mid`` too if ``incl_mid``.
        Needs those sites cached (``cache=["resid_pre.*", "resid_post.*"]``)."""
        return accumulated(self, layer, incl_mid)

    def decompose_resid(self, layer: int | None = None, *, mode: str = "all") -> Stack:
        """The stream entering ``layer`` (the final stream for ``None``) as the sum of what wrote it:
        the embedding, standard positions, each earlier layer's ``attn_out`` and ``mlp_out``
        (``mode``: ``all``, ``attn`` or ``mlp``). The components sum to the stream exactly."""
        return by_component(self, layer, mode)

    def stack_head_results(self, layer: int | None = None) -> Stack:
        """Every head's output (``head_out``, no ``b_O``) in the layers before ``layer`` (all for
        ``None``), one component per head labelled ``"layer.head"``."""
        return by_head(self, layer)

    # ------------------------------------------------------------------ normalisation divisors
    def divisor(self, reader: str, layer: int | None = None) -> Tensor | None:
        """The normalisation divisor the run used for ``reader`` (``attn_v``: the attention's value
        input, its ``attn_scale``; ``attn_qk``: its query/key input, ``qk_scale`` where shortformer
        positions give it one, else ``attn_scale``; ``mlp``: ``mlp_scale``; ``final``: ``final_scale``),
        ``[B, T, 1]``, of ``layer`` for the per-layer readers; ``None`` for a model without
        normalisation.

        Raises:
            QkovError: the run did not cache that divisor.
        """
        if self.source.norm == "none":
            return None
        kind = {"attn_v": "attn_scale", "attn_qk": "qk_scale", "mlp": "mlp_scale", "final": "final_scale"}.get(reader)
        if kind is None:
            raise QkovError(f"divisor: reader must be attn_v, attn_qk, mlp or final, got {reader!r}")
        if kind == "qk_scale" and all(k.name != "qk_scale" for k in self._sites().kinds):
            kind = "attn_scale"  # one input: the query/key input is the value input
        name = Address(kind, layer).name
        if name not in self.cache:
            raise QkovError(f"{name} was not cached: trace(..., cache=[{name!r}]) (cached: {self._cached()})")
        return self.cache[name]
