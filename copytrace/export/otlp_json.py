"""OTLP/JSON encoding: spans as the text lines of an ``ExportTraceServiceRequest``.

The encoder is kept apart from the transports (:mod:`copytrace.export.file_sink`,
:mod:`copytrace.export.sdk_sink`) and from the batching (:mod:`copytrace.export.pipeline`),
as OpenTelemetry's exporters keep theirs. Two encoders live here:

* the generic one, for finished SDK spans (:func:`encode_spans`, :func:`encode_span_lines`),
  used by :class:`~copytrace.export.trace_file.OtlpJsonFileExporter`;
* the file sink's, straight from events without SDK span objects (:class:`Encoder` with
  cached attribute fragments, and :func:`event_attributes`, generated from the field table of
  :mod:`copytrace.schema`): 2.5 s per 100k events with gzip, against 7 s to build the SDK
  spans alone.

OTLP/JSON as the specification requires: hex trace and span ids (not base64), 64-bit
integers as decimal strings, lowerCamelCase keys, enums as integers. Request lines are at
most :data:`MAX_LINE_BYTES` long (the Collector's ``otlpjsonfile`` receiver reads lines up to
1 MiB by default).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from copytrace import schema as _schema

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan

__all__ = [
    "MAX_LINE_BYTES",
    "Encoder",
    "any_value",
    "attribute_list",
    "dumps",
    "encode_span_lines",
    "encode_spans",
    "event_attributes",
    "iter_lines",
    "pack_lines",
    "request_frame",
]

#: Longest line written (bytes of UTF-8 JSON): the OpenTelemetry Collector's ``otlpjsonfile``
#: receiver reads lines up to ``max_log_size`` (1 MiB by default) and cuts longer ones.
MAX_LINE_BYTES = 1_000_000
_INT64 = (-(2**63), 2**63 - 1)


# --- OTLP/JSON encoding of SDK spans (generic) --------------------------------------------------
def any_value(value: Any) -> dict[str, Any]:
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
        return {"arrayValue": {"values": [any_value(v) for v in value]}}
    return {"stringValue": str(value)}


def attribute_list(attrs: Any) -> list[dict[str, Any]]:
    """Attributes (a mapping) as an OTLP/JSON ``KeyValue`` list."""
    if not attrs:
        return []
    return [{"key": k, "value": any_value(v)} for k, v in attrs.items()]


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
        out["attributes"] = attribute_list(span.attributes)
    if span.events:
        out["events"] = [
            {
                "timeUnixNano": str(e.timestamp),
                "name": e.name,
                "attributes": attribute_list(e.attributes),
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
        key = (scope.name, scope.version or "") if scope is not None else (_schema.SCOPE_NAME, "")
        entry[1].setdefault(key, []).append(span)
    return [(res, list(scopes.items())) for res, scopes in by_resource.values()]


def encode_spans(spans: Sequence[ReadableSpan]) -> dict[str, Any]:
    """Encode finished spans as one OTLP/JSON ``ExportTraceServiceRequest`` dict.

    Spans are grouped by resource and instrumentation scope, as OTLP requires.
    """
    return {
        "resourceSpans": [
            {
                "resource": {"attributes": attribute_list(resource.attributes)},
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


def dumps(obj: Any) -> str:
    """Compact JSON text."""
    return json.dumps(obj, separators=(",", ":"))


def request_frame(resource_attrs: Any, scope: str, version: str) -> tuple[str, str]:
    """Head and tail of one ``ExportTraceServiceRequest`` line around its spans."""
    head = (
        '{"resourceSpans":[{"resource":{"attributes":'
        + dumps(attribute_list(resource_attrs))
        + '},"scopeSpans":[{"scope":'
        + dumps({"name": scope, "version": version})
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
            head, tail = request_frame(resource.attributes, name, version)
            lines.extend(pack_lines(head, tail, (dumps(_span_json(s)) for s in items), max_bytes))
    return lines


# --- event attributes, generated from the field table ---------------------------------------
_STR_FIELDS = _schema.STR_FIELDS
_SCALAR_FIELDS = _schema.SCALAR_FIELDS
_ANALYSIS_FIELDS = _schema.ANALYSIS_FIELDS
_OMITTED_DEFAULTS = _schema.OMITTED_DEFAULTS
#: Written on host-to-device copies only.
_H2D_ONLY = _schema.ATTRIBUTE_OF["pinned"]


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
        if key == _H2D_ONLY:
            test += ' and ev.transfer == "h2d"'
        lines.append(f"    if {test}:\n        attrs[{key!r}] = v")
    for field, key in _ANALYSIS_FIELDS:
        lines.append(f"    v = ev.{field}")
        lines.append("    if v is not None and v is not False and v != ():")
        lines.append(f"        attrs[{key!r}] = list(v) if isinstance(v, tuple) else v")
    for field, key in _schema.LIST_FIELDS:
        lines.append(f"    if ev.{field}:\n        attrs[{key!r}] = list(ev.{field})")
    (group, group_key), (tensors, tensors_key) = _schema.GROUP_FIELDS
    lines += [
        f"    if ev.{group}:",
        f"        attrs[{group_key!r}] = True",
        f"        attrs[{tensors_key!r}] = ev.{tensors}",
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


# --- the file sink's encoder: events -> OTLP/JSON text, no SDK objects ----------------------------
class Encoder:
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
            return self._key(key) + dumps(any_value(value)) + "}"
        if frag is None:
            if len(self._frags) >= self._LIMIT:
                self._frags.clear()
            frag = self._frags[ck] = self._key(key) + dumps(any_value(value)) + "}"
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
