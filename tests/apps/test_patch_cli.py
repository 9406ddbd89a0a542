"""``qkov patch`` and ``qkov ablate``'s interventions on a tiny trained model: the numbers are the
library's on the same tokens, inputs are texts or token ids, user mistakes are one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import qkov
from qkov import Weights
from qkov.analysis.causal import ablation as Ab
from qkov.analysis.causal.metrics import LogitDiff, Loss
from qkov.analysis.causal.patching import activation_patching
from qkov.analysis.causal.path_patch import path_patching
from qkov.analysis.causal.studies import patch_study
from qkov.apps.inputs import sample_for
from qkov.io import save_tl

from helpers import TINY, run_main, tiny_train

CLEAN = "def f(self, x): return self.x + x"
CORRUPTED = "def g(self, y): return self.y + y"


@pytest.fixture(scope="module")
def tiny(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("patch") / "run"
    qkov.train(out, TINY, tiny_train(small_corpus, steps=20, snapshots=0), device="cpu")
    return out


def _texts(tmp_path: Path, model: qkov.Transformer) -> tuple[Path, Path, torch.Tensor, torch.Tensor]:
    """Two one-line texts of the same token count (a fallback pair if the BPE splits them differently)."""
    pairs = [(CLEAN, CORRUPTED), ("a = b + c", "a = d + c"), ("x", "y")]
    for a, b in pairs:
        ta, tb = (torch.tensor([[model.bos_token_id, *model.tokenizer.encode(s).ids]]) for s in (a, b))
        if ta.shape == tb.shape:
            (tmp_path / "c.txt").write_text(a + "\n")
            (tmp_path / "x.txt").write_text(b + "\n")
            return tmp_path / "c.txt", tmp_path / "x.txt", ta, tb
    raise AssertionError("no pair of equal-length texts")


def test_patch_prints_the_librarys_numbers_for_texts_and_token_ids(tiny: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    model = qkov.load(tiny)
    c, x, clean, corrupted = _texts(tmp_path, model)
    code, out, err = run_main(capsys, "patch", tiny, "--clean", c, "--corrupted", x, "--receivers", "1.1", "--json")
    assert code == 0, err
    data = json.loads(out)
    got = {(r["method"], r["site"]): r for r in data["results"]}
    assert set(got) == {("activation", "resid_pre"), ("activation", "head_out"), ("attribution", "head_out"), ("path", "sender -> 1.1 k")}
    w = Weights.from_model(model)
    want = activation_patching(w, clean, corrupted, site="head_out", metric=Loss(tokens=clean))
    assert np.allclose(got[("activation", "head_out")]["values"], want.values.numpy(), atol=1e-6)
    pp = path_patching(w, clean, corrupted, receivers=[(1, 1)], metric=Loss(tokens=clean))
    assert np.allclose(np.array(got[("path", "sender -> 1.1 k")]["values"][0], dtype=float), pp.values[0].numpy(), atol=1e-6)
    assert data["tokens"][0] == model.to_str_tokens(clean[0, :1])[0] and len(data["tokens"]) == clean.shape[1]
    assert -1 <= data["agreement"]["head_out"] <= 1
    # token ids, a logit-difference metric by ids, and the table output
    np.save(tmp_path / "c.npy", clean.numpy())
    np.save(tmp_path / "x.npy", corrupted.numpy())
    code, out, err = run_main(
        capsys, "patch", tiny, "--clean", tmp_path / "c.npy", "--corrupted", tmp_path / "x.npy",
        "--metric", "logit-diff:5,6", "--site", "attn_out", "--no-attribution", "--json",
    )  # fmt: skip
    assert code == 0, err
    r = json.loads(out)["results"][0]
    want = activation_patching(w, clean, corrupted, site="attn_out", metric=LogitDiff(correct=5, incorrect=6))
    assert r["site"] == "attn_out" and np.allclose(r["values"], want.values.numpy(), atol=1e-6)
    code, out, _ = run_main(capsys, "patch", tiny, "--clean", c, "--corrupted", x)
    assert code == 0 and "activation patching of head_out by layer x head" in out and "head 1" in out


def test_patch_reads_the_view_straight_from_a_checkpoint(tiny: Path, tmp_path: Path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """On a qkov checkpoint ``qkov patch`` never loads the model (the folded view is read layer by layer from the
    memory map): every result is the study's on the loaded model's view."""
    from qkov.apps.cli import common

    model = qkov.load(tiny)
    c, x, clean, corrupted = _texts(tmp_path, model)
    want = patch_study(Weights.from_model(model), clean, corrupted, receivers="1.1").results

    def refuse(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("qkov patch loaded the model")

    monkeypatch.setattr(common, "load_any", refuse)
    code, out, err = run_main(capsys, "patch", tiny, "--clean", c, "--corrupted", x, "--receivers", "1.1", "--json")
    assert code == 0, err
    got = json.loads(out)["results"]
    assert [(r["method"], r["site"]) for r in got] == [(r.method, r.site) for r in want]
    for g, w in zip(got, want):
        values = np.array(g["values"], dtype=float)  # JSON null: NaN
        assert np.allclose(values, w.values.numpy(), atol=1e-5, equal_nan=True), g["site"]
        assert abs(g["clean"] - w.clean) < 1e-5 and abs(g["corrupted"] - w.corrupted) < 1e-5


def test_patch_and_ablate_user_mistakes_are_one_line_errors(tiny: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    model = qkov.load(tiny)
    c, x, _, _ = _texts(tmp_path, model)
    (tmp_path / "long.txt").write_text(c.read_text().strip() + " more\n")
    (tmp_path / "huge.txt").write_text("word " * 40 + "\n")
    (tmp_path / "two.txt").write_text("a b\nsomething longer than that\n")
    save_tl(model, tmp_path / "m.safetensors")  # no tokenizer
    cases = [
        (["--clean", c, "--corrupted", tmp_path / "long.txt"], "same number of sequences and tokens: [1, "),
        (["--clean", c, "--corrupted", tmp_path / "long.txt"], "they split as '"),
        (["--clean", tmp_path / "two.txt", "--corrupted", x], "same number of tokens"),
        (["--clean", c, "--corrupted", x, "--metric", "median"], "expected loss, logit-diff"),
        (["--clean", c, "--corrupted", x, "--site", "patern"], "no site"),
        (["--clean", c, "--corrupted", x, "--receivers", "0.1"], "layer 0 has no earlier head"),
        (["--clean", c, "--corrupted", tmp_path / "missing.txt"], "cannot read"),
        (["--clean", tmp_path / "huge.txt", "--corrupted", tmp_path / "huge.txt"], "longer than the context (32)"),
    ]
    for args, says in cases:
        code, _, err = run_main(capsys, "patch", tiny, *args)
        assert code == 2 and says in err and err.count("\n") == 1, (args, err)
    code, _, err = run_main(capsys, "patch", tmp_path / "m.safetensors", "--clean", c, "--corrupted", x)
    assert code == 2 and "no tokenizer" in err
    for args, says in [(["--positions", "70"], "out of range for the model's context"), (["--positions", "a:b"], "not a position")]:
        code, _, err = run_main(capsys, "ablate", tiny, "--heads", "1.0", *args)
        assert code == 2 and says in err and err.count("\n") == 1, err


def test_ablate_at_positions_with_resampling_matches_the_library(tiny: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    code, out, err = run_main(capsys, "ablate", tiny, "--heads", "1.0", "--mode", "resample", "--positions", "10:", "--draws", "1", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["mode"] == "resample" and data["positions"] == "10:"
    model = qkov.load(tiny)
    sample = sample_for(tiny, model, text=None, tokens=None, seed=0)
    study = Ab.ablation_study(
        Weights.from_model(model), sample.text, [(1, 0)], icl_text=sample.icl_text, mode="resample",
        draws=1, bos=sample.bos, seed=0, positions=slice(10, None),
    )  # fmt: skip
    assert data["ablated"]["loss"] == pytest.approx(study.ablated.loss, abs=1e-6)
    assert data["ablated"]["repeat_second"] == pytest.approx(study.ablated.repeat_second, abs=1e-6)
    assert data["ablated"]["loss"] != pytest.approx(data["intact"]["loss"], abs=1e-6)
