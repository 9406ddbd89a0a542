"""``qkov circuit``: the circuit of a task found from the command line, as the library finds it; its
files (the circuit's JSON, MIB's submission shape); its mistakes as one line, exit status 2. The
notebook display of the result draws the circuit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import qkov
from qkov.analysis.discovery import read_ground_truth

from hand_built import hand_built
from helpers import run_main

TRUTH = ["embed -> 0.0<v>", "0.0 -> 1.0<k>", "1.0 -> logits"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("circuit") / "hand.pt"
    qkov.save_checkpoint(hand_built(), path)
    return path


def test_the_command_finds_what_the_library_finds(ckpt: Path, tmp_path: Path, capsys: Any) -> None:
    truth = tmp_path / "truth.json"
    truth.write_text(json.dumps(["input->a0.h0<v>", "a0.h0->a1.h0<k>", "a1.h0->logits"]))  # MIB's spelling
    out, mib = tmp_path / "found.json", tmp_path / "mib.json"
    rc, text, err = run_main(
        capsys, "circuit", ckpt, "--task", "induction", "--method", "eap-ig", "--prompts", 8, "--ground-truth", truth,
        "--out", out, "--mib", mib, "--json",
    )  # fmt: skip
    assert rc == 0, err
    data = json.loads(text)
    lib = qkov.find_circuit(
        hand_built(), qkov.load_task("induction", hand_built(), n=8), method="eap-ig", ground_truth=TRUTH
    )
    assert sorted(data["circuit"]["edges"]) == sorted(lib.circuit.names) == sorted(TRUTH)
    assert data["circuit"]["faithfulness"] == pytest.approx(lib.faithfulness.faithfulness[0], abs=1e-6)
    assert data["roc"]["edge_auc"] == 1.0 and data["curve"]["cpr"] == pytest.approx(lib.curve.cpr, abs=1e-6)
    assert "29 edges" in data["graph"] and len(data["scores"]["edges"]) == 29
    assert json.loads(out.read_text()) == data
    assert sorted(read_ground_truth(mib)) == sorted(TRUTH)  # the circuit, read back from MIB's shape
    rc, text, err = run_main(
        capsys, "circuit", ckpt, "--task", "induction", "--prompts", 4, "--edges", 3, "--acdc", 0.01
    )
    assert rc == 0, err
    assert "faithfulness curve" in text and "ACDC pass (KL threshold 0.01)" in text and "29 edges: every sender" in text


def test_a_streamed_model_finds_the_same_circuit(tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--lazy`` (a model read layer by layer, its gradients included): the same scores, circuit, curve and
    checks as the model loaded whole, on a model with MLPs, rotary positions and grouped-query heads."""
    from helpers import MODERN
    from qkov.apps.cli import circuit_cmds

    path = tmp_path / "modern"
    qkov.save_checkpoint(qkov.Transformer(MODERN.replace(n_layers=3), seed=3), path)
    opened: list[Any] = []
    real = circuit_cmds.LazyCheckpoint
    monkeypatch.setattr(circuit_cmds, "LazyCheckpoint", lambda *a, **k: opened.append(real(*a, **k)) or opened[-1])
    got = []
    for extra in ([], ["--lazy"]):
        rc, text, err = run_main(capsys, "circuit", path, "--task", "induction", "--prompts", 6, "--method", "eap-ig", "--json", *extra)
        assert rc == 0, err
        assert len(opened) == len(extra)  # the memory map with --lazy only (this model is under the automatic size)
        got.append(json.loads(text))
    whole, lazy = got
    assert lazy["circuit"]["edges"] == whole["circuit"]["edges"] and len(whole["circuit"]["edges"]) > 0
    a, b = lazy["scores"]["edges"], whole["scores"]["edges"]
    assert list(a) == list(b) and len(a) > 100
    assert [a[k] for k in a] == pytest.approx([b[k] for k in a], rel=1e-5, abs=1e-8)
    assert lazy["curve"]["cpr"] == pytest.approx(whole["curve"]["cpr"], abs=1e-6)
    assert lazy["circuit"]["faithfulness"] == pytest.approx(whole["circuit"]["faithfulness"], abs=1e-6)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--task", "nosuch.json"], "'nosuch.json' is neither a file nor a built-in task"),
        (["--task", "ioi"], "the IOI task: this model has no tokenizer"),
        (["--task", "induction", "--edges", "3", "--faithfulness", "0.5"], "not allowed with argument"),
        (["--task", "induction", "--threshold", "1e6"], "the circuit is empty after pruning its dead ends"),
        (["--task", "induction", "--method", "eap", "--metric", "kl"], "eap with the KL metric is 0"),
        (["--task", "induction", "--ablation", "zero", "--method", "eap-ig"], "eap-ig moves the input"),
    ],
)
def test_mistakes_are_one_line(ckpt: Path, capsys: Any, argv: list[str], says: str) -> None:
    rc, _, err = run_main(capsys, "circuit", ckpt, "--prompts", 2, "--no-curve", *argv)
    assert rc == 2 and says in err and err.count("\n") == 1, err


def test_the_help_names_every_method_and_the_edge_count_rule(capsys: Any) -> None:
    with pytest.raises(SystemExit):
        qkov.apps.cli.main(["circuit", "--help"])
    text = capsys.readouterr().out
    for word in ("eap-ig", "ieg", "exact", "32,491", "--ground-truth", "--per-position", "MIB"):
        assert word in text, word


def test_the_notebook_display_draws_the_circuit() -> None:
    m = hand_built()
    d = qkov.find_circuit(m, qkov.load_task("induction", m, n=4), method="exact", edges=3)
    page = d._repr_html_()
    svg = page[page.index("<svg") :]
    assert svg.count("<line") == 3 + 1  # the circuit's edges, and the curve's line at faithfulness 1
    assert 'stroke="#2ca02c"' in svg and 'stroke="#ff7f0e"' in svg  # the key edge green, the value edge orange
    assert "0.0 -&gt; 1.0&lt;k&gt;" in svg and "faithfulness" in page
    assert "<table>" in d.scores._repr_html_() and "CPR" in d.curve._repr_html_()
