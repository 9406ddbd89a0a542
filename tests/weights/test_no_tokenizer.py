"""A model with no tokenizer and no training corpus (say, imported from a TransformerLens state
dict): every analysis runs from the command line on token ids, or on seeded random tokens, and
names the heads the model was built with."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from qkov import Weights, load_any
from qkov.analysis.circuits.trigrams import TrigramTable
from qkov.io.checkpoint import save_checkpoint

from hand_built import CTX, V, hand_built
from helpers import run_main


@pytest.fixture(scope="module")
def hand(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hand") / "ckpt"
    model = hand_built()
    assert model.tokenizer is None
    save_checkpoint(model, path)
    return path


def _roles(data: dict) -> dict[str, list[str]]:
    return {r["head"]: r["roles"] for r in data["heads"]}


def _designed(roles: dict[str, list[str]]) -> None:
    assert "previous-token" in roles["0.0"] and "sink" in roles["0.1"] and "induction" in roles["1.0"]
    assert all("induction" not in roles[h] for h in ("0.0", "0.1", "1.1"))


def test_heads_on_random_tokens_and_on_token_files(hand: Path, tmp_path: Path, capsys) -> None:
    rc, out, err = run_main(capsys, "heads", hand, "--json", "--batch", 4, "--icl-examples", 4)
    assert rc == 0, err
    data = json.loads(out)
    assert data["inputs"].startswith("seeded random tokens") and data["icl"] is None
    _designed(_roles(data))
    stream = np.random.default_rng(0).integers(1, V, 4 * CTX)
    np.save(tmp_path / "ids.npy", stream)
    (tmp_path / "ids.txt").write_text("\n".join(" ".join(map(str, row)) for row in stream.reshape(4, CTX)))
    stream.astype(np.uint16).tofile(tmp_path / "ids.bin")
    for name in ("ids.npy", "ids.txt", "ids.bin"):
        rc, out, err = run_main(capsys, "heads", hand, "--json", "--batch", 4, "--tokens", tmp_path / name)
        assert rc == 0, err
        data = json.loads(out)
        assert data["inputs"] == f"token ids from {tmp_path / name}: 4 sequences of {CTX} tokens"
        _designed(_roles(data))
    rc, out, _ = run_main(capsys, "heads", hand, "--batch", 2, "--icl-examples", 2)
    assert rc == 0 and "inputs: seeded random tokens" in out and "in-context learning score left out: the tokens are not" in out


def test_paths_and_report_without_a_tokenizer(hand: Path, tmp_path: Path, capsys) -> None:
    rc, out, err = run_main(capsys, "paths", hand, "--json", "--batch", 2)
    assert rc == 0, err
    data = json.loads(out)
    assert data["inputs"].startswith("seeded random tokens") and data["reconstruction_max_abs_error"] < 1e-3
    ids = np.random.default_rng(1).integers(1, V, (6, CTX))
    ids[:, 0] = 0
    np.save(tmp_path / "rows.npy", ids)
    rc, _, err = run_main(capsys, "report", hand, "-o", tmp_path / "rep", "--tokens", tmp_path / "rows.npy", "--quiet")
    assert rc == 0, err
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert rep["inputs"] == f"token ids from {tmp_path / 'rows.npy'}: 6 sequences of {CTX} tokens"
    assert rep["attention"]["tokens"][:3] == [f"<{i}>" for i in ids[0, :3]]  # ids as labels
    _designed({r["head"]: r["roles"] for r in rep["heads"]["rows"]})
    assert rep["composition"]["k"]["top"][0]["writer"] == "0.0" and rep["composition"]["k"]["top"][0]["reader"] == "1.0"


@pytest.mark.parametrize(
    "content, name, needle",
    [
        ("1 2 3 999", "bad.txt", "out of range"),
        ("1 2 x", "bad.txt", "integer token ids"),
        ("", "empty.txt", "1-D or 2-D array"),
    ],
)
def test_bad_token_files_are_one_line_errors(hand: Path, tmp_path: Path, capsys, content, name, needle) -> None:
    (tmp_path / name).write_text(content)
    rc, _, err = run_main(capsys, "heads", hand, "--tokens", tmp_path / name)
    assert rc == 2 and err.count("\n") == 1 and needle in err, err
    rc, _, err = run_main(capsys, "paths", hand, "--tokens", tmp_path / "missing.npy")
    assert rc == 2 and "cannot read" in err


def test_trigrams_without_a_tokenizer_show_token_ids(hand: Path, capsys) -> None:
    rc, out, err = run_main(capsys, "trigrams", hand, "--head", "0.0", "--json", "--source", "<3>", "--top", 5)
    assert rc == 0, err
    data = json.loads(out)
    model = load_any(hand)
    want = TrigramTable(Weights.from_model(model), 0, 0).top(40, exclude=(model.bos_token_id,))[:5]
    got = [(r["source"], r["destination"], r["output"], r["score"]) for r in data["trigrams"]]
    assert got == [(t.source, t.destination, t.output, pytest.approx(t.score, rel=1e-4)) for t in want]
    assert all(r["source_str"] == f"<{r['source']}>" for r in data["trigrams"])
    assert data["source"]["token"] == 3 and data["source"]["string"] == "<3>"
    rc, _, err = run_main(capsys, "trigrams", hand, "--head", "0.0", "--source", "the")
    assert rc == 2 and err.count("\n") == 1 and "no tokenizer, so give a token id" in err, err
