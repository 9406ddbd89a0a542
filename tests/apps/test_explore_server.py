"""``qkov explore``'s server over real sockets on 127.0.0.1: every view's numbers against the forward pass or
the library function it wraps, the disk cache, concurrency within a memory bound, jobs (progress, cancel,
429), one-line JSON errors, and the loopback/token/CSP rules."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

import qkov
from explore_helpers import CONTEXT, TEXT, call, one_line_error, tokenized_checkpoint, view
from helpers import own_patterns
from qkov.apps.explore import session as session_module, views as views_module
from qkov.apps.explore.context import BadRequest, Explorer
from qkov.apps.explore.disk_cache import entry_key, entry_path, read_entry, write_entry
from qkov.apps.explore.jobs import QUEUE_SIZE, JobRunner, ResultCache
from qkov.apps.explore.server import MIN_TOKEN, make_app, start_background
from qkov.apps.explore.session import open_explorer
from qkov.apps.explore.views import VIEWS
from qkov.apps.report.render import render_template
from qkov.analysis.paths.expansion import default_batch
from qkov.analysis.heads.probes import default_icl_examples
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
    """Head ``layer.head``'s pattern recomputed from the training model's own modules, not through qkov.trace."""
    return own_patterns(model, torch.tensor([ids]))[layer][0, head]


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


def heads_of(ckpt: Path, cache: Path, **kw: Any) -> tuple[dict[str, Any], Explorer]:
    ex = open_explorer(ckpt, cache_dir=cache, **kw)
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


def test_heads_on_a_text_are_qkov_heads_on_that_text(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``qkov explore SOURCE --text FILE``'s heads table: the same source and text as ``qkov heads SOURCE --text
    FILE`` give the same inputs line and the same score for every head (1e-6); without the text (a checkpoint
    recording no corpus) the table says it read seeded random tokens, and its scores are not the text's."""
    from helpers import run_main
    from qkov.analysis.heads.report import SCORE_COLUMNS

    text = tmp_path / "code.txt"
    text.write_text(TEXT * 12)
    rc, out, err = run_main(capsys, "heads", ckpt, "--text", text, "--json")
    assert rc == 0, err
    want = json.loads(out)
    got, _ = heads_of(ckpt, tmp_path / "cache", text=text)
    assert got["inputs"] == want["inputs"] and want["inputs"].startswith(f"text from {text}") and got["natural"]
    keys = [key for _, key in SCORE_COLUMNS] + ["diag_top5"]
    assert [r["head"] for r in got["rows"]] == [r["head"] for r in want["heads"]]
    for g, w in zip(got["rows"], want["heads"]):
        assert g["roles"] == w["roles"]
        for key in keys:
            assert g[key] == pytest.approx(w[key], abs=1e-6), (g["head"], key)
    plain, _ = heads_of(ckpt, tmp_path / "cache")
    assert plain["inputs"].startswith("seeded random tokens") and plain["natural"] is False
    pattern = ("previous_token", "self_attention", "sink")  # what the tokens read change
    assert max(abs(a[k] - b[k]) for a, b in zip(plain["rows"], got["rows"]) for k in pattern) > 1e-5  # beyond rounding


