"""Headless Chromium for the tests that open pages: the report and exported notebooks.

Pages are opened from disk with the network cut off (every host name resolves to nothing); a page
probed with :data:`RESOURCES_PROBE` lists what it requested, so a test can assert it requested nothing."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def chromium(url: str, profile: Path, *extra: str) -> subprocess.CompletedProcess:
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        "--host-resolver-rules=MAP * ~NOTFOUND",
        f"--user-data-dir={profile}",
        "--enable-logging=stderr",
        "--v=0",
        "--virtual-time-budget=10000",
    ]
    assert CHROMIUM is not None
    return subprocess.run([CHROMIUM, *flags, *extra, url], capture_output=True, text=True, timeout=120)


def need_browser() -> None:
    if CHROMIUM is None:
        if os.environ.get("QKOV_REQUIRE_BROWSER") == "1":
            pytest.fail("chromium is required (QKOV_REQUIRE_BROWSER=1) but not installed: apt-get install chromium")
        pytest.skip("chromium not installed (apt-get install chromium); .ci/run installs it and requires this test")


def console_lines(res: subprocess.CompletedProcess) -> list[str]:
    """What the page wrote to the console (errors included)."""
    return [line for line in res.stderr.splitlines() if ":CONSOLE" in line]


# injected before </body>: on load, the page's element records every resource it requested
# (Resource Timing lists failed requests too, e.g. a CDN script whose host did not resolve)
RESOURCES_PROBE = (
    "<script>window.addEventListener('load', () => { document.documentElement.dataset.resources = "
    "JSON.stringify(performance.getEntriesByType('resource').map((e) => e.name)); });</script>"
)


def requested(dom: str) -> list[str]:
    """The URLs a page probed with :data:`RESOURCES_PROBE` requested (``--dump-dom`` output)."""
    m = re.search(r'data-resources="([^"]*)"', dom)
    assert m is not None, "the resource probe did not run"
    return [u for u in json.loads(html.unescape(m.group(1))) if not u.startswith(("data:", "blob:"))]
