"""What the README and docs promise and no other test checked: ``Trace.report()``, the
``@copytrace.trace()`` decorator, top-level ``copytrace.analyze``, time-based flushing (the
program's time, not copytrace's set-up), the run span's ERROR status through SDK exporters,
the ``copytrace.hazards`` span's full contents and its size cap, and ``graph-retaining-copy``
when tracing stops mid-step."""

from __future__ import annotations

import gzip
import json
import re
import time
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import copytrace
from copytrace import CopytraceError
from copytrace.analysis import analyze as analysis_analyze

_SOURCE = Path(__file__).read_text(encoding="utf-8").splitlines()


def site(tag: str, function: str) -> str:
    """``file:line function`` of the line tagged ``# site: tag`` in this file."""
    (line,) = [i for i, text in enumerate(_SOURCE, 1) if text.rstrip().endswith(f"# site: {tag}")]
    return f"{__file__}:{line} {function}"


def _raw_spans(path: Path) -> list[dict[str, Any]]:
    raw = path.read_bytes()
    text = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
    return [
        sp
        for line in text.splitlines()
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for sp in ss["spans"]
    ]


def ids_of(spans: list[dict[str, Any]]) -> set[str]:
    return {s["spanId"] for s in spans}


def _attrs(items: list[dict[str, Any]]) -> dict[str, Any]:
    from copytrace.dashboards._load import decode_value

    return {a["key"]: decode_value(a["value"]) for a in items}


# --- the decorator and Trace.report() ------------------------------------------------------------
def test_decorator_traces_each_call_and_report_writes_the_html(tmp_path: Path) -> None:
    t = copytrace.trace(tmp_path / "out")

    @t
    def train_step(x: torch.Tensor) -> torch.Tensor:
        """Docstring kept."""
        return x.clone()  # site: decorated

    x = torch.ones(250)  # 1000 B
    with pytest.raises(CopytraceError, match="not been written yet"):
        t.report()  # before the first call: nothing written
    y = train_step(x)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()  # the function's own result
    assert (train_step.__name__, train_step.__doc__) == ("train_step", "Docstring kept.")
    assert not t.running  # the decorator stops tracing when the call returns
    (ev,) = t.events
    assert (ev.op, ev.bytes_allocated) == ("clone", 1000)
    assert f"{ev.file}:{ev.line} {ev.function}" == site("decorated", "train_step")
    first = t.trace_path
    assert first is not None and first.parent == tmp_path / "out"
    (run,) = copytrace.load_trace(first).runs
    assert [e.op for e in run.events] == ["clone"]

    report = t.report()  # default: <output_dir>/report.html
    assert report == tmp_path / "out" / "report.html"
    html = report.read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>") and first.name in html
    other = t.report(tmp_path / "elsewhere" / "r.html")
    assert other == tmp_path / "elsewhere" / "r.html" and other.stat().st_size > 0

    with pytest.raises(ValueError, match="boom"):  # an exception passes through unchanged

        @t
        def fails() -> None:
            raise ValueError("boom")

        fails()
    assert not t.running
    assert [s["status"] for s in _raw_spans(t.trace_path) if s["name"] == "copytrace.run"] == [
        {"code": 2, "message": "ValueError"}
    ]


def test_report_while_running_is_a_clear_error(tmp_path: Path) -> None:
    with copytrace.trace(tmp_path) as t:
        with pytest.raises(CopytraceError, match="after the with block"):
            t.report()
    with copytrace.trace(write=False) as t:
        torch.ones(2).clone()
    # write=False: the events are in memory, and the report is made from them after the block
    html = t.report(tmp_path / "memory.html")
    assert html == tmp_path / "memory.html" and html.stat().st_size > 0


