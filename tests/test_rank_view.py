"""Ranks side by side in ``copytrace summary``: each rank's copy bytes and copy time per step,
the slowest rank and the imbalance, on a 2-rank trace (two rank files of one launch, written
through the tracer's file sink); the figures agree with the dataset's SQL ``ranks`` query."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

from copytrace.analysis._sql import duckdb_results
from copytrace.cli import main
from copytrace.dashboards._model import format_bytes, format_ns

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from report_size import generate_trace  # noqa: E402


def test_two_ranks_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trace = tmp_path / "trace"
    for rank, n in ((0, 300), (1, 900)):  # rank 1 makes 3x the events: more steps
        generate_trace(trace / f"copytrace-{rank}.otlp.jsonl", n, seed=rank, pid=700 + rank,
                       resource_attrs={"copytrace.rank": rank})  # fmt: skip
    assert main(["summary", str(trace)]) == 0
    out = capsys.readouterr().out
    assert main(["export", str(trace), "--dataset", str(tmp_path / "ds")]) == 0
    capsys.readouterr()
    ranks = duckdb_results(tmp_path / "ds")["ranks"]  # (run_id, host, rank, steps, bytes, ns)
    assert [r[2] for r in ranks] == [0, 1] and ranks[1][3] > ranks[0][3]
    per = {r[2]: (r[3], r[4] / r[3], r[5] / r[3]) for r in ranks}  # per step
    section = out[out.index("ranks side by side (per step):"):].splitlines()
    for rank, (steps, nbytes, ns) in per.items():
        row = next(line for line in section if line.startswith(f"rank {rank} "))
        assert f" {steps} " in row
        assert format_bytes(round(nbytes)) in row and format_ns(round(ns)) in row
    slow = max(per, key=lambda r: per[r][2])
    median = statistics.median(p[2] for p in per.values())  # of two ranks: their mean
    assert f"slowest rank: rank {slow} " in out
    assert f"imbalance (max/median) {per[slow][2] / median:.2f}x the median" in out


def test_one_process_shows_no_rank_table(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    generate_trace(tmp_path / "copytrace-0.otlp.jsonl", 100)
    assert main(["summary", str(tmp_path)]) == 0
    assert "ranks side by side" not in capsys.readouterr().out
