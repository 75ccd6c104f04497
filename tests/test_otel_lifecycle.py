"""No data lost: the trace is flushed and valid however the traced program ends, each case in
a real subprocess; a file cut mid-write is readable up to its last whole line."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from copytrace.cli import main as cli_main
from copytrace.dashboards import load_trace

ROOT = Path(__file__).resolve().parent.parent

# 200 steps of 3 events (clone, detach, a no-op .to) with periodic flushes, then one more
# clone that no flush has written yet, then the ending under test.
PROGRAM = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch
    import copytrace

    mode, out = sys.argv[1], sys.argv[2]
    x = torch.ones(8, requires_grad=True)
    with copytrace.trace(out, flush_events=50, compression=os.environ.get("CT_COMP")) as t:
        for i in range(200):
            x.clone(); x.detach(); x.to(torch.float32)
            t.step()
        x.clone()
        if mode == "raise":
            raise ValueError("boom")
        if mode == "exit":
            sys.exit(3)
        if mode == "interrupt":
            raise KeyboardInterrupt
        if mode == "sigterm-self":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        if mode == "sigterm":
            print("ready", flush=True)
            time.sleep(60)
    print("done", flush=True)
    """
)
EVENTS = 200 * 3 + 1


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COPYTRACE", "OTEL_"))}
    env.update(extra)
    return env


def _run(tmp_path: Path, mode: str, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    out = tmp_path / "out"
    if mode != "sigterm":
        proc = subprocess.run(
            [sys.executable, str(script), mode, str(out)],
            capture_output=True, text=True, env=_env(**env), timeout=240,
        )  # fmt: skip
        return proc, out
    with subprocess.Popen(
        [sys.executable, str(script), mode, str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(**env),
    ) as p:  # fmt: skip
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "ready"
        p.send_signal(signal.SIGTERM)
        stdout, stderr = p.communicate(timeout=120)
    return subprocess.CompletedProcess(p.args, p.returncode, "ready\n" + stdout, stderr), out


def _raw_spans(path: Path, name: str) -> list[dict]:
    """The spans called ``name`` in the file, as OTLP/JSON objects (read without the loader)."""
    out = []
    for line in _lines(path):
        for rs in json.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                out += [sp for sp in ss["spans"] if sp["name"] == name]
    return out


def _check(out: Path, exit_reason: str, error: bool) -> None:
    files = list(out.glob("*.otlp.jsonl*"))
    assert len(files) == 1, files
    # The run span's status: OTLP STATUS_CODE_ERROR (2) with the exit reason as its message
    # when the program ended by an error, no status (unset) when it ended normally.
    (run_span,) = _raw_spans(files[0], "copytrace.run")
    if error:
        assert run_span["status"] == {"code": 2, "message": exit_reason}
    else:
        assert "status" not in run_span
    data = load_trace(files[0])
    assert data.bad_lines == 0  # closed cleanly: every line whole
    (run,) = data.runs
    assert run.has_run_span
    assert run.attrs["copytrace.exit"] == exit_reason
    assert run.attrs["copytrace.events"] == EVENTS
    assert run.attrs["copytrace.flushes"] >= 10  # written while running, not only at the end
    assert len(run.events) == EVENTS
    assert len(run.steps) == 201
    assert sorted(s.step for s in run.steps) == list(range(201))
    ops = [e.op for e in run.events]
    assert ops.count("clone") == 201 and ops.count("detach") == 200 and ops.count("to") == 200


@pytest.mark.parametrize(
    ("mode", "returncode", "reason", "error"),
    [
        ("normal", 0, "normal", False),
        ("raise", 1, "ValueError", True),
        ("exit", 3, "SystemExit(3)", True),
        ("interrupt", -signal.SIGINT, "KeyboardInterrupt", True),
        ("sigterm-self", -signal.SIGTERM, "SIGTERM", True),
        ("sigterm", -signal.SIGTERM, "SIGTERM", True),
    ],
)
def test_trace_is_complete_however_the_program_ends(tmp_path, mode, returncode, reason, error):
    proc, out = _run(tmp_path, mode)
    assert proc.returncode == returncode, proc.stderr
    assert ("done" in proc.stdout) == (mode == "normal")
    _check(out, reason, error)


def test_sigterm_under_copytrace_env_var(tmp_path):
    """No code change (``COPYTRACE=1``): SIGTERM still leaves a whole trace."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import time, torch
            model = torch.nn.Linear(4, 4)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for i in range(50):
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
                torch.ones(3).clone()
            print("ready", flush=True)
            time.sleep(60)
            """
        )
    )
    out = tmp_path / "out"
    env = _env(COPYTRACE="1", COPYTRACE_OUTPUT=str(out), COPYTRACE_REPORT="0")
    with subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env, cwd=tmp_path,
    ) as p:  # fmt: skip
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "ready"
        p.send_signal(signal.SIGTERM)
        _, stderr = p.communicate(timeout=120)
    assert p.returncode == -signal.SIGTERM, stderr
    (path,) = out.glob("*.otlp.jsonl*")
    data = load_trace(path)
    (run,) = data.runs
    assert data.bad_lines == 0 and run.attrs["copytrace.exit"] == "SIGTERM"
    assert sum(e.op == "clone" for e in run.events) == 50
    assert run.attrs["copytrace.steps"] == 51  # 50 optimizer steps


