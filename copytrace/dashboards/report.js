/* copytrace report: builds every view from the JSON payload in #ct-data with Plotly.
 * Strings from the trace reach the page only through textContent (tables, lists) or esc()
 * (plotly text, which understands a little HTML).
 * It waits for window.ctPlotly (set by the page: plotly.js unpacked or loaded); without
 * plotly.js (offline with a --cdn report) every table and text is still drawn, and a note
 * says why the charts are missing and how to get a self-contained report. */
(function (main) {
  (window.ctPlotly || Promise.resolve()).then(() => main(null), (err) => main(err || "failed"));
})(function (plotlyError) {
  "use strict";
  const T_START = performance.now();
  const D = JSON.parse(document.getElementById("ct-data").textContent);
  const S = D.S;
  const KINDS = D.kinds; // ["copy", "alias", "noop"]
  const KIND_LABEL = { copy: "copy", alias: "alias", noop: "no-op" };
  const KIND_COLOR = { copy: "#d62728", alias: "#6baed6", noop: "#b0b0b0" };
  const STAGES = D.stages; // ["warmup", "steady", "tail"]
  const STAGE_LABEL = { warmup: "warm-up", steady: "steady state", tail: "last step" };
  const STAGE_COLOR = { warmup: "#f2a541", steady: "#4c78a8", tail: "#9d9d9d" };
  const GRAPH_COLOR = { attached: "#e6550d", detached: "#31a354", none: "#bdbdbd", "?": "#dddddd" };
  const PHASE_ORDER = ["forward", "backward", "optimizer", "other", ""];
  const METRICS = {
    bc: { label: "bytes copied", fmt: fmtBytes },
    ba: { label: "bytes allocated", fmt: fmtBytes },
    t: { label: "copy time", fmt: fmtNs },
    n: { label: "events", fmt: fmtInt },
  };
  const CONFIG = { displaylogo: false, responsive: true,
    modeBarButtonsToRemove: ["lasso2d", "select2d", "autoScale2d"] };
  const FONT = { family: "system-ui, -apple-system, Segoe UI, Roboto, sans-serif", size: 12 };
  const NRUNS = D.runs.length;

  const state = {
    runs: new Set(D.runs.map((_, i) => i)),
    focus: null, // {type: "site"|"module"|"op"|"hazard", key, label}
    metric: "bc",
    groupBy: "site",
    sortKey: "bc",
    sortDesc: true,
    showAll: false,
    kinds: { copy: true, alias: false, noop: false },
    lanes: "phase",
    zoom: null,
  };
  if (!D.totals.copies) { state.kinds = { copy: true, alias: true, noop: true }; }
  {
    const phases = new Set();
    for (let t = 0; t < D.tpl.kind.length; t++) if (state.kinds[KINDS[D.tpl.kind[t]]]) phases.add(D.tpl.phase[t]);
    if (phases.size <= 1) state.lanes = "site"; // one phase lane says nothing: show sources
  }
  if (!D.totals.bc) { state.metric = "t"; state.sortKey = "t"; }

  // ---- helpers ---------------------------------------------------------------------------
  function esc(s) {
    return String(s).replace(/[&<>"']/g, (c) => (
      { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
  }
  function fmtInt(n) { return (n == null ? 0 : n).toLocaleString("en-US"); }
  function fmtBytes(n) {
    if (n == null) return "-";
    let v = Number(n);
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    for (let i = 0; i < units.length; i++) {
      if (Math.abs(v) < 1024 || i === units.length - 1) {
        return i === 0 ? Math.round(v) + " B" : v.toFixed(1) + " " + units[i];
      }
      v /= 1024;
    }
    return String(n);
  }
  function fmtNs(ns) {
    if (ns == null) return "-";
    const v = Number(ns);
    if (Math.abs(v) < 1e3) return Math.round(v) + " ns";
    if (Math.abs(v) < 1e6) return (v / 1e3).toFixed(1) + " us";
    if (Math.abs(v) < 1e9) return (v / 1e6).toFixed(2) + " ms";
    return (v / 1e9).toFixed(3) + " s";
  }
  function fmtPct(x, digits) {
    if (x == null || !isFinite(x)) return "-";
    const d = digits != null ? digits : (Math.abs(x) >= 10 ? 1 : Math.abs(x) >= 1 ? 2 : 3);
    return x.toFixed(d) + "%";
  }
  function pct(a, b) { return b ? (a / b) * 100 : 0; }
  // Ticks in binary units (KiB, MiB...) for an axis of bytes from 0 to max, about 5 of them.
  function bytesAxis(max) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let k = 0;
    while (k < units.length - 1 && max >= 1024 * Math.pow(1024, k)) k++;
    const u = Math.pow(1024, k);
    const span = Math.max(max / u, 1e-9);
    let step = 1;
    for (const m of [1, 2, 5, 10, 20, 50, 100, 200, 500]) { step = m; if (span / m <= 5) break; }
    if (span < 1) step = span <= 0.2 ? 0.05 : span <= 0.5 ? 0.1 : 0.25;
    const tickvals = [], ticktext = [];
    for (let v = 0; v <= span * 1.0001 + step; v += step) {
      tickvals.push(v * u);
      ticktext.push(v === 0 ? "0" : k === 0 ? Math.round(v) + " B" : (Number.isInteger(v) ? v : v.toFixed(2).replace(/0+$/, "")) + " " + units[k]);
      if (v > span) break;
    }
    return { tickmode: "array", tickvals, ticktext };
  }
  function fmtSec(ms) { return (ms / 1e3).toFixed(ms < 1e5 ? 4 : 3) + " s"; }
  // torch's __torch_function__ dispatch helper says nothing about where a copy came from
  const NOISE_VIA = new Set(["handle_torch_function"]);
  function viaName(si) { const v = S[si] || ""; return NOISE_VIA.has(v) ? "" : v; }
  function quantile(values, q) {
    if (!values.length) return null;
    const s = values.slice().sort((a, b) => a - b);
    const pos = (s.length - 1) * q, lo = Math.floor(pos), hi = Math.ceil(pos);
    return s[lo] + (s[hi] - s[lo]) * (pos - lo);
  }
  function median(values) {
    if (!values.length) return null;
    const s = values.slice().sort((a, b) => a - b);
    const m = s.length >> 1;
    return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
  }
  function el(tag, props, children) {
    const node = document.createElement(tag);
    if (props) {
      for (const [k, v] of Object.entries(props)) {
        if (v == null) continue;
        if (k === "text") node.textContent = v;
        else if (k === "class") node.className = v;
        else if (k === "title") node.title = v;
        else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
        else if (k === "style") node.style.cssText = v;
        else node.setAttribute(k, v);
      }
    }
    for (const c of children || []) {
      if (c == null) continue;
      node.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    }
    return node;
  }
  function $(id) { return document.getElementById(id); }
  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); return node; }
  function siteLabel(si) { const s = D.sites[si]; return s ? S[s.label] : S[si]; }
  function siteSource(si) { const s = D.sites[si]; return s ? S[s.source] : ""; }
  function moduleLabel(mi) { return S[mi] || "outside any nn.Module"; }
  function layout(extra) {
    return Object.assign({ template: "plotly_white", font: FONT, hoverlabel: { align: "left" },
      margin: { l: 60, r: 20, t: 30, b: 45 }, paper_bgcolor: "#fff", plot_bgcolor: "#fff" }, extra);
  }
  const HAS_PLOTLY = typeof Plotly !== "undefined" && !!Plotly.newPlot;
  const NO_FIGURE = { _ctBound: true, data: [], on() {} }; // what plot() resolves to without plotly.js
  function noChart(div) {
    if (div.dataset.ctNoChart) return;
    div.dataset.ctNoChart = "1";
    div.classList.add("nochart");
    clear(div).appendChild(el("div", { text: "Chart not available: plotly.js did not load (see the note at the top of the page)." }));
  }
  function relayout(div, update) { if (HAS_PLOTLY) Plotly.relayout(div, update); }
  function plot(id, traces, lay) {
    const div = $(id);
    if (!HAS_PLOTLY) { noChart(div); return Promise.resolve(NO_FIGURE); }
    // first draw with newPlot, later redraws (rank, focus, filters) with react
    return div.data ? Plotly.react(div, traces, lay, CONFIG) : Plotly.newPlot(div, traces, lay, CONFIG);
  }
  function runLabel(r) { return S[D.runs[r].label]; }
  function runShort(r) { const x = D.runs[r]; return x.rank != null ? "rank " + x.rank : S[x.label]; }
  const RUN_COLORS = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6", "#9d755d"];
  function multi() { return state.runs.size > 1; }
  function rangeText(steps, n) {
    if (!steps.length) return "-";
    const parts = [];
    let a = steps[0], b = steps[0];
    for (let i = 1; i <= steps.length; i++) {
      const s = steps[i];
      if (s === b + 1) { b = s; continue; }
      parts.push(a === b ? String(a) : a + "-" + b);
      if (i < steps.length) { a = b = s; }
      if (parts.length >= 6 && i < steps.length) { parts.push("..."); break; }
    }
    return parts.join(", ") + (n > 1 ? " (" + fmtInt(n) + " steps)" : "");
  }

  // ---- aggregation over the cube ----------------------------------------------------------
  const C = D.cube;
  function blank() { return { n: 0, nc: 0, na: 0, nn: 0, bc: 0, ba: 0, bl: 0, t: 0, err: 0,
    ops: new Map(), others: new Map(), vias: new Map(), entries: new Map() }; }
  // the other call site of a cube row: the user's line beside a library call site (or the
  // library's beside the user's line, when the report groups by the user's line)
  function entryOf(i) { return C.entry ? C.entry[i] : 0; }
  const ENTRY_WORD = D.group_by === "user" ? "library: " : "from your line: ";
  function entryText(entries) {
    const top = [...entries.entries()].filter(([e]) => S[e]).sort((a, b) => b[1] - a[1]);
    if (!top.length) return "";
    return ENTRY_WORD + siteLabel(top[0][0]) + (top.length > 1 ? " (+" + (top.length - 1) + " more)" : "");
  }
  function aggregate(keyOf, otherOf) {
    const out = new Map();
    for (let i = 0; i < C.n.length; i++) {
      if (!state.runs.has(C.run[i])) continue;
      const k = keyOf(i);
      let r = out.get(k);
      if (!r) { r = blank(); r.key = k; out.set(k, r); }
      const n = C.n[i];
      r.n += n; r.bc += C.bc[i]; r.ba += C.ba[i]; r.bl += C.bl[i]; r.t += C.t[i]; r.err += C.err[i];
      const kind = KINDS[C.kind[i]];
      if (kind === "copy") r.nc += n; else if (kind === "alias") r.na += n; else r.nn += n;
      r.ops.set(C.op[i], (r.ops.get(C.op[i]) || 0) + n);
      if (C.via[i]) r.vias.set(C.via[i], (r.vias.get(C.via[i]) || 0) + n);
      const en = entryOf(i);
      if (en) r.entries.set(en, (r.entries.get(en) || 0) + n);
      if (otherOf) { const o = otherOf(i); r.others.set(o, (r.others.get(o) || 0) + n); }
    }
    return out;
  }
  function totals() {
    const all = aggregate(() => 0).get(0) || blank();
    const tk = { copy: 0, alias: 0, noop: 0 };
    for (let i = 0; i < C.n.length; i++) {
      if (state.runs.has(C.run[i])) tk[KINDS[C.kind[i]]] += C.t[i];
    }
    all.t_kind = tk;
    return all;
  }
  function viaText(map) {
    if (!map || !map.size) return "";
    const items = [...map.entries()].filter(([v]) => viaName(v)).sort((a, b) => b[1] - a[1]);
    if (!items.length) return "";
    return " via " + items.slice(0, 2).map(([v]) => S[v]).join(", ") + (items.length > 2 ? ", ..." : "");
  }
  function opsText(map, limit) {
    const items = [...map.entries()].sort((a, b) => b[1] - a[1]);
    const parts = items.slice(0, limit || 4).map(([op, n]) => S[op] + " \u00d7" + fmtInt(n));
    if (items.length > (limit || 4)) parts.push("...");
    return parts.join(", ");
  }

  // ---- steps and stages -------------------------------------------------------------------
  const ST = D.steps;
  function stageStats() {
    const out = {};
    for (const s of STAGES) out[s] = { steps: 0, stepT: 0, ct: 0, bc: 0, ev: 0, shares: [] };
    for (let i = 0; i < ST.step.length; i++) {
      if (!state.runs.has(ST.run[i])) continue;
      const o = out[STAGES[ST.stage[i]]];
      o.steps += 1; o.stepT += ST.dur[i] || 0; o.ct += ST.ct[i]; o.bc += ST.bc[i]; o.ev += ST.ev[i];
      if (ST.dur[i]) o.shares.push(pct(ST.ct[i], ST.dur[i]));
    }
    for (const s of STAGES) {
      const o = out[s];
      o.share = pct(o.ct, o.stepT);
      o.median = median(o.shares);
      o.q1 = quantile(o.shares, 0.25);
      o.q3 = quantile(o.shares, 0.75);
      // Noisy: the middle half of the steps spreads over more than half the median share.
      o.noisy = o.shares.length >= 4 && o.median > 0 && (o.q3 - o.q1) > 0.5 * o.median;
    }
    return out;
  }

  // ---- header -------------------------------------------------------------------------------
  function renderHeader() {
    const runs = D.runs;
    const r0 = runs[0];
    const cmd = S[r0.command];
    const commands = [...new Set(runs.map((r) => S[r.command] || "(command unknown)"))];
    if (commands.length > 1) {
      // runs of different commands in one report: one line per command, with the first run
      // (process) that ran it, so that two programs are never shown as one
      $("ct-cmd").textContent = commands.map((c) => S[runs.find((r) => (S[r.command] || "(command unknown)") === c).label] + ": $ " + c).join("\n");
      $("ct-cmd").style.whiteSpace = "pre-line";
    } else {
      $("ct-cmd").textContent = !cmd ? "(command unknown)" : D.title.includes(cmd) ? "" : "$ " + cmd;
    }
    const meta = $("ct-meta");
    clear(meta);
    const devices = new Set();
    runs.forEach((r) => r.devices.forEach((d) => devices.add(S[d])));
    const ranks = runs.filter((r) => r.rank != null).length;
    const dur = Math.max(...runs.map((r) => r.duration_ns));
    const recorded = runs.reduce((a, r) => a + (r.events_recorded != null ? r.events_recorded : r.events_loaded), 0);
    const dropped = runs.reduce((a, r) => a + r.dropped + (r.discarded || 0), 0);
    const overheadRuns = runs.filter((r) => r.overhead_ns != null);
    const overhead = overheadRuns.reduce((a, r) => a + r.overhead_ns, 0);
    const items = [
      ["torch", [...new Set(runs.map((r) => S[r.torch] || "?"))].join(", ")],
      ["copytrace", [...new Set(runs.map((r) => S[r.copytrace] || "?"))].join(", ")],
      ["devices", [...devices].join(", ") || "?"],
      [ranks ? "ranks" : "processes", ranks ? String(ranks) + (ranks < runs.length ? " (+" + (runs.length - ranks) + " without rank)" : "") : String(runs.length)],
      ["host", [...new Set(runs.map((r) => S[r.host] || "?"))].join(", ")],
      ["duration", fmtNs(dur) + (runs.length > 1 ? " (longest)" : "")],
      ["steps", fmtInt(runs.reduce((a, r) => a + r.steps, 0))],
      ...(runs.some((r) => r.windows && r.windows.length)
        ? [["traced windows", runs.filter((r) => r.windows && r.windows.length).map((r) => (NRUNS > 1 ? runShort(runs.indexOf(r)) + ": " : "") + "steps " + r.windows.map((w) => S[w]).join(", ")).join("; ")]]
        : []),
      ["events", fmtInt(recorded)],
      ["dropped", fmtInt(dropped)],
      ["tracer self-overhead", overheadRuns.length ? fmtNs(overhead) + " (" + fmtPct(pct(overhead, runs.reduce((a, r) => a + r.duration_ns, 0))) + " of run time)" : "not recorded"],
      ["started", runs[0].start || "?"],
    ];
    items.forEach(([k, v], i) => {
      if (i) meta.appendChild(document.createTextNode("  \u00b7  "));
      meta.appendChild(document.createTextNode(k + " "));
      meta.appendChild(el("b", { text: v }));
    });
    if (NRUNS > 1) {
      const sel = $("ct-rank");
      sel.hidden = false;
      clear(sel);
      sel.appendChild(el("option", { value: "all", text: "all " + NRUNS + " runs" }));
      runs.forEach((r, i) => sel.appendChild(el("option", { value: String(i), text: S[r.label] })));
      sel.addEventListener("change", () => {
        state.runs = sel.value === "all" ? new Set(runs.map((_, i) => i)) : new Set([Number(sel.value)]);
        state.zoom = null;
        renderAll();
      });
    }
    const w = $("ct-warnings");
    clear(w);
    D.warnings.forEach((t) => w.appendChild(el("div", { class: "warn", text: t })));
    if (!HAS_PLOTLY) {
      const how = document.body.dataset.ctSelfContained || "copytrace report TRACE_DIR -o report.html";
      const why = plotlyError
        ? "the plotly.js inlined in this page could not be unpacked (" + String(plotlyError.message || plotlyError) + ")"
        : "this report loads plotly.js from the internet (cdn.plot.ly), and it did not load (offline, or blocked)";
      w.appendChild(el("div", { class: "warn", id: "ct-nocharts" }, [
        el("b", { text: "The charts could not load: " }), why + ". Every table and number is still here. " +
        "For a self-contained report that works offline, write it again without --cdn: ", el("code", { text: how })]));
    }
  }

  // ---- at a glance --------------------------------------------------------------------------
  function kpi(k, v, d, hero, extra) {
    return el("div", { class: "kpi" + (hero ? " hero" : "") }, [
      el("div", { class: "k", text: k }), el("div", { class: "v", text: v }),
      d ? el("div", { class: "d", text: d }) : null, extra || null]);
  }
  function renderGlance() {
    const T = totals();
    const st = stageStats();
    const box = clear($("ct-kpis"));
    const steady = st.steady, warm = st.warmup, tail = st.tail;
    let hero;
    if (steady.steps && steady.stepT > 0) {
      const extra = [];
      if (warm.steps) extra.push("warm-up " + fmtPct(warm.share) + " (" + warm.steps + " step" + (warm.steps > 1 ? "s" : "") + ")");
      if (tail.steps) extra.push("last step " + fmtPct(tail.share));
      hero = kpi("Copy time share of each step (steady state)", fmtPct(steady.share),
        fmtNs(steady.stepT / steady.steps) + " per step, " +
        fmtInt(steady.steps) + " steady steps; median " + fmtPct(steady.median) +
        (extra.length ? " \u00b7 " + extra.join(", ") : ""), true);
      // the absolute copy time per step, beside the share
      hero.insertBefore(el("div", { class: "v abs", id: "ct-copy-per-step", text: fmtNs(steady.ct / steady.steps) + " copy time per step" }), hero.children[2]);
      if (steady.noisy) {
        hero.appendChild(el("div", { class: "noisy", id: "ct-noisy", text: "Noisy: the share varies between steps (middle half of the steps " +
          fmtPct(steady.q1) + " to " + fmtPct(steady.q3) + "), as step times move with the machine's load; compare runs by the copy time per step." }));
      }
    } else {
      const stepT = warm.stepT + tail.stepT + steady.stepT;
      hero = kpi("Copy time share of the traced steps", stepT ? fmtPct(pct(T.t, stepT)) : "-",
        stepT ? "too few steps to separate warm-up from the steady state"
          : "the trace has no step timing (no copytrace.step spans); copy calls took " + fmtNs(T.t), true);
    }
    box.appendChild(hero);
    box.appendChild(kpi("Bytes copied", fmtBytes(T.bc),
      (steady.steps ? fmtBytes(steady.bc / steady.steps) + " per steady step \u00b7 " : "") +
      fmtBytes(T.ba) + " newly allocated", false,
      D.totals.bytes_defs ? el("div", { class: "d", id: "ct-bytes-defs", text: D.totals.bytes_defs }) : null));
    box.appendChild(kpi("Copy calls (host time)", fmtNs(T.t),
      "copies " + fmtNs(T.t_kind.copy) + " \u00b7 aliases " + fmtNs(T.t_kind.alias) + " \u00b7 no-ops " + fmtNs(T.t_kind.noop)));
    const bar = el("div", { class: "kindbar" }, KINDS.map((k) => {
      const n = k === "copy" ? T.nc : k === "alias" ? T.na : T.nn;
      return el("span", { style: "width:" + pct(n, T.n) + "%;background:" + KIND_COLOR[k],
        title: KIND_LABEL[k] + ": " + fmtInt(n) });
    }));
    box.appendChild(kpi("Events", fmtInt(T.n),
      fmtInt(T.nc) + " real copies \u00b7 " + fmtInt(T.na) + " aliases \u00b7 " + fmtInt(T.nn) + " no-op conversions", false, bar));
    const xfer = crossDevice();
    box.appendChild(kpi("Cross-device", fmtBytes(xfer.b),
      xfer.n ? fmtInt(xfer.n) + " transfers between devices" : "no copy crossed devices"));
    const nh = D.hazards.length;
    box.appendChild(kpi("Hazards", D.analysis === "ran" || nh ? fmtInt(nh) : "-",
      nh ? "see the hazards table" : D.analysis === "ran" ? "the analyser found none" :
        "hazard analyser " + (D.analysis === "skipped" ? "not run" : D.analysis)));

    const bySite = [...aggregate((i) => C.site[i], (i) => C.module[i]).values()];
    renderTopList($("ct-top-bytes"), bySite, "bc", T.bc, "bytes copied", fmtBytes, "");
    renderTopList($("ct-top-time"), bySite, "t", T.t, "copy time", fmtNs, "time");
  }
  function crossDevice() {
    let n = 0, b = 0;
    for (const r of D.transfers) {
      if (!state.runs.has(r.run)) continue;
      const s = S[r.src], d = S[r.dst];
      if (s && d && s !== d && s !== "?" && d !== "?") { n += r.n; b += r.bl; }
    }
    return { n, b };
  }
  function renderTopList(box, rows, key, total, what, fmt, cls) {
    clear(box);
    rows = rows.filter((r) => r[key] > 0).sort((a, b) => b[key] - a[key] || a.key - b.key).slice(0, 5);
    if (!rows.length) {
      box.appendChild(el("div", { class: "empty", text: "no " + what + " in this selection" + (key === "bc" ? " (every event is an alias or a no-op)" : "") }));
      return;
    }
    const list = el("ol", { class: "toplist " + cls });
    rows.forEach((r, i) => {
      const mods = [...r.others.entries()].filter(([m]) => S[m]).sort((a, b) => b[1] - a[1]).map(([m]) => S[m]);
      const share = pct(r[key], total);
      const src = siteSource(r.key);
      list.appendChild(el("li", { title: S[r.key], onclick: () => setFocus({ type: "site", key: r.key, label: siteLabel(r.key) }, true) }, [
        el("span", { class: "rank", text: String(i + 1) }),
        el("span", { class: "site mono", text: siteLabel(r.key) }),
        el("span", { class: "num", text: fmt(r[key]) + "  " + fmtPct(share, 1) }),
        src ? el("code", { class: "src", text: src }) : null,
        el("span", { class: "share" }, [el("span", { style: "width:" + Math.max(1, share) + "%" })]),
        el("span", { class: "sub", text: opsText(r.ops, 3) + viaText(r.vias) + " \u00b7 " + fmtInt(r.nc) + " copies, " + fmtInt(r.na + r.nn) + " aliases/no-ops" + (mods.length ? " \u00b7 module " + mods.slice(0, 2).join(", ") + (mods.length > 2 ? ", ..." : "") : "") }),
      ]));
    });
    box.appendChild(list);
  }

  // ---- per-step overhead --------------------------------------------------------------------
  function renderSteps() {
    const st = stageStats();
    const tbl = clear($("ct-stage-table"));
    const head = el("tr", null, ["stage", "steps", "step time / step", "copy time / step", "copy-time share", "median share", "bytes copied / step", "events / step"].map((h, i) => el("th", { class: i ? "n" : null, text: h })));
    tbl.appendChild(head);
    for (const s of STAGES) {
      const o = st[s];
      if (!o.steps) continue;
      tbl.appendChild(el("tr", null, [
        el("td", null, [el("span", { class: "swatch", style: "background:" + STAGE_COLOR[s] }), STAGE_LABEL[s]]),
        el("td", { class: "n", text: fmtInt(o.steps) }),
        el("td", { class: "n", text: fmtNs(o.stepT / o.steps) }),
        el("td", { class: "n", text: fmtNs(o.ct / o.steps) }),
        el("td", { class: "n", text: fmtPct(o.share) }),
        el("td", { class: "n", text: fmtPct(o.median) }),
        el("td", { class: "n", text: fmtBytes(o.bc / o.steps) }),
        el("td", { class: "n", text: (o.ev / o.steps).toFixed(1) }),
      ]));
    }
    const runs = [...state.runs];
    const traces = [];
    const many = ST.step.length > 3000;
    const steadyShare = st.steady.steps ? st.steady.share : null;
    let maxStepBytes = 0;
    for (let i = 0; i < ST.step.length; i++) if (state.runs.has(ST.run[i]) && ST.bc[i] > maxStepBytes) maxStepBytes = ST.bc[i];
    for (const r of runs) {
      const idx = [];
      for (let i = 0; i < ST.step.length; i++) if (ST.run[i] === r) idx.push(i);
      if (!idx.length) continue;
      const x = idx.map((i) => ST.step[i]);
      const share = idx.map((i) => (ST.dur[i] ? pct(ST.ct[i], ST.dur[i]) : null));
      const hover = idx.map((i) => "<b>step " + ST.step[i] + "</b> (" + STAGE_LABEL[STAGES[ST.stage[i]]] + ")" +
        (runs.length > 1 ? " \u00b7 " + esc(runLabel(r)) : "") +
        "<br>copy time " + fmtNs(ST.ct[i]) + " of " + fmtNs(ST.dur[i]) + " = " + fmtPct(ST.dur[i] ? pct(ST.ct[i], ST.dur[i]) : null) +
        "<br>bytes copied " + fmtBytes(ST.bc[i]) + " \u00b7 allocated " + fmtBytes(ST.ba[i]) +
        "<br>" + fmtInt(ST.nc[i]) + " copies, " + fmtInt(ST.na[i]) + " aliases, " + fmtInt(ST.nn[i]) + " no-ops" +
        "<br><i>click: show this step on the timeline</i>");
      const colors = idx.map((i) => STAGE_COLOR[STAGES[ST.stage[i]]]);
      const name = runs.length > 1 ? esc(runLabel(r)) : "copy-time share";
      if (runs.length > 1 || many) {
        const color = runs.length > 1 ? RUN_COLORS[r % RUN_COLORS.length] : STAGE_COLOR.steady;
        traces.push({ type: "scatter", mode: "lines", x, y: share, name, hovertext: hover, hoverinfo: "text", line: { width: 1.2, color }, customdata: x, legendgroup: name });
        traces.push({ type: "scatter", mode: "lines", x, y: idx.map((i) => ST.bc[i]), name, hovertext: hover, hoverinfo: "text", xaxis: "x", yaxis: "y2", showlegend: false, line: { width: 1.2, color }, legendgroup: name, customdata: x });
      } else {
        traces.push({ type: "bar", x, y: share, name: "copy-time share", marker: { color: colors }, hovertext: hover, hoverinfo: "text", customdata: x, showlegend: false });
        traces.push({ type: "bar", x, y: idx.map((i) => ST.bc[i]), name: "bytes copied", marker: { color: colors }, hovertext: hover, hoverinfo: "text", yaxis: "y2", customdata: x, showlegend: false });
      }
    }
    if (runs.length === 1 && !many) {
      for (const s of STAGES) {
        if (!st[s].steps) continue;
        traces.push({ type: "bar", x: [null], y: [null], name: STAGE_LABEL[s], marker: { color: STAGE_COLOR[s] }, showlegend: true, hoverinfo: "skip" });
      }
    }
    const shapes = [];
    if (steadyShare != null) {
      shapes.push({ type: "line", xref: "paper", x0: 0, x1: 1, yref: "y", y0: steadyShare, y1: steadyShare,
        line: { color: "#333", width: 1, dash: "dash" } });
    }
    const lay = layout({
      height: 430, barmode: "overlay", bargap: 0.05, hovermode: "closest",
      margin: { l: 70, r: 20, t: 20, b: 45 },
      legend: { orientation: "h", x: 1, xanchor: "right", y: 1.06 },
      xaxis: { title: { text: "step" }, anchor: "y2" },
      yaxis: { title: { text: "copy time / step time" }, domain: [0.45, 1], ticksuffix: "%", rangemode: "tozero" },
      yaxis2: Object.assign({ title: { text: "bytes copied" }, domain: [0, 0.36], rangemode: "tozero" }, bytesAxis(maxStepBytes)),
      shapes,
      annotations: steadyShare != null ? [{ xref: "paper", x: 1, yref: "y", y: steadyShare, text: "steady state " + fmtPct(steadyShare), showarrow: false, xanchor: "right", yanchor: "bottom", font: { size: 11, color: "#333" } }] : [],
    });
    plot("fig-steps", traces, lay).then((gd) => {
      if (gd._ctBound) return;
      gd._ctBound = true;
      gd.on("plotly_click", (ev) => {
        const p = ev.points && ev.points[0];
        if (p && p.x != null) { zoomStep(Number(p.x)); $("timeline").scrollIntoView({ behavior: "smooth" }); }
      });
    });
  }

  // ---- where they come from -----------------------------------------------------------------
  function sourcesRows() {
    if (state.groupBy === "site") return [...aggregate((i) => C.site[i], (i) => C.module[i]).values()];
    if (state.groupBy === "module") return [...aggregate((i) => C.module[i], (i) => C.site[i]).values()];
    return [...aggregate((i) => C.op[i], (i) => C.site[i]).values()];
  }
  function renderTreemap() {
    const m = state.metric;
    const ids = ["root"], labels = ["all events"], parents = [""], values = [0], hover = ["all events"];
    const modTotals = new Map();
    const leaves = [];
    for (let i = 0; i < C.n.length; i++) {
      if (!state.runs.has(C.run[i])) continue;
      const v = C[m][i];
      if (!v) continue;
      const key = C.module[i] + "|" + C.site[i];
      leaves.push([key, C.module[i], C.site[i], v, i]);
    }
    const leafMap = new Map();
    for (const [key, mod, site, v, i] of leaves) {
      let e = leafMap.get(key);
      if (!e) { e = { mod, site, v: 0, n: 0, bc: 0, t: 0, ops: new Map(), vias: new Map(), entries: new Map() }; leafMap.set(key, e); }
      e.v += v; e.n += C.n[i]; e.bc += C.bc[i]; e.t += C.t[i];
      const en = entryOf(i);
      if (en) e.entries.set(en, (e.entries.get(en) || 0) + C.n[i]);
      if (C.via[i]) e.vias.set(C.via[i], (e.vias.get(C.via[i]) || 0) + C.n[i]);
      e.ops.set(C.op[i], (e.ops.get(C.op[i]) || 0) + C.n[i]);
      modTotals.set(mod, (modTotals.get(mod) || 0) + v);
    }
    const total = [...modTotals.values()].reduce((a, b) => a + b, 0);
    values[0] = total;
    hover[0] = "<b>all events</b><br>" + METRICS[m].label + ": " + METRICS[m].fmt(total);
    for (const [mod, v] of modTotals) {
      if (!S[mod]) continue; // call sites outside any nn.Module sit directly under the root
      ids.push("m" + mod); labels.push(esc(moduleLabel(mod))); parents.push("root"); values.push(v);
      hover.push("<b>module " + esc(moduleLabel(mod)) + "</b><br>" + METRICS[m].label + ": " + METRICS[m].fmt(v) + " (" + fmtPct(pct(v, total), 1) + ")");
    }
    for (const [key, e] of leafMap) {
      ids.push("s" + key); labels.push(esc(siteLabel(e.site))); parents.push(S[e.mod] ? "m" + e.mod : "root"); values.push(e.v);
      const src = siteSource(e.site);
      const entry = entryText(e.entries);
      hover.push("<b>" + esc(siteLabel(e.site)) + "</b>" + (src ? "<br>" + esc(src) : "") + (entry ? "<br>" + esc(entry) : "") +
        (S[e.mod] ? "<br>module: " + esc(S[e.mod]) : "") + "<br>" + METRICS[m].label + ": " + METRICS[m].fmt(e.v) + " (" + fmtPct(pct(e.v, total), 1) + ")" +
        "<br>bytes copied " + fmtBytes(e.bc) + " \u00b7 time " + fmtNs(e.t) + " \u00b7 " + fmtInt(e.n) + " events" +
        "<br>" + esc(opsText(e.ops, 4) + viaText(e.vias)) + "<br><i>click: show these events</i>");
    }
    let maxLeaf = 1;
    for (const e of leafMap.values()) if (e.v > maxLeaf) maxLeaf = e.v;
    const rgb = m === "t" ? "123,65,115" : m === "n" ? "76,120,168" : "214,39,40";
    const colors = ids.map((id, k) => (id.startsWith("s") ? "rgba(" + rgb + "," + (0.18 + 0.82 * Math.sqrt(values[k] / maxLeaf)).toFixed(3) + ")" : id === "root" ? "#f4f5f7" : "#e4e7ec"));
    const traces = [{ type: "treemap", ids, labels, parents, values, branchvalues: "total",
      hovertext: hover, hoverinfo: "text", textinfo: "label+value+percent root", maxdepth: 3,
      texttemplate: ids.map((id, k) => (id === "root" ? "%{label}" : "%{label}<br>" + METRICS[m].fmt(values[k]) + " · %{percentRoot:.1%}")),
      marker: { colors, line: { width: 1, color: "#fff" } },
      pathbar: { visible: true }, root: { color: "#f4f5f7" } }];
    const lay = layout({ height: 420, margin: { l: 5, r: 5, t: 30, b: 5 } });
    if (!total) {
      lay.annotations = [{ text: "no " + METRICS[m].label + " in this selection", showarrow: false, x: 0.5, y: 0.5, xref: "paper", yref: "paper" }];
    }
    plot("fig-treemap", total ? traces : [], lay).then((gd) => {
      if (gd._ctBound) return;
      gd._ctBound = true;
      gd.on("plotly_treemapclick", (ev) => {
        const p = ev.points && ev.points[0];
        if (!p || typeof p.id !== "string") return true;
        if (p.id.startsWith("s")) {
          const site = Number(p.id.split("|")[1]);
          setFocus({ type: "site", key: site, label: siteLabel(site) }, false);
          return false;
        }
        if (p.id.startsWith("m")) {
          const mod = Number(p.id.slice(1));
          setFocus({ type: "module", key: mod, label: "module " + moduleLabel(mod) }, false);
        }
        return true;
      });
    });
  }
  function renderSourcesTable() {
    const rows = sourcesRows();
    const T = totals();
    const key = state.sortKey;
    rows.sort((a, b) => (state.sortDesc ? b[key] - a[key] : a[key] - b[key]) || a.key - b.key);
    const what = { site: "call site", module: "module", op: "op" }[state.groupBy];
    const cols = [
      ["#", null], [what, null], ["bytes copied", "bc"], ["% bytes", "bc"], ["bytes allocated", "ba"],
      ["copy time", "t"], ["% time", "t"], ["events", "n"], ["copies", "nc"], ["aliases", "na"],
      ["no-ops", "nn"], [state.groupBy === "site" ? "modules" : "call sites", null], ["ops", null],
    ];
    const table = clear($("ct-sources-table"));
    table.appendChild(el("tr", null, cols.map(([h, k], i) => el("th", {
      class: (i > 1 && i < 11 ? "n " : "") + (k ? "sort" : ""),
      text: h + (k && k === key && (h.startsWith("%") === false) ? (state.sortDesc ? " \u25bc" : " \u25b2") : ""),
      onclick: k ? () => { if (state.sortKey === k) state.sortDesc = !state.sortDesc; else { state.sortKey = k; state.sortDesc = true; } renderSourcesTable(); } : null,
    }))));
    const limit = state.showAll ? 2000 : 25;
    rows.slice(0, limit).forEach((r, i) => {
      let name;
      if (state.groupBy === "site") {
        const src = siteSource(r.key);
        const entry = entryText(r.entries);
        name = el("td", { class: "site", title: S[r.key] }, [el("code", { text: siteLabel(r.key) }), src ? el("code", { class: "src", text: src }) : null,
          entry ? el("code", { class: "src entry", text: entry }) : null]);
      } else if (state.groupBy === "module") {
        name = el("td", { class: "site" }, [el("code", { text: moduleLabel(r.key) })]);
      } else {
        name = el("td", null, [el("span", { class: "swatch", style: "background:" + (D.op_colors[r.key] || "#888") }), S[r.key]]);
      }
      const others = [...r.others.entries()].filter(([o]) => state.groupBy !== "site" || S[o]).sort((a, b) => b[1] - a[1]).map(([o]) => state.groupBy === "module" || state.groupBy === "op" ? siteLabel(o) : S[o]);
      const focusType = state.groupBy;
      const label = state.groupBy === "site" ? siteLabel(r.key) : state.groupBy === "module" ? "module " + moduleLabel(r.key) : "op " + S[r.key];
      const selected = state.focus && state.focus.type === focusType && state.focus.key === r.key;
      table.appendChild(el("tr", { class: "click" + (selected ? " sel" : ""), onclick: () => setFocus({ type: focusType, key: r.key, label }, true) }, [
        el("td", { class: "n", text: String(i + 1) }), name,
        el("td", { class: "n", text: fmtBytes(r.bc) }), el("td", { class: "n", text: fmtPct(pct(r.bc, T.bc), 1) }),
        el("td", { class: "n", text: fmtBytes(r.ba) }), el("td", { class: "n", text: fmtNs(r.t) }),
        el("td", { class: "n", text: fmtPct(pct(r.t, T.t), 1) }), el("td", { class: "n", text: fmtInt(r.n) }),
        el("td", { class: "n", text: fmtInt(r.nc) }), el("td", { class: "n", text: fmtInt(r.na) }),
        el("td", { class: "n", text: fmtInt(r.nn) }),
        el("td", { class: "mono", text: others.slice(0, 3).join(", ") + (others.length > 3 ? ", ..." : "") }),
        el("td", { text: opsText(r.ops, 3) + viaText(r.vias) }),
      ]));
    });
    const more = $("ct-sources-more");
    clear(more);
    if (rows.length > 25) {
      more.appendChild(el("button", { text: state.showAll ? "show the top 25" : "show all " + fmtInt(rows.length) + " rows",
        onclick: () => { state.showAll = !state.showAll; renderSourcesTable(); } }));
    }
  }
  function renderSources() {
    const note = $("ct-groupby-note");
    if (note) note.textContent = D.group_by === "user"
      ? "Call sites are your lines; a copy made inside a library names the library's line beside them."
      : "A copy made inside an installed library (transformers, accelerate, Lightning...) is placed at the library's line, with your line that reached it beside it (copytrace report --group-by user places it at your line).";
    document.querySelectorAll("#ct-metric button").forEach((b) => b.classList.toggle("on", b.dataset.v === state.metric));
    document.querySelectorAll("#ct-groupby button").forEach((b) => b.classList.toggle("on", b.dataset.v === state.groupBy));
    renderTreemap();
    renderSourcesTable();
  }

  // ---- timeline -----------------------------------------------------------------------------
  const P = D.pts, TP = D.tpl;
  // Hazards worth a mark on the timeline (and shown whatever the kind filter): not "info".
  const LOUD = D.hazards.map((h) => !["info", "low", ""].includes(S[h.severity]));
  function loud(i) { return P.hz[i] >= 0 && LOUD[P.hz[i]]; }
  function matchesFocus(i) {
    const f = state.focus;
    if (!f) return true;
    const t = P.tpl[i];
    if (f.type === "site") return TP.call_site[t] === f.key;
    if (f.type === "module") return TP.module[t] === f.key;
    if (f.type === "op") return TP.op[t] === f.key;
    if (f.type === "hazard") return P.hz[i] === f.key;
    return true;
  }
  function hoverOf(i) {
    const t = P.tpl[i];
    const kind = KINDS[TP.kind[t]];
    const lines = [];
    lines.push("<b>" + esc(S[TP.op[t]]) + "</b> (" + KIND_LABEL[kind] + ")" + (S[TP.aten[t]] ? " \u00b7 " + esc(S[TP.aten[t]]) : " \u00b7 no aten op"));
    lines.push("call site: <b>" + esc(siteLabel(TP.call_site[t])) + "</b>" + (viaName(TP.via[t]) ? " via " + esc(viaName(TP.via[t])) : ""));
    const src = siteSource(TP.call_site[t]);
    if (src) lines.push("&nbsp;&nbsp;" + esc(src.length > 90 ? src.slice(0, 87) + "..." : src));
    lines.push("module: " + esc(S[TP.module[t]] || "(none)"));
    lines.push("bytes: allocated " + fmtBytes(TP.ba[t]) + " \u00b7 logical " + fmtBytes(TP.bl[t]) + (kind === "copy" ? "" : " (nothing copied)"));
    const dt = S[TP.src_dtype[t]] && S[TP.src_dtype[t]] !== S[TP.dtype[t]] ? esc(S[TP.src_dtype[t]]) + " \u2192 " + esc(S[TP.dtype[t]]) : esc(S[TP.dtype[t]] || "?");
    lines.push("shape " + esc(S[TP.shape[t]]) + " \u00b7 dtype " + dt);
    let dev = esc(S[TP.src_device[t]] || "?") + " \u2192 " + esc(S[TP.dst_device[t]] || "?");
    const tr = S[TP.transfer[t]];
    if (tr && tr !== "none") dev += " (" + esc(tr) + (TP.nb[t] ? ", non_blocking" : "") + (TP.pinned[t] === 1 ? ", pinned" : TP.pinned[t] === 0 ? ", pageable" : "") + ")";
    lines.push("device: " + dev);
    lines.push("graph: " + esc(S[TP.graph[t]] || "?") + (S[TP.grad_fn[t]] ? " (" + esc(S[TP.grad_fn[t]]) + ")" : "") + " \u00b7 phase " + esc(S[TP.phase[t]] || "?"));
    lines.push("step " + (P.step[i] >= 0 ? P.step[i] : "?") + " \u00b7 t = " + fmtSec(P.t[i]) + " \u00b7 took " + fmtNs(P.d[i]) + (multi() ? " \u00b7 " + esc(runLabel(P.run[i])) : ""));
    if (S[TP.origin[t]]) lines.push("forward call: " + esc(S[TP.origin[t]]));
    if (S[TP.thread[t]]) lines.push("thread: " + esc(S[TP.thread[t]]));
    if (S[TP.group[t]]) lines.push("inside deepcopy of " + esc(S[TP.group[t]]));
    if (S[TP.error[t]]) lines.push("<b>raised " + esc(S[TP.error[t]]) + "</b>");
    if (P.hz[i] >= 0) { const h = D.hazards[P.hz[i]]; lines.push("<b>hazard " + esc(S[h.code]) + "</b>: " + esc(S[h.message])); }
    return lines.join("<br>");
  }
  function laneOf(i) {
    const t = P.tpl[i];
    let lane;
    if (state.lanes === "phase") lane = S[TP.phase[t]] || "(unknown)";
    else if (state.lanes === "thread") lane = S[TP.thread[t]] || "(unknown)";
    else if (state.lanes === "op") lane = S[TP.op[t]];
    else lane = siteLabel(TP.call_site[t]);
    return multi() ? runShort(P.run[i]) + " \u00b7 " + lane : lane;
  }
  function laneOrder(lanes, counts) {
    const runOrder = new Map(D.runs.map((r, i) => [runShort(i), i]));
    return [...lanes].sort((a, b) => {
      const [ra, la] = multi() ? [a.split(" \u00b7 ")[0], a.split(" \u00b7 ").slice(1).join(" \u00b7 ")] : ["", a];
      const [rb, lb] = multi() ? [b.split(" \u00b7 ")[0], b.split(" \u00b7 ").slice(1).join(" \u00b7 ")] : ["", b];
      if (ra !== rb) return (runOrder.get(ra) || 0) - (runOrder.get(rb) || 0);
      if (state.lanes === "phase") {
        const pa = PHASE_ORDER.indexOf(la), pb = PHASE_ORDER.indexOf(lb);
        return (pa < 0 ? 9 : pa) - (pb < 0 ? 9 : pb) || (la < lb ? -1 : 1);
      }
      return (counts.get(b) || 0) - (counts.get(a) || 0) || (la < lb ? -1 : 1);
    });
  }
  function timelineIndices() {
    const out = [];
    for (let i = 0; i < P.t.length; i++) {
      if (!state.runs.has(P.run[i])) continue;
      if (!state.kinds[KINDS[TP.kind[P.tpl[i]]]] && !loud(i)) continue;
      out.push(i);
    }
    return out;
  }
  function renderTimeline() {
    const tStart = performance.now();
    const idx = timelineIndices();
    const lanesSet = new Set(), counts = new Map();
    let maxB = 1;
    for (const i of idx) {
      const l = laneOf(i);
      lanesSet.add(l);
      counts.set(l, (counts.get(l) || 0) + 1);
      const t = P.tpl[i];
      if (KINDS[TP.kind[t]] === "copy" && TP.bl[t] > maxB) maxB = TP.bl[t];
    }
    let lanes = laneOrder(lanesSet, counts);
    if (lanes.length > 40) {
      const keep = new Set(lanes.slice(0, 39));
      lanes = lanes.slice(0, 39).concat(["(other lanes)"]);
      lanesSet.clear();
      keep.forEach((l) => lanesSet.add(l));
    }
    const laneY = new Map(lanes.map((l, k) => [l, lanes.length - 1 - k]));
    const jitter = idx.length > 300 ? 0.32 : 0;
    const gl = idx.length > 4000;
    const type = gl ? "scattergl" : "scatter";
    const sizeMin = idx.length > 2000 ? 4 : 6, sizeSpan = idx.length > 2000 ? 14 : 26; // px
    const byOp = new Map();
    const dim = { x: [], y: [], text: [], cd: [] };
    const hz = { x: [], y: [], text: [], cd: [] };
    for (const i of idx) {
      const t = P.tpl[i];
      let l = laneOf(i);
      if (!laneY.has(l)) l = "(other lanes)";
      const y = laneY.get(l) + (jitter ? ((((i * 2654435761) >>> 0) % 1000) / 1000 - 0.5) * 2 * jitter : 0);
      const x = P.t[i] / 1e3; // seconds
      if (!matchesFocus(i)) { dim.x.push(x); dim.y.push(y); dim.text.push(hoverOf(i)); dim.cd.push(i); continue; }
      const op = TP.op[t];
      const kind = KINDS[TP.kind[t]];
      const gkey = op + "|" + kind; // one trace per op and kind: one marker symbol each
      let g = byOp.get(gkey);
      if (!g) { g = { op, kind, x: [], y: [], text: [], size: [], cd: [] }; byOp.set(gkey, g); }
      g.x.push(x); g.y.push(y); g.text.push(hoverOf(i)); g.cd.push(i);
      g.size.push(kind === "copy" ? sizeMin + sizeSpan * Math.sqrt(TP.bl[t] / maxB) : sizeMin);
      if (loud(i)) { hz.x.push(x); hz.y.push(y); hz.text.push(hoverOf(i)); hz.cd.push(i); }
    }
    const traces = [];
    if (dim.x.length) {
      traces.push({ type, mode: "markers", name: "other events", x: dim.x, y: dim.y, hovertext: dim.text, hoverinfo: "text", customdata: dim.cd,
        marker: { size: 5, color: "#c8c8c8", opacity: 0.35 } });
    }
    const opCount = new Map();
    for (const g of byOp.values()) opCount.set(g.op, (opCount.get(g.op) || 0) + g.x.length);
    const groups = [...byOp.values()].sort((a, b) => (opCount.get(b.op) - opCount.get(a.op)) || (a.op - b.op) || (KINDS.indexOf(a.kind) - KINDS.indexOf(b.kind)));
    const seenOp = new Set();
    const SYMBOL = { copy: "circle", alias: "circle-open", noop: "diamond-open" };
    for (const g of groups) {
      const color = D.op_colors[g.op] || "#888";
      traces.push({ type, mode: "markers", name: esc(S[g.op]), legendgroup: "op" + g.op, showlegend: !seenOp.has(g.op),
        x: g.x, y: g.y, hovertext: g.text, hoverinfo: "text", customdata: g.cd,
        marker: { size: g.size, symbol: SYMBOL[g.kind], color, opacity: 0.8, line: { width: 1, color } } });
      seenOp.add(g.op);
    }
    if (hz.x.length) {
      traces.push({ type, mode: "markers", name: "hazard", x: hz.x, y: hz.y, hovertext: hz.text, hoverinfo: "text", customdata: hz.cd,
        marker: { size: 12, symbol: "x-thin-open", color: "#a50f15", opacity: 0.75, line: { width: 2, color: "#a50f15" } } });
    }
    // Step boundaries of the first selected run, as one line trace (cheap for many steps).
    const r0 = [...state.runs][0];
    const bx = [], by = [], rx = [], ry = [];
    const top = lanes.length - 0.4, bottom = -0.6;
    boundaries = [];
    for (let i = 0; i < ST.step.length; i++) {
      if (ST.run[i] !== r0 || ST.start[i] == null) continue;
      const b = ST.start[i] / 1e3; // seconds
      boundaries.push(b);
      bx.push(b, b, null); by.push(bottom, top, null);
      rx.push(b, b, null); ry.push(bottom, bottom + 0.18, null);
    }
    const fullLines = visibleBoundaries(state.zoom) <= MAX_FULL_BOUNDARIES;
    if (boundaries.length) {
      traces.unshift({ type: "scatter", mode: "lines", name: "step boundary", x: rx, y: ry, hoverinfo: "skip",
        line: { color: "#b5bcc7", width: 1 }, showlegend: false, visible: !fullLines });
      traces.unshift({ type: "scatter", mode: "lines", name: "step boundary", x: bx, y: by, hoverinfo: "skip",
        line: { color: "#9aa3b0", width: 1, dash: "dot" }, showlegend: true, visible: fullLines });
    }
    const r0dur = D.runs[r0] ? D.runs[r0].duration_ns / 1e9 : 0;
    const xmax = Math.max(r0dur, ...idx.slice(-1).map((i) => P.t[i] / 1e3), 1e-6);
    const lay = layout({
      height: Math.max(320, 150 + 34 * lanes.length), hovermode: "closest", dragmode: "zoom",
      margin: { l: 60, r: 20, t: 20, b: 45 },
      legend: { title: { text: "op" }, itemsizing: "constant" },
      xaxis: { title: { text: "seconds since " + (multi() ? "each run's" : "the run's") + " start" }, ticksuffix: " s", range: state.zoom || [-0.01 * xmax, 1.01 * xmax], zeroline: false },
      yaxis: { tickmode: "array", tickvals: lanes.map((_, k) => lanes.length - 1 - k), ticktext: lanes.map((l) => esc(l.length > 40 ? l.slice(0, 14) + "\u2026" + l.slice(-25) : l)), range: [bottom, top], zeroline: false, fixedrange: true, automargin: true },
      uirevision: state.lanes + "|" + [...state.runs].join(","),
    });
    if (!idx.length) {
      lay.annotations = [{ text: "no events of the selected kinds", showarrow: false, x: 0.5, y: 0.5, xref: "paper", yref: "paper" }];
    }
    const nShown = idx.length;
    $("ct-tl-note").textContent =
      fmtInt(nShown) + " events drawn" + (D.sample.shown < D.sample.total
        ? " (the report keeps " + fmtInt(D.sample.shown) + " of " + fmtInt(D.sample.total) + " events: every error, every copy " + D.sample.large + ", up to " + fmtInt(D.sample.per_hazard) + " events of each hazard, and an even sample of the rest per call site and op; every event counts in the totals)"
        : "") + ". Filled circles: real copies (area \u221d bytes copied); open circles: aliases; open diamonds: no-op conversions. Dotted lines: step boundaries. Drag to zoom, double-click to reset; click a point for its details.";
    timings.timeline_data = Math.round(performance.now() - tStart);
    plot("fig-timeline", traces, lay).then((gd) => {
      if (gd._ctBound) return;
      gd._ctBound = true;
      gd.on("plotly_click", (ev) => {
        const p = ev.points && ev.points[0];
        if (p && p.customdata != null) showDetail(Number(p.customdata));
      });
      gd.on("plotly_relayout", (ev) => {
        if (ev["xaxis.autorange"]) state.zoom = null;
        else if (ev["xaxis.range[0]"] != null) state.zoom = [ev["xaxis.range[0]"], ev["xaxis.range[1]"]];
        else if (ev["xaxis.range"]) state.zoom = ev["xaxis.range"];
        else return;
        if (!boundaries.length) return;
        const full = visibleBoundaries(state.zoom) <= MAX_FULL_BOUNDARIES;
        if (full !== (gd.data[0].visible !== false)) Plotly.restyle(gd, { visible: [full, !full] }, [0, 1]);
      });
    });
    document.querySelectorAll("#ct-kinds-toggle input").forEach((b) => { b.checked = !!state.kinds[b.value]; });
    document.querySelectorAll("#ct-lanes button").forEach((b) => b.classList.toggle("on", b.dataset.v === state.lanes));
  }
  let boundaries = [];
  const MAX_FULL_BOUNDARIES = 40;
  function visibleBoundaries(range) {
    if (!range) return boundaries.length;
    let n = 0;
    for (const b of boundaries) if (b >= range[0] && b <= range[1]) n++;
    return n;
  }
  function zoomStep(step) {
    const r0 = [...state.runs][0];
    for (let i = 0; i < ST.step.length; i++) {
      if (ST.run[i] === r0 && ST.step[i] === step && ST.start[i] != null) {
        const pad = (ST.end[i] - ST.start[i]) * 0.03;
        state.zoom = [(ST.start[i] - pad) / 1e3, (ST.end[i] + pad) / 1e3]; // seconds
        $("ct-step").value = String(step);
        relayout($("fig-timeline"), { "xaxis.range": state.zoom });
        return true;
      }
    }
    return false;
  }
  function showDetail(i) {
    const t = P.tpl[i];
    const box = clear($("ct-detail"));
    box.hidden = false;
    const kind = KINDS[TP.kind[t]];
    const rows = [
      ["op", S[TP.op[t]] + " (" + KIND_LABEL[kind] + ")"], ["aten", S[TP.aten[t]] || "(none)"],
      ["call site", S[TP.call_site[t]] + (viaName(TP.via[t]) ? "  (via " + viaName(TP.via[t]) + ")" : "")],
      ["source", siteSource(TP.call_site[t]) || "(not available)"],
      ...(TP.entry && S[TP.entry[t]] ? [[D.group_by === "user" ? "library's line" : "your line", siteLabel(TP.entry[t])]] : []),
      ["module", S[TP.module[t]] || "(none)"],
      ["bytes", "allocated " + fmtInt(TP.ba[t]) + " B \u00b7 logical " + fmtInt(TP.bl[t]) + " B"],
      ["shape / dtype", S[TP.shape[t]] + " \u00b7 " + (S[TP.src_dtype[t]] || "?") + " \u2192 " + (S[TP.dtype[t]] || "?")],
      ["devices", (S[TP.src_device[t]] || "?") + " \u2192 " + (S[TP.dst_device[t]] || "?") + " (" + (S[TP.transfer[t]] || "?") + (TP.nb[t] ? ", non_blocking" : "") + ")"],
      ["graph", (S[TP.graph[t]] || "?") + (S[TP.grad_fn[t]] ? " (" + S[TP.grad_fn[t]] + ")" : "")],
      ["phase / step", (S[TP.phase[t]] || "?") + " \u00b7 step " + (P.step[i] >= 0 ? P.step[i] : "?")],
      ["time", fmtSec(P.t[i]) + " after the start of " + runLabel(P.run[i]) + ", took " + fmtNs(P.d[i])],
      ["thread", S[TP.thread[t]] || "?"],
    ];
    if (S[TP.origin[t]]) rows.push(["forward call", S[TP.origin[t]]]);
    if (S[TP.group[t]]) rows.push(["deepcopy of", S[TP.group[t]]]);
    if (S[TP.error[t]]) rows.push(["raised", S[TP.error[t]]]);
    if (P.hz[i] >= 0) { const h = D.hazards[P.hz[i]]; rows.push(["hazard", S[h.code] + ": " + S[h.message]]); rows.push(["fix", S[h.fix]]); }
    const dl = el("dl");
    for (const [k, v] of rows) { dl.appendChild(el("dt", { text: k })); dl.appendChild(el("dd", { text: v })); }
    box.appendChild(el("div", { style: "display:flex;justify-content:space-between;align-items:center;margin-bottom:4px" }, [
      el("b", { text: "Selected event" }),
      el("button", { text: "all events of this call site", onclick: () => setFocus({ type: "site", key: TP.call_site[t], label: siteLabel(TP.call_site[t]) }, false) }),
    ]));
    box.appendChild(dl);
  }

  // ---- kinds --------------------------------------------------------------------------------
  function renderKinds() {
    const rows = [...aggregate((i) => C.op[i]).values()];
    const graphs = new Map();
    for (let i = 0; i < C.n.length; i++) {
      if (!state.runs.has(C.run[i])) continue;
      const g = S[C.graph[i]] || "?";
      let m = graphs.get(C.op[i]);
      if (!m) { m = {}; graphs.set(C.op[i], m); }
      m[g] = (m[g] || 0) + C.n[i];
    }
    rows.sort((a, b) => a.n - b.n);
    const y = rows.map((r) => esc(S[r.key]) + " (" + fmtInt(r.n) + ")");
    const traces = [];
    for (const k of KINDS) {
      const attr = k === "copy" ? "nc" : k === "alias" ? "na" : "nn";
      traces.push({ type: "bar", orientation: "h", name: KIND_LABEL[k], y, x: rows.map((r) => r[attr]), marker: { color: KIND_COLOR[k] },
        hovertext: rows.map((r) => "<b>" + esc(S[r.key]) + "</b>: " + fmtInt(r[attr]) + " " + KIND_LABEL[k] + (r[attr] === 1 ? "" : "s") + " of " + fmtInt(r.n) +
          "<br>bytes copied " + fmtBytes(r.bc) + " \u00b7 allocated " + fmtBytes(r.ba) + " \u00b7 time " + fmtNs(r.t)), hoverinfo: "text", legendgroup: "kind",
        legendgrouptitle: k === "copy" ? { text: "kind" } : undefined });
    }
    for (const g of ["attached", "detached", "none", "?"]) {
      const xs = rows.map((r) => (graphs.get(r.key) || {})[g] || 0);
      if (!xs.some((v) => v)) continue;
      traces.push({ type: "bar", orientation: "h", name: g === "?" ? "unknown" : g, y, x: xs, xaxis: "x2", yaxis: "y2", marker: { color: GRAPH_COLOR[g] },
        hovertext: rows.map((r, k) => "<b>" + esc(S[r.key]) + "</b>: " + fmtInt(xs[k]) + " " + (g === "?" ? "unknown" : g) + " of " + fmtInt(r.n)), hoverinfo: "text",
        legendgroup: "graph", legendgrouptitle: g === "attached" ? { text: "autograd graph" } : undefined });
    }
    const lay = layout({
      height: Math.max(260, 110 + 26 * rows.length), barmode: "stack", barnorm: "percent", hovermode: "closest",
      margin: { l: 95, r: 20, t: 35, b: 40 },
      legend: { groupclick: "toggleitem" },
      xaxis: { domain: [0, 0.46], title: { text: "share of the op's events" }, ticksuffix: "%", range: [0, 100] },
      xaxis2: { domain: [0.54, 1], title: { text: "share of the op's events" }, anchor: "y2", ticksuffix: "%", range: [0, 100] },
      yaxis: { type: "category", automargin: true },
      yaxis2: { type: "category", anchor: "x2", matches: "y", showticklabels: false },
      annotations: [
        { text: "<b>copy vs alias vs no-op</b>, by op", xref: "paper", yref: "paper", x: 0, y: 1.0, yanchor: "bottom", showarrow: false, xanchor: "left" },
        { text: "<b>autograd graph</b> of the result, by op", xref: "paper", yref: "paper", x: 0.54, y: 1.0, yanchor: "bottom", showarrow: false, xanchor: "left" },
      ],
    });
    plot("fig-kinds", traces, lay);
    const tbl = clear($("ct-kinds-table"));
    tbl.appendChild(el("tr", null, ["op", "events", "copies", "aliases", "no-ops", "attached", "detached", "bytes copied", "bytes allocated", "bytes logical", "time"].map((h, i) => el("th", { class: i ? "n" : null, text: h }))));
    rows.slice().reverse().forEach((r) => {
      const g = graphs.get(r.key) || {};
      tbl.appendChild(el("tr", { class: "click", onclick: () => setFocus({ type: "op", key: r.key, label: "op " + S[r.key] }, true) }, [
        el("td", null, [el("span", { class: "swatch", style: "background:" + (D.op_colors[r.key] || "#888") }), S[r.key]]),
        el("td", { class: "n", text: fmtInt(r.n) }), el("td", { class: "n", text: fmtInt(r.nc) }),
        el("td", { class: "n", text: fmtInt(r.na) }), el("td", { class: "n", text: fmtInt(r.nn) }),
        el("td", { class: "n", text: fmtInt(g.attached || 0) }), el("td", { class: "n", text: fmtInt(g.detached || 0) }),
        el("td", { class: "n", text: fmtBytes(r.bc) }), el("td", { class: "n", text: fmtBytes(r.ba) }),
        el("td", { class: "n", text: fmtBytes(r.bl) }), el("td", { class: "n", text: fmtNs(r.t) }),
      ]));
    });
  }

  // ---- transfers ------------------------------------------------------------------------------
  function renderTransfers() {
    const cells = new Map();
    for (const r of D.transfers) {
      if (!state.runs.has(r.run)) continue;
      const k = r.src + "|" + r.dst;
      let c = cells.get(k);
      if (!c) { c = { src: r.src, dst: r.dst, kinds: new Map(), n: 0, nc: 0, ba: 0, bl: 0, nb: 0, pin: 0, pk: 0, t: 0 }; cells.set(k, c); }
      c.n += r.n; c.nc += r.nc; c.ba += r.ba; c.bl += r.bl; c.nb += r.nb; c.pin += r.pin; c.pk += r.pin_known; c.t += r.t;
      c.kinds.set(r.kind, (c.kinds.get(r.kind) || 0) + r.n);
    }
    const order = (d) => { const s = S[d]; return s === "cpu" ? "0" : s === "?" ? "2" : "1" + s; };
    const devs = [...new Set([...cells.values()].flatMap((c) => [c.src, c.dst]))].sort((a, b) => (order(a) < order(b) ? -1 : 1));
    const z = [], text = [], hover = [];
    for (const s of devs) {
      const zr = [], tr = [], hr = [];
      for (const d of devs) {
        const c = cells.get(s + "|" + d);
        zr.push(c ? Math.log10(c.bl + 1) : null);
        tr.push(c ? fmtBytes(c.bl) + "<br>" + fmtInt(c.n) + " events" : "");
        hr.push(c ? "<b>" + esc(S[s]) + " \u2192 " + esc(S[d]) + "</b><br>" + fmtInt(c.n) + " events (" + fmtInt(c.nc) + " copies)<br>bytes logical " + fmtBytes(c.bl) + " \u00b7 allocated " + fmtBytes(c.ba) +
          "<br>non_blocking " + fmtPct(pct(c.nb, c.n), 0) + " \u00b7 pinned " + (c.pk ? fmtPct(pct(c.pin, c.pk), 0) : "not recorded") : esc(S[s]) + " \u2192 " + esc(S[d]) + ": none");
      }
      z.push(zr); text.push(tr); hover.push(hr);
    }
    const zmax = Math.max(1, ...z.flat().filter((v) => v != null));
    const tickvals = [], ticktext = [];
    for (let p = 0; p <= 5; p++) { const v = Math.log10(Math.pow(1024, p)); if (v <= zmax + 0.01) { tickvals.push(v); ticktext.push(fmtBytes(Math.pow(1024, p))); } }
    const traces = devs.length ? [{ type: "heatmap", x: devs.map((d) => esc(S[d])), y: devs.map((d) => esc(S[d])), z, text, texttemplate: "%{text}",
      hovertext: hover, hoverinfo: "text", colorscale: "Blues", reversescale: true, zmin: 0, zmax, showscale: cells.size > 1,
      colorbar: { title: { text: "bytes (log)" }, tickvals, ticktext }, xgap: 2, ygap: 2 }] : [];
    const lay = layout({ height: 200 + 60 * devs.length, width: Math.min(900, 380 + 150 * devs.length), margin: { l: 90, r: 20, t: 20, b: 60 },
      xaxis: { title: { text: "destination device" }, type: "category", side: "bottom" },
      yaxis: { title: { text: "source device" }, type: "category", autorange: "reversed" } });
    if (!devs.length) lay.annotations = [{ text: "no device information", showarrow: false, x: 0.5, y: 0.5, xref: "paper", yref: "paper" }];
    // The heatmap only says something when data crossed devices; the table and note stay.
    const crossed = crossDevice().n > 0;
    $("fig-transfers").hidden = !crossed;
    if (crossed) plot("fig-transfers", traces, lay);
    const tbl = clear($("ct-transfers-table"));
    tbl.appendChild(el("tr", null, ["source \u2192 destination", "kind", "events", "copies", "bytes logical", "bytes allocated", "time", "non_blocking", "pinned"].map((h, i) => el("th", { class: i > 1 ? "n" : null, text: h }))));
    [...cells.values()].sort((a, b) => b.bl - a.bl).forEach((c) => {
      const kind = [...c.kinds.entries()].sort((a, b) => b[1] - a[1])[0][0];
      tbl.appendChild(el("tr", null, [
        el("td", { class: "mono", text: S[c.src] + " \u2192 " + S[c.dst] }), el("td", { text: S[kind] || "none" }),
        el("td", { class: "n", text: fmtInt(c.n) }), el("td", { class: "n", text: fmtInt(c.nc) }),
        el("td", { class: "n", text: fmtBytes(c.bl) }), el("td", { class: "n", text: fmtBytes(c.ba) }),
        el("td", { class: "n", text: fmtNs(c.t) }), el("td", { class: "n", text: fmtPct(pct(c.nb, c.n), 0) }),
        el("td", { class: "n", text: c.pk ? fmtPct(pct(c.pin, c.pk), 0) : "n/a", title: c.pk ? null : "the trace does not record pinned memory" }),
      ]));
    });
    const xd = crossDevice();
    $("ct-transfers-note").textContent = xd.n
      ? fmtInt(xd.n) + " events (" + fmtBytes(xd.b) + ") crossed devices. A non_blocking copy from pageable (unpinned) host memory is still synchronous."
      : "No event crossed devices: every copy stayed on " + devs.map((d) => S[d]).join(", ") + ".";
  }

  // ---- hazards --------------------------------------------------------------------------------
  function renderHazards() {
    const box = clear($("ct-hazards-body"));
    if (!D.hazards.length) {
      const why = D.analysis === "ran" ? "The hazard analyser found nothing." :
          D.analysis === "skipped" ? "The hazard analyser was not run, and the trace carries no copytrace.hazard events." :
            "The hazard analyser " + D.analysis + ".";
      box.appendChild(el("div", { class: "empty", text: why }));
      return;
    }
    const tbl = el("table");
    const byRun = D.runs.length > 1;  // several runs: a run column says whose hazard it is
    const heads = ["severity", "code", "what", "call sites", "bytes", "steps", "events", "fix"];
    if (byRun) heads.splice(1, 0, "run");
    tbl.appendChild(el("tr", null, heads.map((h) => el("th", { class: h === "bytes" || h === "events" ? "n" : null, text: h }))));
    D.hazards.forEach((h, k) => {
      const sev = S[h.severity] || "?";
      const sel = state.focus && state.focus.type === "hazard" && state.focus.key === k;
      tbl.appendChild(el("tr", { class: "click" + (sel ? " sel" : ""), onclick: () => setFocus({ type: "hazard", key: k, label: "hazard " + S[h.code] }, true) }, [
        el("td", null, [el("span", { class: "sev " + sev.replace(/[^a-z]/g, ""), text: sev })]),
        byRun ? el("td", { class: "mono", text: (h.runs || []).map((r) => S[r]).join("\n") || "-", style: "white-space:pre-line" }) : null,
        el("td", { class: "mono", text: S[h.code] }),
        el("td", { text: S[h.message] }),
        el("td", { class: "mono site", text: h.sites.map((s) => siteLabel(s)).join("\n") || "-", style: "white-space:pre-line" }),
        el("td", { class: "n", text: h.bytes == null ? "-" : fmtBytes(h.bytes) }),
        el("td", { text: rangeText(h.steps, h.n_steps) }),
        el("td", { class: "n", text: fmtInt(h.events) }),
        el("td", { class: "fixcell" }, [S[h.fix], patchView(h)]),
      ]));
    });
    box.appendChild(el("div", { class: "scroll" }, [tbl]));
  }

  // A finding's patch (copytrace fix): collapsed under its one-line reason, the diff's lines
  // coloured; or why a finding whose code has a fix gets none here.
  function patchView(h) {
    if (h.patch == null) return h.no_patch == null ? null : el("div", { class: "nopatch", text: "no patch: " + S[h.no_patch] });
    const kind = (line) => line.startsWith("+++") || line.startsWith("---") ? "file" : line.startsWith("@@") ? "hunk" :
      line.startsWith("+") ? "add" : line.startsWith("-") ? "del" : "ctx";
    const lines = S[h.patch].replace(/\n$/, "").split("\n").map((line) => el("span", { class: "dl " + kind(line), text: line }));
    return el("details", { class: "patch", onclick: (e) => e.stopPropagation() }, [
      el("summary", null, [
        el("span", { class: "badge " + (h.patch_exact ? "exact" : "changes"), text: h.patch_exact ? "bit for bit" : "changes values" }),
        " patch: " + S[h.patch_reason]]),
      el("pre", { class: "diff mono" }, lines),
    ]);
  }

  // ---- focus and the events list -----------------------------------------------------------
  function setFocus(f, scroll) {
    if (f && state.focus && state.focus.type === f.type && state.focus.key === f.key) f = null;
    state.focus = f;
    renderFocus();
    renderTimeline();
    renderSourcesTable();
    renderHazards();
    if (scroll && f) $("timeline").scrollIntoView({ behavior: "smooth" });
  }
  function renderFocus() {
    const f = state.focus;
    for (const id of ["ct-focus-tl", "ct-focus-ev"]) {
      const bar = clear($(id));
      bar.hidden = !f;
      if (!f) continue;
      bar.appendChild(el("span", null, ["Showing events of ", el("b", { text: f.label })]));
      bar.appendChild(el("button", { text: "show all", onclick: () => setFocus(null) }));
    }
    const box = clear($("ct-events-body"));
    if (!f) {
      box.appendChild(el("div", { class: "empty", text: "Click a call site, module, op or hazard (in the lists, tables or the treemap) to list its events here." }));
      return;
    }
    const idx = [];
    for (let i = 0; i < P.t.length; i++) if (state.runs.has(P.run[i]) && matchesFocus(i)) idx.push(i);
    idx.sort((a, b) => TP.bl[P.tpl[b]] * (TP.kind[P.tpl[b]] === 0) - TP.bl[P.tpl[a]] * (TP.kind[P.tpl[a]] === 0) || P.t[a] - P.t[b]);
    let total = null;
    if (f.type !== "hazard") {
      const col = f.type === "site" ? C.site : f.type === "module" ? C.module : C.op;
      total = 0;
      for (let i = 0; i < C.n.length; i++) if (state.runs.has(C.run[i]) && col[i] === f.key) total += C.n[i];
    } else {
      total = D.hazards[f.key].events;
    }
    box.appendChild(el("p", { class: "note", text: fmtInt(total) + " events in all; " + fmtInt(idx.length) + " kept in this report" + (idx.length > 300 ? ", the 300 largest listed" : "") + ". Click a row to show it on the timeline." }));
    const tbl = el("table");
    tbl.appendChild(el("tr", null, ["t (s)", "step", "op", "kind", "bytes copied", "allocated", "shape", "dtype", "devices", "graph", "phase", "module", "call site", "took"].map((h, k) => el("th", { class: k < 2 || k === 4 || k === 5 || k === 13 ? "n" : null, text: h }))));
    for (const i of idx.slice(0, 300)) {
      const t = P.tpl[i];
      const kind = KINDS[TP.kind[t]];
      tbl.appendChild(el("tr", { class: "click", onclick: () => { if (P.step[i] >= 0) zoomStep(P.step[i]); showDetail(i); $("timeline").scrollIntoView({ behavior: "smooth" }); } }, [
        el("td", { class: "n", text: (P.t[i] / 1e3).toFixed(4) }), el("td", { class: "n", text: P.step[i] >= 0 ? String(P.step[i]) : "-" }),
        el("td", { text: S[TP.op[t]] }), el("td", { text: KIND_LABEL[kind] }),
        el("td", { class: "n", text: kind === "copy" ? fmtBytes(TP.bl[t]) : "0 B" }), el("td", { class: "n", text: fmtBytes(TP.ba[t]) }),
        el("td", { class: "mono", text: S[TP.shape[t]] }), el("td", { text: S[TP.dtype[t]] }),
        el("td", { class: "mono", text: (S[TP.src_device[t]] || "?") + "\u2192" + (S[TP.dst_device[t]] || "?") }),
        el("td", { text: S[TP.graph[t]] }), el("td", { text: S[TP.phase[t]] }),
        el("td", { class: "mono", text: S[TP.module[t]] || "-" }), el("td", { class: "mono", text: siteLabel(TP.call_site[t]) }),
        el("td", { class: "n", text: fmtNs(P.d[i]) }),
      ]));
    }
    box.appendChild(el("div", { class: "scroll" }, [tbl]));
  }

  // ---- ranks side by side (D.ranks: sections/ranks.py; null for one process) --------------------
  function renderRanks() {
    const R = D.ranks;
    if (!R) return;
    $("ranks").hidden = false;
    const top = Math.max(1, ...R.rows.map((r) => r.ns));
    const tbl = clear($("ct-ranks-table"));
    tbl.appendChild(el("tr", null, ["rank", "steps", "bytes copied per step", "copy time per step", "vs median", ""].map(
      (h, i) => el("th", { class: i >= 1 && i <= 4 ? "n" : null, text: h }))));
    R.rows.forEach((r, i) => {
      const bar = el("div", { class: "rank-bar", style: "width:" + (100 * r.ns / top).toFixed(1) + "%" });
      tbl.appendChild(el("tr", { class: i === R.slowest ? "slowest" : null, "data-rank": S[r.label] }, [
        el("td", { class: "mono", text: S[r.label] }), el("td", { class: "n", text: fmtInt(r.steps) }),
        el("td", { class: "n", text: fmtBytes(r.bytes) }), el("td", { class: "n", text: fmtNs(r.ns) }),
        el("td", { class: "n", text: r.vs == null ? "-" : r.vs.toFixed(2) + "x" }),
        el("td", { style: "min-width:8em" }, [bar])]));
    });
    const slow = R.rows[R.slowest];
    $("ct-ranks-note").textContent = "slowest rank: " + S[slow.label] + ", " + fmtNs(slow.ns) + " copy time per step, imbalance (max/median) " +
      (R.imbalance == null ? "no copy time" : R.imbalance.toFixed(2) + "x the median");
  }

  // ---- run details ------------------------------------------------------------------------------
  function renderRuns() {
    const tbl = clear($("ct-runs-table"));
    const fields = [
      ["run", (r) => S[r.label]], ["command", (r) => S[r.command] || "?"], ["host", (r) => S[r.host] || "?"],
      ["pid", (r) => (r.pid == null ? "?" : String(r.pid))], ["rank", (r) => (r.rank == null ? "-" : String(r.rank))],
      ["torch", (r) => S[r.torch] || "?"], ["copytrace", (r) => S[r.copytrace] || "?"], ["started", (r) => r.start || "?"],
      ["duration", (r) => fmtNs(r.duration_ns)], ["steps", (r) => fmtInt(r.steps)],
      ["events recorded", (r) => (r.events_recorded == null ? "? (no run span)" : fmtInt(r.events_recorded))],
      ["events loaded", (r) => fmtInt(r.events_loaded)], ["events dropped", (r) => fmtInt(r.dropped) + (r.discarded ? " (+" + fmtInt(r.discarded) + " discarded)" : "")],
      ["internal errors", (r) => fmtInt(r.errors)], ["autograd-internal detaches (not events)", (r) => fmtInt(r.internal_detaches)],
      ["tracer self-overhead", (r) => (r.overhead_ns == null ? "not recorded" : fmtNs(r.overhead_ns) + " (" + fmtPct(pct(r.overhead_ns, r.duration_ns)) + ")")],
      ["devices", (r) => r.devices.map((d) => S[d]).join(", ") || "?"], ["files", (r) => r.files.map((f) => S[f]).join("\n")],
    ];
    for (const [name, get] of fields) {
      tbl.appendChild(el("tr", null, [el("th", { text: name })].concat(D.runs.map((r) => el("td", { class: "mono", text: get(r), style: "white-space:pre-line" })))));
    }
    const g = clear($("ct-groups-body"));
    if (!D.groups.length) { g.appendChild(el("div", { class: "empty", text: "no copy.deepcopy of modules, optimizers or containers" })); return; }
    const t2 = el("table");
    t2.appendChild(el("tr", null, ["run", "step", "object type", "tensors", "bytes allocated", "time", "call site"].map((h, i) => el("th", { class: i === 1 || (i >= 3 && i <= 5) ? "n" : null, text: h }))));
    for (const r of D.groups) {
      t2.appendChild(el("tr", null, [el("td", { text: runLabel(r.run) }), el("td", { class: "n", text: r.step == null ? "-" : String(r.step) }),
        el("td", { class: "mono", text: S[r.type] }), el("td", { class: "n", text: fmtInt(r.tensors) }),
        el("td", { class: "n", text: fmtBytes(r.ba) }), el("td", { class: "n", text: fmtNs(r.t) }), el("td", { class: "mono", text: siteLabel(r.site) })]));
    }
    g.appendChild(el("div", { class: "scroll" }, [t2]));
    if (D.n_groups > D.groups.length) g.appendChild(el("p", { class: "note", text: "first " + D.groups.length + " of " + fmtInt(D.n_groups) + " groups" }));
  }

  // ---- compiled regions (D.compiled: sections/compiled.py) --------------------------------------
  function table(head, rows, numeric) {
    const t = el("table", null, [el("tr", null, head.map((h, i) => el("th", { class: numeric && numeric.has(i) ? "n" : null, text: h })))]);
    for (const r of rows) t.appendChild(r);
    return el("div", { class: "scroll" }, [t]);
  }
  function renderCompiled(box) {
    const c = D.compiled;
    if (!c) return;
    const sec = el("section", { id: "compiled" }, [el("h2", { text: "Compiled regions" })]);
    box.appendChild(sec);
    if (c.error) { sec.appendChild(el("p", { class: "note", text: c.error })); return; }
    sec.appendChild(el("p", { class: "lead", text: "torch.compile'd code runs compiled and is not traced op by op. " +
      "Each call is timed; the copies below were found in the compiled graphs before fusion (not observed at run time) " +
      "and are not part of the totals above." }));
    if (c.mode === "eager") {
      sec.appendChild(el("p", { class: "warn", text: "This torch offers no hook for compiled calls: compiled regions ran eagerly and were traced op by op." }));
    }
    sec.appendChild(el("p", { text: fmtInt(c.calls) + " calls, " + fmtInt(c.graphs) + " graphs, " + fmtNs(c.time_ns) +
      "; graph copies " + fmtBytes(c.graph_copy_bytes) + " = " + fmtPct(c.share_pct, 1) + " of copy bytes (observed " +
      fmtBytes(c.observed_bytes) + " + graphs)." + (c.unknown_graph_runs ? " " + fmtInt(c.unknown_graph_runs) +
      " graph runs of graphs compiled before tracing started (copies unknown)." : "") }));
    const rows = c.rows.map((r) => el("tr", null, [
      el("td", { text: r.graph }), el("td", { text: r.kind }),
      el("td", { class: "mono", text: r.op + (r.input_mutation ? " (input write-back)" : "") }),
      el("td", { text: r.shape.join("x") }), el("td", { text: r.dtype }), el("td", { text: r.device }),
      el("td", { class: "n", text: r.bytes == null ? "?" : fmtBytes(r.bytes) }), el("td", { class: "n", text: fmtInt(r.runs) }),
      el("td", { class: "n", text: fmtBytes(r.total_bytes) }),
      el("td", { class: "mono", text: r.site + (r.code ? " | " + r.code : "") })]));
    sec.appendChild(table(["graph", "kind", "op", "shape", "dtype", "device", "bytes / run", "runs", "total", "source"], rows, new Set([6, 7, 8])));
    if (c.n_rows > c.rows.length) sec.appendChild(el("p", { class: "note", text: "first " + c.rows.length + " of " + fmtInt(c.n_rows) + " graph copies" }));
  }

  // ---- py-spy's sampled view (D.pyspy: sections/pyspy.py), its icicle shipped as plotly JSON ------
  function renderPySpy(box) {
    (D.pyspy || []).forEach((p, i) => {
      const sec = el("section", { id: "pyspy-" + i });
      box.appendChild(sec);
      if (p.error) {
        sec.appendChild(el("h2", { text: "py-spy" }));
        sec.appendChild(el("p", { class: "note", text: p.name ? p.name + " could not be read: " + p.error : p.error }));
        return;
      }
      sec.appendChild(el("h2", { text: "py-spy: sampled view (" + p.name + ")" }));
      sec.appendChild(el("p", { class: "lead", text: "Independent of copytrace's timers: py-spy sampled the process while it was traced. " +
        "Shares are of wall time (idle samples included); compare the sampled rows with the traced ones." }));
      sec.appendChild(table(["measure", "share", "what"], p.rows.map((r) =>
        el("tr", null, [el("td", { text: r[0] }), el("td", { class: "n", text: r[1] }), el("td", { text: r[2] })])), new Set([1])));
      sec.appendChild(el("h3", { text: "Top copy frames (inclusive share of samples)" }));
      const top = p.top.length ? p.top.map((r) => el("tr", null, [el("td", null, [el("code", { text: r[0] })]), el("td", { text: r[1] }), el("td", { class: "n", text: r[2] })]))
        : [el("tr", null, [el("td", { colspan: "3", text: "no copy frame sampled" })])];
      sec.appendChild(table(["frame", "kind", "share"], top, new Set([2])));
      const id = "copytrace-pyspy-" + i;
      sec.appendChild(el("div", { id: id, class: "fig plotly-graph-div" }));
      plot(id, p.fig.data || [], Object.assign({ font: FONT }, p.fig.layout || {}));
    });
  }
  function renderExtra() {
    const box = $("ct-extra");
    if (!box) return;
    renderCompiled(box);
    renderPySpy(box);
  }

  // ---- wiring -------------------------------------------------------------------------------------
  const timings = {};
  window.copytraceTimings = timings; // ms per view, for the curious and for tests
  function timed(name, fn) {
    const t0 = performance.now();
    fn();
    timings[name] = Math.round(performance.now() - t0);
  }
  function renderAll() {
    timed("glance", renderGlance);
    timed("steps", renderSteps);
    timed("sources", renderSources);
    timed("timeline", renderTimeline);
    timed("kinds", renderKinds);
    timed("transfers", renderTransfers);
    timed("hazards", renderHazards);
    timed("focus", renderFocus);
  }
  function wire() {
    document.querySelectorAll("#ct-metric button").forEach((b) => b.addEventListener("click", () => { state.metric = b.dataset.v; state.sortKey = b.dataset.v; state.sortDesc = true; renderSources(); }));
    document.querySelectorAll("#ct-groupby button").forEach((b) => b.addEventListener("click", () => { state.groupBy = b.dataset.v; state.showAll = false; renderSources(); }));
    document.querySelectorAll("#ct-kinds-toggle input").forEach((b) => b.addEventListener("change", () => { state.kinds[b.value] = b.checked; renderTimeline(); }));
    document.querySelectorAll("#ct-lanes button").forEach((b) => b.addEventListener("click", () => { state.lanes = b.dataset.v; renderTimeline(); }));
    $("ct-step-go").addEventListener("click", () => zoomStep(Number($("ct-step").value)));
    $("ct-step").addEventListener("keydown", (e) => { if (e.key === "Enter") zoomStep(Number($("ct-step").value)); });
    $("ct-step-prev").addEventListener("click", () => { const v = Number($("ct-step").value || 0) - 1; zoomStep(v); });
    $("ct-step-next").addEventListener("click", () => { const v = Number($("ct-step").value || 0) + 1; zoomStep(v); });
    $("ct-step-all").addEventListener("click", () => { state.zoom = null; relayout($("fig-timeline"), { "xaxis.autorange": true }); });
  }

  try {
    const t0 = performance.now();
    timings.parse = Math.round(t0 - T_START);
    renderHeader();
    wire();
    renderAll();
    renderRanks();
    renderRuns();
    renderExtra();
    timings.total = Math.round(performance.now() - T_START);
    document.body.setAttribute("data-ct-ready", "1");
  } catch (err) {
    document.body.setAttribute("data-ct-error", String(err && err.stack || err));
    throw err;
  } finally {
    const l = document.getElementById("ct-loading");
    if (l) l.remove();
  }
});
