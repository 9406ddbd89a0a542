"""The public names of 1.0: every renamed name still works for one release and warns naming the new
one; ``import qkov`` leaves the app and notebook layers (and the heavy optional libraries) to first
use; one progress protocol, ``progress(what, done, total)``, with the old one-argument form accepted."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import qkov
from helpers import TINY
from qkov import Transformer, Weights
from qkov.progress import as_progress

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _attr(module: str, name: str) -> Callable[[], Any]:
    return lambda: getattr(importlib.import_module(module), name)


def _shim(old: str) -> Callable[[], Any]:
    """Import a deprecated module path afresh (its warning is given at import)."""

    def get() -> Any:
        sys.modules.pop(old, None)
        parent, _, child = old.rpartition(".")
        package = importlib.import_module(parent)
        if hasattr(package, child):
            delattr(package, child)
        return importlib.import_module(old)

    return get


# old name (as a user reaches it) -> the new object it must be, and the new name the warning must give
RENAMED: list[tuple[str, Callable[[], Any], Callable[[], Any], str]] = [
    ("qkov.run", lambda: qkov.run, lambda: qkov.trace, "qkov.trace"),
    ("qkov.Run", lambda: qkov.Run, lambda: qkov.Trace, "qkov.Trace"),
    ("tour.render_page", _attr("qkov.apps.tour", "render_page"), _attr("qkov.apps.tour", "render_tour"), "qkov.apps.tour.render_tour"),
    (
        "render.render_page",
        _attr("qkov.apps.report.render", "render_page"),
        _attr("qkov.apps.report.render", "render_template"),
        "qkov.apps.report.render.render_template",
    ),
    (
        "qkov.apps.dynamics",
        _shim("qkov.apps.dynamics"),
        lambda: importlib.import_module("qkov.apps.dynamics_study"),
        "qkov.apps.dynamics_study",
    ),
    (
        "qkov.show.dynamics",
        _shim("qkov.show.dynamics"),
        lambda: importlib.import_module("qkov.show.study_displays"),
        "qkov.show.study_displays",
    ),
]


@pytest.mark.parametrize("old, get_old, get_new, new", RENAMED, ids=[r[0] for r in RENAMED])
def test_old_names_work_and_warn(old: str, get_old: Callable[[], Any], get_new: Callable[[], Any], new: str) -> None:
    with pytest.warns(DeprecationWarning, match=f"use {new.replace('.', r'[.]')}.*removed in 1[.]1"):
        got = get_old()
    assert got is get_new()


def _tiny() -> Weights:
    return Weights.from_model(Transformer(TINY, seed=0).eval(), dtype=torch.float64)


def test_the_old_forward_still_computes_the_model() -> None:
    """``qkov.run`` (deprecated) computes what the training model computes on the same tokens."""
    model = Transformer(TINY, seed=0).eval().double()
    toks = torch.randint(0, TINY.d_vocab, (2, 12))
    with pytest.warns(DeprecationWarning):
        old = qkov.run(Weights.from_model(model, dtype=torch.float64), toks)
    with torch.no_grad():  # the view centres the unembedding: the log-probabilities agree
        assert (old.logits.log_softmax(-1) - model(toks).log_softmax(-1)).abs().max() < 1e-9
    assert isinstance(old, qkov.Trace)


def test_old_attribute_names_of_the_induction_scores() -> None:
    """``InductionProbe.scores`` and ``RepeatScores.induction`` are the induction attention: the mean
    attention from a repeated token to the token after its previous occurrence, recomputed here."""
    from qkov.analysis.heads.repeated import repeat_scores

    w = _tiny()
    probe = qkov.induction_probe(w, length=6, batch=2)
    with pytest.warns(DeprecationWarning, match="use InductionProbe.induction_attention"):
        assert probe.scores is probe.induction_attention
    toks = qkov.induction_probe_tokens(TINY.d_vocab, length=6, repeats=2, batch=2, seed=0, bos=0)
    P = qkov.trace(w, toks, cache="pattern.*").stack("pattern")  # [L, B, H, T, T]
    q = torch.arange(7, toks.shape[1])
    by_hand = P[..., q, q - 5].mean(dim=(1, 3))  # key: the token after the previous copy of the query's
    assert (probe.induction_attention - by_hand.float()).abs().max() < 1e-6
    rep = qkov.prefix_matching_tokens(TINY.d_vocab, length=6, seed=0, bos=0)
    rs = repeat_scores(w, rep, 6)
    with pytest.warns(DeprecationWarning, match="use RepeatScores.induction_attention"):
        assert rs.induction is rs.induction_attention
    P = qkov.trace(w, rep, cache="pattern.*").stack("pattern")
    q = torch.arange(7, rep.shape[1])
    assert (rs.induction_attention - P[..., q, q - 5].mean(dim=(1, 3))).abs().max() < 1e-9


# --------------------------------------------------------------------------- import qkov stays light
LIGHT = """
import json, sys, warnings
import qkov
before = {m: m in sys.modules for m in ("qkov.apps", "qkov.show", "transformers", "transformer_lens", "plotly", "rich")}
names_listed = sorted(set(qkov.__all__) - set(dir(qkov)))
dynamics, show = qkov.dynamics, qkov.show  # the lazy names load on first use
from qkov import show as show_again
print(json.dumps({"before": before, "missing_from_dir": names_listed, "dynamics": dynamics.__module__,
                  "show": show.__name__, "same": show is show_again and hasattr(show, "attention"),
                  "after": "qkov.apps.dynamics_study" in sys.modules}))
