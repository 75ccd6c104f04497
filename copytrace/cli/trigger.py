"""Start a traced window in a running, armed process (``COPYTRACE_TRIGGER=signal``).

``copytrace trigger PID`` sends the process its trigger signal (``SIGUSR2`` unless it was
armed with another ``COPYTRACE_TRIGGER_SIGNAL``) and prints where its trace will be. The
process traces the next steps (``--steps N``, else its ``COPYTRACE_TRIGGER_STEPS``) from its
next step boundary, then flushes the trace and writes the report. ``--all-ranks`` signals
every armed process of PID's job (the same torchrun / copytrace launch); PID may be the
launcher itself (torchrun's pid), which is not traced. See ``docs/production.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

from copytrace._armfile import arm_dir, arm_file, request_file, start_time
from copytrace._errors import CopytraceError

__all__ = ["register"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _read_arm(path: Path) -> dict[str, Any] | None:
    """The arm file at ``path`` if its process still runs: alive, and started when the file
    says (an arm file left by a killed process names a pid another process may now have:
    signalling that one would kill it); else None."""
    try:
        info: dict[str, Any] = json.loads(path.read_text())
        pid = int(info["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not _alive(pid):
        return None
    start = start_time(pid)
    if info.get("start") is not None and start is not None and start != info["start"]:
        return None
    return info


def _all_armed() -> list[dict[str, Any]]:
    """The arm files of every living armed process."""
    paths = sorted(arm_dir().glob("*.json"))
    found = [_read_arm(p) for p in paths if not p.name.endswith(".request.json")]
    return [info for info in found if info is not None]


def _by_rank(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(found, key=lambda i: (str(i.get("rank") or ""), int(i["pid"])))


def _under(pid: int) -> list[dict[str, Any]]:
    """The armed processes started under ``pid``, a launcher that is not armed itself: its
    children, and the processes of the launch it is the root of (a launch id starts with
    its root's pid, :func:`copytrace.launch.activate`), by rank."""
    return _by_rank(
        [
            info
            for info in _all_armed()
            if info.get("ppid") == pid or str(info.get("launch") or "").startswith(f"{pid}-")
        ]
    )


def _targets(pid: int, all_ranks: bool) -> list[dict[str, Any]]:
    """The arm files of the processes to signal: ``pid``, or with ``all_ranks`` every armed
    process of its job (the same launch or torchrun run), or of the job it launched.

    Raises:
        CopytraceError: no such process, or neither it nor (with ``all_ranks``) a process
            under it is armed by copytrace.
    """
    if not _alive(pid):
        raise CopytraceError(f"no process {pid}")
    info = _read_arm(arm_file(pid))
    if info is None:
        under = _under(pid)
        if under and all_ranks:
            return under
        if under:
            raise CopytraceError(
                f"process {pid} is not armed by copytrace; {len(under)} armed processes run "
                f"under it: use --all-ranks to signal them all"
            )
        raise CopytraceError(
            f"process {pid} is not armed by copytrace (start it with COPYTRACE=1 "
            f"COPYTRACE_TRIGGER=signal, or copytrace.trace(trigger='signal'))"
        )
    launch = info.get("launch")
    if not all_ranks or not launch:
        return [info]
    job = [o for o in _all_armed() if o.get("launch") == launch and o["pid"] != info["pid"]]
    return _by_rank([info, *job])


def handle(args: argparse.Namespace) -> int:
    if args.steps is not None and args.steps < 1:
        raise CopytraceError(f"--steps must be >= 1, not {args.steps}")
    targets = _targets(args.pid, args.all_ranks)
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


def _pid(text: str) -> int:
    """A process id as argparse's type: a positive integer (``os.kill`` reads 0 and a
    negative number as process groups).

    Raises:
        argparse.ArgumentTypeError: for anything else (argparse prints it on one line, exit 2).
    """
    try:
        pid = int(text)
    except ValueError:
        pid = 0
    if pid <= 0:
        raise argparse.ArgumentTypeError(f"not a process id: {text!r}")
    return pid


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``trigger`` subcommand to ``subparsers``; returns its parser."""
    parser = subparsers.add_parser(
        "trigger", help="start a traced window in a running, armed process "
        "(COPYTRACE_TRIGGER=signal)", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("pid", type=_pid, metavar="PID", help="the armed process")
    parser.add_argument(
        "--steps", type=int, default=None, metavar="N",
        help="steps to trace (default: the process's COPYTRACE_TRIGGER_STEPS)",
    )  # fmt: skip
    parser.add_argument(
        "--all-ranks", action="store_true",
        help="signal every armed process of PID's job (torchrun ranks, the same launch); "
        "PID may be the launcher (torchrun) itself",
    )  # fmt: skip
    parser.set_defaults(handler=handle)
    return parser
