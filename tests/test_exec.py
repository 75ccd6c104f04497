"""``os.exec*`` under ``COPYTRACE=1``: the process is replaced without ``atexit``, so
copytrace finishes its trace at the ``os.exec`` audit event (``copytrace/launch/process.py``
``_register_exec_hook``). The trace so far is written and set aside under an ``-exec1`` name
(the new program keeps the pid, and is traced too, being Python), the launch's markers say
"done", and the root's report is written; the program's output and exit status are its own.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from copytrace.dashboards import load_trace
from copytrace.tracer import _native

AFTER = (
    "import sys, torch; a = torch.ones(10); b = a.clone(); c = a.double(); print('after'); "
    "sys.exit(3)"
)
EXECV = f"""
import os, sys, torch
x = torch.ones(100)
y = x.clone()
print("before", flush=True)
os.execv(sys.executable, [sys.executable, "-c", {AFTER!r}])
"""
FORK_EXEC = f"""
import os, sys, torch
x = torch.ones(100)
y = x.clone()
pid = os.fork()
if pid == 0:
    os.execv(sys.executable, [sys.executable, "-c", {AFTER!r}])
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status), flush=True)
"""


def _run(
    tmp_path: Path, program: str, **extra: str
) -> tuple[subprocess.CompletedProcess[str], Path]:
    (tmp_path / "prog.py").write_text(program, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COPYTRACE", "OTEL_"))}
    env.update(COPYTRACE="1", COPYTRACE_OUTPUT="out", OMP_NUM_THREADS="1", **extra)
    proc = subprocess.run([sys.executable, "prog.py"], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=300)  # fmt: skip
    return proc, tmp_path / "out"


def _events(path: Path) -> list[tuple[str, int, int]]:
    """(op, line, bytes_allocated) of each event in one trace file."""
    (run,) = load_trace(path).runs
    return [(e.op, e.line, e.bytes_allocated) for e in run.events]


def test_execv_writes_the_trace_so_far_and_the_new_program_is_traced_too(tmp_path: Path) -> None:
    proc, out = _run(tmp_path, EXECV)
    assert (proc.stdout, proc.returncode) == ("before\nafter\n", 3), proc.stderr
    host = socket.gethostname() or "host"
    names = sorted(p.name for p in out.glob("copytrace-*.otlp.jsonl*"))
    # both from one pid: exec keeps it
    pid = names[-1].removeprefix(f"copytrace-{host}-").removesuffix(".otlp.jsonl.gz")
    assert pid.isdigit(), names
    assert names == [f"copytrace-{host}-{pid}-exec1.otlp.jsonl.gz",
                     f"copytrace-{host}-{pid}.otlp.jsonl.gz"]  # fmt: skip
    # before exec: y = x.clone() (line 4 of the program), 100 float32 = 400 B
    assert _events(out / names[0]) == [("clone", 4, 400)]
    # the new program: a.clone() and a.double() of 10 elements: 40 B and 80 B
    assert _events(out / names[1]) == [("clone", 1, 40), ("double", 1, 80)]
    assert (out / "report.html").is_file()
    assert not list(out.glob(".copytrace-launch-*")), "launch markers left behind"
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("copytrace:")]
    assert any(names[0] in ln for ln in lines), proc.stderr  # the line names the set-aside file


def test_a_fork_child_that_execs_is_done_for_the_root(tmp_path: Path) -> None:
    proc, out = _run(tmp_path, FORK_EXEC)
    assert (proc.stdout, proc.returncode) == ("after\nchild 3\n", 0), proc.stderr
    # the child's trace (empty: it forked after the clone) set aside at its exec; the new
    # program's; the root's: three files, one report over them, the root waited for no one
    files = sorted(out.glob("copytrace-*.otlp.jsonl*"))
    assert len(files) == 3 and sum("-exec1." in f.name for f in files) == 1, files
    assert "without waiting longer" not in proc.stderr, proc.stderr
    assert not list(out.glob(".copytrace-launch-*")), "launch markers left behind"
    html = (out / "report.html").read_text(encoding="utf-8")
    assert all(f.name in html for f in files)


# Whether copytrace's Python hook runs at an audit event that is not os.exec (sys._getframe
# raises one): the program swaps in a probe as _on_audit's code (CPython turns profiling off
# inside audit hooks, so a profile function would not see the call).
CALLS_AT_AN_AUDIT_EVENT = """
import sys, torch
from copytrace.launch import process
y = torch.ones(3).clone()  # tracing has started: the exec hook is in place
process.seen = []
def probe(event, args):
    seen.append(event)  # a global of _on_audit's module once it is _on_audit's code
original, process._on_audit.__code__ = process._on_audit.__code__, probe.__code__
sys._getframe()
process._on_audit.__code__ = original
print("sys._getframe" in process.seen)
"""


@pytest.mark.parametrize("observer", ["native", "python"])
def test_the_hook_calls_python_only_at_os_exec_where_the_observer_is_loaded(
    tmp_path: Path, observer: str
) -> None:
    if observer == "native" and _native.load() is None:
        pytest.skip("C++ observer unavailable here")
    proc, _ = _run(tmp_path, CALLS_AT_AN_AUDIT_EVENT, COPYTRACE_OBSERVER=observer)
    assert proc.returncode == 0, proc.stderr
    # the C hook (_native/audit.cpp) compares the event's name in C; the Python hook kept for
    # the fallback is a Python call at every event
    assert proc.stdout == ("False\n" if observer == "native" else "True\n"), proc.stderr


def test_execv_on_the_fallback_writes_the_trace_so_far(tmp_path: Path) -> None:
    proc, out = _run(tmp_path, EXECV, COPYTRACE_OBSERVER="python")
    assert (proc.stdout, proc.returncode) == ("before\nafter\n", 3), proc.stderr
    names = sorted(p.name for p in out.glob("copytrace-*.otlp.jsonl*"))
    assert len(names) == 2 and "-exec1." in names[0], names
    assert _events(out / names[0]) == [("clone", 4, 400)]  # y = x.clone(): 100 float32


# A wrapper that never imports torch (so no trace, no exec hook) and execs the real program:
# the new program is the launch's root itself (same pid), not a child of it.
WRAPPER_EXEC = f"""
import os, sys
os.execv(sys.executable, [sys.executable, "-c", {AFTER!r}])
"""


def test_a_root_that_execs_before_importing_torch_still_writes_the_report(
    tmp_path: Path,
) -> None:
    proc, out = _run(tmp_path, WRAPPER_EXEC)
    assert (proc.stdout, proc.returncode) == ("after\n", 3), proc.stderr
    (trace,) = out.glob("copytrace-*.otlp.jsonl*")  # the wrapper traced nothing
    # the new program: a.clone() and a.double() of 10 elements: 40 B and 80 B
    assert _events(trace) == [("clone", 1, 40), ("double", 1, 80)]
    assert (out / "report.html").is_file()
    assert not list(out.glob(".copytrace-launch-*")), "launch markers left behind"
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("copytrace:")]
    assert lines == [f"copytrace: trace {trace}; report {out / 'report.html'}"], proc.stderr
