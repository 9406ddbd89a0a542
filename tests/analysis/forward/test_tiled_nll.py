"""The next-token loss read from the final stream a tile of logits at a time equals the loss of the whole logits:
one block of vocabulary or several, tiles of a few rows, a model in memory or streamed from disk, float32 or
float64; a pass that asks for the final stream without logits stops there; an edit of the logits is honoured."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qkov import LazyCheckpoint, Transformer, Weights, save_checkpoint, trace
from qkov.analysis.budget import Planned, pass_bytes
from qkov.analysis import budget
from qkov.analysis.forward.tiled_nll import pass_nll, tiled_nll
from qkov.model.config import ModelConfig
from qkov.model.ops import next_token_nll
from qkov.weights.parts import VOCAB_BLOCK

from helpers import LN_MLP
from test_forward import CONFIGS, _model, _tokens


@pytest.mark.parametrize("name", ["ln-mlp-shortformer", "llama-like"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_block_of_vocabulary_in_tiles_of_a_few_rows(name: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = CONFIGS[name]
    w = Weights.from_model(_model(cfg), dtype=dtype)
    toks = _tokens(cfg)
    want = next_token_nll(trace(w, toks).logits, toks)
    monkeypatch.setattr(budget, "TILE_BYTES", 5 * cfg.d_vocab * 8)  # 5 or 10 rows a tile: the last one short
    got = pass_nll(w, toks)
    assert got.dtype == want.dtype and got.shape == (toks.shape[0], toks.shape[1] - 1)
    assert (got - want).abs().max() <= (1e-12 if dtype == torch.float64 else 2e-6)


def test_several_blocks_of_vocabulary_in_memory_and_streamed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three blocks of columns (the last a short one), every target's block among them: the loss is the
    whole logits' loss; a streamed source reads each block of ``W_U`` once."""
    cfg = LN_MLP.replace(d_vocab=2 * VOCAB_BLOCK + 100)
    model = Transformer(cfg, seed=3)
    save_checkpoint(model, tmp_path / "m")
    toks = _tokens(cfg, batch=2)
    toks[0, 1:4] = torch.tensor([1, VOCAB_BLOCK + 5, 2 * VOCAB_BLOCK + 99])  # a target in each block
    toks[1, 1:5] = torch.tensor([0, VOCAB_BLOCK - 1, VOCAB_BLOCK, 2 * VOCAB_BLOCK])  # at the blocks' edges
    w = Weights.from_model(model, dtype=torch.float64)
    want = next_token_nll(trace(w, toks).logits, toks)
    monkeypatch.setattr(budget, "TILE_BYTES", 7 * VOCAB_BLOCK * 8)  # 7 rows a tile: 22 rows in 4 tiles
    assert (pass_nll(w, toks) - want).abs().max() < 1e-12
    lazy = LazyCheckpoint(tmp_path / "m")
    read: list[object] = []
    real = type(lazy).unembed
    monkeypatch.setattr(type(lazy), "unembed", lambda self, cols=None: read.append(cols) or real(self, cols))
    got = pass_nll(lazy, toks)
    assert got.dtype == torch.float32 and (got.double() - want).abs().max() < 2e-5
    starts = [c.start for c in read if c is not None and c.stop - c.start > 1]  # type: ignore[attr-defined]
    assert starts == [0, VOCAB_BLOCK, 2 * VOCAB_BLOCK]


def test_a_large_logit_far_from_the_rest_keeps_the_loss_exact() -> None:
    """Logits of very different sizes in different blocks (a block's log-sum-exp read at its largest logit)."""
    cfg = LN_MLP.replace(d_vocab=VOCAB_BLOCK + 10, normalization="none")
    w = Weights.from_model(Transformer(cfg, seed=1), dtype=torch.float64)
    w.W_U[:, VOCAB_BLOCK + 3] *= 400.0
    toks = _tokens(cfg, batch=2)
    want = next_token_nll(trace(w, toks).logits, toks)
    assert want.abs().max() > 50
    assert (pass_nll(w, toks) - want).abs().max() < 1e-10


def test_the_final_stream_asked_without_logits_is_computed_and_the_pass_stops_there() -> None:
    cfg = CONFIGS["ln-mlp-shortformer"]
    w, toks = Weights.from_model(_model(cfg)), _tokens(cfg)
    whole = trace(w, toks, cache=["final"])
    alone = trace(w, toks, cache=["final"], logits=False)
    assert torch.equal(alone["final"], whole["final"])
    assert alone.logits.shape == (toks.shape[0], 0, cfg.d_vocab)
    assert torch.equal(tiled_nll(w, alone["final"], toks), pass_nll(w, toks))


def test_an_edit_of_the_logits_is_honoured() -> None:
    """The loss of a pass whose logits an edit changes is the loss of the changed logits (not the final
    stream's)."""
    cfg = CONFIGS["ln-mlp-shortformer"]
    w, toks = Weights.from_model(_model(cfg)), _tokens(cfg)

    def favour(logits: torch.Tensor, site: object) -> torch.Tensor:
        return logits + 5.0 * (torch.arange(cfg.d_vocab) == 3)

    edits = {"logits": favour}
    want = next_token_nll(trace(w, toks, edits=edits).logits, toks)
    assert (want - pass_nll(w, toks)).abs().max() > 0.1
    assert torch.equal(pass_nll(w, toks, edits=edits), want)
    final_edit = {"final": lambda x, site: 0.5 * x}  # an edit of the final stream itself goes the tiled way
    assert (pass_nll(w, toks, edits=final_edit) - next_token_nll(trace(w, toks, edits=final_edit).logits, toks)).abs().max() < 2e-6


def test_the_tiled_loss_is_planned_without_the_logits() -> None:
    """GPT-2-small's shape: one 1024-token sequence's pass with its loss over the whole logits counts the
    [1024, 50257] logits three times (the product, with b_U, the log-softmax); tiled, none of them."""
    cfg = ModelConfig(n_layers=12, n_heads=12, d_model=768, d_head=64, d_vocab=50257, n_ctx=1024, d_mlp=3072,
                      normalization="layernorm", bias=True)  # fmt: skip
    source = Planned(cfg, torch.float32, torch.device("cpu"))
    whole = pass_bytes(source, 1, 1024, loss=True)  # type: ignore[arg-type]
    tiled_bytes = pass_bytes(source, 1, 1024, tiled=True)  # type: ignore[arg-type]
    assert whole - tiled_bytes > 2.5 * 1024 * 50257 * 4
    assert tiled_bytes < 200 * 2**20
