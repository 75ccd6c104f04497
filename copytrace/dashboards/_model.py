"""The report model: the plain data behind the HTML report and the text summary.

:func:`build_model` computes it from the columnar event table
(:func:`copytrace.tracefile.event_table`), one section module at a time
(:mod:`copytrace.dashboards.sections`), with SQL in DuckDB (:mod:`._query`).

Definitions used throughout:

- An *event* is an event span that is not a deepcopy group (``copytrace.group`` absent or
  false), so a group's children are never counted twice.
- Every event has exactly one *kind*: ``noop`` (the call returned its input object,
  ``copytrace.noop``), else ``alias`` (the result shares storage, ``copytrace.alias``), else
  ``copy`` (real work: new storage, or data written by ``copy_``). A *copy* counted in
  totals is a ``copy`` event whose call did not raise (``copytrace.error`` absent), as in
  ``copytrace check``'s budgets; a failed call is counted apart.
- *Bytes copied* is the logical size (numel x element size) of the results of ``copy``
  events: the data actually written. Aliases and no-ops copy nothing, nor does a copy of a
  meta or fake tensor (``copytrace.fake``: no real memory, nothing moved). *Bytes allocated* is
  new storage (``copytrace.bytes_allocated``; 0 for ``copy_`` into an existing tensor).
- *Copy time* is the summed host-side duration of events (all kinds; a no-op ``.to()``
  still costs a call). The *copy-time share* of a step is copy time / step duration.
- Steps are split into *stages*: ``warmup`` (step 0, which runs from the start of tracing to
  the first step boundary, plus leading steps much slower than the steady state), ``tail``
  (the last step, from the last boundary to the end of tracing) and ``steady`` (the rest).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from copytrace.dashboards._format import (
    call_site_of,
    format_bytes,
    format_ns,
    top,
)
from copytrace.dashboards._rows import (
    KINDS,
    LARGE_EVENT_BYTES,
    NO_MODULE,
    STAGES,
    UNKNOWN_SITE,
    WARMUP_FACTOR,
    CubeRow,
    EventTemplate,
    GroupRow,
    HazardRow,
    OpRow,
    RunInfo,
    SiteRow,
    StageStats,
    StepRow,
    Totals,
    TransferRow,
)
from copytrace.dashboards.sections.hazards import from_finding as hazard_from_finding
from copytrace.dashboards.sections.hazards import run_analysis
from copytrace.dashboards.sections.timeline import SampleInfo

__all__ = [
    "KINDS", "LARGE_EVENT_BYTES", "NO_MODULE", "STAGES", "UNKNOWN_SITE", "WARMUP_FACTOR",
    "CubeRow", "EventTemplate", "GroupRow", "HazardRow", "OpRow",
    "ReportModel", "RunInfo", "SampleInfo", "SiteRow", "StageStats", "StepRow", "Totals",
    "TransferRow", "build_model", "call_site_of", "format_bytes", "format_ns",
    "hazard_from_finding", "run_analysis", "sample_events", "top",
]  # fmt: skip
#: Default budget of events kept for the timeline.
MAX_TIMELINE_POINTS = 30_000


@dataclass
class ReportModel:
    """Plain data behind the HTML report and the text summary.

    The timeline's sample of events (see :mod:`copytrace.dashboards.sections.timeline`; all
    events when there are at most ``max_points``) is stored as columns, in run then time
    order, that index :attr:`templates`: ``ev_run`` (index into ``runs``), ``ev_t_ns`` (start, ns since the
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
        analysis: ``ran``, ``failed: <error>``, ``not installed`` or ``skipped``.
        cube: Aggregates per (run, module, call site, op, kind, graph, phase).
        templates: Distinct descriptions of the sampled events.
        site_labels: Short display label per call-site key.
        site_sources: Source line per call-site key ('' if unavailable).
        group_by: The call site the "where from" tables group by: ``library`` (the
            library's call site where an event has one, else the user's line) or ``user``.
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
    total_events: int | None = None
    sample_info: SampleInfo = field(default_factory=SampleInfo)
    #: Compiled regions (``copytrace.dashboards._compiled.CompiledSection``), or None.
    compiled: Any = None
    group_by: str = "library"

    @property
    def multi_run(self) -> bool:
        """Whether the trace holds more than one process run."""
        return len(self.runs) > 1

    @property
    def n_events(self) -> int:
        """Number of events in the trace (the event columns hold a sample of them)."""
        return self.total_events if self.total_events is not None else len(self.ev_tpl)

    @property
    def n_sampled(self) -> int:
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


def build_model(
    source: Any,
    *,
    findings: Sequence[Any] | None = None,
    analyze: bool = False,
    read_sources: bool = True,
    progress: Any = None,
    max_points: int = MAX_TIMELINE_POINTS,
    timeline: bool = True,
    hazard_events: bool = True,
    patches: bool = True,
    group_by: str = "library",
) -> ReportModel:
    """Aggregate a trace into the data shown by the report.

    Args:
        source: An :class:`~copytrace.tracefile.EventTable`
            (:func:`copytrace.tracefile.event_table`) or a loaded
            :class:`~copytrace.tracefile.TraceData`.
        findings: Hazard findings already computed by ``copytrace.analysis.analyze``.
        analyze: If ``findings`` is None, run the analyser on the trace; else the hazards
            are those the tracer wrote into the trace (``copytrace.hazards`` spans).
        read_sources: Read each call site's source line from disk when the file exists and
            has not been modified since the run started.
        progress: Optional callable ``(n_sections_done)``, called after each section.
        max_points: Most events kept in the event columns for the timeline (hazard and
            error events are kept beyond it).
        timeline: Choose the timeline's events at all (False leaves the event columns
            empty: ``copytrace summary`` has no timeline).
        hazard_events: Complete each hazard's call sites, steps and runs from its events
            (False: only what the finding names, and the run of a one-run trace; the
            terminal summary shows neither, and on a 1M-event trace whose findings name
            every event this saves joining them all).
        patches: Plan each finding's patch (``copytrace fix``, against the files under the
            current directory) for the report to show; the terminal summary does not.
        group_by: What the call-site tables and the treemap group by: ``library`` (the
            library's call site where an event has one, else the user's line; each row
            names the user's lines beside it) or ``user`` (the user's line).

    Raises:
        ValueError: ``group_by`` is neither.

    Returns:
        Run metadata, totals (bytes in bytes, times in ns), steps with stages, per call site /
        module / op / device-pair aggregates, hazards, deepcopy groups, compiled regions and
        the sampled event columns (times in ns since each run's start).
    """
    from copytrace.dashboards._query import Query
    from copytrace.dashboards.sections.hazards import analysis_findings, finding_patches
    from copytrace.tracefile import TraceData, table_from_trace

    if group_by not in ("library", "user"):
        raise ValueError(f"group_by: not {group_by!r}; use library or user")
    found, status = analysis_findings(source, findings, analyze)
    fixes = finding_patches(source, found) if patches and found else None
    if hasattr(source, "analysis_views"):  # the analysis' per-event views: not needed again,
        source.analysis_views = None  # and never held with the report's own tables
    table = table_from_trace(source) if isinstance(source, TraceData) else source
    q = Query(table, group_by)
    if table is not source:  # the analysis numbered the loaded trace's runs in its own order
        q.start_order_known = False
    try:
        points = max_points if timeline else -1
        model = _build(q, found, status, read_sources, progress, points, hazard_events, fixes)
        model.group_by = group_by
        return model
    finally:
        q.close()


def _build(
    q: Any,
    findings: Any,
    status: str,
    read_sources: bool,
    progress: Any,
    max_points: int,
    hazard_events: bool = True,
    fixes: list[Any] | None = None,
) -> ReportModel:
    """The sections of :func:`build_model`, in order, over the open query ``q``."""
    from copytrace.dashboards import sections as sec

    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done)

    runs = sec.run.run_infos(q)
    sec.run.run_devices(q, runs)
    tick()
    hz_rows = sec.hazards.hazard_rows(q, findings, [r.label for r in runs], hazard_events, fixes)
    tick()
    step_rows = sec.steps.step_rows(q, runs)
    src = sec.sources.sources(q, runs, read_sources)
    tick()
    totals = sec.kinds.totals(q)
    totals.hazard_count = len(hz_rows)
    pairs, pairs_by_run = sec.transfers.transfers(q)
    tick()
    smp = sec.timeline.sample(q, max_points) if max_points >= 0 else sec.timeline.Sample()
    tick()
    return ReportModel(
        runs=runs, totals=totals, stages=sec.glance.stage_stats(step_rows),
        bad_lines=q.bad_lines, files=[str(f) for f in q.files], steps=step_rows,
        call_sites=src.call_sites, modules=src.modules, ops=src.ops, transfers=pairs,
        transfers_by_run=pairs_by_run, groups=sec.events.groups(q, runs), hazards=hz_rows,
        analysis=status, cube=src.cube, templates=smp.templates, site_labels=src.labels,
        site_sources=src.sources, ev_run=smp.ev_run, ev_t_ns=smp.ev_t_ns,
        ev_dur_ns=smp.ev_dur_ns, ev_step=smp.ev_step, ev_tpl=smp.ev_tpl,
        ev_span_id=smp.ev_span_id, ev_hazard=smp.ev_hazard, total_events=q.count(),
        sample_info=smp.info, compiled=sec.compiled.compiled_regions(q),
    )  # fmt: skip


