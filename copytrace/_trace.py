"""The public facade: ``copytrace.trace()`` and the :class:`Trace` it returns.

A :class:`Trace` is a recording :class:`~copytrace.tracer.session.Session` plus what is done
with its result: the hazards found when it stops (:mod:`copytrace.analysis`, handed to the
session as its ``find_hazards`` hook, as ``torch.profiler.profile`` takes
``on_trace_ready``), :meth:`Trace.report` (:mod:`copytrace.dashboards`) and the notebook
summary. The recording side imports none of them.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from copytrace._errors import CopytraceError
from copytrace.export._osthread import OsThread
from copytrace.tracer import CopyEvent, Schedule, Session

__all__ = ["Schedule", "Trace", "trace"]


def find_hazards(path: Path) -> list[dict[str, Any]]:
    """The ``find_hazards`` hook of a :class:`Trace`: the run's hazards, as plain dicts
    (``Finding.as_dict``), found over the closed trace file's columnar event table.

    Hazards need the whole run (hot loops, steps), so they are found after the last flush,
    on the export thread, at any size. The export then sends them to every sink as one more
    span, ``copytrace.hazards`` (a child of the run span), whose ``copytrace.hazard`` events
    carry code, severity, message, fix, call sites, bytes and the ids of the event spans
    involved: appended to the trace file, and exported to the OTLP / SDK exporters.
    """
    from copytrace.analysis import analyze
    from copytrace.tracefile import event_table

    return [f.as_dict() for f in analyze(event_table(path, cache=False))]


def _window_report(path: Path | None, window: tuple[int, int]) -> None:
    """The ``on_window`` hook of a :class:`Trace` (on the export thread, once a triggered
    window is in the trace file): write ``report.html`` beside the trace file, on a thread
    of its own, unless ``COPYTRACE_REPORT=0``. A rank of a distributed job (``RANK`` set,
    as torchrun does) writes ``report-rank<RANK>.html``: the ranks share the directory, and
    ``trigger --all-ranks`` ends their windows at the same time."""
    from copytrace import _env

    if path is None or not _env.setting(_env.COPYTRACE_REPORT):
        return
    rank = os.environ.get("RANK", "")
    name = f"report-rank{rank}.html" if rank.isdigit() else "report.html"

    def write() -> None:
        from copytrace.dashboards import write_report

        try:
            out = write_report(path, path.parent / name)
            print(f"copytrace: report of steps {window[0]}-{window[1] - 1}: {out}", file=sys.stderr)
        except Exception as err:
            print(f"copytrace: could not write the window's report: {err}", file=sys.stderr)

    # DuckDB's import registers an atexit hook after which a query that may run Python code
    # (a registered Arrow table, once pandas is loaded) is refused: imported now, before the
    # report's thread, with the wait for the reports registered after it, so that at exit
    # the reports finish before that hook runs (atexit runs the last registered first)
    import duckdb  # noqa: F401

    atexit.unregister(_wait_for_window_reports)
    atexit.register(_wait_for_window_reports)
    # a bare OS thread, which the program's threading module does not see (export/_osthread.py);
    # started and listed as one step: the wait (Trace.stop, atexit) runs on another thread
    # and must not miss one starting
    thread = OsThread(write, "copytrace-window-report", _report_failed)
    with _WINDOW_REPORTS_LOCK:
        if not thread.start():
            raise RuntimeError("no thread can start for the window's report (interpreter shutdown)")
        _WINDOW_REPORTS.append(thread)


def _report_failed(err: BaseException) -> None:
    print(f"copytrace: could not write the window's report: {err!r}", file=sys.stderr)


#: The window reports being written (:func:`_window_report`): :meth:`Trace.stop` waits for
#: them, so that a process that ends right after a window still writes its report.
_WINDOW_REPORTS: list[OsThread] = []
_WINDOW_REPORTS_LOCK = threading.RLock()


def _wait_for_window_reports() -> None:
    """Join the window reports still being written, at most ``COPYTRACE_REPORT_WAIT``
    seconds in all (a report left unfinished is said on stderr)."""
    import time

    from copytrace import _env

    try:
        wait = float(_env.setting(_env.COPYTRACE_REPORT_WAIT))
    except _env.SettingError:
        wait = _env.DEFAULT_REPORT_WAIT_S
    deadline = time.monotonic() + wait
    while True:
        with _WINDOW_REPORTS_LOCK:
            if not _WINDOW_REPORTS:
                return
            thread = _WINDOW_REPORTS.pop(0)
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            print(f"copytrace: a window's report was not written within {wait:g} s",
                  file=sys.stderr)  # fmt: skip


def _session_value(name: str, doc: str) -> property:
    """A read-only attribute of the trace that is its session's."""
    return property(lambda self: getattr(self.session, name), doc=doc)


