"""Render a :class:`~copytrace.dashboards._model.ReportModel` as one self-contained HTML page.

Figures are built with plotly (imported lazily) and embedded with plotly's own ``to_html``;
plotly.js is inlined once, with the first figure. Everything else goes through a jinja2
template with autoescaping. Strings from the trace are HTML-escaped before they reach plotly's
text rendering (hover text, axis labels), and plotly escapes ``<``, ``>`` and ``/`` in the JSON
it writes into the page.
"""

from __future__ import annotations

import datetime as _dt
import html
import math
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

from copytrace.dashboards._model import (
    ReportModel,
    SiteRow,
    TimelinePoint,
    format_bytes,
    format_ns,
)

__all__ = ["render_html", "MAX_TIMELINE_POINTS"]

#: The timeline shows at most this many events (the largest by bytes allocated).
MAX_TIMELINE_POINTS = 20_000
#: Step boundaries are drawn only up to this many steps (shapes are slow in the browser).
MAX_STEP_SHAPES = 300
_WEBGL_ABOVE = 3_000
_PHASE_ORDER = ("forward", "backward", "optimizer", "other")
_PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
    "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#ad494a", "#637939", "#7b4173",
)  # fmt: skip
_FONT = "system-ui, -apple-system, Segoe UI, Roboto, sans-serif"


def _e(value: Any) -> str:
    """Escape a trace string for plotly's pseudo-HTML text (hover, ticks, legend)."""
    return html.escape(str(value), quote=False)


def _short_site(site: str, keep: int = 2) -> str:
    """``/a/b/c/train.py:12 main`` -> ``c/train.py:12 main`` (axis labels only)."""
    path, sep, rest = site.partition(":")
    parts = path.replace("\\", "/").split("/")
    short = "/".join(parts[-keep:])
    if len(parts) > keep:
        short = ".../" + short
    return short + sep + rest


