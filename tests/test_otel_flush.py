"""Hot path vs export: periodic flushes keep memory bounded, the buffer cap drops and counts,
schedules (API, torch.profiler, environment) engage the modes only in traced steps."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.nn as nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import copytrace
from copytrace._trace import Schedule, Trace
from copytrace.dashboards import load_trace
from copytrace.tracer import _native

_UNPATCHED_DEEPCOPY = copy.deepcopy  # copytrace patches it process-wide while engaged


def _engaged() -> bool:
    """Whether any of copytrace's observers is in place: a Python mode on torch's stacks (level
    full, the fallback), or the C++ observer's kernels (every native level)."""
    if _get_current_function_mode_stack() or _get_current_dispatch_mode_stack():
        return True
    native = _native.load() if _native.choice() != "python" else None
    return bool(native is not None and native.enabled())


def _run(path):
    data = load_trace(path)
    assert data.bad_lines == 0
    (run,) = data.runs
    return run


def test_periodic_flush_bounds_the_buffer_and_keeps_every_event(tmp_path):
    x = torch.ones(4)
    lin = nn.Linear(2, 2)
    with copytrace.trace(tmp_path, flush_events=20) as t:
        for _ in range(100):
            x.clone()
            copy.deepcopy(lin)  # a group and its 2 children
            assert len(t.session._rec.events) <= 20 + 4  # never more than one step over the threshold
            t.step()
        x.clone()
    stats = t.stats
    assert stats["events"] == 401 and stats["flushes"] >= 15
    assert len(t.events) < 401  # the rest is in the file only
    run = _run(t.trace_path)
    assert run.attrs["copytrace.events"] == 401 and len(run.events) == 401
    assert len(run.steps) == 101
    step_of = {s.span_id: s.step for s in run.steps}
    by_id = {e.span_id: e for e in run.events}
    groups = [e for e in run.events if e.is_group]
    assert len(groups) == 100
    for g in groups:  # each group under its own step, with its own two children
        kids = [e for e in run.events if e.parent_id == g.span_id]
        assert len(kids) == 2
        assert step_of[g.parent_id] == g.attrs["copytrace.step"]
        assert all(k.attrs["copytrace.step"] == g.attrs["copytrace.step"] for k in kids)
    assert all(e.parent_id in by_id or e.parent_id in step_of for e in run.events)
    # seq numbers stay run-wide across flushes, groups before their children
    seqs = [e.seq for e in t.events]
    assert seqs == sorted(seqs) and seqs[-1] == 400


def test_facts_found_after_a_flush_still_reach_the_file(tmp_path):
    """A ``state_dict()`` alias is found stale steps later: it is held back, not lost."""
    model = nn.Linear(3, 3)
    with copytrace.trace(tmp_path, flush_events=1) as t:
        kept = model.state_dict()  # noqa: F841 - its aliases stay alive
        t.step()
        torch.ones(2).clone()
        t.step()  # flushed here, the snapshot still watched
        with torch.no_grad():
            model.weight.add_(1)
        t.step()
        torch.ones(2).clone()
    assert t.stats["flushes"] >= 2
    run = _run(t.trace_path)
    snaps = [e for e in run.events if e.attrs.get("copytrace.snapshot")]
    assert len(snaps) == 2
    assert [e.attrs.get("copytrace.stale", False) for e in snaps].count(True) == 1
    assert all(e.attrs["copytrace.step"] == 0 for e in snaps)


def test_buffer_cap_drops_and_reports(tmp_path, capsys):
    x = torch.ones(2)
    with copytrace.trace(tmp_path, max_events=5, flush_events=0) as t:
        for _ in range(20):
            x.clone()
    assert t.stats["dropped"] == 15 and t.stats["events"] == 5
    assert "15 event(s) dropped" in capsys.readouterr().err
    run = _run(t.trace_path)
    assert run.attrs["copytrace.events_dropped"] == 15 and len(run.events) == 5
    # the cap is per flush window: with steps and flushes nothing is dropped
    with copytrace.trace(tmp_path / "flushed", max_events=5, flush_events=3) as t:
        for _ in range(20):
            x.clone()
            t.step()
    assert t.stats["dropped"] == 0 and len(_run(t.trace_path).events) == 20


def _scheduled_program(t, steps=12):
    x = torch.ones(4)
    lin = nn.Linear(2, 2)
    seen = []
    for i in range(steps):
        seen.append((i, _engaged(), copy.deepcopy is not _UNPATCHED_DEEPCOPY))
        x.clone()
        lin(torch.ones(1, 2))
        t.step()
    return seen


