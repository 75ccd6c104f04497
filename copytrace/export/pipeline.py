"""The export pipeline: chunks of records become span trees, written to sinks off the hot path.

The torch modes only append :class:`~copytrace.schema.CopyEvent` records. At step boundaries
(every ``flush_events`` records or ``flush_seconds``) and when tracing stops, the session
hands the buffered records to an :class:`ExportPipeline` as a :class:`Chunk`. Its worker
thread (``copytrace-export``) plans each chunk once (:meth:`ExportPipeline._plan`: span ids,
parents), so every :class:`Sink` writes the same span tree, with the same ids when
copytrace's own provider is used:

* :class:`~copytrace.export.file_sink.FileSink` writes the trace file (OTLP/JSON lines) and
  its columnar sidecar;
* :class:`~copytrace.export.sdk_sink.SdkSink` builds real SDK spans for SDK exporters or the
  user's ``TracerProvider``.

When the last chunk is written, the pipeline calls its ``hazards`` hook and hands the findings
to every sink as the run's ``copytrace.hazards`` span. The span model and the attributes are
documented in ``docs/trace-format.md``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from operator import attrgetter
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

from copytrace.export._osthread import OsThread, tidy
from copytrace.schema import CopyEvent

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource

__all__ = [
    "Chunk",
    "ExportPipeline",
    "PlanItem",
    "PlanRun",
    "RunEnd",
    "RunIds",
    "Sink",
    "SpanRecord",
    "epoch_offset",
    "expand",
    "span_times",
]


class RunIds:
    """Identity and clock of one traced run (one OTLP trace).

    Args:
        start_ns: ``perf_counter_ns`` when tracing started.
        epoch_offset_ns: add to a ``perf_counter_ns`` value to get ns since the Unix epoch.
        resource: the OpenTelemetry resource.
    """

    def __init__(self, start_ns: int, epoch_offset_ns: int, resource: Resource) -> None:
        gen = RandomIdGenerator()
        self.trace_id = gen.generate_trace_id()
        self.span_id = gen.generate_span_id()
        self.start_ns = start_ns
        self.offset = epoch_offset_ns
        self.resource = resource

    @property
    def trace_hex(self) -> str:
        return format(self.trace_id, "032x")

    @property
    def span_hex(self) -> str:
        return format(self.span_id, "016x")


class RunEnd:
    """How the run ended: the ``copytrace.run`` span's end, attributes and status."""

    def __init__(self, end_ns: int, attributes: dict[str, Any], error: str | None = None) -> None:
        self.end_ns = end_ns
        self.attributes = attributes
        self.error = error


class Chunk:
    """Records handed from the traced thread to the export thread.

    Attributes:
        events: events to export, oldest first (a deepcopy group before its children).
        steps: ``(number, start_ns, end_ns)`` of finished steps to export (``perf_counter_ns``).
        held: ``id()`` of events in ``events`` whose facts may still change (watched by the
            analysis): their span ids and parents are fixed now, they are written later.
        late: events held back by an earlier chunk, to write now.
        final: set on the last chunk of the run.
        compiled: compiled-region records (:class:`SpanRecord`: the tracer's compiled calls,
            and on the last chunk its compiled graphs).
        then: called (no arguments) on the export thread once the chunk is written; its
            errors are counted, never raised.
        open_step: the step the traced thread is in, when the chunk was cut before that step
            ended (a flush by count): its span id is planned now, for its events' parent, and
            kept for its span, written with a later chunk's ``steps``; None otherwise.
    """

    __slots__ = ("events", "steps", "held", "late", "final", "submitted", "compiled", "then",
                 "open_step")  # fmt: skip

    def __init__(
        self,
        events: Sequence[CopyEvent] = (),
        steps: Sequence[tuple[int, int, int]] = (),
        *,
        held: set[int] | None = None,
        late: Sequence[CopyEvent] = (),
        final: RunEnd | None = None,
    ) -> None:
        self.events = events
        self.steps = steps
        self.held = held or set()
        self.late = late
        self.final = final
        self.submitted = False
        self.compiled: Sequence[Any] = ()
        self.then: Callable[[], None] | None = None
        self.open_step: int | None = None


#: One planned span: (span id hex, parent span id hex, event or None, step tuple or None).
PlanItem = tuple[str, str, "CopyEvent | None", "tuple[int, int, int] | None"]


