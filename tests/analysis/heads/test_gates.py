"""Gate tools (qkov.analysis.heads.gates): every number against a hand computation from the trace's
``gate`` and ``pattern`` sites; the effective OV per query against the block's own ``head_out``."""

from __future__ import annotations

import pytest
import torch

import qkov
from qkov import ModelConfig, QkovError, Transformer, Weights, trace
from qkov.analysis.heads.gates import gate_caveat, token_dependence

CFG = ModelConfig(n_layers=2, n_heads=3, d_model=16, d_head=4, d_vocab=12, n_ctx=16)


def _model(gate: str, seed: int = 0) -> Transformer:
    m = Transformer(CFG.replace(gate=gate), seed=seed).eval()
    with torch.no_grad():  # larger weights: gates spread over (0, 1), patterns sharper
        for p in m.parameters():
            p.mul_(3.0)
    return m


def _toks(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 12, (4, 16), generator=torch.Generator().manual_seed(seed))  # few tokens: each seen often


@pytest.mark.parametrize("gate", ["elementwise", "headwise"])
def test_gate_stats_by_hand(gate: str) -> None:
    m, tokens = _model(gate), _toks()
    stats = qkov.gate_stats(m, tokens, threshold=0.3)
    out = trace(m, tokens, cache=["gate.*", "pattern.*"])
    assert stats.gate == gate and stats.positions == tokens.numel() and stats.threshold == 0.3
    for l in range(2):
        g, A = out["gate", l].double(), out["pattern", l].double()  # [B, T, H, G], [B, H, T, T]
        assert g.shape[-1] == (4 if gate == "elementwise" else 1)
        for h in range(3):
            vals = g[:, :, h, :]
            assert float(stats.mean[l, h]) == pytest.approx(float(vals.sum() / vals.numel()), abs=1e-12)
            below = sum(1 for v in vals.flatten().tolist() if v < 0.3) / vals.numel()
            assert float(stats.sparsity[l, h]) == pytest.approx(below, abs=1e-12)
            per_pos = vals.mean(-1).flatten().tolist()  # one value per position, the token at it
            ids = tokens.flatten().tolist()
            mu = sum(per_pos) / len(per_pos)
            groups: dict[int, list[float]] = {}
            for v, t in zip(per_pos, ids):
                groups.setdefault(t, []).append(v)
            between = sum(len(vs) * (sum(vs) / len(vs) - mu) ** 2 for vs in groups.values())
            total = sum((v - mu) ** 2 for v in per_pos)
            assert float(stats.token_dependence[l, h]) == pytest.approx(between / total, abs=1e-9)
            sink = sum(float(A[b, h, t, 0]) for b in range(4) for t in range(1, 16)) / (4 * 15)
            assert float(stats.sink[l, h]) == pytest.approx(sink, abs=1e-6)
    assert 0 < float(stats.sparsity.max()) < 1 and float(stats.token_dependence.max()) > 0.1  # not trivial
    text = repr(stats)
    assert "1.2" in text and "token eta^2" in text
    assert stats.to_dict()["mean"] == stats.mean.tolist()


def test_ungated_model_has_sinks_only() -> None:
    m, tokens = _model("none"), _toks()
    stats = qkov.gate_stats(Weights.from_model(m), tokens)
    A = trace(m, tokens, cache=["pattern.1"])["pattern", 1]
    assert stats.mean is None and stats.sparsity is None and stats.token_dependence is None
    assert torch.allclose(stats.sink[1], A[:, :, 1:, 0].double().mean((0, 2)), atol=1e-7)
    assert "mean gate" not in repr(stats) and stats.to_dict()["mean"] is None


def test_token_dependence_extremes() -> None:
    ids = torch.tensor([0, 1, 2, 0, 1, 2])
    by_token = torch.tensor([[0.1], [0.5], [0.9], [0.1], [0.5], [0.9]])  # a function of the token alone
    assert float(token_dependence(by_token, ids)[0]) == pytest.approx(1.0)
    unrelated = torch.tensor([[0.1], [0.1], [0.1], [0.9], [0.9], [0.9]])  # each token sees both values
    assert float(token_dependence(unrelated, ids)[0]) == pytest.approx(0.0, abs=1e-12)
    assert float(token_dependence(torch.full((6, 1), 0.5), ids)[0]) == 0.0  # no variance: 0


@pytest.mark.parametrize("gate", ["elementwise", "headwise", "none"])
def test_effective_ov_is_what_the_head_writes(gate: str) -> None:
    """One layer, no normalisation or biases: head ``h`` writes at query ``t`` ``sum_s A[t, s] x_s`` through
    its effective OV there; equal to the block's own ``head_out``."""
    m = Transformer(ModelConfig(n_layers=1, n_heads=2, d_model=16, d_head=4, d_vocab=12, n_ctx=16, gate=gate), seed=2)
    w, tokens = Weights.from_model(m), _toks()
    out = trace(w, tokens, cache=["gate.0", "pattern.0", "head_out.0"] if gate != "none" else ["pattern.0", "head_out.0"])
    x = w.W_E[tokens]
    for b, t, h in [(0, 5, 0), (3, 15, 1), (2, 0, 1)]:
        ov = qkov.effective_ov(w, out, 0, h, b, t).materialize()  # [D, D]
        mixed = out["pattern", 0][b, h, t] @ x[b]  # [D]
        assert torch.allclose(mixed @ ov, out["head_out", 0][b, t, h], atol=1e-5)
        if gate != "none":
            assert not torch.allclose(ov, w.W_V[0, h] @ w.W_O[0, h], atol=1e-3)  # the gate changes it


def test_misuse_is_one_line() -> None:
    m, tokens = _model("headwise"), _toks()
    for call, match in [
        (lambda: qkov.gate_stats(m, tokens, threshold=1.5), "threshold"),
        (lambda: qkov.gate_stats(m, tokens[:, :1]), "at least 2"),
        (lambda: qkov.gate_stats(Transformer(CFG.replace(n_layers=0)), tokens), "no attention layers"),
        (lambda: qkov.effective_ov(Weights.from_model(m), trace(m, tokens), 0, 0, 0, 3), "gate.0"),
        (lambda: qkov.effective_ov(Weights.from_model(m), trace(m, tokens), 5, 0, 0, 3), "no head"),
    ]:
        with pytest.raises(QkovError, match=match) as err:
            call()
        assert "\n" not in str(err.value)


def test_gate_caveat() -> None:
    assert gate_caveat(CFG) is None
    assert "W_V diag(g) W_O" in gate_caveat(CFG.replace(gate="elementwise"))  # type: ignore[operator]
    assert "g W_V W_O" in gate_caveat(CFG.replace(gate="headwise"))  # type: ignore[operator]
