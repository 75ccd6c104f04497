"""The hot path: a TorchFunctionMode and a TorchDispatchMode that record copies and aliases.

How the two modes split the work (facts of torch 2.13, see ``docs/trace-format.md``):

* The function mode sees the user's API call (``Tensor.clone``, ``.data``, ``.to``,
  ``Tensor.__deepcopy__``...). For one of those it runs the call, then compares the result
  with the input: same object (no-op), same storage (alias) or new storage (copy), and reads
  the graph facts. While that call runs, the aten copy ops it causes are folded into its
  event, so one user call is one event.
* The dispatch mode sees aten ops. A copy op (``aten::clone``, ``aten::_to_copy``,
  ``aten::copy_``...) with no API call around it is an ``implicit`` copy: made inside a
  composite, by autograd in backward, by autocast or by an optimizer. A bare ``aten::detach``
  or ``aten::alias`` with no API call is autograd's own bookkeeping (saving an output for
  backward, accumulating ``.grad``): it is counted, not recorded as an event.
* Neither mode is re-entered by its own handler: torch pops a mode from its stack while the
  mode's handler runs, and API calls nested in a recorded call are folded into it.

Nothing here keeps a tensor alive: events hold shapes, names and integers only. Any error in
the recording code is counted in ``Recorder.errors`` and never raised into the user's code.
"""

from __future__ import annotations

import copy
import sys
import threading
import time
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from copytrace.schema import CopyEvent
from copytrace.tracer import _callsite, _handover, _modules, _watch
from copytrace.tracer import _facts as _F
from copytrace.tracer._callsite import user_frame
from copytrace.tracer._fresh import INDEX_OPS

__all__ = ["Recorder", "active_recorder"]

_perf_ns = time.perf_counter_ns
_NoTorchFunction = torch._C.DisableTorchFunction
_get_ident = threading.get_ident
_THREAD_NAMES: dict[int, str] = {}  # thread ident -> name (names are read once per thread)
_Tensor = torch.Tensor
_graph_task_id = torch._C._current_graph_task_id
_current_node = torch._C._current_autograd_node
_sequence_nr = torch._C._autograd._get_sequence_nr
_facts = _F.facts
_py_facts = _F.py_facts
# Every field at its default: the C++ observer copies it for each new event (copy_slots).
_PROTOTYPE = CopyEvent()
_TAG = "copytrace"  # key in grad_fn.metadata: (module path, "file:line") of the forward call

# --- API-level table: function-mode callable -> op name ----------------------------------
_GETITEM = _Tensor.__getitem__
_BASIC_INDEX = frozenset((int, bool, slice, type(None), type(Ellipsis)))


def _basic_index(args: tuple) -> bool:
    """Whether ``Tensor.__getitem__(*args)`` is basic indexing (ints, slices, None, ...),
    which returns a view: the cheap test on the path every ``x[i]`` takes."""
    index = args[1] if len(args) > 1 else None
    kind = type(index)
    if kind in _BASIC_INDEX:
        return True
    if kind is tuple:
        for item in index:
            if type(item) not in _BASIC_INDEX:
                return False
        return True
    return False

_CONVERSIONS = (
    "to", "cpu", "cuda", "type", "float", "double", "half", "bfloat16", "int", "long",
    "short", "char", "byte", "bool", "contiguous",
)  # fmt: skip


def _api_table() -> dict[Any, str]:
    table: dict[Any, str] = {
        _Tensor.clone: "clone",
        torch.clone: "clone",
        _Tensor.detach: "detach",
        torch.detach: "detach",
        _Tensor.detach_: "detach_",
        _Tensor.data.__get__: "data_get",  # a method-wrapper; dict lookup uses == (see DESIGN)
        _Tensor.data.__set__: "data_set",
        _Tensor.__deepcopy__: "deepcopy",
        _Tensor.copy_: "copy_",
        torch.tensor: "tensor_ctor",
        _Tensor.new_tensor: "new_tensor",
        _Tensor.numpy: "numpy",
        _Tensor.reshape: "reshape",  # a view when strides allow, else a hidden copy
        torch.reshape: "reshape",
        # Advanced indexing gathers into fresh storage (aten::index and its relatives).
        # Tensor.__getitem__ also sees every basic index: FunctionMode lets those through.
        _GETITEM: "index",
    }
    for name in INDEX_OPS[1:]:
        for owner in (torch, _Tensor):
            fn = getattr(owner, name, None)
            if fn is not None:
                table[fn] = name
    for name in _CONVERSIONS:
        fn = getattr(_Tensor, name, None)
        if fn is not None:
            table[fn] = name
    return table


# --- aten-level table: OpOverloadPacket -> kind -------------------------------------------
_ALIAS, _COPY, _COPY_INTO = 1, 2, 3


def _is_copy_op(base: str) -> bool:
    """aten op names that copy an input, from torch's own naming scheme: ``clone``,
    ``_to_copy``, ``copy_``, the ``*_copy`` out-of-place variants of every view op
    (``view_copy``, ``t_copy``, ... used by functionalization), ``_foreach_copy_``,
    ``lift_fresh_copy``, ``_copy_from*``."""
    if base == "clone" or base.startswith("_copy_from"):
        return True
    if base in ("_has_compatible_shallow_copy_type",) or base.startswith("copysign"):
        return False
    return base.rstrip("_").endswith("copy")


