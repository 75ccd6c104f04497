"""Cold path: recorded events become OpenTelemetry spans, off the hot path.

The span model and the attributes are documented in ``docs/trace-format.md``. The torch
modes only append :class:`~copytrace.schema.CopyEvent` records. At step boundaries
(every ``flush_events`` records or ``flush_seconds``) and when tracing stops, the session
hands the buffered records to an :class:`ExportPipeline`, whose worker thread turns them into
spans for each *sink*:

* :class:`FileSink` writes the trace file: OTLP/JSON lines, one ``ExportTraceServiceRequest``
  per line and at most :data:`MAX_LINE_BYTES` per line (the Collector's ``otlpjsonfile``
  receiver reads lines up to 1 MiB by default), gzip-compressed by default. It encodes events
  straight to OTLP/JSON text with cached attribute fragments, without building SDK span
  objects: 2.5 s per 100k events with gzip, against 7 s to build the SDK spans alone (and
  about 20 s for the former path, SDK spans then a generic JSON encoder).
* :class:`SdkSink` builds real SDK spans (explicit ids, parents and timestamps) with a
  ``TracerProvider``: copytrace's private one, feeding SDK span exporters (OTLP over HTTP or
  gRPC, console, any ``SpanExporter``), or a provider the user supplied (used as is: never
  replaced, never shut down, only flushed).

The worker plans each chunk once (:meth:`ExportPipeline._plan`: span ids, parents), so every
sink writes the same span tree, with the same ids when copytrace's own provider is used.

OTLP/JSON as the specification requires: hex trace and span ids (not base64), 64-bit
integers as decimal strings, lowerCamelCase keys, enums as integers.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import random
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from opentelemetry.trace.status import Status, StatusCode

from copytrace import schema as _schema
from copytrace.schema import CopyEvent

__all__ = [
    "Chunk",
    "ExportPipeline",
    "FileSink",
    "MAX_LINE_BYTES",
    "OtlpJsonFileExporter",
    "RunEnd",
    "RunIds",
    "SdkSink",
    "TraceFile",
    "encode_span_lines",
    "encode_spans",
    "event_attributes",
    "export_events",
    "exporters_from_env",
    "make_resource",
    "trace_file_name",
]

SCOPE_NAME = "copytrace"
#: Longest line written (bytes of UTF-8 JSON): the OpenTelemetry Collector's ``otlpjsonfile``
#: receiver reads lines up to ``max_log_size`` (1 MiB by default) and cuts longer ones.
MAX_LINE_BYTES = 1_000_000
_INT64 = (-(2**63), 2**63 - 1)
_STATUS_ERROR = 2  # OTLP STATUS_CODE_ERROR


# --- OTLP/JSON encoding of SDK spans (generic) --------------------------------------------------
def _any_value(value: Any) -> dict[str, Any]:
    """One OTLP/JSON ``AnyValue`` as a dict."""
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        if _INT64[0] <= value <= _INT64[1]:
            return {"intValue": str(value)}
        return {"stringValue": str(value)}  # not representable as int64
    if isinstance(value, float):
        if math.isfinite(value):
            return {"doubleValue": value}
        # proto3 JSON spells non-finite doubles as strings
        return {
            "doubleValue": "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
        }
    if isinstance(value, str):
        return {"stringValue": value}
    if isinstance(value, (list, tuple)):
        return {"arrayValue": {"values": [_any_value(v) for v in value]}}
    return {"stringValue": str(value)}


def _attributes(attrs: Any) -> list[dict[str, Any]]:
    if not attrs:
        return []
    return [{"key": k, "value": _any_value(v)} for k, v in attrs.items()]


def _span_json(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.context
    out: dict[str, Any] = {
        "traceId": format(ctx.trace_id, "032x"),
        "spanId": format(ctx.span_id, "016x"),
        "name": span.name,
        "kind": span.kind.value + 1,  # SDK INTERNAL=0 -> OTLP SPAN_KIND_INTERNAL=1
        "startTimeUnixNano": str(span.start_time),
        "endTimeUnixNano": str(span.end_time),
    }
    if span.parent is not None:
        out["parentSpanId"] = format(span.parent.span_id, "016x")
    if span.attributes:
        out["attributes"] = _attributes(span.attributes)
    if span.events:
        out["events"] = [
            {
                "timeUnixNano": str(e.timestamp),
                "name": e.name,
                "attributes": _attributes(e.attributes),
            }
            for e in span.events
        ]
    code = span.status.status_code.value
    if code:
        out["status"] = {"code": code}
        if span.status.description:
            out["status"]["message"] = span.status.description
    return out


def _group_spans(
    spans: Sequence[ReadableSpan],
) -> list[tuple[Resource, list[tuple[tuple[str, str], list[ReadableSpan]]]]]:
    by_resource: dict[int, tuple[Resource, dict[tuple[str, str], list[ReadableSpan]]]] = {}
    for span in spans:
        resource = span.resource
        entry = by_resource.setdefault(id(resource), (resource, {}))
        scope = span.instrumentation_scope
        key = (scope.name, scope.version or "") if scope is not None else (SCOPE_NAME, "")
        entry[1].setdefault(key, []).append(span)
    return [(res, list(scopes.items())) for res, scopes in by_resource.values()]


def encode_spans(spans: Sequence[ReadableSpan]) -> dict[str, Any]:
    """Encode finished spans as one OTLP/JSON ``ExportTraceServiceRequest`` dict.

    Spans are grouped by resource and instrumentation scope, as OTLP requires.
    """
    return {
        "resourceSpans": [
            {
                "resource": {"attributes": _attributes(resource.attributes)},
                "scopeSpans": [
                    {
                        "scope": {"name": name, "version": version},
                        "spans": [_span_json(s) for s in items],
                    }
                    for (name, version), items in scopes
                ],
            }
            for resource, scopes in _group_spans(spans)
        ]
    }


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _request_frame(resource_attrs: Any, scope: str, version: str) -> tuple[str, str]:
    """Head and tail of one ``ExportTraceServiceRequest`` line around its spans."""
    head = (
        '{"resourceSpans":[{"resource":{"attributes":'
        + _dumps(_attributes(resource_attrs))
        + '},"scopeSpans":[{"scope":'
        + _dumps({"name": scope, "version": version})
        + ',"spans":['
    )
    return head, "]}]}]}"


def iter_lines(
    head: str, tail: str, spans: Iterable[str], max_bytes: int = MAX_LINE_BYTES
) -> Iterator[str]:
    """Join encoded spans into request lines of at most ``max_bytes`` characters each (the
    encoding is ASCII: characters are bytes; a single span longer than that gets a line of
    its own). Lazy: memory is one line, whatever the number of spans."""
    room = max_bytes - len(head) - len(tail)
    batch: list[str] = []
    size = 0
    for s in spans:
        n = len(s) + 1
        if batch and size + n > room:
            yield head + ",".join(batch) + tail
            batch, size = [], 0
        batch.append(s)
        size += n
    if batch:
        yield head + ",".join(batch) + tail


def pack_lines(
    head: str, tail: str, spans: Iterable[str], max_bytes: int = MAX_LINE_BYTES
) -> list[str]:
    """:func:`iter_lines` as a list."""
    return list(iter_lines(head, tail, spans, max_bytes))


def encode_span_lines(spans: Sequence[ReadableSpan], max_bytes: int = MAX_LINE_BYTES) -> list[str]:
    """Encode finished SDK spans as OTLP/JSON request lines of at most ``max_bytes``."""
    lines: list[str] = []
    for resource, scopes in _group_spans(spans):
        for (name, version), items in scopes:
            head, tail = _request_frame(resource.attributes, name, version)
            lines.extend(pack_lines(head, tail, (_dumps(_span_json(s)) for s in items), max_bytes))
    return lines


# --- the trace file ------------------------------------------------------------------------------
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

    def _open(self) -> IO[bytes]:
        if self._raw is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._raw = open(self.path, "wb")  # noqa: SIM115 - closed by close()
        if self.compression == "gzip":
            self._gz = gzip.GzipFile(
                filename="", mode="wb", fileobj=self._raw, compresslevel=self.level, mtime=0
            )
            return self._gz
        return self._raw

    def write_lines(self, lines: Sequence[str]) -> None:
        if not lines or self._closed:
            return
        fh = self._gz or (self._raw if self.compression != "gzip" else None) or self._open()
        data = ("\n".join(lines) + "\n").encode("utf-8", "surrogatepass")
        fh.write(data)
        self.lines += len(lines)
        self.bytes_uncompressed += len(data)

    def flush(self) -> None:
        if self._gz is not None:
            self._gz.close()  # ends the member; the raw file stays open
            self._gz = None
        if self._raw is not None:
            self._raw.flush()
            self.size = self._raw.tell()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._gz is not None:
                self._gz.close()
        finally:
            if self._raw is not None:
                self.size = self._raw.tell()
                self._raw.close()

    def abandon(self) -> None:
        """In a forked child: never write to (or close into) the parent's file again."""
        self._closed = True
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


