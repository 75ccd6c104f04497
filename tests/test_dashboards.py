"""Tests of copytrace.dashboards: loading, aggregation and the HTML report.

The synthetic trace comes from ``tests/_tracegen.py``; its module docstring lists every span.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path

import pytest
from _tracegen import MS, SCRIPT_MODULE, T0, trace_lines, write_trace

from copytrace._errors import TraceFileError
from copytrace.dashboards import build_model, load_trace, render_html, write_report
from copytrace.dashboards._load import decode_value

ESCAPED_MODULE = "&lt;script&gt;alert(1)&lt;/script&gt;"

# Expected values for one synthetic run (see tests/_tracegen.py). Non-group events:
#   clone 4000/4000 B 2 ms, detach (alias) 0/4000 B 0.5 ms, to h2d 8000/8000 B 3 ms,
#   deepcopy child 2000/2000 B 1 ms, deepcopy child 1000/1000 B 1 ms,
#   to (no-op, alias) 0/1000 B 0.1 ms, contiguous 16000/16000 B 4 ms.
EVENTS = 7  # the deepcopy group span (3000 B, 6 ms) is not counted
BYTES_ALLOCATED = 4000 + 0 + 8000 + 2000 + 1000 + 0 + 16000  # 31000
BYTES_LOGICAL = 4000 + 4000 + 8000 + 2000 + 1000 + 1000 + 16000  # 36000
COPY_TIME_NS = (2 + 0.5 + 3 + 1 + 1 + 0.1 + 4) * MS  # 11.6 ms
ALIASES = 2  # detach, no-op to
NOOPS = 1
COPIES = EVENTS - ALIASES  # 5 (the no-op is also an alias)


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
    assert clone.attrs["copytrace.alias"] is False
    assert clone.attrs["copytrace.module"] == SCRIPT_MODULE


def test_totals_do_not_double_count_groups(trace_file: Path) -> None:
    t = build_model(load_trace(trace_file)).totals
    assert t.events == EVENTS == 7
    assert t.bytes_allocated == BYTES_ALLOCATED == 31000  # 34000 if the group were counted
    assert t.bytes_logical == BYTES_LOGICAL == 36000
    assert t.copy_time_ns == COPY_TIME_NS == 11_600_000
    assert (t.alias_count, t.copy_count, t.noop_count) == (ALIASES, COPIES, NOOPS)
    assert t.group_count == 1
    assert t.error_count == 0


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
    assert run.complete
    assert model.bad_lines == 0


def test_per_step_rows(trace_file: Path) -> None:
    steps = build_model(load_trace(trace_file)).steps
    got = [
        (s.step, s.duration_ns, s.copy_count, s.alias_count, s.bytes_allocated, s.copy_time_ns)
        for s in steps
    ]
    assert got == [
        # step 0: clone (2 ms) + detach alias (0.5 ms) in a 30 ms step
        (0, 30 * MS, 1, 1, 4000, 2_500_000),
        # step 1: to h2d (3 ms) + 2 deepcopy children (1 ms each); the group is not counted
        (1, 30 * MS, 3, 0, 11000, 5_000_000),
        # step 2: no-op to (0.1 ms, alias) + contiguous (4 ms) in a 40 ms step
        (2, 40 * MS, 1, 1, 16000, 4_100_000),
    ]
    shares = [s.copy_time_share_pct for s in steps]
    assert shares == pytest.approx([2.5 / 30 * 100, 5 / 30 * 100, 4.1 / 40 * 100])
    assert shares == pytest.approx([8.3333333, 16.6666667, 10.25])


def test_call_sites_modules_ops_transfers(trace_file: Path) -> None:
    model = build_model(load_trace(trace_file))
    by_bytes = [
        (r.key, r.bytes_allocated, r.count) for r in model.top_call_sites("bytes_allocated")
    ]
    assert by_bytes == [
        ("train.py:11 forward", 16000, 2),  # detach (0 B) + contiguous (16000 B)
        ("train.py:20 main", 8000, 1),
        ("train.py:10 forward", 4000, 1),
        ("train.py:30 main", 3000, 2),  # the deepcopy children, not the group
        ("train.py:40 main", 0, 1),
    ]
    by_time = [(r.key, r.time_ns) for r in model.top_call_sites("time_ns", 3)]
    assert by_time == [
        ("train.py:11 forward", 4_500_000),
        ("train.py:20 main", 3_000_000),
        ("train.py:10 forward", 2_000_000),  # ties with :30 main; broken by key
    ]
    assert [r.key for r in model.top_call_sites("count", 2)] == [
        "train.py:11 forward",
        "train.py:30 main",
    ]
    modules = [(r.key, r.bytes_allocated, r.count, r.alias_count) for r in model.modules]
    assert modules == [
        ("encoder", 16000, 2, 1),
        ("(no module)", 11000, 4, 1),  # to h2d 8000 + children 3000 + no-op 0
        (SCRIPT_MODULE, 4000, 1, 0),
    ]
    ops = {o.op: (o.count, o.copy_count, o.alias_count, o.noop_count, o.bytes_allocated)
           for o in model.ops}  # fmt: skip
    assert ops == {
        "contiguous": (1, 1, 0, 0, 16000),
        "to": (2, 1, 1, 1, 8000),
        "clone": (1, 1, 0, 0, 4000),
        "deepcopy": (2, 2, 0, 0, 3000),
        "detach": (1, 0, 1, 0, 0),
    }
    transfers = [
        (t.src_device, t.dst_device, t.transfer, t.count, t.bytes_allocated, t.bytes_logical)
        for t in model.transfers
    ]
    assert transfers == [
        ("cpu", "cpu", "none", 6, 23000, 28000),
        ("cpu", "cuda:0", "h2d", 1, 8000, 8000),
    ]
    (group,) = model.groups
    assert (group.object_type, group.tensors, group.children, group.bytes_allocated) == (
        "torch.nn.modules.linear.Linear",
        2,
        2,
        3000,
    )
    assert (group.step, group.duration_ns, group.call_site) == (1, 6 * MS, "train.py:30 main")


def test_timeline_points(trace_file: Path) -> None:
    model = build_model(load_trace(trace_file))
    points = model.timeline
    assert [(p.t_ms, p.op) for p in points] == [
        (1.0, "clone"),
        (5.0, "detach"),
        (31.0, "to"),
        (41.0, "deepcopy"),
        (43.0, "deepcopy"),
        (61.0, "to"),
        (70.0, "contiguous"),
    ]
    h2d = points[2]
    assert (h2d.src_device, h2d.dst_device, h2d.transfer) == ("cpu", "cuda:0", "h2d")
    assert h2d.aten == ["aten::_to_copy", "aten::copy_"]
    assert (h2d.duration_ns, h2d.bytes_allocated, h2d.step, h2d.phase) == (3 * MS, 8000, 1, "other")
    assert points[3].group == "torch.nn.modules.linear.Linear"
    assert points[0].graph == "attached" and points[0].module == SCRIPT_MODULE
    assert points[5].noop and points[5].alias
    assert model.step_bounds_ms == {"pid 4242": [(0, 0.0, 30.0), (1, 30.0, 60.0), (2, 60.0, 100.0)]}


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
    assert model.top_call_sites("bytes_allocated", 1)[0].bytes_allocated == 2 * 16000
    page = render_html(model, tmp_path / "r.html").read_text(encoding="utf-8")
    assert "<td>pid 1</td>" in page and "<td>pid 2</td>" in page  # per-run metadata table
    assert page.count("Plotly.newPlot") == 6


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
    # figures: timeline, per step, call sites, modules, ops, transfers
    assert page.count("Plotly.newPlot") == 6
    assert page.count('class="plotly-graph-div"') == 6
    for fid in ("timeline", "steps", "sites", "modules"):
        assert f'id="copytrace-{fid}"' in page
    # self-contained: plotly.js inlined exactly once, nothing loaded from the network
    assert len(re.findall(r"\* plotly\.js v\d", page)) == 1
    assert '<script src="http' not in page
    assert not re.search(r"<script[^>]*\ssrc=", page)
    # trace strings are escaped: as text in the tables, as entities in plotly's JSON
    assert SCRIPT_MODULE not in page
    assert ESCAPED_MODULE in page
    assert "&lt;script&gt;alert(1)&lt;\\u002fscript&gt;" in page  # hover text / tick label
    # header: metadata and totals
    assert "train.py --epochs 1" in page
    assert "2.13.0+cpu" in page
    assert "31,000 B" in page and "36,000 B" in page and "11.60 ms" in page
    assert "train.py:11 forward" in page
    assert "torch.nn.modules.linear.Linear" in page
    assert "step 2" in page


def test_render_html_escapes_title_and_cdn_mode(trace_file: Path, tmp_path: Path) -> None:
    model = build_model(load_trace(trace_file))
    out = render_html(model, tmp_path / "r.html", title="<b>t</b>", offline=False)
    page = out.read_text(encoding="utf-8")
    assert "<title>&lt;b&gt;t&lt;/b&gt;</title>" in page
    assert len(re.findall(r'<script[^>]*\ssrc="https://cdn\.plot\.ly/', page)) == 1
    assert len(page) < 500_000


def test_truncated_trace_report_warns_in_page(tmp_path: Path) -> None:
    path = write_trace(tmp_path, truncated=True)
    page = write_report(path, tmp_path / "r.html").read_text(encoding="utf-8")
    assert "1 unreadable line(s) were skipped" in page
