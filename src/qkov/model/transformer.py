"""The training model: a small decoder-only transformer (``torch.nn.Module``), nanoGPT-sized.

Every weight is stored with the shape the maths uses (docs/conventions.md), per layer:
``W_E [d_vocab, d_model]``, ``W_pos [n_ctx, d_model]``, per block ``W_Q/W_K/W_V
[n_heads, d_model, d_head]``, ``W_O [n_heads, d_head, d_model]``, MLP ``W_in
[d_model, d_mlp]``, ``W_out [d_mlp, d_model]``, ``W_U [d_model, d_vocab]``. The
stacked views ``model.W_Q`` etc. add the leading layer dimension.

Attention runs fused (``torch.nn.functional.scaled_dot_product_attention``): this module
trains and predicts. Everything that looks inside the model (attention patterns, frozen
patterns, per-head outputs, LayerNorm scales) is the analysis forward's job
(:func:`qkov.analysis.forward.tracer.trace` over :class:`qkov.weights.Weights`), which is tested
against this module.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..device import check_fits
from ..errors import QkovError
from .config import ModelConfig
from . import rotary
from .block import BlockPass
from .bus import BusParameters, make_pass
from .ops import embed, project_heads, stream_start
from . import registry
from .generate import (
    check_options,
    continue_tokens,
    end_ids,
    prompt_tokens,
    sampling_generator,
    texts_of,
)
from .tokens import TextCodec, check_tokens, source_codec

__all__ = ["Attention", "Block", "LayerNorm", "MLP", "ModelPass", "RMSNorm", "Transformer"]

if TYPE_CHECKING:  # pragma: no cover
    from tokenizers import Tokenizer


class LayerNorm(nn.Module):
    """Pre-norm LayerNorm with gain ``w [d_model]`` and bias ``b [d_model]``."""

    def __init__(self, d_model: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.w = nn.Parameter(torch.ones(d_model))
        self.b = nn.Parameter(torch.zeros(d_model))

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.w, self.b, self.eps)


class RMSNorm(nn.Module):
    """Pre-norm RMSNorm: ``x / sqrt(mean(x^2) + eps) * w``, gain ``w [d_model]``, no bias, no centring."""

    def __init__(self, d_model: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.w = nn.Parameter(torch.ones(d_model))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.w, self.eps)


def _norm_layer(cfg: ModelConfig) -> nn.Module | None:
    """The model's pre-norm (LayerNorm, RMSNorm) or ``None``."""
    if cfg.normalization == "layernorm":
        return LayerNorm(cfg.d_model, cfg.ln_eps)
    if cfg.normalization == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.ln_eps)
    return None


class Attention(nn.Module):
    """``n_heads`` independent heads; each writes ``pattern @ (x @ W_V) @ W_O``.

    Grouped-query attention (``n_kv_heads < n_heads``) stores ``W_K, W_V [n_kv_heads, d_model,
    d_head]``: query head ``h`` reads key/value head ``h // (n_heads // n_kv_heads)``. Gated attention
    (``cfg.gate``) adds ``W_G [n_heads, d_model, G]`` (and ``b_G [n_heads, G]`` with biases), ``G = d_head``
    elementwise or 1 headwise: head ``h`` writes ``(z_h * sigmoid(qk_in @ W_G[h] + b_G[h])) @ W_O[h]``.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, d, e, kv = cfg.n_heads, cfg.d_model, cfg.d_head, cfg.kv_heads
        self.cfg = cfg
        self.W_Q = nn.Parameter(torch.empty(h, d, e))
        self.W_K = nn.Parameter(torch.empty(kv, d, e))
        self.W_V = nn.Parameter(torch.empty(kv, d, e))
        self.W_O = nn.Parameter(torch.empty(h, e, d))
        if cfg.bias:
            self.b_Q = nn.Parameter(torch.zeros(h, e))
            self.b_K = nn.Parameter(torch.zeros(kv, e))
            self.b_V = nn.Parameter(torch.zeros(kv, e))
            self.b_O = nn.Parameter(torch.zeros(d))
        else:
            self.register_parameter("b_Q", None)
            self.register_parameter("b_K", None)
            self.register_parameter("b_V", None)
            self.register_parameter("b_O", None)
        if cfg.gate != "none":  # gated attention: the gate's projection of the query position's stream
            self.W_G = nn.Parameter(torch.empty(h, d, cfg.gate_width))
        else:
            self.register_parameter("W_G", None)
        if cfg.gate != "none" and cfg.bias:
            self.b_G = nn.Parameter(torch.zeros(h, cfg.gate_width))
        else:
            self.register_parameter("b_G", None)

    def qkv(self, qk_in: Tensor, v_in: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries ``[batch, heads, seq, d_head]``, keys and values ``[batch, kv_heads, seq, d_head]``
        from the stream inputs (before rotation)."""
        return (
            project_heads(qk_in, self.W_Q, self.b_Q),
            project_heads(qk_in, self.W_K, self.b_K),
            project_heads(v_in, self.W_V, self.b_V),
        )

    def forward(self, body: BlockPass, layer: int, x: Tensor) -> Tensor:
        """The attention output ``[batch, seq, d_model]`` of the block body ``body`` for the stream ``x``
        (:meth:`~qkov.model.block.BlockPass.attention`): called as a module, so torch hooks on it apply."""
        return BlockPass.attention(body, layer, x)


