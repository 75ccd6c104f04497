"""What one run costs, per call site, module and op: the aggregates a diff compares.

Built from the event table (:class:`copytrace.tracefile.EventTable`) with pyarrow's grouped
sums, so no Python object is made per event: one per (key, step) group.

Counting rules (the same as ``copytrace check``): a **copy** is an event that is neither an
alias nor a no-op and whose call did not raise; deepcopy group spans are left out (their
tensors are events of their own). **Bytes** are ``bytes_allocated`` of the copies (new
storage); ``bytes_logical`` is kept beside. **Copy time** is the copies' span durations (ns).

A run's **steps** are the steps that ended with a step call (``optimizer.step()`` or
``t.step()``): every ``copytrace.step`` span but the last, which is the tail after the last
call (a run of 20 optimizer steps has 20). Per-step values are the run's totals (set-up and
tail included) divided by that count; a run without step spans has one step per step number
of its events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from copytrace.schema import META_SPANS, SPAN_STEP

__all__ = ["METRICS", "KeyStats", "RunProfile", "SiteKey", "profile_events", "profile_table"]

#: The summed metrics of a key, in output order.
METRICS = ("copies", "aliases", "noops", "bytes", "bytes_logical", "time_ns")
_COLUMNS = ["run", "name", "step", "file", "line", "function", "op", "module", "alias", "noop",
            "error", "group", "bytes_allocated", "bytes_logical", "start_ns", "end_ns",
            "transfer"]  # fmt: skip


#: A call site: ``(file, line, function)``; ``("", 0, "")`` for events without one.
SiteKey = tuple[str, int, str]


@dataclass
class KeyStats:
    """The totals of one call site, module or op over a run.

    Attributes:
        copies, aliases, noops: Event counts.
        bytes: Bytes allocated by the copies.
        bytes_logical: Logical bytes of the copies.
        time_ns: Summed duration of the copies, ns.
        step_time_ns: Copy time per step number, ns (steps without a copy here absent).
        transfers: Copies per transfer direction (``h2d``, ``d2h``...; none left out).
        ops: Copies per op (call sites only).
    """

    copies: int = 0
    aliases: int = 0
    noops: int = 0
    bytes: int = 0
    bytes_logical: int = 0
    time_ns: int = 0
    step_time_ns: dict[int, int] = field(default_factory=dict)
    transfers: dict[str, int] = field(default_factory=dict)
    ops: dict[str, int] = field(default_factory=dict)


@dataclass
class RunProfile:
    """One run (one or more processes of one launch) as the diff sees it.

    Attributes:
        label: What the run was read from (path, and run number when chosen).
        steps: The step numbers of the run's steps (see the module doc), sorted.
        sites: Per call site.
        modules: Per module path (``""``: outside any module).
        ops: Per op.
        hazards: ``(code, severity, site, bytes, message)`` per finding and call site (its
            first call site; ``""`` for none).
        start_ns: The run's start, ns since the epoch (0 if unknown).
        sources: Source line per call site, when known (see :mod:`._source`).
        files: The trace files read.
        per_step: The run's totals per step number (every step number of its events,
            set-up and tail included; :attr:`steps` says which are steps).
    """

    label: str
    steps: list[int] = field(default_factory=list)
    sites: dict[SiteKey, KeyStats] = field(default_factory=dict)
    modules: dict[str, KeyStats] = field(default_factory=dict)
    ops: dict[str, KeyStats] = field(default_factory=dict)
    hazards: list[tuple[str, str, str, int, str]] = field(default_factory=list)
    start_ns: int = 0
    sources: dict[SiteKey, str] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    per_step: dict[int, KeyStats] = field(default_factory=dict)

    @property
    def n_steps(self) -> int:
        """Steps the per-step values divide by (at least 1)."""
        return max(1, len(self.steps))

    def totals(self) -> KeyStats:
        """The whole run's totals (over every call site)."""
        out = KeyStats()
        for s in self.sites.values():
            _merge(out, s)
        return out


