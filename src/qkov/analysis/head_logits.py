"""A path term's logits at a few positions, read through its last head's ``d_head`` values.

A term that ends in head ``h`` of layer ``l`` (an order-1 term, or a virtual head ``l1.h1 -> l.h``)
is ``y @ W_O[h]`` with ``y = A_h @ (read(x_in) @ W_V[h])`` (``A_h`` the frozen pattern, ``x_in``
the stream term the head reads: the direct path, or the writer's term). Its logits at position
``(b, t)`` are ``read(y W_O[h]) @ W_U``; the frozen final read centres (a projection of each row)
and divides by the position's divisor, both linear, so they equal ``(y @ read(W_O[h])) @ W_U / s``:
one ``[d_head, d_vocab]`` product per head and ``d_head``-wide rows per position instead of
``d_model``-wide ones (about 3.6x fewer operations for GPT-2 small's term effects). A test checks
them against the term's own logits (:meth:`qkov.analysis.paths.Expansion.logits_of`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..weights.parts import WeightSource
from .activations import Trace
from .forward import project, read


def term_logits(source: WeightSource, run: Trace, key: tuple[int, ...], x_in: Tensor, b: Tensor, t: Tensor) -> Tensor:
    """Logits ``[n, 1, V]`` (no ``b_U``) at positions ``(b[i], t[i])`` of the term that head
    ``layer, head = key[-2:]`` writes for the stream term ``x_in [B, T, D]`` alone (the term
    :func:`~qkov.analysis.forward.head_terms` gives), the run's patterns and divisors frozen."""
    layer, head = key[-2], key[-1]
    att = source.attention(layer)
    v = project(read(x_in, source.norm, run.divisor("attn_v", layer)), att.W_V[head : head + 1])[:, 0]  # [B, T, E]
    y = (run.patterns[layer][:, head] @ v)[b, t]  # type: ignore[index]  # [n, E]
    scale = run.divisor("final")
    W_O = att.W_O[head]  # [E, D]
    if scale is None:
        return (y @ (W_O @ source.unembed().W_U))[:, None]
    W_read = read(W_O[None], source.norm, torch.ones(1, W_O.shape[0], 1, dtype=W_O.dtype, device=W_O.device))[0]
    return ((y @ (W_read @ source.unembed().W_U)) / scale[b, t])[:, None]
