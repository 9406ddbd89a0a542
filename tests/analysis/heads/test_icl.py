"""The ICL score's default passes: small enough that the allocator reuses their memory (each
activation within PASS_BYTES), and the same score as one pass over every example."""

from __future__ import annotations

import numpy as np
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


def test_the_heads_table_asks_no_curve_and_prints_the_jsons_score(tmp_path, capsys, monkeypatch) -> None:
    """``qkov heads`` without ``--json`` shows the ICL score alone, so it unembeds only the score's windows
    (``head_report(icl_curve=False)``: an empty curve, the same score to float rounding); ``--json`` keeps the
    curve, and both print the same score."""
    import json

    from qkov.analysis.heads import report as heads_report
    from qkov.analysis.heads.report import head_report
    from qkov.apps.cli import main
    from qkov.io import save_checkpoint

    cfg = ModelConfig(n_layers=2, n_heads=2, d_model=32, d_head=16, d_vocab=64, n_ctx=72)
    model = Transformer(cfg, seed=1)
    w = Weights.from_model(model)
    text = torch.randint(1, cfg.d_vocab, (4, cfg.n_ctx), generator=torch.Generator().manual_seed(3))
    full, bare = (head_report(w, text, bos=0, diag_k=None, icl_curve=c).icl for c in (True, False))
    assert full is not None and bare is not None and len(full.loss_by_position) == cfg.n_ctx - 1
    assert bare.loss_by_position == [] and bare.score == pytest.approx(full.score, abs=1e-6)
    asked: list[bool] = []
    real = heads_report.icl_score
    monkeypatch.setattr(heads_report, "icl_score", lambda *a, **k: asked.append(k["curve"]) or real(*a, **k))
    save_checkpoint(model, tmp_path / "m")
    ids = tmp_path / "ids.npy"
    np.save(ids, text.numpy())
    assert main(["heads", str(tmp_path / "m"), "--tokens", str(ids), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["icl"]
    assert len(got["loss_by_position"]) == cfg.n_ctx - 1
    assert main(["heads", str(tmp_path / "m"), "--tokens", str(ids)]) == 0
    assert f"in-context learning score: {got['score']:+.3f} nats" in capsys.readouterr().out
    assert asked == [True, False]  # the curve only where it is shown
