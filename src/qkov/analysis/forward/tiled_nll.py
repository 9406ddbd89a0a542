"""The next-token loss from the final stream, unembedded a cache-sized tile at a time.

``next_token_nll(trace(...).logits, tokens)`` forms the ``[B, T, V]`` logits, then a log-softmax of the same
size: two tensors that leave the processor's caches and whose pages are faulted in afresh on every call (at
GPT-2-small shape 16 x 1024 tokens make 3.3 GB of each). :func:`tiled_nll` takes the final stream (the ``final``
site, ``trace(..., cache=["final"], logits=False)``) and unembeds at most
:data:`~qkov.analysis.budget.TILE_BYTES` of logits at a time: each tile's log-softmax is read at the targets
while the tile is still in cache, and only ``[B, T - 1]`` numbers leave. A streamed source's ``W_U`` is read
one block of :data:`~qkov.weights.parts.VOCAB_BLOCK` columns at a time, once. The losses equal
:func:`qkov.model.ops.next_token_nll` on the whole logits: bit for bit with a vocabulary of one block, to
float rounding with several (their log-sum-exps are combined; tested). :func:`pass_nll` is a pass and its
loss, the way every whole-text loss of the ablations and of ``dynamics`` is computed.

Measured on this project's 2-core CPU: the tour model's 16 x 256-token text (vocabulary 1024), pass and loss
29 -> 18 ms; ``qkov ablate`` at GPT-2-small shape, 368 -> 306 s and 7.7 -> 2.3 GiB (this alone).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

from ...model.ops import live_bias, next_token_nll
from .. import budget
from ...weights.parts import WeightSource
from .sites import Sites
from .tracer import trace, vocab_blocks

__all__ = ["pass_nll", "tiled_nll"]


def tiled_nll(source: WeightSource, final: Tensor, tokens: Tensor) -> Tensor:
    """Position ``i``'s loss predicting token ``i + 1``, ``[B, T - 1]``, from the final stream ``final [B, T, D]``
    (after the final normalisation: the ``final`` site) and ``tokens [B, T]``; in float32, or float64 for a
    float64 stream (as :func:`~qkov.model.ops.next_token_nll` computes it from the logits)."""
    B, T, D = final.shape
    V = source.cfg.d_vocab
    x = final[:, :-1].reshape(-1, D)
    target = tokens[:, 1:].reshape(-1).to(final.device)
    N = x.shape[0]
    dtype = torch.float64 if final.dtype == torch.float64 else torch.float32
    rows, _ = budget.nll_tile(V, torch.finfo(dtype).bits // 8)
    blocks = list(vocab_blocks(V))
    lse = torch.empty(N, len(blocks), dtype=dtype, device=final.device)  # each block's log-sum-exp
    nll = torch.empty(N, dtype=dtype, device=final.device)  # minus the target's log-probability
    for j, block in enumerate(blocks):
        part = source.unembed(cols=None if len(blocks) == 1 and source.in_memory else block)
        W_U, b_U = part.W_U, live_bias(part.b_U)
        here = (target >= block.start) & (target < block.stop)
        for lo in range(0, N, rows):
            tile = x[lo : lo + rows] @ W_U
            if b_U is not None:
                tile.add_(b_U)
            logp = torch.log_softmax(tile.to(dtype), dim=-1)  # one fused kernel (torch's logsumexp is four passes)
            if len(blocks) == 1:
                nll[lo : lo + rows] = logp.gather(-1, target[lo : lo + rows, None])[:, 0].neg_()
                continue
            lse[lo : lo + rows, j] = tile.amax(-1).to(dtype) - logp.amax(-1)  # at the row's largest logit: no cancellation
            inside = here[lo : lo + rows].nonzero()[:, 0]
            if len(inside):
                nll[lo + inside] = logp[inside, target[lo + inside] - block.start].neg_() - lse[lo + inside, j]
    if len(blocks) > 1:  # -log p = lse - logit = (lse_b - logit) - lse_b + lse, for the target's block b
        nll += torch.logsumexp(lse, dim=-1)
    return nll.reshape(B, T - 1)


def pass_nll(
    source: WeightSource,
    tokens: Tensor,
    *,
    edits: Mapping[Any, Any] | None = None,
    start_at: tuple[int, Tensor] | None = None,
    keep: list[Tensor] | None = None,
) -> Tensor:
    """The next-token losses ``[B, T - 1]`` of one pass of :func:`~qkov.analysis.forward.tracer.trace` over
    ``tokens [B, T]`` with ``edits`` (from ``start_at``, as ``trace`` takes it): :func:`tiled_nll` on the pass's
    final stream, or, when an edit writes (or watches) the ``logits`` site,
    :func:`~qkov.model.ops.next_token_nll` on the whole logits. ``keep``: a list that receives the pass's stream
    entering every layer, ``[n_layers, B, T, d_model]``."""
    keys = list(edits or ())
    whole = any(a.kind == "logits" for a in Sites(source.cfg, source.norm).resolve_all(keys))
    streams = [] if keep is None else ["resid_pre.*"]
    out = trace(source, tokens, cache=streams + ([] if whole else ["final"]), edits=edits, logits=whole, start_at=start_at)
    if keep is not None:
        keep.append(out.stack("resid_pre"))
    return next_token_nll(out.logits, out.tokens) if whole else tiled_nll(source, out["final"], out.tokens)