class PlanRun(NamedTuple):
    """A run of planned copy events, none a deepcopy group or its child, none held: span ids,
    parents and records as three lists, made without a Python step per event. Handed as is to
    a sink that sets ``takes_runs`` (the file sink); the others get one :data:`PlanItem` per
    event (:func:`expand`)."""

    ids: list[str]
    parents: list[str]
    events: list[CopyEvent]


def expand(items: Iterable[PlanItem | PlanRun]) -> Iterator[PlanItem]:
    """``items`` with each :class:`PlanRun` as one :data:`PlanItem` per event."""
    for item in items:
        if type(item) is PlanRun:
            yield from zip(item.ids, item.parents, item.events, repeat(None))
        else:
            yield item  # type: ignore[misc]


def span_times(ev: CopyEvent, fallback: int) -> tuple[int, int]:
    """``(start, end)`` of an event's span in ``perf_counter_ns``: ``fallback`` for a missing
    start, never an end before the start."""
    start = ev.start_ns if ev.start_ns is not None else fallback
    end = ev.end_ns if ev.end_ns is not None else max(start, fallback)
    return start, max(start, end)


class SpanRecord(Protocol):
    """A span that is not a copy event, handed over ready-made (a compiled call or graph)."""

    span_name: str
    start_ns: int  # perf_counter_ns
    end_ns: int
    step: int

    def span_attributes(self) -> dict[str, Any]: ...

    def span_events(self) -> list[tuple[str, int, dict[str, Any]]]: ...


class Sink(Protocol):
    """Where the pipeline writes a run's spans (:class:`~copytrace.export.file_sink.FileSink`,
    :class:`~copytrace.export.sdk_sink.SdkSink`). Every method runs on the export thread
    (or the caller's, for :meth:`ExportPipeline.write_now`); one that raises stops that sink.

    Attributes:
        closes_before_hazards: the pipeline's ``hazards`` hook reads what this sink wrote, so
            it is closed before the hook runs (the trace file), not after.
        spans: spans written so far.
        early_parents: a span may name as its parent a step span written later (a chunk's
            ``open_step``) and keep it as that parent (the file, copytrace's own span ids).
    """

    closes_before_hazards: bool
    spans: int
    early_parents: bool

    def begin(self, run: RunIds) -> None:
        """Start the run (its ids, clock and resource)."""

    def write(self, items: Iterable[PlanItem], chunk: Chunk, keep: Callable[[], set[str]]) -> None:
        """Write one chunk's planned spans; ``keep()`` names the parents held events need."""

    def write_hazards(self, findings: Sequence[Mapping[str, Any]], span_id: str,
                      end_ns: int) -> None:  # fmt: skip
        """Write the run's ``copytrace.hazards`` span (:mod:`copytrace.export.hazard_span`)."""

    def close(self) -> None:
        """Finish the run's output."""

    def abandon(self) -> None:
        """In a forked child: drop everything, never touch the parent's outputs."""

    # Optional: ``done()``, called once every sink is closed and the hazards span written
    # (the file sink removes what it wrote only for the ``hazards`` hook).


