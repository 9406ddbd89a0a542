/* qkov dynamics page: draws every section from the JSON embedded in the page (no network), with
 * the report library (report.js, loaded first): qkovReport.drawPage runs each section's renderer on
 * its own and marks its section data-rendered="ok" or "error" (data that cannot be read fails every
 * section, visibly); nothing goes to the console. */
"use strict";
(function () {
  const { el, fmt, note, table, plot } = window.qkovReport.helpers;
  const big = (v) => (v == null ? "–" : Number(v).toLocaleString("en-US", { maximumFractionDigits: 0 }));
  let D, S, X, AXIS, W, xaxis;  // set by prepare() from the page's data
  function prepare(data) {
    D = data;
    S = D.snapshots;
    X = S.map((s) => s.at);
    AXIS = D.axis === "tokens" ? "tokens seen" : "step";
    W = D.reading.windows;
    xaxis = { title: AXIS };
  }
  const COLORS = { induction: "#d3562f", previous_token: "#2a9d5b", icl: "#3056d3" };
  const NAMES = { induction: "induction score", previous_token: "previous-token score", icl: "in-context improvement" };
  function shade(which) {  // plotly shapes for the windows in ``which``
    return which.filter((k) => W[k]).map((k) => ({
      type: "rect", xref: "x", yref: "paper", x0: W[k].start, x1: W[k].end, y0: 0, y1: 1,
      fillcolor: COLORS[k], opacity: 0.12, line: { width: 0 },
    }));
  }

  function summary(sec) {
    note(sec, `${D.description}; ${S.length} snapshots; measured on ${D.sample}.`);
    const rows = ["induction", "previous_token", "icl"].map((k) => {
      const w = W[k];
      return [NAMES[k], w ? big(w.start) : "no window", w ? big(w.end) : "–", w ? big(w.peak) : "–",
        w ? fmt(w.rise) : "–", w ? fmt(w.sharpness, 1) : "–"];
    });
    table(sec, ["metric", `window start (${AXIS})`, "end", "fastest at", "rise", "sharpness"], rows).id = "windows";
    const m = D.reading.method;
    note(sec, `Method: each metric smoothed (median of 3, then 1-2-1); its rise is the largest increase; the window is the ` +
      `shortest span climbing ${Math.round(m.share * 100)}% of it, kept only when the rise is at least the metric's ` +
      `minimum (${Object.entries(m.min_rise).map(([k, v]) => NAMES[k] + " " + v).join(", ")}) and the window is ` +
      `${m.sharpness}x steeper than the whole series on average. The in-context improvement is max(0, −ICL score): a model that predicts late tokens worse improves nothing in context.`);
    const t = D.reading.together;
    sec.append(el("p", { id: "together", text: t == null ? "No induction window: no phase change in this series." :
      t ? "The previous-token and in-context-learning windows overlap the induction window: they change together." :
        "The previous-token and in-context-learning windows do not both overlap the induction window." }));
  }

  function curves(sec) {
    const traces = [];
    const add = (key, sign, name, color, axis) => {
      if (S.every((s) => s[key] == null)) return;
      traces.push({ x: X, y: S.map((s) => (s[key] == null ? null : sign * s[key])), name, mode: "lines+markers",
        line: { color }, marker: { size: 4 }, yaxis: axis });
    };
    add("induction", 1, "induction score (best head)", COLORS.induction, "y");
    add("previous_token", 1, "previous-token score (best layer-0 head)", COLORS.previous_token, "y");
    add("icl_improvement", 1, "in-context improvement (max(0, −ICL), nats)", COLORS.icl, "y2");
    plot(sec, traces, { title: "detectors over training (windows shaded)", xaxis, shapes: shade(["induction", "previous_token", "icl"]),
      yaxis: { title: "attention score", range: [0, 1] }, yaxis2: { title: "nats", overlaying: "y", side: "right" },
      height: 420, legend: { orientation: "h", y: -0.25 } });
    const rep = [["repeat_first", "1st copy", "#8a8f99"], ["repeat_second", "2nd copy", "#d3562f"]];
    plot(sec, rep.map(([k, name, color]) => ({ x: X, y: S.map((s) => s[k]), name, mode: "lines+markers", line: { color } })),
      { title: "loss on repeated random tokens", xaxis, yaxis: { title: "loss (nats)" }, shapes: shade(["induction"]), height: 320 });
  }

  function loss(sec) {
    if (S.every((s) => s.val_loss == null)) { note(sec, "No natural text: no validation loss."); return; }
    const traces = [{ x: X, y: S.map((s) => s.val_loss), name: "validation loss", mode: "lines+markers", line: { color: "#1d2330" } }];
    const b = D.reading.bump;
    if (b) traces.push({ x: b.fit_tokens, y: b.fit, name: "smooth fit outside the window", mode: "lines", line: { dash: "dot", color: "#d3562f" } });
    const pos = X.filter((x) => x > 0);
    plot(sec, traces, { title: "validation loss", xaxis: { title: AXIS, type: "log", range: pos.length ? [Math.log10(pos[0]), Math.log10(pos[pos.length - 1])] : undefined },
      yaxis: { title: "loss (nats)" }, shapes: shade(["induction"]), height: 360 });
    sec.append(el("p", { id: "bump", text: b ? `Largest excess over the fit inside the induction window: ${fmt(b.height, 4)} nats at ` +
      `${big(b.at)} ${AXIS} (fit residual RMS ${fmt(b.noise, 4)}): ${b.seen ? "a bump" : "no bump above the noise"}.` :
      "No bump measured (no induction window, or too few snapshots around it)." }));
  }

  function heads(sec) {
    const h0 = S[S.length - 1].heads;
    if (!h0) { note(sec, "A model without attention heads."); return; }
    for (const [key, title] of [["prefix_matching", "prefix-matching score"], ["previous_token", "previous-token score"], ["eigen_copying", "eigenvalue copying score"]]) {
      if (!h0[key]) continue;
      const traces = [];
      h0[key].forEach((row, l) => row.forEach((_, h) => traces.push({ x: X, y: S.map((s) => s.heads[key][l][h]), name: `${l}.${h}`, mode: "lines" })));
      plot(sec, traces, { title: `${title} per head`, xaxis, shapes: shade(["induction"]), height: 320 });
    }
    const k = S.map((s) => (s.k_composition ? `${s.k_composition.writer}→${s.k_composition.reader}` : null));
    if (k.some((v) => v)) {
      plot(sec, [{ x: X, y: S.map((s) => (s.k_composition ? s.k_composition.adjusted : null)), text: k, mode: "lines+markers",
        name: "strongest K-composition", hovertemplate: "%{text}: %{y:.3f}<extra></extra>" }],
      { title: "strongest K-composition pair (adjusted score; hover for the pair)", xaxis, shapes: shade(["induction"]), height: 300 });
    }
  }

  function trajectory(sec) {
    const tr = D.reading.trajectory;
    if (!tr) { note(sec, "No per-token losses (no natural text)."); return; }
    const w = W.induction;
    const inside = X.map((x) => w && x >= w.start && x <= w.end);
    plot(sec, [{ x: tr.components.map((c) => c[0]), y: tr.components.map((c) => c[1] || 0), mode: "lines+markers", text: S.map((s) => s.label),
      marker: { size: 7, color: inside.map((v) => (v ? "#d3562f" : "#8a8f99")) }, line: { color: "#c9ccd3" }, name: "snapshots" }],
    { title: "per-token losses on their first two principal components (induction window in red)", height: 420,
      xaxis: { title: `PC1 (${fmt(100 * tr.explained[0], 1)}% of variance)` }, yaxis: { title: `PC2 (${fmt(100 * (tr.explained[1] || 0), 1)}%)` } });
  }

  function ablation(sec) {
    const a = D.ablation;
    if (!a) { note(sec, "No induction heads in the last snapshot: nothing to ablate."); return; }
    note(sec, `Heads ${a.heads.join(", ")} (the last snapshot's induction heads), ${a.mode} ablation` +
      (a.mean_sample ? ` (mean over ${a.mean_sample})` : "") + `; beside ${a.random.length} random sets of as many other heads.`);
    const row = (name, m) => [name, fmt(m.loss, 4), fmt(m.icl, 4), fmt(m.repeat_first, 3), fmt(m.repeat_second, 3)];
    const rows = [row("intact", a.intact), row(`ablated ${a.heads.join(", ")}`, a.ablated)];
    a.random.forEach((m, i) => rows.push(row(`random ${a.random_heads[i].join(", ")}`, m)));
    table(sec, ["model", "validation loss", "ICL score", "repeated: 1st copy", "2nd copy"], rows).id = "ablation-table";
    sec.append(el("p", { id: "icl-removed", text: `Share of the in-context improvement removed: ${fmt(a.icl_removed, 2)} by the induction heads, ` +
      `${fmt(a.random_icl_removed_median, 2)} by random heads (median; mean ${fmt(a.random_icl_removed, 2)}).` }));
  }

  function snapshots(sec) {
    table(sec, ["snapshot", "step", "tokens", "val loss", "ICL", "induction", "previous-token", "K-composition", "s"],
      S.map((s) => [s.label, big(s.step), big(s.tokens), fmt(s.val_loss, 4), fmt(s.icl, 4), fmt(s.induction), fmt(s.previous_token),
        s.k_composition ? `${s.k_composition.writer}→${s.k_composition.reader} ${fmt(s.k_composition.adjusted)}` : "–", fmt(s.seconds, 2)])).id = "snapshot-table";
  }

  const RENDER = { summary, curves, loss, heads, trajectory, ablation, table: snapshots };
  window.qkovReport.drawPage("qkov-dynamics", RENDER, {}, prepare);
})();
