"""The launch's finishing report: written by the root once every process is done, or right
after SIGTERM when it fits in the grace period before a kill.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from copytrace.launch._state import S, warn
from copytrace.launch.markers import (
    is_trace_file,
    launch_dir,
    launch_trace_files,
    mark,
    remove_launch_dir,
    wait_for_launch,
)

__all__ = ["register_signal_hook", "write_launch_report", "write_report_for"]

# --- a fatal signal (SIGTERM) ------------------------------------------------------------------
#: The shortest common grace period between SIGTERM and SIGKILL (``docker stop``: 10 s;
#: Kubernetes: 30 s): the report is written after SIGTERM only when it fits in it.
_SIGNAL_GRACE_S = 10.0
#: Measured cost of writing a report (2 shared CPU cores): about 1.1 s to import the
#: report code, then about 0.5 ms per event (3.8 s for 7120 events); with a margin.
_REPORT_FIXED_S = 1.5
_REPORT_PER_EVENT_S = 0.0007


def register_signal_hook() -> None:
    from copytrace.tracer import _process

    if _on_signal not in _process.SIGNAL_HOOKS:
        _process.SIGNAL_HOOKS.append(_on_signal)


def _on_signal(signum: int, arrived: float) -> None:
    """After the trace was written on a fatal signal: mark this process done and, as the
    root, write the report if it fits in the grace period (else say how to build it);
    never leave the launch directory behind."""
    if not S.active or S.finished:
        return
    S.finished = True
    import signal as _signal

    session, S.session = S.session, None
    path = getattr(session, "trace_path", None)
    mark("done", str(path) if path is not None else "")
    directory = launch_dir()
    if not (S.root and S.report) or directory is None or S.out is None:
        return
    name = _signal.Signals(signum).name
    try:
        events = int(session.stats["events"]) if session is not None else 0
    except Exception:
        events = 0
    estimate = _REPORT_FIXED_S + events * _REPORT_PER_EVENT_S
    left = _SIGNAL_GRACE_S - (time.monotonic() - arrived)
    report = None
    if estimate <= left:
        try:
            report = write_launch_report(0.0)
        except Exception as err:
            warn(f"could not write the report after {name}: {type(err).__name__}: {err}")
    else:
        warn(
            f"report not written after {name} (about {estimate:.0f} s for {events} events, "
            f"{max(left, 0):.0f} s left before a kill is likely); build it with: "
            f"copytrace report {S.out}"
        )
    remove_launch_dir(directory)
    if report is not None:
        warn(f"trace {path}; report {report}" if path is not None else f"report {report}")



def write_launch_report(wait_s: float | None) -> Path | None:
    from copytrace import _env

    directory = launch_dir()
    if directory is None or S.out is None:
        return None
    if not directory.is_dir():
        return None  # no process of this launch traced anything
    if wait_s is None:
        try:
            wait_s = float(_env.setting(_env.COPYTRACE_REPORT_WAIT))
        except _env.SettingError as err:  # checked at start; the program may have changed it
            warn(str(err))
            wait_s = _env.DEFAULT_REPORT_WAIT_S
    found = wait_for_launch(directory, wait_s)
    out = S.out
    files = launch_trace_files(out, found)
    traces = [f for f in files if is_trace_file(f.name)]
    report = out / "report.html"
    if traces:
        write_report_for(out, files, report)
    remove_launch_dir(directory)
    return report if traces else None



def write_report_for(out: Path, files: list[Path], report: Path) -> Path:
    """Write ``report`` from exactly ``files`` (traces and py-spy profiles) of ``out``.

    When ``out`` holds no other trace file the directory itself is reported; otherwise the
    files are linked into a temporary directory first, so that traces from earlier runs are
    left out, and the report names the real files.
    """
    from copytrace.dashboards import build_model, render_html, write_report
    from copytrace.tracefile import event_table

    chosen = {f.resolve() for f in files}
    others = [
        e
        for e in out.iterdir()
        if e.is_file() and is_trace_file(e.name) and e.resolve() not in chosen
    ]
    if not others:
        return write_report(out, report)
    import shutil
    import tempfile

    warn(
        f"{len(others)} trace file(s) in {out} are from other runs and are left out of "
        f"{report.name} (copytrace report {out} --all merges them)"
    )
    with tempfile.TemporaryDirectory(prefix=".copytrace-report-", dir=out) as tmp:
        real: dict[str, Path] = {}
        for f in files:
            link = Path(tmp) / f.name
            real[str(link)] = f
            try:
                os.symlink(f.resolve(), link)
            except OSError:
                shutil.copyfile(f, link)
        trace = event_table(tmp, cache=False)
        trace.files = [Path(real.get(str(f), f)) for f in trace.files]
        for part in trace.parts:  # the report names the real files
            part.path = Path(real.get(str(part.path), part.path))
        return render_html(build_model(trace), report)