def _merge(into: KeyStats, s: KeyStats) -> None:
    for m in METRICS:
        setattr(into, m, getattr(into, m) + getattr(s, m))
    for step, t in s.step_time_ns.items():
        into.step_time_ns[step] = into.step_time_ns.get(step, 0) + t
    for d, n in s.transfers.items():
        into.transfers[d] = into.transfers.get(d, 0) + n
    for op, n in s.ops.items():
        into.ops[op] = into.ops.get(op, 0) + n


def _event_rows(part: Any, trace_ids: list[str] | None) -> Any:
    """The event rows of one file as a pyarrow table with the derived columns."""
    return _derive(part.read([c for c in _COLUMNS if c != "run"] + ["run"]), trace_ids)


def _derive(tab: Any, trace_ids: list[str] | None) -> Any:
    """Event rows (columns :data:`_COLUMNS`) -> the summed columns, meta spans and deepcopy
    group spans left out."""
    import pyarrow as pa
    import pyarrow.compute as pc

    keep = pc.invert(pc.is_in(tab.column("name"), pa.array(sorted(META_SPANS))))
    keep = pc.and_(keep, pc.invert(pc.fill_null(tab.column("group"), False)))
    if trace_ids is not None:
        keep = pc.and_(keep, pc.is_in(tab.column("run"), pa.array(trace_ids)))
    tab = tab.filter(keep)
    alias = pc.fill_null(tab.column("alias"), False)
    noop = pc.fill_null(tab.column("noop"), False)
    failed = pc.not_equal(pc.fill_null(tab.column("error"), ""), "")
    is_copy = pc.invert(pc.or_(pc.or_(alias, noop), failed))
    zero = pa.scalar(0, pa.int64())
    ba = pc.fill_null(tab.column("bytes_allocated"), 0).cast(pa.int64())
    bl = pc.fill_null(tab.column("bytes_logical"), 0).cast(pa.int64())
    dur = pc.max_element_wise(pc.subtract(tab.column("end_ns"), tab.column("start_ns")), zero)
    return pa.table({
        "file": pc.fill_null(tab.column("file"), ""),
        "line": pc.fill_null(tab.column("line"), 0).cast(pa.int64()),
        "function": pc.fill_null(tab.column("function"), ""),
        "op": pc.fill_null(tab.column("op"), ""),
        "module": pc.fill_null(tab.column("module"), ""),
        "transfer": pc.fill_null(tab.column("transfer"), "none"),
        "step": pc.fill_null(tab.column("step"), -1).cast(pa.int64()),
        "copies": is_copy.cast(pa.int64()),
        "aliases": pc.and_(alias, pc.invert(noop)).cast(pa.int64()),
        "noops": noop.cast(pa.int64()),
        "bytes": pc.if_else(is_copy, ba, zero),
        "bytes_logical": pc.if_else(is_copy, bl, zero),
        "time_ns": pc.if_else(is_copy, dur, zero),
    })  # fmt: skip


def _grouped(rows: Any, keys: list[str]) -> list[dict[str, Any]]:
    """Sums of :data:`METRICS` per ``keys`` (one dict per group)."""
    agg = rows.group_by(keys).aggregate([(m, "sum") for m in METRICS])
    cols = {c: agg.column(c).to_pylist() for c in agg.column_names}
    n = agg.num_rows
    return [{(c[:-4] if c.endswith("_sum") else c): cols[c][i] for c in cols} for i in range(n)]


def _add_groups(target: dict[Any, KeyStats], groups: list[dict[str, Any]], key_of: Any) -> None:
    for g in groups:
        s = target.setdefault(key_of(g), KeyStats())
        for m in METRICS:
            setattr(s, m, getattr(s, m) + int(g[m] or 0))
        if g["time_ns"]:
            s.step_time_ns[g["step"]] = s.step_time_ns.get(g["step"], 0) + int(g["time_ns"])


