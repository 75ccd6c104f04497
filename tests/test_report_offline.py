"""The report of a real run, opened in a real browser with the network blocked.

The trace comes from ``copytrace run`` on a small real training loop (a real subprocess);
the pages are opened in headless Chromium (Debian's ``chromium``, driven by Playwright) with
every request that is not a ``file:`` URL aborted: the self-contained report must draw every
figure, and a ``--cdn`` report must still show its tables and text and say why the charts
are missing and how to get a self-contained report.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from copytrace.dashboards import build_model, load_trace, render_html

pytest.importorskip("playwright.sync_api")
CHROMIUM = os.environ.get("COPYTRACE_CHROMIUM") or shutil.which("chromium")
if not CHROMIUM:
    if os.environ.get("COPYTRACE_REQUIRE_INTEGRATION"):
        raise RuntimeError("no chromium binary (apt-get install chromium)")
    pytest.skip("no chromium binary (apt-get install chromium)", allow_module_level=True)

# Copies inside and outside nn.Modules, a no-op .to(), a hazard (torch.tensor of a tensor),
# clip_grad_norm_, a deepcopy of the state dict, and steps whose wall
# time alternates (a sleep every other step) so that the steady-state share is noisy.
PROGRAM = """
import copy, sys, time, warnings
import torch

warnings.simplefilter("ignore")
steps = int(sys.argv[sys.argv.index("--steps") + 1])
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(steps):
    x = torch.randn(32, 64).to("cpu")
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    logged = torch.tensor(loss.detach())
    snapshot = copy.deepcopy(model.state_dict())
    if step % 2:
        time.sleep(0.08)
print("done")
"""
STEPS = 10


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("offline")
    (root / "fit.py").write_text(PROGRAM)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COPYTRACE", "OTEL_"))}
    env["OMP_NUM_THREADS"] = "1"
    # level full: its function mode is on torch's stack, so Tensor.__deepcopy__ and
    # clip_grad_norm_ reach it through torch's handle_torch_function
    env["COPYTRACE_LEVEL"] = "full"
    proc = subprocess.run(
        [sys.executable, "-m", "copytrace", "run", "-o", "out", "fit.py", "--steps", str(STEPS)],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "done\n"
    out = root / "out"
    render_html(build_model(load_trace(out), analyze=True), out / "cdn.html", offline=False)
    return out


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def model(run_dir: Path) -> Any:
    return build_model(load_trace(run_dir))


@pytest.fixture(scope="module")
def inline_page(browser: Any, run_dir: Path) -> Iterator[tuple[Any, list[str], list[str]]]:
    """The self-contained report, opened once (at 1024 px) for the tests that only read it."""
    page, errors, blocked = _open(browser, run_dir / "report.html")
    yield page, errors, blocked
    page.close()


def _open(browser: Any, path: Path, width: int = 1024) -> tuple[Any, list[str], list[str]]:
    """Open ``path`` with every non-file request aborted; return (page, errors, blocked)."""
    page = browser.new_page(viewport={"width": width, "height": 900})
    errors: list[str] = []
    blocked: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))

    def route(r: Any) -> None:
        if r.request.url.startswith("file:"):
            r.continue_()
        else:
            blocked.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    page.goto(path.as_uri())
    page.wait_for_selector("body[data-ct-ready], body[data-ct-error]", timeout=60_000)
    assert page.get_attribute("body", "data-ct-error") is None, errors
    return page, errors, blocked


def _fmt_ns(ns: float) -> str:
    """report.js's fmtNs."""
    if ns < 1e3:
        return f"{round(ns)} ns"
    if ns < 1e6:
        return f"{ns / 1e3:.1f} us"
    if ns < 1e9:
        return f"{ns / 1e6:.2f} ms"
    return f"{ns / 1e9:.3f} s"


def _table_widths(page: Any) -> list[tuple[str, int, int]]:
    return page.evaluate(
        """() => [...document.querySelectorAll('table')].filter(t => t.offsetParent)
        .map(t => [t.id || t.closest('section').id, t.scrollWidth,
                   (t.closest('.scroll') || t.parentElement).clientWidth])"""
    )


def test_cdn_report_offline_shows_tables_text_and_how_to_fix(browser: Any, run_dir: Path):
    page, errors, blocked = _open(browser, run_dir / "cdn.html")
    assert errors == []
    assert [u for u in blocked if u.startswith("https://cdn.plot.ly/")]  # it tried, and failed
    note = page.locator("#ct-nocharts").inner_text()
    assert note.startswith("The charts could not load:")
    assert f"copytrace report {run_dir} -o report.html" in note
    # Tables and text are all there: hazards, steps, sources, kinds, run details.
    hazards = page.locator("#ct-hazards-body tr").all_inner_texts()
    assert any("tensor-ctor-copy" in row for row in hazards), hazards
    stages = page.locator("#ct-stage-table").inner_text()
    assert "warm-up" in stages and "steady state" in stages
    assert page.locator("#ct-sources-table tr").count() > 1
    assert "deepcopy" in page.locator("#ct-kinds-table").inner_text()
    assert "fit.py --steps 10" in page.locator("#ct-runs-table").inner_text()
    assert "COPY TIME SHARE" in page.locator("#ct-kpis").inner_text().upper()
    # Each figure says that it is missing, instead of an empty box.
    for fig in ("steps", "treemap", "timeline", "kinds"):
        assert page.locator(f"#fig-{fig}").inner_text().startswith("Chart not available")
    page.close()


