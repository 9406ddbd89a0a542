"""Every page qkov writes (report, dynamics, tour, exported notebook) in headless Chromium: data that
holds markup (``<!--``, ``</script>``, U+2028) still draws every section, any string survives the
escaping of page data, a page whose data cannot be read says so, and at 1400 and 900 px no two
text boxes overlap and nothing scrolls sideways."""

from __future__ import annotations

import base64
import html
import itertools
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import qkov
from qkov import ModelConfig
from qkov.apps import tour
from qkov.apps.claims import claims
from qkov.apps.dynamics.study import write_dynamics
from qkov.apps.dynamics.phase import phase_charts, phase_claims
from qkov.apps.report import write_report
from qkov.apps.report.render import script_code, script_json
from qkov.training.loop import train

from browser import LAYOUT_PROBE, at_width, chromium, console_lines, layout, need_browser
from helpers import ROOT, tiny_train

ROOT = ROOT
REPORT_SECTIONS = (
    "card", "heads", "composition", "paths", "attention", "icl", "trigrams", "causal", "patching", "circuit"
)
DYNAMICS_SECTIONS = ("summary", "curves", "loss", "heads", "trajectory", "ablation", "table")
TOUR_SECTIONS = ("models", "curves", "phase", "circuit", "claims")
ARCH_SECTIONS = ("variants", "phase", "loss", "sinks", "orders")
MARKUP = "<!-- a comment --> <script>alert(1)</script> \u2028 & </SCRIPT > <!--<script> -->"


# ------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def hostile(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny 2-layer run (with snapshots) in a folder named ``cmt<!--dir``, and a text file whose
    name and content hold markup: what the report and dynamics pages are asked to show."""
    root = tmp_path_factory.mktemp("pages") / "cmt<!--dir"
    cfg = ModelConfig(n_layers=2, n_heads=2, d_model=32, d_head=16, d_vocab=300, n_ctx=80)
    train(root / "ckpt", cfg, tiny_train(small_corpus, steps=20, snapshots=4), device="cpu")
    (root / "page<!--<script>\u2028.txt").write_text(MARKUP * 40)
    g = torch.Generator().manual_seed(3)
    clean = torch.randint(1, 300, (2, 12), generator=g)
    clean[:, 0] = 0
    corrupted = clean.clone()
    corrupted[:, 4:7] = torch.randint(1, 300, (2, 3), generator=g)
    np.save(root / "clean.npy", clean.numpy())
    np.save(root / "corrupted.npy", corrupted.numpy())
    return root


@pytest.fixture(scope="module")
def report(hostile: Path) -> tuple[Path, Any]:
    out = hostile / "report"
    rep = write_report(
        hostile / "ckpt",
        out,
        icl_examples=8,
        batch=2,
        viewer_tokens=40,
        text=hostile / "page<!--<script>\u2028.txt",
        clean=hostile / "clean.npy",
        corrupted=hostile / "corrupted.npy",
    )
    return out / "index.html", rep


@pytest.fixture(scope="module")
def architectures_file(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The architectures study's page from real tiny runs of two variants, trained on a corpus whose
    folder name holds markup (the page shows it)."""
    from qkov.apps.architectures import run_architectures

    root = tmp_path_factory.mktemp("arch") / "cmt<!--dir"
    corpus = root / "corpus<!--<script>"
    corpus.mkdir(parents=True)
    for f in small_corpus.iterdir():
        (corpus / f.name).write_bytes(f.read_bytes())
    cfg = ModelConfig(n_layers=2, n_heads=2, d_model=32, d_head=16, d_vocab=300, n_ctx=48)
    tc = {k: v for k, v in vars(tiny_train(corpus, steps=12, snapshots=4)).items() if k not in ("steps", "corpus")}
    run_architectures(root / "out", variants=["standard", "gate", "loop"], steps=12, corpus=str(corpus), base=cfg, train_options=tc,
                      device="cpu", quiet=True, say=lambda s: None)  # fmt: skip
    return root / "out" / "index.html"


@pytest.fixture(scope="module")
def dynamics_page(hostile: Path) -> tuple[Path, Any]:
    out = hostile / "ckpt" / "dynamics"
    result = write_dynamics(out, [hostile / "ckpt"], device="cpu", draws=1, text=hostile / "page<!--<script>\u2028.txt")
    return out / "index.html", result


