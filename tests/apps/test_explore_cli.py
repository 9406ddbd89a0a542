"""``qkov explore`` on the command line: one-line errors (bad source, port in use), the URL it prints, the
page it serves, a token for a non-loopback host, and Ctrl-C ending it with exit status 0."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from explore_helpers import call, one_line_error, tokenized_checkpoint, view
from helpers import ROOT, run_main
from qkov.apps.cli import build_parser

SRC = ROOT / "src"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenized_checkpoint(tmp_path_factory.mktemp("explore-cli"))


def test_defaults_bind_to_loopback() -> None:
    args = build_parser().parse_args(["explore", "some-model"])
    assert args.host == "127.0.0.1" and args.port == 8765 and args.token is None and not args.open


def test_a_bad_source_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    rc, out, err = run_main(capsys, "explore", tmp_path / "missing", "--port", "0")
    assert rc == 2 and out == ""
    assert err.startswith("qkov: error:") and err.count("\n") == 1 and "missing" in err


def test_a_text_that_cannot_be_read_is_one_line_and_exit_2(ckpt: Path, tmp_path: Path, capsys) -> None:
    rc, out, err = run_main(capsys, "explore", ckpt, "--text", tmp_path / "missing.txt", "--port", "0", "--no-cache")
    assert rc == 2 and out == "" and "Traceback" not in err
    assert err.startswith("qkov: error: cannot read the text") and err.count("\n") == 1, err


def test_a_port_in_use_is_one_line_and_exit_2(ckpt: Path, capsys) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        rc, out, err = run_main(capsys, "explore", ckpt, "--port", port, "--no-cache")
    assert rc == 2 and "Traceback" not in err
    assert err.startswith("qkov: error: cannot serve at 127.0.0.1:") and err.count("\n") == 1


@pytest.mark.parametrize("token", ["", " ", "too-short"])
def test_an_empty_or_short_token_is_one_line_before_anything_is_served(ckpt: Path, token: str, capsys) -> None:
    with socket.socket() as probe:  # a port that is free now: the command must refuse before binding it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    rc, out, err = run_main(capsys, "explore", ckpt, "--host", "0.0.0.0", "--port", port, "--token", token)
    assert rc == 2 and out == "" and "Traceback" not in err
    assert err.startswith("qkov: error: --token: a token must be at least 16 characters") and err.count("\n") == 1


def test_allow_host_needs_a_token(ckpt: Path, capsys) -> None:
    rc, _, err = run_main(capsys, "explore", ckpt, "--port", "0", "--allow-host", "box.lan", "--no-cache")
    assert rc == 2 and "--allow-host applies with a token" in err and err.count("\n") == 1


def start(ckpt: Path, *flags: str, cache: Path) -> tuple[subprocess.Popen[str], str]:
    """``python -m qkov explore CKPT --port 0 FLAGS`` in a subprocess, and the URL it printed."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "QKOV_CACHE": str(cache)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "qkov", "explore", str(ckpt), "--port", "0", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    line = proc.stdout.readline()  # blocks until it prints (or exits)
    if "serving" not in line:
        proc.kill()
        pytest.fail(f"no URL printed: {line!r} {proc.stderr.read()!r}")
    return proc, line.split(" at ", 1)[1].strip()


