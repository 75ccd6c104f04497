"""The rows of the report model: plain dataclasses (bytes in bytes, times in ns).

See :mod:`copytrace.dashboards._model` for the definitions (event, kind, bytes copied, copy
time, stages) these rows use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "BYTES_DEFINITION", "KINDS", "LARGE_EVENT_BYTES", "NO_MODULE", "STAGES", "UNKNOWN_SITE", "WARMUP_FACTOR",
    "CubeRow", "EventTemplate", "GroupRow", "HazardRow", "OpRow", "RunInfo",
    "SiteRow", "StageStats", "StepRow", "Totals", "TransferRow",
]  # fmt: skip

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
        windows: steps traced on a trigger signal, ``"first-last"`` each
            (``copytrace.windows``; empty when not armed).
        ring: the flight recorder's size when the trace holds only its last records
            (``copytrace.ring``), with what wrote it (``ring_reason``) and the older records
            it let go (``ring_skipped``).
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

    def ring_line(self) -> str:
        """What a flight recorder's dump holds, in one sentence ("" for another trace): the
        ring keeps from N to 2 N records (it lets go of the oldest N at a step boundary
        where 2 N are buffered, :mod:`copytrace.tracer._ring`), so the count is the file's."""
        if not self.ring:
            return ""
        skipped = f"; {self.ring_skipped:,} older event(s) were let go" if self.ring_skipped else ""
        return (
            f"flight recorder dump (COPYTRACE_RING={self.ring:,}, which keeps the last "
            f"{self.ring:,} to {2 * self.ring:,} events): this trace holds the last "
            f"{self.events_loaded:,} events before {self.ring_reason or 'the dump'}{skipped}"
        )


#: The two byte totals, defined once (the summary, the report and docs/trace-format.md say
#: this): logical bytes, what the program's copies hold; allocated, what they really made.
BYTES_DEFINITION = (
    "bytes copied = numel x element size of each copy's result; allocated = the new storage "
    "the copies really made: a deepcopy of a view copies its whole storage, a clone under "
    "vmap the whole batch, a copy_ into an existing tensor none"
)


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
        entries: For a call site, event count per other site of its events (the user's lines
            that reached a library call site, or the library sites a user's line reached).
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
    entries: dict[str, int] = field(default_factory=dict)

    @property
    def entry(self) -> str:
        """The other site of most of the events ('' if none)."""
        return max(self.entries, key=lambda k: (self.entries[k], k)) if self.entries else ""


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
        source: ``analysis`` or ``trace`` (the ``copytrace.hazards`` span in the trace file).
        runs: Labels of the runs (processes) whose events show it.
        patch: Its mechanical fix as a unified diff (``copytrace fix``), or ''.
        patch_reason: The fix's one line (code, file:line, the change, what it does to values).
        patch_exact: Whether the fix keeps values bit for bit (None without a patch).
        no_patch: Why a finding whose code has a fix gets none here, or ''.
    """

    code: str
    severity: str
    message: str
    fix: str
    call_sites: list[str] = field(default_factory=list)
    bytes: int | None = None
    steps: list[int] = field(default_factory=list)
    event_ids: Sequence[str] = field(default_factory=list)
    source: str = "analysis"
    runs: list[str] = field(default_factory=list)
    patch: str = ""
    patch_reason: str = ""
    patch_exact: bool | None = None
    no_patch: str = ""


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
        entry: The event's other call site (the user's line beside a library call site; the
            library's beside the user's line when grouped by it), else ''.
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
        entry: The other call site of these events (the user's line beside a library call
            site; the library's beside the user's with ``group_by="user"``), '' if none.
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
    entry: str = ""


