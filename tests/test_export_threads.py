"""copytrace's worker threads (``copytrace/export/_osthread.py``): bare OS threads that the
program's ``threading`` module never lists, hooks or reports on."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from copytrace.export._osthread import OsThread, tidy


def test_an_error_on_the_thread_is_handed_over_not_reported_to_the_program(monkeypatch):
    hooks: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda args: hooks.append("unraisable"))
    monkeypatch.setattr(threading, "excepthook", lambda args: hooks.append("excepthook"))
    errors: list[BaseException] = []
    gate = threading.Event()
    listed = []

    def work() -> None:
        gate.wait()
        ident = threading.get_ident()
        listed.append(
            (ident in sys._current_frames(), ident in {t.ident for t in threading.enumerate()})
        )
        raise SystemExit(3)  # a BaseException too

    worker = OsThread(work, "test-worker", errors.append)
    assert not worker.is_alive()
    assert worker.start()
    assert worker.is_alive()  # until the target returns
    gate.set()
    worker.join()
    assert not worker.is_alive()
    assert listed == [(True, False)]  # running Python code, not listed by threading
    assert [type(e) for e in errors] == [SystemExit] and errors[0].code == 3
    assert hooks == []


def test_tidy_takes_out_the_dummy_thread_current_thread_made():
    # threading.current_thread() on a thread threading did not start (logging's records call
    # it) lists a _DummyThread for good; tidy() takes this thread's out
    seen: list[tuple[bool, bool]] = []

    def work() -> None:
        ident = threading.get_ident()
        threading.current_thread()
        made = ident in {t.ident for t in threading.enumerate()}
        tidy()
        seen.append((made, ident in {t.ident for t in threading.enumerate()}))

    count = threading.active_count()
    worker = OsThread(work, "test-worker", lambda err: seen.append(err))  # type: ignore[arg-type]
    assert worker.start()
    worker.join()
    assert seen == [(True, False)]
    assert threading.active_count() == count


@pytest.mark.skipif(not hasattr(threading, "settrace_all_threads"), reason="Python 3.12+")
def test_a_hook_set_on_every_thread_is_taken_off_at_the_next_wake():
    calls: list[str] = []
    wake, done = threading.Event(), threading.Event()

    def hook(frame, event, arg):  # type: ignore[no-untyped-def]
        calls.append(frame.f_code.co_filename)

    def work() -> None:
        wake.wait()
        tidy()
        sum(range(3))
        calls_after.extend(calls)
        done.set()

    calls_after: list[str] = []
    worker = OsThread(work, "test-worker", lambda err: None)
    assert worker.start()
    threading.settrace_all_threads(hook)  # type: ignore[attr-defined]
    try:
        wake.set()
        done.wait()
    finally:
        threading.settrace_all_threads(None)  # type: ignore[attr-defined]
    worker.join()
    assert __file__ not in calls_after


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork")
def test_in_a_forked_child_the_parents_thread_is_not_alive():
    gate = threading.Event()
    worker = OsThread(gate.wait, "test-worker", lambda err: None)
    assert worker.start()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no such thread here; join returns at once
        worker.join()
        os.write(write, b"alive" if worker.is_alive() else b"gone")
        os._exit(0)
    os.close(write)
    answer = os.read(read, 16)
    os.close(read)
    os.waitpid(pid, 0)
    assert worker.is_alive()  # the parent's still waits
    gate.set()
    worker.join()
    assert (answer, worker.is_alive()) == (b"gone", False)


def test_a_windows_report_is_written_on_a_thread_the_program_does_not_see(tmp_path, capsys):
    # the report of a triggered window (copytrace/_trace.py _window_report) is written on a
    # bare thread: a threading.settrace hook the program set sees none of the dashboards' code
    import torch

    import copytrace
    from copytrace import _trace

    with copytrace.trace(tmp_path) as t:
        torch.ones(2).clone()
    seen: set[str] = set()
    threading.settrace(lambda frame, event, arg: seen.add(frame.f_code.co_filename))
    try:
        count = threading.active_count()
        _trace._window_report(t.trace_path, (0, 1))
        (worker,) = _trace._WINDOW_REPORTS
        assert threading.active_count() == count
        assert worker.ident not in {th.ident for th in threading.enumerate()}
        _trace._wait_for_window_reports()
    finally:
        threading.settrace(None)  # type: ignore[arg-type]
    assert not worker.is_alive() and _trace._WINDOW_REPORTS == []
    assert (tmp_path / "report.html").is_file()
    assert "copytrace: report of steps 0-0: " in capsys.readouterr().err
    assert seen == set()
