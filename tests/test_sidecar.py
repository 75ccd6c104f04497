"""The tracer's columnar sidecar (``.copytrace-cache/<file>.events/part-*.parquet``): a traced
run writes it, its table is the table parsed from the JSON file (every column, every row),
and a cut, corrupt, missing, mixed-version or mismatched part costs one warning line and
nothing readable: the reader takes the parts before it and parses the JSON from there.

The synthetic trace (``_tracegen.write_trace(sidecar=True)``) is written as the tracer
writes it: three flushes (8 event spans, 3 step spans, the run span), one sidecar part
each, then the ``copytrace.hazards`` line appended after the sidecar was closed.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn as nn
from _tracegen import write_trace

import copytrace
from copytrace.cli import main
from copytrace.export import sidecar as sidecar_writer
from copytrace.tracefile import _sidecar
from copytrace.tracefile._parse import Builder, iter_blocks
from copytrace.tracefile._table import build_file_table

ROWS = 13  # 8 event spans + 3 steps + the run span + the hazards span


def _json_table(path: Path) -> tuple[pa.Table, dict]:
    """The table parsed from the JSON file alone (no sidecar, no cache)."""
    builder = Builder()
    for block, _ in iter_blocks(path):
        assert block is not None
        builder.add_block(block)
    return builder.finish(), builder.resources


def _assert_same(path: Path) -> list[str]:
    """The table read for ``path`` equals the JSON-parsed one; returns the reader's notes."""
    part = build_file_table(path, cache=False)
    got = part.read().replace_schema_metadata(None)
    want, resources = _json_table(path)
    assert got.schema.equals(want.schema)
    for name in want.column_names:  # column by column: a failure names the column
        assert got.column(name).to_pylist() == want.column(name).to_pylist(), name
    assert part.rows == want.num_rows
    assert part.resources == resources
    assert part.bad_lines == 0
    return part.notes


def _parts(path: Path) -> list[Path]:
    return sorted(_sidecar.sidecar_dir(path).glob("part-*.parquet"))


@pytest.mark.parametrize("gz", [False, True])
def test_intact_sidecar_is_read_and_only_the_appended_line_parsed(tmp_path: Path, gz: bool) -> None:
    path = write_trace(tmp_path, sidecar=True, gz=gz)
    assert [p.name for p in _parts(path)] == [f"part-{i:06d}.parquet" for i in range(3)]
    part = build_file_table(path, cache=False)
    assert part.sidecar == _parts(path)
    # parsed from the JSON: only the hazards span, appended after the sidecar was closed
    assert part.table is not None and part.table.column("name").to_pylist() == [
        "copytrace.hazards"
    ]
    assert part.rows == ROWS
    assert _assert_same(path) == []


def _cut(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _garble_footer(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[-40:-8] = b"\xff" * 32  # the footer (file metadata) before its length and "PAR1"
    p.write_bytes(bytes(data))


def _older_version(p: Path) -> None:
    table = pq.read_table(p)
    meta = dict(table.schema.metadata)
    meta[b"copytrace.table_version"] = b"0"
    pq.write_table(table.replace_schema_metadata(meta), p)


def _other_columns(p: Path) -> None:
    table = pq.read_table(p)
    pq.write_table(table.drop_columns(["via"]), p)  # an older layout: one column fewer


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (_cut, "part-000001.parquet is unreadable"),
        (_garble_footer, "part-000001.parquet is unreadable"),
        (Path.unlink, "part-000002.parquet follows a missing part-000001.parquet"),
        (_older_version, "part-000001.parquet has other columns"),
        (_other_columns, "part-000001.parquet has other columns"),
    ],
)
def test_damaged_part_costs_one_line_and_nothing_readable(
    tmp_path: Path, damage, says: str  # type: ignore[no-untyped-def]
) -> None:
    path = write_trace(tmp_path, gz=True, sidecar=True)
    damage(_parts(path)[1])
    notes = _assert_same(path)
    assert len(notes) == 1 and says in notes[0], notes
    assert f"reading the rest of {path.name} from its JSON" in notes[0]
    part = build_file_table(path, cache=False)
    assert part.sidecar == _parts(path)[:1]  # the part before the damage is still used


def test_a_killed_run_lacks_its_last_part_and_the_json_has_the_rest(tmp_path: Path) -> None:
    path = write_trace(tmp_path, gz=True, sidecar=True)
    _parts(path)[-1].unlink()  # the run line reached the file, not the sidecar
    assert _assert_same(path) == []  # nothing to warn about: the file holds what is missing
    assert len(build_file_table(path, cache=False).sidecar) == 2


