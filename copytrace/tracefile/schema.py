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
    "CACHE_DIR",
    "EVENT_HAZARD",
    "SIDECAR_SUFFIX",
    "TABLE_COLUMNS",
    "TABLE_VERSION",
    "TRACE_GLOBS",
    "column_kind",
    "event_schema",
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


# --- the event table ------------------------------------------------------------------------
#: Version of the event table's columns (the Parquet cache and the sidecar carry it).
TABLE_VERSION = "1"
#: Hidden folder beside the trace files for their event tables: the tracer's columnar sidecar
#: (``<file>`` + :data:`SIDECAR_SUFFIX`) and the Parquet cache of files read without one.
CACHE_DIR = ".copytrace-cache"
#: The sidecar of a trace file is the folder ``CACHE_DIR/<file name>`` + this suffix.
SIDECAR_SUFFIX = ".events"

_INT_FIELDS = frozenset((
    "bytes_allocated", "bytes_logical", "step", "line", "thread_id", "src_storage",
    "src_offset", "src_version", "dst_storage", "dst_version", "inplace_writes",
    "retained_bytes", "tensors",
))  # fmt: skip
_BOOL_FIELDS = frozenset((
    "alias", "noop", "non_blocking", "requires_grad", "src_requires_grad", "is_leaf",
    "pinned", "snapshot", "stale", "group", "fake",
))  # fmt: skip
_INT_LIST_FIELDS = frozenset(("shape", "src_stride"))
_STR_LIST_FIELDS = frozenset(("aten", "saved_by"))


def column_kind(name: str) -> str:
    """The value kind of event field ``name``: ``str``, ``int``, ``bool``, ``int_list`` or
    ``str_list``."""
    if name in _INT_FIELDS:
        return "int"
    if name in _BOOL_FIELDS:
        return "bool"
    if name in _INT_LIST_FIELDS:
        return "int_list"
    if name in _STR_LIST_FIELDS:
        return "str_list"
    return "str"


#: The event table's columns in order, as ``(name, kind)`` (see :func:`column_kind`): span
#: identity and times (ns since the epoch), one column per CopyEvent field (null where the
#: span has no such attribute), and the attributes / span events of the spans in
#: :data:`META_SPANS` as JSON text. The Parquet cache and the tracer's sidecar both have
#: exactly these columns (:func:`event_schema`).
TABLE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("run", "str"), ("span_id", "str"), ("parent_id", "str"), ("name", "str"),
    ("start_ns", "int"), ("end_ns", "int"),
    *[(name, column_kind(name)) for name in ATTRIBUTE_OF],
    ("attrs_json", "str"), ("events_json", "str"),
)  # fmt: skip

_SCHEMA: list[Any] = []


def event_schema() -> Any:
    """:data:`TABLE_COLUMNS` as a ``pyarrow.Schema`` (imports pyarrow on first use)."""
    if not _SCHEMA:
        import pyarrow as pa

        types = {"str": pa.string(), "int": pa.int64(), "bool": pa.bool_(),
                 "int_list": pa.list_(pa.int64()), "str_list": pa.list_(pa.string())}  # fmt: skip
        _SCHEMA.append(pa.schema([(name, types[kind]) for name, kind in TABLE_COLUMNS]))
    return _SCHEMA[0]
