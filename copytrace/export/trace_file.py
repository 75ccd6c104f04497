"""The trace file: OTLP/JSON lines written in whole lines, plain or gzip, compressed on a
thread of its own (:class:`TraceFile`), and :class:`OtlpJsonFileExporter`, which writes the
same format from any ``TracerProvider``. The file sink (:mod:`copytrace.export.file_sink`)
writes the tracer's spans into a :class:`TraceFile`.
"""

from __future__ import annotations

import gzip
import os
import queue
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from copytrace.export._osthread import OsThread, tidy
from copytrace.export.otlp_json import encode_span_lines

__all__ = ["GZIP_LEVEL", "OtlpJsonFileExporter", "TraceFile", "gzip_writer"]

#: The trace file's gzip level: the fastest. On copytrace's OTLP/JSON (about 1.8 kB per copy
#: event) zlib's level 6 takes about 3x longer than level 1 for files about 1.8x smaller
#: (32 against 57 bytes per event in ``benchmarks/per_event.py``); at level 6, compressing
#: alone took longer than the whole exit's budget (1 s per 100k events). At levels 0-3 the
#: file is written with ISA-L's deflate (:func:`gzip_writer`).
GZIP_LEVEL = 1


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
            return igzip.IGzipFile(
                filename="", mode="wb", fileobj=raw, compresslevel=level, mtime=0
            )
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
        self._lines = 0
        self._bytes = 0
        self._later = [0, 0]  # lines and bytes made on the gzip thread (write_later)
        #: Bytes in the file after the last :meth:`flush` or :meth:`close`.
        self.size = 0
        self._closed = False
        self._thread: OsThread | None = None
        self._queue: queue.Queue[Any] = queue.Queue()
        self._error: BaseException | None = None

    @property
    def lines(self) -> int:
        """Lines written (those of :meth:`write_later` once made)."""
        return self._lines + self._later[0]

    @property
    def bytes_uncompressed(self) -> int:
        """Bytes of lines written, before compression (as :attr:`lines`)."""
        return self._bytes + self._later[1]

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
        self._lines += lines
        self._bytes += nbytes
        if fh is not self._gz or (self._thread is None and not self._start_thread()):
            for part in parts:
                fh.write(part)
            return
        self._queue.put((fh, parts))  # waits while MAX_PENDING blocks are queued

    def write_later(self, make: Callable[[], tuple[list[Any], int, int]]) -> None:
        """Write the lines that ``make()`` returns, as ``(parts, lines, bytes)`` of
        :meth:`write_parts`, after those already handed over: on the gzip thread where it
        runs (``make`` may then run while the caller goes on: the spans' text, written in C
        with the GIL released, is encoded there while the export thread reads the next
        records), else now. An error of ``make`` is raised as a write error is."""
        if self._closed:
            return
        fh = self._gz or (self._raw if self.compression != "gzip" else None) or self._open()
        if fh is not self._gz or (self._thread is None and not self._start_thread()):
            self.write_parts(*make())
            return
        self._queue.put((fh, make))

    def _start_thread(self) -> bool:
        """The gzip thread, a bare OS thread the program cannot see
        (:class:`~copytrace.export._osthread.OsThread`); False where none can start
        (interpreter shutdown)."""
        self._queue = queue.Queue(self.MAX_PENDING)
        thread = OsThread(self._compress, "copytrace-gzip", self._failed)
        if not thread.start():
            return False
        self._thread = thread
        return True

    def _failed(self, err: BaseException) -> None:
        """Re-raised by :meth:`_drain` on the writing thread."""
        self._error = err

    def _compress(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                tidy()
                if self._error is None:
                    parts = item[1]
                    if callable(parts):  # write_later's
                        parts, lines, nbytes = parts()
                        self._later[0] += lines
                        self._later[1] += nbytes
                    for part in parts:
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
