"""Which analyses run on a routed model: those written for the additive stream refuse in one line
(qkov.model.bus.require_sum_residual); activation patching runs (from the start: no stream to start at)
and a patch of a sublayer's input changes what that sublayer reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qkov import QkovError, Weights
from qkov.analysis.causal.patching import activation_patching
from qkov.analysis.discovery.graph import graph_of
from qkov.analysis.forward.tracer import trace
from qkov.analysis.paths.qk_side import expand_qk
from qkov.io.checkpoint import save_checkpoint
from qkov.io.hf import gpt2_export

from helpers import run_main
from model.test_bus import routed, tokens


def test_analyses_of_the_additive_stream_refuse_in_one_line() -> None:
    m = routed("hyper", "ln-mlp")
    w, a = Weights.from_model(m), tokens(0, 1)
    calls = [
        lambda: graph_of(m.cfg),
        lambda: expand_qk(w, a, 2, 0),
        lambda: trace(w, a, cache=["attn_out", "embed"]).decompose_resid(),
        lambda: trace(w, a, cache=["head_out"]).stack_head_results(),
    ]
    for call in calls:
        with pytest.raises(QkovError, match="assumes the additive residual stream") as info:
            call()
        assert "\n" not in str(info.value)
    with pytest.raises(QkovError, match="routed"):
        gpt2_export(m)


def test_activation_patching_runs_and_a_sublayer_input_patch_is_what_it_reads() -> None:
    m = routed("attnres", "attn-only")
    w, clean, corrupted = Weights.from_model(m), tokens(0, 1), tokens(1, 1)
    res = activation_patching(w, clean, corrupted, site="resid_pre")
    assert torch.isfinite(torch.as_tensor(res.values)).all()
    # the last attention given the clean run's input writes the clean run's output
    c = trace(w, clean, cache=["resid_pre.2", "attn_out.2"])
    last = trace(w, corrupted, edits={"resid_pre.2": c["resid_pre", 2]}, cache=["attn_out.2"])
    assert torch.allclose(last["attn_out", 2], c["attn_out", 2], atol=1e-5)
    assert not torch.allclose(trace(w, corrupted, cache=["attn_out.2"])["attn_out", 2], c["attn_out", 2], atol=1e-3)


def test_the_commands_on_a_routed_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = routed("mhc", "ln-mlp")
    save_checkpoint(m, tmp_path / "m")
    rc, out, err = run_main(capsys, "paths", tmp_path / "m", "--json")
    assert rc == 0, err
    assert json.loads(out)["reconstruction_max_abs_error"] < 1e-4
    rc, _, err = run_main(capsys, "circuit", tmp_path / "m", "--task", "induction")
    assert rc == 2 and "assumes the additive residual stream" in err and "Traceback" not in err
