"""Model configuration: the shape and kind of a decoder-only transformer.

Conventions follow SPEC.md: row vectors (``x @ W``), per-head weights
``W_Q/W_K/W_V [layer, head, d_model, d_head]`` and ``W_O [layer, head, d_head, d_model]``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from .errors import QkovError

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
        n_ctx: longest sequence the model accepts (positions 0 .. n_ctx-1).
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
        for name in ("n_heads", "d_model", "d_head", "d_vocab", "n_ctx"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise QkovError(f"config: {name} must be a positive integer, got {value!r}")
        if not isinstance(self.n_layers, int) or isinstance(self.n_layers, bool) or self.n_layers < 0:
            raise QkovError(f"config: n_layers must be an integer >= 0, got {self.n_layers!r}")
        if self.positional not in POSITIONAL_CHOICES:
            raise QkovError(
                f"config: positional must be one of {', '.join(POSITIONAL_CHOICES)}, got {self.positional!r}"
            )
        if self.normalization not in NORMALIZATION_CHOICES:
            raise QkovError(
                f"config: normalization must be one of {', '.join(NORMALIZATION_CHOICES)}, got {self.normalization!r}"
            )
        if self.d_mlp is not None and (not isinstance(self.d_mlp, int) or self.d_mlp < 1):
            raise QkovError(f"config: d_mlp must be a positive integer or null, got {self.d_mlp!r}")
        if self.act_fn not in ACTIVATION_CHOICES:
            raise QkovError(f"config: act_fn must be one of {', '.join(ACTIVATION_CHOICES)}, got {self.act_fn!r}")

    @property
    def attn_only(self) -> bool:
        return self.d_mlp is None

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
