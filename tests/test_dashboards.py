"""Tests of copytrace.dashboards: loading, aggregation and the HTML report.

The synthetic trace comes from ``tests/_tracegen.py``; its module docstring lists every span.
"""

from __future__ import annotations

import base64
import dataclasses
import gzip
import json
import os
import re
import sys
import types
from pathlib import Path

import plotly.offline
import pytest
from _realtrace import HAZARD_CODE as REAL_HAZARD_CODE
from _realtrace import write_real_trace
from _tracegen import (
    MS,
    SCRIPT_MODULE,
    T0,
    trace_lines,
    write_many,
    write_trace,
)

from copytrace._errors import TraceFileError
from copytrace.dashboards import (
    SampleInfo,
    build_model,
    load_trace,
    render_html,
    run_analysis,
    sample_events,
    write_report,
)
from copytrace.dashboards._payload import build_payload, dump_payload
from copytrace.tracefile import decode_value, event_table

# Expected values for one synthetic run (see tests/_tracegen.py). Non-group events:
#   clone 4000/4000 B 2 ms, detach (alias) 0/4000 B 0.5 ms, to h2d 8000/8000 B 3 ms,
#   deepcopy child 2000/2000 B 1 ms, deepcopy child 1000/1000 B 1 ms,
#   to (no-op, alias) 0/1000 B 0.1 ms, contiguous 16000/16000 B 4 ms.
EVENTS = 7  # the deepcopy group span (3000 B, 6 ms) is not counted
BYTES_ALLOCATED = 4000 + 0 + 8000 + 2000 + 1000 + 0 + 16000  # 31000
BYTES_LOGICAL = 4000 + 4000 + 8000 + 2000 + 1000 + 1000 + 16000  # 36000
BYTES_COPIED = 4000 + 8000 + 2000 + 1000 + 16000  # logical bytes of the real copies: 31000
COPY_TIME_NS = (2 + 0.5 + 3 + 1 + 1 + 0.1 + 4) * MS  # 11.6 ms
ALIASES = 1  # detach (kinds are exclusive: the no-op to counts as a no-op only)
NOOPS = 1
COPIES = EVENTS - ALIASES - NOOPS  # 5


@pytest.fixture()
def trace_file(tmp_path: Path) -> Path:
    return write_trace(tmp_path / "out")


def test_decode_value() -> None:
    assert decode_value({"stringValue": "x"}) == "x"
    assert decode_value({"boolValue": True}) is True
    assert decode_value({"intValue": "9007199254740993"}) == 9007199254740993  # > 2**53
    assert decode_value({"intValue": 7}) == 7
    assert decode_value({"doubleValue": 1.5}) == 1.5
    assert decode_value({"doubleValue": "NaN"}) != decode_value({"doubleValue": "NaN"})
    assert decode_value({"arrayValue": {"values": [{"intValue": "2"}, {"intValue": "3"}]}}) == [
        2,
        3,
    ]
    assert decode_value({"arrayValue": {}}) == []
    assert decode_value({}) is None
    with pytest.raises(ValueError):
        decode_value({"intValue": "twelve"})


def test_load_groups_spans_into_a_run(trace_file: Path) -> None:
    data = load_trace(trace_file)
    assert data.bad_lines == 0
    assert data.files == [trace_file]
    assert len(data.runs) == 1
    run = data.runs[0]
    assert run.trace_id == f"{4242:032x}"
    assert run.has_run_span
    assert run.resource["process.pid"] == 4242
    assert run.attrs["process.command_args"] == ["train.py", "--epochs", "1"]
    assert run.attrs["copytrace.internal_detaches"] == 5
    assert (run.start_ns, run.end_ns, run.duration_ns) == (T0, T0 + 100 * MS, 100 * MS)
    assert [(s.step, s.start_ns - T0, s.duration_ns) for s in run.steps] == [
        (0, 0, 30 * MS),
        (1, 30 * MS, 30 * MS),
        (2, 60 * MS, 40 * MS),
    ]
    assert len(run.events) == 8  # 7 events + 1 group, sorted by start time
    assert [e.start_ns for e in run.events] == sorted(e.start_ns for e in run.events)
    groups = [e for e in run.events if e.is_group]
    assert len(groups) == 1
    children = [e for e in run.events if e.parent_id == groups[0].span_id]
    assert [c.attrs["copytrace.bytes_allocated"] for c in children] == [2000, 1000]
    clone = run.events[0]
    assert clone.op == "clone"
    assert clone.parent_id == run.steps[0].span_id
    assert clone.attrs["copytrace.shape"] == [10, 100]
    assert "copytrace.alias" not in clone.attrs  # false: left out, as the tracer does
    assert clone.attrs["copytrace.module"] == SCRIPT_MODULE


