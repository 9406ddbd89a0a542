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
    res = subprocess.run([sys.executable, "-m", "qkov", "train", "--layers", "2", "--out", str(out)],
                         capture_output=True, text=True)
    minutes = (time.time() - t0) / 60
    assert res.returncode == 0, res.stderr[-2000:]
    assert "val loss" in res.stderr
    assert minutes <= 20, f"took {minutes:.1f} min"
    info = json.loads(subprocess.run([sys.executable, "-m", "qkov", "info", str(out), "--json"],
                                     capture_output=True, text=True, check=True).stdout)
    assert info["complete"] and info["induction_score"] >= 0.3, info
    # independent re-measurement on the loaded model, with a different seed of random tokens
    probe = qkov.induction_probe(qkov.load(out), seed=123, batch=16)
    assert probe.best >= 0.3 and probe.best_head is not None and probe.best_head[0] == 1
    assert probe.loss_by_copy[1] < probe.loss_by_copy[0] - 1.0, probe.loss_by_copy
