"""A flush by count: a step holding ``FULL_FACTOR`` (4) x ``flush_events`` records is handed to
the export thread before it ends (``copytrace.tracer._buffer``), and the trace written is
the one a single flush at the step's end writes: the same spans, parents and order of the
events, the same sidecar rows."""

from __future__ import annotations

import gzip
import json
import threading
import warnings
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider

import copytrace
from copytrace.export.file_sink import FileSink
from copytrace.export.pipeline import Chunk, ExportPipeline, RunEnd, RunIds
from copytrace.export.sdk_sink import SdkSink, make_resource
from copytrace.schema import CopyEvent
from copytrace.tracer._buffer import FULL_FACTOR


def _spans(path: Path) -> list[dict]:
    """Every span of the trace file, in the file's order."""
    opener = gzip.open if path.suffix == ".gz" else open
    spans = []
    with opener(path, "rt") as f:
        for line in f:
            for rs in json.loads(line)["resourceSpans"]:
                for ss in rs["scopeSpans"]:
                    spans.extend(ss["spans"])
    return spans


def _copies(n: int) -> None:
    """``3 n`` copy events: an attached clone (its tail in Python), a detach and a cast (both
    recorded in C by the observer's fast path)."""
    x, y = torch.randn(4, requires_grad=True), torch.randn(4)
    for _ in range(n):
        x.clone()
        y.detach()
        y.to(torch.float64)


