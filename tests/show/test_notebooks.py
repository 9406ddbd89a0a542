"""Notebooks: the results' rich and text displays show the objects' own numbers, the inline
attention viewer, and the example notebooks executed (nbclient, ipykernel) and exported to an
offline page that a real browser draws without a network."""

from __future__ import annotations

import html
import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import ROOT
import qkov
from qkov import QkovError, Weights
from qkov.analysis import circuits as C
from qkov.analysis.circuits import trigrams as T
from qkov.analysis.circuits.composition import composition_scores
from qkov.analysis.heads.report import head_report
from qkov.analysis.paths.summary import summarize
from qkov.io.checkpoint import save_checkpoint
from qkov.show import page

from browser import CHROMIUM, RESOURCES_PROBE, chromium, console_lines, need_browser, requested
from reference import reference_forward
from hand_built import CTX, V, hand_built

ROOT = ROOT
NOTEBOOKS = sorted((ROOT / "examples").glob("*.ipynb"))
# a display's data (attributes in any order: an HTML export may reorder them)
SPEC = re.compile(r'<script[^>]*\bid="(qkov-[0-9a-f]{12})-data"[^>]*>(.*?)</script>', re.S)


def specs(html: str) -> list[dict[str, Any]]:
    """The data of every display in ``html`` (what the report's renderers draw)."""
    return [json.loads(m.group(2).replace("<\\!--", "<!--")) for m in SPEC.finditer(html)]


def the_spec(obj: Any) -> dict[str, Any]:
    (spec,) = specs(obj._repr_html_())
    return spec


def text_row(text: str, first: str) -> dict[str, str]:
    """The row of a text table whose first cell is ``first``, keyed by the header (multi-word
    headers are not split: this reads the tables whose headers are single words)."""
    lines = text.splitlines()
    header_at = next(i for i, line in enumerate(lines) if line.split()[:1] in (["head"], ["writer"], ["#"], ["term"]))
    header = lines[header_at].split()
    for line in lines[header_at + 1 :]:
        cells = line.split()
        if cells and cells[0] == first:
            return dict(zip(header, cells))
    raise AssertionError(f"no row {first!r} in\n{text}")


@pytest.fixture(scope="module")
def hand() -> tuple[qkov.Transformer, Weights, torch.Tensor]:
    model = hand_built()
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(1, V, (4, CTX), generator=g)
    toks[:, 0] = 0
    return model, Weights.from_model(model), toks


# ------------------------------------------------------------------ rich and text displays
def test_head_report_shows_its_scores_and_roles(hand: tuple) -> None:
    _, w, toks = hand
    rep = head_report(w, toks, bos=0, diag_k=None)
    spec = the_spec(rep)
    assert spec["section"] == "heads"
    rows = {r["head"]: r for r in spec["data"]["heads"]["rows"]}
    for l in range(2):
        for h in range(2):
            row = rows[f"{l}.{h}"]
            assert row["roles"] == rep.roles[l][h]
            for name, score in rep.scores.items():
                assert row[name] == pytest.approx(float(score[l, h]), rel=1e-3, abs=1e-6), name
    text = repr(rep)
    assert "induction" in text_row(text, "1.0")["roles"] and "previous-token" in text_row(text, "0.0")["roles"]
    assert text_row(text, "0.1")["eig"] == f"{float(rep.scores['eigen_copying'][0, 1]):.2f}"
    assert text_row(text, "1.0")["prefix"] == f"{float(rep.scores['prefix_matching'][1, 0]):.2f}"


def test_composition_shows_heatmap_cells_and_strongest_pairs(hand: tuple) -> None:
    _, w, _ = hand
    scores = composition_scores(w, "qk")
    spec = the_spec(scores)
    assert set(spec["data"]["composition"]) == {"q", "k"}
    k = scores.k
    cells = spec["data"]["composition"]["k"]
    assert cells["writers"] == ["0.0", "0.1"] and cells["readers"] == ["1.0", "1.1"]
    for i in range(2):
        for j in range(2):
            raw = float(k.raw[0, i, 1, j])  # NaN where a head writes nothing (the sink): null in the JSON
            assert cells["raw"][i][j] == (None if math.isnan(raw) else pytest.approx(raw, rel=1e-3))
    best = k.pairs()[0]
    assert (cells["top"][0]["writer"], cells["top"][0]["reader"]) == (best["writer"], best["reader"]) == ("0.0", "1.0")
    row = text_row(repr(k), "0.0")  # the first pair listed is the strongest
    assert (row["reader"], row["adjusted"], row["raw"]) == ("1.0", f"{best['adjusted']:.3f}", f"{best['raw']:.3f}")
    assert the_spec(k)["data"]["composition"]["k"] == cells


