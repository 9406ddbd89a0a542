"""What a training run holds in memory, estimated from its configs before anything is allocated, and
the refusal of a run that would not fit (:func:`check_training_fits`)."""

from __future__ import annotations

import torch

from ..device import check_fits
from ..model.config import ModelConfig

__all__ = ["activation_floats", "check_training_fits", "loss_floats", "training_bytes"]


def activation_floats(cfg: ModelConfig, batch: int) -> int:
    """Floats a float32 training step keeps for its backward pass on ``batch`` sequences of ``n_ctx``
    tokens, estimated from the shapes on the high side (tested against what autograd keeps: between
    1 and 2 times it): per layer and token the stream, the query/key input and the attention's
    output, queries, keys, values, the heads' outputs and their concatenation, the attention's
    log-sum-exp, each normaliser's input and output, and the MLP's input and hidden layers; then the
    final stream and the loss's input gradient, and the loss's ``[d_model, d_vocab]`` gradient."""
    D, H, E, KV, M = cfg.d_model, cfg.n_heads, cfg.d_head, cfg.kv_heads, cfg.d_mlp or 0
    norms = 0 if cfg.normalization == "none" else 2 * D
    layer = 4 * D + (3 * H + 2 * KV) * E + H + norms + 2 * H * cfg.gate_width  # a gate's logits and values
    if cfg.d_mlp is not None:
        layer += D + M * (5 if cfg.gated_mlp else 2) + norms
    tokens = batch * cfg.n_ctx
    return tokens * (cfg.n_layers * cfg.loop * layer + 2 * D + norms // 2) + D * cfg.d_vocab  # effective layers


def loss_floats(cfg: ModelConfig, batch: int, precision: str = "fp32") -> int:
    """Floats the loss works in for a moment (not kept): float32 computes the unembedding and the
    softmax 1024 rows at a time (:mod:`qkov.training.losses`), the logits and a copy of them; bf16
    holds every row's logits, their float32 copy and the softmax."""
    rows = batch * cfg.n_ctx
    return (3 * rows if precision == "bf16" else 2 * min(rows, 1024)) * cfg.d_vocab


def training_bytes(cfg: ModelConfig, batch: int, precision: str = "fp32") -> int:
    """Bytes a training step holds at its peak: the parameters, their gradients and AdamW's two
    moments (16 bytes per parameter), :func:`activation_floats` and :func:`loss_floats` (4 bytes each)."""
    return 16 * cfg.parameter_count() + 4 * (activation_floats(cfg, batch) + loss_floats(cfg, batch, precision))


def check_training_fits(cfg: ModelConfig, batch: int, device: torch.device, precision: str = "fp32") -> None:
    """Refuse, before the model exists, a run whose :func:`training_bytes` exceed the memory free on
    ``device`` (``batch``: the sequences one process computes at a time).

    Raises:
        QkovError: it would not fit (hint ``size``: a smaller model, context or batch).
    """
    check_fits(
        training_bytes(cfg, batch, precision),
        device,
        f"train: a model of {cfg.parameter_count():,} parameters with its gradients and optimizer state, and the "
        f"activations of {batch} sequences of {cfg.n_ctx} tokens,",
        "train a smaller model, or fewer or shorter sequences at a time",
        hint="size",
        budget=False,
    )
