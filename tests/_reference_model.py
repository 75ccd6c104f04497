"""Reference: the report model as built before the columnar table (Python loops over loaded
events), kept only for the differential test (tests/test_model_diff.py).

Turn a :class:`~copytrace.dashboards._load.TraceData` into plain report data.

Everything here is plain data (dataclasses, lists, dicts; no plotly), shared by the HTML
report and the ``summary`` command, and tested on its own.

Definitions used throughout:

- An *event* is an event span that is not a deepcopy group (``copytrace.group`` absent or
  false), so a group's children are never counted twice.
- Every event has exactly one *kind*: ``noop`` (the call returned its input object,
  ``copytrace.noop``), else ``alias`` (the result shares storage, ``copytrace.alias``), else
  ``copy`` (real work: new storage, or data written by ``copy_``). A *copy* counted in
  totals is a ``copy`` event whose call did not raise (``copytrace.error`` absent), as in
  ``copytrace check``'s budgets; a failed call is counted apart.
- *Bytes copied* is the logical size (numel x element size) of the results of ``copy``
  events: the data actually written. Aliases and no-ops copy nothing. *Bytes allocated* is
  new storage (``copytrace.bytes_allocated``; 0 for ``copy_`` into an existing tensor).
- *Copy time* is the summed host-side duration of events (all kinds; a no-op ``.to()``
  still costs a call). The *copy-time share* of a step is copy time / step duration.
- Steps are split into *stages*: ``warmup`` (step 0, which runs from the start of tracing to
  the first step boundary, plus leading steps much slower than the steady state), ``tail``
  (the last step, from the last boundary to the end of tracing) and ``steady`` (the rest).
"""

from __future__ import annotations

import linecache
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from copytrace.analysis._findings import Ids
from copytrace.dashboards._load import Event, Run, TraceData

__all__ = [
    "KINDS",
    "STAGES",
    "CubeRow",
    "EventTemplate",
    "GroupRow",
    "HazardRow",
    "OpRow",
    "ReportModel",
    "RunInfo",
    "SampleInfo",
    "SiteRow",
    "StepRow",
    "StageStats",
    "Totals",
    "TransferRow",
    "build_model",
    "call_site_of",
    "format_bytes",
    "format_ns",
    "sample_events",
    "top",
]

NO_MODULE = "(no module)"
UNKNOWN_SITE = "(unknown call site)"
#: Event kinds, in display order.
KINDS = ("copy", "alias", "noop")
#: Step stages, in display order.
STAGES = ("warmup", "steady", "tail")
#: Leading steps slower than this factor x the steady median are warm-up.
WARMUP_FACTOR = 2.0
#: Copies at least this large (bytes copied) are always kept on the timeline.
LARGE_EVENT_BYTES = 1 << 20
_SEVERITY_RANK = {"critical": 0, "error": 1, "high": 1, "warning": 2, "medium": 2, "info": 3,
                  "low": 3}  # fmt: skip


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
        events_discarded: Events recorded but discarded (``copytrace.events_discarded``).
        errors: Internal copytrace errors caught.
        internal_detaches: Autograd-internal ``aten::detach`` calls not recorded as events.
        steps: Number of steps (run span attribute, else step spans read).
        complete: Whether the ``copytrace.run`` span was read (False for a cut file).
        overhead_ns: Host time spent inside copytrace's own recording
            (``copytrace.overhead_ns`` of the run span), ns; None when not recorded.
        devices: Devices seen in this run's events, sorted (e.g. ``["cpu", "cuda:0"]``).
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
    overhead_ns: int | None = None
    events_discarded: int = 0
    devices: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    windows: list[str] = field(default_factory=list)
    ring: int | None = None
    ring_reason: str = ""
    ring_skipped: int = 0


@dataclass
class Totals:
    """Sums over all events (not groups) of all runs.

    Attributes:
        events: Events.
        copy_count: ``copy`` events (real copies).
        alias_count: ``alias`` events (share storage; no-ops not included).
        noop_count: ``noop`` events (returned the input object).
        error_count: Events whose op raised.
        group_count: Deepcopy group spans (not included in the other totals).
        bytes_copied: Logical bytes of the results of ``copy`` events, bytes.
        bytes_allocated: New storage, bytes.
        bytes_logical: numel x element size of all results (any kind), bytes.
        copy_time_ns: Summed host-side duration of all events, ns.
        time_by_kind_ns: Summed duration per kind (``copy``, ``alias``, ``noop``), ns.
        cross_device_count: Events whose source and destination devices differ.
        cross_device_bytes: Logical bytes of those events, bytes.
        hazard_count: Hazard rows (see :class:`HazardRow`).
    """

    events: int = 0
    copy_count: int = 0
    alias_count: int = 0
    noop_count: int = 0
    error_count: int = 0
    group_count: int = 0
    bytes_copied: int = 0
    bytes_allocated: int = 0
    bytes_logical: int = 0
    copy_time_ns: int = 0
    time_by_kind_ns: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    cross_device_count: int = 0
    cross_device_bytes: int = 0
    hazard_count: int = 0


@dataclass
class StepRow:
    """One step of one run.

    Attributes:
        run: Run label.
        step: Step number.
        duration_ns: Step duration in ns, or None when no step span was read.
        stage: ``warmup``, ``steady`` or ``tail``.
        events: Events in the step.
        copy_count: ``copy`` events.
        alias_count: ``alias`` events.
        noop_count: ``noop`` events.
        bytes_copied: Bytes copied, bytes.
        bytes_allocated: Bytes of new storage, bytes.
        copy_time_ns: Summed event duration (all kinds), ns.
        copy_time_share_pct: ``copy_time_ns / duration_ns * 100``, or None without a duration.
        start_ms: Step start, ms since the run start (None without a step span).
        end_ms: Step end, ms since the run start (None without a step span).
    """

    run: str
    step: int
    duration_ns: int | None
    stage: str = "steady"
    events: int = 0
    copy_count: int = 0
    alias_count: int = 0
    noop_count: int = 0
    bytes_copied: int = 0
    bytes_allocated: int = 0
    copy_time_ns: int = 0
    copy_time_share_pct: float | None = None
    start_ms: float | None = None
    end_ms: float | None = None


