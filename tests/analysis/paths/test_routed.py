"""Path expansion through a routed residual stream (qkov.analysis.paths.routed): the terms sum to the
logits for every scheme (random and briefly trained), one identity stream is the standard expansion, and a
hand-built model with known routing gives the known path coefficients and per-head terms."""

from __future__ import annotations

import pytest
import torch

from qkov import ModelConfig, QkovError, Transformer, Weights
from qkov.analysis.forward.tracer import trace
from qkov.analysis.paths import expand, summarize, term_importance
from qkov.analysis.circuits.composition import composition_scores, routing_reach
from qkov.analysis.paths.routed import routing_coefficients

from hand_built import hand_built, natural_text
from model.test_bus import SHAPES, VARIANTS, routed, tokens


def _relative_error(e) -> float:  # type: ignore[no-untyped-def]
    lg = e.recording.logits
    return float((e.total_logits() - lg).abs().max() / lg.abs().max())


def _trained(m: Transformer, steps: int = 15) -> Transformer:
    """A few optimizer steps of next-token loss on random tokens: the routing moves off its start."""
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        ids = torch.randint(0, m.cfg.d_vocab, (4, 10), generator=g)
        loss = torch.nn.functional.cross_entropy(m(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_terms_sum_to_the_logits(variant: str, shape: str) -> None:
    for m in (routed(variant, shape), _trained(routed(variant, shape, spread=0.0))):
        e = expand(Weights.from_model(m), tokens(4))
        assert _relative_error(e) <= 1e-5
        assert torch.allclose(sum(e.heads.values()), e.orders[1], atol=1e-5)
        assert len(e.orders) == m.cfg.n_layers + 1
        capped = expand(Weights.from_model(m), tokens(4), max_order=1, per_head=False)
        assert len(capped.orders) == 2 and _relative_error(capped) <= 1e-5


def test_one_identity_stream_is_the_standard_expansion() -> None:
    base = ModelConfig(n_layers=3, n_heads=2, d_model=16, d_head=8, d_vocab=40, n_ctx=12, d_mlp=16, normalization="layernorm")
    std = Transformer(base, seed=2)
    hyp = Transformer(base.replace(residual="hyper", n_streams=1), seed=9)
    hyp.load_state_dict({**hyp.state_dict(), **std.state_dict()})
    ids = tokens(5)
    a = expand(Weights.from_model(std, center_writing=False), ids)
    b = expand(Weights.from_model(hyp), ids)
    for x, y in zip(a.orders + [a.bias, a.mlp], b.orders + [b.bias, b.mlp]):
        assert torch.allclose(x, y, atol=1e-5)
    assert all(torch.allclose(a.heads[k], b.heads[k], atol=1e-5) for k in a.heads)
    ta = term_importance(Weights.from_model(std, center_writing=False), ids)
    tb = term_importance(Weights.from_model(hyp), ids)
    assert max(abs(x - y) for x, y in zip(ta.run_losses, tb.run_losses)) < 1e-5


def _hand_built_hyper() -> Transformer:
    """The shared hand-built 2-layer attention-only model on two streams with set routing: layer 0 reads
    stream 0 and writes stream 1; layer 1 reads half of each and writes stream 0; no mixing (A_r = I)."""
    std = hand_built()
    m = Transformer(std.cfg.replace(residual="hyper", n_streams=2), seed=0)
    m.load_state_dict({**m.state_dict(), **std.state_dict()})
    with torch.no_grad():
        m.bus.A_m.copy_(torch.tensor([[1.0, 0.0], [0.5, 0.5]]))  # type: ignore[union-attr]
        m.bus.A_r.copy_(torch.eye(2).expand(2, 2, 2))  # type: ignore[union-attr]
        m.bus.B.copy_(torch.tensor([[0.0, 1.0], [1.0, 0.0]]))  # type: ignore[union-attr]
    return m


def test_hand_built_routing_gives_the_known_path_coefficients() -> None:
    m, ids = _hand_built_hyper(), natural_text(2)[:, :20]
    r = trace(m, ids, cache=["route_attn", "mix_attn", "write_attn", "route_final", "head_out", "embed"])
    C = routing_coefficients(m.cfg, r)[..., 0, 0]  # the same at every position: static
    # streams after layer 0: [emb, emb + o0]; layer 1 reads 0.5 emb + 0.5 (emb + o0) = emb + 0.5 o0;
    # after layer 1: [emb + o1, emb + o0]; the final read sums them: 2 emb + o0 + o1
    want = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.5, 0.0], [2.0, 1.0, 1.0]])
    assert torch.equal(C, want)
    e = expand(Weights.from_model(m), ids)
    assert _relative_error(e) <= 1e-5
    assert torch.allclose(e.orders[0], 2 * r["embed"])
    for h in range(2):  # layer 0 reads the embedding alone: its order-1 terms are its outputs, once each
        assert torch.allclose(e.heads[(0, h)], r["head_out", 0][:, :, h], atol=1e-5)
    # head 1.0's order-1 term: its frozen pattern over the embedding part of its input (coefficient 1),
    # reaching the final read with coefficient 1 (written by hand: this model has no normalisation)
    w = Weights.from_model(m)
    pattern = trace(m, ids, cache=["pattern.1"])["pattern", 1][:, 0]
    by_hand = pattern @ (r["embed"] @ w.W_V[1, 0]) @ w.W_O[1, 0]
    assert torch.allclose(e.heads[(1, 0)], by_hand, atol=1e-4)


