"""Remake ``docs/img/merged-trace.png``: the README's example traced by copytrace inside
torch.profiler, merged into one Chrome trace (``copytrace export --chrome-trace --merge``),
and one step of its main thread drawn as a timeline.

Perfetto's UI (ui.perfetto.dev) is a web app that needs the network, and Chromium no longer
ships the offline ``chrome://tracing`` viewer, so the image is drawn from the merged file
itself: the slices of the main thread's track, stacked by nesting as Perfetto lays out a
thread track (torch.profiler's ops in grey and blue, copytrace's ``copytrace::`` slices in
orange), with plotly, and screenshot with Debian's Chromium through Playwright. Nothing is
fetched from the network.

Usage::

    python docs/img/make_merged_trace.py [--keep DIR] [--step N]

``--keep DIR`` keeps the traces and ``merged.json`` (to open in ui.perfetto.dev, see
docs/production.md). Takes about a minute on two CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
OUT_PNG = HERE / "merged-trace.png"

# The example's main() run for a few steps inside torch.profiler and copytrace.trace().
PROGRAM = """
import runpy, sys, torch, copytrace
from torch.profiler import profile, ProfilerActivity
main = runpy.run_path(sys.argv[1])["main"]
with profile(activities=[ProfilerActivity.CPU]) as prof:
    with copytrace.trace(sys.argv[2]):
        main(["--steps", sys.argv[3], "--eval-every", "1000"])
