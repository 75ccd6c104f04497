"""The trace file against the OTLP/JSON encoding rules, every exporter path except the OTLP
network one (``test_otel_otlp.py``), the standard ``OTEL_*`` variables and the resource."""

from __future__ import annotations

import base64
import copy
import gzip
import json
import os
import re
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from _require import require_module
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

import copytrace
from copytrace.dashboards import build_model, load_trace
from copytrace.export import hazard_span, sdk_sink
from copytrace.export.otlp_json import MAX_LINE_BYTES
from copytrace.export.sdk_sink import exporters_from_env

_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX16 = re.compile(r"[0-9a-f]{16}")
_INT = re.compile(r"-?[0-9]+")
_CAMEL = re.compile(r"[a-z][a-zA-Z0-9]*")


def _lines(path: Path) -> list[str]:
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return raw.decode("utf-8").splitlines()


def _plain(value: dict):
    """An OTLP/JSON AnyValue as a Python value."""
    (kind, v), = value.items()
    if kind == "intValue":
        return int(v)
    if kind == "arrayValue":
        return [_plain(x) for x in v.get("values", [])]
    return v


def _spans(path: Path) -> list[dict]:
    out = []
    for line in _lines(path):
        for rs in json.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                out.extend(ss["spans"])
    return out


def _check_keys(obj, where="") -> None:
    """Every JSON object key is lowerCamelCase (attribute keys are values, not keys)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            assert _CAMEL.fullmatch(k), f"key {k!r} at {where} is not lowerCamelCase"
            _check_keys(v, f"{where}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _check_keys(v, f"{where}[{i}]")


def _check_value(v: dict) -> None:
    (kind,) = v.keys()
    if kind == "intValue":
        assert isinstance(v[kind], str) and _INT.fullmatch(v[kind])  # int64 as a string
    elif kind == "arrayValue":
        for item in v[kind].get("values", []):
            _check_value(item)
    else:
        assert kind in ("stringValue", "boolValue", "doubleValue", "kvlistValue", "bytesValue")


def check_otlp_json_line(line: str) -> dict:
    """Assert one line follows the OTLP/JSON rules; return the parsed request."""
    assert len(line.encode()) <= MAX_LINE_BYTES
    doc = json.loads(line)
    _check_keys(doc)
    for rs in doc["resourceSpans"]:
        for a in rs["resource"]["attributes"]:
            _check_value(a["value"])
        for ss in rs["scopeSpans"]:
            for sp in ss["spans"]:
                assert _HEX32.fullmatch(sp["traceId"]) and _HEX16.fullmatch(sp["spanId"])
                assert "parentSpanId" not in sp or _HEX16.fullmatch(sp["parentSpanId"])
                for key in ("startTimeUnixNano", "endTimeUnixNano"):
                    assert isinstance(sp[key], str) and sp[key].isdigit()
                assert int(sp["startTimeUnixNano"]) <= int(sp["endTimeUnixNano"])
                assert sp["kind"] == 1
                for a in sp.get("attributes", []):
                    _check_value(a["value"])
                if "status" in sp:
                    assert sp["status"]["code"] in (0, 1, 2)
    return doc


def check_with_protobuf(line: str) -> None:
    """Parse the line with the official OTLP protobuf definitions (strict: unknown fields
    fail). Protobuf's own JSON mapping wants bytes as base64, where OTLP/JSON says hex: the
    ids are converted first, which also proves they are hex of the right length."""
    # opentelemetry-proto comes with the test extra (and the otlp extra)
    json_format = require_module("google.protobuf.json_format")
    pb = require_module("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
    doc = json.loads(line)
    for rs in doc["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for sp in ss["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if sp.get(key):
                        sp[key] = base64.b64encode(bytes.fromhex(sp[key])).decode()
    msg = json_format.Parse(json.dumps(doc), pb.ExportTraceServiceRequest())
    assert len(msg.resource_spans) >= 1
    for rs in msg.resource_spans:
        for ss in rs.scope_spans:
            for sp in ss.spans:
                assert len(sp.trace_id) == 16 and len(sp.span_id) == 8
                assert sp.kind == 1  # SPAN_KIND_INTERNAL


def _program(t):
    src = torch.randn(1000, requires_grad=True)
    src.clone()
    src.detach()
    src.to(torch.float32)  # no-op
    t.step()
    copy.deepcopy(nn.Linear(8, 8))
    try:
        torch.ones(2).to("no-such-device")
    except RuntimeError:
        pass


@pytest.mark.parametrize("compression", ["gzip", "none"])
def test_file_follows_otlp_json_encoding(tmp_path, compression):
    with copytrace.trace(tmp_path, compression=compression) as t:
        _program(t)
    path = t.trace_path
    assert path.name.endswith(".otlp.jsonl.gz" if compression == "gzip" else ".otlp.jsonl")
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == (compression == "gzip")
    lines = _lines(path)
    for line in lines:
        check_otlp_json_line(line)
        check_with_protobuf(line)
    spans = _spans(path)
    assert len({s["traceId"] for s in spans}) == 1
    ids = {s["spanId"] for s in spans}
    assert len(ids) == len(spans)  # unique
    roots = [s for s in spans if "parentSpanId" not in s]
    assert [r["name"] for r in roots] == ["copytrace.run"]
    assert all(s["parentSpanId"] in ids for s in spans if "parentSpanId" in s)
    failed = [s for s in spans if s.get("status", {}).get("code") == 2]
    assert len(failed) == 1 and failed[0]["status"]["message"] == "RuntimeError"


def test_compact_attributes_read_back_as_recorded(tmp_path):
    """Defaults left out of the file (false flags, 0 new bytes, no transfer) read back as the
    recorded values: report totals equal the in-memory events'."""
    with copytrace.trace(tmp_path) as t:
        _program(t)
    events = [e for e in t.events if not e.group]
    loaded = {
        e.start_ns - t.session._epoch_offset: e.attrs for e in load_trace(t.trace_path).runs[0].events
    }
    for ev in events:
        a = loaded[ev.start_ns]
        for field in ("alias", "noop", "non_blocking", "requires_grad", "src_requires_grad"):
            assert a.get(f"copytrace.{field}", False) == getattr(ev, field), field
        assert a.get("copytrace.bytes_allocated", 0) == ev.bytes_allocated
        assert a.get("copytrace.transfer", "none") == ev.transfer
        assert a.get("copytrace.aten", []) == list(ev.aten)
        assert a.get("copytrace.shape", []) == list(ev.shape)
    tot = build_model(load_trace(t.trace_path)).totals
    assert tot.events == len(events) and tot.error_count == 1
    assert tot.bytes_allocated == sum(e.bytes_allocated for e in events)
    spans = {
        s["name"]: {a["key"]: a["value"] for a in s.get("attributes", [])}
        for s in _spans(t.trace_path)
    }
    clone = spans["copytrace.clone"]
    assert "copytrace.alias" not in clone and "copytrace.transfer" not in clone
    assert clone["copytrace.bytes_allocated"] == {"intValue": "4000"}
    detach = spans["copytrace.detach"]
    assert detach["copytrace.alias"] == {"boolValue": True}
    assert "copytrace.bytes_allocated" not in detach


