"""Several runs (launches) in one trace directory: told apart, one shown unless ``--all``.

Each launch is the synthetic trace of ``_tracegen`` (7 events, 31000 B copied), moved in
time so that launches do not overlap; processes of one launch overlap (ranks, workers).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _tracegen import trace_lines

from copytrace.cli import main

HOUR_NS = 3600 * 10**9


def _shift(obj: object, ns: int) -> object:
    if isinstance(obj, dict):
        return {k: (str(int(v) + ns) if k in ("startTimeUnixNano", "endTimeUnixNano",
                                               "timeUnixNano") else _shift(v, ns))
                for k, v in obj.items()}  # fmt: skip
    if isinstance(obj, list):
        return [_shift(v, ns) for v in obj]
    return obj


def _launch(directory: Path, pid: int, hours: int, script: str = "train.py") -> None:
    lines = [json.dumps(_shift(json.loads(ln), hours * HOUR_NS)) for ln in trace_lines(pid)]
    text = "\n".join(lines).replace('"train.py"', json.dumps(script)) + "\n"
    (directory / f"copytrace-h-{pid}.otlp.jsonl").write_text(text)


def _summary(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(["summary", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_latest_run_is_shown_and_the_others_named(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    _launch(tmp_path, 11, 0)
    _launch(tmp_path, 12, 1)
    code, out, err = _summary(capsys, str(tmp_path))
    assert code == 0
    assert "holds 2 runs; showing run 2" in err and "run 1: train.py --epochs 1" in err
    assert "run: pid 12" in out and "pid 11" not in out
    assert "bytes copied 30.3 KiB (31000 B)" in out  # one run's totals, not doubled


def test_run_picks_one_and_all_combines(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _launch(tmp_path, 11, 0)
    _launch(tmp_path, 12, 1)
    code, out, err = _summary(capsys, str(tmp_path), "--run", "1")
    assert (code, err) == (0, "")
    assert "run: pid 11" in out and "pid 12" not in out
    code, out, err = _summary(capsys, str(tmp_path), "--all", "--no-analysis")
    assert code == 0 and "combining 2 runs of the same program (train.py)" in err
    assert "bytes copied 60.5 KiB (62000 B)" in out
    # the tracer's hazard of each run, with its run
    assert "warning   CT-TEST  pid 11" in out and "warning   CT-TEST  pid 12" in out


def test_different_programs_are_named_when_combined(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    _launch(tmp_path, 11, 0)
    _launch(tmp_path, 12, 1, script="eval.py")
    code, _, err = _summary(capsys, str(tmp_path), "--all")
    assert code == 0
    assert "combining 2 runs of different programs (eval.py, train.py)" in err


def test_processes_of_one_launch_are_one_run(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    _launch(tmp_path, 11, 0)
    _launch(tmp_path, 12, 0)  # same time: two ranks of one launch
    code, out, err = _summary(capsys, str(tmp_path))
    assert (code, err) == (0, "")
    assert "run: pid 11" in out and "run: pid 12" in out


def test_bad_run_number_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _launch(tmp_path, 11, 0)
    _launch(tmp_path, 12, 1)
    code, out, err = _summary(capsys, str(tmp_path), "--run", "3")
    assert code == 2 and out == ""
    assert err == f"copytrace: error: --run 3: {tmp_path} holds runs 1-2\n"
    assert main(["check", str(tmp_path), "--run", "1", "--allow-partial"]) == 0


@pytest.mark.parametrize(
    "argv, program",
    [
        (["python", "-m", "copytrace", "run", "-o", "out", "--py-spy-rate", "50", "--py-spy",
          "t.py", "-o", "x"], ["t.py", "-o", "x"]),
        (["/v/bin/python3", "-X", "dev", "-W", "error", "-m", "copytrace", "run", "--", "-t.py"],
         ["-t.py"]),
        (["/v/bin/python", "/v/bin/copytrace", "run", "--output=o", "-m", "pkg.m", "--no-report"],
         ["-m", "pkg.m", "--no-report"]),
        # not copytrace run: as it is
        (["python", "train.py", "run"], ["python", "train.py", "run"]),
        (["python", "-m", "copytrace", "summary", "out"],
         ["python", "-m", "copytrace", "summary", "out"]),
        (["train.py", 1], ["train.py", "1"]),
        ([], []),
    ],
)  # fmt: skip
def test_program_args_drops_copytrace_run_and_its_options(argv, program):
    from copytrace.tracefile import program_args

    assert program_args(argv) == program