def test_totals_do_not_double_count_groups(trace_file: Path) -> None:
    t = build_model(load_trace(trace_file)).totals
    assert t.events == EVENTS == 7
    assert t.bytes_allocated == BYTES_ALLOCATED == 31000  # 34000 if the group were counted
    assert t.bytes_logical == BYTES_LOGICAL == 36000
    assert t.bytes_copied == BYTES_COPIED == 31000
    assert t.copy_time_ns == COPY_TIME_NS == 11_600_000
    assert (t.copy_count, t.alias_count, t.noop_count) == (COPIES, ALIASES, NOOPS) == (5, 1, 1)
    assert t.time_by_kind_ns == {"copy": 11_000_000, "alias": 500_000, "noop": 100_000}
    assert t.group_count == 1
    assert t.error_count == 0
    assert (t.cross_device_count, t.cross_device_bytes) == (1, 8000)


def test_run_metadata(trace_file: Path) -> None:
    model = build_model(load_trace(trace_file))
    (run,) = model.runs
    assert run.label == "pid 4242"
    assert run.pid == 4242 and run.rank is None and run.host == "testhost"
    assert run.command == "train.py --epochs 1"
    assert run.torch_version == "2.13.0+cpu"
    assert run.copytrace_version == "0.1.0"
    assert run.duration_ns == 100 * MS
    assert (run.events_recorded, run.events_loaded) == (8, 8)
    assert (run.events_dropped, run.errors, run.internal_detaches, run.steps) == (0, 0, 5, 3)
    assert run.overhead_ns == 1_500_000
    assert run.devices == ["cpu", "cuda:0"]
    assert run.complete
    assert model.bad_lines == 0


def test_per_step_rows_and_stages(trace_file: Path) -> None:
    model = build_model(load_trace(trace_file))
    got = [
        (s.step, s.stage, s.duration_ns, s.copy_count, s.alias_count, s.noop_count,
         s.bytes_copied, s.bytes_allocated, s.copy_time_ns)
        for s in model.steps
    ]  # fmt: skip
    assert got == [
        # step 0: clone (2 ms) + detach alias (0.5 ms) in a 30 ms step; step 0 is warm-up
        (0, "warmup", 30 * MS, 1, 1, 0, 4000, 4000, 2_500_000),
        # step 1: to h2d (3 ms) + 2 deepcopy children (1 ms each); the group is not counted
        (1, "steady", 30 * MS, 3, 0, 0, 11000, 11000, 5_000_000),
        # step 2, the last (ends when tracing stops): no-op to (0.1 ms) + contiguous (4 ms)
        (2, "tail", 40 * MS, 1, 0, 1, 16000, 16000, 4_100_000),
    ]
    shares = [s.copy_time_share_pct for s in model.steps]
    assert shares == pytest.approx([2.5 / 30 * 100, 5 / 30 * 100, 4.1 / 40 * 100])
    assert [(s.start_ms, s.end_ms) for s in model.steps] == [(0, 30), (30, 60), (60, 100)]
    st = model.stages
    assert (st["steady"].steps, st["steady"].share_pct) == (1, pytest.approx(100 * 5 / 30))
    assert st["steady"].bytes_per_step == 11000
    assert st["warmup"].share_pct == pytest.approx(100 * 2.5 / 30)
    assert st["tail"].median_share_pct == pytest.approx(10.25)


