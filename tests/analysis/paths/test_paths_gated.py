"""Path expansion on gated and looped models (docs/architectures.md): with the gates frozen at the run's
values the logits are still an exact sum of paths; term importance against the literal procedure run
through the analysis forward with the recording frozen; the order-1 head terms against the block's own
``head_out``; briefly trained gated models, and the commands on them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import qkov
from qkov import ModelConfig, Transformer, Weights, trace
from qkov.analysis import paths as P
from qkov.analysis.forward.frozen import frozen_edits, frozen_recording, frozen_sites
from qkov.analysis.paths.effects import term_logits
from qkov.analysis.paths.importance import loss

from helpers import TINY, perturb_non_matrices, run_main, tiny_train

KINDS = {
    "attn": {},
    "ln": {"normalization": "layernorm", "d_mlp": 32, "bias": True},
    "rms": {"normalization": "rmsnorm", "positional": "rotary", "d_mlp": 32, "gated_mlp": True, "act_fn": "silu", "bias": True},
}


def toks(shape: tuple[int, int], seed: int = 1, vocab: int = 50) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def make(gate: str, kind: str, loop: int = 1, layers: int = 2, seed: int = 0) -> Transformer:
    cfg = ModelConfig(n_layers=layers, n_heads=3, d_model=32, d_head=8, d_vocab=50, n_ctx=16, gate=gate, loop=loop, **KINDS[kind])
    m = Transformer(cfg, seed=seed).eval()
    with torch.no_grad():  # larger weights than init: sharper patterns and gates, bigger higher-order terms
        for p in m.parameters():
            p.mul_(2.0)
    return perturb_non_matrices(m, 0.3) if cfg.bias or cfg.normalization != "none" else m


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def centred(logits: torch.Tensor) -> torch.Tensor:
    return logits - logits.mean(-1, keepdim=True)


@pytest.mark.parametrize("gate", ["elementwise", "headwise"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("loop", [1, 2])
def test_gated_and_looped_paths_sum_to_the_logits(gate: str, kind: str, loop: int) -> None:
    m = make(gate, kind, loop)
    w, tokens = Weights.from_model(m), toks((3, 16))
    assert "gate.*" in frozen_sites(w)
    exp = P.expand(w, tokens, virtual_heads=True)
    with torch.no_grad():
        ref = centred(m(tokens))
    assert relative(exp.total_logits(), ref) <= 1e-5
    assert relative(exp.total_logits(), exp.recording.logits) <= 1e-5
    assert len(exp.orders) == 2 * loop + 1 and len(exp.heads) == 3 * 2 * loop
    order2 = sum(exp.virtual.values())  # every virtual head kept: they sum to order 2
    assert float((order2 - exp.orders[2]).abs().max()) <= 1e-5 * float(exp.orders[2].abs().max())
    ti = P.term_importance(w, tokens, recording=exp.recording)
    assert ti.run_losses[-1] == pytest.approx(ti.full_loss, abs=1e-5)
    effects = P.term_effects(exp, top_virtual=3)
    assert len(effects.singles) == 6 * loop


def test_ungated_view_of_a_gated_recording_would_not_reconstruct() -> None:
    """The gate matters: the same expansion with the gates frozen at 1 instead (the planted-bug check's
    counterpart) misses the model's logits by far more than float error."""
    m = make("elementwise", "attn")
    w, tokens = Weights.from_model(m), toks((2, 16))
    real = frozen_recording(w, tokens)
    ones = trace(w, tokens, cache=frozen_sites(w), edits={"gate.*": torch.ones(1)})
    exp = P.expand(w, tokens, recording=ones)  # frozen at ones: exact for that run, not for the real one
    assert relative(exp.total_logits(), ones.logits) <= 1e-5
    assert relative(exp.total_logits(), real.logits) > 1e-2


@pytest.mark.parametrize("gate", ["elementwise", "headwise"])
def test_order_one_terms_are_the_heads_own_outputs(gate: str) -> None:
    """One layer, no biases, no normalisation: head ``h``'s order-1 term is all it writes, so it equals the
    block's own ``head_out`` (which the block body computes, gate included, outside the path code)."""
    m = make(gate, "attn", layers=1)
    w, tokens = Weights.from_model(m), toks((2, 16), seed=4)
    exp = P.expand(w, tokens)
    out = trace(w, tokens, cache=["head_out.0"])["head_out", 0]  # [B, T, H, D]
    for h in range(3):
        assert (exp.heads[(0, h)] - out[:, :, h]).abs().max() <= 1e-5 * out.abs().max()


