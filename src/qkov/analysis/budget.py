"""Memory plans: what an analysis allocates at its peak, estimated before it starts.

The analyses that take a memory budget (``--max-memory``, or the memory free on the device:
:func:`qkov.device.memory_budget`) size their chunked steps to it and refuse, in one line and
before any work (:func:`qkov.device.check_fits`), work whose smallest chunks would not fit. The
estimates count the tensors an analysis creates (activations, products, weights read from a
memory-mapped checkpoint), not the weights already in memory; each is the sum of the largest
tensors alive at once, at the chunk sizes the code will use.

:func:`pass_bytes` is one forward pass; :func:`fit_chunk` turns a budget into a chunk size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..device import check_fits, memory_budget
from ..model.config import ModelConfig
from ..weights.parts import VOCAB_BLOCK, WeightSource

__all__ = [
    "fit_chunk", "item", "keeps_streams", "KEEP_STREAMS_BYTES", "layer_read_bytes", "nll_tile", "Planned", "rows_per_chunk", "pass_bytes",
    "TILE_BYTES",
]  # fmt: skip


def item(source: WeightSource) -> int:
    """Bytes per element of ``source``'s dtype."""
    return torch.empty(0, dtype=source.dtype).element_size()


def layer_read_bytes(source: WeightSource) -> int:
    """What reading one layer's attention weights allocates: nothing in memory (views), a copy of
    ``W_Q, W_K, W_V, W_O`` (and the expanded key/value heads) from a memory-mapped checkpoint."""
    if source.in_memory:
        return 0
    c = source.cfg
    return (4 * c.n_heads + 2 * c.kv_heads) * c.d_model * c.d_head * item(source)


TILE_BYTES = 4 * 2**20
"""The most float32 logits one tile of :func:`~qkov.analysis.forward.tiled_nll.tiled_nll` holds (a core's
share of the second-level cache, about)."""


def nll_tile(d_vocab: int, item_bytes: int = 4) -> tuple[int, int]:
    """``(rows, columns)`` of one tile of :func:`~qkov.analysis.forward.tiled_nll.tiled_nll`'s logits: a block of
    :data:`~qkov.weights.parts.VOCAB_BLOCK` vocabulary columns (or the whole vocabulary) and the rows that fill
    :data:`TILE_BYTES` at ``item_bytes`` per logit."""
    cols = min(d_vocab, VOCAB_BLOCK)
    return max(1, TILE_BYTES // (item_bytes * cols)), cols


def pass_bytes(
    source: WeightSource,
    batch: int,
    seq: int,
    *,
    logits: int | None = None,
    patterns: bool = False,
    cached_patterns: bool = False,
    loss: bool = False,
    tiled: bool = False,
) -> int:
    """Peak memory of one analysis forward pass (:func:`~qkov.analysis.forward.tracer.trace`) of ``batch``
    sequences of ``seq`` tokens: the stream and its normalised copies, queries, keys and values,
    one layer's attention (scores, masked scores and pattern when ``patterns`` are computed; fused
    attention otherwise), the MLP's hidden activations, the logits at ``logits`` positions (default:
    every position; the product and its sum with ``b_U``; with ``loss``, their float32 log-softmax
    too), and every layer's pattern when ``cached_patterns``. ``tiled``: the loss is read from the final
    stream a tile of logits at a time (:func:`~qkov.analysis.forward.tiled_nll.pass_nll`): the kept final
    stream and one tile with its log-softmax instead of the logits. Measured against the peak resident
    memory of a 4-layer, d_model-256, 8192-token model: 16 x 256 tokens with their loss 350 to
    430 MiB over runs (estimated 452), the repeated-token probe 59 MiB (estimated 107)."""
    c, it = source.cfg, item(source)
    B, T, D, H, E, V = batch, seq, c.d_model, c.n_heads, c.d_head, c.d_vocab
    P = T if logits is None else logits
    M = (c.d_mlp or 0) * (3 if c.gated_mlp else 2)
    attn = B * H * T * T * (3 if patterns or cached_patterns else 0)
    elems = 6 * B * T * D + 3 * B * H * T * E + attn + B * T * M
    elems += c.n_layers * B * H * T * T if cached_patterns else 0
    if tiled:  # the final stream and its rows; a tile of float32 logits and its log-softmax
        rows, cols = nll_tile(V)
        return (elems + 2 * B * T * D) * it + 2 * 4 * cols * min(B * T, rows)
    elems += 2 * B * P * V  # the logits, and with b_U added
    return elems * it + (B * P * V * 4 if loss else 0)


KEEP_STREAMS_BYTES = 2**30
"""The most a run keeps of its streams entering every layer, to start later passes there (an ablation study's
ablated passes at their first ablated layer); GPT-2-small at 16 x 1024 tokens keeps 0.6 GB."""


def keeps_streams(source: WeightSource, *tokens: Tensor | None) -> bool:
    """Whether runs over ``tokens`` (each ``[B, T]``; ``None`` ones left out) may keep their streams entering every
    layer: an additive stream (a routed model starts only at its final read), a model in memory (a streamed one
    would hold what it streams), and at most :data:`KEEP_STREAMS_BYTES` and a quarter of the memory budget in all."""
    c = source.cfg
    given = [t for t in tokens if t is not None]
    if not given or c.residual != "sum" or not source.in_memory or not c.n_layers:
        return False
    need = c.n_layers * sum(t.numel() for t in given) * c.d_model * item(source)
    have, _ = memory_budget(source.device)
    return need <= KEEP_STREAMS_BYTES and (have is None or 4 * need <= have)


def fit_chunk(
    source: WeightSource, count: int, one: int, fixed: int, what: str, advice: str, *, hint: str | None = None
) -> int:
    """How many of ``count`` items (sequences, rows) to take at once: all of them when ``fixed +
    count * one`` bytes fit the budget, else as many as fit (at least one). Refuses (one-line
    :class:`~qkov.QkovError`, before any work) when even one does not fit."""
    check_fits(fixed + one, source.device, what, advice, hint=hint)
    have, _ = memory_budget(source.device)
    if have is None:
        return count
    return max(1, min(count, (have - fixed) // max(1, one)))


# ------------------------------------------------------------------ weights-only analyses
def rows_per_chunk(source: WeightSource, rows: int, cols: int, max_bytes: int) -> int:
    """Rows of a ``[rows, cols]`` product computed at once under ``max_bytes`` (at least one), as
    :class:`~qkov.analysis.circuits.factored.LowRank`'s row chunks take them."""
    return max(1, min(rows, max_bytes // max(1, cols * item(source))))


class Planned:
    """What the plans read of a weights source, without the weights: ``cfg``, ``dtype``, ``device``
    and ``in_memory`` (for a plan made before the weights are in a view, e.g. a series' snapshots)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, in_memory: bool = True) -> None:
        self.cfg, self.dtype, self.device, self.in_memory = cfg, dtype, device, in_memory


