"""The one interface every analysis reads weights through: a :class:`WeightSource`.

A source serves a model's weights piece by piece, in the row convention of
docs/conventions.md: the embedding (all of it or a block of rows), the positions, the
unembedding (all of it or a block of columns), one layer's attention (every head or one
head) and one layer's MLP. Two implementations exist:

* :class:`qkov.weights.Weights` — the whole model in memory; every getter is a view (a slice).
* :class:`qkov.weights.LazyCheckpoint` — a checkpoint on disk, memory-mapped; every getter
  copies just the bytes it needs, so an analysis that walks the layers holds one at a time.

Circuits, the analysis forward and the trigram tables are written once against this
interface. ``in_memory`` tells an algorithm whether a read is free (take everything at once)
or costs memory and I/O (take blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from ..errors import QkovError
from ..model.config import ModelConfig
from ..model.ops import mlp_hidden, mlp_output, mlp_preactivation

__all__ = [
    "AttentionWeights",
    "centre_rows",
    "check_head",
    "fold_reader",
    "MLPWeights",
    "NORMS",
    "Unembedding",
    "VOCAB_BLOCK",
    "WeightSource",
    "writer_centring",
]

NORMS: tuple[str, ...] = ("none", "layernorm", "rmsnorm", "folded", "scale")
VOCAB_BLOCK = 4096
"""Tokens per block when a streamed source's ``W_E`` rows or ``W_U`` columns are read in pieces."""
"""How a view's stream is normalised before each reader: ``none`` (no normalisation), ``layernorm``
(the affine LayerNorm, gain and bias kept in the view), ``rmsnorm`` (RMSNorm with its gain kept in
the view), ``folded`` (centre and divide by the standard deviation; gain and bias folded into the
readers), ``scale`` (divide by the RMS only: a folded RMSNorm, or a folded LayerNorm view whose
writers were centred, then rotated)."""


@dataclass(frozen=True)
class AttentionWeights:
    """One layer's attention weights for ``h`` heads (all of them, or one: ``h = 1``).

    ``W_Q/W_K/W_V [h, d_model, d_head]``, ``W_O [h, d_head, d_model]``, ``b_Q/b_K/b_V
    [h, d_head]``, ``b_O [d_model]`` (zeros where the model has no bias). ``ln_w/ln_b
    [d_model]``: the pre-attention LayerNorm's gain and bias, only in a ``layernorm`` view
    (``ln_w`` alone in an ``rmsnorm`` view; folded into ``W_Q/W_K/W_V`` and their biases otherwise).
    ``W_K/W_V`` are per query head: under grouped-query attention the heads of a group read
    the same key/value weights (views of one tensor for one head; one layer's read of every head
    expands them, for that read only). ``W_G [h, d_model, G]``, ``b_G [h, G]``: a gated model's
    attention gate (``G = d_head`` elementwise, 1 headwise; it reads what ``W_Q`` reads, so the
    normalisation folds into it as into ``W_Q``); ``None`` without a gate.
    """

    W_Q: Tensor
    W_K: Tensor
    W_V: Tensor
    W_O: Tensor
    b_Q: Tensor
    b_K: Tensor
    b_V: Tensor
    b_O: Tensor
    ln_w: Tensor | None = None
    ln_b: Tensor | None = None
    W_G: Tensor | None = None
    b_G: Tensor | None = None


@dataclass(frozen=True)
class MLPWeights:
    """One layer's MLP: ``W_in [d_model, d_mlp]``, ``b_in [d_mlp]``, ``W_out [d_mlp, d_model]``,
    ``b_out [d_model]``; ``ln_w/ln_b [d_model]`` the pre-MLP LayerNorm in a ``layernorm`` view;
    ``W_gate [d_model, d_mlp]``, ``b_gate [d_mlp]`` for a gated MLP (``None`` otherwise)."""

    W_in: Tensor
    b_in: Tensor
    W_out: Tensor
    b_out: Tensor
    ln_w: Tensor | None = None
    ln_b: Tensor | None = None
    W_gate: Tensor | None = None
    b_gate: Tensor | None = None

    def hidden(self, x: Tensor, act_fn: str) -> Tensor:
        """The MLP's hidden activations ``[..., d_mlp]`` for its (normalised) input ``x [..., d_model]``."""
        return mlp_hidden(act_fn, *mlp_preactivation(x, self.W_in, self.b_in, self.W_gate, self.b_gate))

    def __call__(self, x: Tensor, act_fn: str) -> Tensor:
        """The MLP's output ``[..., d_model]`` for its (normalised) input ``x``."""
        return mlp_output(self.hidden(x, act_fn), self.W_out, self.b_out)


@dataclass(frozen=True)
class Unembedding:
    """``W_U [d_model, v]`` and ``b_U [v]`` (all ``d_vocab`` columns or a block of them);
    ``ln_w/ln_b [d_model]`` the final LayerNorm in a ``layernorm`` view."""

    W_U: Tensor
    b_U: Tensor
    ln_w: Tensor | None = None
    ln_b: Tensor | None = None