def _steps(durations_ms: list[float]) -> list[str]:
    from copytrace.dashboards._rows import StepRow
    from copytrace.dashboards.sections.steps import _assign_stages

    rows = [StepRow("r", i, int(d * MS)) for i, d in enumerate(durations_ms)]
    _assign_stages(rows)
    return [r.stage for r in rows]


def test_warmup_detection() -> None:
    assert _steps([10, 10]) == ["steady", "steady"]  # too few steps to tell
    assert _steps([50, 10, 10, 10, 5]) == ["warmup", "steady", "steady", "steady", "tail"]
    # slow leading steps (> 2x the steady median) are warm-up too: at most 10% of the steps
    durations = [500, 90, 40] + [10] * 27
    assert _steps(durations)[:4] == ["warmup", "warmup", "warmup", "steady"]
    assert _steps([500, 90, 40, 30] + [10] * 6)[:3] == ["warmup", "warmup", "steady"]
    assert _steps([500, 15, 90] + [10] * 27)[:3] == ["warmup", "steady", "steady"]


def test_call_sites_modules_ops_transfers(trace_file: Path) -> None:
    model = build_model(load_trace(trace_file))
    by_bytes = [(r.key, r.bytes_copied, r.count) for r in model.top_call_sites("bytes_copied")]
    assert by_bytes == [
        ("train.py:11 forward", 16000, 2),  # detach (alias, 0 B) + contiguous (16000 B)
        ("train.py:20 main", 8000, 1),
        ("train.py:10 forward", 4000, 1),
        ("train.py:30 main", 3000, 2),  # the deepcopy children, not the group
        ("train.py:40 main", 0, 1),
    ]
    assert model.call_sites[0].label == "train.py:11 forward"
    assert model.call_sites[0].others == {"encoder": 2}
    assert model.call_sites[0].ops == {"contiguous": 1, "detach": 1}
    by_time = [(r.key, r.time_ns) for r in model.top_call_sites("time_ns", 3)]
    assert by_time == [
        ("train.py:11 forward", 4_500_000),
        ("train.py:20 main", 3_000_000),
        ("train.py:10 forward", 2_000_000),  # ties with :30 main; broken by key
    ]
    modules = [(r.key, r.bytes_copied, r.count, r.alias_count, r.noop_count)
               for r in model.modules]  # fmt: skip
    assert modules == [
        ("encoder", 16000, 2, 1, 0),
        ("(no module)", 11000, 4, 0, 1),  # to h2d 8000 + children 3000 + no-op 0
        (SCRIPT_MODULE, 4000, 1, 0, 0),
    ]
    ops = {o.op: (o.count, o.copy_count, o.alias_count, o.noop_count, o.bytes_copied)
           for o in model.ops}  # fmt: skip
    assert ops == {
        "contiguous": (1, 1, 0, 0, 16000),
        "to": (2, 1, 0, 1, 8000),
        "clone": (1, 1, 0, 0, 4000),
        "deepcopy": (2, 2, 0, 0, 3000),
        "detach": (1, 0, 1, 0, 0),
    }
    assert {o.op: o.graph for o in model.ops}["clone"] == {"attached": 1}
    transfers = [
        (t.src_device, t.dst_device, t.transfer, t.count, t.copy_count, t.bytes_logical,
         t.non_blocking_count, t.cross_device)
        for t in model.transfers
    ]  # fmt: skip
    assert transfers == [
        ("cpu", "cpu", "none", 6, 4, 28000, 0, False),
        ("cpu", "cuda:0", "h2d", 1, 1, 8000, 1, True),
    ]
    assert [(run, t.dst_device) for run, t in model.transfers_by_run] == [(0, "cpu"), (0, "cuda:0")]
    (group,) = model.groups
    assert (group.object_type, group.tensors, group.children, group.bytes_allocated) == (
        "torch.nn.modules.linear.Linear",
        2,
        2,
        3000,
    )
    assert (group.step, group.duration_ns, group.call_site) == (1, 6 * MS, "train.py:30 main")


