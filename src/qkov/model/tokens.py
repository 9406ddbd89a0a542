"""Token ids in and token strings out: the checks every entry point applies to ids, and the
one decoder of single tokens (with a tokenizer, or ``<id>`` without one)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from ..errors import QkovError
from .config import ModelConfig


def check_tokens(tokens: Tensor | Any, cfg: ModelConfig) -> Tensor:
    """Validate token ids for ``cfg`` and return them as a ``[batch, seq]`` long tensor.

    Accepts ``[seq]`` or ``[batch, seq]`` integers (a tensor, array or nested list).

    Raises:
        QkovError: not integers, wrong rank, empty, longer than ``n_ctx``, or an id outside
            ``[0, d_vocab)``.
    """
    if not isinstance(tokens, Tensor):
        try:
            tokens = torch.as_tensor(tokens)
        except (TypeError, ValueError) as exc:
            raise QkovError(f"tokens: expected integer ids, got {type(tokens).__name__}") from exc
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool or tokens.is_complex():
        raise QkovError(f"tokens: expected integer ids, got dtype {tokens.dtype}")
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2:
        raise QkovError(f"tokens: expected shape [batch, seq] or [seq], got {tuple(tokens.shape)}")
    if tokens.shape[1] == 0:
        raise QkovError("tokens: empty sequence")
    if tokens.shape[1] > cfg.n_ctx:
        raise QkovError(f"tokens: sequence of {tokens.shape[1]} is longer than n_ctx={cfg.n_ctx}")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= cfg.d_vocab:
        bad = lo if lo < 0 else hi
        raise QkovError(f"tokens: id {bad} out of range [0, {cfg.d_vocab})")
    return tokens.long()


def token_decoder(tokenizer: Any | None) -> Callable[[int], str]:
    """``decode(id) -> str`` for one token: the tokenizer's string (special tokens kept), or
    ``"<id>"`` when there is no tokenizer. Strings are cached per id."""
    cache: dict[int, str] = {}

    def decode(i: int) -> str:
        i = int(i)
        if i not in cache:
            cache[i] = f"<{i}>" if tokenizer is None else tokenizer.decode([i], skip_special_tokens=False)
        return cache[i]

    return decode
