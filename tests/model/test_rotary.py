"""Rotary heads: offset QK circuits exact against the forward, the weights-only offset profile,
composition at offsets, and a hand-built rotary model whose previous-token and induction heads
every analysis must name."""

from __future__ import annotations

import math

import pytest
import torch

from qkov import ModelConfig, QkovError, Transformer, Weights, trace
from qkov.analysis import circuits as Cc
from qkov.analysis import heads as Hd
from qkov.analysis import paths as P
from qkov.analysis.circuits.composition import composition_raw
from qkov.analysis.circuits.rotary import default_offsets, offset_profile, offset_qk
from qkov.analysis.circuits.trigrams import TrigramTable
from qkov.model.rotary import relative_rotation

from helpers import MODERN, perturb_non_matrices
from reference import reference_forward

V, CTX, R = 24, 32, 16  # vocabulary, context, rotary dims
D = 2 * V + 1  # stream: [token one-hot | previous-token one-hot | a constant 1]
E = R + V  # head width: 16 rotary dims, then V that do not rotate
ONE = 2 * V


def _frequencies(base: float = 10000.0) -> torch.Tensor:
    """The rotary frequencies written out independently: base^(-2m/r), m < r/2."""
    return torch.tensor([base ** (-2 * m / R) for m in range(R // 2)])


def hand_built(sharp: float = 400.0) -> Transformer:
    """2 layers x 2 heads, rotary (16 of 40 head dims), attention only, no normalisation.

    0.0 previous-token head from rotary alone: its query and key read the constant direction; the
        key is the query turned by one position, so ``q R_delta k^T`` peaks at delta = 1. Its OV
        copies the token into the previous-token subspace.
    0.1 zero.
    1.0 induction head in the dimensions that do not rotate: query = current token, key = the
        previous-token subspace (K-composition with 0.0); OV copies the attended token.
    1.1 uniform attention, copying OV.
    """
    cfg = ModelConfig(
        n_layers=2, n_heads=2, d_model=D, d_head=E, d_vocab=V, n_ctx=CTX, positional="rotary", rotary_dim=R
    )
    m = Transformer(cfg, seed=0)
    tok, prev, rest = slice(0, V), slice(V, 2 * V), slice(R, E)
    w = _frequencies()
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
        m.W_E[:, tok] = torch.eye(V)
        m.W_E[:, ONE] = 1.0
        m.W_U[tok, :] = torch.eye(V)
        a0, a1 = m.blocks[0].attn, m.blocks[1].attn
        a0.W_Q[0, ONE, : R // 2] = sharp
        a0.W_K[0, ONE, : R // 2] = torch.cos(w)  # plane m: (1, 0) turned by w_m
        a0.W_K[0, ONE, R // 2 : R] = torch.sin(w)
        a0.W_V[0, tok, rest] = torch.eye(V)
        a0.W_O[0, rest, prev] = torch.eye(V)
        a1.W_Q[0, tok, rest] = torch.eye(V) * 40 * math.sqrt(E)
        a1.W_K[0, prev, rest] = torch.eye(V)
        a1.W_V[0, tok, rest] = torch.eye(V)
        a1.W_O[0, rest, tok] = torch.eye(V) * 10
        a1.W_V[1, tok, rest] = torch.eye(V)
        a1.W_O[1, rest, tok] = torch.eye(V)
    return m.eval()


def natural_text(n: int = 4, seed: int = 0) -> torch.Tensor:
    t = torch.randint(1, V, (n, CTX), generator=torch.Generator().manual_seed(seed))
    t[:, 0] = 0
    return t


def test_relative_rotation_is_the_forward_rotation() -> None:
    """``R(i) R(j)^T = R(i - j)``: rotating query and key separately equals the relative rotation."""
    cfg = ModelConfig(n_heads=2, d_model=8, d_head=6, positional="rotary", rotary_dim=4, rotary_base=50.0)
    q, k = torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    for i, j in [(5, 2), (9, 9), (30, 1)]:
        qi = q @ relative_rotation(cfg, i, dtype=torch.float64)
        kj = k @ relative_rotation(cfg, j, dtype=torch.float64)
        rel = q @ relative_rotation(cfg, i - j, dtype=torch.float64) @ k
        assert abs(float(qi @ kj) - float(rel)) < 1e-6 * (1 + abs(float(rel)))
    # the dimensions beyond rotary_dim never turn
    assert torch.equal(relative_rotation(cfg, 7)[4:, 4:], torch.eye(2))


@pytest.mark.parametrize("name", ["llama-like", "neox-like"])
def test_offset_qk_is_the_models_score_at_that_offset(name: str) -> None:
    """Layer 0: ``offset_qk(delta)[a, b]`` is the pre-softmax score of token ``a`` at position ``i``
    for token ``b`` at ``i - delta``; checked through the reference forward's patterns, whose log
    differences along a query row are score differences."""
    cfg = (
        MODERN
        if name == "llama-like"
        else MODERN.replace(
            normalization="layernorm", gated_mlp=False, act_fn="gelu", parallel=True, n_kv_heads=None, rotary_dim=2
        )
    )
    m = perturb_non_matrices(Transformer(cfg, seed=3).double(), 0.2)
    w = Weights.from_model(m, dtype=torch.float64)
    toks = torch.randint(0, cfg.d_vocab, (2, cfg.n_ctx), generator=torch.Generator().manual_seed(1))
    patterns = reference_forward(w, toks)[1][0]  # [B, H, T, T]
    T = cfg.n_ctx
    for h in range(cfg.n_heads):
        tables = [offset_qk(w, 0, h, d).materialize() for d in range(T)]
        for b in range(2):
            t = toks[b]
            for i in range(T):
                logp = patterns[b, h, i, : i + 1].log()
                mine = torch.stack([tables[i - j][t[i], t[j]] for j in range(i + 1)])
                assert ((logp - logp[i]) - (mine - mine[i])).abs().max() < 1e-5


def test_offset_profile_finds_the_previous_token_head_from_weights_alone() -> None:
    w = Weights.from_model(hand_built())
    prof = offset_profile(w, 0)  # [heads, offsets 0 .. 31]
    assert int(prof[0].argmax()) == 1
    assert prof[0, 1] - prof[0, [0, *range(2, CTX)]].max() > 5  # a clear peak
    assert prof[1].abs().max() == 0  # the zero head
    assert offset_profile(w, 1, 0).abs().max() < 1e-3  # the induction head does not care about position


def test_hand_built_rotary_model_heads_composition_and_paths() -> None:
    w = Weights.from_model(hand_built())
    report = Hd.head_report(w, natural_text(), seed=0)
    s = report.scores
    assert s["previous_token"][0, 0] > 0.9 and s["previous_token"][1].max() < 0.3
    assert s["prefix_matching"][1, 0] > 0.9 and s["prefix_matching"][1, 1] < 0.3
    roles = {r["head"]: r["roles"] for r in report.rows()}
    assert "previous-token" in roles["0.0"] and "induction" in roles["1.0"]
    assert all("induction" not in roles[h] for h in ("0.0", "0.1", "1.1"))
    # K-composition: the induction head's key reads what the previous-token head writes
    k = composition_raw(w, "k")["k"]
    assert float(k[0, 0, 1, 0]) == float(k[0].nan_to_num(-1).max()) and k[0, 0, 1, 0] > 1.4 / math.sqrt(D)
    # paths (patterns frozen): the induction head's direct term is the one that matters on repeated text
    rep = torch.as_tensor(Hd.prefix_matching_tokens(V, length=10, repeats=3, examples=4, seed=1, bos=0))
    summary = P.summarize(w, rep)
    assert summary.reconstruction_error < 1e-4
    assert summary.singles[0].name == "1.0" and summary.singles[0].loss_change > 0.5
    assert all(abs(e.loss_change) < 0.1 * summary.singles[0].loss_change for e in summary.singles[1:])


def test_rotary_composition_is_the_offset_mean_of_dense_scores() -> None:
    m = perturb_non_matrices(Transformer(MODERN.replace(n_layers=3), seed=5).double(), 0.2)
    w = Weights.from_model(m, dtype=torch.float64)
    offsets = [0, 1, 3]
    raw = composition_raw(w, "qkv", offsets=offsets)
    Rs = [relative_rotation(w.cfg, d, dtype=torch.float64) for d in offsets]
    fro = torch.linalg.matrix_norm
    for l1, h1, l2, h2 in [(0, 0, 1, 3), (0, 2, 2, 1), (1, 1, 2, 0)]:
        a1, a2 = w.attention(l1, h1), w.attention(l2, h2)
        ov = a1.W_V[0] @ a1.W_O[0]
        qks = [a2.W_Q[0] @ R @ a2.W_K[0].T for R in Rs]
        q = sum(fro(ov @ M) / (fro(ov) * fro(M)) for M in qks) / len(Rs)
        k = sum(fro(ov @ M.T) / (fro(ov) * fro(M)) for M in qks) / len(Rs)
        ov2 = a2.W_V[0] @ a2.W_O[0]
        v = fro(ov @ ov2) / (fro(ov) * fro(ov2))
        for kind, want in (("q", q), ("k", k), ("v", v)):
            assert abs(float(raw[kind][l1, h1, l2, h2]) - float(want)) < 1e-10
    assert default_offsets(2048) == [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def test_rotary_skip_trigram_qk_is_the_offset_mean() -> None:
    m = Transformer(MODERN.replace(normalization="none", d_mlp=None, gated_mlp=False, n_layers=1), seed=2).double()
    w = Weights.from_model(m, dtype=torch.float64)
    table = TrigramTable(w, 0, 1, offsets=[1, 2, 5])
    att, W_E = w.attention(0, 1), w.W_E
    dense = (
        sum(
            W_E @ att.W_Q[0] @ relative_rotation(w.cfg, d, dtype=torch.float64) @ att.W_K[0].T @ W_E.T
            for d in (1, 2, 5)
        )
        / 3
    )
    want = (dense - dense.mean(-1, keepdim=True)).T  # [source, destination], centred over sources
    assert (table.qk.materialize() - want).abs().max() < 1e-10


def test_position_free_qk_circuits_are_refused_for_rotary_models() -> None:
    w = Weights.from_model(Transformer(MODERN, seed=0))
    for call in (lambda: Cc.full_qk(w, 0, 0), lambda: Cc.qk(w)):
        with pytest.raises(QkovError, match="depends on the offset"):
            call()
    with pytest.raises(QkovError, match="offsets must lie in 0 .. 11"):
        offset_qk(w, 0, 0, 12)
    with pytest.raises(QkovError, match="for rotary models"):
        offset_qk(Weights.from_model(Transformer(MODERN.replace(positional="standard"), seed=0)), 0, 0, 1)
    with pytest.raises(QkovError, match="offsets apply to rotary models only"):
        Cc.circuits_report(Weights.from_model(Transformer(MODERN.replace(positional="standard"), seed=0)), offsets=[1])


def test_parallel_block_mlp_does_not_read_its_own_layers_heads() -> None:
    """In a parallel block the MLP reads the stream attention reads: no virtual weight from a
    head of the same layer, but one from the layer before; the gated MLP's W_in is the reader."""
    cfg = MODERN.replace(parallel=True)
    w = Weights.from_model(Transformer(cfg, seed=0))
    with pytest.raises(QkovError, match="does not come after"):
        Cc.virtual_weights(w, ("head", 1, 0), ("mlp", 1))
    vw = Cc.virtual_weights(w, ("head", 0, 0), ("mlp", 1)).materialize()
    assert torch.allclose(vw, w.W_O[0, 0] @ w.W_in[1])
    sequential = Weights.from_model(Transformer(MODERN, seed=0))
    assert Cc.virtual_weights(sequential, ("head", 1, 0), ("mlp", 1)).shape == (cfg.d_head, cfg.d_mlp)


def test_a_rotary_model_trains_saves_and_loads(tmp_path, small_corpus) -> None:  # type: ignore[no-untyped-def]
    """Training keeps working with the new options (fused attention rotates and repeats K/V)."""
    import qkov
    from qkov.io.checkpoint import load

    from helpers import TINY, tiny_train

    cfg = TINY.replace(positional="rotary", n_kv_heads=1, normalization="rmsnorm", d_mlp=32, gated_mlp=True)
    model = qkov.train(tmp_path / "run", cfg, tiny_train(small_corpus, steps=4), device="cpu")
    back = load(tmp_path / "run")
    assert back.cfg == cfg
    toks = torch.randint(0, cfg.d_vocab, (2, cfg.n_ctx), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (back(toks) - model(toks)).abs().max() == 0
        assert (trace(Weights.from_model(back, center_unembed=False), toks).logits - back(toks)).abs().max() < 1e-4


def test_bfloat16_products_move_composition_scores_little() -> None:
    m = perturb_non_matrices(Transformer(MODERN.replace(n_layers=3, d_model=64, d_head=16), seed=5), 0.2)
    w = Weights.from_model(m)
    exact, fast = composition_raw(w, "qkv"), composition_raw(w, "qkv", matmul_dtype=torch.bfloat16)
    for kind in "qkv":
        diff = (exact[kind] - fast[kind]).nan_to_num().abs().max()
        assert 0 < diff < 2e-3, (kind, diff)


def test_term_importance_of_a_rotary_grouped_query_model_by_brute_force() -> None:
    """Run n of the paper's procedure = orders 0..n-1 of the expansion with the (rotary) patterns
    frozen, recomputed from the reference forward's patterns with each query head's KV weights."""
    from reference import reference_loss

    cfg = ModelConfig(
        n_layers=2, n_heads=4, n_kv_heads=2, d_model=16, d_head=4, d_vocab=30, n_ctx=10, positional="rotary"
    )
    w = Weights.from_model(Transformer(cfg, seed=4).double(), dtype=torch.float64)
    tokens = torch.randint(0, 30, (3, 10), generator=torch.Generator().manual_seed(1))
    ti = P.term_importance(w, tokens)
    _, patterns = reference_forward(w, tokens)
    terms = [w.W_E[tokens]]
    for l in range(2):
        new = [t.clone() for t in terms] + [torch.zeros_like(terms[0])]
        for k, t in enumerate(terms):
            for h in range(4):
                new[k + 1] += patterns[l, :, h] @ t @ w.W_V[l, h // 2] @ w.W_O[l, h]
        terms = new
    for n in range(1, 4):
        assert ti.run_losses[n - 1] == pytest.approx(reference_loss(sum(terms[:n]) @ w.W_U, tokens), abs=1e-9)