prof.export_chrome_trace(sys.argv[2] + "/profiler.json")
"""


def make_merged(work: Path, steps: int) -> Path:
    """Trace the example under torch.profiler and copytrace; return ``merged.json``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COPYTRACE", "OTEL_"))}
    example = ROOT / "examples" / "train_charlm.py"
    subprocess.run(
        [sys.executable, "-c", PROGRAM, str(example), str(work), str(steps)],
        check=True, env=env, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    merged = work / "merged.json"
    exe = shutil.which("copytrace", path=str(Path(sys.executable).parent)) or "copytrace"
    subprocess.run(
        [exe, "export", str(work), "--chrome-trace", str(merged), "--merge",
         str(work / "profiler.json")], check=True, env=env,
    )  # fmt: skip
    return merged


def window(doc: dict, step: int) -> tuple[int, float, float, list[dict]]:
    """The main thread's slices around the example's ``torch.tensor(loss)`` copy (its
    deliberate hazard) of ``step``: ``(tid, start us, end us, slices)``."""
    anchor = next(
        e for e in doc["traceEvents"]
        if e.get("name") == "copytrace::tensor_ctor" and e["args"].get("step") == step
    )  # fmt: skip
    tid = anchor["tid"]
    t0, t1 = anchor["ts"] - 100.0, anchor["ts"] + anchor["dur"] + 12.0
    slices = [
        e for e in doc["traceEvents"]
        if e.get("ph") == "X" and e.get("tid") == tid and e["ts"] < t1 and e["ts"] + e["dur"] > t0
    ]  # fmt: skip
    return tid, t0, t1, sorted(slices, key=lambda e: (e["ts"], -e["dur"]))


def depths(slices: list[dict]) -> list[int]:
    """Each slice's depth on its track: the number of slices open when it starts (slices
    sorted by start, longest first), as Perfetto stacks a thread track."""
    out, open_ends = [], []
    for e in slices:
        while open_ends and open_ends[-1] <= e["ts"]:
            open_ends.pop()
        out.append(len(open_ends))
        open_ends.append(e["ts"] + e["dur"])
    return out


def label(e: dict) -> str:
    if e.get("cat") != "copytrace":
        return e["name"]
    a = e["args"]
    hazards = ", ".join(a.get("hazards") or [])
    return f"{e['name']} line {a.get('line')}" + (f" ⚠ {hazards}" if hazards else "")


COLORS = {"copytrace": "#f28e2b", "cpu_op": "#4e79a7", "user_annotation": "#59a14f"}
KINDS = {"copytrace": "copytrace (copies)", "cpu_op": "torch.profiler: aten ops",
         "user_annotation": "torch.profiler: annotations"}  # fmt: skip


PLOT_PX = 1020  # the plot area's width: the figure's 1100 px less its margins
CHAR_PX = 7.0  # about one character of the 12 px font


def placements(rows: list[tuple[dict, int]], t0: float, t1: float) -> list[tuple[str, str]]:
    """``(text, position)`` of each bar: its label inside where it fits, else just after it
    where its row is free that far, else none (as Perfetto elides labels)."""
    px = PLOT_PX / (t1 - t0)
    out = []
    for e, d in rows:
        text, start, end = label(e), max(e["ts"], t0), min(e["ts"] + e["dur"], t1)
        need = CHAR_PX * len(text) + 8
        following = [o["ts"] for o, od in rows if od == d and o["ts"] >= end]
        free = (min(following, default=t1) - end) * px
        if (end - start) * px >= need:
            out.append((text, "inside"))
        elif free >= need:
            out.append((text, "outside"))
        else:
            out.append(("", "none"))
    return out


def figure(doc: dict, step: int) -> object:
    """A plotly timeline of :func:`window`: one row per depth, one bar per slice."""
    import plotly.graph_objects as go

    _, t0, t1, slices = window(doc, step)
    everything = list(zip(slices, depths(slices), strict=True))
    placed = dict(zip(map(id, slices), placements(everything, t0, t1), strict=True))
    fig = go.Figure()
    for cat, name in KINDS.items():
        rows = [(e, d) for e, d in everything if e.get("cat") == cat]
        if not rows:
            continue
        starts = [max(e["ts"], t0) - t0 for e, _ in rows]
        ends = [min(e["ts"] + e["dur"], t1) - t0 for e, _ in rows]
        fig.add_bar(
            orientation="h", name=name, marker_color=COLORS[cat], base=starts,
            x=[b - a for a, b in zip(starts, ends, strict=True)], y=[d for _, d in rows],
            text=[placed[id(e)][0] for e, _ in rows],
            textposition=[placed[id(e)][1] for e, _ in rows], insidetextanchor="start",
            textangle=0, marker_line_color="white", marker_line_width=1,
        )  # fmt: skip
    fig.update_layout(
        title=(f"examples/train_charlm.py, step {step}, main thread: copytrace's slices on "
               f"torch.profiler's track, one clock (drawn from merged.json)"),
        barmode="overlay", width=1100, height=330, bargap=0.15, template="plotly_white",
        font_size=12, legend=dict(orientation="h", y=-0.25),
        margin=dict(l=60, r=20, t=50, b=20),
    )  # fmt: skip
    fig.update_yaxes(autorange="reversed", title="depth", dtick=1)
    fig.update_xaxes(title="time (µs)", range=[0, t1 - t0])
    return fig


def screenshot(fig: object, png: Path) -> None:
    """The figure as HTML (plotly.js inline: no network), screenshot with Chromium."""
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    with tempfile.TemporaryDirectory() as tmp:
        html = Path(tmp) / "merged.html"
        fig.write_html(html, include_plotlyjs=True, config={"displayModeBar": False})  # type: ignore[attr-defined]
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1200, "height": 400})
            page.goto(html.as_uri())
            page.wait_for_selector(".main-svg")
            page.locator(".plot-container").screenshot(path=str(png))
            browser.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, default=None, help="keep the traces in DIR")
    parser.add_argument("--step", type=int, default=3, help="the step drawn")
    parser.add_argument("--merged", type=Path, default=None, help="draw this merged.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        merged = args.merged or make_merged(work, args.step + 1)
        doc = json.loads(merged.read_text())
        screenshot(figure(doc, args.step), OUT_PNG)
    print(f"{OUT_PNG} ({OUT_PNG.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
