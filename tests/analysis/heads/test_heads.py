"""Head detectors on hand-built models whose answer is known."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qkov import ModelConfig, Transformer, trace
from qkov.analysis import circuits as Cc
from qkov.analysis import heads as Hd
from qkov.analysis.heads.probes import induction_probe, induction_probe_tokens, prefix_matching_tokens
from qkov.weights import Weights
from hand_built import CTX, V, hand_built, natural_text


def test_hand_built_model_behaves_as_designed() -> None:
    m = hand_built()
    rep = prefix_matching_tokens(V, length=15, repeats=4, examples=4, seed=1, bos=0)
    with torch.no_grad():
        logits = m(rep)
    # the induction head predicts the repeated tokens: second-copy loss far below the first
    logp = logits.log_softmax(-1)[:, :-1].gather(-1, rep[:, 1:, None])[..., 0]
    assert -logp[:, 16:30].mean() < 0.5 * -logp[:, 1:15].mean()


def test_detectors_name_exactly_the_designed_heads() -> None:
    w = Weights.from_model(hand_built())
    report = Hd.head_report(w, natural_text(), seed=0)
    s = report.scores
    assert s["previous_token"][0, 0] > 0.95 and s["previous_token"].flatten()[1:].max() < 0.3
    assert s["sink"][0, 1] > 0.95
    assert s["prefix_matching"][1, 0] > 0.9
    assert s["prefix_matching"][0].max() < 0.3 and s["prefix_matching"][1, 1] < 0.3
    assert s["copying"][1, 0] > 0.9  # it raises exactly the token it attends to
    assert s["eigen_copying"][1, 0] > 0.99 and s["eigen_copying"][1, 1] > 0.99
    roles = {r["head"]: r["roles"] for r in report.rows()}
    assert "previous-token" in roles["0.0"] and "positional" in roles["0.0"]
    assert "sink" in roles["0.1"]
    assert "induction" in roles["1.0"] and "copying" in roles["1.0"]
    assert "induction" not in roles["1.1"] and "copying" in roles["1.1"]
    assert all("induction" not in roles[h] for h in ("0.0", "0.1"))
    # the ICL curve is the training model's mean loss at each position of the same text, and the
    # score its late window's mean (the 10 positions ending at the last, 62) minus its early
    # window's (the 10 from 45, around token 50): random tokens, so no in-context gain (not negative)
    m = hand_built()
    text = natural_text()
    with torch.no_grad():
        nll = -m(text)[:, :-1].log_softmax(-1).gather(-1, text[:, 1:, None])[..., 0].mean(0)
    icl = report.icl
    assert icl is not None and (icl.early, icl.late) == (50, CTX - 2)
    assert np.allclose(icl.loss_by_position, nll.numpy(), atol=1e-4)
    score = float(nll[CTX - 11 : CTX - 1].mean() - nll[45:55].mean())
    assert icl.score == pytest.approx(score, abs=1e-4) and score > 0


def test_value_weighted_sink_sees_an_empty_sink() -> None:
    w = Weights.from_model(hand_built())
    report = Hd.head_report(w, natural_text(), seed=0, diag_k=None)
    # head 0.1 attends to position 0 but its OV is zero: value-weighted share is 0 (nothing moved)
    assert report.scores["sink"][0, 1] > 0.95
    assert report.scores["sink_value_weighted"][0, 1] == 0


def test_memory_management_head_and_neurons() -> None:
    cfg = ModelConfig(n_layers=1, n_heads=2, d_model=16, d_head=4, d_vocab=20, n_ctx=8, d_mlp=8)
    m = Transformer(cfg, seed=0)
    with torch.no_grad():
        a = m.blocks[0].attn
        a.W_Q[0].zero_()
        a.W_K[0].zero_()
        a.W_Q[0, :, 0] = 50.0 * torch.arange(16.0)  # not needed for the OV test
        P = torch.eye(16)[:, :4]
        a.W_V[0] = P
        a.W_O[0] = -2.0 * P.T  # W_OV = -2 * projection: deletes what it reads
        m.blocks[0].mlp.W_out[3] = -m.blocks[0].mlp.W_in[:, 3]
    w = Weights.from_model(m)
    res = Cc.eigen_copying_score(Cc.residual_ov_eigenvalues(w))
    assert res[0, 0] < -0.99
    neurons = Hd.memory_neurons(w)
    assert {"layer": 0, "neuron": 3} in [{k: n[k] for k in ("layer", "neuron")} for n in neurons]
    assert all(n["cosine"] < -0.5 for n in neurons)


def test_prefix_matching_tokens_respect_frequencies() -> None:
    freq = np.arange(100, dtype=np.float64)  # id 99 most frequent, id 1 least (0 is the start token)
    t = prefix_matching_tokens(100, length=25, repeats=4, examples=10, seed=3, bos=0, frequencies=freq)
    assert t.shape == (10, 101) and (t[:, 0] == 0).all()
    assert torch.equal(t[:, 1:26], t[:, 26:51]) and torch.equal(t[:, 1:26], t[:, 76:101])
    body = t[:, 1:]
    assert body.min() >= 20 and body.max() <= 94  # bottom 20% and top 5% dropped
    assert all(len(set(row[:25].tolist())) == 25 for row in body)  # distinct within a block
    assert torch.equal(t, prefix_matching_tokens(100, length=25, seed=3, bos=0, frequencies=freq))


def test_training_probe_finds_the_induction_head() -> None:
    """The probe training runs (uniform random tokens repeated twice) names head 1.0 of the
    hand-built model, and the second copy's loss is far below the first's."""
    probe = induction_probe(Weights.from_model(hand_built()), length=20, batch=4, seed=2)
    assert probe.best_head == (1, 0) and probe.best > 0.7  # < 1: ids drawn with replacement repeat within a copy
    assert probe.induction_attention[1, 1] < 0.2 and probe.induction_attention[0].max() < 0.2
    assert probe.loss_by_copy[1] < 0.5 * probe.loss_by_copy[0]
    toks = induction_probe_tokens(V, length=20, batch=4, seed=2, bos=0)
    assert toks.shape == (4, 41) and (toks[:, 0] == 0).all() and torch.equal(toks[:, 1:21], toks[:, 21:])
    assert toks[:, 1:].min() >= 1


def test_positional_fraction_is_unchanged_by_a_rotation_of_the_stream() -> None:
    """A rotated (``scale``) view reads positions as the run does (divided, not centred): the
    positional fraction, like the attention it describes, does not depend on the basis."""
    from helpers import LN_MLP, perturb_non_matrices

    cfg = LN_MLP.replace(n_ctx=10)
    m = perturb_non_matrices(Transformer(cfg, seed=2).double(), 0.3)
    good = Weights.from_model(m, dtype=torch.float64, center_writing=True)
    q, r = torch.linalg.qr(
        torch.randn(cfg.d_model, cfg.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    )
    rotated = good.rotate(q * torch.sign(torch.diagonal(r)))
    text = torch.randint(1, cfg.d_vocab, (3, 10), generator=torch.Generator().manual_seed(2))
    fractions = []
    for w in (good, rotated):
        r = trace(w, text, cache=["qk_in", "*_scale*"])
        fractions.append(Hd.positional_fraction(w, r))
    assert rotated.norm == "scale" and (fractions[0] - fractions[1]).abs().max() < 1e-9
    assert fractions[0].max() > 0.05  # positions do matter in this model


def test_positional_fraction_is_its_definition_on_a_recording_and_on_a_live_pass() -> None:
    """Var_k(pos-pos term) / Var_k(real score), each query's variance over the keys it sees, clipped and averaged
    over queries >= 1 and sequences, written out per head, sequence and query with ``torch.var``: the recording's
    route (scores formed from ``qk_in``) and the streamed text scores (the forward's own scores) both equal it."""
    from helpers import LN_MLP, perturb_non_matrices
    from qkov.analysis.heads.pattern_scores import text_scores

    cfg = LN_MLP.replace(n_ctx=10)
    w = Weights.from_model(perturb_non_matrices(Transformer(cfg, seed=6).double(), 0.3), dtype=torch.float64)
    text = torch.randint(1, cfg.d_vocab, (3, 10), generator=torch.Generator().manual_seed(5))
    r = trace(w, text, cache=["qk_in", "*_scale*"])
    want = torch.zeros(cfg.n_layers, cfg.n_heads, dtype=torch.float64)
    pos = w.pos()[:10]
    for l in range(cfg.n_layers):
        att, x, scale = w.attention(l), r["qk_in", l], r.divisor("attn_qk", l)
        assert w.norm == "folded" and scale is not None  # positions read as the run reads them: centred, divided
        for b in range(3):
            p = (pos - pos.mean(-1, keepdim=True)) / scale[b]
            for h in range(cfg.n_heads):
                real = (x[b] @ att.W_Q[h] + att.b_Q[h]) @ (x[b] @ att.W_K[h] + att.b_K[h]).T
                pp = (p @ att.W_Q[h]) @ (p @ att.W_K[h]).T
                ratios = [
                    (pp[i, : i + 1].var(correction=0) / real[i, : i + 1].var(correction=0)).clamp(0, 1)
                    for i in range(1, 10)
                ]
                want[l, h] += torch.stack(ratios).mean() / 3
    assert float(want.min()) > 0.01
    assert torch.allclose(Hd.positional_fraction(w, r), want, atol=1e-12, rtol=0)
    assert torch.allclose(text_scores(w, text, chunk=2)["positional_fraction"], want, atol=1e-12, rtol=0)


def test_positional_fraction_keeps_its_digits_when_scores_share_a_large_offset() -> None:
    """A large key bias adds ``q . b_K`` to every score of a query: the variance over keys is unchanged, and the
    float32 fraction equals the float64 one (a one-pass variance, mean(s^2) - mean(s)^2, loses its digits)."""
    from helpers import LN_MLP, perturb_non_matrices

    cfg = LN_MLP.replace(n_ctx=24)
    m = perturb_non_matrices(Transformer(cfg, seed=4).double(), 0.3)
    with torch.no_grad():
        for block in m.blocks:
            block.attn.b_K.normal_(0.0, 300.0, generator=torch.Generator().manual_seed(7))
    text = torch.randint(1, cfg.d_vocab, (3, 24), generator=torch.Generator().manual_seed(2))
    got = {}
    for dtype in (torch.float32, torch.float64):
        w = Weights.from_model(m, dtype=dtype)
        got[dtype] = Hd.positional_fraction(w, trace(w, text, cache=["qk_in", "*_scale*"])).double()
    want = got[torch.float64]
    assert float(want.min()) > 1e-4  # every head's score varies with position
    err = ((got[torch.float32] - want).abs() / want).max()
    assert err < 1e-3, err


def test_induction_needs_attention_and_copying() -> None:
    """[I]: an induction head attends to the token after the earlier occurrence AND copies it.
    Head 1.0 of the hand-built model with its copying OV replaced by a random one keeps its
    attention (prefix matching ~1) and a positive eigenvalue score (the old criterion, which about
    half of random OV circuits pass), but its logits do not single out what it attends to: no
    induction role. The copying head keeps it."""
    m = hand_built()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        a1 = m.blocks[1].attn
        a1.W_V[0] = torch.randn(a1.W_V[0].shape, generator=g) / CTX**0.5
        a1.W_O[0] = torch.randn(a1.W_O[0].shape, generator=g) / CTX**0.5
    report = Hd.head_report(Weights.from_model(m), natural_text(), seed=0, diag_k=None)
    s = report.scores
    assert s["prefix_matching"][1, 0] > 0.9 and s["eigen_copying"][1, 0] > 0  # what the old role looked at
    assert abs(float(s["copying_rank"][1, 0])) < 0.2  # chance: the head does not raise what it attends to
    assert "induction" not in report.roles[1][0]
    good = Hd.head_report(Weights.from_model(hand_built()), natural_text(), seed=0, diag_k=None)
    assert good.scores["copying_rank"][1, 0] > 0.95 and "induction" in good.roles[1][0]


def test_rank_copying_of_a_silent_head_is_chance() -> None:
    """A head whose output is zero gives every token the same logit: ties count half, so its rank
    copying is exactly 0 (chance), not +1 or -1."""
    m = hand_built()
    with torch.no_grad():
        m.blocks[1].attn.W_O[0].zero_()
    report = Hd.head_report(Weights.from_model(m), natural_text(), seed=0, diag_k=None)
    assert float(report.scores["copying_rank"][1, 0]) == 0.0


@pytest.mark.parametrize("diag_k", [5, None])
def test_head_report_hands_the_copying_products_to_the_repeated_token_scores(diag_k: int | None) -> None:
    """head_report forms each head's W_O W_U once (in the copying scores) and hands it to the
    repeated-token copying scores: the same scores as repeat_scores forming its own, and the product
    handed over is the dense W_O[h] @ W_U of that head (LayerNorm, MLP, biases)."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        n_layers=2, n_heads=3, d_model=48, d_head=16, d_vocab=97, n_ctx=64, normalization="layernorm", d_mlp=96, bias=True
    )
    w = Weights.from_model(Transformer(cfg).eval())
    report = Hd.head_report(w, natural_text(), seed=0, diag_k=diag_k, icl=False)
    length = min(25, (cfg.n_ctx - 1) // 4)
    alone = Hd.repeat_scores(w, prefix_matching_tokens(cfg.d_vocab, length=length, seed=0, bos=0), length)
    for key, mine in (("copying", alone.copying), ("copying_rank", alone.copying_rank), ("induction", alone.induction_attention)):
        torch.testing.assert_close(report.scores[key], mine.float(), rtol=1e-6, atol=1e-6)
    assert alone.copying.abs().max() > 0  # a random model still scores something
    handed: dict[tuple[int, int], torch.Tensor] = {}
    Cc.copying_scores(w, diag_k=diag_k, on_head=lambda l, h, OU: handed.__setitem__((l, h), OU.clone()))
    assert sorted(handed) == [(l, h) for l in range(2) for h in range(3)]
    for (l, h), OU in handed.items():
        torch.testing.assert_close(OU, w.attention(l).W_O[h] @ w.unembed().W_U)
