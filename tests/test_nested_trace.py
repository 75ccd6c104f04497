"""A trace started while another one records (``copytrace.trace()`` inside ``copytrace.trace()``,
or under ``copytrace run`` / ``COPYTRACE=1``): its events go to the running trace, it writes no
file of its own, and that is said once on stderr, naming the running trace's file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_PROGRAM = """
import sys
import torch
import copytrace

with copytrace.trace("outer") as outer:
    torch.ones(4).clone()
    for _ in range(2):  # said once, however many inner traces
        with copytrace.trace("inner") as inner:
            torch.ones(8).clone()
    assert inner is outer  # the running trace is the one handed back
print(outer.trace_path)
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COPYTRACE", "OTEL_"))}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def test_an_inner_trace_says_once_where_its_events_went(tmp_path: Path) -> None:
    (tmp_path / "prog.py").write_text(_PROGRAM)
    proc = subprocess.run(
        [sys.executable, "prog.py"], capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env=_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    outer = Path(proc.stdout.strip())  # relative to the program's folder, as it was given
    assert (tmp_path / outer).is_file() and outer.parent == Path("outer")
    assert not (tmp_path / "inner").exists()
    said = [line for line in proc.stderr.splitlines() if "inside a running trace" in line]
    assert said == [
        "copytrace: a trace for inner was started inside a running trace: it writes no file of "
        f"its own, its events go to the running one (its file {outer})"
    ]


def test_write_false_inside_a_trace_is_quiet(tmp_path: Path) -> None:
    # the pytest plugin's traces (write=False) lose no file: nothing to say
    (tmp_path / "prog.py").write_text(
        "import torch, copytrace\n"
        "with copytrace.trace('outer'):\n"
        "    with copytrace.trace(write=False):\n"
        "        torch.ones(2).clone()\n"
    )
    proc = subprocess.run(
        [sys.executable, "prog.py"], capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env=_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "inside a running trace" not in proc.stderr
