"""Write the interactive HTML report of a trace file or directory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from copytrace.cli._common import add_group_by, add_trace_command, select_runs, warn_unreadable

if TYPE_CHECKING:
    from copytrace.dashboards import ReportModel

__all__ = ["register", "default_output", "handle", "build"]

_SUFFIXES = (".otlp.jsonl.gz", ".otlp.jsonl", ".jsonl.gz", ".jsonl", ".gz")


def default_output(path: Path) -> Path:
    """Return the default report path for a trace ``path``.

    Args:
        path: A trace directory or file.

    Returns:
        ``<dir>/report.html`` for a directory; for a file, ``<name>.report.html`` next to it
        (``copytrace-h-1.otlp.jsonl`` -> ``copytrace-h-1.report.html``).
    """
    if path.is_dir():
        return path / "report.html"
    name = path.name
    for suffix in _SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            name = name[: -len(suffix)]
            break
    return path.with_name(f"{name}.report.html")


def build(
    path: Path,
    out: Path,
    *,
    offline: bool = True,
    max_points: int | None = None,
    analyze: bool = True,
    progress: bool = True,
    runs: argparse.Namespace | None = None,
    group_by: str = "library",
) -> tuple[Path, ReportModel]:
    """Load a trace, aggregate it and write the report, showing progress on stderr.

    Args:
        path: A trace file or directory.
        out: The HTML file to write.
        offline: Inline plotly.js (True) or load it from the plotly CDN (False).
        max_points: Timeline point budget (default
            :data:`~copytrace.dashboards.MAX_TIMELINE_POINTS`).
        analyze: Run the hazard analyser when installed.
        progress: Show progress on stderr (a bar on a terminal, lines in a log, only for
            stages that take long).
        runs: The ``--run`` / ``--all`` choice (default: the latest run of several).
        group_by: ``library`` or ``user``: what the call-site tables and the treemap group
            by (see :func:`copytrace.dashboards.build_model`).

    Returns:
        The file written and the report model.

    Raises:
        TraceFileError: If the trace path is missing, empty or unreadable.
        CopytraceError: If the report file cannot be written.
    """
    from copytrace._errors import CopytraceError
    from copytrace.dashboards import MAX_TIMELINE_POINTS, build_model, render_html
    from copytrace.dashboards._progress import Progress
    from copytrace.tracefile import TRACE_GLOBS, event_table

    files = (
        [f for pattern in TRACE_GLOBS for f in path.glob(pattern) if f.is_file()]
        if path.is_dir()
        else [path]
    )
    total = sum(f.stat().st_size for f in files if f.exists())
    with Progress("reading trace", total, "B", enabled=progress) as bar:
        trace = event_table(path, progress=bar.update)
    trace = select_runs(trace, runs or argparse.Namespace(run=None, all=False), path)
    warn_unreadable(trace, path)
    for empty in trace.empty_files:
        print(f"copytrace: warning: no copytrace spans in {empty}", file=sys.stderr)
    points = MAX_TIMELINE_POINTS if max_points is None else max_points
    with Progress("aggregating", 5, "sections", enabled=progress) as bar:
        model = build_model(trace, analyze=analyze, progress=bar.set_done, max_points=points,
                            group_by=group_by)
    del trace
    with Progress("writing report", None, "B", enabled=progress):
        try:
            written = render_html(
                model,
                out,
                offline=offline,
                max_points=points,
            )
        except OSError as err:
            raise CopytraceError(f"cannot write report {out}: {err.strerror or err}") from err
    return written, model


def handle(args: argparse.Namespace) -> int:
    """Load the trace, write the report and print one line saying where it is.

    Args:
        args: Parsed arguments with ``path``, ``output`` (None for the default), ``cdn``,
            ``max_points`` and ``no_analysis``.

    Returns:
        0 on success.

    Raises:
        TraceFileError: If the trace path is missing, empty or unreadable.
        CopytraceError: If the report file cannot be written or ``--max-points`` < 0.
    """
    from copytrace._errors import CopytraceError

    if args.max_points is not None and args.max_points < 0:
        raise CopytraceError(f"--max-points must be >= 0, got {args.max_points}")
    path = Path(args.path)
    out = Path(args.output) if args.output else default_output(path)
    written, model = build(
        path,
        out,
        offline=not args.cdn,
        max_points=args.max_points,
        analyze=not args.no_analysis,
        runs=args,
        group_by=args.group_by,
    )
    t = model.totals
    print(
        f"copytrace: report written to {written} ({t.events} events, {t.bytes_copied} bytes copied)"
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``report`` subcommand to ``subparsers``.

    Args:
        subparsers: What ``ArgumentParser.add_subparsers()`` returned.

    Returns:
        The new subcommand parser.
    """
    parser = add_trace_command(subparsers, "report", __doc__)
    parser.add_argument(
        "-o",
        "--output",
        metavar="OUT.html",
        default=None,
        help="report file (default: PATH/report.html for a directory, "
        "<name>.report.html next to a file)",
    )
    parser.add_argument(
        "--cdn",
        action="store_true",
        help="load plotly.js from the plotly CDN instead of inlining it "
        "(a smaller file that needs network access to open)",
    )
    parser.add_argument(
        "--max-points",
        type=int,
        default=None,
        metavar="N",
        help="most events drawn on the timeline (default: 30000); every hazard and every "
        "large copy is kept, totals always count every event",
    )
    parser.add_argument(
        "--no-analysis",
        action="store_true",
        help="do not run the hazard analyser (copytrace.analysis): show only the hazards the trace file holds",
    )
    add_group_by(parser)
    parser.set_defaults(handler=handle)
    return parser
