"""copytrace's touches on the process around the program: fork callbacks, signal handlers,
threads and storages' weak handles; one test each (``docs/observer-effects.md`` names them).

Each test compares what the program itself can read, traced and untraced: a forked child's
output and exit status, ``signal.getsignal`` and which handler gets the call,
``threading.enumerate()``, ``weakref.getweakrefcount`` of a storage.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

import copytrace

_FORK_PROGRAM = textwrap.dedent(
    """
    import os, sys
    import torch

    how, out = sys.argv[1], sys.argv[2]


    def work(tag):
        w = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
        y = w.to(torch.float64).clone()
        y.sum().backward()
        print(tag, y.tolist(), w.grad.tolist(), flush=True)


    def run(exit_how):
        work("parent before")
        pid = os.fork()
        if pid == 0:
            work("child")
            if exit_how == "_exit":
                os._exit(3)
            sys.exit(5)  # through the with block (the trace's stop, in the child) and atexit
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status), flush=True)
        work("parent after")


    def run_both():
        for exit_how in ("_exit", "exit"):
            run(exit_how)


    if how == "api":
        import copytrace

        with copytrace.trace(out):
            run_both()
    else:  # untraced, or traced by the start-up hook (COPYTRACE=1)
        run_both()
    print("parent done", flush=True)
    """
)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COPYTRACE", "OTEL_"))}
    env.update(extra)
    return env


def _runner(tmp_path: Path, name: str, text: str) -> tuple[Any, Path]:
    """``run(mode, **env)``: the program ``text`` (written to ``name``) run with ``mode`` and
    the output folder as its arguments, in a clean environment plus ``env``; and that folder."""
    prog = tmp_path / name
    prog.write_text(text)
    out = tmp_path / "out"

    def run(mode: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(prog), mode, str(out)], capture_output=True, text=True,
            env=_clean_env(**env), timeout=300, cwd=tmp_path,
        )  # fmt: skip

    return run, out


def _trace_lines(path: Path) -> list[dict]:
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork")
@pytest.mark.parametrize("how", ["api", "launch"])
def test_a_forked_child_behaves_as_untraced(how, tmp_path):
    # copytrace registers os.register_at_fork callbacks (tracer/_process.py: the child drops
    # the parent's export; launch/process.py: under COPYTRACE=1 the child traces on its own)
    run, out = _runner(tmp_path, "fork.py", _FORK_PROGRAM)
    plain = run("plain")
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.count("child [") == 2  # each child ran its work once
    assert "child exit 3" in plain.stdout and "child exit 5" in plain.stdout
    if how == "api":
        traced = run("api")
    else:
        traced = run("plain", COPYTRACE="1", COPYTRACE_OUTPUT=str(out), COPYTRACE_REPORT="0")
    ours = [ln for ln in traced.stderr.splitlines() if ln.startswith("copytrace: ")]
    program_err = [ln for ln in traced.stderr.splitlines() if not ln.startswith("copytrace: ")]
    assert (traced.returncode, traced.stdout, program_err) == (0, plain.stdout, [])
    # the launch names the files it wrote: the parent's, and the child's that exited through
    # atexit (a child of os.fork traces on its own; os._exit runs no atexit: no file)
    assert all(ln.startswith("copytrace: trace ") for ln in ours)
    assert len(ours) == (0 if how == "api" else 2)
    files = sorted(out.glob("copytrace-*.otlp.jsonl*"))
    if how == "api":
        # the parent's trace only: a child never writes into it, nor a trace of its own
        assert [f.name.rsplit("-", 1)[1].split(".")[0] for f in files] == [
            str(_parent_pid(files[0]))
        ]
    # every file whole: each line one OTLP/JSON object (no child's bytes inside a line)
    assert files and all(_trace_lines(f) for f in files)


def _parent_pid(path: Path) -> int:
    for line in _trace_lines(path):
        for rs in line.get("resourceSpans", []):
            for attr in rs["resource"]["attributes"]:
                if attr["key"] == "process.pid":
                    return int(attr["value"]["intValue"])
    raise AssertionError(f"no process.pid in {path}")


# --- signal handlers -------------------------------------------------------------------------
needs_main = pytest.mark.skipif(
    not hasattr(signal, "SIGTERM") or threading.current_thread() is not threading.main_thread(),
    reason="no SIGTERM, or not the main thread (copytrace takes signals from the main thread)",
)


def _all_handlers() -> dict[int, object]:
    out = {}
    for s in signal.valid_signals():
        try:
            out[s] = signal.getsignal(s)
        except (ValueError, OSError):  # not a signal Python can read here
            continue
    return out


@needs_main
def test_the_program_sigterm_handler_set_before_is_kept_and_called():
    calls = []

    def mine(signum, frame):
        calls.append(signum)

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        with copytrace.trace(write=False):
            during = signal.getsignal(signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # handled between two bytecodes, here
            torch.ones(2).clone()
        after = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert during is mine and after is mine
    assert calls == [signal.SIGTERM]


@needs_main
def test_the_program_sigterm_handler_set_while_tracing_is_kept_and_called():
    calls = []

    def mine(signum, frame):
        calls.append(signum)

    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    try:
        with copytrace.trace(write=False):
            ours = signal.getsignal(signal.SIGTERM)  # copytrace's (docs/observer-effects.md)
            signal.signal(signal.SIGTERM, mine)
            during = signal.getsignal(signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            torch.ones(2).clone()
        after = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert ours is not signal.SIG_DFL and ours.__module__ == "copytrace.tracer._process"
    assert during is mine and after is mine  # stop() leaves the program's handler in place
    assert calls == [signal.SIGTERM]


@needs_main
def test_without_ring_or_trigger_only_an_unhandled_sigterm_is_taken_and_given_back():
    before = _all_handlers()
    with copytrace.trace(write=False):
        during = _all_handlers()
    after = _all_handlers()
    assert after == before
    changed = sorted(s for s in before if during[s] is not before[s])
    assert changed == [signal.SIGTERM]  # the one taken: SIG_DFL before (pytest leaves it)


_C_HANDLER_PROGRAM = textwrap.dedent(
    """
    import faulthandler, os, signal, sys, time
    import torch
    import copytrace

    # a C-level handler (sigaction): Python's table of handlers, which getsignal reads,
    # keeps answering SIG_DFL over it
    faulthandler.register(signal.SIGTERM, chain=False)
    print("before", int(signal.getsignal(signal.SIGTERM)), flush=True)
    with copytrace.trace(sys.argv[1], write=sys.argv[1] != "-"):
        torch.ones(3).clone()
        os.kill(os.getpid(), signal.SIGTERM)  # faulthandler prints the stacks and returns
        time.sleep(0.2)
        print("alive while tracing", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)
    print("alive after", flush=True)
    """
)


def test_a_c_sigterm_handler_the_program_set_is_kept(tmp_path):
    """``faulthandler.register(SIGTERM)`` sets a C handler that ``getsignal`` does not see (it
    answers SIG_DFL, the first line): copytrace reads the C-level action and leaves it, so the
    program survives both signals and faulthandler prints its stacks twice, as untraced."""
    script = tmp_path / "c_handler.py"
    script.write_text(_C_HANDLER_PROGRAM)
    runs = {}
    for how, out in (("untraced", "-"), ("traced", str(tmp_path / "out"))):
        env = {k: v for k, v in os.environ.items() if not k.startswith("COPYTRACE")}
        runs[how] = subprocess.run(
            [sys.executable, str(script), out],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    untraced, traced = runs["untraced"], runs["traced"]
    assert untraced.returncode == 0, untraced.stderr
    assert traced.returncode == untraced.returncode, traced.stderr
    lines = ["before 0", "alive while tracing", "alive after"]
    assert untraced.stdout.splitlines() == lines
    assert traced.stdout.splitlines() == lines
    dumps = "Current thread"
    assert untraced.stderr.count(dumps) == 2
    assert traced.stderr.count(dumps) == 2


# --- threads ---------------------------------------------------------------------------------
def _threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate())


def test_export_threads_are_invisible_while_a_trace_writes(tmp_path):
    # the export and gzip threads are bare OS threads (export/_osthread.py): running, with
    # Python frames (sys._current_frames() lists them), but in no table of the threading module
    before, count = _threads(), threading.active_count()
    with copytrace.trace(tmp_path, compression="gzip", flush_events=1) as t:
        for _ in range(3):
            torch.ones(2).clone()
            t.step()  # a flush: the export thread writes, the gzip thread starts
        file = t.session._file_sink.file
        pipeline = t.session._pipeline

        def running() -> bool:  # both started and in Python code
            frames = sys._current_frames()
            return all(
                w is not None and w.ident in frames for w in (pipeline._thread, file._thread)
            )

        deadline = time.monotonic() + 120  # a bound on a wait, not a timing assertion
        while not running() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert running()
        workers = [pipeline._thread, file._thread]
        assert all(w.is_alive() for w in workers)
        listed = {th.ident for th in threading.enumerate()}
        assert not listed & {w.ident for w in workers}
        assert (_threads(), threading.active_count()) == (before, count)
    assert (_threads(), threading.active_count()) == (before, count)
    assert not any(w.is_alive() for w in workers)
    with copytrace.trace(write=False):  # nothing written: no thread at all
        torch.ones(2).clone()
        assert _threads() == before


_HOOKS_PROGRAM = textwrap.dedent(
    """
    import os, sys, threading

    seen = set()


    def hook(frame, event, arg):  # coverage.py's and profilers' way into every thread
        seen.add(os.path.relpath(frame.f_code.co_filename))


    threading.settrace(hook)
    threading.setprofile(hook)
    import torch

    how, out = sys.argv[1], sys.argv[2]


    def look(tag):
        worker = threading.Thread(target=lambda: sum(range(10)), name="worker")
        worker.start()
        worker.join()
        names = sorted(t.name for t in threading.enumerate())
        print(tag, threading.active_count(), names, flush=True)


    def train(steps):
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(steps):
            model(torch.ones(1, 2)).sum().backward()
            opt.step()  # a step boundary: a flush (one event a flush)
            torch.ones(2).clone()
        look("while")


    look("before")
    if how == "api":
        import copytrace

        with copytrace.trace(out, compression="gzip", flush_events=1):
            train(4)
    else:  # untraced, or traced by the start-up hook (COPYTRACE=1)
        train(4)
    look("after")
    print(sorted(seen), flush=True)
    """
)


@pytest.mark.parametrize("how", ["api", "launch"])
def test_thread_hooks_and_counts_read_as_untraced(how, tmp_path):
    # threading.settrace/setprofile set before tracing reach every threading.Thread started
    # after (Thread._bootstrap_inner installs them): before, copytrace's export and gzip
    # threads ran the program's hook on copytrace's own code (pipeline.py, file_sink.py,
    # threading.py's frames of two more threads) and were listed while tracing
    run, out = _runner(tmp_path, "hooks.py", _HOOKS_PROGRAM)
    plain = run("plain")
    assert plain.returncode == 0, plain.stderr
    lines = plain.stdout.splitlines()
    assert lines[:3] == [f"{tag} 1 ['MainThread']" for tag in ("before", "while", "after")]
    assert "hooks.py" in lines[3]  # the worker's frames reached the hook
    if how == "api":
        traced = run("api")
    else:
        env = dict(COPYTRACE_OUTPUT=str(out), COPYTRACE_REPORT="0", COPYTRACE_FLUSH_EVENTS="1")
        traced = run("plain", COPYTRACE="1", **env)
    assert (traced.returncode, traced.stdout) == (0, plain.stdout), traced.stderr
    # the trace was written off the program's thread, compressed: both threads ran
    files = sorted(out.glob("copytrace-*.otlp.jsonl.gz"))
    assert len(files) == 1 and _trace_lines(files[0])


_BARE_THREAD_PROGRAM = textwrap.dedent(
    """
    import _thread, copy, sys, threading, time
    import torch

    how = sys.argv[1]
    names = set()


    def program():
        x = torch.randn(4, 4, requires_grad=True)
        y = x.clone()
        x.detach(), x.to(torch.float64), copy.deepcopy(torch.ones(3))
        torch.nn.Linear(2, 2).load_state_dict(torch.nn.Linear(2, 2).state_dict())
        (y * 2).sum().backward()


    def on_a_bare_thread(work):
        done = _thread.allocate_lock()
        done.acquire()
        box = []

        def run():
            try:
                box.append((work(), threading.get_native_id()))
            except BaseException as err:
                box.append((err, None))
            finally:
                done.release()

        _thread.start_new_thread(run, ())
        done.acquire()
        while _thread._count():  # the thread's state gone: no Python left on it
            time.sleep(0.01)
        result, native = box[0]
        if isinstance(result, BaseException):
            raise result
        return native


    def traced_on_the_thread():  # the trace started and stopped there, copytrace imported there
        if how == "plain":
            return program()
        import copytrace

        with copytrace.trace(write=False) as t:
            program()
        names.update(e.thread_name for e in t.events)


    native = on_a_bare_thread(traced_on_the_thread)
    if how == "plain":
        on_a_bare_thread(program)
    else:  # traced from the main thread: the bare thread's backward is recorded
        import copytrace

        with copytrace.trace(write=False) as t:
            native2 = on_a_bare_thread(program)
        names.update(e.thread_name + "*" for e in t.events if e.phase == "backward")
    listed = sorted((type(v).__name__, k == threading.get_ident()) for k, v in threading._active.items())
    print(listed, threading.active_count(), len(threading.enumerate()), threading.Thread().name)
    if how != "plain":
        want = {f"os-thread-{native}", f"os-thread-{native2}*"}  # the OS may reuse an id
        print(names == want, sorted(names))
    """
)


def test_a_bare_thread_of_the_program_stays_out_of_threading_s_tables(tmp_path):
    # threading.current_thread() on a thread threading did not start lists a _DummyThread for
    # good and takes a number from the counter that names Thread-N. Before, the recorder (each
    # event's thread name), trace start (the main-thread check before SIGTERM's handler) and
    # psutil's import (under the OpenTelemetry SDK's, imported at the first trace) called it
    # on a program's _thread.start_new_thread thread: a second entry, "Thread-2" after.
    run, _ = _runner(tmp_path, "bare.py", _BARE_THREAD_PROGRAM)
    plain = run("plain")
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.splitlines() == ["[('_MainThread', True)] 1 1 Thread-1"]
    traced = run("traced")
    assert traced.returncode == 0, traced.stderr
    lines = traced.stdout.splitlines()
    assert lines[0] == plain.stdout.splitlines()[0]
    # named from the OS thread id: the events of the first thread, the second's backward (*)
    assert lines[1].startswith("True "), lines[1]


# --- weak handles on storages ----------------------------------------------------------------
def _storage_program() -> tuple[list[int], list[int]]:
    """Copies, a state_dict() handover, a .data alias written and a rebinding: the weak
    reference counts of every storage involved, and the strong counts of two."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    w = torch.nn.Parameter(torch.randn(3))
    y = w.clone().to(torch.float64)
    state = model.state_dict()
    model.load_state_dict(state)
    loss = (w * w).sum()
    alias = w.data
    alias.mul_(2.0)
    w.data = torch.ones(3)
    tensors = [w, y, alias, *model.parameters(), *state.values()]
    counts = [weakref.getweakrefcount(x.untyped_storage()) for x in tensors]
    uses = [torch._C._storage_Use_Count(x.untyped_storage()._cdata) for x in (y, w, alias)]
    loss.backward()
    return counts, uses


@pytest.mark.parametrize("observer", ["native", "python"])
def test_no_python_weakref_on_the_program_storages(observer, monkeypatch):
    # copytrace follows storages (trace ids, state_dict() handovers, pending .data writes and
    # rebindings) by torch's own weak handle on the StorageImpl (tracer/_storage_ref.py),
    # which neither weakref.getweakrefcount nor torch._C._storage_Use_Count counts
    monkeypatch.setenv("COPYTRACE_OBSERVER", observer)
    plain = _storage_program()
    for level in ("lean", "full"):
        with copytrace.trace(write=False, level=level) as t:
            traced = _storage_program()
            t.step()
        assert traced == plain
        assert t.stats["errors"] == 0
    assert set(plain[0]) == {0}