def _trim(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _layout(fig: Any, title: str, height: int) -> None:
    fig.update_layout(
        title={"text": title, "x": 0.01, "xanchor": "left"},
        height=height,
        template="plotly_white",
        font={"family": _FONT, "size": 12},
        margin={"l": 60, "r": 30, "t": 60, "b": 50},
        hoverlabel={"align": "left"},
    )


def _lane(p: TimelinePoint, by: str, multi: bool) -> str:
    lane = (p.phase if by == "phase" else p.op) or "(unknown)"
    return f"{_e(p.run)} · {_e(lane)}" if multi else _e(lane)


def _hover(p: TimelinePoint, multi: bool) -> str:
    kind = "no-op" if p.noop else ("alias" if p.alias else "copy")
    lines = [f"<b>{_e(p.op)}</b> ({kind})" + (f" · <b>error: {_e(p.error)}</b>" if p.error else "")]
    if multi:
        lines.append(f"run: {_e(p.run)}")
    lines.append(
        f"t = {p.t_ms:.3f} ms · step {p.step if p.step is not None else '?'}"
        f" · took {format_ns(p.duration_ns)}"
    )
    lines.append(f"aten: {_e(', '.join(p.aten) or '(none)')}")
    lines.append(
        f"bytes allocated: {p.bytes_allocated:,} ({format_bytes(p.bytes_allocated)})"
        f" · logical: {p.bytes_logical:,} ({format_bytes(p.bytes_logical)})"
    )
    dtype = _e(p.dtype or "?")
    if p.src_dtype and p.src_dtype != p.dtype:
        dtype = f"{_e(p.src_dtype)} -> {dtype}"
    shape = "[" + ", ".join(str(d) for d in p.shape) + "]"
    lines.append(f"shape: {shape} · dtype: {dtype}")
    dev = f"{_e(p.src_device or '?')} -> {_e(p.dst_device or '?')}"
    if p.transfer and p.transfer != "none":
        dev += f" ({_e(p.transfer)})"
    lines.append(f"device: {dev}")
    lines.append(f"graph: {_e(p.graph or '?')} · phase: {_e(p.phase or '?')}")
    lines.append(f"module: {_e(p.module or '(none)')}")
    if p.group:
        lines.append(f"in deepcopy of: {_e(p.group)}")
    lines.append(f"call site: {_e(p.call_site)}")
    return "<br>".join(lines)


def _lane_order(
    points: list[TimelinePoint], by: str, multi: bool, runs: list[str] | None = None
) -> list[str]:
    """Lane names top to bottom: by run (in ``runs`` order), then phase order or op name."""
    lanes = {_lane(p, by, multi) for p in points}
    run_rank = {_e(r): i for i, r in enumerate(runs or [])}
    phase_rank = {_e(ph): i for i, ph in enumerate(_PHASE_ORDER)}

    def key(lane: str) -> tuple[Any, ...]:
        run, _, name = lane.rpartition(" · ") if multi else ("", "", lane)
        within = phase_rank.get(name, len(phase_rank)) if by == "phase" else 0
        return (run_rank.get(run, len(run_rank)), run, within, name)

    return sorted(lanes, key=key)


def _sample(points: list[TimelinePoint]) -> list[TimelinePoint]:
    """Keep the largest events (bytes allocated), ties spread evenly over time."""
    if len(points) <= MAX_TIMELINE_POINTS:
        return points
    order = sorted(
        range(len(points)),
        key=lambda i: (-points[i].bytes_allocated, (i * 2654435761) & 0xFFFFFFFF),
    )
    keep = sorted(order[:MAX_TIMELINE_POINTS])
    return [points[i] for i in keep]


def _lane_positions(
    points: list[TimelinePoint], by: str, multi: bool, jitter: float, runs: list[str]
) -> tuple[list[float], list[str]]:
    """Numeric y of each point (lane index, top lane highest, plus jitter) and lane names."""
    lanes = _lane_order(points, by, multi, runs)
    pos = {lane: len(lanes) - 1 - i for i, lane in enumerate(lanes)}
    ys = []
    for i, p in enumerate(points):
        spread = (((i * 2654435761) & 0xFFFF) / 0xFFFF - 0.5) * 2 * jitter if jitter else 0.0
        ys.append(pos[_lane(p, by, multi)] + spread)
    return ys, lanes


def _yaxis(lanes: list[str], title: str) -> dict[str, Any]:
    n = len(lanes)
    return {
        "yaxis.title.text": title,
        "yaxis.tickvals": list(range(n)),
        "yaxis.ticktext": list(reversed(lanes)),
        "yaxis.range": [-0.6, n - 0.4],
    }


def _timeline_figure(model: ReportModel) -> tuple[Any, int]:
    """Build figure (a); return it and the number of events left out (over the cap)."""
    import plotly.graph_objects as go

    multi = model.multi_run
    points = _sample(model.timeline)
    left_out = len(model.timeline) - len(points)
    jitter = 0.0 if len(points) <= 300 else 0.3  # spread dense lanes so density shows

    max_bytes = max((p.bytes_allocated for p in points), default=0) or 1
    size_min, size_span = (6, 26) if len(points) <= 2000 else (3, 10)  # marker px
    counts: dict[str, int] = {}
    for p in points:
        counts[p.op] = counts.get(p.op, 0) + 1
    ops = sorted(counts, key=lambda o: (-counts[o], o))
    colour = {op: _PALETTE[i % len(_PALETTE)] for i, op in enumerate(ops)}
    run_labels = [r.label for r in model.runs]
    y_phase_all, lanes_phase = _lane_positions(points, "phase", multi, jitter, run_labels)
    y_op_all, lanes_op = _lane_positions(points, "op", multi, jitter, run_labels)
    scatter = go.Scattergl if len(points) > _WEBGL_ABOVE else go.Scatter
    fig = go.Figure()
    y_phase: list[list[float]] = []
    y_op: list[list[float]] = []
    for op in ops:
        idx = [i for i, p in enumerate(points) if p.op == op]
        pts = [points[i] for i in idx]
        y_phase.append([y_phase_all[i] for i in idx])
        y_op.append([y_op_all[i] for i in idx])
        fig.add_trace(
            scatter(
                x=[p.t_ms for p in pts],
                y=y_phase[-1],
                mode="markers",
                name=_e(op),
                marker={
                    "size": [
                        size_min + size_span * math.sqrt(p.bytes_allocated / max_bytes) for p in pts
                    ],
                    "color": colour[op],
                    "opacity": 0.75,
                    "symbol": ["circle-open" if (p.alias or p.noop) else "circle" for p in pts],
                    "line": {"width": 1, "color": colour[op]},
                },
                hovertext=[_hover(p, multi) for p in pts],
                hoverinfo="text",
            )
        )

    # Step boundaries: alternating shading plus a label, from the first run's steps.
    first = model.runs[0].label if model.runs else ""
    bounds = model.step_bounds_ms.get(first, [])
    if 0 < len(bounds) <= MAX_STEP_SHAPES:
        span_ms = max(bounds[-1][2] - bounds[0][1], 1e-9)
        for i, (step, start, end) in enumerate(bounds):
            fig.add_vrect(
                x0=start,
                x1=end,
                fillcolor="#4c72b0" if i % 2 else "#dd8452",
                opacity=0.07,
                layer="below",
                line_width=0,
            )
            fig.add_vline(x=start, line={"color": "#888", "width": 1, "dash": "dot"})
            if len(bounds) <= 40 and (end - start) >= 0.03 * span_ms:  # room for a label
                fig.add_annotation(
                    x=(start + end) / 2,
                    y=1.0,
                    yref="paper",
                    yanchor="top",
                    text=f"step {step}",
                    showarrow=False,
                    font={"size": 10, "color": "#666"},
                )

    n_lanes = max(len(lanes_phase), len(lanes_op), 1)
    title = "Copy and alias events over time"
    if left_out:
        title += f" (largest {len(points):,} of {len(model.timeline):,} events shown)"
    _layout(fig, title, height=max(380, 160 + 45 * n_lanes))
    xtitle = "ms since run start" + (f" (step boundaries: {_e(first)})" if multi else "")
    x_end = max((r.duration_ns for r in model.runs), default=0) / 1e6
    x_end = max([x_end] + [p.t_ms for p in points])
    fig.update_xaxes(title_text=xtitle, range=[-0.01 * x_end, 1.01 * x_end] if x_end else None)
    phase_axis, op_axis = _yaxis(lanes_phase, "phase"), _yaxis(lanes_op, "op")
    fig.update_yaxes(
        title_text="phase",
        tickmode="array",
        tickvals=phase_axis["yaxis.tickvals"],
        ticktext=phase_axis["yaxis.ticktext"],
        range=phase_axis["yaxis.range"],
        zeroline=False,
    )
    fig.update_layout(
        margin={"t": 80},
        legend={"title": {"text": "op"}, "itemsizing": "constant"},
        updatemenus=[
            {
                "type": "buttons",
                "direction": "right",
                "x": 1.0,
                "xanchor": "right",
                "y": 1.0,
                "yanchor": "bottom",
                "pad": {"b": 6},
                "showactive": True,
                "buttons": [
                    {
                        "label": "lanes: phase",
                        "method": "update",
                        "args": [{"y": y_phase}, phase_axis],
                    },
                    {"label": "lanes: op", "method": "update", "args": [{"y": y_op}, op_axis]},
                ],
            }
        ],
    )
    return fig, left_out


def _steps_figure(model: ReportModel) -> Any:
    """Figure (b): per-step copy count, bytes, and copy time vs step time."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = model.steps
    multi = model.multi_run
    x = [f"{_e(r.run)} · {r.step}" if multi else r.step for r in rows]
    fig = make_subplots(
        rows=3,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        specs=[[{}], [{}], [{"secondary_y": True}]],
        subplot_titles=(
            "Events per step",
            "Bytes allocated per step",
            "Copy time vs step time",
        ),
    )
    fig.add_trace(
        go.Bar(x=x, y=[r.copy_count for r in rows], name="copies", marker_color="#1f77b4",
               hovertemplate="step %{x}<br>copies: %{y}<extra></extra>"),
        row=1, col=1,
    )  # fmt: skip
    fig.add_trace(
        go.Bar(x=x, y=[r.alias_count for r in rows], name="aliases", marker_color="#aec7e8",
               hovertemplate="step %{x}<br>aliases: %{y}<extra></extra>"),
        row=1, col=1,
    )  # fmt: skip
    fig.add_trace(
        go.Bar(
            x=x,
            y=[r.bytes_allocated for r in rows],
            name="bytes allocated",
            marker_color="#ff7f0e",
            hovertext=[
                f"step {r.step}: {r.bytes_allocated:,} B ({format_bytes(r.bytes_allocated)})"
                for r in rows
            ],
            hoverinfo="text",
        ),
        row=2,
        col=1,
    )
    fig.add_trace(
        go.Bar(
            x=x,
            y=[(r.duration_ns or 0) / 1e6 for r in rows],
            name="step time (ms)",
            marker_color="#c7c7c7",
            hovertext=[f"step {r.step}: {format_ns(r.duration_ns)}" for r in rows],
            hoverinfo="text",
        ),
        row=3,
        col=1,
    )
    fig.add_trace(
        go.Bar(
            x=x,
            y=[r.copy_time_ns / 1e6 for r in rows],
            name="copy time (ms)",
            marker_color="#d62728",
            hovertext=[f"step {r.step}: copy time {format_ns(r.copy_time_ns)}" for r in rows],
            hoverinfo="text",
        ),
        row=3,
        col=1,
    )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=[r.copy_time_share_pct for r in rows],
            name="copy time share (%)",
            mode="lines+markers",
            line={"color": "#2ca02c"},
            hovertext=[
                f"step {r.step}: {r.copy_time_share_pct:.2f} % of step time"
                if r.copy_time_share_pct is not None
                else f"step {r.step}: no step span"
                for r in rows
            ],
            hoverinfo="text",
        ),
        row=3,
        col=1,
        secondary_y=True,
    )
    _layout(fig, "Per step", height=760)
    fig.update_layout(barmode="group", bargap=0.25)
    fig.update_yaxes(title_text="events", row=1, col=1)
    fig.update_yaxes(title_text="bytes", row=2, col=1)
    fig.update_yaxes(title_text="ms", row=3, col=1)
    fig.update_yaxes(
        title_text="share %",
        rangemode="tozero",
        tickmode="auto",
        showgrid=False,
        row=3,
        col=1,
        secondary_y=True,
    )
    fig.update_layout(legend={"x": 1.07})
    fig.update_xaxes(title_text="step", type="category", row=3, col=1)
    fig.update_xaxes(type="category")
    return fig


def _site_hover(row: SiteRow) -> str:
    ops = ", ".join(f"{_e(op)} x{n}" for op, n in sorted(row.ops.items(), key=lambda kv: -kv[1]))
    return "<br>".join(
        [
            f"<b>{_e(row.key)}</b>",
            f"bytes allocated: {row.bytes_allocated:,} ({format_bytes(row.bytes_allocated)})",
            f"bytes logical: {row.bytes_logical:,} ({format_bytes(row.bytes_logical)})",
            f"events: {row.count} ({row.copy_count} copies, {row.alias_count} aliases)",
            f"time: {format_ns(row.time_ns)}",
            f"ops: {ops}",
        ]
    )


def _bar_figure(rows: list[SiteRow], title: str, label: Any, colour: str) -> Any:
    """Horizontal bar of bytes allocated per key, largest on top."""
    import plotly.graph_objects as go

    rows = list(reversed(rows))
    labels = []
    for r in rows:  # category labels must be unique
        text = _e(_trim(label(r.key)))
        while text in labels:
            text += " "
        labels.append(text)
    fig = go.Figure(
        go.Bar(
            x=[r.bytes_allocated for r in rows],
            y=labels,
            orientation="h",
            marker_color=colour,
            hovertext=[_site_hover(r) for r in rows],
            hoverinfo="text",
            text=[format_bytes(r.bytes_allocated) for r in rows],
            textposition="auto",
        )
    )
    _layout(fig, title, height=max(260, 120 + 26 * len(rows)))
    fig.update_xaxes(title_text="bytes allocated")
    fig.update_yaxes(type="category", automargin=True)
    fig.update_layout(showlegend=False)
    return fig


def _ops_figure(model: ReportModel) -> Any:
    """Bytes allocated and event counts (copies / aliases / no-ops) per op."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = model.ops
    names = [_e(r.op) for r in rows]
    fig = make_subplots(
        rows=1,
        cols=2,
        horizontal_spacing=0.12,
        subplot_titles=("Bytes allocated by op", "Events by op"),
    )
    fig.add_trace(
        go.Bar(
            x=names,
            y=[r.bytes_allocated for r in rows],
            name="bytes allocated",
            marker_color="#ff7f0e",
            hovertext=[
                f"<b>{_e(r.op)}</b><br>{r.bytes_allocated:,} B allocated"
                f" ({format_bytes(r.bytes_allocated)})<br>{r.bytes_logical:,} B logical"
                f"<br>time: {format_ns(r.time_ns)}"
                for r in rows
            ],
            hoverinfo="text",
        ),
        row=1,
        col=1,
    )
    for attr, label, colour in (
        ("copy_count", "copies", "#1f77b4"),
        ("alias_count", "aliases", "#aec7e8"),
        ("noop_count", "no-ops", "#98df8a"),
    ):
        fig.add_trace(
            go.Bar(
                x=names,
                y=[getattr(r, attr) for r in rows],
                name=label,
                marker_color=colour,
                hovertemplate=f"%{{x}}<br>{label}: %{{y}}<extra></extra>",
            ),
            row=1,
            col=2,
        )
    _layout(fig, "By op", height=420)
    fig.update_layout(barmode="group")
    fig.update_xaxes(type="category")
    return fig


def _transfers_figure(model: ReportModel) -> Any:
    """Heatmap of bytes (logical) and counts from source to destination device."""
    import plotly.graph_objects as go

    srcs = sorted({t.src_device for t in model.transfers})
    dsts = sorted({t.dst_device for t in model.transfers})
    cell = {(t.src_device, t.dst_device): t for t in model.transfers}
    z, text, hover = [], [], []
    for s in srcs:
        zr, tr, hr = [], [], []
        for d in dsts:
            t = cell.get((s, d))
            zr.append(t.bytes_logical if t else None)
            tr.append(f"{format_bytes(t.bytes_logical)}<br>{t.count} events" if t else "")
            hr.append(
                f"{_e(s)} -> {_e(d)} ({_e(t.transfer)})<br>events: {t.count}"
                f"<br>bytes logical: {t.bytes_logical:,}<br>bytes allocated: {t.bytes_allocated:,}"
                if t
                else f"{_e(s)} -> {_e(d)}: none"
            )
        z.append(zr)
        text.append(tr)
        hover.append(hr)
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=[_e(d) for d in dsts],
            y=[_e(s) for s in srcs],
            text=text,
            texttemplate="%{text}",
            hovertext=hover,
            hoverinfo="text",
            colorscale="Blues",
            colorbar={"title": {"text": "bytes"}},
        )
    )
    _layout(
        fig, "Device transfers (source -> destination, logical bytes)", height=260 + 50 * len(srcs)
    )
    fig.update_xaxes(title_text="destination device", type="category")
    fig.update_yaxes(title_text="source device", type="category")
    return fig


_TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="copytrace">
<title>{{ title }}</title>
<style>
  :root { --fg:#1d2330; --muted:#5d6675; --line:#e3e6eb; --bg:#f6f7f9; --accent:#1f77b4; }
  * { box-sizing: border-box; }
  body { margin:0; font-family:{{ font }}; color:var(--fg); background:var(--bg); }
  header { background:#1d2330; color:#fff; padding:18px 28px; }
  header h1 { margin:0 0 4px; font-size:22px; font-weight:600; }
  header .sub { color:#c5cad3; font-size:13px; word-break:break-all; }
  main { padding:18px 28px 40px; max-width:1500px; margin:0 auto; }
  section { background:#fff; border:1px solid var(--line); border-radius:8px;
            padding:14px 18px; margin:0 0 18px; }
  h2 { font-size:16px; margin:0 0 10px; }
  .cards { display:grid; grid-template-columns:repeat(auto-fill, minmax(165px, 1fr)); gap:10px; }
  .card { border:1px solid var(--line); border-radius:6px; padding:8px 10px; background:#fbfbfc; }
  .card .k { color:var(--muted); font-size:11px; text-transform:uppercase; letter-spacing:.04em; }
  .card .v { font-size:18px; font-weight:600; margin-top:2px; }
  .card .d { color:var(--muted); font-size:11px; }
  .warn { background:#fff6e5; border:1px solid #f0c36d; border-radius:6px; padding:8px 12px;
          margin:0 0 12px; font-size:13px; }
  table { border-collapse:collapse; width:100%; font-size:13px; }
  th, td { text-align:left; padding:5px 8px; border-bottom:1px solid var(--line);
           vertical-align:top; }
  th { color:var(--muted); font-weight:600; background:#fafbfc; }
  td.n, th.n { text-align:right; font-variant-numeric:tabular-nums; white-space:nowrap; }
  td code { font-size:12px; word-break:break-all; }
  dl.meta { display:grid; grid-template-columns:max-content 1fr; gap:4px 14px; margin:0 0 12px;
            font-size:13px; }
  dl.meta dt { color:var(--muted); }
  dl.meta dd { margin:0; word-break:break-all; }
  .grid2 { display:grid; grid-template-columns:minmax(0, 1fr) minmax(0, 1fr); gap:18px; }
  .scroll { overflow-x:auto; }
  @media (max-width: 1100px) { .grid2 { grid-template-columns:1fr; } }
  .note { color:var(--muted); font-size:12px; margin:6px 0 0; }
  footer { color:var(--muted); font-size:12px; text-align:center; padding:10px; }
</style>
</head>
<body>
<header>
  <h1>{{ title }}</h1>
  <div class="sub">{{ model.files | length }} trace file(s): {{ model.files | join(", ") }}</div>
</header>
<main>
<section id="run">
  <h2>Run</h2>
  {% for w in warnings %}<div class="warn">{{ w }}</div>{% endfor %}
  {% if model.runs | length == 1 %}{% set r = model.runs[0] %}
  <dl class="meta">
    <dt>command</dt><dd><code>{{ r.command or "(unknown)" }}</code></dd>
    <dt>process</dt><dd>{{ r.label }}{% if r.host %} on {{ r.host }}{% endif %}</dd>
    <dt>torch</dt><dd>{{ r.torch_version or "(unknown)" }}</dd>
    <dt>copytrace</dt><dd>{{ r.copytrace_version or "(unknown)" }}</dd>
    <dt>started</dt><dd>{{ r.start_ns | when }}</dd>
  </dl>
  {% else %}
  <div class="scroll"><table>
    <tr><th>run</th><th>host</th><th>command</th><th>torch</th><th class="n">duration</th>
        <th class="n">steps</th><th class="n">events</th><th class="n">dropped</th>
        <th class="n">errors</th><th class="n">internal detaches</th></tr>
    {% for r in model.runs %}
    <tr><td>{{ r.label }}</td><td>{{ r.host }}</td><td><code>{{ r.command }}</code></td>
        <td>{{ r.torch_version }}</td><td class="n">{{ r.duration_ns | ns }}</td>
        <td class="n">{{ r.steps }}</td>
        <td class="n">{{ r.events_recorded if r.events_recorded is not none else r.events_loaded }}</td>
        <td class="n">{{ r.events_dropped }}</td><td class="n">{{ r.errors }}</td>
        <td class="n">{{ r.internal_detaches }}</td></tr>
    {% endfor %}
  </table></div>
  <p></p>
  {% endif %}
  <div class="cards">
    {% for c in run_cards %}<div class="card"><div class="k">{{ c[0] }}</div>
      <div class="v">{{ c[1] }}</div><div class="d">{{ c[2] }}</div></div>{% endfor %}
  </div>
</section>
<section id="totals">
  <h2>Totals <span class="note">(over copy and alias events; deepcopy groups are not counted
    twice)</span></h2>
  <div class="cards">
    {% for c in total_cards %}<div class="card"><div class="k">{{ c[0] }}</div>
      <div class="v">{{ c[1] }}</div><div class="d">{{ c[2] }}</div></div>{% endfor %}
  </div>
</section>
{% for fig in figures %}
<section class="figure" id="fig-{{ fig.id }}">
  {{ fig.html }}
  {% if fig.note %}<p class="note">{{ fig.note }}</p>{% endif %}
</section>
{% endfor %}
<section id="call-sites">
  <h2>Top call sites by bytes allocated</h2>
  {{ site_table(sites, "call site") }}
</section>
<div class="grid2">
<section id="call-sites-time">
  <h2>Top call sites by time</h2>
  {{ small_table(sites_by_time, "call site", "time_ns") }}
</section>
<section id="call-sites-count">
  <h2>Top call sites by count</h2>
  {{ small_table(sites_by_count, "call site", "count") }}
</section>
</div>
<section id="modules">
  <h2>Top modules by bytes allocated</h2>
  {{ site_table(modules, "module") }}
</section>
<div class="grid2">
<section id="ops">
  <h2>By op</h2>
  <div class="scroll"><table>
    <tr><th>op</th><th class="n">events</th><th class="n">copies</th><th class="n">aliases</th>
        <th class="n">no-ops</th><th class="n">bytes allocated</th><th class="n">bytes logical</th>
        <th class="n">time</th></tr>
    {% for o in model.ops %}
    <tr><td>{{ o.op }}</td><td class="n">{{ o.count }}</td><td class="n">{{ o.copy_count }}</td>
        <td class="n">{{ o.alias_count }}</td><td class="n">{{ o.noop_count }}</td>
        <td class="n">{{ o.bytes_allocated | nbytes }}</td>
        <td class="n">{{ o.bytes_logical | nbytes }}</td><td class="n">{{ o.time_ns | ns }}</td></tr>
    {% endfor %}
  </table></div>
</section>
<section id="transfers">
  <h2>Transfers (source -> destination device)</h2>
  <div class="scroll"><table>
    <tr><th>source</th><th>destination</th><th>kind</th><th class="n">events</th>
        <th class="n">bytes allocated</th><th class="n">bytes logical</th></tr>
    {% for t in model.transfers %}
    <tr><td>{{ t.src_device }}</td><td>{{ t.dst_device }}</td><td>{{ t.transfer }}</td>
        <td class="n">{{ t.count }}</td><td class="n">{{ t.bytes_allocated | nbytes }}</td>
        <td class="n">{{ t.bytes_logical | nbytes }}</td></tr>
    {% else %}<tr><td colspan="6">no device information</td></tr>
    {% endfor %}
  </table></div>
</section>
</div>
{% if model.groups %}
<section id="groups">
  <h2>deepcopy groups</h2>
  <div class="scroll"><table>
    <tr>{% if model.multi_run %}<th>run</th>{% endif %}<th>object type</th><th class="n">step</th>
        <th class="n">tensors</th><th class="n">bytes allocated</th><th class="n">time</th>
        <th>call site</th></tr>
    {% for g in model.groups[:200] %}
    <tr>{% if model.multi_run %}<td>{{ g.run }}</td>{% endif %}<td><code>{{ g.object_type }}</code></td>
        <td class="n">{{ g.step if g.step is not none else "-" }}</td><td class="n">{{ g.tensors }}</td>
        <td class="n">{{ g.bytes_allocated | nbytes }}</td><td class="n">{{ g.duration_ns | ns }}</td>
        <td><code>{{ g.call_site }}</code></td></tr>
    {% endfor %}
  </table></div>
  {% if model.groups | length > 200 %}<p class="note">first 200 of {{ model.groups | length }}
    groups shown</p>{% endif %}
</section>
{% endif %}
</main>
<footer>generated by copytrace{% if version %} {{ version }}{% endif %} ·
  {{ model.totals.events }} events</footer>
</body>
</html>
"""

_MACROS = """
{% macro site_table(rows, what) -%}
<div class="scroll"><table>
  <tr><th>{{ what }}</th><th class="n">bytes allocated</th><th class="n">bytes logical</th>
      <th class="n">events</th><th class="n">copies</th><th class="n">aliases</th>
      <th class="n">time</th><th>ops</th></tr>
  {% for s in rows %}
  <tr><td><code>{{ s.key }}</code></td><td class="n">{{ s.bytes_allocated | nbytes }}</td>
      <td class="n">{{ s.bytes_logical | nbytes }}</td><td class="n">{{ s.count }}</td>
      <td class="n">{{ s.copy_count }}</td><td class="n">{{ s.alias_count }}</td>
      <td class="n">{{ s.time_ns | ns }}</td>
      <td>{% for op, n in s.ops | dictsort(by="value", reverse=true) %}{{ op }}&nbsp;x{{ n }}{{ ", " if not loop.last }}{% endfor %}</td></tr>
  {% else %}<tr><td colspan="8">no events</td></tr>
  {% endfor %}
</table></div>
{%- endmacro %}
{% macro small_table(rows, what, by) -%}
<div class="scroll"><table>
  <tr><th>{{ what }}</th><th class="n">{{ "time" if by == "time_ns" else "events" }}</th>
      <th class="n">bytes allocated</th></tr>
  {% for s in rows %}
  <tr><td><code>{{ s.key }}</code></td>
      <td class="n">{{ s.time_ns | ns if by == "time_ns" else s.count }}</td>
      <td class="n">{{ s.bytes_allocated | nbytes }}</td></tr>
  {% else %}<tr><td colspan="3">no events</td></tr>
  {% endfor %}
</table></div>
{%- endmacro %}
"""


def _nbytes(n: int) -> str:
    return f"{n:,} B" if n < 1024 else f"{n:,} B ({format_bytes(n)})"


def _when(ns: int) -> str:
    if not ns:
        return "-"
    stamp = _dt.datetime.fromtimestamp(ns / 1e9, tz=_dt.timezone.utc)
    return stamp.strftime("%Y-%m-%d %H:%M:%S UTC")


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    env.filters["nbytes"] = _nbytes
    env.filters["ns"] = format_ns
    env.filters["when"] = _when
    return env


def _cards(model: ReportModel) -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]]]:
    runs = model.runs
    duration = max((r.duration_ns for r in runs), default=0)
    recorded = [r.events_recorded for r in runs]
    events = (
        sum(e for e in recorded if e is not None)
        if all(e is not None for e in recorded)
        else sum(r.events_loaded for r in runs)
    )
    run_cards = [
        (
            "runs",
            str(len(runs)),
            ", ".join(r.label for r in runs[:4]) + (" ..." if len(runs) > 4 else ""),
        ),
        ("duration", format_ns(duration), "longest run" if len(runs) > 1 else "traced region"),
        ("steps", str(sum(r.steps for r in runs)), ""),
        ("events recorded", f"{events:,}", "groups included"),
        ("events dropped", f"{sum(r.events_dropped for r in runs):,}", "buffer cap"),
        ("internal errors", f"{sum(r.errors for r in runs):,}", "caught by copytrace"),
        (
            "internal detaches",
            f"{sum(r.internal_detaches for r in runs):,}",
            "autograd, not events",
        ),
        ("unreadable lines", f"{model.bad_lines:,}", "skipped"),
    ]
    t = model.totals
    total_cards = [
        ("events", f"{t.events:,}", f"{t.group_count} deepcopy group(s)"),
        ("copies", f"{t.copy_count:,}", "new storage or copy_"),
        ("aliases", f"{t.alias_count:,}", "share storage"),
        ("no-ops", f"{t.noop_count:,}", "returned the input"),
        ("bytes allocated", format_bytes(t.bytes_allocated), f"{t.bytes_allocated:,} B"),
        ("bytes logical", format_bytes(t.bytes_logical), f"{t.bytes_logical:,} B"),
        ("copy time", format_ns(t.copy_time_ns), "host-side call time"),
        ("ops that raised", f"{t.error_count:,}", ""),
    ]
    return run_cards, total_cards


def _warnings(model: ReportModel) -> list[str]:
    out = []
    if model.bad_lines:
        out.append(f"{model.bad_lines} unreadable line(s) were skipped (file cut mid-write?).")
    for r in model.runs:
        if r.events_dropped:
            out.append(f"{r.label}: {r.events_dropped:,} event(s) dropped at the buffer cap.")
        if r.errors:
            out.append(f"{r.label}: {r.errors:,} internal copytrace error(s) were caught.")
        if not r.complete:
            out.append(f"{r.label}: no run span (tracing did not stop cleanly); "
                       "run metadata is incomplete.")  # fmt: skip
    return out


def render_html(
    model: ReportModel,
    out_path: str | Path,
    *,
    title: str | None = None,
    offline: bool = True,
) -> Path:
    """Write the report as one HTML page.

    Args:
        model: What :func:`build_model` returned.
        out_path: The HTML file to write (parent directories are created).
        title: Page title; default ``copytrace report: <command>``.
        offline: Inline plotly.js (a self-contained page, about 4.5 MB); if False, load it
            from the plotly CDN.

    Returns:
        ``out_path`` as a :class:`~pathlib.Path`.

    Raises:
        OSError: If the file cannot be written.
    """
    out = Path(out_path)
    if title is None:
        command = model.runs[0].command if model.runs else ""
        title = f"copytrace report: {command}" if command else "copytrace report"

    figures: list[tuple[str, Any, str]] = []
    timeline, left_out = _timeline_figure(model)
    note = "Marker size: bytes allocated; open markers: aliases and no-ops. "
    note += "Shaded bands: steps. Click legend entries to hide ops; drag to zoom."
    if left_out:
        note += f" {left_out:,} smaller events are not drawn."
    figures.append(("timeline", timeline, note))
    if model.steps:
        figures.append(
            ("steps", _steps_figure(model), "Copy time: summed host-side duration of the events.")
        )
    figures.append(
        (
            "sites",
            _bar_figure(
                model.top_call_sites("bytes_allocated", 20),
                "Bytes allocated by call site (top 20)",
                _short_site,
                "#1f77b4",
            ),
            "",
        )
    )
    figures.append(
        (
            "modules",
            _bar_figure(
                model.top_modules("bytes_allocated", 20),
                "Bytes allocated by module (top 20)",
                str,
                "#9467bd",
            ),
            "",
        )
    )
    if model.ops:
        figures.append(("ops", _ops_figure(model), ""))
    if model.transfers:
        figures.append(("transfers", _transfers_figure(model), ""))

    rendered = []
    config = {"displaylogo": False, "responsive": True}
    for i, (fid, fig, fnote) in enumerate(figures):
        include: bool | str = (True if offline else "cdn") if i == 0 else False
        div = fig.to_html(
            full_html=False,
            include_plotlyjs=include,
            config=config,
            default_width="100%",
            div_id=f"copytrace-{fid}",
        )
        rendered.append({"id": fid, "html": Markup(div), "note": fnote})

    run_cards, total_cards = _cards(model)
    env = _environment()
    macros = env.from_string(_MACROS).module
    try:
        from copytrace import __version__ as version
    except ImportError:  # pragma: no cover - the package always defines it
        version = ""
    page = env.from_string(_TEMPLATE).render(
        title=title,
        font=_FONT,
        model=model,
        figures=rendered,
        warnings=_warnings(model),
        run_cards=run_cards,
        total_cards=total_cards,
        sites=model.top_call_sites("bytes_allocated", 20),
        sites_by_time=model.top_call_sites("time_ns", 10),
        sites_by_count=model.top_call_sites("count", 10),
        modules=model.top_modules("bytes_allocated", 20),
        site_table=macros.site_table,
        small_table=macros.small_table,
        version=version,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out
