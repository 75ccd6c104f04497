"""The flight recorder (``COPYTRACE_RING=N``): a real training process keeps only its last N
records and writes them, with the run span, after an uncaught exception, on SIGTERM and on
SIGUSR1 (while it goes on). Memory over a long run is checked in a benchmark
(``benchmarks/ring_memory.py``), not here."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# Two clones per iteration, each iteration one step (optimizer.step() ends it): 2 records a
# step. ``HOW`` decides how the process ends after iteration 20.
TRAIN = """
import os, signal, sys, time, torch
how = sys.argv[1]
if how == "usr1_at_end":  # SIGUSR1 while the trace's end is being written, at exit
    from copytrace.tracer.session import Session

    write_final = Session._write_final

    def late_signal(self, *args):
        os.kill(os.getpid(), signal.SIGUSR1)  # handled at the next bytecode, in the write
        return write_final(self, *args)

    Session._write_final = late_signal
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(21):
    x = torch.ones(2, 4).clone()
    model(x.clone()).sum().backward()
    opt.step()
    if how == "usr1" and i == 15:
        os.kill(os.getpid(), signal.SIGUSR1)
print("done", flush=True)
if how == "raise":
    raise MemoryError("out of memory at top level")
if how == "term":
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
"""

RING = 6


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COPYTRACE", "OTEL_"))}
    env.update(extra)
    return env


def _read(path: Path) -> tuple[list[int], dict]:
    """The steps of a trace file's clones, and its run span's attributes."""
    steps, run = [], {}
    for line in gzip.open(path, "rt").read().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            for span in rs["scopeSpans"][0]["spans"]:
                attrs = {a["key"]: next(iter(a["value"].values())) for a in span["attributes"]}
                if span["name"] == "copytrace.clone":
                    steps.append(int(attrs["copytrace.step"]))
                elif span["name"] == "copytrace.run":
                    run = attrs
    return sorted(steps), run


def _run(tmp_path: Path, how: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    prog = tmp_path / "train.py"
    prog.write_text(TRAIN)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(prog), how], capture_output=True, text=True, timeout=180,
        env=_env(COPYTRACE="1", COPYTRACE_RING=str(RING), COPYTRACE_OUTPUT=str(out),
                 COPYTRACE_REPORT="0"),
    )  # fmt: skip
    return proc, out


def _last_steps(steps: list[int]) -> None:
    # the ring keeps at least the last RING records, at most 2 RING (it is cut at step
    # boundaries), and always the newest: the last steps' 2 records each
    assert RING <= len(steps) <= 2 * RING, steps
    assert steps == sorted(steps) and steps[-1] == 20
    assert steps == [s for s in range(21) for _ in range(2)][-len(steps) :]


def test_ring_after_an_exception(tmp_path):
    proc, out = _run(tmp_path, "raise")
    assert proc.returncode == 1 and "MemoryError" in proc.stderr
    (path,) = out.glob("*.otlp.jsonl.gz")
    steps, run = _read(path)
    _last_steps(steps)
    assert run["copytrace.ring"] == str(RING)  # OTLP/JSON: ints as strings
    assert run["copytrace.ring_reason"] == "MemoryError"
    assert int(run["copytrace.ring_skipped"]) == 42 - len(steps)  # 21 steps x 2 clones
    # summary and report say what the dump holds: the file's own count (N to 2 N), not N
    said = (
        f"flight recorder dump (COPYTRACE_RING={RING}, which keeps the last {RING} to "
        f"{2 * RING} events): this trace holds the last {len(steps)} events before MemoryError; "
        f"{42 - len(steps)} older event(s) were let go"
    )
    cli = [sys.executable, "-m", "copytrace"]
    summary = subprocess.run([*cli, "summary", str(path)], capture_output=True, text=True,
                             timeout=180, env=_env())  # fmt: skip
    assert summary.returncode == 0, summary.stderr
    assert f"  {said}" in summary.stdout.splitlines()
    html = tmp_path / "r.html"
    report = subprocess.run([*cli, "report", str(path), "-o", str(html)], capture_output=True,
                            text=True, timeout=180, env=_env())  # fmt: skip
    assert report.returncode == 0, report.stderr
    assert said in html.read_text(encoding="utf-8")


@pytest.mark.skipif(not hasattr(signal, "SIGTERM"), reason="no SIGTERM")
def test_ring_on_sigterm(tmp_path):
    proc, out = _run(tmp_path, "term")
    assert proc.returncode == -signal.SIGTERM  # it still dies of the signal
    (path,) = out.glob("*.otlp.jsonl.gz")
    steps, run = _read(path)
    _last_steps(steps)
    assert run["copytrace.ring_reason"] == "SIGTERM"


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1")
def test_ring_on_sigusr1_while_running(tmp_path):
    proc, out = _run(tmp_path, "usr1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "done\n"  # SIGUSR1 did not end the program
    # the dump at SIGUSR1, then the end of the run: told apart by what each says, not by
    # modification times (two files written within one tick of the file system's clock)
    read = [_read(path) for path in out.glob("*.otlp.jsonl.gz")]
    files = {run["copytrace.ring_reason"]: steps for steps, run in read}
    assert len(read) == len(files) == 2, read
    assert sorted(files) == ["SIGUSR1", "the end of the run"]
    dumped = files["SIGUSR1"]
    # SIGUSR1 arrives in step 15, after its records; written at the boundary ending step 16
    # (the next one) together with step 16's records
    assert dumped[-1] == 16 and RING <= len(dumped) <= 2 * RING + 2
    _last_steps(files["the end of the run"])


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1")
def test_a_ring_signal_while_the_end_is_written_is_taken(tmp_path):
    # copytrace's handler stays until the end is written: the signal is taken (the ring is
    # being written anyway); before, SIG_DFL was back first and the process died of SIGUSR1
    # (status -10) in the middle of its trace file. SIG_DFL is back once the file is written.
    proc, out = _run(tmp_path, "usr1_at_end")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "done\n"
    (path,) = out.glob("*.otlp.jsonl.gz")  # one file: the end of the run, whole
    steps, run = _read(path)
    _last_steps(steps)
    assert run["copytrace.ring_reason"] == "the end of the run"


# The flight recorder and the trigger together are refused, with one line, before any work.
REFUSED = (
    "COPYTRACE_RING=6 and COPYTRACE_TRIGGER=signal do not go together: the flight recorder "
    "records every step to keep the last 6 events, the trigger records nothing until its "
    "signal; use one of them"
)


def test_ring_and_trigger_under_copytrace_1_run_untraced(tmp_path):
    # the COPYTRACE=1 hook never stops a program: one line, and the program runs untraced
    prog = tmp_path / "train.py"
    prog.write_text(TRAIN)
    out = tmp_path / "out"
    env = _env(COPYTRACE="1", COPYTRACE_RING=str(RING), COPYTRACE_TRIGGER="signal",
               COPYTRACE_OUTPUT=str(out))  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(prog), "end"], capture_output=True, text=True, env=env, timeout=180
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "done\n"
    assert proc.stderr.splitlines() == [f"copytrace: {REFUSED}; tracing disabled"]
    assert not list(out.glob("*.otlp.jsonl*"))


def test_ring_and_trigger_refused_by_copytrace_run(tmp_path):
    prog = tmp_path / "train.py"
    prog.write_text(TRAIN)
    exe = Path(sys.executable).with_name("copytrace")
    env = _env(COPYTRACE_RING=str(RING), COPYTRACE_TRIGGER="signal")
    proc = subprocess.run(
        [str(exe), "run", "-o", str(tmp_path / "out"), str(prog), "end"],
        capture_output=True, text=True, env=env, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stdout == ""  # refused before the program started
    assert proc.stderr.splitlines() == [f"copytrace: error: {REFUSED}"]


def test_ring_and_trigger_refused_by_trace():
    import copytrace

    with pytest.raises(copytrace.SettingError) as err:
        copytrace.trace(write=False, ring=RING, trigger="signal")
    assert str(err.value) == REFUSED.replace("COPYTRACE_RING", "ring").replace(
        "COPYTRACE_TRIGGER", "trigger"
    )