class WeightSource(Protocol):
    """What every analysis reads. See the module docstring."""

    cfg: ModelConfig
    bos_token_id: int | None
    """The start token the analyses prepend when not told otherwise (``None``: none known)."""
    tokenizer: Any
    """The model's ``tokenizers.Tokenizer``, or ``None`` when it has none."""
    default_prepend_bos: bool
    """Whether a text gets the start token unless asked (:class:`~qkov.model.tokens.TextCodec`)."""

    @property
    def norm(self) -> str:
        """One of :data:`NORMS`."""
        ...

    @property
    def centered_writing(self) -> bool:
        """Whether the writers (``W_E``, ``W_pos``, ``W_O``, ``b_O``, ``W_out``, ``b_out``) are centred."""
        ...

    @property
    def centered_unembed(self) -> bool:
        """Whether ``W_U`` and ``b_U`` have their mean over the vocabulary removed."""
        ...

    @property
    def in_memory(self) -> bool:
        """``True`` when reads are free views; ``False`` when each read copies from disk."""
        ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    def embed(self, rows: slice | None = None) -> Tensor:
        """``W_E [d_vocab, d_model]``, or the block ``rows`` of it."""
        ...

    def pos(self) -> Tensor | None:
        """``W_pos [n_ctx, d_model]``, or ``None`` for a model without positional embeddings."""
        ...

    def unembed(self, cols: slice | None = None) -> Unembedding:
        """The unembedding, all columns or the block ``cols``."""
        ...

    def attention(self, layer: int, head: int | None = None, *, expand_kv: bool = True) -> AttentionWeights:
        """Layer ``layer``'s attention: every head, or only ``head`` (leading dim 1).
        ``expand_kv=False`` (every head only): grouped-query ``W_K, W_V, b_K, b_V`` once per
        key/value head, ``[n_kv_heads, ...]``, instead of repeated per query head."""
        ...

    def mlp(self, layer: int) -> MLPWeights | None:
        """Layer ``layer``'s MLP, or ``None`` for an attention-only model."""
        ...


def writer_centring(cfg: ModelConfig, center_writing: bool | None) -> bool:
    """Whether to centre the writers: ``None`` -> exactly when the model has LayerNorm (where it
    is exact); ``True`` for a model without LayerNorm is refused (it would change its function)."""
    layernorm = cfg.normalization == "layernorm"
    if cfg.residual != "sum":  # the bus reads its sources through RMS norms: centring would change the routing
        if center_writing:
            raise QkovError(f"center_writing changes the routing of a model with residual {cfg.residual!r}")
        return False
    if center_writing is None:
        return layernorm
    if center_writing and not layernorm:
        raise QkovError(
            "center_writing changes the function of a model without LayerNorm (nothing removes the "
            "mean it subtracts); it is offered for LayerNorm models only"
        )
    return center_writing


def centre_rows(x: Tensor | None, inplace: bool = False) -> Tensor | None:
    """``x`` minus its mean over the last (``d_model``) dimension: a centred writer (``inplace``:
    ``x`` itself, changed; the same numbers without a second tensor)."""
    if x is None:
        return None
    mean = x.mean(dim=-1, keepdim=True)
    return x.sub_(mean) if inplace else x - mean


def check_head(cfg: ModelConfig, layer: int, head: int | None = None) -> None:
    """Raise a one-line :class:`QkovError` unless ``layer`` (and ``head``) exist in ``cfg``."""
    ok = isinstance(layer, int) and 0 <= layer < cfg.n_layers
    if head is not None:
        ok = ok and isinstance(head, int) and 0 <= head < cfg.n_heads
    if not ok:
        what = f"head {layer}.{head}" if head is not None else f"layer {layer}"
        raise QkovError(f"no {what}: the model has {cfg.n_layers} layers x {cfg.n_heads} heads")


def fold_reader(
    W: Tensor, b: Tensor, g: Tensor, beta: Tensor | None, read_dim: int, inplace: bool = False
) -> tuple[Tensor, Tensor]:
    """Fold a LayerNorm's gain ``g`` and bias ``beta`` into a reader ``W`` (bias ``b``); centre ``W``.

    ``W`` reads the normalised stream along ``read_dim`` (size d_model): ``(n * g + beta) @ W =
    n @ (g W) + beta @ W``; then the mean over ``read_dim`` is removed (``n`` has zero mean).
    ``beta=None``: an RMSNorm, whose output ``n`` is not centred: the gain is folded, and nothing
    is centred (removing ``W``'s mean would change ``n @ W``).
    Either stacked over layers (``g, beta [L, D]``; ``W [L, H, D, E]`` or ``[L, D, M]``) or one
    LayerNorm (``g, beta [D]``; ``W [D, V]``, ``[H, D, E]`` or ``[D, M]``, read along ``read_dim``).
    Each output column folds on its own, so one head, one layer or a block of ``W_U``'s
    columns folds exactly as it would inside the whole. ``inplace``: ``W`` itself is changed and
    returned (the same numbers, no new tensor as large as ``W``; for a ``W`` nothing else holds).
    """
    shape = [1] * W.ndim
    if g.ndim == 2:
        shape[0] = g.shape[0]
    shape[read_dim] = g.shape[-1]
    if beta is None:
        return (W.mul_(g.reshape(shape)) if inplace else W * g.reshape(shape)), b
    if beta.ndim == 1:
        read = beta @ W
    elif W.ndim == 4:
        read = torch.einsum("ld,lhde->lhe", beta, W)
    else:
        read = torch.einsum("ld,ldm->lm", beta, W)
    new_W = W.mul_(g.reshape(shape)) if inplace else W * g.reshape(shape)
    mean = new_W.mean(dim=read_dim, keepdim=True)
    return (new_W.sub_(mean) if inplace else new_W - mean), b + read
