"""The shortcuts the path analysis takes at real size, each against the straightforward computation:
term importance against the literal procedure through ``trace`` (every layer re-run on every run,
per-head outputs handed back with ``head_outputs=``), the loss against ``cross_entropy`` in
float64, the per-layer head unembedding against the term's own logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qkov.analysis import paths as P
from qkov.analysis.forward.tracer import trace
from qkov.analysis.paths.effects import SampledTerms, head_unembed, term_logits
from qkov.analysis.forward.frozen import frozen_edits, head_terms
from qkov.analysis.paths.importance import lm_loss, loss, rms
from qkov.weights import Weights

from helpers import perturb_non_matrices
from test_paths import make, toks
from qkov.analysis.forward.frozen import frozen_recording


def literal_run_losses(w: Weights, tokens: torch.Tensor) -> list[float]:
    """The paper's procedure as written: L + 1 full passes, each head adding its previous output."""
    c = w.cfg
    real = frozen_recording(w, tokens)
    frozen = frozen_edits(real)  # its patterns, divisors and MLP outputs
    B, T = tokens.shape
    outputs = [real.logits.new_zeros(B, T, c.n_heads, c.d_model) for _ in range(c.n_layers)]  # head_out layout
    losses = []
    for _ in range(c.n_layers + 1):
        live: dict[int, torch.Tensor] = {}

        def written(l: int) -> object:
            def write(value: torch.Tensor, site: object) -> torch.Tensor:
                live[l] = value.clone()  # what the heads computed on this run
                return outputs[l]  # what they add: the previous run's

            return write

        r = trace(w, tokens, edits={**frozen, **{f"head_out.{l}": written(l) for l in range(c.n_layers)}})
        losses.append(float(F.cross_entropy(r.logits[:, :-1].reshape(-1, c.d_vocab).double(), tokens[:, 1:].reshape(-1))))
        outputs = [live[l] for l in range(c.n_layers)]
    return losses


KINDS = [
    dict(normalization="layernorm", d_mlp=64, bias=True),
    dict(normalization="layernorm", d_mlp=64, bias=True, parallel=True),
    dict(normalization="rmsnorm", d_mlp=64, n_kv_heads=1),
    dict(),
]


@pytest.mark.parametrize("kw", KINDS)
@pytest.mark.parametrize("layers", [1, 3])
def test_term_importance_equals_the_literal_procedure(kw: dict, layers: int) -> None:
    positional = "rotary" if kw.get("normalization") == "rmsnorm" else "standard"
    m, _ = make(layers, positional, torch.float64, **kw)
    perturb_non_matrices(m, 0.3)
    w = Weights.from_model(m, dtype=torch.float64)
    tokens = toks((3, 16), seed=7)
    ti = P.term_importance(w, tokens)
    want = literal_run_losses(w, tokens)
    assert len(ti.run_losses) == layers + 1
    assert ti.run_losses == pytest.approx(want, abs=1e-10)
    assert len(set(round(x, 6) for x in want)) > 1  # the runs differ: the orders matter here


def test_loss_equals_float64_cross_entropy() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 5000, generator=g) * 8 + torch.randn(37, 1, generator=g) * 50  # wide, shifted rows
    target = torch.randint(0, 5000, (37,), generator=g)
    want = float(F.cross_entropy(logits.double(), target))
    kept = logits.clone()
    assert lm_loss(logits, target) == pytest.approx(want, abs=1e-6)
    assert torch.equal(logits, kept)  # not overwritten unless asked
    assert lm_loss(logits.clone(), target, overwrite=True) == lm_loss(logits, target)
    assert lm_loss(logits.double(), target) == pytest.approx(want, abs=1e-12)
    tokens = torch.randint(0, 5000, (2, 9), generator=g)
    lg = torch.randn(2, 9, 5000, generator=g, dtype=torch.float64)
    assert loss(lg, tokens) == pytest.approx(float(F.cross_entropy(lg[:, :-1].reshape(-1, 5000), tokens[:, 1:].reshape(-1))), abs=1e-12)
    assert rms(lg) == pytest.approx(float(lg.pow(2).mean().sqrt()), rel=1e-12)


def sampled_expansion(layers: int, dtype: torch.dtype, seed: int, **kw: object) -> tuple:
    """A perturbed model's weights, 6 x 16 tokens, their expansion with virtual heads, and 20 sampled positions."""
    m, _ = make(layers, "standard", dtype, **kw)
    perturb_non_matrices(m, 0.3)
    w = Weights.from_model(m, dtype=dtype)
    tokens = toks((6, 16), seed=seed)
    exp = P.expand(w, tokens, virtual_heads=True)
    return w, tokens, exp, P.effect_positions(exp, max_logits=20 * w.cfg.d_vocab)