@pytest.mark.parametrize("gate", ["elementwise", "headwise"])
def test_term_importance_is_the_literal_procedure_with_the_gates_frozen(gate: str) -> None:
    """Run n of [F]'s procedure through the analysis forward: the recording's patterns, divisors, MLP outputs
    and gates frozen (frozen_edits), each head's output replaced by what it computed on run n - 1."""
    m = make(gate, "ln", layers=3)
    w, tokens = Weights.from_model(m, dtype=torch.float64), toks((2, 16), seed=2)
    real = frozen_recording(w, tokens)
    frozen = frozen_edits(real)
    assert all(f"gate.{l}" in frozen for l in range(3))
    prev = {l: torch.zeros(2, 16, 3, 32, dtype=torch.float64) for l in range(3)}  # run 1: every head zeroed
    losses = []
    for _ in range(4):
        computed: dict[int, torch.Tensor] = {}

        def swap(l: int):  # what the heads computed on this run, then last run's outputs in their place
            def fn(value: torch.Tensor, site: object) -> torch.Tensor:
                computed[l] = value.clone()
                return prev[l]

            return fn

        out = trace(w, tokens, edits={**frozen, **{f"head_out.{l}": swap(l) for l in range(3)}})
        losses.append(loss(out.logits, tokens))
        prev = computed
    ti = P.term_importance(w, tokens, recording=real)
    assert ti.run_losses == pytest.approx(losses, abs=1e-9)
    assert abs(ti.run_losses[0] - ti.run_losses[-1]) > 1e-3  # the heads matter (a random model: either way)


@pytest.fixture(scope="module", params=["elementwise", "headwise"])
def trained_gated(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, small_corpus: Path) -> Path:
    out = tmp_path_factory.mktemp(f"gated-{request.param}") / "run"
    tc = tiny_train(small_corpus, steps=30, lr=1e-2, eval_interval=30, ckpt_interval=30, log_interval=10)
    qkov.train(out, TINY.replace(gate=request.param), tc, device="cpu")
    return out


def test_trained_gated_model_reconstructs_and_the_commands_run(trained_gated: Path, capsys: pytest.CaptureFixture) -> None:
    model = qkov.load(trained_gated)
    w, tokens = Weights.from_model(model), toks((2, 32), vocab=300)
    with torch.no_grad():
        ref = centred(model(tokens))
    assert relative(P.expand(w, tokens).total_logits(), ref) <= 1e-5
    ti = P.term_importance(w, tokens)
    assert ti.run_losses[-1] == pytest.approx(ti.full_loss, abs=1e-5)
    rc, out, err = run_main(capsys, "paths", trained_gated, "--batch", "2")
    assert rc == 0, err
    for command in ("circuits", "heads"):
        rc, out, err = run_main(capsys, command, trained_gated)
        assert rc == 0, err
        assert "the weight-only OV circuits" in " ".join(out.split()), command
    rc, out, err = run_main(capsys, "circuits", trained_gated, "--json")
    assert rc == 0 and "gate_note" in out


@pytest.mark.parametrize("gate", ["elementwise", "headwise"])
def test_sampled_term_logits_through_a_gated_head(gate: str) -> None:
    """At sampled positions a term's logits are read through its last head, d_head wide
    (qkov.analysis.paths.effects): with the head's gate there they equal the term's own logits."""
    m = make(gate, "ln", layers=3)
    w, tokens = Weights.from_model(m, dtype=torch.float64), toks((6, 16), seed=5)
    exp = P.expand(w, tokens, virtual_heads=True)
    pos = P.effect_positions(exp, max_logits=20 * w.cfg.d_vocab)
    assert pos is not None
    b, t = pos[:, 0], pos[:, 1]
    for key in [(0, 1), (2, 0), (0, 2, 1, 1), (1, 0, 2, 2)]:
        x_in = exp.direct if len(key) == 2 else exp.heads[key[:2]]
        term = exp.heads[key] if len(key) == 2 else exp.virtual[key]
        want = exp.logits_of(term)[b, t][:, None]
        assert (term_logits(w, exp.recording, key, x_in, b, t) - want).abs().max() <= 1e-10 * want.abs().max()
