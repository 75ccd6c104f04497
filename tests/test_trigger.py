"""Armed and idle (``COPYTRACE_TRIGGER=signal``): a real training process traces exactly the
steps after ``copytrace trigger``, its stdout unchanged; a program's own handler of the
signal still gets its calls."""

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

from copytrace.tracer._schedule import NONE, RECORD, RECORD_AND_SAVE
from copytrace.tracer._trigger import Windows, arm_file, start_time

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR2"), reason="no SIGUSR2 here")

# One clone per iteration; each optimizer.step() ends a step (auto_step), so iteration i's
# clone is in step i. The program waits after iteration 5's optimizer.step(), i.e. in step 6.
TRAIN = """
import os, sys, time, torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(8, 4)
for i in range(30):
    loss = model(x.clone()).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"iter {i} loss {loss.item():.6f}", flush=True)
    if i == 5:
        print("waiting", flush=True)
        while not os.path.exists(sys.argv[1]):
            time.sleep(0.01)
"""

OWN_HANDLER = """
import os, signal, torch, copytrace
calls = []
signal.signal(signal.SIGUSR2, lambda s, f: calls.append(s))
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with copytrace.trace(os.environ["OUT"], trigger="signal", trigger_steps=3) as t:
    for i in range(10):
        model(torch.ones(2, 4).clone()).sum().backward()
        opt.step()
        if i == 2:
            os.kill(os.getpid(), signal.SIGUSR2)
print("handler calls", len(calls), "windows", t.session.trigger.windows.windows)
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COPYTRACE", "OTEL_"))}
    env.update(extra)
    return env


def _spans(out: Path) -> list[tuple[str, dict]]:
    (path,) = out.glob("*.otlp.jsonl*")
    spans = []
    for line in gzip.open(path, "rt").read().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for span in ss["spans"]:
                    attrs = {a["key"]: a["value"] for a in span["attributes"]}
                    spans.append((span["name"], attrs))
    return spans


def _steps(spans: list[tuple[str, dict]], name: str) -> list[int]:
    return sorted(int(a["copytrace.step"]["intValue"]) for n, a in spans if n == name)


def test_trigger_traces_exactly_the_next_steps(tmp_path):
    prog, go, out = tmp_path / "train.py", tmp_path / "go", tmp_path / "out"
    prog.write_text(TRAIN)
    plain_go = tmp_path / "plain-go"
    plain_go.touch()
    plain = subprocess.run(
        [sys.executable, str(prog), str(plain_go)], capture_output=True, text=True,
        env=_env(), timeout=120,
    )  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, str(prog), str(go)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=_env(COPYTRACE="1", COPYTRACE_TRIGGER="signal", COPYTRACE_OUTPUT=str(out)),
    )  # fmt: skip
    try:
        lines = []
        assert proc.stdout is not None
        while not lines or lines[-1] != "waiting\n":
            lines.append(proc.stdout.readline())
            assert lines[-1], "the program ended early"
        exe = Path(sys.executable).with_name("copytrace")
        trig = subprocess.run(
            [str(exe), "trigger", str(proc.pid)], capture_output=True, text=True, timeout=60
        )
        assert trig.returncode == 0, trig.stderr
        assert f"process {proc.pid}: tracing the next 10 steps -> {out}" in trig.stdout
        time.sleep(0.2)
        go.touch()
        rest, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "".join(lines) + rest == plain.stdout  # the program's output is unchanged
    assert "copytrace: traced steps 7-16" in err
    spans = _spans(out)
    # signalled during step 6: the window opens at the next boundary, steps 7..16
    assert _steps(spans, "copytrace.step") == list(range(7, 17))
    assert _steps(spans, "copytrace.clone") == list(range(7, 17))
    (run,) = [a for n, a in spans if n == "copytrace.run"]
    windows = [v["stringValue"] for v in run["copytrace.windows"]["arrayValue"]["values"]]
    assert windows == ["7-16"]
    assert (out / "report.html").exists()


def test_the_programs_own_handler_is_chained(tmp_path):
    prog = tmp_path / "own.py"
    prog.write_text(OWN_HANDLER)
    proc = subprocess.run(
        [sys.executable, str(prog)], capture_output=True, text=True, timeout=120,
        env=_env(OUT=str(tmp_path / "out"), COPYTRACE_REPORT="0"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    # the signal arrives in step 3 (after the third optimizer.step, iteration i's clone is
    # in step i): the window opens at the next boundary, steps 4..6
    assert "handler calls 1 windows [(4, 7)]" in proc.stdout
    assert _steps(_spans(tmp_path / "out"), "copytrace.clone") == [4, 5, 6]


def test_an_ignored_signal_is_the_programs(tmp_path):
    code = (
        "import signal, torch, copytrace\n"
        "signal.signal(signal.SIGUSR2, signal.SIG_IGN)\n"
        "with copytrace.trace(write=False, trigger='signal') as t:\n"
        "    assert not t.session.trigger.installed\n"
        "assert signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("the program handles SIGUSR2 itself") == 1


def test_a_c_handler_on_the_ring_signal_is_the_programs(tmp_path):
    # faulthandler.register sets a C handler that getsignal does not see (it answers SIG_DFL):
    # copytrace reads the C-level action and leaves the signal to it; faulthandler still
    # prints the stacks on SIGUSR1, the process lives on, and no ring is written
    code = (
        "import faulthandler, os, signal, time, torch, copytrace\n"
        "faulthandler.register(signal.SIGUSR1, chain=False)\n"
        "assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL\n"
        f"with copytrace.trace({str(tmp_path / 'out')!r}, ring=4) as t:\n"
        "    assert not t.session._ring_signal.installed\n"
        "    torch.ones(2).clone()\n"
        "    os.kill(os.getpid(), signal.SIGUSR1)\n"
        "    time.sleep(0.2)\n"
        "    torch.ones(2).clone()\n"
        "print('alive', flush=True)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "alive\n"
    assert proc.stderr.count("the program handles SIGUSR1 itself") == 1
    assert proc.stderr.count("Current thread") == 1  # faulthandler's dump, once
    assert len(list((tmp_path / "out").glob("*.otlp.jsonl*"))) == 1  # the end only


def test_trigger_refuses_a_process_that_is_not_armed():
    exe = Path(sys.executable).with_name("copytrace")
    proc = subprocess.run(
        [str(exe), "trigger", str(os.getpid())], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"copytrace: error: process {os.getpid()} is not armed by copytrace (start it with "
        "COPYTRACE=1 COPYTRACE_TRIGGER=signal, or copytrace.trace(trigger='signal'))"
    ]


def test_windows_queue_one_after_another():
    w = Windows(3)
    assert [w(s) for s in range(3)] == [NONE] * 3
    assert w.open(5) == (5, 8)
    assert w.open(6) == (8, 11)  # a second signal mid-window: the next one starts after it
    assert w.windows == [(5, 8), (8, 11)]
    assert [w(s) for s in range(4, 12)] == [
        NONE, RECORD, RECORD, RECORD_AND_SAVE, RECORD, RECORD, RECORD_AND_SAVE, NONE,
    ]  # fmt: skip


@pytest.mark.skipif(start_time(os.getpid()) is None, reason="no /proc here")
def test_an_arm_file_left_by_a_killed_process_is_not_taken_for_a_new_one():
    # a process that reuses the pid of an armed process that was killed (its arm file left
    # behind) is not signalled: SIGUSR2's default action would kill it
    proc = subprocess.Popen(["sleep", "60"])
    arm = arm_file(proc.pid)
    try:
        arm.parent.mkdir(parents=True, exist_ok=True)
        stale = {"pid": proc.pid, "start": start_time(proc.pid) - 1, "signal": "SIGUSR2",
                 "steps": 10, "trace": None, "output_dir": "out", "launch": None}  # fmt: skip
        arm.write_text(json.dumps(stale))
        exe = Path(sys.executable).with_name("copytrace")
        trig = subprocess.run(
            [str(exe), "trigger", str(proc.pid)], capture_output=True, text=True, timeout=60
        )
        assert trig.returncode == 2
        assert f"process {proc.pid} is not armed by copytrace" in trig.stderr
        assert proc.poll() is None  # not signalled
    finally:
        arm.unlink(missing_ok=True)
        proc.kill()
        proc.wait()


def test_idle_steps_are_counted_in_c_and_the_signal_wakes_the_session():
    # armed and idle, each optimizer.step() is counted by the C++ observer's step callback
    # alone: the session's Python hook is not called, so its own step number stays 0 until
    # something reads the count back
    import copytrace

    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(2, 4)
    with copytrace.trace(write=False, trigger="signal", trigger_steps=2) as t:
        session = t.session
        if session._step_native is None:
            pytest.skip("no C++ observer: the Python path counts no untraced optimizer steps")
        for _ in range(5):
            model(x).sum().backward()
            opt.step()
        assert session._idle.on
        assert session._rec.step_index == 0
        assert t.stats["steps"] == 6  # steps 0-5: the 5 counted in C, read back
        os.kill(os.getpid(), signal.SIGUSR2)
        for _ in range(500):  # the Python handler runs at the next bytecode boundary
            if not session._idle.on:
                break
            time.sleep(0.001)
        assert not session._idle.on
        model(x.clone()).sum().backward()
        opt.step()  # step 5 ends: the window opens with step 6
        assert session.trigger.windows.windows == [(6, 8)]
        model(x.clone()).sum().backward()
        opt.step()
        assert session._engagement.engaged  # step 7, the window's last, is traced
        model(x.clone()).sum().backward()
        opt.step()  # step 7 ends the window: everything is taken off again
        assert not session._engagement.engaged
        assert t.stats["steps_traced"] == 2


def test_explicit_steps_while_idle_are_counted():
    import copytrace

    with copytrace.trace(write=False, trigger="signal") as t:
        assert t.step() == 1  # the first explicit step turns the automatic one off
        assert t.session._idle.on
        assert [t.step() for _ in range(3)] == [2, 3, 4]
        assert t.stats["steps"] == 5


class _Outer:
    """An optimizer that steps another (as ZeroRedundancyOptimizer steps its local one): two
    nested ``Optimizer.step#`` scopes and two ``_optimizer_step_code`` calls per step."""

    @staticmethod
    def make(params):
        import torch

        class Outer(torch.optim.Optimizer):
            def __init__(self, params):
                params = list(params)
                super().__init__(params, {})
                self.inner = torch.optim.SGD(params, lr=0.1)

            def step(self, closure=None):
                return self.inner.step(closure)

        return Outer(params)


