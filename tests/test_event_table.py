"""The columnar event table (``copytrace.tracefile.event_table``): cut, corrupt and
mixed-version files lose only what cannot be read, the Parquet cache, several ranks, and
``copytrace export --parquet``.

The synthetic trace (``_tracegen.write_trace``) has 4 lines: 8 event spans (7 events and a
deepcopy group), then 3 step spans, then the run span, then a hazards span.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from _tracegen import trace_lines, write_many, write_trace

from copytrace._errors import TraceFileError
from copytrace.cli import main
from copytrace.dashboards import build_model
from copytrace.tracefile import event_table, load_trace

EVENT_SPANS = 8  # 7 events + 1 deepcopy group


def _events(table) -> list[str]:  # type: ignore[no-untyped-def]
    rows = table.read(["name", "op"])
    names = rows.column("name").to_pylist()
    meta = {"copytrace.run", "copytrace.step", "copytrace.hazards"}
    return [op for op, n in zip(rows.column("op").to_pylist(), names, strict=True)
            if n not in meta]  # fmt: skip


def test_cut_file_keeps_every_whole_line(tmp_path: Path) -> None:
    write_trace(tmp_path, truncated=True)
    table = event_table(tmp_path, cache=False)
    assert table.bad_lines == 1
    assert len(_events(table)) == EVENT_SPANS


def test_cut_gzip_file_keeps_what_decompresses(tmp_path: Path) -> None:
    path = write_trace(tmp_path, gz=True)
    lines = trace_lines()
    # a gzip stream whose last member (the run line) is cut mid-write
    head = gzip.compress(("\n".join(lines[:2]) + "\n").encode())
    tail = gzip.compress((lines[2] + "\n").encode())
    path.write_bytes(head + tail[: len(tail) // 2])
    table = event_table(path, cache=False)
    assert table.bad_lines == 1
    assert len(_events(table)) == EVENT_SPANS  # the first two lines survive
    assert table.unfinished_runs() == [f"{4242:032x}"]  # the run span was in the cut line


def test_corrupt_line_in_the_middle_is_skipped_alone(tmp_path: Path) -> None:
    lines = trace_lines()
    path = tmp_path / "t.otlp.jsonl"
    path.write_text("\n".join([lines[0], '{"resourceSpans": [garbage', lines[1], lines[2]]))
    table = event_table(path, cache=False)
    assert table.bad_lines == 1
    assert len(_events(table)) == EVENT_SPANS
    assert table.unfinished_runs() == []


def test_mixed_version_values_are_read(tmp_path: Path) -> None:
    """Another writer's typing (an ``intValue`` as a JSON number, a ``doubleValue`` as
    "NaN") cannot go through pyarrow's typed reader: the line is read by the Python reader,
    not lost."""
    lines = trace_lines()
    numeric = lines[0].replace('{"intValue":"4000"}', '{"intValue":4000}')
    assert numeric != lines[0]
    path = tmp_path / "t.otlp.jsonl"
    path.write_text("\n".join([numeric, lines[1], lines[2]]) + "\n")
    table = event_table(path, cache=False)
    assert table.bad_lines == 0
    rows = table.read(["op", "bytes_allocated"]).to_pylist()
    assert {"op": "clone", "bytes_allocated": 4000} in rows
    model = build_model(table)
    assert model.totals.bytes_allocated == 31000  # as for the original file


def test_unreadable_file_is_one_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "t.otlp.jsonl"
    path.write_bytes(b"\x00\x01 not json\n")
    with pytest.raises(TraceFileError, match=r"^no readable copytrace spans in .*t\.otlp\.jsonl "
                       r"\(1 unreadable line\(s\)\)$"):  # fmt: skip
        event_table(path, cache=False)


def test_foreign_spans_are_left_out(tmp_path: Path) -> None:
    doc = json.loads(trace_lines()[0])
    spans = doc["resourceSpans"][0]["scopeSpans"][0]["spans"]
    spans.append(dict(spans[0], name="http.request", spanId="ffffffffffffffff", attributes=[]))
    path = tmp_path / "t.otlp.jsonl"
    path.write_text(json.dumps(doc) + "\n")
    assert len(_events(event_table(path, cache=False))) == EVENT_SPANS


def test_cache_is_written_beside_and_renewed_when_the_file_changes(tmp_path: Path) -> None:
    path = write_trace(tmp_path)
    cache = path.parent / ".copytrace-cache" / (path.name + ".events.parquet")
    first = event_table(path)
    assert first.parts[0].parquet == cache and cache.exists()
    again = event_table(path)
    assert again.parts[0].parquet == cache and len(_events(again)) == EVENT_SPANS
    path.write_text("\n".join(trace_lines()[:1]) + "\n")  # the file changed: read it again
    changed = event_table(path)
    assert changed.unfinished_runs() == [f"{4242:032x}"]


def test_loaded_events_have_copy_event_field_names(tmp_path: Path) -> None:
    ev = load_trace(write_trace(tmp_path)).runs[0].events[0]
    # clone of 4000 B at train.py:10 forward (see _tracegen), defaults for absent attributes
    assert (ev.op, ev.bytes_allocated, ev.file, ev.line, ev.function) == (
        "clone", 4000, "train.py", 10, "forward")  # fmt: skip
    assert (ev.aten, ev.shape, ev.transfer, ev.non_blocking) == (
        ("aten::clone",), (10, 100), "none", False)  # fmt: skip


def test_eight_ranks(tmp_path: Path) -> None:
    for rank in range(8):
        write_many(tmp_path, 500, pid=6000 + rank)
    table = event_table(tmp_path)
    model = build_model(table, max_points=1000)
    assert len(model.runs) == 8 and model.totals.events == 8 * 500
    assert [r.label for r in model.runs] == [f"pid {6000 + r}" for r in range(8)]
    assert model.n_sampled <= 1000 + 8 * 2  # the hazard events may come on top


def test_export_parquet(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_trace(tmp_path / "t")
    out = tmp_path / "events.parquet"
    assert main(["export", str(tmp_path / "t"), "--parquet", str(out)]) == 0
    assert capsys.readouterr().out == f"copytrace: {EVENT_SPANS} events written to {out}\n"
    rows = pq.read_table(out)
    assert rows.num_rows == EVENT_SPANS
    assert pc.sum(rows.column("bytes_allocated")).as_py() == 31000  # the group's 3000 B once
    assert pc.sum(rows.column("group_bytes_allocated")).as_py() == 3000
    assert "attrs_json" not in rows.column_names
