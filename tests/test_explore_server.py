"""``qkov explore``'s server over real sockets on 127.0.0.1: every view's numbers against the forward pass or
the library function it wraps, the disk cache, concurrency within a memory bound, jobs (progress, cancel,
429), one-line JSON errors, and the loopback/token/CSP rules."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

import qkov
from explore_helpers import CONTEXT, call, one_line_error, tokenized_checkpoint, view
from qkov.apps.explore import views as views_module
from qkov.apps.explore.context import Explorer
from qkov.apps.explore.jobs import QUEUE_SIZE
from qkov.apps.explore.server import make_app, start_background
from qkov.apps.explore.session import open_explorer
from qkov.apps.explore.views import VIEWS
from qkov.analysis.paths import default_batch
from qkov.analysis.probes import default_icl_examples
from qkov.apps.inputs import analysis_inputs

SLOW_STEPS = 400  # x 25 ms: 10 s, far longer than any test waits for it


def slow_view(ex: Explorer, args: dict[str, Any], progress: Any) -> dict[str, Any]:
    """A test-only view that takes 10 s, ticking progress; ``args["n"]`` tells requests apart."""
    for i in range(SLOW_STEPS):
        progress("slow", i, SLOW_STEPS)
        time.sleep(0.025)
    return {"n": args.get("n")}


def broken_view(ex: Explorer, args: dict[str, Any], progress: Any) -> dict[str, Any]:
    return {"x": 1 // 0}  # a bug in a view


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenized_checkpoint(tmp_path_factory.mktemp("explore"))


@pytest.fixture(scope="module")
def model(ckpt: Path) -> qkov.Transformer:
    return qkov.load(ckpt).eval()  # loaded on its own: the server's copy is not what the tests compare with


@pytest.fixture(scope="module")
def served(ckpt: Path):
    ex = open_explorer(ckpt, cache_dir=None)
    app = make_app(ex, views={**VIEWS, "slow": slow_view, "broken": broken_view}, cache_bytes=64 * 2**10)
    bg = start_background(app)
    yield bg, app
    bg.stop()


def encode(model: qkov.Transformer, text: str) -> list[int]:
    return [model.bos_token_id, *model.tokenizer.encode(text).ids]


def test_text_loss_is_the_forward_pass_cross_entropy(served, model: qkov.Transformer) -> None:
    bg, _ = served
    text = "def f(self): return"
    status, got = view(bg.url, "text", {"text": text})
    assert status == 200
    ids = encode(model, text)
    assert got["ids"] == ids and got["tokens"] == model.to_str_tokens(torch.tensor(ids))
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0]
    ce = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="none")
    assert got["loss"][-1] is None
    assert got["loss"][:-1] == pytest.approx(ce.tolist(), rel=1e-5)
    assert got["mean_loss"] == pytest.approx(float(ce.mean()), rel=1e-5)
    assert [row[0]["id"] for row in got["top"]] == logits.argmax(-1).tolist()
    p = torch.softmax(logits, -1)
    assert [row[0]["p"] for row in got["top"]] == pytest.approx(p.max(-1).values.tolist(), rel=1e-5)


def forward_pattern(model: qkov.Transformer, ids: list[int], layer: int, head: int) -> torch.Tensor:
    """Head ``layer.head``'s pattern recomputed from the attention module's own inputs in the model's forward
    pass (a hook on the module; softmax of q.k / sqrt(d_head), causal), not through qkov.trace."""
    seen: dict[str, torch.Tensor] = {}
    attn = model.blocks[layer].attn
    handle = attn.register_forward_pre_hook(lambda mod, inputs: seen.update(qk=inputs[0]))
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
            q, k, _ = attn.qkv(seen["qk"], seen["qk"])
    finally:
        handle.remove()
    scores = q[0, head] @ k[0, head].T / model.cfg.d_head**0.5
    T = len(ids)
    scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    return torch.softmax(scores, -1)


def test_attention_is_the_forward_pass_pattern(served, model: qkov.Transformer) -> None:
    bg, _ = served
    text = "self.x return self.x"
    ids = encode(model, text)
    for head in ("0.1", "1.0"):
        status, got = view(bg.url, "attention", {"text": text, "head": head})
        assert status == 200 and got["head"] == head
        want = forward_pattern(model, ids, *map(int, head.split(".")))
        assert torch.tensor(got["pattern"]) == pytest.approx(want, abs=1e-5)
        assert got["argmax"] == want.argmax(-1).tolist()
        assert got["tokens"] == model.to_str_tokens(torch.tensor(ids))


def heads_expected(ckpt: Path) -> dict[str, Any]:
    """qkov.head_report on the inputs `qkov heads SOURCE` reads, computed here on a model loaded apart."""
    model = qkov.load(ckpt)
    batch, icl = default_batch(model.cfg.n_ctx), default_icl_examples(model.cfg)
    inputs = analysis_inputs(ckpt, model, batch=max(batch, icl), want_corpus=True)
    report = qkov.head_report(
        model, inputs.tokens[:batch], frequencies=inputs.frequencies, icl_text=inputs.tokens[:icl], icl=inputs.natural
    )
    return {"rows": report.rows(), "inputs": inputs.source, "left_out": report.left_out}


def heads_of(ckpt: Path, cache: Path) -> tuple[dict[str, Any], Explorer]:
    ex = open_explorer(ckpt, cache_dir=cache)
    bg = start_background(make_app(ex))
    try:
        status, got = view(bg.url, "heads")
    finally:
        bg.stop()
    assert status == 200, got
    return got, ex


def same_rows(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert [r["head"] for r in got] == [r["head"] for r in want]
    for g, w in zip(got, want):
        assert g["roles"] == w["roles"]
        for key, value in w.items():
            if isinstance(value, float):
                assert g[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (g["head"], key)


def test_heads_view_is_head_report_and_a_second_start_reads_the_disk_cache(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = heads_expected(ckpt)
    cache = tmp_path / "cache"
    first, _ = heads_of(ckpt, cache)
    same_rows(first["rows"], want["rows"])
    assert first["inputs"] == want["inputs"] and first["left_out"] == want["left_out"]
    assert first["from_cache"] is False
    path = Path(first["cached"])
    assert path.parent == cache and path.is_file()
    assert sorted(p.name for p in cache.iterdir()) == [path.name]  # no temporaries left beside it

    def no_compute(*a: Any, **kw: Any) -> None:
        raise AssertionError("head_report ran: the disk cache was not read")

    with monkeypatch.context() as m:
        m.setattr(views_module, "head_report", no_compute)
        second, _ = heads_of(ckpt, cache)  # a fresh explorer and server: nothing in memory
    assert second["from_cache"] is True and second["cached"] == str(path)
    assert second["rows"] == first["rows"] and second["columns"] == first["columns"]

    path.write_text('{"format": 1, "key": "')  # a torn or corrupt file is recomputed, not trusted
    third, _ = heads_of(ckpt, cache)
    assert third["from_cache"] is False and third["rows"] == first["rows"]
    assert json.loads(path.read_text())["result"]["rows"] == first["rows"]

    other = tokenized_checkpoint(tmp_path, seed=5)  # other weights: another file, never the first one's
    fourth, _ = heads_of(other, cache)
    assert fourth["from_cache"] is False and fourth["cached"] != str(path)
    same_rows(fourth["rows"], heads_expected(other)["rows"])


def test_concurrent_clients_all_get_their_answers_within_a_memory_bound(served, model: qkov.Transformer) -> None:
    bg, app = served
    words = ["self", "x", "f", "return", "def", "(", ")", ":"]
    texts = [" ".join(words[(i + j) % len(words)] for j in range(3 + i % 9)) for i in range(48)]
    want, argmax = {}, {}
    for text in texts:
        ids = encode(model, text)
        with torch.no_grad():
            logits = model(torch.tensor([ids]))[0]
        want[text] = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="none").tolist()
        argmax[text] = forward_pattern(model, ids, 1, 1).argmax(-1).tolist()
    rss = psutil.Process().memory_info().rss
    errors: list[str] = []

    def client(k: int) -> None:
        try:
            requests(k)
        except Exception as exc:  # an exception in a thread would not fail the test by itself
            errors.append(repr(exc))

    def requests(k: int) -> None:
        for r in range(6):  # 16 clients x 6 requests, texts shared between clients (joined jobs, cache hits)
            text = texts[(k * 7 + r * 5) % len(texts)]
            name, args = ("text", {"text": text}) if r % 2 == 0 else ("attention", {"text": text, "head": "1.1"})
            status, got = view(bg.url, name, args)
            if status != 200:
                errors.append(f"{status} {got}")
            elif name == "text" and got["loss"][:-1] != pytest.approx(want[text], rel=1e-5):
                errors.append(f"wrong loss for {text!r}")
            elif name == "attention" and got["argmax"] != argmax[text]:
                errors.append(f"wrong pattern for {text!r}")

    threads = [threading.Thread(target=client, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors[:5]
    assert len(threads) == 16 and not any(t.is_alive() for t in threads)
    cache = app.state.runner.cache
    assert 0 < cache.bytes <= cache.max_bytes == 64 * 2**10
    assert psutil.Process().memory_info().rss - rss < 200 * 2**20


def error_of(url: str, method: str, path: str, body: Any = None, **kw: Any) -> tuple[int, str]:
    status, headers, data = call(url, method, path, body, **kw)
    return status, one_line_error(status, headers, data)


def test_bad_requests_are_one_line_json_errors(served) -> None:
    bg, _ = served
    url = bg.url
    assert error_of(url, "POST", "/api/views/attention", {"text": "self", "head": "7.0"})[0] == 404
    assert error_of(url, "POST", "/api/views/attention", {"text": "self", "head": "one"})[0] == 400
    status, msg = error_of(url, "POST", "/api/views/text", {"text": "self " * CONTEXT})
    assert status == 400 and f"at most {CONTEXT}" in msg
    assert error_of(url, "POST", "/api/views/text", {"text": [0, 10**6]})[0] == 400
    assert error_of(url, "POST", "/api/views/text", {})[0] == 400
    assert error_of(url, "POST", "/api/jobs", raw=b'{"view": "text", "args": {')[0] == 400
    assert error_of(url, "POST", "/api/jobs", {"view": "text", "args": [1, 2]})[0] == 400
    assert error_of(url, "POST", "/api/jobs", ["text"])[0] == 400
    assert error_of(url, "GET", "/api/views/text?args=%7Bnot-json")[0] == 400
    status, msg = error_of(url, "POST", "/api/views/text", raw=b'{"text": "' + b"x" * (2 << 20) + b'"}')
    assert status == 413 and "bytes" in msg
    assert error_of(url, "POST", "/api/jobs", {"view": "nope", "args": {}})[0] == 404
    assert error_of(url, "GET", "/api/views/nope")[0] == 404
    assert error_of(url, "GET", "/api/jobs/0123456789abcdef")[0] == 404
    assert error_of(url, "DELETE", "/api/jobs/0123456789abcdef")[0] == 404
    assert error_of(url, "GET", "/no/such/page")[0] == 404
    assert error_of(url, "PUT", "/api/jobs")[0] == 405
    status, msg = error_of(url, "GET", "/api/views/broken")  # a bug in a view: 500, one line, no traceback
    assert status == 500 and msg.startswith("internal error") and "by zero" in msg


def job(url: str, method: str, path: str, body: Any = None) -> dict[str, Any]:
    status, _, data = call(url, method, path, body)
    assert status == 200, data
    return json.loads(data)


def wait_for(pred: Any, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_a_long_job_reports_progress_and_is_cancelled(served) -> None:
    bg, _ = served
    started = job(bg.url, "POST", "/api/jobs", {"view": "slow", "args": {"n": "cancel-me"}})
    assert started["state"] in ("queued", "running")
    jid = started["id"]
    wait_for(lambda: job(bg.url, "GET", f"/api/jobs/{jid}")["done"] >= 3)
    seen = job(bg.url, "GET", f"/api/jobs/{jid}")
    assert seen["state"] == "running" and seen["what"] == "slow" and seen["total"] == SLOW_STEPS
    assert job(bg.url, "DELETE", f"/api/jobs/{jid}")["state"] == "cancelled"
    assert job(bg.url, "GET", f"/api/jobs/{jid}")["state"] == "cancelled"
    # the worker is free again: a quick job behind it in the slow lane finishes long before 10 s
    t0 = time.monotonic()
    assert view(bg.url, "heads")[0] == 200
    assert time.monotonic() - t0 < SLOW_STEPS * 0.025


def test_a_full_queue_is_429_and_a_finished_result_comes_from_the_cache(served) -> None:
    bg, _ = served
    ids = [job(bg.url, "POST", "/api/jobs", {"view": "slow", "args": {"n": i}})["id"] for i in range(QUEUE_SIZE + 1)]
    again = job(bg.url, "POST", "/api/jobs", {"view": "slow", "args": {"n": 0}})
    assert again["id"] == ids[0]  # the same request joins its unfinished job
    status, msg = error_of(bg.url, "POST", "/api/jobs", {"view": "slow", "args": {"n": "one too many"}})
    assert status == 429 and "too many" in msg
    for i in ids:
        assert job(bg.url, "DELETE", f"/api/jobs/{i}")["state"] == "cancelled"
    first = job(bg.url, "POST", "/api/jobs", {"view": "text", "args": {"text": "return self"}})
    wait_for(lambda: job(bg.url, "GET", f"/api/jobs/{first['id']}")["state"] == "done")
    hit = job(bg.url, "POST", "/api/jobs", {"view": "text", "args": {"text": "return self"}})
    assert hit["state"] == "done" and hit["result"] == job(bg.url, "GET", f"/api/jobs/{first['id']}")["result"]


def test_the_page_has_a_strict_csp_with_a_nonce_per_response(served) -> None:
    bg, _ = served
    status, headers, body = call(bg.url, "GET", "/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert headers["x-content-type-options"] == "nosniff"
    policy = headers["content-security-policy"]
    nonce = re.search(r"script-src 'nonce-([^']+)'", policy).group(1)
    assert "connect-src 'self'" in policy and "default-src 'none'" in policy and "unsafe-eval" not in policy
    assert "'unsafe-inline'" not in policy.split("script-src")[1].split(";")[0]
    html = body.decode()
    for tag in re.findall(r"<script[^>]*>", html):
        assert f'nonce="{nonce}"' in tag, tag
    assert call(bg.url, "GET", "/")[1]["content-security-policy"] != policy  # fresh per response


def test_loopback_only_without_a_token(served, ckpt: Path) -> None:
    bg, _ = served
    assert bg.uvicorn.servers[0].sockets[0].getsockname()[0] == "127.0.0.1"  # the default bind
    status, msg = error_of(bg.url, "GET", "/api/views/model", headers={"Host": "evil.example:80"})
    assert status == 403 and "loopback" in msg  # a rebound DNS name never reaches the views
    assert call(bg.url, "GET", "/api/views/model", headers={"Host": f"localhost:{bg.port}"})[0] == 200
    status, _ = error_of(bg.url, "POST", "/api/jobs", {"view": "model"}, headers={"Origin": "http://evil.example"})
    assert status == 403


def test_a_token_is_required_when_given(ckpt: Path) -> None:
    ex = open_explorer(ckpt, cache_dir=None)
    bg = start_background(make_app(ex, token="s3cret-token"), host="0.0.0.0")
    url = f"http://127.0.0.1:{bg.port}/"
    try:
        assert bg.uvicorn.servers[0].sockets[0].getsockname()[0] == "0.0.0.0"
        assert error_of(url, "GET", "/api/views/model")[0] == 403
        assert error_of(url, "GET", "/?token=wrong")[0] == 403
        assert error_of(url, "GET", "/", headers={"Authorization": "token s3cret-tokeX"})[0] == 403
        status, headers, _ = call(url, "GET", "/?token=s3cret-token")
        assert status == 200
        cookie = headers["set-cookie"]
        assert "httponly" in cookie.lower() and "samesite=strict" in cookie.lower()
        jar = cookie.split(";")[0]
        assert call(url, "GET", "/api/views/model", headers={"Cookie": jar})[0] == 200
        assert call(url, "GET", "/api/views/model", headers={"Authorization": "token s3cret-token"})[0] == 200
        host = {"Host": "evil.example", "Authorization": "token s3cret-token"}
        assert call(url, "GET", "/api/views/model", headers=host)[0] == 200  # the token, not the name, decides
    finally:
        bg.stop()