def test_copying_scores_display(hand: tuple) -> None:
    _, w, _ = hand
    scores = C.copying_scores(w, diag_k=3)
    assert scores.k == 3 and len(scores.heads) == 4 and list(scores) == scores.heads  # len/iteration: kept
    assert scores.to_dict() == {"k": 3, "heads": [c.to_dict() for c in scores.heads]}
    heads = the_spec(scores)["data"]["copying"]["heads"]
    assert [h["head"] for h in heads] == ["0.0", "0.1", "1.0", "1.1"]
    for h, c in zip(heads, scores.heads):
        assert h["eigen_score"] == pytest.approx(c.eigen_score) and h["diag_topk_rate"] == pytest.approx(
            c.diag_topk_rate
        )
    lines = repr(scores).splitlines()
    assert "own in top 3" in lines[1]
    last = lines[-1].split()  # layer 1 head 1
    assert (
        last[:3] == ["1", "1", f"{scores.heads[3].eigen_score:.3f}"]
        and last[-1] == f"{scores.heads[3].residual_eigen_score:.3f}"
    )


def test_topk_and_trigrams_show_token_strings(hand: tuple) -> None:
    _, w, _ = hand
    decode = lambda i: f"t{i}"  # noqa: E731
    top = C.full_ov(w, 1, 0).topk(5).with_tokens(decode)
    entries = the_spec(top)["data"]["topk"]["entries"]
    assert [e["value"] for e in entries] == pytest.approx(top.values.tolist())
    assert [(e["row"], e["row_str"], e["col_str"]) for e in entries] == [
        (r, f"t{r}", f"t{c}") for r, c in zip(top.rows.tolist(), top.cols.tolist())
    ]
    r, c = int(top.rows[0]), int(top.cols[0])
    assert repr(top).splitlines()[2].split() == [
        "0",
        str(r),
        f"'t{r}'",
        str(c),
        f"'t{c}'",
        f"{float(top.values[0]):.4f}",
    ]
    tri = T.skip_trigrams(w, 0, 0, top=4).with_tokens(decode)
    assert tri.head == "0.0"
    (head,) = the_spec(tri)["data"]["trigrams"]["heads"]
    for r, t in zip(head["rows"], tri):
        assert (r["source_str"], r["output_str"]) == (f"t{t.source}", f"t{t.output}")
        assert r["score"] == pytest.approx(t.score, rel=1e-3)
    bi = T.bigrams(w, top=3)
    assert [b["logit"] for b in the_spec(bi)["data"]["trigrams"]["bigrams"]] == pytest.approx(
        [b.logit for b in bi], rel=1e-3
    )


def test_paths_and_probe_displays(hand: tuple) -> None:
    _, w, toks = hand
    summary = summarize(w, toks[:2])
    data = the_spec(summary)["data"]["paths"]
    assert data == json.loads(json.dumps(summary.to_dict()))
    text = repr(summary)
    assert f"{summary.reconstruction_error:.2e}" in text and f"{summary.importance.full_loss:.3f}" in text
    assert text_row(text, summary.singles[0].name)["loss_change"] == f"{summary.singles[0].loss_change:.4f}"
    probe = qkov.induction_probe(w, bos=0, length=20)
    p = the_spec(probe)["data"]["probe"]
    assert sum(p["scores"], []) == pytest.approx(probe.induction_attention.flatten().tolist()) and p["best_head"] == "1.0"
    assert p["repeat"]["first_mean"] == pytest.approx(probe.loss_by_copy[0])
    assert p["repeat"]["second_mean"] == pytest.approx(probe.loss_by_copy[1])
    assert "best induction head 1.0" in repr(probe)
    assert f"{float(probe.induction_attention[1, 0]):.3f}" in repr(probe).splitlines()[-1]