def sample_events(
    model: ReportModel,
    max_points: int,
    *,
    large_bytes: int = LARGE_EVENT_BYTES,
    info: SampleInfo | None = None,
) -> list[int]:
    """Choose which of the model's events the timeline draws, at most about ``max_points``.

    The model holds the sample :func:`build_model` chose (by the same rules, in DuckDB);
    this picks from it again for a smaller budget.

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
        Sorted indices into the model's event columns.
    """
    info = info if info is not None else SampleInfo()
    info.large_bytes = large_bytes
    n = model.n_sampled
    if n <= max_points:
        info.large_bytes = model.sample_info.large_bytes
        info.per_hazard = model.sample_info.per_hazard
        return list(range(n))
    tpls = model.templates
    must, by_hazard, large, rest = _classify(model, large_bytes)
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


def _classify(
    model: ReportModel, large_bytes: int
) -> tuple[list[int], dict[int, list[int]], dict[int, list[int]], dict[tuple, list[int]]]:
    """The model's events as: errors, events per hazard, large copies per size (bytes),
    and the rest per (run, call site, op, kind); indices into the event columns."""
    tpls = model.templates
    must: list[int] = []
    by_hazard: dict[int, list[int]] = {}
    large: dict[int, list[int]] = {}
    rest: dict[tuple[Any, ...], list[int]] = {}
    for i in range(model.n_sampled):
        t = tpls[model.ev_tpl[i]]
        hz = model.ev_hazard[i]
        if t.error:
            must.append(i)
        elif hz >= 0:
            by_hazard.setdefault(hz, []).append(i)
        elif t.kind == "copy" and t.bytes_logical >= large_bytes:
            large.setdefault(t.bytes_logical, []).append(i)
        else:
            rest.setdefault((model.ev_run[i], t.call_site, t.op, t.kind), []).append(i)
    return must, by_hazard, large, rest


def _spread(items: list[int], k: int) -> list[int]:
    """``k`` items of ``items`` spread evenly (all of them if ``k >= len(items)``)."""
    if k >= len(items):
        return items
    if k <= 0:
        return []
    step = len(items) / k
    return [items[int(j * step + step / 2)] for j in range(k)]
