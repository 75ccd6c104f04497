"""The file sink's bulk path (``copytrace.export.columnar``) against its per-event encoder:
the same records give the same OTLP/JSON text, byte for byte (span ids aside, which are
random per plan), in request lines within the size limit, and the same sidecar rows; a record holding a value
its column cannot hold takes the per-event path, with the same result."""

from __future__ import annotations

import copy
import gzip
import re
import warnings
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn as nn

import copytrace
from copytrace.export import columnar
from copytrace.export.file_sink import FileSink
from copytrace.export.pipeline import Chunk, ExportPipeline, RunEnd, RunIds
from copytrace.export.sdk_sink import make_resource
from copytrace.schema import CopyEvent
from copytrace.tracer import _native

_IDS = re.compile(r'"(spanId|parentSpanId)":"[0-9a-f]{16}"')


def _events() -> list[CopyEvent]:
    """Real records of a mix of copies: clones, aliases, casts, a deepcopy group and its
    children, advanced indexing, ``.data``, ``torch.tensor`` of a tensor."""
    w = torch.randn(10, 100, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with copytrace.trace(write=False) as t:
            for _ in range(3):
                w.clone()
                w.detach()
                copy.deepcopy(nn.Linear(3, 3))
                w.to(torch.float64, non_blocking=True)
                w.data  # noqa: B018
                torch.tensor(w)
                w[[0, 1]]
                w.T.contiguous()
                t.step()
            events = t.session.events
    return events


def _observer() -> Any:
    """The C++ observer (the tracer hands its ``event_columns`` and ``span_json`` to the file
    sink)."""
    module = _native.load()
    if module is None:
        pytest.skip(f"no C++ observer: {_native.status()['reason']}")
    return module


def _extract() -> columnar.Extract:
    return _observer().event_columns  # type: ignore[no-any-return]


def _write(tmp: Path, events: list[CopyEvent], bulk: bool, max_line: int,
           native: bool = False, gz: bool = False) -> tuple[str, Path]:  # fmt: skip
    run = RunIds(events[0].start_ns, 1_000, make_resource())
    run.trace_id, run.span_id = 0xABC, 0xDEF  # the same run in both files
    codecs = {"extract": _extract(), "encode": _observer().span_json} if native else {}
    name = "t.otlp.jsonl.gz" if gz else "t.otlp.jsonl"
    sink = FileSink(tmp / name, compression="gzip" if gz else None, sidecar=True, bulk=bulk,
                    max_line_bytes=max_line, **codecs)  # fmt: skip
    pipeline = ExportPipeline(run, [sink])
    pipeline.begin()
    steps = [(0, events[0].start_ns, events[-1].end_ns)]
    pipeline.write_now(Chunk(events, steps))
    pipeline.close(Chunk([], [], final=RunEnd(events[-1].end_ns, {"copytrace.events": 1})))
    text = gzip.open(sink.path, "rt").read() if gz else sink.path.read_text()
    return _IDS.sub('"ID":""', text), sink.path


def _spans(text: str) -> str:
    """The spans' text of every request line, joined (a line's spans are ``,``-separated):
    the bulk path starts a line of its own for a run of copy events."""
    head, tail = '"spans":[', "]}]}]}"
    return ",".join(line[line.index(head) + len(head) : -len(tail)] for line in text.splitlines())


def _sidecar(path: Path) -> list[dict]:
    table = pq.read_table(path.parent / ".copytrace-cache" / (path.name + ".events"))
    return table.drop(["span_id", "parent_id"]).to_pylist()


@pytest.mark.parametrize("max_line", [4_000, 1_000_000])
def test_bulk_text_lines_and_rows_equal_the_per_event_encoder(
    tmp_path: Path, max_line: int
) -> None:
    events = _events()
    odd = [copy.copy(ev) for ev in events]
    odd[0].error = 'RuntimeError: ü "quoted"\n'  # escaped once per distinct value
    odd[1].file = "/p/ä\\b.py"
    odd[2].transfer, odd[2].pinned = "h2d", True  # pinned is written on h2d copies only
    odd[3].src_stride = []  # an empty analysis list is written, () is not
    odd[4].saved_by = ("AddmmBackward0.mat2",)
    odd[5].op = ""  # no op attribute: the table's op is the (empty) name's
    odd[6].aten = []  # an empty list of another field is not written
    odd[7].shape = ()
    for records in (events, odd):
        for d in "abc":
            (tmp_path / d).mkdir(exist_ok=True)
        one, one_path = _write(tmp_path / "a", records, False, max_line)
        bulk, bulk_path = _write(tmp_path / "b", records, True, max_line)
        native, native_path = _write(tmp_path / "c", records, True, max_line, native=True)
        assert _spans(bulk) == _spans(one)
        assert _spans(native) == _spans(one)
        assert max(map(len, bulk.splitlines())) <= max_line
        assert _sidecar(bulk_path) == _sidecar(one_path)
        assert _sidecar(native_path) == _sidecar(one_path)
    # 27 records + 1 step + the run span: several lines at 4,000 bytes
    assert len(bulk.splitlines()) > (1 if max_line == 4_000 else 0)


def test_runs_written_on_the_gzip_thread_keep_their_place_among_the_other_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gzip file's runs of copy events get their text on the gzip thread
    (``TraceFile.write_later``), in runs of 4 records here, while the spans written one at a
    time (the steps, the run) are written by the export thread: the file holds the per-event
    encoder's spans in the same order, and the uncompressed file's lines."""
    monkeypatch.setattr("copytrace.export.file_sink.BULK_EVENTS", 4)
    events = _events()
    for d in "abc":
        (tmp_path / d).mkdir()
    one, _ = _write(tmp_path / "a", events, False, 4_000)
    plain, _ = _write(tmp_path / "b", events, True, 4_000, native=True)
    packed, path = _write(tmp_path / "c", events, True, 4_000, native=True, gz=True)
    # 27 records: 7 runs, the step span before them and the run span after them
    assert len(packed.splitlines()) >= 9
    assert _spans(packed) == _spans(one)
    assert packed == plain
    assert _sidecar(path) == _sidecar(tmp_path / "a" / "t.otlp.jsonl")


def test_values_the_columns_cannot_hold_take_the_per_event_path(tmp_path: Path) -> None:
    events = _events()
    ids = [f"{i:016x}" for i in range(len(events))]
    parents = ["0" * 16] * len(events)
    extract = _extract()
    batch = columnar.event_columns(events, "t", ids, parents, 0, 0)
    assert batch is not None
    assert columnar.event_columns(events, "t", ids, parents, 0, 0, extract) == batch
    for field, value in [("bytes_logical", True), ("line", 2**64), ("shape", ("16",)),
                         ("aten", "aten::clone"), ("dtype", 3), ("file", "\ud800"),
                         ("group", 1), ("shape", [1, True])]:  # fmt: skip
        odd = [copy.copy(ev) for ev in events]
        setattr(odd[1], field, value)
        assert columnar.event_columns(odd, "t", ids, parents, 0, 0) is None, field
        assert columnar.event_columns(odd, "t", ids, parents, 0, 0, extract) is None, field
        field = field + str(len(value) if isinstance(value, list) else "")
        (tmp_path / field).mkdir()
        (tmp_path / f"{field}1").mkdir()
        one, _ = _write(tmp_path / field, odd, False, 1_000_000)
        bulk, _ = _write(tmp_path / f"{field}1", odd, True, 1_000_000)
        assert _spans(bulk) == _spans(one), field


def test_the_c_encoder_writes_the_text_of_arrows_string_kernels() -> None:
    """``span_json`` (C) against :func:`columnar.span_texts`' Arrow kernels on strings that
    JSON escapes: quotes, backslashes, control characters, DEL, non-ASCII in
    and beyond the BMP (a surrogate pair), and a sliced batch (Arrow offsets)."""
    events = [copy.copy(ev) for ev in _events()]
    odd = ['a"b\\c', "tab\tnl\ncr\r\b\f\x01\x1f", "del\x7f", "é€", "\U0001f600 x", ""]
    for i, text in enumerate(odd):
        events[i].file = text
        events[i + len(odd)].error = text
    ids = [f"{i:016x}" for i in range(len(events))]
    parents = ["0" * 16] * len(events)
    batch = columnar.event_columns(events, "f" * 32, ids, parents, 0, 7, _extract())
    assert batch is not None
    encode = _observer().span_json
    for part in (batch, batch.slice(3, 11)):
        want = columnar.span_texts(part, "f" * 32).to_pylist()
        got = columnar.span_texts(part, "f" * 32, encode)
        assert got.type == pa.large_string()  # written in C, not by the kernels
        assert got.to_pylist() == want
    assert '\\ud83d\\ude00 x' in "".join(want)  # json.dumps' surrogate pair


def test_the_c_encoder_copies_only_equal_attributes_from_the_last_span_of_its_name() -> None:
    """``span_json`` copies an attribute's text from the last span of the same name when the
    values are equal: spans of one name whose attributes differ one at a time, come and go
    (an empty list, None), or change length (lists), give the Arrow kernels' text."""
    base = [ev for ev in _events() if not ev.group and ev.parent in (None, -1)]
    changes = [("file", "other.py"), ("file", None), ("line", 7), ("shape", (3, 3, 3)),
               ("shape", ()), ("aten", ["aten::clone", "aten::copy_"]), ("aten", []),
               ("requires_grad", False), ("step", 12), ("module", "M.a"), ("error", "E"),
               ("src_stride", (100, 1)), ("grad_fn", None), ("thread_name", "t")]  # fmt: skip
    events = []
    for i in range(120):  # each name's spans: a change, then back, then two at once
        ev = copy.copy(base[i % len(base)])
        for name, value in (changes[i % len(changes)], changes[(i * 5) % len(changes)])[: 1 + i % 2]:
            setattr(ev, name, value)
        events.append(ev)
    ids = [f"{i:016x}" for i in range(len(events))]
    batch = columnar.event_columns(events, "f" * 32, ids, ["0" * 16] * len(events), 0, 7,
                                   _extract())  # fmt: skip
    assert batch is not None
    want = columnar.span_texts(batch, "f" * 32).to_pylist()
    got = columnar.span_texts(batch, "f" * 32, _observer().span_json)
    assert got.type == pa.large_string()
    assert got.to_pylist() == want
