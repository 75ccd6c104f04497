"""The SDK sink: real OpenTelemetry SDK spans for SDK exporters or the user's provider.

:class:`SdkSink` builds SDK spans (explicit ids, parents and timestamps) with a
``TracerProvider``: copytrace's private one, feeding SDK span exporters (OTLP over HTTP or
gRPC, console, any ``SpanExporter``) through a synchronous batching processor that never
drops, or a provider the user supplied (used as is: never replaced, never shut down, only
flushed). Also here: the process's resource (:func:`make_resource`), the exporters
``OTEL_TRACES_EXPORTER`` names (:func:`exporters_from_env`), the ``OTEL_TRACES_SAMPLER``
decision (:func:`env_sampler_keeps`) and the one-shot :func:`export_events`.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from opentelemetry.trace.status import Status, StatusCode

from copytrace._redact import redact_args
from copytrace._version import __version__
from copytrace.export.hazard_span import hazard_parts
from copytrace.export.otlp_json import event_attributes
from copytrace.export.pipeline import Chunk, ExportPipeline, PlanItem, RunEnd, RunIds, span_times
from copytrace.schema import EVENT_HAZARD, SCOPE_NAME, SPAN_HAZARDS, CopyEvent

__all__ = [
    "SdkSink",
    "env_sampler_keeps",
    "export_events",
    "exporters_from_env",
    "make_resource",
]


# --- resource -----------------------------------------------------------------------------------
#: torchrun / torch.distributed variables -> resource attributes (no semantic convention
#: exists for them).
_DIST_ENV = (
    ("RANK", "copytrace.rank"),
    ("LOCAL_RANK", "copytrace.local_rank"),
    ("WORLD_SIZE", "copytrace.world_size"),
    ("LOCAL_WORLD_SIZE", "copytrace.local_world_size"),
    ("GROUP_RANK", "copytrace.group_rank"),
)


def make_resource(extra: dict[str, Any] | None = None) -> Resource:
    """The process's resource: service, process, host, rank; merged with ``OTEL_*``.

    ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME`` are applied by the SDK
    (``OTEL_SERVICE_NAME`` wins over everything; copytrace's own values win over
    ``OTEL_RESOURCE_ATTRIBUTES``, except ``service.name``, which copytrace only defaults).

    The SDK's resource detectors run one after another on the calling thread
    (:func:`_create_resource`), not in the SDK's thread pool.
    """
    attrs: dict[str, Any] = {
        "process.pid": os.getpid(),
        "process.executable.path": sys.executable,
        "process.command_args": redact_args(getattr(sys, "orig_argv", sys.argv)),
        "process.runtime.name": sys.implementation.name,
        "process.runtime.version": sys.version.split()[0],
        "host.name": socket.gethostname(),
    }
    for env, key in _DIST_ENV:
        value = os.environ.get(env)
        if value is not None and value.isdigit():
            attrs[key] = int(value)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id:
        attrs["copytrace.torchelastic_run_id"] = run_id
    attrs.update(extra or {})
    resource = _create_resource(attrs)
    line = resource.attributes.get("process.command_line")  # a resource detector's
    if isinstance(line, str):
        resource = resource.merge(
            Resource({"process.command_line": " ".join(redact_args(line.split(" ")))})
        )
    if "service.name" not in (extra or {}) and not os.environ.get("OTEL_SERVICE_NAME"):
        name = resource.attributes.get("service.name")
        if not name or str(name).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": "copytrace"}))
    return resource


def _create_resource(attrs: dict[str, Any]) -> Resource:
    """``Resource.create(attrs)`` with the SDK's detectors run in order on this thread.

    ``Resource.create`` runs them in a ``concurrent.futures.ThreadPoolExecutor``
    (``get_aggregated_resources`` in ``opentelemetry/sdk/resources/__init__.py``): a
    ``threading.Thread`` started inside the traced program, which runs its
    ``threading.settrace``/``setprofile`` hooks on the SDK's code, moves the executors' name
    counter (the program's next pool's threads are named ``ThreadPoolExecutor-1_0``, not
    ``-0_0``) and refuses work during interpreter shutdown. The merge order, the skipping of a
    detector that fails (unless it sets ``raise_on_error``) and the default service name are
    the SDK's; a detector is not given up after 5 s (the SDK's pool waits for it anyway). An
    SDK without ``_build_resource_detectors``: ``Resource.create``."""
    from opentelemetry.sdk import resources as sdk

    detectors = getattr(sdk, "_build_resource_detectors", None)
    merged = getattr(sdk, "_DEFAULT_RESOURCE", None)
    if detectors is None or merged is None:
        return Resource.create(attrs)
    for detector in detectors():
        try:
            merged = merged.merge(detector.detect())
        except Exception as err:
            if detector.raise_on_error:
                raise
            sdk.logger.warning("Exception %s in detector %s, ignoring", err, detector)
    merged = merged.merge(Resource(attrs))
    if not merged.attributes.get("service.name"):
        exe = f":{os.path.basename(sys.executable)}" if sys.executable else ""
        merged = merged.merge(Resource({"service.name": "unknown_service" + exe}))
    return merged


class _BatchingProcessor(SpanProcessor):
    """Synchronous batching: exports every ``batch`` ended spans, and the rest on flush.

    The SDK's BatchSpanProcessor drops spans when its queue fills faster than its worker
    drains it, which is exactly what building thousands of spans in a loop does; this one
    never drops (it runs on copytrace's export thread, never on the traced one). An exporter
    that keeps failing is given up after ``max_failures`` batches in a row; the spans it did
    not take are counted in ``lost``.
    """

    def __init__(self, exporter: SpanExporter, batch: int = 512, max_failures: int = 3) -> None:
        self._exporter = exporter
        self._batch = max(1, batch)
        self._spans: list[ReadableSpan] = []
        self._failures = 0
        self._max_failures = max_failures
        self.exported = 0
        self.lost = 0
        self.gave_up = False

    def on_end(self, span: ReadableSpan) -> None:
        self._spans.append(span)
        if len(self._spans) >= self._batch:
            self.force_flush()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        spans, self._spans = self._spans, []
        if not spans:
            return True
        if self.gave_up:
            self.lost += len(spans)
            return False
        try:
            ok = self._exporter.export(spans) == SpanExportResult.SUCCESS
        except Exception as err:  # an exporter must not break the export thread
            print(f"copytrace: {type(self._exporter).__name__} failed: {err}", file=sys.stderr)
            ok = False
        if ok:
            self._failures = 0
            self.exported += len(spans)
            return True
        self.lost += len(spans)
        self._failures += 1
        if self._failures >= self._max_failures:
            self.gave_up = True
            print(
                f"copytrace: giving up on {type(self._exporter).__name__} after "
                f"{self._failures} failed exports in a row; the trace file is not affected",
                file=sys.stderr,
            )
        return False

    def shutdown(self) -> None:
        self.force_flush()
        try:
            self._exporter.shutdown()
        except Exception as err:
            print(f"copytrace: {type(self._exporter).__name__} shutdown: {err}", file=sys.stderr)


# --- the SDK sink: real SDK spans for SDK exporters or the user's TracerProvider -------------------
class _PlannedIds(IdGenerator):
    """Hands the SDK the ids copytrace planned (random ids when none is set)."""

    def __init__(self) -> None:
        self._random = RandomIdGenerator()
        self.trace_id = 0
        self.next_span = 0

    def generate_span_id(self) -> int:
        span_id, self.next_span = self.next_span, 0
        return span_id or self._random.generate_span_id()

    def generate_trace_id(self) -> int:
        return self.trace_id or self._random.generate_trace_id()


class SdkSink:
    """Builds real OpenTelemetry SDK spans with explicit ids, parents and timestamps.
    A :class:`~copytrace.export.pipeline.Sink`.

    Args:
        exporters: SDK span exporters fed through copytrace's private ``TracerProvider``
            (synchronous batches on the export thread; an exporter that keeps failing is
            given up, not retried forever).
        tracer_provider: a provider of the user's instead (``exporters`` is then ignored): its
            processors, sampler and limits apply; it is flushed, never shut down or replaced.
        batch_size: spans per export call (``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``, default 512).
    """

    closes_before_hazards = False

    def __init__(
        self,
        exporters: Sequence[SpanExporter] = (),
        *,
        tracer_provider: Any = None,
        resource: Resource | None = None,
        batch_size: int | None = None,
    ) -> None:
        if batch_size is None:
            try:
                batch_size = int(os.environ.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE") or 512)
            except ValueError:
                batch_size = 512
        self._own = tracer_provider is None
        self._ids: _PlannedIds | None = None
        self.processors: list[_BatchingProcessor] = []
        if self._own:
            self._ids = _PlannedIds()
            provider = TracerProvider(
                resource=resource if resource is not None else make_resource(),
                id_generator=self._ids,
                shutdown_on_exit=False,
            )
            for exporter in exporters:
                proc = _BatchingProcessor(exporter, batch_size)
                self.processors.append(proc)
                provider.add_span_processor(proc)
            self.provider: Any = provider
        else:
            self.provider = tracer_provider
        self._tracer = self.provider.get_tracer(SCOPE_NAME, __version__)
        self._run_span: Any = None
        self._run: RunIds | None = None
        self._ctx: dict[str, SpanContext] = {}  # planned id -> SDK context (user provider)
        self._since_flush = 0
        self.spans = 0

    @property
    def early_parents(self) -> bool:
        """With copytrace's own provider a planned parent is the SDK's id, written or not; a
        user's provider makes its own ids: a parent not yet written would be the run."""
        return self._ids is not None

    def begin(self, run: RunIds) -> None:
        self._run = run
        if self._ids is not None:
            self._ids.trace_id = run.trace_id
            self._ids.next_span = run.span_id
        self._run_span = self._tracer.start_span(
            "copytrace.run", context=otel_context.Context(), start_time=run.start_ns + run.offset
        )
        self._ctx[run.span_hex] = self._run_span.get_span_context()

    def sampled(self) -> bool:
        """Whether the provider's sampler kept the run span (the whole trace)."""
        span = self._run_span
        return span is not None and span.get_span_context().trace_flags.sampled

    def _parent(self, planned: str) -> Any:
        run = self._run
        assert run is not None
        if self._ids is not None:  # our ids are the SDK's ids
            sc = SpanContext(run.trace_id, int(planned, 16), False, TraceFlags(TraceFlags.SAMPLED))
        else:
            sc = self._ctx.get(planned) or self._ctx[run.span_hex]
        return otel_trace.set_span_in_context(NonRecordingSpan(sc))

    def write(self, items: Iterable[PlanItem], chunk: Chunk, keep: Callable[[], set[str]]) -> None:
        run = self._run
        assert run is not None
        tracer, ids, off = self._tracer, self._ids, run.offset
        parents = self._ctx if ids is None else None
        for span_id, parent, ev, step in items:
            ctx = self._parent(parent)
            if ids is not None:
                ids.next_span = int(span_id, 16)
            if ev is not None and type(ev) is not CopyEvent:  # a compiled-region record
                span = tracer.start_span(ev.span_name, context=ctx, start_time=ev.start_ns + off,
                                         attributes=ev.span_attributes())  # fmt: skip
                for name, t, attrs in ev.span_events():
                    span.add_event(name, attrs, timestamp=t + off)
                span.end(end_time=ev.end_ns + off)
            elif ev is not None:
                start, end = span_times(ev, run.start_ns)
                span = tracer.start_span("copytrace." + ev.op, context=ctx, start_time=start + off,
                                         attributes=event_attributes(ev))  # fmt: skip
                if ev.error:
                    span.set_status(Status(StatusCode.ERROR, ev.error))
                span.end(end_time=end + off)
                if parents is not None and ev.group:
                    parents[span_id] = span.get_span_context()
            elif step is not None:
                span = tracer.start_span("copytrace.step", context=ctx, start_time=step[1] + off,
                                         attributes={"copytrace.step": step[0]})  # fmt: skip
                span.end(end_time=step[2] + off)
                if parents is not None:
                    parents[span_id] = span.get_span_context()
            self.spans += 1
            self._since_flush += 1
            if ids is None and self._since_flush >= 1024:
                self._flush_user_provider()  # the SDK's BatchSpanProcessor drops when full
        final = chunk.final
        if final is not None and self._run_span is not None:
            self._run_span.set_attributes(final.attributes)
            if final.error:
                self._run_span.set_status(Status(StatusCode.ERROR, final.error))
            self._run_span.end(end_time=final.end_ns + off)
            self.spans += 1
        if parents is not None:  # keep the run, and the parents of held-back events
            needed = keep()
            self._ctx = {k: v for k, v in parents.items() if k in needed or k == run.span_hex}
        self.flush()

    def write_hazards(
        self, findings: Sequence[Mapping[str, Any]], span_id: str, end_ns: int
    ) -> None:
        """The run's ``copytrace.hazards`` span(s), children of the run span: one
        ``copytrace.hazard`` span event per finding, at most ``HAZARDS_PER_SPAN`` per span
        (the SDK's default span event limit; see :func:`.hazard_span.hazard_parts`)."""
        run = self._run
        if run is None or self._run_span is None:
            return
        t = end_ns + run.offset
        for k, attrs, events in hazard_parts(findings):
            if self._ids is not None:
                self._ids.next_span = int(span_id, 16) if k == 0 else 0
            span = self._tracer.start_span(SPAN_HAZARDS, context=self._parent(run.span_hex),
                                           start_time=t, attributes=attrs)  # fmt: skip
            for event in events:
                span.add_event(EVENT_HAZARD, event, timestamp=t)
            span.end(end_time=t)
            self.spans += 1
        self.flush()

    def _flush_user_provider(self) -> None:
        self._since_flush = 0
        flush = getattr(self.provider, "force_flush", None)
        if flush is not None:
            try:
                flush()
            except Exception as err:
                print(f"copytrace: tracer provider flush failed: {err}", file=sys.stderr)

    def flush(self) -> None:
        if self._own:
            for proc in self.processors:
                proc.force_flush()
        else:
            self._flush_user_provider()

    def close(self) -> None:
        if self._own:
            self.provider.shutdown()
        else:
            self._flush_user_provider()

    def abandon(self) -> None:
        self.processors = []

    @property
    def lost(self) -> int:
        return sum(p.lost for p in self.processors)


# --- exporters named by OTEL_TRACES_EXPORTER --------------------------------------------------------
def _console_line(span: ReadableSpan) -> str:
    """One short line per span for the console exporter."""
    a = span.attributes or {}
    dur = ((span.end_time or 0) - (span.start_time or 0)) / 1e3
    parts = [f"{span.name:<22}", f"{dur:9.1f} us"]
    if "copytrace.bytes_logical" in a:
        parts.append(f"{a.get('copytrace.bytes_allocated', 0):>10} B new")
        parts.append(f"{a.get('copytrace.src_device', '')}->{a.get('copytrace.dst_device', '')}")
        kind = (
            "noop" if a.get("copytrace.noop") else "alias" if a.get("copytrace.alias") else "copy"
        )
        parts.append(kind)
    if "copytrace.step" in a:
        parts.append(f"step {a['copytrace.step']}")
    if "code.file.path" in a:
        parts.append(f"{a['code.file.path']}:{a.get('code.line.number', '?')}")
    return "  ".join(str(p) for p in parts) + "\n"


_PROTOCOLS = {"http/protobuf": "otlp_proto_http", "grpc": "otlp_proto_grpc"}
_EXTRAS = {"otlp_proto_http": "otlp", "otlp_proto_grpc": "otlp-grpc"}


def exporters_from_env(environ: Any = None) -> list[SpanExporter]:
    """The span exporters ``OTEL_TRACES_EXPORTER`` names (comma-separated), built from the
    ``opentelemetry_traces_exporter`` entry points as the SDK's auto-configuration does.

    ``otlp`` picks the exporter by ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` /
    ``OTEL_EXPORTER_OTLP_PROTOCOL`` (``http/protobuf``, the specification's default, or
    ``grpc``); each exporter reads its own endpoint, headers, timeout and compression
    variables. ``console`` prints one line per span; ``none`` or unset: no exporter (the trace
    file is written either way). A name that cannot be loaded prints one warning.
    """
    env = os.environ if environ is None else environ
    names = [n.strip() for n in (env.get("OTEL_TRACES_EXPORTER") or "").split(",") if n.strip()]
    out: list[SpanExporter] = []
    for name in names:
        lname = name.lower()
        if lname in ("none", ""):
            continue
        if lname == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            out.append(ConsoleSpanExporter(out=sys.stdout, formatter=_console_line))
            continue
        entry = lname
        if lname == "otlp":
            protocol = (
                env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf"
            ).strip()
            entry = _PROTOCOLS.get(protocol, "")
            if not entry:
                print(
                    f"copytrace: OTLP protocol {protocol!r} is not supported "
                    f"(use http/protobuf or grpc); no OTLP export",
                    file=sys.stderr,
                )
                continue
        try:
            from opentelemetry.util._importlib_metadata import entry_points

            eps = list(entry_points(group="opentelemetry_traces_exporter", name=entry))
            if not eps:
                extra = _EXTRAS.get(entry)
                hint = f" (pip install 'copytrace[{extra}]')" if extra else ""
                print(f"copytrace: trace exporter {name!r} is not installed{hint}", file=sys.stderr)
                continue
            out.append(eps[0].load()())
        except Exception as err:
            print(f"copytrace: cannot create trace exporter {name!r}: {err}", file=sys.stderr)
    return out


def env_sampler_keeps(run: RunIds) -> bool:
    """Whether the sampler configured by ``OTEL_TRACES_SAMPLER`` keeps this run's trace."""
    from opentelemetry.sdk.trace.sampling import _get_from_env_or_default

    try:
        sampler = _get_from_env_or_default()
        result = sampler.should_sample(None, run.trace_id, "copytrace.run")
    except Exception as err:
        print(f"copytrace: sampler error, tracing anyway: {err}", file=sys.stderr)
        return True
    return result.decision.is_sampled()


# --- one-shot export (all events at once) ------------------------------------------------------------
def export_events(
    events: Sequence[CopyEvent],
    step_starts: Sequence[int],
    start_ns: int,
    end_ns: int,
    run_attributes: dict[str, Any],
    exporter: SpanExporter,
    *,
    epoch_offset_ns: int,
    resource: Resource | None = None,
) -> int:
    """Build the run, step and event spans of a whole run and hand them to ``exporter``.

    Args:
        events: recorded events (times in ``perf_counter_ns``).
        step_starts: ``perf_counter_ns`` of each step boundary after step 0.
        start_ns, end_ns: ``perf_counter_ns`` when tracing started and stopped.
        run_attributes: attributes of the ``copytrace.run`` span.
        exporter: any SDK span exporter.
        epoch_offset_ns: add to a ``perf_counter_ns`` value to get ns since the Unix epoch.
        resource: the OpenTelemetry resource (default: :func:`make_resource`).

    Returns:
        The number of spans exported (run + steps + events).
    """
    res = resource if resource is not None else make_resource()
    run = RunIds(start_ns, epoch_offset_ns, res)
    sink = SdkSink([exporter], resource=res)
    pipeline = ExportPipeline(run, [sink])
    pipeline.begin()
    bounds = [start_ns, *step_starts, end_ns]
    steps = [(i, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    pipeline.close(Chunk(events, steps, final=RunEnd(end_ns, run_attributes)))
    return sink.spans
