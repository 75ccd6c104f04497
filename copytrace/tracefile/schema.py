"""The trace format's names: span names, attribute keys and the defaults an absent attribute
stands for. The tracer writes with these names, the readers read with them.

``docs/trace-format.md`` describes the format; this module is its single source in code.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ANALYSIS_FIELDS",
    "ATTRIBUTE_OF",
    "EVENT_FIELDS",
    "FIELD_DEFAULTS",
    "HAZARD_ATTRS",
    "META_SPANS",
    "OMITTED_DEFAULTS",
    "PREFIX",
    "SCALAR_FIELDS",
    "SPAN_COMPILED",
    "SPAN_COMPILED_GRAPH",
    "SPAN_HAZARDS",
    "SPAN_RUN",
    "SPAN_STEP",
    "STR_FIELDS",
    "EVENT_HAZARD",
    "TRACE_GLOBS",
]

#: File name patterns read from a trace directory.
TRACE_GLOBS = ("*.otlp.jsonl", "*.otlp.jsonl.gz")
#: Span and attribute name prefix.
PREFIX = "copytrace."
#: The root span of one traced process run.
SPAN_RUN = "copytrace.run"
#: One training step.
SPAN_STEP = "copytrace.step"
#: The run's hazards, as ``copytrace.hazard`` span events (a child of the run span).
SPAN_HAZARDS = "copytrace.hazards"
#: A call into torch.compile'd code while tracing.
SPAN_COMPILED = "copytrace.compiled"
#: One compiled graph; its ``copytrace.graph_copy`` span events are the copies in it.
SPAN_COMPILED_GRAPH = "copytrace.compiled_graph"
#: Spans that are not copy events; the event table keeps their attributes as JSON.
META_SPANS = frozenset((SPAN_RUN, SPAN_STEP, SPAN_HAZARDS, SPAN_COMPILED, SPAN_COMPILED_GRAPH))
#: Span event name of one hazard.
EVENT_HAZARD = "copytrace.hazard"
#: Attributes of a ``copytrace.hazard`` span event (field -> key).
HAZARD_ATTRS = {
    "code": "copytrace.hazard.code",
    "severity": "copytrace.hazard.severity",
    "message": "copytrace.hazard.message",
    "fix": "copytrace.hazard.fix",
    "call_sites": "copytrace.hazard.call_sites",
    "bytes": "copytrace.hazard.bytes",
    "span_ids": "copytrace.hazard.span_ids",
    "events": "copytrace.hazard.events",
}

# CopyEvent field -> span attribute, by value type.
STR_FIELDS = (
    ("op", "copytrace.op"), ("dtype", "copytrace.dtype"), ("src_dtype", "copytrace.src_dtype"),
    ("src_device", "copytrace.src_device"), ("dst_device", "copytrace.dst_device"),
    ("transfer", "copytrace.transfer"), ("grad_fn", "copytrace.grad_fn"),
    ("graph", "copytrace.graph"), ("phase", "copytrace.phase"), ("module", "copytrace.module"),
    ("object_type", "copytrace.object_type"), ("error", "copytrace.error"),
    ("file", "code.file.path"), ("function", "code.function.name"),
    ("thread_name", "thread.name"), ("via", "copytrace.via"), ("origin", "copytrace.origin"),
)  # fmt: skip
SCALAR_FIELDS = (
    ("bytes_allocated", "copytrace.bytes_allocated"), ("bytes_logical", "copytrace.bytes_logical"),
    ("alias", "copytrace.alias"), ("noop", "copytrace.noop"),
    ("non_blocking", "copytrace.non_blocking"), ("requires_grad", "copytrace.requires_grad"),
    ("src_requires_grad", "copytrace.src_requires_grad"), ("is_leaf", "copytrace.is_leaf"),
    ("step", "copytrace.step"), ("line", "code.line.number"), ("thread_id", "thread.id"),
    ("pinned", "copytrace.pinned"),
)  # fmt: skip
#: Facts for copytrace.analysis (hazards); written only when set (not None, False or empty).
ANALYSIS_FIELDS = (
    ("src_storage", "copytrace.src_storage"), ("src_offset", "copytrace.src_offset"),
    ("src_stride", "copytrace.src_stride"), ("src_version", "copytrace.src_version"),
    ("dst_storage", "copytrace.dst_storage"), ("dst_version", "copytrace.dst_version"),
    ("inplace_writes", "copytrace.inplace_writes"), ("saved_by", "copytrace.saved_by"),
    ("write_site", "copytrace.write_site"), ("src_name", "copytrace.src_name"),
    ("retained_bytes", "copytrace.retained_bytes"), ("snapshot", "copytrace.snapshot"),
    ("stale", "copytrace.stale"), ("fake", "copytrace.fake"),
)  # fmt: skip
#: Array-valued and group fields (written when non-empty / on a group).
LIST_FIELDS = (("aten", "copytrace.aten"), ("shape", "copytrace.shape"))
GROUP_FIELDS = (("group", "copytrace.group"), ("tensors", "copytrace.tensors"))

#: Every event field with its attribute key, in CopyEvent order where it has one.
EVENT_FIELDS: tuple[tuple[str, str], ...] = (
    STR_FIELDS + SCALAR_FIELDS + ANALYSIS_FIELDS + LIST_FIELDS + GROUP_FIELDS
)
#: CopyEvent field name -> span attribute key.
ATTRIBUTE_OF: dict[str, str] = dict(EVENT_FIELDS)

#: Attributes left out when they hold this value (a reader takes absent as this value):
#: false flags, zero new bytes and no transfer, the most common values, which cost ~50 bytes
#: each uncompressed. ``copytrace.pinned`` is written on host-to-device copies only.
OMITTED_DEFAULTS: dict[str, Any] = {
    "copytrace.alias": False,
    "copytrace.noop": False,
    "copytrace.non_blocking": False,
    "copytrace.requires_grad": False,
    "copytrace.src_requires_grad": False,
    "copytrace.bytes_allocated": 0,
    "copytrace.transfer": "none",
}

#: What a loaded event's field is when its attribute is absent (None for the rest).
FIELD_DEFAULTS: dict[str, Any] = {
    "aten": (),
    "bytes_allocated": 0,
    "bytes_logical": 0,
    "alias": False,
    "noop": False,
    "shape": (),
    "transfer": "none",
    "non_blocking": False,
    "requires_grad": False,
    "src_requires_grad": False,
    "group": False,
    "tensors": 1,
    "src_stride": (),
    "saved_by": (),
    "snapshot": False,
    "stale": False,
    "fake": False,
}
