"""The span export's encoding, value by value: OTLP/JSON ``AnyValue`` of every Python type, the
file encoder's fast path for integers, event times, the spans an SDK exporter receives (count,
status) and events whose facts arrive after they were flushed (written once, with the facts)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import copytrace
from copytrace import CopyEvent
from copytrace.export.otlp_json import Encoder, any_value
from copytrace.export.pipeline import epoch_offset, span_times
from copytrace.export.sdk_sink import export_events


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
    assert any_value(value) == encoded
    # the file encoder writes the same value, cached or not
    enc = Encoder()
    for _ in range(2):
        frag = json.loads(enc.attr("k", list(value) if isinstance(value, tuple) else value))
        assert frag == {"key": "k", "value": encoded if not isinstance(value, tuple) else encoded}


def test_encoder_attrs_and_span_fields() -> None:
    enc = Encoder()
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
    assert span_times(CopyEvent(start_ns=5, end_ns=9), 100) == (5, 9)
    assert span_times(CopyEvent(start_ns=5, end_ns=None), 100) == (5, 100)  # open: ends at fallback
    assert span_times(CopyEvent(start_ns=5, end_ns=None), 2) == (5, 5)  # never before its start
    assert span_times(CopyEvent(start_ns=None, end_ns=None), 7) == (7, 7)
    assert span_times(CopyEvent(start_ns=9, end_ns=5), 0) == (9, 9)  # never negative


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
    """A ``state_dict()`` snapshot is watched until its source changes (aliasing-snapshot):
    the flushes in between hold its events back; they are written later, once, with
    ``copytrace.stale``."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    with copytrace.trace(tmp_path, flush_events=1) as t:
        best = model.state_dict()  # step 0: unchanged at the step's end, still watched
        t.step()  # a flush
        t.step()  # another: still unchanged
        model(x).pow(2).mean().backward()
        opt.step()  # step 2 changes it in place
        t.step()
    (run,) = copytrace.load_trace(t.trace_path).runs
    assert run.attrs["copytrace.flushes"] == 3
    snaps = [e for e in run.events if e.attrs.get("copytrace.snapshot")]
    assert [e.op for e in snaps] == ["detach", "detach"]  # weight and bias, once each
    assert [e.attrs.get("copytrace.stale") for e in snaps] == [True, True]
    assert len({e.span_id for e in run.events}) == len(run.events) == 2
    assert sorted(best) == ["bias", "weight"]


def test_unhashable_attribute_values_are_encoded_uncached() -> None:
    enc = Encoder()
    for _ in range(2):
        assert json.loads(enc.attr("k", [[1, 2], [3]])) == {
            "key": "k",
            "value": {"arrayValue": {"values": [any_value([1, 2]), any_value([3])]}},
        }


def test_user_provider_gets_groups_and_steps_as_parents(tmp_path) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    mem = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(mem))
    with copytrace.trace(tmp_path, tracer_provider=provider) as t:
        copy.deepcopy(nn.Linear(2, 2))  # a group of 2 copies, in step 0
        t.step()
        torch.ones(2).clone()  # in step 1
    spans = mem.get_finished_spans()
    by_name: dict[str, list] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    (run,) = by_name["copytrace.run"]
    steps = sorted(by_name["copytrace.step"], key=lambda s: s.attributes["copytrace.step"])
    group = next(s for s in by_name["copytrace.deepcopy"] if s.attributes.get("copytrace.group"))
    children = [s for s in by_name["copytrace.deepcopy"] if s is not group]
    assert len(children) == 2 and len(steps) == 2
    assert all(s.parent.span_id == run.context.span_id for s in steps)
    assert group.parent.span_id == steps[0].context.span_id
    assert all(c.parent.span_id == group.context.span_id for c in children)
    (clone,) = by_name["copytrace.clone"]
    assert clone.parent.span_id == steps[1].context.span_id
    assert len({s.context.trace_id for s in spans}) == 1


def test_pinned_is_written_on_host_to_device_copies_only(tmp_path) -> None:
    x = torch.ones(4)
    cuda = torch.cuda.is_available()
    with copytrace.trace(tmp_path) as t:
        x.to("cuda" if cuda else "meta")  # host to device; meta has no memory: no transfer
        x.to(torch.float64)  # host to host
    (run,) = copytrace.load_trace(t.trace_path).runs
    assert [(e.attrs["copytrace.transfer"] if "copytrace.transfer" in e.attrs else "none",
             e.attrs.get("copytrace.pinned")) for e in run.events] == [
        ("h2d", False) if cuda else ("none", None), ("none", None)]  # fmt: skip
