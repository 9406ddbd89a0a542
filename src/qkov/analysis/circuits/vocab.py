"""Products with the embedding and the unembedding, in blocks of the vocabulary for a streamed source.

A full circuit's factors are ``W_E @ M`` (``[d_vocab, r]``) and ``M @ W_U`` (``[r, d_vocab]``)
for a small ``M``. In memory they are one product; for a memory-mapped source (a Llama-3 shape
has a 128256 x 4096 embedding: 2 GiB in float32) the vocabulary is read ``block`` tokens at a
time, so only the ``r``-wide result and one block are ever held.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ...weights.parts import VOCAB_BLOCK, WeightSource

__all__ = ["embed_product", "unembed_product", "VOCAB_BLOCK"]


def embed_product(
    source: WeightSource, M: Tensor, *, rows: Callable[[Tensor], Tensor] | None = None, block: int = VOCAB_BLOCK
) -> Tensor:
    """``f(W_E) @ M`` ``[d_vocab, ...]`` for ``M [d_model, ...]``, ``f`` = ``rows`` applied to each
    block of embedding rows (default: none)."""
    f = rows or (lambda x: x)
    if source.in_memory:
        return f(source.embed()) @ M
    V = source.cfg.d_vocab
    parts = [f(source.embed(slice(lo, min(V, lo + block)))) @ M for lo in range(0, V, block)]
    return torch.cat(parts)


def unembed_product(source: WeightSource, M: Tensor, *, block: int = VOCAB_BLOCK) -> Tensor:
    """``M @ W_U`` ``[..., d_vocab]`` for ``M [..., d_model]``."""
    if source.in_memory:
        return M @ source.unembed().W_U
    V = source.cfg.d_vocab
    return torch.cat([M @ source.unembed(cols=slice(lo, min(V, lo + block))).W_U for lo in range(0, V, block)], -1)
