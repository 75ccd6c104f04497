"""Turn a :class:`~copytrace.dashboards._load.TraceData` into plain report data.

Everything here is plain dataclasses (no plotly), shared by the HTML report and the
``summary`` command. Totals are sums over event spans that are not deepcopy groups
(``copytrace.group`` absent or false), so a group's children are not counted twice.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from copytrace.dashboards._load import Event, Run, TraceData

__all__ = [
    "GroupRow",
    "OpRow",
    "ReportModel",
    "RunInfo",
    "SiteRow",
    "StepRow",
    "TimelinePoint",
    "Totals",
    "TransferRow",
    "build_model",
    "call_site_of",
    "format_bytes",
    "format_ns",
    "top",
]

NO_MODULE = "(no module)"
UNKNOWN_SITE = "(unknown call site)"


@dataclass
class RunInfo:
    """Metadata of one traced process run.

    Attributes:
        label: Short display name, e.g. ``pid 4242`` or ``rank 1 (pid 4242)``.
        trace_id: OTLP trace id.
        pid: ``process.pid`` resource attribute, if any.
        rank: Distributed rank (resource/run attribute ``copytrace.rank`` or ``rank``), if any.
        host: ``host.name`` resource attribute, if any.
        command: ``process.command_args`` joined with spaces ('' if unknown).
        torch_version: ``copytrace.torch_version`` ('' if unknown).
        copytrace_version: ``copytrace.version`` ('' if unknown).
        start_ns: Run start, ns since the epoch.
        duration_ns: Run duration in ns.
        events_recorded: ``copytrace.events`` of the run span (groups included), or None.
        events_loaded: Event spans read from the file (groups included).
        events_dropped: Events dropped at the buffer cap.
        errors: Internal copytrace errors caught.
        internal_detaches: Autograd-internal ``aten::detach`` calls not recorded as events.
        steps: Number of steps (run span attribute, else step spans read).
        complete: Whether the ``copytrace.run`` span was read (False for a cut file).
        files: Trace file names (str) this run was read from.
    """

    label: str
    trace_id: str
    pid: int | None
    rank: int | None
    host: str
    command: str
    torch_version: str
    copytrace_version: str
    start_ns: int
    duration_ns: int
    events_recorded: int | None
    events_loaded: int
    events_dropped: int
    errors: int
    internal_detaches: int
    steps: int
    complete: bool
    files: list[str] = field(default_factory=list)


@dataclass
class Totals:
    """Sums over all non-group events of all runs.

    Attributes:
        events: Non-group events.
        bytes_allocated: New storage, bytes.
        bytes_logical: numel x element size of the results, bytes.
        copy_time_ns: Summed host-side duration of the events, ns.
        alias_count: Events whose result shares storage with the input.
        copy_count: Events that are neither aliases nor no-ops.
        noop_count: Events that returned their input object itself.
        error_count: Events whose op raised.
        group_count: Deepcopy group spans (not included in the other totals).
    """

    events: int = 0
    bytes_allocated: int = 0
    bytes_logical: int = 0
    copy_time_ns: int = 0
    alias_count: int = 0
    copy_count: int = 0
    noop_count: int = 0
    error_count: int = 0
    group_count: int = 0


@dataclass
class StepRow:
    """One step of one run.

    Attributes:
        run: Run label.
        step: Step number.
        duration_ns: Step duration in ns, or None when no step span was read.
        copy_count: Non-alias, non-no-op events.
        alias_count: Alias events.
        events: Non-group events.
        bytes_allocated: Bytes of new storage.
        copy_time_ns: Summed event duration, ns.
        copy_time_share_pct: ``copy_time_ns / duration_ns * 100``, or None without a duration.
    """

    run: str
    step: int
    duration_ns: int | None
    copy_count: int = 0
    alias_count: int = 0
    events: int = 0
    bytes_allocated: int = 0
    copy_time_ns: int = 0
    copy_time_share_pct: float | None = None


@dataclass
class SiteRow:
    """Aggregate over the events of one key (a call site, a module).

    Attributes:
        key: ``file:line function`` for a call site, a module path for a module.
        count: Non-group events.
        copy_count: Non-alias, non-no-op events.
        alias_count: Alias events.
        bytes_allocated: Bytes of new storage.
        bytes_logical: Logical bytes of the results.
        time_ns: Summed event duration, ns.
        ops: Event count per op.
    """

    key: str
    count: int = 0
    copy_count: int = 0
    alias_count: int = 0
    bytes_allocated: int = 0
    bytes_logical: int = 0
    time_ns: int = 0
    ops: dict[str, int] = field(default_factory=dict)


@dataclass
class OpRow:
    """Aggregate over the non-group events of one ``copytrace.op``.

    Attributes:
        op: The op name.
        count: Events.
        copy_count: Non-alias, non-no-op events.
        alias_count: Alias events.
        noop_count: No-op events.
        bytes_allocated: Bytes of new storage.
        bytes_logical: Logical bytes of the results.
        time_ns: Summed event duration, ns.
    """

    op: str
    count: int = 0
    copy_count: int = 0
    alias_count: int = 0
    noop_count: int = 0
    bytes_allocated: int = 0
    bytes_logical: int = 0
    time_ns: int = 0


@dataclass
class TransferRow:
    """Events from one device to another (``src_device -> dst_device``).

    Attributes:
        src_device: Input device, e.g. ``cpu``.
        dst_device: Result device, e.g. ``cuda:0``.
        transfer: ``none``, ``h2d``, ``d2h`` or ``d2d`` (the most common one seen).
        count: Non-group events.
        bytes_allocated: Bytes of new storage.
        bytes_logical: Logical bytes of the results (bytes moved, also for ``copy_``).
    """

    src_device: str
    dst_device: str
    transfer: str = "none"
    count: int = 0
    bytes_allocated: int = 0
    bytes_logical: int = 0


@dataclass
class GroupRow:
    """One deepcopy group span.

    Attributes:
        run: Run label.
        step: Step number, or None.
        object_type: Type of the deep-copied object.
        tensors: ``copytrace.tensors`` of the group (tensors copied), or the child count.
        children: Child events read.
        bytes_allocated: Sum over the children, bytes.
        duration_ns: Group span duration, ns.
        call_site: ``file:line function``.
    """

    run: str
    step: int | None
    object_type: str
    tensors: int
    children: int
    bytes_allocated: int
    duration_ns: int
    call_site: str


@dataclass(slots=True)
class TimelinePoint:
    """One non-group event placed on the timeline.

    Attributes:
        run: Run label.
        t_ms: Start time in ms since the run start.
        duration_ns: Host-side duration, ns.
        op: ``copytrace.op``.
        bytes_allocated: Bytes of new storage.
        bytes_logical: Logical bytes of the result.
        alias: Result shares storage with the input.
        noop: The call returned its input.
        phase: ``forward``, ``backward``, ``optimizer``, ``other`` ('' if unknown).
        aten: Aten overloads seen.
        shape: Result shape (empty if unknown).
        dtype: Result dtype ('' if unknown).
        src_dtype: Input dtype ('' if unknown).
        src_device: Input device ('' if unknown).
        dst_device: Result device ('' if unknown).
        transfer: ``none``, ``h2d``, ``d2h``, ``d2d`` ('' if unknown).
        graph: ``attached``, ``detached``, ``none`` ('' if unknown).
        module: ``nn.Module`` path ('' outside any module).
        call_site: ``file:line function``.
        step: Step number, or None.
        group: Type of the deep-copied object when the event is a deepcopy child, else ''.
        error: Exception type when the op raised, else ''.
    """

    run: str
    t_ms: float
    duration_ns: int
    op: str
    bytes_allocated: int
    bytes_logical: int
    alias: bool
    noop: bool
    phase: str
    aten: list[str]
    shape: list[int]
    dtype: str
    src_dtype: str
    src_device: str
    dst_device: str
    transfer: str
    graph: str
    module: str
    call_site: str
    step: int | None
    group: str
    error: str


@dataclass
class ReportModel:
    """Plain data behind the HTML report and the text summary.

    Attributes:
        runs: One entry per traced process run.
        totals: Sums over non-group events.
        bad_lines: Unreadable lines skipped while loading.
        files: Trace file paths (str) read.
        steps: Per-step rows, ordered by run then step.
        call_sites: Per call site, sorted by bytes allocated (desc).
        modules: Per ``nn.Module`` path (``(no module)`` outside any), by bytes (desc).
        ops: Per op, sorted by bytes allocated (desc).
        transfers: Per (src_device, dst_device), sorted by logical bytes (desc).
        groups: Deepcopy groups, in time order.
        timeline: Non-group events in time order.
        step_bounds_ms: Per run label, ``(step, start_ms, end_ms)`` since the run start.
    """

    runs: list[RunInfo]
    totals: Totals
    bad_lines: int
    files: list[str]
    steps: list[StepRow]
    call_sites: list[SiteRow]
    modules: list[SiteRow]
    ops: list[OpRow]
    transfers: list[TransferRow]
    groups: list[GroupRow]
    timeline: list[TimelinePoint]
    step_bounds_ms: dict[str, list[tuple[int, float, float]]]

    @property
    def multi_run(self) -> bool:
        """Whether the trace holds more than one process run."""
        return len(self.runs) > 1

    def top_call_sites(self, by: str = "bytes_allocated", n: int = 20) -> list[SiteRow]:
        """Return the top ``n`` call sites by ``by`` (``bytes_allocated``, ``time_ns``, ``count``)."""
        return top(self.call_sites, by, n)

    def top_modules(self, by: str = "bytes_allocated", n: int = 20) -> list[SiteRow]:
        """Return the top ``n`` modules by ``by`` (``bytes_allocated``, ``time_ns``, ``count``)."""
        return top(self.modules, by, n)


def top(rows: Iterable[Any], by: str, n: int) -> list[Any]:
    """Return the ``n`` rows with the largest attribute ``by``; ties keep key order.

    Args:
        rows: Rows with the attribute ``by`` and a ``key`` or ``op`` attribute.
        by: Attribute name to sort on, e.g. ``bytes_allocated`` (bytes) or ``time_ns`` (ns).
        n: Maximum number of rows returned.

    Returns:
        The rows, largest first.
    """

    def order(row: Any) -> tuple[Any, str]:
        return (-getattr(row, by), str(getattr(row, "key", getattr(row, "op", ""))))

    return sorted(rows, key=order)[: max(0, n)]


def _int(value: Any, default: int = 0) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return default
    return default


def _opt_int(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def _str(value: Any) -> str:
    return "" if value is None else str(value)


def _strlist(value: Any) -> list[str]:
    if isinstance(value, list):
        return [str(v) for v in value]
    return [] if value is None else [str(value)]


def call_site_of(attrs: dict[str, Any]) -> str:
    """Return the ``file:line function`` call-site key of an event's attributes.

    Args:
        attrs: Event span attributes (``code.file.path``, ``code.line.number``,
            ``code.function.name``).

    Returns:
        e.g. ``train.py:42 main``, or ``(unknown call site)`` without a file path.
    """
    path = attrs.get("code.file.path")
    if not path:
        return UNKNOWN_SITE
    line = attrs.get("code.line.number")
    func = attrs.get("code.function.name")
    site = f"{path}:{line}" if line is not None else str(path)
    return f"{site} {func}" if func else site


def _run_info(run: Run, index: int) -> RunInfo:
    res, attrs = run.resource, run.attrs
    pid = _opt_int(res.get("process.pid", attrs.get("process.pid")))
    rank = None
    for key in ("copytrace.rank", "rank", "process.rank"):
        rank = _opt_int(attrs.get(key, res.get(key)))
        if rank is not None:
            break
    if rank is not None:
        label = f"rank {rank}" + (f" (pid {pid})" if pid is not None else "")
    elif pid is not None:
        label = f"pid {pid}"
    else:
        label = f"run {index}"
    argv = attrs.get("process.command_args", res.get("process.command_args"))
    if isinstance(argv, list):
        command = " ".join(str(a) for a in argv)
    else:
        command = _str(argv or res.get("process.command_line"))
    steps_attr = _opt_int(attrs.get("copytrace.steps"))
    return RunInfo(
        label=label,
        trace_id=run.trace_id,
        pid=pid,
        rank=rank,
        host=_str(res.get("host.name")),
        command=command,
        torch_version=_str(attrs.get("copytrace.torch_version")),
        copytrace_version=_str(attrs.get("copytrace.version")),
        start_ns=run.start_ns,
        duration_ns=run.duration_ns,
        events_recorded=_opt_int(attrs.get("copytrace.events")),
        events_loaded=len(run.events),
        events_dropped=_int(attrs.get("copytrace.events_dropped")),
        errors=_int(attrs.get("copytrace.errors")),
        internal_detaches=_int(attrs.get("copytrace.internal_detaches")),
        steps=steps_attr if steps_attr is not None else len(run.steps),
        complete=run.has_run_span,
        files=[str(f) for f in run.files],
    )


def _add(row: Any, ev: Event, alias: bool, noop: bool) -> None:
    """Add one non-group event to a SiteRow/OpRow-like aggregate."""
    row.count += 1
    if alias:
        row.alias_count += 1
    elif not noop:
        row.copy_count += 1
    if noop and hasattr(row, "noop_count"):
        row.noop_count += 1
    row.bytes_allocated += _int(ev.attrs.get("copytrace.bytes_allocated"))
    row.bytes_logical += _int(ev.attrs.get("copytrace.bytes_logical"))
    row.time_ns += ev.duration_ns


def build_model(trace: TraceData) -> ReportModel:
    """Aggregate a loaded trace into the data shown by the report.

    Args:
        trace: What :func:`load_trace` returned.

    Returns:
        Run metadata, totals (over non-group events only; bytes in bytes, times in ns),
        per-step rows, per call site / module / op / device-pair aggregates, deepcopy
        groups and timeline points (ms since each run's start).
    """
    runs = [_run_info(run, i) for i, run in enumerate(trace.runs)]
    seen_labels: set[str] = set()
    for i, info in enumerate(runs):  # labels key per-run data: keep them unique
        if info.label in seen_labels:
            info.label = f"{info.label} {info.host or ''} #{i}".replace("  ", " ")
        seen_labels.add(info.label)
    totals = Totals()
    steps: list[StepRow] = []
    sites: dict[str, SiteRow] = {}
    modules: dict[str, SiteRow] = {}
    ops: dict[str, OpRow] = {}
    transfers: dict[tuple[str, str], TransferRow] = {}
    transfer_kinds: dict[tuple[str, str], dict[str, int]] = {}
    groups: list[GroupRow] = []
    timeline: list[TimelinePoint] = []
    bounds: dict[str, list[tuple[int, float, float]]] = {}

    pairs = sorted(  # ranks in order, then processes by start time
        zip(trace.runs, runs, strict=True),
        key=lambda ri: (
            ri[1].rank is None,
            ri[1].rank or 0,
            ri[1].start_ns,
            ri[1].pid or 0,
            ri[1].trace_id,
        ),
    )
    runs = [info for _, info in pairs]
    for run, info in pairs:
        label = info.label
        step_rows: dict[int, StepRow] = {}
        for s in run.steps:
            step_rows[s.step] = StepRow(run=label, step=s.step, duration_ns=s.duration_ns)
        bounds[label] = [
            (s.step, (s.start_ns - run.start_ns) / 1e6, (s.end_ns - run.start_ns) / 1e6)
            for s in run.steps
        ]
        group_events = {ev.span_id: ev for ev in run.events if ev.is_group}
        group_children: dict[str, list[Event]] = {gid: [] for gid in group_events}

        for ev in run.events:
            a = ev.attrs
            step = _opt_int(a.get("copytrace.step"))
            if ev.is_group:
                totals.group_count += 1
                continue
            alias = a.get("copytrace.alias") is True
            noop = a.get("copytrace.noop") is True
            b_alloc = _int(a.get("copytrace.bytes_allocated"))
            b_log = _int(a.get("copytrace.bytes_logical"))
            dur = ev.duration_ns
            op = ev.op
            site = call_site_of(a)
            module = _str(a.get("copytrace.module"))
            parent_group = group_events.get(ev.parent_id or "")
            if parent_group is not None:
                group_children[parent_group.span_id].append(ev)

            totals.events += 1
            totals.bytes_allocated += b_alloc
            totals.bytes_logical += b_log
            totals.copy_time_ns += dur
            if alias:
                totals.alias_count += 1
            elif not noop:
                totals.copy_count += 1
            if noop:
                totals.noop_count += 1
            if a.get("copytrace.error"):
                totals.error_count += 1

            if step is not None:
                row = step_rows.get(step)
                if row is None:
                    row = step_rows[step] = StepRow(run=label, step=step, duration_ns=None)
                row.events += 1
                if alias:
                    row.alias_count += 1
                elif not noop:
                    row.copy_count += 1
                row.bytes_allocated += b_alloc
                row.copy_time_ns += dur

            _add(sites.setdefault(site, SiteRow(site)), ev, alias, noop)
            mod_row = modules.setdefault(module or NO_MODULE, SiteRow(module or NO_MODULE))
            _add(mod_row, ev, alias, noop)
            sites[site].ops[op] = sites[site].ops.get(op, 0) + 1
            mod_row.ops[op] = mod_row.ops.get(op, 0) + 1
            _add(ops.setdefault(op, OpRow(op)), ev, alias, noop)

            src, dst = _str(a.get("copytrace.src_device")), _str(a.get("copytrace.dst_device"))
            if src or dst:
                key = (src or "?", dst or "?")
                tr = transfers.setdefault(key, TransferRow(*key))
                tr.count += 1
                tr.bytes_allocated += b_alloc
                tr.bytes_logical += b_log
                kind = _str(a.get("copytrace.transfer")) or "none"
                kinds = transfer_kinds.setdefault(key, {})
                kinds[kind] = kinds.get(kind, 0) + 1

            timeline.append(
                TimelinePoint(
                    run=label,
                    t_ms=(ev.start_ns - run.start_ns) / 1e6,
                    duration_ns=dur,
                    op=op,
                    bytes_allocated=b_alloc,
                    bytes_logical=b_log,
                    alias=alias,
                    noop=noop,
                    phase=_str(a.get("copytrace.phase")),
                    aten=_strlist(a.get("copytrace.aten")),
                    shape=[_int(d) for d in a.get("copytrace.shape") or []]
                    if isinstance(a.get("copytrace.shape"), list)
                    else [],
                    dtype=_str(a.get("copytrace.dtype")),
                    src_dtype=_str(a.get("copytrace.src_dtype")),
                    src_device=src,
                    dst_device=dst,
                    transfer=_str(a.get("copytrace.transfer")),
                    graph=_str(a.get("copytrace.graph")),
                    module=module,
                    call_site=site,
                    step=step,
                    group=_str(parent_group.attrs.get("copytrace.object_type"))
                    if parent_group is not None
                    else "",
                    error=_str(a.get("copytrace.error")),
                )
            )

        for row in step_rows.values():
            if row.duration_ns:
                row.copy_time_share_pct = row.copy_time_ns / row.duration_ns * 100.0
        steps.extend(sorted(step_rows.values(), key=lambda r: r.step))

        for gid, gev in group_events.items():
            children = group_children[gid]
            tensors = _opt_int(gev.attrs.get("copytrace.tensors"))
            groups.append(
                GroupRow(
                    run=label,
                    step=_opt_int(gev.attrs.get("copytrace.step")),
                    object_type=_str(gev.attrs.get("copytrace.object_type")) or "?",
                    tensors=tensors if tensors is not None else len(children),
                    children=len(children),
                    bytes_allocated=sum(
                        _int(c.attrs.get("copytrace.bytes_allocated")) for c in children
                    ),
                    duration_ns=gev.duration_ns,
                    call_site=call_site_of(gev.attrs),
                )
            )

    for key, tr in transfers.items():
        kinds = transfer_kinds[key]
        tr.transfer = max(sorted(kinds), key=lambda k: kinds[k])

    def by_bytes(rows: Iterable[Any]) -> list[Any]:
        return top(rows, "bytes_allocated", 1 << 62)

    return ReportModel(
        runs=runs,
        totals=totals,
        bad_lines=trace.bad_lines,
        files=[str(Path(f)) for f in trace.files],
        steps=steps,
        call_sites=by_bytes(sites.values()),
        modules=by_bytes(modules.values()),
        ops=by_bytes(ops.values()),
        transfers=sorted(
            transfers.values(),
            key=lambda t: (-t.bytes_logical, -t.count, t.src_device, t.dst_device),
        ),
        groups=groups,
        timeline=timeline,
        step_bounds_ms=bounds,
    )


def format_bytes(n: int | float) -> str:
    """Format a byte count for people, e.g. ``31000`` -> ``30.3 KiB``.

    Args:
        n: Bytes.

    Returns:
        The value in B, KiB, MiB, GiB or TiB (powers of 1024).
    """
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_ns(ns: int | float | None) -> str:
    """Format a duration for people, e.g. ``11600000`` -> ``11.60 ms``.

    Args:
        ns: Duration in ns, or None.

    Returns:
        The value in ns, us, ms or s; ``-`` for None.
    """
    if ns is None:
        return "-"
    value = float(ns)
    if abs(value) < 1e3:
        return f"{int(value)} ns"
    if abs(value) < 1e6:
        return f"{value / 1e3:.1f} us"
    if abs(value) < 1e9:
        return f"{value / 1e6:.2f} ms"
    return f"{value / 1e9:.3f} s"
