"""Headless Chromium for the tests that open pages: the report, the dynamics and tour pages, and
exported notebooks.

Pages are opened from disk with the network cut off (every host name resolves to nothing); a page
probed with :data:`RESOURCES_PROBE` lists what it requested, so a test can assert it requested nothing;
a page probed with :data:`LAYOUT_PROBE` and opened at a width (:func:`at_width`) records which of its
text boxes overlap and whether it scrolls sideways (:func:`layout`)."""

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


def at_width(width: int, height: int = 1000) -> str:
    """The flag that opens a page in a window (viewport) ``width`` CSS pixels wide."""
    return f"--window-size={width},{height}"


# injected before </body>: once the page has drawn, every visible text fragment (one box per line
# of each text node, cut to what its scrolling or clipping ancestors show) and every chart (a
# plotly chart's stacked layers as one box, any other top-level <svg>) is collected, and the pairs
# that overlap by more than 2 px both ways are recorded with the page's widths on the root element
# (two lines of one text node are not a pair: a heading's tight line height lets them touch).
# Text inside a chart is the chart's own business (plotly places it) and is not collected.
LAYOUT_PROBE = """<script>
window.addEventListener("load", () => setTimeout(() => {
  const inter = (a, b) => ({ l: Math.max(a.l, b.l), t: Math.max(a.t, b.t),
    r: Math.min(a.r, b.r), b: Math.min(a.b, b.b) });
  const box = (r) => ({ l: r.left, t: r.top, r: r.right, b: r.bottom });
  const clips = new Map();
  function clip(elem) {  // the part of the page elem's content can show in (null: unclipped)
    if (!elem || elem === document.documentElement || elem === document.body) return null;
    if (clips.has(elem)) return clips.get(elem);
    let c = clip(elem.parentElement);
    const s = getComputedStyle(elem);
    if (s.overflowX !== "visible" || s.overflowY !== "visible") {
      const own = box(elem.getBoundingClientRect());
      c = c ? inter(c, own) : own;
    }
    clips.set(elem, c);
    return c;
  }
  const boxes = [];
  function add(b, elem, what, node = elem) {  // b cut to what elem's clipping ancestors show
    const c = clip(elem);
    if (c) b = inter(b, c);
    if (b.r - b.l >= 1 && b.b - b.t >= 1) boxes.push(Object.assign(b, { elem, what, node }));
  }
  const charts = [...document.querySelectorAll(".js-plotly-plot")];
  for (const chart of charts) {
    const layers = [...chart.querySelectorAll("svg.main-svg")].map((s) => box(s.getBoundingClientRect()));
    if (!layers.length) continue;
    const union = (a, b) => ({ l: Math.min(a.l, b.l), t: Math.min(a.t, b.t),
      r: Math.max(a.r, b.r), b: Math.max(a.b, b.b) });
    add(layers.reduce(union), chart, "[chart]");
  }
  for (const svg of document.querySelectorAll("svg")) {
    if (svg.parentElement.closest("svg") || svg.closest(".js-plotly-plot")) continue;
    add(box(svg.getBoundingClientRect()), svg, "[svg]");
  }
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    const p = n.parentElement;
    if (!n.data.trim() || !p || p.closest("svg, script, style, select, template, noscript, .js-plotly-plot")) continue;
    if (getComputedStyle(p).visibility !== "visible") continue;
    const range = document.createRange();
    range.selectNodeContents(n);
    for (const r of range.getClientRects()) add(box(r), p, n.data.trim().slice(0, 60), n);
  }
  boxes.sort((a, b) => a.t - b.t);
  const overlaps = [];
  const fix = (b) => [b.what, Math.round(b.l), Math.round(b.t), Math.round(b.r), Math.round(b.b)];
  for (let i = 0; i < boxes.length; i++) {
    const a = boxes[i];
    for (let j = i + 1; j < boxes.length && boxes[j].t < a.b - 2; j++) {
      const b = boxes[j];
      const o = inter(a, b);
      if (o.r - o.l > 2 && o.b - o.t > 2 && a.node !== b.node) overlaps.push([fix(a), fix(b)]);
    }
  }
  document.documentElement.dataset.layout = JSON.stringify({
    width: window.innerWidth, scroll_width: document.documentElement.scrollWidth, boxes: boxes.length,
    charts: charts.length, overlaps: overlaps.slice(0, 30), n_overlaps: overlaps.length,
  });
}, 300));
</script>"""


def layout(dom: str) -> dict:
    """What :data:`LAYOUT_PROBE` recorded (``--dump-dom`` output): ``width`` (the viewport's),
    ``scroll_width`` (the page's), ``boxes`` (boxes collected), ``overlaps`` (the first 30 pairs:
    [text, left, top, right, bottom] each) and ``n_overlaps``."""
    m = re.search(r'data-layout="([^"]*)"', dom)
    assert m is not None, "the layout probe did not run"
    return json.loads(html.unescape(m.group(1)))


# evaluated in a drawn page (tests/cdp.py Chrome.eval): what of it does not fit. ``clipped``: chart titles
# reaching past their chart (the chart cuts them off) and headings or notes wider than their box; ``past``:
# tables whose visible part (cut to any scrolling ancestor) reaches past their section (the card); ``scrolled``:
# tables that fit only by scrolling sideways (their last column hidden); ``cells``: heatmap cell texts bigger
# than their cells (the first of each heatmap); and the counts of charts, heatmaps, cell texts and tables seen.
FIT_CHECK = """(() => {
  const out = { clipped: [], past: [], scrolled: [], cells: [], charts: 0, heatmaps: 0, cell_texts: 0, tables: 0 };
  const R = (e) => e.getBoundingClientRect();
  const name = (e) => (e.closest("[id]") || {}).id + ": " + (e.textContent || "").trim().slice(0, 70);
  for (const chart of document.querySelectorAll(".js-plotly-plot")) {
    out.charts++;
    const c = R(chart);
    for (const t of chart.querySelectorAll(".gtitle")) {
      const r = R(t);
      if (r.width && (r.left < c.left - 1 || r.right > c.right + 1)) out.clipped.push(name(t));
    }
    const trace = (chart.data || [])[0], drag = chart.querySelector("rect.nsewdrag");
    if (!trace || trace.type !== "heatmap" || !drag) continue;
    out.heatmaps++;
    const d = R(drag), cw = d.width / trace.z[0].length, ch = d.height / trace.z.length;
    for (const t of chart.querySelectorAll("g.heatmap-label text")) {
      out.cell_texts++;
      const r = R(t);
      if (r.width > cw || r.height > ch) {
        out.cells.push([name(t), Math.round(r.width), Math.round(r.height), Math.round(cw), Math.round(ch)]);
        break;
      }
    }
  }
  for (const e of document.querySelectorAll("h1, h2, h3, p.note")) {
    if (e.offsetParent && e.scrollWidth > e.clientWidth + 1) out.clipped.push(name(e));
  }
  for (const t of document.querySelectorAll("section table")) {
    if (!t.offsetParent) continue;
    out.tables++;
    const card = R(t.closest("section")), own = R(t);
    let right = own.right;
    for (let a = t.parentElement; a && a !== document.body; a = a.parentElement) {
      if (getComputedStyle(a).overflowX !== "visible") right = Math.min(right, R(a).right);
    }
    if (right > card.right + 0.5) out.past.push([name(t), Math.round(right - card.right)]);
    if (own.right > right + 0.5) out.scrolled.push([name(t), Math.round(own.right - right)]);
  }
  return out;
})()"""
