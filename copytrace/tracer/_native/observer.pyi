# The C++ observer's entry points (module.cpp's method table), typed. The module itself is
# built and loaded by copytrace.tracer._native.load() under a name keyed by the build; this
# stub documents and types what the Python side calls. Times are host ns (as
# time.perf_counter_ns); None clears a setter's references. tests/test_native_stub.py checks
# that the stub and the module list the same names.
from collections.abc import Callable, Iterable, Sequence
from types import CodeType, FrameType
from typing import Any, Final

import torch

from copytrace.tracer._rules import RecordRules

# --- facts.cpp ------------------------------------------------------------------------------
class Facts(tuple[Any, ...]):
    """A plain tensor's facts (a struct sequence: index it or read the names); the same fields,
    in the same order, as copytrace.tracer._facts.Facts."""

    n_fields: Final[int]
    n_sequence_fields: Final[int]
    n_unnamed_fields: Final[int]
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def requires_grad(self) -> bool: ...
    @property
    def is_leaf(self) -> bool | None: ...
    @property
    def grad_fn(self) -> Any | None: ...
    @property
    def grad_fn_name(self) -> str | None: ...
    @property
    def storage(self) -> int: ...
    @property
    def storage_bytes(self) -> int: ...
    @property
    def logical_bytes(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def stride(self) -> tuple[int, ...]: ...
    @property
    def version(self) -> int | None: ...
    @property
    def fake(self) -> bool: ...

def facts(t: object, with_grad_fn: bool = False, /) -> Facts | None:
    """A plain tensor's facts; None for anything else (the Python readers decide)."""

def sizes_strides_policy(t: object, /) -> int:
    """0 when torch answers ``t``'s sizes and strides itself (or ``t`` is no tensor), 1 when a
    tensor subclass answers its strides in Python, 2 when it answers its sizes too; read from
    the TensorImpl, no dispatch."""

def sizes_default(t: object, /) -> tuple[tuple[int, ...], int, int] | None:
    """``(shape, numel, storage_offset)`` as ``t``'s TensorImpl holds them (``sizes_default()``,
    ``numel_default()``, ``storage_offset_default()``), asking no tensor subclass that answers
    its sizes in Python; None for symbolic sizes or anything that is not a tensor."""

def storage_of(t: object, /) -> tuple[int, int | None] | None:
    """``(address of t's StorageImpl, its bytes or None where symbolic)``; None where ``t`` has
    no storage torch lets one read, or is no tensor. Makes no Python storage object."""

def storage_hold(address: int, /) -> int:
    """Take torch's weak handle on the live StorageImpl at ``address`` (as
    ``UntypedStorage._weak_ref()``; ``UntypedStorage._free_weak_ref`` gives it back); returns
    ``address``."""

def storage_owners(address: int, /) -> int:
    """Strong references to the StorageImpl at ``address`` (a weak handle held on it) other
    than torch's own Python storage object; 0 once the storage is gone."""

def set_step_hooks(begin: Callable[[], object] | None, end: Callable[[], object] | None, /) -> bool:
    """Call ``begin()`` and ``end()`` around each optimizer step on this thread (a USER_SCOPE
    RecordFunction callback on torch's ``Optimizer.step#<Class>.step`` scope); ``(None, None)``
    removes the callback. Returns whether it is on."""

def set_step_idle(on: bool, /) -> int:
    """Idle (``on``): the optimizer steps are only counted (the outermost ones), calling
    neither hook: at ``Optimizer._optimizer_step_code`` with the callback taken off where
    :func:`set_step_code` was given a code (only on the thread of :func:`set_step_hooks`),
    else by the callback; off: the callback calls the hooks again. Returns the steps counted
    since the previous call (then counts from 0)."""

def set_step_code(code: CodeType | None, /) -> None:
    """copytrace's code stands at ``Optimizer._optimizer_step_code`` (``tracer/_stepcode.py``)
    and ``code`` is ``Optimizer.profile_hook_step``'s wrapper's code object; None: it does
    not."""

def optimizer_step_seen() -> None:
    """Called by that code after each ``step()``: counts the step while idle (under exactly one
    profile_hook_step wrapper on the stack), ends a step left open when the idle ended.
    Raises nothing."""

def copy_slots(proto: object, /) -> Any:
    """A shallow copy of a __slots__ object (a new CopyEvent from a prototype), not tracked by
    the cycle collector."""

# --- kernels.cpp: the aten level ------------------------------------------------------------
def install(
    ops: Iterable[tuple[str, str, int, str]],
    callback: Callable[[str, int, tuple[Any, ...], dict[str, Any], Any, int, int], object],
    /,
) -> int:
    """Register the BackendSelect kernels of the (qualified name, overload, kind, display name)
    ops (``aten::_to_copy``: on each backend key where torch has no kernel of its own, never
    over one of torch's); callback(name, kind, args, kwargs, result, t0, t1) gets each implicit copy. Returns
    how many ops are registered (a second install keeps the first)."""

def uninstall() -> None: ...
def set_enabled(on: bool, /) -> None: ...
def enabled() -> bool: ...
def set_owner(owner: bool, /) -> None:
    """Mark the calling thread as the traced one (thread-local)."""

def suppress() -> None:
    """Enter a region the observer ignores (a compiled call), on this thread."""

def unsuppress() -> None: ...
def suppressed() -> int: ...
def begin_fold() -> None: ...
def end_fold() -> tuple[str, ...]:
    """Stop folding; the aten names seen since begin_fold."""

def internal_detaches() -> int:
    """Autograd's own detach/alias calls since the last call."""

def errors() -> int:
    """Errors counted in copytrace's hooks since the last call."""

def depth() -> int: ...

# --- api_mode.cpp: the API level ------------------------------------------------------------
def set_api_hooks(
    table: dict[Callable[..., Any], str] | None,
    before: Callable[[str, Callable[..., Any], tuple[Any, ...], dict[str, Any] | None], Any] | None,
    after: Callable[[Any, Any, type[BaseException] | None, int, int, tuple[str, ...]], object]
    | None,
    write_hook: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any] | None], object]
    | None,
    /,
) -> None:
    """The API table (callable -> op name) and the hooks of a recorded call:
    before(op, func, args, kwargs) -> token (None: not recorded), after(token, result, error
    type, t0, t1, aten names)."""

