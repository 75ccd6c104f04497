"""Check a trace against copy budgets and forbidden hazards; exit 1 on any violation."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO

from copytrace.cli._common import add_trace_command, select_runs, warn_unreadable
from copytrace.cli._engine import add_engine_options, is_dataset
from copytrace.cli.fix import suggest

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

    With ``--baseline BASE`` the run is also compared with BASE (``copytrace diff``) and
    fails when its per-step copies or bytes grew beyond ``--max-increase`` or a new hazard
    code appeared (:func:`copytrace.analysis.diff.gate`).

    Raises:
        TraceFileError: If a trace path is missing, empty or unreadable.
        CopytraceError: For an unknown hazard code or severity, or a bad ``--max-increase``.
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
    limit = _increase(args)
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
    if not args.allow_partial:
        violations += _partial(trace)
    if args.baseline is not None:
        violations += _against_baseline(args, trace, limit, err)
    patches = _patches(args, findings, trace)
    if args.findings:
        out.write(format_findings(findings, notes=[patches.get(id(f), "") for f in findings]))
    status = _verdict(_with_patches(violations, findings, patches), len(findings), totals[0],
                      out, err)  # fmt: skip
    if patches:
        codes = sorted({f.code for f in findings if id(f) in patches})
        command = suggest(str(args.path), codes)
        print(f"copytrace check: patches for some findings: {command}", file=out)
    return status


def _patches(args: argparse.Namespace, findings: list[Any], trace: Any) -> dict[int, str]:
    """``id(finding) -> "patch: copytrace fix TRACE --code CODE"`` for each finding that has a
    mechanical patch (``copytrace fix``). Without a finding whose first call site is a file
    here, none has (``copytrace.fixes`` plans a patch only in such a file): libcst is then
    not imported (about 0.3 s)."""
    import re

    from copytrace.cli.fix import patch_commands

    site = re.compile(r"^(?P<file>.+):(?P<line>\d+)(?: .*)?$")  # as copytrace.fixes reads it
    pins = {m["file"] for f in findings if f.call_sites
            for m in [site.match(f.call_sites[0])] if m}  # fmt: skip
    if not any(Path(p).is_file() for p in pins):
        return {}
    return {k: f"patch: {v}" for k, v in patch_commands(str(args.path), findings, trace).items()}


def _with_patches(violations: list[str], findings: list[Any], patches: dict[int, str]) -> list[str]:
    """The violations, each forbidden hazard that has a patch followed by its command."""
    if not patches:
        return violations
    out = []
    for line in violations:
        out.append(line)
        for f in findings:  # the line of a forbidden finding (copytrace.analysis.check_budget)
            if id(f) in patches and line.startswith(f"forbidden hazard {f.code} ({f.severity}) "
                                                    f"at {', '.join(f.call_sites[:3])}: "):
                out.append(f"  {patches[id(f)]}")
                break
    return out


def _verdict(violations: list[str], findings: int, steps: list, out: TextIO, err: TextIO) -> int:
    """Print the violations (stderr) and the one-line verdict (stdout); the exit status.
    A line starting with two spaces belongs to the violation above it (not counted)."""
    from copytrace._units import format_bytes_exact

    for line in violations:
        print(f"copytrace check: {line}", file=err)
    violations = [v for v in violations if not v.startswith("  ")]
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


def _partial(trace: Any) -> list[str]:
    """The violations of a cut file or an unfinished process. A gate must not pass a run that
    crashed or a file that was cut: what is missing could be exactly the copies over budget."""
    lines = []
    if trace.bad_lines:
        lines.append(
            f"trace is partial: {trace.bad_lines} unreadable line(s) "
            "(a file cut mid-write); --allow-partial to check what was read"
        )
    unfinished = trace.unfinished_runs()
    if unfinished:
        lines.append(
            f"trace is partial: {len(unfinished)} process(es) never finished their trace "
            "(killed or still running); --allow-partial to check what was read"
        )
    return lines


def _increase(args: argparse.Namespace) -> Any:
    """``--max-increase`` parsed (checked before any trace is read).

    Raises:
        CopytraceError: For a value that is neither a share nor a size, or one given
            without ``--baseline``.
    """
    from copytrace._errors import CopytraceError

    if args.max_increase is not None and args.baseline is None:
        raise CopytraceError("--max-increase needs --baseline BASE")
    if args.baseline is None:
        return None  # no gate (and copytrace.analysis.diff not imported)
    from copytrace.analysis.diff import parse_increase

    try:
        return parse_increase(args.max_increase or "0%")
    except ValueError as e:
        raise CopytraceError(f"--max-increase: {e}") from None


def _against_baseline(args: argparse.Namespace, trace: Any, limit: Any, err: TextIO) -> list[str]:
    """The gate's lines for the run checked against ``--baseline`` (see ``docs/diff.md``)."""
    from copytrace.analysis.diff import compare, gate, load_run
    from copytrace.cli.diff import load_side

    base = load_side(args.baseline, args.baseline_run, err)
    new = load_run(trace, str(args.path))
    return [f"baseline {args.baseline}: {line}" for line in gate(compare(base, new), limit)]


def _engine_check(args: argparse.Namespace, budget: object, out: TextIO, err: TextIO) -> int:
    """``check`` on the SQL aggregates (``--engine spark``, or a dataset folder): the budget's
    limits and the hazards, every rule computed in SQL."""
    from copytrace.cli._engine import CHECK_QUERIES, engine_results, engine_violations

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
    _add_baseline_options(parser)
    parser.add_argument("--findings", action="store_true", help="also print every hazard found")
    parser.add_argument(
        "--allow-partial",
        action="store_true",
        help="check a cut or unfinished trace as read (default: a partial trace fails)",
    )
    add_engine_options(parser)
    parser.set_defaults(handler=handle)
    return parser


def _add_baseline_options(parser: argparse.ArgumentParser) -> None:
    """``--baseline``, ``--baseline-run`` and ``--max-increase`` (docs/diff.md)."""
    parser.add_argument(
        "--baseline",
        metavar="BASE",
        default=None,
        help="also fail when copies or bytes per step grew beyond --max-increase against the "
        "run in BASE (a trace file or directory), or a hazard code BASE did not show appeared; "
        "one line per call site that grew (docs/diff.md)",
    )
    parser.add_argument(
        "--baseline-run", type=_count, metavar="N", default=None,
        help="run N of BASE (default: its latest)",
    )  # fmt: skip
    parser.add_argument(
        "--max-increase",
        metavar="LIMIT",
        default=None,
        help="with --baseline: allowed growth per step, a share (10%%: copies and bytes) or a "
        "size (64KiB: bytes); default 0%%",
    )
