"""Open the HTML report in a real browser: headless Chromium driven by Playwright.

Uses the system Chromium (Debian's ``chromium`` package, ``/usr/bin/chromium``); never a
browser downloaded by ``playwright install``. Skips when Playwright or Chromium is missing
(fails under ``COPYTRACE_REQUIRE_INTEGRATION=1``, as CI runs it).
Set ``COPYTRACE_CHROMIUM`` to use another Chromium binary.

The report is built from two real traces of the small program of ``tests/_realtrace.py``
(ranks 0 and 1, so the rank selector shows), whose module ``Net.<script>alert(1)</script>``
must appear as text.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _realtrace import (
    CONTIGUOUS_SITE,
    COPIES,
    HAZARD_CODE,
    SCRIPT_MODULE,
    write_real_trace,
)
from _require import require_module, require_or_skip

require_module("playwright.sync_api", allow_module_level=True)

CHROMIUM = (
    os.environ.get("COPYTRACE_CHROMIUM")
    or shutil.which("chromium")
    or shutil.which("chromium-browser")
    or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
)
if not CHROMIUM:
    require_or_skip("no chromium binary (apt-get install chromium)", allow_module_level=True)

ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
FIGURES = ["steps", "treemap", "timeline", "kinds", "transfers"]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from copytrace.dashboards import write_report

    root = tmp_path_factory.mktemp("browser")
    write_real_trace(root / "trace", rank=0)
    write_real_trace(root / "trace", rank=1)
    return write_report(root / "trace", root / "report.html")


class _Page:
    """A loaded report page and the problems it reported."""

    def __init__(self, browser: Any, path: Path) -> None:
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.requests: list[str] = []
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.page.on(
            "console",
            lambda m: self.errors.append(f"console: {m.text}") if m.type == "error" else None,
        )
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.goto(path.as_uri())
        self.page.wait_for_selector("body[data-ct-ready], body[data-ct-error]", timeout=30_000)
        assert self.page.get_attribute("body", "data-ct-error") is None, self.errors


@pytest.fixture(scope="module")
def loaded(browser: Any, report: Path) -> Iterator[_Page]:
    page = _Page(browser, report)
    yield page
    page.page.close()


def test_every_figure_renders_without_errors(loaded: _Page) -> None:
    page = loaded.page
    figs = page.eval_on_selector_all("[data-fig]", "els => els.map(e => e.dataset.fig)")
    assert figs == FIGURES
    # no copy crossed devices (a CPU-only program): the transfers figure is hidden, not drawn
    assert page.locator("#fig-transfers").is_hidden()
    assert "no copy crossed devices" in page.locator("#ct-kpis").inner_text()
    for fig in [f for f in FIGURES if f != "transfers"]:
        div = page.locator(f"#fig-{fig}")
        assert div.locator(".main-svg").count() >= 1, f"{fig} not drawn"
        assert page.evaluate(f"!!document.getElementById('fig-{fig}')._fullLayout"), fig
        assert div.bounding_box()["height"] > 100, fig
    assert loaded.errors == []
    assert loaded.dialogs == []
    # offline: the page asked for nothing but itself
    assert [u for u in loaded.requests if not u.startswith("file:")] == []
    # the headline answers: copy-time share of a step and the top sources of copy bytes
    kpis = page.locator("#ct-kpis").inner_text()
    # 3 steps per run: warm-up, steady, last: one steady step each
    assert "COPY TIME SHARE OF EACH STEP (STEADY STATE)" in kpis.upper()
    assert re.search(r"\b2 steady steps; median \d+(\.\d+)?%", kpis), kpis
    assert "47.7 KiB" in kpis  # 2 x 24440 B copied
    assert f"{2 * COPIES} real copies \u00b7 2 aliases \u00b7 2 no-op conversions" in kpis
    top = page.locator("#ct-top-bytes li")
    assert top.count() == 4  # the call sites that copied bytes: contiguous, clone, ctor, deepcopy
    assert top.first.inner_text().startswith("1\n" + CONTIGUOUS_SITE)


def test_hover_on_a_timeline_point_shows_the_call_site(loaded: _Page) -> None:
    page = loaded.page
    page.locator("#fig-timeline").scroll_into_view_if_needed()
    points = page.locator("#fig-timeline .scatterlayer .trace .point")
    # 5 copies in each of the 2 runs (aliases hidden by default), plus a hazard mark on each
    # run's torch.tensor copy
    assert points.count() == 2 * COPIES + 2
    box = points.first.bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    hover = page.locator("#fig-timeline .hoverlayer")
    # as long as the page load may take: Chromium's renderer starves on a loaded machine
    hover.locator("text").first.wait_for(timeout=30_000)
    text = hover.text_content() or ""
    assert "call site: _realtrace.py:" in text
    assert "bytes: allocated" in text and "shape [" in text
    page.mouse.move(1, 1)


def test_trace_strings_show_as_text(loaded: _Page) -> None:
    page = loaded.page
    assert page.evaluate("document.scripts.length") == 3  # plotly.js, data, report script
    table = page.locator("#ct-sources-table").inner_text()
    assert SCRIPT_MODULE in table  # the module of the clone and detach, as text
    page.locator("#ct-groupby button[data-v=module]").click()
    assert SCRIPT_MODULE in page.locator("#ct-sources-table").inner_text()
    page.locator("#ct-groupby button[data-v=site]").click()
    # plotly text (treemap labels) shows it too, as text, not markup
    assert SCRIPT_MODULE in (page.locator("#fig-treemap").text_content() or "")
    hazards = page.locator("#ct-hazards-body").inner_text()
    assert HAZARD_CODE in hazards and "`torch.tensor(t)` of an existing tensor" in hazards
    assert loaded.dialogs == [] and loaded.errors == []


def test_click_through_and_rank_selector(browser: Any, report: Path) -> None:
    loaded = _Page(browser, report)
    page = loaded.page
    try:
        page.locator("#ct-top-bytes li").first.click()
        assert page.locator("#ct-focus-ev").is_visible()
        assert CONTIGUOUS_SITE in page.locator("#ct-focus-ev").inner_text()
        rows = page.locator("#ct-events-body tr")
        assert rows.count() == 1 + 2  # header + the contiguous of each of the 2 runs
        assert "contiguous" in rows.nth(1).inner_text()
        rows.nth(1).click()  # zooms the timeline on the event's step, shows its details
        detail = page.locator("#ct-detail")
        assert detail.is_visible() and CONTIGUOUS_SITE in detail.inner_text()
        page.locator("#ct-focus-ev button").click()
        assert not page.locator("#ct-focus-ev").is_visible()

        options = page.eval_on_selector_all("#ct-rank option", "els => els.map(e => e.text)")
        assert options[0] == "all 2 runs" and len(options) == 3, options
        assert [o.split(" (")[0] for o in options[1:]] == ["rank 0", "rank 1"], options
        page.select_option("#ct-rank", "1")
        assert page.locator("#fig-timeline .scatterlayer .trace .point").count() == COPIES + 1
        top = page.locator("#ct-top-bytes").inner_text()
        assert "15.6 KiB" in top  # one run's contiguous: CONTIGUOUS_BYTES
        page.select_option("#ct-rank", "all")
        assert "31.3 KiB" in page.locator("#ct-top-bytes").inner_text()  # 2 x 16000 B
        assert loaded.errors == [] and loaded.dialogs == []
    finally:
        page.close()


def test_runs_of_two_programs_are_told_apart(browser: Any, tmp_path: Path) -> None:
    """`copytrace report --all` over launches of two programs: one command line per program
    in the header and a run column in the hazards table."""
    from test_runs_cli import _launch

    from copytrace.cli import main

    _launch(tmp_path, 11, 0, script="train.py")
    _launch(tmp_path, 12, 1, script="eval.py")
    out = tmp_path / "report.html"
    # the hazards each trace file carries (its copytrace.hazards span), one file per program
    assert main(["report", str(tmp_path), "--all", "--no-analysis", "-o", str(out)]) == 0
    page = _Page(browser, out)
    try:
        header = page.page.locator("#ct-cmd").inner_text().splitlines()
        assert len(header) == 2
        assert "train.py" in header[0] and "eval.py" in header[1]
        heads = page.page.eval_on_selector_all(
            "#ct-hazards-body th", "els => els.map(e => e.textContent)"
        )
        assert heads[:2] == ["severity", "run"]
        cells = page.page.eval_on_selector_all(
            "#ct-hazards-body tr td:nth-child(2)", "els => els.map(e => e.textContent)"
        )
        assert cells and all(c for c in cells)  # every hazard names its run(s)
        assert page.errors == []
    finally:
        page.page.close()


# Line 10 has a patch that keeps values; line 11 holds two torch.tensor calls (ambiguous: no
# patch, the advice only); line 13's .data write, a finding per parameter, has one patch
# that changes values on purpose (the write moves after the backward).
PATCHED = """\
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(5, 3)
for step in range(3):
    out = model(x).pow(2).sum()
    kept = torch.tensor(out)
    a, b = torch.tensor(out), torch.tensor(out)
    for p in model.parameters():
        p.data.mul_(0.5)
    out.backward()
    opt.step()
    opt.zero_grad()
