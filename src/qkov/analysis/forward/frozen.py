"""A recording frozen: what the path expansion holds fixed, and a reader's view of one stream term under it.

[F]'s expansion writes the logits as a sum of paths once the attention patterns, the normalisation
divisors and the MLP outputs of a real forward pass are held at their values: the logits are then
linear in each stream term. Three pieces serve every analysis that does so (paths, term importance,
term effects, virtual heads, the QK split):

* :func:`frozen_sites` — the sites a recording must cache to be frozen (``pattern``, the normalisation
  divisors ``attn_scale``/``qk_scale``/``mlp_scale``/``final_scale``, ``mlp_out``, a gated model's
  attention ``gate``; a routed model's routing, ``route_*``, ``mix_*``, ``write_*``), and
  :func:`frozen_edits` — the edits that hold another pass of the same tokens at those values;
* :func:`read` — a reader's linear view of a stream term with the divisor frozen;
* :func:`frozen_values` — what a layer's heads read as values from one stream term, ``[B, h, T, E]``:
  written once here (the expansion's head terms, term importance's head writes, term effects' head
  logits and virtual heads all read it);
* :func:`frozen_gate` — a gated model's recorded gates ``[B, h, T, G]``: with them frozen a head's
  write at query ``t`` is ``(z_t * g_t) @ W_O``, still linear in the stream term it reads (every
  analysis that mixes values by a frozen pattern multiplies by them: :func:`gated`).

Shapes: ``B`` batch, ``T`` positions, ``H`` heads, ``D`` d_model, ``E`` d_head.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from ...errors import QkovError
from ...model.ops import expand_kv, normalize, project_heads
from ...weights.parts import WeightSource
from .cache import Trace
from .sites import ROUTE_KINDS, Sites
from .tracer import trace

__all__ = [
    "check_linear",
    "frozen_edits",
    "frozen_gate",
    "frozen_recording",
    "frozen_sites",
    "frozen_values",
    "gated",
    "head_terms",
    "head_writes",
    "read",
    "sites_of",
]

FROZEN_KINDS = ("pattern", "attn_scale", "qk_scale", "mlp_scale", "final_scale", "mlp_out", "gate", *ROUTE_KINDS)
"""The site kinds a frozen recording holds (those the model has)."""


def check_linear(source: WeightSource) -> None:
    """Path analyses need reads that are linear once the normalisation divisor is frozen."""
    if source.norm == "layernorm":
        raise QkovError("paths: use a weights view with LayerNorm folded (fold_ln=True)")


def sites_of(source: WeightSource, kinds: tuple[str, ...]) -> list[str]:
    """The ``cache=`` names of those of ``kinds`` the model of ``source`` has, at every layer (``"pattern.*"``,
    ``"route_final"``)."""
    have = {k.name: k.per_layer for k in Sites(source.cfg, source.norm).kinds}
    return [f"{k}.*" if have[k] else k for k in kinds if k in have]


def frozen_sites(source: WeightSource) -> list[str]:
    """The sites (``cache=`` names) a recording must keep to be frozen: every one of :data:`FROZEN_KINDS`
    the model has, at every layer."""
    return sites_of(source, FROZEN_KINDS)


def frozen_edits(recording: Trace) -> dict[str, Tensor]:
    """Edits that hold a pass of ``recording``'s tokens at ``recording``'s patterns, divisors, MLP outputs (and gates).

    Raises:
        QkovError: ``recording`` did not cache them (:func:`frozen_sites`).
    """
    out: dict[str, Tensor] = {}
    for pattern in frozen_sites(recording.source):
        kind = pattern.removesuffix(".*")
        names = [f"{kind}.{l}" for l in range(recording.source.cfg.n_layers)] if pattern.endswith(".*") else [kind]
        missing = [n for n in names if n not in recording.cache]
        if missing:
            raise QkovError(f"a frozen recording must have cached {', '.join(frozen_sites(recording.source))}; {missing[0]} is missing")
        out.update({n: recording.cache[n] for n in names})
    return out


def read(x: Tensor, norm: str, scale: Tensor | None, w: Tensor | None = None) -> Tensor:
    """A reader's (linear) view of a stream term ``x [B, T, D]`` with the normalisation's divisor
    frozen at ``scale [B, T, 1]``: centred and divided (``folded``), divided (``scale``), divided and
    multiplied by the gain ``w`` (an unfolded ``rmsnorm`` view), or ``x`` itself (``none``). Summed
    over terms, it gives the real normalised input."""
    if norm == "layernorm":
        raise QkovError("a frozen read needs a weights view with LayerNorm folded (fold_ln=True)")
    return normalize(x, norm, 0.0, scale=scale, w=w)[0] if scale is not None else x


def frozen_values(
    source: WeightSource,
    recording: Trace,
    layer: int,
    x: Tensor,
    *,
    heads: Sequence[int] | None = None,
    value_bias: bool = False,
) -> Tensor:
    """What the heads of ``layer`` (all, or ``heads``) read as values from the stream term ``x [B, T, D]``,
    the recording's divisor frozen: ``[B, h, T, E]`` (``b_V`` added with ``value_bias``). Key/value heads
    shared by a group are projected once and repeated for their query heads."""
    att = source.attention(layer, expand_kv=False)
    x = read(x, source.norm, recording.divisor("attn_v", layer), att.ln_w)
    group = source.cfg.n_heads // source.cfg.kv_heads
    if heads is None:
        return expand_kv(project_heads(x, att.W_V, att.b_V if value_bias else None), group, dim=1)
    kv = torch.as_tensor(list(heads), dtype=torch.long) // group
    return project_heads(x, att.W_V[kv], att.b_V[kv] if value_bias else None)


def frozen_gate(recording: Trace, layer: int, heads: Sequence[int] | None = None) -> Tensor | None:
    """The recorded attention gates of ``layer`` (all heads, or ``heads``) as ``[B, h, T, G]`` (``G``
    = ``d_head`` elementwise, 1 headwise), or ``None`` for a model without gated attention."""
    if getattr(recording.source.cfg, "gate", "none") == "none":
        return None
    g = recording["gate", layer].transpose(1, 2)
    return g if heads is None else g[:, list(heads)]


def gated(recording: Trace, layer: int, z: Tensor, heads: Sequence[int] | None = None) -> Tensor:
    """``z [B, h, T, E]`` (a pattern's mix of values) times the recording's frozen gates of ``layer``
    (:func:`frozen_gate`): what ``W_O`` reads; ``z`` itself for an ungated model."""
    g = frozen_gate(recording, layer, heads)
    return z if g is None else z * g


def head_writes(pattern: Tensor, v: Tensor, W_O: Tensor, gate: Tensor | None = None) -> Tensor:
    """Each head's output ``[B, H, T, D]``: ``pattern [B, H, T, T] @ v [B, H, T, E]``, times the frozen
    ``gate [B, H, T, G]`` of a gated model, ``@ W_O [H, E, D]``."""
    z = pattern @ v
    return torch.einsum("bhte,hed->bhtd", z if gate is None else z * gate, W_O)


def head_terms(source: WeightSource, recording: Trace, layer: int, x: Tensor, heads: list[int] | None = None) -> Tensor:
    """What each head of ``layer`` (or only ``heads``) writes for one stream term ``x [B, T, D]``
    alone, with the recording's patterns, normalisation divisors (and gates) frozen, no biases: ``[h, B, T, D]``."""
    pattern, W_O = recording["pattern", layer], source.attention(layer, expand_kv=False).W_O
    if heads is not None:
        pattern, W_O = pattern[:, heads], W_O[heads]
    v = frozen_values(source, recording, layer, x, heads=heads)
    return head_writes(pattern, v, W_O, frozen_gate(recording, layer, heads)).transpose(0, 1)


def frozen_recording(source: WeightSource, tokens: Tensor, *, cache: tuple[str, ...] = ()) -> Trace:
    """A real forward pass caching what the expansion freezes (:func:`~qkov.analysis.forward.frozen.frozen_sites`:
    patterns, normalisation divisors, MLP outputs, gates), plus ``cache``."""
    check_linear(source)
    return trace(source, tokens, cache=[*frozen_sites(source), *cache])