def test_idle_counts_at_torchs_step_hook_point_and_gives_it_back():
    # armed and idle, the steps are counted at Optimizer._optimizer_step_code (torch's
    # profiler hook point) with the RecordFunction callback off: same function object, name,
    # signature, file and first line; torch's own code again after stop; an optimizer that
    # steps another counts once per outer step, as the record scopes are counted
    import inspect

    import copytrace

    torch = pytest.importorskip("torch")
    fn = torch.optim.Optimizer._optimizer_step_code
    original = fn.__code__
    signature = inspect.signature(fn)
    model = torch.nn.Linear(4, 4)
    opt = _Outer.make(model.parameters())
    x = torch.ones(2, 4)
    with copytrace.trace(write=False, trigger="signal") as t:
        if t.session._step_native is None:
            pytest.skip("no C++ observer: the Python path counts no untraced optimizer steps")
        ours = fn.__code__
        assert torch.optim.Optimizer._optimizer_step_code is fn
        assert ours is not original and inspect.signature(fn) == signature
        assert (ours.co_name, ours.co_qualname, ours.co_filename, ours.co_firstlineno) == (
            original.co_name, original.co_qualname, original.co_filename,
            original.co_firstlineno,
        )  # fmt: skip
        assert fn.__doc__.startswith("Entry point for `torch.profile.profiler`")
        for _ in range(4):
            model(x).sum().backward()
            opt.step()
        assert t.session._idle.on
        assert t.stats["steps"] == 5  # steps 0-4: four ended by the outer optimizer's step()
    assert fn.__code__ is original