def _add_part(prof: RunProfile, rows: Any, event_steps: set[int]) -> None:
    import pyarrow.compute as pc

    site = lambda g: (g["file"], int(g["line"]) if g["file"] else 0, g["function"])  # noqa: E731
    _add_groups(prof.sites, _grouped(rows, ["file", "line", "function", "step"]), site)
    _add_groups(prof.modules, _grouped(rows, ["module", "step"]), lambda g: g["module"])
    _add_groups(prof.ops, _grouped(rows, ["op", "step"]), lambda g: g["op"])
    _add_groups(prof.per_step, _grouped(rows, ["step"]), lambda g: g["step"])
    copies = rows.filter(pc.equal(rows.column("copies"), 1))
    for g in _grouped(copies, ["file", "line", "function", "op", "transfer"]):
        s = prof.sites[site(g)]
        s.ops[g["op"]] = s.ops.get(g["op"], 0) + int(g["copies"])
        if g["transfer"] not in ("none", ""):
            s.transfers[g["transfer"]] = s.transfers.get(g["transfer"], 0) + int(g["copies"])
    if rows.num_rows:
        event_steps.update(pc.unique(rows.column("step")).to_pylist())


def _span_steps(part: Any, trace_ids: list[str] | None) -> tuple[set[int], int]:
    """Step numbers of the step spans of one file, and the earliest span start."""
    import pyarrow as pa
    import pyarrow.compute as pc

    tab = part.read(["run", "name", "step", "start_ns"])
    if trace_ids is not None:
        tab = tab.filter(pc.is_in(tab.column("run"), pa.array(trace_ids)))
    start = pc.min(tab.column("start_ns")).as_py() if tab.num_rows else 0
    steps = tab.filter(pc.equal(tab.column("name"), SPAN_STEP)).column("step")
    return {s for s in steps.to_pylist() if s is not None and s >= 0}, start or 0


def profile_table(table: Any, label: str, trace_ids: list[str] | None = None) -> RunProfile:
    """Aggregate an event table into a :class:`RunProfile` (hazards and sources not filled).

    Args:
        table: A :class:`copytrace.tracefile.EventTable` (already restricted to one run).
        label: Shown in the output to name the run.
        trace_ids: Only these processes (ranks); default all of ``table``.
    """
    prof = RunProfile(label, files=list(table.files))
    event_steps: set[int] = set()
    span_steps: set[int] = set()
    starts = []
    for part in table.parts:
        if part.rows == 0:
            continue
        _add_part(prof, _event_rows(part, trace_ids), event_steps)
        found, start = _span_steps(part, trace_ids)
        span_steps |= found
        if start:
            starts.append(start)
    prof.start_ns = min(starts, default=0)
    if len(span_steps) >= 2:  # each step span but the last ended with a step() call
        prof.steps = sorted(span_steps)[:-1]
    else:
        prof.steps = sorted(s for s in event_steps if s >= 0)
    return prof


def profile_events(events: list[Any], label: str, start_ns: int = 0) -> RunProfile:
    """Aggregate recorded events (:class:`copytrace.CopyEvent`, e.g. ``t.events``) into a
    :class:`RunProfile`, counted as :func:`profile_table` counts a trace file's events.

    In memory there are no step spans: the steps are the step numbers of the events (one
    step for events all made in step 0).

    Args:
        events: The events.
        label: Names the run in the output.
        start_ns: When the run started, ns since the epoch (for :func:`read_sources`).
    """
    import pyarrow as pa

    cols = {c: [None if c in ("run", "name") else getattr(e, c, None) for e in events]
            for c in _COLUMNS}  # fmt: skip
    types = {"line": pa.int64(), "step": pa.int64(), "bytes_allocated": pa.int64(),
             "bytes_logical": pa.int64(), "start_ns": pa.int64(), "end_ns": pa.int64(),
             "alias": pa.bool_(), "noop": pa.bool_(), "group": pa.bool_()}  # fmt: skip
    tab = pa.table({c: pa.array(v, type=types.get(c, pa.string())) for c, v in cols.items()})
    tab = tab.set_column(tab.schema.get_field_index("name"), "name",
                         pa.array([""] * len(events), type=pa.string()))  # fmt: skip
    prof = RunProfile(label, start_ns=start_ns)
    steps: set[int] = set()
    _add_part(prof, _derive(tab, None), steps)
    prof.steps = sorted(s for s in steps if s >= 0)
    return prof


def add_hazards(prof: RunProfile, findings: list[Any]) -> None:
    """Fill :attr:`RunProfile.hazards` from :func:`copytrace.analysis.analyze` findings."""
    for f in findings:
        site = f.call_sites[0] if f.call_sites else ""
        prof.hazards.append((f.code, f.severity, site, int(f.bytes), f.message))