def set_fast_api(
    ops: frozenset[str] | None,
    types: tuple[type, ...] | None,
    after: Callable[
        [str, tuple[Any, ...], Any, type[BaseException] | None, int, int, tuple[str, ...]], object
    ]
    | None,
    /,
) -> None:
    """The one-call path: ops whose call with no keywords on an exact `types` first argument
    goes to after(op, args, result, error type, t0, t1, aten names)."""

def set_attached(
    attached_cls: type | None,
    storage_ref_cls: type | None,
    free_weak_ref: Callable[[int], object] | None,
    storage_owners: Callable[[int], int] | None,
    /,
) -> None:
    """The classes an attached copy's entry (``_Attached``, its ``StorageRef``) is made of in
    C, and the callables a StorageRef holds; None clears."""

def set_fast_events(
    rec: Any | None,
    copies: Any | None,
    tail: Callable[[str, Any, Any, Any, Any, Any], object] | None,
    ops: frozenset[str] | None,
    /,
) -> None:
    """The recorder, its FreshCopies, tail(op, src, out, event, grad_fn, placed) and the ops
    whose whole event may be made in C."""

def set_watch_writes(on: bool, /) -> None: ...
def set_copy_hooks(
    fresh: dict[int, Any] | None,
    written: dict[int, Any] | None,
    hook: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any] | None], object] | None,
    getitem: Callable[..., Any] | None,
    /,
) -> None: ...
def bind_torch_function(mode: object, /) -> Callable[..., Any]:
    """The C __torch_function__ bound to `mode` (torch requires it as __self__)."""

def entry_frames() -> tuple[FrameType, ...]: ...
def has_entry_frames() -> bool: ...

# --- audit.cpp ------------------------------------------------------------------------------
def exec_hook(on_exec: Callable[[], object] | None, /) -> None:
    """Call on_exec() at each os.exec audit event, from a C audit hook added once for the
    process's life (None: call nothing); raises what an audit hook refusing it raises."""

# --- warn_shim.cpp --------------------------------------------------------------------------
def make_warn(orig: Callable[..., None], /) -> Callable[..., None]:
    """A warnings.warn calling `orig` with the stacklevel counted as untraced."""

# --- versions.cpp ---------------------------------------------------------------------------
class VersionRef:
    """A tensor's version counter and its value when read (holds no tensor)."""

def version_of(t: object, /) -> VersionRef | None: ...
def version_delta(handle: VersionRef, /) -> int: ...
def version_final(handle: VersionRef, /) -> int | None: ...

class NodeRef:
    """A weak pointer on a tensor's grad_fn (holds neither the tensor nor the node)."""

def grad_fn_ref(t: object, /) -> NodeRef | None:
    """On a tensor's grad_fn, or on a C++ autograd node itself; None otherwise."""
def grad_fn_of(ref: NodeRef, /) -> Any | None: ...
def grad_fn_alive(ref: NodeRef, /) -> bool: ...
def kept_pair(a: object, b: object, /) -> tuple[Any, Any]:
    """(a, b), untracked by the cycle collector when neither a nor b is tracked."""

# --- lean.cpp -------------------------------------------------------------------------------
def wrap_api(name: str, original: Callable[..., Any], method: bool, /) -> Any:
    """A C function named `name` recording calls of `original`; method: a descriptor that
    binds it to Tensor instances and gives `original` on the class."""

def data_descriptor(
    original: Any, get: Callable[..., Any], set: Callable[..., Any], /
) -> Any:
    """A data descriptor for Tensor.data recording its reads and writes."""

def set_wrappers(on: bool, /) -> None: ...
def set_quiet_codes(codes: set[CodeType] | None, /) -> None: ...

