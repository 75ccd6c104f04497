"""Start a traced window in a running, armed process (``COPYTRACE_TRIGGER=signal``).

``copytrace trigger PID`` sends the process its trigger signal (``SIGUSR2`` unless it was
armed with another ``COPYTRACE_TRIGGER_SIGNAL``) and prints where its trace will be. The
process traces the next steps (``--steps N``, else its ``COPYTRACE_TRIGGER_STEPS``) from its
next step boundary, then flushes the trace and writes the report. ``--all-ranks`` signals
every armed process of PID's job (the same torchrun / copytrace launch). See
``docs/production.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

from copytrace._errors import CopytraceError

__all__ = ["register"]


def _armed(pid: int) -> dict[str, Any]:
    """The arm file of ``pid``.

    Raises:
        CopytraceError: no such process, or it is not armed by copytrace.
    """
    from copytrace.tracer._trigger import arm_file  # imports torch: not when the CLI starts

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        raise CopytraceError(f"no process {pid}") from None
    except PermissionError:
        pass
    try:
        info: dict[str, Any] = json.loads(arm_file(pid).read_text())
    except (OSError, ValueError):
        raise CopytraceError(
            f"process {pid} is not armed by copytrace (start it with COPYTRACE=1 "
            f"COPYTRACE_TRIGGER=signal, or copytrace.trace(trigger='signal'))"
        ) from None
    return info


def _job(info: dict[str, Any]) -> list[dict[str, Any]]:
    """Every armed process of the same job as ``info`` (itself included), by rank."""
    from copytrace.tracer._trigger import arm_dir

    launch = info.get("launch")
    found = [info]
    if not launch:
        return found
    for path in sorted(arm_dir().glob("*.json")):
        if path.name.endswith(".request.json"):
            continue
        try:
            other = json.loads(path.read_text())
            os.kill(int(other["pid"]), 0)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if other.get("launch") == launch and other["pid"] != info["pid"]:
            found.append(other)
    return sorted(found, key=lambda i: (str(i.get("rank") or ""), int(i["pid"])))


def handle(args: argparse.Namespace) -> int:
    from copytrace.tracer._trigger import request_file

    if args.steps is not None and args.steps < 1:
        raise CopytraceError(f"--steps must be >= 1, not {args.steps}")
    info = _armed(args.pid)
    targets = _job(info) if args.all_ranks else [info]
    for target in targets:
        pid = int(target["pid"])
        sig = getattr(signal, str(target["signal"]), None)
        if sig is None:
            raise CopytraceError(f"this platform has no {target['signal']}")
        if args.steps is not None:
            request_file(pid).write_text(json.dumps({"steps": args.steps}))
        os.kill(pid, sig)
        steps = args.steps or target.get("steps")
        where = target.get("trace") or str(Path(target["output_dir"]))
        rank = f" (rank {target['rank']})" if target.get("rank") is not None else ""
        print(f"process {pid}{rank}: tracing the next {steps} steps -> {where}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``trigger`` subcommand to ``subparsers``; returns its parser."""
    parser = subparsers.add_parser(
        "trigger", help=__doc__.splitlines()[0], description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("pid", type=int, metavar="PID", help="the armed process")
    parser.add_argument(
        "--steps", type=int, default=None, metavar="N",
        help="steps to trace (default: the process's COPYTRACE_TRIGGER_STEPS)",
    )  # fmt: skip
    parser.add_argument(
        "--all-ranks", action="store_true",
        help="signal every armed process of PID's job (torchrun ranks, the same launch)",
    )  # fmt: skip
    parser.set_defaults(handler=handle)
    return parser
