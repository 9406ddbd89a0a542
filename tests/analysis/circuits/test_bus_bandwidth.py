"""BusBandwidth per residual scheme (qkov.analysis.circuits.bus_bandwidth) on models whose writers' subspaces are
set by hand, so the overlaps are known numbers."""

from __future__ import annotations

import pytest
import torch

from qkov import ModelConfig, QkovError, Transformer, Weights
from qkov.analysis.circuits.bus_bandwidth import bus_bandwidth

from model.test_bus import routed, tokens


def _writers_on(cfg: ModelConfig, dims0: list[int], dims1: list[int]) -> Transformer:
    """2 attention layers of one head writing only into the stream dimensions ``dims0`` / ``dims1``."""
    m = Transformer(cfg, seed=0)
    with torch.no_grad():
        for l, dims in ((0, dims0), (1, dims1)):
            W_O = m.blocks[l].attn.W_O
            W_O.zero_()
            for i, d in enumerate(dims):
                W_O[0, i, d] = 1.0 + i
    return m


@pytest.mark.parametrize("second, want", [([0, 1], 1.0), ([1, 2], 0.5), ([4, 5], 0.0)])
def test_the_sum_shares_one_stream_and_hyper_connections_can_separate_it(second: list[int], want: float) -> None:
    base = ModelConfig(n_layers=2, n_heads=1, d_model=8, d_head=2, d_vocab=10, n_ctx=8)
    b = bus_bandwidth(Weights.from_model(_writers_on(base, [0, 1], second)))
    assert (b.streams, b.width) == (1, 8) and abs(b.overlap[0] - want) < 1e-9
    hyp = _writers_on(base.replace(residual="hyper", n_streams=2), [0, 1], second)
    with torch.no_grad():
        hyp.bus.B.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))  # type: ignore[union-attr]  # one stream each
    h = bus_bandwidth(Weights.from_model(hyp))
    assert (h.streams, h.width) == (2, 16) and h.overlap == [0.0, 0.0]
    assert h.writers == [{"attn.0": 1.0}, {"attn.1": 1.0}]
    a = bus_bandwidth(Weights.from_model(_writers_on(base.replace(residual="attnres"), [0, 1], second)))
    assert (a.streams, a.overlap) == (3, [0.0, 0.0, 0.0])


def test_text_dependent_write_weights_need_tokens() -> None:
    m = routed("mhc", "ln-mlp")
    with pytest.raises(QkovError, match="give tokens"):
        bus_bandwidth(Weights.from_model(m))
    b = bus_bandwidth(Weights.from_model(m), tokens())
    assert b.streams == 4 and all(0.0 <= o <= 1.0 for o in b.overlap) and len(b.writers[0]) == 6
    assert "numbers per position" in str(b)
