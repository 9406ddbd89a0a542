"""``qkov explore``'s page in a real headless Chromium (tests/cdp.py), against a real server on
127.0.0.1 over a tiny model built here, whose word-level tokenizer holds tokens that are HTML:
``</script>`` and ``<img src=x onerror="window.__pwned=1">``.

Every number the page shows is checked against something computed here without the explorer: the
training model's own forward pass (loss, and each head's attention pattern recomputed from its
queries and keys), the dense full OV circuit of the folded weights (eigenvalues, largest entry),
and the model with a head's W_O zeroed (ablation) as well as qkov's ablation edits. One browser and
one server serve the whole module; the page is driven with real mouse moves and typing.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

import qkov
from browser import need_browser
from helpers import own_patterns
from qkov.analysis.causal.ablation import ablation_edits, sequence_losses
from qkov.model.tokens import left_out_tokens
from qkov.io.checkpoint import save_checkpoint

pytest.importorskip("starlette")
pytest.importorskip("websocket")

from cdp import Chrome  # noqa: E402  (needs websocket-client)

SCRIPT_TOKEN = "</script>"
IMG_TOKEN = '<img src=x onerror="window.__pwned=1">'
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "to", "red", "big", "and", "it", "was", "then"]
# tokens are split at "|", so a token may hold spaces (the <img> one does)
TEXT = "|".join(
    [
        "the",
        "cat",
        "sat",
        "on",
        "the",
        "mat",
        SCRIPT_TOKEN,
        "and",
        "the",
        "cat",
        "sat",
        "on",
        IMG_TOKEN,
        "the",
        "big",
        "red",
        "dog",
        "ran",
        "to",
        "the",
        "cat",
    ]
)


def _tokenizer() -> tuple[Tokenizer, int]:
    vocab = {"<bos>": 0, "<unk>": 1}
    for w in [*WORDS, SCRIPT_TOKEN, IMG_TOKEN]:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("|", behavior="removed")
    return tok, len(vocab)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, qkov.Transformer, Tokenizer]:
    tok, V = _tokenizer()
    cfg = qkov.ModelConfig(n_layers=2, n_heads=2, d_model=32, d_head=16, d_vocab=V, n_ctx=32)
    model = qkov.Transformer(cfg, seed=3).eval()
    with torch.no_grad():  # sharper patterns than the initialisation's: argmax keys stand out
        for b in model.blocks:
            b.attn.W_Q.mul_(6.0)
    model.bos_token_id = 0
    path = tmp_path_factory.mktemp("explore") / "tiny-html-tokens"
    save_checkpoint(model, path, tokenizer_json=tok.to_str())
    return path, model, tok


SLOW = threading.Event()  # set: the composition view first ticks slowly (for the Cancel test)


def slowed(view: Any) -> Any:
    def run(ex: Any, args: dict, progress: Any) -> dict:
        for i in range(200 if SLOW.is_set() else 0):
            progress("waiting", i, 200)  # raises Cancelled once the page cancels the job
            time.sleep(0.05)
        return view(ex, args, progress)

    return run


SLOW_TABLES = threading.Event()  # set: a card with its tables (the page's second step) first ticks slowly


def slowed_tables(view: Any) -> Any:
    def run(ex: Any, args: dict, progress: Any) -> dict:
        for i in range(400):
            if args.get("tables") is False or not SLOW_TABLES.is_set():
                break
            progress("waiting", i, 400)  # raises Cancelled once the page cancels the job
            time.sleep(0.05)
        return view(ex, args, progress)

    return run


@pytest.fixture(scope="module")
def server(built: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from qkov.apps.explore.server import make_app, start_background
    from qkov.apps.explore.session import open_explorer
    from qkov.apps.explore.views import VIEWS

    ex = open_explorer(built[0], cache_dir=tmp_path_factory.mktemp("explore-cache"))
    views = {**VIEWS, "composition": slowed(VIEWS["composition"]), "card": slowed_tables(VIEWS["card"])}
    bg = start_background(make_app(ex, views=views))
    try:
        yield bg
    finally:
        bg.stop()


@pytest.fixture(scope="module")
def page(server: Any) -> Any:
    need_browser()
    with Chrome() as c:
        c.open(server.url, ready="document.documentElement.dataset.ready === '1'")
        yield c


def ids_of(tok: Tokenizer, text: str) -> torch.Tensor:
    return torch.tensor([[0, *tok.encode(text).ids]])


def own_losses(model: qkov.Transformer, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logp = model(ids)[0].log_softmax(-1)
    return -logp[:-1].gather(-1, ids[0, 1:, None])[:, 0]


def run_text(page: Chrome, text: str) -> None:
    page.type_into("#text-input", text)
    page.click("#text-run")
    page.wait("document.querySelector('#text').dataset.rendered !== 'busy'")
    drawn(page, "text")
    page.wait("document.querySelector('#attention').dataset.rendered !== 'busy'")
    drawn(page, "attention")


def drawn(page: Chrome, panel: str, timeout: float = 60.0) -> None:
    """Wait until the panel's view has ended, and check it drew (else: the message it shows)."""
    sel = json.dumps(f"section[data-panel={panel}]")
    page.wait(f"['ok', 'error', 'cancelled'].includes(document.querySelector({sel}).dataset.rendered)", timeout)
    state, text = page.eval(
        f"[document.querySelector({sel}).dataset.rendered, document.querySelector({sel}).textContent]"
    )
    assert state == "ok", f"{panel}: {state}: {' '.join(text.split())[:300]}"


