"""The trace file: real OpenTelemetry SDK spans, written as OTLP/JSON lines."""

from __future__ import annotations

import copy
import gzip
import json
import re

import torch
import torch.nn as nn
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import copytrace


def _spans(path):
    spans, resources = [], []
    for line in gzip.open(path, "rt").read().splitlines():
        req = json.loads(line)
        for rs in req["resourceSpans"]:
            resources.append(rs["resource"])
            for ss in rs["scopeSpans"]:
                assert ss["scope"]["name"] == "copytrace"
                spans.extend(ss["spans"])
    return spans, resources


def _attrs(span):
    return {a["key"]: a["value"] for a in span["attributes"]}


def _program(t):
    src = torch.randn(1000, requires_grad=True)
    src.clone()
    t.step()
    copy.deepcopy(nn.Linear(8, 8))


def test_file_follows_otlp_json_rules(tmp_path):
    with copytrace.trace(tmp_path) as t:
        _program(t)
    path = t.trace_path
    assert path.parent == tmp_path and path.name.endswith(".otlp.jsonl.gz")
    spans, resources = _spans(path)
    names = [s["name"] for s in spans]
    # 1 run + 2 steps + clone + deepcopy group + 2 parameter copies
    assert sorted(names) == sorted(
        ["copytrace.run", "copytrace.step", "copytrace.step", "copytrace.clone"]
        + ["copytrace.deepcopy"] * 3
    )
    for s in spans:
        assert re.fullmatch(r"[0-9a-f]{32}", s["traceId"])  # hex, not base64
        assert re.fullmatch(r"[0-9a-f]{16}", s["spanId"])
        assert s["startTimeUnixNano"].isdigit() and s["endTimeUnixNano"].isdigit()
        assert int(s["startTimeUnixNano"]) <= int(s["endTimeUnixNano"])
        assert s["kind"] == 1
    assert len({s["traceId"] for s in spans}) == 1
    res = {a["key"]: a["value"] for a in resources[0]["attributes"]}
    assert res["service.name"] == {"stringValue": "copytrace"}
    assert res["process.pid"]["intValue"].isdigit()  # 64-bit ints are strings in OTLP/JSON

    by_id = {s["spanId"]: s for s in spans}
    run = next(s for s in spans if s["name"] == "copytrace.run")
    assert "parentSpanId" not in run
    clone = next(s for s in spans if s["name"] == "copytrace.clone")
    a = _attrs(clone)
    assert a["copytrace.bytes_allocated"] == {"intValue": "4000"}
    assert "copytrace.alias" not in a  # false flags are left out (docs/trace-format.md)
    assert a["copytrace.grad_fn"] == {"stringValue": "CloneBackward0"}
    assert a["copytrace.aten"] == {"arrayValue": {"values": [{"stringValue": "aten::clone"}]}}
    assert a["copytrace.shape"] == {"arrayValue": {"values": [{"intValue": "1000"}]}}
    assert a["code.file.path"] == {"stringValue": __file__}
    step0 = by_id[clone["parentSpanId"]]
    assert step0["name"] == "copytrace.step" and _attrs(step0)["copytrace.step"]["intValue"] == "0"
    assert step0["parentSpanId"] == run["spanId"]

    group = next(s for s in spans if _attrs(s).get("copytrace.group") == {"boolValue": True})
    assert _attrs(group)["copytrace.bytes_allocated"]["intValue"] == "288"  # 256 + 32
    assert _attrs(by_id[group["parentSpanId"]])["copytrace.step"]["intValue"] == "1"
    children = [s for s in spans if s.get("parentSpanId") == group["spanId"]]
    assert sorted(int(_attrs(c)["copytrace.bytes_allocated"]["intValue"]) for c in children) == [
        32,
        256,
    ]
    run_attrs = _attrs(run)
    assert run_attrs["copytrace.events"]["intValue"] == "4"  # clone + group + 2 children
    assert run_attrs["copytrace.steps"]["intValue"] == "2"


