"""Shared by the ``qkov explore`` tests: a small checkpoint with a tokenizer, and plain HTTP calls over real
sockets (the standard library's client, so nothing in the test can hide what the server sent)."""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import qkov
from qkov import ModelConfig, Transformer
from qkov.training.data import train_tokenizer

TEXT = "def f(self): return self.x\n"
CONTEXT = 24


def tokenized_checkpoint(folder: Path, *, seed: int = 3) -> Path:
    """A 2-layer, 2-head attention-only qkov checkpoint with a byte-level BPE tokenizer (start token 0)."""
    tok = train_tokenizer([TEXT] * 20, 64, start="<|endoftext|>", alphabet=list("def(slf):rtunx.\n "))
    cfg = ModelConfig(n_layers=2, n_heads=2, d_model=32, d_head=16, d_vocab=tok.get_vocab_size(), n_ctx=CONTEXT)
    path = folder / f"ck{seed}"
    qkov.save_checkpoint(Transformer(cfg, seed=seed), path, tokenizer_json=tok.to_str())
    return path


def call(
    url: str, method: str, path: str, body: Any = None, *, raw: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One request to the server at ``url``: ``(status, headers (lower-case names), body bytes)``. ``body`` is
    sent as JSON; ``raw`` as given."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def view(url: str, name: str, args: dict[str, Any] | None = None, **kw: Any) -> tuple[int, Any]:
    """``GET /api/views/NAME?args=...``: ``(status, parsed JSON)``."""
    status, _, body = call(url, "GET", f"/api/views/{name}?args={quote(json.dumps(args or {}))}", **kw)
    return status, json.loads(body)


def one_line_error(status: int, headers: dict[str, str], body: bytes) -> str:
    """The error message of a 4xx/5xx answer, checked to be one line of JSON ``{"error": ...}``."""
    assert 400 <= status < 600, status
    assert headers["content-type"].startswith("application/json"), headers
    text = body.decode()
    assert "\n" not in text.strip() and "Traceback" not in text, text
    data = json.loads(text)
    assert list(data) == ["error"] and isinstance(data["error"], str) and data["error"], data
    return data["error"]
