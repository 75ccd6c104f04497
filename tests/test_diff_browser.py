"""The HTML diff page (``copytrace diff BASE NEW -o diff.html``) in a real browser: headless
Chromium (Debian's ``chromium``) driven by Playwright, as ``tests/test_report_browser.py``
launches it (skips without them; fails under ``COPYTRACE_REQUIRE_INTEGRATION=1``).

BASE runs ``STEPS`` optimizer steps, each cloning a float32 10x10 tensor (400 B). NEW adds
``w.double()`` (800 B) and ``torch.tensor(w)`` (400 B, hazard ``tensor-ctor-copy``) in the
loop: per step 1 -> 3 copies, 400 -> 1600 B.
"""

from __future__ import annotations

import json
import os
import runpy
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _require import require_module
from test_report_browser import ARGS, CHROMIUM

import copytrace
from copytrace.analysis.diff import snapshot_sources
from copytrace.cli import main

require_module("playwright.sync_api", allow_module_level=True)

STEPS = 5
BASE = """import torch
w = torch.randn(10, 10)
opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
for _ in range(STEPS):
    a = w.clone()
    opt.step()
""".replace("STEPS", str(STEPS))
NEW = BASE.replace("    a = w.clone()\n",
                   "    a = w.clone()\n    b = w.double()\n    c = torch.tensor(w)\n")  # fmt: skip


def _trace(prog: Path, source: str, out: Path) -> Path:
    prog.write_text(source, encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own warning against torch.tensor(t)
        with copytrace.trace(out) as t:
            runpy.run_path(str(prog), run_name="__main__")
    assert t.trace_path is not None
    snapshot_sources(t.trace_path)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """BASE's trace and NEW's."""
    root = tmp_path_factory.mktemp("diffpage")
    prog = root / "prog.py"
    return _trace(prog, BASE, root / "base"), _trace(prog, NEW, root / "new")


@pytest.fixture(scope="module")
def page_path(runs: tuple[Path, Path]) -> Path:
    out = runs[0].parent / "diff.html"
    assert main(["diff", str(runs[0]), str(runs[1]), "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def page(page_path: Path) -> Iterator[tuple[Any, list[str]]]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            pg = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            pg.on("pageerror", lambda e: errors.append(str(e)))
            pg.goto(page_path.as_uri())
            pg.wait_for_selector("body[data-ct-ready], body[data-ct-error]", timeout=30_000)
            assert pg.get_attribute("body", "data-ct-error") is None, errors
            yield pg, errors
        finally:
            browser.close()


def _line(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_page_renders_without_errors(page: tuple[Any, list[str]]) -> None:
    pg, errors = page
    for fig in ("steps", "sites"):
        assert pg.locator(f"#fig-{fig} .main-svg").count() >= 1, fig
    assert errors == []
    # the headline names the rows as the text diff does: "time only", not "copy time only"
    body = pg.locator("body").inner_text()
    assert " time only \u00b7 " in body and "copy time only" not in body
    # per step: copies 1 -> 3 (+2); bytes 400 B -> 400 + 800 + 400 = 1600 B (+1200 B)
    assert pg.locator('[data-total="copies_per_step"] .v').inner_text() == "+2"
    assert pg.locator('[data-total="bytes_per_step"] .d').inner_text() == "400 B \u2192 1.6 KiB"
    # NEW's bars are red (it copied more in every step), BASE's grey, STEPS each
    fills = pg.eval_on_selector_all(
        "#fig-steps .trace.bars .point path", "ps => ps.map(p => getComputedStyle(p).fill)")
    assert sorted(set(fills)) == ["rgb(154, 163, 176)", "rgb(214, 39, 40)"]
    assert len(fills) == 2 * STEPS


def test_added_sites_highlighted(
    page: tuple[Any, list[str]], runs: tuple[Path, Path], capsys: pytest.CaptureFixture
) -> None:
    pg, _ = page
    added = pg.locator('#ct-sites-table tr[data-status="added"]')
    sites = sorted(added.evaluate_all("rs => rs.map(r => r.dataset.site)"))
    assert sites == sorted([f"prog.py:{_line(NEW, 'w.double()')} <module>",
                            f"prog.py:{_line(NEW, 'torch.tensor')} <module>"])  # fmt: skip
    style = added.first.locator("td").first.evaluate(
        "td => [getComputedStyle(td).backgroundColor, getComputedStyle(td).borderLeftColor]")
    assert style == ["rgb(253, 236, 234)", "rgb(214, 39, 40)"]
    # the clone, the same bytes in both, is listed too: "same", or "time" when its copy time
    # changed between the two runs (a timing fact, read from the diff's JSON form)
    assert main(["diff", str(runs[0]), str(runs[1]), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    clone_status = "time" if [i["code"] for i in d["time_changed"]] == ["a = w.clone()"] else "same"
    assert d["unchanged"] + len(d["time_changed"]) == 1
    listed = pg.locator(f'#ct-sites-table tr[data-status="{clone_status}"]')
    assert listed.evaluate_all("rs => rs.map(r => r.dataset.site)") == [
        f"prog.py:{_line(NEW, 'w.clone()')} <module>"]  # fmt: skip
    assert "y = " not in pg.locator("#ct-sites-table").inner_text()
    hz = pg.locator('#ct-hazards-table tr[data-status="added"]')
    assert "tensor-ctor-copy" in hz.first.inner_text()
    if os.environ.get("COPYTRACE_SCREENSHOT"):
        pg.screenshot(path=os.environ["COPYTRACE_SCREENSHOT"], full_page=True)
