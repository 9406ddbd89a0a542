"""The HTTP side of ``qkov explore``: a starlette app over one :class:`Explorer` (:func:`make_app`), served
by uvicorn (:func:`bind`, :func:`start_background`).

Routes: ``GET /`` the page; ``POST /api/jobs``, ``GET``/``DELETE /api/jobs/{id}`` the job API;
``GET``/``POST /api/views/{name}`` a view run to its end. Every error is one line of JSON
``{"error": ...}`` with its status (404 unknown view/job/head, 400 malformed, 413 body too large, 429 too
many jobs, 403 refused, 500 a bug, whose traceback goes to the server's stderr). With a token every request
must carry it (``?token=``, ``Authorization: token ...`` or the cookie the page sets); without one, only
requests whose ``Host`` is a loopback name are answered (no DNS rebinding), and a request that changes
state must come from the page's own origin. With a token the ``Host`` is checked too: a loopback name,
the address the request arrived at, this machine's name or a name the server was told to accept
(:func:`check_token`: a token is at least :data:`MIN_TOKEN` visible characters).
The page is sent with a strict Content-Security-Policy (a
fresh nonce per response for its inline scripts, ``connect-src 'self'``).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import secrets
import socket
import threading
from dataclasses import dataclass
from html import escape
from importlib import resources
from typing import Any, Mapping
from urllib.parse import quote, urlsplit

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ...errors import QkovError
from ..report.render import render_template
from .context import BadRequest, Explorer
from .jobs import Job, JobRunner, one_line
from .views import QUICK_VIEWS, VIEWS

__all__ = [
    "Background",
    "bind",
    "COOKIE",
    "csp",
    "error",
    "finished",
    "Guard",
    "http_error",
    "internal_error",
    "is_loopback",
    "job_response",
    "LOOPBACK_NAMES",
    "make_app",
    "MAX_BODY",
    "page_html",
    "read_json",
    "SECURITY_HEADERS",
    "server",
    "start_background",
    "url_of",
    "user_error",
]

MAX_BODY = 1 << 20
"""Bytes a request body may hold (a text of the model's context is far less); more is refused (413)."""

COOKIE = "qkov_explore_token"
LOOPBACK_NAMES = {"127.0.0.1", "localhost", "::1"}
MIN_TOKEN = 16
"""Characters a token must have at least (a generated one has 32): an empty or short one is refused."""


def check_token(token: str | None) -> None:
    """Refuse a token that would not protect anything: empty, blank, shorter than :data:`MIN_TOKEN`
    characters, or holding spaces or characters a URL cannot carry as they are (``None``: no token).

    Raises:
        QkovError: the token is not a string of at least :data:`MIN_TOKEN` visible ASCII characters.
    """
    if token is None:
        return
    if not isinstance(token, str):
        raise QkovError(f"a token must be a string, got {type(token).__name__}")
    if len(token) < MIN_TOKEN or not all(c.isascii() and c.isprintable() and not c.isspace() for c in token):
        raise QkovError(
            f"a token must be at least {MIN_TOKEN} characters, visible ASCII without spaces "
            f"(got {len(token)} characters{'' if token.strip() else ', all blank'})"
        )


def host_name(host_header: str) -> str:
    """The name in a ``Host`` header, without its port, lower-case (``""`` when it has none)."""
    try:
        return (urlsplit(f"//{host_header}").hostname or "").lower()
    except ValueError:  # a malformed port or bracket
        return ""


def machine_names() -> set[str]:
    """This machine's own names (``hostname``, its fully qualified form), lower-case."""
    names = {socket.gethostname().lower()}
    try:
        names.add(socket.getfqdn().lower())
    except OSError:
        pass
    return {n for n in names if n}


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or address) is this machine's loopback."""
    if host.strip("[]").lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def error(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": " ".join(str(message).split())}, status_code=status)


def csp(nonce: str) -> str:
    """The page's Content-Security-Policy: its inline scripts by nonce, nothing fetched but from this server."""
    return (
        f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data: blob:; font-src 'self' data:; connect-src 'self'; base-uri 'none'; "
        "form-action 'none'; frame-ancestors 'none'"
    )


SECURITY_HEADERS = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-store"}


class Guard:
    """ASGI middleware: the token, the ``Host`` and the ``Origin`` of state-changing requests are checked
    before any route runs; refusals are 403 with one-line JSON.

    Without a token only loopback names are answered. With one, the request must carry it, and its
    ``Host`` must be a loopback name, the address the request arrived at, this machine's name or one of
    ``hosts`` (a DNS name pointed at this machine by someone else, the rebinding of a page the user
    visits, is refused even with the token)."""

    def __init__(self, app: ASGIApp, token: str | None, hosts: tuple[str, ...] = ()) -> None:
        check_token(token)
        self.app, self.token = app, token
        self.hosts = {h.strip("[]").lower() for h in hosts} | (machine_names() if token is not None else set())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        why = self.refusal(Request(scope))
        if why is not None:
            await error(why, 403)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def refusal(self, request: Request) -> str | None:
        host = request.headers.get("host", "")
        name = host_name(host)
        if self.token is None:
            if not is_loopback(name):
                return f"refused: host {host!r} is not this machine's loopback (serve with --token to allow it)"
        else:
            given = (
                request.query_params.get("token")
                or request.headers.get("authorization", "").removeprefix("token ").strip()
                or request.cookies.get(COOKIE)
                or ""
            )
            if not given or not hmac.compare_digest(given.encode(), self.token.encode()):
                return "refused: a token is required (open the URL the server printed, with its ?token=...)"
            arrived = (request.scope.get("server") or ("",))[0] or ""
            if not (is_loopback(name) or name in self.hosts or (name and name == arrived.lower())):
                return f"refused: host {host!r} is not a name of this server (serve with --allow-host to accept it)"
        origin = request.headers.get("origin")
        if request.method not in ("GET", "HEAD") and origin is not None and urlsplit(origin).netloc != host:
            return f"refused: a request from another origin ({origin})"
        return None


async def read_json(request: Request, max_body: int) -> Any:
    """The request's body as JSON (at most ``max_body`` bytes; empty: ``{}``).

    Raises:
        BadRequest: over the limit (413) or not JSON (400).
    """
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_body:
        raise BadRequest(f"the request body is {int(length):,} bytes; at most {max_body:,} are read", status=413)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_body:
            raise BadRequest(f"the request body is over {max_body:,} bytes", status=413)
    if not body.strip():
        return {}
    try:
        return json.loads(bytes(body))
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not JSON ({exc})") from None


def job_response(job: Job) -> Response:
    status = job.status if job.state == "error" else 200
    return Response(job.to_json(), status_code=status, media_type="application/json", headers=SECURITY_HEADERS)


async def finished(job: Job) -> Job:
    """Wait (without blocking the event loop) for ``job`` to finish."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def wake(_: Job) -> None:
        loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

    job.on_finish(wake)
    await done
    return job


def page_html(ex: Explorer, views: Mapping[str, Any], nonce: str) -> str:
    """The page: ``explore.html`` (with report.js and explore.js) when the package holds it, else a minimal
    placeholder; the ``model`` view's dict is its embedded data."""
    data = views["model"](ex, {}, lambda *a: None)
    folder = resources.files("qkov.apps.explore").joinpath("static")
    title = f"qkov explore: {ex.name}"
    if folder.joinpath("explore.html").is_file():
        styles = ("report.css", "explore.css") if folder.joinpath("explore.css").is_file() else ("report.css",)
        return render_template(
            "explore.html", data, ("report.js", "explore.js"), title, package="qkov.apps.explore", styles=styles,
            nonce=nonce,
        )
    return (
        f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{escape(title)}</title></head>"
        f"<body><h1>{escape(title)}</h1><p>The page is not built yet; the API is at /api/views/NAME.</p></body></html>"
    )


def make_app(
    ex: Explorer,
    *,
    token: str | None = None,
    hosts: tuple[str, ...] = (),
    views: Mapping[str, Any] | None = None,
    runner: JobRunner | None = None,
    cache_bytes: int = 256 * 2**20,
    max_body: int = MAX_BODY,
) -> Starlette:
    """The starlette app serving ``ex``: ``views`` (default :data:`~qkov.apps.explore.views.VIEWS`) run by
    ``runner`` (default: a :class:`JobRunner` with a result cache of ``cache_bytes``); ``token``: required
    on every request when given (:func:`check_token`); ``hosts``: the names a request's ``Host`` may give
    besides loopback, the address it arrived at and this machine's name (token mode).
    ``app.state.runner`` is the runner (``runner.close()`` stops it).

    Raises:
        QkovError: the token is empty, blank or too short (:func:`check_token`).
    """
    check_token(token)
    views = VIEWS if views is None else views
    runner = runner or JobRunner(ex, views, quick=QUICK_VIEWS, cache_bytes=cache_bytes)

    async def page(request: Request) -> Response:
        nonce = secrets.token_urlsafe(18)
        html_text = await asyncio.to_thread(page_html, ex, views, nonce)
        response = HTMLResponse(html_text, headers={**SECURITY_HEADERS, "Content-Security-Policy": csp(nonce)})
        if token is not None and request.query_params.get("token") == token:
            response.set_cookie(COOKIE, token, httponly=True, samesite="strict", path="/")
        return response

    async def post_job(request: Request) -> Response:
        body = await read_json(request, max_body)
        if not isinstance(body, dict) or not isinstance(body.get("view"), str):
            raise BadRequest('the body must be {"view": NAME, "args": {...}}')
        return job_response(runner.submit(body["view"], body.get("args", {})))

    async def get_job(request: Request) -> Response:
        return job_response(runner.get(request.path_params["id"]))

    async def delete_job(request: Request) -> Response:
        return job_response(runner.cancel(request.path_params["id"]))

    async def run_view(request: Request) -> Response:
        if request.method == "POST":
            args = await read_json(request, max_body)
        else:
            raw = request.query_params.get("args", "{}")
            if len(raw) > max_body:
                raise BadRequest(f"args is over {max_body:,} bytes", status=413)
            try:
                args = json.loads(raw)
            except ValueError as exc:
                raise BadRequest(f"args is not JSON ({exc})") from None
        job = await finished(runner.submit(request.path_params["name"], args))
        if job.state == "done" and job.result is not None:
            return Response(job.result, media_type="application/json", headers=SECURITY_HEADERS)
        return error(job.error or job.state, job.status if job.state == "error" else 409)

    app = Starlette(
        routes=[
            Route("/", page, methods=["GET"]),
            Route("/api/jobs", post_job, methods=["POST"]),
            Route("/api/jobs/{id}", get_job, methods=["GET"]),
            Route("/api/jobs/{id}", delete_job, methods=["DELETE"]),
            Route("/api/views/{name}", run_view, methods=["GET", "POST"]),
        ],
        exception_handlers={HTTPException: http_error, QkovError: user_error, Exception: internal_error},
    )
    app.add_middleware(Guard, token=token, hosts=tuple(hosts))
    app.state.runner = runner
    app.state.explorer = ex
    return app


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error(f"{exc.detail}: {request.method} {request.url.path}", exc.status_code)


async def user_error(request: Request, exc: Exception) -> Response:
    return error(one_line(exc), getattr(exc, "status", 400))


async def internal_error(request: Request, exc: Exception) -> Response:
    """A bug outside the views: 500, one line; starlette then re-raises it, and uvicorn logs its traceback
    to the server's stderr."""
    return error(f"internal error: {one_line(exc)}", 500)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (``port=0``: any free one), made before the server starts so a
    port in use is one line.

    Raises:
        QkovError: the address cannot be bound (in use, not this machine's, not permitted).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except (OSError, OverflowError) as exc:
        sock.close()
        why = getattr(exc, "strerror", None) or str(exc)
        raise QkovError(f"cannot serve at {host}:{port} ({why})") from None
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket, token: str | None = None) -> str:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/" + (f"?token={quote(token, safe='')}" if token else "")


def server(app: ASGIApp, *, access_log: bool = False) -> uvicorn.Server:
    """A uvicorn server for ``app`` (run it with ``server.run(sockets=[bind(...)])``)."""
    return uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=access_log, lifespan="off"))


@dataclass
class Background:
    """A server running on a thread (:func:`start_background`): its ``url``, stopped by :meth:`stop`."""

    url: str
    port: int
    uvicorn: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(timeout=10)
        state = getattr(self.uvicorn.config.app, "state", None)
        if getattr(state, "runner", None) is not None:
            state.runner.close()
        settle = getattr(getattr(state, "explorer", None), "settle", None)
        if settle is not None:
            settle()


def start_background(app: Starlette, host: str = "127.0.0.1", port: int = 0) -> Background:
    """Serve ``app`` on a thread (tests, notebooks); returns once it accepts connections."""
    sock = bind(host, port)
    srv = server(app)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True, name="qkov-explore-http")
    thread.start()
    while not srv.started:
        if not thread.is_alive():
            raise QkovError(f"the server at {host}:{port} did not start")
        threading.Event().wait(0.01)
    return Background(url=url_of(sock), port=sock.getsockname()[1], uvicorn=srv, thread=thread)
