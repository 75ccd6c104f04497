"""Write synthetic copytrace trace files (OTLP/JSON lines) with known contents.

The report, summary and browser tests use traces of the real tracer (``tests/_realtrace.py``);
this generator is for what a real trace cannot give cheaply: exact times and devices (an h2d
copy on a CPU-only machine), cut and duplicated files, and large traces for the sampling and
size tests. ``tests/test_tracegen_schema.py`` checks that what it writes has the attribute
names and types of a real trace's spans, so that tests on it test the format the tracer writes.

The trace written by :func:`write_trace` (times relative to ``T0``, ms):

- run span 0..100, pid ``pid``; steps: 0 = [0, 30), 1 = [30, 60), 2 = [60, 100).
- step 0: ``clone`` at 1 ms, 2 ms, 4000 B allocated / 4000 B logical, module
  ``<script>alert(1)</script>``, forward, ``train.py:10 forward``;
  ``detach`` alias at 5 ms, 0.5 ms, 0 B / 4000 B, module ``encoder``, forward,
  ``train.py:11 forward``.
- step 1: ``to`` h2d cpu -> cuda:0 at 31 ms, 3 ms, 8000 B / 8000 B, no module, other,
  ``train.py:20 main``; a ``deepcopy`` group (Linear, 2 tensors) at 40..46 ms carrying a
  (redundant) bytes_allocated of 3000 B, with 2 ``deepcopy`` children at 41 ms (1 ms,
  2000 B) and 43 ms (1 ms, 1000 B), ``train.py:30 main``, phase other.
- step 2: ``to`` no-op (alias) at 61 ms, 0.1 ms, 0 B / 1000 B, ``train.py:40 main``;
  ``contiguous`` at 70 ms, 4 ms, 16000 B / 16000 B, module ``encoder``, backward,
  ``train.py:11 forward``.

The run span carries ``copytrace.overhead_ns`` = 1.5 ms. As the tracer does when tracing
stops, a last line holds a ``copytrace.hazards`` span (child of the run span, at its end) with
one ``copytrace.hazard`` span event: code ``CT-TEST``, warning, 8000 B, call site
``train.py:20 main``, naming the h2d ``to`` (span id 12).

Spans are spread over four lines (events, steps, run, hazards), as the tracer writes them.

:func:`write_many` writes a larger trace (``n`` events over ``n // 100`` steps) for the
sampling tests.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from copytrace.schema import OMITTED_DEFAULTS as _OMITTED_DEFAULTS

T0 = 1_700_000_000_000_000_000
MS = 1_000_000
SCRIPT_MODULE = "<script>alert(1)</script>"


def _value(v: Any) -> dict[str, Any]:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, (list, tuple)):
        return {"arrayValue": {"values": [_value(x) for x in v]}}
    return {"stringValue": str(v)}


def hazard_event(time_ms: float, span_ids: list[int], call_site: str, nbytes: int) -> dict:
    """One ``copytrace.hazard`` span event, as the tracer writes it on its hazards span."""
    attrs = {
        "copytrace.hazard.code": "CT-TEST",
        "copytrace.hazard.severity": "warning",
        "copytrace.hazard.message": "h2d copy <every> step",
        "copytrace.hazard.fix": "move it out of the loop",
        "copytrace.hazard.call_sites": [call_site],
        "copytrace.hazard.bytes": nbytes,
        "copytrace.hazard.events": len(span_ids),
        "copytrace.hazard.span_ids": [f"{i:016x}" for i in span_ids],
    }
    return {
        "timeUnixNano": str(T0 + round(time_ms * MS)),
        "name": "copytrace.hazard",
        "attributes": [{"key": k, "value": _value(v)} for k, v in attrs.items()],
    }


def hazards_span(trace_id: str, run_id: int, end_ms: float, events: list[dict]) -> dict:
    """The ``copytrace.hazards`` span the tracer appends when tracing stops."""
    span = _span(trace_id, 99, run_id, "copytrace.hazards", end_ms, end_ms,
                 {"copytrace.hazards": len(events)})  # fmt: skip
    span["events"] = events
    return span


def _span(
    trace_id: str,
    span_id: int,
    parent: int | None,
    name: str,
    start_ms: float,
    end_ms: float,
    attrs: dict[str, Any],
) -> dict[str, Any]:
    span = {"traceId": trace_id, "spanId": f"{span_id:016x}"}
    if parent is not None:  # as the tracer writes it: no parentSpanId on the root span
        span["parentSpanId"] = f"{parent:016x}"
    return {
        **span,
        "name": name,
        "kind": 1,
        "startTimeUnixNano": str(T0 + round(start_ms * MS)),
        "endTimeUnixNano": str(T0 + round(end_ms * MS)),
        "attributes": [{"key": k, "value": _value(v)} for k, v in attrs.items()],
    }


def _event(
    op: str,
    step: int,
    alloc: int,
    logical: int,
    *,
    module: str | None,
    phase: str,
    line: int,
    func: str,
    src: str = "cpu",
    dst: str = "cpu",
    alias: bool = False,
    noop: bool = False,
    aten: tuple[str, ...] = (),
    **extra: Any,
) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "copytrace.op": op,
        "copytrace.aten": list(aten),
        "copytrace.bytes_allocated": alloc,
        "copytrace.bytes_logical": logical,
        "copytrace.alias": alias,
        "copytrace.noop": noop,
        "copytrace.shape": [10, 100],
        "copytrace.dtype": "float32",
        "copytrace.src_dtype": "float32",
        "copytrace.src_device": src,
        "copytrace.dst_device": dst,
        "copytrace.transfer": "h2d" if (src, dst) == ("cpu", "cuda:0") else "none",
        "copytrace.graph": "none",
        "copytrace.phase": phase,
        "copytrace.step": step,
        "code.file.path": "train.py",
        "code.line.number": line,
        "code.function.name": func,
        "thread.id": 1,
        "thread.name": "MainThread",
    }
    if module is not None:
        attrs["copytrace.module"] = module
    attrs.update(extra)
    # as the tracer writes them: no empty lists, no flag or count at its default value
    return {
        k: v
        for k, v in attrs.items()
        if v != [] and not (k in _OMITTED_DEFAULTS and v == _OMITTED_DEFAULTS[k])
    }


def trace_lines(pid: int = 4242, trace_id: str | None = None) -> list[str]:
    """Return the three OTLP/JSON lines of the synthetic trace described in the module doc."""
    tid = trace_id or f"{pid:032x}"
    run_id, step_ids = 1, (2, 3, 4)
    spans_events = [
        _span(
            tid,
            10,
            step_ids[0],
            "copytrace.clone",
            1,
            3,
            _event(
                "clone",
                0,
                4000,
                4000,
                module=SCRIPT_MODULE,
                phase="forward",
                line=10,
                func="forward",
                aten=("aten::clone",),
                **{"copytrace.graph": "attached"},
            ),
        ),
        _span(
            tid,
            11,
            step_ids[0],
            "copytrace.detach",
            5,
            5.5,
            _event(
                "detach",
                0,
                0,
                4000,
                module="encoder",
                phase="forward",
                line=11,
                func="forward",
                alias=True,
                aten=("aten::detach",),
            ),
        ),
        _span(
            tid,
            12,
            step_ids[1],
            "copytrace.to",
            31,
            34,
            _event(
                "to",
                1,
                8000,
                8000,
                module=None,
                phase="other",
                line=20,
                func="main",
                dst="cuda:0",
                aten=("aten::_to_copy", "aten::copy_"),
                **{"copytrace.non_blocking": True},
            ),
        ),
        _span(
            tid,
            14,
            13,
            "copytrace.deepcopy",
            41,
            42,
            _event(
                "deepcopy",
                1,
                2000,
                2000,
                module=None,
                phase="other",
                line=30,
                func="main",
                aten=("aten::clone",),
            ),
        ),
        _span(
            tid,
            15,
            13,
            "copytrace.deepcopy",
            43,
            44,
            _event(
                "deepcopy",
                1,
                1000,
                1000,
                module=None,
                phase="other",
                line=30,
                func="main",
                aten=("aten::clone",),
            ),
        ),
        _span(
            tid,
            13,
            step_ids[1],
            "copytrace.deepcopy",
            40,
            46,
            {
                "copytrace.op": "deepcopy",
                "copytrace.group": True,
                "copytrace.object_type": "torch.nn.modules.linear.Linear",
                "copytrace.tensors": 2,
                "copytrace.bytes_allocated": 3000,
                "copytrace.bytes_logical": 3000,
                "copytrace.step": 1,
                "copytrace.phase": "other",
                "code.file.path": "train.py",
                "code.line.number": 30,
                "code.function.name": "main",
            },
        ),
        _span(
            tid,
            16,
            step_ids[2],
            "copytrace.to",
            61,
            61.1,
            _event(
                "to",
                2,
                0,
                1000,
                module=None,
                phase="other",
                line=40,
                func="main",
                alias=True,
                noop=True,
            ),
        ),
        _span(
            tid,
            17,
            step_ids[2],
            "copytrace.contiguous",
            70,
            74,
            _event(
                "contiguous",
                2,
                16000,
                16000,
                module="encoder",
                phase="backward",
                line=11,
                func="forward",
                aten=("aten::clone",),
            ),
        ),
    ]
    spans_steps = [
        _span(tid, step_ids[i], run_id, "copytrace.step", a, b, {"copytrace.step": i})
        for i, (a, b) in enumerate(((0, 30), (30, 60), (60, 100)))
    ]
    spans_run = [
        _span(
            tid,
            run_id,
            None,
            "copytrace.run",
            0,
            100,
            {
                "copytrace.version": "0.1.0",
                "copytrace.torch_version": "2.13.0+cpu",
                "process.command_args": ["train.py", "--epochs", "1"],
                "copytrace.events": 8,
                "copytrace.events_dropped": 0,
                "copytrace.errors": 0,
                "copytrace.internal_detaches": 5,
                "copytrace.steps": 3,
                "copytrace.overhead_ns": 1_500_000,
            },
        ),
    ]
    resource = {
        "attributes": [
            {"key": "service.name", "value": {"stringValue": "copytrace"}},
            {"key": "process.pid", "value": {"intValue": str(pid)}},
            {"key": "host.name", "value": {"stringValue": "testhost"}},
        ]
    }

    def line(spans: list[dict[str, Any]]) -> str:
        doc = {
            "resourceSpans": [
                {
                    "resource": resource,
                    "scopeSpans": [
                        {"scope": {"name": "copytrace", "version": "0.1.0"}, "spans": spans}
                    ],
                }
            ]
        }
        return json.dumps(doc, separators=(",", ":"))

    spans_hazards = [
        hazards_span(tid, run_id, 100, [hazard_event(100, [12], "train.py:20 main", 8000)])
    ]
    return [line(spans_events), line(spans_steps), line(spans_run), line(spans_hazards)]


def write_trace(
    directory: Path,
    *,
    pid: int = 4242,
    truncated: bool = False,
    gz: bool = False,
    sidecar: bool = False,
) -> Path:
    """Write the synthetic trace of one process into ``directory`` and return its path.

    Args:
        directory: Output directory (created if missing).
        pid: Process id; also determines the trace id.
        truncated: Append half of an extra line, as a file cut mid-write would end.
        gz: Write ``.otlp.jsonl.gz`` instead of ``.otlp.jsonl`` (one gzip member per line,
            as the tracer ends a member at each flush).
        sidecar: Also write the columnar sidecar as the tracer does, through its writer: one
            flush per line for the events, steps and run lines, one part each; the hazards
            line is appended after the sidecar is closed, as the tracer appends it at stop.

    Returns:
        The file written, ``copytrace-testhost-<pid>.otlp.jsonl[.gz]``.
    """
    directory.mkdir(parents=True, exist_ok=True)
    lines = [ln + "\n" for ln in trace_lines(pid)]
    if truncated:
        lines.append(lines[0][: len(lines[0]) // 2])
    name = f"copytrace-testhost-{pid}.otlp.jsonl"
    path = directory / (name + ".gz" if gz else name)
    writer = None
    if sidecar:
        from copytrace.export import sidecar

        writer = sidecar.SidecarWriter(path, f"{pid:032x}", {
            "service.name": "copytrace", "process.pid": pid, "host.name": "testhost"})  # fmt: skip
    with path.open("wb") as fh:
        for i, ln in enumerate(lines):
            data = ln.encode()
            fh.write(gzip.compress(data, mtime=0) if gz else data)
            fh.flush()
            if writer is not None and i < 3:
                _to_sidecar(writer, ln, fh.tell())
    return path


def _to_sidecar(writer: Any, line: str, json_bytes: int) -> None:
    """Hand the spans of one flushed ``line`` to the sidecar writer, as the file sink does."""
    from copytrace.export import sidecar
    from copytrace.schema import META_SPANS
    from copytrace.tracefile import decode_value

    for rs in json.loads(line)["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for sp in ss["spans"]:
                attrs = {a["key"]: decode_value(a["value"]) for a in sp.get("attributes", [])}
                args = (sp["traceId"], sp["spanId"], sp.get("parentSpanId"), sp["name"],
                        int(sp["startTimeUnixNano"]), int(sp["endTimeUnixNano"]))  # fmt: skip
                if sp["name"] in META_SPANS:
                    events = [(e["name"], int(e["timeUnixNano"]),
                               {a["key"]: decode_value(a["value"]) for a in e["attributes"]})
                              for e in sp.get("events", [])]  # fmt: skip
                    writer.add_rows([sidecar.meta_row(*args, attrs, events)])
                else:
                    writer.add(sidecar.event_batch(args[0], [args[1]], [args[2] or ""],
                                                   [args[3]], [args[4]], [args[5]], [attrs]))
    writer.close(json_bytes)  # a part per flush


def write_many(
    directory: Path, n: int, *, pid: int = 5151, large_every: int = 500, hazard_every: int = 250
) -> Path:
    """Write a trace of ``n`` events over ``n // 100`` steps of 10 ms and return its path.

    Events cycle through: ``to`` no-op (``loop.py:5 main``), ``detach`` alias
    (``loop.py:6 main``), ``clone`` copy of 4000 B (``model.py:20 forward``, module ``net``)
    and, every ``large_every``-th event instead, a 4 MiB ``clone`` (``loop.py:9 main``). A last
    line holds the ``copytrace.hazards`` span with one ``copytrace.hazard`` span event per call
    site (as the analyser reports them), naming every ``hazard_every``-th event of that site.
    """
    directory.mkdir(parents=True, exist_ok=True)
    tid = f"{pid:032x}"
    n_steps = max(1, n // 100)
    spans = []
    hazards: dict[str, tuple[list[int], int]] = {}  # call site -> (span ids, bytes)
    for i in range(n):
        step = min(i // 100, n_steps - 1)
        t = step * 10 + (i % 100) * 0.09 + 0.01
        if i % large_every == large_every - 1:
            ev = _event("clone", step, 4 << 20, 4 << 20, module=None, phase="other", line=9,
                        func="main", aten=("aten::clone",))  # fmt: skip
            ev["code.file.path"] = "loop.py"
        elif i % 3 == 0:
            ev = _event("to", step, 0, 400, module=None, phase="other", line=5, func="main",
                        alias=True, noop=True)  # fmt: skip
            ev["code.file.path"] = "loop.py"
        elif i % 3 == 1:
            ev = _event("detach", step, 0, 400, module=None, phase="other", line=6, func="main",
                        alias=True)  # fmt: skip
            ev["code.file.path"] = "loop.py"
        else:
            ev = _event("clone", step, 4000, 4000, module="net", phase="forward", line=20,
                        func="forward", aten=("aten::clone",))  # fmt: skip
            ev["code.file.path"] = "model.py"
        span = _span(tid, 1000 + i, 100 + step, f"copytrace.{ev['copytrace.op']}", t, t + 0.05, ev)
        if i % hazard_every == 0:
            site = f"{ev['code.file.path']}:{ev['code.line.number']} {ev['code.function.name']}"
            ids, nbytes = hazards.get(site, ([], 0))
            hazards[site] = ([*ids, 1000 + i], nbytes + ev["copytrace.bytes_logical"])
        spans.append(span)
    spans += [
        _span(tid, 100 + s, 1, "copytrace.step", s * 10, (s + 1) * 10, {"copytrace.step": s})
        for s in range(n_steps)
    ]
    spans.append(
        _span(tid, 1, None, "copytrace.run", 0, n_steps * 10, {"copytrace.steps": n_steps})
    )
    resource = {"attributes": [{"key": "process.pid", "value": {"intValue": str(pid)}}]}
    lines = []
    findings = [hazard_event(n_steps * 10, ids, site, b) for site, (ids, b) in hazards.items()]
    for group in (spans, [hazards_span(tid, 1, n_steps * 10, findings)] if findings else []):
        if group:
            doc = {"resourceSpans": [{"resource": resource, "scopeSpans": [{"spans": group}]}]}
            lines.append(json.dumps(doc, separators=(",", ":")) + "\n")
    path = directory / f"copytrace-many-{pid}.otlp.jsonl"
    path.write_text("".join(lines), encoding="utf-8")
    return path