def test_a_signal_inside_a_step_ends_that_step_at_its_boundary():
    # the signal lands inside step 2's optimizer.step() (its record scope began with no
    # callback, while idle): that step still ends there, so the window is steps 3-4, and each
    # traced step has its boundary (no step lost, none counted twice)
    import copytrace

    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(2, 4)
    calls = []

    def signal_in_step_2(optimizer, args, kwargs):
        calls.append(1)
        if len(calls) == 3:  # inside step 2 (0-based): the handler runs before step() returns
            os.kill(os.getpid(), signal.SIGUSR2)

    opt.register_step_pre_hook(signal_in_step_2)
    with copytrace.trace(write=False, trigger="signal", trigger_steps=2) as t:
        if t.session._step_native is None:
            pytest.skip("no C++ observer")
        for _ in range(7):
            model(x.clone()).sum().backward()
            opt.step()
        assert t.session.trigger.windows.windows == [(3, 5)]
        assert t.stats["steps"] == 8  # steps 0-6 ended, step 7 open
        assert t.stats["steps_traced"] == 2


def test_a_compiled_optimizer_step_counts_and_compiles_as_untraced():
    # torch.compile ignores the Optimizer.step# record scope, so an armed session counts no
    # compiled step (as before the step code); the code's branch is dead under dynamo
    # (torch.compiler.is_compiling): the same graphs, calls and graph breaks as untraced, no
    # recompile while armed nor after stop
    import copytrace

    torch = pytest.importorskip("torch")
    from torch._dynamo.utils import counters

    def run(armed: bool) -> tuple[dict, int]:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = torch.compile(opt.step, backend="eager")
        x = torch.ones(2, 4)
        steps = -1
        if armed:
            with copytrace.trace(write=False, trigger="signal") as t:
                for _ in range(3):
                    model(x).sum().backward()
                    step()
                steps = t.stats["steps"]
        for _ in range(3 if armed else 6):
            model(x).sum().backward()
            step()
        seen = {
            "graphs": counters["stats"]["unique_graphs"],
            "calls": counters["stats"]["calls_captured"],
            "breaks": sum(counters["graph_break"].values()),
            "recompiles": sum(counters["recompiles"].values()),
        }
        return seen, steps

    untraced, _ = run(False)
    armed, steps = run(True)
    torch._dynamo.reset()
    assert armed == untraced
    assert untraced["graphs"] >= 1 and untraced["recompiles"] == 0
    assert steps == 1  # only the open step 0: no compiled step counted


