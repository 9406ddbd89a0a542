"""Circuits: hand-built answers, materialised references, and parity with TransformerLens 3.9."""

from __future__ import annotations

import math

import pytest
import torch

from qkov import ModelConfig, QkovError, Transformer
from qkov.analysis import circuits as C
from qkov.analysis.circuits import composition as Cm
from qkov.analysis.circuits.factored import LowRank
from qkov.weights import Weights
from hand_built import identity_model

CFG = ModelConfig(n_layers=3, n_heads=4, d_model=32, d_head=8, d_vocab=60, n_ctx=20)


def weights(cfg: ModelConfig = CFG, seed: int = 0) -> tuple[Transformer, Weights]:
    m = Transformer(cfg, seed=seed).double()
    return m, Weights.from_model(m, dtype=torch.float64)


def test_copying_score_hand_built() -> None:
    pos = C.copying_scores(identity_model(10, 3, +1.0), diag_k=1)
    neg = C.copying_scores(identity_model(10, 3, -1.0), diag_k=1)
    assert all(abs(h.eigen_score - 1.0) < 1e-12 for h in pos)
    assert all(abs(h.eigen_score + 1.0) < 1e-12 for h in neg)
    # positive projection: the 3 projected tokens rank their own logit first; the other 7 rows are
    # all zeros, a tie that does not count as "own logit in the top 1"
    assert all(h.diag_topk_rate == pytest.approx(0.3) for h in pos)
    assert all(h.diag_topk_rate == 0.0 for h in C.copying_scores(identity_model(10, 3, 0.0), diag_k=5))
    scores = [h.eigen_score for seed in range(20) for h in C.copying_scores(weights(seed=seed)[1], diag_k=None)]
    assert abs(sum(scores) / len(scores)) < 0.1
    assert max(abs(s) for s in scores) < 0.9


def test_diag_rank_counts_ties_against_the_diagonal_in_both_paths() -> None:
    """``diag_rank``: how many other entries of a row are at least its diagonal one (ties count against
    it), by brute force on integer-valued factors full of ties, through the one-matrix path and the
    batched one."""
    g = torch.Generator().manual_seed(0)
    A, B = torch.randint(-1, 2, (2, 9, 2), generator=g).double(), torch.randint(-1, 2, (2, 9), generator=g).double()
    M = A @ B  # [2, 9, 9]
    want = torch.stack([(M[b] >= M[b].diagonal()[:, None]).sum(-1) - 1 for b in range(2)])
    assert torch.equal(LowRank(A[0], B).diag_rank(), want[0])
    assert torch.equal(LowRank(A, B).diag_rank(), want)
    assert int((want > 0).sum()) > 3 and bool((M == M.diagonal(dim1=1, dim2=2)[..., None]).sum(-1).gt(1).any())


def test_full_circuits_match_materialised_products() -> None:
    _, w = weights()
    E, U, P = w.W_E, w.W_U, w.W_pos
    for layer, head in [(0, 0), (2, 3)]:
        OV = w.W_V[layer, head] @ w.W_O[layer, head]
        QK = w.W_Q[layer, head] @ w.W_K[layer, head].T
        assert torch.allclose(C.full_ov(w, layer, head).materialize(), E @ OV @ U)
        assert torch.allclose(C.full_qk(w, layer, head).materialize(), E @ QK @ E.T)
        assert torch.allclose(C.positional_qk(w, layer, head).materialize(), P @ QK @ P.T)
        tp, pt = C.token_position_qk(w, layer, head)
        assert torch.allclose(tp.materialize(), E @ QK @ P.T) and torch.allclose(pt.materialize(), P @ QK @ E.T)
        assert torch.allclose(C.qk(w)[layer, head].materialize(), QK)
        assert torch.allclose(C.ov(w)[layer, head].materialize(), OV)


def test_token_and_position_terms_sum_to_real_scores() -> None:
    m, w = weights()
    tokens = torch.randint(0, CFG.d_vocab, (1, 12))
    layer, head = 0, 1
    with torch.no_grad():
        q, k, _ = m.blocks[0].attn.qkv(m.W_E[tokens] + m.W_pos[:12], m.W_E[tokens])
    real = q[0, head] @ k[0, head].T
    t = tokens[0]
    pos = torch.arange(12)
    tp, pt = C.token_position_qk(w, layer, head)
    total = (
        C.full_qk(w, layer, head).materialize()[t][:, t]
        + tp.materialize()[t][:, pos]
        + pt.materialize()[pos][:, t]
        + C.positional_qk(w, layer, head).materialize()[:12, :12]
    )
    assert torch.allclose(total, real, atol=1e-10)