def test_sdk_exporter_gets_the_same_spans_as_the_file(tmp_path):
    memory = InMemorySpanExporter()
    with copytrace.trace(tmp_path, exporters=[memory], flush_events=2) as t:
        for _ in range(3):
            _program(t)
    # the run's copytrace.hazards span (a deepcopy every step) too, with the same id
    file_spans = {s["spanId"]: s for s in _spans(t.trace_path)}
    assert [s["name"] for s in file_spans.values()].count("copytrace.hazards") == 1
    sdk_spans = memory.get_finished_spans()
    assert len(sdk_spans) == len(file_spans)
    for span in sdk_spans:
        f = file_spans[format(span.context.span_id, "016x")]
        assert f["traceId"] == format(span.context.trace_id, "032x")
        assert f.get("parentSpanId") == (
            format(span.parent.span_id, "016x") if span.parent is not None else None
        )
        assert f["name"] == span.name
        assert int(f["startTimeUnixNano"]) == span.start_time
        assert int(f["endTimeUnixNano"]) == span.end_time
        assert {a["key"] for a in f.get("attributes", [])} == set(span.attributes)


def test_sdk_exporter_gets_the_hazards_span_of_the_file(tmp_path):
    memory = InMemorySpanExporter()
    with copytrace.trace(tmp_path, exporters=[memory]) as t:
        for _ in range(3):
            _program(t)
    (hz,) = [s for s in _spans(t.trace_path) if s["name"] == "copytrace.hazards"]
    (sdk,) = [s for s in memory.get_finished_spans() if s.name == "copytrace.hazards"]
    (run,) = [s for s in memory.get_finished_spans() if s.name == "copytrace.run"]
    assert format(sdk.context.span_id, "016x") == hz["spanId"]
    assert sdk.parent.span_id == run.context.span_id
    assert sdk.start_time == sdk.end_time == run.end_time
    assert dict(sdk.attributes) == {"copytrace.hazards": len(hz["events"])}
    file_events = [
        {a["key"]: _plain(a["value"]) for a in e["attributes"]} for e in hz["events"]
    ]
    sdk_events = [
        {k: list(v) if isinstance(v, tuple) else v for k, v in e.attributes.items()}
        for e in sdk.events
    ]
    assert sdk_events == file_events
    # three steps each deep-copy a Linear: the analysis' findings, in its order
    assert [e["copytrace.hazard.code"] for e in sdk_events] == [
        f.code for f in copytrace.analyze(t.trace_path)
    ]
    assert "deepcopy-in-loop" in [e["copytrace.hazard.code"] for e in sdk_events]


