"""The records between the recorder and the export thread: flushes, run-wide numbering,
records held back for the analysis watch, and the steps not yet exported.

The recorder appends to ``Recorder.events``; at a step boundary the session asks
:meth:`Buffer.flush` to hand that list (and the finished steps' bounds) to the export
thread as one ``Chunk``, and the recorder starts a new list. The recorder numbers each list
from 0: the flush adds the records already exported, so ``seq`` and ``parent`` run
run-wide in the trace file. Records whose facts the analysis watch may still change (an
in-place write to an alias, a stale read) are exported but held back from encoding until
the watch lets them go (``Chunk.held`` / ``Chunk.late``). Records of warmup steps, and of
untraced steps where copytrace's modes could not be removed, are discarded before export.

A step that holds :data:`FULL_FACTOR` x ``flush_events`` records is flushed before it ends
(a flush by count, :meth:`Buffer.flush_full`): a program that marks no step (or very long
steps) then writes its trace while it runs, on the export thread, instead of holding every
record until it stops. The recorder asks for it (``Recorder.full``) once its buffer reaches
``Recorder.flush_at``, from its Python after-call hook or the C observer's ``fast_event``,
after the call's event is complete, outside any torch kernel. The step's span id is planned
with that first chunk (``Chunk.open_step``) and its span written when the step ends, so the
spans, their parents and their order among the events are those of a flush at the step's end.

Cost: a flush is one list swap plus, after the first flush, one pass adding the base to
``seq`` (about 40 ns per record); the encoding runs on the export thread.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from copytrace.export.file_sink import FileSink, trace_file_name
from copytrace.export.pipeline import Chunk, ExportPipeline, RunEnd, RunIds
from copytrace.export.sdk_sink import SdkSink, env_sampler_keeps, exporters_from_env
from copytrace.schema import CopyEvent
from copytrace.tracer import _native
from copytrace.tracer._recorder import FLUSH_NEVER
from copytrace.tracer._rules import settle_unreal_events
from copytrace.tracer.watch import HeldEvents

__all__ = [
    "FULL_FACTOR",
    "Buffer",
    "drop_dead_watched",
    "make_pipeline",
    "new_trace_path",
    "renumber",
    "unwatched_head",
    "watched_event_ids",
]

#: A step is flushed by count once it holds this many times ``flush_events`` records (16,384
#: at the default 4,096). At 32,768 the exit was longer: the export thread was further behind
#: when the program stopped (docs/performance.md, "Flushing by count").
FULL_FACTOR = 4

_USED_PATHS: set[Path] = set()


def new_trace_path(output_dir: Path, compression: str | None) -> Path:
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


def native_columns(events: list[Any], specs: Sequence[tuple[str, int, bool]]) -> Any:
    """The records' fields as Arrow buffers, read in C by the C++ observer's
    ``event_columns`` (``columns.cpp``), for the file sink's bulk path; None where a value
    does not fit; NotImplemented where the observer is not loaded (the sink then reads them
    in Python)."""
    module = _native.loaded()
    if module is None:
        return NotImplemented
    return module.event_columns(events, specs)


def native_span_json(*args: Any) -> Any:
    """The OTLP/JSON text of a run of copy-event spans, written in C by the C++ observer's
    ``span_json`` (``otlp.cpp``) from the run's columns; NotImplemented where the observer is
    not loaded (the sink then builds it with Arrow's string kernels)."""
    module = _native.loaded()
    if module is None:
        return NotImplemented
    return module.span_json(*args)


#: The file sink's C readers and writers (``FileSink(..., **NATIVE_CODECS)``).
NATIVE_CODECS: dict[str, Any] = {"extract": native_columns, "encode": native_span_json}


def make_pipeline(
    run: RunIds,
    path: Path | None,
    compression: str | None,
    exporters: Sequence[Any] | None,
    tracer_provider: Any,
) -> tuple[ExportPipeline | None, FileSink | None, bool]:
    """The export thread (begun, not started) and its sinks: the trace file at ``path``
    (None: no file) and the OpenTelemetry exporters (default ``$OTEL_TRACES_EXPORTER``'s),
    or the given ``tracer_provider``.

    Returns:
        ``(pipeline or None when there is no sink, the file sink or None, sampled)``:
        ``sampled`` is False when the provider's sampler (or ``OTEL_TRACES_SAMPLER``) drops
        the run.
    """
    sinks: list[Any] = []
    file_sink = None
    if path is not None:
        file_sink = FileSink(path, compression=compression, hazards_sidecar=True, **NATIVE_CODECS)
    if file_sink is not None:
        sinks.append(file_sink)
    sdk: SdkSink | None = None
    if tracer_provider is not None:
        sdk = SdkSink(tracer_provider=tracer_provider)
    else:
        exporters = exporters if exporters is not None else exporters_from_env()
        if exporters:
            sdk = SdkSink(exporters, resource=run.resource)
    if sdk is not None:
        sinks.append(sdk)
    pipeline = ExportPipeline(run, sinks) if sinks else None
    if pipeline is not None:
        pipeline.begin()
    sampled = sdk.sampled() if sdk is not None else env_sampler_keeps(run)
    if not sampled and sdk is not None:
        sdk.close()
    return pipeline, file_sink, sampled


def renumber(events: list[CopyEvent], base: int) -> None:
    """Add ``base`` to each record's ``seq`` and to its ``parent`` when it has one."""
    for ev in events:
        ev.seq += base
        if ev.parent is not None and ev.parent >= 0:
            ev.parent += base


def watched_event_ids(watch: HeldEvents, rec: Any) -> set[int]:
    """``id()`` of the events whose late facts the watch may still change (its contract:
    :class:`copytrace.tracer.watch.HeldEvents`); an error is counted and holds nothing back."""
    try:
        return {id(ev) for ev in watch.live_events()}
    except Exception as err:
        rec.note_error(err)
        return set()


def drop_dead_watched(rec: Any) -> None:
    """Let the watch drop its attached copies whose ``grad_fn`` is gone and its fresh copies
    found dead (what it does each time those lists double): no later check changes their
    records. An error is counted."""
    watch = rec.watch
    try:
        prune = getattr(watch, "_prune_attached", None)
        if prune is not None and watch.attached:
            prune()
        prune = getattr(watch.copies, "_prune_fresh", None)
        if prune is not None and watch.copies.fresh:
            prune()
    except Exception as err:
        rec.note_error(err)


def unwatched_head(events: list[CopyEvent], watched: set[int]) -> int:
    """How many records from the start of ``events`` go before the first one in ``watched``
    (``id()`` of records), and before the deepcopy group of a watched group child."""
    cut = len(events)
    if watched:
        cut = next((i for i, ev in enumerate(events) if id(ev) in watched), cut)
    while 0 < cut < len(events):
        parent = events[cut].parent
        if parent is None or parent < 0:
            break
        cut -= 1  # a group's child: the group and its children stay together
    return cut


class Buffer:
    """What one session has buffered and exported so far.

    Attributes:
        step_log: ``(step, start_ns, end_ns)`` of finished traced steps not yet exported
            (``perf_counter_ns``).
        cur_step_start: ``perf_counter_ns`` when the current step started.
        steps_traced: traced steps finished (exported or not).
        removed: records handed to the export thread (the ``seq`` base of the buffer).
        discarded: records of warmup (or untraced) steps, never exported.
        held: exported records the analysis watch may still annotate.
        inflight: the chunk a flush is building (a signal may cut it short).
        flushes: chunks handed over; last_flush: ``perf_counter_ns`` of the last one (or of
            the start), moved on by copytrace's own set-up time (:meth:`not_counting`).
        discard_from: buffer index where the current step's records to discard start.
        calls_discard_from: the same in the compiled calls' list.
    """

    def __init__(self) -> None:
        self.step_log: list[tuple[int, int, int]] = []
        self.cur_step_start = 0
        self.steps_traced = 0
        self.removed = 0
        self.discarded = 0
        self.held: list[CopyEvent] = []
        self.inflight: Chunk | None = None
        self.seq_final = False
        self.flushes = 0
        self.full_flushes = 0  # of them, flushes by count (a step cut before its end)
        self.full_thread: int | None = None  # the traced thread, where a flush by count runs
        self.last_flush = 0
        self.discard_from: int | None = None
        self.calls_discard_from: int | None = None
        self.ring_skipped = 0  # records the flight recorder let go (copytrace.ring_skipped)

    # -- warmup and untraced steps -----------------------------------------------------------
    def mark_discard(self, rec: Any, compiled: Any) -> None:
        """Discard what is recorded from here to the next boundary."""
        self.discard_from = len(rec.events)
        self.calls_discard_from = len(compiled.calls) if compiled is not None else 0

    def keep(self) -> None:
        """Keep what is recorded from here on."""
        self.discard_from = self.calls_discard_from = None

    def drop_untraced(self, rec: Any, compiled: Any) -> None:
        """Discard the records of a warmup step (or of an untraced step that could not be
        disengaged): they are not exported."""
        start = self.discard_from
        calls_start, self.calls_discard_from = self.calls_discard_from, None
        if calls_start is not None and compiled is not None:
            compiled.discard_calls(calls_start)
        if start is None:
            return
        self.discard_from = None
        events = rec.events
        if len(events) > start and rec.group is None:
            self.discarded += len(events) - start
            del events[start:]

    # -- steps ---------------------------------------------------------------------------------
    def restart_steps(self, start_ns: int) -> None:
        """Forget the steps logged so far: the run is renumbered from step 0."""
        self.step_log.clear()
        self.steps_traced = 0
        self.cur_step_start = start_ns

    # -- flushes ---------------------------------------------------------------------------------
    def not_counting(self, since_ns: int) -> None:
        """Take copytrace's own work from ``since_ns`` (``perf_counter_ns``) to now out of the
        time since the last flush: ``flush_seconds`` counts the program's time. The first
        engage in a process imports ``torch._dynamo`` (about 1 s of CPU, 5 to 9 s of wall
        time on a loaded 2-core host); counted, it made the first step boundary flush step
        0's records out of ``Trace.events`` although the program ran for well under 5 s."""
        self.last_flush += time.perf_counter_ns() - since_ns

    def flush_due(self, rec: Any, flush_events: int, flush_ns: int, now_ns: int) -> bool:
        """``flush_events`` records (or steps) buffered, or ``flush_ns`` passed since the last
        flush (``now_ns``: ``perf_counter_ns``, as the step bounds)."""
        if flush_events <= 0:
            return False
        buffered = len(rec.events) + len(self.step_log)
        if buffered >= flush_events:
            return True
        return buffered > 0 and now_ns - self.last_flush >= flush_ns

    def flush(
        self,
        rec: Any,
        pipeline: Any,
        compiled: Any,
        pid: int,
        then: Callable[[], None] | None = None,
        open_step: int | None = None,
        cut: int | None = None,
    ) -> None:
        """Hand the buffered records and finished steps to the export thread (records that
        the analysis may still annotate are held back until it is done with them); ``then``
        runs on the export thread once they are written; ``open_step``: the step not ended
        yet whose records are in the chunk (:attr:`Chunk.open_step`, a flush by count);
        ``cut``: only the records before this index go, the rest stays buffered, renumbered
        from 0 as the recorder numbers a new buffer."""
        if pipeline is None or pid != os.getpid() or pipeline.closed:
            return
        if rec.group is not None or rec.active is not None:
            return  # not between two records: the next boundary will do
        events, kept = rec.events, []
        if cut is not None:
            events, kept = events[:cut], events[cut:]
            renumber(kept, -cut)
        settle_unreal_events(events)  # the C fast path's events (api_mode.cpp) to a meta device
        chunk = Chunk(events, self.step_log)
        chunk.then = then
        chunk.open_step = open_step
        if compiled is not None:
            chunk.compiled = compiled.take_calls()
        self.inflight = chunk
        rec.events = kept
        rec.flush_at = rec.flush_every
        self.step_log = []
        base = self.removed
        self.removed += len(events)
        if base:  # the recorder numbers each buffer from 0: make seq (and parents) run-wide
            renumber(events, base)
        if events or self.held:
            self._hold_back(rec, events, chunk)
        self.flushes += 1
        self.last_flush = time.perf_counter_ns()
        pipeline.submit(chunk)
        self.inflight = None

    def arm_full(
        self, rec: Any, flush_events: int, pipeline: Any, on_full: Callable[[], None]
    ) -> None:
        """Flush by count from here on: ``on_full`` (the session's) is called by the recorder
        once it holds :data:`FULL_FACTOR` x ``flush_events`` records; not armed when
        ``flush_events`` is 0 (flush at the end only) or a sink cannot take a step's span id
        planned before its span (:meth:`ExportPipeline.early_parents`)."""
        if flush_events <= 0 or pipeline is None or not pipeline.early_parents():
            return
        # at most FLUSH_NEVER: the C observer reads it as an int64
        rec.flush_every = rec.flush_at = min(FULL_FACTOR * flush_events, FLUSH_NEVER)
        rec.on_full = on_full
        self.full_thread = threading.get_ident()

    def flush_full(self, rec: Any, pipeline: Any, compiled: Any, pid: int) -> None:
        """A flush by count (``pipeline`` None: the session records no plain step now): the
        buffer up to its first record the analysis watch may still change (none is held
        back, so the file has the records in the order a flush at the step's end writes
        them; the rest stays buffered), and the current step's span id planned now. Not when
        that leaves more than half of the buffer (a record watched since early in the step:
        its tensor still alive), nor while ``optimizer.step()`` numbers the steps (a first
        explicit step may still renumber them from 0), where this step's records may be
        discarded, nor on another thread than the traced one (an autograd thread's implicit
        copy: the traced thread may be amid a record). When nothing is flushed, the recorder
        asks again after ``flush_every`` more records."""
        may = self.discard_from is None and self.calls_discard_from is None
        may = may and threading.get_ident() == self.full_thread
        if may and pipeline is not None and not (rec.auto_step and rec.step_index > 0):
            drop_dead_watched(rec)
            cut = unwatched_head(rec.events, watched_event_ids(rec.watch, rec))
            flushes = self.flushes
            if cut >= len(rec.events) // 2:
                self.flush(rec, pipeline, compiled, pid, open_step=rec.step_index, cut=cut)
            if self.flushes > flushes:
                self.full_flushes += 1
                return
        rec.flush_at = len(rec.events) + rec.flush_every

    def _hold_back(self, rec: Any, events: list[CopyEvent], chunk: Chunk) -> None:
        """Let go of the held records the watch is done with; hold the new ones it is not."""
        watched = watched_event_ids(rec.watch, rec)
        chunk.late = [ev for ev in self.held if id(ev) not in watched]
        self.held = [ev for ev in self.held if id(ev) in watched]
        if watched:
            new = [ev for ev in events if id(ev) in watched]
            chunk.held = {id(ev) for ev in new}
            self.held.extend(new)

    def steps_until(self, step: int, recording: bool, end_ns: int, start_ns: int) -> list[Any]:
        """The steps not yet exported, the current one included when it is traced (for a
        one-shot export; nothing changes)."""
        steps = list(self.step_log)
        if recording and (not steps or steps[-1][0] != step):
            steps.append((step, self.cur_step_start or start_ns, end_ns))
        return steps

    def final_chunk(
        self,
        rec: Any,
        compiled: Any,
        end_ns: int,
        recording: bool,
        run_attributes: Callable[[], dict[str, Any]],
        exit_error: str | None,
    ) -> Chunk:
        """Everything not yet exported, and the run span (``run_attributes()`` is read after
        the last step is counted). The buffer stays readable as ``rec.events``."""
        self.drop_untraced(rec, compiled)
        base = self.removed
        if base and not self.seq_final:
            self.seq_final = True
            renumber(rec.events, base)
        steps = list(self.step_log)
        if recording:
            steps.append((rec.step_index, self.cur_step_start, end_ns))
            self.steps_traced += 1
        self.step_log = []
        late, self.held = self.held, []
        final = RunEnd(end_ns, run_attributes(), exit_error)
        chunk = Chunk(list(rec.events), steps, late=late, final=final)
        if compiled is not None:
            chunk.compiled = [*compiled.take_calls(), *compiled.graph_spans()]
        return chunk
