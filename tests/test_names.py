"""The public names of 1.1: the aliases of 1.0's renames are gone (each old name fails the way Python
fails on a name that never existed), ``import qkov`` leaves the app and notebook layers (and the heavy
optional libraries) to first use, and one progress protocol, ``progress(what, done, total)``."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import qkov
from helpers import TINY
from qkov import Transformer, Weights

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _tiny() -> Weights:
    return Weights.from_model(Transformer(TINY, seed=0).eval(), dtype=torch.float64)


def _attr(module: str, name: str) -> Callable[[], Any]:
    return lambda: getattr(importlib.import_module(module), name)


def _module(name: str) -> Callable[[], Any]:
    return lambda: importlib.import_module(name)


# every alias 1.0 kept for one release (CHANGELOG, 1.0.0 "Renamed"), as a user reaches it, and what
# reaching it now raises
GONE: list[tuple[str, Callable[[], Any], type[Exception]]] = [
    ("qkov.run", _attr("qkov", "run"), AttributeError),
    ("qkov.Run", _attr("qkov", "Run"), AttributeError),
    ("qkov.analysis.run", _attr("qkov.analysis", "run"), AttributeError),
    ("qkov.analysis.forward.Run", _attr("qkov.analysis.forward", "Run"), AttributeError),
    ("qkov.analysis.activations", _module("qkov.analysis.activations"), ImportError),
    ("qkov.analysis.dynamics", _module("qkov.analysis.dynamics"), ImportError),
    ("qkov.analysis.snapshot_measures", _module("qkov.analysis.snapshot_measures"), ImportError),
    ("qkov.analysis.circuits.analyse", _attr("qkov.analysis.circuits", "analyse"), AttributeError),
    ("qkov.apps.tour.render_page", _attr("qkov.apps.tour", "render_page"), AttributeError),
    ("qkov.apps.report.render.render_page", _attr("qkov.apps.report.render", "render_page"), AttributeError),
    ("qkov.analysis.series.measures.analyse", _attr("qkov.analysis.series.measures", "analyse"), AttributeError),
    ("qkov.show.dynamics", _module("qkov.show.dynamics"), ImportError),
    ("qkov.deprecated", _module("qkov.deprecated"), ImportError),
    ("qkov.progress.as_progress", _attr("qkov.progress", "as_progress"), AttributeError),
    ("qkov.analysis.shown.ListAccess", _attr("qkov.analysis.shown", "ListAccess"), AttributeError),
]


@pytest.mark.parametrize("old, get, error", GONE, ids=[g[0] for g in GONE])
def test_the_old_names_are_gone(old: str, get: Callable[[], Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        get()


# renamed in 1.1 without an alias (CHANGELOG, 1.1.0 "Renamed"): (old module, old name or None for the
# module itself, new module, new name)
RENAMED_1_1: list[tuple[str, str | None, str, str | None]] = [
    ("qkov.ranks", "Split", "qkov.ranks", "Ranks"),
    ("qkov.training.distributed", "DistInfo", "qkov.ranks", "Ranks"),
    ("qkov.training.distributed", "from_env", "qkov.ranks", "Ranks"),
    ("qkov.analysis.forward.sites", "SPLIT_INPUTS", "qkov.analysis.forward.sites", "HEAD_INPUTS"),
    ("qkov.analysis.paths.qk_side", "qk_split", "qkov.analysis.paths.qk_side", "expand_qk"),
    ("qkov.analysis.paths", "QKSplit", "qkov.analysis.paths", "QKExpansion"),
    ("qkov.analysis.forward.frozen", "frozen_run", "qkov.analysis.forward.frozen", "frozen_recording"),
    ("qkov.analysis.paths", "RUN_FLOPS", "qkov.analysis.paths", "PASS_FLOPS"),
    ("qkov.analysis.shown", "ListAccess", "qkov.analysis.shown", "Items"),
    ("qkov.apps.dynamics_study", None, "qkov.apps.dynamics.study", None),
    ("qkov.apps.dynamics_page", None, "qkov.apps.dynamics.page", None),
    ("qkov.apps.series", None, "qkov.apps.dynamics.series", None),
    ("qkov.apps.phase_section", None, "qkov.apps.dynamics.phase", None),
]


@pytest.mark.parametrize("old_module, old, new_module, new", RENAMED_1_1, ids=[f"{r[0]}.{r[1]}" for r in RENAMED_1_1])
def test_the_names_renamed_in_1_1_have_no_alias(old_module: str, old: str | None, new_module: str, new: str | None) -> None:
    module = importlib.import_module(new_module)
    assert new is None or hasattr(module, new)
    with pytest.raises(AttributeError if old else ImportError):
        _attr(old_module, old)() if old else importlib.import_module(old_module)


def test_a_recorded_pass_is_a_recording_not_a_run() -> None:
    """In qkov a run is a training run: the fields and arguments holding a ``Trace`` say ``recording``."""
    from qkov.analysis.forward.cache import Stack
    from qkov.analysis.paths.expansion import Expansion

    for cls in (Stack, Expansion):
        names = {f.name for f in dataclasses.fields(cls)}
        assert "recording" in names and "run" not in names, cls
    for fn in (qkov.expand, qkov.term_importance):
        params = inspect.signature(fn).parameters
        assert "recording" in params and "run" not in params, fn


def test_the_old_forms_of_the_results_are_gone(tmp_path: Path) -> None:
    """Indexing the list-like results, unpacking the term effects, the old attribute names and the old
    argument order fail; what replaced them reads the same objects."""
    from qkov.analysis.heads.repeated import repeat_scores

    w = _tiny()
    copying = qkov.copying_scores(w, diag_k=3)
    composition = qkov.composition_scores(w, kinds=("q",), baseline_samples=4)
    for result, index in [(copying, 0), (composition, "q")]:
        with pytest.raises(TypeError, match="not subscriptable"):
            result[index]
    assert list(copying) == copying.heads and len(copying) == len(copying.heads)  # len and iteration stay
    assert composition.kinds["q"] is composition.q and list(composition) == ["q"]
    exp = qkov.expand(w, torch.randint(0, TINY.d_vocab, (1, 8)))
    with pytest.raises(TypeError, match="non-iterable"):
        singles, virtual = qkov.term_effects(exp, top_virtual=0)
    probe = qkov.induction_probe(w, length=6, batch=2)
    rep = repeat_scores(w, qkov.prefix_matching_tokens(TINY.d_vocab, length=6, seed=0, bos=0), 6)
    for result, old in [(probe, "scores"), (rep, "induction")]:
        with pytest.raises(AttributeError, match=old):
            getattr(result, old)
    model = Transformer(TINY, seed=0)
    with pytest.raises(qkov.QkovError, match="save_checkpoint"):
        qkov.save_checkpoint(tmp_path / "old", model)  # type: ignore[arg-type]
    assert not (tmp_path / "old").exists()


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
                  "after": "qkov.apps.dynamics.study" in sys.modules}))
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
    assert got["dynamics"] == "qkov.apps.dynamics.study" and got["show"] == "qkov.show" and got["same"]
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


def test_load_corpus_reports_with_the_protocol(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(4):
        (docs / f"doc{i}.txt").write_text(f"def f{i}(x):\n    return x + {i}\n" * 20)
    heard: list[tuple[str, int, int]] = []
    qkov.load_corpus(str(docs), vocab_size=280, cache_dir=tmp_path / "c", progress=lambda *a: heard.append(a))
    assert [a[0] for a in heard][-1] == "corpus: tokenising" and all(0 <= d <= n for _, d, n in heard)
