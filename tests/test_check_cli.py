"""``copytrace check``: per-step and total copy budgets and forbidden hazards, as exit codes.

The synthetic trace of ``_tracegen.write_trace`` (no hazard facts, so no findings) has, per
step: step 0 one 4000 B clone; step 1 an 8000 B transfer and a deepcopy whose two children
allocate 2000 + 1000 B (3 copies, 11000 B); step 2 a 16000 B contiguous (and a no-op, which
is not a copy). 31000 B and 5 copies in all.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _tracegen import write_trace

import copytrace
from copytrace.cli import main

STEP1 = "top call sites: train.py:20 main (8000 B, 1 copy), train.py:30 main (3000 B, 2 copies)"
STEP2 = "top call sites: train.py:11 forward (16000 B, 1 copy)"


def run_check(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, list[str]]:
    code = main(["check", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err.splitlines()


def test_within_budget_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_trace(tmp_path)
    code, out, err = run_check(
        capsys, str(tmp_path), "--max-bytes-per-step", "16000", "--max-copies-per-step", "3",
        "--max-bytes", "31000", "--max-copies", "5", "--forbid", "all",
    )  # fmt: skip
    assert (code, err) == (0, [])
    assert out == (
        "copytrace check: OK: 0 violation(s); 0 finding(s); worst step 16000 B (15.6 KiB), "
        "3 copies\n"
    )


def test_per_step_budgets_exit_1_with_one_line_each(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    write_trace(tmp_path)
    code, out, err = run_check(
        capsys, str(tmp_path), "--max-bytes-per-step", "10000", "--max-copies-per-step", "2"
    )
    assert code == 1
    assert err == [
        "copytrace check: bytes per step over max-bytes-per-step 10000 B (9.8 KiB) in 2 of 3 "
        f"step(s) with copies; worst step 2: 16000 B (15.6 KiB) in 1 copy, {STEP2}",
        "copytrace check: copies per step over max-copies-per-step 2 in 1 of 3 step(s) with "
        f"copies; worst step 1: 11000 B (10.7 KiB) in 3 copies, {STEP1}",
    ]
    assert out.startswith("copytrace check: FAILED: 2 violation(s)")


def test_total_budgets_and_byte_units(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_trace(tmp_path)
    code, _, err = run_check(capsys, str(tmp_path), "--max-bytes", "30KB", "--max-copies", "4")
    assert code == 1 and len(err) == 2
    assert err[0].startswith(
        "copytrace check: bytes allocated 31000 B (30.3 KiB) over max-bytes 30000 B (29.3 KiB) "
        "(5 copies), top call sites: train.py:11 forward (16000 B, 1 copy)"
    )
    assert err[1].startswith("copytrace check: copies 5 over max-copies 4 (31000 B (30.3 KiB))")
    assert run_check(capsys, str(tmp_path), "--max-bytes", "31KiB")[0] == 0  # 31744 B


def test_warmup_steps_are_left_out_of_per_step_limits(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    write_trace(tmp_path)
    limit = ("--max-bytes-per-step", "10000")
    assert run_check(capsys, str(tmp_path), *limit, "--warmup-steps", "2")[0] == 1  # step 2
    assert run_check(capsys, str(tmp_path), *limit, "--warmup-steps", "3")[0] == 0


def _redundant_trace(out: Path) -> str:
    x = torch.arange(16.0)
    with copytrace.trace(out):
        x.clone()
        x.clone()  # the same unchanged source again: redundant-copy (warning)
    return f"{__file__}:{_redundant_trace.__code__.co_firstlineno + 4} _redundant_trace"


def test_forbidden_hazard_exits_1_naming_the_call_site(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    second = _redundant_trace(tmp_path)
    code, _, err = run_check(capsys, str(tmp_path), "--forbid", "data_inplace,redundant_copy")
    assert code == 1 and len(err) == 1
    assert err[0].startswith("copytrace check: forbidden hazard redundant-copy (warning) at ")
    assert f", {second}: the same unchanged source (float32 16)" in err[0]
    # not forbidden: reported with --findings, but the check passes
    code, out, err = run_check(capsys, str(tmp_path), "--forbid", "data-inplace", "--findings")
    assert (code, err) == (0, [])
    assert "warning redundant-copy" in out and "fix: Make the copy once per step" in out


def test_fail_on_severity(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _redundant_trace(tmp_path)
    assert run_check(capsys, str(tmp_path), "--fail-on", "error")[0] == 0
    assert run_check(capsys, str(tmp_path), "--fail-on", "warning")[0] == 1


def test_unknown_hazard_code_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_trace(tmp_path)
    assert main(["check", str(tmp_path), "--forbid", "no-such-hazard"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("copytrace: error: unknown hazard code 'no-such-hazard'; valid codes:")


def test_bad_byte_count_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main(["check", str(tmp_path), "--max-bytes-per-step", "lots"])
    assert info.value.code == 2
    assert "not a byte count: 'lots'" in capsys.readouterr().err


def test_missing_trace_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["check", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.startswith("copytrace: error: trace path not found")


def test_exit_status_from_the_command_line(tmp_path: Path) -> None:
    write_trace(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "copytrace", "check", str(tmp_path), "--max-copies", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("copytrace check: copies 5 over max-copies 1")


def test_partial_trace_fails_the_gate_unless_allowed(tmp_path, capsys):
    import subprocess
    import sys

    import torch

    import copytrace

    with copytrace.trace(tmp_path / "full", compression="none", flush_events=1) as t:
        for _ in range(3):
            torch.ones(4).clone()
            t.step()
    lines = t.trace_path.read_text().splitlines(keepends=True)
    cut = tmp_path / "cut"
    cut.mkdir()
    # the first line whole, the second cut in the middle; the run span (written last) is gone
    (cut / t.trace_path.name).write_text(lines[0] + lines[1][: len(lines[1]) // 2])
    proc = subprocess.run(
        [sys.executable, "-m", "copytrace", "check", str(cut), "--max-copies", "100"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "trace is partial: 1 unreadable line(s)" in proc.stderr
    ok = subprocess.run(
        [sys.executable, "-m", "copytrace", "check", str(cut), "--max-copies", "100",
         "--allow-partial"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
