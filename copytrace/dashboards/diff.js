/* copytrace diff page: draws BASE and NEW side by side from the JSON in #ct-data (the diff's
 * JSON form, docs/diff.md, plus "same", "names" and "steps"). Strings from the traces reach
 * the page only through textContent. It waits for window.ctPlotly as report.js does; without
 * plotly.js every table and text is still drawn. */
(function (main) {
  (window.ctPlotly || Promise.resolve()).then(() => main(null), (err) => main(err || "failed"));
})(function (plotlyError) {
  "use strict";
  const D = JSON.parse(document.getElementById("ct-data").textContent);
  const UP = "#d62728", DOWN = "#2ca02c", FLAT = "#9d9d9d", BASE = "#9aa3b0";
  const FONT = { family: "system-ui, -apple-system, Segoe UI, Roboto, sans-serif", size: 12 };
  const CONFIG = { displaylogo: false, responsive: true,
    modeBarButtonsToRemove: ["lasso2d", "select2d", "autoScale2d"] };
  const HAS_PLOTLY = typeof Plotly !== "undefined" && !!Plotly.newPlot;

  // ---- helpers ------------------------------------------------------------------------------
  function $(id) { return document.getElementById(id); }
  function el(tag, props, children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (v == null) continue;
      if (k === "text") node.textContent = v;
      else if (k === "class") node.className = v;
      else node.setAttribute(k, v);
    }
    for (const c of children || []) {
      if (c != null) node.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    }
    return node;
  }
  function fmtInt(n) { return Number(n).toLocaleString("en-US", { maximumFractionDigits: 3 }); }
  function fmtBytes(n) {
    let v = Number(n);
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    for (let i = 0; i < units.length; i++) {
      if (Math.abs(v) < 1024 || i === units.length - 1) {
        return i === 0 ? fmtInt(Math.round(v * 1000) / 1000) + " B" : v.toFixed(1) + " " + units[i];
      }
      v /= 1024;
    }
    return String(n);
  }
  function fmtNs(ns) {
    const v = Number(ns);
    if (Math.abs(v) < 1e3) return Math.round(v) + " ns";
    if (Math.abs(v) < 1e6) return (v / 1e3).toFixed(1) + " us";
    if (Math.abs(v) < 1e9) return (v / 1e6).toFixed(2) + " ms";
    return (v / 1e9).toFixed(3) + " s";
  }
  function signed(x, fmt) { return x === 0 ? "0" : (x > 0 ? "+" : "-") + fmt(Math.abs(x)); }
  function cls(x) { return x > 0 ? "up" : x < 0 ? "down" : "flat"; }
  function color(x) { return x > 0 ? UP : x < 0 ? DOWN : FLAT; }
  function site(i) {
    if (!i.file) return "(no call site)";
    return (D.names[i.file] || i.file) + ":" + i.line + (i.function ? " " + i.function : "");
  }
  function layout(extra) {
    return Object.assign({ template: "plotly_white", font: FONT, hoverlabel: { align: "left" },
      margin: { l: 60, r: 20, t: 30, b: 45 }, paper_bgcolor: "#fff", plot_bgcolor: "#fff" }, extra);
  }
  function plot(id, traces, lay) {
    const div = $(id);
    if (!HAS_PLOTLY) {
      div.textContent = "Chart not available: plotly.js did not load.";
      return;
    }
    Plotly.newPlot(div, traces, lay, CONFIG);
  }
  // a cell "base -> new (delta)" of a triple, coloured by the delta
  function tripleCell(t, fmt) {
    return el("td", { class: "n" }, [
      el("span", { class: cls(t.delta), text: signed(t.delta, fmt) }),
      el("span", { class: "flat", text: " (" + fmt(t.base) + " \u2192 " + fmt(t.new) + ")" }),
    ]);
  }
  // copy time: coloured only when the rank test says it changed (* changed, ~ noise, ? too few steps)
  function timeCell(i) {
    const t = i.time_per_step_ns, test = i.time_test;
    const mark = !test || test.p_value == null ? "?" : test.significant ? "*" : "~";
    return el("td", { class: "n", title: mark === "*" ? "changed (Mann-Whitney U, p < 0.05)" : mark === "~" ? "within noise" : "too few steps to tell" }, [
      el("span", { class: mark === "*" ? cls(t.delta) : "flat", text: signed(t.delta, fmtNs) + mark }),
      el("span", { class: "flat", text: " (" + fmtNs(t.base) + " \u2192 " + fmtNs(t.new) + ")" }),
    ]);
  }
  function table(id, head, rows) {
    const t = $(id);
    t.appendChild(el("tr", null, head.map((h, k) => el("th", { class: k >= head.length - 3 ? "n" : null, text: h }))));
    for (const r of rows) t.appendChild(r);
    if (!rows.length) t.appendChild(el("tr", null, [el("td", { colspan: String(head.length), text: "no change" })]));
  }

  // ---- sections -----------------------------------------------------------------------------
  function renderHeader() {
    const m = $("ct-meta");
    for (const side of ["base", "new"]) {
      m.appendChild(el("div", null, [el("b", { text: side.toUpperCase() + " " }),
        D[side].label + " \u00b7 " + D[side].steps + " step(s)"]));
    }
    if (plotlyError) {
      $("ct-warnings").appendChild(el("div", { class: "warn",
        text: "plotly.js did not load (" + plotlyError + "): the charts are missing." }));
    }
  }
  function renderGlance() {
    const box = $("ct-kpis");
    const rows = [["copies_per_step", "copies per step", fmtInt], ["bytes_per_step", "bytes per step", fmtBytes],
      ["time_per_step_ns", "copy time per step", fmtNs], ["aliases_per_step", "aliases per step", fmtInt]];
    for (const [key, label, fmt] of rows) {
      const t = D.totals[key];
      box.appendChild(el("div", { class: "kpi", "data-total": key }, [
        el("div", { class: "k", text: label }),
        el("div", { class: "v " + (key === "time_per_step_ns" ? "flat" : cls(t.delta)), text: signed(t.delta, fmt) }),
        el("div", { class: "d", text: fmt(t.base) + " \u2192 " + fmt(t.new) }),
      ]));
    }
    const n = (k) => D[k].length;
    box.appendChild(el("div", { class: "kpi", style: "grid-column:1 / -1" }, [
      el("div", { class: "k", text: "call sites" }),
      el("div", { class: "d", text: n("added") + " added \u00b7 " + n("removed") + " removed \u00b7 " +
        n("changed") + " changed \u00b7 " + n("time_changed") + " time only \u00b7 " + D.unchanged + " unchanged" }),
    ]));
  }
  function renderHazards() {
    const body = $("ct-hazards-body");
    const t = el("table", { id: "ct-hazards-table" });
    t.appendChild(el("tr", null, ["", "code", "severity", "call site", "bytes", "message"].map((h) => el("th", { text: h }))));
    for (const [side, mark] of [["added", "+"], ["removed", "-"]]) {
      for (const h of D.hazards[side]) {
        t.appendChild(el("tr", { class: "st-" + side, "data-status": side }, [
          el("td", { class: side === "added" ? "up" : "down", text: mark }), el("td", { class: "mono", text: h.code }),
          el("td", { text: h.severity }), el("td", { class: "site mono", text: site(h) }),
          el("td", { class: "n", text: fmtBytes(h.bytes) }), el("td", { text: h.message }),
        ]));
      }
    }
    if (!D.hazards.added.length && !D.hazards.removed.length) body.appendChild(el("p", { class: "note", text: "no change" }));
    else body.appendChild(t);
  }
  function renderSteps() {
    const b = D.steps.base, n = D.steps.new;
    const len = Math.max(b.length, n.length);
    const x = Array.from({ length: len }, (_, k) => k + 1);
    const nb = b.map((s) => s.bytes), nn = n.map((s) => s.bytes);
    const deltas = nn.map((v, k) => v - (nb[k] || 0));
    plot("fig-steps", [
      { type: "bar", name: "BASE", x: x.slice(0, b.length), y: nb, marker: { color: BASE },
        customdata: b.map((s) => [s.step, s.copies]), hovertemplate: "BASE step %{customdata[0]}<br>%{y:,} B in %{customdata[1]} copies<extra></extra>" },
      { type: "bar", name: "NEW", x: x.slice(0, n.length), y: nn, marker: { color: deltas.map(color) },
        customdata: n.map((s, k) => [s.step, s.copies, deltas[k]]), hovertemplate: "NEW step %{customdata[0]}<br>%{y:,} B in %{customdata[1]} copies<br>%{customdata[2]:+,} B against BASE<extra></extra>" },
    ], layout({ barmode: "group", height: 300, xaxis: { title: { text: "n-th step" } }, yaxis: { title: { text: "bytes copied" } } }));
  }
  function siteRow(i, status) {
    const moved = i.base_line != null ? " (was :" + i.base_line + ")" : "";
    return el("tr", { class: "st-" + status, "data-status": status, "data-site": site(i) }, [
      el("td", { text: status === "same" ? "" : status === "time" ? "time only" : status }),
      el("td", { class: "site mono" }, [site(i) + moved, i.code ? el("code", { class: "src", text: i.code }) : null]),
      tripleCell(i.copies_per_step, fmtInt), tripleCell(i.bytes_per_step, fmtBytes), timeCell(i),
    ]);
  }
  function renderSites() {
    const statuses = ["added", "removed", "changed", "time_changed"];
    const items = [];
    for (const s of statuses) for (const i of D[s]) items.push([s === "time_changed" ? "time" : s, i]);
    const exact = items.filter(([s, i]) => i.bytes_per_step.delta !== 0).slice(0, 40).reverse();
    if (exact.length) {
      plot("fig-sites", [{ type: "bar", orientation: "h", y: exact.map(([, i]) => site(i)), x: exact.map(([, i]) => i.bytes_per_step.delta),
        marker: { color: exact.map(([, i]) => color(i.bytes_per_step.delta)) },
        customdata: exact.map(([s, i]) => [s, i.bytes_per_step.base, i.bytes_per_step.new]),
        hovertemplate: "%{y}: %{customdata[0]}<br>%{customdata[1]:,} B \u2192 %{customdata[2]:,} B per step<extra></extra>" }],
      layout({ height: 120 + 26 * exact.length, margin: { l: 260, r: 20, t: 20, b: 45 }, xaxis: { title: { text: "bytes per step, NEW - BASE" }, zeroline: true } }));
    } else {
      $("fig-sites").hidden = true;
    }
    const rows = items.map(([s, i]) => siteRow(i, s)).concat(D.same.map((i) => siteRow(i, "same")));
    table("ct-sites-table", ["", "call site", "copies / step", "bytes / step", "copy time / step"], rows);
  }
  function renderKeyed(id, key, label) {
    const rows = D[key].map((m) => el("tr", { class: "st-" + m.status, "data-status": m.status }, [
      el("td", { text: m.status }), el("td", { class: "mono", text: m[key === "modules" ? "module" : "op"] || "(outside any nn.Module)" }),
      tripleCell(m.copies_per_step, fmtInt), tripleCell(m.bytes_per_step, fmtBytes), tripleCell(m.time_per_step_ns, fmtNs),
    ]));
    table(id, ["", label, "copies / step", "bytes / step", "copy time / step"], rows);
  }
  function renderRuns() {
    const t = $("ct-runs-table");
    t.appendChild(el("tr", null, ["", "trace", "steps", "copies / step", "bytes / step"].map((h) => el("th", { text: h }))));
    for (const side of ["base", "new"]) {
      t.appendChild(el("tr", null, [el("th", { text: side.toUpperCase() }), el("td", { class: "mono", text: D[side].label }),
        el("td", { class: "n", text: String(D[side].steps) }), el("td", { class: "n", text: fmtInt(D.totals.copies_per_step[side]) }),
        el("td", { class: "n", text: fmtBytes(D.totals.bytes_per_step[side]) })]));
    }
  }

  try {
    renderHeader();
    renderGlance();
    renderHazards();
    renderSteps();
    renderSites();
    renderKeyed("ct-modules-table", "modules", "module");
    renderKeyed("ct-ops-table", "ops", "op");
    renderRuns();
    document.body.setAttribute("data-ct-ready", "1");
  } catch (err) {
    document.body.setAttribute("data-ct-error", String(err && err.stack || err));
    throw err;
  } finally {
    const l = $("ct-loading");
    if (l) l.remove();
  }
});
