"""The training model: shapes, head additivity, positional modes, LayerNorm + MLP, input checks; the public API."""

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


def test_multihead_equals_sum_of_heads() -> None:
    cfg = ModelConfig(n_layers=1, n_heads=4, d_model=32, d_head=8, d_vocab=40, n_ctx=12, positional="none")
    model = Transformer(cfg, seed=3).eval()
    attn = model.blocks[0].attn
    x = torch.randn(2, 12, 32)
    with torch.no_grad():
        fused = model.blocks[0](x, None) - x  # the block body's fused attention (no norm, no MLP here)
        total = torch.zeros_like(x)
        for h in range(cfg.n_heads):
            s = (x @ attn.W_Q[h]) @ (x @ attn.W_K[h]).transpose(-1, -2) / math.sqrt(cfg.d_head)
            s = s.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
            pattern = torch.softmax(s, dim=-1)
            total += pattern @ (x @ attn.W_V[h]) @ attn.W_O[h]
    assert (fused - total).abs().max() <= 1e-5


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
        assert torch.allclose(model(tokens), model.W_E[tokens] @ model.W_U, atol=1e-6)


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


@pytest.mark.parametrize(
    "kwargs",
    [{"n_layers": -1}, {"n_heads": 0}, {"positional": "alibi"}, {"normalization": "rms"}, {"d_mlp": 0}],
)
def test_bad_config_is_a_user_error(kwargs: dict) -> None:
    with pytest.raises(QkovError):
        ModelConfig(**kwargs)


def test_config_round_trip_and_unknown_fields() -> None:
    cfg = CONFIGS[3]
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(QkovError, match="unknown"):
        ModelConfig.from_dict({**cfg.to_dict(), "rotary": True})


def test_public_api_is_what_the_package_docs_list() -> None:
    """``qkov.__all__`` is the documented API: each name is importable, is the object defined where
    the docs say, and nothing else is exported."""
    from qkov.analysis.causal import ablation
    from qkov.analysis.forward import tracer as forward
    from qkov.analysis.causal import studies as patch_study
    from qkov.analysis.causal import patching
    from qkov.analysis.causal import path_patch as path_patching
    from qkov.analysis import discovery
    from qkov.analysis.heads import probes
    from qkov import progress
    from qkov.analysis.causal import composition as causal_composition
    from qkov.analysis import circuits
    from qkov.analysis.circuits import composition
    from qkov.analysis import heads
    from qkov.analysis import paths
    from qkov.analysis.heads import pattern_scores as text_scores
    from qkov.analysis.circuits import trigrams
    from qkov.apps.dynamics import study as dynamics_study
    from qkov.weights import convert
    from qkov.io import checkpoint, sources
    from qkov.model import config, transformer
    from qkov.training import data, loop
    from qkov.weights import lazy, view

    homes = {
        "ModelConfig": config,
        "Transformer": transformer,
        "Weights": view,
        "LazyCheckpoint": lazy,
        "trace": forward,
        "Trace": forward,
        "load": sources,
        "save_checkpoint": checkpoint,
        "load_any": sources,
        "train": loop,
        "Corpus": data,
        "load_corpus": data,
        "induction_probe": probes,
        "induction_probe_tokens": probes,
        "prefix_matching_tokens": probes,
        "InductionProbe": probes,
        "dynamics": dynamics_study,
        "Progress": progress,
        "ablation_study": ablation,
        "ablation_edits": ablation,
        "activation_patching": patching,
        "attribution_patching": patching,
        "path_patching": path_patching,
        "patch_study": patch_study,
        # the analyses a user reaches for (issue 25), and the one conversion they all share
        "as_source": convert,
        "head_report": heads,
        "composition_scores": composition,
        "composition_paths": causal_composition,
        "copying_scores": circuits,
        "qk": circuits,
        "ov": circuits,
        "full_qk": circuits,
        "full_ov": circuits,
        "positional_qk": circuits,
        "virtual_weights": circuits,
        "ov_eigenvalues": circuits,
        "skip_trigrams": trigrams,
        "bigrams": trigrams,
        "expand": paths,
        "term_importance": paths,
        "term_effects": paths,
        "text_scores": text_scores,
        "icl_score": probes,
        # circuit discovery (issue 37)
        "find_circuit": discovery,
        "edge_scores": discovery,
        "evaluate_circuit": discovery,
        "load_task": discovery,
        # gated attention (issue 38)
        "gate_stats": heads,
        "GateStats": heads,
        "effective_ov": heads,
    }
    for name, module in homes.items():
        assert getattr(qkov, name) is getattr(module, name), name
    expected = set(homes) | {"QkovError", "TrainConfig", "LowRank", "__version__", "show"}
    assert set(qkov.__all__) == expected
    for name in qkov.__all__:
        assert getattr(qkov, name) is not None
    assert qkov.__version__ == __import__("importlib.metadata").metadata.version("qkov")


@pytest.mark.parametrize("positional", ["shortformer", "rotary"])
def test_the_block_is_written_once(positional: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention scale lives in one place (``qkov.model.ops.score_divisor``): changing it changes
    the training model's fused attention, the analysis forward's fused and explicit attention, and
    the few-positions last layer alike, and they still agree with each other."""
    import qkov.model.ops as ops
    from qkov import Weights, trace

    cfg = ModelConfig(n_layers=2, n_heads=2, d_model=16, d_head=8, d_vocab=30, n_ctx=10, positional=positional)
    model = Transformer(cfg, seed=4).double().eval()
    toks = torch.randint(0, 30, (2, 10), generator=torch.Generator().manual_seed(1))
    w = Weights.from_model(model, dtype=torch.float64, center_unembed=False)

    def passes() -> list[torch.Tensor]:
        with torch.no_grad():
            return [model(toks), trace(w, toks).logits, trace(w, toks, cache=["pattern"]).logits,
                    trace(w, toks, positions=torch.tensor([3, 9])).logits]  # fmt: skip

    before = passes()
    monkeypatch.setattr(ops, "score_divisor", lambda d: 0.5 * math.sqrt(d))
    after = passes()
    for b, a in zip(before, after):
        assert (a - b).abs().max() > 1e-3  # every pass reads the changed scale
    assert (after[0] - after[1]).abs().max() < 1e-10 and (after[0] - after[2]).abs().max() < 1e-10
    assert (after[0][:, [3, 9]] - after[3]).abs().max() < 1e-10
