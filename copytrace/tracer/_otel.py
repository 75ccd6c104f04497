"""Cold path: turn recorded events into OpenTelemetry spans and write them as OTLP/JSON lines.

Spans are built with the real OpenTelemetry SDK (a private ``TracerProvider``, never the
global one) with explicit start and end times, after tracing has stopped, so the SDK costs
nothing while the user's code runs. The span model and attributes are documented in
``docs/trace-format.md``.

The file exporter writes OTLP/JSON as the specification requires (and the Collector's
``otlpjsonfile`` receiver reads): hex trace and span ids, 64-bit integers as strings,
lowerCamelCase keys, one ``ExportTraceServiceRequest`` object per line.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from opentelemetry import trace as otel_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

if TYPE_CHECKING:
    from copytrace.tracer._events import CopyEvent

__all__ = ["OtlpJsonFileExporter", "encode_spans", "export_events", "trace_file_name"]

SCOPE_NAME = "copytrace"


# --- OTLP/JSON encoding ------------------------------------------------------------------------
def _any_value(value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
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
        "attributes": _attributes(span.attributes),
        "status": {},
    }
    if span.parent is not None:
        out["parentSpanId"] = format(span.parent.span_id, "016x")
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


def encode_spans(spans: Sequence[ReadableSpan]) -> dict[str, Any]:
    """Encode finished spans as one OTLP/JSON ``ExportTraceServiceRequest`` dict.

    Spans are grouped by resource and instrumentation scope, as OTLP requires.
    """
    by_resource: dict[int, tuple[Resource, dict[tuple[str, str], list[dict[str, Any]]]]] = {}
    for span in spans:
        resource = span.resource
        entry = by_resource.setdefault(id(resource), (resource, {}))
        scope = span.instrumentation_scope
        key = (scope.name, scope.version or "") if scope is not None else (SCOPE_NAME, "")
        entry[1].setdefault(key, []).append(_span_json(span))
    resource_spans = []
    for resource, scopes in by_resource.values():
        resource_spans.append(
            {
                "resource": {"attributes": _attributes(resource.attributes)},
                "scopeSpans": [
                    {"scope": {"name": name, "version": version}, "spans": items}
                    for (name, version), items in scopes.items()
                ],
            }
        )
    return {"resourceSpans": resource_spans}


class OtlpJsonFileExporter(SpanExporter):
    """A span exporter that appends one OTLP/JSON line per exported batch to a file.

    Args:
        path: the file to write (created with its parent directory; appended to).

    Each line is flushed as it is written, so a process killed mid-run leaves every
    earlier batch readable.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fh: IO[str] | None = None

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        try:
            if self._fh is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
            self._fh.write(json.dumps(encode_spans(spans), separators=(",", ":")) + "\n")
            self._fh.flush()
        except OSError as err:
            print(f"copytrace: cannot write {self.path}: {err}", file=sys.stderr)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        if self._fh is not None:
            self._fh.flush()
        return True


class _BatchingProcessor(SpanProcessor):
    """Synchronous batching: exports every ``batch`` ended spans, and the rest on flush.

    The SDK's BatchSpanProcessor drops spans when its queue fills faster than its worker
    drains it, which is exactly what building thousands of spans in a loop does; this one
    never drops.
    """

    def __init__(self, exporter: SpanExporter, batch: int = 4096) -> None:
        self._exporter = exporter
        self._batch = batch
        self._spans: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self._spans.append(span)
        if len(self._spans) >= self._batch:
            self.force_flush()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        spans, self._spans = self._spans, []
        if spans:
            self._exporter.export(spans)
        return True

    def shutdown(self) -> None:
        self.force_flush()
        self._exporter.shutdown()


# --- building spans ------------------------------------------------------------------------------
def trace_file_name(pid: int | None = None) -> str:
    """``copytrace-<host>-<pid>[-rank<N>].otlp.jsonl`` for this process."""
    pid = os.getpid() if pid is None else pid
    rank = os.environ.get("RANK")
    suffix = f"-rank{rank}" if rank is not None and rank.isdigit() else ""
    host = socket.gethostname() or "host"
    return f"copytrace-{host}-{pid}{suffix}.otlp.jsonl"


def make_resource(extra: dict[str, Any] | None = None) -> Resource:
    """The process's resource: service name, pid, host, rank; merged with ``OTEL_*``.

    Build it while the interpreter is running normally: the SDK's resource detectors use a
    thread pool, which refuses work during interpreter shutdown (``atexit``).
    """
    attrs: dict[str, Any] = {
        "service.name": os.environ.get("OTEL_SERVICE_NAME", "copytrace"),
        "process.pid": os.getpid(),
        "process.runtime.name": sys.implementation.name,
        "process.runtime.version": sys.version.split()[0],
        "host.name": socket.gethostname(),
    }
    for env, key in (("RANK", "copytrace.rank"), ("LOCAL_RANK", "copytrace.local_rank"),
                     ("WORLD_SIZE", "copytrace.world_size")):  # fmt: skip
        value = os.environ.get(env)
        if value is not None and value.isdigit():
            attrs[key] = int(value)
    attrs.update(extra or {})
    # Resource.create merges OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME from the environment.
    return Resource.create(attrs)


