"""The public facade: ``copytrace.trace()`` and the :class:`Trace` session it returns."""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.optim.optimizer as _optim

from copytrace import _env
from copytrace._errors import CopytraceError
from copytrace.export.file_sink import FileSink, trace_file_name
from copytrace.export.pipeline import Chunk, ExportPipeline, RunEnd, RunIds, epoch_offset
from copytrace.export.sdk_sink import SdkSink, env_sampler_keeps, exporters_from_env, make_resource
from copytrace.schema import CopyEvent
from copytrace.tracer import _compiled, _native, _observer, _recorder
from copytrace.tracer._rules import settle_unreal_events
from copytrace.tracer.watch import HeldEvents

__all__ = ["Schedule", "Trace", "trace"]

# Schedule actions, named as torch.profiler.ProfilerAction's members.
_NONE, _WARMUP, _RECORD, _SAVE = "NONE", "WARMUP", "RECORD", "RECORD_AND_SAVE"
_RECORDING = (_RECORD, _SAVE)


class Schedule:
    """Which steps are traced: torch.profiler's schedule, driven by :meth:`Trace.step`
    (or by ``optimizer.step()`` while ``auto_step`` is on).

    The first ``skip_first`` steps are not traced; then each cycle has ``wait`` untraced
    steps, ``warmup`` steps traced but not kept, and ``active`` traced steps, the last of
    which flushes the trace; ``repeat`` cycles (0: cycles until the end). Outside warmup and
    active steps the modes, hooks and patches are removed, so untraced steps cost nearly
    nothing. Any callable ``step -> torch.profiler.ProfilerAction`` (for instance
    ``torch.profiler.schedule(...)``) is accepted in its place.

    In the environment: ``COPYTRACE_SCHEDULE="wait=1,warmup=1,active=3,repeat=2,skip_first=10"``.
    """

    _FIELDS = _env.SCHEDULE_FIELDS

    def __init__(
        self,
        *,
        wait: int = 0,
        warmup: int = 0,
        active: int = 1,
        repeat: int = 0,
        skip_first: int = 0,
    ) -> None:
        for name, value in zip(
            self._FIELDS, (wait, warmup, active, repeat, skip_first), strict=True
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"schedule {name} must be a whole number >= 0, not {value!r}")
        if active < 1:
            raise ValueError("schedule active must be >= 1")
        self.wait, self.warmup, self.active = wait, warmup, active
        self.repeat, self.skip_first = repeat, skip_first

    @classmethod
    def parse(cls, text: str) -> Schedule:
        """``"wait=1,warmup=1,active=3,repeat=2,skip_first=10"`` (any subset, any order).

        Raises:
            copytrace.SettingError: (a ``ValueError``) a field or value not accepted.
        """
        return cls(**_env.parse_schedule(text))

    def __call__(self, step: int) -> str:
        if step < self.skip_first:
            return _NONE
        step -= self.skip_first
        cycle = self.wait + self.warmup + self.active
        if self.repeat > 0 and step // cycle >= self.repeat:
            return _NONE
        pos = step % cycle
        if pos < self.wait:
            return _NONE
        if pos < self.wait + self.warmup:
            return _WARMUP
        return _SAVE if pos == cycle - 1 else _RECORD

    def __repr__(self) -> str:
        return ",".join(f"{n}={getattr(self, n)}" for n in self._FIELDS)


def _schedule_from(value: Any) -> Callable[[int], Any] | None:
    if value is None:
        value = _env.setting(_env.COPYTRACE_SCHEDULE)
        if value is None:
            return None
    if isinstance(value, str):
        return Schedule.parse(value)
    if isinstance(value, dict):
        return Schedule(**value)
    if callable(value):
        return value
    raise TypeError(f"schedule must be a Schedule, a callable, a dict or a string, not {value!r}")


def _action_name(action: Any) -> str:
    name = str(getattr(action, "name", action)).upper()
    return name if name in (_NONE, _WARMUP, _RECORD, _SAVE) else _RECORD


def _watched_event_ids(watch: HeldEvents, rec: Any) -> set[int]:
    """``id()`` of the events whose late facts the watch may still change (its contract:
    :class:`copytrace.tracer.watch.HeldEvents`); an error is counted and holds nothing back."""
    try:
        return {id(ev) for ev in watch.live_events()}
    except Exception as err:
        rec.note_error(err)
        return set()


F = TypeVar("F", bound=Callable[..., Any])


