"""``copytrace export TRACE --dataset OUT``: the Hive-partitioned layout, its columns, and a
second run added without rewriting the first."""

from __future__ import annotations

import sys
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest

from copytrace.cli import main
from copytrace.schema import TABLE_VERSION
from copytrace.tracefile import event_table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from report_size import T0, generate_trace  # noqa: E402


def _two_ranks(folder: Path, n: int, **attrs: object) -> None:
    for rank in range(2):
        generate_trace(folder / f"copytrace-{rank}.otlp.jsonl", n + rank, seed=rank,
                       pid=700 + rank, resource_attrs={"copytrace.rank": rank, **attrs})


def test_dataset_layout_columns_and_a_second_run(tmp_path: Path) -> None:
    _two_ranks(tmp_path / "a", 300)
    out = tmp_path / "ds"
    assert main(["export", str(tmp_path / "a"), "--dataset", str(out)]) == 0
    # one launch (both ranks ran at once): run_id is its lowest pid and its start (ns)
    launch = f"700-{T0}"
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.parquet"))
    rank_of = {res["copytrace.rank"]: t for t, res in event_table(tmp_path / "a").resources.items()}
    assert files == [f"run_id={launch}/host=bench/rank={r}/part-{rank_of[r]}.parquet"
                     for r in (0, 1)]
    one = pq.read_table(out / files[1])
    assert one.num_rows == 301  # rank 1's events (no run, step or hazards span)
    assert set(one.column("rank").to_pylist()) == {1}
    assert set(one.column("host").to_pylist()) == {"bench"}
    assert set(one.column("run_id").to_pylist()) == {launch}
    assert set(one.column("schema_version").to_pylist()) == {TABLE_VERSION}
    assert "attrs_json" not in one.column_names and "bytes_allocated" in one.column_names
    first = {p: p.stat().st_mtime_ns for p in out.rglob("*.parquet")}

    # a torchelastic run added into the same dataset: the first run's files are untouched
    _two_ranks(tmp_path / "b", 100, **{"copytrace.torchelastic_run_id": "job-7"})
    assert main(["export", str(tmp_path / "b"), "--dataset", str(out)]) == 0
    assert {p: p.stat().st_mtime_ns for p in (out / f"run_id={launch}").rglob("*.parquet")} \
        == first  # fmt: skip
    rows = duckdb.sql(
        f"SELECT run_id, rank, count(*) FROM read_parquet('{out}/*/*/*/*.parquet', "
        "hive_partitioning=true) GROUP BY ALL ORDER BY ALL"
    ).fetchall()
    assert rows == [("700-" + str(T0), 0, 300), ("700-" + str(T0), 1, 301),
                    ("job-7", 0, 100), ("job-7", 1, 101)]  # fmt: skip


def test_dataset_into_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    generate_trace(tmp_path / "copytrace-0.otlp.jsonl", 50)
    (tmp_path / "taken").write_text("")
    assert main(["export", str(tmp_path), "--dataset", str(tmp_path / "taken")]) != 0
    err = capsys.readouterr().err
    assert "--dataset must name a directory" in err and len(err.strip().splitlines()) == 1
