"""Rich output in Jupyter: a trace's summary as HTML or Markdown, and the report inline.

A :class:`copytrace.Trace` (live or written) and a loaded trace (what
:func:`copytrace.load_trace` returns) show their summary when they are the value of a
notebook cell (``_repr_html_`` / ``_repr_markdown_`` call the functions here);
``Trace.report()`` in a notebook also shows the interactive report in the output, in an
``<iframe srcdoc>`` (the self-contained page, so it works offline and in a saved notebook).
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import jinja2

from copytrace.dashboards._model import ReportModel, format_bytes, format_ns, top
from copytrace.dashboards._progress import in_notebook

__all__ = [
    "in_notebook",
    "summary_html",
    "summary_markdown",
    "trace_summary_html",
    "trace_summary_markdown",
    "display_report",
]

#: Rows of the call-site table in a summary.
TOP_SITES = 5

_HTML = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined).from_string(
    """<div class="copytrace-summary">
<p><b>copytrace</b>{% if where %} &middot; <code>{{ where }}</code>{% endif %}</p>
<table>
{% for k, v in headline %}<tr><th style="text-align:left">{{ k }}</th><td style="text-align:left">{{ v }}</td></tr>
{% endfor %}</table>
{% if sites %}<p><b>Top call sites by bytes copied</b></p>
<table><tr><th>call site</th><th>bytes copied</th><th>copy time</th><th>events</th><th>ops</th></tr>
{% for s in sites %}<tr><td style="text-align:left"><code>{{ s.label }}</code></td><td>{{ s.bytes }}</td><td>{{ s.time }}</td><td>{{ s.events }}</td><td style="text-align:left">{{ s.ops }}</td></tr>
{% endfor %}</table>{% endif %}
{% if hazards %}<p><b>Hazards</b></p>
<table><tr><th>severity</th><th>code</th><th>what</th><th>fix</th></tr>
{% for h in hazards %}<tr><td>{{ h.severity }}</td><td><code>{{ h.code }}</code></td><td style="text-align:left">{{ h.message }}</td><td style="text-align:left">{{ h.fix }}</td></tr>
{% endfor %}</table>{% endif %}
</div>"""
)


def _facts(model: ReportModel) -> dict[str, Any]:
    """Headline rows, top call sites and hazards of ``model``, as display strings."""
    t = model.totals
    st = model.stages
    steady = st["steady"]
    headline: list[tuple[str, str]] = []
    if steady.steps and steady.step_time_ns:
        headline.append((
            "copy time share of a step (steady state)",
            f"{steady.share_pct:.3g}% ({format_ns(steady.copy_time_ns / steady.steps)} "
            f"copy time per step, {steady.steps} steps)",
        ))  # fmt: skip
    steps = sum(r.steps for r in model.runs)
    headline.append((
        "events",
        f"{t.events:,} in {steps:,} steps: {t.copy_count:,} copies, {t.alias_count:,} "
        f"aliases, {t.noop_count:,} no-ops",
    ))  # fmt: skip
    headline.append((
        "bytes copied",
        f"{format_bytes(t.bytes_copied)} ({format_bytes(t.bytes_allocated)} allocated), "
        f"copy time {format_ns(t.copy_time_ns)}",
    ))  # fmt: skip
    if t.cross_device_count:
        headline.append((
            "cross-device",
            f"{format_bytes(t.cross_device_bytes)} in {t.cross_device_count:,} events",
        ))  # fmt: skip
    headline.append(("hazards", str(len(model.hazards))))
    sites = [
        {
            "label": r.label,
            "bytes": format_bytes(r.bytes_copied),
            "time": format_ns(r.time_ns),
            "events": f"{r.count:,}",
            "ops": ", ".join(sorted(r.ops, key=lambda o: -r.ops[o])[:3]),
        }
        for r in top(model.call_sites, "bytes_copied", TOP_SITES)
        if r.bytes_copied > 0
    ]
    hazards = [
        {"severity": h.severity or "?", "code": h.code, "message": h.message, "fix": h.fix}
        for h in model.hazards[:10]
    ]
    return {"headline": headline, "sites": sites, "hazards": hazards}


def summary_html(model: ReportModel, where: str = "") -> str:
    """The summary of ``model`` as an HTML fragment (strings from the trace escaped)."""
    return _HTML.render(where=where, **_facts(model))


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def summary_markdown(model: ReportModel, where: str = "") -> str:
    """The summary of ``model`` as Markdown."""
    facts = _facts(model)
    lines = ["**copytrace**" + (f" · `{where}`" if where else ""), ""]
    lines += [f"- {k}: {_md(v)}" for k, v in facts["headline"]]
    if facts["sites"]:
        lines += [
            "",
            "| call site | bytes copied | copy time | events | ops |",
            "|---|--:|--:|--:|---|",
        ]
        lines += [
            f"| `{_md(s['label'])}` | {s['bytes']} | {s['time']} | {s['events']} | {_md(s['ops'])} |"
            for s in facts["sites"]
        ]
    if facts["hazards"]:
        lines += ["", "| severity | code | what |", "|---|---|---|"]
        lines += [
            f"| {h['severity']} | `{h['code']}` | {_md(h['message'])} |" for h in facts["hazards"]
        ]
    return "\n".join(lines) + "\n"


def _trace_model(trace: Any) -> tuple[ReportModel | None, str]:
    """The model of a :class:`copytrace.Trace` once written, else None and a status line."""
    target = getattr(trace, "_delegate", None) or trace
    if target.running:
        stats = target.stats
        return None, (
            f"tracing: {stats['events']:,} events in {stats['steps']:,} steps so far "
            f"(the summary comes when the trace stops)"
        )
    if target.trace_path is None:
        events = len(target.events)
        why = "write=False" if not target.write else "not started"
        return None, f"no trace file ({why}); {events:,} events in memory"
    from copytrace.dashboards import build_model, load_trace

    key = (str(target.trace_path), target.trace_path.stat().st_mtime_ns)
    cached = getattr(target, "_summary_model", None)
    if cached is None or cached[0] != key:
        cached = (key, build_model(load_trace(target.trace_path), analyze=True))
        target._summary_model = cached
    return cached[1], str(target.trace_path)


def trace_summary_html(trace: Any) -> str:
    """``Trace._repr_html_``: the summary of the written trace, or its status while live."""
    model, where = _trace_model(trace)
    if model is None:
        return f"<p><b>copytrace</b>: {html.escape(where)}</p>"
    return summary_html(model, where)


def trace_summary_markdown(trace: Any) -> str:
    """``Trace._repr_markdown_``."""
    model, where = _trace_model(trace)
    return f"**copytrace**: {where}\n" if model is None else summary_markdown(model, where)


def display_report(path: Path, height: int = 900) -> None:
    """Show the report page at ``path`` in the notebook's output, in an ``<iframe srcdoc>``."""
    from IPython.display import HTML, display

    page = Path(path).read_text(encoding="utf-8")
    display(
        HTML(
            f'<iframe class="copytrace-report" srcdoc="{html.escape(page, quote=True)}" '
            f'style="width:100%;height:{int(height)}px;border:1px solid #ddd"></iframe>'
        )
    )
