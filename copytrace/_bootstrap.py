"""Start-up hook for ``COPYTRACE=1``: imported by ``copytrace_hook.pth`` only when the
variable is set. Starts a trace for the whole process and writes the trace (and, by
default, the report) at exit. Never raises: a failure prints one warning and the program
runs untraced.
"""

from __future__ import annotations

import atexit
import os
import sys

_session = None


def _finish() -> None:
    global _session
    session, _session = _session, None
    if session is None:
        return
    try:
        path = session.stop()
        from copytrace import _env

        if path is not None and _env.flag(_env.COPYTRACE_REPORT, True):
            from copytrace.dashboards import write_report

            out = write_report(session.output_dir, session.output_dir / "report.html")
            print(f"copytrace: trace {path}; report {out}", file=sys.stderr)
        elif path is not None:
            print(f"copytrace: trace {path}", file=sys.stderr)
    except Exception as err:  # never break the program's exit
        print(f"copytrace: could not finish the trace: {err}", file=sys.stderr)


def start() -> None:
    """Start tracing this process (idempotent)."""
    global _session
    if _session is not None:
        return
    try:
        from copytrace import _env
        from copytrace.tracer import Trace

        max_events = int(os.environ.get(_env.COPYTRACE_MAX_EVENTS) or 1_000_000)
        _session = Trace(_env.output_dir(), max_events=max_events).start()
        atexit.register(_finish)
    except Exception as err:
        _session = None
        print(f"copytrace: tracing disabled, start-up failed: {err}", file=sys.stderr)


try:
    from copytrace import _env as _e

    if _e.enabled():
        start()
except Exception as _err:  # pragma: no cover - the hook must never break start-up
    print(f"copytrace: tracing disabled: {_err}", file=sys.stderr)