@dataclass
class StageStats:
    """Copy overhead over the steps of one stage (all runs together).

    Attributes:
        stage: ``warmup``, ``steady`` or ``tail``.
        steps: Steps in the stage.
        step_time_ns: Summed step duration, ns.
        copy_time_ns: Summed event duration, ns.
        share_pct: ``copy_time_ns / step_time_ns * 100`` (0 without step time).
        median_share_pct: Median of the per-step shares, or None without steps.
        bytes_copied: Bytes copied, bytes.
        bytes_per_step: ``bytes_copied / steps`` (0 without steps), bytes.
        events_per_step: Events per step (0 without steps).
    """

    stage: str
    steps: int = 0
    step_time_ns: int = 0
    copy_time_ns: int = 0
    share_pct: float = 0.0
    median_share_pct: float | None = None
    bytes_copied: int = 0
    bytes_per_step: float = 0.0
    events_per_step: float = 0.0


@dataclass
class SiteRow:
    """Aggregate over the events of one key (a call site, a module).

    Attributes:
        key: ``file:line function`` for a call site, a module path for a module.
        label: Short display name (``train.py:42 main``; the module path for a module).
        source: The source line of a call site, stripped ('' if unavailable).
        count: Events.
        copy_count: ``copy`` events.
        alias_count: ``alias`` events.
        noop_count: ``noop`` events.
        bytes_copied: Bytes copied, bytes.
        bytes_allocated: Bytes of new storage, bytes.
        bytes_logical: Logical bytes of the results, bytes.
        time_ns: Summed event duration, ns.
        ops: Event count per op.
        others: Event count per module (for a call site) or per call site (for a module).
        vias: Event count per torch function the events came through (``copytrace.via``;
            direct calls not counted).
    """

    key: str
    label: str = ""
    source: str = ""
    count: int = 0
    copy_count: int = 0
    alias_count: int = 0
    noop_count: int = 0
    bytes_copied: int = 0
    bytes_allocated: int = 0
    bytes_logical: int = 0
    time_ns: int = 0
    ops: dict[str, int] = field(default_factory=dict)
    others: dict[str, int] = field(default_factory=dict)
    vias: dict[str, int] = field(default_factory=dict)
    #: the other site of the events (library call sites): none in the traces compared here
    entries: dict[str, int] = field(default_factory=dict)


@dataclass
class OpRow:
    """Aggregate over the events of one ``copytrace.op``.

    Attributes:
        op: The op name.
        count: Events.
        copy_count: ``copy`` events.
        alias_count: ``alias`` events.
        noop_count: ``noop`` events.
        bytes_copied: Bytes copied, bytes.
        bytes_allocated: Bytes of new storage, bytes.
        bytes_logical: Logical bytes of the results, bytes.
        time_ns: Summed event duration, ns.
        graph: Event count per ``copytrace.graph`` value (``attached``, ``detached``,
            ``none``; ``?`` when absent).
    """

    op: str
    count: int = 0
    copy_count: int = 0
    alias_count: int = 0
    noop_count: int = 0
    bytes_copied: int = 0
    bytes_allocated: int = 0
    bytes_logical: int = 0
    time_ns: int = 0
    graph: dict[str, int] = field(default_factory=dict)


@dataclass
class TransferRow:
    """Events from one device to another (``src_device -> dst_device``).

    Attributes:
        src_device: Input device, e.g. ``cpu`` (``?`` if unknown).
        dst_device: Result device, e.g. ``cuda:0`` (``?`` if unknown).
        transfer: ``none``, ``h2d``, ``d2h`` or ``d2d`` (the most common one seen).
        count: Events.
        copy_count: ``copy`` events.
        bytes_allocated: Bytes of new storage, bytes.
        bytes_logical: Logical bytes of the results (bytes moved for copies), bytes.
        non_blocking_count: Events with ``non_blocking=True``.
        pinned_count: Events whose host memory was pinned (``copytrace.pinned`` or
            ``copytrace.src_pinned`` true).
        pinned_known: Events that carry a pinned attribute at all.
        time_ns: Summed event duration, ns.
    """

    src_device: str
    dst_device: str
    transfer: str = "none"
    count: int = 0
    copy_count: int = 0
    bytes_allocated: int = 0
    bytes_logical: int = 0
    non_blocking_count: int = 0
    pinned_count: int = 0
    pinned_known: int = 0
    time_ns: int = 0

    @property
    def cross_device(self) -> bool:
        """Whether source and destination devices differ (both known)."""
        return "?" not in (self.src_device, self.dst_device) and self.src_device != self.dst_device


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


@dataclass
class HazardRow:
    """One hazard: from the analyser (``copytrace.analysis``) or a ``copytrace.hazard`` span event.

    Attributes:
        code: Short identifier, e.g. ``CT001``.
        severity: ``error``, ``warning``, ``info`` ... ('' if unknown).
        message: What is wrong.
        fix: How to fix it.
        call_sites: ``file:line function`` keys involved.
        bytes: Bytes involved (as the analyser reports them), or None.
        steps: Steps involved.
        event_ids: Span ids of the events involved (16 hex digits).
        source: ``analysis`` or ``trace`` (a span event in the trace file).
    """

    code: str
    severity: str
    message: str
    fix: str
    call_sites: list[str] = field(default_factory=list)
    bytes: int | None = None
    steps: list[int] = field(default_factory=list)
    event_ids: list[str] = field(default_factory=list)
    source: str = "analysis"


