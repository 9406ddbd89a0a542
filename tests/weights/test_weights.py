"""The canonical weights view: exact against the model (checked with the reference forward of
tests/reference.py and with the analysis forward), folding/centring, rotation, moving and casting."""

from __future__ import annotations

import pytest
import torch

from qkov import ModelConfig, QkovError, Transformer
from qkov import trace
from qkov.weights import Weights

from helpers import LN_MLP, perturb_non_matrices
from reference import reference_forward

CONFIGS = {
    "attn-shortformer": ModelConfig(n_layers=2, n_heads=3, d_model=24, d_head=8, d_vocab=50, n_ctx=16),
    "attn-standard": ModelConfig(
        n_layers=3, n_heads=2, d_model=16, d_head=8, d_vocab=30, n_ctx=12, positional="standard"
    ),
    "ln-mlp-bias": LN_MLP,
    "ln-mlp-standard": LN_MLP.replace(positional="standard"),
}


def model_for(cfg: ModelConfig, dtype=torch.float64) -> Transformer:
    return perturb_non_matrices(Transformer(cfg, seed=0).to(dtype).eval(), 0.2)  # non-trivial LN and biases


def random_orthogonal(d: int, dtype=torch.float64) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64, generator=torch.Generator().manual_seed(5)))
    return (q * torch.sign(torch.diagonal(r))).to(dtype)


@pytest.mark.parametrize("name", CONFIGS)
def test_views_reproduce_the_model(name: str) -> None:
    cfg = CONFIGS[name]
    model = model_for(cfg)
    tokens = torch.randint(0, cfg.d_vocab, (2, cfg.n_ctx))
    with torch.no_grad():
        ref = model(tokens)
    for fold in (False, True):
        w = Weights.from_model(model, fold_ln=fold, center_unembed=False, dtype=torch.float64)
        assert w.W_Q.shape == (cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head)
        assert w.W_O.shape == (cfg.n_layers, cfg.n_heads, cfg.d_head, cfg.d_model)
        logits, _ = reference_forward(w, tokens)
        assert (logits - ref).abs().max() < 1e-10, (name, fold)
    if cfg.normalization == "layernorm":
        w = Weights.from_model(model, fold_ln=True, center_writing=True, center_unembed=True, dtype=torch.float64)
        logits, _ = reference_forward(w, tokens)
        # centring the unembedding shifts each position's logits by a constant: compare log-probs
        assert (logits.log_softmax(-1) - ref.log_softmax(-1)).abs().max() < 1e-10
        assert w.W_E.mean(-1).abs().max() < 1e-12 and w.W_O.mean(-1).abs().max() < 1e-12


@pytest.mark.parametrize("name", ["attn-shortformer", "attn-standard"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_rotation_leaves_logits_unchanged(name: str, dtype: torch.dtype, tol: float) -> None:
    cfg = CONFIGS[name]
    model = model_for(cfg, dtype)
    tokens = torch.randint(0, cfg.d_vocab, (2, cfg.n_ctx))
    w = Weights.from_model(model, dtype=dtype, center_unembed=False)
    R = random_orthogonal(cfg.d_model, dtype)
    ref, _ = reference_forward(w, tokens)
    rot, _ = reference_forward(w.rotate(R), tokens)
    rel = (rot - ref).abs().max() / ref.abs().max()
    assert rel <= tol
    assert (w.rotate(R).W_E - w.W_E).abs().max() > 0.01  # the weights did change


def test_layernorm_breaks_rotation_unless_folded_and_centred() -> None:
    cfg = CONFIGS["ln-mlp-bias"]
    model = model_for(cfg)
    tokens = torch.randint(0, cfg.d_vocab, (2, cfg.n_ctx))
    R = random_orthogonal(cfg.d_model)
    with torch.no_grad():
        ref = model(tokens)
    # Folded but not centred: refused. Forcing it (centre-and-scale LN after rotating) changes the logits.
    folded = Weights.from_model(model, fold_ln=True, center_writing=False, dtype=torch.float64)
    with pytest.raises(QkovError, match="centred"):
        folded.rotate(R)
    forced = folded.replace(centered_writing=True).rotate(R).replace(norm="folded")
    assert (reference_forward(forced, tokens)[0] - ref).abs().max() > 1e-2
    # Unfolded: refused.
    with pytest.raises(QkovError, match="fold"):
        Weights.from_model(model, fold_ln=False).rotate(R)
    # Folded and centred: exact.
    good = Weights.from_model(model, fold_ln=True, center_writing=True, dtype=torch.float64)
    out = reference_forward(good.rotate(R), tokens)[0]
    assert (out.log_softmax(-1) - ref.log_softmax(-1)).abs().max() < 1e-10


def test_default_view_is_transformerlens_processed_and_refuses_centring_without_layernorm() -> None:
    """The default view: LayerNorm folded, writers centred where LayerNorm makes that exact,
    unembedding centred; centring the writers of a model without LayerNorm is refused."""
    ln = Weights.from_model(model_for(CONFIGS["ln-mlp-bias"]), dtype=torch.float64)
    assert ln.norm == "folded" and ln.centered_writing and ln.centered_unembed
    for t in (ln.W_E, ln.W_O, ln.b_O, ln.W_pos, ln.W_out, ln.b_out):
        assert t.mean(-1).abs().max() < 1e-12
    assert ln.W_U.mean(-1).abs().max() < 1e-12 and abs(float(ln.b_U.mean())) < 1e-12
    plain = model_for(CONFIGS["attn-shortformer"])
    w = Weights.from_model(plain, dtype=torch.float64)
    assert w.norm == "none" and not w.centered_writing and w.centered_unembed
    assert torch.equal(w.W_E, plain.W_E.detach())  # writers untouched: the function is kept
    with pytest.raises(QkovError, match="without LayerNorm"):
        Weights.from_model(plain, center_writing=True)


def test_rotate_checks_its_argument() -> None:
    w = Weights.from_model(Transformer(CONFIGS["attn-shortformer"], seed=0))
    with pytest.raises(QkovError, match="shape"):
        w.rotate(torch.eye(5))
    with pytest.raises(QkovError, match="orthogonal"):
        w.rotate(2 * torch.eye(24))


def test_analysis_forward_runs_every_view() -> None:
    """The analysis forward handles the folded, centred and rotated ("scale") views like the reference."""
    cfg = CONFIGS["ln-mlp-standard"]
    model = model_for(cfg)
    tokens = torch.randint(0, cfg.d_vocab, (2, cfg.n_ctx), generator=torch.Generator().manual_seed(3))
    good = Weights.from_model(model, fold_ln=True, center_writing=True, dtype=torch.float64)
    for w in (good, good.rotate(random_orthogonal(cfg.d_model)), Weights.from_model(model, fold_ln=False)):
        assert w.norm in ("folded", "scale", "layernorm")
        assert (trace(w, tokens).logits - reference_forward(w, tokens)[0]).abs().max() < 1e-5


def test_to_moves_and_casts_like_a_tensor() -> None:
    w = Weights.from_model(Transformer(CONFIGS["ln-mlp-bias"], seed=0))
    for moved in (w.to(torch.float64), w.to("cpu", torch.float64), w.to(dtype=torch.float64)):
        assert moved.W_Q.dtype == moved.b_U.dtype == moved.W_in.dtype == torch.float64
        assert torch.equal(moved.W_Q, w.W_Q.double()) and moved.cfg == w.cfg
    assert w.to("cpu").W_E.dtype == torch.float32
