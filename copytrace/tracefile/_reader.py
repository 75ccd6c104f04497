"""Read copytrace OTLP/JSON-lines trace files into plain Python objects.

See ``docs/trace-format.md`` for the format. Loaded events have the field names of
:class:`copytrace.CopyEvent` (``ev.op``, ``ev.bytes_allocated``, ``ev.file``, ...), so code
written against live events works on loaded ones. For large traces use the columnar event
table (:func:`copytrace.tracefile.event_table`) instead.
"""

from __future__ import annotations

import gc
import gzip
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any

from copytrace._errors import TraceFileError
from copytrace.schema import (
    EVENT_HAZARD,
    PREFIX,
    SPAN_COMPILED,
    SPAN_COMPILED_GRAPH,
    SPAN_HAZARDS,
    SPAN_RUN,
    SPAN_STEP,
    TRACE_GLOBS,
)
from copytrace.tracefile._spans import Event, Run, Step, TraceData

__all__ = ["Event", "Run", "Step", "TraceData", "decode_value", "load_trace", "TRACE_GLOBS"]

_RUN = SPAN_RUN
_STEP = SPAN_STEP
_HAZARDS = SPAN_HAZARDS
_PREFIX = PREFIX
#: Copytrace spans that are not copy events (kept apart from ``Run.events``).
_NOT_EVENTS = frozenset((SPAN_COMPILED, SPAN_COMPILED_GRAPH))
_GZIP_MAGIC = b"\x1f\x8b"

def decode_value(value: Any) -> Any:
    """Decode one OTLP/JSON ``AnyValue`` object into a plain Python value.

    Args:
        value: A dict such as ``{"intValue": "4000"}`` or ``{"arrayValue": {"values": [...]}}``.

    Returns:
        ``str``, ``bool``, ``int``, ``float``, ``list`` (arrays), ``dict`` (kvlists), or None
        for an empty value.

    Raises:
        ValueError: If the value is malformed (e.g. an ``intValue`` that is not an integer).
    """
    if not isinstance(value, dict):
        raise ValueError(f"attribute value is not an object: {value!r}")
    if "stringValue" in value:
        return str(value["stringValue"])
    if "boolValue" in value:
        b = value["boolValue"]
        if isinstance(b, str):
            return b.lower() == "true"
        return bool(b)
    if "intValue" in value:
        iv = value["intValue"]
        if isinstance(iv, bool):
            raise ValueError("boolean intValue")
        return int(iv)
    if "doubleValue" in value:
        return float(value["doubleValue"])  # accepts "NaN", "Infinity" as proto3 JSON writes
    if "arrayValue" in value:
        arr = value["arrayValue"] or {}
        return [decode_value(v) for v in arr.get("values", [])]
    if "kvlistValue" in value:
        kv = value["kvlistValue"] or {}
        return _decode_attrs(kv.get("values", []))
    if "bytesValue" in value:
        return str(value["bytesValue"])
    return None


_INTERN: dict[Any, Any] = {}


class _KvList(dict):  # type: ignore[type-arg]
    """A decoded ``kvlistValue`` (tells it apart from an undecoded AnyValue object)."""


def _pairs_hook(pairs: list[tuple[str, Any]]) -> Any:
    """``json.loads`` object hook: decode OTLP AnyValue and KeyValue objects as they are read.

    An AnyValue (one of ``stringValue``, ``intValue``, ...) becomes its Python value and a
    KeyValue (``key`` then ``value``) a ``(key, value)`` tuple; every other object stays a
    dict. Decoding here avoids building two dicts per attribute (3x faster loading).
    Raises ValueError for a malformed value, which marks the line unreadable.
    """
    if len(pairs) == 1:
        k, v = pairs[0]
        if k == "stringValue":
            if type(v) is str and len(v) <= 256:
                return _INTERN.setdefault(v, v)
            return str(v)
        if k == "intValue":
            if isinstance(v, bool):
                raise ValueError("boolean intValue")
            return int(v)
        if k == "boolValue":
            return v.lower() == "true" if isinstance(v, str) else bool(v)
        if k == "doubleValue":
            return float(v)
        if k == "arrayValue":
            if not isinstance(v, dict):
                raise ValueError("arrayValue is not an object")
            values = v.get("values") or []
            if not isinstance(values, list):
                raise ValueError("arrayValue values is not a list")
            return [None if type(x) is dict else x for x in values]
        if k == "kvlistValue":
            if not isinstance(v, dict):
                raise ValueError("kvlistValue is not an object")
            return _KvList(_decode_attrs(v.get("values") or []))
        if k == "bytesValue":
            return str(v)
    elif len(pairs) == 2 and pairs[0][0] == "key" and pairs[1][0] == "value":
        key = pairs[0][1]
        if type(key) is str:
            return (_INTERN.setdefault(key, key), pairs[1][1])
    return dict(pairs)