def test_virtual_weights() -> None:
    _, w = weights()
    v = C.virtual_weights(w, ("head", 0, 1), ("k", 2, 3))
    assert torch.allclose(v.materialize(), w.W_O[0, 1] @ w.W_K[2, 3])
    assert C.virtual_weights(w, ("embed",), ("q", 0, 0)).shape == (60, 8)
    assert torch.allclose(C.virtual_weights(w, ("head", 1, 0), ("unembed",)).materialize(), w.W_O[1, 0] @ w.W_U)
    with pytest.raises(QkovError, match="does not come after"):
        C.virtual_weights(w, ("head", 1, 0), ("v", 1, 2))
    with pytest.raises(QkovError, match="no MLP"):
        C.virtual_weights(w, ("mlp", 0), ("unembed",))
    with pytest.raises(QkovError, match="no head"):
        C.virtual_weights(w, ("head", 5, 0), ("unembed",))
    # shortformer positions reach only queries and keys
    assert torch.allclose(C.virtual_weights(w, ("pos",), ("k", 1, 2)).materialize(), w.W_pos @ w.W_K[1, 2])
    with pytest.raises(QkovError, match="only the query/key input"):
        C.virtual_weights(w, ("pos",), ("v", 1, 2))


def test_composition_against_materialised_formula() -> None:
    _, w = weights()
    OV = w.W_V @ w.W_O
    QK = w.W_Q @ w.W_K.transpose(-1, -2)
    fro = torch.linalg.matrix_norm
    for kind, right in (("q", QK), ("k", QK.transpose(-1, -2)), ("v", OV)):
        raw = Cm.composition_raw(w, kind)[kind]
        for l1, h1, l2, h2 in [(0, 0, 1, 1), (0, 3, 2, 0), (1, 2, 2, 3)]:
            ref = fro(OV[l1, h1] @ right[l2, h2]) / (fro(OV[l1, h1]) * fro(right[l2, h2]))
            assert abs(float(raw[l1, h1, l2, h2]) - float(ref)) < 1e-12
        assert torch.isnan(raw[1, 0, 0, 0]) and torch.isnan(raw[1, 0, 1, 0])


def test_composition_detects_a_planted_k_composition() -> None:
    m, _ = weights(ModelConfig(n_layers=2, n_heads=2, d_model=32, d_head=4, d_vocab=40, n_ctx=8))
    with torch.no_grad():  # layer-1 head 0 keys read exactly what layer-0 head 1 writes
        m.blocks[1].attn.W_K[0].copy_(m.blocks[0].attn.W_O[1].T)
    w = Weights.from_model(m, dtype=torch.float64)
    k = Cm.composition_scores(w, "k").k
    top = k.pairs()[0]
    assert (top["writer"], top["reader"]) == ("0.1", "1.0")
    assert top["adjusted"] > 5 * k.baseline.std


def test_baseline_is_a_sensible_random_expectation() -> None:
    b = Cm.composition_baseline(256, 256, "v", samples=64)
    assert abs(b.mean - 1 / math.sqrt(256)) < 0.01  # full-rank: ~1/sqrt(d_model)
    low = Cm.composition_baseline(256, 32, "k", samples=64)
    assert abs(low.mean - 1 / math.sqrt(256)) < 0.01  # the mean barely depends on the rank ...
    assert low.std > 2 * b.std  # ... but the spread does
    assert Cm.composition_baseline(256, 32, "k", samples=64, seed=0) == low


def test_bandwidth_and_overlap() -> None:
    _, w = weights(ModelConfig(n_layers=3, n_heads=4, d_model=32, d_head=8, d_vocab=40, n_ctx=8, d_mlp=64))
    b = C.bandwidth(w.cfg)
    assert [x.before for x in b] == [0, 96, 192] and b[2].to_dict()["before_ratio"] == 6.0
    ov = C.write_overlap(w)
    assert torch.allclose(ov.overlap.diagonal(), torch.ones(12, dtype=torch.float64))
    off = ov.overlap[~torch.eye(12, dtype=torch.bool)]
    assert abs(float(off.mean()) - 8 / 32) < 0.1


def test_diagonal_topk_rate_against_materialised() -> None:
    _, w = weights()
    full = C.full_ov(w, 1, 2).materialize()
    ranks = (full > full.diagonal()[:, None]).sum(-1)
    assert C.diagonal_topk_rate(w, 1, 2, k=10, max_bytes=1000) == pytest.approx(float((ranks < 10).float().mean()))


