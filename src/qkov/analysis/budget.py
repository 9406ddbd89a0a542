"""Memory plans: what an analysis allocates at its peak, estimated before it starts.

The analyses that take a memory budget (``--max-memory``, or the memory free on the device:
:func:`qkov.device.memory_budget`) size their chunked steps to it and refuse, in one line and
before any work (:func:`qkov.device.check_fits`), work whose smallest chunks would not fit. The
estimates count the tensors an analysis creates (activations, products, weights read from a
memory-mapped checkpoint), not the weights already in memory; each is the sum of the largest
tensors alive at once, at the chunk sizes the code will use.

:func:`run_bytes` is one forward pass; :func:`fit_chunk` turns a budget into a chunk size.
"""

from __future__ import annotations

import torch

from ..device import check_fits, memory_budget
from ..model.config import ModelConfig
from ..weights.parts import WeightSource
from .composition import DEFAULT_WRITER_BYTES, PRODUCT_BYTES
from .factored import CACHE_BYTES, DEFAULT_MAX_BYTES
from .rotary_circuits import resolve_offsets
from .vocab import VOCAB_BLOCK

COPYING_LOGITS = 2**24  # logits per head the copying scores read at most (beyond: sampled queries)


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


def run_bytes(
    source: WeightSource,
    batch: int,
    seq: int,
    *,
    logits: int | None = None,
    patterns: bool = False,
    cached_patterns: bool = False,
    loss: bool = False,
) -> int:
    """Peak memory of one analysis forward pass (:func:`~qkov.analysis.forward.trace`) of ``batch``
    sequences of ``seq`` tokens: the stream and its normalised copies, queries, keys and values,
    one layer's attention (scores, masked scores and pattern when ``patterns`` are computed; fused
    attention otherwise), the MLP's hidden activations, the logits at ``logits`` positions (default:
    every position; the product and its sum with ``b_U``; with ``loss``, their float32 log-softmax
    too), and every layer's pattern when ``cached_patterns``. Measured against the peak resident
    memory of a 4-layer, d_model-256, 8192-token model: 16 x 256 tokens with their loss 350 to
    430 MiB over runs (estimated 452), the repeated-token probe 59 MiB (estimated 107)."""
    c, it = source.cfg, item(source)
    B, T, D, H, E, V = batch, seq, c.d_model, c.n_heads, c.d_head, c.d_vocab
    P = T if logits is None else logits
    M = (c.d_mlp or 0) * (3 if c.gated_mlp else 2)
    attn = B * H * T * T * (3 if patterns or cached_patterns else 0)
    elems = 6 * B * T * D + 3 * B * H * T * E + attn + B * T * M + 2 * B * P * V  # the logits, and with b_U added
    elems += c.n_layers * B * H * T * T if cached_patterns else 0
    return elems * it + (B * P * V * 4 if loss else 0)


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
    :class:`~qkov.analysis.factored.LowRank`'s row chunks take them."""
    return max(1, min(rows, max_bytes // max(1, cols * item(source))))


def copying_bytes(source: WeightSource, *, diag: bool, rows: int | None, chunk_rows: int) -> int:
    """Peak of :func:`~qkov.analysis.circuits.copying_scores`: ``G = W_U W_E``, one layer's ``W_O G``
    and attention read, every head's twins and eigenvalues; with the diagonal rate (``diag``) also
    ``W_E`` and ``W_U`` read whole (a streamed source), the sampled rows (``rows`` of them, ``None``:
    every token), one head's full-OV factors and a chunk of ``chunk_rows`` rows of its full OV
    circuit with their comparisons."""
    c, it = source.cfg, item(source)
    V, D, H, E, L = c.d_vocab, c.d_model, c.n_heads, c.d_head, c.n_layers
    elems = D * D + H * E * D + 2 * L * H * E * E + 4 * L * H * E
    extra = 0
    if diag:
        n = V if rows is None else rows
        elems += (0 if source.in_memory else 2 * V * D) + (0 if rows is None else n * D)
        elems += n * E + E * V + chunk_rows * V
        extra = chunk_rows * V  # the comparison with the diagonal (bool)
    elif not source.in_memory:
        elems += 2 * VOCAB_BLOCK * D  # W_U W_E summed over blocks of the vocabulary
    return elems * it + extra + layer_read_bytes(source)


def composition_bytes(source: WeightSource, kinds: int, *, writer_bytes: int, offsets: int = 1) -> int:
    """Peak of :func:`~qkov.analysis.composition.composition_scores` of ``kinds`` kinds: the
    ``[L, H, L, H]`` scores, the writer factors of a block of layers (every layer in memory; under
    ``writer_bytes`` for a streamed source), the product of a group of writer layers with one
    reader layer (and its float64 Gram matrices for rotary offsets or grouped-query heads), and
    the random-matrix baseline's sample blocks."""
    c, it = source.cfg, item(source)
    L, H, D, E = c.n_layers, c.n_heads, c.d_model, c.d_head
    out = (kinds * L * L * H * H + L * H) * it
    if L < 2:
        return out
    block = L - 1 if source.in_memory else max(1, min(L - 1, writer_bytes // (H * E * D * it)))
    group = min(block, max(1, PRODUCT_BYTES // (H * E * H * E * it)))
    product = group * H * E * H * E * it
    gram = 8 * group * H * H * E * E + 8 * offsets * H * E * E if (offsets > 1 or c.kv_heads < H) else 0
    raw = out + block * H * E * D * it + layer_read_bytes(source) + 2 * product + gram
    per_sample = 4 * D * E * 8  # the baseline's four float64 factors of one sample
    samples = 256 if (D * E) % 16 else min(256, max(1, (64 << 20) // per_sample))
    return max(raw, out + 2 * samples * per_sample)


def trigram_table_bytes(source: WeightSource) -> int:
    """What a :class:`~qkov.analysis.trigrams.TrigramTable` holds: its ``[d_vocab, d_head]``
    factors (and one block of the vocabulary while a streamed source is read)."""
    c = source.cfg
    read = 0 if source.in_memory else VOCAB_BLOCK * c.d_model
    return (8 * c.d_vocab * c.d_head + read) * item(source)


def trigram_search_bytes(source: WeightSource, *, batch: int, chunk_rows: int) -> int:
    """Peak of :meth:`~qkov.analysis.trigrams.TrigramTable.top` beyond the table: the bounds, a
    chunk of ``chunk_rows`` rows of a circuit, and ``batch`` sources' rows of both circuits."""
    V = source.cfg.d_vocab
    return (4 * V + chunk_rows * V + 2 * batch * V) * item(source) + 2 * batch * V * 8  # top-k indices


def bigram_bytes(source: WeightSource, *, chunk_rows: int) -> int:
    """Peak of :func:`~qkov.analysis.trigrams.bigrams`: the copied embedding and the centred
    unembedding (both read first from a streamed source) and a chunk of their product."""
    c = source.cfg
    V, D = c.d_vocab, c.d_model
    return ((2 if source.in_memory else 4) * V * D + chunk_rows * V) * item(source)


def repeat_bytes(source: WeightSource, batch: int, seq: int) -> int:
    """Peak of :func:`~qkov.analysis.heads.repeat_scores` on ``[batch, seq]`` repeated tokens: the
    pass with every layer's pattern and per-head output, and one head's copying logits (at most
    :data:`COPYING_LOGITS`) with their rectified copy and mask."""
    c, it = source.cfg, item(source)
    outputs = c.n_layers * batch * c.n_heads * seq * c.d_model * it
    logits = min(COPYING_LOGITS, batch * seq * c.d_vocab) * it * 3
    return run_bytes(source, batch, seq, cached_patterns=True) + outputs + logits


class Planned:
    """What the plans read of a weights source, without the weights: ``cfg``, ``dtype``, ``device``
    and ``in_memory`` (for a plan made before the weights are in a view, e.g. a series' snapshots)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, in_memory: bool = True) -> None:
        self.cfg, self.dtype, self.device, self.in_memory = cfg, dtype, device, in_memory


def circuits_budget(
    source: WeightSource,
    *,
    diag_k: int | None,
    rows: int | None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    writer_bytes: int = DEFAULT_WRITER_BYTES,
    offsets: list[int] | None = None,
) -> tuple[int, int]:
    """The chunk bounds :func:`~qkov.analysis.circuits.circuits_report` uses (``rows``: the tokens whose
    own-logit rate is measured, ``None`` for all), ``(max_bytes, writer_bytes)``: the ones given when
    the copying scores (:func:`~qkov.analysis.budget.copying_bytes`) and composition
    (:func:`~qkov.analysis.budget.composition_bytes`) fit the memory budget
    (:func:`qkov.device.memory_budget`) with them, else smaller ones that fit. Refuses (one-line
    :class:`QkovError`) when one row of a full OV circuit and one writer layer do not fit."""
    c, it = source.cfg, item(source)
    V = c.d_vocab
    n = V if rows is None else rows
    offs = resolve_offsets(c, offsets)
    spots = 1 if offs is None else len(offs)
    layer = c.n_heads * c.d_head * c.d_model * it  # one layer's writer factors

    def need(chunk: int, writers: int) -> int:
        copy = copying_bytes(
            source, diag=bool(diag_k), rows=None if rows is None else n, chunk_rows=rows_per_chunk(source, n, V, chunk)
        )
        return max(copy, composition_bytes(source, 3, writer_bytes=writers, offsets=spots))

    least = need(1, layer)
    check_fits(
        least,
        source.device,
        "circuits: scoring copying and composition",
        "skip the own-logit rate (diag_k=0) or measure it on fewer tokens (diag_sample)",
        hint="memory",
    )
    have, _ = memory_budget(source.device)
    chunk, writers = min(max_bytes, CACHE_BYTES), writer_bytes
    if have is None or need(chunk, writers) <= have:
        return max_bytes, writer_bytes
    spare = have - least  # each step runs alone: either may take all of it
    row = V * it
    return min(chunk, row * (1 + spare // (row + V))), min(writers, layer * (1 + spare // layer))


def expansion_bytes(source: WeightSource, batch: int, seq: int, *, virtual: int = 0) -> int:
    """Memory :func:`~qkov.analysis.paths.summarize` holds at its peak, about: every head's term and the orders
    (``[batch, seq, d_model]`` each), ``virtual`` kept virtual-head terms, the frozen patterns,
    the per-head outputs of term importance and three ``[batch, seq, d_vocab]`` logits."""
    c = source.cfg
    size = torch.finfo(source.dtype).bits // 8
    term = batch * seq * c.d_model
    terms = (c.n_layers + 4 + 3 * c.n_layers * c.n_heads + virtual + 2 * c.n_heads) * term
    patterns = c.n_layers * batch * c.n_heads * seq * seq
    return (terms + patterns + 3 * batch * seq * c.d_vocab) * size
