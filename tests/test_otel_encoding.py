"""The span export's encoding, value by value: OTLP/JSON ``AnyValue`` of every Python type, the
file encoder's fast path for integers, event times, the spans an SDK exporter receives (count,
status) and events whose facts arrive after they were flushed (written once, with the facts)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import copytrace
from copytrace import CopyEvent
from copytrace.tracer._otel import _any_value, _Encoder, _times, epoch_offset, export_events


@pytest.mark.parametrize(
    ("value", "encoded"),
    [
        (True, {"boolValue": True}),
        (7, {"intValue": "7"}),
        (-(2**63), {"intValue": str(-(2**63))}),
        (2**63, {"stringValue": str(2**63)}),  # beyond int64: a string, never a wrong int
        (1.5, {"doubleValue": 1.5}),
        (float("nan"), {"doubleValue": "NaN"}),  # proto3 JSON spells non-finite doubles
        (float("inf"), {"doubleValue": "Infinity"}),
        (float("-inf"), {"doubleValue": "-Infinity"}),
        ("s", {"stringValue": "s"}),
        ((1, "a"), {"arrayValue": {"values": [{"intValue": "1"}, {"stringValue": "a"}]}}),
        (None, {"stringValue": "None"}),
    ],
)
def test_any_value(value: object, encoded: dict) -> None:
    assert _any_value(value) == encoded
    # the file encoder writes the same value, cached or not
    enc = _Encoder()
    for _ in range(2):
        frag = json.loads(enc.attr("k", list(value) if isinstance(value, tuple) else value))
        assert frag == {"key": "k", "value": encoded if not isinstance(value, tuple) else encoded}


def test_encoder_attrs_and_span_fields() -> None:
    enc = _Encoder()
    assert json.loads("[" + enc.attrs({"a": 1, "b": [2, 3]}) + "]") == [
        {"key": "a", "value": {"intValue": "1"}},
        {"key": "b", "value": {"arrayValue": {"values": [{"intValue": "2"}, {"intValue": "3"}]}}},
    ]
    span = json.loads(enc.span("t" * 32, "s" * 16, "p" * 16, "copytrace.clone", 5, 9, {}, "E"))
    assert span == {
        "traceId": "t" * 32,
        "spanId": "s" * 16,
        "parentSpanId": "p" * 16,
        "name": "copytrace.clone",
        "kind": 1,
        "startTimeUnixNano": "5",
        "endTimeUnixNano": "9",
        "status": {"code": 2, "message": "E"},
    }
    root = json.loads(enc.span("t" * 32, "s" * 16, None, "copytrace.run", 1, 2, {"x": 1}))
    assert "parentSpanId" not in root and "status" not in root and len(root["attributes"]) == 1


def test_event_times() -> None:
    assert _times(CopyEvent(start_ns=5, end_ns=9), 100) == (5, 9)
    assert _times(CopyEvent(start_ns=5, end_ns=None), 100) == (5, 100)  # open: ends at fallback
    assert _times(CopyEvent(start_ns=5, end_ns=None), 2) == (5, 5)  # never before its start
    assert _times(CopyEvent(start_ns=None, end_ns=None), 7) == (7, 7)
    assert _times(CopyEvent(start_ns=9, end_ns=5), 0) == (9, 9)  # never negative


def test_export_events_returns_the_spans_exported() -> None:
    with copytrace.trace(write=False) as t:
        src = torch.ones(4)
        src.clone()
        t.step()
        src.detach()
        try:
            torch.ones(2).to("no-such-device")
        except RuntimeError:
            pass
    mem = InMemorySpanExporter()
    start = t.events[0].start_ns - 10
    end = t.events[-1].end_ns + 10
    n = export_events(
        t.events, [t.events[1].start_ns - 1], start, end, {"copytrace.exit": "normal"}, mem,
        epoch_offset_ns=epoch_offset(),
    )  # fmt: skip
    spans = mem.get_finished_spans()
    # 1 run + 2 steps + clone, detach and the failed to
    assert n == len(spans) == 1 + 2 + 3
    failed = [s for s in spans if s.status.status_code is StatusCode.ERROR]
    assert [(s.name, s.status.description) for s in failed] == [("copytrace.to", "RuntimeError")]
    unset = sorted(s.name for s in spans if s.status.status_code is StatusCode.UNSET)
    assert (
        unset == ["copytrace.clone", "copytrace.detach", "copytrace.run"] + ["copytrace.step"] * 2
    )


def test_events_held_across_flushes_are_written_once_with_their_late_facts(tmp_path) -> None:
    """Attached copies are watched until their step ends (graph-retaining-copy): a flush in
    between holds them back, and they are written later, once, with ``retained_bytes``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    x = torch.randn(4, 8)
    history = []
    with copytrace.trace(tmp_path, flush_events=1) as t:
        for _ in range(3):
            history.append(model(x).pow(2).mean().clone())
            t.step()
    (run,) = copytrace.load_trace(t.trace_path).runs
    assert run.attrs["copytrace.flushes"] == 3  # one at each step boundary
    assert [e.op for e in run.events] == ["clone"] * 3
    # x (128 B), the ReLU output (256 B) and pow's input (16 B) saved per step
    assert [e.attrs["copytrace.retained_bytes"] for e in run.events] == [400] * 3
    assert len({e.span_id for e in run.events}) == 3