def _aten_table() -> dict[Any, int]:
    """OpOverload -> kind for every overload of the aten alias and copy ops.

    The copy ops are found by name among all registered operators
    (``torch._C._dispatch_get_all_op_names()``), so new ``*_copy`` ops are covered without a
    hand-kept list. In-place (``copy_``, ``index_copy_``) and ``out=`` overloads write into an
    existing tensor: kind ``_COPY_INTO`` (0 bytes allocated).
    """
    aten = torch.ops.aten
    kinds: dict[str, int] = {"detach": _ALIAS, "alias": _ALIAS}
    try:
        names = torch._C._dispatch_get_all_op_names()
    except Exception:  # pragma: no cover - very old torch
        names = ["aten::clone", "aten::_to_copy", "aten::copy_", "aten::lift_fresh_copy"]
    for full in names:
        ns, _, rest = full.partition("::")
        base = rest.partition(".")[0]
        if ns == "aten" and _is_copy_op(base):
            kinds[base] = _COPY
    table: dict[Any, int] = {}
    for name, kind in kinds.items():
        try:
            packet = getattr(aten, name)
            overloads = packet.overloads()
        except Exception:
            continue
        for overload in overloads:
            try:
                op = getattr(packet, overload)
            except Exception:
                continue
            if kind == _COPY and (
                name.endswith("_") or "out" in overload or name.startswith("_copy_from")
            ):
                table[op] = _COPY_INTO
            else:
                table[op] = kind
    return table


_ATEN_NAMES: dict[Any, str] = {}


def _aten_name(op: Any) -> str:
    name = _ATEN_NAMES.get(op)
    if name is None:
        # OpOverload 'aten.clone.default' -> 'aten::clone' (overload kept when not default)
        ns, _, rest = str(op).partition(".")
        base, _, overload = rest.partition(".")
        name = f"{ns}::{base}" if overload in ("", "default") else f"{ns}::{base}.{overload}"
        _ATEN_NAMES[op] = sys.intern(name)
    return name


_dtype_name = _F.dtype_name
_device_str = _F.device_str
_shape = _F.shape
_nbytes = _F.nbytes


def _storage_nbytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except Exception:
        return _nbytes(t)


def _transfer(src: str, dst: str) -> str:
    if src == dst:
        return "none"
    src_host = src == "cpu"
    dst_host = dst == "cpu"
    if src_host and not dst_host:
        return "h2d"
    if dst_host and not src_host:
        return "d2h"
    if src_host and dst_host:
        return "none"
    return "d2d"


# Ops whose result always shares the input's storage (decided without looking at storages,
# which wrapper subclasses and sparse tensors do not expose).
_ALWAYS_ALIAS = frozenset(("detach", "detach_", "data_get", "numpy", "copy", "swap_tensors"))
# Ops whose event the Python path records (observer.cpp's record leaves them out).
_IN_PYTHON = frozenset(("numpy", "deepcopy"))
# Ops whose api_before has work to do for any call (a check before the call, a read of the
# input's state, a memo or basic-index test): never on the C observer's one-call path.
_BEFORE_OPS = frozenset(("backward", "deepcopy", "index", "detach_", "numpy"))
# Fast ops whose whole event observer.cpp may finish in C (fast_event): not those _record_api
# reads differently (a write into a tensor, a rebinding) nor the gathers (a fresh copy watched
# by identity, _fresh.py).
_NOT_C_EVENT_OPS = frozenset(("copy_", "data_set", "data_get", "swap_tensors")) | frozenset(
    INDEX_OPS
)
_NO_KWARGS: dict[str, Any] = {}


class _Pending:
    """An API call in progress: the aten ops it caused are appended to ``aten``."""

    __slots__ = ("aten",)

    def __init__(self) -> None:
        self.aten: list[str] = []


class _Group:
    """An outermost ``copy.deepcopy`` of a non-tensor object in progress."""

    __slots__ = ("seq", "start_ns", "storages", "bytes", "tensors", "children")

    def __init__(self, seq: int, start_ns: int) -> None:
        self.seq = seq
        self.start_ns = start_ns
        self.storages: set[int] = set()  # result storage pointers already counted
        self.bytes = 0
        self.tensors = 0
        self.children = 0


