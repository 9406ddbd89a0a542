"""A small driver for the system Chromium over the DevTools protocol (CDP), for the tests that use a
page the way a person does: load it, type, hover, click, and read what it shows.

One :class:`Chrome` is one headless browser (its own profile, the network cut off as in
tests/browser.py: every host name resolves to nothing, and only the address 127.0.0.1 is reached)
with one page target, spoken to over one WebSocket (``websocket-client``) in flattened-session mode.
While it runs it records what the page wrote to the console (``console``), the exceptions it threw
(``exceptions``), the browser's log entries (``log``) and the URL of every request it made
(``requests``). :meth:`Chrome.close` kills the browser's whole process group; use it as a context
manager (or a module fixture) so that happens when a test fails too.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import websocket

from browser import CHROMIUM


class CDPError(RuntimeError):
    """A DevTools command failed, or the page threw while evaluating an expression."""


def _flags(profile: Path, width: int, height: int) -> list[str]:
    return [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        "--hide-scrollbars",
        "--mute-audio",
        # every host name resolves to nothing, except the loopback address the tests serve on
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        f"--user-data-dir={profile}",
        f"--window-size={width},{height}",
        "--remote-debugging-port=0",
        "about:blank",
    ]


class Chrome:
    """A headless Chromium with one page, driven over the DevTools protocol.

    Args:
        width, height: the window (viewport) in CSS pixels.
        timeout: seconds to wait for the browser to start and for any one command's answer.
    """

    def __init__(self, *, width: int = 1280, height: int = 900, timeout: float = 30.0) -> None:
        assert CHROMIUM is not None, "call browser.need_browser() first"
        self.timeout = timeout
        self.console: list[dict[str, Any]] = []  # {type, text}
        self.exceptions: list[str] = []
        self.log: list[dict[str, Any]] = []  # {level, source, text, url}
        self.requests: list[str] = []
        self._tmp = tempfile.TemporaryDirectory(prefix="qkov-cdp-")
        self._profile = Path(self._tmp.name)
        self._proc: subprocess.Popen | None = subprocess.Popen(
            [CHROMIUM, *_flags(self._profile, width, height)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: close() kills every child with it
        )
        self._ws: websocket.WebSocket | None = None
        self._next_id = 0
        self._events: list[dict[str, Any]] = []
        self._session: str | None = None
        try:
            self._connect()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ start and stop
    def _connect(self) -> None:
        port_file = self._profile / "DevToolsActivePort"
        deadline = time.monotonic() + self.timeout
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise CDPError(f"chromium exited at start (status {self._proc.returncode})")
            lines = port_file.read_text().split("\n") if port_file.exists() else []
            if len(lines) >= 2 and lines[0].strip() and lines[1].strip():
                break
            if time.monotonic() > deadline:
                raise CDPError("chromium did not open its DevTools port")
            time.sleep(0.05)
        url = f"ws://127.0.0.1:{lines[0].strip()}{lines[1].strip()}"
        # no Origin header: Chromium refuses DevTools WebSockets from an origin it was not told to allow
        self._ws = websocket.create_connection(url, timeout=self.timeout, suppress_origin=True)
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self._session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Runtime", "Log", "Network", "Page"):
            self.send(f"{domain}.enable")

    def close(self) -> None:
        """Kill the browser (its process group) and remove its profile; safe to call twice."""
        if self._ws is not None:
            try:
                self._ws.close()
            except Exception:  # noqa: BLE001 - the browser may be gone already
                pass
            self._ws = None
        if self._proc is not None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._proc.wait(timeout=10)
            self._proc = None
        self._tmp.cleanup()

    def __enter__(self) -> Chrome:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ protocol
    def send(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one command (to the page's session once attached) and return its result; events that
        arrive meanwhile are recorded."""
        assert self._ws is not None, "the browser is closed"
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if self._session is not None:
            msg["sessionId"] = self._session
        self._ws.send(json.dumps(msg))
        while True:
            reply = self._receive(self.timeout)
            if reply is None:
                raise CDPError(f"{method}: no answer in {self.timeout} s")
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise CDPError(f"{method}: {reply['error'].get('message')}")
                return reply.get("result", {})

    def _receive(self, timeout: float) -> dict[str, Any] | None:
        """The next message (an event is recorded and also returned), or None after ``timeout`` s."""
        assert self._ws is not None
        self._ws.settimeout(timeout)
        try:
            raw = self._ws.recv()
        except websocket.WebSocketTimeoutException:
            return None
        msg = json.loads(raw)
        if "method" in msg:
            self._record(msg["method"], msg.get("params", {}))
        return msg

    def pump(self, seconds: float = 0.05) -> None:
        """Read the events that arrive within ``seconds``."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if self._receive(left) is None:
                break

    def _record(self, method: str, p: dict[str, Any]) -> None:
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
            self.console.append({"type": p.get("type"), "text": text})
        elif method == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            self.exceptions.append(str(d.get("exception", {}).get("description") or d.get("text")))
        elif method == "Log.entryAdded":
            e = p.get("entry", {})
            self.log.append({k: e.get(k) for k in ("level", "source", "text", "url")})
        elif method == "Network.requestWillBeSent":
            self.requests.append(p["request"]["url"])

    def problems(self) -> list[str]:
        """Console errors and warnings, exceptions and error-level log entries, as text."""
        out = [f"console.{c['type']}: {c['text']}" for c in self.console if c["type"] in ("error", "warning", "assert")]
        out += [f"exception: {e}" for e in self.exceptions]
        out += [
            f"log {e['level']} ({e['source']}): {e['text']} {e['url'] or ''}"
            for e in self.log
            if e["level"] in ("error", "warning")
        ]
        return out

    # ------------------------------------------------------------------ page
    def open(self, url: str, *, ready: str = "document.readyState === 'complete'") -> None:
        """Navigate to ``url`` and wait until the JS condition ``ready`` holds."""
        res = self.send("Page.navigate", url=url)
        if res.get("errorText"):
            raise CDPError(f"could not open {url}: {res['errorText']}")
        self.wait(ready)

    def eval(self, expression: str) -> Any:
        """The value of a JS expression in the page (promises awaited; returned by value)."""
        res = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            d = res["exceptionDetails"]
            raise CDPError(f"{expression[:80]!r} threw: {d.get('exception', {}).get('description') or d.get('text')}")
        return res["result"].get("value")

    def wait(self, condition: str, timeout: float = 30.0) -> Any:
        """Poll the JS expression ``condition`` until it is truthy; return its value. While a page loads
        the expression may throw (no document yet): that counts as not yet, and the last such error is
        named if the wait times out."""
        end = time.monotonic() + timeout
        last = ""
        while True:
            try:
                value = self.eval(condition)
            except CDPError as exc:
                value, last = None, f" (last: {exc})"
            if value:
                return value
            if time.monotonic() > end:
                raise CDPError(f"timed out after {timeout} s waiting for {condition}{last}")
            self.pump(0.05)

    def center(self, selector: str) -> tuple[float, float]:
        """The centre of the (first) element matching ``selector``, scrolled into view, in viewport pixels."""
        box = self.eval(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)}); if (!e) return null;"
            " e.scrollIntoView({block: 'center', inline: 'center'}); const r = e.getBoundingClientRect();"
            " return [r.left + r.width / 2, r.top + r.height / 2, r.width, r.height]; })()"
        )
        if box is None:
            raise CDPError(f"no element matches {selector!r}")
        if box[2] <= 0 or box[3] <= 0:
            raise CDPError(f"{selector!r} has no box (hidden?)")
        return box[0], box[1]

    def hover(self, selector: str) -> None:
        """Move the mouse onto the element's centre (real mouse events: mouseover/mouseenter fire)."""
        x, y = self.center(selector)
        self.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)

    def click(self, selector: str) -> None:
        x, y = self.center(selector)
        self.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def type_into(self, selector: str, text: str) -> None:
        """Focus the text box, select what it holds and type ``text`` over it (Input.insertText: the
        box's input events fire as for typing)."""
        self.eval(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); e.focus(); e.select(); }})()")
        self.send("Input.insertText", text=text)

    def screenshot(self, path: Path | str) -> None:
        """Save the whole page as a PNG (for a person looking at a failure)."""
        data = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        Path(path).write_bytes(base64.b64decode(data))