def test_patching_and_composition_path_displays(hand: tuple) -> None:
    """A patch study, one result and the composition paths show their own numbers (the report's
    patching and causal renderers draw them)."""
    from qkov.analysis.causal.composition import composition_paths

    _, w, toks = hand
    clean = qkov.induction_probe_tokens(V, length=10, repeats=2, batch=2, seed=1, bos=0)
    corrupted = qkov.induction_probe_tokens(V, length=20, repeats=1, batch=2, seed=2, bos=0)
    study = qkov.patch_study(w, clean, corrupted, receivers=[(1, 0)])
    spec = the_spec(study)
    assert spec["section"] == "patching" and spec["data"]["patching"] == json.loads(json.dumps(study.to_dict()))
    one = study.results[1]
    assert sum(the_spec(one)["data"]["patching"]["results"][0]["values"], []) == pytest.approx(one.values.flatten().tolist())
    assert "activation patching of head_out by layer x head" in repr(study) and "agreement" in repr(study)
    paths = composition_paths(w, (0, 0), (1, 0), text=toks)
    data = the_spec(paths)["data"]["causal"]
    assert data["prefix_removed"] == pytest.approx(paths.prefix_removed) and data["writer"] == "0.0"
    assert f"{paths.prefix_removed['k']:+.0%}" in repr(paths)


def test_results_with_axes_of_any_kind_draw_in_a_browser(tmp_path: Path) -> None:
    """The patching renderer draws a result by its own axes: one axis (edges, one row), two axes whose
    first is not the layer, three axes (rows "a · b"); every display draws, with its labels."""
    need_browser()
    from qkov.analysis.causal import PatchResult

    edges = ["0.0 -> 1.0<k>", "0.1 -> 1.0<k>", "0.1 -> 1.1<q>"]
    results = [
        PatchResult("edge", "edges", ("edge",), torch.tensor([0.5, 2.0, 1.25]), 2.0, 0.0, "denoise", "m", {"edge": edges}),
        PatchResult("steps", "z", ("step", "head"), torch.arange(6.0).reshape(3, 2), 5.0, 0.0, "noise", "m"),
        PatchResult("act", "z", ("head", "step", "pos"), torch.arange(12.0).reshape(2, 3, 2), 5.0, 0.0, "denoise", "m",
                    {"head": ["h0", "h1"]}),
    ]  # fmt: skip
    page.reset()
    out = tmp_path / "axes.html"
    body = "".join(r._repr_html_() for r in results)
    out.write_text(f'<!DOCTYPE html><html><head><meta charset="utf-8"></head><body>{body}</body></html>')
    res = chromium(out.as_uri(), tmp_path / "profile", "--dump-dom")
    assert res.returncode == 0 and not console_lines(res), "\n".join(console_lines(res)) or res.stderr[-2000:]
    roots = re.findall(r'<div class="qkov-nb" id="(qkov-[0-9a-f]{12})"([^>]*)>', res.stdout)
    assert len(roots) == 3 and all('data-rendered="ok"' in attrs for _, attrs in roots), roots
    assert len(re.findall(r'<g class="hm"[^>]*><image', res.stdout)) == 3  # a heatmap each
    rows = [html.unescape(t) for t in re.findall(r'class="ytick"><text[^>]*>([^<]*)<', res.stdout)]
    assert rows[:1] == ["edge"] and {"0", "1", "2"} <= set(rows) and "h1 · 2" in rows  # first axis (and second) as rows
    dom = html.unescape(res.stdout)
    for label in [*edges, "edge patching of edges by edge", "steps patching of z by step × head"]:
        assert label in dom, label


def test_text_reprs_fit_one_screen_and_say_what_was_left_out() -> None:
    model = qkov.Transformer(qkov.ModelConfig(n_layers=3, n_heads=6, d_model=48, d_head=8, d_vocab=50, n_ctx=16))
    w = Weights.from_model(model)
    comp = composition_scores(w, "k").k
    assert len(comp.pairs()) == 3 * 36
    text = repr(comp)
    assert text.endswith(f"... {3 * 36 - 12} more") and len(text.splitlines()) == 1 + 1 + 12 + 1
    assert all(len(line) <= 120 for line in text.splitlines())
    cop = C.copying_scores(w, diag_k=None)
    assert repr(cop).endswith("... 6 more") and len(repr(cop).splitlines()) == 15
    assert repr(cop).splitlines()[-2].split()[:2] == ["1", "5"]  # the 12th head listed is 1.5