def _with_ablation(dyn: dict) -> dict:
    """``dyn`` with an ablation as a 2-layer tour run measures one (the tiny run has no induction
    heads to ablate), so the phase claims read as long as they do on a real tour."""
    ab = {"heads": ["1.0", "1.3"], "mode": "mean", "mean_sample": "the validation text",
          "intact": {"loss": 5.1, "icl": -0.42, "repeat_first": 6.0, "repeat_second": 1.2},
          "ablated": {"loss": 5.3, "icl": -0.08, "repeat_first": 6.0, "repeat_second": 5.1},
          "random": [{"loss": 5.2, "icl": -0.3 - 0.01 * i, "repeat_first": 6.0, "repeat_second": 2.0}
                     for i in range(5)],
          "random_heads": [["0.1", "1.2"], ["0.0", "0.3"], ["1.1", "0.2"], ["0.3", "1.2"], ["0.2", "1.1"]],
          "icl_removed": 0.81, "random_icl_removed": 0.27, "random_icl_removed_median": 0.24}
    return {**dyn, "ablation": ab}


def tour_page(rep: Any, dyn: dict) -> str:
    """The tour's comparison page as ``run_tour`` draws it, from one tiny report standing for each
    model and one dynamics result for both runs: the real claim texts, rows, curves and charts."""
    two = _with_ablation(dyn)
    table = claims({1: rep, 2: rep}) + phase_claims(two, dyn)
    models = [tour._model_row(n, rep) for n in (0, 1, 2)]
    meta = {"device": "cpu", "corpus": "python-stdlib (built in) <!-- </script>", "seconds": 3725.4}
    curves = {f"{n}-layer": rep.icl.loss_by_position or [] for n in (0, 1, 2)}
    return tour.render_tour(models, table, meta, curves, phase_charts({2: two, 1: dyn}), rep.circuit.to_dict())


