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


def _fmt_ns(ns: float) -> str:
    """The page's ``fmtNs`` (report.js): what the rank table shows for a copy time."""
    if ns < 1e3:
        return f"{round(ns)} ns"
    if ns < 1e6:
        return f"{ns / 1e3:.1f} us"
    return f"{ns / 1e6:.2f} ms" if ns < 1e9 else f"{ns / 1e9:.3f} s"


def test_the_report_shows_ranks_side_by_side(tmp_path: Path) -> None:
    """The HTML report's rank table, in real Chromium: a row per rank with its steps and
    copy time per step, the slowest rank marked, and the imbalance the summary prints."""
    from _require import require_module

    require_module("playwright.sync_api")
    from playwright.sync_api import sync_playwright
    from test_report_browser import ARGS, CHROMIUM

    trace = tmp_path / "trace"
    for rank, n in ((0, 300), (1, 900)):
        generate_trace(trace / f"copytrace-{rank}.otlp.jsonl", n, seed=rank, pid=700 + rank,
                       resource_attrs={"copytrace.rank": rank})  # fmt: skip
    assert main(["export", str(trace), "--dataset", str(tmp_path / "ds")]) == 0
    ranks = duckdb_results(tmp_path / "ds")["ranks"]  # (run_id, host, rank, steps, bytes, ns)
    per = {r[2]: (r[3], r[5] / r[3]) for r in ranks}  # steps, copy time per step
    slow = max(per, key=lambda r: per[r][1])
    median = statistics.median(p[1] for p in per.values())
    out = tmp_path / "report.html"
    assert main(["report", str(trace), "-o", str(out)]) == 0
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(out.as_uri())
            page.wait_for_selector("body[data-ct-ready], body[data-ct-error]", timeout=30_000)
            assert page.get_attribute("body", "data-ct-error") is None, errors
            assert page.locator("#ranks").is_visible()
            rows = page.eval_on_selector_all(
                "#ct-ranks-table tr[data-rank]",
                "els => els.map(e => [e.getAttribute('data-rank'), e.className,"
                " Array.from(e.cells).map(c => c.textContent)])",
            )
            note = page.locator("#ct-ranks-note").inner_text()
        finally:
            browser.close()
    assert [r[0].split(" (")[0] for r in rows] == ["rank 0", "rank 1"]
    for (_label, cls, cells), rank in zip(rows, (0, 1), strict=True):
        steps, ns = per[rank]
        assert cells[1] == str(steps) and cells[3] == _fmt_ns(ns)
        assert cells[4] == f"{ns / median:.2f}x"
        assert (cls == "slowest") == (rank == slow)
    assert f"slowest rank: rank {slow} " in note
    assert f"imbalance (max/median) {per[slow][1] / median:.2f}x the median" in note