class Trace(contextlib.ContextDecorator):
    """One tracing session: records every tensor copy and alias while it is active.

    Use it as a context manager (``with copytrace.trace() as t:``) or as a decorator. Inside,
    call :meth:`step` at each training step boundary; if it is never called, each
    ``optimizer.step()`` ends a step instead. On exit the trace is written to
    ``output_dir`` as OTLP/JSON lines (``docs/trace-format.md``).

    Only one trace records at a time in a process: entering a trace while another is active
    returns the active one (so a traced script run under ``COPYTRACE=1`` or
    ``copytrace run`` keeps working), and that inner exit does nothing.

    The records are turned into spans off the traced thread: at a step boundary once
    ``flush_events`` records are buffered or ``flush_seconds`` have passed (and at the end
    of each active window of a ``schedule``), the buffer is handed to the export thread,
    which writes the trace file and feeds any OpenTelemetry exporter; memory stays bounded
    on long runs. The rest is written when the trace stops: on a normal exit, an exception,
    ``sys.exit``, ``KeyboardInterrupt`` or ``SIGTERM`` (copytrace's handler writes the
    trace, then the process dies of the signal as it would have).

    Args:
        output_dir: directory for the trace file (and the default report); created on
            write. Default ``$COPYTRACE_OUTPUT``, else ``./copytrace-out``.
        write: write the trace file.
        max_events: cap on records buffered between two flushes; beyond it records are
            counted as dropped (``copytrace.events_dropped``), never buffered.
        auto_step: let ``optimizer.step()`` advance the step while :meth:`step` is unused.
        schedule: which steps are traced (:class:`Schedule`, ``torch.profiler.schedule``,
            a dict or ``"wait=1,warmup=1,active=3,repeat=2"``); default
            ``$COPYTRACE_SCHEDULE``, else every step.
        exporters: OpenTelemetry ``SpanExporter`` objects that also get the spans; default:
            those named by ``$OTEL_TRACES_EXPORTER`` (``otlp``, ``console``).
        tracer_provider: send the spans through this ``TracerProvider`` instead of
            copytrace's own (its processors, sampler and limits apply; it is never replaced
            or shut down).
        compression: ``"gzip"`` (the default, ``$COPYTRACE_COMPRESSION``) or ``"none"``.
        flush_events: flush at the first step boundary with this many records buffered,
            and within a step once it holds 4 times this many (default 4096,
            ``$COPYTRACE_FLUSH_EVENTS``; 0: only when the trace stops).
        flush_seconds: also flush at a step boundary this long after the last flush
            (default 5, ``$COPYTRACE_FLUSH_SECONDS``); copytrace's own set-up (installing
            its modes and hooks) is not counted.
        level: one of ``copytrace._env.LEVELS`` (default ``"lean"``, ``$COPYTRACE_LEVEL``);
            see :func:`trace`.
        observer: one of ``copytrace._env.OBSERVERS`` (default ``"auto"``,
            ``$COPYTRACE_OBSERVER``): ``"auto"``/``"native"`` copytrace's C++ observer where it
            can be built, ``"python"`` the Python dispatch mode.
        trigger: ``"signal"``: armed and idle, nothing installed per op, until
            ``$COPYTRACE_TRIGGER_SIGNAL`` (``SIGUSR2``) arrives; then the next
            ``trigger_steps`` steps (default ``$COPYTRACE_TRIGGER_STEPS``, 10) are traced from
            the next step boundary, flushed, and the report written (``docs/production.md``).
            Default ``$COPYTRACE_TRIGGER``, else ``"none"`` (trace from the start). It
            replaces ``schedule``.
        ring: the flight recorder: keep only the last ``ring`` records (default
            ``$COPYTRACE_RING``, else 0: off), written with the run span when the run ends
            (an exception, SIGTERM, or its end) and on ``$COPYTRACE_RING_SIGNAL``
            (``SIGUSR1``) into a file of their own (``docs/production.md``).

    Options left as None take their ``COPYTRACE_*`` variable (parsed by
    :mod:`copytrace._env`); a value not accepted, given or from the variable, raises
    ``copytrace.SettingError`` (``max_events``, ``flush_events``, ``ring``: whole numbers
    >= 0; ``trigger_steps`` >= 1; ``flush_seconds``: seconds >= 0).

    ``OTEL_TRACES_SAMPLER`` (or the given provider's sampler) decides once per run: a run
    sampled out is not traced at all.

    Attributes:
        session: the recording :class:`~copytrace.tracer.session.Session`.

    Known limitations:
        torch's mode stacks are thread-local: copies made on threads other than the one that
        entered the trace (and not by autograd's engine on its behalf) are not seen.
        ``torch.compile``d regions run compiled and are not traced op by op: each call is a
        ``copytrace.compiled`` span, and the copies their graphs contain are listed (found in
        the graphs, not observed).
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str] | None = None,
        *,
        write: bool = True,
        max_events: int = 1_000_000,
        auto_step: bool = True,
        schedule: Any = None,
        exporters: Sequence[Any] | None = None,
        tracer_provider: Any = None,
        compression: str | None = None,
        flush_events: int | None = None,
        flush_seconds: float | None = None,
        level: str | None = None,
        observer: str | None = None,
        trigger: str | None = None,
        trigger_steps: int | None = None,
        ring: int | None = None,
    ) -> None:
        self.session = Session(
            output_dir, write=write, max_events=max_events, auto_step=auto_step,
            schedule=schedule, exporters=exporters, tracer_provider=tracer_provider,
            compression=compression, flush_events=flush_events, flush_seconds=flush_seconds,
            level=level, observer=observer, find_hazards=find_hazards, trigger=trigger,
            trigger_steps=trigger_steps, ring=ring, on_window=_window_report,
        )  # fmt: skip
        self.session.owner = self

    output_dir = _session_value("output_dir", "Directory of the trace file.")
    write = _session_value("write", "The trace file is written.")
    level = _session_value("level", "``lean``, ``full`` or ``api`` (see :func:`trace`).")
    observer = _session_value("observer", "``auto``, ``native`` or ``python``.")
    schedule = _session_value("schedule", "Which steps are traced (None: every step).")
    compression = _session_value("compression", "``gzip`` or None.")
    flush_events = _session_value("flush_events", "Records buffered before a flush.")
    flush_seconds = _session_value("flush_seconds", "Seconds between flushes at most.")
    sampled = _session_value("sampled", "False when the run was sampled out.")
    running = _session_value("running", "Between :meth:`start` and :meth:`stop`.")
    trace_path = _session_value("trace_path", "The trace file once written, else None.")
    observer_path = _session_value(
        "observer_path",
        '``"native"`` (the C++ observer) or ``"python"`` once tracing started; ``None`` before.',
    )

    @property
    def _delegate(self) -> Trace | None:
        """The active trace this one hands over to (entered while that one records)."""
        target = self.session._delegate
        return None if target is None else (target.owner or target)

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> Trace:
        """Install the modes, hooks and patches; return the trace that records.

        Returns:
            ``self``, or the already active trace when another one is recording.

        Raises:
            CopytraceError: The trace file is to be written and ``output_dir`` cannot be
                created or written to (checked here, as ``copytrace run`` does, so that
                nothing recorded is lost at exit).
        """
        from copytrace import _env, _envcheck
        from copytrace.tracer.session import active_session

        if not os.environ.get(_env.COPYTRACE_LAUNCH):  # a launch's root has said it
            _envcheck.warn_unknown()
        if self.session.write and not self.running and active_session() is None:
            problem = _env.unwritable(self.session.output_dir)
            if problem:
                raise CopytraceError(problem)
        active = self.session.start()
        return self if active is self.session else (active.owner or active)

    def stop(self) -> Path | None:
        """Remove everything :meth:`start` installed and write the rest of the trace.

        Returns:
            The trace file written, or ``None`` (``write=False``, sampled out, or a
            delegating inner trace). A failure to write is reported on stderr, never raised.
        """
        path = self.session.stop()
        _wait_for_window_reports()
        return path

    def note_exit(self, exc_type: Any, exc: Any) -> None:
        """Record how the traced program ended (``copytrace.exit``) before :meth:`stop`:
        ``exc_type`` / ``exc`` of the exception it raised, or None for a normal end."""
        self.session.note_exit(exc_type, exc)

    def __enter__(self) -> Trace:
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.note_exit(exc_type, exc)
        self.stop()

    # -- during tracing ---------------------------------------------------------------------------
    def step(self) -> int:
        """Mark a training step boundary; return the new step number (the first step is 0).

        Calling it turns off the automatic step on ``optimizer.step()``.
        """
        return self.session.step()

    @property
    def events(self) -> list[CopyEvent]:
        """The events recorded and not yet flushed to the exporters (a copy of the list),
        oldest first: all of them unless a long run flushed some (``flush_events``); the
        trace file has every one."""
        return self.session.events

    @property
    def first_error(self) -> str | None:
        """The traceback (text) of the first internal error copytrace counted and swallowed
        while tracing (``stats["errors"]`` counts them all), or None."""
        return self.session._target()._rec.first_error

    @property
    def stats(self) -> dict[str, int]:
        """Counters: ``events`` (recorded in traced steps, flushed or not), ``dropped``,
        ``errors``, ``internal_detaches``, ``steps``, ``steps_traced``, ``discarded`` (warmup
        records), ``flushes``."""
        return self.session.stats

    # -- output -----------------------------------------------------------------------------------
    def export(self, exporter: Any = None) -> Path | None:
        """Write the buffered events (:attr:`events`) as spans, all at once.

        For a trace that did not write its own file (``write=False``), or to send it to one
        more exporter afterwards.

        Args:
            exporter: an OpenTelemetry ``SpanExporter``; default: the trace file
                ``<output_dir>/copytrace-<host>-<pid>.otlp.jsonl[.gz]`` (replaced if present;
                a trace that writes its own file just returns it).

        Returns:
            The file written, or ``None`` for a caller-supplied exporter.
        """
        return self.session.export(exporter)

    def report(
        self, path: str | os.PathLike[str] | None = None, *, display: bool | None = None
    ) -> Path:
        """Write the interactive HTML report of this trace.

        Args:
            path: the HTML file; default ``<output_dir>/report.html``.
            display: also show the report in the notebook's output (default: when running
                in a Jupyter kernel).

        Returns:
            The report path.

        Raises:
            CopytraceError: The trace is still running, has not started, or it wrote no file
                and some of its events went to exporters only (``write=False`` with
                ``flush_events``).
        """
        import tempfile

        from copytrace.dashboards import _notebook, write_report

        target = self._delegate or self
        if target.running:
            raise CopytraceError("the trace is still running: call report() after the with block")
        out = Path(path) if path is not None else target.output_dir / "report.html"
        if target.trace_path is not None:
            written = write_report(target.trace_path, out)
        elif not target.session._start_ns:
            raise CopytraceError("the trace has not been written yet: nothing was traced")
        elif target.stats.get("flushes"):
            raise CopytraceError(
                "the trace wrote no file and flushed events to its exporters: "
                "trace with write=True (or flush_events=0) to report it"
            )
        else:  # write=False: the events are all in memory; report them from a scratch file
            with tempfile.TemporaryDirectory(prefix="copytrace-report-") as scratch:
                trace_file = target.session.export(directory=Path(scratch))
                written = write_report(trace_file, out)
        if display or (display is None and _notebook.in_notebook()):
            _notebook.display_report(written)
        return written

    # -- rich output in notebooks (the summary; see copytrace.dashboards._notebook) ------------
    def _repr_html_(self) -> str:
        from copytrace.dashboards._notebook import trace_summary_html

        return trace_summary_html(self)

    def _repr_markdown_(self) -> str:
        from copytrace.dashboards._notebook import trace_summary_markdown

        return trace_summary_markdown(self)


def trace(output_dir: str | os.PathLike[str] | None = None, **options: Any) -> Trace:
    """Create a :class:`Trace`; use it as ``with copytrace.trace() as t:``.

    Args:
        output_dir: where the trace file goes (default ``./copytrace-out``, or
            ``$COPYTRACE_OUTPUT``).
        **options: keyword options of :class:`Trace`:
        write: write the OTLP/JSON-lines trace file.
        max_events: cap on records buffered between flushes (beyond it they are counted as
            dropped).
        auto_step: advance the step on each ``optimizer.step()`` until ``t.step()`` is called.
        schedule, exporters, tracer_provider, compression, flush_events, flush_seconds: see
            :class:`Trace`.
        level: ``"lean"`` (default, or ``$COPYTRACE_LEVEL``): every API and aten copy with no
            Python mode on the hot path (C wrappers on the copying API; writes into a ``.data``
            alias of a tensor that requires grad or an advanced-indexing result are seen by a
            RecordFunction callback of the C++ observer while one is alive: no mode ever);
            needs the C++ observer, else as ``"full"``. ``"full"``: the same events with
            copytrace's function mode always on the stack. ``"api"``: the function mode only,
            but no implicit copies (backward, autocast, composites), no aten op names, no count
            of autograd's internal detaches and no ``data-inplace`` hazard.

    Returns:
        An unstarted :class:`Trace`.

    Raises:
        SettingError: (a ``CopytraceError`` and ``ValueError``) an option, or the
            ``COPYTRACE_*`` variable an option left as None falls back to, holds a value
            not accepted (an unknown ``level``, ``compression`` or ``schedule`` field).
        TypeError: an unknown option.
    """
    return Trace(output_dir, **options)
