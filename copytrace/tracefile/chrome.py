"""A trace as Chrome trace-event JSON (Perfetto, ``chrome://tracing``), alone or merged into
a torch.profiler trace of the same run.

The format (the "Trace Event Format" document, as torch.profiler's
``export_chrome_trace`` writes it): ``{"traceEvents": [...]}``, each copy a complete event
(``"ph": "X"``) with ``ts`` and ``dur`` in microseconds, ``pid``/``tid`` the process and the
thread (one track per thread), ``name`` the op, ``cat`` ``"copytrace"`` and ``args`` its
bytes, devices, call site, step and hazards.

One clock: copytrace's span times are ns since the Unix epoch (``startTimeUnixNano``).
Threads: copytrace records Python's thread ident; the main thread is put on the process id,
the OS thread id Kineto gives it, so its copies share the profiler's main thread track;
other threads get tracks of their own, named ``<thread> (copytrace)``.

torch.profiler (Kineto) writes ``ts`` in microseconds relative to the trace's
``baseTimeNanoseconds``, itself ns since the Unix epoch (Kineto converts its monotonic clock
to the wall clock once per trace; ``torch/csrc/profiler/kineto_shim`` and Kineto's
``ChromeTraceLogger``). So a copytrace time ``t`` goes to ``(t - baseTimeNanoseconds) /
1000``; without a profiler trace the base is the first event's time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from copytrace.schema import META_SPANS

__all__ = ["chrome_events", "merge_into_profiler", "read_profiler", "write_chrome_trace"]

#: The event table's columns a slice's ``args`` carry (``None`` / empty values left out).
ARG_COLUMNS = (
    "op", "bytes_allocated", "bytes_logical", "src_device", "dst_device", "transfer",
    "dtype", "shape", "step", "module", "file", "line", "function", "alias", "noop",
)  # fmt: skip


def _hazards_by_span(table: Any) -> dict[str, list[str]]:
    """``span_id -> [hazard code, ...]`` from the trace's ``copytrace.hazards`` span(s)."""
    out: dict[str, list[str]] = {}
    for part in table.parts:
        rows = part.read().to_pylist()
        for row in rows:
            if row["name"] != "copytrace.hazards" or not row.get("events_json"):
                continue
            for event in json.loads(row["events_json"]):  # [name, time_ns, attributes]
                attrs = event[2] if isinstance(event, list) and len(event) > 2 else {}
                code = attrs.get("copytrace.hazard.code")
                for sid in attrs.get("copytrace.hazard.span_ids") or ():
                    out.setdefault(str(sid), []).append(str(code))
    return out


def _rows(table: Any) -> Iterator[dict[str, Any]]:
    for part in table.parts:
        yield from part.read().to_pylist()


def chrome_events(table: Any, base_ns: int | None, pid: int | None = None) -> list[dict[str, Any]]:
    """The copy and alias events of ``table`` (a :class:`copytrace.tracefile.EventTable`)
    as complete events, ``ts``/``dur`` in µs from ``base_ns`` (ns since the epoch; None:
    the first event's start), on ``pid`` (None: each run's own process id, else 0)."""
    hazards = _hazards_by_span(table)
    skip = {*META_SPANS, "copytrace.step"}
    rows = [r for r in _rows(table) if r.get("op") and r["name"] not in skip]
    if not rows:
        return []
    base = base_ns if base_ns is not None else min(r["start_ns"] for r in rows)
    events: list[dict[str, Any]] = []
    threads: dict[tuple[Any, int], str] = {}
    for r in rows:
        proc = pid if pid is not None else _run_pid(r)
        tid = int(r.get("thread_id") or 0)
        if r.get("thread_name") == "MainThread" and proc:
            tid = proc  # the main thread's OS id is the process id: the profiler's own track
        args = {k: r[k] for k in ARG_COLUMNS if r.get(k) not in (None, "", [])}
        if r.get("span_id") in hazards:
            args["hazards"] = hazards[r["span_id"]]
        events.append({
            "ph": "X", "cat": "copytrace", "name": f"copytrace::{r['op']}",
            "pid": proc, "tid": tid, "ts": (r["start_ns"] - base) / 1000,
            "dur": max(0, r["end_ns"] - r["start_ns"]) / 1000, "args": args,
        })  # fmt: skip
        threads.setdefault((proc, tid), r.get("thread_name") or f"thread {tid}")
    for (proc, tid), name in threads.items():
        events.append({"ph": "M", "name": "thread_name", "pid": proc, "tid": tid,
                       "args": {"name": f"{name} (copytrace)"}})  # fmt: skip
    return events


def _run_pid(row: dict[str, Any]) -> int:
    try:
        return int(json.loads(row.get("attrs_json") or "{}").get("process.pid", 0))
    except (ValueError, TypeError):
        return 0


def write_chrome_trace(table: Any, out: Path) -> int:
    """Write ``table``'s events alone as a Chrome trace; returns the slices written."""
    events = chrome_events(table, None)
    doc = {"traceEvents": events, "displayTimeUnit": "ms"}
    out.write_text(json.dumps(doc))
    return sum(1 for e in events if e["ph"] == "X")


def read_profiler(profiler: Path) -> dict[str, Any]:
    """torch.profiler's Chrome trace (``export_chrome_trace``) in ``profiler``, checked
    before any trace is read.

    Raises:
        ValueError: one line naming the file: it is not JSON text, has no ``traceEvents``
            list of objects, or no ``baseTimeNanoseconds`` (torch.profiler's clock).
        OSError: the file cannot be read.
    """
    try:
        doc = json.loads(profiler.read_bytes())
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{profiler} is not JSON ({err})") from None
    events = doc.get("traceEvents") if isinstance(doc, dict) else None
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise ValueError(f"{profiler} is not a Chrome trace (no traceEvents)")
    if not isinstance(doc.get("baseTimeNanoseconds"), int):
        raise ValueError(f"{profiler} has no baseTimeNanoseconds (not torch.profiler's?)")
    return doc


def merge_into_profiler(table: Any, doc: dict[str, Any], out: Path) -> int:
    """Write torch.profiler's Chrome trace ``doc`` (from :func:`read_profiler`) with
    ``table``'s events added on its clock, each on the profiler's own process and thread
    track where their ids match; returns the slices added."""
    base = doc["baseTimeNanoseconds"]
    pids = {e.get("pid") for e in doc["traceEvents"] if e.get("cat") == "cpu_op"}
    pid = next(iter(pids)) if len(pids) == 1 else None
    events = chrome_events(table, base, pid)
    doc["traceEvents"].extend(events)
    out.write_text(json.dumps(doc))
    return sum(1 for e in events if e["ph"] == "X")
