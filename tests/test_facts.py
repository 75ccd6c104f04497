"""Facts that must not depend on how they are read or how the program ends: one definition
of a copy for the report, ``summary`` and ``check``; the version a write-back into a view
leaves; the report and the launch directory after SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

import copytrace
from copytrace.analysis import Budget, check, parse_bytes
from copytrace.dashboards import build_model, load_trace


def test_a_failed_call_is_not_a_copy_anywhere(tmp_path: Path) -> None:
    x = torch.ones(3, 2)
    with copytrace.trace(tmp_path):
        x.clone()  # 24 B
        try:
            torch.ones(2).copy_(torch.ones(3))  # raises: a failed call
        except RuntimeError:
            pass
    totals = build_model(load_trace(tmp_path)).totals
    assert (totals.events, totals.copy_count, totals.error_count) == (2, 1, 1)
    assert totals.bytes_copied == 24
    violations, _ = check(tmp_path, Budget(max_copies=0, max_bytes=parse_bytes("1K")))
    assert len(violations) == 1 and violations[0].startswith("copies 1 over max-copies 0")


def test_write_back_into_a_view_records_the_version_after_the_write() -> None:
    x = torch.ones(4, 3)
    with copytrace.trace(write=False) as t:
        x[:, 0] = torch.sigmoid(x[:, 0])  # aten::copy_ into a view of x
        x[1:, 1] = x[1:, 2] * 2
    assert x._version == 2
    assert [(e.op, e.src_version, e.dst_version) for e in t.events] == [
        ("implicit", 0, 1),  # x's version counter: 0 -> 1
        ("implicit", 0, 2),  # the second view shares it: 1 -> 2
    ]


_SLEEPER = """\
import sys, time
import torch
{setup}
x = torch.ones(10)
for _ in range(3):
    y = x.clone()
print("ready", flush=True)
time.sleep(60)
"""


def _terminate(tmp_path: Path, setup: str) -> tuple[subprocess.CompletedProcess, Path]:
    script = tmp_path / "sleeper.py"
    script.write_text(_SLEEPER.format(setup=setup))
    out = tmp_path / "out"
    env = {**os.environ, "COPYTRACE": "1", "COPYTRACE_OUTPUT": str(out)}
    proc = subprocess.Popen(
        [sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), out


def test_sigterm_writes_the_report_and_leaves_no_launch_directory(tmp_path: Path) -> None:
    # a grace period no load can use up: whether the report fits in the default 10 s is a
    # timing fact (the time taken to write the trace counts against it)
    done, out = _terminate(
        tmp_path, "import copytrace.launch.report as r; r._SIGNAL_GRACE_S = 3600.0"
    )
    assert done.returncode == -signal.SIGTERM  # the program still dies of the signal
    assert (out / "report.html").is_file(), done.stderr
    assert not list(out.glob(".copytrace-launch-*"))
    (run,) = load_trace(out).runs
    assert run.attrs["copytrace.exit"] == "SIGTERM" and len(run.events) == 3


def test_sigterm_without_time_for_the_report_says_how_to_build_it(tmp_path: Path) -> None:
    # no grace period left: the report would not fit
    done, out = _terminate(tmp_path, "import copytrace.launch.report as r; r._SIGNAL_GRACE_S = 0.0")
    assert done.returncode == -signal.SIGTERM
    assert not (out / "report.html").exists()
    assert f"build it with: copytrace report {out}" in done.stderr
    assert not list(out.glob(".copytrace-launch-*"))
    assert len(load_trace(out).runs[0].events) == 3
