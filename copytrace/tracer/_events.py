"""The copy/alias event record: what the hot path stores for each intercepted op.

The span attribute names an event becomes are listed in ``docs/trace-format.md``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CopyEvent", "PHASES", "GRAPH_STATES"]

PHASES = ("forward", "backward", "optimizer", "other")
GRAPH_STATES = ("attached", "detached", "none")


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
        grad_fn: class name of the result's ``grad_fn`` (``"CloneBackward0"``) or ``None``.
        is_leaf: the result is an autograd leaf.
        graph: ``"attached"`` (result is in the input's autograd graph), ``"detached"`` (the
            input required grad but the result is cut from its graph) or ``"none"``.
        phase: ``"forward"``, ``"backward"``, ``"optimizer"`` or ``"other"``.
        step: step number at the time of the event.
        module: ``nn.Module`` path (``"CharLM.blocks.0.attn"``) or ``None``.
        file, line, function: the user's call site (first frame outside copytrace, torch and
            the standard library), or ``None`` when there is none.
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
            unused (a lost write).
        src_name: ``Module.path.param`` of the written tensor, when it is a parameter or
            buffer of a module seen in forward.
        retained_bytes: on an attached copy, bytes of saved tensors its autograd graph still
            held when its step ended (no backward had run through it); ``None`` otherwise.
        snapshot: a ``detach`` alias made by ``Module.state_dict()``.
        stale: on a snapshot, its source was changed in place while the alias was kept.
        fake: the result is a FakeTensor or a meta tensor (``FakeTensorMode``, torch.compile's
            tracing, ``FakeCopyMode``): ``bytes_logical`` is what a real copy would move,
            ``bytes_allocated`` is 0 (no real memory).
    """

    __slots__ = (
        "seq", "op", "aten", "bytes_allocated", "bytes_logical", "alias", "noop", "shape",
        "dtype", "src_dtype", "src_device", "dst_device", "transfer", "non_blocking",
        "requires_grad", "src_requires_grad", "grad_fn", "is_leaf", "graph", "phase", "step",
        "module", "file", "line", "function", "thread_id", "thread_name", "start_ns", "end_ns",
        "parent", "group", "object_type", "tensors", "error", "via", "origin", "pinned",
        "src_storage", "src_offset", "src_stride", "src_version", "dst_storage", "dst_version",
        "inplace_writes", "saved_by", "write_site", "src_name", "retained_bytes", "snapshot",
        "stale", "fake",
    )  # fmt: skip

    def __init__(self, **fields: Any) -> None:  # replaced below by a generated __init__
        for name in self.__slots__:
            setattr(self, name, fields.get(name, _DEFAULTS.get(name)))

    @property
    def duration_ns(self) -> int:
        """Host-side duration of the call in ns."""
        return self.end_ns - self.start_ns

    def as_dict(self) -> dict[str, Any]:
        """All fields as a plain dict (for JSON, tests and the REPL)."""
        return {name: getattr(self, name) for name in self.__slots__}

    def __repr__(self) -> str:
        where = f"{self.file}:{self.line}" if self.file else "?"
        kind = "alias" if self.alias else "copy"
        return (
            f"CopyEvent(#{self.seq} {self.op} {kind} {self.bytes_allocated} B "
            f"{self.dtype}{list(self.shape)} {self.src_device}->{self.dst_device} "
            f"graph={self.graph} phase={self.phase} step={self.step} at {where})"
        )


_DEFAULTS: dict[str, Any] = {
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
    "is_leaf": True,
    "graph": "none",
    "phase": "other",
    "step": 0,
    "parent": -1,
    "group": False,
    "tensors": 1,
    "pinned": False,
    "src_stride": (),
    "saved_by": (),
    "snapshot": False,
    "stale": False,
    "fake": False,
}


def _generated_init() -> Any:
    """A keyword-only ``__init__`` with one plain attribute store per field, as dataclasses
    generate: about 5x faster than a setattr loop, and it runs once per recorded event."""
    names = CopyEvent.__slots__
    params = ", ".join(f"{n}=_d[{n!r}]" for n in names)
    body = "\n".join(f"    self.{n} = {n}" for n in names)
    namespace: dict[str, Any] = {"_d": {n: _DEFAULTS.get(n) for n in names}}
    exec(f"def __init__(self, *, {params}):\n{body}\n", namespace)  # noqa: S102
    init = namespace["__init__"]
    init.__doc__ = "Create an event; every field is keyword-only and has a default."
    init.__qualname__ = "CopyEvent.__init__"
    return init


CopyEvent.__init__ = _generated_init()  # type: ignore[method-assign]
