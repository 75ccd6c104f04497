"""A program that makes no tensor copy: a trace of 0 events is read by every verb without an
internal error (the column analysis once took the maximum of an empty array)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def _copytrace(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "copytrace", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_a_trace_of_no_event_is_read_by_every_verb(tmp_path: Path) -> None:
    (tmp_path / "hi.py").write_text("import torch\nprint(torch.ones(2).sum().item())\n")
    run = _copytrace("run", "hi.py", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0] == "2.0"
    assert "internal error" not in run.stderr
    assert "copytrace: 0 events in 1 steps" in run.stderr
    check = _copytrace("check", "copytrace-out", cwd=tmp_path)
    assert (check.returncode, check.stderr) == (0, "")
    assert check.stdout.startswith("copytrace check: OK: 0 violation(s); 0 finding(s)")
    diff = _copytrace("diff", "copytrace-out", "copytrace-out", cwd=tmp_path)
    assert (diff.returncode, diff.stderr) == (0, "")
    assert "no call site changed" in diff.stdout
    fix = _copytrace("fix", "copytrace-out", cwd=tmp_path)
    assert fix.returncode == 0 and "Traceback" not in fix.stderr
