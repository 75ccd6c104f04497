"""Reports from copytrace trace files: loading, aggregation and the HTML dashboard.

Typical use::

    from copytrace.dashboards import write_report
    write_report("copytrace-out", "copytrace-out/report.html")

or step by step with :func:`copytrace.tracefile.event_table`, :func:`build_model` and
:func:`render_html`. Aggregation runs in DuckDB over the columnar event table, one module
per report section (:mod:`copytrace.dashboards.sections`); only :func:`render_html` needs
plotly (for the plotly.js bundle it inlines), and imports it when called.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from copytrace.dashboards import _display
from copytrace.dashboards._model import (
    MAX_TIMELINE_POINTS,
    HazardRow,
    ReportModel,
    SampleInfo,
    Totals,
    build_model,
    run_analysis,
    sample_events,
)
from copytrace.tracefile import Event, Run, Step, TraceData, load_trace

__all__ = [
    "MAX_TIMELINE_POINTS",
    "Event",
    "HazardRow",
    "ReportModel",
    "Run",
    "SampleInfo",
    "Step",
    "Totals",
    "TraceData",
    "build_model",
    "load_trace",
    "render_html",
    "run_analysis",
    "sample_events",
    "write_report",
]

_display.register()  # a loaded trace's notebook display (the reader never imports this room)


def __getattr__(name: str) -> Any:
    if name == "render_html":  # jinja2 and the page are imported only to render one
        from copytrace.dashboards._html import render_html

        return render_html
    raise AttributeError(f"module 'copytrace.dashboards' has no attribute {name!r}")


def write_report(
    path: str | Path,
    out_html: str | Path,
    *,
    offline: bool = True,
    max_points: int = MAX_TIMELINE_POINTS,
    analyze: bool = True,
    progress: bool | None = None,
    group_by: str = "library",
) -> Path:
    """Load a trace, aggregate it and write the HTML report.

    Args:
        path: A trace file (``*.otlp.jsonl`` or ``*.otlp.jsonl.gz``) or a directory of them
            (one per process or rank).
        out_html: The HTML file to write; parent directories are created.
        offline: Inline plotly.js (default) rather than loading it from the plotly CDN.
        max_points: Most events drawn on the timeline (every hazard kept beyond it).
        analyze: Run the hazard analyser (``copytrace.analysis``) when it is installed.
        progress: Show a progress bar for each stage that takes longer than half a second
            (default: in a Jupyter notebook only, in the notebook's own form).
        group_by: ``library`` (default) or ``user``: what the call-site table and the treemap
            group by (see :func:`build_model`).

    Returns:
        ``out_html`` as a :class:`~pathlib.Path`. The page shows bytes (copied, allocated,
        logical) and times (ns since each run's start; event and step durations in ns).

    Raises:
        TraceFileError: If ``path`` is missing, a directory without trace files, or holds no
            readable copytrace spans.
        OSError: If the report cannot be written.
    """
    from copytrace.dashboards._html import render_html
    from copytrace.dashboards._progress import Progress, in_notebook
    from copytrace.tracefile import event_table

    show = in_notebook() if progress is None else progress
    with Progress("reading trace", None, "B", enabled=show) as bar:
        trace = event_table(path, progress=bar.update)
    with Progress("aggregating", 5, "sections", enabled=show) as bar:
        model = build_model(trace, analyze=analyze, progress=bar.set_done, max_points=max_points,
                            group_by=group_by)
    del trace
    with Progress("writing report", None, "B", enabled=show):
        return render_html(model, out_html, offline=offline, max_points=max_points)
