/* qkov tour page: the comparison of the tour's models, drawn from the JSON embedded in the page (no
 * network) with the report library (report.js, loaded first): qkovReport.drawPage runs each
 * section's renderer on its own and marks its section data-rendered="ok" or "error" (data that
 * cannot be read fails every section, visibly); nothing goes to the console. */
"use strict";
(function () {
  const { el, fmt, signed, note, table, plot } = window.qkovReport.helpers;
  const big = (v) => (v == null ? "–" : Number(v).toLocaleString("en-US", { maximumFractionDigits: 0 }));

  function models(sec, D) {
    const m = D.meta;
    sec.append(el("p", { class: "note" },
      `Trained on ${m.corpus || "the built-in corpus"} with qkov's default settings on ${m.device || "–"}; this run ` +
      `of the tour took ${big(m.seconds)} s (models already trained in its directory are reused; training times ` +
      "are in the table). Each model links to its full report."));
    table(sec, ["model", "parameters", "tokens", "validation loss", "ICL score (nats)",
      "repeated tokens: loss 1st / 2nd copy", "max prefix matching", "copying heads", "training s"],
    D.models.map((r) => [el("a", { href: r.report, text: `${r.layers}-layer` }), big(r.parameters), big(r.tokens),
      fmt(r.val_loss, 4), signed(r.icl), `${fmt(r.repeat_first, 2)} / ${fmt(r.repeat_second, 2)}`,
      fmt(r.max_prefix_matching), `${r.copying_heads} / ${r.heads}`, big(r.wall_s)]), [0]);
  }

  function curves(sec, D) {
    const named = Object.entries(D.curves).filter(([, ys]) => ys && ys.length);
    if (!named.length) { note(sec, "No validation text: no loss by position."); return; }
    plot(sec, named.map(([name, ys]) => ({ x: ys.map((_, i) => i + 1), y: ys, name, mode: "lines" })), {
      title: { text: "validation loss by token position" }, height: 360,
      xaxis: { title: { text: "token index" }, type: "log", dtick: 1 }, yaxis: { title: { text: "loss (nats)" } },
    });
  }

  const COLORS = { induction: "#d3562f", previous_token: "#2a9d5b", icl_improvement: "#3056d3" };
  const NAMES = { induction: "induction score", previous_token: "previous-token score",
    icl_improvement: "ICL improvement (nats)" };
  function phase(sec, D) {
    const P = D.phase;
    if (!P.runs.length) { note(sec, "No snapshots: the runs kept none."); return; }
    const row = el("div", { class: "cols" });
    sec.append(row);
    for (const r of P.runs) {
      const box = el("div");
      row.append(box);
      const traces = ["induction", "previous_token", "icl_improvement"].filter((k) => r[k].some((v) => v != null))
        .map((k) => ({ x: r.at, y: r[k], name: NAMES[k], mode: "lines+markers", marker: { size: 4 },
          line: { color: COLORS[k] }, yaxis: k === "icl_improvement" ? "y2" : "y" }));
      const w = r.window;
      plot(box, traces, {
        title: { text: `${r.layers}-layer: detectors over training` }, width: 560, height: 340,
        xaxis: { title: { text: r.axis === "tokens" ? "tokens seen" : "step" } },
        yaxis: { title: { text: "attention score" }, range: [0, 1] },
        yaxis2: { title: { text: "nats" }, overlaying: "y", side: "right", range: [0, P.icl_top] },
        legend: { orientation: "h", y: -0.3 }, margin: { l: 60, r: 60, t: 40, b: 50 },
        shapes: w ? [{ type: "rect", xref: "x", yref: "paper", x0: w.start, x1: w.end, y0: 0, y1: 1,
          fillcolor: COLORS.induction, opacity: 0.12, line: { width: 0 } }] : [],
      });
      box.append(el("p", { class: "note" }, el("a", { href: r.link, text: `${r.layers}-layer dynamics page` }),
        ` (induction window: ${r.span})`));
    }
  }

  function circuit(sec, D) {
    if (!D.circuit) { note(sec, "No 2-layer model in this tour: no circuit."); return; }
    window.qkovReport.sections.circuit(sec, D.circuit);
  }

  const VERDICT = (holds) => (holds === true ? "agrees" : holds === false ? "differs" : "compare");
  function claims(sec, D) {
    const verdict = (c) => el("span", { class: "verdict " + VERDICT(c.holds), text: VERDICT(c.holds) });
    const t = table(sec, ["claim (paper)", "measured here", "", "verdict rule (against the paper's number)"],
      D.claims.map((c) => [c.claim, c.measured, verdict(c), c.rule]), [0, 1, 3], [0, 1, 3]);
    t.classList.add("claims");
    ["30%", "34%", "5.5em", ""].forEach((w, i) => { t.rows[0].cells[i].style.width = w; });
  }

  window.qkovReport.drawPage("qkov-tour", { models, curves, phase, circuit, claims });
})();