class ExportPipeline:
    """Plans chunks of records into span trees and writes them to the sinks, on one worker
    thread (``copytrace-export``) or synchronously (:meth:`write_now`).

    Args:
        run: the run's ids and clock.
        sinks: :class:`Sink` objects (the file sink, the SDK sink).
        max_pending: chunks queued before :meth:`submit` waits for the worker (bounded
            memory: the traced thread slows down rather than buffering without end).

    A sink that raises is reported once on stderr and skipped from then on; the others go on.
    """

    def __init__(self, run: RunIds, sinks: Sequence[Sink], *, max_pending: int = 2) -> None:
        self.run = run
        self.sinks = list(sinks)
        self.max_pending = max(1, max_pending)
        self._pending: deque[Chunk] = deque()
        self._wake = threading.Event()
        self._progress = threading.Event()
        self._thread: OsThread | None = None
        self._held: dict[int, tuple[str, str]] = {}  # id(event) -> (span id, parent id)
        self._open: dict[int, str] = {}  # step -> span id planned before the step's span
        self._failed: set[int] = set()
        self.errors = 0
        self.closed = False
        #: Called once the final chunk is written and the sinks that ``closes_before_hazards``
        #: are closed (so that it can read the finished file); the findings it returns, plain
        #: dicts (``Finding.as_dict()``; an object with ``as_dict`` is turned into one), go to
        #: every sink as the run's ``copytrace.hazards`` span (:mod:`.hazard_span`).
        self.hazards: Callable[[], Sequence[Any]] | None = None
        self._end_ns: int | None = None
        self.export_seconds = 0.0
        self.waited_seconds = 0.0  # time the traced thread waited for the worker

    def begin(self) -> None:
        for i, sink in enumerate(self.sinks):
            self._call(i, sink.begin, self.run)

    def start(self) -> None:
        """Start the worker, a bare OS thread the program cannot see
        (:class:`~copytrace.export._osthread.OsThread`); where none can start, every chunk is
        written on the thread that submits it."""
        thread = OsThread(self._work, "copytrace-export", self._worker_failed)
        if thread.start():
            self._thread = thread

    def early_parents(self) -> bool:
        """Whether every sink keeps a parent planned before its span is written
        (:attr:`Sink.early_parents`): only then may a chunk have an ``open_step``."""
        return all(getattr(sink, "early_parents", False) for sink in self.sinks)

    # -- traced thread --------------------------------------------------------------------------
    def submit(self, chunk: Chunk) -> None:
        """Queue a chunk for the worker; wait while too many are queued."""
        if self.closed or chunk.submitted:
            return
        chunk.submitted = True
        thread = self._thread
        if thread is None:
            self.write_now(chunk)
            return
        self._pending.append(chunk)
        self._wake.set()
        if len(self._pending) > self.max_pending:
            t0 = time.perf_counter()
            while len(self._pending) > self.max_pending and thread.is_alive():
                self._progress.wait(0.05)
                self._progress.clear()
            self.waited_seconds += time.perf_counter() - t0

    def close(self, final: Chunk, timeout: float | None = 60.0) -> bool:
        """Queue the final chunk, let the worker write everything and close the sinks.

        Returns:
            False when the worker did not finish within ``timeout`` seconds.
        """
        if self.closed:
            return True
        thread = self._thread
        if thread is None or not thread.is_alive():
            while self._pending:
                self.write_now(self._pending.popleft())
            self.write_now(final)
            self._close_sinks()
            return True
        if not final.submitted:
            final.submitted = True
            self._pending.append(final)
        self._wake.set()
        thread.join(timeout)
        return not thread.is_alive()

    def abandon(self) -> None:
        """In a forked child: drop everything, never touch the parent's files."""
        self.closed = True
        self._pending.clear()
        self._thread = None
        for sink in self.sinks:
            abandon = getattr(sink, "abandon", None)
            if abandon is not None:
                abandon()

    # -- worker -----------------------------------------------------------------------------------
    def _worker_failed(self, err: BaseException) -> None:
        """The worker ended on an error outside any chunk's write (counted, said once)."""
        self.errors += 1
        print(f"copytrace: export thread stopped: {type(err).__name__}: {err}", file=sys.stderr)

    def _work(self) -> None:
        while True:
            tidy()  # after each write, and after each wait (a hook set on every thread)
            self._wake.wait()
            self._wake.clear()
            tidy()
            while self._pending:
                if self._write_one(self._pending.popleft()):
                    return

    def _write_one(self, chunk: Chunk) -> bool:
        """Write a chunk on the worker (its records are freed on return, not kept by the
        worker's frame until the next chunk comes); True once the final chunk is written."""
        try:
            self.write_now(chunk)
        except Exception as err:  # never let the export thread die
            self.errors += 1
            print(f"copytrace: export failed: {type(err).__name__}: {err}", file=sys.stderr)
        self._progress.set()
        if chunk.final is not None:
            self._close_sinks()
            return True
        return False

    def write_now(self, chunk: Chunk) -> None:
        """Plan ``chunk`` and write it to every sink, on the calling thread."""
        if self.closed:
            return
        t0 = time.perf_counter()
        if chunk.final is not None:
            self._end_ns = chunk.final.end_ns
        live = [i for i in range(len(self.sinks)) if i not in self._failed]
        items: Iterable[PlanItem | PlanRun] = self._plan(chunk)
        if len(live) > 1:
            items = list(items)  # one plan, the same ids in every sink
        for i in live:
            sink = self.sinks[i]
            mine = items if getattr(sink, "takes_runs", False) else expand(items)
            self._call(i, sink.write, mine, chunk, self._held_parents)
        self.export_seconds += time.perf_counter() - t0
        if chunk.then is not None:
            try:
                chunk.then()
            except Exception as err:
                self.errors += 1
                print(f"copytrace: after a flush: {type(err).__name__}: {err}", file=sys.stderr)

    def _held_parents(self) -> set[str]:
        """Parent span ids that held-back events will still need."""
        return {parent for _, parent in self._held.values()}

    def _plan(self, chunk: Chunk) -> Iterator[PlanItem | PlanRun]:
        """Span ids and parents: steps under the run, events under their step or their
        deepcopy group; held events are planned now and written when they come back. The
        ``open_step``'s span id is planned at its first chunk and its span written with the
        chunk that ends it.
        Lazy, so that a big chunk costs no memory per event here. A block of events with no
        group, no group's child and none held is one :class:`PlanRun`."""
        run_id = self.run.span_hex
        step_ids: dict[int, str] = {}
        for step in chunk.steps:  # a step cut by a flush by count has its id already
            sid = self._open.pop(step[0], None) or os.urandom(8).hex()
            step_ids[step[0]] = sid
            yield (sid, run_id, None, step)
        if chunk.open_step is not None:
            sid = self._open.setdefault(chunk.open_step, os.urandom(8).hex())
            step_ids[chunk.open_step] = sid
        groups: dict[int, str] = {}
        held = chunk.held
        events = chunk.events
        for base in range(0, len(events), 4096):
            hexids = os.urandom(8 * 4096).hex()
            block = events[base : base + 4096]
            run = None if held else _plain_run(block, hexids, step_ids, run_id)
            if run is not None:
                yield run
                continue
            k = 0
            for ev in block:
                sid = hexids[k : k + 16]
                k += 16
                parent = groups.get(ev.parent) if ev.parent is not None and ev.parent >= 0 else None
                if parent is None:
                    parent = step_ids.get(ev.step, run_id)
                if ev.group:
                    groups[ev.seq] = sid
                if held and id(ev) in held:
                    self._held[id(ev)] = (sid, parent)
                    continue
                yield (sid, parent, ev, None)
        for ev in chunk.late:
            planned = self._held.pop(id(ev), None)
            if planned is not None:
                yield (planned[0], planned[1], ev, None)
        for record in chunk.compiled:  # compiled calls under their step; graphs under the run
            yield (os.urandom(8).hex(), step_ids.get(record.step, run_id), record, None)

    def _call(self, i: int, fn: Callable[..., Any], *args: Any) -> None:
        if i in self._failed:
            return
        try:
            fn(*args)
        except Exception as err:
            self.errors += 1
            self._failed.add(i)
            name = type(self.sinks[i]).__name__
            print(f"copytrace: export to {name} failed, stopped: {type(err).__name__}: {err}",
                  file=sys.stderr)  # fmt: skip

    def _close_sinks(self) -> None:
        if self.closed:
            return
        self.closed = True
        find, end_ns = self.hazards, self._end_ns
        if find is None or end_ns is None:
            for i, sink in enumerate(self.sinks):
                self._call(i, sink.close)
            self._done_sinks()
            return
        files = [i for i, sink in enumerate(self.sinks) if sink.closes_before_hazards]
        for i in files:  # the analysis reads the finished file
            self._call(i, self.sinks[i].close)
        try:
            findings = [f if isinstance(f, Mapping) else f.as_dict() for f in find()]
        except Exception as err:  # hazards are advisory
            self.errors += 1
            print(f"copytrace: hazard analysis failed: {type(err).__name__}: {err}",
                  file=sys.stderr)  # fmt: skip
            findings = []
        if findings:
            span_id = os.urandom(8).hex()
            for i, sink in enumerate(self.sinks):
                self._call(i, sink.write_hazards, findings, span_id, end_ns)
        for i, sink in enumerate(self.sinks):
            if i not in files:
                self._call(i, sink.close)
        self._done_sinks()

    def _done_sinks(self) -> None:
        for i, sink in enumerate(self.sinks):
            done = getattr(sink, "done", None)
            if done is not None:
                self._call(i, done)
        self._progress.set()


_GROUP, _PARENT, _STEP = attrgetter("group"), attrgetter("parent"), attrgetter("step")


def _plain_run(block: Sequence[CopyEvent], hexids: str, step_ids: dict[int, str],
               run_id: str) -> PlanRun | None:  # fmt: skip
    """``block`` as a :class:`PlanRun` (each event under its step, else the run), or None
    when one of its events is a deepcopy group or a group's child."""
    if any(map(_GROUP, block)):
        return None
    if any(p is not None and p >= 0 for p in set(map(_PARENT, block))):
        return None
    ids = [hexids[k : k + 16] for k in range(0, 16 * len(block), 16)]
    parents = list(map(step_ids.get, map(_STEP, block), repeat(run_id)))
    return PlanRun(ids, parents, list(block))


def epoch_offset() -> int:
    """ns to add to ``time.perf_counter_ns()`` to get ns since the Unix epoch."""
    return time.time_ns() - time.perf_counter_ns()