def test_sidecar_of_another_file_is_not_used(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "a", sidecar=True)
    other = write_trace(tmp_path / "b", pid=4243)  # same size, other trace id
    path.write_bytes(other.read_bytes())  # the trace file replaced, the sidecar left behind
    notes = _assert_same(path)
    assert len(notes) == 1 and "part-000000.parquet does not match the trace file" in notes[0]
    assert build_file_table(path, cache=False).sidecar == []


def test_trace_file_cut_before_the_sidecar_ends(tmp_path: Path) -> None:
    path = write_trace(tmp_path, sidecar=True)
    assert len(_parts(path)) == 3
    first = path.read_text().splitlines(keepends=True)[0]
    path.write_text(first)  # only the events line survived: parts 1 and 2 cover more
    notes = _assert_same(path)
    assert len(notes) == 1 and "part-000001.parquet does not match" in notes[0]


def test_cli_warns_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_trace(tmp_path, sidecar=True)
    _cut(_parts(path)[0])
    assert main(["summary", str(tmp_path)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"copytrace: warning: columnar sidecar {path.name}.events/part-000000.parquet is "
        f"unreadable (ArrowInvalid); reading the rest of {path.name} from its JSON"
    ]


def test_traced_run_writes_the_sidecar_equal_to_its_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sidecar_writer, "PART_ROWS", 8)  # several parts from a short run
    w = torch.randn(10, 100, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with copytrace.trace(tmp_path, flush_events=4) as t:
            for _ in range(4):
                w.clone()
                w.detach()
                copy.deepcopy(nn.Linear(3, 3))  # a group and its children
                w.to(torch.float64, non_blocking=True)
                t.step()
            torch.tensor(w)  # a hazard: the copytrace.hazards span appended at stop
    path = t.trace_path
    assert path is not None and path.name.endswith(".gz")
    parts = _parts(path)
    assert len(parts) >= 3
    part = build_file_table(path, cache=False)
    assert part.sidecar == parts
    # everything but the hazards span (appended after the sidecar closed) from the sidecar
    assert part.table is not None
    assert part.table.column("name").to_pylist() == ["copytrace.hazards"]
    assert _assert_same(path) == []


def _hazard_run(out: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[tuple]]:
    """A short traced run with one hazard; returns its trace file and, for each call of the
    ``find_hazards`` hook, (the sidecar parts beside the file then, the hazard codes found)."""
    from copytrace import _trace

    calls: list[tuple] = []

    def find(path: Path) -> list[dict]:
        found = _trace.find_hazards.__wrapped__(path)  # type: ignore[attr-defined]
        calls.append((len(_parts(path)), sorted(f["code"] for f in found)))
        return found

    find.__wrapped__ = _trace.find_hazards  # type: ignore[attr-defined]
    monkeypatch.setattr(_trace, "find_hazards", find)
    w = torch.randn(10, 100, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with copytrace.trace(out) as t:
            for _ in range(3):
                w.clone()
                w.detach()
                t.step()
            torch.tensor(w)  # a hazard: tensor() of a tensor
    monkeypatch.undo()
    assert t.trace_path is not None
    return t.trace_path, calls


def test_without_the_sidecar_the_hazards_read_the_columns_then_none_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``COPYTRACE_SIDECAR=0``: the hazards hook still reads the run's columns (a sidecar
    written for it, not the JSON parsed back), finds what a run with the sidecar finds,
    and no ``.copytrace-cache`` folder is left beside the trace file."""
    kept, with_sidecar = _hazard_run(tmp_path / "on", monkeypatch)
    monkeypatch.setenv("COPYTRACE_SIDECAR", "0")
    path, without = _hazard_run(tmp_path / "off", monkeypatch)
    # one hook call each; the sidecar's parts were there when the hook read the file
    assert len(with_sidecar) == len(without) == 1
    assert with_sidecar[0][0] >= 1 and without[0][0] >= 1
    assert without[0][1] == with_sidecar[0][1] and without[0][1]  # the same codes, not none
    assert _parts(kept)  # the sidecar stays where it is on
    assert not (path.parent / ".copytrace-cache").exists()
    part = build_file_table(path, cache=False)  # the file alone, hazards span included
    assert "copytrace.hazards" in part.read().column("name").to_pylist()
