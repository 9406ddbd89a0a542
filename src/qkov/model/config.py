"""Model configuration: the shape and kind of a decoder-only transformer.

Conventions (docs/conventions.md): row vectors (``x @ W``), per-head weights
``W_Q/W_K/W_V [layer, head, d_model, d_head]`` and ``W_O [layer, head, d_head, d_model]``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import QkovError, check_choice, check_int

Positional = Literal["shortformer", "standard", "none"]
Normalization = Literal["none", "layernorm"]

POSITIONAL_CHOICES: tuple[str, ...] = ("shortformer", "standard", "none")
NORMALIZATION_CHOICES: tuple[str, ...] = ("none", "layernorm")
ACTIVATION_CHOICES: tuple[str, ...] = ("gelu", "gelu_new", "relu")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a qkov transformer.

    Attributes:
        n_layers: number of blocks; 0 gives embedding -> unembedding (a bigram model).
        n_heads: attention heads per layer.
        d_model: width of the residual stream.
        d_head: width of each head's query/key/value.
        d_vocab: vocabulary size.
        n_ctx: longest sequence the model accepts (positions 0 .. n_ctx-1); at least 2.
        positional: ``shortformer`` (positions added to the query/key input only, as the
            paper's models), ``standard`` (added to the residual stream) or ``none``.
        normalization: ``none`` (the paper's attention-only models) or ``layernorm``
            (pre-norm: before attention, before the MLP and before the unembedding).
        d_mlp: width of an MLP after each attention layer, or ``None`` for attention-only.
        act_fn: MLP non-linearity.
        bias: whether Q/K/V/O, MLP and unembedding carry biases (imported models do;
            the paper's models do not).
        ln_eps: LayerNorm epsilon.
    """

    n_layers: int = 2
    n_heads: int = 4
    d_model: int = 128
    d_head: int = 32
    d_vocab: int = 1024
    n_ctx: int = 256
    positional: Positional = "shortformer"
    normalization: Normalization = "none"
    d_mlp: int | None = None
    act_fn: str = "gelu"
    bias: bool = False
    ln_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("n_heads", "d_model", "d_head", "d_vocab"):
            check_int("config", name, getattr(self, name))
        check_int("config", "n_ctx", self.n_ctx, minimum=2)  # a start token and one token to predict
        check_int("config", "n_layers", self.n_layers, minimum=0)
        check_choice("config", "positional", self.positional, POSITIONAL_CHOICES)
        check_choice("config", "normalization", self.normalization, NORMALIZATION_CHOICES)
        if self.d_mlp is not None and (not isinstance(self.d_mlp, int) or self.d_mlp < 1):
            raise QkovError(f"config: d_mlp must be a positive integer or null, got {self.d_mlp!r}")
        check_choice("config", "act_fn", self.act_fn, ACTIVATION_CHOICES)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        if not isinstance(data, dict):
            raise QkovError("config: expected a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise QkovError(f"config: unknown field(s) {', '.join(unknown)}")
        return cls(**data)

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)