class Recorder:
    """Owns the event buffer, the counters and the attribution state of one trace.

    Args:
        max_events: cap on buffered events; beyond it events are counted in ``dropped``.
        auto_step: advance the step on each ``optimizer.step()`` until :meth:`step` is
            called explicitly.
    """

    def __init__(self, max_events: int = 1_000_000, auto_step: bool = True) -> None:
        self.events: list[CopyEvent] = []
        self.max_events = max_events
        self.dropped = 0
        self.errors = 0
        self.last_error: str | None = None
        self.internal_detaches = 0
        # Nesting depth of torch.compile'd calls running now on the traced thread (set by
        # copytrace.tracer._compiled): inside them copytrace's modes are off the stacks.
        self.compiled_depth = 0
        # aten copies of compiled graphs' backward (CompiledFunctionBackward) left unrecorded:
        # the graph's copies are listed from the graph instead.
        self.compiled_backward_skipped = 0
        # Host ns spent recording events (after the user's op returned): the tracer's own
        # cost per event, reported on the run span as copytrace.overhead_ns. The per-op cost
        # of the modes themselves (the floor) is measured by benchmarks/overhead.py instead.
        self.overhead_ns = 0
        self.step_index = 0
        self.step_starts: list[int] = []  # perf_counter_ns at each step start
        self.auto_step = auto_step
        self.active: _Pending | None = None
        self.group: _Group | None = None
        self.in_optimizer = 0
        # nn.Module paths, from the frames at event time (copytrace/tracer/_modules.py)
        self.modules = _modules.Modules()
        self.api_table = _api_table()
        self.aten_table = _aten_table()
        # Runtime facts for copytrace.analysis (copytrace/tracer/_watch.py).
        self.watch = _watch.Watch(self)
        #: the C++ observer module while it is engaged (copytrace/tracer/_native), else None
        self.native: Any = None
        #: level lean: the mode pushed while ``.data`` writes are watched (_observer.LeanWatch)
        self.lean_watch: Any = None
        self._native_state: tuple | None = None  # observer.cpp record's first argument
        for fn in _watch.BACKWARD_FUNCTIONS:
            self.api_table[fn] = "backward"

    # -- counters and attribution ---------------------------------------------------------
    def note_error(self, err: BaseException) -> None:
        self.errors += 1
        self.last_error = f"{type(err).__name__}: {err}"

    def step(self, now_ns: int | None = None) -> int:
        self.watch.step_end()
        self.step_index += 1
        self.step_starts.append(_perf_ns() if now_ns is None else now_ns)
        return self.step_index

    def module_name(self, module: torch.nn.Module) -> str:
        """Path of ``module``: ``Root.child.grandchild``, the root named by its class."""
        return self.modules.name(module)

    def _append(self, ev: CopyEvent) -> None:
        if len(self.events) < self.max_events:
            self.events.append(ev)
        else:
            self.dropped += 1

    def _context(self, ev: CopyEvent) -> None:
        native = self.native
        if native is not None:  # the same walk in C, with the user's line cached
            site = native.call_site(_callsite._code_kind)
        else:
            site = user_frame(sys._getframe(2))
        if site is not None:
            ev.file, ev.line, ev.function, ev.via = site
        ev.step = self.step_index
        self._place(ev, sys._getframe(1))

    def _place(self, ev: CopyEvent, frame: Any) -> None:
        """Phase, module, thread and deepcopy group of ``ev`` (the rest of :meth:`_context`);
        ``frame``: where the search for the module call in progress starts (None: none)."""
        node = _current_node() if _graph_task_id() >= 0 else None
        if node is not None:
            ev.phase = "backward"
            # The node running now is the forward output's grad_fn; copytrace tagged it
            # when it recorded that forward call (see _tag_grad_fn).
            ev.via = type(node).__name__
            tag = node.metadata.get(_TAG)
            if tag is not None:
                ev.module, ev.origin = tag
            else:
                ev.module = self.modules.of_node(node)
        else:
            ev.module = self.modules.current(frame)
            if _graph_task_id() >= 0:
                ev.phase = "backward"
            elif self.in_optimizer:
                ev.phase = "optimizer"
            elif ev.module is not None:
                ev.phase = "forward"
            else:
                ev.phase = "other"
        ident = _get_ident()
        name = _THREAD_NAMES.get(ident)
        if name is None:
            name = _THREAD_NAMES[ident] = threading.current_thread().name
        ev.thread_id = ident
        ev.thread_name = name
        group = self.group
        if group is not None:
            ev.parent = group.seq

    # -- API-level events -------------------------------------------------------------------
    def api_before(self, op: str, func: Any, args: tuple, kwargs: dict | None) -> Any:
        """Start recording the user's API call ``op``; ``None`` means: run it unrecorded.

        Called by the C handler (``_native/observer.cpp``) or :meth:`api_call` before
        ``func(*args, **kwargs)`` runs; the token goes to :meth:`api_after`."""
        if op == "backward":
            self.watch.check_backward(func, args, kwargs or {})
            return None
        if op == "deepcopy" and len(args) > 1 and args[1] is not None and id(args[0]) in args[1]:
            return None  # memo hit: deepcopy returns an earlier copy
        if op == "index" and _basic_index(args):
            return None  # x[i], x[a:b]: a view (the C handler lets these through itself)
        if kwargs and op in INDEX_OPS and kwargs.get("out") is not None:
            return None  # gathers into an existing tensor: no fresh copy
        # detach_() clears requires_grad in place: read the input's state before the call.
        src_rg = args[0].requires_grad if op == "detach_" and args else None
        pending = _Pending()
        token = (op, args, kwargs or {}, self.active, src_rg, pending)
        self.active = pending
        return token

    def api_after(
        self, token: Any, result: Any, error: Any, start: int, end: int, aten: tuple = ()
    ) -> None:
        """Record the call begun by :meth:`api_before`. ``error``: the exception's type, or
        ``None``; ``aten``: the aten copy ops it ran (from the C++ observer). Never raises."""
        op, args, kwargs, outer, src_rg, pending = token
        self.active = outer
        if pending.aten:  # folded by the Python dispatch mode
            aten = (*pending.aten, *aten)
        try:
            name = error.__name__ if error is not None else None
            self._record_api(op, args, kwargs, result, aten, start, end, name, src_rg)
        except Exception as err:
            self.note_error(err)
        self.overhead_ns += _perf_ns() - end

    def api_fast(
        self, op: str, args: tuple, result: Any, error: Any, start: int, end: int, aten: tuple
    ) -> None:
        """Record a call the C observer ran without :meth:`api_before` (no keyword arguments, a
        plain tensor first, an op in :data:`FAST_OPS`; ``observer.cpp``, ``fast_call``): as
        :meth:`api_after` records it. Never raises."""
        try:
            name = error.__name__ if error is not None else None
            self._record_api(op, args, _NO_KWARGS, result, aten, start, end, name)
        except Exception as err:
            self.note_error(err)
        self.overhead_ns += _perf_ns() - end

    def api_call(self, op: str, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run ``func(*args, **kwargs)`` as the user's API call ``op`` and record it (the
        Python function mode's path and copytrace's own patches)."""
        # copytrace's own reads (.requires_grad, .grad_fn, storages) must reach no mode and
        # no subclass's __torch_function__: torch function handling is off around them.
        with _NoTorchFunction():
            token = self.api_before(op, func, args, kwargs)
        if token is None:
            return func(*args, **kwargs)
        native = self.native
        if native is not None:
            native.begin_fold()
        start = _perf_ns()
        try:
            result = func(*args, **kwargs)
        except BaseException as err:
            end = _perf_ns()
            with _NoTorchFunction():
                self.api_after(token, None, type(err), start, end, _end_fold(native))
            raise
        end = _perf_ns()
        with _NoTorchFunction():
            self.api_after(token, result, None, start, end, _end_fold(native))
        return result

    def api_tail(
        self, op: str, src: Any, out: Any, ev: CopyEvent, grad_fn: Any, where: Any
    ) -> None:
        """The rest of an event observer.cpp's ``record`` made (``where``: True when its phase,
        module and thread are set, else the frame to place it from): tag ``grad_fn``, start
        the watches, keep the event. Called by :meth:`_record_api` and by observer.cpp's fast
        events for what they do not finish in C."""
        if where is not True:
            self._place(ev, where)
        if grad_fn is not None and ev.phase != "backward":
            _tag_grad_fn(grad_fn, ev)
        try:  # the rest of Watch.event: an error there still keeps the event
            self.watch.follow(ev, op, src, out, grad_fn)
        except Exception as err:
            self.note_error(err)
        self._append(ev)

    def _record_api(
        self,
        op: str,
        args: tuple,
        kwargs: dict,
        result: Any,
        aten: tuple,
        start: int,
        end: int,
        error: str | None,
        src_requires_grad: bool | None = None,
    ) -> None:
        if op == "copy_" or op == "data_set" or op == "swap_tensors":
            # dst.copy_(src) writes into dst; dst.data = src rebinds dst to src's storage;
            # swap_tensors(dst, src) exchanges their payloads (src now holds dst's old one).
            if len(args) < 2:
                return
            dst, src = args[0], args[1]
            if not isinstance(dst, _Tensor) or not isinstance(src, _Tensor):
                return
            out = dst
        else:
            src = args[0] if args else None
            if not isinstance(src, _Tensor):
                return  # torch.tensor([1, 2]), torch.clone(x=...) etc.: no tensor input
            out = result
        if (
            error is None
            and op not in ("numpy", "copy_", "data_set")
            and not isinstance(out, _Tensor)
        ):
            return  # t.type() with no argument returns a string
        native = self.native
        if native is not None and error is None and self.group is None and op not in _IN_PYTHON:
            # the common case in one C call (observer.cpp, record): same fields, same ids
            state = self._native_state
            if state is None:
                state = self._native_state = (
                    _PROTOTYPE, self.watch.ids, _callsite._code_kind, _modules.CALL_IMPL,
                    _THREAD_NAMES,
                )  # fmt: skip
            found = native.record(
                state, op, src, out, src_requires_grad, len(self.events) + self.dropped,
                start, end, aten, self.step_index, self.in_optimizer,
            )  # fmt: skip
            if found is None:  # not a plain tensor: the Python readers below
                pass
            elif found is False:  # no event (an integer index's view)
                return
            else:  # tensor facts, call site, step and storage ids set
                ev, grad_fn, where = found
                if kwargs:
                    ev.non_blocking = bool(kwargs.get("non_blocking", False))
                self.api_tail(op, src, out, ev, grad_fn, where)
                return
        fs = native.facts(src, False) if native is not None else None  # _facts.facts, inlined
        if fs is None:
            fs = _py_facts(src)
        if native is not None:
            ev = native.copy_slots(_PROTOTYPE)  # every field at its default
            ev.op = op
            ev.aten = aten
            ev.error = error
        else:
            ev = CopyEvent(op=op, aten=aten, error=error)
        ev.seq = len(self.events) + self.dropped
        ev.start_ns = start
        ev.end_ns = end
        ev.src_dtype = src_dtype = fs[1]  # _facts.DTYPE
        ev.src_device = src_device = fs[2]  # _facts.DEVICE
        src_rg = fs[3] if src_requires_grad is None else src_requires_grad  # REQUIRES_GRAD
        ev.src_requires_grad = src_rg
        if kwargs:
            ev.non_blocking = bool(kwargs.get("non_blocking", False))
        fo = None
        grad_fn = None
        if error is not None or op == "numpy":
            # Failed call, or an ndarray view of the tensor's memory (an alias).
            ev.shape = fs[0]  # _facts.SHAPE
            ev.dtype = src_dtype
            ev.dst_device = dst_device = src_device
            ev.bytes_logical = fs[9]  # _facts.LOGICAL_BYTES
            alias = ev.alias = op == "numpy" and error is None
            ev.requires_grad = False
            if src_rg and alias:
                ev.graph = "detached"
        else:
            fo = native.facts(out, True) if native is not None else None
            if fo is None:
                fo = _py_facts(out, True)
            (shape, dtype, dst_device, rg, is_leaf, grad_fn, grad_fn_name, storage,
             storage_bytes, logical, _, _, _, fake) = fo  # fmt: skip
            ev.shape = shape
            ev.dtype = dtype
            ev.dst_device = dst_device
            ev.bytes_logical = logical
            ev.requires_grad = rg
            ev.grad_fn = grad_fn_name
            ev.is_leaf = is_leaf
            noop = False
            if op == "copy_":
                alias = False  # written into an existing tensor: 0 bytes allocated
            elif out is src:
                noop = ev.noop = alias = ev.alias = True
            elif op in _ALWAYS_ALIAS:
                alias = ev.alias = True
            else:
                src_storage = fs[7]  # _facts.STORAGE; same_storage(), inlined:
                alias = ev.alias = (
                    storage is not None
                    and src_storage is not None
                    and (storage is src_storage or storage._cdata == src_storage._cdata)
                )
                if not alias and fake:
                    ev.fake = True  # a copy of no real memory: logical bytes only
                elif not alias:
                    nbytes = storage_bytes
                    group = self.group
                    if op == "deepcopy":
                        grad = getattr(out, "grad", None) if is_leaf else None
                        if grad is not None:
                            nbytes += _storage_nbytes(grad)
                    if group is not None and storage is not None:
                        ptr = storage._cdata
                        if ptr in group.storages:
                            nbytes = 0  # storage shared inside the copied object: copied once
                        else:
                            group.storages.add(ptr)
                    ev.bytes_allocated = nbytes
            if grad_fn is not None or (noop and rg):
                ev.graph = "attached"
            elif src_rg:
                ev.graph = "detached"
        if alias and op == "index":
            return  # a zero-dim integer index selects a view: not a copy
        if src_device is not dst_device:  # interned names: equal names are one object
            transfer = ev.transfer = _transfer(src_device, dst_device)
            if transfer == "h2d":
                ev.pinned = src.is_pinned()
        self._context(ev)
        if grad_fn is not None and ev.phase != "backward":
            _tag_grad_fn(grad_fn, ev)
        group = self.group
        if group is not None and error is None:
            group.bytes += ev.bytes_allocated
            group.tensors += 1
        try:  # Watch.event, inlined: an error there still keeps the event
            self.watch._event(ev, op, src, out, fs, fo)
        except Exception as err:
            self.note_error(err)
        self._append(ev)

    # -- aten-level events ------------------------------------------------------------------
    def implicit(
        self, name: str, kind: int, args: tuple, kwargs: dict, out: Any, start: int, end: int
    ) -> None:
        """Record an aten copy that no API call explains.

        Args:
            name: the aten op, as ``aten::clone`` (overload appended when not the default).
            kind: ``_COPY`` (a new tensor) or ``_COPY_INTO`` (written into an existing one).
            args, kwargs: the op's arguments; out: its result.
            start, end: host ``perf_counter_ns`` around the op.
        """
        node = _current_node()
        if node is not None and type(node).__name__ == "CompiledFunctionBackward":
            self.compiled_backward_skipped += 1  # a compiled graph's backward: not op by op
            return None
        tensors = [a for a in args if isinstance(a, _Tensor)]
        if kind == _COPY_INTO:
            # copy_(dst, src), index_copy_(dst, dim, index, source), foo_copy(..., out=dst)
            if not tensors and args and isinstance(args[0], (list, tuple)):
                return self._implicit_foreach(name, args, start, end)
            dst = kwargs.get("out") if kwargs else None
            if not isinstance(dst, _Tensor):
                dst = tensors[0] if tensors else None
            src = tensors[-1] if len(tensors) > 1 else dst
            if name.startswith("aten::_copy_from") and len(tensors) > 1:
                src, dst = tensors[0], tensors[1]  # _copy_from(self=src, dst)
            allocated = 0
        else:
            dst = out if isinstance(out, _Tensor) else None
            src = tensors[0] if tensors else None
            allocated = -1  # the new storage's bytes, from its facts below
        if src is None or dst is None:
            return None
        native = self.native
        fs = _facts(native, src)
        fd = fs if dst is src else _facts(native, dst)
        if native is not None:
            ev = native.copy_slots(_PROTOTYPE)
            ev.op = "implicit"
            ev.aten = (name,)
        else:
            ev = CopyEvent(op="implicit", aten=(name,))
        ev.seq = len(self.events) + self.dropped
        ev.start_ns = start
        ev.end_ns = end
        ev.bytes_allocated = fd[_F.STORAGE_BYTES] if allocated < 0 else allocated
        ev.src_dtype = fs[_F.DTYPE]
        ev.src_device = fs[_F.DEVICE]
        ev.src_requires_grad = fs[_F.REQUIRES_GRAD]
        ev.shape = fd[_F.SHAPE]
        ev.dtype = fd[_F.DTYPE]
        ev.dst_device = fd[_F.DEVICE]
        ev.transfer = _transfer(ev.src_device, ev.dst_device)
        ev.bytes_logical = fd[_F.LOGICAL_BYTES]
        ev.non_blocking = bool(kwargs.get("non_blocking", False)) if kwargs else False
        # Dispatch-level tensors carry no autograd metadata: graph facts stay unknown ("none").
        self._context(ev)
        if ev.module is not None and ev.phase != "backward" and _made_node(tensors):
            # autograd made this copy's node just before the copy ran (the next sequence
            # number is the node's + 1): a backward copy of that node names this module
            self.modules.note_node(_sequence_nr() - 1, ev.module)
        self.watch.event(ev, "implicit", src, dst, fs, fd)
        if kind == _COPY_INTO and ev.dst_version is not None:
            # Seen below the ADInplaceOrView kernel, which bumps the written tensor's version
            # counter once the op returns (a write-back `x[:, 0] = f(x[:, 0])`): record the
            # version the tensor has afterwards, as for an API-level copy_.
            ev.dst_version += 1
        self._append(ev)
        return None

    def _implicit_foreach(self, name: str, args: tuple, start: int, end: int) -> None:
        """``_foreach_copy_(dsts, srcs)``: one event for the whole list (0 bytes allocated)."""
        dsts = [t for t in args[0] if isinstance(t, _Tensor)]
        srcs = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else dsts
        if not dsts:
            return
        first, src = dsts[0], srcs[0] if srcs else dsts[0]
        ev = CopyEvent(op="implicit", aten=(name,))
        ev.seq = len(self.events) + self.dropped
        ev.start_ns = start
        ev.end_ns = end
        ev.tensors = len(dsts)
        ev.bytes_logical = sum(_nbytes(t) for t in dsts)
        ev.shape = _shape(first)
        ev.dtype = _dtype_name(first.dtype)
        ev.src_dtype = _dtype_name(src.dtype)
        ev.src_device = _device_str(src.device)
        ev.dst_device = _device_str(first.device)
        ev.transfer = _transfer(ev.src_device, ev.dst_device)
        self._context(ev)
        self._append(ev)

    def from_numpy(self, out: torch.Tensor, start: int, end: int) -> None:
        """Record ``torch.from_numpy(array)``: a tensor over the array's memory (an alias)."""
        ev = CopyEvent(op="from_numpy", aten=(), alias=True)
        ev.seq = len(self.events) + self.dropped
        ev.start_ns = start
        ev.end_ns = end
        ev.shape = _shape(out)
        ev.dtype = ev.src_dtype = _dtype_name(out.dtype)
        ev.src_device = ev.dst_device = "cpu"
        ev.bytes_logical = _nbytes(out)
        self._context(ev)
        self._append(ev)

    # -- deepcopy groups ----------------------------------------------------------------------
    def deepcopy_group(self, orig: Any, x: Any, memo: Any, nil: Any) -> Any:
        """Run the outermost ``copy.deepcopy(x)`` as one group span over its tensor copies."""
        seq = len(self.events) + self.dropped
        group = _Group(seq, _perf_ns())
        self.group = group
        # Reserve the group's slot so it precedes its children in the buffer.
        placeholder = CopyEvent(op="deepcopy", group=True)
        placeholder.seq = seq
        self._append(placeholder)
        error = None
        try:
            return orig(x, memo, nil)
        except BaseException as err:
            error = type(err).__name__
            raise
        finally:
            end = _perf_ns()
            self.group = None
            try:
                with _NoTorchFunction():
                    self._close_group(placeholder, group, x, end, error)
            except Exception as err:
                self.note_error(err)

    def _close_group(
        self, ev: CopyEvent, group: _Group, x: Any, end: int, error: str | None
    ) -> None:
        if group.tensors == 0 and error is None and self.events and self.events[-1] is ev:
            self.events.pop()  # deepcopy of an object holding no tensor: not a copy event
            return
        ev.start_ns = group.start_ns
        ev.end_ns = end
        ev.bytes_allocated = group.bytes
        ev.tensors = group.tensors
        ev.object_type = f"{type(x).__module__}.{type(x).__qualname__}"
        ev.error = error
        ev.dtype = ev.src_dtype = ""
        ev.src_device = ev.dst_device = ""
        self._context(ev)
        ev.parent = -1


