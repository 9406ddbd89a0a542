/* qkov explore: the page over one model. Each panel (section[data-panel]) asks the server for one view
 * (POST /api/jobs, then GET /api/jobs/{id} until it ends; Cancel sends DELETE) and draws the result with
 * the report's renderers and helpers (window.qkovReport). A panel's state is in data-rendered: "busy"
 * while its job runs, then "ok", "error" (the message shown in the panel) or "cancelled".
 * Every string from the model (token strings above all) goes into the page as text (textContent,
 * createTextNode, attribute values), never as HTML. Nothing is written to the console. */
"use strict";
(function () {
  const R = window.qkovReport;
  const { el, fmt, signed, note, table, plot, tok, runningText, leftOut } = R.helpers;
  const $ = (sel) => document.querySelector(sel);
  const pageError = (msg) => { const p = $("#page-error"); p.hidden = false; p.textContent = msg; };
  window.addEventListener("error", (e) => pageError("page error: " + e.message));
  window.addEventListener("unhandledrejection", (e) => pageError("page error: " + (e.reason && e.reason.message || e.reason)));
  let M;
  try { M = JSON.parse($("#qkov-explore-data").textContent); } catch (e) { pageError("could not read the page's data: " + e); return; }
  const OFF = M.unavailable || {};  // views this session does not answer (weights read from disk), and why
  const S = { text: null, textResult: null, head: M.heads[0] || null, cardHead: null, ablate: new Set(), comp: null };

  // ------------------------------------------------------------------ server
  const TOKEN = new URLSearchParams(location.search).get("token");
  async function api(method, url, body) {
    const headers = { "Content-Type": "application/json" };
    if (TOKEN) headers.Authorization = "token " + TOKEN;
    const r = await fetch(url, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
    let j = null;
    try { j = await r.json(); } catch (e) { /* not JSON: said below */ }
    if (!r.ok || j === null) throw new Error((j && j.error) || `${method} ${url}: HTTP ${r.status}`);
    return j;
  }
  const sleep = (ms) => new Promise((ok) => setTimeout(ok, ms));

  // one panel (a section, or a part of one such as a card's tables): its job line (progress, Cancel) and
  // its output, the first .job and .out inside it; run() replaces what it shows; stop() drops its job
  class Panel {
    constructor(root) {
      this.sec = root;
      this.job = this.sec.querySelector(".job");
      this.out = this.sec.querySelector(".out");
      this.seq = 0;
      this.id = null;
    }
    fail(msg) {
      this.sec.dataset.rendered = "error";
      this.out.replaceChildren(el("p", { class: "error", text: msg }));
    }
    draw(render, result) {
      const out = el("div");
      try {
        render(out, result);
      } catch (e) {
        this.fail("could not draw this view: " + e);
        return;
      }
      this.out.replaceChildren(out);
      this.sec.dataset.rendered = "ok";
    }
    cancel() {
      if (this.id) api("DELETE", `/api/jobs/${this.id}`).catch(() => {});
    }
    stop() {
      this.cancel();
      this.seq++;  // a result still on its way is not drawn
    }
    async run(view, args, render, label = view) {  // label: what its job line calls it
      this.cancel();
      const seq = ++this.seq;
      this.sec.dataset.rendered = "busy";
      const line = el("span", { class: "progress", text: `${label}: starting` });
      const stop = el("button", { type: "button", class: "cancel", text: "Cancel" });
      stop.addEventListener("click", () => this.cancel());
      this.job.replaceChildren(line, stop);
      try {
        let j = await api("POST", "/api/jobs", { view, args });
        if (seq !== this.seq) { api("DELETE", `/api/jobs/${j.id}`).catch(() => {}); return null; }  // stopped meanwhile
        this.id = j.id;
        for (let wait = 60; j.state === "queued" || j.state === "running"; wait = Math.min(400, wait * 1.5)) {
          line.textContent = `${label}: ${j.what || j.state}` + (j.total ? ` ${j.done}/${j.total}` : "");
          await sleep(wait);
          if (seq !== this.seq) return null;  // a newer run replaced this one
          j = await api("GET", `/api/jobs/${j.id}`);
        }
        if (seq !== this.seq) return null;
        this.id = null;
        this.job.replaceChildren();
        if (j.state === "done") { this.draw(render, j.result); return j.result; }
        if (j.state === "cancelled") {
          this.sec.dataset.rendered = "cancelled";
          this.out.replaceChildren(el("p", { class: "note", text: `${label}: cancelled` }));
        } else this.fail(`${label}: ${j.error || j.state}`);
      } catch (e) {
        if (seq !== this.seq) return null;
        this.id = null;
        this.job.replaceChildren();
        this.fail(`${label}: ${e.message}`);
      }
      return null;
    }
  }
  const P = {};
  for (const s of document.querySelectorAll("section[data-panel]")) P[s.dataset.panel] = new Panel(s);

  // a button that opens head h's card
  function headLink(h) {
    const b = el("button", { type: "button", class: "head-link", "data-head": h, text: h });
    b.addEventListener("click", () => openCard(h));
    return b;
  }
  const valued = (v, d = 4) => el("span", { "data-value": v == null ? "" : String(v), text: fmt(v, d) });

  // ------------------------------------------------------------------ attention viewer
  // tokens as spans[data-pos]; hovering (or clicking) query q shades every key by pattern[q][k], marks
  // the query (class "query") and its argmax key (class "argmax"); the box's data-query/data-argmax say which
  function viewer(parent, tokens, pattern, argmax, label) {
    const status = el("p", { class: "note viewer-status" });
    const box = el("div", { class: "viewer-text attention-text" });
    parent.append(status, box);
    const shown = runningText(tokens);
    const spans = tokens.map((t, i) => {
      const sp = el("span", { "data-pos": i, title: `${i}: ${tok(t)}` });
      sp.textContent = shown[i];
      box.append(sp);
      return sp;
    });
    function show(q) {
      const row = pattern[q];
      spans.forEach((sp, k) => {
        const w = k < row.length ? row[k] : 0;
        sp.classList.toggle("query", k === q);
        sp.classList.toggle("argmax", k === argmax[q]);
        sp.style.background = w > 0.005 ? `rgba(48, 86, 211, ${Math.min(1, w).toFixed(3)})` : "";
        sp.style.color = w > 0.55 ? "#fff" : "";
        sp.dataset.weight = k <= q && k < row.length ? String(w) : "";
      });
      box.dataset.query = String(q);
      box.dataset.argmax = String(argmax[q]);
      status.textContent = `${label}: token ${q} ${tok(tokens[q])} attends most to token ${argmax[q]} ` +
        `${tok(tokens[argmax[q]])} (${fmt(row[argmax[q]], 3)})`;
    }
    spans.forEach((sp, i) => { sp.addEventListener("mouseenter", () => show(i)); sp.addEventListener("click", () => show(i)); });
    show(tokens.length - 1);
    return box;
  }
  function heatmap(parent, tokens, pattern, title) {
    const T = tokens.length;
    const z = pattern.map((row, q) => Array.from({ length: T }, (_, k) => (k <= q && k < row.length ? row[k] : null)));
    const labels = tokens.map((t, i) => `${i} ${t}`);
    plot(parent, [{ type: "heatmap", z, x: labels, y: labels, colorscale: "Blues", reversescale: true, zmin: 0, zmax: 1,
      hovertemplate: "query %{y}<br>key %{x}<br>%{z:.3f}<extra></extra>", colorbar: { thickness: 10 } }], {
      title: { text: title }, width: 520, height: 480, margin: { l: 40, r: 30, t: 40, b: 40 },
      xaxis: { showticklabels: false, title: { text: "key" } },
      yaxis: { showticklabels: false, autorange: "reversed", title: { text: "query" } },
    });
  }

  // ------------------------------------------------------------------ model, text, attention
  function drawModel(out) {
    table(out, ["", ""], [
      ["model", M.name], ["source", String(M.source)],
      ["shape", `${M.n_layers} layers × ${M.n_heads} heads, d_model ${M.d_model}, d_head ${M.d_head}, ` +
        `vocab ${M.d_vocab.toLocaleString("en-US")}, context ${M.n_ctx}${M.rotary ? ", rotary positions" : ""}`],
      ["texts", M.has_tokenizer ? `up to ${M.max_tokens} tokens, the start token first` :
        "no tokenizer: type token ids separated by spaces"],
      ["weights", M.streamed ? "read from disk layer by layer as each view needs them (memory-mapped): nothing of " +
        "them is held in memory" : "in memory (the folded view)"],
      ["disk cache", M.cache_dir || "none (results are kept in memory only)"],
    ], [0, 1], [1]);
  }
  // the text box's content as the views' "text" argument: ids for a model without a tokenizer
  function textArg(value) {
    if (M.has_tokenizer) return value;
    const ids = value.trim().split(/[\s,]+/).filter(Boolean).map(Number);
    return ids.every(Number.isInteger) ? ids : value;
  }
  function drawText(out, r) {
    S.textResult = r;
    const pos = $("#terms-position");
    pos.max = String(Math.max(0, r.tokens.length - 2));  // a position with a next token
    if (+pos.value > +pos.max) pos.value = pos.max;
    note(out, `${r.tokens.length} tokens, mean loss ${fmt(r.mean_loss, 4)} nats. Each token is shaded by the loss ` +
      "of predicting the next one; hover a token for the model's top predictions there, click it for its term effects.");
    out.append(el("p", { class: "note" }, "mean loss ", el("span", { "data-field": "mean_loss", "data-value": String(r.mean_loss), text: fmt(r.mean_loss, 4) })));
    const box = el("div", { class: "viewer-text loss-text" });
    const hover = el("div", { class: "hover-box" });
    out.append(box, hover);
    const finite = r.loss.filter((v) => v != null);
    const top = Math.max(1e-9, ...finite);
    const shown = runningText(r.tokens);
    r.tokens.forEach((t, i) => {
      const l = r.loss[i];
      const sp = el("span", { "data-pos": i, "data-loss": l == null ? "" : String(l), title: `${i}: ${tok(t)}` });
      sp.textContent = shown[i];
      if (l != null) sp.style.background = `rgba(211, 86, 47, ${Math.min(1, l / top).toFixed(3)})`;
      sp.addEventListener("mouseenter", () => predictions(hover, r, i));
      sp.addEventListener("click", () => { $("#terms-position").value = i; runTerms(); });
      box.append(sp);
    });
    predictions(hover, r, r.tokens.length - 1);
  }
  function predictions(parent, r, i) {
    parent.replaceChildren();
    parent.dataset.pos = String(i);
    const next = i + 1 < r.tokens.length ? `; the next token is ${tok(r.tokens[i + 1])}, loss ${fmt(r.loss[i], 4)}` : "";
    parent.append(el("p", { class: "note", text: `after token ${i} ${tok(r.tokens[i])}${next}` }));
    table(parent, ["prediction", "p"], r.top[i].map((p) => [tok(p.token), fmt(p.p, 4)]), [0]);
  }
  function runText() {
    const value = $("#text-input").value;
    S.text = textArg(value);
    $("#patch-clean").value ||= value;
    return P.text.run("text", { text: S.text }, drawText).then((r) => {
      if (!r) return;
      runAttention();
      if (S.cardHead) openCard(S.cardHead);
    });
  }
  function runAttention() {
    if (S.text == null) { P.attention.fail("type a text first (the Text box above)"); return; }
    S.head = $("#attention-head").value;
    P.attention.run("attention", { text: S.text, head: S.head }, (out, a) => {
      viewer(out, a.tokens, a.pattern, a.argmax, `head ${a.head}`);
      heatmap(out, a.tokens, a.pattern, `pattern of head ${a.head} (rows: queries, columns: keys)`);
    });
  }

  // ------------------------------------------------------------------ heads
  // the table the report draws, on the tokens `qkov heads` reads (said in its note: h.inputs)
  function drawHeads(out, h) {
    if (h.natural === false && M.has_tokenizer) {
      note(out, "No text to measure the pattern scores on: this model records no corpus. Start the explorer with " +
        "qkov explore SOURCE --text FILE to measure them on a text (as qkov heads --text FILE does).");
    }
    if (h.cached) note(out, `Computed once for this model and these tokens; kept at ${h.cached}.`);
    leftOut(out, h.left_out);
    const cols = (h.columns || []).map((c) => (Array.isArray(c) ? c : [c.label, c.key]));  // [label, score name]
    if (h.thresholds) {  // the report's table and plots, its head cells made into links to the cards
      R.sections.heads(out, Object.assign({}, h, { columns: cols }), null, M.d_vocab, h.inputs);
      const t = out.querySelector("table");
      [...t.rows].slice(1).forEach((tr, i) => { const c = tr.cells[0]; c.replaceChildren(headLink(h.rows[i].head)); });
      t.classList.add("heads-table");
      return;
    }
    const t = table(out, ["head", ...cols.map((c) => c[0]), "roles"], h.rows.map((r) => {
      const roles = el("span");
      (r.roles.length ? r.roles : ["–"]).forEach((x) => roles.append(el("span", { class: "role", text: x })));
      return [headLink(r.head), ...cols.map((c) => fmt(r[c[1]], 2)), roles];
    }), [cols.length + 1], [], [cols.length + 1]);
    t.classList.add("heads-table");
  }

  // ------------------------------------------------------------------ head card
  // in two jobs: the card without its vocabulary-wide tables (seconds each at GPT-2's vocabulary), shown
  // at once, then the full card, whose tables fill in below the spectra (their own progress and Cancel)
  function openCard(h) {
    S.cardHead = h;
    if (S.cardTables) S.cardTables.stop();
    S.cardTables = null;
    const args = { head: h, tables: false };
    if (S.text != null) args.text = S.text;
    P.card.run("card", args, drawCard).then((c) => {
      if (!c || S.cardHead !== h || S.cardTables) return;
      S.cardTables = new Panel(P.card.out.querySelector(".card-tables"));
      const tables = () => S.cardTables.run("card", { head: h }, drawTables, "card tables");  // no text: the pattern is drawn
      if (!M.streamed) { tables(); return; }
      // weights read from disk: each table reads the whole vocabulary from disk (minutes): only when asked
      const b = el("button", { type: "button", id: "card-tables-run", text: "Compute the vocabulary tables" });
      b.addEventListener("click", tables);
      S.cardTables.out.replaceChildren(el("p", { class: "note" }, b, " top full-OV and full-QK entries and " +
        `skip-trigrams: each reads the ${M.d_vocab.toLocaleString("en-US")}-token vocabulary from disk (minutes on a large model)`));
    });
    P.card.sec.scrollIntoView({ block: "start" });
  }
  function spectrum(parent, eig, title) {
    const scale = Math.max(1e-12, ...eig.map((e) => Math.hypot(e.re, e.im)));
    plot(parent, [{ x: eig.map((e) => e.re / scale), y: eig.map((e) => e.im / scale), mode: "markers",
      marker: { size: 6, color: "#3056d3" }, hovertemplate: "%{x:.3f} %{y:+.3f}i<extra></extra>" }], {
      title: { text: `${title} (scaled by max |λ| ${fmt(scale, 2)})`, font: { size: 12 } }, width: 300, height: 300,
      margin: { l: 35, r: 10, t: 35, b: 30 }, showlegend: false,
      xaxis: { range: [-1.15, 1.15] }, yaxis: { range: [-1.15, 1.15], scaleanchor: "x" },
      shapes: [{ type: "circle", x0: -1, y0: -1, x1: 1, y1: 1, line: { color: "#ccc" } }],
    }, "small-plot");
  }
  function compRows(parent, title, rows) {
    parent.append(el("h3", { text: title }));
    if (!rows.length) { note(parent, "none"); return; }
    table(parent, ["head", "Q", "K", "V"], rows.map((r) => [headLink(r.head), fmt(r.q), fmt(r.k), fmt(r.v)]));
  }
  function drawCard(out, c) {
    out.append(el("h3", { text: `head ${c.head}` }));
    out.append(el("p", {}, "eigen copying score (Σλ / Σ|λ| of the full OV circuit) ",
      el("span", { "data-field": "copying", "data-value": String(c.copying), text: signed(c.copying, 4) })));
    const row = el("div", { class: "cols" });
    out.append(row);
    spectrum(row, c.ov_eigenvalues, "OV eigenvalues");
    spectrum(row, c.qk_eigenvalues, "QK eigenvalues");
    const tables = el("div", { class: "card-tables" }, el("div", { class: "job" }), el("div", { class: "out" }));
    out.append(tables);
    if (c.top_ov) { drawTables(tables.lastChild, c); tables.dataset.rendered = "ok"; }
    drawCardRest(out, c);
  }
  function drawTables(out, c) {
    if (c.left_out) note(out, `Tables over the vocabulary's ordinary tokens: ${c.left_out}.`);
    const tabs = el("div", { class: "cols" });
    out.append(tabs);
    if (c.top_ov) {
      const ov = el("div"); tabs.append(ov);
      ov.append(el("h3", { text: "largest full-OV entries (W_E W_OV W_U)" }));
      table(ov, ["source", "output", "value"], c.top_ov.map((e) => [tok(e.src), tok(e.out), valued(e.value)]), [0, 1])
        .classList.add("top-ov");
    }
    if (c.top_qk) {
      const qk = el("div"); tabs.append(qk);
      const at = c.qk_offset == null ? "" : ` at offset ${c.qk_offset} (the profile's peak)`;
      qk.append(el("h3", { text: `largest full-QK entries (query · key)${at}` }));
      table(qk, ["query", "key", "value"], c.top_qk.map((e) => [tok(e.query), tok(e.key), valued(e.value)]), [0, 1])
        .classList.add("top-qk");
    }
    if (c.trigrams && c.trigrams.length) {
      const tg = el("div"); tabs.append(tg);
      tg.append(el("h3", { text: "skip-trigrams: source … destination → output" }));
      table(tg, ["source", "destination", "output", "score"],
        c.trigrams.map((t) => [tok(t.src), tok(t.dest), tok(t.out), valued(t.value, 2)]), [0, 1, 2]).classList.add("trigrams");
    }
  }
  function drawCardRest(out, c) {
    const pos = c.positional;
    if (pos && pos.kind !== "none" && pos.offsets.length) {
      plot(out, [{ x: pos.offsets, y: pos.values, mode: "lines+markers" }], {
        title: { text: `positional profile (${pos.kind}): the attention score by query − key offset` }, height: 300,
        xaxis: { title: { text: "offset" } }, yaxis: { title: { text: "score" } },
      });
    } else note(out, "No positional profile: this model has no positional embedding.");
    const comp = el("div", { class: "cols" });
    out.append(comp);
    const a = el("div"), b = el("div");
    comp.append(a, b);
    compRows(a, "reads (earlier heads this head composes with)", c.composition.reads);
    compRows(b, "read by (later heads composing with it)", c.composition.read_by);
    if (c.pattern) {
      out.append(el("h3", { text: `pattern of ${c.head} on the text` }));
      viewer(out, c.pattern.tokens, c.pattern.pattern, c.pattern.argmax, `head ${c.head}`).classList.add("card-pattern");
    }
  }

  // ------------------------------------------------------------------ composition graph
  const KIND_COLOR = { q: "#3056d3", k: "#d3562f", v: "#2a9d5b" };
  const SVGNS = "http://www.w3.org/2000/svg";
  function svg(tag, attrs) {
    const n = document.createElementNS(SVGNS, tag);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
    return n;
  }
  function drawComposition(out, g) {
    S.comp = g;
    const max = Math.max(1e-9, ...g.edges.map((e) => e.value));
    const slider = $("#composition-threshold");
    slider.max = String(max);
    slider.step = "any";
    slider.value = String(g.default_threshold);
    const base = Object.entries(g.baselines || {}).map(([k, b]) => `${k.toUpperCase()} ${fmt(b.mean)} ± ${fmt(b.std)}`);
    note(out, "Heads by layer (columns); an edge from an earlier head to a later one is their Q-, K- or V-composition " +
      `score (blue, orange, green), drawn when it is at least the threshold. The threshold starts at the ` +
      `${g.default_edges} strongest edges above the random-matrix baselines (${base.join(", ")}); the slider ` +
      "shows more or fewer. Click a head for its card.");
    // the graph's elements, kept: redrawGraph draws into them before and after they are on the page
    S.compShown = el("p", { class: "note graph-shown" });
    S.compBox = el("div", { class: "graph" });
    out.append(S.compShown, S.compBox);
    redrawGraph();
  }
  function redrawGraph() {
    const g = S.comp, box = S.compBox;
    if (!g || !box) return;
    const th = +$("#composition-threshold").value;
    $("#composition-threshold-value").textContent = fmt(th, 4);
    const kinds = new Set([...document.querySelectorAll(".composition-kind")].filter((c) => c.checked).map((c) => c.value));
    const H = M.n_heads, W = 140 * M.n_layers + 60, Ht = 34 * H + 40;
    const at = (h) => { const [l, i] = h.split(".").map(Number); return [60 + 140 * l, 30 + 34 * i]; };
    // drawn at its size, scaled down to fit a narrower card
    const s = svg("svg", { width: W, height: Ht, viewBox: `0 0 ${W} ${Ht}`, class: "composition-graph" });
    s.style.maxWidth = "100%";
    s.style.height = "auto";
    const max = Math.max(1e-9, ...g.edges.map((e) => e.value));
    let n = 0;
    for (const e of g.edges) {
      if (!kinds.has(e.kind) || !(e.value >= th)) continue;
      const [x1, y1] = at(e.src), [x2, y2] = at(e.dst);
      const line = svg("line", { x1, y1, x2, y2, stroke: KIND_COLOR[e.kind], "stroke-opacity": 0.7,
        "stroke-width": (0.5 + 4 * e.value / max).toFixed(2), "data-src": e.src, "data-dst": e.dst, "data-kind": e.kind,
        "data-value": String(e.value) });
      const t = svg("title", {}); t.textContent = `${e.src} → ${e.dst} ${e.kind.toUpperCase()} ${fmt(e.value)}`;
      line.append(t); s.append(line); n++;
    }
    for (const h of g.heads) {
      const [x, y] = at(h);
      const node = svg("g", { class: "node", "data-head": h });
      node.append(svg("circle", { cx: x, cy: y, r: 11 }));
      const label = svg("text", { x, y: y + 4, "text-anchor": "middle" }); label.textContent = h;
      node.append(label);
      node.addEventListener("click", () => openCard(h));
      s.append(node);
    }
    s.dataset.shown = String(n);
    box.replaceChildren(s);
    const above = g.edges.filter((e) => e.value >= e.baseline).length;
    S.compShown.textContent = `showing ${n} of ${g.edges.length} edges (score ≥ ${fmt(th, 4)}${kinds.size < 3 ?
      `, kinds ${[...kinds].join(", ").toUpperCase() || "none"}` : ""}); ${above} are above their kind's baseline mean.`;
  }

  // ------------------------------------------------------------------ terms, ablation, patching
  function runTerms() {
    if (OFF.terms) return;  // said in the panel
    if (S.text == null) { P.terms.fail("type a text first (the Text box above)"); return; }
    P.terms.run("terms", { text: S.text, position: +$("#terms-position").value }, (out, r) => {
      note(out, `Loss change (nats) at position ${r.position} (token ${tok(r.token)}, predicting ${tok(r.next)}, ` +
        `loss ${fmt(r.loss, 4)}) when each term of the path expansion is removed (the direct path, each head, virtual ` +
        "heads), attention patterns frozen; positive: the term helps predict the next token.");
      const rows = r.rows.slice(0, 40);
      table(out, ["term", "effect"], rows.map((e) => [e.term, valued(e.effect)]), [0]).classList.add("terms-table");
      plot(out, [{ type: "bar", x: rows.map((e) => e.term), y: rows.map((e) => e.effect), marker: { color: "#8aa2e8" } }],
        { height: 320, xaxis: { type: "category" }, yaxis: { title: { text: "effect" } } });
    });
  }
  function topList(top) {  // the predictions at the last position that has them (or the list itself)
    if (!top || !top.length) return [];
    return Array.isArray(top[0]) ? top[top.length - 1] : top;
  }
  function drawAblate(out, r) {
    out.append(el("p", {}, `${r.heads.join(", ")} ${r.mode}-ablated: mean loss `,
      el("span", { "data-field": "mean_before", "data-value": String(r.mean_before), text: fmt(r.mean_before, 4) }),
      " → ", el("span", { "data-field": "mean_after", "data-value": String(r.mean_after), text: fmt(r.mean_after, 4) }),
      ` (${signed(r.mean_after - r.mean_before, 4)} nats)`));
    const toks = (S.textResult && S.textResult.tokens) || [];
    const rows = r.loss_before.map((b, i) => [i, toks[i] == null ? "" : tok(toks[i]), fmt(b, 4), fmt(r.loss_after[i], 4),
      b == null ? "–" : signed(r.loss_after[i] - b, 4)]).filter((x) => x[2] !== "–");
    const cols = el("div", { class: "cols" });
    out.append(cols);
    const a = el("div"), b = el("div"), c = el("div");
    cols.append(a, b, c);
    a.append(el("h3", { text: "loss per token (predicting the next)" }));
    table(a, ["pos", "token", "before", "after", "change"], rows, [1]).classList.add("ablate-loss");
    for (const [d, name, top] of [[b, "before", r.top_before], [c, "after", r.top_after]]) {
      d.append(el("h3", { text: `top predictions at the end, ${name}` }));
      table(d, ["token", "p"], topList(top).map((p) => [tok(p.token), fmt(p.p, 4)]), [0]);
    }
  }
  function drawPatch(out, r) {
    if (!r.results || !r.results.length) throw new Error("no patching results in the answer");
    R.sections.patching(out, r);
  }
  function ablateChips() {
    const box = $("#ablate-heads");
    for (const h of M.heads) {
      const b = el("button", { type: "button", class: "chip", "data-head": h, "aria-pressed": "false", text: h });
      b.addEventListener("click", () => {
        if (S.ablate.has(h)) S.ablate.delete(h); else S.ablate.add(h);
        b.setAttribute("aria-pressed", String(S.ablate.has(h)));
      });
      box.append(b);
    }
  }

  // ------------------------------------------------------------------ circuit discovery
  // the report's circuit section (graph, faithfulness curve, top edges); clicking an edge of the graph patches
  // that edge alone on the same task (the circuit_edge view), shown in the box under the graph
  function drawCircuit(out, c) {
    R.sections.circuit(out, c, patchEdge);
    const box = el("div", { class: "circuit-edge" }, el("div", { class: "job" }),
      el("div", { class: "out" }, el("p", { class: "note", text: "Click an edge of the graph: it is ablated alone " +
        "on the task's prompts and the change of the metric measured (exact edge patching)." })));
    const row = out.querySelector(".cols");
    if (row) row.after(box); else out.append(box);
    if (S.circuitEdge) S.circuitEdge.stop();
    S.circuitEdge = new Panel(box);
  }
  function patchEdge(e) {
    if (!S.circuitEdge) return;
    for (const g of document.querySelectorAll("svg.circuit-graph g.edge")) g.classList.toggle("chosen", g.dataset.edge === String(e.edge));
    S.circuitEdge.run("circuit_edge", { edge: e.edge }, (out, r) => {
      out.append(el("p", { class: "edge-effect" }, `${r.edge} ablated alone: ${r.metric} ${fmt(r.clean, 4)} → ` +
        `${fmt(r.ablated, 4)}, exact patching `,
        el("span", { "data-field": "exact", "data-value": String(r.exact), text: signed(r.exact, 4) }),
        r.eap == null ? " (not among the edges EAP scored here)." : ` (EAP's estimate ${signed(r.eap, 4)}).`));
      note(out, r.task);
    }, `patching ${e.name}`);
  }

  // ------------------------------------------------------------------ wiring
  P.model.draw(drawModel, M);
  for (const h of M.heads) $("#attention-head").append(el("option", { value: h, text: h }));
  ablateChips();
  $("#text-form").addEventListener("submit", (e) => { e.preventDefault(); runText(); });
  $("#attention-head").addEventListener("change", runAttention);
  $("#attention-card").addEventListener("click", () => openCard($("#attention-head").value));
  $("#composition-run").addEventListener("click", () => P.composition.run("composition", {}, drawComposition));
  $("#composition-threshold").addEventListener("input", redrawGraph);
  for (const c of document.querySelectorAll(".composition-kind")) c.addEventListener("change", redrawGraph);
  $("#terms-run").addEventListener("click", runTerms);
  $("#ablate-run").addEventListener("click", () => {
    if (S.text == null) { P.ablate.fail("type a text first (the Text box above)"); return; }
    if (!S.ablate.size) { P.ablate.fail("choose the heads to ablate (click them above)"); return; }
    P.ablate.run("ablate", { text: S.text, heads: [...S.ablate], mode: $("#ablate-mode").value }, drawAblate);
  });
  $("#patch-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const args = { clean: textArg($("#patch-clean").value), corrupted: textArg($("#patch-corrupted").value) };
    if ($("#patch-metric").value.trim()) args.metric = $("#patch-metric").value.trim();
    P.patch.run("patch", args, drawPatch);
  });
  $("#circuit-run").addEventListener("click", () => P.circuit.run("circuit", {}, drawCircuit));
  // weights read from disk: the views that would read every layer many times say why instead of running
  for (const [view, why] of Object.entries(OFF)) {
    const panel = P[view];
    if (!panel) continue;
    for (const b of panel.sec.querySelectorAll("button")) b.disabled = true;
    panel.sec.dataset.rendered = "off";
    panel.out.replaceChildren(el("p", { class: "note", text: "Not available while the weights are read from disk " +
      `layer by layer: ${why}. Open a model that fits in memory for it.` }));
  }
  if (!OFF.heads) P.heads.run("heads", {}, drawHeads);
  document.documentElement.dataset.ready = "1";
})();