# --- watch_cb.cpp ---------------------------------------------------------------------------
# kind: 1 a `.data` alias (its written storage is handed to the hook), 2 an index result
def watch_tensor(tensor: object, kind: int, /) -> int | None: ...
def unwatch(key: int, kind: int, /) -> None: ...
def set_watch_hook(hook: Callable[[tuple[tuple[int, bool, Any], ...]], object] | None, /) -> None: ...
def watched() -> tuple[int, bool]: ...

# --- hotpatch.cpp ---------------------------------------------------------------------------
def hot_install(
    callables: Sequence[Callable[..., Any]],
    data: Any | None,
    get: Callable[..., Any] | None,
    set: Callable[..., Any] | None,
    /,
) -> list[bool]:
    """Hot-patch torch's pointers: a bool per callable, then one for Tensor.data."""

def hot_restore() -> None: ...
def hot_count() -> int: ...

# --- legacy.cpp -----------------------------------------------------------------------------
def legacy_install(op: str, base: type, tensor: type, typed: tuple[type, ...], /) -> int:
    """Swap the ``tp_new`` of ``base`` (``TensorBase``), of its subclasses that hold its
    pointer and of the ``typed`` legacy types for trampolines that record ``tensor(seq)`` and
    ``Typed(seq)`` as ``op``; how many slots were swapped."""

def legacy_restore(base: type, typed: tuple[type, ...], /) -> int:
    """Put the original ``tp_new`` back wherever a trampoline is; how many slots."""

# --- frames.cpp -----------------------------------------------------------------------------
def call_site(
    classify: Callable[[CodeType], int], /
) -> tuple[str | None, int | None, str | None, str | None, tuple[str, int, str] | None] | None:
    """The user's (file, line, function), the via and the library's (file, line, function)
    on this thread's stack, or None when it holds neither (see _callsite.call_site)."""

def clear_sites() -> None: ...
def frame_var(frame: FrameType, name: str, /) -> Any:
    """A running frame's variable without f_locals; NameError where it has none."""
def module_calls(frame: FrameType, code: CodeType, /) -> list[Any]:
    """The ``self`` of each frame running ``code`` at or above ``frame``, outermost first."""

# --- record.cpp -----------------------------------------------------------------------------
RECORD_FIELDS: Final[tuple[str, ...]]
"""The event fields record writes; record_setup checks them against the schema's."""

def record_setup(fields: Sequence[str], /) -> None:
    """The schema's event field names; ValueError naming a field of RECORD_FIELDS the schema
    lacks."""

def set_record_rules(rules: RecordRules | None, /) -> None:
    """The rule table record and fast_finish follow (copytrace.tracer._rules.RULES), its items
    resolved once; None clears it (record then returns None: the Python path records).
    TypeError where an item is not of its type, KeyError where transfers lacks a key."""

def record(
    state: tuple[Any, Any, Callable[[CodeType], int], CodeType, dict[int, str]],
    op: str,
    src: torch.Tensor,
    out: Any,
    src_requires_grad: bool | None,
    seq: int,
    start: int,
    end: int,
    aten: tuple[str, ...],
    step: int,
    in_optimizer: bool,
    /,
) -> tuple[Any, Any, Any] | bool | None:
    """An API call's event as (event, grad_fn, placed or module frame); False: no event; None:
    the Python readers record it. state: (prototype event, StorageIds, classify,
    Module._call_impl's code, ``copytrace._threads.NAMES``: the thread's name where read)."""

# --- compiled.cpp ---------------------------------------------------------------------------
def callback_from_stance(callback: Any, /) -> Any: ...
def cfs_install(orig: Any | None, state: Any | None, wrap: Any | None, /) -> None: ...
def cfs_begin(codes: list[CodeType] | None, /) -> None: ...
def compiled_enter() -> Callable[[], None] | Any: ...
def compiled_backward(fn: Callable[..., Any], /, *args: Any) -> Any: ...
def user_fn_install(
    orig: Any | None, partial: Any | None, run: Any | None, /
) -> Callable[..., Any] | None: ...
def cc_install(
    state: Any | None,
    rec: Any | None,
    raw: list[tuple[Any, ...]] | None,
    code_graphs: dict[CodeType, int | None] | None,
    graph_runs: dict[int, int] | None,
    module_type: type | None,
    graphs: dict[int, Any] | None,
    nothing: Any | None,
    /,
) -> bool:
    """Connect the compiled-call hooks (None x 8 clears); whether a call was still open."""
def event_columns(
    events: list[Any], specs: Sequence[tuple[str, int, bool]], /
) -> list[tuple[Any, ...]] | None:
    """Arrow column buffers of the records' fields (columns.cpp), or None when a value does
    not fit its column."""
def span_json(
    n: int, trace: str, ids: tuple[Any, ...], parents: tuple[Any, ...], names: tuple[Any, ...],
    starts: tuple[Any, ...], ends: tuple[Any, ...], attrs: Sequence[tuple[str, tuple[Any, ...]]],
    error: tuple[Any, ...] | None, /,
) -> tuple[bytes, bytes]:
    """The OTLP/JSON text of n copy-event spans from Arrow buffers (otlp.cpp), each followed
    by ",", and the texts' int64 offsets."""