class _BatchingProcessor(SpanProcessor):
    """Synchronous batching: exports every ``batch`` ended spans, and the rest on flush.

    The SDK's BatchSpanProcessor drops spans when its queue fills faster than its worker
    drains it, which is exactly what building thousands of spans in a loop does; this one
    never drops (it runs on copytrace's export thread, never on the traced one). An exporter
    that keeps failing is given up after ``max_failures`` batches in a row; the spans it did
    not take are counted in ``lost``.
    """

    def __init__(self, exporter: SpanExporter, batch: int = 512, max_failures: int = 3) -> None:
        self._exporter = exporter
        self._batch = max(1, batch)
        self._spans: list[ReadableSpan] = []
        self._failures = 0
        self._max_failures = max_failures
        self.exported = 0
        self.lost = 0
        self.gave_up = False

    def on_end(self, span: ReadableSpan) -> None:
        self._spans.append(span)
        if len(self._spans) >= self._batch:
            self.force_flush()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        spans, self._spans = self._spans, []
        if not spans:
            return True
        if self.gave_up:
            self.lost += len(spans)
            return False
        try:
            ok = self._exporter.export(spans) == SpanExportResult.SUCCESS
        except Exception as err:  # an exporter must not break the export thread
            print(f"copytrace: {type(self._exporter).__name__} failed: {err}", file=sys.stderr)
            ok = False
        if ok:
            self._failures = 0
            self.exported += len(spans)
            return True
        self.lost += len(spans)
        self._failures += 1
        if self._failures >= self._max_failures:
            self.gave_up = True
            print(
                f"copytrace: giving up on {type(self._exporter).__name__} after "
                f"{self._failures} failed exports in a row; the trace file is not affected",
                file=sys.stderr,
            )
        return False

    def shutdown(self) -> None:
        self.force_flush()
        try:
            self._exporter.shutdown()
        except Exception as err:
            print(f"copytrace: {type(self._exporter).__name__} shutdown: {err}", file=sys.stderr)