class MLP(nn.Module):
    """``act(x @ W_in + b_in) @ W_out + b_out``; gated (Llama's):
    ``(act(x @ W_gate + b_gate) * (x @ W_in + b_in)) @ W_out + b_out``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.d_mlp is not None
        self.act_fn = cfg.act_fn
        self.W_in = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp))
        self.W_out = nn.Parameter(torch.empty(cfg.d_mlp, cfg.d_model))
        if cfg.gated_mlp:
            self.W_gate = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp))
        else:
            self.register_parameter("W_gate", None)
        if cfg.bias:
            self.b_in = nn.Parameter(torch.zeros(cfg.d_mlp))
            self.b_out = nn.Parameter(torch.zeros(cfg.d_model))
        else:
            self.register_parameter("b_in", None)
            self.register_parameter("b_out", None)
        if cfg.bias and cfg.gated_mlp:
            self.b_gate = nn.Parameter(torch.zeros(cfg.d_mlp))
        else:
            self.register_parameter("b_gate", None)

    def forward(self, body: BlockPass, layer: int, x: Tensor) -> Tensor | None:
        """The MLP output of the block body ``body`` for the stream ``x`` it reads
        (:meth:`~qkov.model.block.BlockPass.mlp`): called as a module, so torch hooks on it apply."""
        return BlockPass.mlp(body, layer, x)


class Block(nn.Module):
    """Attention (and optionally an MLP), each reading and adding to the residual stream."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.ln1 = _norm_layer(cfg)
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg) if cfg.d_mlp is not None else None
        self.ln2 = _norm_layer(cfg) if self.mlp is not None else None

    def parts(self) -> tuple[SimpleNamespace, SimpleNamespace | None]:
        """This block's weights as the block body reads them (:class:`~qkov.model.block.BlockPass`):
        the attention's with its pre-norm, and the MLP's (``None`` without one). No copies."""
        ln1, ln2, a, m = self.ln1, self.ln2, self.attn, self.mlp
        att = SimpleNamespace(
            W_Q=a.W_Q, W_K=a.W_K, W_V=a.W_V, W_O=a.W_O, b_Q=a.b_Q, b_K=a.b_K, b_V=a.b_V, b_O=a.b_O,
            ln_w=None if ln1 is None else ln1.w, ln_b=getattr(ln1, "b", None), W_G=a.W_G, b_G=a.b_G,
        )  # fmt: skip
        if m is None:
            return att, None
        mlp = SimpleNamespace(
            W_in=m.W_in, b_in=m.b_in, W_gate=m.W_gate, b_gate=m.b_gate, W_out=m.W_out, b_out=m.b_out,
            ln_w=None if ln2 is None else ln2.w, ln_b=getattr(ln2, "b", None),
        )  # fmt: skip
        return att, mlp

    def forward(self, x: Tensor, pos: Tensor | None) -> Tensor:
        """One block on the stream ``x [batch, seq, d_model]``; ``pos [seq, d_model]`` the learned
        positions (``None`` without them; only shortformer positions enter here)."""
        return ModelPass(self.cfg, [self], pos, x).block(0, x)


class ModelPass(BlockPass):
    """The block body (:class:`~qkov.model.block.BlockPass`) on a training model's parameters: no hook
    points, so attention and normalisation run fused."""

    def __init__(self, cfg: ModelConfig, blocks: Sequence[Block], pos: Tensor | None, x: Tensor) -> None:
        super().__init__(cfg, cfg.normalization)
        self.pos, self.blocks = pos, blocks
        self.parts = [b.parts() for b in blocks]
        if cfg.positional == "rotary":
            self.turn = rotary.tables(cfg, x.shape[-2], x.device, x.dtype)

    def attention_weights(self, layer: int) -> SimpleNamespace:
        return self.parts[layer][0]

    def mlp_weights(self, layer: int) -> SimpleNamespace | None:
        return self.parts[layer][1]

    def attention(self, l: int, x: Tensor) -> Tensor:
        return self.blocks[l].attn(self, l, x)  # through the module (its hooks), which runs the body's

    def mlp(self, l: int, x: Tensor) -> Tensor | None:
        m = self.blocks[l].mlp
        return None if m is None else m(self, l, x)