def tables_drawn(page: Chrome, timeout: float = 60.0) -> None:
    """Wait until the card's second job (its vocabulary-wide tables) has ended, and check it drew."""
    box = "document.querySelector('#card .card-tables')"
    page.wait(f"['ok', 'error', 'cancelled'].includes(({box} || {{dataset: {{}}}}).dataset.rendered)", timeout)
    state, text = page.eval(f"[{box}.dataset.rendered, {box}.textContent]")
    assert state == "ok", f"card tables: {state}: {' '.join(text.split())[:300]}"


def full_ov(model: qkov.Transformer, layer: int, head: int) -> torch.Tensor:
    """The dense full OV circuit ``[V, V]`` of the folded weights (float64)."""
    w = qkov.Weights.from_model(model)
    att = w.attention(layer)
    return (w.embed() @ att.W_V[head] @ att.W_O[head] @ w.unembed().W_U).double()


def dom_floats(page: Chrome, selector: str) -> list[float]:
    return page.eval(f"[...document.querySelectorAll({json.dumps(selector)})].map((e) => +e.dataset.value)")


def test_page_loads_and_draws_the_model_and_heads(page: Chrome, built: Any) -> None:
    assert page.eval("document.querySelector('#model').dataset.rendered") == "ok"
    drawn(page, "heads", timeout=120)
    heads = page.eval("[...document.querySelectorAll('#heads .head-link')].map((b) => b.dataset.head)")
    assert heads == ["0.0", "0.1", "1.0", "1.1"]


def test_typed_text_shows_its_tokens_and_the_models_loss(page: Chrome, built: Any) -> None:
    _, model, tok = built
    run_text(page, TEXT)
    ids = ids_of(tok, TEXT)
    shown = page.eval("[...document.querySelectorAll('#text .loss-text span')].map((s) => s.textContent)")
    assert shown == [tok.id_to_token(i) for i in ids[0].tolist()]
    loss = page.eval("[...document.querySelectorAll('#text .loss-text span')].map((s) => s.dataset.loss)")
    want = own_losses(model, ids)
    assert loss[-1] == ""  # nothing to predict after the last token
    assert [float(v) for v in loss[:-1]] == pytest.approx(want.tolist(), rel=1e-4, abs=1e-5)
    assert dom_floats(page, "#text [data-field=mean_loss]")[0] == pytest.approx(float(want.mean()), rel=1e-4)
    # hovering a token shows the model's top next-token predictions there
    page.hover("#text .loss-text span[data-pos='3']")
    page.wait("document.querySelector('#text .hover-box').dataset.pos === '3'")
    first = page.eval("document.querySelector('#text .hover-box td').textContent")
    with torch.no_grad():
        best = int(model(ids)[0, 3].argmax())
    assert first == json.dumps(tok.id_to_token(best))


