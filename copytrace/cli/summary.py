"""Print a terminal summary of a trace: copy share per step, top call sites and modules, ops."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from copytrace.cli._common import add_group_by, add_trace_command, select_runs, warn_unreadable
from copytrace.cli._engine import (
    SUMMARY_QUERIES,
    add_engine_options,
    engine_results,
    format_engine_summary,
    is_dataset,
)

if TYPE_CHECKING:
    from copytrace.dashboards._model import ReportModel

__all__ = ["register", "format_summary", "handle", "rank_lines"]


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


def _pct(part: float, whole: float) -> str:
    return f"{part / whole * 100:.1f}%" if whole else "-"


def _share(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}%"


def _spread(model: ReportModel) -> tuple[float, float] | None:
    """``(q1, q3)`` of the steady steps' copy-time shares (percent) when they are noisy: the
    middle half spreads over more than half the median (the report's rule); else None."""
    import statistics

    shares = [
        100 * s.copy_time_ns / s.duration_ns
        for s in model.steps
        if s.stage == "steady" and s.duration_ns
    ]
    if len(shares) < 4:
        return None
    q1, median, q3 = statistics.quantiles(shares, n=4, method="inclusive")
    return (q1, q3) if median > 0 and q3 - q1 > 0.5 * median else None


def format_summary(model: ReportModel, top_n: int = 10) -> str:
    """Format a report model as terminal text: headline numbers and top-N tables.

    Args:
        model: What :func:`copytrace.dashboards.build_model` returned.
        top_n: Rows per "top" table.

    Returns:
        The summary text, ending with a newline. Bytes are shown in B/KiB/MiB/GiB, times
        in ns/us/ms/s, shares in percent.
    """
    lines = _run_lines(model)
    lines.append("")
    lines.extend(_headline_lines(model))
    lines.extend(_top_lines(model, top_n))
    lines.extend(_op_and_transfer_lines(model))
    compiled = getattr(model, "compiled", None)
    if compiled is not None:
        from copytrace.dashboards._compiled import summary_lines

        lines.extend(summary_lines(compiled, model.totals.bytes_copied, top_n))
    from copytrace.dashboards.sections.ranks import rank_totals

    lines.extend(rank_lines(rank_totals(model)))
    lines.extend(_hazard_lines(model, top_n))
    return "\n".join(lines) + "\n"


def rank_lines(rows: Sequence[tuple[str, int, int, int]]) -> list[str]:
    """Ranks side by side: each one's copy bytes and copy time per step, the slowest rank (the
    most copy time per step) and the imbalance (its copy time per step over the median
    rank's). Nothing for a single process.

    Args:
        rows: ``(label, steps, bytes copied, copy time ns)`` per rank; a rank without steps
            counts as one step.
    """
    import statistics

    from copytrace.dashboards._model import format_bytes, format_ns

    if len(rows) < 2:
        return []
    per = [(label, b / max(n, 1), t / max(n, 1), n) for label, n, b, t in rows]
    slow = max(per, key=lambda r: r[2])
    median = statistics.median(r[2] for r in per)
    lines = ["", "ranks side by side (per step):"]
    lines.extend(
        _table(
            ["rank", "steps", "bytes copied", "copy time", "vs median"],
            [[label, str(n), format_bytes(round(b)), format_ns(round(t)),
              f"{t / median:.2f}x" if median else "-"] for label, b, t, n in per],
            right={1, 2, 3, 4},
        )
    )  # fmt: skip
    imbalance = f"{slow[2] / median:.2f}x the median" if median else "no copy time"
    lines.append(f"slowest rank: {slow[0]}, {format_ns(round(slow[2]))} copy time per step, "
                 f"imbalance (max/median) {imbalance}")  # fmt: skip
    return lines


def _run_lines(model: ReportModel) -> list[str]:
    """Each run's command, versions, duration and recording counts."""
    from copytrace.dashboards._model import format_ns

    lines: list[str] = []
    for r in model.runs:
        lines.append(f"run: {r.label}{' on ' + r.host if r.host else ''}")
        lines.append(f"  command: {r.command or '(unknown)'}")
        lines.append(
            f"  torch {r.torch_version or '?'}, copytrace {r.copytrace_version or '?'}, "
            f"duration {format_ns(r.duration_ns)}, {r.steps} steps, "
            f"devices {', '.join(r.devices) or '?'}"
        )
        recorded = r.events_recorded if r.events_recorded is not None else r.events_loaded
        overhead = (
            f", tracer overhead {format_ns(r.overhead_ns)}" if r.overhead_ns is not None else ""
        )
        lines.append(
            f"  events recorded {recorded}, dropped {r.events_dropped}, errors {r.errors}, "
            f"internal detaches {r.internal_detaches}{overhead}"
            + ("" if r.complete else " (no run span: trace incomplete)")
        )
        if r.ring:
            lines.append(f"  {r.ring_line()}")
    if model.bad_lines:
        lines.append(f"unreadable lines skipped: {model.bad_lines}")
    return lines


def _headline_lines(model: ReportModel) -> list[str]:
    """The copy time share of a step, the event counts, bytes and the number of hazards."""
    from copytrace.dashboards._model import format_bytes, format_ns

    t = model.totals
    lines: list[str] = []
    st = model.stages
    steady, warm, tail = st["steady"], st["warmup"], st["tail"]
    if steady.steps and steady.step_time_ns:
        extra = []
        if warm.steps:
            extra.append(f"warm-up {_share(warm.share_pct)}")
        if tail.steps:
            extra.append(f"last step {_share(tail.share_pct)}")
        lines.append(
            f"copy time share of a step (steady state, {steady.steps} steps): "
            f"{_share(steady.share_pct)} (median {_share(steady.median_share_pct)}), "
            f"{format_ns(steady.copy_time_ns / steady.steps)} copy time per step"
            + (f"; {', '.join(extra)}" if extra else "")
        )
        spread = _spread(model)
        if spread is not None:
            lines.append(
                f"  noisy: the share varies between steps (middle half {_share(spread[0])} to "
                f"{_share(spread[1])}); compare runs by the copy time per step"
            )
    failed = t.events - t.copy_count - t.alias_count - t.noop_count  # calls that raised
    lines.append(
        f"events: {t.events} = {t.copy_count} copies + {t.alias_count} aliases + "
        f"{t.noop_count} no-ops{f' + {failed} failed calls' if failed else ''} "
        f"({t.group_count} deepcopy groups)"
    )
    lines.append(
        f"bytes copied {format_bytes(t.bytes_copied)} ({t.bytes_copied} B), allocated "
        f"{format_bytes(t.bytes_allocated)}, copy time {format_ns(t.copy_time_ns)}, "
        f"cross-device {format_bytes(t.cross_device_bytes)} in {t.cross_device_count} events"
    )
    import textwrap

    from copytrace.dashboards._rows import BYTES_DEFINITION

    lines.extend(textwrap.wrap(f"({BYTES_DEFINITION})", 100, initial_indent="  ",
                               subsequent_indent="   "))  # fmt: skip
    if model.hazards or model.analysis == "ran":
        lines.append(f"hazards: {len(model.hazards)}")
    return lines


def _entry_text(model: ReportModel, r: Any) -> str:
    """The other site of a call-site row: the user's line beside a library call site (or the
    library site beside a user's line), and how many more there are."""
    if not r.entries:
        return ""
    more = len(r.entries) - 1
    return model.site_labels.get(r.entry, r.entry) + (f" (+{more} more)" if more else "")


def _top_lines(model: ReportModel, top_n: int) -> list[str]:
    """The top call sites and modules, by bytes copied and by copy time; a call site of a
    library has the user's line that reached it beside it (``--group-by user``: the other
    way round)."""
    from copytrace.dashboards._model import NO_MODULE, format_bytes, format_ns, top

    t = model.totals
    by_user = getattr(model, "group_by", "library") == "user"

    def site_rows(rows: Sequence, is_site: bool, entries: bool) -> list[list[str]]:
        out = []
        for i, r in enumerate(rows, 1):
            name = r.label if is_site else (r.key or NO_MODULE)
            if is_site and r.source:
                src = r.source if len(r.source) <= 60 else r.source[:57] + "..."
                name = f"{name}  | {src}"
            out.append(
                [str(i), format_bytes(r.bytes_copied), _pct(r.bytes_copied, t.bytes_copied),
                 format_bytes(r.bytes_allocated),  # logical vs really allocated
                 format_ns(r.time_ns), _pct(r.time_ns, t.copy_time_ns), str(r.count),
                 str(r.copy_count), str(r.alias_count), str(r.noop_count), name]
                + ([_entry_text(model, r) or "-"] if entries else [])
            )  # fmt: skip
        return out

    lines: list[str] = []
    headers = ["#", "bytes copied", "%", "allocated", "time", "%", "events", "copies",
               "aliases", "no-ops"]  # fmt: skip
    entry_word = "library site" if by_user else "user's line"
    for what, rows_of, is_site in (
        ("call sites", model.call_sites, True),
        ("modules", model.modules, False),
    ):
        for by, label in (("bytes_copied", "bytes copied"), ("time_ns", "copy time")):
            chosen = [r for r in top(rows_of, by, top_n) if getattr(r, by) > 0]
            entries = is_site and any(r.entries for r in chosen)
            lines.append("")
            lines.append(f"top {what} by {label}:")
            cols = headers + [what[:-1]]
            lines.extend(_table(cols + [entry_word] * entries,
                                site_rows(chosen, is_site, entries), set(range(10))))  # fmt: skip
    return lines


def _op_and_transfer_lines(model: ReportModel) -> list[str]:
    """The per-op table, and the device-pair table when anything crossed devices."""
    from copytrace.dashboards._model import format_bytes, format_ns

    lines = ["", "by op:"]
    lines.extend(
        _table(
            ["op", "events", "copies", "aliases", "no-ops", "bytes copied", "allocated", "time"],
            [[o.op, str(o.count), str(o.copy_count), str(o.alias_count), str(o.noop_count),
              format_bytes(o.bytes_copied), format_bytes(o.bytes_allocated), format_ns(o.time_ns)]
             for o in model.ops],
            right=set(range(1, 8)),
        )
    )  # fmt: skip
    if model.transfers:
        lines.append("")
        lines.append("transfers:")
        lines.extend(
            _table(
                ["src -> dst", "kind", "events", "copies", "bytes logical", "non_blocking"],
                [[f"{x.src_device} -> {x.dst_device}", x.transfer, str(x.count),
                  str(x.copy_count), format_bytes(x.bytes_logical),
                  _pct(x.non_blocking_count, x.count)] for x in model.transfers],
                right={2, 3, 4, 5},
            )
        )  # fmt: skip
    return lines


def _hazard_lines(model: ReportModel, top_n: int) -> list[str]:
    """The hazards table (at most ``2 * top_n`` rows), or nothing without hazards."""
    if not model.hazards:
        return []
    run_col = ["run"] if model.multi_run else []
    lines = ["", "hazards:"]
    lines.extend(
        _table(
            ["severity", "code", *run_col, "events", "message", "fix"],
            [[h.severity or "?", h.code, *([", ".join(h.runs)] if run_col else []),
              str(len(h.event_ids)), h.message, h.fix]
             for h in model.hazards[: max(top_n, 1) * 2]],
            right={3 if run_col else 2},
        )
    )  # fmt: skip
    return lines


def handle(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Load the trace and print its summary to stdout.

    Args:
        args: Parsed arguments with ``path``, ``top``, ``no_analysis`` and ``group_by``.
        out: Stream to write to (default ``sys.stdout``).

    Returns:
        0 on success.

    Raises:
        TraceFileError: If the trace path is missing, empty or unreadable.
        CopytraceError: If ``--top`` is negative.
    """
    from copytrace._errors import CopytraceError
    from copytrace.dashboards import build_model
    from copytrace.tracefile import event_table

    if args.top < 0:
        raise CopytraceError(f"--top must be >= 0, got {args.top}")
    path = Path(args.path)
    if args.engine == "spark" or is_dataset(path):
        (out or sys.stdout).write(format_engine_summary(engine_results(args, SUMMARY_QUERIES), args.top))
        return 0
    trace = select_runs(event_table(path), args, path)
    warn_unreadable(trace, path)
    model = build_model(trace, analyze=not args.no_analysis, timeline=False, hazard_events=False,
                        patches=False, group_by=getattr(args, "group_by", "library"))
    (out or sys.stdout).write(format_summary(model, args.top))
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``summary`` subcommand to ``subparsers``.

    Args:
        subparsers: What ``ArgumentParser.add_subparsers()`` returned.

    Returns:
        The new subcommand parser.
    """
    parser = add_trace_command(subparsers, "summary", __doc__)
    parser.add_argument(
        "--top", type=int, default=10, metavar="N", help="rows per top-N table (default: 10)"
    )
    parser.add_argument(
        "--no-analysis",
        action="store_true",
        help="do not run the hazard analyser (copytrace.analysis): show only the hazards the trace file holds",
    )
    add_group_by(parser)
    add_engine_options(parser)
    parser.set_defaults(handler=handle)
    return parser
