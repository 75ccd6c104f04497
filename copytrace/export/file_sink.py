"""The file sink: the tracer's spans as the trace file's OTLP/JSON lines.

:class:`FileSink` is the pipeline's sink for the trace file (a
:class:`~copytrace.export.trace_file.TraceFile`): one ``ExportTraceServiceRequest`` per line
and at most :data:`~copytrace.export.otlp_json.MAX_LINE_BYTES` per line, gzip-compressed by
default (level :data:`GZIP_LEVEL`, on a thread of its own), encoded straight from the events
without SDK span objects: runs of copy events in bulk from their Arrow columns
(:mod:`copytrace.export.columnar`; their text is written on the gzip thread), the other
spans one at a time (:class:`~copytrace.export.otlp_json.Encoder`); each flush's rows also
go to the columnar sidecar (:mod:`copytrace.export.sidecar`), the bulk path's columns as
they are. The trace file's writer, and :class:`OtlpJsonFileExporter` (the same format from
any ``TracerProvider``), are in :mod:`copytrace.export.trace_file`.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NamedTuple

from copytrace._version import __version__
from copytrace.export.hazard_span import append_hazard_span
from copytrace.export.otlp_json import (
    MAX_LINE_BYTES,
    Encoder,
    event_attributes,
    iter_lines,
    request_frame,
)
from copytrace.export.pipeline import Chunk, PlanItem, PlanRun, RunIds, expand, span_times
from copytrace.export.trace_file import GZIP_LEVEL, OtlpJsonFileExporter, TraceFile, gzip_writer
from copytrace.schema import SCOPE_NAME, CopyEvent

if TYPE_CHECKING:
    from copytrace.export.sidecar import FlushRows

__all__ = ["BULK_EVENTS", "GZIP_LEVEL", "FileSink", "OtlpJsonFileExporter", "TraceFile",
           "gzip_writer", "trace_file_name"]  # fmt: skip

#: Copy events encoded together from their columns (bounds the memory of one flush's text).
BULK_EVENTS = 32768
#: Bytes of request lines handed to the trace file's gzip thread at once.
BLOCK_BYTES = 16 << 20


# --- file name ----------------------------------------------------------------------------------
def trace_file_name(pid: int | None = None, compression: str | None = None) -> str:
    """``copytrace-<host>-<pid>[-rank<N>].otlp.jsonl[.gz]`` for this process."""
    pid = os.getpid() if pid is None else pid
    rank = os.environ.get("RANK")
    suffix = f"-rank{rank}" if rank is not None and rank.isdigit() else ""
    host = socket.gethostname() or "host"
    ext = ".otlp.jsonl.gz" if compression == "gzip" else ".otlp.jsonl"
    return f"copytrace-{host}-{pid}{suffix}{ext}"



# --- the file sink: events -> OTLP/JSON text, no SDK objects ----------------------------------------
_COPY_EVENT = {CopyEvent}


class _Later(NamedTuple):
    """Lines to write once made: ``make()`` returns ``(parts, lines, bytes)``
    (:meth:`TraceFile.write_later`)."""

    make: Callable[[], tuple[list[Any], int, int]]


class _Run:
    """Copy events waiting for the bulk path: span ids, parents, records."""

    __slots__ = ("ids", "parents", "events")

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.parents: list[str] = []
        self.events: list[CopyEvent] = []

    def add(self, ids: list[str], parents: list[str], events: list[CopyEvent]) -> None:
        self.ids += ids
        self.parents += parents
        self.events += events

    def take(self, n: int | None = None) -> tuple[list[str], list[str], list[CopyEvent]]:
        """The first ``n`` (all) of them, removed."""
        n = len(self.events) if n is None else n
        out = (self.ids[:n], self.parents[:n], self.events[:n])
        del self.ids[:n], self.parents[:n], self.events[:n]
        return out


def _load_arrow(sidecar: bool) -> None:
    """Import the bulk path's and the sidecar's modules and let pyarrow look for pandas now,
    on the thread that starts the trace, with the program's warnings state kept
    (:func:`copytrace._warnstate.frozen_warnings`). pyarrow imports pandas the first time
    it converts a Python value (its pandas shim), and pandas' import sets filters about 50
    times: done on the export thread in the middle of a run, that made the program's
    once-per-location warnings show again (``docs/observer-effects.md``). A failure here
    is left to the export thread, which counts it."""
    from copytrace._warnstate import frozen_warnings

    try:
        with frozen_warnings():
            import pyarrow as pa

            from copytrace.export import columnar  # noqa: F401

            if sidecar:
                from copytrace.export import sidecar as _sidecar  # noqa: F401
            pa.scalar(0)  # the shim's one look for pandas (pyarrow's pandas-shim.pxi)
    except Exception:
        return


class FileSink:
    """Writes the trace file (see :class:`TraceFile`); spans encoded straight from events.
    A :class:`~copytrace.export.pipeline.Sink`.

    Args:
        path: the trace file.
        compression: ``"gzip"`` or ``None``.
        level: gzip level (default :data:`GZIP_LEVEL`).
        max_line_bytes: longest request line.
        sidecar: also write the columnar sidecar (:mod:`copytrace.export.sidecar`): the
            event table's rows of each flush, built from the flush's span attributes.
            Default: unless ``COPYTRACE_SIDECAR=0``.
        hazards_sidecar: where ``sidecar`` is off and runs are encoded in bulk, write the
            sidecar all the same for the pipeline's ``hazards`` hook, which reads the closed
            file's table, and remove it in :meth:`done`: the hook then reads the columns
            already built for the JSON text (a Parquet write, about 1.5 µs per event)
            instead of parsing the JSON file back (about 12 µs of CPU per event with
            pyarrow's JSON reader, more on its threads).
        bulk: encode runs of copy events from their columns
            (:mod:`copytrace.export.columnar`); False: one event at a time.
        extract: reads a run's fields in C for the bulk path
            (:data:`copytrace.export.columnar.Extract`, the tracer hands in the C++
            observer's); None: in Python.
        encode: writes a run's OTLP/JSON text in C from its columns
            (:data:`copytrace.export.columnar.Encode`, the tracer hands in the C++ observer's);
            None: with Arrow's string kernels.
    """

    #: The hazards hook reads the finished trace file.
    closes_before_hazards = True
    #: Takes :class:`~copytrace.export.pipeline.PlanRun` items as they are.
    takes_runs = True
    #: Writes a span's planned parent id as it is, whether that span is written yet or not.
    early_parents = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        compression: str | None = "gzip",
        level: int = GZIP_LEVEL,
        max_line_bytes: int = MAX_LINE_BYTES,
        sidecar: bool | None = None,
        hazards_sidecar: bool = False,
        bulk: bool = True,
        extract: Callable[..., Any] | None = None,
        encode: Callable[..., Any] | None = None,
    ) -> None:
        self.file = TraceFile(path, compression, level)
        self._max = max_line_bytes
        self._enc = Encoder()
        self._run: RunIds | None = None
        self._frame = ("", "")
        self._sidecar: Any = None
        if sidecar is None:
            sidecar = os.environ.get("COPYTRACE_SIDECAR", "1").strip() != "0"
        #: The sidecar stays beside the trace file (else one written is removed by done()).
        self._keep_sidecar = sidecar
        self._want_sidecar = sidecar or (hazards_sidecar and bulk)
        self._bulk = bulk
        self._extract = extract
        self._encode_c = encode
        self.sidecar_seconds = 0.0
        self.spans = 0
        if bulk or sidecar:
            _load_arrow(self._want_sidecar)

    @property
    def path(self) -> Path:
        return self.file.path

    def begin(self, run: RunIds) -> None:
        self._run = run
        self._frame = request_frame(run.resource.attributes, SCOPE_NAME, __version__)

    def write(
        self, items: Iterable[PlanItem | PlanRun], chunk: Chunk, keep: Callable[[], set[str]]
    ) -> None:
        rows = None
        if self._want_sidecar:
            from copytrace.export.sidecar import FlushRows

            rows = FlushRows()
        block: list[Any] = []
        size = lines = 0
        for parts in self._lines(items, chunk, rows):
            if type(parts) is _Later:  # a run's lines, made on the gzip thread
                self.file.write_parts(block, lines, size)
                block, size, lines = [], 0, 0
                self.file.write_later(parts.make)
                continue
            block += parts
            size += sum(map(len, parts))
            lines += 1
            if size >= BLOCK_BYTES:  # the gzip thread takes whole blocks
                self.file.write_parts(block, lines, size)
                block, size, lines = [], 0, 0
        self.file.write_parts(block, lines, size)
        self.file.flush()
        if rows is not None:
            self._to_sidecar(rows)

    def _lines(
        self, items: Iterable[PlanItem | PlanRun], chunk: Chunk, rows: FlushRows | None
    ) -> Iterator[tuple[Any, ...]]:
        """The chunk's request lines, each as its parts (bytes-like, the last one ending in
        ``\\n``): runs of copy events (up to :data:`BULK_EVENTS`) in
        bulk from their columns (:mod:`copytrace.export.columnar`), the other spans (and a
        run the bulk path does not take) one at a time."""
        run = _Run()
        other: list[PlanItem] = []
        for item in items:
            plain = type(item) is PlanRun and self._bulk
            if plain and set(map(type, item.events)) <= _COPY_EVENT:  # type: ignore[union-attr]
                if other:
                    yield from self._one_by_one(other, None, rows)
                    other = []
                run.add(item.ids, item.parents, item.events)
            elif (ev := item[2]) is not None and type(ev) is CopyEvent and self._bulk:
                if other:
                    yield from self._one_by_one(other, None, rows)
                    other = []
                run.add([item[0]], [item[1]], [ev])  # type: ignore[list-item]
            else:
                if run.events:
                    yield from self._bulk_lines(run.take(), rows)
                other.extend(expand([item]))
            while len(run.events) >= BULK_EVENTS:
                yield from self._bulk_lines(run.take(BULK_EVENTS), rows)
        if run.events:
            yield from self._bulk_lines(run.take(), rows)
        if other or chunk.final is not None:
            yield from self._one_by_one(other, chunk, rows)

    def _one_by_one(
        self, items: list[PlanItem], chunk: Chunk | None, rows: FlushRows | None
    ) -> Iterator[tuple[bytes]]:
        for line in iter_lines(*self._frame, self._encode(items, chunk, rows), self._max):
            yield ((line + "\n").encode("utf-8", "surrogatepass"),)

    def _bulk_lines(
        self, run: tuple[list[str], list[str], list[CopyEvent]], rows: FlushRows | None
    ) -> Iterator[tuple[Any, ...]]:
        """Lines of a run of copy events from their columns, as their parts (the spans a
        view of the texts' buffer, not copied); the sidecar gets the columns."""
        assert self._run is not None
        from copytrace.export import columnar

        r = self._run
        ids, parents, events = run
        batch = columnar.event_columns(events, r.trace_hex, ids, parents, r.start_ns, r.offset,
                                       self._extract)  # fmt: skip
        if batch is None:
            yield from self._one_by_one(list(zip(ids, parents, events, repeat(None))), None, rows)
            return
        self.spans += len(events)
        yield _Later(functools.partial(self._run_lines, batch))
        if rows is not None:
            rows.batch(batch)

    def _run_lines(self, batch: Any) -> tuple[list[Any], int, int]:
        """The request lines of a run's columns (:meth:`_bulk_lines`) as
        :meth:`TraceFile.write_later` takes them: all their parts, lines, bytes."""
        from copytrace.export import columnar

        assert self._run is not None
        texts = columnar.span_texts(batch, self._run.trace_hex, self._encode_c)
        flat: list[Any] = []
        lines = size = 0
        for parts in columnar.span_line_parts(*self._frame, texts, self._max):
            flat += parts
            lines += 1
            size += sum(map(len, parts))
        return flat, lines, size

    def _to_sidecar(self, rows: FlushRows | None, final: bool = False) -> None:
        """Hand a flush's rows to the sidecar writer (after the JSON lines are flushed);
        any trouble stops the sidecar (readers then parse the JSON), never the trace file."""
        t0 = time.perf_counter()
        try:
            from copytrace.export import sidecar as sc

            side = self._sidecar
            if side is None:
                assert self._run is not None
                side = self._sidecar = sc.SidecarWriter(
                    self.file.path, self._run.trace_hex, dict(self._run.resource.attributes)
                )
            if rows is not None:
                rows.done()
                trace = self._run.trace_hex if self._run is not None else ""
                for kind, seg in rows.segments:
                    if kind == "batch":
                        side.add(seg)
                    elif kind == "events":
                        side.add(sc.event_batch(trace, *seg))
                    else:
                        side.add_rows([sc.meta_row(*args) for args in seg])
            if final:
                side.close(self.file.size)
            else:
                side.commit(self.file.size)
        except Exception as err:
            self._want_sidecar = False
            print(f"copytrace: columnar sidecar of {self.file.path.name} stopped "
                  f"({type(err).__name__}: {err}); the trace file is complete", file=sys.stderr)
        self.sidecar_seconds += time.perf_counter() - t0

    def _encode(
        self, items: Iterable[PlanItem], chunk: Chunk | None, rows: FlushRows | None = None
    ) -> Iterator[str]:
        """Spans one at a time (``chunk``: its run span when it is the final one)."""
        run = self._run
        assert run is not None
        enc, trace, off = self._enc, run.trace_hex, run.offset
        for span_id, parent, ev, step in items:
            self.spans += 1
            if ev is not None and type(ev) is not CopyEvent:  # a compiled-region record
                args = (trace, span_id, parent, ev.span_name, ev.start_ns + off, ev.end_ns + off,
                        ev.span_attributes(), [(n, t + off, a) for n, t, a in ev.span_events()])
                if rows is not None:
                    rows.meta(*args)
                yield enc.span(*args[:7], None, args[7])
            elif ev is not None:
                start, end = span_times(ev, run.start_ns)
                attrs = event_attributes(ev)
                if rows is not None:
                    rows.event(span_id, parent, "copytrace." + ev.op, start + off, end + off, attrs)
                yield enc.span(trace, span_id, parent, "copytrace." + ev.op, start + off,
                               end + off, attrs, ev.error)  # fmt: skip
            elif step is not None:
                args = (trace, span_id, parent, "copytrace.step", step[1] + off, step[2] + off,
                        {"copytrace.step": step[0]})
                if rows is not None:
                    rows.meta(*args)
                yield enc.span(*args)
        final = chunk.final if chunk is not None else None
        if final is not None:
            self.spans += 1
            args = (trace, run.span_hex, None, "copytrace.run", run.start_ns + off,
                    final.end_ns + off, final.attributes)
            if rows is not None:
                rows.meta(*args)
            yield enc.span(*args, final.error)

    def close(self) -> None:
        self.file.close()
        if self._want_sidecar and self.file.size:
            self._to_sidecar(None, final=True)

    def done(self) -> None:
        """The run is finished, its hazards span written: remove the sidecar written only
        for the hazards hook (``hazards_sidecar``)."""
        if not self._keep_sidecar and self._sidecar is not None:
            self._sidecar.remove()

    def write_hazards(
        self, findings: Sequence[Mapping[str, Any]], span_id: str, end_ns: int
    ) -> None:
        """Append the run's ``copytrace.hazards`` span to the closed file."""
        assert self._run is not None
        append_hazard_span(self.path, self.file.compression, self._run, end_ns, findings,
                           span_id=span_id, gzip_open=self._gzip_member)  # fmt: skip

    def _gzip_member(self, raw: IO[bytes]) -> IO[bytes]:
        """A gzip member at the trace file's level and with its writer (:func:`gzip_writer`)."""
        return gzip_writer(raw, self.file.level)

    def abandon(self) -> None:
        self._want_sidecar = False
        self.file.abandon()