print(kept.item(), (a + b).item())
"""


def test_each_finding_shows_its_patch(
    browser: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess
    import sys

    from copytrace.dashboards import write_report

    (tmp_path / "train.py").write_text(PATCHED)
    cmd = [sys.executable, "-m", "copytrace", "run", "--no-report", "-o", "out", "train.py"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    monkeypatch.chdir(tmp_path)  # the project whose files the patches name
    loaded = _Page(browser, write_report(tmp_path / "out", tmp_path / "report.html"))
    page = loaded.page
    try:
        rows = page.locator("#ct-hazards-body tr")
        texts = [rows.nth(i).inner_text() for i in range(1, rows.count())]
        by_line = {n: [t for t in texts if f"train.py:{n} " in t] for n in (10, 11, 13)}
        writes = len(by_line[13])  # one finding per parameter whose saved value was written
        assert [len(by_line[10]), len(by_line[11])] == [1, 1] and writes >= 2
        patches = page.locator("#ct-hazards-body details.patch")
        assert patches.count() == 1 + writes
        # the ambiguous line: the advice and why there is no patch, nothing to unfold
        assert "no patch: ambiguous line: 2 torch.tensor calls on line 11" in by_line[11][0]
        assert "detach().clone()" in by_line[11][0]  # the finding's advice
        # collapsed under its reason and what it does to values
        ctor = page.locator("#ct-hazards-body tr", has_text="train.py:10 ").locator("details")
        summary = ctor.locator("summary").inner_text()
        assert summary.startswith("bit for bit patch: tensor-ctor-copy at train.py:10: ")
        assert "`torch.tensor(out)` -> `out.detach().clone()`" in summary
        diff = ctor.locator("pre.diff")
        assert not diff.is_visible()
        ctor.locator("summary").click()
        assert diff.is_visible()
        # a click on the patch does not select the row (the table is not drawn again)
        assert page.locator("#ct-hazards-body tr.sel").count() == 0
        assert diff.locator(".del").all_inner_texts() == ["-    kept = torch.tensor(out)"]
        assert diff.locator(".add").all_inner_texts() == ["+    kept = out.detach().clone()"]
        assert diff.locator(".hunk").all_inner_texts() == ["@@ -7,7 +7,7 @@"]
        # highlighted: additions and deletions on different backgrounds
        bg = "el => getComputedStyle(el).backgroundColor"
        assert diff.locator(".add").evaluate(bg) != diff.locator(".del").evaluate(bg)
        assert diff.locator(".ctx").first.evaluate(bg) == "rgba(0, 0, 0, 0)"
        # the .data writes: one patch for the line (each parameter's finding shows it)
        data = page.locator("#ct-hazards-body details.patch", has_text="data-inplace")
        assert data.count() == writes
        assert set(data.locator("summary").all_inner_texts()) == {data.first.locator(
            "summary").inner_text()}  # fmt: skip
        assert data.first.locator("summary").inner_text().startswith(
            "changes values patch: data-inplace at train.py:13: ")
        data.first.locator("summary").click()
        added = data.first.locator("pre.diff .add").all_inner_texts()
        assert added == ["+    out.backward()", "+        with torch.no_grad():",
                         "+            p.mul_(0.5)"]  # fmt: skip
        assert loaded.errors == [] and loaded.dialogs == []
    finally:
        page.close()


_LIBRARY = "import torch\n\ndef prepare(batch):\n    return batch.to(torch.float64)\n"


@pytest.mark.parametrize("group_by", ["library", "user"])
def test_library_call_sites_with_the_user_line_beside(
    browser: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, group_by: str
) -> None:
    import importlib
    import sys

    import torch

    import copytrace
    from copytrace.dashboards import write_report

    pkg = tmp_path / "site-packages" / "ctbrowserlib"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(_LIBRARY)
    monkeypatch.syspath_prepend(str(pkg.parent))
    sys.modules.pop("ctbrowserlib", None)
    lib = importlib.import_module("ctbrowserlib")
    with copytrace.trace(tmp_path / "trace") as t:
        for _ in range(3):
            lib.prepare(torch.randn(4, 4))  # the user's line
            t.step()
    line = sys._getframe(0).f_lineno - 2
    sys.modules.pop("ctbrowserlib", None)
    page = _Page(browser, write_report(tmp_path / "trace", tmp_path / "r.html", group_by=group_by))
    try:
        table = page.page.locator("#ct-sources-table").inner_text()
        lib_site = "ctbrowserlib/__init__.py:4 prepare"
        mine = f"test_report_browser.py:{line} test_library_call_sites_with_the_user_line_beside"
        row = next(r for r in table.splitlines() if lib_site in r or mine in r)
        if group_by == "library":  # the library's line is the row, the user's line beside it
            assert lib_site in row and f"from your line: {mine}" in table
            assert "placed at the library's line" in page.page.locator("#sources").inner_text()
        else:
            assert mine in row and f"library: {lib_site}" in table
        assert page.errors == []
    finally:
        page.page.close()
