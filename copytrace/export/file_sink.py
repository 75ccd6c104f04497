"""The trace file: OTLP/JSON lines written in whole lines, plain or gzip, and the file sink.

:class:`FileSink` is the pipeline's sink for the trace file: one ``ExportTraceServiceRequest``
per line and at most :data:`~copytrace.export.otlp_json.MAX_LINE_BYTES` per line,
gzip-compressed by default (level :data:`GZIP_LEVEL`, on a thread of its own), encoded
straight from the events without SDK span objects: runs of copy events in bulk from their
Arrow columns (:mod:`copytrace.export.columnar`), the other spans one at a time
(:class:`~copytrace.export.otlp_json.Encoder`); each flush's rows also go to the columnar
sidecar (:mod:`copytrace.export.sidecar`), the bulk path's columns as they are.
:class:`OtlpJsonFileExporter` writes the same format from any ``TracerProvider``.
"""

from __future__ import annotations

import gzip
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from copytrace._version import __version__
from copytrace.export.hazard_span import append_hazard_span
from copytrace.export.otlp_json import (
    MAX_LINE_BYTES,
    Encoder,
    encode_span_lines,
    event_attributes,
    iter_lines,
    request_frame,
)
from copytrace.export.pipeline import Chunk, PlanItem, PlanRun, RunIds, expand, span_times
from copytrace.schema import SCOPE_NAME, CopyEvent

if TYPE_CHECKING:
    from copytrace.export.sidecar import FlushRows

__all__ = ["BULK_EVENTS", "GZIP_LEVEL", "FileSink", "OtlpJsonFileExporter", "TraceFile",
           "gzip_writer", "trace_file_name"]  # fmt: skip

#: Copy events encoded together from their columns (bounds the memory of one flush's text).
BULK_EVENTS = 32768
#: The trace file's gzip level: the fastest. On copytrace's OTLP/JSON (about 1.8 kB per copy
#: event) zlib's level 6 takes about 3x longer than level 1 for files about 1.8x smaller
#: (32 against 57 bytes per event in ``benchmarks/per_event.py``); at level 6, compressing
#: alone took longer than the whole exit's budget (1 s per 100k events). At levels 0-3 the
#: file is written with ISA-L's deflate (:func:`gzip_writer`).
GZIP_LEVEL = 1
#: Bytes of request lines handed to the trace file's gzip thread at once.
BLOCK_BYTES = 16 << 20


def gzip_writer(raw: IO[bytes], level: int) -> gzip.GzipFile:
    """A gzip member written into ``raw``: at levels 0-3 with ISA-L's deflate (python-isal's
    ``igzip``, levels 0-3 only) where it is installed, else the standard library's zlib. The
    same gzip format either way; on the trace file's JSON, at level 1, ISA-L compresses in
    0.66 µs of CPU per event against 4.7 µs for zlib, into 52 against 72 bytes per event
    (``benchmarks/per_event.py``'s records)."""
    if level <= 3:
        try:
            from isal import igzip
        except ImportError:
            pass
        else:
            return igzip.IGzipFile(filename="", mode="wb", fileobj=raw, compresslevel=level, mtime=0)
    return gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=level, mtime=0)