# --- file name and resource ------------------------------------------------------------------------
def trace_file_name(pid: int | None = None, compression: str | None = None) -> str:
    """``copytrace-<host>-<pid>[-rank<N>].otlp.jsonl[.gz]`` for this process."""
    pid = os.getpid() if pid is None else pid
    rank = os.environ.get("RANK")
    suffix = f"-rank{rank}" if rank is not None and rank.isdigit() else ""
    host = socket.gethostname() or "host"
    ext = ".otlp.jsonl.gz" if compression == "gzip" else ".otlp.jsonl"
    return f"copytrace-{host}-{pid}{suffix}{ext}"


#: torchrun / torch.distributed variables -> resource attributes (no semantic convention
#: exists for them).
_DIST_ENV = (
    ("RANK", "copytrace.rank"),
    ("LOCAL_RANK", "copytrace.local_rank"),
    ("WORLD_SIZE", "copytrace.world_size"),
    ("LOCAL_WORLD_SIZE", "copytrace.local_world_size"),
    ("GROUP_RANK", "copytrace.group_rank"),
)


def make_resource(extra: dict[str, Any] | None = None) -> Resource:
    """The process's resource: service, process, host, rank; merged with ``OTEL_*``.

    ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME`` are applied by the SDK
    (``OTEL_SERVICE_NAME`` wins over everything; copytrace's own values win over
    ``OTEL_RESOURCE_ATTRIBUTES``, except ``service.name``, which copytrace only defaults).

    Build it while the interpreter is running normally: the SDK's resource detectors use a
    thread pool, which refuses work during interpreter shutdown (``atexit``).
    """
    attrs: dict[str, Any] = {
        "process.pid": os.getpid(),
        "process.executable.path": sys.executable,
        "process.command_args": [str(a) for a in getattr(sys, "orig_argv", sys.argv)],
        "process.runtime.name": sys.implementation.name,
        "process.runtime.version": sys.version.split()[0],
        "host.name": socket.gethostname(),
    }
    for env, key in _DIST_ENV:
        value = os.environ.get(env)
        if value is not None and value.isdigit():
            attrs[key] = int(value)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id:
        attrs["copytrace.torchelastic_run_id"] = run_id
    attrs.update(extra or {})
    resource = Resource.create(attrs)
    if "service.name" not in (extra or {}) and not os.environ.get("OTEL_SERVICE_NAME"):
        name = resource.attributes.get("service.name")
        if not name or str(name).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": "copytrace"}))
    return resource


# --- event attributes ------------------------------------------------------------------------------
_STR_FIELDS = _schema.STR_FIELDS
_SCALAR_FIELDS = _schema.SCALAR_FIELDS
_ANALYSIS_FIELDS = _schema.ANALYSIS_FIELDS
_OMITTED_DEFAULTS = _schema.OMITTED_DEFAULTS
_KEEP = object()


def _event_attributes_source() -> str:
    """Source of :func:`event_attributes`: one straight-line test per field, with each
    omitted default resolved when the module loads (about 4x faster than looping over the
    field tables with getattr; it runs once per exported event)."""
    lines = ["def event_attributes(ev):", "    attrs = {}"]
    for i, (field, key) in enumerate(_STR_FIELDS):
        lines.append(f"    v = ev.{field}")
        test = "v" if key not in _OMITTED_DEFAULTS else f"v and v != _D[{i}]"
        lines.append(f"    if {test}:\n        attrs[{key!r}] = v")
    for i, (field, key) in enumerate(_SCALAR_FIELDS, len(_STR_FIELDS)):
        lines.append(f"    v = ev.{field}")
        test = "v is not None"
        if key in _OMITTED_DEFAULTS:
            test += f" and (v != _D[{i}] or type(v) is not type(_D[{i}]))"
        if key == "copytrace.pinned":  # written on host-to-device copies only
            test += ' and ev.transfer == "h2d"'
        lines.append(f"    if {test}:\n        attrs[{key!r}] = v")
    for field, key in _ANALYSIS_FIELDS:
        lines.append(f"    v = ev.{field}")
        lines.append("    if v is not None and v is not False and v != ():")
        lines.append(f"        attrs[{key!r}] = list(v) if isinstance(v, tuple) else v")
    lines += [
        "    if ev.aten:",
        '        attrs["copytrace.aten"] = list(ev.aten)',
        "    if ev.shape:",
        '        attrs["copytrace.shape"] = list(ev.shape)',
        "    if ev.group:",
        '        attrs["copytrace.group"] = True',
        '        attrs["copytrace.tensors"] = ev.tensors',
        "    return attrs",
    ]
    return "\n".join(lines) + "\n"


def _make_event_attributes() -> Any:
    defaults = [_OMITTED_DEFAULTS.get(key) for _, key in _STR_FIELDS + _SCALAR_FIELDS]
    namespace: dict[str, Any] = {"_D": tuple(defaults)}
    exec(_event_attributes_source(), namespace)  # noqa: S102
    fn = namespace["event_attributes"]
    fn.__doc__ = (
        "Span attributes of one event (absent values, empty lists and the values in "
        "``_OMITTED_DEFAULTS`` are left out; ``copytrace.pinned`` on host-to-device copies "
        "only)."
    )
    fn.__module__ = __name__
    return fn


