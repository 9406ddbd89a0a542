"""``qkov explore``'s page over a model read from disk layer by layer (``open_explorer(..., lazy=True)``), in a real
headless Chromium against a real server: the model panel says where the weights are, the views a streamed
session does not answer say why in their panels (their buttons off, no job started), a typed text shows the
model's own losses (its forward pass on the loaded model), and a card opens from the Attention panel with its
vocabulary tables computed only when asked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import qkov
from browser import need_browser
from explore_helpers import TEXT, tokenized_checkpoint

pytest.importorskip("starlette")
pytest.importorskip("websocket")

from cdp import Chrome  # noqa: E402  (needs websocket-client)

OFF = ("heads", "terms", "patch", "circuit")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenized_checkpoint(tmp_path_factory.mktemp("explore-streamed"))


@pytest.fixture(scope="module")
def page(ckpt: Path) -> Any:
    from qkov.apps.explore.server import make_app, start_background
    from qkov.apps.explore.session import open_explorer

    need_browser()
    bg = start_background(make_app(open_explorer(ckpt, cache_dir=None, lazy=True)))
    try:
        with Chrome(width=1400) as c:
            c.open(bg.url, ready="document.documentElement.dataset.ready === '1'")
            yield c
    finally:
        bg.stop()


def state(page: Chrome, panel: str) -> str:
    return page.eval(f"document.querySelector('section[data-panel={panel}]').dataset.rendered || ''")


def test_the_page_says_the_weights_are_on_disk_and_which_views_are_off(page: Chrome) -> None:
    model = page.eval("document.querySelector('#model').textContent")
    assert "read from disk layer by layer" in model
    for panel in OFF:
        assert state(page, panel) == "off", panel
        text = page.eval(f"document.querySelector('#{panel} .out').textContent")
        assert text.startswith("Not available while the weights are read from disk layer by layer:"), text
        assert page.eval(f"[...document.querySelectorAll('#{panel} button')].every((b) => b.disabled)")
        assert page.eval(f"document.querySelector('#{panel} .progress') === null")  # no job was started


def test_a_text_shows_the_models_own_losses_and_a_card_opens_from_attention(page: Chrome, ckpt: Path) -> None:
    page.type_into("#text-input", TEXT)
    page.click("#text-run")
    page.wait("['ok', 'error'].includes(document.querySelector('#text').dataset.rendered)", 60)
    assert state(page, "text") == "ok"
    model = qkov.load(ckpt).eval()
    ids = torch.tensor([model.codec.encode(TEXT)])
    with torch.no_grad():
        want = -model(ids)[0].log_softmax(-1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
    loss = page.eval("[...document.querySelectorAll('#text .loss-text span')].map((s) => s.dataset.loss)")
    assert [float(v) for v in loss[:-1]] == pytest.approx(want.tolist(), rel=1e-4, abs=1e-5)
    page.click("#attention-card")
    page.wait("['ok', 'error'].includes(document.querySelector('#card').dataset.rendered)", 60)
    assert state(page, "card") == "ok"
    page.wait("!!document.querySelector('#card-tables-run')", 30)  # the tables wait to be asked for
    assert not page.eval("document.querySelector('#card .card-tables').dataset.rendered")
    page.click("#card-tables-run")
    page.wait("['ok', 'error'].includes(document.querySelector('#card .card-tables').dataset.rendered)", 60)
    assert page.eval("document.querySelector('#card .card-tables').dataset.rendered") == "ok"
    assert page.eval("document.querySelectorAll('#card .card-tables tr').length") > 3
    assert page.problems() == []
