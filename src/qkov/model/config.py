"""Model configuration: the shape and kind of a decoder-only transformer.

Conventions (docs/conventions.md): row vectors (``x @ W``), per-head weights
``W_Q/W_K/W_V [layer, head, d_model, d_head]`` and ``W_O [layer, head, d_head, d_model]``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import QkovError, check_choice, check_int

__all__ = [
    "ACTIVATION_CHOICES",
    "GATE_CHOICES",
    "ModelConfig",
    "Normalization",
    "NORMALIZATION_CHOICES",
    "Positional",
    "POSITIONAL_CHOICES",
    "RESIDUAL_CHOICES",
    "ROPE_SCALINGS",
]

Positional = Literal["shortformer", "standard", "rotary", "none"]
Normalization = Literal["none", "layernorm", "rmsnorm"]
Residual = Literal["sum", "attnres", "attnres-block", "hyper", "mhc"]

POSITIONAL_CHOICES: tuple[str, ...] = ("shortformer", "standard", "rotary", "none")
NORMALIZATION_CHOICES: tuple[str, ...] = ("none", "layernorm", "rmsnorm")
ACTIVATION_CHOICES: tuple[str, ...] = ("gelu", "gelu_new", "relu", "silu")
GATE_CHOICES: tuple[str, ...] = ("none", "elementwise", "headwise")
"""Gated attention (Qiu et al. 2025): none, one sigmoid gate per head and channel, or one per head."""
RESIDUAL_CHOICES: tuple[str, ...] = ("sum", "attnres", "attnres-block", "hyper", "mhc")
"""How sublayers read and write the residual stream (:mod:`qkov.model.bus`): the fixed sum, Attention
Residuals (whole or in blocks), hyper-connections, manifold-constrained hyper-connections."""
ROPE_SCALINGS: tuple[str, ...] = ("linear", "llama3")
"""The rotary frequency rescalings qkov implements exactly (see :mod:`qkov.model.rotary`); the
others some checkpoints ship (dynamic, yarn, longrope) are refused on import, never ignored."""
_ROPE_KEYS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


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
            paper's models), ``standard`` (added to the residual stream), ``rotary``
            (queries and keys rotated by their position: Pythia, Llama, Mistral, Qwen2) or ``none``.
        normalization: ``none`` (the paper's attention-only models), ``layernorm`` or ``rmsnorm``
            (pre-norm: before attention, before the MLP and before the unembedding; RMSNorm
            divides by the root mean square and has a gain but no bias and no centring).
        d_mlp: width of an MLP after each attention layer, or ``None`` for attention-only.
        act_fn: MLP non-linearity.
        bias: whether Q/K/V/O, MLP and unembedding carry biases (imported models do;
            the paper's models do not). An imported family with only some biases (Qwen2:
            Q/K/V only) carries zeros for the others.
        ln_eps: normalisation epsilon (LayerNorm or RMSNorm).
        n_kv_heads: key/value heads (grouped-query attention: query head ``h`` reads key/value
            head ``h // (n_heads // n_kv_heads)``); ``None`` means ``n_heads``.
        gated_mlp: the MLP is ``(act(x W_gate) * (x W_in)) W_out`` (Llama's SiLU-gated MLP).
        parallel: attention and MLP both read the block's input stream and add to it
            together (GPT-NeoX's ``use_parallel_residual``), instead of one after the other.
        rotary_dim: how many of each head's dimensions rotate (``None``: all of them; Pythia
            rotates a quarter); only for ``positional="rotary"``.
        rotary_base: the rotary frequencies' base (theta).
        rope_scaling: ``None`` or a rescaling of the rotary frequencies, ``{"rope_type":
            "linear", "factor": f}`` or ``{"rope_type": "llama3", "factor", "low_freq_factor",
            "high_freq_factor", "original_max_position_embeddings"}`` (Llama 3.1).
        gate: gated attention (Qiu et al. 2025, arXiv 2505.06708): ``none``, ``elementwise`` or
            ``headwise``; each head's output ``z`` is multiplied, before ``W_O``, by
            ``sigmoid(qk_in @ W_G[h] + b_G[h])`` of its query position (``[d_head]`` values per
            head elementwise, one headwise); docs/architectures.md.
        loop: looped depth: the ``n_layers`` stored blocks are applied ``loop`` times (effective
            layer ``l`` runs block ``l % n_layers``); :meth:`unrolled` is the model every analysis sees.
        residual: how sublayers read and write the stream (:data:`RESIDUAL_CHOICES`,
            :mod:`qkov.model.bus`): ``sum`` (``x + out``, every model before these options),
            ``attnres`` / ``attnres-block`` (Attention Residuals), ``hyper`` (hyper-connections),
            ``mhc`` (manifold-constrained hyper-connections).
        attnres_block: sublayers per block of ``attnres-block`` (required there, refused elsewhere).
        n_streams: copies of the stream for ``hyper`` / ``mhc`` (1 elsewhere).
        hyper_dynamic: ``hyper`` only: add the dynamic (input-dependent) hyper-connection terms.
        sinkhorn_iters: ``mhc``: Sinkhorn-Knopp iterations projecting the mixing matrix.
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
    n_kv_heads: int | None = None
    gated_mlp: bool = False
    parallel: bool = False
    rotary_dim: int | None = None
    rotary_base: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    gate: Literal["none", "elementwise", "headwise"] = "none"
    loop: int = 1
    residual: Residual = "sum"
    attnres_block: int | None = None
    n_streams: int = 1
    hyper_dynamic: bool = False
    sinkhorn_iters: int = 20

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
        if self.n_kv_heads is not None:
            check_int("config", "n_kv_heads", self.n_kv_heads)
            if self.n_heads % self.n_kv_heads:
                raise QkovError(
                    f"config: n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
                )
        if self.gated_mlp and self.d_mlp is None:
            raise QkovError("config: gated_mlp needs an MLP (d_mlp)")
        if self.parallel and self.d_mlp is None:
            raise QkovError("config: parallel attention and MLP needs an MLP (d_mlp)")
        self._check_rotary()
        check_choice("config", "gate", self.gate, GATE_CHOICES)
        check_int("config", "loop", self.loop)
        self._check_residual()

    def _check_residual(self) -> None:
        check_choice("config", "residual", self.residual, RESIDUAL_CHOICES)
        check_int("config", "n_streams", self.n_streams)
        check_int("config", "sinkhorn_iters", self.sinkhorn_iters)
        if self.n_streams > 1 and self.residual not in ("hyper", "mhc"):
            raise QkovError(f"config: n_streams > 1 needs residual 'hyper' or 'mhc', not {self.residual!r}")
        if not isinstance(self.hyper_dynamic, bool) or (self.hyper_dynamic and self.residual != "hyper"):
            raise QkovError("config: hyper_dynamic (true or false) applies to residual 'hyper' only")
        if self.residual == "attnres-block":
            if self.attnres_block is None:
                raise QkovError("config: residual 'attnres-block' needs attnres_block (sublayers per block)")
            check_int("config", "attnres_block", self.attnres_block)
        elif self.attnres_block is not None:
            raise QkovError("config: attnres_block applies to residual 'attnres-block' only")

    def _check_rotary(self) -> None:
        rotary = self.positional == "rotary"
        if not rotary and (self.rotary_dim is not None or self.rope_scaling is not None):
            raise QkovError("config: rotary_dim and rope_scaling apply to positional='rotary' only")
        if self.rotary_dim is not None:
            check_int("config", "rotary_dim", self.rotary_dim, minimum=2)
            if self.rotary_dim % 2 or self.rotary_dim > self.d_head:
                raise QkovError(
                    f"config: rotary_dim must be even and at most d_head ({self.d_head}), got {self.rotary_dim}"
                )
        if not (isinstance(self.rotary_base, (int, float)) and self.rotary_base > 1):
            raise QkovError(f"config: rotary_base must be a number above 1, got {self.rotary_base!r}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type") if isinstance(self.rope_scaling, dict) else None
            if kind not in ROPE_SCALINGS:
                known = ", ".join(ROPE_SCALINGS)
                raise QkovError(f"config: rope scaling {kind!r} is not supported (qkov implements {known} exactly)")
            for key in _ROPE_KEYS[kind]:
                value = self.rope_scaling.get(key)
                if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                    raise QkovError(f"config: rope scaling {kind!r} needs a positive {key}, got {value!r}")

    def describe(self) -> str:
        """One line: shape and kind, e.g. ``2 layers x 8 heads (2 kv heads), d_model 64, ...``."""
        kv = f" ({self.kv_heads} kv heads)" if self.kv_heads != self.n_heads else ""
        pos = self.positional
        if pos == "rotary":
            extra = [f"{self.rotary_width} of {self.d_head} dims", f"base {self.rotary_base:g}"]
            if self.rope_scaling is not None:
                extra.append(f"{self.rope_scaling['rope_type']} x{self.rope_scaling['factor']:g}")
            pos += f" ({', '.join(extra)})"
        mlp = "none" if self.d_mlp is None else f"{self.d_mlp} ({'gated ' if self.gated_mlp else ''}{self.act_fn})"
        return (
            f"{self.n_layers} layers x {self.n_heads} heads{kv}, d_model {self.d_model}, d_head {self.d_head}, "
            f"vocab {self.d_vocab}, ctx {self.n_ctx}, positions {pos}, norm {self.normalization}, mlp {mlp}"
            + (", attention and MLP in parallel" if self.parallel else "")
            + (f", {self.gate} attention gate" if self.gate != "none" else "")
            + (f", looped x{self.loop} ({self.n_layers * self.loop} effective layers)" if self.loop != 1 else "")
            + ("" if self.residual == "sum" else f", residual {self.residual_text}")
        )

    @property
    def residual_text(self) -> str:
        """The residual scheme in words (``attnres-block (4 sublayers)``, ``hyper (2 streams, dynamic)``)."""
        if self.residual == "attnres-block":
            return f"attnres-block ({self.attnres_block} sublayers)"
        if self.residual in ("hyper", "mhc"):
            extra = ", dynamic" if self.hyper_dynamic else ""
            extra += f", {self.sinkhorn_iters} Sinkhorn iterations" if self.residual == "mhc" else ""
            return f"{self.residual} ({self.n_streams} streams{extra})"
        return self.residual

    @property
    def sublayers(self) -> int:
        """Sublayers the residual bus connects: attention then MLP per layer (one per layer when
        attention-only or parallel); the final read is aggregation point ``sublayers``."""
        layers = self.n_layers * getattr(self, "loop", 1)  # effective layers (a looped model unrolls)
        return layers * (2 if self.d_mlp is not None and not self.parallel else 1)

    def bus_parameters(self) -> int:
        """Parameters of the residual bus (0 for ``sum``; :mod:`qkov.model.bus`)."""
        S, D, n = self.sublayers, self.d_model, self.n_streams
        if self.residual in ("attnres", "attnres-block"):
            return 2 * (S + 1) * D  # a pseudo-query and a key RMSNorm gain per aggregation point
        if self.residual == "hyper":
            static = n + n * n + n
            dynamic = (D * (1 + 1 + n) + 2) if self.hyper_dynamic else 0  # W_beta, W_m, W_r, s_alpha, s_beta
            return S * (static + dynamic)
        if self.residual == "mhc":
            # RMSNorm gain [nD], projections [nD, n + n + n*n], three scales, biases n + n + n*n
            return S * (n * D + n * D * (2 * n + n * n) + 3 + 2 * n + n * n)
        return 0

    def parameter_count(self) -> int:
        """Parameters of a :class:`~qkov.Transformer` with this config, counted from the shapes
        alone (nothing allocated): what ``Transformer(cfg).num_parameters()`` returns."""
        D, H, E, KV, M = self.d_model, self.n_heads, self.d_head, self.kv_heads, self.d_mlp or 0
        norm = {"none": 0, "layernorm": 2 * D, "rmsnorm": D}[self.normalization]
        attn = (H + 2 * KV) * D * E + H * E * D + (((H + 2 * KV) * E + D) if self.bias else 0)
        attn += H * self.gate_width * (D + (1 if self.bias else 0))
        mlp = 0
        if self.d_mlp is not None:
            mlp = (3 if self.gated_mlp else 2) * D * M + norm
            mlp += (M + D + (M if self.gated_mlp else 0)) if self.bias else 0
        pos = self.n_ctx * D if self.positional in ("standard", "shortformer") else 0
        unembed = D * self.d_vocab + (self.d_vocab if self.bias else 0)
        return self.d_vocab * D + pos + self.n_layers * (norm + attn + mlp) + norm + unembed + self.bus_parameters()

    @property
    def kv_heads(self) -> int:
        """Key/value heads per layer (``n_heads`` unless grouped-query)."""
        return self.n_kv_heads or self.n_heads

    @property
    def gate_width(self) -> int:
        """Gate values per head: ``d_head`` (elementwise), 1 (headwise), 0 (no gate)."""
        return {"none": 0, "elementwise": self.d_head, "headwise": 1}[self.gate]

    def unrolled(self) -> "ModelConfig":
        """The same model with its loop written out: ``n_layers * loop`` layers, ``loop=1`` (the
        config every analysis sees; effective layer ``l`` holds stored block ``l % n_layers``)."""
        return self if self.loop == 1 else self.replace(n_layers=self.n_layers * self.loop, loop=1)

    @property
    def rotary_width(self) -> int:
        """Rotated dimensions per head (0 for a model without rotary positions)."""
        if self.positional != "rotary":
            return 0
        return self.rotary_dim or self.d_head

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