def test_assets_once_per_session_unique_ids_and_scoped_style(hand: tuple) -> None:
    model, w, toks = hand
    page.reset()
    first, second = qkov.show.attention(w, toks[0]), qkov.show.attention(w, toks[1], 1, 1)
    a, b = first._repr_html_(), second._repr_html_()
    assert a.count('data-qkov="plotly"') == 1 and 'data-qkov="report"' in a
    assert "data-qkov" not in b
    assert 'data-qkov="plotly"' in qkov.show.init()._repr_html_()
    ids = SPEC.findall(a + b + first._repr_html_())
    assert len({i for i, _ in ids}) == 3
    assert not re.search(r"<script[^>]+src=", a), "scripts must be inline"
    css = re.search(r'<style data-qkov="css">(.*?)</style>', a, re.S).group(1)  # type: ignore[union-attr]
    selectors = [s.strip() for rule in re.findall(r"([^{}]+)\{", css) for s in rule.split(",")]
    rules = [s for s in selectors if not s.startswith("@media")]  # a media query wraps rules, checked here too
    assert rules and all(s.startswith(".qkov-nb") for s in rules), rules


def test_attention_viewer_patterns_are_the_forward_pass(hand: tuple, tmp_path: Path) -> None:
    model, w, toks = hand
    ids = toks[0, :30]
    pat = reference_forward(w, ids[None])[1][:, 0]  # [L, H, T, T]
    view = qkov.show.attention(w, ids, layer=1, head=0, query=20)
    assert view.tokens[:2] == ["<0>", f"<{int(ids[1])}>"]
    data = the_spec(view)
    assert data["opts"]["hash"] == "#attend=1.0.20" and data["data"]["attention"]["ids"] == ids.tolist()
    rows = data["data"]["attention"]["patterns"]
    for l, h, q in ((0, 0, 5), (1, 0, 20), (1, 1, 29)):
        assert rows[l][h][q] == pytest.approx(pat[l, h, q, : q + 1].tolist(), abs=6e-4)
        assert view.argmax(l, h, q) == int(pat[l, h, q, : q + 1].argmax())
    k = view.argmax(1, 0, 20)
    assert f"token 20 {view.tokens[20]!r} attends most to token {k} " in repr(view)
    # the induction head on a repeated sequence attends to the token after the earlier copy
    rep = torch.cat([torch.tensor([0]), ids[1:11], ids[1:11]])
    assert qkov.show.attention(w, rep).argmax(1, 0, 15) == 6
    # a checkpoint path and the model give the same view
    save_checkpoint(model, tmp_path / "hand")
    by_path = qkov.show.attention(tmp_path / "hand", ids, 1, 0)
    assert torch.allclose(by_path.patterns, qkov.show.attention(model, ids, 1, 0).patterns)
    with pytest.raises(QkovError, match="tokenizer"):
        qkov.show.attention(w, "some text")
    with pytest.raises(QkovError, match="no head 2.0"):
        qkov.show.attention(w, ids, layer=2)


# ------------------------------------------------------------------ example notebooks
def test_committed_notebooks_have_no_outputs() -> None:
    import nbformat

    assert {p.name for p in NOTEBOOKS} >= {"paper_walkthrough.ipynb", "imported_model.ipynb"}
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: strip the outputs"


_EXECUTED: dict[str, Any] = {}


def executed(name: str, corpus: Path, work: Path) -> Any:
    """The example notebook ``name`` run top to bottom on small settings (once per session)."""
    if name not in _EXECUTED:
        nbformat = pytest.importorskip("nbformat")
        nbclient = pytest.importorskip("nbclient")
        nb = nbformat.read(ROOT / "examples" / name, as_version=4)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
            "QKOV_CACHE": str(work / "cache"),
            "QKOV_EXAMPLE_STEPS": "20",
            "QKOV_EXAMPLE_MODEL": "train",  # not a model the tour may have left in runs/
            "QKOV_EXAMPLE_CORPUS": str(corpus),
            "QKOV_EXAMPLE_CONFIG": json.dumps({"n_heads": 2, "d_model": 32, "d_vocab": 300, "n_ctx": 64}),
        }
        t0 = time.perf_counter()
        client = nbclient.NotebookClient(
            nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(work)}}
        )
        client.execute(env=env)
        _EXECUTED[name] = nb, time.perf_counter() - t0
    return _EXECUTED[name][0]


