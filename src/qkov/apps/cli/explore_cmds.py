"""``qkov explore SOURCE``: a local web server over one model, each view computed on demand.

The web stack (starlette, uvicorn: ~50 ms to import) is loaded with the command line, never by ``import qkov``."""

from __future__ import annotations

import argparse
import secrets
import sys
import webbrowser
from pathlib import Path
from typing import Any

from ...device import memory_budget, peak_resident
from ...errors import QkovError
from ...weights.lazy import weights_bytes
from ..explore.server import MIN_TOKEN, bind, check_token, is_loopback, make_app, server, url_of
from ..explore.context import Explorer
from ..explore.session import DEFAULT, open_explorer
from ..explore.views import IN_MEMORY_VIEWS
from .common import add_device, add_lazy, add_source_args, device, int_at_least, lazy

__all__ = ["add_explore", "CACHE_SHARE", "cmd_explore", "DEFAULT_PORT", "serve", "start_lines"]

DEFAULT_PORT = 8765
CACHE_SHARE = 4
"""The in-memory result cache holds at most 1/CACHE_SHARE of ``--max-memory`` (256 MiB without it)."""


def add_explore(sub: Any) -> None:
    p = sub.add_parser(
        "explore",
        help="a local web page over one model: texts, attention, heads, head cards, ablation, computed on demand",
        description=(
            "Serve a page over the model of SOURCE on this machine: type a text to see its tokens, loss per "
            "token and any head's attention; the heads table (on --text FILE, a qkov checkpoint's validation text "
            "or seeded random tokens; computed once per model and text and kept in the disk cache); each head's card, the composition graph, ablation and patching, each computed when asked "
            "by the library's functions. Binds to 127.0.0.1 by default; another --host requires a token "
            "(generated unless --token is given, and printed in the URL). Ctrl-C stops it."
        ),
    )
    add_source_args(p)
    p.add_argument(
        "--text", type=Path, metavar="FILE",
        help="a text file the heads table is measured on, as qkov heads --text FILE measures it (default: a qkov "
        "checkpoint's validation text; a model without a corpus: seeded random tokens, and the table says so)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, this machine only)")
    p.add_argument(
        "--port", type=int_at_least(0, "a port number"), default=DEFAULT_PORT,
        help=f"port (default {DEFAULT_PORT}; 0 = any free port)",
    )
    p.add_argument("--open", action="store_true", help="open the page in the default browser")
    p.add_argument(
        "--token",
        help=f"require this token on every request, at least {MIN_TOKEN} characters (default: none on loopback, "
        "else generated)",
    )
    p.add_argument(
        "--allow-host", action="append", default=[], metavar="NAME",
        help="with a token: also answer requests addressed to NAME (a DNS name of this machine; loopback, the "
        "address connected to and this machine's hostname are always answered)",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--cache-dir", type=Path,
        help="where once-per-model results (the heads table) are kept (default: explore/ in qkov's cache, "
        "$QKOV_CACHE or $XDG_CACHE_HOME/qkov or ~/.cache/qkov)",
    )
    g.add_argument("--no-cache", action="store_true", help="keep nothing on disk")
    p.add_argument("--access-log", action="store_true", help="print one line per HTTP request")
    add_lazy(p)
    add_device(p)
    p.set_defaults(func=cmd_explore)


def cmd_explore(args: argparse.Namespace) -> int:
    if args.port > 65535:
        raise QkovError(f"--port {args.port}: a port is at most 65535")
    try:
        check_token(args.token)
    except QkovError as exc:
        raise QkovError(f"--token: {exc}") from None
    dev = device(args)
    token = args.token
    if token is None and not is_loopback(args.host):
        token = secrets.token_urlsafe(24)  # a non-loopback address is never served without one
    if args.allow_host and token is None:
        raise QkovError("--allow-host applies with a token (pass --token, or serve on another --host)")
    cache_dir = None if args.no_cache else (args.cache_dir or DEFAULT)
    sock = bind(args.host, args.port)  # first: a port in use is refused before the model is read
    try:
        ex = open_explorer(args.ckpt, device=dev, cache_dir=cache_dir, config=args.config, text=args.text, lazy=lazy(args))
        budget, _ = memory_budget(dev) if args.max_memory else (None, "")
        cache_bytes = 256 * 2**20 if budget is None else max(2**20, budget // CACHE_SHARE)
        hosts = (*args.allow_host, args.host)  # a --host given as a name is one of the server's names
        app = make_app(ex, token=token, hosts=hosts, cache_bytes=cache_bytes)
        url = url_of(sock, token)
        print(f"qkov explore: serving {ex.name} at {url}", flush=True)
        for line in start_lines(ex):
            print(f"qkov explore: {line}", flush=True)
        if args.open:
            webbrowser.open(url)
        try:
            serve(app, sock, access_log=args.access_log)
        finally:
            ex.settle()  # type: ignore[attr-defined]  (a Session: its weights' thread ends before we do)
    finally:
        sock.close()
    sys.stdout.write("qkov explore: stopped\n")
    return 0


def start_lines(ex: Explorer) -> list[str]:
    """What the command prints once the server is up: where the weights are, the peak memory so far, the disk cache."""
    peak = peak_resident()
    memory = "unknown" if peak is None else f"{peak / 2**30:.2f} GiB"
    if ex.streamed:
        size = weights_bytes(str(ex.extra["source"])) / 2**30
        names = ", ".join(sorted(IN_MEMORY_VIEWS))
        weights = (
            f"weights: read from disk layer by layer as each view needs them (memory-mapped, {size:.1f} GiB); texts "
            f"up to {ex.max_tokens:,} tokens; not available: {names}"
        )
        memory += " (nothing of the weights held)"
    else:
        weights = "weights: in memory (the folded view is built in the background; the loaded model is then dropped)"
    where = "nowhere (--no-cache)" if ex.cache_dir is None else str(ex.cache_dir)
    return [weights, f"peak memory so far: {memory}", f"disk cache: {where}; Ctrl-C stops"]


def serve(app: Any, sock: Any, *, access_log: bool) -> None:
    """Run uvicorn on ``sock`` until Ctrl-C (uvicorn shuts down cleanly and re-raises the signal: caught)."""
    try:
        server(app, access_log=access_log).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        app.state.runner.close()
