/* qkov architectures page: the variants of the 2-layer model compared, drawn from the JSON embedded in
 * the page (no network) with the report library (report.js, loaded first): qkovReport.drawPage runs
 * each section's renderer on its own and marks its section data-rendered="ok" or "error". */
"use strict";
(function () {
  const { el, fmt, signed, note, table, plot } = window.qkovReport.helpers;
  const big = (v) => (v == null ? "–" : Number(v).toLocaleString("en-US", { maximumFractionDigits: 0 }));
  const mega = (v) => `${(v / 1e6).toFixed(1)}M`;
  const span = (w) => (w ? `${mega(w.start)} – ${mega(w.end)} (fastest ${mega(w.peak)})` : "no window");
  const change = (c) => {  // one line per changed field: "residual hyper", "n_streams 4" (never broken inside)
    const pairs = Object.entries(c);
    return pairs.length ? el("span", {}, ...pairs.map(([k, v]) => el("div", { text: `${k} ${v}` }))) : "–";
  };
  const bus = (b) => (b ? `${b.streams} x ${b.d_model}` : "–");
  const overlap = (b) => (b ? b.overlap.map((o) => fmt(o, 2)).join(" ") : "–");
  const kc = (k) => (k ? `${k.writer} → ${k.reader}: ${fmt(k.adjusted, 2)}` : "–");
  const pct = (v) => (v == null ? "–" : `${(100 * v).toFixed(0)}%`);
  // the share means something only where noising the head matters: at least a tenth of the repeat's advantage
  const kp = (k) => {
    if (!k) return "–";
    const effect = k.loss_head - k.loss_clean, gap = k.loss_corrupted - k.loss_clean;
    if (k.share == null || !(gap > 0) || effect < 0.1 * gap) {
      return `none (${k.reader}: ${signed(effect)} nats)`;
    }
    return `${pct(k.share)} (${k.writer} → ${k.reader})`;
  };

  function variants(sec, D) {
    sec.append(el("p", { class: "note" },
      `${D.variants.length} variants, ${big(D.steps)} steps each, on ${D.corpus || "the built-in corpus"} ` +
      `(${D.device || "–"}); this run of the study took ${big(D.seconds)} s (finished runs in its directory are ` +
      "reused). Tokens/s is the training throughput of each variant on this machine, the cost of its extra. " +
      "Bus width: streams x d_model, with each stream's write overlap (the mean overlap of the writers' subspaces); " +
      "a routed model's K-composition is weighted by how much of the writer reaches the reader. " +
      "K path share: the share of the induction head's effect on the loss of repeated random tokens (its output " +
      "noised with a non-repeating run's) that noising the path from the previous-token head into its keys alone " +
      "carries (path patching; the routing frozen at the repeated run's values); \"none\" where noising that head " +
      "costs less than a tenth of what the repeat saves (no induction head to speak of; beside it, the loss that noising the head adds)."));
    const base = D.variants.find((r) => r.variant === "standard");
    if (base) sec.append(el("p", { class: "note" }, `The model: ${base.model}; each variant changes what its row says.`));
    table(sec, ["variant", "changes", "parameters", "tokens/s", "validation loss", "ICL score (nats)",
      "induction score", "phase change (tokens)", "strongest K-composition", "K path share", "max sink mass",
      "bus width", "write overlap"],
    D.variants.map((r) => [r.dynamics ? el("a", { href: r.dynamics, text: r.variant }) : r.variant, change(r.config),
      big(r.parameters), big(r.tokens_per_s),
      r.diverged != null ? `diverged at step ${big(r.diverged)}` : fmt(r.val_loss, 4), signed(r.icl), fmt(r.induction), span(r.phase_change),
      kc(r.k_composition), kp(r.k_path_share), fmt(r.max_sink), bus(r.bandwidth), overlap(r.bandwidth)]), [0, 1], [7, 9]);
  }

  const done = (D) => D.variants.filter((r) => r.diverged == null);
  function phase(sec, D) {
    const row = el("div", { class: "cols" });
    sec.append(row);
    for (const [key, title, axis] of [["induction", "induction score", "attention"],
      ["icl_improvement", "in-context improvement", "nats"]]) {
      const box = el("div");
      row.append(box);
      plot(box, done(D).map((r) => ({ x: r.curves.tokens, y: r.curves[key], name: r.variant,
        mode: "lines+markers", marker: { size: 3 } })), {
        title: { text: title }, width: 560, height: 360, xaxis: { title: { text: "tokens seen" } },
        yaxis: { title: { text: axis } }, legend: { orientation: "h", y: -0.3 }, margin: { l: 60, r: 20, t: 40, b: 50 },
      });
    }
  }

  function loss(sec, D) {
    const runs = D.variants.filter((r) => r.loss_curve && r.loss_curve.tokens.length);
    if (!runs.length) { note(sec, "No evaluations were logged."); return; }
    plot(sec, runs.map((r) => ({ x: r.loss_curve.tokens, y: r.loss_curve.val_loss, name: r.variant, mode: "lines" })), {
      title: { text: "validation loss" }, height: 380, xaxis: { title: { text: "tokens seen" } },
      yaxis: { title: { text: "loss (nats)" } }, legend: { orientation: "h", y: -0.25 },
    });
  }

  function grid(sec, D, key, runs) {
    const L = Math.max(...runs.map((r) => r[key].length));
    const H = Math.max(...runs.map((r) => Math.max(...r[key].map((h) => h.length))));
    const head = ["variant"];
    for (let l = 0; l < L; l++) for (let h = 0; h < H; h++) head.push(`${l}.${h}`);
    table(sec, head, runs.map((r) => {
      const cells = [r.variant];
      for (let l = 0; l < L; l++) for (let h = 0; h < H; h++) {
        const v = (r[key][l] || [])[h];
        cells.push(v == null ? "–" : fmt(v, 2));
      }
      return cells;
    }), [0]);
  }

  function sinks(sec, D) {
    grid(sec, D, "sink_mass", done(D));
    const gated = done(D).filter((r) => r.gate_mean);
    if (!gated.length) return;
    sec.append(el("p", { class: "note" }, "Gated variants: each head's mean gate (the share of its output the " +
      "gate lets through, averaged over positions and channels), then the fraction of gate values below 0.1."));
    grid(sec, D, "gate_mean", gated);
    grid(sec, D, "gate_sparsity", gated);
  }

  function orders(sec, D) {
    plot(sec, done(D).map((r) => ({ x: r.paths_by_order.map((_, k) => k), y: r.paths_by_order, name: r.variant,
      mode: "lines+markers" })), {
      title: { text: "loss of the paths through at most k heads" }, height: 380,
      xaxis: { title: { text: "k (heads on the path)" }, dtick: 1 }, yaxis: { title: { text: "loss (nats)" } },
      legend: { orientation: "h", y: -0.25 },
    });
  }

  window.qkovReport.drawPage("qkov-architectures", { variants, phase, loss, sinks, orders });
})();