def test_hazards_go_to_every_exporter_in_chunks_of_the_sdk_event_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(hazard_span, "HAZARDS_PER_SPAN", 1)
    memory = InMemorySpanExporter()
    with copytrace.trace(tmp_path, exporters=[memory]) as t:
        for _ in range(3):
            _program(t)
    (hz,) = [s for s in _spans(t.trace_path) if s["name"] == "copytrace.hazards"]
    sdk = [s for s in memory.get_finished_spans() if s.name == "copytrace.hazards"]
    assert len(hz["events"]) >= 2  # deepcopy-in-loop and the no-op .to() every step
    assert [len(s.events) for s in sdk] == [1] * len(hz["events"])
    assert format(sdk[0].context.span_id, "016x") == hz["spanId"]


def test_user_tracer_provider_is_used_not_replaced(tmp_path):
    before = otel_trace.get_tracer_provider()
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "my-trainer"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    with copytrace.trace(tmp_path, tracer_provider=provider) as t:
        _program(t)
    assert otel_trace.get_tracer_provider() is before
    spans = memory.get_finished_spans()
    names = [s.name for s in spans]
    assert names.count("copytrace.run") == 1 and names.count("copytrace.step") == 2
    assert names.count("copytrace.clone") == 1
    ids = {s.context.span_id for s in spans}
    assert all(s.parent is None or s.parent.span_id in ids for s in spans)
    assert {s.resource.attributes["service.name"] for s in spans} == {"my-trainer"}
    assert len({s.context.trace_id for s in spans}) == 1
    # still usable: copytrace did not shut it down
    with provider.get_tracer("app").start_as_current_span("after"):
        pass
    assert memory.get_finished_spans()[-1].name == "after"
    assert t.trace_path is not None  # and the file is written as well


def test_user_provider_sampler_decides(tmp_path):
    provider = TracerProvider(sampler=ALWAYS_OFF)
    with copytrace.trace(tmp_path, tracer_provider=provider) as t:
        torch.ones(2).clone()
    assert not t.sampled and t.trace_path is None and not list(tmp_path.iterdir())


def test_env_sampler_decides(tmp_path, monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    with copytrace.trace(tmp_path / "off") as t:
        torch.ones(2).clone()
    assert not t.sampled and t.trace_path is None
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "1")
    with copytrace.trace(tmp_path / "on") as t:
        torch.ones(2).clone()
    assert t.sampled and t.trace_path is not None