def test_self_contained_report_draws_every_figure_offline(run_dir: Path, inline_page: Any):
    # The inlined plotly.js is compressed: the page is well under plotly.js's own 4.8 MB.
    assert (run_dir / "report.html").stat().st_size < 2_400_000
    page, errors, blocked = inline_page
    assert errors == [] and blocked == []
    assert page.locator("#ct-nocharts").count() == 0
    for fig in ("steps", "treemap", "timeline", "kinds"):
        assert page.evaluate(f"!!document.getElementById('fig-{fig}')._fullLayout"), fig
    # A short title: the program and its arguments, not copytrace's executable.
    assert page.title() == f"copytrace: fit.py --steps {STEPS}"
    # Nothing crossed devices: no heatmap, the table and a note instead.
    assert page.locator("#fig-transfers").is_hidden()
    assert page.locator("#ct-transfers-note").inner_text().startswith("No event crossed devices")
    # The timeline in seconds; bytes on every axis in binary units.
    timeline = page.evaluate("document.getElementById('fig-timeline')._fullLayout.xaxis")
    assert timeline["title"]["text"] == "seconds since the run's start"
    assert timeline["ticksuffix"] == " s"
    steps_bytes = page.evaluate("document.getElementById('fig-steps').layout.yaxis2.ticktext")
    assert len(steps_bytes) >= 2
    assert all(re.fullmatch(r"0|\d+(\.\d+)? (B|KiB|MiB|GiB)", t) for t in steps_bytes), steps_bytes


def test_report_text_has_no_noise_and_tables_fit(model: Any, inline_page: Any):
    # The trace has copies outside any module (so the checks below can fail); the copies
    # reached through handle_torch_function name the torch function, not that helper.
    assert "" in {c.module for c in model.cube}
    assert "handle_torch_function" not in {c.via for c in model.cube}
    assert "_clip_grads_with_norm_" in {c.via for c in model.cube}
    page, errors, _ = inline_page
    # show every table there is: the events of the top call site too
    page.locator("#ct-top-bytes li").first.click()
    page.wait_for_selector("#ct-events-body table")
    text = page.locator("body").inner_text()
    assert "(no module)" not in text and "handle_torch_function" not in text
    treemap_labels = page.evaluate("document.getElementById('fig-treemap').data[0].labels")
    assert "(no module)" not in treemap_labels
    widths = _table_widths(page)
    assert len(widths) >= 7
    assert [w for w in widths if w[1] > w[2]] == []  # no table wider than its box
    assert errors == []


def test_headline_shows_copy_time_per_step_and_says_when_the_share_is_noisy(
    model: Any, inline_page: Any
):
    steady = model.stages["steady"]
    shares = sorted(
        100 * s.copy_time_ns / s.duration_ns
        for s in model.steps
        if s.stage == "steady" and s.duration_ns
    )

    def quantile(q: float) -> float:  # linear interpolation, as report.js's quantile()
        pos = (len(shares) - 1) * q
        lo, hi = int(pos), min(int(pos) + 1, len(shares) - 1)
        return shares[lo] + (shares[hi] - shares[lo]) * (pos - lo)

    median = quantile(0.5)
    # The program sleeps 80 ms every other step, so the share usually spreads far beyond the
    # rule's threshold (interquartile range over half the median); but the shares are timing
    # facts (a loaded machine stretches any step), so the verdict is read from them.
    assert len(shares) >= 4
    noisy = median > 0 and quantile(0.75) - quantile(0.25) > 0.5 * median
    page = inline_page[0]
    per_step = page.locator("#ct-copy-per-step").inner_text()
    assert per_step == _fmt_ns(steady.copy_time_ns / steady.steps) + " copy time per step"
    said = page.locator("#ct-noisy")
    assert said.count() == int(noisy)
    if noisy:
        assert said.inner_text().startswith("Noisy: the share varies between steps")
    # copytrace summary says the same, with the same numbers
    from copytrace.cli.summary import format_summary

    text = format_summary(model)
    assert f", {_fmt_ns(steady.copy_time_ns / steady.steps)} copy time per step" in text
    assert ("\n  noisy: the share varies between steps (middle half " in text) == noisy


@pytest.mark.parametrize(
    "command, title",
    [
        ("/venv/bin/python /venv/bin/copytrace run -o out --py-spy /a/b/fit.py --steps 6",
         "fit.py --steps 6"),
        ("fit.py --steps 6", "fit.py --steps 6"),
        ("python3.11 -m copytrace run -m pkg.train --lr 1", "-m pkg.train --lr 1"),
        ("/usr/bin/copytrace run -- /a/x.py 'two words'", "x.py 'two words'"),
    ],
)  # fmt: skip
def test_short_title_is_the_program_and_its_arguments(command, title):
    from copytrace.dashboards._html import short_command

    assert short_command(command) == title
    assert short_command("train.py " + "x" * 100).endswith("...")
    assert len(short_command("train.py " + "x" * 100)) == 80