@pytest.fixture(scope="module")
def tour_file(
    report: tuple[Path, Any], dynamics_page: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    path = tmp_path_factory.mktemp("tour") / "index.html"
    path.write_text(tour_page(report[1], dynamics_page[1].to_dict()))
    return path


@pytest.fixture(scope="module")
def notebook_file(hostile: Path, dynamics_page: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A notebook of qkov's displays (each kind once, the attention viewer on markup text), exported
    to HTML as the offline template does it."""
    nbformat = pytest.importorskip("nbformat")
    nbconvert = pytest.importorskip("nbconvert")
    from qkov.analysis import circuits as C
    from qkov.analysis.circuits import trigrams as T
    from qkov.analysis.causal.ablation import ablation_study
    from qkov.analysis.causal.composition import composition_paths
    from qkov.analysis.circuits.composition import composition_scores
    from qkov.analysis.heads.report import head_report
    from qkov.analysis.paths.summary import summarize
    from qkov.model.tokens import token_decoder
    from qkov.show import page

    model = qkov.load(hostile / "ckpt")
    w = qkov.Weights.from_model(model)
    toks = qkov.induction_probe_tokens(300, length=20, repeats=2, batch=2, seed=1, bos=0)[:, :41]
    decode = token_decoder(model.tokenizer)
    shown = {
        "qkov.show.attention(model, text)": qkov.show.attention(model, MARKUP, 1, 0),
        "head_report(w, toks)": head_report(w, toks, bos=0),
        "composition_scores(w)": composition_scores(w),
        "C.copying_scores(w)": C.copying_scores(w, diag_k=3),
        "C.full_ov(w, 1, 0).topk(8)": C.full_ov(w, 1, 0).topk(8).with_tokens(decode),
        "T.skip_trigrams(w, 0, 0)": T.skip_trigrams(w, 0, 0, top=8).with_tokens(decode),
        "T.bigrams(w)": T.bigrams(w, top=8).with_tokens(decode),
        "summarize(w, toks)": summarize(w, toks),
        "qkov.induction_probe(w)": qkov.induction_probe(w, bos=0, length=20),
        "qkov.patch_study(w, clean, corrupted)": qkov.patch_study(
            w, toks[:, :21], toks.flip(1)[:, :21], receivers=[(1, 0)]
        ),
        "composition_paths(w, (0, 0), (1, 0))": composition_paths(w, (0, 0), (1, 0), text=toks),
        "dynamics result": dynamics_page[1],
        "ablation_study(w, ...)": ablation_study(w, toks, [(1, 0)], draws=2),
    }
    page.reset()
    nb = nbformat.v4.new_notebook()
    for i, (code, obj) in enumerate(shown.items()):
        out = nbformat.v4.new_output("execute_result", {"text/html": obj._repr_html_(), "text/plain": repr(obj)},
                                     execution_count=i + 1)
        nb.cells.append(nbformat.v4.new_code_cell(code, execution_count=i + 1, outputs=[out]))
    exporter = nbconvert.HTMLExporter(template_file=str(ROOT / "examples" / "offline.html.j2"))
    body, _ = exporter.from_notebook_node(nb)
    path = tmp_path_factory.mktemp("notebook") / "displays.html"
    path.write_text(body)
    return path


def _open(page: Path, profile: Path, *extra: str) -> str:
    res = chromium(page.as_uri(), profile, "--dump-dom", *extra)
    assert res.returncode == 0, res.stderr[-2000:]
    assert not console_lines(res), "console output from the page:\n" + "\n".join(console_lines(res))
    return res.stdout


def _rendered(dom: str, sections: tuple[str, ...]) -> None:
    assert 'data-ready="1"' in dom and "data-errors=" not in dom and '<p class="error"' not in dom
    for s in sections:
        assert re.search(rf'data-section="{s}" data-rendered="ok"', dom), f"section {s} did not render"


# ------------------------------------------------------------------------- markup in the data
def test_a_report_whose_strings_hold_markup_renders_every_section(report: tuple[Path, Any], tmp_path: Path) -> None:
    """The folder ``cmt<!--dir`` and a text file named with ``<!--``, ``<script>`` and U+2028: every
    section of the report draws and the card shows the names as they are."""
    need_browser()
    index, rep = report
    data = rep.to_dict()
    blob = json.dumps(data, ensure_ascii=False)
    assert "<!--" in blob and "\u2028" in blob and "cmt<!--dir" in data["inputs"]
    dom = _open(index, tmp_path / "profile")
    _rendered(dom, REPORT_SECTIONS)
    assert html.escape(data["inputs"], quote=False) in dom


def test_the_dynamics_page_of_that_run_renders_every_section(dynamics_page: tuple[Path, Any], tmp_path: Path) -> None:
    need_browser()
    index, result = dynamics_page
    assert "<!--" in result.sample
    dom = _open(index, tmp_path / "profile")
    _rendered(dom, DYNAMICS_SECTIONS)
    assert html.escape(result.sample, quote=False) in dom


def hostile_strings() -> list[str]:
    """Every printable ASCII string of length <= 2 (9,121 with the empty one), every string of
    length 3 and 4 over the characters that matter inside a <script> element (110,808), and named
    ones: 119,929 + 12 strings."""
    printable = [chr(c) for c in range(0x20, 0x7F)]
    danger = list("<>/!-&\"\\' script") + ["\u2028", "\u2029"]
    assert len(danger) == 18
    out = [""] + printable + ["".join(p) for p in itertools.product(printable, repeat=2)]
    for n in (3, 4):
        out += ["".join(p) for p in itertools.product(danger, repeat=n)]
    out += ["</script>", "</SCRIPT >", "</script/", "<!--", "<!--<script>", "<script>", "-->", "\u2028", "\u2029",
            "]]>", "<\\/script>", MARKUP]
    return out


CHECK = """
const dec = (b) => new TextDecoder().decode(Uint8Array.from(atob(b), (c) => c.charCodeAt(0)));
const me = document.getElementById("check");
const want = JSON.parse(dec(me.dataset.want));
const node = document.getElementById("data");
const same = (a) => Array.isArray(a) && a.length === want.length && a.every((s, i) => s === want[i]);
const out = { scripts: document.scripts.length, text_intact: node.textContent === dec(me.dataset.text) };
let got = null;
try { got = JSON.parse(node.textContent); out.parsed = true; } catch (e) { out.parsed = String(e); }
out.data_equal = same(got);
out.code_equal = same(window.fromCode);
out.first_difference = got && got.findIndex((s, i) => s !== want[i]);
window.addEventListener("load", () => {
  out.sentinel = document.getElementById("sentinel") !== null;
  document.documentElement.dataset.result = JSON.stringify(out);
});
"""


def test_any_string_survives_the_escaping_into_a_page(tmp_path: Path) -> None:
    """Every string of :func:`hostile_strings`, embedded in one page as JSON data (script_json) and
    as a script's literal (script_code), parses in Chromium to the same list; the data element
    holds exactly the text written (no element ended early) and the page goes on after it."""
    need_browser()
    strings = hostile_strings()
    data = script_json(strings)
    assert json.loads(data) == strings
    assert not re.search("[<>&\u2028\u2029]", data)
    code = script_code("window.fromCode = " + json.dumps(strings, ensure_ascii=False) + ";")
    assert "</script" not in code.lower() and "<!--" not in code
    b64 = lambda s: base64.b64encode(s.encode()).decode()  # noqa: E731
    page = tmp_path / "strings.html"
    page.write_text(
        '<!DOCTYPE html><html><head><meta charset="utf-8"></head><body>\n'
        f'<script type="application/json" id="data">{data}</script>\n<script>{code}</script>\n'
        f'<script id="check" data-want="{b64(json.dumps(strings))}" data-text="{b64(data)}">{CHECK}</script>\n'
        '<p id="sentinel">after the scripts</p></body></html>',
        encoding="utf-8",
    )
    dom = _open(page, tmp_path / "profile")
    m = re.search(r'data-result="([^"]*)"', dom)
    assert m is not None, "the check did not run"
    result = json.loads(html.unescape(m.group(1)))
    assert result == {"scripts": 3, "text_intact": True, "parsed": True, "data_equal": True, "code_equal": True,
                      "first_difference": -1, "sentinel": True}, result


# ------------------------------------------------------------------------- data that cannot be read
def _break_data(page: str, element: str) -> str:
    """``page`` with the JSON in ``<script ... id="element">`` replaced by text that is not JSON."""
    new, n = re.subn(rf'(<script type="application/json" id="{element}">).*?(</script>)', r'\1{"broken\2', page,
                     count=1, flags=re.S)
    assert n == 1, element
    return new


@pytest.mark.parametrize("which", ["report", "dynamics", "tour", "architectures"])
def test_a_page_whose_data_cannot_be_read_says_so_in_every_section(
    which: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    need_browser()
    index, element, sections = {
        "report": lambda: (request.getfixturevalue("report")[0], "qkov-data", REPORT_SECTIONS),
        "dynamics": lambda: (request.getfixturevalue("dynamics_page")[0], "qkov-dynamics", DYNAMICS_SECTIONS),
        "tour": lambda: (request.getfixturevalue("tour_file"), "qkov-tour", TOUR_SECTIONS),
        "architectures": lambda: (request.getfixturevalue("architectures_file"), "qkov-architectures", ARCH_SECTIONS),
    }[which]()
    broken = tmp_path / "broken.html"
    broken.write_text(_break_data(index.read_text(), element))
    dom = _open(broken, tmp_path / "profile")
    assert 'data-ready="1"' in dom and "data-errors=" in dom
    for s in sections:
        m = re.search(rf'<section[^>]*data-section="{s}" data-rendered="error"[^>]*>(.*?)</section>', dom, re.S)
        assert m is not None, f"section {s} is not marked as failed"
        assert re.search(r'<p class="error">[^<]*could not read the page\'s data', m.group(1)), (s, m.group(1)[:300])


def test_a_notebook_display_whose_data_cannot_be_read_says_so(report: tuple[Path, Any], tmp_path: Path) -> None:
    need_browser()
    from qkov.show import page

    page.reset()
    shown = qkov.show.attention(qkov.load(report[1].path), "some text", 1, 0)._repr_html_()
    uid = re.search(r'id="(qkov-[0-9a-f]{12})-data"', shown).group(1)  # type: ignore[union-attr]
    path = tmp_path / "display.html"
    path.write_text("<!DOCTYPE html><html><body>" + _break_data(shown, uid + "-data") + "</body></html>")
    dom = _open(path, tmp_path / "profile")
    root = re.search(rf'<div class="qkov-nb" id="{uid}"([^>]*)>(.*?)</div>', dom, re.S)
    assert root is not None and 'data-rendered="error"' in root.group(1)
    assert "could not read the page's data" in root.group(2)


# ------------------------------------------------------------------------- layout
@pytest.mark.parametrize("width", [1400, 900])
@pytest.mark.parametrize("which", ["report", "dynamics", "tour", "notebook", "architectures"])
def test_no_text_overlaps_and_nothing_scrolls_sideways(
    which: str, width: int, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """At 1400 and 900 px every page draws, no two text boxes (or charts) overlap, and the page
    is no wider than the window."""
    need_browser()
    index = {
        "report": lambda: request.getfixturevalue("report")[0],
        "dynamics": lambda: request.getfixturevalue("dynamics_page")[0],
        "tour": lambda: request.getfixturevalue("tour_file"),
        "notebook": lambda: request.getfixturevalue("notebook_file"),
        "architectures": lambda: request.getfixturevalue("architectures_file"),
    }[which]()
    probed = tmp_path / "probed.html"
    probed.write_text(index.read_text().replace("</body>", LAYOUT_PROBE + "</body>"))
    dom = _open(probed, tmp_path / "profile", at_width(width))
    if which == "notebook":
        roots = re.findall(r'<div class="qkov-nb" id="qkov-[0-9a-f]{12}"([^>]*)>', dom)
        assert len(roots) >= 10 and all('data-rendered="ok"' in r for r in roots), roots
    else:
        sections = {"report": REPORT_SECTIONS, "dynamics": DYNAMICS_SECTIONS, "tour": TOUR_SECTIONS}
        _rendered(dom, {**sections, "architectures": ARCH_SECTIONS}[which])
    got = layout(dom)
    assert got["width"] == width and got["boxes"] > (40 if which == "architectures" else 100), got
    assert got["n_overlaps"] == 0, f"{got['n_overlaps']} overlapping pairs, the first: " + "\n".join(
        f"{a}  x  {b}" for a, b in got["overlaps"]
    )
    assert got["scroll_width"] <= width, f"the page is {got['scroll_width']} px wide in a {width} px window"