def test_cube_sums_to_totals(trace_file: Path) -> None:
    model = build_model(load_trace(trace_file))
    t = model.totals
    assert sum(c.count for c in model.cube) == t.events
    assert sum(c.bytes_copied for c in model.cube) == t.bytes_copied
    assert sum(c.bytes_allocated for c in model.cube) == t.bytes_allocated
    assert sum(c.time_ns for c in model.cube) == t.copy_time_ns
    kinds = {(c.call_site, c.op): c.kind for c in model.cube}
    assert kinds[("train.py:40 main", "to")] == "noop"
    assert kinds[("train.py:11 forward", "detach")] == "alias"


def test_event_columns(trace_file: Path) -> None:
    model = build_model(load_trace(trace_file))
    assert model.n_events == EVENTS
    events = [model.event(i) for i in range(model.n_events)]
    assert [(e["t_ms"], e["op"], e["kind"]) for e in events] == [
        (1.0, "clone", "copy"),
        (5.0, "detach", "alias"),
        (31.0, "to", "copy"),
        (41.0, "deepcopy", "copy"),
        (43.0, "deepcopy", "copy"),
        (61.0, "to", "noop"),
        (70.0, "contiguous", "copy"),
    ]
    h2d = events[2]
    assert (h2d["src_device"], h2d["dst_device"], h2d["transfer"]) == ("cpu", "cuda:0", "h2d")
    assert h2d["aten"] == ("aten::_to_copy", "aten::copy_")
    assert (h2d["duration_ns"], h2d["bytes_allocated"], h2d["step"]) == (3 * MS, 8000, 1)
    assert h2d["non_blocking"] is True
    assert events[3]["group"] == "torch.nn.modules.linear.Linear"
    assert events[0]["graph"] == "attached" and events[0]["module"] == SCRIPT_MODULE
    assert events[0]["shape"] == (10, 100) and events[0]["hazard"] is None
    assert len(model.templates) == 7  # all differ (the deepcopy children in their bytes)


def test_hazards_from_the_hazards_span(trace_file: Path) -> None:
    model = build_model(load_trace(trace_file))
    assert model.totals.hazard_count == 1  # the one copytrace.hazard event
    assert model.event(2)["hazard"] == 0  # the h2d to, named by span id
    (h,) = model.hazards
    assert (h.code, h.severity, h.source) == ("CT-TEST", "warning", "trace")
    assert (h.message, h.fix) == ("h2d copy <every> step", "move it out of the loop")
    assert h.call_sites == ["train.py:20 main"]
    assert h.steps == [1]
    assert h.event_ids == [f"{12:016x}"]
    assert model.analysis == "skipped"


@dataclasses.dataclass
class _Finding:
    code: str
    severity: str
    message: str
    fix: str
    call_sites: list
    bytes: int
    steps: list
    event_ids: list


def test_hazards_from_findings(trace_file: Path) -> None:
    data = load_trace(trace_file)
    clone_id, contiguous_id = f"{10:016x}", f"{17:016x}"
    findings = [
        _Finding("CT-INFO", "info", "fyi", "none", [], 0, [], [clone_id]),
        {"code": "CT-BIG", "severity": "error", "message": "m", "fix": "f",
         "call_site": "train.py:11 forward", "bytes": 16000, "step": 2,
         "event_ids": [contiguous_id]},
    ]  # fmt: skip
    model = build_model(data, findings=findings)
    assert model.analysis == "ran"
    codes = [h.code for h in model.hazards]
    assert codes == ["CT-BIG", "CT-INFO"]  # error, info; the trace's own hazards are not merged
    big, info = model.hazards
    assert (big.call_sites, big.bytes, big.steps, big.source) == (
        ["train.py:11 forward"], 16000, [2], "analysis")  # fmt: skip
    assert info.call_sites == ["train.py:10 forward"]  # filled in from its event
    assert info.steps == [0]
    hz = {model.event(i)["op"]: model.event(i)["hazard"] for i in range(model.n_events)}
    assert (hz["contiguous"], hz["clone"]) == (0, 1)