class TraceFile:
    """An OTLP/JSON-lines file, plain or gzip, written in whole lines.

    Args:
        path: the file (created with its parent directory when first written; an existing
            file is replaced).
        compression: ``"gzip"`` or ``None``.
        level: gzip compression level (1 = fastest ... 9 = smallest).

    After each :meth:`flush` every line written so far is readable, also if the process is
    killed right after: a gzip file ends its gzip member at each flush and starts a new one
    at the next write (readers of concatenated gzip, ``zcat`` and the Collector read the
    members as one stream), so the file can also be read from any flush point on
    (:attr:`size`), which the columnar sidecar relies on.
    """

    #: Blocks of lines queued for the gzip thread before a write waits for it.
    MAX_PENDING = 2

    def __init__(
        self, path: str | os.PathLike[str], compression: str | None = "gzip", level: int = 6
    ) -> None:
        self.path = Path(path)
        self.compression = compression
        self.level = level
        self._raw: IO[bytes] | None = None
        self._gz: gzip.GzipFile | None = None
        self.lines = 0
        self.bytes_uncompressed = 0
        #: Bytes in the file after the last :meth:`flush` or :meth:`close`.
        self.size = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue[Any] = queue.Queue()
        self._error: BaseException | None = None

    def _open(self) -> IO[bytes]:
        if self._raw is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._raw = open(self.path, "wb")  # noqa: SIM115 - closed by close()
        if self.compression == "gzip":
            self._gz = gzip_writer(self._raw, self.level)
            return self._gz
        return self._raw

    def write_lines(self, lines: Sequence[str]) -> None:
        if lines:
            self.write_bytes(("\n".join(lines) + "\n").encode("utf-8", "surrogatepass"))

    def write_bytes(self, data: bytes) -> None:
        """Write whole lines already encoded (each ending in ``\\n``)."""
        if data:
            self.write_parts([data], data.count(b"\n"), len(data))

    def write_parts(self, parts: Sequence[Any], lines: int, nbytes: int) -> None:
        """Write ``parts`` (bytes-like objects, in order: ``lines`` whole lines of ``nbytes``
        bytes in all), as they are: no joined copy. A gzip file compresses them on its own
        thread (``copytrace-gzip``: ISA-L and zlib release the GIL, so the encoding of the
        next lines goes on meanwhile), which holds the parts until they are written;
        :meth:`flush` waits for it, and re-raises its error."""
        if not parts or self._closed:
            return
        fh = self._gz or (self._raw if self.compression != "gzip" else None) or self._open()
        self.lines += lines
        self.bytes_uncompressed += nbytes
        if fh is not self._gz or (self._thread is None and not self._start_thread()):
            for part in parts:
                fh.write(part)
            return
        self._queue.put((fh, parts))  # waits while MAX_PENDING blocks are queued

    def _start_thread(self) -> bool:
        """The gzip thread; False where no thread can start (interpreter shutdown)."""
        self._queue = queue.Queue(self.MAX_PENDING)
        thread = threading.Thread(target=self._compress, name="copytrace-gzip", daemon=True)
        try:
            thread.start()
        except RuntimeError:
            return False
        self._thread = thread
        return True

    def _compress(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None:
                    for part in item[1]:
                        item[0].write(part)
            except BaseException as err:  # re-raised by _drain on the writing thread
                self._error = err
            finally:
                self._queue.task_done()

    def _drain(self) -> None:
        """Wait for the gzip thread's writes; raise its error."""
        if self._thread is not None:
            self._queue.join()
        err, self._error = self._error, None
        if err is not None:
            raise err

    def flush(self) -> None:
        self._drain()
        if self._gz is not None:
            self._gz.close()  # ends the member; the raw file stays open
            self._gz = None
        if self._raw is not None:
            self._raw.flush()
            self.size = self._raw.tell()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._drain()
            self._closed = True
            if self._gz is not None:
                self._gz.close()
        finally:
            self._closed = True
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join()
                self._thread = None
            if self._raw is not None:
                self.size = self._raw.tell()
                self._raw.close()

    def abandon(self) -> None:
        """In a forked child: never write to (or close into) the parent's file again."""
        self._closed = True
        self._thread = None  # the parent's gzip thread: none in this child
        raw = self._raw
        if raw is None:
            return
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, raw.fileno())  # the child's copy of the descriptor only
            os.close(devnull)
        except (OSError, ValueError):
            pass


class OtlpJsonFileExporter(SpanExporter):
    """An SDK span exporter that writes OTLP/JSON lines (for any ``TracerProvider``).

    Args:
        path: the file to write (replaced if present).
        compression: ``None`` (default) or ``"gzip"``.

    Each export is written as whole lines of at most :data:`MAX_LINE_BYTES` and flushed, so a
    process killed mid-run leaves every earlier batch readable.
    """

    def __init__(self, path: str | os.PathLike[str], compression: str | None = None) -> None:
        self.path = Path(path)
        self._file = TraceFile(self.path, compression)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        try:
            self._file.write_lines(encode_span_lines(spans))
            self._file.flush()
        except OSError as err:
            print(f"copytrace: cannot write {self.path}: {err}", file=sys.stderr)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self._file.flush()
        return True


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
        texts = columnar.span_texts(batch, r.trace_hex, self._encode_c)
        yield from columnar.span_line_parts(*self._frame, texts, self._max)
        if rows is not None:
            rows.batch(batch)

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
