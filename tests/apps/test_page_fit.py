"""The report and the explorer on a model shaped like a real one, in headless Chromium at 1400 and 900 px:
what they show fits and reads as text.

The model is a Llama-family Hugging Face directory (rotary, grouped-query attention, 5 layers of 8 heads:
32 x 32 composition heatmaps whose Q and K titles carry the rotary offsets) with a SentencePiece-style
tokenizer with byte fallback, read with a text holding characters that only byte tokens spell. At both widths:
no chart title is cut off and no heading runs past its box, no table reaches past its card, the heads table
shows its roles column without scrolling (every head given three roles), heatmap cells print their values only
where they fit; the texts on the pages are the text itself (spaces kept, byte tokens joined into their
characters); the explorer's composition graph is drawn as soon as Compute ends, with the strongest edges above
their random baselines (not a hairball), and its heads table says which tokens it was measured on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import qkov
from browser import FIT_CHECK, need_browser
from tokenizers_like import STORY, llama_tokenizer, write_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("starlette")
pytest.importorskip("websocket")

from cdp import Chrome  # noqa: E402  (needs websocket-client)
from test_explore_browser import drawn  # noqa: E402

WIDTHS = [1400, 900]
LAYERS, HEADS = 5, 8
OPENING = "Ça va? “Lily” said 日本語, and Tim\tlaughed.\n"  # Ç, the quotes and 日本語: byte tokens
ROLES = ["previous-token", "induction", "memory-management"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The Hugging Face directory (a 512-token Llama tokenizer that adds ``<s>`` itself) and the text file."""
    need_browser()  # before the work: every test here opens a page
    folder = tmp_path_factory.mktemp("fit")
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=4,
        head_dim=8, intermediate_size=96, max_position_embeddings=64, tie_word_embeddings=True,
        initializer_range=0.15, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(folder / "llama")
    write_tokenizer(folder / "llama", llama_tokenizer(512))
    text = folder / "story.txt"
    text.write_text(OPENING + STORY * 3, encoding="utf-8")
    return folder / "llama", text


@pytest.fixture(scope="module")
def report_page(llama: tuple[Path, Path]) -> Path:
    """The report of the model on the text, drawn again with three roles on every head (the longest rows)."""
    from qkov.apps.report import Report, render_html, write_report

    path, text = llama
    out = path.parent / "report"
    report = write_report(path, out, text=text, batch=2, icl_examples=4, diag_k=0, viewer_tokens=64).to_dict()
    for row in report["heads"]["rows"]:
        row["roles"] = list(ROLES)
    (out / "roles.html").write_text(render_html(Report.from_dict(report)), encoding="utf-8")
    return out / "roles.html"


@pytest.fixture(scope="module")
def explorer(llama: tuple[Path, Path]) -> Any:
    from qkov.apps.explore.server import make_app, start_background
    from qkov.apps.explore.session import open_explorer

    path, text = llama
    bg = start_background(make_app(open_explorer(path, cache_dir=None, text=text)))
    try:
        yield bg
    finally:
        bg.stop()


def fits(page: Chrome) -> dict[str, Any]:
    """The page's :data:`~browser.FIT_CHECK`, asserted: nothing clipped, past its card or scrolled."""
    got = page.eval(FIT_CHECK)
    assert got["clipped"] == [], f"cut off: {got['clipped']}"
    assert got["past"] == [], f"tables past their card (px): {got['past']}"
    assert got["scrolled"] == [], f"tables that show all their columns only when scrolled (px): {got['scrolled']}"
    assert got["cells"] == [], f"heatmap cell texts bigger than their cells [text, w, h, cell w, cell h]: {got['cells']}"
    return got


def spans_text(page: Chrome, selector: str) -> str:
    """The text of a running-text display's token spans, newline marks dropped."""
    parts = page.eval(f"[...document.querySelectorAll({json.dumps(selector)})].map((s) => s.textContent)")
    return "".join(parts).replace("↵", "")