class Trace:
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
        flush_events: flush at the first step boundary with this many records buffered
            (default 4096, ``$COPYTRACE_FLUSH_EVENTS``; 0: only when the trace stops).
        flush_seconds: also flush at a step boundary this long after the last flush
            (default 5, ``$COPYTRACE_FLUSH_SECONDS``).
        level: one of ``copytrace._env.LEVELS`` (default ``"lean"``, ``$COPYTRACE_LEVEL``);
            see :func:`trace`.
        observer: one of ``copytrace._env.OBSERVERS`` (default ``"auto"``,
            ``$COPYTRACE_OBSERVER``): ``"auto"``/``"native"`` copytrace's C++ observer where it
            can be built, ``"python"`` the Python dispatch mode.

    Options left as None take their ``COPYTRACE_*`` variable (parsed by
    :mod:`copytrace._env`); a value not accepted raises ``copytrace.SettingError``.

    ``OTEL_TRACES_SAMPLER`` (or the given provider's sampler) decides once per run: a run
    sampled out is not traced at all.

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
        self._observer_path: str | None = None  # "native" | "python" once decided
        self._native_module: Any = None
        self.write = write
        self._rec = _recorder.Recorder(max_events=max_events, auto_step=auto_step)
        self._auto_step = auto_step
        self._modes: list[Any] = []
        self._engaged = False  # modes (or level lean's wrappers), patches and kernels in place
        self._lean_mode: Any = None  # level lean: the mode pushed only while writes are watched
        self._stance: Any = None  # force_eager stance where compiled regions cannot be hooked
        self._compiled: _compiled.Compiled | None = None  # compiled regions (start to stop)
        self._compiled_mode: str | None = None  # "compiled", or "eager" (force_eager fallback)
        self._calls_discard_from: int | None = None
        self._optim_hooks: list[Any] = []  # step hooks: installed from start to stop
        self._start_ns = 0
        self._end_ns = 0
        self._epoch_offset = 0
        self._delegate: Trace | None = None
        self._resource: Any = None
        self.trace_path: Path | None = None
        self.running = False
        # export and lifecycle
        self.schedule = _schedule_from(schedule)
        self._exporters = list(exporters) if exporters is not None else None
        self._tracer_provider = tracer_provider
        if compression is None:
            compression = _env.setting(_env.COPYTRACE_COMPRESSION)
        comp = _env.parse_compression(compression)
        self.compression: str | None = None if comp == "none" else comp
        if flush_events is None:
            flush_events = _env.setting(_env.COPYTRACE_FLUSH_EVENTS)
        if flush_seconds is None:
            flush_seconds = _env.setting(_env.COPYTRACE_FLUSH_SECONDS)
        self.flush_events = max(0, int(flush_events))
        self.flush_seconds = float(flush_seconds)
        self.sampled = True
        self._run: RunIds | None = None
        self._pipeline: ExportPipeline | None = None
        self._file_sink: FileSink | None = None
        self._pid = 0
        self._action = _RECORD
        self._discard_from: int | None = None  # buffer index where untraced records start
        self._cur_step_start = 0
        self._step_log: list[tuple[int, int, int]] = []  # finished traced steps, not flushed
        self._steps_traced = 0
        self._removed = 0  # records handed to the exporter (seq offset of the buffer)
        self._discarded = 0  # records of warmup (or untraced) steps, not exported
        self._held: list[CopyEvent] = []  # flushed records the analysis watch may still change
        self._inflight: Chunk | None = None
        self._seq_final = False
        self._flushes = 0
        self._last_flush = 0.0
        self._closing = False
        self._exit: str | None = None
        self._exit_error: str | None = None

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> Trace:
        """Install the modes, hooks and patches; return the trace that records.

        Returns:
            ``self``, or the already active trace when another one is recording.
        """
        active = _ACTIVE_TRACE[0]
        if active is not None:
            self._delegate = active
            return active
        if self.running:
            return self
        if self._native() is None:
            _recorder.warm_up()
        if self._run is not None:  # started again (a decorated function called again)
            self._reset()
        self._pid = os.getpid()
        self._resource = make_resource()
        self._epoch_offset = epoch_offset()
        self._start_ns = time.perf_counter_ns()
        self._cur_step_start = self._start_ns
        self._last_flush = time.monotonic()
        self._run = RunIds(self._start_ns, self._epoch_offset, self._resource)
        self._pipeline = self._make_pipeline()
        if not self.sampled:
            print(
                "copytrace: this run is sampled out (OTEL_TRACES_SAMPLER or the tracer "
                "provider's sampler): not tracing",
                file=sys.stderr,
            )
            self._pipeline = None
            return self
        self._optim_hooks = [
            _optim.register_optimizer_step_pre_hook(self._on_optim_pre),
            _optim.register_optimizer_step_post_hook(self._on_optim_post),
        ]
        self.running = True
        _ACTIVE_TRACE[0] = self
        self._set_action(self._action_at(0))
        if self._pipeline is not None:
            self._pipeline.start()
        _install_signal_handlers()
        return self

    def _reset(self) -> None:
        """A new run of the same trace object: a new recorder and new counters."""
        old = self._rec
        self._rec = _recorder.Recorder(max_events=old.max_events, auto_step=self._auto_step)
        self.trace_path = None
        self._file_sink = None
        self._action, self._discard_from = _RECORD, None
        self._compiled, self._compiled_mode, self._calls_discard_from = None, None, None
        self._step_log, self._held, self._inflight = [], [], None
        self._steps_traced = self._removed = self._discarded = self._flushes = 0
        self._seq_final = self._closing = False
        self._exit = self._exit_error = None
        self._end_ns = 0

    def _make_pipeline(self) -> ExportPipeline | None:
        """The export thread and its sinks: the trace file, OpenTelemetry exporters."""
        assert self._run is not None
        sinks: list[Any] = []
        if self.write:
            path = _new_trace_path(self.output_dir, self.compression)
            self._file_sink = FileSink(path, compression=self.compression)
            sinks.append(self._file_sink)
        sdk: SdkSink | None = None
        if self._tracer_provider is not None:
            sdk = SdkSink(tracer_provider=self._tracer_provider)
        else:
            exporters = self._exporters if self._exporters is not None else exporters_from_env()
            if exporters:
                sdk = SdkSink(exporters, resource=self._resource)
        if sdk is not None:
            sinks.append(sdk)
        pipeline = ExportPipeline(self._run, sinks) if sinks else None
        if pipeline is not None:
            pipeline.begin()
        self.sampled = sdk.sampled() if sdk is not None else env_sampler_keeps(self._run)
        if not self.sampled and sdk is not None:
            sdk.close()
        return pipeline

    # -- engaging the modes (whole run, or the traced steps of a schedule) -----------------------
    def _engage(self) -> None:
        if self._engaged:
            return
        self._engaged = True
        rec = self._rec
        _recorder.set_active(rec)
        native = self._native()
        if native is not None:
            fmode = _observer.engage(rec, native, full=self.level != "api")
            if self.level == "lean":  # no mode: the API's callables are wrapped in C instead
                _observer.install_wrappers(rec, native, fmode)
                _recorder.install_patches()
                self._lean_mode = fmode
            else:
                _recorder.install_patches()
                fmode.__enter__()
                self._modes = [fmode]
            self._engage_compiled(eager_fallback=False)
            return
        _recorder.install_patches()
        fmode = _recorder.FunctionMode(rec)
        fmode.__enter__()
        self._modes = [fmode]
        if self.level != "api":
            dmode = _recorder.DispatchMode(rec)
            dmode.__enter__()
            self._modes.append(dmode)
        self._engage_compiled(eager_fallback=self.level != "api")

    def _engage_compiled(self, eager_fallback: bool) -> None:
        """Let torch.compile'd code run compiled (copytrace steps aside at each compiled call);
        where this torch offers no hook for it and a Python dispatch mode is on
        (``eager_fallback``), fall back to the ``force_eager`` stance."""
        if self._compiled is None:
            self._compiled = _compiled.Compiled(self._rec)
        try:
            modes = self._modes or ([self._lean_mode] if self._lean_mode is not None else [])
            ok = self._compiled.engage(modes, self._optim_hooks)
        except Exception as err:
            self._rec.note_error(err)
            self._compiled.disengage()
            ok = False
        if ok:
            self._compiled_mode = "compiled"
        elif eager_fallback:
            self._compiled_mode = "eager"
            self._stance = _force_eager()

    def _disengage(self, force: bool = False) -> bool:
        """Remove the modes and patches; False (nothing removed) when the
        program pushed modes of its own above copytrace's and this is not the end."""
        if not self._engaged:
            return True
        if not force and self._modes and not self._modes_on_top():
            return False
        self._engaged = False
        if self._compiled is not None:
            self._compiled.disengage()
        for mode in reversed(self._modes):
            try:
                mode.__exit__(None, None, None)
            except Exception as err:  # the user's code left the mode stack unbalanced
                self._rec.note_error(err)
        self._modes = []
        if self._rec.native is not None:
            try:
                if self.level == "lean":
                    _observer.remove_wrappers(self._rec, self._rec.native)
                _observer.disengage(self._rec)
            except Exception as err:
                self._rec.note_error(err)
        if self._stance is not None:
            try:
                self._stance.__exit__(None, None, None)  # back to the program's own stance
            except Exception as err:
                self._rec.note_error(err)
            self._stance = None
        _recorder.remove_patches()
        _recorder.set_active(None)
        return True

    @property
    def observer_path(self) -> str | None:
        """``"native"`` (copytrace's C++ observer) or ``"python"`` (the Python dispatch mode
        fallback) once tracing started; ``None`` before."""
        return (self._delegate or self)._observer_path

    def _native(self) -> Any:
        """The C++ observer module for this trace, or None (the Python modes' path)."""
        if self._observer_path is None:
            module = None if self.observer == "python" else _native.load()
            self._observer_path = "native" if module is not None else "python"
            self._native_module = module
        return self._native_module

    def _modes_on_top(self) -> bool:
        from torch.overrides import _get_current_function_mode_stack
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        fstack = _get_current_function_mode_stack()
        dstack = _get_current_dispatch_mode_stack()
        if not (fstack and fstack[-1] is self._modes[0]):
            return False
        return len(self._modes) < 2 or bool(dstack and dstack[-1] is self._modes[1])

    def _action_at(self, step: int) -> str:
        if self.schedule is None:
            return _RECORD
        try:
            return _action_name(self.schedule(step))
        except Exception as err:
            self._rec.note_error(err)
            return _RECORD

    def _set_action(self, action: str) -> None:
        """Enter step ``action``: engage or disengage, and mark where untraced records start."""
        self._action = action
        if action == _NONE:
            self._discard_from = None if self._disengage() else len(self._rec.events)
            self._calls_discard_from = None if self._discard_from is None else self._calls_mark()
            return
        self._engage()
        self._discard_from = len(self._rec.events) if action == _WARMUP else None
        self._calls_discard_from = self._calls_mark() if action == _WARMUP else None

    def _drop_untraced(self) -> None:
        """Discard the records of a warmup step (or of an untraced step that could not be
        disengaged): they are not exported."""
        start = self._discard_from
        calls_start, self._calls_discard_from = self._calls_discard_from, None
        if calls_start is not None and self._compiled is not None:
            self._compiled.discard_calls(calls_start)
        if start is None:
            return
        self._discard_from = None
        events = self._rec.events
        if len(events) > start and self._rec.group is None:
            self._discarded += len(events) - start
            del events[start:]

    def _calls_mark(self) -> int:
        return len(self._compiled.calls) if self._compiled is not None else 0

    # -- step boundaries and flushes ---------------------------------------------------------------
    def _boundary(self, auto: bool = False) -> int:
        """A step ended: log it, discard untraced records, flush when due, apply the schedule.

        ``auto``: the boundary is an ``optimizer.step()``; the first one does not flush, so
        that a first explicit :meth:`step` right after it can still renumber the steps."""
        rec = self._rec
        now = time.perf_counter_ns()
        ended = rec.step_index
        recorded = self._action in _RECORDING
        rec.step(now)
        lean = rec.lean_watch
        if lean is not None and (lean.pushed or lean.aliases or lean.indexes):
            lean.settle()  # an alias freed on another thread
        if not self.running:
            return rec.step_index
        if recorded:
            self._step_log.append((ended, self._cur_step_start, now))
            self._steps_traced += 1
        self._cur_step_start = now
        if self._discard_from is not None or self._calls_discard_from is not None:
            self._drop_untraced()
        nxt = _RECORD if self.schedule is None else self._action_at(rec.step_index)
        window_end = (self._action == _SAVE) or (recorded and nxt not in _RECORDING)
        if self._pipeline is not None and not (auto and rec.step_index == 1 and rec.auto_step):
            rec.step_starts.clear()  # the export keeps its own step bounds
            if window_end or self._flush_due():
                self._flush()
        if nxt != self._action or nxt == _WARMUP:
            self._set_action(nxt)
        return rec.step_index

    def _flush_due(self) -> bool:
        if self.flush_events <= 0:
            return False
        buffered = len(self._rec.events) + len(self._step_log)
        if buffered >= self.flush_events:
            return True
        return buffered > 0 and time.monotonic() - self._last_flush >= self.flush_seconds

    def _flush(self) -> None:
        """Hand the buffered records and finished steps to the export thread (records that
        the analysis may still annotate are held back until it is done with them)."""
        pipeline, rec = self._pipeline, self._rec
        if pipeline is None or self._pid != os.getpid() or pipeline.closed:
            return
        if rec.group is not None or rec.active is not None:
            return  # not between two records: the next boundary will do
        events = rec.events
        settle_unreal_events(events)  # observer.cpp's fast events to a meta device
        chunk = Chunk(events, self._step_log)
        if self._compiled is not None:
            chunk.compiled = self._compiled.take_calls()
        self._inflight = chunk
        rec.events = []
        self._step_log = []
        base = self._removed
        self._removed += len(events)
        if base:  # the recorder numbers each buffer from 0: make seq (and parents) run-wide
            for ev in events:
                ev.seq += base
                if ev.parent is not None and ev.parent >= 0:
                    ev.parent += base
        if events or self._held:
            watched = _watched_event_ids(rec.watch, rec)
            chunk.late = [ev for ev in self._held if id(ev) not in watched]
            self._held = [ev for ev in self._held if id(ev) in watched]
            if watched:
                new = [ev for ev in events if id(ev) in watched]
                chunk.held = {id(ev) for ev in new}
                self._held.extend(new)
        self._flushes += 1
        self._last_flush = time.monotonic()
        pipeline.submit(chunk)
        self._inflight = None

    def _final_chunk(self, end_ns: int) -> Chunk:
        """Everything not yet exported, and the run span. The buffer stays readable as
        :attr:`events`."""
        rec = self._rec
        self._drop_untraced()
        base = self._removed
        if base and not self._seq_final:
            self._seq_final = True
            for ev in rec.events:
                ev.seq += base
                if ev.parent is not None and ev.parent >= 0:
                    ev.parent += base
        steps = list(self._step_log)
        if self._action in _RECORDING:
            steps.append((rec.step_index, self._cur_step_start, end_ns))
            self._steps_traced += 1
        self._step_log = []
        late, self._held = self._held, []
        attrs = self._run_attributes()
        chunk = Chunk(
            list(rec.events), steps, late=late, final=RunEnd(end_ns, attrs, self._exit_error)
        )
        if self._compiled is not None:
            chunk.compiled = [*self._compiled.take_calls(), *self._compiled.graph_spans()]
        return chunk

    def _write_final(self, end_ns: int, timeout: float) -> None:
        pipeline = self._pipeline
        if pipeline is None:
            return
        if self._inflight is not None and not self._inflight.submitted:
            pipeline.submit(self._inflight)  # a flush cut short by a signal
        chunk = self._final_chunk(end_ns)
        if not pipeline.close(chunk, timeout):
            print(
                f"copytrace: the export did not finish within {timeout:.0f} s; the trace may "
                f"be incomplete",
                file=sys.stderr,
            )
        if self._file_sink is not None and self._file_sink.path.exists():
            self.trace_path = self._file_sink.path

    def _finish_on_signal(self, signum: int) -> None:
        """From the SIGTERM handler: write what was recorded (the process dies next)."""
        name = signal.Signals(signum).name
        if self._closing:  # stop() was already writing: let it finish
            pipeline = self._pipeline
            thread = pipeline._thread if pipeline is not None else None
            if thread is not None:
                thread.join(_SIGNAL_TIMEOUT_S)
            return
        self._closing = True
        self._exit, self._exit_error = name, name
        self._write_final(time.perf_counter_ns(), _SIGNAL_TIMEOUT_S)

    def _abandon_in_child(self) -> None:
        """A forked child inherited this running trace: remove it there without touching the
        parent's trace file (the child's own trace, if any, is a new one)."""
        self._disengage(force=True)
        if self._compiled is not None:
            self._compiled.close()
        for handle in self._optim_hooks:
            handle.remove()
        self._optim_hooks = []
        self.running = False
        if _ACTIVE_TRACE[0] is self:
            _ACTIVE_TRACE[0] = None
        if self._pipeline is not None:
            self._pipeline.abandon()
        self._pipeline = None

    def stop(self) -> Path | None:
        """Remove everything :meth:`start` installed and write the rest of the trace.

        Returns:
            The trace file written, or ``None`` (``write=False``, sampled out, or a
            delegating inner trace). A failure to write is reported on stderr, never raised.
        """
        if self._delegate is not None:
            self._delegate = None
            return None
        if not self.running:
            return self.trace_path
        if self._pid != os.getpid():
            self._abandon_in_child()
            return None
        self._end_ns = time.perf_counter_ns()
        self._closing = True
        settle_unreal_events(self._rec.events)
        last = getattr(sys, "last_type", None)  # an uncaught exception, seen from atexit
        if self._exit is None and last is not None and not hasattr(sys, "ps1"):
            self._exit = self._exit_error = getattr(last, "__name__", str(last))
        self._disengage(force=True)
        for handle in self._optim_hooks:
            handle.remove()
        self._optim_hooks = []
        self.running = False
        _ACTIVE_TRACE[0] = None
        _FINISHING[0] = self
        if self._pipeline is not None and self._file_sink is not None:
            self._pipeline.hazards = self._find_hazards
        try:
            self._write_final(self._end_ns, _CLOSE_TIMEOUT_S)
        except Exception as err:
            print(f"copytrace: could not write the trace: {err}", file=sys.stderr)
        finally:
            _FINISHING[0] = None
            _restore_signal_handlers()
            if self._compiled is not None:
                self._compiled.close()
        if self._rec.dropped:
            print(
                f"copytrace: {self._rec.dropped} event(s) dropped: more than "
                f"max_events={self._rec.max_events} were buffered between two flushes (raise "
                f"max_events / ${_env.COPYTRACE_MAX_EVENTS}, or mark steps more often); the "
                f"count is in the trace (copytrace.events_dropped)",
                file=sys.stderr,
            )
        if self._rec.errors:
            # stderr, not warnings.warn: a program running with warnings as errors
            # (-W error, pytest's filterwarnings) must not see copytrace's own trouble.
            print(
                f"copytrace: {self._rec.errors} internal error(s) while tracing "
                f"(last: {self._rec.last_error}); the traced program was not affected",
                file=sys.stderr,
            )
        return self.trace_path

    def _find_hazards(self) -> list[Any]:
        """The run's hazards, found when the export pipeline has written the final chunk and
        closed the trace file (on the export thread; see ``ExportPipeline.hazards``).

        Hazards need the whole run (hot loops, steps), so they are found after the last
        flush, over the trace's columnar event table, at any size. The pipeline then sends
        them to every sink as one more span, ``copytrace.hazards`` (a child of the run span),
        whose ``copytrace.hazard`` events carry code, severity, message, fix, call sites,
        bytes and the ids of the event spans involved: appended to the trace file, and
        exported to the OTLP / SDK exporters with the events.
        """
        sink = self._file_sink
        if sink is None or not sink.path.exists():
            return []
        try:
            from copytrace.analysis import analyze
            from copytrace.tracefile import event_table

            return analyze(event_table(sink.path, cache=False))
        except Exception as err:  # hazards are advisory: never fail the program's exit
            self._rec.note_error(err)
            return []

    def __enter__(self) -> Trace:
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.note_exit(exc_type, exc)
        self.stop()

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

    def __call__(self, fn: F) -> F:
        """Use the trace as a decorator: ``fn`` runs traced; each call writes the trace."""

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    # -- during tracing ---------------------------------------------------------------------------
    def step(self) -> int:
        """Mark a training step boundary; return the new step number (the first step is 0).

        Calling it turns off the automatic step on ``optimizer.step()``.
        """
        if self._delegate is not None:
            return self._delegate.step()
        rec = self._rec
        if rec.auto_step:
            rec.auto_step = False
            if rec.step_index > 0 and not self._flushes and not self._discarded:
                # optimizer.step() already advanced steps before this first explicit call:
                # by the user's own marks, everything so far is step 0 (once records have
                # been flushed or discarded, the automatic numbering stays).
                rec.step_starts.clear()
                rec.step_index = 0
                for ev in rec.events:
                    ev.step = 0
                self._step_log.clear()
                self._steps_traced = 0
                self._cur_step_start = self._start_ns
                if self.running:
                    action = self._action_at(0)
                    self._set_action(action)
                    if action not in _RECORDING:  # step 0 is not traced after all
                        self._discard_from = 0
                        self._drop_untraced()
                        self._discard_from = 0 if action == _WARMUP else None
        if not self.running:
            return rec.step()
        return self._boundary()

    @property
    def events(self) -> list[CopyEvent]:
        """The events recorded and not yet flushed to the exporters (a copy of the list),
        oldest first: all of them unless a long run flushed some (``flush_events``); the
        trace file has every one."""
        target = self._delegate or self
        return list(target._rec.events)

    @property
    def stats(self) -> dict[str, int]:
        """Counters: ``events`` (recorded in traced steps, flushed or not), ``dropped``,
        ``errors``, ``internal_detaches``, ``steps``, ``steps_traced``, ``discarded`` (warmup
        records), ``flushes``."""
        target = self._delegate or self
        rec = target._rec
        return {
            "events": target._removed + len(rec.events),
            "dropped": rec.dropped,
            "errors": rec.errors,
            "internal_detaches": rec.internal_detaches,
            "steps": rec.step_index + 1,
            "steps_traced": target._steps_traced,
            "discarded": target._discarded,
            "flushes": target._flushes,
        }

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
        if exporter is None and self._file_sink is not None:
            return self.trace_path
        rec = self._rec
        end = self._end_ns or time.perf_counter_ns()
        resource = self._resource if self._resource is not None else make_resource()
        run = RunIds(self._start_ns or end, self._epoch_offset or epoch_offset(), resource)
        path = None
        if exporter is None:
            path = _new_trace_path(self.output_dir, self.compression)
            sink: Any = FileSink(path, compression=self.compression)
        else:
            sink = SdkSink([exporter], resource=resource)
        steps = list(self._step_log)
        if self._action in _RECORDING and (not steps or steps[-1][0] != rec.step_index):
            steps.append((rec.step_index, self._cur_step_start or run.start_ns, end))
        pipeline = ExportPipeline(run, [sink])
        pipeline.begin()
        final = RunEnd(end, self._run_attributes(), self._exit_error)
        chunk = Chunk(list(rec.events), steps, final=final)
        if self._compiled is not None:
            chunk.compiled = [*self._compiled.calls, *self._compiled.graph_spans()]
        pipeline.close(chunk)
        return path

    def _run_attributes(self) -> dict[str, Any]:
        from copytrace._version import __version__

        stats = self.stats
        observer = (self._delegate or self)._observer_path or "python"
        attrs: dict[str, Any] = {
            "copytrace.version": __version__,
            "copytrace.torch_version": torch.__version__,
            "process.command_args": [str(a) for a in sys.argv],
            "copytrace.events": stats["events"],
            "copytrace.events_dropped": stats["dropped"],
            "copytrace.events_discarded": stats["discarded"],
            "copytrace.max_events": self._rec.max_events,
            "copytrace.errors": stats["errors"],
            "copytrace.internal_detaches": stats["internal_detaches"],
            "copytrace.overhead_ns": (self._delegate or self)._rec.overhead_ns,
            "copytrace.steps": stats["steps"],
            "copytrace.steps_traced": stats["steps_traced"],
            "copytrace.flushes": stats["flushes"],
            "copytrace.exit": self._exit or "normal",
            # the level in effect: lean needs the C++ observer, the Python fallback is full
            "copytrace.level": (
                "full" if self.level == "lean" and observer == "python" else self.level
            ),
            # the aten-level path: "native" (the C++ observer) or "python" (the fallback mode)
            "copytrace.observer": observer,
        }
        if self.schedule is not None:
            attrs["copytrace.schedule"] = repr(self.schedule)
        compiled = _compiled_frames()
        if compiled:
            attrs["copytrace.compiled_frames"] = compiled
            # "compiled": compiled regions ran compiled, as spans of their own; "eager": this
            # torch offered no hook, so they ran eagerly (force_eager) and were traced op by op.
            attrs["copytrace.compiled_mode"] = self._compiled_mode or "compiled"
            attrs["copytrace.compiled_ran_eagerly"] = self._compiled_mode == "eager"
        target = self._delegate or self
        if target._compiled is not None:
            attrs.update(target._compiled.run_attributes())
        return attrs

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
            CopytraceError: the trace has not been written (still running, or ``write=False``).
        """
        from copytrace.dashboards import _notebook, write_report

        target = self._delegate or self
        if target.trace_path is None:
            raise CopytraceError(
                "the trace has not been written yet: call report() after the with block"
            )
        out = Path(path) if path is not None else target.output_dir / "report.html"
        written = write_report(target.trace_path, out)
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

    # -- hooks ------------------------------------------------------------------------------------
    def _on_optim_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._rec.compiled_depth:
            return  # an optimizer step inside a compiled region: stand aside (see _compiled)
        self._rec.in_optimizer += 1

    def _on_optim_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        rec = self._rec
        if rec.compiled_depth:
            return
        rec.in_optimizer = max(0, rec.in_optimizer - 1)
        if rec.auto_step and not rec.in_optimizer:
            self._boundary(auto=True)


def _force_eager() -> Any:
    """Fallback for a torch whose compiled callables offer no hook (see ``_compiled``): put
    torch.compile in its ``force_eager`` stance while the dispatch mode is active.

    Any active TorchDispatchMode makes compiled frames run eagerly; but with ``fullgraph=True``
    torch then raises "found no compiled frames". In the ``force_eager`` stance compiled
    functions simply run as Python, traced op by op. Returns the stance object (its
    ``__exit__`` restores the previous stance), or None.
    """
    try:
        return torch.compiler.set_stance("force_eager")
    except Exception:  # a torch without stances
        return None


_USED_PATHS: set[Path] = set()




def _new_trace_path(output_dir: Path, compression: str | None) -> Path:
    """This process's trace file in ``output_dir``; a second trace in the same process gets
    ``-run2`` (then ``-run3``...) instead of overwriting the first one's file."""
    name = trace_file_name(compression=compression)
    stem, dot, ext = name.partition(".otlp")
    path = output_dir / name
    n = 1
    while path.resolve() in _USED_PATHS:
        n += 1
        path = output_dir / f"{stem}-run{n}{dot}{ext}"
    _USED_PATHS.add(path.resolve())
    return path


def _compiled_frames() -> int:
    """Frames torch.compile has compiled in this process so far (0 when dynamo is unused)."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    if dynamo is None:
        return 0
    try:
        return int(dynamo.counters["frames"]["ok"])
    except Exception:
        return 0


_ACTIVE_TRACE: list[Trace | None] = [None]
_FINISHING: list[Trace | None] = [None]  # the trace whose stop() is writing
_CLOSE_TIMEOUT_S = 120.0  # stop() waits this long for the export thread
_SIGNAL_TIMEOUT_S = 10.0  # the SIGTERM handler waits this long, then the process dies

# --- signals and fork ----------------------------------------------------------------------------
_FATAL_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM",) if hasattr(signal, n))
_SAVED_HANDLERS: dict[int, Any] = {}


#: Called as ``hook(signum, monotonic time the signal arrived)`` after the trace is written
#: on a fatal signal (the launch's report, see copytrace._bootstrap).
SIGNAL_HOOKS: list[Callable[[int, float], None]] = []


def _on_fatal_signal(signum: int, frame: Any) -> None:
    """Write the active trace, then die of the signal as the program would have."""
    arrived = time.monotonic()
    target = _ACTIVE_TRACE[0] or _FINISHING[0]
    try:
        if target is not None and target._pid == os.getpid():
            target._finish_on_signal(signum)
    except BaseException as err:  # never keep a dying process alive
        print(f"copytrace: could not write the trace on signal {signum}: {err}", file=sys.stderr)
    for hook in list(SIGNAL_HOOKS):
        try:
            hook(signum, arrived)
        except BaseException as err:  # never keep a dying process alive
            print(f"copytrace: on signal {signum}: {err}", file=sys.stderr)
    try:
        sys.stderr.flush()
    except Exception:
        pass
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_signal_handlers() -> None:
    """Catch SIGTERM while tracing, unless the program handles or ignores it itself."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in _FATAL_SIGNALS:
        try:
            if signal.getsignal(sig) is signal.SIG_DFL:
                signal.signal(sig, _on_fatal_signal)
                _SAVED_HANDLERS[sig] = signal.SIG_DFL
        except (ValueError, OSError):  # not the main interpreter
            pass


def _restore_signal_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, previous in list(_SAVED_HANDLERS.items()):
        try:
            if signal.getsignal(sig) is _on_fatal_signal:
                signal.signal(sig, previous)
        except (ValueError, OSError):
            pass
        _SAVED_HANDLERS.pop(sig, None)


def _after_fork_in_child() -> None:
    """A forked child must never write into its parent's trace file."""
    active = _ACTIVE_TRACE[0]
    if active is not None and active._pipeline is not None and active._pid != os.getpid():
        active._pipeline.abandon()
        active._pipeline = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


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
            Python mode on the hot path (C wrappers on the copying API; copytrace's function
            mode joins torch's stack only while a write it must see can happen: a ``.data``
            alias of a tensor that requires grad, or an advanced-indexing result, is alive);
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
