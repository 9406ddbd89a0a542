"""The analysis forward: against the training model and the reference einsum forward; what it
records; frozen patterns, frozen runs and replaced head outputs; bad input."""

from __future__ import annotations

import pytest
import torch

from qkov import ModelConfig, QkovError, Transformer, Weights, trace
from qkov.analysis.forward.frozen import frozen_edits, frozen_sites

from helpers import LN_MLP, MODERN, perturb_non_matrices
from reference import reference_forward

CONFIGS = {
    "shortformer": ModelConfig(n_layers=2, n_heads=3, d_model=24, d_head=8, d_vocab=50, n_ctx=16),
    "standard": ModelConfig(n_layers=1, n_heads=2, d_model=16, d_head=4, d_vocab=30, n_ctx=12, positional="standard"),
    "none": ModelConfig(n_layers=3, n_heads=2, d_model=16, d_head=8, d_vocab=30, n_ctx=12, positional="none"),
    "ln-mlp-shortformer": LN_MLP,
    "ln-mlp-standard-gelu_new": LN_MLP.replace(positional="standard", act_fn="gelu_new"),
    "mlp-relu": LN_MLP.replace(normalization="none", act_fn="relu"),
    # the modern families' pieces: rotary (full and partial, rescaled), RMSNorm, grouped-query
    # attention, gated SiLU MLPs, parallel attention + MLP
    "llama-like": MODERN,
    "neox-like": MODERN.replace(
        normalization="layernorm", gated_mlp=False, act_fn="gelu", parallel=True, n_kv_heads=None, rotary_dim=2
    ),
    "rotary-llama3-mqa": MODERN.replace(
        n_kv_heads=1,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
    ),
    "rotary-linear-attn-only": ModelConfig(
        n_layers=2,
        n_heads=2,
        d_model=16,
        d_head=8,
        d_vocab=30,
        n_ctx=12,
        positional="rotary",
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
}


def _model(cfg: ModelConfig, seed: int = 1) -> Transformer:
    m = Transformer(cfg, seed=seed).double().eval()
    return perturb_non_matrices(m, 0.1)


def _tokens(cfg: ModelConfig, batch: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, cfg.d_vocab, (batch, cfg.n_ctx), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("fold", [True, False])
def test_run_equals_training_model_and_reference(name: str, fold: bool) -> None:
    """The two forwards (fused training model, analysis forward) and the einsum reference agree."""
    cfg = CONFIGS[name]
    m = _model(cfg)
    w = Weights.from_model(m, dtype=torch.float64, fold_ln=fold, center_unembed=False)
    toks = _tokens(cfg)
    r = trace(w, toks, cache=["pattern"])
    ref_logits, ref_patterns = reference_forward(w, toks)
    with torch.no_grad():
        assert (r.logits - m(toks)).abs().max() < 1e-10
        # the default view also centres the unembedding: logits move by a constant per position
        centred = trace(Weights.from_model(m, dtype=torch.float64, fold_ln=fold), toks).logits
        assert (centred.log_softmax(-1) - m(toks).log_softmax(-1)).abs().max() < 1e-10
        assert centred.mean(-1).abs().max() < 1e-10
    assert (r.logits - ref_logits).abs().max() < 1e-10
    patterns = r.stack("pattern")
    assert (patterns - ref_patterns).abs().max() < 1e-12
    assert torch.allclose(patterns.sum(-1), torch.ones(()).double()) and patterns.triu(1).abs().max() == 0
    # nothing cached: the fused attention gives the same logits
    assert (trace(w, toks).logits - ref_logits).abs().max() < 1e-10


def test_recorded_pieces_rebuild_the_stream() -> None:
    """Per-head outputs, MLP outputs and biases add up to the final stream; values and scales are
    the ones the layer used."""
    cfg = CONFIGS["ln-mlp-shortformer"]
    m = _model(cfg)
    w = Weights.from_model(m, dtype=torch.float64)
    toks = _tokens(cfg)
    r = trace(w, toks, cache=["pattern", "head_out", "mlp_out", "v", "qk_in", "attn_scale", "final_scale"])
    L, B, H, T, D = cfg.n_layers, 3, cfg.n_heads, cfg.n_ctx, cfg.d_model
    assert r.stack("head_out").shape == (L, B, T, H, D) and r.stack("mlp_out").shape == (L, B, T, D)
    assert r.stack("v").shape == (L, B, T, cfg.kv_heads, cfg.d_head) and r.stack("qk_in").shape == (L, B, T, D)
    x = w.W_E[toks]
    for l in range(L):
        x = x + r["head_out", l].sum(2) + w.b_O[l] + r["mlp_out", l]
    final = (x - x.mean(-1, keepdim=True)) / r["final_scale"]
    assert (final @ w.W_U + w.b_U - r.logits).abs().max() < 1e-10
    # head 1.1's output is its pattern times its cached values times W_O
    out = r["pattern", 1][:, 1] @ r["v", 1][:, :, 1] @ w.W_O[1, 1]
    assert (out - r["head_out", 1][:, :, 1]).abs().max() < 1e-12
    # the value input of layer 0 is the embedding, normalised by the cached divisor
    v_in = (w.W_E[toks] - w.W_E[toks].mean(-1, keepdim=True)) / r["attn_scale", 0]
    assert (v_in @ w.W_V[0, 1] + w.b_V[0, 1] - r["v", 0][:, :, 1]).abs().max() < 1e-12


def test_frozen_patterns_replace_the_models() -> None:
    """Uniform patterns frozen in: the logits are those of the reference with the same patterns,
    and differ from the model's own."""
    cfg = CONFIGS["shortformer"]
    w = Weights.from_model(_model(cfg), dtype=torch.float64)
    toks = _tokens(cfg, batch=2)
    T = cfg.n_ctx
    uniform = torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None]
    forced = trace(w, toks, edits={"pattern": uniform.double()}, cache=["pattern"])  # every layer, every head
    expected, _ = reference_forward(w, toks, patterns=uniform.expand(cfg.n_layers, 2, cfg.n_heads, T, T).double())
    assert (forced.logits - expected).abs().max() < 1e-12
    assert (forced.logits - trace(w, toks).logits).abs().max() > 1e-3
    assert torch.equal(forced["pattern", 0][0], uniform.expand(cfg.n_heads, T, T).double())


def test_shortformer_positions_only_enter_queries_and_keys() -> None:
    """Under shortformer, scaling W_pos changes patterns but not values: with patterns frozen, logits stay."""
    cfg = CONFIGS["shortformer"]
    w = Weights.from_model(_model(cfg), dtype=torch.float64)
    toks = _tokens(cfg, batch=2)
    own = trace(w, toks, cache=["pattern"])
    moved = w.replace(W_pos=w.W_pos * 3)
    assert (trace(moved, toks, cache=["pattern"]).stack("pattern") - own.stack("pattern")).abs().max() > 1e-3
    frozen = {f"pattern.{l}": own["pattern", l] for l in range(cfg.n_layers)}
    assert (trace(moved, toks, edits=frozen).logits - own.logits).abs().max() < 1e-12


def test_frozen_recording_with_own_outputs_is_the_model_and_is_linear() -> None:
    """Frozen patterns, divisors and MLP outputs: each head adding its own live output gives the
    model back; with all of it frozen the logits are linear in the embedding."""
    cfg = CONFIGS["ln-mlp-standard-gelu_new"]
    w = Weights.from_model(_model(cfg), dtype=torch.float64)
    toks = _tokens(cfg)
    real = trace(w, toks, cache=[*frozen_sites(w), "head_out"])
    frozen, L = frozen_edits(real), cfg.n_layers
    again = trace(w, toks, edits={**frozen, **{f"head_out.{l}": real["head_out", l] for l in range(L)}})
    assert (again.logits - real.logits).abs().max() < 1e-10
    live: dict[int, torch.Tensor] = {}

    def zero(value: torch.Tensor, site: object) -> torch.Tensor:  # keeps what the heads computed, adds nothing
        live[site.layer] = value.clone()  # type: ignore[attr-defined]
        return torch.zeros_like(value)

    zeroed = trace(w, toks, edits={**frozen, "head_out": zero})
    assert (zeroed.logits - real.logits).abs().max() > 1e-2
    # heads replaced by zeros, the stream is embedding + biases + frozen MLP outputs
    x = w.W_E[toks] + w.W_pos[: cfg.n_ctx] + w.b_O.sum(0) + real.stack("mlp_out").sum(0)
    expected = (x - x.mean(-1, keepdim=True)) / real["final_scale"] @ w.W_U + w.b_U
    assert (zeroed.logits - expected).abs().max() < 1e-10
    # the outputs heads compute on that run are computed from that run's stream, not the real one
    assert (live[1] - real["head_out", 1]).abs().max() > 1e-3
    assert (live[0] - real["head_out", 0]).abs().max() < 1e-12  # layer 0 reads the same stream


def test_zero_layer_model() -> None:
    cfg = ModelConfig(n_layers=0, d_model=8, d_vocab=10, n_ctx=6)
    w = Weights.from_model(Transformer(cfg, seed=5))
    r = trace(w, torch.tensor([[1, 2, 3, 4]]), cache=["pattern", "head_out"])
    assert torch.allclose(r.logits, w.W_E[torch.tensor([[1, 2, 3, 4]])] @ w.W_U, atol=1e-6)
    assert r.stack("pattern").shape == (0, 1, cfg.n_heads, 4, 4) and r.stack("head_out").shape[0] == 0


def test_bad_input_is_a_user_error() -> None:
    cfg = CONFIGS["shortformer"]
    w = Weights.from_model(Transformer(cfg, seed=0))
    toks = torch.zeros(1, 5, dtype=torch.long)
    with pytest.raises(QkovError, match="pattern"):
        trace(w, toks, edits={"pattern.0": torch.zeros(2, 1, 3, 4, 4)})
    with pytest.raises(QkovError, match="attention"):
        trace(w, toks, cache=["attention"])
    with pytest.raises(QkovError, match="out of range"):
        trace(w, torch.tensor([[0, 50]]))
    with pytest.raises(QkovError, match="a frozen recording must have cached"):
        frozen_edits(trace(w, toks))
    with pytest.raises(TypeError):  # the pre-1.1 modes are gone
        trace(w, toks, record=("patterns",))  # type: ignore[call-arg]


def _counting_last_block(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the calls of the last layer's few-positions attention (:meth:`qkov.model.block.BlockPass.attention_at`)."""
    from qkov.model.block import BlockPass

    calls: list[int] = []
    real = BlockPass.attention_at

    def counted(self, l, x, rows):  # type: ignore[no-untyped-def]
        calls.append(l)
        return real(self, l, x, rows)

    monkeypatch.setattr(BlockPass, "attention_at", counted)
    return calls


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("fold", [True, False])
def test_logits_at_positions_equal_the_full_pass(name: str, fold: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """With logits asked at a few positions the last layer runs its queries there only: the logits
    equal the full pass's and the training model's at those positions (negative and repeated ones too)."""
    cfg = CONFIGS[name]
    m = _model(cfg)
    w = Weights.from_model(m, dtype=torch.float64, fold_ln=fold, center_unembed=False)
    toks = _tokens(cfg)
    at = torch.tensor([0, 3, 3, cfg.n_ctx - 1, -2])
    calls = _counting_last_block(monkeypatch)
    early = ["pattern.0"] if cfg.n_layers > 1 else []  # a site of an earlier layer: cached at every position
    got = trace(w, toks, positions=at, cache=[*early, "final"])
    assert calls == [cfg.n_layers - 1]  # the few-positions block ran, for the last layer only
    full = trace(w, toks, cache=["final"])
    assert calls == [cfg.n_layers - 1]
    with torch.no_grad():
        ref = m(toks)
    assert got.logits.shape == (3, len(at), cfg.d_vocab) and got["final"].shape == (3, len(at), cfg.d_model)
    assert (got.logits - full.logits[:, at]).abs().max() < 1e-12
    assert (got["final"] - full["final"][:, at]).abs().max() < 1e-12
    assert (got.logits - ref[:, at]).abs().max() < 1e-10
    if early:
        assert got["pattern", 0].shape == (3, cfg.n_heads, cfg.n_ctx, cfg.n_ctx)


@pytest.mark.parametrize("name", ["ln-mlp-shortformer", "llama-like"])
def test_positions_with_the_last_layer_read_run_it_whole(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Anything that reads or writes the last layer's queries or what follows them (a cached or edited
    site there, an observing edit, a gradient) runs it at every position: same logits, full-size sites.
    An edit of an earlier layer, of the last layer's keys or values, or a start inside the pass keeps
    the few-positions block, and its effect."""
    cfg = CONFIGS[name]
    w = Weights.from_model(_model(cfg), dtype=torch.float64)
    toks, at, last = _tokens(cfg), torch.tensor([2, 7, cfg.n_ctx - 1]), cfg.n_layers - 1
    calls = _counting_last_block(monkeypatch)
    zero = {f"z.{last}.1": lambda z, site: torch.zeros_like(z)}
    for kw in (dict(cache=[f"pattern.{last}"]), dict(edits=zero), dict(edits={f"pattern.{last}": lambda p, site: None}), dict(grad=True),
               dict(edits={f"q.{last}": lambda q, site: 2 * q})):
        got = trace(w, toks, positions=at, **kw)  # type: ignore[arg-type]
        full = trace(w, toks, **{k: v for k, v in kw.items() if k != "cache"})  # type: ignore[arg-type]
        assert calls == [], kw
        assert (got.logits - full.logits[:, at]).abs().max() < 1e-12, kw
    assert got.logits.shape == (3, 3, cfg.d_vocab)
    assert trace(w, toks, positions=at, cache=[f"pattern.{last}"])["pattern", last].shape[-2:] == (cfg.n_ctx, cfg.n_ctx)
    plain = trace(w, toks, positions=at).logits
    x_last = trace(w, toks, cache=[f"resid_pre.{last}"])[f"resid_pre.{last}"]
    for kw in (dict(edits={"z.0.1": lambda z, site: torch.zeros_like(z)}),
               dict(edits={f"k.{last}": lambda k, site: 2 * k}), dict(edits={f"v.{last}": lambda v, site: -v}),
               dict(start_at=(last, x_last)), dict(start_at=(0, trace(w, toks, cache=["resid_pre.0"])["resid_pre.0"]))):  # fmt: skip
        calls.clear()
        got, full = trace(w, toks, positions=at, **kw).logits, trace(w, toks, **kw).logits  # type: ignore[arg-type]
        assert calls == [last] and (got - full[:, at]).abs().max() < 1e-12, kw
        if "edits" in kw:
            assert (got - plain).abs().max() > 1e-6, kw  # the edit did change the logits


def test_zero_biases_are_skipped_and_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weights view holds zeros for the biases a model lacks; the forward skips adding them
    (:func:`~qkov.model.ops.live_bias`): the same logits and sites, bit for bit."""
    import qkov.analysis.forward.tracer as F
    import qkov.model.block as FB
    from qkov.model.ops import live_bias

    zeros, some = torch.zeros(3, 4), torch.zeros(3, 4)
    some[1, 2] = 1e-30
    assert live_bias(zeros) is None and live_bias(None) is None
    assert live_bias(some) is some and live_bias(zeros.clone().requires_grad_()) is not None
    cfg = LN_MLP.replace(bias=False, normalization="rmsnorm")
    w = Weights.from_model(_model(cfg).float(), fold_ln=False)
    assert not w.b_Q.any() and not w.b_O.any()
    toks, at = _tokens(cfg), torch.tensor([1, 5])
    runs = lambda: [trace(w, toks, cache="*"), trace(w, toks, positions=at)]  # noqa: E731
    fast = runs()
    for module in (F, FB):
        monkeypatch.setattr(module, "live_bias", lambda b: b)
    slow = runs()
    for a, b in zip(fast, slow):
        assert torch.equal(a.logits, b.logits)
        assert a.cache.keys() == b.cache.keys() and all(torch.equal(a.cache[k], b.cache[k]) for k in a.cache)