_STR_FIELDS = (
    ("op", "copytrace.op"), ("dtype", "copytrace.dtype"), ("src_dtype", "copytrace.src_dtype"),
    ("src_device", "copytrace.src_device"), ("dst_device", "copytrace.dst_device"),
    ("transfer", "copytrace.transfer"), ("grad_fn", "copytrace.grad_fn"),
    ("graph", "copytrace.graph"), ("phase", "copytrace.phase"), ("module", "copytrace.module"),
    ("object_type", "copytrace.object_type"), ("error", "copytrace.error"),
    ("file", "code.file.path"), ("function", "code.function.name"),
    ("thread_name", "thread.name"), ("via", "copytrace.via"), ("origin", "copytrace.origin"),
)  # fmt: skip
_SCALAR_FIELDS = (
    ("bytes_allocated", "copytrace.bytes_allocated"), ("bytes_logical", "copytrace.bytes_logical"),
    ("alias", "copytrace.alias"), ("noop", "copytrace.noop"),
    ("non_blocking", "copytrace.non_blocking"), ("requires_grad", "copytrace.requires_grad"),
    ("src_requires_grad", "copytrace.src_requires_grad"), ("is_leaf", "copytrace.is_leaf"),
    ("step", "copytrace.step"), ("line", "code.line.number"), ("thread_id", "thread.id"),
    ("pinned", "copytrace.pinned"),
)  # fmt: skip


def event_attributes(ev: CopyEvent) -> dict[str, Any]:
    """Span attributes of one event (absent values are left out)."""
    attrs: dict[str, Any] = {}
    for field, key in _STR_FIELDS:
        value = getattr(ev, field)
        if value:
            attrs[key] = value
    for field, key in _SCALAR_FIELDS:
        value = getattr(ev, field)
        if value is not None:
            attrs[key] = value
    attrs["copytrace.aten"] = list(ev.aten)
    attrs["copytrace.shape"] = list(ev.shape)
    if ev.group:
        attrs["copytrace.group"] = True
        attrs["copytrace.tensors"] = ev.tensors
    return attrs


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
    """Build the run, step and event spans and hand them to ``exporter``.

    Args:
        events: recorded events (times in ``perf_counter_ns``).
        step_starts: ``perf_counter_ns`` of each step boundary after step 0.
        start_ns, end_ns: ``perf_counter_ns`` when tracing started and stopped.
        run_attributes: attributes of the ``copytrace.run`` span.
        exporter: where the spans go (the file exporter, or any SDK span exporter).
        epoch_offset_ns: add to a ``perf_counter_ns`` value to get ns since the Unix epoch.
        resource: the OpenTelemetry resource (default: :func:`make_resource`).

    Returns:
        The number of spans exported (run + steps + events).
    """
    processor = _BatchingProcessor(exporter)
    provider = TracerProvider(resource=resource if resource is not None else make_resource())
    provider.add_span_processor(processor)
    tracer = provider.get_tracer(SCOPE_NAME, _version())
    off = epoch_offset_ns
    run = tracer.start_span("copytrace.run", start_time=start_ns + off, attributes=run_attributes)
    run_ctx = otel_trace.set_span_in_context(run)
    bounds = [start_ns, *step_starts, end_ns]
    step_spans = []
    for i in range(len(bounds) - 1):
        span = tracer.start_span(
            "copytrace.step", context=run_ctx, start_time=bounds[i] + off,
            attributes={"copytrace.step": i},
        )  # fmt: skip
        step_spans.append((span, otel_trace.set_span_in_context(span)))
    groups: dict[int, Any] = {}
    pending_groups: list[tuple[Any, int]] = []
    count = 1 + len(step_spans)
    for ev in events:
        step = min(max(ev.step, 0), len(step_spans) - 1)
        if ev.parent >= 0 and ev.parent in groups:
            ctx = groups[ev.parent]
        else:
            ctx = step_spans[step][1]
        span = tracer.start_span(
            "copytrace." + ev.op, context=ctx, start_time=ev.start_ns + off,
            attributes=event_attributes(ev),
        )  # fmt: skip
        count += 1
        if ev.group:
            groups[ev.seq] = otel_trace.set_span_in_context(span)
            pending_groups.append((span, ev.end_ns))
        else:
            span.end(end_time=ev.end_ns + off)
    for span, end in pending_groups:
        span.end(end_time=end + off)
    for i, (span, _) in enumerate(step_spans):
        span.end(end_time=bounds[i + 1] + off)
    run.end(end_time=end_ns + off)
    provider.shutdown()
    return count


def _version() -> str:
    from copytrace import __version__

    return __version__


def epoch_offset() -> int:
    """ns to add to ``time.perf_counter_ns()`` to get ns since the Unix epoch."""
    return time.time_ns() - time.perf_counter_ns()