def _decode_attrs(items: Any) -> dict[str, Any]:
    """Attributes of a span, resource or span event, as read with :func:`_pairs_hook`."""
    if items is None:
        return {}
    if not isinstance(items, list):
        raise ValueError("attributes is not a list")
    if all(type(item) is tuple for item in items):
        out = dict(items)  # the common case: every item a (key, decoded value) tuple
    else:
        out = {}
        for item in items:
            if type(item) is tuple:
                out[item[0]] = item[1]
                continue
            if not isinstance(item, dict) or "key" not in item:
                raise ValueError("attribute is not a key/value object") from None
            value = item.get("value")
            # an AnyValue left undecoded (empty, or not JSON-decoded here), or decoded
            out[str(item["key"])] = decode_value(value) if type(value) is dict else value
        return out
    for key, value in out.items():
        if type(value) is dict:  # an empty or unknown AnyValue
            out[key] = decode_value(value)
        elif type(key) is not str:
            raise ValueError("attribute key is not a string")
    return out


def _ns(value: Any) -> int:
    if value is None or value == "":
        return 0
    if isinstance(value, bool):
        raise ValueError("boolean timestamp")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("non-finite timestamp")
        return int(value)
    return int(value)


@dataclass
class _RawSpan:
    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    start_ns: int
    end_ns: int
    attrs: dict[str, Any]
    resource: dict[str, Any]
    span_events: tuple[tuple[str, int, dict[str, Any]], ...] = ()


def _parse_line(line: str) -> list[_RawSpan]:
    """Parse one ExportTraceServiceRequest line; raise ValueError/KeyError/TypeError if bad."""
    doc = json.loads(line, object_pairs_hook=_pairs_hook)
    if not isinstance(doc, dict) or not isinstance(doc.get("resourceSpans"), list):
        raise ValueError("not an ExportTraceServiceRequest")
    spans: list[_RawSpan] = []
    for rs in doc["resourceSpans"]:
        resource = _decode_attrs((rs.get("resource") or {}).get("attributes"))
        for ss in rs.get("scopeSpans") or []:
            for sp in ss.get("spans") or []:
                name = str(sp.get("name", ""))
                attrs = _decode_attrs(sp.get("attributes"))
                if not name.startswith(_PREFIX) and "copytrace.op" not in attrs:
                    continue  # somebody else's span in the same file
                parent = sp.get("parentSpanId") or None
                raw_events = sp.get("events")
                span_events: tuple[tuple[str, int, dict[str, Any]], ...] = ()
                if raw_events:
                    span_events = tuple(
                        (
                            str(e.get("name", "")),
                            _ns(e.get("timeUnixNano")),
                            _decode_attrs(e.get("attributes")),
                        )
                        for e in raw_events
                    )
                spans.append(
                    _RawSpan(
                        trace_id=str(sp["traceId"]).lower(),
                        span_id=str(sp["spanId"]).lower(),
                        parent_id=str(parent).lower() if parent else None,
                        name=name,
                        start_ns=_ns(sp.get("startTimeUnixNano")),
                        end_ns=_ns(sp.get("endTimeUnixNano")),
                        attrs=attrs,
                        resource=resource,
                        span_events=span_events,
                    )
                )
    return spans


