/* qkov report: draws every section from JSON embedded in the page (no network).
 * The renderers are one library, window.qkovReport, defined once per page: the report page
 * draws its sections from #qkov-data; a notebook display (qkov.show) calls
 * qkovReport.mount(id) on its own element, whose data sits in the element "<id>-data"; the
 * dynamics and tour pages draw theirs with qkovReport.drawPage and the helpers.
 * Each section's renderer runs on its own; success sets data-rendered="ok" on the section,
 * failure shows the error in the section and sets data-rendered="error", so a test (or a
 * reader) sees which part failed; data that cannot be read fails every section, visibly.
 * Nothing is written to the console. */
"use strict";
(function () {
  if (window.qkovReport) return;  // a notebook may carry this script more than once
  // no mode bar: it hides titles and axis labels; drag to zoom and double-click to reset still work
  const CONFIG = { displaylogo: false, responsive: true, displayModeBar: false };

  // ------------------------------------------------------------------ helpers
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else node.setAttribute(k, v);
    }
    for (const c of children) if (c != null) node.append(c);
    return node;
  }
  const fmt = (v, d = 3) => (v == null || Number.isNaN(v) ? "–" : Number(v).toFixed(d));
  const sig = (v, d = 3) => (v == null || Number.isNaN(v) ? "–" : Number(v).toPrecision(d));  // d significant digits
  const signed = (v, d = 3) => (v == null ? "–" : (v >= 0 ? "+" : "") + Number(v).toFixed(d));
  const tok = (s) => JSON.stringify(s);  // quotes and escapes: whitespace tokens stay visible
  // tokens as running text, one string per token: its own string, except that a run of byte-fallback tokens
  // spelling UTF-8 characters (<0xE2><0x80><0x9C> for a quotation mark) shows each character on its first byte's
  // token and nothing on the others, and a byte that is a printable character, a tab or a newline shows as it;
  // any other byte keeps its <0xNN> name. A newline shows as ↵ and breaks the line.
  const BYTE = /^<0x([0-9A-Fa-f]{2})>$/;
  function runningText(tokens) {
    const byte = (t) => { const m = BYTE.exec(t); return m ? parseInt(m[1], 16) : null; };
    const width = (b) => (b == null ? 0 : b < 0x80 ? 1 : b >= 0xc2 && b < 0xe0 ? 2 : b >= 0xe0 && b < 0xf0 ? 3 :
      b >= 0xf0 && b < 0xf5 ? 4 : 0);  // bytes of the character a lead byte starts (0: none)
    const out = tokens.map((t) => String(t));
    for (let i = 0; i < tokens.length;) {
      const n = width(byte(tokens[i]));
      const bytes = tokens.slice(i, i + n).map(byte);
      let ch = null;
      if (n && bytes.length === n && bytes.every((b, k) => b != null && (k === 0 || (b & 0xc0) === 0x80))) {
        try { ch = new TextDecoder("utf-8", { fatal: true }).decode(new Uint8Array(bytes)); } catch (e) { ch = null; }
      }
      if (ch != null && n === 1 && !/^[\t\n\x20-\x7e]$/.test(ch)) ch = null;  // control bytes keep their names
      if (ch == null) { i++; continue; }
      out[i] = ch;
      for (let k = 1; k < n; k++) out[i + k] = "";
      i += n;
    }
    return out.map((s) => s.replace(/\n/g, "↵\n"));
  }
  function note(parent, text) { parent.append(el("p", { class: "note", text })); }
  // a table of rows (cells: text or nodes); leftCols are left-aligned, wrapCols' cells wrap their text,
  // chipCols' cells wrap between the chips (spans) they hold; the table returned sits in a div.table-scroll
  function table(parent, head, rows, leftCols = [], wrapCols = [], chipCols = []) {
    const t = el("table");
    const tr = el("tr");
    const left = (i) => (leftCols.includes(i) ? "l" : "");
    const cls = (i) => [left(i), wrapCols.includes(i) ? "w" : "", chipCols.includes(i) ? "chips-cell" : ""].join(" ").trim();
    head.forEach((h, i) => tr.append(el("th", { class: left(i), text: h })));
    t.append(tr);
    for (const r of rows) {
      const row = el("tr");
      r.forEach((c, i) => {
        const td = el("td", { class: cls(i) });
        if (c instanceof Node) td.append(c); else td.textContent = c;
        row.append(td);
      });
      t.append(row);
    }
    parent.append(el("div", { class: "table-scroll" }, t));  // a table wider than its card scrolls inside it
    return t;
  }
  function plot(parent, traces, layout, cls = "plot") {
    const div = el("div", { class: cls });
    parent.append(div);
    const base = { margin: { l: 60, r: 40, t: 40, b: 50 }, font: { size: 12 }, paper_bgcolor: "#fff",
      modebar: { orientation: "v" } };
    Plotly.newPlot(div, traces, Object.assign(base, layout), CONFIG);
    return div;
  }
  function absent(sec, obj) {
    if (obj && obj.absent) { sec.append(el("p", { class: "absent", text: obj.absent })); return true; }
    return false;
  }

  // ------------------------------------------------------------------ sections
  function card(sec, c, inputs) {
    const m = c.model;
    const arch = `${m.n_layers} layers × ${m.n_heads} heads, d_model ${m.d_model}, d_head ${m.d_head}, ` +
      `vocab ${m.d_vocab.toLocaleString("en-US")}, context ${m.n_ctx}, positions ${m.positional}, norm ${m.normalization}, ` +
      `MLP ${m.d_mlp || "none"}`;
    const rows = [["architecture", arch], ["parameters", (c.parameters || 0).toLocaleString("en-US")]];
    if (c.source) {
      const o = c.origin || { format: c.source, path: c.path };
      const what = { hf: "Hugging Face directory", tl: "TransformerLens file", hub: "Hugging Face Hub model" };
      rows.push(["imported from", `${what[o.format] || o.format}${o.family ? ` (${o.family})` : ""} ${o.path}`]);
      for (const w of o.warnings || []) rows.push(["import warning", w]);
      rows.push(["unknown", (c.unknown && c.unknown.length ? c.unknown : ["training history"]).join("; ")]);
    } else {
      rows.push(
        ["trained", `${(c.steps || 0).toLocaleString("en-US")} / ${(c.steps_planned || 0).toLocaleString("en-US")} ` +
          `steps, ${(c.tokens || 0).toLocaleString("en-US")} tokens` +
          (c.wall_s ? `, ${Math.round(c.wall_s)} s on ${c.device}` : "")],
        ["train loss", fmt(c.train_loss, 4)],
        ["validation loss", fmt(c.val_loss, 4)],
        ["induction score (training probe)", fmt(c.induction_score, 3)],
        ["corpus", String(c.corpus || "–")],
      );
    }
    const v = c.view || {};
    const done = [v.fold_ln && "LayerNorm folded into the readers", v.center_writing && "writers centred",
      v.center_unembed && "unembedding centred"].filter(Boolean);
    rows.push(["weights analysed", (done.length ? done.join(", ") : "as stored") +
      " (TransformerLens's processed weights by default)"]);
    rows.push(["analysed on", String(inputs || "–")]);
    table(sec, ["", ""], rows, [0, 1], [1]);  // long values (paths) wrap
    const cv = c.curve;
    if (cv && cv.tokens.length) {
      plot(sec, [
        { x: cv.tokens, y: cv.val_loss, name: "validation loss", mode: "lines+markers" },
        { x: cv.train_tokens, y: cv.train_loss, name: "train loss", mode: "lines", opacity: 0.6 },
        { x: cv.tokens, y: cv.induction, name: "induction score", yaxis: "y2", mode: "lines", line: { dash: "dot" } },
      ], {
        title: { text: "training curve" }, height: 330,
        xaxis: { title: { text: "tokens" } }, yaxis: { title: { text: "loss (nats)" } },
        yaxis2: { title: { text: "induction score" }, overlaying: "y", side: "right", range: [0, 1] },
        legend: { orientation: "h", y: -0.25 },
      });
    }
    if (c.bandwidth && c.bandwidth.length) {
      sec.append(el("h3", { text: "Bandwidth audit" }));
      note(sec, "Dimensions the components write to or read from the residual stream (computational " +
        "dimensions) before and after each layer, against d_model: above 1, the stream is a bottleneck.");
      table(sec, ["layer", "own", "before", "after", "before / d_model", "after / d_model"],
        c.bandwidth.map((b) => [b.layer, b.own, b.before, b.after, fmt(b.before_ratio, 2), fmt(b.after_ratio, 2)]));
    }
  }

  // inputs: what the pattern scores were measured on (the "inputs" line of `qkov heads`)
  function heads(sec, h, ev, vocab, inputs) {
    if (absent(sec, h)) return;
    const HEAD_COLS = h.columns;  // [label, score name], the same columns as `qkov heads`
    note(sec, "Per-head scores. Pattern scores (prev, self, sink, pos) are measured on the analysed tokens" +
      (inputs ? ` (${inputs}); ` : "; ") +
      "prefix matching, induction, " +
      "duplicate-token and [I] copying from repeated random tokens; eigen copying = Σλ / Σ|λ| of the full OV " +
      "circuit W_E W_OV W_U (1 = copies its input, −1 = suppresses it); own in topk = share of tokens whose own " +
      "logit is among the k largest of their OV row. Roles use the thresholds listed below.");
    const diag = Object.keys(h.rows[0] || {}).find((k) => k.startsWith("diag_top"));
    if (diag && h.diag_tokens && h.diag_tokens < vocab) {
      note(sec, `own in topk is estimated on a seeded sample of ${h.diag_tokens.toLocaleString("en-US")} of ` +
        `${vocab.toLocaleString("en-US")} tokens (standard error at most ` +
        `${(50 / Math.sqrt(h.diag_tokens)).toFixed(1)} points); qkov report --diag-sample sets the sample.`);
    }
    const shown = diag ? [...HEAD_COLS, [diag.replace("diag_", "own in "), diag]] : HEAD_COLS;
    const listed = h.max_rows ? h.rows.slice(0, h.max_rows) : h.rows;  // a notebook display lists the first ones
    table(sec, ["head", ...shown.map((c) => c[0]), "roles"],
      listed.map((r) => {
        const roles = el("span");
        (r.roles.length ? r.roles : ["–"]).forEach((x) => roles.append(el("span", { class: "role", text: x })));
        return [r.head, ...shown.map((c) => (r[c[1]] == null ? "n/a" : fmt(r[c[1]], 2))), roles];
      }), [shown.length + 1], [], [shown.length + 1]);
    if (listed.length < h.rows.length) note(sec, `... ${h.rows.length - listed.length} more heads (in the object)`);
    note(sec, "Thresholds: " + Object.entries(h.thresholds).map(([k, v]) => `${k} ${v}`).join(", ") +
      (h.memory_neurons ? `; memory-management neurons: ${h.memory_neurons}` : ""));
    const layers = [...new Set(h.rows.map((r) => r.layer))];
    const cols = ["#3056d3", "#d3562f", "#2a9d5b", "#9b59b6", "#c79a00", "#17a2b8"];
    const traces = layers.map((l, i) => {
      const rs = h.rows.filter((r) => r.layer === l);
      return {
        x: rs.map((r) => r.prefix_matching), y: rs.map((r) => r.eigen_copying), text: rs.map((r) => r.head),
        name: `layer ${l}`, mode: "markers+text", textposition: "middle right",
        marker: { size: 11, color: cols[i % cols.length] },
        hovertemplate: "head %{text}<br>prefix matching %{x:.3f}<br>eigen copying %{y:.3f}<extra></extra>",
      };
    });
    sec.append(el("h3", { text: "Copying vs prefix matching (the induction-head signature)" }));
    note(sec, "Induction heads sit top right: they attend to the token after an earlier copy of the current " +
      "token (prefix matching) and copy it (positive OV eigenvalues).");
    plot(sec, traces, {
      height: 420, width: 620, xaxis: { title: { text: "prefix-matching score" }, range: [-0.05, 1.05] },
      yaxis: { title: { text: "OV eigenvalue copying score" }, range: [-1.1, 1.15] },
      shapes: [{ type: "line", x0: h.thresholds.induction, x1: h.thresholds.induction, y0: -1.1, y1: 1.15,
        line: { dash: "dot", color: "#999" } }],
    });
    if (ev && !ev.absent) {
      sec.append(el("h3", { text: "Eigenvalues of each head's OV circuit (complex plane)" }));
      note(sec, "Eigenvalues of W_E W_OV W_U, each head scaled by its largest |λ| (in the title). Points on the " +
        "positive real axis mean copying; the unit circle is drawn for scale.");
      const grid = el("div", { class: "grid" });
      sec.append(grid);
      const circle = { type: "circle", x0: -1, y0: -1, x1: 1, y1: 1, line: { color: "#ccc" } };
      for (const e of ev.heads) {
        plot(grid, [{ x: e.re, y: e.im, mode: "markers", marker: { size: 5, color: "#3056d3" },
          hovertemplate: "%{x:.3f} %{y:+.3f}i<extra></extra>" }], {
          title: { text: `${e.head}: score ${signed(e.score, 2)}, max |λ| ${fmt(e.scale, 1)}`, font: { size: 11 } },
          width: 230, height: 230, margin: { l: 30, r: 10, t: 30, b: 25 }, showlegend: false,
          xaxis: { range: [-1.15, 1.15], zeroline: true }, yaxis: { range: [-1.15, 1.15], scaleanchor: "x" },
          shapes: [circle],
        }, "small");
      }
    }
  }

  // a heatmap's size for cols x rows cells (8 px cells at least, within 420..640 x 380..640 px), and whether
  // its cells are big enough to print their values in (else hovering a cell still gives them)
  function heatmapSize(cols, rows) {
    const width = Math.min(640, Math.max(420, 150 + 10 * cols)), height = Math.min(640, Math.max(380, 110 + 10 * rows));
    const cell = Math.min((width - 150) / Math.max(1, cols), (height - 110) / Math.max(1, rows));
    return { width, height, cellText: cell >= 30 };
  }
  function composition(sec, comp) {
    if (absent(sec, comp)) return;
    note(sec, "Composition score ‖W_A W_B‖_F / (‖W_A‖_F ‖W_B‖_F) between the output of an earlier head (rows) " +
      "and the query, key or value side of a later head (columns), minus the mean over random matrices of the " +
      "same shapes. Cells show the adjusted score (printed when the cells are big enough); hover shows the " +
      "adjusted and raw scores and the baseline.");
    const grid = el("div", { class: "cols" });
    sec.append(grid);
    for (const kind of ["q", "k", "v"].filter((k) => comp[k])) {
      const c = comp[kind];
      const custom = c.raw.map((row) => row.map((v) => [v, c.baseline_mean, c.baseline_std]));
      const size = heatmapSize(c.readers.length, c.writers.length);
      const div = el("div", { class: "heatmap-box", "data-kind": kind });
      div.style.width = `${size.width}px`;
      grid.append(div);
      // the title and its caption are page text (they wrap), not the chart's (a chart cuts a long title off)
      div.append(el("h3", { class: "heatmap-title", text: `${kind.toUpperCase()}-composition` }));
      note(div, `baseline ${fmt(c.baseline_mean)} ± ${fmt(c.baseline_std)} (random matrices of the same shapes)` +
        (c.offsets ? `; mean over query-key offsets ${c.offsets.join(", ")} (rotary)` : ""));
      const cells = size.cellText ? { texttemplate: "%{z:.2f}", textfont: { size: 10 } } : {};
      plot(div, [Object.assign({
        type: "heatmap", z: c.adjusted, x: c.readers, y: c.writers, customdata: custom, colorscale: "RdBu",
        reversescale: true, zmid: 0,
        hovertemplate: "%{y} → %{x}<br>adjusted %{z:.3f}<br>raw %{customdata[0]:.3f}<br>" +
          "baseline %{customdata[1]:.3f} ± %{customdata[2]:.3f}<extra></extra>",
        colorbar: { thickness: 10 },
      }, cells)], {
        width: size.width, height: size.height, margin: { l: 60, r: 40, t: 10, b: 50 },
        xaxis: { title: { text: "reader head" }, type: "category" },
        yaxis: { title: { text: "writer head" }, type: "category", autorange: "reversed" },
      });
      const top = c.top.slice(0, 5).map((p) => [p.writer, p.reader, signed(p.adjusted), fmt(p.raw)]);
      table(div, ["writer", "reader", "adjusted", "raw"], top);
    }
  }

  // what the virtual-head table holds: every virtual head, or the ones chosen by an upper bound
  function virtualNote(c) {
    if (!c) return "";
    const n = (v) => v.toLocaleString("en-US");
    if (c.materialised === c.pairs) return ` All ${n(c.pairs)} virtual heads were expanded one by one.`;
    return ` Of the model's ${n(c.pairs)} virtual heads, the ${n(c.materialised)} with the largest upper bounds ` +
      `on their size were expanded one by one: they explain ${(100 * c.explained).toFixed(1)}% of the ` +
      `order-2 term (squared norm), and ` + (c.left_bound === null ? "no bound holds for those left out " +
      "(every expanded term is zero)" : `none left out can exceed ${fmt(c.left_bound, 2)}× the largest expanded one`) +
      "; the whole order-2 term is in the term-importance runs.";
  }

  function paths(sec, p) {
    const ti = p.term_importance;
    note(sec, `Path expansion on ${p.tokens[0]} × ${p.tokens[1]} tokens of the analysed text, attention patterns frozen. ` +
      `The sum of all path terms reproduces the model's logits to ${p.reconstruction_max_abs_error.toExponential(2)} ` +
      `(max |difference|).` + virtualNote(p.virtual_coverage) + (p.effect_positions
        ? ` Term effects (loss change when a term is removed) were measured on a seeded sample of ` +
          `${p.effect_positions.toLocaleString("en-US")} positions.` : ""));
    const runs = ["uniform", ...ti.run_losses.map((_, i) => (i === 0 ? "direct path" : `orders 0..${i}`))];
    const losses = [ti.uniform_loss, ...ti.run_losses];
    const orderNames = ti.marginal_by_order.map((_, i) =>
      i === 0 ? "direct path" : i === 1 ? "individual heads" : i === 2 ? "virtual heads" : `order ${i}`);
    const row = el("div", { class: "cols" });
    sec.append(row);
    plot(row, [{ type: "bar", x: runs, y: losses, text: losses.map((v) => fmt(v, 2)), textposition: "auto",
      marker: { color: "#8aa2e8" } }], {
      title: { text: "loss by run (term importance)" }, width: 460, height: 340,
      xaxis: { automargin: true }, yaxis: { title: { text: "loss (nats)" } },
    });
    plot(row, [{ type: "bar", x: orderNames, y: ti.marginal_by_order, text: ti.marginal_by_order.map((v) => fmt(v, 2)),
      textposition: "auto", marker: { color: "#d3562f" } }], {
      title: { text: "marginal loss reduction by order" }, width: 460, height: 340,
      xaxis: { automargin: true }, yaxis: { title: { text: "nats" } },
    });
    const terms = el("div", { class: "cols" });
    sec.append(terms);
    const s = el("div"); terms.append(s);
    s.append(el("h3", { text: "Single-head terms: loss increase when removed" }));
    table(s, ["term", "Δ loss", "RMS logit"], p.single_head_terms.map((e) => [e.name, signed(e.loss_change, 4), fmt(e.size)]));
    if (p.virtual_head_terms.length) {
      const v = el("div"); terms.append(v);
      v.append(el("h3", { text: "Largest virtual-head terms: loss increase when removed" }));
      table(v, ["term", "Δ loss", "RMS logit"], p.virtual_head_terms.map((e) => [e.name, signed(e.loss_change, 4), fmt(e.size)]));
    }
  }

  // ids: prefix of the viewer's element ids (unique per page); hash: "#attend=L.H.Q" opens head L.H at token Q
  function attention(sec, a, ids = "viewer", hash = "") {
    if (absent(sec, a)) return;
    note(sec, "The start of the first sequence analysed. Choose a head; hover (or click) a token to see where it " +
      "attends: earlier tokens are shaded by attention weight. The heatmap shows the head's whole pattern.");
    const L = a.patterns.length, H = a.patterns[0].length, T = a.tokens.length;
    const selL = el("select", { id: `${ids}-layer` }), selH = el("select", { id: `${ids}-head` });
    for (let l = 0; l < L; l++) selL.append(el("option", { value: l, text: String(l) }));
    for (let h = 0; h < H; h++) selH.append(el("option", { value: h, text: String(h) }));
    const status = el("span", { id: `${ids}-status`, class: "note viewer-status" });
    sec.append(el("div", { class: "controls" }, el("label", { text: "layer " }, selL), el("label", { text: "head " }, selH), status));
    const box = el("div", { id: `${ids}-text`, class: "viewer-text" });
    sec.append(box);
    const shown = runningText(a.tokens);
    const spans = a.tokens.map((t, i) => {
      const sp = el("span", { "data-pos": i, title: `${i}: ${tok(t)}` });
      sp.textContent = shown[i];
      box.append(sp);
      return sp;
    });
    const heat = el("div");
    sec.append(heat);
    let current = null;
    function show(q) {
      const row = a.patterns[+selL.value][+selH.value][q];
      spans.forEach((sp, i) => {
        sp.classList.toggle("query", i === q);
        const w = i < row.length ? row[i] : 0;
        sp.style.background = w > 0.005 ? `rgba(48, 86, 211, ${Math.min(1, w).toFixed(3)})` : "";
        sp.style.color = w > 0.55 ? "#fff" : "";
        sp.dataset.weight = i < row.length ? String(w) : "";
      });
      let best = 0;
      row.forEach((w, i) => { if (w > row[best]) best = i; });
      status.textContent = `head ${selL.value}.${selH.value}, token ${q} ${tok(a.tokens[q])} attends most to ` +
        `token ${best} ${tok(a.tokens[best])} (${fmt(row[best], 2)})`;
      current = q;
    }
    function redraw() {
      const P = a.patterns[+selL.value][+selH.value];
      const z = P.map((row) => Array.from({ length: T }, (_, k) => (k < row.length ? row[k] : null)));
      const labels = a.tokens.map((t, i) => `${i} ${t}`);
      Plotly.react(heat, [{ type: "heatmap", z, x: labels, y: labels, colorscale: "Blues", reversescale: true, zmin: 0, zmax: 1,
        hovertemplate: "query %{y}<br>key %{x}<br>%{z:.3f}<extra></extra>", colorbar: { thickness: 10 } }], {
        title: { text: `pattern of head ${selL.value}.${selH.value} (rows: queries, columns: keys)` },
        width: 640, height: 600, margin: { l: 50, r: 40, t: 40, b: 40 }, modebar: { orientation: "v" },
        xaxis: { showticklabels: false, title: { text: "key position" } },
        yaxis: { showticklabels: false, autorange: "reversed", title: { text: "query position" } },
      }, CONFIG);
      show(current == null ? T - 1 : current);
    }
    spans.forEach((sp, i) => {
      sp.addEventListener("mouseenter", () => show(i));
      sp.addEventListener("click", () => show(i));
    });
    selL.addEventListener("change", redraw);
    selH.addEventListener("change", redraw);
    // a link like index.html#attend=1.2.40 opens head 1.2 with token 40 selected
    const m = /attend=(\d+)\.(\d+)\.(\d+)/.exec(hash);
    if (m && +m[1] < L && +m[2] < H && +m[3] < T) { selL.value = m[1]; selH.value = m[2]; current = +m[3]; }
    redraw();
  }

  const LEFT_OUT_NAMES = { icl: "ICL score", positional_fraction: "positional score (pos)" };
  function leftOut(sec, left) {  // scores the text does not give, and why (report.json "left_out")
    for (const [name, why] of Object.entries(left || {})) {
      note(sec, `${LEFT_OUT_NAMES[name] || name} left out: ${why}.`);
    }
  }

  function icl(sec, c, left) {
    leftOut(sec, left);
    note(sec, c.score == null ? "" : `ICL score (loss at token ${c.late} minus loss at token ${c.early}, ` +
      `10-position windows): ${signed(c.score)} nats. Negative = later tokens are predicted better.`);
    const row = el("div", { class: "cols" });
    sec.append(row);
    if (c.loss_by_position) {
      plot(row, [{ y: c.loss_by_position, x: c.loss_by_position.map((_, i) => i + 1), mode: "lines",
        name: "analysed text" }], {
        title: { text: "loss by token position (analysed text)" }, width: 560, height: 360,
        xaxis: { title: { text: "token index" }, type: "log" }, yaxis: { title: { text: "loss (nats)" } },
      });
    }
    const r = c.repeat;
    const xs = r.first.map((_, i) => i);
    plot(row, [
      { x: xs, y: r.first, name: `1st copy (mean ${fmt(r.first_mean, 2)})`, mode: "lines" },
      { x: xs, y: r.second, name: `2nd copy (mean ${fmt(r.second_mean, 2)})`, mode: "lines" },
    ], {
      title: { text: `random tokens repeated twice (${r.length} per copy)` }, width: 560, height: 360,
      xaxis: { title: { text: "position within the copy" } }, yaxis: { title: { text: "loss (nats)" } },
      legend: { orientation: "h", y: -0.25 },
    });
  }

  function trigrams(sec, t) {
    note(sec, "Skip-trigrams [source] … [destination] → [output] of each layer-0 head, read off its QK and OV " +
      "circuits over the whole vocabulary (score = centred QK × centred OV), and the direct path's bigrams." +
      (t.note ? " " + t.note : ""));
    const grid = el("div", { class: "cols" });
    sec.append(grid);
    for (const h of t.heads) {
      const d = el("div"); grid.append(d);
      d.append(el("h3", { text: `head ${h.head}` }));
      table(d, ["source", "destination", "output", "score"],
        h.rows.map((r) => [tok(r.source_str), tok(r.destination_str), tok(r.output_str), sig(r.score)]), [0, 1, 2]);
    }
    if (!t.bigrams.length) return;
    const d = el("div"); grid.append(d);
    d.append(el("h3", { text: "bigrams (direct path W_E W_U)" }));
    table(d, ["token", "next", "logit"], t.bigrams.map((b) => [tok(b.token_str), tok(b.next_str), fmt(b.logit, 2)]), [0, 1]);
  }

  const pct = (v) => (v == null || Number.isNaN(v) ? "–" : `${(100 * v).toFixed(0)}%`);
  function causal(sec, c) {
    if (absent(sec, c)) return;
    note(sec, `[F]'s K-composition, tested causally: each path from the previous-token head ${c.writer} into the ` +
      `induction head ${c.reader}'s query, key or value input is noised on its own (path patching: ${c.writer}'s ` +
      `output from a corrupted run reaches only that input; everything else keeps its clean value). Shares of ` +
      `${c.reader}'s prefix-matching attention on ${c.repeat_length}-token repeats (clean ${fmt(c.prefix_clean)}, ` +
      `non-repeating tokens ${fmt(c.prefix_corrupted)}) and of the in-context improvement ` +
      (c.icl_clean == null ? "(no text)" : `(ICL score ${signed(c.icl_clean)} on ${c.icl_examples} examples)`) +
      " each path removes. [F]'s reading predicts: the key path carries most of it; query and value little.");
    table(sec, ["path", "prefix matching removed", "in-context improvement removed"],
      ["q", "k", "v"].map((i) => [`${c.writer} → ${c.reader} ${i}`, pct(c.prefix_removed[i]),
        c.icl_removed ? pct(c.icl_removed[i]) : "–"]), [0]);
  }

  // a circuit's layout (qkov.analysis.discovery.layout: nodes by layer, edge width by |score|, colour by the
  // input an edge enters) as an SVG scaled to fit its card; onEdge(edge) when an edge is clicked
  const SVG_NS = "http://www.w3.org/2000/svg";
  function svgEl(tag, attrs, text) {
    const n = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
    if (text != null) n.textContent = text;
    return n;
  }
  function circuitGraph(parent, lay, onEdge) {
    const s = svgEl("svg", { width: lay.width, height: lay.height, viewBox: `0 0 ${lay.width} ${lay.height}`,
      class: "circuit-graph" });
    s.style.maxWidth = "100%";
    s.style.height = "auto";
    for (const e of lay.edges) {
      const g = svgEl("g", { class: "edge", "data-edge": e.edge, "data-name": e.name });
      g.append(svgEl("line", { x1: e.x1, y1: e.y1, x2: e.x2, y2: e.y2, stroke: e.colour, "stroke-width": e.width,
        "stroke-opacity": 0.8 }));
      if (onEdge) {  // a wide transparent line over it: thin edges are easy to click
        g.append(svgEl("line", { x1: e.x1, y1: e.y1, x2: e.x2, y2: e.y2, stroke: "transparent", "stroke-width": 10 }));
        g.addEventListener("click", () => onEdge(e));
      }
      g.append(svgEl("title", {}, `${e.name}: ${signed(e.score, 4)}`));
      s.append(g);
    }
    for (const n of lay.nodes) {
      s.append(svgEl("rect", { x: n.x - n.half, y: n.y - 9, width: 2 * n.half, height: 18, rx: 9, fill: "#fff",
        stroke: "#333" }));
      s.append(svgEl("text", { x: n.x, y: n.y + 3, "font-size": 8, "text-anchor": "middle" }, n.label));
    }
    lay.legend.forEach(([name, colour], k) =>
      s.append(svgEl("text", { x: 24 + 90 * k, y: lay.height - 6, "font-size": 10, fill: colour }, name)));
    parent.append(el("div", { class: "graph" }, s));
    return s;
  }
  // a faithfulness curve (FaithfulnessCurve.to_dict): by importance (CPR) and by |score| (CMD), over the edge fraction
  function circuitCurve(parent, curve) {
    const x = curve.fractions.map((p) => 100 * p);
    const traces = [["signed", "by importance (CPR)", "#1f77b4"], ["absolute", "by |score| (CMD)", "#d62728"]]
      .map(([k, name, color]) => ({ x, y: curve[k].faithfulness, customdata: curve[k].edges, name,
        mode: "lines+markers", line: { color }, marker: { size: 5 },
        hovertemplate: "%{x}% of the edges: %{customdata} after pruning<br>faithfulness %{y:.3f}<extra></extra>" }));
    return plot(parent, traces, {
      title: { text: `faithfulness curve: CPR ${fmt(curve.cpr)}, CMD ${fmt(curve.cmd)}` }, height: 340, width: 440,
      xaxis: { type: "log", title: { text: "edges kept (% of the graph)" } }, yaxis: { title: { text: "faithfulness" } },
      shapes: [{ type: "line", xref: "paper", x0: 0, x1: 1, y0: 1, y1: 1, line: { dash: "dot", color: "#999", width: 1 } }],
      legend: { orientation: "h", y: -0.32 }, margin: { l: 60, r: 20, t: 40, b: 60 },
    }, "plot circuit-curve");
  }
  function circuitText(c) {
    return `${c.task}. Every edge of the model's graph (${c.graph}) scored by EAP (${c.ablation} ablation; ` +
      `${c.metric}: clean ${sig(c.clean, 4)}, every edge ablated ${sig(c.ablated, 4)}). The circuit drawn is the ` +
      `smallest of the faithfulness curve's circuits (by |score|) reaching faithfulness ${c.target}: ` +
      `${c.circuit.length} edges, faithfulness ${fmt(c.faithfulness)}. Nodes by layer (the input at the bottom, the ` +
      "logits at the top); edge width by |score|; queries blue, keys green, values orange. Faithfulness: the circuit " +
      "run with every other edge ablated, 0 = no better than everything ablated, 1 = the full model.";
  }
  function circuit(sec, c, onEdge) {
    if (absent(sec, c)) return;
    note(sec, circuitText(c));
    const row = el("div", { class: "cols" });
    sec.append(row);
    const a = el("div"), b = el("div");
    row.append(a, b);
    circuitGraph(a, c.layout, onEdge);
    circuitCurve(b, c.curve);
    sec.append(el("h3", { text: `the ${c.top.length} edges with the largest |EAP score|` }));
    note(sec, "Scores are m(edge ablated) − m(clean): EAP's first-order estimate, and the edge ablated alone and " +
      "measured (exact patching). They agree where the model is linear in the edge.");
    table(sec, ["edge", "EAP score", "exact patching", "in the circuit"],
      c.top.map((e) => [e.edge, signed(e.score, 4), signed(e.exact, 4), e.in_circuit ? "yes" : ""]), [0]);
  }

  // one patching result as a heatmap: rows the first axis, columns the last (named axes of any kind:
  // layer, head, pos, edge, ...); three axes: rows "first · second"; one axis: a single row
  function patchResult(sec, r, agreement) {
    sec.append(el("h3", { text: `${r.method} patching of ${r.site} by ${r.axes.join(" × ")}` }));
    const share = r.normalized != null;
    note(sec, `${r.direction}; metric: ${r.metric}, clean ${fmt(r.clean, 4)}, corrupted ${fmt(r.corrupted, 4)}. ` +
      (share ? "Cells: the share of the way each patch moves the metric from the base run's value to the source " +
        "run's (1 = all the way)." : "Cells: the metric after each patch.") +
      (agreement == null ? "" : ` Agreement with activation patching: r = ${fmt(agreement)}.`));
    let z = share ? r.normalized : r.values;
    let y = r.labels[r.axes[0]];
    const x = r.labels[r.axes[r.axes.length - 1]];
    if (r.axes.length === 1) { z = [z]; y = [r.method]; }
    if (r.axes.length === 3) {  // (a, b, c) -> rows "a · b", columns c
      y = []; const rows = [];
      z.forEach((plane, l) => plane.forEach((row, i) => {
        rows.push(row); y.push(`${r.labels[r.axes[0]][l]} · ${r.labels[r.axes[1]][i]}`);
      }));
      z = rows;
    }
    plot(sec, [{ type: "heatmap", z, x, y, colorscale: "RdBu", reversescale: true, zmid: 0, colorbar: { thickness: 10 },
      hovertemplate: `${r.axes[0]} %{y}<br>${r.axes[r.axes.length - 1]} %{x}<br>%{z:.3f}<extra></extra>` }], {
      height: Math.min(900, 140 + 22 * y.length), xaxis: { type: "category", title: { text: r.axes[r.axes.length - 1] } },
      yaxis: { type: "category", autorange: "reversed", title: { text: r.axes.slice(0, -1).join(" · ") } },
    });
  }
  function patching(sec, p) {
    if (absent(sec, p)) return;
    if (p.clean) note(sec, `Clean input ${p.clean}, corrupted input ${p.corrupted}.`);
    for (const r of p.results) patchResult(sec, r, r.method === "attribution" ? (p.agreement || {})[r.site] : null);
  }

  // ------------------------------------------- notebook-only displays (qkov.show)
  function copying(sec, c) {
    note(sec, "Per head: eigen copying = Σλ / Σ|λ| of the full OV circuit W_E W_OV W_U (1 = copies its input, " +
      "−1 = suppresses it); own in top k = share of tokens whose own logit is among the k largest of their OV row; " +
      "residual eig = the same eigenvalue score of W_OV in the residual stream.");
    table(sec, ["head", "eigen copying", `own in top ${c.k || "k"}`, "residual eig"],
      c.heads.map((h) => [h.head, fmt(h.eigen_score), fmt(h.diag_topk_rate), fmt(h.residual_eigen_score)]));
    if (c.more) note(sec, `... ${c.more} more heads (in the object)`);
  }

  function topk(sec, t) {
    note(sec, `The ${t.k} largest entries of ${t.what}${t.batch ? ` (batch ${t.batch})` : ""}.`);
    table(sec, ["#", "row", "column", "value"],
      t.entries.map((e, i) => [i, e.row_str ? `${e.row} ${tok(e.row_str)}` : e.row,
        e.col_str ? `${e.col} ${tok(e.col_str)}` : e.col, fmt(e.value, 4)]), [1, 2]);
    if (t.more) note(sec, `... ${t.more} more (in the object)`);
  }

  function probe(sec, p) {
    note(sec, `Induction score per head: attention from each token of the 2nd copy of ${p.repeat.length} repeated ` +
      `random tokens to the token after its earlier copy. Best head ${p.best_head || "–"} (${fmt(p.best)}).`);
    table(sec, ["layer", ...p.scores[0].map((_, h) => `head ${h}`)],
      p.scores.map((row, l) => [l, ...row.map((v) => fmt(v))]));
    icl(sec, { loss_by_position: null, repeat: p.repeat });
  }

  // each renderer reads the sections it needs from D (the report's JSON, or a part of it)
  const RENDER = {
    card: (s, D) => card(s, D.card, D.inputs),
    heads: (s, D) => { leftOut(s, D.left_out); heads(s, D.heads, D.eigenvalues, D.card.model.d_vocab, D.inputs); },
    composition: (s, D) => composition(s, D.composition),
    paths: (s, D) => paths(s, D.paths),
    attention: (s, D, o) => attention(s, D.attention, o.ids, o.hash),
    icl: (s, D) => icl(s, D.icl, D.left_out),
    trigrams: (s, D) => trigrams(s, D.trigrams),
    causal: (s, D) => causal(s, D.causal),
    patching: (s, D) => patching(s, D.patching),
    circuit: (s, D) => circuit(s, D.circuit),
    copying: (s, D) => copying(s, D.copying),
    topk: (s, D) => topk(s, D.topk),
    probe: (s, D) => probe(s, D.probe),
  };
  // show `message` as the section's failure; returns it
  function fail(sec, message) {
    sec.dataset.rendered = "error";
    sec.append(el("p", { class: "error", text: message }));
    return message;
  }
  // draw section `name` of D into sec with render[name] (default: the report's); returns the error text, or null
  function draw(sec, name, D, opts = {}, render = RENDER) {
    try {
      render[name](sec, D, opts);
      sec.dataset.rendered = "ok";
      return null;
    } catch (e) {
      return fail(sec, "could not draw this section: " + e);
    }
  }
  // the JSON in element `id`; throws an Error that says what went wrong
  function readData(id) {
    const node = document.getElementById(id);
    if (!node) throw new Error(`could not read the page's data: no element #${id}`);
    try {
      return JSON.parse(node.textContent);
    } catch (e) {
      throw new Error(`could not read the page's data (#${id}): ${e}`);
    }
  }
  // a notebook display: element `id` (its text form inside, replaced) and its data {section, data, opts}
  function mount(id) {
    const root = document.getElementById(id);
    let spec;
    try {
      spec = readData(id + "-data");
    } catch (e) {
      root.append(el("p", { class: "error", text: e.message }));
      root.dataset.rendered = "error";
      return;
    }
    const sec = el("section", { "data-section": spec.section });
    if (spec.title) sec.append(el("h2", { text: spec.title }));
    root.replaceChildren(sec);
    const error = draw(sec, spec.section, spec.data, Object.assign({ ids: id }, spec.opts || {}));
    root.dataset.rendered = error ? "error" : "ok";
  }
  // a page: the JSON in element `dataId`, given to prepare(D) once, then every section[data-section]
  // drawn by render[name](sec, D, opts). Errors (and data that cannot be read: every section says
  // so) are listed in the root element's dataset.errors; dataset.ready = "1" marks the end.
  function drawPage(dataId, render, opts = {}, prepare = null) {
    const root = document.documentElement;
    const errors = [];
    const record = (e) => { errors.push(e); root.dataset.errors = errors.join(" | "); };
    window.addEventListener("error", (e) => record(String(e.message)));
    let D = null, failure = null;
    try {
      D = readData(dataId);
    } catch (e) {
      failure = e.message;
    }
    if (!failure && prepare) {
      try { prepare(D); } catch (e) { failure = "could not read the page's data: " + e; }
    }
    for (const sec of document.querySelectorAll("section[data-section]")) {
      const name = sec.dataset.section;
      const error = failure ? fail(sec, failure) : draw(sec, name, D, opts, render);
      if (error) record(name + ": " + error);
    }
    root.dataset.ready = "1";
  }
  // the helpers serve the other qkov pages drawn with this library (the dynamics and tour pages)
  // sections: the section renderers themselves, for pages that draw them from their own data (qkov explore)
  window.qkovReport = { draw, drawPage, mount, helpers: { el, fmt, signed, note, table, plot, tok, runningText, leftOut,
    circuitGraph, circuitCurve }, sections: { heads, composition, attention, trigrams, patching, patchResult, topk, circuit } };

  // the report page: every section from #qkov-data
  if (document.getElementById("qkov-data")) drawPage("qkov-data", RENDER, { hash: location.hash });
})();
