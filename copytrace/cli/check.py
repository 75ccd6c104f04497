"""Check a trace against copy budgets and forbidden hazards; exit 1 on any violation."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

from copytrace.cli._common import add_trace_command, select_runs, warn_unreadable
from copytrace.cli._engine import add_engine_options, is_dataset

__all__ = ["register", "handle", "EXIT_VIOLATION"]

#: Exit status when the trace breaks a budget or shows a forbidden hazard.
EXIT_VIOLATION = 1


def _bytes(text: str) -> int:
    from copytrace.analysis import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def handle(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Load the trace, analyse it and check the budget.

    Prints one line per violation on stderr (``copytrace check: <reason>``) and a one-line
    verdict on stdout; with ``--findings`` also every finding.

    Returns:
        0 within budget, :data:`EXIT_VIOLATION` (1) otherwise.

    Raises:
        TraceFileError: If the trace path is missing, empty or unreadable.
        CopytraceError: For an unknown hazard code or severity.
    """
    from copytrace._errors import CopytraceError
    from copytrace.analysis import (
        Budget,
        analyze_with_totals,
        check,
        format_findings,
        normalize_codes,
        severity_codes,
    )
    from copytrace.tracefile import event_table

    out = out or sys.stdout
    err = err or sys.stderr
    try:
        forbid = normalize_codes(args.forbid)
        if args.fail_on:
            forbid += [c for c in severity_codes(args.fail_on) if c not in forbid]
    except ValueError as e:
        raise CopytraceError(str(e)) from None
    path = Path(args.path)
    budget = Budget(
        max_bytes_per_step=args.max_bytes_per_step,
        max_copies_per_step=args.max_copies_per_step,
        max_bytes=args.max_bytes,
        max_copies=args.max_copies,
        forbid=forbid,
        warmup_steps=args.warmup_steps,
    )
    if args.engine == "spark" or is_dataset(path):
        return _engine_check(args, budget, out, err)
    trace = select_runs(event_table(path), args, path, err)
    warn_unreadable(trace, path, err)
    findings, totals = analyze_with_totals(trace)
    violations, _ = check(trace, budget, findings, totals)
    unfinished = trace.unfinished_runs()
    if not args.allow_partial:
        # A gate must not pass a run that crashed or a file that was cut: what is missing
        # could be exactly the copies over budget.
        if trace.bad_lines:
            violations.append(
                f"trace is partial: {trace.bad_lines} unreadable line(s) "
                "(a file cut mid-write); --allow-partial to check what was read"
            )
        if unfinished:
            violations.append(
                f"trace is partial: {len(unfinished)} process(es) never finished their trace "
                "(killed or still running); --allow-partial to check what was read"
            )
    if args.findings:
        out.write(format_findings(findings))
    return _verdict(violations, len(findings), totals[0], out, err)


def _verdict(violations: list[str], findings: int, steps: list, out: TextIO, err: TextIO) -> int:
    """Print the violations (stderr) and the one-line verdict (stdout); the exit status."""
    from copytrace._units import format_bytes_exact

    for line in violations:
        print(f"copytrace check: {line}", file=err)
    worst_bytes = max((t.bytes for t in steps), default=0)
    worst_copies = max((t.copies for t in steps), default=0)
    verdict = "FAILED" if violations else "OK"
    print(
        f"copytrace check: {verdict}: {len(violations)} violation(s); "
        f"{findings} finding(s); worst step {format_bytes_exact(worst_bytes)}, "
        f"{worst_copies} copies",
        file=out,
    )
    return EXIT_VIOLATION if violations else 0


def _engine_check(args: argparse.Namespace, budget: object, out: TextIO, err: TextIO) -> int:
    """``check`` on the SQL aggregates (``--engine spark``, or a dataset folder): the budget's
    limits and the hazards computed in SQL (a forbidden code that is not: exit 2 first)."""
    from copytrace._errors import CopytraceError
    from copytrace.cli._engine import (
        CHECK_QUERIES,
        engine_results,
        engine_violations,
        spark_forbid_error,
    )

    problem = spark_forbid_error(list(budget.forbid))  # type: ignore[attr-defined]
    if problem:
        raise CopytraceError(problem)
    res = engine_results(args, CHECK_QUERIES, err)
    violations, steps = engine_violations(res, budget)
    if args.findings:
        for code, _run, site, n, nbytes in res["hazards"]:
            out.write(f"{code} at {site}: {n} event(s), {nbytes} B\n")
    return _verdict(violations, len(res["hazards"]), steps, out, err)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``check`` subcommand to ``subparsers``.

    Args:
        subparsers: What ``ArgumentParser.add_subparsers()`` returned.

    Returns:
        The new subcommand parser.
    """
    parser = add_trace_command(
        subparsers,
        "check",
        __doc__,
        " Byte counts take K/M/G (x1000) or KiB/MiB/GiB (x1024). Hazard codes are listed"
        " in docs/hazards.md; underscores work for hyphens (data_inplace).",
    )
    parser.add_argument(
        "--max-bytes-per-step",
        type=_bytes,
        metavar="N",
        default=None,
        help="fail when a step allocates more than N bytes in copies",
    )
    parser.add_argument(
        "--max-copies-per-step",
        type=_count,
        metavar="N",
        default=None,
        help="fail when a step makes more than N copies",
    )
    parser.add_argument(
        "--max-bytes",
        type=_bytes,
        metavar="N",
        default=None,
        help="fail when the whole trace allocates more than N bytes in copies",
    )
    parser.add_argument(
        "--max-copies",
        type=_count,
        metavar="N",
        default=None,
        help="fail when the whole trace makes more than N copies",
    )
    parser.add_argument(
        "--forbid",
        metavar="CODES",
        default="",
        help="comma-separated hazard codes that fail the check "
        "(e.g. data-inplace,graph-retaining-copy; 'all' for every code)",
    )
    parser.add_argument(
        "--fail-on",
        metavar="SEVERITY",
        default=None,
        choices=("error", "warning", "info"),
        help="fail on any hazard of this severity or worse",
    )
    parser.add_argument(
        "--warmup-steps",
        type=_count,
        metavar="N",
        default=0,
        help="leave steps 0..N-1 out of the per-step limits (default 0)",
    )
    parser.add_argument("--findings", action="store_true", help="also print every hazard found")
    parser.add_argument(
        "--allow-partial",
        action="store_true",
        help="check a cut or unfinished trace as read (default: a partial trace fails)",
    )
    add_engine_options(parser)
    parser.set_defaults(handler=handle)
    return parser