def stop(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, out, err


def test_serves_the_page_and_ctrl_c_exits_0(ckpt: Path, tmp_path: Path) -> None:
    proc, url = start(ckpt, cache=tmp_path / "cache")
    try:
        assert url.startswith("http://127.0.0.1:") and "token" not in url
        weights, peak, cache = (proc.stdout.readline() for _ in range(3))
        assert weights.startswith("qkov explore: weights: in memory") and re.fullmatch(
            r"qkov explore: peak memory so far: \d+\.\d\d GiB\n", peak
        )
        assert cache.startswith(f"qkov explore: disk cache: {tmp_path / 'cache' / 'explore'}")
        status, headers, body = call(url, "GET", "/")
        assert status == 200 and headers["content-type"].startswith("text/html") and b"ck3" in body
    finally:
        rc, out, err = stop(proc)
    assert rc == 0 and "Traceback" not in err, err
    assert "stopped" in out


def test_lazy_serves_the_model_from_disk_and_says_so(ckpt: Path, tmp_path: Path) -> None:
    """--lazy: the start lines say the weights stay on disk (with the peak memory), the model view says it is
    streamed, a text runs, and a view that would read every layer many times is one line (400)."""
    proc, url = start(ckpt, "--lazy", "--no-cache", cache=tmp_path / "cache")
    try:
        weights, peak = proc.stdout.readline(), proc.stdout.readline()
        assert weights.startswith("qkov explore: weights: read from disk layer by layer") and "not available: " in weights
        assert re.fullmatch(r"qkov explore: peak memory so far: \d+\.\d\d GiB \(nothing of the weights held\)\n", peak)
        status, model = view(url, "model")
        assert status == 200 and model["streamed"] is True and set(model["unavailable"]) >= {"heads", "patch"}
        status, text = view(url, "text", {"text": "def f(self):"})
        assert status == 200 and len(text["loss"]) == len(text["tokens"]) > 2
        status, headers, body = call(url, "GET", "/api/views/heads")
        assert status == 400 and "read from disk layer by layer" in one_line_error(status, headers, body)
    finally:
        rc, _, err = stop(proc)
    assert rc == 0 and "Traceback" not in err, err


def test_lazy_on_a_source_qkov_cannot_stream_is_one_line(tmp_path: Path, capsys) -> None:
    from qkov import ModelConfig, Transformer
    from qkov.io import save_tl

    save_tl(Transformer(ModelConfig(n_layers=1, n_heads=2, d_model=16, d_head=8, d_vocab=20, n_ctx=8)), tmp_path / "m.pt")
    rc, out, err = run_main(capsys, "explore", tmp_path / "m.pt", "--lazy", "--port", "0", "--no-cache")
    assert rc == 2 and out == "" and err.startswith("qkov: error: --lazy reads qkov checkpoints") and err.count("\n") == 1


def test_a_non_loopback_host_gets_a_token(ckpt: Path, tmp_path: Path) -> None:
    proc, url = start(ckpt, "--host", "0.0.0.0", "--no-cache", cache=tmp_path / "cache")
    try:
        assert url.startswith("http://0.0.0.0:") and "?token=" in url
        token = url.split("?token=")[1]
        assert len(token) >= 24
        local = url.replace("0.0.0.0", "127.0.0.1", 1).split("?")[0]
        status, headers, body = call(local, "GET", "/api/views/model")
        assert status == 403 and "token" in one_line_error(status, headers, body)
        assert call(local, "GET", f"/?token={token}")[0] == 200
        assert "disk cache: nowhere" in [proc.stdout.readline() for _ in range(3)][-1]
    finally:
        rc, _, err = stop(proc)
    assert rc == 0 and "Traceback" not in err, err
    assert not (tmp_path / "cache").exists()  # --no-cache: nothing written


def test_the_web_stack_is_not_imported_by_import_qkov() -> None:
    code = "import sys, qkov; print(sorted(m for m in sys.modules if m.split('.')[0] in ('starlette', 'uvicorn')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ,
                         "PYTHONPATH": str(SRC)}, check=True).stdout  # fmt: skip
    assert out.strip() == "[]"


def test_a_script_that_opens_an_explorer_and_returns_exits_0(ckpt: Path) -> None:
    """The folded weights are built on a thread: a script that opens an explorer and ends at once waits for
    it (a daemon thread still inside torch at exit aborts the process: "terminate called without an active
    exception", exit 134)."""
    code = (
        "import sys; from qkov.apps.explore.session import open_explorer; "
        "ex = open_explorer(sys.argv[1], cache_dir=None); print(ex.name)"
    )
    res = subprocess.run([sys.executable, "-c", code, str(ckpt)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == ckpt.name
