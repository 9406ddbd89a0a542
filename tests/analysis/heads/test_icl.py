"""The ICL score's default passes: small enough that the allocator reuses their memory (each
activation within PASS_BYTES), and the same score as one pass over every example."""

from __future__ import annotations

import pytest
import torch

from qkov import ModelConfig, Transformer, Weights
from qkov.analysis.heads.probes import PASS_BYTES, icl_chunk, icl_score, icl_windows


def test_default_icl_passes_hold_small_activations_and_give_one_passs_score() -> None:
    cfg = ModelConfig(n_layers=2, n_heads=4, d_model=128, d_head=32, d_vocab=1024, n_ctx=256)  # the tour's 2-layer shape
    w = Weights.from_model(Transformer(cfg, seed=0))
    examples = torch.randint(1, cfg.d_vocab, (40, cfg.n_ctx), generator=torch.Generator().manual_seed(0))
    width = len(torch.cat(icl_windows(cfg.n_ctx)[2:]).unique())  # the positions the score unembeds
    chunk = icl_chunk(cfg, cfg.n_ctx, width, 4)
    per_example = cfg.n_ctx * cfg.d_model * 4  # bytes of one example's widest activation, [T, d_model]
    assert chunk * per_example <= PASS_BYTES < (chunk + 1) * per_example and chunk < len(examples)
    done: list[int] = []
    split = icl_score(w, examples, curve=False, progress=lambda what, d, n: done.append(d))
    sizes = [b - a for a, b in zip([0, *done], done)]
    assert done[-1] == len(examples) and max(sizes) <= chunk and len(sizes) == -(-len(examples) // chunk)
    whole = icl_score(w, examples, curve=False, chunk=len(examples))
    assert split.score == pytest.approx(whole.score, abs=1e-6) and split.score != 0
