"""Build a TransformerLens 3.9 HookedTransformer holding a qkov model's weights (tests only)."""

from __future__ import annotations

import torch

import qkov


def to_hooked(model: qkov.Transformer, dtype: torch.dtype = torch.float64):  # -> HookedTransformer
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    c = model.cfg
    if c.normalization != "none" or c.d_mlp is not None:
        raise NotImplementedError("tests build attention-only, LayerNorm-free models only")
    cfg = HookedTransformerConfig(
        n_layers=c.n_layers,
        n_heads=c.n_heads,
        d_model=c.d_model,
        d_head=c.d_head,
        d_vocab=c.d_vocab,
        n_ctx=c.n_ctx,
        attn_only=True,
        normalization_type=None,
        act_fn=None,
        positional_embedding_type=c.positional if c.positional != "none" else "standard",
        device="cpu",
        dtype=dtype,
        default_prepend_bos=False,
    )
    tl = HookedTransformer(cfg)
    sd = dict(tl.state_dict())  # keeps TL's buffers (causal mask, IGNORE); its biases start at zero
    assert all(float(v.abs().max()) == 0 for k, v in sd.items() if ".b_" in k or k.endswith("b_U"))
    sd["embed.W_E"] = model.W_E.detach().to(dtype)
    sd["pos_embed.W_pos"] = (
        model.W_pos.detach().to(dtype) if model.W_pos is not None else torch.zeros_like(sd["pos_embed.W_pos"])
    )
    sd = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in sd.items()}
    sd["unembed.W_U"] = model.W_U.detach().to(dtype)
    for layer, b in enumerate(model.blocks):
        for n in ("W_Q", "W_K", "W_V", "W_O"):
            sd[f"blocks.{layer}.attn.{n}"] = getattr(b.attn, n).detach().to(dtype)
    tl.load_state_dict(sd, strict=True)
    return tl.eval()