@pytest.mark.parametrize("observer", ["auto", "python"])
def test_a_run_without_steps_is_flushed_by_count_before_it_stops(
    tmp_path: Path, observer: str
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with copytrace.trace(tmp_path, flush_events=32, observer=observer) as t:
            _copies(100)
            # 300 records, a flush each time the buffer holds 4 x 32 = 128. The first at
            # record 127 (a detach) takes all 128. The second, when the buffer holds 128
            # again, is checked right after record 255 (128 + 127, 255 % 3 == 0: a clone)
            # whose result the program still holds: it stays buffered (its facts may still
            # change) with what follows: 128 + 127 records handed over, 45 buffered
            assert FULL_FACTOR * 32 == 128
            flushes, buffered = t.session.stats["flushes"], len(t.session.events)
    assert (flushes, buffered) == (2, 45)
    assert t.session.stats["events"] == 300
    spans = _spans(t.trace_path)
    events = [s for s in spans if s["name"] in ("copytrace.clone", "copytrace.detach",
                                                "copytrace.to")]  # fmt: skip
    steps = [s for s in spans if s["name"] == "copytrace.step"]
    assert len(events) == 300 and len(steps) == 1
    starts = [int(s["startTimeUnixNano"]) for s in events]
    assert starts == sorted(starts)  # in the program's order
    assert {s["parentSpanId"] for s in events} == {steps[0]["spanId"]}
    ops = [s["name"] for s in events]
    assert ops == ["copytrace.clone", "copytrace.detach", "copytrace.to"] * 100


def test_no_flush_by_count_when_flush_events_is_0(tmp_path: Path) -> None:
    with copytrace.trace(tmp_path, flush_events=0) as t:
        _copies(50)
        flushes, buffered = t.session.stats["flushes"], len(t.session.events)
    assert (flushes, buffered) == (0, 150)


def test_no_flush_by_count_from_another_thread(tmp_path: Path) -> None:
    """The traced thread may be amid a record: another thread's full buffer is flushed
    later, by the traced thread."""
    with copytrace.trace(tmp_path, flush_events=32) as t:
        session = t.session
        rec = session._rec
        other = threading.Thread(target=rec.full)
        _copies(20)  # 60 records, under 128
        flush_at = rec.flush_at
        other.start()
        other.join()
        assert session.stats["flushes"] == 0
        assert rec.flush_at == 60 + 128  # asked again 128 records later
        assert flush_at == 128
        _copies(43)  # 189 records: the traced thread's check after record 187, a detach
        assert (session.stats["flushes"], len(session.events)) == (1, 1)


def test_only_sinks_that_keep_planned_parents_take_a_flush_by_count(tmp_path: Path) -> None:
    run = RunIds(0, 0, make_resource())
    file_sink = FileSink(tmp_path / "t.otlp.jsonl")
    ours, theirs = SdkSink(()), SdkSink(tracer_provider=TracerProvider())
    assert ExportPipeline(run, [file_sink, ours]).early_parents()
    # a user's provider makes its own span ids: a step's span not yet made cannot be a parent
    assert not ExportPipeline(run, [file_sink, theirs]).early_parents()
    file_sink.close()


def _records() -> list[CopyEvent]:
    """Real records of one step: copies, a deepcopy group and its children."""
    import copy

    import torch.nn as nn

    w = torch.randn(10, 100, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with copytrace.trace(write=False) as t:
            for _ in range(4):
                w.clone()
                copy.deepcopy(nn.Linear(3, 3))
                w.detach()
                w.to(torch.float64)
            events = t.session.events
    return events


def _write(tmp: Path, events: list[CopyEvent], cuts: list[int]) -> tuple[list[dict], Path]:
    """The records written by one pipeline, cut into chunks at ``cuts`` (flushes by count,
    step 0 open), then the final chunk ending step 0."""
    run = RunIds(events[0].start_ns, 1_000, make_resource())
    run.trace_id, run.span_id = 0xABC, 0xDEF  # the same run in both files
    sink = FileSink(tmp / "t.otlp.jsonl.gz", compression="gzip", sidecar=True)
    pipeline = ExportPipeline(run, [sink])
    pipeline.begin()
    start = 0
    for cut in cuts:
        chunk = Chunk(events[start:cut])
        chunk.open_step = 0
        pipeline.write_now(chunk)
        start = cut
    steps = [(0, events[0].start_ns, events[-1].end_ns)]
    end = RunEnd(events[-1].end_ns, {"copytrace.events": len(events)})
    pipeline.write_now(Chunk(events[start:], steps, final=end))
    pipeline._close_sinks()
    return _spans(sink.path), sink.path


def _named(spans: list[dict]) -> list[dict]:
    """The spans with each span id replaced by its span's place among the spans of its name
    (ids are random per plan)."""
    count: dict[str, int] = {}
    label: dict[str, str] = {}
    for s in spans:
        n = count[s["name"]] = count.get(s["name"], -1) + 1
        label[s["spanId"]] = f"{s['name']}#{n}"
    out = []
    for s in spans:
        s = dict(s)
        s["spanId"] = label[s["spanId"]]
        if "parentSpanId" in s:
            s["parentSpanId"] = label.get(s["parentSpanId"], "outside")
        out.append(s)
    return out


def _rows(path: Path) -> list[dict[str, Any]]:
    table = pq.read_table(path.parent / ".copytrace-cache" / (path.name + ".events"))
    return table.drop(["span_id", "parent_id"]).to_pylist()


def test_chunks_cut_before_the_step_ends_write_the_trace_of_one_flush(tmp_path: Path) -> None:
    events = _records()
    assert len(events) == 24  # 4 x (clone, a deepcopy group and its 2 children, detach, to)
    (tmp_path / "one").mkdir()
    (tmp_path / "cut").mkdir()
    one, one_path = _write(tmp_path / "one", events, [])
    # chunks of records 0-4, 5 alone, 6-18, then 19 (a group) to 23 with the step's end
    cut, cut_path = _write(tmp_path / "cut", events, [5, 6, 19])
    one, cut = _named(one), _named(cut)
    # the step's span comes with the chunk that ends the step: after the records cut before
    # it, where a single flush writes it first; every other span is the same, in one order
    assert [s["name"] for s in one][0] == "copytrace.step"
    assert one[1:20] == cut[:19]
    assert cut[19] == one[0]
    assert one[20:] == cut[20:]
    assert len(one) == 26  # the step, 24 records, the run
    assert {s["parentSpanId"] for s in cut if s["name"] == "copytrace.clone"} == {
        "copytrace.step#0"
    }
    rows, cut_rows = _rows(one_path), _rows(cut_path)
    assert rows[0]["name"] == cut_rows[19]["name"] == "copytrace.step"
    assert cut_rows == rows[1:20] + rows[:1] + rows[20:]  # the sidecar, in the file's order