def test_export_to_any_sdk_exporter():
    exporter = InMemorySpanExporter()
    with copytrace.trace(write=False) as t:
        torch.ones(3).double()
    assert t.export(exporter) is None
    spans = exporter.get_finished_spans()
    double = [s for s in spans if s.name == "copytrace.double"]
    assert len(double) == 1
    assert double[0].attributes["copytrace.bytes_allocated"] == 24  # 3 float64
    assert double[0].parent is not None


def test_service_name_from_standard_env(tmp_path, monkeypatch):
    monkeypatch.setenv("OTEL_SERVICE_NAME", "trainer")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=ci")
    with copytrace.trace(tmp_path) as t:
        torch.ones(2).clone()
    _, resources = _spans(t.trace_path)
    res = {a["key"]: a["value"] for a in resources[0]["attributes"]}
    assert res["service.name"] == {"stringValue": "trainer"}
    assert res["deployment.environment"] == {"stringValue": "ci"}


def test_run_span_reports_the_tracers_own_overhead(tmp_path):
    with copytrace.trace(tmp_path) as t:
        for _ in range(50):
            torch.ones(4).clone()
    spans, _ = _spans(t.trace_path)
    run = next(s for s in spans if s["name"] == "copytrace.run")
    overhead = int(_attrs(run)["copytrace.overhead_ns"]["intValue"])
    duration = int(run["endTimeUnixNano"]) - int(run["startTimeUnixNano"])
    # 50 recorded clones cost something, and never more than the traced region itself
    assert 0 < overhead < duration


def test_run_span_says_compiled_regions_ran_compiled(tmp_path):
    @torch.compile(backend="eager")
    def double(x):
        return x.clone() * 2

    double(torch.ones(3))  # compiled once, before tracing
    with copytrace.trace(tmp_path) as t:
        double(torch.ones(3))
    spans, _ = _spans(t.trace_path)
    run = _attrs(next(s for s in spans if s["name"] == "copytrace.run"))
    assert int(run["copytrace.compiled_frames"]["intValue"]) >= 1
    assert run["copytrace.compiled_mode"] == {"stringValue": "compiled"}
    assert run["copytrace.compiled_ran_eagerly"] == {"boolValue": False}
    assert run["copytrace.compiled_calls"] == {"intValue": "1"}


def test_second_trace_in_one_process_gets_its_own_file(tmp_path):
    with copytrace.trace(tmp_path) as first:
        for _ in range(5):
            torch.ones(2).clone()
    with copytrace.trace(tmp_path) as second:
        torch.ones(2).clone()
    assert first.trace_path != second.trace_path
    assert second.trace_path.name.split(".otlp")[0].endswith("-run2")
    counts = [
        sum(s["name"] == "copytrace.clone" for s in _spans(t.trace_path)[0])
        for t in (first, second)
    ]
    assert counts == [5, 1]


def test_hazards_are_span_events_in_the_trace_file(tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.tensor(t) warns: that is the hazard here
        with copytrace.trace(tmp_path) as t:
            for _ in range(4):
                torch.tensor(torch.ones(2))
                t.step()
    spans, _ = _spans(t.trace_path)
    run = next(s for s in spans if s["name"] == "copytrace.run")
    (hz,) = [s for s in spans if s["name"] == "copytrace.hazards"]
    assert hz["parentSpanId"] == run["spanId"] and hz["traceId"] == run["traceId"]
    (event,) = hz["events"]
    attrs = {a["key"]: a["value"] for a in event["attributes"]}
    assert event["name"] == "copytrace.hazard"
    assert attrs["copytrace.hazard.code"] == {"stringValue": "tensor-ctor-copy"}
    assert attrs["copytrace.hazard.bytes"] == {"intValue": "32"}  # 4 copies of 2 float32
    # the loader keeps it out of the events: 4 tensor_ctor events, nothing else
    assert [e.op for e in copytrace.load_trace(t.trace_path).events] == ["tensor_ctor"] * 4
