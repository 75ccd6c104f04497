"""A read command whose stdout reader went away (``copytrace diff --json | head``) stops
quietly with status 141 (128 + SIGPIPE, what a shell reports for a C tool in the same
pipe), never with a Python traceback; ``copytrace run`` leaves the program's own broken
pipe to the program."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _tracegen import write_trace

from copytrace.cli import main


class _GoneReader(io.StringIO):
    """A stdout whose reader has left: every write and flush fails as a closed pipe does."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.parametrize(
    "args",
    [("summary",), ("diff", "--json"), ("check", "--max-copies", "100")],
)
def test_a_broken_pipe_is_status_141_in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, args: tuple[str, ...]
) -> None:
    trace = write_trace(tmp_path / "t")
    paths = [str(trace), str(trace)] if args[0] == "diff" else [str(trace)]
    monkeypatch.setattr(sys, "stdout", _GoneReader())
    assert main([args[0], *paths, *args[1:]]) == 141
    assert capsys.readouterr().err == ""


def test_a_closed_pipe_gives_no_traceback(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t")
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write: EPIPE at once
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("COPYTRACE")}
        proc = subprocess.run(
            [sys.executable, "-m", "copytrace", "diff", "--json", str(trace), str(trace)],
            stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300, env=env,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert proc.stderr == ""
    assert proc.returncode == 141


def test_run_leaves_the_programs_broken_pipe_to_the_program(tmp_path: Path) -> None:
    # untraced, a print into a closed pipe raises in the program: traceback, status 1
    prog = tmp_path / "prog.py"
    prog.write_text("print('x' * 100000)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COPYTRACE")}

    def closed_pipe_run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            return subprocess.run(cmd, stdout=write_end, stderr=subprocess.PIPE, text=True,
                                  timeout=300, env=env, cwd=tmp_path)  # fmt: skip
        finally:
            os.close(write_end)

    untraced = closed_pipe_run([sys.executable, str(prog)])
    traced = closed_pipe_run(
        [sys.executable, "-m", "copytrace", "run", "--no-report", "-o", "o", str(prog)]
    )
    assert untraced.returncode == 1 and "BrokenPipeError" in untraced.stderr
    assert traced.returncode == untraced.returncode
    assert "BrokenPipeError" in traced.stderr