def test_attnres_starts_with_uniform_coefficients() -> None:
    cfg = ModelConfig(n_layers=2, n_heads=2, d_model=16, d_head=8, d_vocab=40, n_ctx=12, residual="attnres")
    m = Transformer(cfg, seed=0)
    r = trace(m, tokens(), cache=["route_attn", "route_final"])
    C = routing_coefficients(cfg, r)[..., 0, 0]
    assert torch.allclose(C, torch.tensor([[1.0, 0, 0], [0.5, 0.5, 0], [1 / 3, 1 / 3, 1 / 3]]))


def test_summaries_work_and_virtual_heads_are_refused() -> None:
    m = routed("mhc", "ln-mlp")
    e = expand(Weights.from_model(m), tokens())
    assert e.reconstruction_error() < 1e-4
    ids = tokens()
    s = summarize(Weights.from_model(m), ids)
    assert not s.virtual and len(s.singles) == 6
    # the last run lets every order in: the model's own loss
    assert abs(s.importance.run_losses[-1] - s.importance.full_loss) < 1e-4
    with pytest.raises(QkovError, match="virtual-head terms need the additive"):
        expand(Weights.from_model(m), tokens(), virtual_heads=True)


def test_composition_is_weighted_by_what_reaches_the_reader() -> None:
    m, ids = _hand_built_hyper(), natural_text(2)[:, :20]
    w, plain = Weights.from_model(m), Weights.from_model(hand_built())
    assert float(routing_reach(w)[0, 1]) == 0.5  # layer 1 reads half of the stream layer 0 wrote
    assert torch.allclose(routing_reach(w, ids), routing_reach(w))  # static: the text changes nothing
    routed_k = composition_scores(w, "k", routing="static").k
    plain_k = composition_scores(plain, "k").k
    assert torch.allclose(routed_k.adjusted[0, :, 1], 0.5 * plain_k.adjusted[0, :, 1], equal_nan=True)  # NaN: a zero head
    assert routed_k.pairs()[0]["writer"] == "0.0" and routed_k.pairs()[0]["reader"] == "1.0"  # K-composition
    assert routed_k.pairs()[0]["reach"] == 0.5
    a = routed("attnres", "attn-only")
    wa = Weights.from_model(a)
    ids = ids[:, :12] % 40
    r = trace(wa, ids, cache=["route_attn.2"])
    assert torch.allclose(routing_reach(wa, ids)[1, 2], r["route_attn", 2][..., 2].mean(), atol=1e-6)
    with pytest.raises(QkovError, match="depends on the text"):
        composition_scores(wa, "k", routing="static")


@pytest.mark.parametrize("variant", ["attnres", "mhc", "hyper-dynamic"])
@pytest.mark.parametrize("gate", ["elementwise", "headwise"])
def test_routing_gates_and_loops_together(variant: str, gate: str) -> None:
    """A routed, gated, looped model (the three options at once): the training model, the analysis forward
    and the path expansion agree; the loop unrolls into per-effective-layer routing (one more source per
    effective sublayer for AttnRes)."""
    m = routed(variant, "ln-mlp", gate=gate, loop=2)
    with torch.no_grad():
        for blk in m.blocks:  # gates off their symmetric start too
            blk.attn.W_G.add_(torch.randn(blk.attn.W_G.shape, generator=torch.Generator().manual_seed(3)))
    ids = tokens(6)
    w = Weights.from_model(m)
    assert w.cfg.n_layers == 6 and w.cfg.loop == 1
    with torch.no_grad():
        own = m(ids)
    got = trace(w, ids, cache=["gate.5", "route_attn.5"])
    centred = own - own.mean(-1, keepdim=True)  # the default view centres the unembedding
    assert torch.allclose(got.logits, centred, atol=5e-5)  # float32 through 6 normalised layers
    assert got["gate", 5].shape[-1] == (8 if gate == "elementwise" else 1)
    e = expand(w, ids)
    assert _relative_error(e) <= 1e-5 and len(e.orders) == 7
