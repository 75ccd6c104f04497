"""Print a plain-text summary of a trace: totals, top call sites and modules, ops."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from copytrace.dashboards._model import ReportModel

__all__ = ["register", "format_summary", "handle"]


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def fmt(cells: Sequence[str]) -> str:
        out = [
            c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)
        ]
        return "  ".join(out).rstrip()

    lines = [fmt(headers), "  ".join("-" * w for w in widths)]
    lines.extend(fmt(row) for row in rows)
    if not rows:
        lines.append("(none)")
    return lines


def format_summary(model: ReportModel, top_n: int = 10) -> str:
    """Format a report model as a plain-text summary.

    Args:
        model: What :func:`copytrace.dashboards.build_model` returned.
        top_n: Rows per "top" table.

    Returns:
        The summary text (bytes in bytes, times in ms), ending with a newline.
    """
    from copytrace.dashboards._model import format_bytes, format_ns, top

    t = model.totals
    lines: list[str] = []
    for r in model.runs:
        lines.append(f"run: {r.label}{' on ' + r.host if r.host else ''}")
        lines.append(f"  command: {r.command or '(unknown)'}")
        lines.append(
            f"  torch {r.torch_version or '?'}, copytrace {r.copytrace_version or '?'}, "
            f"duration {format_ns(r.duration_ns)}, {r.steps} steps"
        )
        recorded = r.events_recorded if r.events_recorded is not None else r.events_loaded
        lines.append(
            f"  events recorded {recorded}, dropped {r.events_dropped}, errors {r.errors}, "
            f"internal detaches {r.internal_detaches}"
            + ("" if r.complete else " (no run span: trace incomplete)")
        )
    if model.bad_lines:
        lines.append(f"unreadable lines skipped: {model.bad_lines}")
    lines.append("")
    lines.append("totals (non-group events):")
    lines.extend(
        _table(
            ["events", "copies", "aliases", "no-ops", "bytes allocated", "bytes logical",
             "copy time", "groups"],
            [[str(t.events), str(t.copy_count), str(t.alias_count), str(t.noop_count),
              f"{t.bytes_allocated} ({format_bytes(t.bytes_allocated)})",
              f"{t.bytes_logical} ({format_bytes(t.bytes_logical)})",
              format_ns(t.copy_time_ns), str(t.group_count)]],
            right=set(range(8)),
        )
    )  # fmt: skip

    def site_rows(rows: Sequence) -> list[list[str]]:
        return [
            [str(r.bytes_allocated), format_ns(r.time_ns), str(r.count), str(r.alias_count), r.key]
            for r in rows
        ]

    headers = ["bytes alloc", "time", "events", "aliases"]
    for what, rows_of in (("call sites", model.call_sites), ("modules", model.modules)):
        for by, label in (("bytes_allocated", "bytes allocated"), ("time_ns", "time")):
            lines.append("")
            lines.append(f"top {what} by {label}:")
            lines.extend(
                _table(headers + [what[:-1]], site_rows(top(rows_of, by, top_n)), {0, 1, 2, 3})
            )
    lines.append("")
    lines.append("by op:")
    lines.extend(
        _table(
            ["op", "events", "copies", "aliases", "no-ops", "bytes alloc", "bytes logical", "time"],
            [[o.op, str(o.count), str(o.copy_count), str(o.alias_count), str(o.noop_count),
              str(o.bytes_allocated), str(o.bytes_logical), format_ns(o.time_ns)]
             for o in model.ops],
            right=set(range(1, 8)),
        )
    )  # fmt: skip
    if model.transfers:
        lines.append("")
        lines.append("transfers:")
        lines.extend(
            _table(
                ["src -> dst", "kind", "events", "bytes alloc", "bytes logical"],
                [[f"{x.src_device} -> {x.dst_device}", x.transfer, str(x.count),
                  str(x.bytes_allocated), str(x.bytes_logical)] for x in model.transfers],
                right={2, 3, 4},
            )
        )  # fmt: skip
    return "\n".join(lines) + "\n"


def handle(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Load the trace and print its summary to stdout.

    Args:
        args: Parsed arguments with ``path`` and ``top``.
        out: Stream to write to (default ``sys.stdout``).

    Returns:
        0 on success.

    Raises:
        TraceFileError: If the trace path is missing, empty or unreadable.
        CopytraceError: If ``--top`` is negative.
    """
    from copytrace._errors import CopytraceError
    from copytrace.dashboards import build_model, load_trace

    if args.top < 0:
        raise CopytraceError(f"--top must be >= 0, got {args.top}")
    path = Path(args.path)
    trace = load_trace(path)
    if trace.bad_lines:
        print(
            f"copytrace: warning: skipped {trace.bad_lines} unreadable line(s) in {path}",
            file=sys.stderr,
        )
    (out or sys.stdout).write(format_summary(build_model(trace), args.top))
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``summary`` subcommand to ``subparsers``.

    Args:
        subparsers: What ``ArgumentParser.add_subparsers()`` returned.

    Returns:
        The new subcommand parser.
    """
    doc = (__doc__ or "").strip()
    short = doc[:1].lower() + doc[1:].rstrip(".")
    parser = subparsers.add_parser("summary", help=short, description=doc)
    parser.add_argument(
        "path",
        metavar="PATH",
        help="trace file (*.otlp.jsonl[.gz]) or a directory of them",
    )
    parser.add_argument(
        "--top", type=int, default=10, metavar="N", help="rows per top-N table (default: 10)"
    )
    parser.set_defaults(handler=handle)
    return parser
