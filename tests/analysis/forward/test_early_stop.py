"""A recording that asks for no logits (``trace(..., logits=False)`` or empty ``positions``) stops once the
last site it caches or edits is computed: the sites read hold the full pass's values bit for bit, the
layers after them never run (counted at the weights each layer reads), and nothing is unembedded."""

from __future__ import annotations

import pytest
import torch

from qkov import Transformer, Weights, trace
from qkov.analysis.forward import tracer

from helpers import LN_MLP, MODERN, TINY, perturb_non_matrices

CONFIGS = {
    "attn-only": TINY,
    "layernorm-mlp": LN_MLP.replace(n_layers=3),
    "rotary-gqa-gated": MODERN,
    "parallel": MODERN.replace(normalization="layernorm", gated_mlp=False, act_fn="gelu", parallel=True, n_kv_heads=None),
}


def _view(name: str) -> Weights:
    model = perturb_non_matrices(Transformer(CONFIGS[name], seed=1).double().eval(), 0.1)
    return Weights.from_model(model, dtype=torch.float64)


def _tokens(w: Weights) -> torch.Tensor:
    return torch.randint(0, w.cfg.d_vocab, (2, w.cfg.n_ctx), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """The layers whose attention and MLP weights a pass reads, and its unembeddings (what ran)."""
    seen: dict[str, list[int]] = {"attention": [], "mlp": [], "unembed": []}
    real_att, real_mlp = tracer._Pass.attention_weights, tracer._Pass.mlp_weights

    def attention(self, l):  # type: ignore[no-untyped-def]
        seen["attention"].append(l)
        return real_att(self, l)

    def mlp(self, l):  # type: ignore[no-untyped-def]
        seen["mlp"].append(l)
        return real_mlp(self, l)

    real_unembed = Weights.unembed

    def unembed(self, *a, **k):  # type: ignore[no-untyped-def]
        seen["unembed"].append(1)
        return real_unembed(self, *a, **k)

    monkeypatch.setattr(tracer._Pass, "attention_weights", attention)
    monkeypatch.setattr(tracer._Pass, "mlp_weights", mlp)
    monkeypatch.setattr(Weights, "unembed", unembed)
    return seen


def _clear(seen: dict[str, list[int]]) -> None:
    for v in seen.values():
        v.clear()


@pytest.mark.parametrize("name", CONFIGS)
def test_a_recording_without_logits_equals_the_full_pass_and_stops_at_its_last_site(name: str, reads) -> None:
    w = _view(name)
    toks, L = _tokens(w), w.cfg.n_layers
    mlp = w.cfg.d_mlp is not None
    cases = {  # sites asked -> (attention layers, MLP layers) that must run
        ("pattern.0",): (1, 0),
        ("z.1", "pattern.0"): (2, 1 if mlp else 0),
        (f"resid_pre.{L - 1}",): (L - 1, L - 1 if mlp else 0),
        (f"attn_out.{L - 1}",): (L, L - 1 if mlp else 0),
        ("embed",): (0, 0),
    }
    if mlp:
        cases[("mlp_out.0",)] = (1, 1)
    for sites, (n_att, n_mlp) in cases.items():
        full = trace(w, toks, cache=list(sites))
        _clear(reads)
        got = trace(w, toks, cache=list(sites), logits=False)
        assert reads["attention"] == list(range(n_att)) and reads["mlp"] == list(range(n_mlp)), sites
        assert reads["unembed"] == [], sites
        assert got.logits.shape == (2, 0, w.cfg.d_vocab)
        for s in sites:
            assert torch.equal(got[s], full[s]), (sites, s)
        empty = trace(w, toks, cache=list(sites), positions=torch.zeros(0, dtype=torch.long))
        assert all(torch.equal(empty[s], got[s]) for s in sites)


@pytest.mark.parametrize("name", ["layernorm-mlp", "rotary-gqa-gated"])
def test_edits_are_waited_for_and_start_at_and_grad_hold(name: str, reads) -> None:
    w = _view(name)
    toks, L = _tokens(w), w.cfg.n_layers
    seen: list[str] = []

    def observe(value: torch.Tensor, site) -> torch.Tensor:  # type: ignore[no-untyped-def]
        seen.append(site.name)
        return value

    zero = {"z.0.1": lambda z, site: torch.zeros_like(z), f"pattern.{L - 1}": observe}
    full = trace(w, toks, cache=["resid_pre.1"], edits=zero)
    _clear(reads)
    seen.clear()
    got = trace(w, toks, cache=["resid_pre.1"], edits=zero, logits=False)
    assert seen == [f"pattern.{L - 1}"] and reads["attention"] == list(range(L)) and reads["unembed"] == []
    assert torch.equal(got["resid_pre.1"], full["resid_pre.1"])
    assert (got["resid_pre.1"] - trace(w, toks, cache=["resid_pre.1"], logits=False)["resid_pre.1"]).abs().max() > 1e-6

    # a start inside the pass: the sites before it are never computed, so never waited for
    stream = full["resid_pre.1"]
    _clear(reads)
    got = trace(w, toks, cache=["embed", "z.1"], start_at=(1, stream), logits=False)
    assert reads["attention"] == [1] and reads["mlp"] == [] and "embed" not in got
    assert torch.equal(got["z.1"], trace(w, toks, cache=["z.1"], start_at=(1, stream))["z.1"])

    # differentiable: the gradient of a function of the last site read is the full pass's
    grads = []
    for logits in (True, False):
        r = trace(w, toks, cache=["embed", "pattern.1"], grad=True, logits=logits)
        r["pattern.1"][:, :, 3, 0].sum().backward()  # query 3 to key 0: a row sums to 1
        grads.append(r["embed"].grad)
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().max() > 0


def test_nothing_asked_runs_nothing(reads) -> None:
    w = _view("attn-only")
    got = trace(w, _tokens(w), logits=False)
    assert reads == {"attention": [], "mlp": [], "unembed": []} and got.logits.shape == (2, 0, w.cfg.d_vocab)
