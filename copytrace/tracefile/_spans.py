"""The spans of a loaded trace as Python objects: runs, steps and events.

Loaded events have the field names of :class:`copytrace.CopyEvent` (``ev.op``,
``ev.bytes_allocated``, ``ev.file``...), with the defaults absent attributes stand for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from copytrace.schema import ATTRIBUTE_OF, FIELD_DEFAULTS, PREFIX

__all__ = ["Event", "Run", "Step", "TraceData"]

_PREFIX = PREFIX


@dataclass(slots=True)
class Step:
    """One ``copytrace.step`` span.

    Attributes:
        step: 0-based step number.
        start_ns: Span start, ns since the epoch.
        end_ns: Span end, ns since the epoch.
        span_id: The span's id (16 hex digits).
        attrs: All span attributes.
    """

    step: int
    start_ns: int
    end_ns: int
    span_id: str = ""
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_ns(self) -> int:
        """Step duration in ns (never negative)."""
        return max(0, self.end_ns - self.start_ns)


@dataclass(slots=True)
class Event:
    """One copy/alias event span, or a deepcopy group span (``copytrace.group`` true).

    Attributes:
        name: Span name, e.g. ``copytrace.clone``.
        span_id: The span's id.
        parent_id: The parent span's id (a step or a group), or None for a root span.
        start_ns: Call start, ns since the epoch.
        end_ns: Call end, ns since the epoch.
        attrs: All span attributes, decoded to plain Python values.
        span_events: The span's OTLP events as ``(name, time_ns, attributes)`` tuples, e.g.
            a ``copytrace.hazard`` event; empty for most spans.
    """

    name: str
    span_id: str
    parent_id: str | None
    start_ns: int
    end_ns: int
    attrs: dict[str, Any] = field(default_factory=dict)
    span_events: tuple[tuple[str, int, dict[str, Any]], ...] = ()

    @property
    def duration_ns(self) -> int:
        """Host-side call duration in ns (never negative)."""
        return max(0, self.end_ns - self.start_ns)

    @property
    def is_group(self) -> bool:
        """True for a deepcopy group span, whose bytes are the sum of its children."""
        return self.attrs.get("copytrace.group") is True

    @property
    def op(self) -> str:
        """The user-level op (``copytrace.op``), falling back to the span name."""
        op = self.attrs.get("copytrace.op")
        if isinstance(op, str) and op:
            return op
        return self.name[len(_PREFIX) :] if self.name.startswith(_PREFIX) else self.name


def _field_property(name: str, key: str) -> property:
    default = FIELD_DEFAULTS.get(name)

    def get(self: Event) -> Any:
        value = self.attrs.get(key)
        if value is None:
            return default
        return tuple(value) if type(value) is list else value

    get.__name__ = name
    get.__doc__ = f"``{key}`` (the :class:`copytrace.CopyEvent` field ``{name}``)."
    return property(get)


# Every CopyEvent field the span carries, under the CopyEvent name (``ev.bytes_allocated``,
# ``ev.file``, ``ev.line``...), with the default an absent attribute stands for.
for _name, _key in ATTRIBUTE_OF.items():
    if _name != "op":
        setattr(Event, _name, _field_property(_name, _key))
del _name, _key


@dataclass
class Run:
    """All spans of one traced process run (one OTLP trace id).

    Attributes:
        trace_id: The OTLP trace id (32 hex digits).
        resource: Resource attributes (``process.pid``, ``host.name``, ...).
        attrs: Attributes of the ``copytrace.run`` span; empty when that span is missing
            (e.g. the file was cut before the tracer stopped).
        start_ns: Run start in ns since the epoch: the run span's start, else the earliest
            span start seen.
        end_ns: Run end in ns since the epoch: the run span's end, else the latest span end.
        has_run_span: Whether a ``copytrace.run`` span was read.
        steps: Step spans, sorted by step number.
        events: Event and group spans, sorted by start time.
        files: Trace files this run's spans were read from.
        hazards: Attributes of the ``copytrace.hazard`` span events of the run's
            ``copytrace.hazards`` span (the hazards the tracer found at stop).
        compiled_calls: ``copytrace.compiled`` spans (calls into torch.compile'd code), in
            start order.
        compiled_graphs: ``copytrace.compiled_graph`` spans (one per compiled graph; its
            ``copytrace.graph_copy`` span events are the copies found in the graph).
    """

    trace_id: str
    resource: dict[str, Any] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)
    start_ns: int = 0
    end_ns: int = 0
    has_run_span: bool = False
    steps: list[Step] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    hazards: list[dict[str, Any]] = field(default_factory=list)
    compiled_calls: list[Event] = field(default_factory=list)
    compiled_graphs: list[Event] = field(default_factory=list)

    @property
    def duration_ns(self) -> int:
        """Run duration in ns (never negative)."""
        return max(0, self.end_ns - self.start_ns)

    def __repr__(self) -> str:
        """Counts, not contents: the generated form printed every span (hundreds of
        kilobytes at the REPL for a few hundred events)."""
        return (
            f"Run(trace_id={self.trace_id!r}, pid={self.resource.get('process.pid')!r}, "
            f"steps={len(self.steps)}, events={len(self.events)}, "
            f"hazards={len(self.hazards)}, files={[str(f) for f in self.files]!r})"
        )


@dataclass
class TraceData:
    """Everything read from one trace file or directory.

    In a notebook it shows its summary: :mod:`copytrace.dashboards` gives it
    ``_repr_html_`` / ``_repr_markdown_`` when imported (``copytrace.load_trace`` imports it),
    so that this reader never imports the dashboards.

    Attributes:
        runs: One entry per traced process run, sorted by start time.
        files: The trace files read, sorted.
        bad_lines: Lines that could not be parsed (cut mid-write, garbage) and were skipped.
        empty_files: Files that held no readable copytrace spans (skipped).
    """

    runs: list[Run] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    bad_lines: int = 0
    empty_files: list[Path] = field(default_factory=list)

    @property
    def events(self) -> list[Event]:
        """All event and group spans of all runs."""
        return [ev for run in self.runs for ev in run.events]

    def __repr__(self) -> str:
        """Counts, not contents (as :meth:`Run.__repr__`): ``copytrace.load_trace(DIR)``
        typed at a terminal's REPL prints one line."""
        return (
            f"TraceData(runs={len(self.runs)}, events={sum(len(r.events) for r in self.runs)}, "
            f"files={[str(f) for f in self.files]!r}, bad_lines={self.bad_lines}, "
            f"empty_files={[str(f) for f in self.empty_files]!r})"
        )
