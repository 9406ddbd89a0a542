"""What one analysis forward records, and the residual stream taken apart on it.

:class:`Trace` holds the logits and the cached activations:
``out = trace(source, tokens, cache=["pattern.*", "resid_pre.*"])`` indexes like TransformerLens'
cache: ``out["pattern", 1]``, ``out["blocks.1.attn.hook_pattern"]``, ``out["z.0.3"]`` (head 3 of
``z.0``), ``out.stack("pattern")`` (every layer, ``[L, ...]``); :meth:`Trace.divisor` reads the
normalisation divisor a reader used (what a frozen read needs).

Its decompositions (:meth:`Trace.accumulated_resid`, :meth:`Trace.decompose_resid`,
:meth:`Trace.stack_head_results`) take the stream apart by layer, by component (embedding, positions,
each layer's attention and MLP output) or by head, as a :class:`Stack`: components ``[C, B, T, D]`` of
the stream at one place, the input of layer ``layer``'s attention or the final stream (``layer=None``).
:meth:`Stack.apply_ln` reads every component through that place's normalisation with the recording's
divisor frozen, which is linear, so normalised components still add up to the normalised stream;
:meth:`Stack.logit_attrs` then gives each component's share of a logit or logit difference (they sum
to the logit minus ``b_U``: direct logit attribution).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any
from dataclasses import field
from typing import Iterator

import torch
from torch import Tensor

from ...errors import QkovError
from ...model.bus import require_sum_residual
from ...model.ops import normalize
from .sites import BY_NAME, Address, Sites

__all__ = ["accumulated", "by_component", "by_head", "final_stream", "Stack", "Trace"]


@dataclass
class Stack:
    """Stream components ``values [C, B, T, D]`` with one label each, read at ``layer``'s attention
    input (``None``: the final stream); ``normalized`` once :meth:`apply_ln` has run."""

    values: Tensor
    labels: list[str]
    recording: "Trace"
    layer: int | None
    normalized: bool = False

    def __len__(self) -> int:
        return len(self.labels)

    def __repr__(self) -> str:
        at = "the final stream" if self.layer is None else f"layer {self.layer}'s input"
        return f"Stack({len(self)} components of {at}: {', '.join(self.labels[:6])}{' ...' if len(self) > 6 else ''})"

    def total(self) -> Tensor:
        """The sum of the components ``[B, T, D]``."""
        return self.values.sum(0)

    def apply_ln(self) -> "Stack":
        """Every component through the normalisation at this place, its divisor frozen at the recording's
        (``attn_scale`` of the layer, or ``final_scale``): centred and divided (LayerNorm folded) or
        divided (RMS). Needs a view with the normalisation folded (``fold_ln=True``, the default)."""
        src = self.recording.source
        if self.normalized or src.norm == "none":
            return replace(self, normalized=True)
        if src.norm not in ("folded", "scale"):
            raise QkovError("apply_ln needs a weights view with the normalisation folded (fold_ln=True)")
        name = "final_scale" if self.layer is None else f"attn_scale.{self.layer}"
        if name not in self.recording.cache:
            raise QkovError(f"apply_ln needs {name} cached: trace(..., cache=[{name!r}, ...])")
        scale = self.recording.cache[name]
        if scale.shape[1] != self.values.shape[2]:
            raise QkovError("apply_ln at the final stream needs a recording with logits at every position")
        return replace(self, values=normalize(self.values, src.norm, 0.0, scale=scale)[0], normalized=True)

    def project(self, direction: Tensor) -> Tensor:
        """Each component's dot product with ``direction`` (``[D]``, or per sequence / position,
        broadcasting to ``[B, T, D]``): ``[C, B, T]``."""
        direction = direction.to(self.values)
        if direction.shape[-1] != self.values.shape[-1]:
            raise QkovError(f"project: a direction has {self.values.shape[-1]} entries (d_model), got {direction.shape[-1]}")
        return (self.values * direction).sum(-1)

    def logit_attrs(self, tokens: Any, incorrect: Any = None, *, pos_slice: Any = None) -> Tensor:
        """Each component's direct contribution to the logit of ``tokens`` (minus that of ``incorrect``,
        for a logit difference) at the positions ``pos_slice`` picks (TransformerLens' ``pos_slice``):

        * ``None``: every position, ``[C, B, T]``;
        * an int (``-1``: the last position): that position, ``[C, B]``;
        * a ``slice``, a ``(start, stop[, step])`` tuple (``slice(*tuple)``, as TransformerLens reads it),
          a list or a 1-D tensor of positions: those, in that order, ``[C, B, P]``.

        ``tokens`` (and ``incorrect``): an id, ``[B]`` (one per sequence, at every position picked) or
        ``[B, P]`` (one per position picked). The logit a position *predicts* is that of the next token:
        ``logit_attrs(tokens[:, 1:], pos_slice=slice(0, -1))`` credits each position with its next token,
        ``logit_attrs(answer, pos_slice=-1)`` the last position with ``answer [B]``. Components read at the
        final stream are normalised first (:meth:`apply_ln`); summed over components they give
        ``logits[..., token] - b_U[token]`` at those positions (tested)."""
        stack = self.apply_ln() if self.layer is None and not self.normalized else self
        values = _at_positions(stack.values, pos_slice)  # [C, B, P, D] or [C, B, D]
        W_U = self.recording.source.unembed().W_U  # [D, V]
        batch_pos = values.shape[1:3] if values.ndim == 4 else values.shape[1:2]
        direction = _directions(W_U, tokens, batch_pos)
        if incorrect is not None:
            direction = direction - _directions(W_U, incorrect, batch_pos)
        return (values * direction.to(values)).sum(-1)


def _at_positions(values: Tensor, pos_slice: Any) -> Tensor:
    """``values [C, B, T, D]`` at the positions ``pos_slice`` picks (see :meth:`Stack.logit_attrs`):
    ``[C, B, D]`` for an int, ``[C, B, P, D]`` otherwise."""
    T = values.shape[2]
    if pos_slice is None:
        return values
    if isinstance(pos_slice, int) and not isinstance(pos_slice, bool):
        if not -T <= pos_slice < T:
            raise QkovError(f"logit_attrs: pos_slice {pos_slice} is outside the {T} positions")
        return values[:, :, pos_slice]
    if isinstance(pos_slice, tuple):
        pos_slice = slice(*pos_slice)
    if isinstance(pos_slice, slice):
        picked = torch.arange(T)[pos_slice]
    else:
        try:
            picked = torch.as_tensor(pos_slice)
        except (TypeError, ValueError):
            picked = torch.zeros(0, 0)
        if picked.ndim != 1 or picked.dtype.is_floating_point or picked.dtype == torch.bool:
            raise QkovError(
                f"logit_attrs: pos_slice must be None, an int, a slice, a tuple or a list of ints; got {pos_slice!r}"
            )
        if bool(((picked < -T) | (picked >= T)).any()):
            raise QkovError(f"logit_attrs: pos_slice {picked.tolist()} reaches outside the {T} positions")
    if len(picked) == 0:
        raise QkovError(f"logit_attrs: pos_slice {pos_slice!r} picks no position of {T}")
    return values[:, :, picked.to(values.device) % T]


def _directions(W_U: Tensor, tokens: Any, batch_pos: torch.Size) -> Tensor:
    """Unembedding columns of ``tokens`` shaped to broadcast over ``[B, P, D]`` (or ``[B, D]`` when
    ``batch_pos`` is ``[B]``: one position picked)."""
    t = torch.as_tensor(tokens, device=W_U.device)
    per_pos = t.ndim == 2 and len(batch_pos) == 2 and t.shape[1] == batch_pos[1]
    if t.ndim > 2 or (t.ndim >= 1 and t.shape[0] != batch_pos[0]) or (t.ndim == 2 and not per_pos):
        want = "one id or [batch]" if len(batch_pos) == 1 else "one id, [batch] or [batch, positions]"
        raise QkovError(f"logit_attrs: tokens must be {want} (batch {batch_pos[0]}, positions picked "
                        f"{batch_pos[1] if len(batch_pos) == 2 else 1}); got {list(t.shape)}")
    if bool(((t < 0) | (t >= W_U.shape[1])).any()):
        raise QkovError(f"logit_attrs: token ids must be in 0..{W_U.shape[1] - 1}")
    cols = W_U[:, t].movedim(0, -1)  # [..., D]
    return cols[:, None] if t.ndim == 1 and len(batch_pos) == 2 else cols


def _need(recording: "Trace", names: list[str], what: str) -> None:
    """A one-line error naming every site ``what`` reads that the recording did not cache."""
    missing = [n for n in names if n not in recording.cache]
    if missing:
        raise QkovError(f"{what} reads {', '.join(names)}: trace(..., cache={missing!r}) to cache the missing ones")


def final_stream(recording: "Trace") -> Tensor:
    """The recording's final residual stream (before the final normalisation): ``resid_post`` of the last
    layer, or the embedding (plus standard positions) of a 0-layer model; a routed model's final read,
    ``resid_final`` (:mod:`qkov.model.bus`)."""
    if recording.source.cfg.residual != "sum":
        return recording["resid_final"]
    L = recording.source.cfg.n_layers
    if L:
        return recording["resid_post", L - 1]
    x = recording["embed"]
    return x + recording["pos"] if recording.source.cfg.positional == "standard" else x


def _upto(recording: "Trace", layer: int | None) -> int:
    L = recording.source.cfg.n_layers
    if layer is not None and not 0 <= layer <= L:
        raise QkovError(f"layer {layer}: the model has {L} layers (0..{L - 1}, or {L} for the final stream)")
    return L if layer is None else layer


def accumulated(recording: "Trace", layer: int | None, incl_mid: bool) -> Stack:
    """``resid_pre`` of layers ``0 .. layer`` (with ``resid_mid`` of those before it when ``incl_mid``);
    for ``None`` every layer's and then the final stream, labelled ``"0_pre"``, ``"0_mid"``, ``"final"``."""
    require_sum_residual(recording.source.cfg, "accumulated_resid")
    upto = _upto(recording, layer)
    L = recording.source.cfg.n_layers
    mid = incl_mid and recording.source.cfg.d_mlp is not None and not recording.source.cfg.parallel
    names = [f"resid_pre.{l}" for l in range(min(upto + 1, L))] + [f"resid_mid.{l}" for l in range(upto) if mid]
    _need(recording, names + ([f"resid_post.{L - 1}"] if upto == L and L else []), "accumulated_resid")
    parts, labels = [], []
    for l in range(min(upto + 1, L)):
        parts.append(recording["resid_pre", l])
        labels.append(f"{l}_pre")
        if mid and l < upto:
            parts.append(recording["resid_mid", l])
            labels.append(f"{l}_mid")
    if upto == L:
        parts.append(final_stream(recording))
        labels.append("final")
    return Stack(torch.stack(parts), labels, recording, None if upto == L else upto)


def by_component(recording: "Trace", layer: int | None, mode: str) -> Stack:
    """The stream entering ``layer`` as embedding, positions and each earlier layer's outputs."""
    require_sum_residual(recording.source.cfg, "decompose_resid")
    if mode not in ("all", "attn", "mlp"):
        raise QkovError(f"decompose_resid: mode must be all, attn or mlp, got {mode!r}")
    upto, cfg = _upto(recording, layer), recording.source.cfg
    writers = ["attn_out"] * (mode != "mlp") + ["mlp_out"] * (mode != "attn" and cfg.d_mlp is not None)
    names = ["embed"] + ["pos"] * (cfg.positional == "standard") + [f"{k}.{l}" for l in range(upto) for k in writers]
    _need(recording, names, "decompose_resid")
    parts, labels = [recording["embed"]], ["embed"]
    if cfg.positional == "standard":
        parts.append(recording["pos"])
        labels.append("pos")
    for l in range(upto):
        if mode in ("all", "attn"):
            parts.append(recording["attn_out", l])
            labels.append(f"{l}_attn_out")
        if mode in ("all", "mlp") and cfg.d_mlp is not None:
            parts.append(recording["mlp_out", l])
            labels.append(f"{l}_mlp_out")
    return Stack(torch.stack(parts), labels, recording, None if upto == cfg.n_layers else upto)


def by_head(recording: "Trace", layer: int | None) -> Stack:
    """Every head's output in the layers before ``layer``, one component per head."""
    require_sum_residual(recording.source.cfg, "stack_head_results")
    upto, cfg = _upto(recording, layer), recording.source.cfg
    if upto == 0:
        raise QkovError("stack_head_results: no heads before layer 0")
    _need(recording, [f"head_out.{l}" for l in range(upto)], "stack_head_results")
    outs = torch.cat([recording["head_out", l].permute(2, 0, 1, 3) for l in range(upto)])  # [upto * H, B, T, D]
    labels = [f"{l}.{h}" for l in range(upto) for h in range(cfg.n_heads)]
    return Stack(outs, labels, recording, None if upto == cfg.n_layers else upto)


@dataclass(repr=False)
class Trace:
    """One forward pass: ``tokens [B, T]``, ``logits [B, T, V]`` (``[B, P, V]`` when the recording was
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
        """A per-layer kind cached at every layer, stacked: ``[L, ...]`` (a view when the recording kept it
        in one buffer)."""
        if kind in self.stacks:
            return self.stacks[kind]
        L = self.source.cfg.n_layers
        if L == 0:
            return self.logits.new_zeros(0, *self._sites().shape(kind, *self.tokens.shape))
        return torch.stack([self[(kind, l)] for l in range(L)])

    def select(self, index: Any) -> "Trace":
        """The recording of some sequences only (``index`` along the batch: an int, slice or index tensor)."""
        pick = (lambda t: t[index : index + 1]) if isinstance(index, int) else (lambda t: t[index])  # noqa: E731
        cache = {name: pick(value) for name, value in self.cache.items()}
        return Trace(pick(self.tokens), pick(self.logits), cache, self.source, self.positions)

    def logits_at(self, positions: Tensor | list[int] | int) -> Tensor:
        """The logits at ``positions`` (absolute; negative from the end of the sequence), whether or not
        the recording unembedded only some positions: ``[B, len(positions), V]`` (``[B, V]`` for an int)."""
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
                raise QkovError(f"the recording computed logits at positions {sorted(where)} only, not {missing}")
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
        """The normalisation divisor the recording used for ``reader`` (``attn_v``: the attention's value
        input, its ``attn_scale``; ``attn_qk``: its query/key input, ``qk_scale`` where shortformer
        positions give it one, else ``attn_scale``; ``mlp``: ``mlp_scale``; ``final``: ``final_scale``),
        ``[B, T, 1]``, of ``layer`` for the per-layer readers; ``None`` for a model without
        normalisation.

        Raises:
            QkovError: the recording did not cache that divisor.
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
