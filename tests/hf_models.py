"""Small random models of the modern families, built with ``transformers``' own config and model
classes and saved with ``save_pretrained``: the offline stand-ins for Pythia, Llama, Mistral and
Qwen2 checkpoints (the tests never reach a model hub)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SMALL = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (family, config overrides)
    "neox-parallel": ("gpt_neox", dict(rotary_pct=0.25, rotary_emb_base=500.0, intermediate_size=64)),
    "neox-sequential": ("gpt_neox", dict(use_parallel_residual=False, rotary_pct=0.5, intermediate_size=64)),
    "llama-gqa-bias": (
        "llama",
        dict(num_key_value_heads=2, intermediate_size=48, attention_bias=True, mlp_bias=True, head_dim=12),
    ),
    "llama-llama3-tied": (
        "llama",
        dict(
            num_key_value_heads=1,
            intermediate_size=48,
            tie_word_embeddings=True,
            rope_theta=5000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "llama-linear": ("llama", dict(intermediate_size=48, rope_scaling=dict(rope_type="linear", factor=4.0))),
    "mistral-window": ("mistral", dict(num_key_value_heads=2, intermediate_size=48, sliding_window=10)),
    "qwen2-window": (
        "qwen2",
        dict(
            num_key_value_heads=2, intermediate_size=48, use_sliding_window=True, sliding_window=12, max_window_layers=1
        ),
    ),
}


def build(name: str, seed: int = 0) -> Any:
    """The ``transformers`` model of variant ``name`` (float32, eval), random, with norm gains and
    biases moved away from their trivial init and logits of a few units."""
    import transformers as tf

    family, overrides = VARIANTS[name]
    config_cls, model_cls = {
        "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM),
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
    }[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**SMALL, "initializer_range": 0.15, **overrides})).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n and n.endswith("weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def save(name: str, folder: Path, *, dtype: torch.dtype = torch.float32, shard: str | None = None) -> Path:
    """Build variant ``name`` and ``save_pretrained`` it into ``folder`` (in ``dtype``; sharded
    into files of at most ``shard``, e.g. ``"20KB"``)."""
    model = build(name).to(dtype)
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, **kw)
    return folder


# TransformerLens 3.9 cannot express: Llama's attention/MLP biases (its converter writes zeros)
# and the linear rope scaling; every other variant converts (built by hand: its from_pretrained
# needs a Hub name).
TL_VARIANTS = ("neox-parallel", "neox-sequential", "llama-llama3-tied", "mistral-window", "qwen2-window")


def hooked(hf: Any, n_ctx: int | None = None) -> Any:
    """A TransformerLens ``HookedTransformer`` of a ``transformers`` model of these families,
    converted with TransformerLens' own weight converters and its default weight processing
    (``n_ctx``: its context, default the model's ``max_position_embeddings``)."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained import weight_conversions as wc

    c, arch = hf.config, type(hf).__name__
    rp = c.rope_parameters
    H, D = c.num_attention_heads, c.hidden_size
    kw: dict[str, Any] = dict(
        d_model=D,
        n_heads=H,
        n_layers=c.num_hidden_layers,
        d_mlp=c.intermediate_size,
        d_vocab=c.vocab_size,
        n_ctx=n_ctx or c.max_position_embeddings,
        act_fn=c.hidden_act,
        positional_embedding_type="rotary",
        rotary_adjacent_pairs=False,
        rotary_base=rp["rope_theta"],
        original_architecture=arch,
        tokenizer_name=None,
        device="cpu",
        dtype=torch.float32,
    )
    if arch == "GPTNeoXForCausalLM":
        dh = D // H
        kw.update(
            d_head=dh,
            eps=c.layer_norm_eps,
            normalization_type="LN",
            rotary_dim=int(dh * rp.get("partial_rotary_factor", 1.0)),
            parallel_attn_mlp=c.use_parallel_residual,
        )
        convert = wc.convert_neox_weights
    else:
        dh = getattr(c, "head_dim", None) or D // H
        kv = c.num_key_value_heads
        kw.update(
            d_head=dh,
            rotary_dim=dh,
            eps=c.rms_norm_eps,
            normalization_type="RMS",
            final_rms=True,
            gated_mlp=True,
            n_key_value_heads=None if (arch == "LlamaForCausalLM" and kv == H) else kv,
        )
        if getattr(c, "sliding_window", None) is not None:
            types = getattr(c, "layer_types", None) or ["sliding_attention"] * c.num_hidden_layers
            kw.update(
                use_local_attn=True,
                window_size=c.sliding_window,
                attn_types=["local" if t == "sliding_attention" else "global" for t in types],
            )
        if rp.get("rope_type") == "llama3":
            kw.update(
                use_NTK_by_parts_rope=True,
                NTK_original_ctx_len=rp["original_max_position_embeddings"],
                NTK_by_parts_factor=rp["factor"],
                NTK_by_parts_low_freq_factor=rp["low_freq_factor"],
                NTK_by_parts_high_freq_factor=rp["high_freq_factor"],
            )
        convert = {
            "LlamaForCausalLM": wc.convert_llama_weights,
            "MistralForCausalLM": wc.convert_mistral_weights,
            "Qwen2ForCausalLM": wc.convert_qwen2_weights,
        }[arch]
    model = HookedTransformer(HookedTransformerConfig(**kw))
    model.load_and_process_state_dict(convert(hf, model.cfg))
    return model.eval()
