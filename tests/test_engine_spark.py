"""``summary``/``check --engine spark``: the SQL aggregates on Spark (local mode) equal DuckDB's
on the same dataset, exported from a real traced program (tests/_realtrace.py); so do the
hazards of every rule, on a dataset whose findings cover every code; bad input is one line and
exit 2 before Spark starts. (tests/test_hazard_diff.py checks the SQL rules on DuckDB against
the in-process findings.)"""

from __future__ import annotations

import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from _realtrace import BYTES_COPIED, COPIES, EVENTS, HAZARD_BYTES, HAZARD_CODE, write_real_trace
from _require import require_module, require_or_skip

from copytrace.analysis import HAZARDS
from copytrace.analysis._sql import duckdb_results, spark_sql
from copytrace.cli import main
from copytrace.tracefile import event_table
from copytrace.tracefile._dataset import write_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("engine")
    write_real_trace(root / "trace")
    assert main(["export", str(root / "trace"), "--dataset", str(root / "ds")]) == 0
    return root / "ds"


@pytest.fixture(scope="module")
def spark() -> Iterator[object]:
    """One local Spark session (one core) for the whole module."""
    require_module("pyspark")
    require_module("sqlglot")
    if shutil.which("java") is None:
        require_or_skip("no Java runtime on PATH (Spark needs 17 or later)")
    from copytrace.cli._engine import spark_session

    session = spark_session("local[1]")
    yield session
    session.stop()


def test_duckdb_and_spark_give_equal_numbers(dataset: Path, spark: object) -> None:
    ours = duckdb_results(dataset)
    # the hazards are compared as summary and check print them (the tests below): the
    # hazards query is most of what Spark spends here
    names = [name for name in ours if name != "hazards"]
    assert spark_sql(spark, dataset, names) == {name: ours[name] for name in names}
    # and the numbers are the traced program's (tests/_realtrace.py's docstring)
    events, copies, _aliases, _noops, copied, _alloc, time_ns, processes = ours["totals"][0]
    assert (events, copies, copied, processes) == (EVENTS, COPIES, BYTES_COPIED, 1)
    assert time_ns > 0
    assert [(h[0], h[3], h[4]) for h in ours["hazards"]] == [(HAZARD_CODE, 1, HAZARD_BYTES)]
    assert [r[1] for r in ours["steps"]] == [0, 1, 2]
    # (rank, step, counts..., bytes copied, ...) and (site, counts..., bytes copied, ...)
    assert sum(r[6] for r in ours["steps"]) == sum(r[5] for r in ours["sites"]) == BYTES_COPIED


def test_summary_and_check_on_spark_print_what_duckdb_prints(
    dataset: Path, spark: object, capsys: pytest.CaptureFixture
) -> None:
    spark_args = ["--engine", "spark", "--spark-master", "local[1]"]
    assert main(["summary", str(dataset), "--top", "3"]) == 0
    duck = capsys.readouterr().out
    assert main(["summary", str(dataset), "--top", "3", *spark_args]) == 0
    assert capsys.readouterr().out == duck
    assert f"{BYTES_COPIED} B" in duck and HAZARD_CODE in duck
    assert "most copied: rank 0 step 2, 15.6 KiB in 1 copies" in duck  # x.t().contiguous()
    budget = ["--max-bytes-per-step", "10000", "--forbid", HAZARD_CODE]
    assert main(["check", str(dataset), *budget]) == 1
    duck_check = capsys.readouterr()
    # a trace folder goes through a temporary dataset: the same answer
    assert main(["check", str(dataset.parent / "trace"), *budget, *spark_args]) == 1
    assert capsys.readouterr() == duck_check
    # the largest step copies 16000 B (x.t().contiguous()), over 10000 B; the forbidden code
    assert "16000 B" in duck_check.err and f"forbidden hazard {HAZARD_CODE}" in duck_check.err


@pytest.fixture(scope="module")
def hazard_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dataset of two runs whose findings cover every hazard code: a real program that
    copies in each way the pair and hot-loop rules look for (tests/test_hazard_diff.py's
    ``copies``: repeats, a copy of a copy, clone().detach(), a deepcopy and a no-op every
    step; and a deepcopy that raises on a graph-attached tensor), and 300 random events (test_hazard_diff's generator: round trips, pageable
    transfers, snapshots, ...)."""
    from test_hazard_diff import _programs, _random_events, _write

    import copytrace

    root = tmp_path_factory.mktemp("hazards")
    programs = {p.__name__: p for p in _programs()}
    with copytrace.trace(root / "real") as t:
        programs["copies"](t)
        programs["nonleaf_deepcopy"](t)  # deepcopy-nonleaf: no random event makes one
    _write(_random_events(random.Random(0), 300), root / "random" / "copytrace-1.otlp.jsonl")
    for trace in ("real", "random"):  # the second run is added beside the first
        write_dataset(event_table(root / trace), root / "ds")
    return root / "ds"


def test_every_hazard_rule_on_spark_prints_what_duckdb_prints(
    hazard_dataset: Path, spark: object, capsys: pytest.CaptureFixture
) -> None:
    """``check --findings`` prints one line per finding (code, call sites, events, bytes):
    the same lines on both engines, for findings of every code."""
    args = ["check", str(hazard_dataset), "--findings", "--forbid", "all"]
    assert main(args) == 1
    duck = capsys.readouterr()
    assert main([*args, "--engine", "spark", "--spark-master", "local[1]"]) == 1
    assert capsys.readouterr() == duck
    codes = {line.split(" at ")[0] for line in duck.out.splitlines() if " at " in line}
    assert codes == set(HAZARDS)
    rows = duckdb_results(hazard_dataset, ["hazards"])["hazards"]
    assert len({r[1] for r in rows}) == 2  # both runs
    assert duck.out.count(" event(s), ") == len(rows) > len(HAZARDS)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--spark-master", "nonsense"], "is not a Spark master URL"),
        ([], "needs --spark-master"),
    ],
)
def test_bad_spark_input_is_one_line_and_exit_2(
    dataset: Path, extra: list[str], says: str, capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SPARK_REMOTE", raising=False)
    assert main(["summary", str(dataset), "--engine", "spark", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    # without pyspark the first thing checked is pyspark itself
    assert says in err[0] or "not installed: pip install 'copytrace[spark]'" in err[0]
