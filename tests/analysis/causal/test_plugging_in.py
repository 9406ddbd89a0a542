"""docs/dev/plugging-in.md, executed: its example module (a new sweep, one module and one registration)
run on a tiny model, its numbers checked against the training model's own forward pass, and the sweep
shown by every surface that iterates the registry (the study, ``qkov patch``, the explorer, the notebook)
without any of them naming it. The page's edge example runs too."""

from __future__ import annotations

import json
import re
import types
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch

import qkov
from qkov import Transformer, Weights
from qkov.analysis.causal import SWEEPS, Contrast, LogitDiff
from qkov.analysis.forward.address import Address
from qkov.apps.explore.context import BadRequest, Explorer
from qkov.apps.explore.views import VIEWS

from helpers import LN_MLP, ROOT, TINY, perturb_non_matrices, run_main

DOC = ROOT / "docs" / "dev" / "plugging-in.md"
NOOP = lambda *a: None  # noqa: E731


def _block(marker: str) -> str:
    """The page's one Python code block containing ``marker``."""
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S) if marker in b]
    return code


@pytest.fixture
def example() -> Iterator[types.ModuleType]:
    """The page's module, imported (its sweep registered); unregistered afterwards."""
    module = types.ModuleType("token_patching")
    exec(compile(_block("# token_patching.py"), str(DOC), "exec"), module.__dict__)
    try:
        yield module
    finally:
        SWEEPS.pop("token", None)


def _pair(cfg: Any = LN_MLP) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(1, cfg.d_vocab, (2, 9), generator=g)
    corrupted = clean.clone()
    corrupted[:, 2:6] = torch.randint(1, cfg.d_vocab, (2, 4), generator=g)
    return clean, corrupted


def _logit_diff(model: Transformer, tokens: torch.Tensor, correct: torch.Tensor, incorrect: int) -> float:
    """The metric on the training model's own forward (not qkov.trace), written out."""
    with torch.no_grad():
        last = model(tokens)[:, -1]
    return float((last.gather(-1, correct[:, None])[:, 0] - last[:, incorrect]).mean())


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_the_example_sweep_equals_one_token_swapped_at_a_time(
    example: types.ModuleType, direction: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = perturb_non_matrices(Transformer(LN_MLP, seed=2).double().eval(), 0.2)
    w = Weights.from_model(model, dtype=torch.float64)
    clean, corrupted = _pair()
    metric = LogitDiff(correct=clean[:, -1], incorrect=3)
    monkeypatch.setattr(Contrast, "copies", lambda self, *a, **k: 4)  # 9 positions in passes of 4, 4 and 1
    r = example.token_patching(w, clean, corrupted, metric=metric, direction=direction)
    base, source = (corrupted, clean) if direction == "denoise" else (clean, corrupted)
    assert r.axes == ("pos",) and r.values.shape == (9,) and r.method == "token"
    assert r.clean == pytest.approx(_logit_diff(model, clean, clean[:, -1], 3), abs=1e-10)
    assert r.corrupted == pytest.approx(_logit_diff(model, corrupted, clean[:, -1], 3), abs=1e-10)
    for p in range(9):
        swapped = base.clone()
        swapped[:, p] = source[:, p]
        assert r.at(pos=p) == pytest.approx(_logit_diff(model, swapped, clean[:, -1], 3), abs=1e-10), p
    moved = (r.values - r.base).abs() > 1e-9
    assert moved[2:6].all() and not moved[[0, 1, 6, 7, 8]].any()  # only the positions that differ move it


def test_every_surface_shows_the_registered_sweep(
    example: types.ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    torch.manual_seed(0)
    model = Transformer(TINY, seed=5).eval()
    w = Weights.from_model(model)
    clean, corrupted = _pair(TINY)
    want = example.token_patching(w, clean, corrupted)  # the default metric: the loss on the clean tokens
    # the study: on when asked, off by default
    study = qkov.patch_study(w, clean, corrupted, by_token=True, attribution=False)
    assert [r.method for r in study.results] == ["activation", "activation", "token"]
    assert torch.allclose(study.result("token", "each token").values, want.values)
    assert "token" not in [r.method for r in qkov.patch_study(w, clean, corrupted, attribution=False).results]
    # qkov patch: the option is a flag, the result is in the JSON and the table
    qkov.save_checkpoint(model, tmp_path / "m")
    np.save(tmp_path / "c.npy", clean.numpy())
    np.save(tmp_path / "x.npy", corrupted.numpy())
    args = ["patch", tmp_path / "m", "--clean", tmp_path / "c.npy", "--corrupted", tmp_path / "x.npy", "--by-token"]
    code, out, err = run_main(capsys, *args, "--json")
    assert code == 0, err
    (got,) = [r for r in json.loads(out)["results"] if r["method"] == "token"]
    assert got["axes"] == ["pos"] and np.allclose(got["values"], want.values.numpy(), atol=1e-6)
    code, out, err = run_main(capsys, *args, "--no-attribution")
    assert code == 0 and "token patching of each token by pos" in out, err
    code, out, _ = run_main(capsys, "patch", "--help")
    assert "--by-token" in out and "token: each position's token taken from the source alone" in " ".join(out.split())
    # the explorer's patch view: the option by name, as JSON
    ex = Explorer(model=model, weights=w, name="tiny", decode=str, codec=None, bos=0, max_tokens=TINY.n_ctx)
    res = VIEWS["patch"](ex, {"clean": clean[0].tolist(), "corrupted": corrupted[0].tolist(), "by_token": True}, NOOP)
    (view,) = [r for r in res["results"] if r["method"] == "token"]
    one = example.token_patching(w, clean[:1], corrupted[:1])
    assert np.allclose(view["values"], one.values.numpy(), atol=1e-5)
    with pytest.raises(BadRequest, match="by_token: expected true or false"):
        VIEWS["patch"](ex, {"clean": clean[0].tolist(), "corrupted": corrupted[0].tolist(), "by_token": "yes"}, NOOP)
    # the notebook: the study's display carries the result for the report's renderer
    html = study._repr_html_()
    assert html is not None and '"method": "token"' in html.replace('\\"', '"')


def test_the_edge_example_reads_back_by_label() -> None:
    torch.manual_seed(0)
    w = Weights.from_model(Transformer(TINY, seed=5).eval())
    contrast = Contrast.of(w, *_pair(TINY)).record()
    scores = torch.tensor([0.25, -1.5], dtype=torch.float64)
    names: dict[str, Any] = {"Address": Address, "w": w, "contrast": contrast, "scores": scores}
    exec(compile(_block("Address.parse(e).check(w.cfg)"), str(DOC), "exec"), names)
    r = names["r"]
    assert r.at(edge="0.1 -> 1.0<k>") == -1.5 and r.labels["edge"] == ["0.0 -> 1.0<k>", "0.1 -> 1.0<k>"]
    assert r.clean == contrast.clean_value and r.corrupted == contrast.corrupted_value