@pytest.mark.parametrize("head", ["0.1", "1.0"])
def test_hovering_a_token_marks_the_argmax_key_of_the_forward_pass(page: Chrome, built: Any, head: str) -> None:
    _, model, tok = built
    if page.eval("document.querySelector('#text').dataset.rendered") != "ok":
        run_text(page, TEXT)
    page.eval(
        f"(() => {{ const s = document.querySelector('#attention-head'); s.value = {json.dumps(head)};"
        " s.dispatchEvent(new Event('change')); })()"
    )
    page.wait(
        f"document.querySelector('#attention').dataset.rendered === 'ok' && "
        f"document.querySelector('#attention .viewer-status').textContent.startsWith('head {head}')"
    )
    layer, h = (int(x) for x in head.split("."))
    pattern = own_patterns(model, ids_of(tok, TEXT))[layer][0, h]
    top2 = pattern.topk(2, dim=-1)
    clear = [q for q in range(1, pattern.shape[0]) if float(top2.values[q, 0] - top2.values[q, 1]) > 1e-3]
    assert len(clear) >= 5, "the test model's patterns are too flat to tell the argmax"
    for q in clear[-3:] + clear[:2]:
        page.hover(f"#attention .attention-text span[data-pos='{q}']")
        page.wait(f"document.querySelector('#attention .attention-text').dataset.query === '{q}'")
        marked = page.eval(
            "[...document.querySelectorAll('#attention .attention-text span.argmax')].map((s) => +s.dataset.pos)"
        )
        assert marked == [int(pattern[q].argmax())], (head, q)
        weights = page.eval(
            f"[...document.querySelectorAll('#attention .attention-text span')].slice(0, {q + 1})"
            ".map((s) => +s.dataset.weight)"
        )
        assert weights == pytest.approx(pattern[q, : q + 1].tolist(), abs=2e-5)


def _kept(full: torch.Tensor, model: Any, tok: Tokenizer) -> torch.Tensor:
    """``full`` with the rows and columns of the tokens the card's tables leave out (the start token,
    any special or unknown ids of the checkpoint's tokenizer) at -inf."""
    left, _ = left_out_tokens(SimpleNamespace(tokenizer=tok, bos_token_id=model.bos_token_id), full.shape[0])
    full = full.clone()
    full[list(left)], full[:, list(left)] = float("-inf"), float("-inf")
    return full


def test_head_card_numbers_are_the_librarys(page: Chrome, built: Any) -> None:
    _, model, tok = built
    drawn(page, "heads", timeout=120)
    page.click("#heads .head-link[data-head='1.1']")
    drawn(page, "card")
    assert page.eval("document.querySelector('#card h3').textContent") == "head 1.1"
    tables_drawn(page)  # the tables come from the page's second job, the full card
    full = full_ov(model, 1, 1)
    eig = torch.linalg.eigvals(full)
    copying = float(eig.sum().real / eig.abs().sum())
    assert dom_floats(page, "#card [data-field=copying]")[0] == pytest.approx(copying, abs=1e-4)
    top = dom_floats(page, "#card table.top-ov td span[data-value]")
    flat = _kept(full, model, tok).flatten().topk(len(top))
    assert top == pytest.approx(flat.values.tolist(), rel=1e-4, abs=1e-5)
    src, out = divmod(int(flat.indices[0]), full.shape[1])
    cells = page.eval("[...document.querySelector('#card table.top-ov').rows[1].cells].map((c) => c.textContent)")
    assert cells[:2] == [json.dumps(tok.id_to_token(src)), json.dumps(tok.id_to_token(out))]