# An armed program that waits, in step 0, for its window to open; then traces it and ends.
ARMED_AND_WAITING = """
import sys, time, torch, copytrace
with copytrace.trace(write=False, trigger="signal", trigger_steps=2) as t:
    print("armed", flush=True)
    deadline = time.monotonic() + 60
    while not t.session.trigger.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    for _ in range(3):
        torch.ones(2).clone()
        t.step()
print("windows", t.session.trigger.windows.windows, flush=True)
"""

#: what ``copytrace trigger`` must not import: it only reads arm files and sends a signal
HEAVY = ("torch", "numpy", "pandas", "pyarrow", "duckdb", "opentelemetry", "jinja2", "libcst")


def test_trigger_imports_nothing_heavy_and_signals_a_real_armed_process(tmp_path):
    prog = tmp_path / "armed.py"
    prog.write_text(ARMED_AND_WAITING)
    proc = subprocess.Popen(
        [sys.executable, str(prog)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=_env(), cwd=tmp_path,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "armed\n", proc.stderr.read() if proc.stderr else ""
        exe = Path(sys.executable).with_name("copytrace")
        trig = subprocess.run(
            [str(exe), "trigger", str(proc.pid)], capture_output=True, text=True, timeout=60,
            env={**_env(), "PYTHONPROFILEIMPORTTIME": "1"},
        )  # fmt: skip
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert trig.returncode == 0, trig.stderr
    # no arm-file trace path (write=False): the output directory is printed, resolved
    where = (tmp_path / "copytrace-out").resolve()
    assert trig.stdout == f"process {proc.pid}: tracing the next 2 steps -> {where}\n"
    # -X importtime lines: "import time: self | cumulative | <indent>name"
    imported = {
        line.rsplit("|", 1)[1].strip()
        for line in trig.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    assert "copytrace.cli.trigger" in imported  # the import profile is really there
    assert {m.split(".")[0] for m in imported} & set(HEAVY) == set()
    assert proc.returncode == 0, err
    # signalled in step 0 (before the first t.step()); the window opens at the next
    # boundary: steps 1..2, i.e. (1, 3)
    assert rest == "windows [(1, 3)]\n"


def test_a_wait_for_the_window_reports_while_one_starts_joins_it_once_started(
    tmp_path, monkeypatch
):
    # the window's report is started on the export thread while Trace.stop (or atexit) may
    # already wait for the reports on the main thread: here the wait runs right when the
    # report's thread is being started (on a loaded machine it did: "cannot join thread
    # before it is started", from the atexit wait)
    import threading

    import _tracegen

    from copytrace import _trace

    errors: list[BaseException] = []

    def wait() -> None:
        try:
            _trace._wait_for_window_reports()
        except BaseException as err:  # noqa: BLE001 - reported by the assertion below
            errors.append(err)

    waiters: list[threading.Thread] = []

    class WaitedForAtItsStart(_trace.OsThread):
        def start(self):
            wait()  # on this thread, inside the start
            waiters.append(threading.Thread(target=wait))  # and on another one
            waiters[0].start()
            return super().start()

    # only the report's thread, as _trace makes it (no other thread of the process)
    monkeypatch.setattr(_trace, "OsThread", WaitedForAtItsStart)
    monkeypatch.delenv("COPYTRACE_REPORT", raising=False)
    path = _tracegen.write_trace(tmp_path)
    _trace._window_report(path, (3, 5))
    waiters[0].join()  # it waited for the report: listed once started, not missed
    assert errors == [] and _trace._WINDOW_REPORTS == []
    assert (tmp_path / "report.html").is_file()
