"""Path expansion: exact reconstruction, the paper's term-importance runs, the QK-side split."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import qkov
from qkov import ModelConfig, Transformer
from qkov.analysis import paths as P
from qkov.analysis.paths.qk_side import expand_qk
from qkov.weights import Weights

from helpers import TINY, perturb_non_matrices, tiny_train
from reference import reference_forward, reference_loss


def centred(logits: torch.Tensor) -> torch.Tensor:
    """The model's logits as the default view computes them: the unembedding is centred, which
    moves each position's logits by a constant."""
    return logits - logits.mean(-1, keepdim=True)


def toks(shape: tuple[int, int], seed: int = 1, vocab: int = 50) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def make(layers: int, positional: str, dtype: torch.dtype, seed: int = 0, **kw) -> tuple[Transformer, Weights]:
    cfg = ModelConfig(
        n_layers=layers, n_heads=3, d_model=32, d_head=8, d_vocab=50, n_ctx=16, positional=positional, **kw
    )
    m = Transformer(cfg, seed=seed).to(dtype).eval()
    with torch.no_grad():  # larger weights than init: sharper patterns, bigger higher-order terms
        for p in m.parameters():
            p.mul_(2.0)
    return m, Weights.from_model(m, dtype=dtype)


TOL = {torch.float32: 1e-4, torch.float64: 1e-9}


