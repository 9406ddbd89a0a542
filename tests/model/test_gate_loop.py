"""Gated attention and looped depth (docs/architectures.md): the config, the gate's arithmetic against a
hand computation, the gate frozen at 1 is the ungated model bit for bit, a loop of 1 is today's model and a
looped model is its explicitly unrolled model, folding, checkpoints, exports and the train flags."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from qkov import LazyCheckpoint, ModelConfig, QkovError, Transformer, Weights, load, save_checkpoint, trace
from qkov.io.checkpoint import read_metrics
from qkov.io.hf import gpt2_export
from qkov.io.tl import tl_config_dict

from helpers import LN_MLP, perturb_non_matrices, run_main, train_flags

SMALL = ModelConfig(n_layers=2, n_heads=2, d_model=16, d_head=8, d_vocab=30, n_ctx=12)
GATES = ("elementwise", "headwise")


def _toks(seed: int = 1, batch: int = 2, seq: int = 12, vocab: int = 30) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _gated(cfg: ModelConfig, gate: str, seed: int = 3) -> Transformer:
    """A gated model with non-trivial biases and norm gains (so folding and biases are exercised)."""
    return perturb_non_matrices(Transformer(cfg.replace(gate=gate), seed=seed), 0.3).eval()


def _ungated_copy(model: Transformer) -> Transformer:
    """The same weights without the gate."""
    plain = Transformer(model.cfg.replace(gate="none"), init=False)
    state = {k: v for k, v in model.state_dict().items() if ".W_G" not in k and ".b_G" not in k}
    plain.load_state_dict(state)
    return plain.eval()


# ------------------------------------------------------------------ config
@pytest.mark.parametrize(
    "kwargs, message",
    [({"gate": "sigmoid"}, "gate"), ({"gate": None}, "gate"), ({"loop": 0}, "loop"), ({"loop": 1.5}, "loop"), ({"loop": True}, "loop")],
)
def test_bad_gate_or_loop_is_a_one_line_error(kwargs: dict, message: str) -> None:
    with pytest.raises(QkovError, match=message) as err:
        SMALL.replace(**kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("gate", ["none", *GATES])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("loop", [1, 3])
def test_parameter_count_counts_the_gate_and_not_the_loop(gate: str, bias: bool, loop: int) -> None:
    cfg = LN_MLP.replace(gate=gate, bias=bias, loop=loop, n_kv_heads=1)
    model = Transformer(cfg, seed=0)
    assert cfg.parameter_count() == model.num_parameters()
    assert model.num_parameters() == Transformer(cfg.replace(loop=1), seed=0).num_parameters()
    G = {"none": 0, "elementwise": cfg.d_head, "headwise": 1}[gate]
    plain = Transformer(cfg.replace(gate="none"), seed=0).num_parameters()
    assert model.num_parameters() - plain == cfg.n_layers * cfg.n_heads * G * (cfg.d_model + bias)


def test_describe_unrolled_and_old_configs() -> None:
    cfg = SMALL.replace(gate="headwise", loop=3)
    assert "headwise attention gate" in cfg.describe() and "looped x3 (6 effective layers)" in cfg.describe()
    assert "gate" not in SMALL.describe() and "loop" not in SMALL.describe()
    assert cfg.unrolled() == SMALL.replace(gate="headwise", n_layers=6)
    assert SMALL.unrolled() is SMALL
    old = {k: v for k, v in SMALL.to_dict().items() if k not in ("gate", "loop")}  # a config.json from before
    assert ModelConfig.from_dict(old) == SMALL
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


# ------------------------------------------------------------------ the gate
@pytest.mark.parametrize("gate", GATES)
def test_gated_attention_matches_a_hand_computation(gate: str) -> None:
    """One layer, no normalisation, shortformer positions: ``(softmax(q k^T / sqrt(E)) v * sigmoid(qk_in
    W_G + b_G)) W_O`` per head, written out here, equals the training model's and the analysis forward's."""
    cfg = ModelConfig(n_layers=1, n_heads=3, d_model=16, d_head=4, d_vocab=30, n_ctx=12, bias=True, gate=gate)
    model = _gated(cfg.replace(gate="none"), gate)
    a, toks = model.blocks[0].attn, _toks()
    with torch.no_grad():
        x = model.W_E[toks]
        qk = x + model.W_pos[: toks.shape[1]]
        out = x.clone()
        for h in range(cfg.n_heads):
            q, k, v = qk @ a.W_Q[h] + a.b_Q[h], qk @ a.W_K[h] + a.b_K[h], x @ a.W_V[h] + a.b_V[h]
            s = (q @ k.transpose(-1, -2) / math.sqrt(cfg.d_head)).masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), -math.inf)
            g = torch.sigmoid(qk @ a.W_G[h] + a.b_G[h])  # [B, T, G]
            assert g.shape[-1] == (cfg.d_head if gate == "elementwise" else 1)
            out += (torch.softmax(s, -1) @ v * g) @ a.W_O[h]
        expected = (out + a.b_O) @ model.W_U + model.b_U
        assert (model(toks) - expected).abs().max() < 1e-5
        w = Weights.from_model(model, center_unembed=False)
        got = trace(w, toks, cache=["gate.0"])
        assert (got.logits - expected).abs().max() < 1e-5
        gate_hand = torch.stack([torch.sigmoid(qk @ a.W_G[h] + a.b_G[h]) for h in range(3)], 2)  # [B, T, H, G]
        assert (got["gate", 0] - gate_hand).abs().max() < 1e-6


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("cfg", [SMALL, LN_MLP, LN_MLP.replace(normalization="rmsnorm", positional="rotary")], ids=["attn", "ln", "rms"])
def test_gate_frozen_at_one_is_the_ungated_model_bit_for_bit(gate: str, cfg: ModelConfig) -> None:
    model = _gated(cfg, gate)
    plain = _ungated_copy(model)
    toks = _toks()
    for view in ({}, {"fold_ln": False, "center_writing": False}):
        w, w0 = Weights.from_model(model, **view), Weights.from_model(plain, **view)  # type: ignore[arg-type]
        ones = trace(w, toks, edits={"gate.*": torch.ones(1)}, cache=["z.1"])
        ref = trace(w0, toks, cache=["z.1"])
        assert torch.equal(ones.logits, ref.logits) and torch.equal(ones["z", 1], ref["z", 1])
        live = trace(w, toks)
        assert (live.logits - ref.logits).abs().max() > 1e-3  # the gate does something
    with torch.no_grad():  # the training model: a gate of exactly 1 (sigmoid(100) rounds to 1 in float32)
        biased = _gated(cfg.replace(bias=True), gate)
        for b in biased.blocks:
            b.attn.W_G.zero_()
            b.attn.b_G.fill_(100.0)
        assert torch.equal(biased(toks), _ungated_copy(biased)(toks))


@pytest.mark.parametrize("gate", GATES)
def test_gated_passes_agree(gate: str) -> None:
    """The training model, the analysis forward (processed view, the model's own stream, the unfolded view,
    a rotated view) and the last layer at a few positions give the same logits."""
    model = _gated(LN_MLP.replace(positional="standard"), gate).double()
    toks = _toks()
    with torch.no_grad():
        ref = torch.log_softmax(model(toks), -1)

    def lp(out: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(out, -1)

    w = Weights.from_model(model, dtype=torch.float64)
    assert (lp(trace(w, toks).logits) - ref).abs().max() < 1e-10
    assert (lp(trace(model, toks, stream="model").logits.double()) - ref.float()).abs().max() < 1e-5
    unfolded = Weights.from_model(model, dtype=torch.float64, fold_ln=False, center_writing=False)
    assert (lp(trace(unfolded, toks).logits) - ref).abs().max() < 1e-10
    R = torch.linalg.qr(torch.randn(16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2)))[0]
    assert (lp(trace(w.rotate(R), toks).logits) - ref).abs().max() < 1e-10
    rows = torch.tensor([3, 11])
    assert (lp(trace(w, toks, positions=rows).logits) - ref[:, rows]).abs().max() < 1e-10


# ------------------------------------------------------------------ the loop
def _unrolled_copy(model: Transformer) -> Transformer:
    """The explicitly unrolled model: ``n_layers * loop`` blocks, block ``l`` a copy of stored block ``l % n``."""
    cfg, n = model.cfg, model.cfg.n_layers
    flat = Transformer(cfg.unrolled(), init=False)
    state = {}
    for k, v in model.state_dict().items():
        if k.startswith("blocks."):
            _, l, rest = k.split(".", 2)
            for e in range(int(l), cfg.n_layers * cfg.loop, n):
                state[f"blocks.{e}.{rest}"] = v.clone()
        else:
            state[k] = v.clone()
    flat.load_state_dict(state)
    return flat.eval()


def test_loop_one_is_todays_model() -> None:
    cfg = LN_MLP
    a, b = Transformer(cfg, seed=7), Transformer(cfg.replace(loop=1), seed=7)
    assert cfg.replace(loop=1) == cfg and a.state_dict().keys() == b.state_dict().keys()
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    toks = _toks()
    assert torch.equal(a(toks), b(toks))
    assert len(b.effective_blocks()) == cfg.n_layers and all(x is y for x, y in zip(b.effective_blocks(), b.blocks))


@pytest.mark.parametrize("gate", ["none", "headwise"])
@pytest.mark.parametrize("base", [SMALL, LN_MLP], ids=["attn", "ln"])
def test_looped_model_is_its_unrolled_model(gate: str, base: ModelConfig) -> None:
    model = _gated(base.replace(loop=3), gate) if gate != "none" else perturb_non_matrices(Transformer(base.replace(loop=3), seed=5), 0.3).eval()
    flat = _unrolled_copy(model)
    toks = _toks()
    with torch.no_grad():
        assert torch.equal(model(toks), flat(toks))  # the same blocks in the same order: bit for bit
        assert (model(toks) - Transformer(base.replace(gate=gate), seed=5)(toks)).abs().max() > 1e-3
    w, wf = Weights.from_model(model), Weights.from_model(flat)
    assert w.cfg == flat.cfg  # the view of a looped model is the unrolled model's
    for f in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_O", "W_G", "b_G", "W_in", "W_out", "W_E", "W_U"):
        assert (getattr(w, f) is None and getattr(wf, f) is None) or torch.equal(getattr(w, f), getattr(wf, f)), f
    got = trace(w, toks, cache=["pattern.*"])
    assert torch.equal(got.logits, trace(wf, toks, cache=["pattern.*"]).logits)
    assert got.stack("pattern").shape[0] == base.n_layers * 3
    with torch.no_grad():
        assert (torch.log_softmax(got.logits, -1) - torch.log_softmax(model(toks), -1)).abs().max() < 1e-5


def test_looped_gated_checkpoint_round_trip(tmp_path: Path) -> None:
    model = _gated(LN_MLP.replace(loop=2), "elementwise")
    save_checkpoint(model, tmp_path / "ck")
    back, toks = load(tmp_path / "ck"), _toks()
    assert back.cfg == model.cfg and torch.equal(back(toks), model(toks))
    assert "blocks.1.attn.W_G" in back.state_dict() and "blocks.2.attn.W_G" not in back.state_dict()
    lazy = LazyCheckpoint(tmp_path / "ck")
    assert lazy.cfg == model.cfg.unrolled()
    w, ref = Weights.from_source(lazy), Weights.from_model(model)
    for name in ("W_Q", "W_K", "W_V", "W_O", "W_G", "b_G", "W_in", "W_out", "W_E", "b_Q"):
        assert torch.allclose(getattr(w, name), getattr(ref, name), atol=1e-6), name
    assert (trace(lazy, toks).logits - trace(ref, toks).logits).abs().max() < 1e-5
    cfg_file = tmp_path / "ck" / "config.json"
    data = json.loads(cfg_file.read_text())
    data["model"]["gate"] = "none"  # a config that does not describe the weights: refused, one line
    cfg_file.write_text(json.dumps(data))
    with pytest.raises(QkovError, match="unexpected weight"):
        load(tmp_path / "ck")


@pytest.mark.parametrize("change, what", [({"gate": "headwise"}, "gated attention"), ({"loop": 2}, "loop")])
def test_exports_refuse_gate_and_loop(change: dict, what: str) -> None:
    cfg = LN_MLP.replace(positional="standard", n_heads=2, d_head=8, **change)
    with pytest.raises(QkovError, match=what):
        tl_config_dict(cfg)
    with pytest.raises(QkovError, match=what):
        gpt2_export(Transformer(cfg, seed=0))


def test_train_flags_gate_and_loop(tmp_path: Path, small_corpus: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    flags = train_flags(layers=1, steps=2, eval_interval=2, ckpt_interval=2, corpus=small_corpus, gate="headwise", loop=2)
    rc, stdout, _ = run_main(capsys, "train", *flags, "--snapshots", "none", "--out", out)
    assert rc == 0, stdout  # one stored block run twice: two effective layers, so the induction probe runs
    cfg = load(out).cfg
    assert (cfg.gate, cfg.loop, cfg.n_layers) == ("headwise", 2, 1)
    assert any("induction_score" in row for row in read_metrics(out))
    rc, _, err = run_main(capsys, "train", *train_flags(gate="sideways"), "--out", tmp_path / "bad")
    assert rc == 2 and "--gate" in err