def _iter_lines(path: Path) -> Iterator[tuple[str | None, int]]:
    """Yield ``(line, bytes_read)`` for ``path``; the line is None if it is not valid text.

    Gzip files are recognised by their magic bytes; ``bytes_read`` then counts compressed
    bytes. A gzip stream cut mid-write yields what could be decompressed, then None.
    """
    with path.open("rb") as fh:
        magic = fh.read(2)
    if magic != _GZIP_MAGIC:
        with path.open("rb") as fh:
            for raw in fh:
                try:
                    yield raw.decode("utf-8"), len(raw)
                except UnicodeDecodeError:
                    yield None, len(raw)
        return
    with path.open("rb") as raw_fh:
        pos = 0
        try:
            with gzip.open(raw_fh, "rb") as fh:
                for raw in fh:
                    now = raw_fh.tell()
                    done, pos = now - pos, now
                    try:
                        yield raw.decode("utf-8"), done
                    except UnicodeDecodeError:
                        yield None, done
        except (EOFError, OSError, gzip.BadGzipFile):
            yield None, 0  # truncated or corrupt gzip stream: count as one unreadable line


def _trace_files(path: Path) -> list[Path]:
    if not path.exists():
        raise TraceFileError(f"trace path not found: {path}")
    if path.is_dir():
        files = sorted({f for pattern in TRACE_GLOBS for f in path.glob(pattern) if f.is_file()})
        if not files:
            raise TraceFileError(
                f"no trace files (*.otlp.jsonl, *.otlp.jsonl.gz) in directory: {path}"
            )
        return files
    if not path.is_file():
        raise TraceFileError(f"not a regular file or directory: {path}")
    return [path]


def load_trace(path: str | Path, *, progress: Callable[[int], None] | None = None) -> TraceData:
    """Read a copytrace trace file, or every trace file in a directory.

    Args:
        path: A ``*.otlp.jsonl`` / ``*.otlp.jsonl.gz`` file, or a directory whose
            ``*.otlp.jsonl`` and ``*.otlp.jsonl.gz`` files (not recursive) are read in
            sorted order.
        progress: Optional callable given the number of bytes just read from disk
            (compressed bytes for gzip files), called once per line.

    Returns:
        The spans grouped into runs (one per OTLP trace id, i.e. per traced process). Times
        are ns since the epoch; byte counts are bytes. Lines that cannot be parsed are
        skipped and counted in ``bad_lines``; a span id seen twice in a trace is kept once.

    Raises:
        TraceFileError: If ``path`` does not exist, is a directory without trace files, or
            no copytrace span at all could be read from the file(s) (empty, binary or
            corrupt files).
    """
    path = Path(path)
    files = _trace_files(path)
    data = TraceData(files=files)
    runs: dict[str, Run] = {}
    seen: set[tuple[str, str]] = set()

    # Millions of small containers are created and all kept: the cyclic GC would walk them
    # again and again for nothing (they hold no cycles), so pause it while reading.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for file in files:
            try:
                n_spans = _read_file(file, data, runs, seen, progress)
            except OSError as err:
                raise TraceFileError(
                    f"cannot read trace file {file}: {err.strerror or err}"
                ) from err
            if n_spans == 0:
                data.empty_files.append(file)
    finally:
        _INTERN.clear()
        if gc_was_enabled:
            gc.enable()

    if not runs:
        where = files[0] if len(files) == 1 else path
        detail = f" ({data.bad_lines} unreadable line(s))" if data.bad_lines else ""
        raise TraceFileError(f"no readable copytrace spans in {where}{detail}")

    for run in runs.values():
        _finish_run(run)
    data.runs = sorted(runs.values(), key=lambda r: (r.start_ns, r.trace_id))
    return data


