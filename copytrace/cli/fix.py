"""Propose the code change for each finding that has a mechanical fix, as a unified diff.

Usage::

    copytrace fix TRACE [--code CODES] [--apply] [--verify -- python train.py args...]
    copytrace fix TRACE > fix.diff && git apply fix.diff      (or: patch -p1 < fix.diff)

The diff goes to stdout, each hunk under a ``# copytrace fix:`` line that gives its reason;
each finding without a safe fix follows as a ``# no patch:`` line with its advice.

``--apply`` writes the patched files in place. ``--verify`` checks the patch first: it copies
the current directory twice into a scratch folder, patches one copy, runs the program traced
in each (``copytrace run``), and says for each patched finding whether it was there before
and is gone after, whether the program's stdout and exit status stayed the same, and the
bytes copied per step before and after; it exits 1 unless all of that holds. Your files are
written only with ``--apply``. Files outside the current directory, in installed packages or
in the standard library are never touched. See docs/fix.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO

from copytrace.cli._common import add_trace_command, select_runs, warn_unreadable

__all__ = ["register", "handle", "patch_commands", "suggest"]


def suggest(path: str, codes: list[str]) -> str:
    """The command that prints the patch for ``codes`` of the trace ``path``."""
    from copytrace.fixes import FIXES

    fixable = [c for c in codes if c in FIXES]
    return f"copytrace fix {path} --code {','.join(fixable)}" if fixable else ""


def patch_commands(path: str, findings: list[Any], source: Any) -> dict[int, str]:
    """``id(finding) -> the copytrace fix command that prints its patch``, for each finding
    that gets one from the current directory (the files it names are here, inside it, and
    the rule does not refuse); planned once (:func:`copytrace.fixes.plan_findings`)."""
    from copytrace.fixes import FIXES, plan_findings

    if not any(f.code in FIXES for f in findings):
        return {}
    plan = plan_findings(findings, source)
    return {id(f.finding): suggest(path, [f.finding.code]) for f in plan.fixes}


def handle(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Plan the fixes, print the diff, and apply and/or verify them.

    Returns:
        0, or 1 when ``--verify`` cannot confirm the patch (:attr:`Verification.ok`).

    Raises:
        TraceFileError: If the trace path is missing, empty or unreadable.
        CopytraceError: For an unknown hazard code, or ``--verify`` without a program.
    """
    from copytrace._errors import CopytraceError
    from copytrace.fixes import apply_plan, format_diff, format_unfixed, plan_fixes
    from copytrace.fixes._verify import program_args, verify_plan
    from copytrace.tracefile import event_table

    out = out or sys.stdout
    err = err or sys.stderr
    command = list(getattr(args, "program", None) or [])
    if command and not args.verify:
        raise CopytraceError("a program after -- is only used with --verify")
    if args.verify:
        try:
            program_args(command)
        except ValueError as e:
            raise CopytraceError(str(e)) from None
    path = Path(args.path)
    trace = select_runs(event_table(path), args, path, err)
    warn_unreadable(trace, path, err)
    try:
        plan = plan_fixes(trace, codes=args.code)
    except ValueError as e:
        raise CopytraceError(str(e)) from None
    out.write(format_diff(plan))
    out.write(format_unfixed(plan))
    patches = len({(f.rel, f.line, f.finding.code) for f in plan.fixes})
    print(f"copytrace fix: {patches} patch(es) in {len(plan.files)} file(s); "
          f"{len(plan.unfixed)} finding(s) without a safe fix", file=err)  # fmt: skip
    status = 0
    if args.verify and not plan.fixes:
        print("copytrace fix --verify: no patch to check; the program was not run", file=err)
    elif args.verify:
        result = verify_plan(plan, command, timeout=args.timeout)
        for line in result.lines():
            print(f"copytrace fix --verify: {line}", file=err)
        if result.stdout_diff:
            err.write(result.stdout_diff)
        status = 0 if result.ok else 1
    if args.apply:
        for written in apply_plan(plan):
            print(f"copytrace fix: wrote {written}", file=err)
    return status


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``fix`` subcommand to ``subparsers``."""
    parser = add_trace_command(
        subparsers,
        "fix",
        __doc__,
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--code", metavar="CODES", default=None,
        help="only these hazard codes (comma-separated; underscores work for hyphens)",
    )  # fmt: skip
    parser.add_argument("--apply", action="store_true", help="write the patched files in place")
    parser.add_argument(
        "--verify", action="store_true",
        help="trace the program given after -- (python train.py [args]) before and after "
        "the patch, in scratch copies of the current directory",
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=float, default=None, metavar="S",
        help="seconds allowed to each --verify run (default: none)",
    )  # fmt: skip
    parser.set_defaults(handler=handle)
    return parser