def test_the_card_shows_before_its_tables_which_cancel_alone(page: Chrome, built: Any) -> None:
    _, model, tok = built
    drawn(page, "heads", timeout=120)
    SLOW_TABLES.set()  # the second job (the full card, for its tables) is slow: the first must show alone
    try:
        page.click("#heads .head-link[data-head='0.1']")
        drawn(page, "card")
        assert page.eval("document.querySelector('#card h3').textContent") == "head 0.1"
        line = page.wait(
            "(() => { const p = document.querySelector('#card .card-tables .job .progress');"
            " return p && /waiting \\d+\\/400/.test(p.textContent) && p.textContent; })()"
        )
        assert line.startswith("card tables: waiting")
        assert page.eval("document.querySelector('#card table.top-ov')") is None
        eig = torch.linalg.eigvals(full_ov(model, 0, 1))
        copying = float(eig.sum().real / eig.abs().sum())
        assert dom_floats(page, "#card [data-field=copying]")[0] == pytest.approx(copying, abs=1e-4)
        page.click("#card .card-tables .job button.cancel")
        page.wait("document.querySelector('#card .card-tables').dataset.rendered === 'cancelled'", timeout=20)
        assert page.eval("document.querySelector('#card').dataset.rendered") == "ok"  # the card stays
    finally:
        SLOW_TABLES.clear()
    page.click("#heads .head-link[data-head='0.1']")  # again: this time the tables fill in
    drawn(page, "card")
    tables_drawn(page)
    full = full_ov(model, 0, 1)
    top = dom_floats(page, "#card table.top-ov td span[data-value]")
    assert top == pytest.approx(_kept(full, model, tok).flatten().topk(len(top)).values.tolist(), rel=1e-4, abs=1e-5)


def test_ablating_a_head_changes_the_loss_as_qkov_ablate_says(page: Chrome, built: Any) -> None:
    _, model, tok = built
    if page.eval("document.querySelector('#text').dataset.rendered") != "ok":
        run_text(page, TEXT)
    page.click("#ablate-heads button[data-head='0.1']")
    assert (
        page.eval("document.querySelector(\"#ablate-heads button[data-head='0.1']\").getAttribute('aria-pressed')")
        == "true"
    )
    page.click("#ablate-run")
    drawn(page, "ablate")
    ids = ids_of(tok, TEXT)
    before = float(own_losses(model, ids).mean())
    edits = ablation_edits([(0, 1)], "zero")
    after = float(sequence_losses(qkov.Weights.from_model(model), ids, edits=edits).mean())
    zeroed = qkov.Transformer(model.cfg, init=False)
    zeroed.load_state_dict(model.state_dict())
    with torch.no_grad():
        zeroed.blocks[0].attn.W_O[1].zero_()  # zero ablation = the head writes nothing
    assert float(own_losses(zeroed.eval(), ids).mean()) == pytest.approx(after, rel=1e-5)
    assert abs(after - before) > 1e-4, "the ablation changes nothing: the test cannot tell"
    assert dom_floats(page, "#ablate [data-field=mean_before]")[0] == pytest.approx(before, rel=1e-4)
    assert dom_floats(page, "#ablate [data-field=mean_after]")[0] == pytest.approx(after, rel=1e-4)


def test_a_long_job_shows_progress_and_cancel_stops_it(page: Chrome) -> None:
    SLOW.set()  # the first composition request (nothing cached yet) is slow
    try:
        page.click("#composition-run")
        line = page.wait(
            "(() => { const p = document.querySelector('#composition .job .progress');"
            " return p && /waiting \\d+\\/200/.test(p.textContent) && p.textContent; })()"
        )
        assert line.startswith("composition: waiting")
        page.click("#composition .job button.cancel")
        page.wait("document.querySelector('#composition').dataset.rendered === 'cancelled'", timeout=20)
        assert "cancelled" in page.eval("document.querySelector('#composition .out').textContent")
    finally:
        SLOW.clear()


