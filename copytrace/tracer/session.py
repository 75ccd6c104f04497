"""The recording session: start, step, stop; a context manager and a decorator.

A :class:`Session` records every tensor copy and alias on the thread that starts it, from
:meth:`Session.start` to :meth:`Session.stop`, and streams the records to the export thread
(the trace file, OpenTelemetry exporters) at step boundaries. It is the whole of recording;
the public :class:`copytrace.Trace` composes it with what is done with the result (hazards,
reports, notebook display), the way ``torch.profiler.profile`` takes ``on_trace_ready``:
the one hook a session takes, ``find_hazards``, runs on the export thread once the trace
file is closed, and what it returns is appended to the file as the ``copytrace.hazards``
span. This package therefore imports no reader, analysis or renderer.

Its parts: :mod:`._schedule` (which steps are traced, and what each step boundary does),
:mod:`._buffer` (flushes, run-wide numbering, held-back records), :mod:`._engage` (the
modes, wrappers and patches), :mod:`._process` (the one active session, SIGTERM, fork).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from copytrace import _env
from copytrace._threads import unlisted
from copytrace._warnstate import frozen_warnings
from copytrace.export.file_sink import FileSink
from copytrace.export.pipeline import ExportPipeline, RunIds, epoch_offset
from copytrace.export.sdk_sink import make_resource
from copytrace.schema import CopyEvent
from copytrace.tracer import (
    _export_now,
    _idle,
    _native,
    _process,
    _recorder,
    _ring,
    _runattrs,
    _trigger,
)
from copytrace.tracer import _schedule as S
from copytrace.tracer import _stepcode as _stepcode
from copytrace.tracer._buffer import Buffer, make_pipeline, new_trace_path
from copytrace.tracer._engage import Engagement
from copytrace.tracer._rules import settle_unreal_events

__all__ = ["HazardFinder", "Session", "active_session"]


#: ``find_hazards(trace file) -> hazards``, each a plain dict with ``code``, ``severity``,
#: ``message``, ``fix``, ``call_sites`` and optionally ``bytes``, ``event_seqs``,
#: ``span_ids`` (what ``copytrace.analysis.Finding.as_dict`` gives).
HazardFinder = Callable[[Path], Sequence[Mapping[str, Any]]]


def active_session() -> Session | None:
    """The session recording in this process, or None."""
    return _process.active()  # type: ignore[no-any-return]


class Session(contextlib.ContextDecorator):
    """One recording: the options of :class:`copytrace.Trace` (see there), plus:

    Args:
        find_hazards: the hook run on the export thread once the trace file is closed
            (:data:`HazardFinder`); its hazards become the ``copytrace.hazards`` span.
            Errors in it are counted (``copytrace.errors``), never raised.

    Attributes:
        owner: the object that wraps this session (a :class:`copytrace.Trace`), returned to
            a second trace entered while this one records.
        trace_path: the trace file once written, else None.
        running: between :meth:`start` and :meth:`stop`.
        sampled: False when ``OTEL_TRACES_SAMPLER`` (or the provider's sampler) dropped the
            run: it is then not traced at all.
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
        find_hazards: HazardFinder | None = None,
        trigger: str | None = None,
        trigger_steps: int | None = None,
        ring: int | None = None,
        on_window: Callable[[Path | None, tuple[int, int]], None] | None = None,
    ) -> None:
        self.output_dir = Path(output_dir if output_dir is not None else _env.output_dir())
        # Options left as None come from the environment (copytrace._env, one typed check
        # each); a value not accepted raises SettingError naming the option or variable.
        if level is None:
            level = _env.setting(_env.COPYTRACE_LEVEL)
        self.level = _env.parse_level(level)
        if observer is None:
            observer = _env.setting(_env.COPYTRACE_OBSERVER)
        #: "auto" or "native": copytrace's C++ observer where it can be built; "python": the
        #: Python modes (torch.compile'd code then runs eagerly while traced)
        self.observer = _env.parse_observer(observer)
        if compression is None:
            compression = _env.setting(_env.COPYTRACE_COMPRESSION)
        comp = _env.parse_compression(compression)
        self.compression: str | None = None if comp == "none" else comp
        if flush_events is None:
            flush_events = _env.setting(_env.COPYTRACE_FLUSH_EVENTS)
        if flush_seconds is None:
            flush_seconds = _env.setting(_env.COPYTRACE_FLUSH_SECONDS)
        self.flush_events = _env.parse_count(flush_events, "flush_events")
        self.flush_seconds = _env.parse_seconds(flush_seconds, "flush_seconds")
        self._flush_ns = int(self.flush_seconds * 1e9)
        self._production(trigger, trigger_steps, ring, schedule)
        self.on_window = on_window
        max_events = _env.parse_count(max_events, "max_events")
        if self.ring:
            max_events = max(max_events, 2 * self.ring)
        self.write = write
        self.find_hazards = find_hazards
        self.owner: Any = None
        self._auto_step = auto_step
        self._exporters = list(exporters) if exporters is not None else None
        self._tracer_provider = tracer_provider
        self._observer_path: str | None = None  # "native" | "python" once decided
        self._native_module: Any = None
        self._rec = _recorder.Recorder(max_events=max_events, auto_step=auto_step)
        self._engagement = Engagement(self.level)
        self._buf = Buffer()
        self._idle = _idle.Idle()  # armed, nothing due: the boundaries only count (_idle)
        self._optim_hooks: list[Any] = []  # global optimizer hooks: none (see _install_step_hooks)
        self._step_native: Any = None  # the observer whose step callback is on
        self._delegate: Session | None = None
        self._start_ns = self._end_ns = self._epoch_offset = self.pid = 0
        self._resource: Any = None
        self._run: RunIds | None = None
        self._pipeline: ExportPipeline | None = None
        self._file_sink: FileSink | None = None
        self._action = S.RECORD
        self._closing = False
        self._exit: str | None = None
        self._exit_error: str | None = None
        self.trace_path: Path | None = None
        self.running = False
        self.sampled = True

    def _production(self, trigger: Any, trigger_steps: Any, ring: Any, schedule: Any) -> None:
        """The trigger (armed and idle) or the schedule, and the flight recorder's ring;
        SettingError for both the ring and the trigger (:func:`._env.ring_and_trigger`)."""
        names = ("ring" if ring is not None else _env.COPYTRACE_RING,
                 "trigger" if trigger is not None else _env.COPYTRACE_TRIGGER)  # fmt: skip
        trigger = trigger if trigger is not None else _env.setting(_env.COPYTRACE_TRIGGER)
        if _env.parse_trigger(trigger) == "signal":
            steps = (_env.parse_count(trigger_steps, "trigger_steps", 1) if trigger_steps
                     is not None else _env.setting(_env.COPYTRACE_TRIGGER_STEPS))  # fmt: skip
            signame = _env.setting(_env.COPYTRACE_TRIGGER_SIGNAL)
            #: armed and idle until the signal (:mod:`copytrace.tracer._trigger`), else None
            self.trigger: _trigger.Trigger | None = _trigger.Trigger(signame, int(steps))
            self.schedule: Any = self.trigger.windows
        else:
            self.trigger = None
            self.schedule = S.schedule_from(schedule)
        #: the flight recorder's size (:mod:`copytrace.tracer._ring`); 0: off
        self.ring = (_env.parse_count(ring, "ring") if ring is not None
                     else _env.setting(_env.COPYTRACE_RING))  # fmt: skip
        _env.ring_and_trigger(self.ring, "none" if self.trigger is None else "signal", *names)
        ring_signal = _env.setting(_env.COPYTRACE_RING_SIGNAL)
        self._ring_signal = (
            _trigger.Trigger(ring_signal, 0, _env.COPYTRACE_RING_SIGNAL) if self.ring else None
        )

    def _target(self) -> Session:
        """The session that records: the active one this session delegates to, or itself."""
        return self._delegate if self._delegate is not None else self

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> Session:
        """Install the modes, hooks and patches; return the session that records (see
        :meth:`_start`). The program's warnings state is kept (:mod:`copytrace._warnstate`)."""
        with frozen_warnings(), unlisted():
            return self._start()

    def _start(self) -> Session:
        """Install the modes, hooks and patches; return ``self``, or the already active session
        when another one is recording (this one then delegates to it; its :meth:`stop` does
        nothing)."""
        active = _process.active()
        if active is not None:
            if self.write and active is not self:
                _process.say_nested(self.output_dir, active)
            self._delegate = active
            return active  # type: ignore[no-any-return]
        if self.running:
            return self
        if self._native() is None:
            _recorder.warm_up()
        if self._run is not None:  # started again (a decorated function called again)
            self._reset()
        self.pid = os.getpid()
        self._resource = make_resource()
        self._epoch_offset = epoch_offset()
        self._start_ns = time.perf_counter_ns()
        self._buf.cur_step_start = self._start_ns
        self._buf.last_flush = self._start_ns
        self._run = RunIds(self._start_ns, self._epoch_offset, self._resource)
        self._pipeline = self._make_pipeline()
        if not self.sampled:
            print("copytrace: this run is sampled out (OTEL_TRACES_SAMPLER or the tracer "
                  "provider's sampler): not tracing", file=sys.stderr)  # fmt: skip
            self._pipeline = None
            return self
        self._install_step_hooks()
        self.running = True
        _process.set_active(self)
        first = self._action_at(0)
        self._enter_action(first, S.START[first])
        if self.schedule is None and self.trigger is None and not self.ring:
            self._buf.arm_full(self._rec, self.flush_events, self._pipeline, self._full)
        if self._pipeline is not None:
            self._pipeline.start()
        _process.install_signal_handlers()
        if self.trigger is not None:
            sink = self._file_sink
            self.trigger.install(sink.path if sink is not None else None, self.output_dir)
            self.trigger.wake = functools.partial(self._idle.wake, self)
        if self._ring_signal is not None:
            self._ring_signal.install(None, self.output_dir, arm=False)
        self._idle.enter(self)
        return self

    def _reset(self) -> None:
        """A new run of the same session object: a new recorder and new counters."""
        old = self._rec
        self._rec = _recorder.Recorder(max_events=old.max_events, auto_step=self._auto_step)
        self._engagement = Engagement(self.level)
        self._buf = Buffer()
        self.trace_path = None
        self._file_sink = None
        self._action = S.RECORD
        self._closing = False
        self._exit = self._exit_error = None
        self._end_ns = 0

    def _make_pipeline(self) -> ExportPipeline | None:
        """The export thread and its sinks: the trace file, OpenTelemetry exporters."""
        assert self._run is not None
        path = new_trace_path(self.output_dir, self.compression) if self.write else None
        pipeline, self._file_sink, self.sampled = make_pipeline(
            self._run, path, self.compression, self._exporters, self._tracer_provider
        )
        return pipeline

    @property
    def observer_path(self) -> str | None:
        """``"native"`` (copytrace's C++ observer) or ``"python"`` (the Python dispatch mode
        fallback) once tracing started; ``None`` before."""
        return self._target()._observer_path

    def _native(self) -> Any:
        """The C++ observer module for this session, or None (the Python modes' path)."""
        if self._observer_path is None:
            module = None if self.observer == "python" else _native.load()
            self._observer_path = "native" if module is not None else "python"
            self._native_module = module
        return self._native_module

    # -- the schedule -------------------------------------------------------------------------------
    def _action_at(self, step: int) -> str:
        if self.schedule is None:
            return S.RECORD
        try:
            return S.action_name(self.schedule(step))
        except Exception as err:
            self._rec.note_error(err)
            return S.RECORD

    def _enter_action(self, action: str, steps: Sequence[str]) -> None:
        """Enter a step whose action is ``action``, running the transition ``steps``
        (:data:`~copytrace.tracer._schedule.TRANSITIONS`; ``SAVE`` is done by the caller)."""
        self._action = action
        eng, buf, rec = self._engagement, self._buf, self._rec
        for step in steps:
            if step == S.ENGAGE:
                began = time.perf_counter_ns()
                eng.engage(rec, self._native(), self._optim_hooks)
                buf.not_counting(began)  # copytrace's own set-up is not the program's time
                buf.keep()
            elif step == S.DISENGAGE:
                if eng.disengage(rec):
                    buf.keep()
                else:  # the program's modes sit above ours: discard this step's records
                    buf.mark_discard(rec, eng.compiled)
            elif step == S.DISCARD:
                buf.mark_discard(rec, eng.compiled)

    def _boundary(self, auto: bool = False) -> int:
        """A step ended: log it, discard untraced records, flush when due, apply the schedule.

        ``auto``: the boundary is an ``optimizer.step()``; the first one does not flush, so
        that a first explicit :meth:`step` right after it can still renumber the steps.

        An armed session with nothing due goes idle at the end (:mod:`._idle`): its later
        boundaries only count, until a signal or an explicit step brings it back here.
        """
        self._idle.leave(self)
        rec, buf = self._rec, self._buf
        now = time.perf_counter_ns()
        ended = rec.step_index
        rec.step(now)
        rec.watch.copies.reap()  # index results that died since the last watched op
        if not self.running:
            return rec.step_index
        action = self._action
        if action == S.RECORD or action == S.RECORD_AND_SAVE:
            buf.step_log.append((ended, buf.cur_step_start, now))
            buf.steps_traced += 1
        buf.cur_step_start = now
        if buf.discard_from is not None or buf.calls_discard_from is not None:
            buf.drop_untraced(rec, self._engagement.compiled)
        trig = self.trigger
        if trig is not None and trig.pending:
            trig.open(rec.step_index)
        nxt = S.RECORD if self.schedule is None else self._action_at(rec.step_index)
        pipeline = self._pipeline
        if self.ring:  # the flight recorder: no export until something happens
            _ring.trim(rec, buf, self.ring)
            if self._ring_signal is not None and self._ring_signal.pending:
                self._ring_signal.pending = 0
                path = _ring.dump(self, self._ring_signal.signame)
                print(f"copytrace: the last {len(rec.events)} events -> {path}", file=sys.stderr)
            pipeline = None
            rec.step_starts.clear()
        if pipeline is not None and not (auto and rec.step_index == 1 and rec.auto_step):
            rec.step_starts.clear()  # the export keeps its own step bounds
            if (action, nxt) in S.SAVES or buf.flush_due(
                rec, self.flush_events, self._flush_ns, now
            ):
                then = None
                if trig is not None and action == S.RECORD_AND_SAVE:
                    then = functools.partial(_trigger.window_written, self, ended)
                buf.flush(rec, pipeline, self._engagement.compiled, self.pid, then)
        if nxt != action or nxt == S.WARMUP or (nxt == S.NONE and self._engagement.engaged):
            self._enter_action(nxt, S.transition(action, nxt))
        self._idle.enter(self)
        return rec.step_index

    def _full(self) -> None:
        """The recorder's buffer is full: a flush by count (:meth:`Buffer.flush_full`)."""
        plain = self.running and not self._closing and self._action == S.RECORD
        pipeline = self._pipeline if plain else None
        self._buf.flush_full(self._rec, pipeline, self._engagement.compiled, self.pid)

    # -- stopping -------------------------------------------------------------------------------------
    def _write_final(self, end_ns: int, timeout: float) -> None:
        pipeline = self._pipeline
        if pipeline is None:
            return
        buf = self._buf
        if buf.inflight is not None and not buf.inflight.submitted:
            pipeline.submit(buf.inflight)  # a flush cut short by a signal
        chunk = buf.final_chunk(
            self._rec, self._engagement.compiled, end_ns, self._action in S.RECORDING,
            self.run_attributes, self._exit_error,
        )  # fmt: skip
        if not pipeline.close(chunk, timeout):
            print(
                f"copytrace: the export did not finish within {timeout:.0f} s; the trace may "
                f"be incomplete",
                file=sys.stderr,
            )
        if self._file_sink is not None and self._file_sink.path.exists():
            self.trace_path = self._file_sink.path

    def finish_on_signal(self, signum: int) -> None:
        """From the SIGTERM handler: write what was recorded (the process dies next)."""
        name = signal.Signals(signum).name
        if self._closing:  # stop() was already writing: let it finish
            pipeline = self._pipeline
            thread = pipeline._thread if pipeline is not None else None
            if thread is not None:
                thread.join(_process.SIGNAL_TIMEOUT_S)
            return
        self._closing = True
        self._exit, self._exit_error = name, name
        self._idle.sync(self)
        self._write_final(time.perf_counter_ns(), _process.SIGNAL_TIMEOUT_S)

    def abandon_export(self) -> None:
        """In a forked child: drop the inherited export without touching the parent's file."""
        if self._pipeline is not None:
            self._pipeline.abandon()
            self._pipeline = None

    def _uninstall(self, keep_ring_signal: bool = False) -> None:
        """Remove the modes, patches and step hooks; no longer the active session.

        ``keep_ring_signal``: the flight recorder's handler stays until the trace's end is
        written (:meth:`_stop`): a ring signal sent then is taken (the ring is being written
        anyway) instead of killing the process in the middle of the write."""
        self._engagement.disengage(self._rec, force=True)
        for handle in self._optim_hooks:
            handle.remove()
        self._optim_hooks = []
        self._rec.step_scope = None
        self._idle.leave(self)
        if self._step_native is not None:
            self._step_native.set_step_code(None)
            self._step_native.set_step_hooks(None, None)
            self._step_native = None
            _stepcode.remove()
        self.running = False
        if self.trigger is not None:
            self.trigger.uninstall()
        if self._ring_signal is not None and not keep_ring_signal:
            self._ring_signal.uninstall()
        if _process.active() is self:
            _process.set_active(None)

    def stop(self) -> Path | None:
        """:meth:`_stop`, keeping the program's warnings state (:mod:`copytrace._warnstate`)."""
        with frozen_warnings(), unlisted():
            return self._stop()

    def _stop(self) -> Path | None:
        """Remove everything :meth:`start` installed and write the rest of the trace.

        Returns:
            The trace file written, or ``None`` (``write=False``, sampled out, or a
            delegating inner session). A failure to write is reported on stderr, never
            raised.
        """
        if self._delegate is not None:
            self._delegate = None
            return None
        if not self.running:
            return self.trace_path
        if self.pid != os.getpid():  # a forked child inherited this running session
            self._uninstall()
            self._engagement.close()
            self.abandon_export()
            return None
        self._end_ns = time.perf_counter_ns()
        self._closing = True
        settle_unreal_events(self._rec.events)
        if self._exit is None:
            self._exit = self._exit_error = _process.uncaught_exit()
        self._uninstall(keep_ring_signal=True)
        _process.set_finishing(self)
        if self._pipeline is not None and self._file_sink is not None:
            self._pipeline.hazards = self._hazards
        try:
            self._write_final(self._end_ns, _process.CLOSE_TIMEOUT_S)
        except Exception as err:
            print(f"copytrace: could not write the trace: {err}", file=sys.stderr)
        finally:
            _process.set_finishing(None)
            _process.restore_signal_handlers()
            if self._ring_signal is not None:
                self._ring_signal.uninstall()
            self._engagement.close()
            self._rec.release()
        _runattrs.say_losses(self._rec)
        return self.trace_path

    def _hazards(self) -> list[Mapping[str, Any]]:
        """The ``find_hazards`` hook over the closed trace file (on the export thread; see
        ``ExportPipeline.hazards``); its failure is counted, never raised (hazards are
        advisory)."""
        sink, find = self._file_sink, self.find_hazards
        if find is None or sink is None or not sink.path.exists():
            return []
        try:
            return list(find(sink.path))
        except Exception as err:
            self._rec.note_error(err)
            return []

    def note_exit(self, exc_type: Any, exc: Any) -> None:
        """Record how the traced program ended (``copytrace.exit``) before :meth:`stop`:
        ``exc_type`` / ``exc`` of the exception it raised, or None for a normal end."""
        if exc_type is not None and self._exit is None:
            if issubclass(exc_type, SystemExit):
                code = getattr(exc, "code", None)
                self._exit = f"SystemExit({code!r})" if code not in (None, 0) else "SystemExit"
                if code not in (None, 0):
                    self._exit_error = self._exit
            else:
                self._exit = self._exit_error = exc_type.__name__

    def __enter__(self) -> Session:
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.note_exit(exc_type, exc)
        self.stop()

    # -- during tracing ---------------------------------------------------------------------------
    def step(self) -> int:
        """Mark a training step boundary; return the new step number (the first step is 0).

        Calling it turns off the automatic step on ``optimizer.step()``.
        """
        if self._delegate is not None and self._delegate is not self:
            return self._delegate.step()
        rec, buf = self._rec, self._buf
        if self._idle.on and not rec.auto_step:
            return self._idle.step(self)  # armed, nothing due: count it (see _idle)
        self._idle.leave(self)
        if rec.auto_step:
            rec.auto_step = False
            if rec.step_index > 0 and buf.flushes == buf.full_flushes and not buf.discarded:
                self._renumber_from_zero()
        if not self.running:
            return rec.step()
        return self._boundary()

    def _renumber_from_zero(self) -> None:
        """``optimizer.step()`` already advanced steps before this first explicit
        :meth:`step`: by the user's own marks, everything so far is step 0 (once records have
        been flushed or discarded, the automatic numbering stays)."""
        rec, buf = self._rec, self._buf
        rec.step_starts.clear()
        rec.step_index = 0
        for ev in rec.events:
            ev.step = 0
        buf.restart_steps(self._start_ns)
        if self.running:
            action = self._action_at(0)
            self._enter_action(action, S.START[action])
            if action not in S.RECORDING:  # step 0 is not traced after all
                buf.discard_from = 0
                buf.drop_untraced(rec, self._engagement.compiled)
                if action == S.WARMUP:
                    buf.discard_from = 0

    @property
    def events(self) -> list[CopyEvent]:
        """The events recorded and not yet flushed (a copy of the list), oldest first."""
        return list(self._target()._rec.events)

    @property
    def stats(self) -> dict[str, int]:
        """Counters: ``events`` (recorded in traced steps, flushed or not), ``dropped``,
        ``errors``, ``internal_detaches``, ``steps``, ``steps_traced``, ``discarded`` (warmup
        records), ``flushes``."""
        return _runattrs.session_stats(self._target())

    # -- output -----------------------------------------------------------------------------------
    def export(self, exporter: Any = None, directory: Path | None = None) -> Path | None:
        """Write the buffered events (:attr:`events`) as spans, all at once: see
        :meth:`copytrace.Trace.export`; ``directory``: the trace file's folder instead of
        :attr:`output_dir` (for a trace that writes no file of its own)."""
        if exporter is None and self._file_sink is not None:
            return self.trace_path
        return _export_now.export_buffered(self, exporter, directory)

    def run_attributes(self) -> dict[str, Any]:
        """The ``copytrace.run`` span's attributes (``docs/trace-format.md``)."""
        return _runattrs.run_attributes(self)

    def _install_step_hooks(self) -> None:
        """Follow optimizer steps at the ``Optimizer.step#...`` record scope that torch opens
        around every ``step()`` (``Optimizer.profile_hook_step``): the C++ observer's
        RecordFunction callback, else (the Python fallback) the function mode, which sees
        torch's ``profiler._record_function_enter_new``/``_record_function_exit`` calls.
        Nothing goes into torch's global optimizer hook dicts."""
        native = self._native()
        if native is not None and native.set_step_hooks(self._on_optim_pre, self._on_optim_post):
            self._step_native = native
            if self.trigger is not None:  # armed: idle counts at torch's hook point (_stepcode)
                native.set_step_code(_stepcode.install(native))
            return
        self._rec.step_scope = (self._on_optim_pre, self._on_optim_post)

    def _on_optim_pre(self, *_: Any) -> None:  # (optimizer, args, kwargs) from a hook
        if self._rec.compiled_depth:
            return  # an optimizer step inside a compiled region: stand aside (see _compiled)
        self._rec.in_optimizer += 1

    def _on_optim_post(self, *_: Any) -> None:
        rec = self._rec
        if rec.compiled_depth:
            return
        rec.in_optimizer = max(0, rec.in_optimizer - 1)
        if rec.auto_step and not rec.in_optimizer:
            self._boundary(auto=True)