def test_run_analysis(monkeypatch: pytest.MonkeyPatch, trace_file: Path) -> None:
    real = load_trace(write_real_trace(trace_file.parent / "real"))
    findings, status = run_analysis(real)
    assert status == "ran" and [f.code for f in findings or []] == [REAL_HAZARD_CODE]

    data = load_trace(trace_file)
    fake = types.ModuleType("copytrace.analysis")
    fake.analyze = lambda trace: [{"code": "X1", "severity": "warning", "message": "m",  # type: ignore[attr-defined]
                                   "fix": "f", "event_ids": [trace.events[0].span_id]}]  # fmt: skip
    monkeypatch.setitem(sys.modules, "copytrace.analysis", fake)
    findings, status = run_analysis(data)
    assert status == "ran" and len(findings or []) == 1
    model = build_model(data, analyze=True)
    assert [h.code for h in model.hazards] == ["X1"]  # the analysis replaces the trace's own

    def boom(trace: object) -> list:
        raise RuntimeError("bad <input>")

    fake.analyze = boom  # type: ignore[attr-defined]
    assert run_analysis(data) == (None, "failed: RuntimeError: bad <input>")
    model = build_model(data, analyze=True)
    assert model.analysis == "failed: RuntimeError: bad <input>"
    assert [h.code for h in model.hazards] == ["CT-TEST"]  # the hazards the tracer wrote
    assert model.hazards[0].source == "trace"


def test_sample_events_keeps_hazards_and_large_copies(tmp_path: Path) -> None:
    model = build_model(load_trace(write_many(tmp_path, 3000)))
    assert model.n_events == model.n_sampled == 3000
    assert model.totals.hazard_count == 3  # the trace's hazards: one per call site
    chosen = list(range(build_model(event_table(tmp_path), max_points=300).n_sampled))
    assert len(chosen) <= 300
    small = build_model(event_table(tmp_path), max_points=300)
    events = [small.event(i) for i in chosen]
    assert sum(1 for e in events if e["hazard"] is not None) == 12
    assert sum(1 for e in events if e["bytes_logical"] == 4 << 20) == 6
    chosen = sample_events(model, 300)
    assert chosen == sorted(set(chosen))
    events = [model.event(i) for i in chosen]
    hazards = [i for i in range(model.n_events) if model.ev_hazard[i] >= 0]
    large = [i for i in range(model.n_events) if model.event(i)["bytes_logical"] == 4 << 20]
    assert len(hazards) == 12 and len(large) == 6
    assert set(hazards) <= set(chosen) and set(large) <= set(chosen)
    assert len(chosen) <= 300
    # every (call site, op, kind) group is represented, spread over the run
    groups = {(e["call_site"], e["op"], e["kind"]) for e in events}
    assert len(groups) == 4
    clones = [e["t_ms"] for e in events if e["call_site"] == "model.py:20 forward"]
    assert min(clones) < 3000 * 0.1 * 0.2 and max(clones) > 3000 * 0.1 * 0.8
    assert sample_events(model, 10**6) == list(range(3000))
    # a budget smaller than the must-keep set keeps the hazards and the largest copies
    assert set(hazards) <= set(sample_events(model, 5))


def test_sample_events_raises_the_large_threshold_to_stay_bounded(tmp_path: Path) -> None:
    write_many(tmp_path, 3000, large_every=10)
    model = build_model(event_table(tmp_path), max_points=300)
    info = SampleInfo()
    chosen = sample_events(model, 300, info=info)
    assert len(chosen) == model.n_sampled <= 300 + 12  # the 12 hazard events may come on top
    # 300 copies of 4 MiB do not fit in half the budget: they are sampled like the rest;
    # each of the 3 hazards keeps up to max(20, 300 // 30) of its events
    assert info.large_bytes == (4 << 20) + 1 and info.per_hazard == 20
    sites = {model.event(i)["call_site"] for i in chosen}
    assert sites == {"loop.py:5 main", "loop.py:6 main", "loop.py:9 main", "model.py:20 forward"}
    big = [
        model.event(i)["t_ms"] for i in chosen if model.event(i)["call_site"] == "loop.py:9 main"
    ]
    assert 10 < len(big) < 300 and min(big) < 60 and max(big) > 240  # spread over the run