def _read_file(
    file: Path,
    data: TraceData,
    runs: dict[str, Run],
    seen: set,
    progress: Callable[[int], None] | None = None,
) -> int:
    n_spans = 0
    for line, nbytes in _iter_lines(file):
        if progress is not None:
            progress(nbytes)
        if line is None:
            data.bad_lines += 1
            continue
        if not line.strip():
            continue
        try:
            spans = _parse_line(line)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            data.bad_lines += 1
            continue
        for sp in spans:
            key = (sp.trace_id, sp.span_id)
            if key in seen:
                continue
            seen.add(key)
            n_spans += 1
            run = runs.get(sp.trace_id)
            if run is None:
                run = runs[sp.trace_id] = Run(trace_id=sp.trace_id)
            run.resource.update(sp.resource)
            if file not in run.files:
                run.files.append(file)
            _add_span(run, sp)
    return n_spans


def _add_span(run: Run, sp: _RawSpan) -> None:
    if sp.name == _RUN:
        run.attrs.update(sp.attrs)
        run.start_ns, run.end_ns = sp.start_ns, sp.end_ns
        run.has_run_span = True
    elif sp.name == _HAZARDS:
        run.hazards.extend(a for name, _t, a in sp.span_events if name == EVENT_HAZARD)
    elif sp.name in _NOT_EVENTS:
        target = run.compiled_calls if sp.name == SPAN_COMPILED else run.compiled_graphs
        target.append(
            Event(sp.name, sp.span_id, sp.parent_id, sp.start_ns, sp.end_ns, sp.attrs,
                  sp.span_events)
        )  # fmt: skip
    elif sp.name == _STEP:
        number = sp.attrs.get("copytrace.step")
        step = number if isinstance(number, int) and not isinstance(number, bool) else -1
        run.steps.append(Step(step, sp.start_ns, sp.end_ns, sp.span_id, sp.attrs))
    else:
        run.events.append(
            Event(
                sp.name, sp.span_id, sp.parent_id, sp.start_ns, sp.end_ns, sp.attrs, sp.span_events
            )
        )


def _finish_run(run: Run) -> None:
    """Sort spans, number unnumbered steps, fill in step numbers and missing run bounds."""
    run.steps.sort(key=lambda s: (s.start_ns, s.step))
    known = {s.step for s in run.steps if s.step >= 0}
    for i, s in enumerate(run.steps):
        if s.step < 0:  # a step span without its number: use its position if free
            s.step = i if i not in known else max(known | {-1}) + 1
            known.add(s.step)
    run.steps.sort(key=lambda s: s.step)
    run.events.sort(key=attrgetter("start_ns", "end_ns", "span_id"))
    run.compiled_calls.sort(key=attrgetter("start_ns", "end_ns", "span_id"))

    if not run.has_run_span:
        starts = [s.start_ns for s in run.steps] + [e.start_ns for e in run.events]
        ends = [s.end_ns for s in run.steps] + [e.end_ns for e in run.events]
        run.start_ns = min(starts) if starts else 0
        run.end_ns = max(ends) if ends else run.start_ns

    # Events without a step number: take it from the parent step/group, else by time.
    step_of_span = {s.span_id: s.step for s in run.steps}
    by_id = {e.span_id: e for e in run.events}
    for ev in run.events:
        number = ev.attrs.get("copytrace.step")
        if isinstance(number, int) and not isinstance(number, bool):
            continue
        found = _step_from_parent(ev, step_of_span, by_id)
        if found is None:
            found = next((s.step for s in run.steps if s.start_ns <= ev.start_ns < s.end_ns), None)
        if found is not None:
            ev.attrs["copytrace.step"] = found


def _step_from_parent(
    ev: Event, step_of_span: dict[str, int], by_id: dict[str, Event]
) -> int | None:
    parent = ev.parent_id
    for _ in range(16):  # bounded walk up (step <- group <- event)
        if parent is None:
            return None
        if parent in step_of_span:
            return step_of_span[parent]
        up = by_id.get(parent)
        if up is None:
            return None
        number = up.attrs.get("copytrace.step")
        if isinstance(number, int) and not isinstance(number, bool):
            return number
        parent = up.parent_id
    return None
