"""Opt-in (``pytest -m slow``): the default 2-layer run grows induction heads on this CPU.

This is the foundation issue's acceptance run: ``qkov train --layers 2`` with every
other option at its default, on the built-in corpus. It takes minutes, so it is not
part of the default test command; ``benchmarks/induction_sweep.py`` records the curves.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

import qkov


@pytest.mark.slow
def test_default_two_layer_run_forms_induction_heads(tmp_path: Path) -> None:
    out = tmp_path / "qkov-2l"
    t0 = time.time()
    res = subprocess.run(
        [sys.executable, "-m", "qkov", "train", "--layers", "2", "--out", str(out)], capture_output=True, text=True
    )
    minutes = (time.time() - t0) / 60
    assert res.returncode == 0, res.stderr[-2000:]
    assert "val loss" in res.stderr
    assert minutes <= 20, f"took {minutes:.1f} min"
    info = json.loads(
        subprocess.run(
            [sys.executable, "-m", "qkov", "info", str(out), "--json"], capture_output=True, text=True, check=True
        ).stdout
    )
    assert info["complete"] and info["induction_score"] >= 0.3, info
    # independent re-measurement on the loaded model, with a different seed of random tokens
    probe = qkov.induction_probe(qkov.load(out), seed=123, batch=16)
    assert probe.best >= 0.3 and probe.best_head is not None and probe.best_head[0] == 1
    assert probe.loss_by_copy[1] < probe.loss_by_copy[0] - 1.0, probe.loss_by_copy


@pytest.mark.slow
def test_default_models_reproduce_the_papers_head_findings(tmp_path: Path) -> None:
    """1-layer: mostly copying heads, no prefix matching. 2-layer: an induction head in layer 1
    K-composing with a layer-0 previous-token head, and more in-context learning than 1-layer."""
    import numpy as np
    import torch

    from qkov import circuits as C
    from qkov.data import load_corpus, val_batches
    from qkov.heads import head_report
    from qkov.weights import Weights

    reports = {}
    for layers in (1, 2):
        out = tmp_path / f"qkov-{layers}l"
        subprocess.run(
            [sys.executable, "-m", "qkov", "train", "--layers", str(layers), "--out", str(out), "--quiet"],
            check=True,
            capture_output=True,
        )
        model = qkov.load(out)
        corpus = load_corpus("stdlib", vocab_size=model.cfg.d_vocab)
        text = torch.from_numpy(val_batches(corpus.val, model.cfg.n_ctx, 0, 256))
        reports[layers] = (model, head_report(model, text[:8], frequencies=np.bincount(corpus.train), icl_text=text))
    one = reports[1][1].scores
    assert (one["eigen_copying"] > 0.5).float().mean() > 0.5  # mostly copying
    assert one["prefix_matching"].max() < 0.3
    model2, rep2 = reports[2]
    s = rep2.scores
    l1 = s["prefix_matching"][1]
    ind = int(l1.argmax())
    assert l1[ind] >= 0.3 and s["induction"][1, ind] >= 0.3 and s["eigen_copying"][1, ind] > 0
    assert s["copying"][1, ind] > 0
    prev = int(s["previous_token"][0].argmax())
    assert s["previous_token"][0, prev] > 0.3
    k = C.composition_scores(Weights.from_model(model2), "k")
    assert int(k.adjusted[0, :, 1, ind].argmax()) == prev
    assert rep2.icl.score < reports[1][1].icl.score - 0.05