def test_source_lines_only_from_unchanged_files(tmp_path: Path) -> None:
    src = tmp_path / "train.py"
    src.write_text("\n".join(f"x{i} = {i}  # line {i}" for i in range(1, 50)) + "\n")
    lines = [line.replace('"train.py"', json.dumps(str(src))) for line in trace_lines()]
    path = tmp_path / "t.otlp.jsonl"
    path.write_text("\n".join(lines) + "\n")
    before = T0 - 10**9  # the file is older than the run: its lines are shown
    os.utime(src, ns=(before, before))
    model = build_model(load_trace(path))
    site = next(r for r in model.call_sites if r.key.endswith(":20 main"))
    assert (site.label, site.source) == ("train.py:20 main", "x20 = 20  # line 20")
    os.utime(src, ns=(T0 + 10**9, T0 + 10**9))  # changed after the run started: not shown
    model = build_model(load_trace(path))
    assert all(r.source == "" for r in model.call_sites)
    assert build_model(load_trace(path), read_sources=False).site_sources[site.key] == ""


def test_payload_is_compact_json(trace_file: Path) -> None:
    model = build_model(load_trace(trace_file))
    payload = build_payload(model, title="t <x>", max_points=100)
    text = dump_payload(payload)
    assert "<" not in text and ">" not in text and "&" not in text
    back = json.loads(text)
    S = back["S"]
    assert SCRIPT_MODULE in S and back["title"] == "t <x>"
    assert back["pts"]["t"] == [1, 5, 31, 41, 43, 61, 70]
    assert back["sample"] == {"shown": 7, "total": 7, "max_points": 100, "large": "at least 1.0 MiB",
                              "per_hazard": 0}  # fmt: skip
    assert [S[i] for i in back["tpl"]["op"]] == ["clone", "detach", "to", "deepcopy", "deepcopy",
                                                  "to", "contiguous"]  # fmt: skip
    assert sum(back["cube"]["n"]) == EVENTS and sum(back["cube"]["bc"]) == BYTES_COPIED
    assert back["steps"]["stage"] == [0, 1, 2] and back["stages"] == ["warmup", "steady", "tail"]
    assert back["runs"][0]["overhead_ns"] == 1_500_000
    assert len(text) < 20_000


def test_payload_points_at_the_hazards_of_the_trace_file(trace_file: Path) -> None:
    back = json.loads(dump_payload(build_payload(build_model(load_trace(trace_file)), title="t")))
    assert [back["S"][h["code"]] for h in back["hazards"]] == ["CT-TEST"]
    assert back["pts"]["hz"] == [-1, -1, 0, -1, -1, -1, -1]  # the h2d to, third event


def test_truncated_last_line_is_skipped_and_counted(tmp_path: Path) -> None:
    path = write_trace(tmp_path, truncated=True)
    data = load_trace(path)
    assert data.bad_lines == 1
    model = build_model(data)
    assert model.bad_lines == 1
    assert (model.totals.events, model.totals.bytes_allocated) == (EVENTS, BYTES_ALLOCATED)


def test_file_cut_before_run_span(tmp_path: Path) -> None:
    lines = trace_lines()
    path = tmp_path / "cut.otlp.jsonl"
    path.write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][:50], encoding="utf-8")
    data = load_trace(path)
    assert data.bad_lines == 1
    (run,) = data.runs
    assert not run.has_run_span
    assert (run.start_ns, run.end_ns) == (T0, T0 + 100 * MS)  # from the step spans
    model = build_model(data)
    assert not model.runs[0].complete
    assert model.runs[0].events_recorded is None and model.runs[0].events_loaded == 8
    assert model.totals.bytes_allocated == BYTES_ALLOCATED


def test_directory_with_two_processes_and_gzip(tmp_path: Path) -> None:
    write_trace(tmp_path, pid=1)
    write_trace(tmp_path, pid=2, gz=True)
    (tmp_path / "notes.txt").write_text("not a trace")
    data = load_trace(tmp_path)
    assert [p.name for p in data.files] == [
        "copytrace-testhost-1.otlp.jsonl",
        "copytrace-testhost-2.otlp.jsonl.gz",
    ]
    model = build_model(data)
    assert [r.label for r in model.runs] == ["pid 1", "pid 2"]
    assert model.multi_run
    assert model.totals.events == 2 * EVENTS
    assert model.totals.bytes_allocated == 2 * BYTES_ALLOCATED
    assert len(model.steps) == 6
    assert model.top_call_sites("bytes_copied", 1)[0].bytes_copied == 2 * 16000
    payload = build_payload(model, title="t")
    assert [payload["S"][r["label"]] for r in payload["runs"]] == ["pid 1", "pid 2"]
    assert sorted(set(payload["cube"]["run"])) == [0, 1]
    assert payload["steps"]["run"] == [0, 0, 0, 1, 1, 1]