def test_composition_graph_draws_the_edges_above_the_threshold(page: Chrome, built: Any) -> None:
    _, model, _ = built
    page.click("#composition-run")
    drawn(page, "composition")
    scores = qkov.composition_scores(qkov.Weights.from_model(model), "qkv")
    L, H = model.cfg.n_layers, model.cfg.n_heads
    edges = {
        (f"{l1}.{h1}", f"{l2}.{h2}", kind): float(scores.kinds[kind].raw[l1, h1, l2, h2])
        for kind in "qkv"
        for l1 in range(L)
        for l2 in range(l1 + 1, L)
        for h1 in range(H)
        for h2 in range(H)
    }
    values = sorted(edges.values())
    th = (values[len(values) // 2] + values[len(values) // 2 + 1]) / 2  # between two scores: no tie
    page.eval(
        f"(() => {{ const s = document.querySelector('#composition-threshold'); s.value = '{th!r}';"
        " s.dispatchEvent(new Event('input')); })()"
    )
    lines = page.eval(
        "[...document.querySelectorAll('#composition svg line')].map((e) => "
        "[e.dataset.src, e.dataset.dst, e.dataset.kind, +e.dataset.value])"
    )
    want = {k for k, v in edges.items() if v >= th}
    assert {tuple(x[:3]) for x in lines} == want and len(lines) == len(want)
    for src, dst, kind, v in lines:
        assert v == pytest.approx(edges[src, dst, kind], rel=1e-4)
    # a kind unticked drops its edges; a head node opens its card
    page.click(".composition-kind[value='k']")
    kinds = page.eval(
        "[...new Set([...document.querySelectorAll('#composition svg line')].map((e) => e.dataset.kind))]"
    )
    assert "k" not in kinds
    page.click("#composition svg g.node[data-head='0.0']")
    drawn(page, "card")
    assert page.eval("document.querySelector('#card h3').textContent") == "head 0.0"


def test_term_effects_for_a_clicked_token(page: Chrome, built: Any) -> None:
    _, _, tok = built
    if page.eval("document.querySelector('#text').dataset.rendered") != "ok":
        run_text(page, TEXT)
    page.click("#text .loss-text span[data-pos='4']")
    drawn(page, "terms")
    text = page.eval("document.querySelector('#terms .out').textContent")
    assert "position 4" in text and json.dumps(tok.id_to_token(int(ids_of(tok, TEXT)[0, 4]))) in text
    terms = page.eval(
        "[...document.querySelectorAll('#terms table.terms-table tr')].slice(1).map((r) => r.cells[0].textContent)"
    )
    assert "direct" in terms and {"0.0", "0.1", "1.0", "1.1"} <= {t.replace("head ", "") for t in terms} | set(terms)


def test_patching_between_two_texts_shows_the_librarys_results(page: Chrome, built: Any) -> None:
    from qkov.analysis.causal.studies import patch_study

    _, model, tok = built
    corrupted = TEXT.replace("cat", "dog", 1)  # the same number of tokens
    page.type_into("#patch-clean", TEXT)
    page.type_into("#patch-corrupted", corrupted)
    page.click("#patch-run")
    drawn(page, "patch")
    study = patch_study(qkov.Weights.from_model(model), ids_of(tok, TEXT), ids_of(tok, corrupted))
    titles = page.eval("[...document.querySelectorAll('#patch .out h3')].map((h) => h.textContent)")
    assert titles == [f"{r.method} patching of {r.site} by {' × '.join(r.axes)}" for r in study.results]
    notes = page.eval("[...document.querySelectorAll('#patch .out p.note')].map((p) => p.textContent)")
    notes = [n for n in notes if "; metric: " in n]  # one per result, in order
    assert len(notes) == len(study.results)
    for r, text in zip(study.results, notes):
        assert f"clean {r.clean:.4f}, corrupted {r.corrupted:.4f}" in text, (text, r.clean, r.corrupted)


def test_circuit_is_drawn_and_a_clicked_edge_is_patched_exactly(page: Chrome, built: Any) -> None:
    """The circuit view draws the report's circuit section (one line per circuit edge, q/k/v coloured as the
    layout says, the faithfulness curve beside it); clicking an edge shows its exact patching effect, the
    library's on the same task."""
    from qkov.analysis.discovery import edge_scores
    from qkov.apps.report.discovery import circuit_section, section_task

    w = qkov.Weights.from_model(qkov.load(built[0]))  # as the explorer reads it (its tokenizer's special tokens)
    want = circuit_section(w)
    page.click("#circuit-run")
    drawn(page, "circuit", timeout=120)
    lines = page.eval(
        "[...document.querySelectorAll('#circuit svg.circuit-graph g.edge')].map((g) => "
        "[g.dataset.name, g.querySelector('line').getAttribute('stroke')])"
    )
    assert sorted(lines) == sorted([e["name"], e["colour"]] for e in want.layout.edges)
    assert page.eval("document.querySelectorAll('#circuit .circuit-curve .main-svg').length") >= 1
    assert f"CPR {want.curve['cpr']:.3f}" in page.eval("document.querySelector('#circuit .out').textContent")
    name = want.layout.edges[0]["name"]
    page.click(f"#circuit svg.circuit-graph g.edge[data-edge='{want.layout.edges[0]['edge']}']")
    box = "document.querySelector('#circuit .circuit-edge')"
    page.wait(f"['ok', 'error'].includes({box}.dataset.rendered)", 60)
    text, value = page.eval(f"[{box}.textContent, +{box}.querySelector('[data-field=exact]').dataset.value]")
    clicked = text.split(" ablated alone")[0].strip()  # the topmost edge at that point (lines may cross)
    assert clicked in {e["name"] for e in want.layout.edges}, (text, name)
    exact = edge_scores(w, section_task(w), method="exact", edges=[clicked]).at_edge(clicked)
    assert value == pytest.approx(exact, rel=1e-4, abs=1e-6)


def test_server_errors_show_in_the_page(page: Chrome) -> None:
    long = "|".join(["cat"] * 40)  # more tokens than the context (32)
    page.type_into("#text-input", long)
    page.click("#text-run")
    page.wait("document.querySelector('#text').dataset.rendered === 'error'")
    shown = page.eval("document.querySelector('#text .out .error').textContent")
    assert "at most 32" in shown, shown
    # the browser logs the refused request (the job's 400); that one is expected, and only that one
    refused = [e for e in page.log if e["source"] == "network" and "status of 400" in (e["text"] or "")]
    assert len(refused) == 1 and "/api/jobs" in refused[0]["url"], page.log
    page.log.remove(refused[0])
    run_text(page, TEXT)  # and the page goes on working


def test_html_token_strings_render_as_text(page: Chrome, built: Any) -> None:
    if page.eval("document.querySelector('#text').dataset.rendered") != "ok":
        run_text(page, TEXT)
    shown = page.eval("[...document.querySelectorAll('#text .loss-text span')].map((s) => s.textContent)")
    assert SCRIPT_TOKEN in shown and IMG_TOKEN in shown
    assert page.eval("document.querySelectorAll('main img').length") == 0
    assert page.eval("typeof window.__pwned") == "undefined"
    # the <img> token's top-prediction table and the attention viewer hold it as text too
    pos = shown.index(IMG_TOKEN)
    page.hover(f"#attention .attention-text span[data-pos='{pos}']")
    page.hover(f"#text .loss-text span[data-pos='{pos}']")
    page.pump(0.3)
    assert page.eval("typeof window.__pwned") == "undefined"


def test_no_console_errors_and_no_request_leaves_the_loopback(page: Chrome, server: Any) -> None:
    page.pump(0.5)
    assert page.problems() == []
    origin = urlsplit(server.url)
    assert page.requests, "no request recorded: the recorder is broken"
    for url in page.requests:
        parts = urlsplit(url)
        assert (parts.scheme, parts.netloc) == (origin.scheme, origin.netloc) or parts.scheme in ("data", "blob"), url