def test_console_exporter_from_env(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    with copytrace.trace(tmp_path) as t:
        torch.ones(3).clone()
    out = capsys.readouterr().out.splitlines()
    assert any(re.match(r"copytrace\.clone .* 12 B new +cpu->cpu +copy", line) for line in out)
    assert any(line.startswith("copytrace.run") for line in out)
    assert t.trace_path is not None


def test_exporters_named_by_env(monkeypatch, capsys):
    assert exporters_from_env({}) == []
    assert exporters_from_env({"OTEL_TRACES_EXPORTER": "none"}) == []
    assert (
        exporters_from_env(
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
        )
        == []
    )
    assert "not supported" in capsys.readouterr().err
    assert exporters_from_env({"OTEL_TRACES_EXPORTER": "nosuch"}) == []
    assert "not installed" in capsys.readouterr().err
    http = require_module("opentelemetry.exporter.otlp.proto.http.trace_exporter")
    (exp,) = exporters_from_env({"OTEL_TRACES_EXPORTER": "otlp"})  # http/protobuf by default
    assert isinstance(exp, http.OTLPSpanExporter)
    exp.shutdown()


def test_resource_service_name_and_torchrun_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv(
        "OTEL_RESOURCE_ATTRIBUTES", "service.name=from-attrs,deployment.environment=ci"
    )
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    with copytrace.trace(tmp_path) as t:
        torch.ones(2).clone()
    assert t.trace_path.name.endswith("-rank3.otlp.jsonl.gz")
    run = load_trace(t.trace_path).runs[0]
    res = run.resource
    assert res["service.name"] == "from-attrs"  # copytrace only defaults it
    assert res["deployment.environment"] == "ci"
    assert (res["copytrace.rank"], res["copytrace.local_rank"], res["copytrace.world_size"]) == (
        3,
        1,
        8,
    )
    assert res["process.pid"] == os.getpid() and res["process.command_args"] == sys.orig_argv
    monkeypatch.setenv("OTEL_SERVICE_NAME", "trainer")
    assert sdk_sink.make_resource().attributes["service.name"] == "trainer"
    monkeypatch.delenv("OTEL_SERVICE_NAME")
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES")
    assert sdk_sink.make_resource().attributes["service.name"] == "copytrace"


@pytest.mark.parametrize(
    ("env", "x"),
    [({}, None),
     ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=a,x=1", "OTEL_SERVICE_NAME": "b"}, "1"),
     ({"OTEL_EXPERIMENTAL_RESOURCE_DETECTORS": "process", "OTEL_RESOURCE_ATTRIBUTES": "x=2"}, "2")],
)  # fmt: skip
def test_resource_is_the_sdks_without_its_thread_pool(env, x, monkeypatch):
    # Resource.create runs the detectors in a ThreadPoolExecutor, a threading.Thread the
    # program would see (its settrace hooks, the executors' name counter); copytrace runs
    # them on the calling thread, with the SDK's merge order
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    threads = []
    monkeypatch.setattr(threading.Thread, "start", lambda self: threads.append(self))
    attrs = {"process.pid": 7, "service.name": "mine"}
    ours = dict(sdk_sink._create_resource(attrs).attributes)
    assert threads == []  # no thread started (a started one would not have run: no result)
    monkeypatch.setattr(threading.Thread, "start", _THREAD_START)
    assert ours == dict(Resource.create(attrs).attributes)  # service.instance.id: per process
    # the detectors ran (OTEL_RESOURCE_ATTRIBUTES, the process detector when named), then the
    # attributes given won, over OTEL_SERVICE_NAME too
    assert (ours["service.name"], ours["process.pid"], ours.get("x")) == ("mine", 7, x)
    assert ours.get("process.parent_pid") == (os.getppid() if "process" in str(env) else None)


_THREAD_START = threading.Thread.start


def test_long_lines_are_split_under_the_collector_limit(tmp_path):
    """No line over the limit (the Collector's otlpjsonfile receiver reads 1 MiB lines)."""
    from copytrace.export.file_sink import FileSink
    from copytrace.export.pipeline import Chunk, ExportPipeline, RunEnd, RunIds

    with copytrace.trace(write=False) as t:
        x = torch.ones(4)
        for _ in range(300):
            x.clone()
    sink = FileSink(tmp_path / "small.otlp.jsonl", compression=None, max_line_bytes=20_000)
    run = RunIds(t.session._start_ns, t.session._epoch_offset, sdk_sink.make_resource())
    pipe = ExportPipeline(run, [sink])
    pipe.begin()
    pipe.close(Chunk(t.events, [(0, t.session._start_ns, t.session._end_ns)], final=RunEnd(t.session._end_ns, {})))
    lines = _lines(sink.path)
    assert len(lines) > 5 and all(len(line) <= 20_000 for line in lines)
    assert len(load_trace(sink.path).runs[0].events) == 300


def test_sdk_exporter_failures_do_not_stall_tracing(tmp_path, capsys):
    from opentelemetry.sdk.trace.export import SpanExportResult

    class Failing:
        calls = 0

        def export(self, spans):
            Failing.calls += 1
            return SpanExportResult.FAILURE

        def shutdown(self):
            pass

    with copytrace.trace(tmp_path, exporters=[Failing()], flush_events=5) as t:
        x = torch.ones(2)
        for _ in range(40):
            x.clone()
            t.step()
    assert Failing.calls <= 3  # given up after 3 failed batches in a row
    assert "giving up" in capsys.readouterr().err
    assert len(load_trace(t.trace_path).runs[0].events) == 40  # the file is unaffected