def test_duplicate_spans_are_kept_once(tmp_path: Path) -> None:
    path = write_trace(tmp_path)
    (tmp_path / "copy.otlp.jsonl").write_bytes(path.read_bytes())
    model = build_model(load_trace(tmp_path))
    assert len(model.runs) == 1
    assert model.totals.events == EVENTS


def test_rank_label(tmp_path: Path) -> None:
    lines = trace_lines(pid=7)
    doc = json.loads(lines[2])
    doc["resourceSpans"][0]["resource"]["attributes"].append(
        {"key": "copytrace.rank", "value": {"intValue": "3"}}
    )
    path = tmp_path / "r.otlp.jsonl"
    path.write_text("\n".join([lines[0], lines[1], json.dumps(doc)]) + "\n")
    (run,) = build_model(load_trace(path)).runs
    assert (run.rank, run.label) == (3, "rank 3 (pid 7)")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "no readable copytrace spans"),
        (os.urandom(4096), "no readable copytrace spans"),
        (b'{"resourceSpans": []}\n', "no readable copytrace spans"),
        (b"[1, 2, 3]\n{\n", "no readable copytrace spans"),
        (gzip.compress(b"hello")[:8], "no readable copytrace spans"),
    ],
    ids=["empty", "random-bytes", "no-spans", "not-otlp", "cut-gzip"],
)
def test_unreadable_files_raise(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.otlp.jsonl"
    path.write_bytes(content)
    with pytest.raises(TraceFileError, match=message) as info:
        load_trace(path)
    assert "\n" not in str(info.value)


def test_missing_path_and_empty_directory_raise(tmp_path: Path) -> None:
    with pytest.raises(TraceFileError, match="not found"):
        load_trace(tmp_path / "nope")
    with pytest.raises(TraceFileError, match="no trace files"):
        load_trace(tmp_path)


def test_render_html(trace_file: Path, tmp_path: Path) -> None:
    out = render_html(build_model(load_trace(trace_file)), tmp_path / "sub" / "r.html")
    assert out == tmp_path / "sub" / "r.html"
    page = out.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    for fig in ("steps", "treemap", "timeline", "kinds", "transfers"):
        assert f'data-fig="{fig}"' in page
    # self-contained: plotly.js inlined exactly once (gzip + base64), nothing loaded from the
    # network
    packed = re.findall(
        r'<script type="application/gzip\+base64" id="ct-plotly">([^<]*)</script>', page
    )
    assert len(packed) == 1
    js = gzip.decompress(base64.b64decode(packed[0])).decode()
    assert js == plotly.offline.get_plotlyjs()
    assert len(packed[0]) < 0.45 * len(js)  # about 1.9 MB instead of 4.8 MB
    assert not re.search(r"<script[^>]*\ssrc=", page)
    assert "https://" not in page.split('id="ct-data"')[1].split("</script>")[0]
    # plotly.js, its unpacker, the data, the report script
    assert page.count("<script") == 4
    # trace strings only as escaped JSON data: never as markup
    assert SCRIPT_MODULE not in page
    assert "\\u003cscript\\u003ealert(1)\\u003c/script\\u003e" in page
    # header: title from the command: the program and its arguments
    assert "<title>copytrace: train.py --epochs 1</title>" in page
    data = json.loads(page.split('id="ct-data">')[1].split("</script>")[0])
    assert data["totals"]["bc"] == BYTES_COPIED and data["totals"]["events"] == EVENTS
    assert "train.py:11 forward" in data["S"]


def test_render_html_escapes_title_and_cdn_mode(trace_file: Path, tmp_path: Path) -> None:
    model = build_model(load_trace(trace_file))
    out = render_html(model, tmp_path / "r.html", title="<b>t</b>", offline=False)
    page = out.read_text(encoding="utf-8")
    assert "<title>&lt;b&gt;t&lt;/b&gt;</title>" in page
    assert (
        len(re.findall(r'<script[^>]*\ssrc="https://cdn\.plot\.ly/plotly-[\d.]+\.min\.js"', page))
        == 1
    )
    assert "* plotly.js v" not in page and 'id="ct-plotly"' not in page
    assert len(page) < 200_000


def test_truncated_trace_report_warns_in_page(tmp_path: Path) -> None:
    path = write_trace(tmp_path, truncated=True)
    page = write_report(path, tmp_path / "r.html").read_text(encoding="utf-8")
    assert "1 unreadable line(s) were skipped" in page


def test_report_size_is_bounded(tmp_path: Path) -> None:
    model = build_model(load_trace(write_many(tmp_path, 4000)))
    small = render_html(model, tmp_path / "small.html", offline=False, max_points=200)
    big = render_html(model, tmp_path / "big.html", offline=False, max_points=10_000)
    assert small.stat().st_size < big.stat().st_size < 200_000
    data = json.loads(small.read_text().split('id="ct-data">')[1].split("</script>")[0])
    assert data["sample"]["total"] == 4000 and data["sample"]["shown"] <= 200 + 16
    assert sum(data["cube"]["n"]) == 4000  # aggregates still count every event


def test_compiled_section_ships_as_json() -> None:
    """The compiled-regions section is page data like every other section."""
    from copytrace.dashboards._compiled import CompiledSection, GraphCopyRow
    from copytrace.dashboards.sections.compiled import payload_compiled

    row = GraphCopyRow(
        graph="1/0", kind="forward", op="aten::clone", copy_kind="clone", shape=[32, 64],
        dtype="float32", device="cpu", bytes=32 * 64 * 4, runs=6, file="m.py", line=3,
        code="y = x.clone()",
    )  # fmt: skip
    section = CompiledSection(calls=6, time_ns=5_000_000, graphs=1,
                              graph_copy_bytes=6 * 8192, rows=[row], mode="compiled")  # fmt: skip
    model = types.SimpleNamespace(compiled=section, totals=types.SimpleNamespace(bytes_copied=16384))
    part = payload_compiled(model)
    json.dumps(part, allow_nan=False)
    assert part["share_pct"] == 75.0  # 49152 graph-copy bytes of 49152 + 16384 observed
    (r,) = part["rows"]
    assert (r["bytes"], r["runs"], r["total_bytes"]) == (8192, 6, 49152)
    assert (r["site"], r["code"], r["shape"]) == ("m.py:3", "y = x.clone()", ["32", "64"])
    assert payload_compiled(types.SimpleNamespace(compiled=None)) is None


def test_call_sites_beyond_the_cap_are_summed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trace with a call site per event: the report names the top sites and sums the rest
    under one key, with the totals unchanged."""
    from copytrace.dashboards.sections import sources as sources_section

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from report_size import generate_trace

    path = tmp_path / "copytrace-1.otlp.jsonl"
    generate_trace(path, 300, mix="sites")
    whole = build_model(event_table(path), read_sources=False, timeline=False)
    monkeypatch.setattr(sources_section, "MAX_SITES", 10)
    capped = build_model(event_table(path), read_sources=False, timeline=False)
    assert len(whole.call_sites) == 300  # one site per event
    keys = [r.key for r in capped.call_sites]
    assert len(keys) == 11 and sources_section.OTHER_SITES in keys
    # the ten named are the ten largest of the whole table
    named = sorted(whole.call_sites, key=lambda r: (-r.bytes_copied, -r.time_ns, r.key))[:10]
    assert set(keys) - {sources_section.OTHER_SITES} == {r.key for r in named}
    for field in ("count", "bytes_copied", "time_ns"):
        assert sum(getattr(r, field) for r in capped.call_sites) == sum(
            getattr(r, field) for r in whole.call_sites)