@dataclass(frozen=True, slots=True)
class EventTemplate:
    """Everything about an event except when it happened; events share templates.

    Attributes:
        op: ``copytrace.op``.
        kind: ``copy``, ``alias`` or ``noop``.
        bytes_allocated: Bytes of new storage.
        bytes_logical: Logical bytes of the result.
        shape: Result shape (empty if unknown).
        dtype: Result dtype ('' if unknown).
        src_dtype: Input dtype ('' if unknown).
        src_device: Input device ('' if unknown).
        dst_device: Result device ('' if unknown).
        transfer: ``none``, ``h2d``, ``d2h``, ``d2d`` ('' if unknown).
        non_blocking: ``non_blocking=True`` was passed.
        pinned: Host memory pinned (None when not recorded).
        graph: ``attached``, ``detached``, ``none`` ('' if unknown).
        grad_fn: Result's ``grad_fn`` class name ('' if none).
        phase: ``forward``, ``backward``, ``optimizer``, ``other`` ('' if unknown).
        module: ``nn.Module`` path ('' outside any module).
        call_site: ``file:line function``.
        aten: Aten overloads seen.
        thread: Thread name ('' if unknown).
        group: Type of the deep-copied object for a deepcopy child, else ''.
        error: Exception type when the op raised, else ''.
        via: The torch function the user's line went through (``clip_grad_norm_``), or for
            a backward copy the autograd node that made it; '' for a direct call.
        origin: For a backward copy, ``file:line`` of the forward call behind it, else ''.
    """

    op: str
    kind: str
    bytes_allocated: int
    bytes_logical: int
    shape: tuple[int, ...]
    dtype: str
    src_dtype: str
    src_device: str
    dst_device: str
    transfer: str
    non_blocking: bool
    pinned: bool | None
    graph: str
    grad_fn: str
    phase: str
    module: str
    call_site: str
    aten: tuple[str, ...]
    thread: str
    group: str
    error: str
    via: str
    origin: str
    #: the other call site (library call sites): none in the traces compared here
    entry: str = ""

    @property
    def bytes_copied(self) -> int:
        """Logical bytes for a ``copy`` event, 0 for aliases, no-ops and failed calls."""
        return self.bytes_logical if self.kind == "copy" and not self.error else 0


@dataclass(frozen=True, slots=True)
class CubeRow:
    """Events of one run sharing module, call site, op, kind, graph and phase.

    Every per-site, per-module and per-op table is a sum over cube rows, so the report can
    re-aggregate for any selection of runs (ranks).

    Attributes:
        run: Index into :attr:`ReportModel.runs`.
        module: ``nn.Module`` path ('' outside any module).
        call_site: ``file:line function``.
        op: ``copytrace.op``.
        kind: ``copy``, ``alias`` or ``noop``.
        graph: ``attached``, ``detached``, ``none`` ('' if unknown).
        phase: ``forward``, ``backward``, ``optimizer``, ``other`` ('' if unknown).
        via: Torch function (or autograd node) the copy came through ('' if direct).
        count: Events.
        bytes_copied: Bytes copied, bytes.
        bytes_allocated: Bytes of new storage, bytes.
        bytes_logical: Logical bytes, bytes.
        time_ns: Summed duration, ns.
        errors: Events whose op raised.
    """

    run: int
    module: str
    call_site: str
    op: str
    kind: str
    graph: str
    phase: str
    via: str
    count: int
    bytes_copied: int
    bytes_allocated: int
    bytes_logical: int
    time_ns: int
    errors: int
    #: the other call site (library call sites): none in the traces compared here
    entry: str = ""


@dataclass
class ReportModel:
    """Plain data behind the HTML report and the text summary.

    Events are stored as columns (one entry per event, in run then time order) that index
    :attr:`templates`: ``ev_run`` (index into ``runs``), ``ev_t_ns`` (start, ns since the
    run start), ``ev_dur_ns`` (duration, ns), ``ev_step`` (step number, -1 if unknown),
    ``ev_tpl`` (index into ``templates``), ``ev_span_id`` and ``ev_hazard`` (index into
    ``hazards`` of the first hazard naming the event, -1 if none).

    Attributes:
        runs: One entry per traced process run (ranks in order).
        totals: Sums over events.
        stages: Copy overhead per stage (``warmup``, ``steady``, ``tail``).
        bad_lines: Unreadable lines skipped while loading.
        files: Trace file paths (str) read.
        steps: Per-step rows, ordered by run then step.
        call_sites: Per call site, by bytes copied (desc).
        modules: Per ``nn.Module`` path (``(no module)`` outside any), by bytes copied (desc).
        ops: Per op, by bytes copied (desc).
        transfers: Per (src_device, dst_device), by logical bytes (desc).
        transfers_by_run: ``(run index, row)`` per run and device pair.
        groups: Deepcopy groups, in time order.
        hazards: Hazards, most severe first.
        analysis: ``ran``, ``failed: <error>`` or ``skipped``.
        cube: Aggregates per (run, module, call site, op, kind, graph, phase).
        templates: Distinct event descriptions.
        site_labels: Short display label per call-site key.
        site_sources: Source line per call-site key ('' if unavailable).
    """

    runs: list[RunInfo]
    totals: Totals
    stages: dict[str, StageStats]
    bad_lines: int
    files: list[str]
    steps: list[StepRow]
    call_sites: list[SiteRow]
    modules: list[SiteRow]
    ops: list[OpRow]
    transfers: list[TransferRow]
    transfers_by_run: list[tuple[int, TransferRow]]
    groups: list[GroupRow]
    hazards: list[HazardRow]
    analysis: str
    cube: list[CubeRow]
    templates: list[EventTemplate]
    site_labels: dict[str, str]
    site_sources: dict[str, str]
    ev_run: list[int] = field(default_factory=list)
    ev_t_ns: list[int] = field(default_factory=list)
    ev_dur_ns: list[int] = field(default_factory=list)
    ev_step: list[int] = field(default_factory=list)
    ev_tpl: list[int] = field(default_factory=list)
    ev_span_id: list[str] = field(default_factory=list)
    ev_hazard: list[int] = field(default_factory=list)
    #: Compiled regions (``copytrace.dashboards._compiled.CompiledSection``), or None.
    compiled: Any = None

    @property
    def multi_run(self) -> bool:
        """Whether the trace holds more than one process run."""
        return len(self.runs) > 1

    @property
    def n_events(self) -> int:
        """Number of events in the event columns."""
        return len(self.ev_tpl)

    @property
    def devices(self) -> list[str]:
        """All devices seen, sorted (``cpu`` first)."""
        seen = {d for r in self.runs for d in r.devices}
        return sorted(seen, key=lambda d: (d != "cpu", d))

    def event(self, i: int) -> dict[str, Any]:
        """Return event ``i`` as a flat dict (template fields plus run, t_ms, duration_ns, step).

        Args:
            i: Index into the event columns.

        Returns:
            A dict with every :class:`EventTemplate` field, ``run`` (label), ``t_ms`` (ms
            since the run start), ``duration_ns`` (ns), ``step`` (None if unknown),
            ``span_id`` and ``hazard`` (index into :attr:`hazards`, or None).
        """
        tpl = self.templates[self.ev_tpl[i]]
        out = {name: getattr(tpl, name) for name in EventTemplate.__slots__}
        step = self.ev_step[i]
        hz = self.ev_hazard[i]
        out.update(
            run=self.runs[self.ev_run[i]].label,
            t_ms=self.ev_t_ns[i] / 1e6,
            duration_ns=self.ev_dur_ns[i],
            step=None if step < 0 else step,
            span_id=self.ev_span_id[i],
            hazard=None if hz < 0 else hz,
        )
        return out

    def top_call_sites(self, by: str = "bytes_copied", n: int = 20) -> list[SiteRow]:
        """Return the top ``n`` call sites by ``by`` (a :class:`SiteRow` number attribute).

        Args:
            by: e.g. ``bytes_copied`` (bytes), ``bytes_allocated`` (bytes), ``time_ns`` (ns)
                or ``count``.
            n: Maximum number of rows.

        Returns:
            The rows, largest first; ties in key order.
        """
        return top(self.call_sites, by, n)

    def top_modules(self, by: str = "bytes_copied", n: int = 20) -> list[SiteRow]:
        """Return the top ``n`` modules by ``by`` (see :meth:`top_call_sites`)."""
        return top(self.modules, by, n)