def _made_node(tensors: list) -> bool:
    """Whether autograd recorded the op on ``tensors`` (grad mode on, an input needs grad)."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t.requires_grad:
            return True
    return False


def _end_fold(native: Any) -> tuple:
    return native.end_fold() if native is not None else ()


def _tag_grad_fn(grad_fn: Any, ev: CopyEvent) -> None:
    """Tag the copy's grad_fn so that the copy its backward makes names this forward call."""
    if ev.file is None:
        return
    try:
        grad_fn.metadata[_TAG] = (ev.module, f"{ev.file}:{ev.line}")
    except Exception:  # nodes without metadata (custom C++ functions)
        pass


_ACTIVE: Recorder | None = None


def active_recorder() -> Recorder | None:
    """The recorder of the running trace, or ``None``."""
    return _ACTIVE


def set_active(rec: Recorder | None) -> None:
    global _ACTIVE, _THREAD
    if rec is None and _ACTIVE is not None:
        _ACTIVE.watch.finish()  # last retention/snapshot checks, before the export
    _ACTIVE = rec
    _THREAD = threading.get_ident() if rec is not None else None


_THREAD: int | None = None


def _here() -> Recorder | None:
    """The active recorder when called on the traced thread, else None.

    The patches below are process-wide, but torch's modes are thread-local: a deepcopy on
    another thread (an exporter's worker, a data loader thread) must not be recorded. Inside
    a compiled region (``compiled_depth``) they stay in place and call the original straight
    through (dynamo skips their own frames, see ``_compiled._skip_patch_codes``).
    """
    rec = _ACTIVE
    if rec is not None and threading.get_ident() == _THREAD and not rec.compiled_depth:
        return rec
    return None  # or inside a compiled region, where the patches stand aside