@pytest.mark.parametrize(
    "schedule",
    [
        Schedule(skip_first=1, wait=1, warmup=1, active=2, repeat=2),
        "skip_first=1,wait=1,warmup=1,active=2,repeat=2",
        {"skip_first": 1, "wait": 1, "warmup": 1, "active": 2, "repeat": 2},
        torch.profiler.schedule(skip_first=1, wait=1, warmup=1, active=2, repeat=2),
    ],
    ids=["Schedule", "str", "dict", "torch.profiler"],
)
def test_schedule_traces_only_active_steps(tmp_path, schedule):
    with copytrace.trace(tmp_path, schedule=schedule) as t:
        seen = _scheduled_program(t)
    # step: 0 skip, 1 wait, 2 warmup, 3-4 active, 5 wait, 6 warmup, 7-8 active, then none
    engaged = [i for i, on, _ in seen if on]
    assert engaged == [2, 3, 4, 6, 7, 8]
    assert all(patched == on for _, on, patched in seen)  # deepcopy patched only while engaged
    assert t.stats["steps_traced"] == 4 and t.stats["discarded"] == 2
    run = _run(t.trace_path)
    assert [s.step for s in run.steps] == [3, 4, 7, 8]
    assert sorted({e.attrs["copytrace.step"] for e in run.events}) == [3, 4, 7, 8]
    assert len(run.events) == 4
    assert run.attrs["copytrace.steps"] == 13 and run.attrs["copytrace.events_discarded"] == 2


def test_schedule_from_env_with_optimizer_steps(tmp_path):
    """No code change: COPYTRACE_SCHEDULE with COPYTRACE=1, steps from optimizer.step()."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            model = torch.nn.Linear(4, 4)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for i in range(10):
                torch.ones(3).clone()
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
            """
        )
    )
    out = tmp_path / "out"
    env = {
        k: v
        for k, v in __import__("os").environ.items()
        if not k.startswith(("COPYTRACE", "OTEL_"))
    }
    env.update(
        COPYTRACE="1",
        COPYTRACE_OUTPUT=str(out),
        COPYTRACE_REPORT="0",
        COPYTRACE_SCHEDULE="wait=2,active=3,repeat=1",
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=240
    )
    assert proc.returncode == 0, proc.stderr
    (path,) = out.glob("*.otlp.jsonl*")
    run = _run(path)
    assert [s.step for s in run.steps] == [2, 3, 4]
    assert run.attrs["copytrace.schedule"] == "wait=2,warmup=0,active=3,repeat=1,skip_first=0"
    clones = [e for e in run.events if e.op == "clone"]
    assert sorted(e.attrs["copytrace.step"] for e in clones) == [2, 3, 4]


def test_bad_schedule_is_refused():
    with pytest.raises(ValueError):
        Schedule.parse("wait=1,sometimes=2")
    with pytest.raises(ValueError):
        Schedule(active=0)
    with pytest.raises(ValueError):
        Trace(schedule="active=x")


def test_explicit_step_after_optimizer_steps_renumbers_once(tmp_path):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with copytrace.trace(tmp_path) as t:
        for _ in range(3):
            torch.ones(2).clone()
            opt.step()  # auto step, until the first t.step()
            t.step()
    run = _run(t.trace_path)
    assert [s.step for s in run.steps] == [0, 1, 2, 3]
    assert sorted(e.attrs["copytrace.step"] for e in run.events if e.op == "clone") == [0, 1, 2]


def test_export_thread_is_not_traced(tmp_path):
    from opentelemetry.sdk.trace.export import SpanExportResult

    class DeepCopying:  # like grpc's channel, which deep-copies call metadata
        def export(self, spans):
            for _ in range(2000):
                copy.deepcopy({"metadata": (("a", "b"),)})
            return SpanExportResult.SUCCESS

        def shutdown(self):
            pass

    x = torch.ones(2)
    with copytrace.trace(tmp_path, exporters=[DeepCopying()], flush_events=5) as t:
        for _ in range(200):
            for _ in range(5):
                x.clone()
            t.step()
    run = _run(t.trace_path)
    # every event is the program's thread's (the export thread, a bare OS thread, would be
    # named by threading as a "Dummy-N")
    assert {e.attrs.get("thread.name") for e in run.events} == {threading.current_thread().name}
    assert sum(e.op == "clone" for e in run.events) == 1000
    assert all(not e.is_group for e in run.events)