def top(rows: Iterable[Any], by: str, n: int) -> list[Any]:
    """Return the ``n`` rows with the largest attribute ``by``; ties keep key order.

    Args:
        rows: Rows with the attribute ``by`` and a ``key`` or ``op`` attribute.
        by: Attribute name to sort on, e.g. ``bytes_copied`` (bytes) or ``time_ns`` (ns).
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
        return int(value) if math.isfinite(value) else default
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


def _split_site(site: str) -> tuple[str, int | None, str]:
    """``/a/train.py:42 main`` -> (``/a/train.py``, 42, ``main``)."""
    head, _, func = site.partition(" ")
    path, sep, line = head.rpartition(":")
    if not sep or not line.isdigit():
        return head, None, func
    return path, int(line), func


def _site_labels(keys: Iterable[str]) -> dict[str, str]:
    """Shortest unique labels: the file's base name, more parent folders where names clash."""
    keys = list(keys)
    parts = {k: _split_site(k) for k in keys}
    labels: dict[str, str] = {}
    depth = {k: 1 for k in keys}
    for _ in range(8):
        for k in keys:
            path, line, func = parts[k]
            if k == UNKNOWN_SITE or line is None:
                labels[k] = k
                continue
            segs = path.replace("\\", "/").split("/")
            short = "/".join(segs[-depth[k] :])
            labels[k] = f"{short}:{line}" + (f" {func}" if func else "")
        clashes: dict[str, list[str]] = {}
        for k, lab in labels.items():
            clashes.setdefault(lab, []).append(k)
        again = False
        for same in clashes.values():
            if len(same) > 1:
                for k in same:
                    depth[k] += 1
                again = True
        if not again:
            break
    return labels


def _source_line(site: str, not_after_ns: int | None = None) -> str:
    """The stripped source line of a call site, if the file is readable here ('' if not).

    A file modified after ``not_after_ns`` (ns since the epoch: the start of the traced run)
    may no longer hold the traced line, so it is not read.
    """
    path, line, _ = _split_site(site)
    if line is None or not path or not os.path.isfile(path):
        return ""
    try:
        if not_after_ns and os.stat(path).st_mtime_ns > not_after_ns:
            return ""
    except OSError:
        return ""
    try:
        text = linecache.getline(path, line).strip()
    except (OSError, UnicodeDecodeError, MemoryError):  # pragma: no cover - odd files
        return ""
    return text if len(text) <= 200 else text[:197] + "..."


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
    overhead = _opt_int(attrs.get("copytrace.overhead_ns"))
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
        overhead_ns=overhead,
        events_discarded=_int(attrs.get("copytrace.events_discarded")),
        files=[str(f) for f in run.files],
        windows=[str(w) for w in attrs.get("copytrace.windows") or []],
        ring=_opt_int(attrs.get("copytrace.ring")),
        ring_reason=_str(attrs.get("copytrace.ring_reason")),
        ring_skipped=_int(attrs.get("copytrace.ring_skipped")),
    )


def _kind(a: dict[str, Any]) -> str:
    if a.get("copytrace.noop") is True:
        return "noop"
    if a.get("copytrace.alias") is True:
        return "alias"
    return "copy"


def _template_key(a: dict[str, Any], group: str) -> tuple[Any, ...]:
    """The :class:`EventTemplate` fields of an event's attributes, in field order."""
    shape = a.get("copytrace.shape")
    aten = a.get("copytrace.aten")
    pinned = a.get("copytrace.pinned", a.get("copytrace.src_pinned"))
    op = a.get("copytrace.op")
    return (
        op if isinstance(op, str) and op else "",
        _kind(a),
        _int(a.get("copytrace.bytes_allocated")),
        _int(a.get("copytrace.bytes_logical")),
        tuple(_int(d) for d in shape) if isinstance(shape, list) else (),
        _str(a.get("copytrace.dtype")),
        _str(a.get("copytrace.src_dtype")),
        _str(a.get("copytrace.src_device")),
        _str(a.get("copytrace.dst_device")),
        _str(a.get("copytrace.transfer")) or "none",  # the tracer omits the default
        a.get("copytrace.non_blocking") is True,
        pinned if isinstance(pinned, bool) else None,
        _str(a.get("copytrace.graph")),
        _str(a.get("copytrace.grad_fn")),
        _str(a.get("copytrace.phase")),
        _str(a.get("copytrace.module")),
        call_site_of(a),
        tuple(str(x) for x in aten) if isinstance(aten, list) else (),
        _str(a.get("thread.name")),
        group,
        _str(a.get("copytrace.error")),
        _str(a.get("copytrace.via")),
        _str(a.get("copytrace.origin")),
    )


