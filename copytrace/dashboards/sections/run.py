"""Run details: one :class:`RunInfo` per traced process, and the order runs are shown in."""

from __future__ import annotations

import datetime as _dt
from typing import Any

from copytrace.dashboards._format import as_int, as_str, opt_int
from copytrace.dashboards._pack import Strings
from copytrace.dashboards._query import Query, RunMeta
from copytrace.dashboards._rows import RunInfo

__all__ = ["payload_runs", "payload_warnings", "run_infos", "run_devices"]


def _label(rank: int | None, pid: int | None, index: int) -> str:
    if rank is not None:
        return f"rank {rank}" + (f" (pid {pid})" if pid is not None else "")
    return f"pid {pid}" if pid is not None else f"run {index}"


def _command(meta: RunMeta) -> str:
    """The run span's command (the program's argv), else the program's part of the
    resource's (a trace cut short has no run span; under ``copytrace run`` the resource
    holds copytrace's own command: ``tracefile.resource_command``)."""
    argv = meta.attrs.get("process.command_args")
    if isinstance(argv, list):
        return " ".join(str(a) for a in argv)
    if argv:
        return as_str(argv)
    from copytrace.tracefile import resource_command

    return resource_command(meta.resource)


def _info(meta: RunMeta, index: int) -> RunInfo:
    res, attrs = meta.resource, meta.attrs
    pid = opt_int(res.get("process.pid", attrs.get("process.pid")))
    rank = None
    for key in ("copytrace.rank", "rank", "process.rank"):
        rank = opt_int(attrs.get(key, res.get(key)))
        if rank is not None:
            break
    steps_attr = opt_int(attrs.get("copytrace.steps"))
    return RunInfo(
        label=_label(rank, pid, index),
        trace_id=meta.trace_id,
        pid=pid,
        rank=rank,
        host=as_str(res.get("host.name")),
        command=_command(meta),
        torch_version=as_str(attrs.get("copytrace.torch_version")),
        copytrace_version=as_str(attrs.get("copytrace.version")),
        start_ns=meta.start_ns,
        duration_ns=meta.duration_ns,
        events_recorded=opt_int(attrs.get("copytrace.events")),
        events_loaded=meta.spans,
        events_dropped=as_int(attrs.get("copytrace.events_dropped")),
        errors=as_int(attrs.get("copytrace.errors")),
        internal_detaches=as_int(attrs.get("copytrace.internal_detaches")),
        steps=steps_attr if steps_attr is not None else len(meta.steps),
        complete=meta.has_run_span,
        overhead_ns=opt_int(attrs.get("copytrace.overhead_ns")),
        events_discarded=as_int(attrs.get("copytrace.events_discarded")),
        files=[str(f) for f in meta.files],
        windows=[str(w) for w in attrs.get("copytrace.windows") or []],
        ring=opt_int(attrs.get("copytrace.ring")),
        ring_reason=as_str(attrs.get("copytrace.ring_reason")),
        ring_skipped=as_int(attrs.get("copytrace.ring_skipped")),
    )


def run_infos(q: Query) -> list[RunInfo]:
    """Describe the runs of ``q`` and put them (and ``q``'s event table) in report order:
    ranks in order, then processes by start time. Labels are made unique."""
    infos = [_info(meta, i) for i, meta in enumerate(q.runs)]
    seen: set[str] = set()
    for i, info in enumerate(infos):  # labels key per-run data: keep them unique
        if info.label in seen:
            info.label = f"{info.label} {info.host or ''} #{i}".replace("  ", " ")
        seen.add(info.label)
    order = sorted(
        range(len(infos)),
        key=lambda i: (infos[i].rank is None, infos[i].rank or 0, infos[i].start_ns,
                       infos[i].pid or 0, infos[i].trace_id),
    )  # fmt: skip
    q.build_events(order)
    return [infos[i] for i in order]


def run_devices(q: Query, runs: list[RunInfo]) -> None:
    """Fill in each run's devices (from its events), ``cpu`` first."""
    found: dict[int, set[str]] = {}
    for run_idx, dev in q.sql(
        "SELECT DISTINCT run_idx, d FROM (SELECT run_idx, src_device AS d FROM ev "
        "UNION ALL SELECT run_idx, dst_device FROM ev) WHERE d <> ''"
    ):
        found.setdefault(run_idx, set()).add(dev)
    for i, info in enumerate(runs):
        info.devices = sorted(found.get(i, ()), key=lambda d: (d != "cpu", d))


# --- the page's payload ------------------------------------------------------------------------
def _started(start_ns: int | None) -> str:
    if not start_ns:
        return ""
    return _dt.datetime.fromtimestamp(start_ns / 1e9, tz=_dt.timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S UTC"
    )


def payload_runs(model: Any, S: Strings) -> list[dict[str, Any]]:
    """The run details of the page's payload: one dict per run (strings as ``S`` indices)."""
    return [
        {
            "label": S(r.label),
            "rank": r.rank,
            "pid": r.pid,
            "host": S(r.host),
            "command": S(r.command),
            "torch": S(r.torch_version),
            "copytrace": S(r.copytrace_version),
            "start": _started(r.start_ns),
            "duration_ns": r.duration_ns,
            "events_recorded": r.events_recorded,
            "events_loaded": r.events_loaded,
            "dropped": r.events_dropped,
            "discarded": r.events_discarded,
            "errors": r.errors,
            "internal_detaches": r.internal_detaches,
            "steps": r.steps,
            "complete": r.complete,
            "overhead_ns": r.overhead_ns,
            "devices": [S(d) for d in r.devices],
            "files": [S(f) for f in r.files],
            "windows": [S(w) for w in r.windows],
        }
        for r in model.runs
    ]


def payload_warnings(model: Any) -> list[str]:
    """The page's warnings: unreadable lines, dropped or discarded events, internal errors,
    runs without a run span, a failed analysis."""
    out = []
    if model.bad_lines:
        out.append(f"{model.bad_lines} unreadable line(s) were skipped (file cut mid-write?).")
    for r in model.runs:
        if r.ring:
            out.append(f"{r.label}: {r.ring_line()}.")
        if r.events_dropped:
            out.append(f"{r.label}: {r.events_dropped:,} event(s) dropped at the buffer cap; "
                       "totals are lower bounds.")  # fmt: skip
        if r.events_discarded:
            out.append(f"{r.label}: {r.events_discarded:,} recorded event(s) were discarded "
                       "and are not in the trace; totals are lower bounds.")  # fmt: skip
        if r.errors:
            out.append(f"{r.label}: {r.errors:,} internal copytrace error(s) were caught.")
        if not r.complete:
            out.append(f"{r.label}: no run span (tracing did not stop cleanly); "
                       "run metadata is incomplete.")  # fmt: skip
    if model.analysis.startswith("failed"):
        out.append(f"hazard analysis {model.analysis}")
    return out
