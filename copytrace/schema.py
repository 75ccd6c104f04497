"""The contract between the tracer and every reader: the copy event's fields, the span names,
the attribute keys and the defaults an absent attribute stands for.

The field table :data:`FIELDS` spells each :class:`CopyEvent` field once: its span attribute,
its value kind, its default in memory and when its attribute is absent from a trace file.
Everything else is made from it: ``CopyEvent.__slots__`` and its generated ``__init__``, the
attribute groups the encoder writes (:data:`STR_FIELDS` ...), the event table's columns
(:data:`TABLE_COLUMNS`) and the field list the C observer resolves at set-up
(:data:`EVENT_SLOTS`: the C record checks the fields it writes against them). ``docs/trace-format.md`` describes the format; this module is its
single source in code. It imports neither torch nor pyarrow (pyarrow only inside
:func:`event_schema`), so the tracer, the exporters and the readers all stand on it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, NamedTuple

__all__ = [
    "ANALYSIS_FIELDS",
    "ATTRIBUTE_OF",
    "CACHE_DIR",
    "EVENT_FIELDS",
    "EVENT_HAZARD",
    "EVENT_SLOTS",
    "FIELDS",
    "FIELD_DEFAULTS",
    "GRAPH_STATES",
    "GROUP_FIELDS",
    "HAZARD_ATTRS",
    "LIST_FIELDS",
    "META_SPANS",
    "OMITTED_DEFAULTS",
    "PHASES",
    "PREFIX",
    "SCALAR_FIELDS",
    "SCOPE_NAME",
    "SIDECAR_KEY_BYTES",
    "SIDECAR_KEY_RESOURCES",
    "SIDECAR_KEY_TAIL",
    "SIDECAR_KEY_VERSION",
    "SIDECAR_SUFFIX",
    "SIDECAR_TAIL_BYTES",
    "SPAN_COMPILED",
    "SPAN_COMPILED_GRAPH",
    "SPAN_HAZARDS",
    "SPAN_RUN",
    "SPAN_STEP",
    "STR_FIELDS",
    "TABLE_COLUMNS",
    "TABLE_VERSION",
    "TRACE_GLOBS",
    "CopyEvent",
    "Field",
    "column_kind",
    "event_schema",
    "json_tail",
    "sidecar_dir",
]

#: File name patterns read from a trace directory.
TRACE_GLOBS = ("*.otlp.jsonl", "*.otlp.jsonl.gz")
#: Span and attribute name prefix.
PREFIX = "copytrace."
#: The instrumentation scope (name) of every span copytrace writes.
SCOPE_NAME = "copytrace"
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

#: Values of ``CopyEvent.phase`` and ``CopyEvent.graph``.
PHASES = ("forward", "backward", "optimizer", "other")
GRAPH_STATES = ("attached", "detached", "none")


# --- the field table ------------------------------------------------------------------------
class Field(NamedTuple):
    """One :class:`CopyEvent` field.

    Attributes:
        name: The field (``CopyEvent`` attribute and event-table column).
        key: Its span attribute, or None for a field the span carries otherwise (``seq``,
            the times, the parent) or not at all.
        kind: Value kind: ``str``, ``int``, ``bool``, ``int_list`` or ``str_list``.
        group: How the attribute is written: ``str`` (when truthy), ``scalar`` (when not
            None), ``analysis`` (when set: not None, False or empty), ``list`` (when
            non-empty), ``group`` (on a deepcopy group); empty for no attribute.
        default: The field's value on a new ``CopyEvent`` when not given.
        absent: A loaded event's value when the attribute is absent from the span.
        omit: The attribute is left out when it holds ``absent`` (the common values, ~50
            bytes each uncompressed; a reader takes absent as that value).
    """

    name: str
    key: str | None
    kind: str
    group: str
    default: Any = None
    absent: Any = None
    omit: bool = False


_C = PREFIX
#: Every CopyEvent field, in event-table column order (the fields without an attribute first).
FIELDS: tuple[Field, ...] = (
    Field("seq", None, "int", ""),
    Field("start_ns", None, "int", ""),
    Field("end_ns", None, "int", ""),
    Field("parent", None, "int", "", -1),
    # written when truthy
    Field("op", _C + "op", "str", "str"),
    Field("dtype", _C + "dtype", "str", "str"),
    Field("src_dtype", _C + "src_dtype", "str", "str"),
    Field("src_device", _C + "src_device", "str", "str"),
    Field("dst_device", _C + "dst_device", "str", "str"),
    Field("transfer", _C + "transfer", "str", "str", "none", "none", omit=True),
    Field("grad_fn", _C + "grad_fn", "str", "str"),
    Field("graph", _C + "graph", "str", "str", "none"),
    Field("phase", _C + "phase", "str", "str", "other"),
    Field("module", _C + "module", "str", "str"),
    Field("object_type", _C + "object_type", "str", "str"),
    Field("error", _C + "error", "str", "str"),
    Field("file", "code.file.path", "str", "str"),
    Field("function", "code.function.name", "str", "str"),
    Field("thread_name", "thread.name", "str", "str"),
    Field("via", _C + "via", "str", "str"),
    Field("origin", _C + "origin", "str", "str"),
    # written when not None
    Field("bytes_allocated", _C + "bytes_allocated", "int", "scalar", 0, 0, omit=True),
    Field("bytes_logical", _C + "bytes_logical", "int", "scalar", 0, 0),
    Field("alias", _C + "alias", "bool", "scalar", False, False, omit=True),
    Field("noop", _C + "noop", "bool", "scalar", False, False, omit=True),
    Field("non_blocking", _C + "non_blocking", "bool", "scalar", False, False, omit=True),
    Field("requires_grad", _C + "requires_grad", "bool", "scalar", False, False, omit=True),
    Field("src_requires_grad", _C + "src_requires_grad", "bool", "scalar", False, False,
          omit=True),
    Field("is_leaf", _C + "is_leaf", "bool", "scalar", True),
    Field("step", _C + "step", "int", "scalar", 0),
    Field("line", "code.line.number", "int", "scalar"),
    Field("thread_id", "thread.id", "int", "scalar"),
    Field("pinned", _C + "pinned", "bool", "scalar", False),  # on host-to-device copies only
    # --- the library's call site (issue 23): the innermost frame of an installed package
    # other than torch between the copy and the user's line (code.* above); OTel's code.*
    # names under copytrace.library. Written when set.
    Field("lib_file", _C + "library.file.path", "str", "str"),
    Field("lib_line", _C + "library.line.number", "int", "scalar"),
    Field("lib_function", _C + "library.function.name", "str", "str"),
    # an aten cast made while autocast ran with its weight cache off (analysis fact)
    Field("autocast_nocache", _C + "autocast_nocache", "bool", "analysis", False, False),
    # --- end of the library's call site and the autocast fact
    # facts for copytrace.analysis (hazards), written when set
    Field("src_storage", _C + "src_storage", "int", "analysis"),
    Field("src_offset", _C + "src_offset", "int", "analysis"),
    Field("src_stride", _C + "src_stride", "int_list", "analysis", (), ()),
    Field("src_version", _C + "src_version", "int", "analysis"),
    Field("dst_storage", _C + "dst_storage", "int", "analysis"),
    Field("dst_version", _C + "dst_version", "int", "analysis"),
    Field("inplace_writes", _C + "inplace_writes", "int", "analysis"),
    Field("saved_by", _C + "saved_by", "str_list", "analysis", (), ()),
    Field("write_site", _C + "write_site", "str", "analysis"),
    Field("src_name", _C + "src_name", "str", "analysis"),
    Field("load_site", _C + "load_site", "str", "analysis"),
    Field("retained_bytes", _C + "retained_bytes", "int", "analysis"),
    Field("snapshot", _C + "snapshot", "bool", "analysis", False, False),
    Field("stale", _C + "stale", "bool", "analysis", False, False),
    Field("fake", _C + "fake", "bool", "analysis", False, False),
    # --- facts of what the tensor is (batched, storage-level, recomputed), written when set
    Field("batch_size", _C + "batch_size", "int", "analysis"),
    Field("storage_move", _C + "storage_move", "bool", "analysis", False, False),
    Field("recompute", _C + "recompute", "bool", "analysis", False, False),
    # --- end of the tensor-kind facts
    # arrays written when non-empty, and the deepcopy group's two
    Field("aten", _C + "aten", "str_list", "list", (), ()),
    Field("shape", _C + "shape", "int_list", "list", (), ()),
    Field("group", _C + "group", "bool", "group", False, False),
    Field("tensors", _C + "tensors", "int", "group", 1, 1),
)  # fmt: skip
del _C


def _pairs(group: str) -> tuple[tuple[str, str], ...]:
    return tuple((f.name, f.key) for f in FIELDS if f.group == group and f.key is not None)


#: CopyEvent field -> span attribute, by how the attribute is written (see :attr:`Field.group`).
STR_FIELDS = _pairs("str")
SCALAR_FIELDS = _pairs("scalar")
#: Facts for copytrace.analysis (hazards); written only when set (not None, False or empty).
ANALYSIS_FIELDS = _pairs("analysis")
#: Array-valued and group fields (written when non-empty / on a group).
LIST_FIELDS = _pairs("list")
GROUP_FIELDS = _pairs("group")
#: Every event field with its attribute key, in event-table column order.
EVENT_FIELDS: tuple[tuple[str, str], ...] = tuple(
    (f.name, f.key) for f in FIELDS if f.key is not None
)
#: CopyEvent field name -> span attribute key.
ATTRIBUTE_OF: dict[str, str] = dict(EVENT_FIELDS)
#: Attributes left out when they hold this value (a reader takes absent as this value): false
#: flags, zero new bytes and no transfer. ``copytrace.pinned`` is written on host-to-device
#: copies only.
OMITTED_DEFAULTS: dict[str, Any] = {f.key: f.absent for f in FIELDS if f.omit and f.key}
#: What a loaded event's field is when its attribute is absent (None for the rest).
FIELD_DEFAULTS: dict[str, Any] = {f.name: f.absent for f in FIELDS if f.absent is not None}
#: ``CopyEvent.__slots__``: every field name, in :data:`FIELDS` order.
EVENT_SLOTS: tuple[str, ...] = tuple(f.name for f in FIELDS)
_KIND_OF = {f.name: f.kind for f in FIELDS}



def column_kind(name: str) -> str:
    """The value kind of event field ``name``: ``str``, ``int``, ``bool``, ``int_list`` or
    ``str_list`` (``str`` for a name that is no field)."""
    return _KIND_OF.get(name, "str")


# --- the event record -----------------------------------------------------------------------
class CopyEvent:
    """One tensor copy or alias seen while tracing.

    Plain metadata only: an event never holds a reference to a tensor.

    Attributes:
        seq: 0-based sequence number within the trace.
        op: user-level API (``clone``, ``detach``, ``data_get``, ``deepcopy``, ``to``, ...), or
            ``implicit`` for an aten-level copy no API call explains.
        aten: aten overloads that did the work, e.g. ``["aten::clone"]``; empty for a no-op.
        bytes_allocated: bytes of newly allocated storage (0 for an alias and for ``copy_``
            into an existing tensor).
        bytes_logical: numel x element size of the result, in bytes.
        alias: the result shares storage with its input.
        noop: the call returned its input object itself (``.to()`` to the same device/dtype).
        shape: result shape.
        dtype, src_dtype: result / input dtype names, e.g. ``"float32"``.
        src_device, dst_device: e.g. ``"cpu"``, ``"cuda:0"``.
        transfer: ``"none"``, ``"h2d"``, ``"d2h"`` or ``"d2d"``.
        non_blocking: ``non_blocking=True`` was passed.
        requires_grad, src_requires_grad: of the result / of the input.
        grad_fn: class name of the result's ``grad_fn`` (``"CloneBackward0"``) or ``None``;
            on a failed ``deepcopy`` of a non-leaf tensor, the tensor's own.
        is_leaf: the result is an autograd leaf (on a failed ``deepcopy``: the input).
        graph: ``"attached"`` (result is in the input's autograd graph), ``"detached"`` (the
            input required grad but the result is cut from its graph) or ``"none"``.
        phase: ``"forward"``, ``"backward"``, ``"optimizer"`` or ``"other"``.
        step: step number at the time of the event.
        module: ``nn.Module`` path (``"CharLM.blocks.0.attn"``) or ``None``.
        file, line, function: the user's call site (first frame outside copytrace, torch,
            the standard library and installed packages), or ``None`` when there is none.
        lib_file, lib_line, lib_function: the library's call site: the innermost frame of an
            installed package other than torch (``site-packages``, ``dist-packages`` or
            ``COPYTRACE_LIBRARY_PATHS``) between the copy and the user's line, e.g.
            transformers' ``sdpa_attention_forward``; ``None`` when the user's code called
            torch directly.
        thread_id, thread_name: the Python thread that made the copy.
        start_ns, end_ns: ``time.perf_counter_ns()`` around the call (host time; on CUDA the
            launch, not the transfer).
        parent: ``seq`` of the enclosing deepcopy group event, or -1.
        group: this event is a deepcopy group over child events (its bytes are their sum).
        object_type: on a group, the deep-copied object's type.
        tensors: on a group, how many tensors were copied; 1 otherwise.
        error: exception type name when the op raised, else ``None``.
        via: the torch function through which the user's line reached the copy
            (``clip_grad_norm_``, ``Module._save_to_state_dict``), or for a backward copy the
            autograd node that made it (``ToCopyBackward0``); ``None`` for a direct call.
        origin: for a backward copy, ``file:line`` of the forward call whose ``grad_fn`` made
            it (known for copies whose forward was recorded by copytrace).
        pinned: for a host-to-device copy, whether the source is in pinned memory.
        src_storage, dst_storage: trace-unique ids of the input's / result's storage (ids,
            not addresses: a storage allocated later at a reused address gets a new id).
        src_offset, src_stride: the input's storage offset and strides (its view).
        src_version, dst_version: the input's version counter at the call / the result's
            right after it (in-place writes move a counter; ``.data`` writes do not).
        inplace_writes: on a ``data_get`` of a tensor that requires grad, in-place writes
            made through this ``.data`` alias or its views; on an API-level copy into new
            storage, in-place calls on the result while it lived (``None`` when not watched).
        saved_by: on a ``data_get`` / ``data_set``, the autograd nodes (``AddmmBackward0.mat2``)
            that had saved the tensor before the write / rebinding and that a later backward
            then ran: the gradient they computed used the changed values.
        write_site: ``file:line function`` of that in-place write (or rebinding); on an
            advanced-indexing copy, of the first in-place write into it when it then died
            unused (a lost write); on an alias from a no-op conversion, a ``reshape`` view or
            ``copy.copy``, of the first in-place write through it or its input while the
            program held both.
        src_name: ``Module.path.param`` of the written tensor, when it is a parameter or
            buffer of a module seen in forward; on a failed ``deepcopy`` of a non-leaf tensor,
            where the deep-copied object held it (``Net.last_hidden``, ``dict['logits']``).
        load_site: on a ``snapshot`` event handed over by ``load_state_dict``, ``file:line
            function`` of the user's load call that made the receiver share the storage
            (``load_state_dict(sd, assign=True)``, an optimizer's load keeping the tensors).
        retained_bytes: on an attached copy, bytes of saved tensors its autograd graph still
            held when its step ended (no backward had run through it); ``None`` otherwise.
        snapshot: a ``detach`` alias made by ``Module.state_dict()``.
        stale: on a snapshot, its source was changed in place while the alias was kept.
        autocast_nocache: an implicit ``aten::_to_copy`` in forward, made while autocast was
            on for its device with its weight cache off (``torch.autocast(...,
            cache_enabled=False)``): autocast casts each weight again at every use.
        fake: the result is a FakeTensor or a meta tensor (``FakeTensorMode``, torch.compile's
            tracing, ``FakeCopyMode``): ``bytes_logical`` is what a real copy would move,
            ``bytes_allocated`` is 0 (no real memory).
        batch_size: the result is a batched tensor (``torch.func.vmap``): how many members
            its one call ran over (the product over nested vmap levels); ``shape`` is one
            member's, ``bytes_logical`` and ``bytes_allocated`` are the whole batch's (what
            the dispatch level sees); None for a plain tensor.
        storage_move: ``share_memory_()`` (or ``Module.share_memory()``) moved the storage's
            bytes into a new shared segment that the same storage now owns:
            ``bytes_allocated`` is the storage's bytes, ``src_storage`` and ``dst_storage``
            are its one id (the storage object stays, its memory moved).
        recompute: the call ran again in backward, inside an activation checkpoint's
            recomputation (``torch.utils.checkpoint``): the user's own op and line, re-run.
    """

    __slots__ = EVENT_SLOTS

    def __init__(self, **fields: Any) -> None:  # replaced below by a generated __init__
        for f in FIELDS:
            setattr(self, f.name, fields.get(f.name, f.default))

    @property
    def duration_ns(self) -> int:
        """Host-side duration of the call in ns."""
        return self.end_ns - self.start_ns

    def as_dict(self) -> dict[str, Any]:
        """All fields as a plain dict (for JSON, tests and the REPL)."""
        return {name: getattr(self, name) for name in EVENT_SLOTS}

    def __repr__(self) -> str:
        where = f"{self.file}:{self.line}" if self.file else "?"
        # the three kinds the summary counts: a no-op returns its input itself (its alias
        # flag is set too, as it shares the input's storage)
        kind = "no-op" if self.noop else "alias" if self.alias else "copy"
        return (
            f"CopyEvent(#{self.seq} {self.op} {kind} {self.bytes_allocated} B "
            f"{self.dtype}{list(self.shape)} {self.src_device}->{self.dst_device} "
            f"graph={self.graph} phase={self.phase} step={self.step} at {where})"
        )


def _generated_init() -> Any:
    """A keyword-only ``__init__`` with one plain attribute store per field, as dataclasses
    generate: about 5x faster than a setattr loop, and it runs once per recorded event."""
    params = ", ".join(f"{f.name}=_d[{f.name!r}]" for f in FIELDS)
    body = "\n".join(f"    self.{f.name} = {f.name}" for f in FIELDS)
    namespace: dict[str, Any] = {"_d": {f.name: f.default for f in FIELDS}}
    exec(f"def __init__(self, *, {params}):\n{body}\n", namespace)  # noqa: S102
    init = namespace["__init__"]
    init.__doc__ = "Create an event; every field is keyword-only and has a default."
    init.__qualname__ = "CopyEvent.__init__"
    init.__module__ = __name__
    return init


CopyEvent.__init__ = _generated_init()  # type: ignore[method-assign]


# --- the event table ------------------------------------------------------------------------
#: Version of the event table's columns (the Parquet cache and the sidecar carry it).
TABLE_VERSION = "3"  # 3: batch_size, storage_move, recompute; the library call site columns
#: Hidden folder beside the trace files for their event tables: the tracer's columnar sidecar
#: (``<file>`` + :data:`SIDECAR_SUFFIX`) and the Parquet cache of files read without one.
CACHE_DIR = ".copytrace-cache"
#: The sidecar of a trace file is the folder ``CACHE_DIR/<file name>`` + this suffix.
SIDECAR_SUFFIX = ".events"
#: Parquet key-value metadata of a sidecar part: bytes of the trace file its rows and the
#: parts before it cover, the digest of the bytes before that point (:func:`json_tail`), the
#: table version and the resource attributes per run (JSON).
SIDECAR_KEY_BYTES = b"copytrace.json_bytes"
SIDECAR_KEY_TAIL = b"copytrace.json_tail"
SIDECAR_KEY_VERSION = b"copytrace.table_version"
SIDECAR_KEY_RESOURCES = b"copytrace.resources"
#: Bytes of the trace file that :func:`json_tail` digests.
SIDECAR_TAIL_BYTES = 4096

#: The event table's columns in order, as ``(name, kind)`` (see :func:`column_kind`): span
#: identity and times (ns since the epoch), one column per CopyEvent field with an attribute
#: (null where the span has no such attribute), and the attributes / span events of the spans
#: in :data:`META_SPANS` as JSON text. The Parquet cache and the tracer's sidecar both have
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


def sidecar_dir(trace: Path) -> Path:
    """The sidecar folder of trace file ``trace``: ``CACHE_DIR/<name>.events`` beside it."""
    return trace.parent / CACHE_DIR / (trace.name + SIDECAR_SUFFIX)


def json_tail(path: Path, size: int) -> str:
    """Digest (16 hex digits) of the :data:`SIDECAR_TAIL_BYTES` bytes of ``path`` before byte
    ``size``: a sidecar part names it, and a reader compares it with the file's.

    Raises:
        OSError: If the file cannot be read.
    """
    with open(path, "rb") as fh:
        fh.seek(max(0, size - SIDECAR_TAIL_BYTES))
        data = fh.read(min(size, SIDECAR_TAIL_BYTES))
    return hashlib.sha1(data).hexdigest()[:16]