def _median(values: Sequence[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def _assign_stages(rows: list[StepRow]) -> None:
    """Mark warm-up, steady and tail steps of one run (rows sorted by step)."""
    timed = [r for r in rows if r.duration_ns is not None]
    for r in rows:
        r.stage = "steady"
    if len(timed) < 3:
        return  # too few steps to tell warm-up from steady state
    timed[0].stage = "warmup"
    timed[-1].stage = "tail"
    middle = timed[1:-1]
    reference = _median([r.duration_ns or 0 for r in middle[len(middle) // 2 :]]) or 0
    limit = max(1, len(timed) // 10)
    for r in middle[:limit]:
        if reference and (r.duration_ns or 0) > WARMUP_FACTOR * reference:
            r.stage = "warmup"
        else:
            break
    for r in rows:  # steps without a span: follow the nearest timed neighbour
        if r.duration_ns is None:
            r.stage = "steady"


def _stage_stats(steps: list[StepRow]) -> dict[str, StageStats]:
    out = {s: StageStats(s) for s in STAGES}
    shares: dict[str, list[float]] = {s: [] for s in STAGES}
    for r in steps:
        st = out[r.stage]
        st.steps += 1
        st.step_time_ns += r.duration_ns or 0
        st.copy_time_ns += r.copy_time_ns
        st.bytes_copied += r.bytes_copied
        st.events_per_step += r.events
        if r.copy_time_share_pct is not None:
            shares[r.stage].append(r.copy_time_share_pct)
    for s, st in out.items():
        if st.steps:
            st.share_pct = st.copy_time_ns / st.step_time_ns * 100.0 if st.step_time_ns else 0.0
            st.median_share_pct = _median(shares[s])
            st.bytes_per_step = st.bytes_copied / st.steps
            st.events_per_step = st.events_per_step / st.steps
    return out


def _get(obj: Any, *names: str) -> Any:
    for name in names:
        value = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
        if value is not None:
            return value
    return None


def _text(value: Any) -> str:
    if value is None:
        return ""
    for attr in ("value", "name"):  # enums
        inner = getattr(value, attr, None)
        if isinstance(inner, str):
            return inner
    return str(value)


def _listify(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple, set, frozenset, Ids)):  # Ids: a finding's events
        return list(value)
    return [value]


def _site_text(value: Any) -> str:
    """A call site as the analyser may give it: a string, or an object/dict with file/line."""
    if isinstance(value, str):
        return value
    path = _get(value, "file", "path", "filename", "code.file.path")
    if path is None:
        return _text(value)
    line = _get(value, "line", "lineno", "code.line.number")
    func = _get(value, "function", "func", "code.function.name")
    site = f"{path}:{line}" if line is not None else str(path)
    return f"{site} {func}" if func else site


def hazard_from_finding(finding: Any) -> HazardRow:
    """Normalise one analyser finding (object or dict) into a :class:`HazardRow`.

    Args:
        finding: An object or dict with ``code``, ``severity``, ``message``, ``fix``,
            ``call_sites`` (or ``call_site``), ``bytes``, ``steps`` (or ``step``) and
            ``event_ids`` (or ``span_ids``); missing fields are left empty.

    Returns:
        The row (``bytes`` in bytes).
    """
    sites = _listify(_get(finding, "call_sites", "call_site", "sites", "site"))
    steps = [s for s in (_opt_int(x) for x in _listify(_get(finding, "steps", "step"))) if
             s is not None]  # fmt: skip
    ids = _listify(_get(finding, "event_ids", "span_ids", "events"))
    nbytes = _opt_int(_get(finding, "bytes", "nbytes", "bytes_copied", "bytes_allocated"))
    return HazardRow(
        code=_text(_get(finding, "code", "id", "rule")),
        severity=_text(_get(finding, "severity", "level")).lower(),
        message=_text(_get(finding, "message", "title", "description")),
        fix=_text(_get(finding, "fix", "suggestion", "remedy")),
        call_sites=[_site_text(s) for s in sites],
        bytes=nbytes,
        steps=sorted(set(steps)),
        event_ids=[str(i).lower() for i in ids],
        source="analysis",
    )


def run_analysis(trace: TraceData) -> tuple[list[Any] | None, str]:
    """Run ``copytrace.analysis.analyze`` on a trace.

    Args:
        trace: What :func:`~copytrace.dashboards.load_trace` returned.

    Returns:
        ``(findings, status)``: the findings and ``ran``; or None and
        ``failed: <ExceptionType>: <message>`` (the report is written without hazards).
    """
    from copytrace.analysis import analyze

    try:
        return list(analyze(trace)), "ran"
    except Exception as err:  # the report must not die with the analyser
        return None, f"failed: {type(err).__name__}: {err}"


def _trace_hazards(ev: Event, site: str, step: int) -> list[HazardRow]:
    rows = []
    for name, _t, attrs in getattr(ev, "span_events", ()) or ():
        if name != "copytrace.hazard":
            continue
        nbytes = _opt_int(attrs.get("copytrace.hazard.bytes"))
        rows.append(
            HazardRow(
                code=_str(attrs.get("copytrace.hazard.code")),
                severity=_str(attrs.get("copytrace.hazard.severity")).lower(),
                message=_str(attrs.get("copytrace.hazard.message")),
                fix=_str(attrs.get("copytrace.hazard.fix")),
                call_sites=[site],
                bytes=nbytes if nbytes is not None else None,
                steps=[step] if step >= 0 else [],
                event_ids=[ev.span_id],
                source="trace",
            )
        )
    return rows


def _merge_trace_hazards(rows: list[HazardRow]) -> list[HazardRow]:
    """Merge span-event hazards with the same code, message, fix and call site."""
    merged: dict[tuple[str, str, str, str, str], HazardRow] = {}
    for r in rows:
        key = (r.code, r.severity, r.message, r.fix, r.call_sites[0] if r.call_sites else "")
        m = merged.get(key)
        if m is None:
            merged[key] = r
            continue
        m.event_ids.extend(r.event_ids)
        m.steps = sorted(set(m.steps) | set(r.steps))
        if r.bytes is not None:
            m.bytes = (m.bytes or 0) + r.bytes
    return list(merged.values())


def build_model(
    trace: TraceData,
    *,
    findings: Sequence[Any] | None = None,
    analyze: bool = False,
    read_sources: bool = True,
    progress: Any = None,
) -> ReportModel:
    """Aggregate a loaded trace into the data shown by the report.

    Args:
        trace: What :func:`~copytrace.dashboards.load_trace` returned.
        findings: Hazard findings already computed by ``copytrace.analysis.analyze``.
        analyze: If ``findings`` is None, run the analyser (when installed) on ``trace``.
        read_sources: Read each call site's source line from disk when the file exists and
            has not been modified since the run started.
        progress: Optional callable ``(n_events_done)`` called now and then while events are
            aggregated.

    Returns:
        Run metadata, totals (bytes in bytes, times in ns), steps with stages, per call site /
        module / op / device-pair aggregates, hazards, deepcopy groups and the event columns
        (times in ns since each run's start).
    """
    analysis_status = "skipped"
    if findings is None and analyze:
        findings, analysis_status = run_analysis(trace)
    elif findings is not None:
        analysis_status = "ran"
    hazards = [hazard_from_finding(f) for f in findings or []]
    for f, h in zip(findings or [], hazards, strict=True):
        if h.event_ids:
            continue
        seqs = _listify(_get(f, "event_seqs"))
        run_no = _opt_int(_get(f, "run")) or 0
        if seqs and 0 <= run_no < len(trace.runs):
            evs = trace.runs[run_no].events
            h.event_ids = [evs[q].span_id for q in (_opt_int(x) for x in seqs)
                           if q is not None and 0 <= q < len(evs)]  # fmt: skip

    infos = [_run_info(run, i) for i, run in enumerate(trace.runs)]
    seen_labels: set[str] = set()
    for i, info in enumerate(infos):  # labels key per-run data: keep them unique
        if info.label in seen_labels:
            info.label = f"{info.label} {info.host or ''} #{i}".replace("  ", " ")
        seen_labels.add(info.label)
    pairs = sorted(  # ranks in order, then processes by start time
        zip(trace.runs, infos, strict=True),
        key=lambda ri: (
            ri[1].rank is None,
            ri[1].rank or 0,
            ri[1].start_ns,
            ri[1].pid or 0,
            ri[1].trace_id,
        ),
    )
    runs = [info for _, info in pairs]

    hazard_of_event: dict[str, int] = {}
    for hi, h in enumerate(hazards):
        for eid in h.event_ids:
            hazard_of_event.setdefault(eid, hi)

    tpl_index: dict[tuple[Any, ...], int] = {}
    templates: list[EventTemplate] = []
    # per (run, template): [count, time_ns, errors]
    per_tpl: dict[tuple[int, int], list[int]] = {}
    ev_run: list[int] = []
    ev_t: list[int] = []
    ev_dur: list[int] = []
    ev_step: list[int] = []
    ev_tpl: list[int] = []
    ev_id: list[str] = []
    trace_hazards: list[HazardRow] = []
    trace_hazard_events: list[tuple[int, int]] = []  # (event index, trace hazard index)
    steps: list[StepRow] = []
    groups: list[GroupRow] = []
    group_count = 0
    done = 0

    for run_idx, (run, info) in enumerate(pairs):
        label = info.label
        step_rows: dict[int, StepRow] = {}
        for s in run.steps:
            step_rows[s.step] = StepRow(
                run=label,
                step=s.step,
                duration_ns=s.duration_ns,
                start_ms=(s.start_ns - run.start_ns) / 1e6,
                end_ms=(s.end_ns - run.start_ns) / 1e6,
            )
        group_events = {ev.span_id: ev for ev in run.events if ev.is_group}
        group_type = {
            gid: _str(g.attrs.get("copytrace.object_type")) or "?"
            for gid, g in group_events.items()
        }
        group_children: dict[str, list[Event]] = {gid: [] for gid in group_events}
        devices: set[str] = set()
        run_start = run.start_ns

        for ev in run.events:
            a = ev.attrs
            if ev.is_group:
                group_count += 1
                continue
            parent = ev.parent_id
            group = ""
            if parent is not None and parent in group_type:
                group = group_type[parent]
                group_children[parent].append(ev)
            key = _template_key(a, group)
            ti = tpl_index.get(key)
            if ti is None:
                ti = tpl_index[key] = len(templates)
                templates.append(EventTemplate(*key))
            tpl = templates[ti]
            dur = ev.duration_ns
            step = _opt_int(a.get("copytrace.step"))
            step = -1 if step is None else step
            agg = per_tpl.get((run_idx, ti))
            if agg is None:
                agg = per_tpl[(run_idx, ti)] = [0, 0, 0]
            agg[0] += 1
            agg[1] += dur
            if tpl.error:
                agg[2] += 1
            if step >= 0:
                row = step_rows.get(step)
                if row is None:
                    row = step_rows[step] = StepRow(run=label, step=step, duration_ns=None)
                row.events += 1
                kind = tpl.kind
                if kind == "copy":
                    if not tpl.error:  # a failed call is not a copy
                        row.copy_count += 1
                        row.bytes_copied += tpl.bytes_logical
                elif kind == "alias":
                    row.alias_count += 1
                else:
                    row.noop_count += 1
                row.bytes_allocated += tpl.bytes_allocated
                row.copy_time_ns += dur
            if tpl.src_device:
                devices.add(tpl.src_device)
            if tpl.dst_device:
                devices.add(tpl.dst_device)
            idx = len(ev_tpl)
            ev_run.append(run_idx)
            ev_t.append(ev.start_ns - run_start)
            ev_dur.append(dur)
            ev_step.append(step)
            ev_tpl.append(ti)
            ev_id.append(ev.span_id)
            if getattr(ev, "span_events", None):
                for h in _trace_hazards(ev, tpl.call_site, step):
                    trace_hazard_events.append((idx, len(trace_hazards)))
                    trace_hazards.append(h)
            done += 1
            if progress is not None and done % 50_000 == 0:
                progress(done)

        info.devices = sorted(devices, key=lambda d: (d != "cpu", d))
        rows = sorted(step_rows.values(), key=lambda r: r.step)
        for row in rows:
            if row.duration_ns:
                row.copy_time_share_pct = row.copy_time_ns / row.duration_ns * 100.0
        _assign_stages(rows)
        steps.extend(rows)

        for gid, gev in group_events.items():
            children = group_children[gid]
            tensors = _opt_int(gev.attrs.get("copytrace.tensors"))
            groups.append(
                GroupRow(
                    run=label,
                    step=_opt_int(gev.attrs.get("copytrace.step")),
                    object_type=group_type[gid],
                    tensors=tensors if tensors is not None else len(children),
                    children=len(children),
                    bytes_allocated=sum(
                        _int(c.attrs.get("copytrace.bytes_allocated")) for c in children
                    ),
                    duration_ns=gev.duration_ns,
                    call_site=call_site_of(gev.attrs),
                )
            )
    if progress is not None:
        progress(done)

    # Span-event hazards: merge repeats, then point events at them.
    merged = _merge_trace_hazards(trace_hazards)
    base = len(hazards)
    hazards.extend(merged)
    order = sorted(
        range(len(hazards)),
        key=lambda i: (
            _SEVERITY_RANK.get(hazards[i].severity, 4),
            -(hazards[i].bytes or 0),
            hazards[i].code,
            i,
        ),
    )
    new_pos = {old: new for new, old in enumerate(order)}
    hazards = [hazards[i] for i in order]
    ev_hazard = [-1] * len(ev_tpl)
    if hazard_of_event:
        for i, sid in enumerate(ev_id):
            hi = hazard_of_event.get(sid)
            if hi is not None:
                h = hazards[new_pos[hi]]
                ev_hazard[i] = new_pos[hi]
                site = templates[ev_tpl[i]].call_site
                if site not in h.call_sites:  # fill in what the finding left out
                    h.call_sites.append(site)
                if ev_step[i] >= 0 and ev_step[i] not in h.steps:
                    h.steps.append(ev_step[i])
        for h in hazards:
            h.steps.sort()
    if merged:
        pos_of_merged = {}
        for j, m in enumerate(merged):
            for eid in m.event_ids:
                pos_of_merged.setdefault(eid, new_pos[base + j])
        for i, _h in trace_hazard_events:
            if ev_hazard[i] < 0:
                ev_hazard[i] = pos_of_merged.get(ev_id[i], -1)

    # Cube and the per-key tables.
    cube_acc: dict[tuple[Any, ...], list[int]] = {}
    totals = Totals(group_count=group_count, hazard_count=len(hazards))
    transfers: dict[tuple[str, str], TransferRow] = {}
    run_transfers: dict[tuple[int, str, str], TransferRow] = {}
    transfer_kinds: dict[tuple[Any, ...], dict[str, int]] = {}
    for (run_idx, ti), (count, time_ns, errors) in per_tpl.items():
        t = templates[ti]
        ckey = (run_idx, t.module, t.call_site, t.op, t.kind, t.graph, t.phase, t.via)
        acc = cube_acc.get(ckey)
        if acc is None:
            acc = cube_acc[ckey] = [0, 0, 0, 0, 0, 0]
        acc[0] += count
        acc[1] += count * t.bytes_copied
        acc[2] += count * t.bytes_allocated
        acc[3] += count * t.bytes_logical
        acc[4] += time_ns
        acc[5] += errors

        totals.events += count
        totals.error_count += errors
        totals.bytes_copied += count * t.bytes_copied
        totals.bytes_allocated += count * t.bytes_allocated
        totals.bytes_logical += count * t.bytes_logical
        totals.copy_time_ns += time_ns
        totals.time_by_kind_ns[t.kind] += time_ns
        if t.kind == "copy":
            totals.copy_count += count - errors  # a failed call is not a copy
        elif t.kind == "alias":
            totals.alias_count += count
        else:
            totals.noop_count += count

        if t.src_device or t.dst_device:
            dkey = (t.src_device or "?", t.dst_device or "?")
            for table, tkey in ((transfers, dkey), (run_transfers, (run_idx, *dkey))):
                tr = table.get(tkey)
                if tr is None:
                    tr = table[tkey] = TransferRow(*dkey)
                tr.count += count
                tr.copy_count += count - errors if t.kind == "copy" else 0
                tr.bytes_allocated += count * t.bytes_allocated
                tr.bytes_logical += count * t.bytes_logical
                tr.non_blocking_count += count if t.non_blocking else 0
                if t.pinned is not None:
                    tr.pinned_known += count
                    tr.pinned_count += count if t.pinned else 0
                tr.time_ns += time_ns
                kinds = transfer_kinds.setdefault(tkey, {})
                kinds[t.transfer or "none"] = kinds.get(t.transfer or "none", 0) + count
            if "?" not in dkey and dkey[0] != dkey[1]:
                totals.cross_device_count += count
                totals.cross_device_bytes += count * t.bytes_logical
    for table in (transfers, run_transfers):
        for tkey, tr in table.items():
            kinds = transfer_kinds[tkey]
            tr.transfer = max(sorted(kinds), key=lambda k: kinds[k])

    cube = [CubeRow(*k, *v) for k, v in cube_acc.items()]
    cube.sort(key=lambda c: (c.run, -c.bytes_copied, -c.time_ns, c.call_site, c.op, c.kind))
    sites: dict[str, SiteRow] = {}
    modules: dict[str, SiteRow] = {}
    ops: dict[str, OpRow] = {}
    for c in cube:
        mod = c.module or NO_MODULE
        for table, key, other in ((sites, c.call_site, mod), (modules, mod, c.call_site)):
            row = table.get(key)
            if row is None:
                row = table[key] = SiteRow(key)
            _add_cube(row, c)
            row.ops[c.op] = row.ops.get(c.op, 0) + c.count
            row.others[other] = row.others.get(other, 0) + c.count
            if c.via:
                row.vias[c.via] = row.vias.get(c.via, 0) + c.count
        orow = ops.get(c.op)
        if orow is None:
            orow = ops[c.op] = OpRow(c.op)
        _add_cube(orow, c)
        g = c.graph or "?"
        orow.graph[g] = orow.graph.get(g, 0) + c.count

    labels = _site_labels(sites)
    first_start = min((r.start_ns for r in runs if r.start_ns), default=None)
    sources = (
        {k: _source_line(k, first_start) for k in sites}
        if read_sources
        else dict.fromkeys(sites, "")
    )
    for k, row in sites.items():
        row.label = labels[k]
        row.source = sources[k]
    for k, row in modules.items():
        row.label = k

    def by_copied(rows: Iterable[Any]) -> list[Any]:
        return sorted(
            rows,
            key=lambda r: (-r.bytes_copied, -r.bytes_allocated, -r.time_ns,
                           str(getattr(r, "key", getattr(r, "op", "")))),
        )  # fmt: skip

    from copytrace.dashboards._compiled import compiled_section

    return ReportModel(
        compiled=compiled_section(trace),
        runs=runs,
        totals=totals,
        stages=_stage_stats(steps),
        bad_lines=trace.bad_lines,
        files=[str(Path(f)) for f in trace.files],
        steps=steps,
        call_sites=by_copied(sites.values()),
        modules=by_copied(modules.values()),
        ops=by_copied(ops.values()),
        transfers=sorted(
            transfers.values(),
            key=lambda t: (-t.bytes_logical, -t.count, t.src_device, t.dst_device),
        ),
        transfers_by_run=[
            (k[0], tr)
            for k, tr in sorted(
                run_transfers.items(), key=lambda kv: (kv[0][0], -kv[1].bytes_logical, kv[0])
            )
        ],
        groups=groups,
        hazards=hazards,
        analysis=analysis_status,
        cube=cube,
        templates=templates,
        site_labels=labels,
        site_sources=sources,
        ev_run=ev_run,
        ev_t_ns=ev_t,
        ev_dur_ns=ev_dur,
        ev_step=ev_step,
        ev_tpl=ev_tpl,
        ev_span_id=ev_id,
        ev_hazard=ev_hazard,
    )


def _add_cube(row: Any, c: CubeRow) -> None:
    row.count += c.count
    if c.kind == "copy":
        row.copy_count += c.count - c.errors  # a failed call is not a copy
    elif c.kind == "alias":
        row.alias_count += c.count
    else:
        row.noop_count += c.count
    row.bytes_copied += c.bytes_copied
    row.bytes_allocated += c.bytes_allocated
    row.bytes_logical += c.bytes_logical
    row.time_ns += c.time_ns


@dataclass
class SampleInfo:
    """What :func:`sample_events` kept.

    Attributes:
        large_bytes: The effective "large copy" threshold, bytes: every copy at least this
            large was kept. At least the ``large_bytes`` asked for; higher when the large
            copies alone would not fit half the point budget.
        per_hazard: Most events kept per hazard.
    """

    large_bytes: int = LARGE_EVENT_BYTES
    per_hazard: int = 0


def sample_events(
    model: ReportModel,
    max_points: int,
    *,
    large_bytes: int = LARGE_EVENT_BYTES,
    info: SampleInfo | None = None,
) -> list[int]:
    """Choose which events the timeline draws, at most about ``max_points`` of them.

    Kept: every event whose op raised; every hazard, with up to
    ``max(20, max_points // (10 * hazards))`` of its events spread over time; every copy of
    at least ``large_bytes`` bytes copied (the threshold is raised, largest sizes first,
    until the large copies fit in half of the budget left); and, with what remains, an
    even share for every (run, call site, op, kind) group, so that every source shows up,
    each group's events spread evenly over time.

    Args:
        model: The report model.
        max_points: Point budget (>= 0). Error and hazard events are kept even beyond it.
        large_bytes: Copies at least this large (bytes copied) count as large.
        info: If given, filled in with the effective threshold and the per-hazard cap.

    Returns:
        Sorted event indices into the model's event columns.
    """
    info = info if info is not None else SampleInfo()
    info.large_bytes = large_bytes
    n = model.n_events
    if n <= max_points:
        return list(range(n))
    tpls = model.templates
    must: list[int] = []
    large: dict[int, list[int]] = {}  # bytes copied -> events
    rest: dict[tuple[Any, ...], list[int]] = {}
    by_hazard: dict[int, list[int]] = {}
    for i in range(n):
        t = tpls[model.ev_tpl[i]]
        hz = model.ev_hazard[i]
        if t.error:
            must.append(i)
        elif hz >= 0:
            bucket = by_hazard.get(hz)
            if bucket is None:
                bucket = by_hazard[hz] = []
            bucket.append(i)
        elif t.kind == "copy" and t.bytes_logical >= large_bytes:
            bucket = large.get(t.bytes_logical)
            if bucket is None:
                bucket = large[t.bytes_logical] = []
            bucket.append(i)
        else:
            key = (model.ev_run[i], t.call_site, t.op, t.kind)
            bucket = rest.get(key)
            if bucket is None:
                bucket = rest[key] = []
            bucket.append(i)
    info.per_hazard = max(20, max_points // (10 * max(1, len(by_hazard))))
    for bucket in by_hazard.values():
        must.extend(_spread(bucket, info.per_hazard))
    budget = max(0, max_points - len(must))
    chosen = must
    # Large copies, largest sizes first, while they fit in half the budget; smaller ones
    # join the sampled rest.
    room = budget // 2
    threshold = None
    for size in sorted(large, reverse=True):
        bucket = large[size]
        if threshold is None and len(bucket) <= room:
            chosen.extend(bucket)
            room -= len(bucket)
            budget -= len(bucket)
            continue
        threshold = size if threshold is None else threshold
        for i in bucket:
            t = tpls[model.ev_tpl[i]]
            rest.setdefault((model.ev_run[i], t.call_site, t.op, t.kind), []).append(i)
    if threshold is not None:
        info.large_bytes = threshold + 1
    # Water-filling: small groups keep everything, large groups share what is left.
    buckets = sorted(rest.values(), key=len)
    left = len(buckets)
    for bucket in buckets:
        bucket.sort()
        share = budget // left if left else 0
        take = min(len(bucket), share)
        chosen.extend(_spread(bucket, take))
        budget -= take
        left -= 1
    return sorted(chosen)


def _spread(items: list[int], k: int) -> list[int]:
    """``k`` items of ``items`` spread evenly (all of them if ``k >= len(items)``)."""
    if k >= len(items):
        return items
    if k <= 0:
        return []
    step = len(items) / k
    return [items[int(j * step + step / 2)] for j in range(k)]


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