class FunctionMode(TorchFunctionMode):
    """API-level interception: one dict lookup per torch call, a record for copy/alias calls."""

    def __init__(self, rec: Recorder) -> None:
        super().__init__()
        self._rec = rec
        self._table = rec.api_table
        self._copies = rec.watch.copies  # in-place writes into fresh copies (_fresh.py)
        self._fresh = self._copies.fresh  # both dicts live as long as the watch
        self._written = self._copies.written

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        try:
            op = self._table.get(func)
        except TypeError:  # an unhashable callable
            op = None
        fresh = self._fresh
        if fresh and args and (id(args[0]) in fresh or self._written):
            self._copies.call(func, args, kwargs)  # a write into (or use of) a fresh copy
        if op is None or self._rec.active is not None:
            return func(*args, **kwargs)
        if func is _GETITEM and (type(args[1]) in _BASIC_INDEX or _basic_index(args)):
            return func(*args, **kwargs)  # x[i], x[a:b]: a view, no event
        return self._rec.api_call(op, func, args, kwargs)


class DispatchMode(TorchDispatchMode):
    """aten-level interception: folds copies into the API call in progress, or records them
    as implicit copies; counts autograd's own detaches."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps every mode's handler in torch._disable_dynamo (two extra Python calls
        # per aten op). warm_up() instead tells dynamo to skip the handler's code object,
        # which keeps compiled code from tracing it at no per-op cost.
        return False

    def __init__(self, rec: Recorder) -> None:
        super().__init__()
        self._rec = rec
        self._table = rec.aten_table
        self._watch = rec.watch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if self._watch.aliases:  # only while a `.data` alias of a grad tensor is alive
            with _NoTorchFunction():
                self._watch.before_op(func, args, kwargs)
        kind = self._table.get(func)
        if kind is None:
            return func(*args, **kwargs)
        rec = self._rec
        pending = rec.active
        if pending is not None:
            pending.aten.append(_aten_name(func))
            return func(*args, **kwargs)
        if kind == _ALIAS:
            rec.internal_detaches += 1
            return func(*args, **kwargs)
        start = _perf_ns()
        out = func(*args, **kwargs)
        end = _perf_ns()
        try:
            with _NoTorchFunction():
                rec.implicit(_aten_name(func), kind, args, kwargs, out, start, end)
        except Exception as err:
            rec.note_error(err)
        rec.overhead_ns += _perf_ns() - end
        return out


class _NullDispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


_WARM = [False]


def warm_up() -> None:
    """Pay torch's one-time cost of the first op under a dispatch mode (it imports
    ``torch._dynamo``, ~1 s) before tracing starts, so it is not timed as a user copy; and
    keep dynamo out of the dispatch handler (see ``DispatchMode._should_skip_dynamo``)."""
    if _WARM[0]:
        return
    _WARM[0] = True
    with _NullDispatch():
        torch.empty(1).clone()
    raw = DispatchMode.__dict__["__torch_dispatch__"]
    try:
        from torch._dynamo.eval_frame import (
            FrameAction,
            FrameExecStrategy,
            set_code_exec_strategy,
        )

        # SKIP the handler's frame and, recursively, every frame it calls (the recorder).
        set_code_exec_strategy(raw.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    except Exception:  # a torch without this private API: fall back to torch's own wrapper
        DispatchMode.__torch_dispatch__ = torch._disable_dynamo(raw, recursive=True)


# --- patches installed while a trace is active ----------------------------------------------
_ORIG_DEEPCOPY = copy.deepcopy
_ORIG_COPY = copy.copy
_ORIG_SWAP = torch.utils.swap_tensors
_ORIG_FROM_NUMPY = torch.from_numpy
_ORIG_PARAM_DEEPCOPY = torch.nn.Parameter.__deepcopy__


def _traced_deepcopy(x, memo=None, _nil=[]):  # noqa: B006 - same signature as copy.deepcopy
    rec = _here()
    if rec is None or rec.group is not None or rec.active is not None:
        return _ORIG_DEEPCOPY(x, memo, _nil)
    if isinstance(x, _Tensor):
        # Recorded here rather than at Tensor.__deepcopy__: a mode above copytrace's (torch's
        # FakeCopyMode) may answer __deepcopy__ without calling down to copytrace.
        return rec.api_call("deepcopy", _ORIG_DEEPCOPY, (x, memo, _nil), {})
    return rec.deepcopy_group(_ORIG_DEEPCOPY, x, memo, _nil)


def _traced_copy(x):
    # Tensor has no __copy__: copy.copy rebuilds a new tensor on the same storage through
    # __reduce_ex__ (an alias), which neither mode sees as one call.
    rec = _here()
    if rec is None or rec.active is not None or not isinstance(x, _Tensor):
        return _ORIG_COPY(x)
    return rec.api_call("copy", _ORIG_COPY, (x,), {})


def _traced_from_numpy(array):
    # torch.from_numpy reaches neither mode as itself (only an aten::lift_fresh): record it
    # as an alias of the array's memory.
    rec = _here()
    if rec is None or rec.active is not None:
        return _ORIG_FROM_NUMPY(array)
    start = _perf_ns()
    out = _ORIG_FROM_NUMPY(array)
    end = _perf_ns()
    try:
        with _NoTorchFunction():
            rec.from_numpy(out, start, end)
    except Exception as err:
        rec.note_error(err)
    return out


def _traced_swap_tensors(t1, t2):
    # nn.Module._apply's swap path (torch.__future__.set_swap_module_params_on_conversion)
    # rebinds parameters with torch.utils.swap_tensors, which neither mode sees.
    rec = _here()
    if rec is None or rec.active is not None:
        return _ORIG_SWAP(t1, t2)
    return rec.api_call("swap_tensors", _ORIG_SWAP, (t1, t2), {})


def _traced_param_deepcopy(self, memo):
    # nn.Parameter.__deepcopy__ never reaches the function mode (its __torch_function__ is
    # disabled); it shows as `.data` + `clone`. Record it as one deepcopy of the parameter.
    rec = _here()
    if rec is None or rec.active is not None:
        return _ORIG_PARAM_DEEPCOPY(self, memo)
    return rec.api_call("deepcopy", _ORIG_PARAM_DEEPCOPY, (self, memo), {})


#: the Python functions patched in (their frames are skipped by dynamo)
PATCH_FUNCTIONS = (
    _traced_deepcopy, _traced_copy, _traced_from_numpy, _traced_swap_tensors,
    _traced_param_deepcopy,
)  # fmt: skip

#: ``(owner, attribute, original, replacement)`` patched with the others (level ``lean``: the
#: API's C wrappers, see ``_observer.install_wrappers``); ``MISSING``: not in the owner's dict
EXTRA_PATCHES: list[tuple[Any, str, Any, Any]] = []
MISSING = object()


def install_patches(stepping_aside: bool = False) -> None:
    """Install copytrace's patches (``stepping_aside``: back after a compiled call, where the
    ``torch.Tensor`` ones stayed)."""
    for owner, name, _, new in EXTRA_PATCHES:
        if not (stepping_aside and owner is _Tensor):
            setattr(owner, name, new)
    copy.deepcopy = _traced_deepcopy
    copy.copy = _traced_copy
    torch.utils.swap_tensors = _traced_swap_tensors
    torch.from_numpy = _traced_from_numpy
    torch.nn.Parameter.__deepcopy__ = _traced_param_deepcopy
    _handover.install(_here)


def remove_patches(stepping_aside: bool = False) -> None:
    """Remove copytrace's patches (``stepping_aside``: for a compiled call, which sees
    ``torch.Tensor``'s own methods through the wrappers' descriptors and whose wrappers stand
    aside by themselves; changing ``torch.Tensor``'s attributes costs a type-cache flush each)."""
    for owner, name, orig, new in EXTRA_PATCHES:
        if stepping_aside and owner is _Tensor:
            continue
        if owner.__dict__.get(name) is new:
            if orig is MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, orig)
    if copy.deepcopy is _traced_deepcopy:
        copy.deepcopy = _ORIG_DEEPCOPY
    if copy.copy is _traced_copy:
        copy.copy = _ORIG_COPY
    if torch.utils.swap_tensors is _traced_swap_tensors:
        torch.utils.swap_tensors = _ORIG_SWAP
    if torch.from_numpy is _traced_from_numpy:
        torch.from_numpy = _ORIG_FROM_NUMPY
    if torch.nn.Parameter.__dict__.get("__deepcopy__") is _traced_param_deepcopy:
        torch.nn.Parameter.__deepcopy__ = _ORIG_PARAM_DEEPCOPY
    _handover.remove()
