"""Write the interactive HTML report of a trace file or directory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["register", "default_output", "handle"]

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


def handle(args: argparse.Namespace) -> int:
    """Load the trace, write the report and print one line saying where it is.

    Args:
        args: Parsed arguments with ``path`` and ``output`` (None for the default).

    Returns:
        0 on success.

    Raises:
        TraceFileError: If the trace path is missing, empty or unreadable.
        CopytraceError: If the report file cannot be written.
    """
    from copytrace._errors import CopytraceError
    from copytrace.dashboards import build_model, load_trace, render_html

    path = Path(args.path)
    trace = load_trace(path)
    out = Path(args.output) if args.output else default_output(path)
    if trace.bad_lines:
        print(
            f"copytrace: warning: skipped {trace.bad_lines} unreadable line(s) in {path}",
            file=sys.stderr,
        )
    for empty in trace.empty_files:
        print(f"copytrace: warning: no copytrace spans in {empty}", file=sys.stderr)
    model = build_model(trace)
    try:
        written = render_html(model, out)
    except OSError as err:
        raise CopytraceError(f"cannot write report {out}: {err.strerror or err}") from err
    t = model.totals
    print(
        f"copytrace: report written to {written} "
        f"({t.events} events, {t.bytes_allocated} bytes copied)"
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``report`` subcommand to ``subparsers``.

    Args:
        subparsers: What ``ArgumentParser.add_subparsers()`` returned.

    Returns:
        The new subcommand parser.
    """
    doc = (__doc__ or "").strip()
    short = doc[:1].lower() + doc[1:].rstrip(".")
    parser = subparsers.add_parser("report", help=short, description=doc)
    parser.add_argument(
        "path",
        metavar="PATH",
        help="trace file (*.otlp.jsonl[.gz]) or a directory of them",
    )
    parser.add_argument(
        "-o",
        "--output",
        metavar="OUT.html",
        default=None,
        help="report file (default: PATH/report.html for a directory, "
        "<name>.report.html next to a file)",
    )
    parser.set_defaults(handler=handle)
    return parser
