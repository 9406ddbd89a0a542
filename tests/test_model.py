"""The transformer: shapes, frozen patterns, head additivity, positional modes, input checks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import qkov
from qkov import ModelConfig, QkovError, Transformer

from helpers import LN_MLP, perturb_non_matrices

CONFIGS = [
    ModelConfig(n_layers=2, n_heads=3, d_model=24, d_head=8, d_vocab=50, n_ctx=16),
    ModelConfig(n_layers=1, n_heads=2, d_model=16, d_head=4, d_vocab=30, n_ctx=12, positional="standard"),
    ModelConfig(n_layers=3, n_heads=2, d_model=16, d_head=8, d_vocab=30, n_ctx=12, positional="none"),
    LN_MLP,
    LN_MLP.replace(positional="standard", act_fn="gelu_new"),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.n_layers}L-{c.positional}-{c.normalization}-mlp{c.d_mlp}")
def test_frozen_patterns_reproduce_logits(cfg: ModelConfig) -> None:
    model = Transformer(cfg, seed=1).eval()
    perturb_non_matrices(model, 0.1)
    tokens = torch.randint(0, cfg.d_vocab, (3, cfg.n_ctx), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fused = model(tokens)
        out = model.run(tokens, return_patterns=True)
        frozen = model.run(tokens, patterns=out.patterns)
    assert out.patterns is not None
    assert out.patterns.shape == (cfg.n_layers, 3, cfg.n_heads, cfg.n_ctx, cfg.n_ctx)
    assert (fused - out.logits).abs().max() <= 1e-5
    assert (frozen.logits - fused).abs().max() <= 1e-5
    # patterns are causal probability distributions
    p = out.patterns
    assert torch.allclose(p.sum(-1), torch.ones_like(p.sum(-1)), atol=1e-5)
    assert p.triu(1).abs().max() == 0


def test_frozen_patterns_are_used() -> None:
    """Frozen patterns must actually replace the model's: uniform patterns give different logits."""
    cfg = CONFIGS[0]
    model = Transformer(cfg, seed=2).eval()
    tokens = torch.randint(0, cfg.d_vocab, (2, 10))
    t = tokens.shape[1]
    uniform = torch.tril(torch.ones(t, t)) / torch.arange(1, t + 1)[:, None]
    patterns = uniform.expand(cfg.n_layers, 2, cfg.n_heads, t, t)
    with torch.no_grad():
        own = model(tokens)
        forced = model.run(tokens, patterns=patterns).logits
        # by hand: layer by layer with uniform averaging
        x = model.W_E[tokens]
        pos = model.W_pos[:t]
        for block in model.blocks:
            a = block.attn
            v = torch.einsum("btd,hde->bhte", x, a.W_V)
            z = uniform @ v
            x = x + torch.einsum("bhte,hed->btd", z, a.W_O)
        manual = x @ model.W_U
    assert (forced - manual).abs().max() < 1e-5
    assert (forced - own).abs().max() > 1e-3
    del pos


def test_multihead_equals_sum_of_heads() -> None:
    cfg = ModelConfig(n_layers=1, n_heads=4, d_model=32, d_head=8, d_vocab=40, n_ctx=12)
    model = Transformer(cfg, seed=3).eval()
    attn = model.blocks[0].attn
    x = torch.randn(2, 12, 32)
    with torch.no_grad():
        fused, _ = attn(x, x)
        q, k, v = attn.qkv(x, x)
        total = torch.zeros_like(x)
        for h in range(cfg.n_heads):
            s = (x @ attn.W_Q[h]) @ (x @ attn.W_K[h]).transpose(-1, -2) / math.sqrt(cfg.d_head)
            s = s.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
            pattern = torch.softmax(s, dim=-1)
            total += pattern @ (x @ attn.W_V[h]) @ attn.W_O[h]
    assert (fused - total).abs().max() <= 1e-5


def test_shortformer_positions_only_enter_queries_and_keys() -> None:
    """Under shortformer, changing W_pos changes patterns but not values: with patterns frozen, logits stay."""
    cfg = ModelConfig(n_layers=2, n_heads=2, d_model=16, d_head=8, d_vocab=30, n_ctx=12)
    model = Transformer(cfg, seed=4).eval()
    tokens = torch.randint(0, 30, (2, 12))
    with torch.no_grad():
        out = model.run(tokens, return_patterns=True)
        model.W_pos.mul_(3.0)
        changed = model.run(tokens, return_patterns=True)
        frozen = model.run(tokens, patterns=out.patterns)
    assert (changed.patterns - out.patterns).abs().max() > 1e-3
    assert (frozen.logits - out.logits).abs().max() <= 1e-5


def test_standard_positions_enter_the_stream() -> None:
    cfg = ModelConfig(n_layers=0, d_model=8, d_vocab=10, n_ctx=6, positional="standard")
    model = Transformer(cfg, seed=5).eval()
    tokens = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        expected = (model.W_E[tokens] + model.W_pos[:3]) @ model.W_U
        assert torch.allclose(model(tokens), expected, atol=1e-6)


