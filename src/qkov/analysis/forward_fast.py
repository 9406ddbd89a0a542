"""The analysis forward's shortcuts that change no number: the last layer at a few positions only,
and biases of zeros not added.

When :func:`~qkov.analysis.forward.trace` is asked for the logits at ``positions`` and nothing reads
the last layer, its keys and values are still computed at every position, but its queries,
attention, output, MLP and residual stream only at those positions (the scores that read a few
positions, such as the ICL score, then skip most of the last layer's attention). :func:`query_rows`
says when that holds (else the full pass runs, as before); :func:`last_block` computes the block. A
test checks the logits against the full pass's at the same positions (with LayerNorm, MLPs,
parallel blocks, grouped-query attention and rotary positions). Edits of the last layer's ``z`` by
functions marked :func:`per_position` (the ablations of every position) are applied there too.

:func:`live_bias`: a weights view holds zeros for the biases a model does not have; adding them
changes no value (``x + 0 == x``) but costs a pass over every activation, so the forward skips them.

Shapes: ``B`` batch, ``T`` positions, ``P`` selected positions, ``D`` d_model.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..model import rotary
from ..model.ops import expand_kv, project_heads, query_key_stream, write_heads


PER_POSITION = "qkov_per_position"  # the attribute that marks an edit function as acting on each position alone


def per_position(edit: Callable[[Tensor, Any], Tensor]) -> Callable[[Tensor, Any], Tensor]:
    """Mark the function ``edit`` (of a ``z`` site) as acting on each position alone: its output at a
    position depends on the inputs at that position only, not on the others or on how many there
    are. The last layer then still runs at a few positions only with it. The ablations of every
    position (:func:`~qkov.analysis.ablation.ablation_edits`) are marked."""
    setattr(edit, PER_POSITION, True)
    return edit


def live_bias(b: Tensor | None) -> Tensor | None:
    """``b``, or ``None`` for a bias of zeros on the CPU that needs no gradient (the add is skipped:
    the same values; on an accelerator the check would wait for the device, so it is not made)."""
    if b is None or b.device.type != "cpu" or b.requires_grad or bool(b.any()):
        return b
    return None


def plus_bias(x: Tensor, b: Tensor | None) -> Tensor:
    """``x + b``, or ``x`` itself when :func:`live_bias` skips ``b``."""
    b = live_bias(b)
    return x if b is None else x + b


def query_rows(
    state: Any, positions: Tensor | None, T: int, *, start_at: Any, observe: Any, grad: bool
) -> Tensor | None:
    """The positions ``[P]`` (in ``0 .. T-1``) where the last layer of the pass ``state`` needs its
    queries, or ``None`` when the whole last layer must run: no positions (or as many as ``T``), a
    gradient, an observer, a start inside the pass, a cached site at the last layer, or an edit there
    other than of ``z`` by functions marked :func:`per_position`."""
    L = state.cfg.n_layers
    if positions is None or L == 0 or grad or observe is not None or start_at is not None:
        return None
    if positions.dim() != 1 or not 0 < len(positions) < T:
        return None
    if positions.is_floating_point() or positions.dtype == torch.bool:
        return None
    if any(layer == L - 1 for _, layer in state.store.wanted):
        return None
    for (kind, layer), edits in state.edits.by_site.items():  # at the last layer: only per-position z edits
        if layer == L - 1 and (kind != "z" or not all(getattr(e, PER_POSITION, False) for _, e in edits)):
            return None
    return positions.to(state.source.device).remainder(T)


def last_block(state: Any, l: int, x: Tensor, rows: Tensor) -> Tensor:
    """Block ``l`` (the last) of the pass ``state`` for the stream ``x [B, T, D]``, at ``rows [P]``
    only: ``[B, P, D]``, the full block's output at those positions."""
    cfg, att = state.cfg, state.source.attention(l, expand_kv=False)
    v_in = state.normed("attn", l, x, att.ln_w, att.ln_b)[0]
    qk_src = query_key_stream(x, state.pos, cfg.positional)
    qk_in = v_in if qk_src is x else state.normed("qk", l, qk_src, att.ln_w, att.ln_b)[0]
    v = expand_kv(project_heads(v_in, att.W_V, live_bias(att.b_V)), state.group, dim=1)
    k = project_heads(qk_in, att.W_K, live_bias(att.b_K))
    q = project_heads(qk_in[:, rows], att.W_Q, live_bias(att.b_Q))
    if state.turn is not None:
        cos, sin = state.turn
        q, k = rotary.rotate(q, cos[rows], sin[rows]), rotary.rotate(k, cos, sin)
    sees = torch.arange(x.shape[1], device=x.device)[None, :] <= rows[:, None]  # [P, T]: keys at or before
    z = F.scaled_dot_product_attention(q, expand_kv(k, state.group, dim=1), v, attn_mask=sees)
    z = state.at_heads("z", l, z)  # per-position edits only (query_rows)
    a = write_heads(z, att.W_O, live_bias(att.b_O))
    x = x[:, rows]
    if cfg.parallel:  # attention and MLP both read the block's input
        m = state.mlp(l, x)
        return x + a if m is None else x + a + m
    x = x + a
    return x + state.mlp(l, x) if cfg.d_mlp is not None else x
