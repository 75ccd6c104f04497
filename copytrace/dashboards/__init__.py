"""Reports from copytrace trace files: loading, aggregation and the HTML dashboard.

Typical use::

    from copytrace.dashboards import write_report
    write_report("copytrace-out", "copytrace-out/report.html")

or step by step with :func:`load_trace`, :func:`build_model` and :func:`render_html`.
Only :func:`render_html` needs plotly, and imports it when called.
"""

from __future__ import annotations

from pathlib import Path

from copytrace.dashboards._html import render_html
from copytrace.dashboards._load import Event, Run, Step, TraceData, load_trace
from copytrace.dashboards._model import ReportModel, Totals, build_model

__all__ = [
    "Event",
    "ReportModel",
    "Run",
    "Step",
    "Totals",
    "TraceData",
    "build_model",
    "load_trace",
    "render_html",
    "write_report",
]


def write_report(path: str | Path, out_html: str | Path) -> Path:
    """Load a trace, aggregate it and write the HTML report.

    Args:
        path: A trace file (``*.otlp.jsonl`` or ``*.otlp.jsonl.gz``) or a directory of them.
        out_html: The HTML file to write; parent directories are created.

    Returns:
        ``out_html`` as a :class:`~pathlib.Path`. The page shows bytes (allocated and
        logical) and times (ns since each run's start, event and step durations in ns).

    Raises:
        TraceFileError: If ``path`` is missing, a directory without trace files, or holds no
            readable copytrace spans.
        OSError: If the report cannot be written.
    """
    return render_html(build_model(load_trace(path)), out_html)