event_attributes = _make_event_attributes()


# --- the span plan ---------------------------------------------------------------------------------
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
        compiled: compiled-region records (``copytrace.tracer._compiled``): calls, and on the
            last chunk the compiled graphs; each has ``span_name``, ``span_attributes()``,
            ``span_events()``, ``start_ns``, ``end_ns`` and ``step``.
    """

    __slots__ = ("events", "steps", "held", "late", "final", "submitted", "compiled")

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


#: One planned span: (span id hex, parent span id hex, event or None, step tuple or None).
PlanItem = tuple[str, str, "CopyEvent | None", "tuple[int, int, int] | None"]


def _times(ev: CopyEvent, fallback: int) -> tuple[int, int]:
    start = ev.start_ns if ev.start_ns is not None else fallback
    end = ev.end_ns if ev.end_ns is not None else max(start, fallback)
    return start, max(start, end)


# --- the file sink: events -> OTLP/JSON text, no SDK objects ----------------------------------------
class _Encoder:
    """Encodes spans to OTLP/JSON text with cached attribute fragments."""

    _LIMIT = 65536

    def __init__(self) -> None:
        self._frags: dict[tuple[str, type, Any], str] = {}
        self._keys: dict[str, str] = {}
        self._names: dict[str, str] = {}

    def _key(self, key: str) -> str:
        prefix = self._keys.get(key)
        if prefix is None:
            prefix = self._keys[key] = '{"key":' + json.dumps(key) + ',"value":'
        return prefix

    def attr(self, key: str, value: Any) -> str:
        t = type(value)
        if t is int:
            if _INT64[0] <= value <= _INT64[1]:
                return self._key(key) + '{"intValue":"' + str(value) + '"}}'
            return self._key(key) + '{"stringValue":"' + str(value) + '"}}'
        ck = (key, t, tuple(value) if t is list else value)
        try:
            frag = self._frags.get(ck)
        except TypeError:  # unhashable value
            return self._key(key) + _dumps(_any_value(value)) + "}"
        if frag is None:
            if len(self._frags) >= self._LIMIT:
                self._frags.clear()
            frag = self._frags[ck] = self._key(key) + _dumps(_any_value(value)) + "}"
        return frag

    def attrs(self, attrs: dict[str, Any]) -> str:
        attr = self.attr
        return ",".join([attr(k, v) for k, v in attrs.items()])

    def name(self, name: str) -> str:
        out = self._names.get(name)
        if out is None:
            out = self._names[name] = json.dumps(name)
        return out

    def span(
        self,
        trace: str,
        span_id: str,
        parent: str | None,
        name: str,
        start: int,
        end: int,
        attrs: dict[str, Any],
        error: str | None = None,
        events: Sequence[tuple[str, int, dict[str, Any]]] = (),
    ) -> str:
        parts = ['{"traceId":"', trace, '","spanId":"', span_id]
        if parent:
            parts += ['","parentSpanId":"', parent]
        parts += ['","name":', self.name(name), ',"kind":1,"startTimeUnixNano":"', str(start),
                  '","endTimeUnixNano":"', str(end), '"']  # fmt: skip
        if attrs:
            parts += [',"attributes":[', self.attrs(attrs), "]"]
        if error:
            parts += [',"status":{"code":2,"message":', json.dumps(error), "}"]
        if events:
            parts.append(',"events":[')
            parts.append(",".join(
                '{"timeUnixNano":"' + str(t) + '","name":' + self.name(n)
                + ',"attributes":[' + self.attrs(a) + "]}"
                for n, t, a in events
            ))  # fmt: skip
            parts.append("]")
        parts.append("}")
        return "".join(parts)


class _SidecarRows:
    """One flush's spans for the columnar sidecar, in file order: runs of copy events (span
    ids, parents, names, times, span attributes), the other spans as ``meta_row`` arguments."""

    __slots__ = ("segments", "ids", "parents", "names", "starts", "ends", "attrs")

    def __init__(self) -> None:
        self.segments: list[tuple[str, Any]] = []
        self._new()

    def _new(self) -> None:
        self.ids: list[str] = []
        self.parents: list[str] = []
        self.names: list[str] = []
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.attrs: list[dict[str, Any]] = []

    def event(self, sid: str, parent: str, name: str, start: int, end: int, attrs: Any) -> None:
        self.ids.append(sid)
        self.parents.append(parent)
        self.names.append(name)
        self.starts.append(start)
        self.ends.append(end)
        self.attrs.append(attrs)

    def meta(self, *args: Any) -> None:
        self.done()
        if self.segments and self.segments[-1][0] == "meta":
            self.segments[-1][1].append(args)
        else:
            self.segments.append(("meta", [args]))

    def done(self) -> None:
        if self.ids:
            self.segments.append(("events", (self.ids, self.parents, self.names, self.starts,
                                             self.ends, self.attrs)))  # fmt: skip
            self._new()


class FileSink:
    """Writes the trace file (see :class:`TraceFile`); spans encoded straight from events.

    Args:
        path: the trace file.
        compression: ``"gzip"`` or ``None``.
        level: gzip level.
        max_line_bytes: longest request line.
        sidecar: also write the columnar sidecar (``copytrace.tracefile._sidecar``): the
            event table's rows of each flush, built from the flush's span attributes.
            Default: unless ``COPYTRACE_SIDECAR=0``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        compression: str | None = "gzip",
        level: int = 6,
        max_line_bytes: int = MAX_LINE_BYTES,
        sidecar: bool | None = None,
    ) -> None:
        self.file = TraceFile(path, compression, level)
        self._max = max_line_bytes
        self._enc = _Encoder()
        self._run: RunIds | None = None
        self._frame = ("", "")
        self._sidecar: Any = None
        if sidecar is None:
            sidecar = os.environ.get("COPYTRACE_SIDECAR", "1").strip() != "0"
        self._want_sidecar = sidecar
        self.sidecar_seconds = 0.0
        self.spans = 0

    @property
    def path(self) -> Path:
        return self.file.path

    def begin(self, run: RunIds) -> None:
        self._run = run
        self._frame = _request_frame(run.resource.attributes, SCOPE_NAME, _version())

    def write(self, items: Iterable[PlanItem], chunk: Chunk, keep: Callable[[], set[str]]) -> None:
        write = self.file.write_lines
        rows = _SidecarRows() if self._want_sidecar else None
        for line in iter_lines(*self._frame, self._encode(items, chunk, rows), self._max):
            write((line,))
        self.file.flush()
        if rows is not None:
            self._to_sidecar(rows)

    def _to_sidecar(self, rows: _SidecarRows | None, final: bool = False) -> None:
        """Hand a flush's rows to the sidecar writer (after the JSON lines are flushed);
        any trouble stops the sidecar (readers then parse the JSON), never the trace file."""
        t0 = time.perf_counter()
        try:
            from copytrace.tracefile import _sidecar as sc

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
                    if kind == "events":
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
        self, items: Sequence[PlanItem], chunk: Chunk, rows: _SidecarRows | None = None
    ) -> Iterator[str]:
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
                start, end = _times(ev, run.start_ns)
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
        final = chunk.final
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

    def write_hazards(self, findings: Sequence[Any], span_id: str, end_ns: int) -> None:
        """Append the run's ``copytrace.hazards`` span to the closed file."""
        assert self._run is not None
        append_hazard_span(self.path, self.file.compression, self._run, end_ns, findings,
                           span_id=span_id)  # fmt: skip

    def abandon(self) -> None:
        self._want_sidecar = False
        self.file.abandon()