def _lines(path: Path) -> list[bytes]:
    raw = path.read_bytes()
    return (gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw).splitlines(keepends=True)


@pytest.mark.parametrize("compression", ["gzip", "none"])
def test_file_cut_mid_write_is_readable_up_to_last_whole_line(tmp_path, compression, capsys):
    proc, out = _run(tmp_path, "normal", CT_COMP=compression)
    assert proc.returncode == 0, proc.stderr
    (path,) = out.glob("*.otlp.jsonl*")
    raw = path.read_bytes()
    lines = _lines(path)
    assert len(lines) >= 10
    whole = load_trace(path)
    n_events = len(whole.runs[0].events)
    for frac in (0.3, 0.55, 0.8):  # before the end: the run span and hazards come last
        cut = tmp_path / f"cut{int(frac * 100)}{''.join(path.suffixes)}"
        cut.write_bytes(raw[: int(len(raw) * frac)])
        data = load_trace(cut)
        assert data.bad_lines == 1  # the one cut line (or cut gzip stream) is counted
        (run,) = data.runs
        assert not run.has_run_span  # the run span is written last
        assert 0 < len(run.events) < n_events
        # every event read is whole: attributes intact
        assert all(e.attrs.get("code.line.number") for e in run.events)
    # and the report says so
    capsys.readouterr()
    assert cli_main(["summary", str(cut)]) == 0
    assert "skipped 1 unreadable line(s)" in capsys.readouterr().err
    assert cli_main(["report", str(cut), "-o", str(tmp_path / "r.html"), "--no-analysis"]) == 0
    assert "skipped 1 unreadable line(s)" in capsys.readouterr().err


def test_forked_child_does_not_write_into_the_parents_file(tmp_path):
    """A fork child inherits the open trace file: it must never write to it."""
    script = tmp_path / "fork.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys, torch, copytrace
            x = torch.ones(4)
            with copytrace.trace(sys.argv[1], flush_events=10) as t:
                for i in range(30):
                    x.clone()
                    t.step()
                pid = os.fork()
                if pid == 0:
                    for i in range(30):
                        x.clone()
                        t.step()
                    sys.exit(0)  # runs finalizers: a stray gzip trailer would corrupt the file
                os.waitpid(pid, 0)
                for i in range(30):
                    x.clone()
                    t.step()
            """
        )
    )
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(script), str(out)], capture_output=True, text=True, env=_env(),
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (path,) = out.glob("*.otlp.jsonl*")
    data = load_trace(path)
    assert data.bad_lines == 0
    (run,) = data.runs
    assert run.has_run_span and len(run.events) == 60


def test_export_thread_does_not_block_exit(tmp_path):
    """The export thread is a bare OS thread, which the interpreter does not wait for (as a
    daemon), and stop() joins it: the program exits (a hang fails by the timeout; how long
    exit takes is measured by benchmarks/startup.py)."""
    script = tmp_path / "quick.py"
    script.write_text(
        "import sys, torch, copytrace\n"
        "with copytrace.trace(sys.argv[1]) as t:\n"
        "    torch.ones(2).clone()\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out")], capture_output=True, text=True,
        env=_env(), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (path,) = (tmp_path / "out").glob("*.otlp.jsonl.gz")
    (run,) = load_trace(path).runs
    assert run.has_run_span and [e.op for e in run.events] == ["clone"]
