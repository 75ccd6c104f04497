"""Tracing in production, end to end, as a user runs it: a training job that runs until told
to stop, armed with ``COPYTRACE=1 COPYTRACE_TRIGGER=signal``, traced for exactly the next 10
steps after ``copytrace trigger PID`` (trace and report written while it goes on); and the
flight recorder writing its last N events, and a report that says so, when a job crashes."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR2"), reason="no SIGUSR2 here")

# A job that trains until the file argv[1] exists (or 100000 iterations): one clone per
# iteration, each optimizer.step() ends a step, so iteration i's clone is in step i. It
# prints each iteration on stdout; with argv[2] == "crash" it raises after 30 iterations.
JOB = """
import os, sys, torch
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(8, 4)
for i in range(100000):
    loss = model(x.clone()).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"iter {i}", flush=True)
    if os.path.exists(sys.argv[1]):
        break
    if sys.argv[2] == "crash" and i == 29:
        raise RuntimeError("the job failed at iteration 29")
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COPYTRACE", "OTEL_"))}
    env.update(extra)
    return env


def _clones_and_run(out: Path) -> tuple[list[int], dict]:
    """The steps of the trace's clones, and its run span's attributes."""
    (path,) = out.glob("*.otlp.jsonl.gz")
    steps, run = [], {}
    for line in gzip.open(path, "rt").read().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            for span in rs["scopeSpans"][0]["spans"]:
                attrs = {a["key"]: a["value"] for a in span["attributes"]}
                if span["name"] == "copytrace.clone":
                    steps.append(int(attrs["copytrace.step"]["intValue"]))
                elif span["name"] == "copytrace.run":
                    run = attrs
    return sorted(steps), run


def test_armed_job_traces_the_next_10_steps_on_copytrace_trigger(tmp_path):
    prog, stop, out = tmp_path / "job.py", tmp_path / "stop", tmp_path / "out"
    prog.write_text(JOB)
    stdout = tmp_path / "stdout.txt"
    with stdout.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, str(prog), str(stop), "run"], stdout=sink, stderr=subprocess.PIPE,
            text=True, env=_env(COPYTRACE="1", COPYTRACE_TRIGGER="signal",
                                COPYTRACE_OUTPUT=str(out)),
        )  # fmt: skip
    try:
        while stdout.read_text().count("\n") < 20:  # the job is well into its steps
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.05)
        exe = Path(sys.executable).with_name("copytrace")
        trig = subprocess.run(
            [str(exe), "trigger", str(proc.pid)], capture_output=True, text=True, timeout=60
        )
        assert trig.returncode == 0, trig.stderr
        assert f"process {proc.pid}: tracing the next 10 steps -> {out}" in trig.stdout
        said = []
        assert proc.stderr is not None
        while not said or "report of steps" not in said[-1]:
            said.append(proc.stderr.readline())
            assert said[-1], "the job ended before the report"
        running = proc.poll() is None  # trace and report were written while the job ran on
        stop.touch()
        rest = proc.communicate(timeout=180)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert running and proc.returncode == 0, rest
    traced, report = said[-2], said[-1]
    first, last = (int(s) for s in traced.split("traced steps ")[1].split()[0].split("-"))
    assert last - first + 1 == 10
    assert report.startswith(f"copytrace: report of steps {first}-{last}: ")
    steps, run = _clones_and_run(out)
    assert steps == list(range(first, last + 1))  # exactly the 10 steps, one clone each
    windows = [v["stringValue"] for v in run["copytrace.windows"]["arrayValue"]["values"]]
    assert windows == [f"{first}-{last}"]
    # the job printed every iteration as it does untraced, from 0 on, one line each
    lines = stdout.read_text().splitlines()
    assert lines == [f"iter {i}" for i in range(len(lines))] and len(lines) > last
    assert (out / "report.html").is_file()


def test_flight_recorder_writes_its_last_events_and_report_on_a_crash(tmp_path):
    prog, out = tmp_path / "job.py", tmp_path / "out"
    prog.write_text(JOB)
    proc = subprocess.run(
        [sys.executable, str(prog), str(tmp_path / "never"), "crash"], capture_output=True,
        text=True, timeout=180,
        env=_env(COPYTRACE="1", COPYTRACE_RING="8", COPYTRACE_OUTPUT=str(out)),
    )  # fmt: skip
    assert proc.returncode == 1 and "RuntimeError: the job failed at iteration 29" in proc.stderr
    steps, run = _clones_and_run(out)
    # the ring keeps at least the last 8 records and at most 16, always the newest: one clone
    # per step, steps 0..29
    assert 8 <= len(steps) <= 16 and steps == list(range(30 - len(steps), 30)), steps
    assert run["copytrace.ring_reason"]["stringValue"] == "RuntimeError"
    html = (out / "report.html").read_text(encoding="utf-8")
    assert (
        "flight recorder dump (COPYTRACE_RING=8, which keeps the last 8 to 16 events): this "
        f"trace holds the last {len(steps)} events before RuntimeError; {30 - len(steps)} "
        "older event(s) were let go"
    ) in html