def test_copying_scores_read_heads_out_in_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """copying_scores reads a layer's heads out by the unembedding a group at a time (here groups of 3 for
    4 heads, so one group is short): each head's own-logit rate equals diagonal_topk_rate (its full OV
    circuit read alone) and each ``on_head`` product is that head's ``W_O[h] @ W_U``."""
    from qkov.analysis.circuits import copying as Cp

    _, w = weights()
    monkeypatch.setattr(Cp, "READ_OUT_BYTES", 3 * CFG.d_head * CFG.d_vocab * 8)
    seen: dict[tuple[int, int], torch.Tensor] = {}
    got = C.copying_scores(w, diag_k=10, on_head=lambda l, h, OU: seen.__setitem__((l, h), OU.clone()))
    rates = [c.diag_topk_rate for c in got]
    assert rates == [pytest.approx(C.diagonal_topk_rate(w, c.layer, c.head, k=10)) for c in got]
    assert len(set(rates)) > 3  # the heads' rates differ: a head read out as another would show
    for (l, h), OU in seen.items():
        assert torch.allclose(OU, w.attention(l).W_O[h] @ w.W_U, atol=1e-12)
    assert len(seen) == CFG.n_layers * CFG.n_heads


# ------------------------------------------------------------ TransformerLens parity
tl = pytest.importorskip("transformer_lens", reason="transformer-lens is a test extra: pip install -e '.[dev]'")


@pytest.fixture(scope="module")
def pair() -> tuple[Transformer, object, Weights]:
    from qkov.io import to_hooked

    m = Transformer(ModelConfig(n_layers=3, n_heads=4, d_model=32, d_head=8, d_vocab=60, n_ctx=20), seed=3).double()
    hooked = to_hooked(m, dtype=torch.float64)
    with torch.no_grad():
        logits = hooked(torch.arange(20)[None])
        # the weights TransformerLens analyses; for this LayerNorm-free model only the unembedding is centred
        hooked.process_weights_(fold_ln=True, center_writing_weights=True, center_unembed=True)
        assert (hooked(torch.arange(20)[None]).log_softmax(-1) - logits.log_softmax(-1)).abs().max() < 1e-6
    return m, hooked, Weights.from_model(m, dtype=torch.float64)  # qkov's default view: the same weights


def test_tl_logits_match(pair) -> None:
    m, hooked, _ = pair
    tokens = torch.randint(0, 60, (2, 20))
    with torch.no_grad():  # the processed TransformerLens model: the same distribution (logits moved by a constant)
        assert (m(tokens).log_softmax(-1) - hooked(tokens).log_softmax(-1)).abs().max() < 1e-6


def _sorted(z: torch.Tensor) -> torch.Tensor:
    return torch.stack([z.real, z.imag], -1)[torch.argsort(z.real * 1e6 + z.imag)]


def test_tl_ov_eigenvalues_and_copying_scores(pair) -> None:
    _, hooked, w = pair
    ours = LowRank(w.W_V, w.W_O).eigenvalues()
    theirs = hooked.OV.eigenvalues
    full_theirs = (hooked.W_E @ hooked.OV @ hooked.W_U).eigenvalues
    full_ours = C.ov_eigenvalues(w)
    for l in range(3):
        for h in range(4):
            assert torch.allclose(_sorted(ours[l, h]), _sorted(theirs[l, h]), atol=1e-5)
            assert torch.allclose(_sorted(full_ours[l, h]), _sorted(full_theirs[l, h]), atol=1e-5)
    tl_copy = full_theirs.sum(-1).real / full_theirs.abs().sum(-1)
    ours_copy = torch.tensor([h.eigen_score for h in C.copying_scores(w, diag_k=None)]).reshape(3, 4)
    assert (tl_copy - ours_copy).abs().max() < 1e-5


@pytest.mark.parametrize("kind", ["q", "k", "v"])
def test_tl_composition_scores(pair, kind: str) -> None:
    _, hooked, w = pair
    theirs = hooked.all_composition_scores(kind.upper())
    ours = Cm.composition_raw(w, kind)[kind]
    valid = ~torch.isnan(ours)
    assert valid.sum() == 3 * 16  # (0,1), (0,2), (1,2) layer pairs x 16 head pairs
    assert (ours[valid] - theirs[valid]).abs().max() < 1e-5
    assert (theirs[~valid] == 0).all()