"""


def _python(code: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONPATH": SRC, "PATH": ""}
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_qkov_leaves_the_app_and_notebook_layers_to_first_use() -> None:
    got = _python(LIGHT)
    assert got["before"] == dict.fromkeys(got["before"], False), got["before"]
    assert got["missing_from_dir"] == []
    assert got["dynamics"] == "qkov.apps.dynamics_study" and got["show"] == "qkov.show" and got["same"]
    assert got["after"]


DISPLAY = """
import json, sys, torch
import qkov
from qkov import Transformer, Weights, ModelConfig
w = Weights.from_model(Transformer(ModelConfig(n_layers=2, n_heads=2, d_model=32, d_head=16, d_vocab=300, n_ctx=32)))
probe = qkov.induction_probe(w, length=6, batch=2)
before = "qkov.show" in sys.modules
html = probe._repr_html_()
print(json.dumps({"before": before, "after": "qkov.show" in sys.modules, "html": html}))
"""


def test_the_first_notebook_display_loads_the_notebook_layer() -> None:
    """A result's rich display appears without importing ``qkov.show``: the first display loads it."""
    got = _python(DISPLAY)
    assert not got["before"] and got["after"]
    assert got["html"] is not None and "<" in got["html"]


def test_qkov_dir_and_all_agree() -> None:
    assert set(qkov.__all__) <= set(dir(qkov))
    for name in qkov.__all__:
        assert getattr(qkov, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        qkov.nothing_here  # noqa: B018


# --------------------------------------------------------------------------- one progress protocol
def test_analyses_report_progress_as_what_done_total() -> None:
    heard: list[tuple[Any, ...]] = []
    w = _tiny()
    toks = torch.randint(0, TINY.d_vocab, (2, 16))
    from qkov.analysis.circuits.report import circuits_report
    from qkov.analysis.paths.summary import summarize

    circuits_report(w, diag_k=None, progress=lambda *a: heard.append(a))
    summarize(w, toks, progress=lambda *a: heard.append(a))
    assert heard and all(len(a) == 3 and isinstance(a[0], str) for a in heard)
    assert all(isinstance(d, int) and isinstance(n, int) and 0 <= d <= n for _, d, n in heard)
    for stage in {a[0] for a in heard}:  # every stage is heard to its end
        assert max(d - n for s, d, n in heard if s == stage) == 0, stage


def test_load_corpus_reports_with_the_protocol_and_accepts_the_old_form(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(4):
        (docs / f"doc{i}.txt").write_text(f"def f{i}(x):\n    return x + {i}\n" * 20)
    heard: list[tuple[str, int, int]] = []
    qkov.load_corpus(str(docs), vocab_size=280, cache_dir=tmp_path / "c", progress=lambda *a: heard.append(a))
    assert [a[0] for a in heard][-1] == "corpus: tokenising" and all(0 <= d <= n for _, d, n in heard)
    old: list[str] = []
    with pytest.warns(DeprecationWarning, match=r"one-argument progress callback to qkov\.load_corpus"):
        qkov.load_corpus(str(docs), vocab_size=280, cache_dir=tmp_path / "c2", progress=old.append)
    assert old == [what for what, _, _ in heard]  # each message once, in order


def test_as_progress_tells_the_two_forms_apart_by_signature() -> None:
    calls: list[Any] = []
    new = lambda what, done, total: calls.append((what, done, total))  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert as_progress(new, "f") is new and as_progress(print, "f") is print and as_progress(None, "f") is None
    with pytest.warns(DeprecationWarning):
        wrapped = as_progress(lambda message: calls.append(message), "f")
    assert wrapped is not None
    for args in [("a", 0, 2), ("a", 1, 2), ("a", 2, 2), ("b", 0, 1), ("b", 1, 1)]:
        wrapped(*args)
    assert calls == ["a", "b"]