def test_zero_layers_is_a_bigram_model() -> None:
    cfg = ModelConfig(n_layers=0, d_model=8, d_vocab=10, n_ctx=6)
    model = Transformer(cfg, seed=5).eval()
    tokens = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        out = model.run(tokens, return_patterns=True)
        assert torch.allclose(out.logits, model.W_E[tokens] @ model.W_U, atol=1e-6)
    assert out.patterns is not None and out.patterns.shape[0] == 0


def test_layernorm_mlp_model_matches_manual_forward() -> None:
    cfg = CONFIGS[3]
    model = Transformer(cfg, seed=6).eval()
    perturb_non_matrices(model, 0.1)
    tokens = torch.randint(0, cfg.d_vocab, (2, 9))
    with torch.no_grad():
        x = model.W_E[tokens]
        pos = model.W_pos[:9]
        for b in model.blocks:
            ln = lambda y, m: F.layer_norm(y, (cfg.d_model,), m.w, m.b, cfg.ln_eps)  # noqa: E731
            qk_in, v_in = ln(x + pos, b.ln1), ln(x, b.ln1)
            a = b.attn
            q = torch.einsum("btd,hde->bhte", qk_in, a.W_Q) + a.b_Q[:, None]
            k = torch.einsum("btd,hde->bhte", qk_in, a.W_K) + a.b_K[:, None]
            v = torch.einsum("btd,hde->bhte", v_in, a.W_V) + a.b_V[:, None]
            s = (q @ k.transpose(-1, -2)) / math.sqrt(cfg.d_head)
            s = s.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
            x = x + torch.einsum("bhte,hed->btd", torch.softmax(s, -1) @ v, a.W_O) + a.b_O
            h = F.gelu(ln(x, b.ln2) @ b.mlp.W_in + b.mlp.b_in)
            x = x + h @ b.mlp.W_out + b.mlp.b_out
        logits = F.layer_norm(x, (cfg.d_model,), model.ln_final.w, model.ln_final.b, cfg.ln_eps) @ model.W_U + model.b_U
        assert (model(tokens) - logits).abs().max() < 1e-5


def test_stacked_weight_views_have_spec_shapes() -> None:
    cfg = ModelConfig(n_layers=2, n_heads=3, d_model=24, d_head=8, d_vocab=50, n_ctx=16)
    m = Transformer(cfg, seed=0)
    assert m.W_Q.shape == (2, 3, 24, 8) and m.W_K.shape == (2, 3, 24, 8) and m.W_V.shape == (2, 3, 24, 8)
    assert m.W_O.shape == (2, 3, 8, 24)
    assert m.W_E.shape == (50, 24) and m.W_U.shape == (24, 50) and m.W_pos.shape == (16, 24)


def test_same_seed_same_weights() -> None:
    cfg = CONFIGS[0]
    a, b, c = Transformer(cfg, seed=7), Transformer(cfg, seed=7), Transformer(cfg, seed=8)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.W_E, c.W_E)


@pytest.mark.parametrize(
    "tokens, message",
    [
        (torch.tensor([[0, 1, 50]]), "out of range"),
        (torch.tensor([[-1, 1]]), "out of range"),
        (torch.zeros(1, 17, dtype=torch.long), "longer than n_ctx"),
        (torch.zeros(1, 3), "integer"),
        (torch.zeros(2, 2, 2, dtype=torch.long), "shape"),
        (torch.zeros(1, 0, dtype=torch.long), "empty"),
    ],
)
def test_bad_tokens_are_user_errors(tokens: torch.Tensor, message: str) -> None:
    model = Transformer(CONFIGS[0], seed=0)
    with pytest.raises(QkovError, match=message):
        model(tokens)


def test_bad_pattern_shape_is_a_user_error() -> None:
    model = Transformer(CONFIGS[0], seed=0)
    with pytest.raises(QkovError, match="patterns"):
        model.run(torch.zeros(1, 5, dtype=torch.long), patterns=torch.zeros(2, 1, 3, 4, 4))


@pytest.mark.parametrize(
    "kwargs",
    [{"n_layers": -1}, {"n_heads": 0}, {"positional": "rotary"}, {"normalization": "rms"}, {"d_mlp": 0}],
)
def test_bad_config_is_a_user_error(kwargs: dict) -> None:
    with pytest.raises(QkovError):
        ModelConfig(**kwargs)


def test_config_round_trip_and_unknown_fields() -> None:
    cfg = CONFIGS[3]
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(QkovError, match="unknown"):
        ModelConfig.from_dict({**cfg.to_dict(), "rotary": True})


def test_public_api_exports() -> None:
    for name in ("ModelConfig", "Transformer", "load", "train", "TrainConfig", "QkovError"):
        assert hasattr(qkov, name)
