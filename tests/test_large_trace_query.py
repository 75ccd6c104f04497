"""The report model of a many-rank trace, as the large-trace paths build it: DuckDB's tables
in a compressed database file (from ``LARGE_ROWS`` events on) give the model the in-memory
tables give, and the summary names each finding's rank from the finding itself (no join of
its events) as the report does from its events. On two rank files written through the
tracer's file sink."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from copytrace.dashboards import _query, build_model
from copytrace.tracefile import event_table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from report_size import generate_trace  # noqa: E402


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    trace = tmp_path_factory.mktemp("ranks") / "trace"
    for rank, n in ((0, 1500), (1, 2500)):
        generate_trace(trace / f"copytrace-{rank}.otlp.jsonl", n, seed=rank, pid=900 + rank,
                       resource_attrs={"copytrace.rank": rank})  # fmt: skip
    return trace


def _facts(model: Any) -> dict[str, Any]:
    """What the summary and the report show, as plain values."""
    return {
        "totals": vars(model.totals),
        "steps": [(s.run, s.step, s.events, s.copy_count, s.bytes_copied, s.copy_time_ns,
                   s.stage) for s in model.steps],
        "sites": [(r.key, r.count, r.bytes_copied, r.time_ns, dict(r.entries))
                  for r in model.call_sites],
        "ops": [(o.op, o.count, o.bytes_copied) for o in model.ops],
        "hazards": [(h.code, h.runs, h.steps, h.call_sites, len(h.event_ids))
                    for h in model.hazards],
        "timeline": (model.ev_span_id, model.ev_t_ns, model.ev_step, model.ev_hazard,
                     [model.templates[i] for i in model.ev_tpl]),
        "info": (model.sample_info.large_bytes, model.sample_info.per_hazard),
    }  # fmt: skip


def test_database_file_gives_the_same_model(two_ranks: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 200 points of 4,000 events: the timeline samples (hazards, large copies, groups)
    in_memory = _facts(build_model(event_table(two_ranks), analyze=True, max_points=200))
    monkeypatch.setattr(_query, "LARGE_ROWS", 0)  # every trace counts as large
    opened: list[str] = []
    connect = _query.duckdb.connect
    monkeypatch.setattr(_query.duckdb, "connect",
                        lambda where, **kw: opened.append(where) or connect(where, **kw))
    on_file = _facts(build_model(event_table(two_ranks), analyze=True, max_points=200))
    assert len(opened) == 1 and opened[0].endswith("report.duckdb")
    assert len(on_file["timeline"][0]) >= 200 and on_file["hazards"]
    assert on_file == in_memory


def test_summary_names_finding_runs_without_their_events(two_ranks: Path) -> None:
    joined = build_model(event_table(two_ranks), analyze=True, timeline=False, patches=False)
    named = build_model(event_table(two_ranks), analyze=True, timeline=False, patches=False,
                        hazard_events=False)  # fmt: skip
    runs = [h.runs for h in joined.hazards]
    # every finding is one rank's: both ranks have some
    assert all(len(r) == 1 for r in runs) and {r[0] for r in runs} == {
        "rank 0 (pid 900)", "rank 1 (pid 901)"}
    assert [h.runs for h in named.hazards] == runs
    assert [h.code for h in named.hazards] == [h.code for h in joined.hazards]