@pytest.mark.parametrize("layers", [1, 2, 3])
@pytest.mark.parametrize("positional", ["shortformer", "standard"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_paths_sum_to_logits(layers: int, positional: str, dtype: torch.dtype) -> None:
    m, w = make(layers, positional, dtype)
    tokens = toks((2, 16))
    exp = P.expand(w, tokens, virtual_heads=True)
    with torch.no_grad():
        ref = centred(m(tokens))
    assert len(exp.orders) == layers + 1
    assert (exp.total_logits() - ref).abs().max() <= TOL[dtype]
    # order 1 = the sum of the per-head terms; order 2 = the sum of the virtual heads
    assert (sum(exp.heads.values()) - exp.orders[1]).abs().max() <= TOL[dtype]
    if layers >= 2:
        assert len(exp.virtual) == (layers * (layers - 1) // 2) * 9
        assert (sum(exp.virtual.values()) - exp.orders[2]).abs().max() <= TOL[dtype]
        assert exp.orders[2].abs().max() > 1e-3  # the virtual heads are not trivially zero here


def test_order_one_term_by_hand() -> None:
    m, w = make(1, "shortformer", torch.float64)
    tokens = toks((1, 10))
    exp = P.expand(w, tokens)
    A = reference_forward(w, tokens)[1][0, 0, 2]  # layer 0, head 2: [T, T]
    E, OV, U = w.W_E[tokens[0]], w.W_V[0, 2] @ w.W_O[0, 2], w.W_U
    assert torch.allclose(exp.logits_of(exp.heads[(0, 2)])[0], A @ E @ OV @ U, atol=1e-10)
    assert torch.allclose(exp.order_logits()[0][0], E @ U, atol=1e-10)


def test_zero_ov_head_has_zero_paths() -> None:
    m, _ = make(2, "shortformer", torch.float64)
    with torch.no_grad():
        m.blocks[0].attn.W_O[1].zero_()
    w = Weights.from_model(m, dtype=torch.float64)
    exp = P.expand(w, toks((2, 12)), virtual_heads=True)
    assert exp.heads[(0, 1)].abs().max() == 0
    for h2 in range(3):
        assert exp.virtual[(0, 1, 1, h2)].abs().max() == 0
    assert exp.virtual[(0, 0, 1, 0)].abs().max() > 0


@pytest.mark.parametrize(
    "kw",
    [
        dict(normalization="layernorm", d_mlp=64, bias=True),
        dict(normalization="layernorm", bias=True),
        dict(d_mlp=64, bias=True),
    ],
)
def test_layernorm_mlp_bias_models_reconstruct(kw: dict) -> None:
    m, _ = make(2, "shortformer", torch.float64, **kw)
    perturb_non_matrices(m, 0.3)
    w = Weights.from_model(m, dtype=torch.float64)
    tokens = toks((2, 16))
    exp = P.expand(w, tokens)
    with torch.no_grad():
        ref = centred(m(tokens))
    assert (exp.total_logits() - ref).abs().max() <= 1e-9
    assert exp.bias.abs().max() > 0
    ti = P.term_importance(w, tokens)
    assert ti.run_losses[-1] == pytest.approx(ti.full_loss, abs=1e-9)


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_term_importance_against_an_independent_recomputation(layers: int) -> None:
    """Run n of the paper's procedure is the model with patterns frozen and only paths through
    fewer than n heads: computed here with the reference forward, by running it with frozen
    patterns on a copy of the weights whose heads are cut after n - 1 steps (a path of k heads
    needs k heads in increasing layers; with no LayerNorm and no biases the n-th run's logits
    are orders 0..n-1 of the expansion, which the reference gives as the difference of
    partial products)."""
    _, w = make(layers, "shortformer", torch.float64)
    tokens = toks((4, 16), seed=2)
    ti = P.term_importance(w, tokens)
    _, patterns = reference_forward(w, tokens)
    assert len(ti.run_losses) == layers + 1
    # the model's own loss, the reference's way
    assert ti.full_loss == pytest.approx(reference_loss(reference_forward(w, tokens)[0], tokens), abs=1e-9)
    assert ti.uniform_loss == pytest.approx(math.log(50))
    # orders 0..n-1 by brute force: expand (1 + sum_h A_h x OV_h) layer by layer, truncating the order
    x0 = w.W_E[tokens]
    terms = [x0]  # terms[k]: the stream's order-k part
    for l in range(layers):
        new = [t.clone() for t in terms] + [torch.zeros_like(x0)]
        for k, t in enumerate(terms):
            for h in range(w.cfg.n_heads):
                new[k + 1] += patterns[l, :, h] @ t @ w.W_V[l, h] @ w.W_O[l, h]
        terms = new
    for n in range(1, layers + 2):
        logits = sum(terms[:n]) @ w.W_U
        assert ti.run_losses[n - 1] == pytest.approx(reference_loss(logits, tokens), abs=1e-9), n
    assert ti.run_losses[-1] == pytest.approx(ti.full_loss, abs=1e-9)


def test_term_effects_match_a_recomputed_loss() -> None:
    """Each single-head term's loss change = the loss with that head's order-1 path removed (logits
    rebuilt from the reference forward's patterns) minus the model's loss."""
    _, w = make(2, "shortformer", torch.float64)
    tokens = toks((2, 16), seed=3)
    exp = P.expand(w, tokens, virtual_heads=True)
    effects = P.term_effects(exp, top_virtual=4)
    singles, virtual = effects.singles, effects.virtual
    assert len(singles) == 6 and len(virtual) == 4
    assert effects.to_dict()["single_head_terms"] == [e.to_dict() for e in singles]
    assert "single-head terms" in repr(effects) and singles[0].name in repr(effects)
    assert singles == sorted(singles, key=lambda e: -e.loss_change)
    logits, patterns = reference_forward(w, tokens)
    base = reference_loss(logits, tokens)
    by_name = {e.name: e for e in singles + virtual}
    E = w.W_E[tokens]
    for l, h in [(0, 0), (0, 2), (1, 1)]:
        term = patterns[l, :, h] @ E @ w.W_V[l, h] @ w.W_O[l, h] @ w.W_U
        e = by_name[f"{l}.{h}"]
        assert e.loss_change == pytest.approx(reference_loss(logits - term, tokens) - base, abs=1e-9)
        assert e.size == pytest.approx(float(term.pow(2).mean().sqrt()), rel=1e-9)
    top = virtual[0]
    (l1, h1), (l2, h2) = [tuple(map(int, p.split("."))) for p in top.name.split("->")]
    term = patterns[l2, :, h2] @ patterns[l1, :, h1] @ E @ w.W_V[l1, h1] @ w.W_O[l1, h1] @ w.W_V[l2, h2] @ w.W_O[l2, h2]
    assert top.loss_change == pytest.approx(reference_loss(logits - term @ w.W_U, tokens) - base, abs=1e-9)


@pytest.mark.parametrize("kw", [dict(normalization="layernorm", d_mlp=64, bias=True), dict()])
def test_sampled_term_effects_through_the_head_equal_the_terms_own_logits(kw: dict) -> None:
    """At sampled positions each term's logits are read through its last head (d_head wide,
    qkov.analysis.paths.effects); they equal the logits of the term itself, as do the effects."""
    from qkov.analysis.paths.effects import term_logits

    m, _ = make(3, "standard", torch.float64, **kw)
    perturb_non_matrices(m, 0.3)
    w = Weights.from_model(m, dtype=torch.float64)
    tokens = toks((6, 16), seed=5)  # 90 predicted positions, 64 of them sampled
    exp = P.expand(w, tokens, virtual_heads=True)
    pos = P.effect_positions(exp, max_logits=20 * w.cfg.d_vocab)  # a seeded sample of the positions
    assert pos is not None and len(pos) == 64
    b, t = pos[:, 0], pos[:, 1]
    for key in [(0, 1), (2, 0), (0, 2, 1, 1), (1, 0, 2, 2)]:
        x_in = exp.direct if len(key) == 2 else exp.heads[key[:2]]
        term = exp.heads[key] if len(key) == 2 else exp.virtual[key]
        want = exp.logits_of(term)[b, t][:, None]
        assert (term_logits(w, exp.recording, key, x_in, b, t) - want).abs().max() <= 1e-10 * want.abs().max()
    fast = P.term_effects(exp, top_virtual=5, positions=pos)
    exp.direct = None  # the terms' own logits, d_model wide
    slow = P.term_effects(exp, top_virtual=5, positions=pos)
    assert [e.name for e in fast.singles + fast.virtual] == [e.name for e in slow.singles + slow.virtual]
    for f, s in zip(fast.singles + fast.virtual, slow.singles + slow.virtual):
        assert f.loss_change == pytest.approx(s.loss_change, abs=1e-12) and f.size == pytest.approx(s.size, rel=1e-10)


@pytest.mark.parametrize("positional", ["shortformer", "standard", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_expand_qk_sums_to_real_scores(positional: str, dtype: torch.dtype) -> None:
    m, w = make(3, positional, dtype)
    tokens = toks((2, 12))
    with torch.no_grad():  # the real scores, from the model's own attention module
        x = m.W_E[tokens] + (m.W_pos[:12] if positional == "standard" else 0)
        for l in range(2):
            x = m.blocks[l](x, m.W_pos[:12] if positional == "shortformer" else None)
        qk_in = x + m.W_pos[:12] if positional == "shortformer" else x
        q, k, _ = m.blocks[2].attn.qkv(qk_in, x)
        real = (q @ k.transpose(-1, -2)) / (8**0.5)
    qk = expand_qk(w, tokens, 2, 1)
    assert qk.earlier == [f"{l}.{h}" for l in range(2) for h in range(3)]
    assert (qk.total() - real[:, 1]).abs().max() <= TOL[dtype]
    assert (qk.scores - real[:, 1]).abs().max() <= TOL[dtype]
    assert qk.k_comp.shape == (6, 2, 12, 12)
    # the both-sides-composed term, pair by pair: query from head i, key from head j
    pairs = qk.qk_pairs()
    assert pairs.shape == (6, 6, 2, 12, 12)
    assert (pairs.sum((0, 1)) - qk.qk_comp).abs().max() <= TOL[dtype]
    assert (qk.qk_pair(1, 4) - pairs[1, 4]).abs().max() <= TOL[dtype]


def test_expand_qk_of_a_rotary_rmsnorm_head_sums_to_its_scores() -> None:
    """Each part is rotated by its position (rotation is linear): the parts still add up, and the
    softmax of the sum is the reference forward's pattern."""
    from helpers import MODERN

    m = Transformer(MODERN.replace(n_layers=3, n_ctx=12), seed=1).double()
    w = Weights.from_model(m, dtype=torch.float64)
    tokens = toks((2, 12), vocab=30)
    qk = expand_qk(w, tokens, 2, 3)
    assert (qk.total() - qk.scores).abs().max() < 1e-10
    pats = reference_forward(w, tokens)[1][2, :, 3]
    mask = torch.ones(12, 12, dtype=torch.bool).triu(1)
    assert torch.allclose(torch.softmax(qk.scores.masked_fill(mask, float("-inf")), -1), pats, atol=1e-6)


def test_expand_qk_with_layernorm() -> None:
    m, _ = make(2, "shortformer", torch.float64, normalization="layernorm", bias=True, d_mlp=32)
    w = Weights.from_model(m, dtype=torch.float64)
    tokens = toks((2, 12))
    qk = expand_qk(w, tokens, 1, 0)
    assert (qk.total() - qk.scores).abs().max() < 1e-10
    pats = reference_forward(Weights.from_model(m, dtype=torch.float64, fold_ln=False), tokens)[1][1, :, 0]
    mask = torch.ones(12, 12, dtype=torch.bool).triu(1)
    assert torch.allclose(torch.softmax(qk.scores.masked_fill(mask, float("-inf")), -1), pats, atol=1e-10)


def test_trained_model_reconstructs(tmp_path: Path, small_corpus: Path) -> None:
    tc = tiny_train(small_corpus, steps=30, lr=1e-2, eval_interval=30, ckpt_interval=30, log_interval=10)
    model = qkov.train(tmp_path / "run", TINY, tc, device="cpu")
    w = Weights.from_model(model)
    tokens = toks((2, 32), vocab=300)
    with torch.no_grad():
        ref = centred(model(tokens))
    assert (P.expand(w, tokens).total_logits() - ref).abs().max() <= 1e-4
    w64 = Weights.from_model(model, dtype=torch.float64)
    with torch.no_grad():
        ref64 = centred(model.double()(tokens))
    assert (P.expand(w64, tokens).total_logits() - ref64).abs().max() <= 1e-9


def test_summarize_reads_a_recording_given_and_refuses_one_of_other_tokens() -> None:
    """``summarize(recording=...)`` (the report's one recorded run of its text, holding more sites than the
    expansion freezes) gives the summary it computes with its own run, bit for bit; a recording of other
    tokens or without a frozen site is refused in one line."""
    from qkov.analysis.forward.frozen import frozen_recording
    from qkov.analysis.forward.tracer import trace

    cfg = ModelConfig(n_layers=2, n_heads=2, d_model=16, d_head=4, d_vocab=40, n_ctx=10, d_mlp=32)
    w = Weights.from_model(Transformer(cfg, seed=2))
    tokens = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(1))
    own = P.summarize(w, tokens, top_virtual=3).to_dict()
    rec = frozen_recording(w, tokens, cache=("v.*", "qk_in.*"))
    assert P.summarize(w, tokens, top_virtual=3, recording=rec).to_dict() == own
    with pytest.raises(qkov.QkovError, match="tokens analysed"):
        P.summarize(w, tokens, recording=frozen_recording(w, tokens.flip(0)))
    with pytest.raises(qkov.QkovError, match="mlp_out"):
        P.summarize(w, tokens, recording=trace(w, tokens, cache=["pattern", "*_scale*"]))