def test_a_text_that_cannot_be_read_fails_when_the_explorer_opens(ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(qkov.QkovError, match="cannot read the text"):
        open_explorer(ckpt, cache_dir=None, text=tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(qkov.QkovError, match="holds no tokens"):
        open_explorer(ckpt, cache_dir=None, text=tmp_path / "empty.txt")


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
    assert bg.url.startswith("http://127.0.0.1:")  # the default bind (the URL is the bound socket's name)
    status, msg = error_of(bg.url, "GET", "/api/views/model", headers={"Host": "evil.example:80"})
    assert status == 403 and "loopback" in msg  # a rebound DNS name never reaches the views
    assert call(bg.url, "GET", "/api/views/model", headers={"Host": f"localhost:{bg.port}"})[0] == 200
    status, _ = error_of(bg.url, "POST", "/api/jobs", {"view": "model"}, headers={"Origin": "http://evil.example"})
    assert status == 403


TOKEN = "s3cret-token-0123456789"


def test_a_token_is_required_when_given(ckpt: Path) -> None:
    ex = open_explorer(ckpt, cache_dir=None)
    bg = start_background(make_app(ex, token=TOKEN), host="0.0.0.0")
    url = f"http://127.0.0.1:{bg.port}/"
    try:
        assert bg.url.startswith("http://0.0.0.0:")
        assert error_of(url, "GET", "/api/views/model")[0] == 403
        assert error_of(url, "GET", "/?token=wrong")[0] == 403
        assert error_of(url, "GET", "/", headers={"Authorization": f"token {TOKEN[:-1]}X"})[0] == 403
        status, headers, _ = call(url, "GET", f"/?token={TOKEN}")
        assert status == 200
        cookie = headers["set-cookie"]
        assert "httponly" in cookie.lower() and "samesite=strict" in cookie.lower()
        jar = cookie.split(";")[0]
        assert call(url, "GET", "/api/views/model", headers={"Cookie": jar})[0] == 200
        assert call(url, "GET", "/api/views/model", headers={"Authorization": f"token {TOKEN}"})[0] == 200
    finally:
        bg.stop()


@pytest.mark.parametrize("bad", ["", " ", "\t\n", "short-token", "sixteen chars ok", "x" * 15])
def test_an_empty_blank_or_short_token_is_refused_before_serving(ckpt: Path, bad: str) -> None:
    ex = open_explorer(ckpt, cache_dir=None)
    with pytest.raises(qkov.QkovError, match=f"a token must be at least {MIN_TOKEN} characters"):
        make_app(ex, token=bad)


@pytest.fixture(scope="module")
def guarded(ckpt: Path):
    """A server with a token on every interface, and one name it was told to accept."""
    app = make_app(open_explorer(ckpt, cache_dir=None), token=TOKEN, hosts=("box.lan",))
    bg = start_background(app, host="0.0.0.0")
    yield f"http://127.0.0.1:{bg.port}/", bg.port
    bg.stop()


AUTH = {"Authorization": f"token {TOKEN}"}
JOB = {"view": "model"}


@pytest.mark.parametrize(
    "method, path, headers, why",
    [
        ("GET", "/api/views/model", {}, "token"),  # no token
        ("POST", "/api/jobs", {}, "token"),  # no token and no Origin (a script, not a page)
        ("GET", "/api/views/model", {"Authorization": "token " + "y" * len(TOKEN)}, "token"),  # a wrong one
        ("GET", "/api/views/model?token=", {}, "token"),  # empty, in each place a token is read
        ("GET", "/api/views/model", {"Authorization": "token "}, "token"),
        ("GET", "/api/views/model", {"Cookie": "qkov_explore_token="}, "token"),
        ("GET", "/api/views/model", {**AUTH, "Host": "evil.example:8797"}, "host"),  # the token at a foreign name
        ("POST", "/api/jobs", {**AUTH, "Host": "evil.example"}, "host"),
        ("GET", "/api/views/model", {**AUTH, "Host": "10.9.8.7"}, "host"),  # an address it was not reached at
        ("POST", "/api/jobs", {**AUTH, "Origin": "http://evil.example"}, "origin"),  # the token from another page
    ],
)
def test_token_mode_refuses(guarded, method: str, path: str, headers: dict[str, str], why: str) -> None:
    url, _ = guarded
    status, msg = error_of(url, method, path, JOB if method == "POST" else None, headers=headers)
    assert status == 403 and why in msg, msg


def test_token_mode_answers_the_token_at_this_servers_names(guarded) -> None:
    url, port = guarded
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"{socket.gethostname()}:{port}", "BOX.lan:80"):
        assert call(url, "GET", "/api/views/model", headers={**AUTH, "Host": host})[0] == 200, host
    # a script (no Origin) with the token may start jobs; the page's own origin too
    assert call(url, "POST", "/api/jobs", JOB, headers=AUTH)[0] == 200
    assert call(url, "POST", "/api/jobs", JOB, headers={**AUTH, "Origin": f"http://127.0.0.1:{port}"})[0] == 200


def test_render_template_puts_the_nonce_on_the_templates_tags_only() -> None:
    data = {"s": "<script>alert(1)</script><style>"}
    page = render_template("template.html", data, ("report.js",), "t", nonce="abc123")
    plain = render_template("template.html", data, ("report.js",), "t")
    tags = re.findall(r"<(?:script|style)\b[^>]*>", plain)
    assert tags and all("nonce" not in t for t in tags)
    assert page.count('nonce="abc123"') == len(tags)  # every tag of the template, nothing inserted into it
    assert page.replace(' nonce="abc123"', "") == plain
    with pytest.raises(qkov.QkovError):
        render_template("template.html", data, ("report.js",), "t", nonce='x" onload="alert(1)')


def test_a_hostile_token_or_name_stays_data(tmp_path: Path) -> None:
    evil = "</script><img/src=x/onerror=alert(1)>"
    vocab = {"<|endoftext|>": 0, evil: 1, "ok": 2, "<!--": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path / "m<img src=x onerror=alert(2)>"
    cfg = qkov.ModelConfig(n_layers=1, n_heads=1, d_model=8, d_head=8, d_vocab=len(vocab), n_ctx=8)
    qkov.save_checkpoint(qkov.Transformer(cfg, seed=0), path, tokenizer_json=tok.to_str())
    bg = start_background(make_app(open_explorer(path, cache_dir=None)))
    try:
        status, got = view(bg.url, "text", {"text": f"ok {evil} <!-- ok"})
        assert status == 200 and got["tokens"] == ["<|endoftext|>", "ok", evil, "<!--", "ok"]  # raw, as data
        status, headers, body = call(bg.url, "GET", "/api/views/model")
        assert headers["content-type"] == "application/json" and headers["x-content-type-options"] == "nosniff"
        assert json.loads(body)["name"] == path.name
        status, headers, body = call(bg.url, "GET", "/")
        html = body.decode()
        assert status == 200 and "<img" not in html and "</script><img" not in html
        blobs = re.findall(r'<script type="application/json"[^>]*>(.*?)</script>', html, re.S)
        for blob in blobs:  # the page's data (once the page exists) is the model view, escaped for <script>
            assert "<" not in blob and json.loads(blob)["name"] == path.name
    finally:
        bg.stop()


def test_the_result_cache_is_bounded_in_bytes_and_drops_the_least_recently_used() -> None:
    cache = ResultCache(100)
    for k in "abc":
        cache.put(k, b"x" * 40)  # 120 bytes: "a" goes
    assert cache.get("a") is None and cache.get("b") == b"x" * 40 and cache.bytes == 80
    cache.get("b")  # "b" used: "c" is now the oldest
    cache.put("d", b"y" * 40)
    assert cache.get("c") is None and cache.get("b") is not None and cache.bytes == 80 <= cache.max_bytes
    cache.put("huge", b"z" * 101)  # larger than the whole cache: not kept, nothing else dropped
    assert cache.get("huge") is None and cache.bytes == 80


def test_finished_jobs_are_forgotten_after_keep_s(ckpt: Path) -> None:
    ex = open_explorer(ckpt, cache_dir=None)
    runner = JobRunner(ex, VIEWS, quick={"model"}, keep_s=0.2)
    try:
        first = runner.submit("model", {})
        assert first.finished_event.wait(60) and first.state == "done"
        assert runner.get(first.id) is first
        time.sleep(0.3)
        with pytest.raises(BadRequest) as err:
            runner.get(first.id)
        assert err.value.status == 404
        again = runner.submit("model", {})  # its result is still in the result cache: done at once
        assert again.state == "done" and again.result == first.result
    finally:
        runner.close()


def test_a_bug_outside_the_views_is_a_one_line_500(ckpt: Path, capfd: pytest.CaptureFixture[str]) -> None:
    bg = start_background(make_app(open_explorer(ckpt, cache_dir=None), views={"text": VIEWS["text"]}))
    try:  # no "model" view: drawing the page fails inside the server
        status, msg = error_of(bg.url, "GET", "/")
        assert status == 500 and msg.startswith("internal error")
        assert view(bg.url, "text", {"text": "self"})[0] == 200  # and the server goes on
    finally:
        bg.stop()
    assert "Traceback" in capfd.readouterr().err  # the traceback is the server's log, not the answer


def test_the_weights_view_is_built_behind_the_first_page_and_waited_for(ckpt: Path, monkeypatch) -> None:
    gate, built = threading.Event(), threading.Event()
    real = session_module.Weights.from_model

    def slow_from_model(*a: Any, **kw: Any) -> Any:
        gate.wait(20)
        try:
            return real(*a, **kw)
        finally:
            built.set()

    monkeypatch.setattr(session_module.Weights, "from_model", slow_from_model)
    ex = open_explorer(ckpt, cache_dir=None)
    bg = start_background(make_app(ex))
    try:
        assert call(bg.url, "GET", "/")[0] == 200  # served while the weights are still being built
        assert view(bg.url, "model")[0] == 200
        assert not built.is_set()
        got: list[Any] = []
        reader = threading.Thread(target=lambda: got.append(view(bg.url, "attention", {"text": "self", "head": "0.0"})))
        reader.start()
        time.sleep(0.5)
        assert not got  # the pattern waits for the weights
        gate.set()
        reader.join(60)
        assert got and got[0][0] == 200
        want = real(qkov.load(ckpt))
        assert torch.equal(ex.weights.W_Q, want.W_Q) and torch.equal(ex.weights.W_U, want.W_U)
    finally:
        gate.set()
        bg.stop()


def test_a_disk_entry_is_read_only_for_its_own_key(tmp_path: Path) -> None:
    tokens = torch.tensor([[0, 1, 2]])
    key = entry_key("heads", "f" * 64, tokens, {"seed": 0})
    assert key != entry_key("heads", "f" * 64, torch.tensor([[0, 1, 3]]), {"seed": 0})  # other tokens
    assert key != entry_key("heads", "f" * 64, tokens, {"seed": 1})  # other options
    assert key != entry_key("heads", "e" * 64, tokens, {"seed": 0})  # other weights
    path = entry_path(tmp_path / "made" / "here", "heads", key)
    write_entry(path, key, {"rows": [1, 2]})
    assert read_entry(path, key) == {"rows": [1, 2]}
    assert read_entry(path, "another key") is None
    for text in ["", "[]", '{"format": 1, "key": "' + key + '", "result": [1]}', "\x00\xff", '{"format": 99}']:
        path.write_text(text, encoding="latin-1")
        assert read_entry(path, key) is None, text