# --- the SDK sink: real SDK spans for SDK exporters or the user's TracerProvider -------------------
class _PlannedIds(IdGenerator):
    """Hands the SDK the ids copytrace planned (random ids when none is set)."""

    def __init__(self) -> None:
        self._random = RandomIdGenerator()
        self.trace_id = 0
        self.next_span = 0

    def generate_span_id(self) -> int:
        span_id, self.next_span = self.next_span, 0
        return span_id or self._random.generate_span_id()

    def generate_trace_id(self) -> int:
        return self.trace_id or self._random.generate_trace_id()


class SdkSink:
    """Builds real OpenTelemetry SDK spans with explicit ids, parents and timestamps.

    Args:
        exporters: SDK span exporters fed through copytrace's private ``TracerProvider``
            (synchronous batches on the export thread; an exporter that keeps failing is
            given up, not retried forever).
        tracer_provider: a provider of the user's instead (``exporters`` is then ignored): its
            processors, sampler and limits apply; it is flushed, never shut down or replaced.
        batch_size: spans per export call (``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``, default 512).
    """

    def __init__(
        self,
        exporters: Sequence[SpanExporter] = (),
        *,
        tracer_provider: Any = None,
        resource: Resource | None = None,
        batch_size: int | None = None,
    ) -> None:
        if batch_size is None:
            try:
                batch_size = int(os.environ.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE") or 512)
            except ValueError:
                batch_size = 512
        self._own = tracer_provider is None
        self._ids: _PlannedIds | None = None
        self.processors: list[_BatchingProcessor] = []
        if self._own:
            self._ids = _PlannedIds()
            provider = TracerProvider(
                resource=resource if resource is not None else make_resource(),
                id_generator=self._ids,
                shutdown_on_exit=False,
            )
            for exporter in exporters:
                proc = _BatchingProcessor(exporter, batch_size)
                self.processors.append(proc)
                provider.add_span_processor(proc)
            self.provider: Any = provider
        else:
            self.provider = tracer_provider
        self._tracer = self.provider.get_tracer(SCOPE_NAME, _version())
        self._run_span: Any = None
        self._run: RunIds | None = None
        self._ctx: dict[str, SpanContext] = {}  # planned id -> SDK context (user provider)
        self._since_flush = 0
        self.spans = 0

    def begin(self, run: RunIds) -> None:
        self._run = run
        if self._ids is not None:
            self._ids.trace_id = run.trace_id
            self._ids.next_span = run.span_id
        self._run_span = self._tracer.start_span(
            "copytrace.run", context=otel_context.Context(), start_time=run.start_ns + run.offset
        )
        self._ctx[run.span_hex] = self._run_span.get_span_context()

    def sampled(self) -> bool:
        """Whether the provider's sampler kept the run span (the whole trace)."""
        span = self._run_span
        return span is not None and span.get_span_context().trace_flags.sampled

    def _parent(self, planned: str) -> Any:
        run = self._run
        assert run is not None
        if self._ids is not None:  # our ids are the SDK's ids
            sc = SpanContext(run.trace_id, int(planned, 16), False, TraceFlags(TraceFlags.SAMPLED))
        else:
            sc = self._ctx.get(planned) or self._ctx[run.span_hex]
        return otel_trace.set_span_in_context(NonRecordingSpan(sc))

    def write(self, items: Iterable[PlanItem], chunk: Chunk, keep: Callable[[], set[str]]) -> None:
        run = self._run
        assert run is not None
        tracer, ids, off = self._tracer, self._ids, run.offset
        parents = self._ctx if ids is None else None
        for span_id, parent, ev, step in items:
            ctx = self._parent(parent)
            if ids is not None:
                ids.next_span = int(span_id, 16)
            if ev is not None and type(ev) is not CopyEvent:  # a compiled-region record
                span = tracer.start_span(ev.span_name, context=ctx, start_time=ev.start_ns + off,
                                         attributes=ev.span_attributes())  # fmt: skip
                for name, t, attrs in ev.span_events():
                    span.add_event(name, attrs, timestamp=t + off)
                span.end(end_time=ev.end_ns + off)
            elif ev is not None:
                start, end = _times(ev, run.start_ns)
                span = tracer.start_span("copytrace." + ev.op, context=ctx, start_time=start + off,
                                         attributes=event_attributes(ev))  # fmt: skip
                if ev.error:
                    span.set_status(Status(StatusCode.ERROR, ev.error))
                span.end(end_time=end + off)
                if parents is not None and ev.group:
                    parents[span_id] = span.get_span_context()
            elif step is not None:
                span = tracer.start_span("copytrace.step", context=ctx, start_time=step[1] + off,
                                         attributes={"copytrace.step": step[0]})  # fmt: skip
                span.end(end_time=step[2] + off)
                if parents is not None:
                    parents[span_id] = span.get_span_context()
            self.spans += 1
            self._since_flush += 1
            if ids is None and self._since_flush >= 1024:
                self._flush_user_provider()  # the SDK's BatchSpanProcessor drops when full
        final = chunk.final
        if final is not None and self._run_span is not None:
            self._run_span.set_attributes(final.attributes)
            if final.error:
                self._run_span.set_status(Status(StatusCode.ERROR, final.error))
            self._run_span.end(end_time=final.end_ns + off)
            self.spans += 1
        if parents is not None:  # keep the run, and the parents of held-back events
            needed = keep()
            self._ctx = {k: v for k, v in parents.items() if k in needed or k == run.span_hex}
        self.flush()

    def write_hazards(self, findings: Sequence[Any], span_id: str, end_ns: int) -> None:
        """The run's ``copytrace.hazards`` span(s), children of the run span: one
        ``copytrace.hazard`` span event per finding, at most :data:`HAZARDS_PER_SPAN` per span
        (the SDK's default span event limit)."""
        run = self._run
        if run is None or self._run_span is None:
            return
        t = end_ns + run.offset
        for k in range(0, len(findings), HAZARDS_PER_SPAN):
            part = findings[k : k + HAZARDS_PER_SPAN]
            if self._ids is not None:
                self._ids.next_span = int(span_id, 16) if k == 0 else 0
            attrs, events = hazard_span_parts(part)
            span = self._tracer.start_span(_schema.SPAN_HAZARDS, context=self._parent(run.span_hex),
                                           start_time=t, attributes=attrs)  # fmt: skip
            for event in events:
                span.add_event(_schema.EVENT_HAZARD, event, timestamp=t)
            span.end(end_time=t)
            self.spans += 1
        self.flush()

    def _flush_user_provider(self) -> None:
        self._since_flush = 0
        flush = getattr(self.provider, "force_flush", None)
        if flush is not None:
            try:
                flush()
            except Exception as err:
                print(f"copytrace: tracer provider flush failed: {err}", file=sys.stderr)

    def flush(self) -> None:
        if self._own:
            for proc in self.processors:
                proc.force_flush()
        else:
            self._flush_user_provider()

    def close(self) -> None:
        if self._own:
            self.provider.shutdown()
        else:
            self._flush_user_provider()

    def abandon(self) -> None:
        self.processors = []

    @property
    def lost(self) -> int:
        return sum(p.lost for p in self.processors)


# --- exporters named by OTEL_TRACES_EXPORTER --------------------------------------------------------
def _console_line(span: ReadableSpan) -> str:
    """One short line per span for the console exporter."""
    a = span.attributes or {}
    dur = ((span.end_time or 0) - (span.start_time or 0)) / 1e3
    parts = [f"{span.name:<22}", f"{dur:9.1f} us"]
    if "copytrace.bytes_logical" in a:
        parts.append(f"{a.get('copytrace.bytes_allocated', 0):>10} B new")
        parts.append(f"{a.get('copytrace.src_device', '')}->{a.get('copytrace.dst_device', '')}")
        kind = (
            "noop" if a.get("copytrace.noop") else "alias" if a.get("copytrace.alias") else "copy"
        )
        parts.append(kind)
    if "copytrace.step" in a:
        parts.append(f"step {a['copytrace.step']}")
    if "code.file.path" in a:
        parts.append(f"{a['code.file.path']}:{a.get('code.line.number', '?')}")
    return "  ".join(str(p) for p in parts) + "\n"


_PROTOCOLS = {"http/protobuf": "otlp_proto_http", "grpc": "otlp_proto_grpc"}
_EXTRAS = {"otlp_proto_http": "otlp", "otlp_proto_grpc": "otlp-grpc"}


def exporters_from_env(environ: Any = None) -> list[SpanExporter]:
    """The span exporters ``OTEL_TRACES_EXPORTER`` names (comma-separated), built from the
    ``opentelemetry_traces_exporter`` entry points as the SDK's auto-configuration does.

    ``otlp`` picks the exporter by ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` /
    ``OTEL_EXPORTER_OTLP_PROTOCOL`` (``http/protobuf``, the specification's default, or
    ``grpc``); each exporter reads its own endpoint, headers, timeout and compression
    variables. ``console`` prints one line per span; ``none`` or unset: no exporter (the trace
    file is written either way). A name that cannot be loaded prints one warning.
    """
    env = os.environ if environ is None else environ
    names = [n.strip() for n in (env.get("OTEL_TRACES_EXPORTER") or "").split(",") if n.strip()]
    out: list[SpanExporter] = []
    for name in names:
        lname = name.lower()
        if lname in ("none", ""):
            continue
        if lname == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            out.append(ConsoleSpanExporter(out=sys.stdout, formatter=_console_line))
            continue
        entry = lname
        if lname == "otlp":
            protocol = (
                env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf"
            ).strip()
            entry = _PROTOCOLS.get(protocol, "")
            if not entry:
                print(
                    f"copytrace: OTLP protocol {protocol!r} is not supported "
                    f"(use http/protobuf or grpc); no OTLP export",
                    file=sys.stderr,
                )
                continue
        try:
            from opentelemetry.util._importlib_metadata import entry_points

            eps = list(entry_points(group="opentelemetry_traces_exporter", name=entry))
            if not eps:
                extra = _EXTRAS.get(entry)
                hint = f" (pip install 'copytrace[{extra}]')" if extra else ""
                print(f"copytrace: trace exporter {name!r} is not installed{hint}", file=sys.stderr)
                continue
            out.append(eps[0].load()())
        except Exception as err:
            print(f"copytrace: cannot create trace exporter {name!r}: {err}", file=sys.stderr)
    return out


def env_sampler_keeps(run: RunIds) -> bool:
    """Whether the sampler configured by ``OTEL_TRACES_SAMPLER`` keeps this run's trace."""
    from opentelemetry.sdk.trace.sampling import _get_from_env_or_default

    try:
        sampler = _get_from_env_or_default()
        result = sampler.should_sample(None, run.trace_id, "copytrace.run")
    except Exception as err:
        print(f"copytrace: sampler error, tracing anyway: {err}", file=sys.stderr)
        return True
    return result.decision.is_sampled()


# --- the export thread ----------------------------------------------------------------------------
class ExportPipeline:
    """Plans chunks of records into span trees and writes them to the sinks, on one worker
    thread (``copytrace-export``) or synchronously (:meth:`write_now`).

    Args:
        run: the run's ids and clock.
        sinks: :class:`FileSink` / :class:`SdkSink` objects.
        max_pending: chunks queued before :meth:`submit` waits for the worker (bounded
            memory: the traced thread slows down rather than buffering without end).

    A sink that raises is reported once on stderr and skipped from then on; the others go on.
    """

    def __init__(self, run: RunIds, sinks: Sequence[Any], *, max_pending: int = 2) -> None:
        self.run = run
        self.sinks = list(sinks)
        self.max_pending = max(1, max_pending)
        self._pending: deque[Chunk] = deque()
        self._wake = threading.Event()
        self._progress = threading.Event()
        self._thread: threading.Thread | None = None
        self._held: dict[int, tuple[str, str]] = {}  # id(event) -> (span id, parent id)
        self._failed: set[int] = set()
        self.errors = 0
        self.closed = False
        #: Called once the final chunk is written and the file sinks are closed (so that it
        #: can read the finished file); the findings it returns go to every sink as the run's
        #: ``copytrace.hazards`` span (see :func:`hazard_span_parts`).
        self.hazards: Callable[[], Sequence[Any]] | None = None
        self._end_ns: int | None = None
        self.export_seconds = 0.0
        self.waited_seconds = 0.0  # time the traced thread waited for the worker

    def begin(self) -> None:
        for i, sink in enumerate(self.sinks):
            self._call(i, sink.begin, self.run)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="copytrace-export", daemon=True)
        self._thread.start()

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
    def _work(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            while self._pending:
                chunk = self._pending.popleft()
                try:
                    self.write_now(chunk)
                except Exception as err:  # never let the export thread die
                    self.errors += 1
                    print(f"copytrace: export failed: {type(err).__name__}: {err}", file=sys.stderr)
                self._progress.set()
                if chunk.final is not None:
                    self._close_sinks()
                    return

    def write_now(self, chunk: Chunk) -> None:
        """Plan ``chunk`` and write it to every sink, on the calling thread."""
        if self.closed:
            return
        t0 = time.perf_counter()
        if chunk.final is not None:
            self._end_ns = chunk.final.end_ns
        live = [i for i in range(len(self.sinks)) if i not in self._failed]
        items: Iterable[PlanItem] = self._plan(chunk)
        if len(live) > 1:
            items = list(items)  # one plan, the same ids in every sink
        for i in live:
            self._call(i, self.sinks[i].write, items, chunk, self._held_parents)
        self.export_seconds += time.perf_counter() - t0

    def _held_parents(self) -> set[str]:
        """Parent span ids that held-back events will still need."""
        return {parent for _, parent in self._held.values()}

    def _plan(self, chunk: Chunk) -> Iterator[PlanItem]:
        """Span ids and parents: steps under the run, events under their step or their
        deepcopy group; held events are planned now and written when they come back.
        Lazy, so that a big chunk costs no memory per event here."""
        run_id = self.run.span_hex
        step_ids: dict[int, str] = {}
        for step in chunk.steps:
            sid = os.urandom(8).hex()
            step_ids[step[0]] = sid
            yield (sid, run_id, None, step)
        groups: dict[int, str] = {}
        held = chunk.held
        events = chunk.events
        for base in range(0, len(events), 4096):
            hexids = os.urandom(8 * 4096).hex()
            k = 0
            for ev in events[base : base + 4096]:
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
            self._progress.set()
            return
        files = [i for i, sink in enumerate(self.sinks) if isinstance(sink, FileSink)]
        for i in files:  # the analysis reads the finished file
            self._call(i, self.sinks[i].close)
        try:
            findings = list(find())
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
        self._progress.set()


# --- one-shot export (all events at once) ------------------------------------------------------------
def export_events(
    events: Sequence[CopyEvent],
    step_starts: Sequence[int],
    start_ns: int,
    end_ns: int,
    run_attributes: dict[str, Any],
    exporter: SpanExporter,
    *,
    epoch_offset_ns: int,
    resource: Resource | None = None,
) -> int:
    """Build the run, step and event spans of a whole run and hand them to ``exporter``.

    Args:
        events: recorded events (times in ``perf_counter_ns``).
        step_starts: ``perf_counter_ns`` of each step boundary after step 0.
        start_ns, end_ns: ``perf_counter_ns`` when tracing started and stopped.
        run_attributes: attributes of the ``copytrace.run`` span.
        exporter: any SDK span exporter.
        epoch_offset_ns: add to a ``perf_counter_ns`` value to get ns since the Unix epoch.
        resource: the OpenTelemetry resource (default: :func:`make_resource`).

    Returns:
        The number of spans exported (run + steps + events).
    """
    res = resource if resource is not None else make_resource()
    run = RunIds(start_ns, epoch_offset_ns, res)
    sink = SdkSink([exporter], resource=res)
    pipeline = ExportPipeline(run, [sink])
    pipeline.begin()
    bounds = [start_ns, *step_starts, end_ns]
    steps = [(i, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    pipeline.close(Chunk(events, steps, final=RunEnd(end_ns, run_attributes)))
    return sink.spans


def _version() -> str:
    from copytrace._version import __version__

    return __version__


def epoch_offset() -> int:
    """ns to add to ``time.perf_counter_ns()`` to get ns since the Unix epoch."""
    return time.time_ns() - time.perf_counter_ns()


#: Findings per ``copytrace.hazards`` span sent to SDK exporters (the SDK keeps at most 128
#: span events per span by default).
HAZARDS_PER_SPAN = 128
#: Span ids named per finding (``copytrace.hazard.span_ids``); the count of all its events is
#: ``copytrace.hazard.events``. Bounds the span's size whatever the run's length.
MAX_HAZARD_SPAN_IDS = 10_000


def hazard_span_parts(findings: Sequence[Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The attributes of a ``copytrace.hazards`` span and of its ``copytrace.hazard`` events,
    one per finding (:class:`copytrace.analysis.Finding`)."""
    events = []
    for f in findings:
        attrs: dict[str, Any] = {
            "copytrace.hazard.code": f.code,
            "copytrace.hazard.severity": f.severity,
            "copytrace.hazard.message": f.message,
            "copytrace.hazard.fix": f.fix,
            "copytrace.hazard.call_sites": [str(c) for c in f.call_sites],
        }
        if getattr(f, "bytes", None) is not None:
            attrs["copytrace.hazard.bytes"] = int(f.bytes)
        seqs = getattr(f, "event_seqs", None)
        if seqs:
            attrs["copytrace.hazard.events"] = len(seqs)
        span_ids = [str(i) for i in (getattr(f, "span_ids", ()) or ())[:MAX_HAZARD_SPAN_IDS]]
        if span_ids:
            attrs["copytrace.hazard.span_ids"] = span_ids
        events.append(attrs)
    return {"copytrace.hazards": len(findings)}, events


def append_hazard_span(
    path: Path,
    compression: str | None,
    run: RunIds,
    end_ns: int,
    findings: Sequence[Any],
    *,
    span_id: str | None = None,
) -> None:
    """Append one request line holding a ``copytrace.hazards`` span (child of the run span)
    with one ``copytrace.hazard`` span event per finding. A gzip file gets a new gzip member,
    which readers of concatenated gzip (Python, zcat, the Collector) read as one stream."""
    off = run.offset
    attrs, events = hazard_span_parts(findings)
    span = {
        "traceId": run.trace_hex,
        "spanId": span_id or format(random.getrandbits(64) or 1, "016x"),
        "parentSpanId": run.span_hex,
        "name": _schema.SPAN_HAZARDS,
        "kind": 1,
        "startTimeUnixNano": str(end_ns + off),
        "endTimeUnixNano": str(end_ns + off),
        "attributes": _attributes(attrs),
        "events": [{"timeUnixNano": str(end_ns + off), "name": _schema.EVENT_HAZARD,
                    "attributes": _attributes(e)} for e in events],
    }  # fmt: skip
    head, tail = _request_frame(run.resource.attributes, SCOPE_NAME, _version())
    line = (head + _dumps(span) + tail + "\n").encode("utf-8")
    if compression == "gzip":
        with open(path, "ab") as raw, gzip.GzipFile(fileobj=raw, mode="wb") as gz:
            gz.write(line)
    else:
        with open(path, "ab") as raw:
            raw.write(line)
