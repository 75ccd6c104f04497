"""Turn a :class:`~copytrace.dashboards._model.ReportModel` into the compact JSON the page reads.

The page (``report.js``) builds every figure in the browser from this payload, so the HTML
file holds each fact once: strings sit in one table (``S``) and everything else refers to
them by index; events are columns of numbers that index a table of event templates. Only a
sample of the events is shipped (see :func:`~copytrace.dashboards._model.sample_events`);
all counts, bytes and times come from aggregates over every event.
"""

from __future__ import annotations

import datetime as _dt
import json
from typing import Any

from copytrace.dashboards._model import (
    KINDS,
    LARGE_EVENT_BYTES,
    MAX_TIMELINE_POINTS,
    STAGES,
    EventTemplate,
    ReportModel,
    SampleInfo,
    format_bytes,
    sample_events,
)

__all__ = ["build_payload", "dump_payload", "MAX_TIMELINE_POINTS", "OP_PALETTE"]

#: Op colours, assigned to ops in order of bytes copied, then count.
OP_PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
    "#17becf", "#bcbd22", "#7f7f7f", "#393b79", "#ad494a", "#637939", "#7b4173",
    "#3182bd", "#e6550d", "#31a354", "#756bb1",
)  # fmt: skip
_TEMPLATE_STR_FIELDS = (
    "op", "dtype", "src_dtype", "src_device", "dst_device", "transfer", "graph", "grad_fn",
    "phase", "module", "call_site", "thread", "group", "error", "via", "origin",
)  # fmt: skip


