"""The run's ``copytrace.hazards`` span: one ``copytrace.hazard`` span event per finding.

Built from plain dicts (``copytrace.analysis.Finding.as_dict()``: ``code``, ``severity``,
``message``, ``fix``, ``call_sites``, ``bytes``, ``event_seqs``, ``span_ids``), so the export
side never imports the analysis. :func:`hazard_span_parts` gives the attributes both sinks
write; :func:`append_hazard_span` appends the span to a closed trace file; the SDK sink sends
the findings in parts of :data:`HAZARDS_PER_SPAN` (:func:`hazard_parts`).
"""

from __future__ import annotations

import gzip
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from copytrace._version import __version__
from copytrace.export.otlp_json import attribute_list, dumps, request_frame
from copytrace.schema import EVENT_HAZARD, HAZARD_ATTRS, SCOPE_NAME, SPAN_HAZARDS

if TYPE_CHECKING:
    from copytrace.export.pipeline import RunIds

__all__ = [
    "HAZARDS_PER_SPAN",
    "MAX_HAZARD_SPAN_IDS",
    "append_hazard_span",
    "hazard_parts",
    "hazard_span_parts",
]

#: Findings per ``copytrace.hazards`` span sent to SDK exporters (the SDK keeps at most 128
#: span events per span by default).
HAZARDS_PER_SPAN = 128
#: Span ids named per finding (``copytrace.hazard.span_ids``); the count of all its events is
#: ``copytrace.hazard.events``. Bounds the span's size whatever the run's length.
MAX_HAZARD_SPAN_IDS = 10_000


def hazard_span_parts(
    findings: Sequence[Mapping[str, Any]],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The attributes of a ``copytrace.hazards`` span and of its ``copytrace.hazard`` events.

    Args:
        findings: One dict per finding (the keys of ``Finding.as_dict()``; ``bytes``,
            ``event_seqs`` and ``span_ids`` may be absent).

    Returns:
        ``({"copytrace.hazards": count}, [event attributes, one dict per finding])``; at
        most :data:`MAX_HAZARD_SPAN_IDS` span ids per finding.
    """
    key = HAZARD_ATTRS
    events = []
    for f in findings:
        attrs: dict[str, Any] = {
            key["code"]: f["code"],
            key["severity"]: f["severity"],
            key["message"]: f["message"],
            key["fix"]: f["fix"],
            key["call_sites"]: [str(c) for c in f.get("call_sites") or ()],
        }
        if f.get("bytes") is not None:
            attrs[key["bytes"]] = int(f["bytes"])
        seqs = f.get("event_seqs")
        if seqs:
            attrs[key["events"]] = len(seqs)
        span_ids = [str(i) for i in (f.get("span_ids") or ())[:MAX_HAZARD_SPAN_IDS]]
        if span_ids:
            attrs[key["span_ids"]] = span_ids
        events.append(attrs)
    return {"copytrace.hazards": len(findings)}, events


def hazard_parts(
    findings: Sequence[Mapping[str, Any]],
) -> Iterator[tuple[int, dict[str, Any], list[dict[str, Any]]]]:
    """``(first index, span attributes, event attributes)`` of each ``copytrace.hazards``
    span an SDK exporter gets: at most :data:`HAZARDS_PER_SPAN` findings each."""
    for k in range(0, len(findings), HAZARDS_PER_SPAN):
        attrs, events = hazard_span_parts(findings[k : k + HAZARDS_PER_SPAN])
        yield k, attrs, events


def append_hazard_span(
    path: Path,
    compression: str | None,
    run: RunIds,
    end_ns: int,
    findings: Sequence[Mapping[str, Any]],
    *,
    span_id: str | None = None,
    gzip_open: Callable[[IO[bytes]], IO[bytes]] | None = None,
) -> None:
    """Append one request line holding a ``copytrace.hazards`` span (child of the run span)
    with one ``copytrace.hazard`` span event per finding. A gzip file gets a new gzip member,
    which readers of concatenated gzip (Python, zcat, the Collector) read as one stream.

    ``gzip_open(raw)`` opens that member (default: the standard library's, level 9; the
    file sink gives its own writer and level: about 10x less CPU on a finding that lists
    tens of thousands of span ids).

    Raises:
        OSError: If the file cannot be appended to.
    """
    off = run.offset
    attrs, events = hazard_span_parts(findings)
    span = {
        "traceId": run.trace_hex,
        "spanId": span_id or format(random.getrandbits(64) or 1, "016x"),
        "parentSpanId": run.span_hex,
        "name": SPAN_HAZARDS,
        "kind": 1,
        "startTimeUnixNano": str(end_ns + off),
        "endTimeUnixNano": str(end_ns + off),
        "attributes": attribute_list(attrs),
        "events": [{"timeUnixNano": str(end_ns + off), "name": EVENT_HAZARD,
                    "attributes": attribute_list(e)} for e in events],
    }  # fmt: skip
    head, tail = request_frame(run.resource.attributes, SCOPE_NAME, __version__)
    line = (head + dumps(span) + tail + "\n").encode("utf-8")
    if compression == "gzip":
        with open(path, "ab") as raw:
            gz = gzip_open(raw) if gzip_open is not None else gzip.GzipFile(fileobj=raw, mode="wb")
            with gz:
                gz.write(line)
    else:
        with open(path, "ab") as raw:
            raw.write(line)
