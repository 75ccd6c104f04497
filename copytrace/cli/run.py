"""Run a Python script or module traced, then write the trace and the HTML report.

Usage: ``copytrace run [-o DIR] [--no-report] script.py [args...]`` or
``copytrace run [-o DIR] -m package.module [args...]``. The program sees its own
``sys.argv``; its exit status is passed through.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path
from typing import Any

from copytrace import _env
from copytrace._errors import CopytraceError


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "run",
        help="run a script (or -m module) traced and write the trace and report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-o", "--output", default=None,
        help=f"output directory (default: ${_env.COPYTRACE_OUTPUT} or ./{_env.DEFAULT_OUTPUT_DIR})",
    )  # fmt: skip
    parser.add_argument("--no-report", action="store_true", help="write the trace only")
    parser.add_argument(
        "-m", dest="module", action="store_true", help="run a module, like python -m"
    )
    parser.add_argument("target", help="the script to run (or the module, with -m)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the program")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from copytrace.tracer import Trace

    out_dir = Path(args.output or _env.output_dir())
    target = args.target
    if not args.module:
        script = Path(target)
        if not script.is_file():
            raise CopytraceError(f"no such script: {target}")
    argv = [target, *args.args]
    saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
    sys.argv = argv
    if args.module:
        sys.path.insert(0, os.getcwd())
    else:
        sys.path.insert(0, str(Path(target).resolve().parent))
    status = 0
    session = Trace(out_dir)
    try:
        with session:
            try:
                if args.module:
                    runpy.run_module(target, run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(target, run_name="__main__")
            except SystemExit as exc:
                status = _exit_status(exc.code)
    except ImportError as err:
        if args.module and getattr(err, "name", None) == target:
            raise CopytraceError(f"no module named {target}") from None
        raise
    finally:
        sys.argv = saved_argv
        if sys.path and saved_path0 is not None and sys.path[0] != saved_path0:
            sys.path.pop(0)
    trace_path = session.trace_path
    if trace_path is None:
        print("copytrace: no trace written", file=sys.stderr)
        return status or 1
    stats = session.stats
    print(
        f"copytrace: {stats['events']} events in {stats['steps']} steps -> {trace_path}",
        file=sys.stderr,
    )
    if not args.no_report:
        from copytrace.dashboards import write_report

        report = write_report(out_dir, out_dir / "report.html")
        print(f"copytrace: report written to {report}", file=sys.stderr)
    return status


def _exit_status(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