def check_config(cfg: Any, *, size: bool = True) -> None:
    """Refuse what is not a :class:`ModelConfig`, and (``size``) a model whose parameters (with the random
    init's temporary copies of its largest matrix) would not fit in the CPU memory free now. Loaders
    (``init=False``) skip the size: their parameters stay untouched until the file's tensors, checked
    against the config first, fill them, and a config that lies is refused naming the tensor."""
    if not isinstance(cfg, ModelConfig):
        got = "None" if cfg is None else f"a {type(cfg).__name__}"
        if cfg is ModelConfig:
            got = "the class ModelConfig itself (call it: qkov.ModelConfig() or qkov.ModelConfig(n_layers=...))"
        raise QkovError(f"qkov.Transformer expects a config, qkov.ModelConfig(...); got {got}")
    if not size:
        return
    D, V = cfg.d_model, cfg.d_vocab
    largest = max(V * D, cfg.n_ctx * D, (cfg.d_mlp or 0) * D, cfg.n_heads * D * cfg.d_head)
    n = cfg.parameter_count()
    check_fits(
        4 * (n + 2 * largest), torch.device("cpu"), f"qkov.Transformer: a model of {n:,} parameters",
        "choose a smaller config", budget=False,
    )  # fmt: skip


class Transformer(nn.Module):
    """A decoder-only transformer (attention-only by default, as the paper's models).

    ``model(tokens)`` returns logits. To look inside (patterns, per-head outputs, frozen
    patterns), run the analysis forward on its weights: ``qkov.trace(Weights.from_model(model), tokens)``.
    """

    def __init__(self, cfg: ModelConfig, *, seed: int | None = None, init: bool = True) -> None:
        """``init=False`` leaves the parameters uninitialised, for a caller that loads every one of
        them next (checkpoint and import loaders: :func:`qkov.io.checkpoint.load_state` refuses a
        state that misses any); it saves the random init, ~3 s at GPT-2 size.

        Raises:
            QkovError: ``cfg`` is not a :class:`ModelConfig`, or (``init``) its parameters would not fit
                in the memory free now (checked before any is allocated).
        """
        check_config(cfg, size=init)
        super().__init__()
        self.cfg = cfg
        self.tokenizer: Tokenizer | None = None
        self.bos_token_id: int = 0
        # whether texts get the start token unless asked (to_tokens, every command that reads a
        # text): true for qkov's models, GPT-2 and Pythia (TransformerLens' convention); a
        # Llama-family directory sets what its own tokenizer does
        self.default_prepend_bos: bool = True
        self.W_E = nn.Parameter(torch.empty(cfg.d_vocab, cfg.d_model))
        if cfg.positional in ("standard", "shortformer"):
            self.W_pos = nn.Parameter(torch.empty(cfg.n_ctx, cfg.d_model))
        else:
            self.register_parameter("W_pos", None)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        # the residual bus of a routed model (qkov.model.bus), per effective sublayer; None for the sum
        self.bus = BusParameters(cfg) if cfg.residual != "sum" else None
        self.ln_final = _norm_layer(cfg)
        self.W_U = nn.Parameter(torch.empty(cfg.d_model, cfg.d_vocab))
        if cfg.bias:
            self.b_U = nn.Parameter(torch.zeros(cfg.d_vocab))
        else:
            self.register_parameter("b_U", None)
        if init:
            self.reset_parameters(seed)

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Normal(0, 0.8/sqrt(d_model)) for every matrix, zeros for biases, ones for LN gains."""
        gen = torch.Generator(device="cpu")
        if seed is not None:
            gen.manual_seed(seed)
        else:
            gen.seed()
        std = 0.8 / math.sqrt(self.cfg.d_model)
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf.startswith("W_"):
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif leaf == "w":
                p.fill_(1.0)
            else:
                p.zero_()
        if self.bus is not None:
            self.bus.reset_parameters(gen)

    # ------------------------------------------------------- stacked views
    def _stack(self, getter: Any) -> Tensor:
        if not self.blocks:
            raise QkovError("this model has no layers")
        return torch.stack([getter(b) for b in self.blocks])

    @property
    def W_Q(self) -> Tensor:
        """``[n_layers, n_heads, d_model, d_head]``"""
        return self._stack(lambda b: b.attn.W_Q)

    @property
    def W_K(self) -> Tensor:
        """``[n_layers, n_kv_heads, d_model, d_head]``"""
        return self._stack(lambda b: b.attn.W_K)

    @property
    def W_V(self) -> Tensor:
        """``[n_layers, n_kv_heads, d_model, d_head]``"""
        return self._stack(lambda b: b.attn.W_V)

    @property
    def W_O(self) -> Tensor:
        """``[n_layers, n_heads, d_head, d_model]``"""
        return self._stack(lambda b: b.attn.W_O)

    # --------------------------------------------------------------- input
    def check_tokens(self, tokens: Tensor | Any) -> Tensor:
        """Validate token ids (:func:`qkov.model.tokens.check_tokens`): ``[batch, seq]`` long, on the model's device."""
        return check_tokens(tokens, self.cfg).to(self.W_E.device)

    @property
    def codec(self) -> TextCodec:
        """The model's :class:`~qkov.model.tokens.TextCodec`: texts to ids with one start token,
        ids to readable strings (needs a tokenizer)."""
        return source_codec(self)

    def to_tokens(self, text: str | Sequence[str], *, prepend_bos: bool | None = None) -> Tensor:
        """Encode ``text`` -> ``[1, seq]`` (a list of texts of equal token counts -> ``[batch, seq]``).

        The start token comes first exactly once when ``prepend_bos`` (``None``: the model's
        :attr:`default_prepend_bos`), whether or not the tokenizer adds one itself; ``False``: none."""
        return self.check_tokens(self.codec.encode_texts(text, prepend_bos=prepend_bos))

    def to_str_tokens(self, tokens: Tensor | str | Sequence[int], *, prepend_bos: bool | None = None) -> list[str]:
        """Readable token strings of a text (encoded as :meth:`to_tokens` does) or of a ``[seq]`` /
        ``[1, seq]`` sequence of ids: SentencePiece's ``▁`` shown as a space, byte tokens as ``<0x0A>``."""
        codec = self.codec
        if isinstance(tokens, str):
            return codec.str_tokens(codec.encode(tokens, prepend_bos=prepend_bos))
        ids = torch.as_tensor(tokens)
        if ids.ndim > 1 and ids.shape[0] != 1:
            raise QkovError(f"to_str_tokens: expected one sequence, got shape {tuple(ids.shape)}")
        return codec.str_tokens(ids)

    def to_single_token(self, word: str) -> int:
        """The id of ``word`` as one token (with or without its leading space: ``"Tim"`` finds
        ``▁Tim`` / ``ĠTim``); a :class:`QkovError` shows how it splits when no spelling is one token."""
        return self.codec.single_token(word)

    def to_string(self, tokens: Tensor | Sequence[int]) -> str:
        """The text of a sequence of ids, as the tokenizer decodes it (special tokens kept)."""
        return self.codec.decode(tokens)

    # ---------------------------------------------- TransformerLens' habits
    def run_with_cache(
        self,
        input: str | Sequence[str] | Tensor,
        names_filter: Any = None,
        *,
        prepend_bos: bool | None = None,
        stream: str | None = None,
        return_type: str | None = "logits",
    ) -> tuple[Any, Any]:
        """TransformerLens' ``run_with_cache``: ``(logits [batch, seq, d_vocab], cache)`` for a text,
        texts of equal token counts or ids; the cache is a :class:`~qkov.Trace` that TransformerLens hook
        names and qkov site names both index, ``names_filter`` as TransformerLens' (``None``: every site).
        The logits are ``model(tokens)``'s; ``stream="model"``: the sites hold the model's own residual
        stream (else, with LayerNorm, the writers are centred). Runs
        :func:`qkov.analysis.forward.lens.run_with_cache` (registered by the analysis package:
        :mod:`qkov.model.registry`)."""
        kw = dict(prepend_bos=prepend_bos, stream=stream, return_type=return_type)
        return registry.call("run_with_cache", self, input, names_filter, **kw)  # type: ignore[no-any-return]

    def run_with_hooks(
        self,
        input: str | Sequence[str] | Tensor,
        fwd_hooks: Sequence[tuple[Any, Callable[..., Tensor | None]]] = (),
        *,
        bwd_hooks: Sequence[Any] = (),
        prepend_bos: bool | None = None,
        stream: str | None = None,
        return_type: str | None = "logits",
    ) -> Any:
        """TransformerLens' ``run_with_hooks``: the logits ``[batch, seq, d_vocab]`` (or what
        ``return_type`` asks) with ``fwd_hooks = [(hook name, fn(activation, hook))]`` applied, each
        ``fn`` returning a replacement or ``None``; which hook points are supported is listed in
        :mod:`qkov.analysis.forward.lens`, whose :func:`~qkov.analysis.forward.lens.run_with_hooks` this runs."""
        kw = dict(bwd_hooks=bwd_hooks, prepend_bos=prepend_bos, stream=stream, return_type=return_type)
        return registry.call("run_with_hooks", self, input, fwd_hooks, **kw)

    def generate(
        self,
        input: str | Sequence[str] | Tensor,
        max_new_tokens: int = 10,
        *,
        stop_at_eos: bool = True,
        eos_token_id: int | Sequence[int] | None = None,
        do_sample: bool = True,
        top_k: int | None = None,
        temperature: float = 1.0,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        prepend_bos: bool | None = None,
        return_type: str = "input",
    ) -> str | list[str] | Tensor:
        """TransformerLens' ``generate``: continue ``input`` (a text, which gets one start token, added
        once; texts of equal token counts; or ids ``[batch, seq]``) by up to ``max_new_tokens`` tokens
        (:mod:`qkov.model.generate`). Greedy at ``temperature=0`` (or ``do_sample=False``), else sampled
        from ``softmax(logits / temperature)`` over the ``top_k`` most likely tokens with ``generator`` (or
        one seeded with ``seed``; neither: torch's global generator, as TransformerLens; the same seed gives
        TransformerLens' tokens). ``stop_at_eos``: stop a sequence at ``eos_token_id`` (one id or several;
        ``None``: the start token, which also ends a text in qkov's models and GPT-2; pass Llama's ``</s>``),
        padding it with that token until every sequence has ended. The prompt and the new tokens must fit
        ``n_ctx``. ``return_type``: ``"input"`` (text for text, ids for ids), ``"str"`` (the whole text
        without special tokens, as TransformerLens decodes it: a string for one sequence, else a list) or
        ``"tokens"`` (``[batch, seq + new]``, the prompt included)."""
        check_options(self, max_new_tokens, temperature, top_k, return_type)
        tokens, as_text, skip = prompt_tokens(self, input, prepend_bos)
        ends, draw = end_ids(self, eos_token_id) if stop_at_eos else None, sampling_generator(self, seed, generator)
        new = continue_tokens(
            self, tokens, max_new_tokens, temperature=temperature if do_sample else 0, top_k=top_k, generator=draw, ends=ends
        )
        return new if return_type == "tokens" or (return_type == "input" and not as_text) else texts_of(self, new, skip)

    # ------------------------------------------------------------- forward
    def effective_blocks(self) -> list[Block]:
        """The blocks in the order the forward runs them: effective layer ``l`` is stored block
        ``l % n_layers``, ``n_layers * loop`` of them (the stored blocks themselves when ``loop == 1``)."""
        n = len(self.blocks)
        return [self.blocks[l % n] for l in range(n * self.cfg.loop)]

    def stream(self, tokens: Tensor) -> Tensor:
        """The final residual stream ``[batch, seq, d_model]`` (before the final LayerNorm) of checked ids; for a
        routed model (:mod:`qkov.model.bus`) the bus's final read (its blocks run in one body: torch hooks on a
        ``Block`` module do not apply there, hooks on its ``attn`` and ``mlp`` modules do)."""
        x, pos = embed(tokens, self.W_E, self.W_pos)
        x = stream_start(x, pos, self.cfg.positional)
        blocks = self.effective_blocks()
        if self.bus is not None:  # a routed model: one body over every effective block, its stream through the bus
            body = ModelPass(self.cfg, blocks, pos, x)
            body.bus = make_pass(self.cfg, self.bus.tensors(), body.at)
            body.bus.start(x)
            for l in range(len(blocks)):
                body.block(l, x)
            return body.bus.final()
        for block in blocks:  # each through its module call: torch hooks on a block still apply
            x = block(x, pos)
        return x

    def unembed(self, resid: Tensor) -> Tensor:
        """Final residual stream ``[..., d_model]`` -> logits ``[..., d_vocab]`` (final LayerNorm included)."""
        if self.ln_final is not None:
            resid = self.ln_final(resid)
        logits = resid @ self.W_U
        if self.b_U is not None:
            logits = logits + self.b_U
        return logits

    def forward(self, tokens: Tensor) -> Tensor:
        """Token ids ``[batch, seq]`` (or ``[seq]``) -> logits ``[batch, seq, d_vocab]``."""
        return self.unembed(self.stream(self.check_tokens(tokens)))

    # -------------------------------------------------------------- counts
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