@pytest.mark.parametrize("width", WIDTHS)
def test_the_report_fits_and_its_text_reads_as_text(report_page: Path, llama: tuple[Path, Path], width: int) -> None:
    need_browser()
    with Chrome(width=width) as page:
        page.open(report_page.as_uri(), ready="document.documentElement.dataset.ready === '1'")
        assert not page.eval("document.documentElement.dataset.errors"), page.eval("document.documentElement.dataset.errors")
        got = fits(page)
        assert got["heatmaps"] >= 3 and got["tables"] > 10, got
        titles = page.eval("[...document.querySelectorAll('#composition h3.heatmap-title')].map((h) => h.textContent)")
        assert titles == ["Q-composition", "K-composition", "V-composition"]
        roles = page.eval("[...document.querySelectorAll('#heads td .role')].length")
        assert roles == 3 * LAYERS * HEADS  # every role of every head is on the page, inside the card (fits)
        # a rotary model's positional score does not apply: n/a in every row, and the reason on the page
        pos = page.eval(
            "(() => { const t = document.querySelector('#heads table'); const i = [...t.rows[0].cells]"
            ".findIndex((c) => c.textContent === 'pos'); return [...t.rows].slice(1).map((r) => r.cells[i].textContent); })()"
        )
        assert pos == ["n/a"] * (LAYERS * HEADS), pos[:4]
        assert "positional score (pos) left out: not applicable" in page.eval("document.querySelector('#heads').textContent")
        # the viewer is the text itself: the start token, then the file's opening (a SentencePiece space first)
        shown = spans_text(page, "#viewer-text span")
        story = llama[1].read_text(encoding="utf-8")
        assert shown.startswith("<s> ") and len(shown) > 100 and "日本語" in shown and "<0x" not in shown
        assert story.startswith(shown[len("<s> ") :])
        assert page.problems() == []


@pytest.mark.parametrize("width", WIDTHS)
def test_the_explorer_graph_is_drawn_after_compute_with_the_strongest_edges(
    explorer: Any, llama: tuple[Path, Path], width: int
) -> None:
    need_browser()
    model = qkov.load_any(llama[0])
    scores = qkov.composition_scores(qkov.Weights.from_model(model), "qkv")
    edges = {}  # (src, dst, kind) -> raw score, for the kinds' scores above their baseline mean
    for kind in "qkv":
        c = scores.kinds[kind]
        for l1 in range(LAYERS):
            for l2 in range(l1 + 1, LAYERS):
                for h1 in range(HEADS):
                    for h2 in range(HEADS):
                        edges[f"{l1}.{h1}", f"{l2}.{h2}", kind] = (float(c.raw[l1, h1, l2, h2]), c.baseline.mean)
    above = sorted((k for k, (v, base) in edges.items() if v >= base), key=lambda k: -edges[k][0])
    strongest = set(above[:24])
    assert len(above) > 100, "too few edges above the baselines: the test cannot tell a hairball"
    with Chrome(width=width) as page:
        page.open(explorer.url, ready="document.documentElement.dataset.ready === '1'")
        drawn(page, "heads", timeout=180)  # first: the table it draws moves the button clicked next
        page.click("#composition-run")
        drawn(page, "composition", timeout=120)
        lines = page.eval("[...document.querySelectorAll('#composition svg line')].map((e) => "
                          "[e.dataset.src, e.dataset.dst, e.dataset.kind])")  # fmt: skip
        nodes = page.eval("document.querySelectorAll('#composition svg g.node').length")
        assert nodes == LAYERS * HEADS and {tuple(x) for x in lines} == strongest and len(lines) == 24
        shown = page.eval("document.querySelector('#composition .graph-shown').textContent")
        assert shown.startswith(f"showing 24 of {len(edges)} edges") and f"{len(above)} are above" in shown, shown
        svg, card = page.eval("[document.querySelector('#composition svg').getBoundingClientRect().right, "
                              "document.querySelector('#composition').getBoundingClientRect().right]")  # fmt: skip
        assert svg <= card, "the graph runs past its card"
        assert page.problems() == []


@pytest.mark.parametrize("width", WIDTHS)
def test_the_explorer_heads_table_fits_and_names_its_text(explorer: Any, llama: tuple[Path, Path], width: int) -> None:
    need_browser()
    with Chrome(width=width) as page:
        page.open(explorer.url, ready="document.documentElement.dataset.ready === '1'")
        drawn(page, "heads", timeout=180)
        notes = page.eval("[...document.querySelectorAll('#heads .out p.note')].map((p) => p.textContent).join(' ')")
        assert f"(text from {llama[1]}: " in notes, notes[:400]
        assert "seeded random tokens" not in notes and "validation text" not in notes, notes[:400]
        assert "positional score (pos) left out: not applicable" in notes
        # a text typed in reads back as itself, byte tokens joined into the characters they spell
        page.type_into("#text-input", OPENING.strip())
        page.click("#text-run")
        drawn(page, "text")
        assert spans_text(page, "#text .loss-text span") == "<s> " + OPENING.strip()
        drawn(page, "attention")
        got = fits(page)
        assert got["tables"] >= 2, got
        assert page.problems() == []