# --- copytrace.analyze ---------------------------------------------------------------------------
def _ctor_twice(t: Any) -> None:
    w = torch.ones(10, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns against torch.tensor(t): the hazard
        for _ in range(2):
            torch.tensor(w)  # site: ctor
            t.step()


def test_top_level_analyze_on_events_trace_and_file(tmp_path: Path) -> None:
    assert copytrace.analyze is analysis_analyze
    assert copytrace.Finding.__module__.startswith("copytrace.analysis")
    with copytrace.trace(tmp_path) as t:
        _ctor_twice(t)
    expected = [("tensor-ctor-copy", "warning", [site("ctor", "_ctor_twice")], 80, [0, 1])]
    # 2 copies of 10 float32 = 80 B, one in each of steps 0 and 1
    for source in (t.events, t, tmp_path, t.trace_path, copytrace.load_trace(t.trace_path)):
        found = copytrace.analyze(source)
        assert [(f.code, f.severity, f.call_sites, f.bytes, f.steps) for f in found] == expected
    assert copytrace.analyze(t.events, codes=["redundant-copy"]) == []
    with pytest.raises(copytrace.TraceFileError):
        copytrace.analyze(tmp_path / "missing")


# --- time-based flushing -------------------------------------------------------------------------
class _ProgramClock:
    """The clock that time-based flushing reads (``time.perf_counter_ns`` in the session and
    its buffer: the step boundaries, the last flush, copytrace's own set-up), moved only by
    :meth:`advance`: a step lasts exactly as long as the test says, however loaded the
    machine (a real 5-step loop meant to take milliseconds can take 0.2 s there)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from copytrace.tracer import _buffer, session

        self.ns = time.perf_counter_ns()
        frozen = types.SimpleNamespace(perf_counter_ns=lambda: self.ns)
        for module in (session, _buffer):
            monkeypatch.setattr(module, "time", frozen)

    def advance(self, seconds: float) -> None:
        self.ns += round(seconds * 1e9)


def _timed_steps(t: Any, clock: _ProgramClock, seconds: list[float]) -> list[int]:
    """One step per entry of ``seconds``, each a clone and that long on ``clock``; the flush
    count after each step's boundary."""
    x = torch.ones(4)
    flushes = []
    for step_s in seconds:
        x.clone()
        clock.advance(step_s)
        t.step()
        flushes.append(t.stats["flushes"])
    return flushes


def test_flush_seconds_flushes_at_the_next_step_boundary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = _ProgramClock(monkeypatch)
    with copytrace.trace(tmp_path, flush_events=10**6, flush_seconds=0.2) as t:
        # 3 steps of 0.25 s > flush_seconds: a flush at each end; then 5 steps of 0.035 s:
        # the last ends 0.175 s after the last flush, none
        flushes = _timed_steps(t, clock, [0.25] * 3 + [0.035] * 5)
    assert flushes == [1, 2, 3, 3, 3, 3, 3, 3]
    (run,) = copytrace.load_trace(t.trace_path).runs
    assert run.attrs["copytrace.flushes"] == 3
    assert len(run.events) == 8 and len(run.steps) == 9
    assert t.flush_seconds == 0.2


def test_flush_seconds_is_due_once_it_has_passed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = _ProgramClock(monkeypatch)
    with copytrace.trace(tmp_path, flush_events=10**6, flush_seconds=0.2) as t:
        # 0.2 s since the last flush reached at the 2nd and the 5th step's end, exactly
        flushes = _timed_steps(t, clock, [0.1, 0.1, 0.05, 0.149, 0.001])
    assert flushes == [0, 1, 1, 1, 2]


def test_without_flush_seconds_no_time_based_flush(tmp_path: Path) -> None:
    x = torch.ones(4)
    with copytrace.trace(tmp_path, flush_events=10**6, flush_seconds=60) as t:
        for _ in range(2):
            x.clone()
            time.sleep(0.25)
            t.step()
    (run,) = copytrace.load_trace(t.trace_path).runs
    assert run.attrs["copytrace.flushes"] == 0


def _slow_engage(monkeypatch: pytest.MonkeyPatch, clock: _ProgramClock, seconds: float) -> None:
    """Make each engage last ``seconds`` longer on ``clock``, as the first one in a process
    can on a loaded host (the C++ observer's set-up; it imported ``torch._dynamo`` before
    that was left to the program: 5 to 9 s of wall time there)."""
    from copytrace.tracer import _engage

    engage_compiled = _engage.Engagement._compiled_with_dynamo

    def slow(self: Any, *args: Any, **kwargs: Any) -> None:
        clock.advance(seconds)
        engage_compiled(self, *args, **kwargs)

    monkeypatch.setattr(_engage.Engagement, "_compiled_with_dynamo", slow)


def test_flush_seconds_does_not_count_copytraces_set_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = _ProgramClock(monkeypatch)
    _slow_engage(monkeypatch, clock, 1.5)
    x = torch.ones(4)
    with copytrace.trace(tmp_path, flush_events=10**6, flush_seconds=0.75) as t:
        x.clone()  # step 0 starts 1.5 s after the trace, but the program ran for 0.5 s
        clock.advance(0.5)
        t.step()
        x.clone()
        flushes_before_stop = t.stats["flushes"]
    assert flushes_before_stop == 0
    assert [ev.step for ev in t.events] == [0, 1]  # both still in memory, none flushed out


def test_flush_seconds_does_not_count_an_engage_at_a_step_boundary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = _ProgramClock(monkeypatch)
    _slow_engage(monkeypatch, clock, 1.5)
    x = torch.ones(4)
    with copytrace.trace(
        tmp_path, flush_events=10**6, flush_seconds=0.75, schedule="wait=1,active=2"
    ) as t:
        for _ in range(3):  # step 0 waits; the 0 -> 1 boundary engages (1.5 s); 1 and 2 traced
            x.clone()
            clock.advance(0.2)
            t.step()
        flushes_before_stop = t.stats["flushes"]
    # one flush: the active window's end (2 -> 3); none at 1 -> 2, 1.5 s after the last one
    # (0.2 s of the program's time since the engage)
    assert flushes_before_stop == 1
    (run,) = copytrace.load_trace(t.trace_path).runs
    assert [ev.step for ev in run.events] == [1, 2]


# --- the run span's status through SDK exporters -------------------------------------------------
def test_run_span_error_status_reaches_sdk_exporters(tmp_path: Path) -> None:
    mem = InMemorySpanExporter()
    with pytest.raises(KeyError):
        with copytrace.trace(tmp_path, exporters=[mem]):
            torch.ones(2).clone()
            raise KeyError("k")
    spans = {s.name: s for s in mem.get_finished_spans()}
    run = spans["copytrace.run"]
    assert run.status.status_code is StatusCode.ERROR
    assert run.status.description == "KeyError"
    assert run.attributes["copytrace.exit"] == "KeyError"
    assert spans["copytrace.clone"].status.status_code is StatusCode.UNSET

    mem = InMemorySpanExporter()
    with copytrace.trace(tmp_path / "ok", exporters=[mem]):
        torch.ones(2).clone()
    (run,) = [s for s in mem.get_finished_spans() if s.name == "copytrace.run"]
    assert run.status.status_code is StatusCode.UNSET


# --- the copytrace.hazards span ------------------------------------------------------------------
def test_hazards_span_holds_every_finding_in_full(tmp_path: Path) -> None:
    with copytrace.trace(tmp_path) as t:
        _ctor_twice(t)
        w = torch.ones(5, requires_grad=True)
        w.clone().detach()  # site: clone-detach
    spans = _raw_spans(t.trace_path)
    (run,) = [s for s in spans if s["name"] == "copytrace.run"]
    (hz,) = [s for s in spans if s["name"] == "copytrace.hazards"]
    assert spans[-1] is hz  # the last line of the file
    assert (hz["traceId"], hz["parentSpanId"]) == (run["traceId"], run["spanId"])
    assert re.fullmatch("[0-9a-f]{16}", hz["spanId"]) and hz["spanId"] not in ids_of(spans[:-1])
    assert hz["startTimeUnixNano"] == hz["endTimeUnixNano"] == run["endTimeUnixNano"]
    assert _attrs(hz["attributes"]) == {"copytrace.hazards": 2}
    ids = {s["name"]: [] for s in spans}
    for s in spans:
        ids[s["name"]].append(s["spanId"])
    got = [(e["name"], e["timeUnixNano"], _attrs(e["attributes"])) for e in hz["events"]]
    findings = copytrace.analyze(t.events)
    assert [f.code for f in findings] == ["tensor-ctor-copy", "clone-detach-order"]
    end = run["endTimeUnixNano"]
    assert got == [
        (
            "copytrace.hazard",
            end,
            {
                "copytrace.hazard.code": "tensor-ctor-copy",
                "copytrace.hazard.severity": "warning",
                "copytrace.hazard.message": findings[0].message,
                "copytrace.hazard.fix": findings[0].fix,
                "copytrace.hazard.call_sites": [site("ctor", "_ctor_twice")],
                "copytrace.hazard.bytes": 80,  # 2 x 10 float32
                "copytrace.hazard.events": 2,
                "copytrace.hazard.span_ids": ids["copytrace.tensor_ctor"],
            },
        ),
        (
            "copytrace.hazard",
            end,
            {
                "copytrace.hazard.code": "clone-detach-order",
                "copytrace.hazard.severity": "info",
                "copytrace.hazard.message": findings[1].message,
                "copytrace.hazard.fix": findings[1].fix,
                "copytrace.hazard.call_sites": [
                    site("clone-detach", "test_hazards_span_holds_every_finding_in_full")
                ],
                "copytrace.hazard.bytes": 20,  # the clone: 5 float32
                "copytrace.hazard.events": 2,  # the clone and its detach
                "copytrace.hazard.span_ids": ids["copytrace.clone"] + ids["copytrace.detach"],
            },
        ),
    ]
    # no event span carries span events: hazards are on the hazards span only
    assert [s["name"] for s in spans if "events" in s] == ["copytrace.hazards"]


def test_hazards_span_names_at_most_the_span_id_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A finding names at most ``MAX_HAZARD_SPAN_IDS`` (10,000) event spans, and counts them
    all; the run's size does not matter (no cap on the analysis)."""
    from copytrace.export import hazard_span

    assert hazard_span.MAX_HAZARD_SPAN_IDS == 10_000  # as docs/trace-format.md says
    monkeypatch.setattr(hazard_span, "MAX_HAZARD_SPAN_IDS", 1)
    with copytrace.trace(tmp_path) as t:
        _ctor_twice(t)
    spans = _raw_spans(t.trace_path)
    (hz,) = [s for s in spans if s["name"] == "copytrace.hazards"]
    (event,) = hz["events"]
    attrs = _attrs(event["attributes"])
    first = [s["spanId"] for s in spans if s["name"] == "copytrace.tensor_ctor"][0]
    assert attrs["copytrace.hazard.events"] == 2 and attrs["copytrace.hazard.span_ids"] == [first]


# --- graph-retaining-copy when tracing stops mid-step -------------------------------------------
def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def test_several_survivors_from_one_line_at_stop_are_reported() -> None:
    model, x = _net(), torch.randn(4, 8)
    history = []
    with copytrace.trace(write=False) as t:  # no step ends: only the stop checks them
        for _ in range(3):
            history.append(model(x).pow(2).mean().clone())  # site: survivors
    (f,) = copytrace.analyze(t.events)
    assert (f.code, f.severity) == ("graph-retaining-copy", "warning")
    assert f.call_sites == [
        site("survivors", "test_several_survivors_from_one_line_at_stop_are_reported")
    ]
    # each graph saves x (4x8 float32 = 128 B), the ReLU output (4x16 = 256 B) and pow's
    # input (4x1 = 16 B); x is shared by the 3 graphs, counted once: 400 + 272 + 272
    assert [e.retained_bytes for e in t.events] == [400, 272, 272]
    assert f.bytes == 944 and f.steps == [0]
    assert len(history) == 3


def test_one_survivor_per_line_at_stop_is_not_reported() -> None:
    model, x = _net(), torch.randn(4, 8)
    with copytrace.trace(write=False) as t:
        a = model(x).clone()
        b = model(x).clone()  # another line: one pending output each
    assert copytrace.analyze(t.events) == []
    assert [e.retained_bytes for e in t.events] == [None, None]
    del a, b