@pytest.mark.parametrize("kw", [dict(normalization="layernorm", d_mlp=64, bias=True), dict()])
def test_shared_head_unembedding_gives_each_terms_own_logits(kw: dict) -> None:
    w, tokens, exp, pos = sampled_expansion(3, torch.float64, 5, **kw)
    b, t = pos[:, 0], pos[:, 1]
    U = head_unembed(w, 2)
    assert U.shape == (w.cfg.n_heads, w.cfg.d_head, w.cfg.d_vocab)
    for key in [(2, 0), (2, 1), (0, 2, 2, 2), (1, 0, 2, 1)]:
        x_in = exp.direct if len(key) == 2 else exp.heads[key[:2]]
        term = exp.heads[key] if len(key) == 2 else exp.virtual[key]
        want = exp.logits_of(term)[b, t][:, None]
        assert (term_logits(w, exp.recording, key, x_in, b, t, U) - want).abs().max() <= 1e-10 * want.abs().max()
    full = exp.recording.logits[b, t]
    through = SampledTerms(w, exp.recording, b, t, full)
    for key in [(0, 1), (0, 2), (1, 0, 2, 2), (2, 1)]:  # across layers, back and forth
        term = exp.heads[key] if len(key) == 2 else exp.virtual[key]
        own = exp.logits_of(term)[b, t]
        z, size = through.without(key, exp.direct if len(key) == 2 else exp.heads[key[:2]])
        assert (z - (full - own)).abs().max() <= 1e-10 * full.abs().max()
        assert size == pytest.approx(float(own.pow(2).mean().sqrt()), rel=1e-10)


def test_sampled_term_effects_equal_cross_entropy_of_the_terms_own_logits() -> None:
    """float32, as at real size: each effect is the float64 cross-entropy of (model - term) logits."""
    w, tokens, exp, pos = sampled_expansion(2, torch.float32, 4, normalization="layernorm", d_mlp=64, bias=True)
    b, t = pos[:, 0], pos[:, 1]
    effects = P.term_effects(exp, top_virtual=3, positions=pos)
    target = tokens[b, t + 1]
    full = exp.recording.logits[b, t]
    base = float(F.cross_entropy(full.double(), target))
    terms = {f"{l}.{h}": x for (l, h), x in exp.heads.items()}
    terms |= {f"{l1}.{h1}->{l2}.{h2}": x for (l1, h1, l2, h2), x in exp.virtual.items()}
    assert len(effects.singles) == 6 and len(effects.virtual) == 3
    for e in effects.singles + effects.virtual:
        own = exp.logits_of(terms[e.name])[b, t]
        assert e.loss_change == pytest.approx(float(F.cross_entropy((full - own).double(), target)) - base, abs=1e-5)
        assert e.size == pytest.approx(float(own.double().pow(2).mean().sqrt()), rel=1e-5)



@pytest.mark.parametrize("kw", [dict(normalization="layernorm", d_mlp=64, bias=True), dict()])
def test_materialised_virtual_heads_equal_the_reader_head_run_on_the_writers_term(kw: dict) -> None:
    """Each virtual term is what its reader head writes for the writer's order-1 term alone
    (``head_terms``); the kept ones are the largest, and the sum and largest norm are of all of them."""
    from qkov.analysis.paths import virtual as Vh

    m, _ = make(3, "standard", torch.float64, **kw)
    perturb_non_matrices(m, 0.3)
    w = Weights.from_model(m, dtype=torch.float64)
    exp = P.expand(w, toks((2, 16), seed=6))
    keys = Vh.virtual_keys(w.cfg)[::2]  # some pairs: not every reader of every writer
    want = {k: head_terms(w, exp.recording, k[2], exp.heads[k[:2]], heads=[k[3]])[0] for k in keys}
    every, total, largest = Vh.materialize(w, exp.recording, exp.heads, keys)
    assert list(every) == keys
    for k in keys:
        assert (every[k] - want[k]).abs().max() <= 1e-12 * want[k].abs().max()
    assert (total - sum(want.values())).abs().max() <= 1e-12 * total.abs().max()
    assert largest == pytest.approx(max(float(t.pow(2).sum().sqrt()) for t in want.values()), rel=1e-12)
    kept = Vh.materialize(w, exp.recording, exp.heads, keys, keep=4)[0]
    assert sorted(kept) == sorted(sorted(keys, key=lambda k: -float(want[k].pow(2).mean()))[:4])


@pytest.mark.parametrize("kw", KINDS)
def test_heads_write_without_value_bias_equals_the_sum_of_head_terms(kw: dict) -> None:
    positional = "rotary" if kw.get("normalization") == "rmsnorm" else "standard"
    m, _ = make(2, positional, torch.float64, **kw)
    perturb_non_matrices(m, 0.3)
    w = Weights.from_model(m, dtype=torch.float64)
    recording = frozen_recording(w, toks((2, 12), seed=3))
    x = torch.randn(2, 12, w.cfg.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for layer in range(2):
        want = head_terms(w, recording, layer, x).sum(0)
        torch.testing.assert_close(P.heads_write(w, recording, layer, x, value_bias=False), want, rtol=0, atol=1e-12)


def test_gram_in_column_blocks_equals_the_float64_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each head's ``P P^T`` (``P = R W_U``) as ``R (W_U W_U^T) R^T``, the vocabulary summed in column blocks:
    the float64 product of the factors."""
    from qkov.analysis.paths import effects as head_logits

    monkeypatch.setattr(head_logits, "GRAM_COLUMNS", 7)  # 50 columns: 7 full blocks and a short one
    g = torch.Generator().manual_seed(2)
    R, W_U = torch.randn(3, 5, 8, generator=g), torch.randn(8, 50, generator=g)
    UU = head_logits.unembed_gram(W_U)
    torch.testing.assert_close(UU, W_U.double() @ W_U.double().T, rtol=1e-13, atol=1e-13)
    Pm = R.double() @ W_U.double()
    torch.testing.assert_close(head_logits._gram(R, UU), Pm @ Pm.transpose(1, 2), rtol=1e-12, atol=1e-12)