def html_outputs(nb: Any) -> str:
    return "".join(
        o["data"]["text/html"]
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if "data" in o and "text/html" in o["data"]
    )


@pytest.mark.parametrize("name", [p.name for p in NOTEBOOKS])
def test_example_notebook_runs(name: str, small_corpus: Path, tmp_path: Path) -> None:
    nb = executed(name, small_corpus, tmp_path)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code)
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    shown = html_outputs(nb)
    assert shown.count('data-qkov="plotly"') == 1 and shown.count('data-qkov="report"') == 1  # once per notebook
    sections = [s["section"] for s in specs(shown)]
    assert "attention" in sections and "composition" in sections and "copying" in sections
    if name == "paper_walkthrough.ipynb":
        assert {"heads", "paths", "probe", "trigrams", "topk"} <= set(sections)
        assert "embedding + sum of head outputs gives the logits: True" in "".join(
            o.get("text", "") for c in code for o in c.outputs
        )
    print(f"{name}: executed in {_EXECUTED[name][1]:.1f} s")


def test_resource_probe_sees_requests(tmp_path: Path) -> None:
    """The probe the next test relies on does report a request (a page that makes one)."""
    need_browser()
    page_ = tmp_path / "requests.html"
    page_.write_text(
        f'<!DOCTYPE html><html><body><img src="http://example.invalid/x.png">{RESOURCES_PROBE}</body></html>'
    )
    res = chromium(page_.as_uri(), tmp_path / "profile", "--dump-dom")
    assert requested(res.stdout) == ["http://example.invalid/x.png"]


def test_exported_notebook_renders_offline(small_corpus: Path, tmp_path: Path) -> None:
    """The walkthrough, executed and exported to HTML: every display draws, the page requests
    nothing, and hovering token 7 of each viewer names the key that token attends to most."""
    need_browser()
    nbconvert = pytest.importorskip("nbconvert")
    nb = executed("paper_walkthrough.ipynb", small_corpus, tmp_path)
    exporter = nbconvert.HTMLExporter(template_file=str(ROOT / "examples" / "offline.html.j2"))
    body, _ = exporter.from_notebook_node(nb)
    assert CHROMIUM is not None and not re.search(r"<script[^>]+src=", body)
    hover = (
        "<script>window.addEventListener('load', () => document.querySelectorAll('.viewer-text').forEach("
        "(box) => box.querySelector('span[data-pos=\"7\"]').dispatchEvent(new MouseEvent('mouseenter'))));</script>"
    )
    out = tmp_path / "walkthrough.html"
    out.write_text(body.replace("</body>", hover + RESOURCES_PROBE + "</body>"))
    res = chromium(out.as_uri(), tmp_path / "profile", "--dump-dom")
    assert res.returncode == 0, res.stderr[-2000:]
    assert not console_lines(res), "console output from the page:\n" + "\n".join(console_lines(res))
    dom = res.stdout
    assert requested(dom) == []
    roots = re.findall(r'<div class="qkov-nb" id="(qkov-[0-9a-f]{12})"([^>]*)>', dom)
    assert len(roots) >= 10 and len({r for r, _ in roots}) == len(roots)
    assert all('data-rendered="ok"' in attrs for _, attrs in roots), roots
    assert '<p class="error"' not in dom
    viewers = [
        (uid, s)
        for uid, s in ((m.group(1), json.loads(m.group(2))) for m in SPEC.finditer(body))
        if s["section"] == "attention"
    ]
    assert len(viewers) == 2
    for uid, spec in viewers:
        l, h, _ = map(int, spec["opts"]["hash"].removeprefix("#attend=").split("."))
        row = spec["data"]["attention"]["patterns"][l][h][7]
        best = max(range(len(row)), key=lambda i: row[i])
        status = re.search(rf'id="{uid}-status"[^>]*>([^<]*)<', dom)
        assert status is not None and f"head {l}.{h}, token 7 " in status.group(1)
        assert f"attends most to token {best} " in status.group(1)