class _Strings:
    """A string table: each distinct string stored once, referred to by index."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self.index: dict[str, int] = {}

    def __call__(self, s: Any) -> int:
        s = "" if s is None else str(s)
        i = self.index.get(s)
        if i is None:
            i = self.index[s] = len(self.items)
            self.items.append(s)
        return i


def _r(x: float, nd: int = 3) -> float:
    """Round for JSON size; keeps ints short (``1.0`` -> ``1``)."""
    v = round(float(x), nd)
    return int(v) if v.is_integer() else v


def _warnings(model: ReportModel) -> list[str]:
    out = []
    if model.bad_lines:
        out.append(f"{model.bad_lines} unreadable line(s) were skipped (file cut mid-write?).")
    for r in model.runs:
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


def build_payload(
    model: ReportModel,
    *,
    title: str,
    max_points: int = MAX_TIMELINE_POINTS,
    version: str = "",
) -> dict[str, Any]:
    """Build the page's data: strings table, aggregates, steps, sampled events, hazards.

    Args:
        model: What :func:`~copytrace.dashboards.build_model` returned.
        title: Page title.
        max_points: Timeline point budget (hazard and error events are kept beyond it).
        version: copytrace version for the footer.

    Returns:
        A JSON-serialisable dict (times in ns unless a key ends in ``_ms``, bytes in bytes).
    """
    S = _Strings()
    S("")  # index 0 is the empty string
    kinds = list(KINDS)
    stages = list(STAGES)

    # Ops: colour in order of bytes copied, then events.
    ops_sorted = sorted(model.ops, key=lambda o: (-o.bytes_copied, -o.count, o.op))
    op_color = {o.op: OP_PALETTE[i % len(OP_PALETTE)] for i, o in enumerate(ops_sorted)}

    runs = [
        {
            "label": S(r.label),
            "rank": r.rank,
            "pid": r.pid,
            "host": S(r.host),
            "command": S(r.command),
            "torch": S(r.torch_version),
            "copytrace": S(r.copytrace_version),
            "start": _dt.datetime.fromtimestamp(r.start_ns / 1e9, tz=_dt.timezone.utc).strftime(
                "%Y-%m-%d %H:%M:%S UTC"
            )
            if r.start_ns
            else "",
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
        }
        for r in model.runs
    ]

    cube_cols: dict[str, list[Any]] = {k: [] for k in (
        "run", "module", "site", "op", "kind", "graph", "phase", "via", "n", "bc", "ba", "bl", "t",
        "err"
    )}  # fmt: skip
    for c in model.cube:
        cube_cols["run"].append(c.run)
        cube_cols["module"].append(S(c.module))
        cube_cols["site"].append(S(c.call_site))
        cube_cols["op"].append(S(c.op))
        cube_cols["kind"].append(kinds.index(c.kind))
        cube_cols["graph"].append(S(c.graph))
        cube_cols["phase"].append(S(c.phase))
        cube_cols["via"].append(S(c.via))
        cube_cols["n"].append(c.count)
        cube_cols["bc"].append(c.bytes_copied)
        cube_cols["ba"].append(c.bytes_allocated)
        cube_cols["bl"].append(c.bytes_logical)
        cube_cols["t"].append(c.time_ns)
        cube_cols["err"].append(c.errors)

    sites = {
        S(row.key): {"label": S(row.label), "source": S(row.source)} for row in model.call_sites
    }

    run_index = {r.label: i for i, r in enumerate(model.runs)}
    step_cols: dict[str, list[Any]] = {k: [] for k in (
        "run", "step", "dur", "stage", "ev", "nc", "na", "nn", "bc", "ba", "ct", "start", "end"
    )}  # fmt: skip
    for s in model.steps:
        step_cols["run"].append(run_index[s.run])
        step_cols["step"].append(s.step)
        step_cols["dur"].append(s.duration_ns)
        step_cols["stage"].append(stages.index(s.stage))
        step_cols["ev"].append(s.events)
        step_cols["nc"].append(s.copy_count)
        step_cols["na"].append(s.alias_count)
        step_cols["nn"].append(s.noop_count)
        step_cols["bc"].append(s.bytes_copied)
        step_cols["ba"].append(s.bytes_allocated)
        step_cols["ct"].append(s.copy_time_ns)
        step_cols["start"].append(None if s.start_ms is None else _r(s.start_ms))
        step_cols["end"].append(None if s.end_ms is None else _r(s.end_ms))

    transfer_rows = [
        {
            "run": run,
            "src": S(t.src_device),
            "dst": S(t.dst_device),
            "kind": S(t.transfer),
            "n": t.count,
            "nc": t.copy_count,
            "ba": t.bytes_allocated,
            "bl": t.bytes_logical,
            "nb": t.non_blocking_count,
            "pin": t.pinned_count,
            "pin_known": t.pinned_known,
            "t": t.time_ns,
        }
        for run, t in model.transfers_by_run
    ]

    # Timeline sample and the templates it uses.
    info = SampleInfo()
    chosen = sample_events(model, max_points, info=info)
    tpl_map: dict[int, int] = {}
    tpl_rows: list[EventTemplate] = []
    pts: dict[str, list[Any]] = {k: [] for k in ("run", "t", "d", "step", "tpl", "hz")}
    ev_run, ev_t, ev_dur, ev_step = model.ev_run, model.ev_t_ns, model.ev_dur_ns, model.ev_step
    ev_tpl, ev_hz = model.ev_tpl, model.ev_hazard
    for i in chosen:
        ti = ev_tpl[i]
        j = tpl_map.get(ti)
        if j is None:
            j = tpl_map[ti] = len(tpl_rows)
            tpl_rows.append(model.templates[ti])
        pts["run"].append(ev_run[i])
        pts["t"].append(_r(ev_t[i] / 1e6))
        pts["d"].append(ev_dur[i])
        pts["step"].append(ev_step[i])
        pts["tpl"].append(j)
        pts["hz"].append(ev_hz[i])
    tpl_cols: dict[str, list[Any]] = {f: [] for f in _TEMPLATE_STR_FIELDS}
    tpl_cols.update(kind=[], ba=[], bl=[], shape=[], nb=[], pinned=[], aten=[])
    for t in tpl_rows:
        for f in _TEMPLATE_STR_FIELDS:
            tpl_cols[f].append(S(getattr(t, f)))
        tpl_cols["kind"].append(kinds.index(t.kind))
        tpl_cols["ba"].append(t.bytes_allocated)
        tpl_cols["bl"].append(t.bytes_logical)
        tpl_cols["shape"].append(S("[" + ", ".join(str(d) for d in t.shape) + "]"))
        tpl_cols["nb"].append(1 if t.non_blocking else 0)
        tpl_cols["pinned"].append(None if t.pinned is None else int(t.pinned))
        tpl_cols["aten"].append(S(", ".join(t.aten)))

    hazards = [
        {
            "code": S(h.code),
            "severity": S(h.severity),
            "message": S(h.message),
            "fix": S(h.fix),
            "sites": [S(s) for s in h.call_sites],
            "bytes": h.bytes,
            "steps": h.steps[:2000],
            "n_steps": len(h.steps),
            "events": len(h.event_ids),
            "source": S(h.source),
            "runs": [S(r) for r in h.runs],
        }
        for h in model.hazards
    ]
    groups = [
        {
            "run": run_index[g.run],
            "step": g.step,
            "type": S(g.object_type),
            "tensors": g.tensors,
            "ba": g.bytes_allocated,
            "t": g.duration_ns,
            "site": S(g.call_site),
        }
        for g in model.groups[:500]
    ]
    t = model.totals
    payload: dict[str, Any] = {
        "v": 1,
        "title": title,
        "version": version,
        "generated": _dt.datetime.now(tz=_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "files": [S(f) for f in model.files],
        "warnings": _warnings(model),
        "analysis": model.analysis,
        "kinds": kinds,
        "stages": stages,
        "runs": runs,
        "totals": {
            "events": t.events,
            "copies": t.copy_count,
            "aliases": t.alias_count,
            "noops": t.noop_count,
            "errors": t.error_count,
            "groups": t.group_count,
            "bc": t.bytes_copied,
            "ba": t.bytes_allocated,
            "bl": t.bytes_logical,
            "t": t.copy_time_ns,
            "t_kind": [t.time_by_kind_ns[k] for k in kinds],
            "xdev_n": t.cross_device_count,
            "xdev_b": t.cross_device_bytes,
            "hazards": t.hazard_count,
        },
        "stage_stats": {
            name: {
                "steps": st.steps,
                "step_t": st.step_time_ns,
                "ct": st.copy_time_ns,
                "share": _r(st.share_pct, 4),
                "median": None if st.median_share_pct is None else _r(st.median_share_pct, 4),
                "bc": st.bytes_copied,
                "bc_step": _r(st.bytes_per_step, 1),
                "ev_step": _r(st.events_per_step, 2),
            }
            for name, st in model.stages.items()
        },
        "op_colors": {S(op): c for op, c in op_color.items()},
        "cube": cube_cols,
        "sites": sites,
        "steps": step_cols,
        "transfers": transfer_rows,
        "tpl": tpl_cols,
        "pts": pts,
        "sample": {
            "shown": len(chosen),
            "total": model.n_events,
            "max_points": max_points,
            "large": (
                f"at least {format_bytes(info.large_bytes)}"
                if info.large_bytes == LARGE_EVENT_BYTES
                else f"larger than {format_bytes(info.large_bytes - 1)}"
            ),
            "per_hazard": info.per_hazard,
        },
        "hazards": hazards,
        "groups": groups,
        "n_groups": len(model.groups),
    }
    payload["S"] = S.items
    return payload


def dump_payload(payload: dict[str, Any]) -> str:
    """Serialise the payload for a ``<script type="application/json">`` element.

    ``<``, ``>`` and ``&`` are written as ``\\u003c``, ``\\u003e``, ``\\u0026`` (and U+2028,
    U+2029 escaped), so no string from the trace can close the element or start markup.

    Args:
        payload: What :func:`build_payload` returned.

    Returns:
        Compact JSON text, safe inside a script element.
    """
    text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return (
        text.replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )
