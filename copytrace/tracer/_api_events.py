"""API-level events: the user's call (``Tensor.clone``, ``.data``, ``.to``...) as one event.

:class:`ApiEvents` is the part of :class:`copytrace.tracer._recorder.Recorder` that records
the calls in its API table. A call is begun by :meth:`ApiEvents.api_before` and recorded by
:meth:`ApiEvents.api_after` (or :meth:`ApiEvents.api_fast`, for the C observer's calls with no
``api_before``). The event is decided by the rules of :mod:`copytrace.tracer._rules`: in one
call of the C++ observer's ``record`` for plain tensors, else by :meth:`ApiEvents._record_py`
with the Python readers of :mod:`copytrace.tracer._facts`. Both set the same fields in the
same order of storage ids (``tests/test_native_facts.py`` compares them). The C path's
common case (``fast_event`` in ``_native/api_mode.cpp``) calls nothing here.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

import torch

from copytrace import _threads
from copytrace.schema import CopyEvent
from copytrace.tracer import _callsite, _modules
from copytrace.tracer import _facts as _F
from copytrace.tracer._fresh import INDEX_OPS
from copytrace.tracer._rules import (
    HOST_TO_DEVICE,
    IN_PYTHON,
    LEGACY_CTOR,
    NO_MEMORY,
    RULES,
    STORAGE_MOVES,
    _basic_index,
    _storage_nbytes,
    _transfer,
    settle_unreal,
)
from copytrace.tracer._warnplace import call_placed

if TYPE_CHECKING:
    from copytrace.tracer._node_tags import NodeTags
    from copytrace.tracer._recorder import Recorder

__all__ = ["ApiEvents"]

_perf_ns = time.perf_counter_ns
_NoTorchFunction = torch._C.DisableTorchFunction
_Tensor = torch.Tensor
_py_facts = _F.py_facts
_is_wrapped = _F.is_wrapped
# Every field at its default: the C++ observer copies it for each new event (copy_slots).
_PROTOTYPE = CopyEvent()
_NO_KWARGS: dict[str, Any] = {}
# Ops whose event's result is their first argument: dst.copy_(src) writes into dst;
# dst.data = src rebinds dst to src's storage; swap_tensors(dst, src) exchanges payloads.
_DST_FIRST = frozenset(("copy_", "data_set", "swap_tensors"))
# ops that read their data argument value by value
_FROM_DATA = ("tensor_ctor", "new_tensor", "as_tensor", LEGACY_CTOR)
# ops whose data is their second argument: u.new_tensor(data), a legacy ctor's (cls, data)
_DATA_SECOND = ("new_tensor", LEGACY_CTOR)
_SEQUENCES = (list, tuple)
_NO_TENSOR_RESULT = ("numpy", "copy_", "data_set")  # ops whose result may be no tensor
_WRITES_INTO = RULES.writes_into
_ALWAYS_ALIAS = RULES.always_alias
_VIEW_NO_EVENT = RULES.view_is_no_event
_IN_PYTHON = IN_PYTHON  # ops record.cpp's record leaves to the Python readers


class _Pending:
    """An API call in progress: the aten ops it caused are appended to ``aten``."""

    __slots__ = ("aten",)

    def __init__(self) -> None:
        self.aten: list[str] = []


class ApiEvents:
    """The API-level events of :class:`~copytrace.tracer._recorder.Recorder` (a mixin: every
    attribute read here is the recorder's)."""

    def api_before(self: Recorder, op: str, func: Any, args: tuple, kwargs: dict | None) -> Any:
        """Start recording the user's API call ``op``; ``None`` means: run it unrecorded.

        Called by the C handler (``_native/api_mode.cpp``) or :meth:`api_call` before
        ``func(*args, **kwargs)`` runs; the token goes to :meth:`api_after`."""
        if op == "backward":
            self.watch.check_backward(func, args, kwargs or {})
            return None
        if op == "deepcopy" and len(args) > 1 and args[1] is not None and id(args[0]) in args[1]:
            return None  # memo hit: deepcopy returns an earlier copy
        if op == "as_tensor" and not _reads_tensors(args, kwargs):
            return None  # as_tensor(t): t, its alias or an aten conversion (recorded as such)
        if op == LEGACY_CTOR and (
            self.compiled_depth or len(args) != 2 or not _reads_tensors(args[1:], None)
        ):
            return None  # torch.Tensor(3), torch.Tensor([1.0]), torch.Tensor(t): no list copy
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
        self: Recorder, token: Any, result: Any, error: Any, start: int, end: int, aten: tuple = ()
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
        if len(self.events) >= self.flush_at:
            self.full()  # a flush by count (copytrace.tracer._buffer), between two calls
        self.overhead_ns += _perf_ns() - end

    def api_fast(
        self: Recorder, op: str, args: tuple, result: Any, error: Any, start: int, end: int,
        aten: tuple,
    ) -> None:  # fmt: skip
        """Record a call the C observer ran without :meth:`api_before` (no keyword arguments, a
        plain tensor first, an op in :data:`FAST_OPS`; ``api_mode.cpp``, ``fast_call``): as
        :meth:`api_after` records it. Never raises."""
        try:
            name = error.__name__ if error is not None else None
            self._record_api(op, args, _NO_KWARGS, result, aten, start, end, name)
        except Exception as err:
            self.note_error(err)
        if len(self.events) >= self.flush_at:
            self.full()
        self.overhead_ns += _perf_ns() - end

    def api_call(self: Recorder, op: str, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run ``func(*args, **kwargs)`` as the user's API call ``op`` and record it (the
        Python function mode's path and copytrace's own patches)."""
        # copytrace's own reads (.requires_grad, .grad_fn, storages) must reach no mode and
        # no subclass's __torch_function__: torch function handling is off around them.
        with _NoTorchFunction():
            token = self.api_before(op, func, args, kwargs)
        if token is None:
            return call_placed(func, args, kwargs)
        native = self.native
        if native is not None:
            native.begin_fold()
        start = _perf_ns()
        try:
            result = call_placed(func, args, kwargs)  # a C++ warning names the program's line
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
        self: Recorder, op: str, src: Any, out: Any, ev: CopyEvent, grad_fn: Any, where: Any
    ) -> None:
        """The rest of an event record.cpp's ``record`` made (``where``: True when its phase,
        module and thread are set, else the frame to place it from): tag ``grad_fn``, start
        the watches, keep the event. Called by :meth:`_record_api` and by api_mode.cpp's fast
        events for what they do not finish in C."""
        if where is not True:
            self._place(ev, where)
        if ev.transfer != "none" and (
            ev.fake or ev.dst_device in NO_MEMORY or ev.src_device in NO_MEMORY
        ):
            settle_unreal(ev)  # a meta tensor: record.cpp's record names a transfer
        if grad_fn is not None and ev.phase != "backward":
            _tag_grad_fn(self.node_tags, grad_fn, ev)
        try:  # the rest of Watch.event: an error there still keeps the event
            self.watch.follow(ev, op, src, out, grad_fn)
        except Exception as err:
            self.note_error(err)
        self._append(ev)

    def _record_api(
        self: Recorder, op: str, args: tuple, kwargs: dict, result: Any, aten: tuple,
        start: int, end: int, error: str | None, src_requires_grad: bool | None = None,
    ) -> None:  # fmt: skip
        """Record API call ``op`` (``error``: the exception's type name, or None): in one call
        of the C++ observer's ``record`` where it reads the tensors, else :meth:`_record_py`."""
        if op in _DST_FIRST:
            if len(args) < 2:
                return
            dst, src = args[0], args[1]
            if not isinstance(dst, _Tensor) or not isinstance(src, _Tensor):
                return
            if dst is src and op == "data_set":
                return  # `p.data = p` (Module._apply after an in-place fn): nothing rebound
            out = dst
        else:
            src = args[0] if args else kwargs.get("data")
            if op in _DATA_SECOND:  # u.new_tensor(data) copies data; u gives dtype and device
                src = args[1] if len(args) > 1 else kwargs.get("data")
            if not isinstance(src, _Tensor):
                if op in _FROM_DATA and isinstance(src, _SEQUENCES):
                    src = _first_tensor(src)  # torch.tensor([t1, t2]): copies each tensor
                if not isinstance(src, _Tensor):
                    return  # torch.tensor([1, 2]), torch.clone(x=...) etc.: no tensor input
            out = result
        if error is None and op not in _NO_TENSOR_RESULT and not isinstance(out, _Tensor):
            return  # t.type() with no argument returns a string
        native = self.native
        if native is not None and error is None and self.group is None and op not in _IN_PYTHON:
            # the common case in one C call (record.cpp, record): same fields, same ids
            state = self._native_state
            if state is None:
                state = self._native_state = (
                    _PROTOTYPE, self.watch.ids, _callsite._code_kind, _modules.CALL_IMPL,
                    _threads.NAMES,
                )  # fmt: skip
            found = native.record(
                state, op, src, out, src_requires_grad, len(self.events) + self.dropped,
                start, end, aten, self.step_index, self.in_optimizer,
            )  # fmt: skip
            if found is False:  # no event (an integer index's view)
                return
            if found is not None:  # tensor facts, call site, step and storage ids set
                ev, grad_fn, where = found
                if kwargs:
                    ev.non_blocking = bool(kwargs.get("non_blocking", False))
                self.api_tail(op, src, out, ev, grad_fn, where)
                return
            # None: not a plain tensor, the Python readers below
        events = self.events
        count = len(events)
        self._record_py(op, src, out, kwargs, aten, start, end, error, src_requires_grad)
        if len(events) > count and events[-1].via == _ENTRY:
            _past_entry(events[-1])  # reached through a Python-level torch function

    def _record_py(
        self: Recorder, op: str, src: Any, out: Any, kwargs: dict, aten: tuple, start: int,
        end: int, error: str | None, src_requires_grad: bool | None,
    ) -> None:  # fmt: skip
        """:meth:`_record_api` with the Python readers (no observer, a tensor it does not
        read, numpy, deepcopy, a failed call or a call inside a deepcopy group)."""
        native = self.native
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
        ev.start_ns, ev.end_ns = start, end
        ev.src_dtype = src_dtype = fs.dtype
        ev.src_device = src_device = fs.device
        src_rg = fs.requires_grad if src_requires_grad is None else src_requires_grad
        ev.src_requires_grad = src_rg
        if kwargs:
            ev.non_blocking = bool(kwargs.get("non_blocking", False))
        fo = grad_fn = None
        if error is not None or op == "numpy":  # failed, or an ndarray on its memory (alias)
            ev.shape = fs.shape
            ev.dtype = src_dtype
            ev.dst_device = dst_device = src_device
            ev.bytes_logical = fs.logical_bytes
            if op in _DST_FIRST and out is not src and isinstance(out, _Tensor):
                # dst.copy_(src) that raised: the destination is where the data was to go
                ev.shape = _F.shape(out)
                ev.dtype = _F.dtype_name(out.dtype)
                ev.dst_device = dst_device = _F.device_str(out.device)
                ev.bytes_logical = _F.nbytes(out)
            alias = ev.alias = op == "numpy" and error is None
            ev.requires_grad = False
            if src_rg and alias:
                ev.graph = "detached"
            if op == "deepcopy":  # (a failed one: no numpy)
                _failed_deepcopy(self, ev, src)
        else:
            fo = native.facts(out, True) if native is not None else None
            if fo is None:
                fo = _py_facts(out, True)
            dst_device = fo.device
            grad_fn = fo.grad_fn
            alias = self._classify(ev, op, src, out, fs, fo, src_rg)
        if alias and op in _VIEW_NO_EVENT:
            return  # a zero-dim integer index selects a view: not a copy
        if src_device is not dst_device:  # interned names: equal names are one object
            transfer = ev.transfer = _transfer(src_device, dst_device)
            if transfer == HOST_TO_DEVICE:
                ev.pinned = src.is_pinned()
        if ev.fake or dst_device in NO_MEMORY:
            settle_unreal(ev)  # no real memory: nothing allocated, nothing moved
        if native is not None:  # Recorder._context, inlined: the same walk in C
            site = native.call_site(_callsite._code_kind)
        else:
            site = _callsite.call_site(sys._getframe(2))
        if site is not None:
            _callsite.put_site(ev, site)
        ev.step = self.step_index
        self._place(ev, sys._getframe(1))
        if grad_fn is not None and ev.phase != "backward":
            _tag_grad_fn(self.node_tags, grad_fn, ev)
        group = self.group
        if group is not None and error is None:
            group.bytes += ev.bytes_allocated
            group.tensors += 1
        try:  # Watch.event, inlined: an error there still keeps the event
            self.watch._event(ev, op, src, out, fs, fo)
        except Exception as err:
            self.note_error(err)
        if len(self.events) < self.max_events:  # _append, inlined
            self.events.append(ev)
        else:
            self.dropped += 1

    def _classify(
        self: Recorder, ev: CopyEvent, op: str, src: Any, out: Any, fs: _F.Facts, fo: _F.Facts,
        src_rg: Any,
    ) -> bool:  # fmt: skip
        """Set the result's facts on ``ev`` (``fs``, ``fo``: the facts of ``src``, ``out``)
        and class it by :data:`~copytrace.tracer._rules.RULES`: no-op, alias, or a copy with
        the bytes it allocated; and its graph. Returns whether the result is an alias."""
        (shape, dtype, dst_device, rg, is_leaf, grad_fn, grad_fn_name, storage,
         storage_bytes, logical, _, _, _, fake) = fo  # fmt: skip
        ev.shape = shape
        ev.dtype = dtype
        ev.dst_device = dst_device
        ev.bytes_logical = logical
        ev.requires_grad = rg
        ev.grad_fn = grad_fn_name
        ev.is_leaf = is_leaf
        if _is_wrapped(out):  # vmap: one call over the whole batch (its facts: _F.unbatched)
            ev.batch_size = _F.batch_size(out)
        noop = False
        if op in _WRITES_INTO:
            alias = False  # written into an existing tensor: 0 bytes allocated
        elif out is src and op in STORAGE_MOVES and "aten::copy_" in ev.aten:
            alias = False  # the same storage, its bytes moved into a new allocation
            ev.storage_move = True
            ev.bytes_allocated = storage_bytes
            noop = rg  # the same tensor: still in its graph
        elif out is src:
            noop = ev.noop = alias = ev.alias = True
        elif op in _ALWAYS_ALIAS:
            alias = ev.alias = True
        else:
            # the same storage: the same key (its StorageImpl's address, both alive)
            alias = ev.alias = storage is not None and storage == fs.storage
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
                    if storage in group.storages:
                        nbytes = 0  # storage shared inside the copied object: copied once
                    else:
                        group.storages.add(storage)
                ev.bytes_allocated = nbytes
        if grad_fn is not None or (noop and rg):
            ev.graph = "attached"
        elif src_rg:
            ev.graph = "detached"
        return alias


#: torch/overrides.py's function through which a Python-level torch function (``Tensor.
#: share_memory_``) hands its own call to a function mode
_ENTRY = "handle_torch_function"


def _failed_deepcopy(rec: Any, ev: CopyEvent, src: Any) -> None:
    """A deepcopy of ``src`` that raised: where ``src`` is not a graph leaf (the case
    ``Tensor.__deepcopy__`` refuses, ``torch/_tensor.py``), ``grad_fn`` and ``is_leaf`` are
    its own (no result exists), and the enclosing deepcopy group notes its identity, for the
    name of the attribute that held it (``Recorder._close_group``)."""
    grad_fn = getattr(src, "grad_fn", None) if isinstance(src, _Tensor) else None
    if grad_fn is None:
        return
    ev.grad_fn = type(grad_fn).__name__
    ev.is_leaf = False
    group = rec.group
    if group is not None and group.failed is None:
        group.failed = (id(src), src._cdata, ev)


def _past_entry(ev: CopyEvent) -> None:
    """``ev``'s ``via`` is ``handle_torch_function``: a Python-level torch function
    (``Tensor.share_memory_``, ``Tensor.__deepcopy__`` of a tensor inside a deepcopied
    object) handed its own call to a function mode. Set its call site from the frames beyond
    that frame and the torch function that called it (the API call itself, not a ``via``),
    as without a function mode. The program's own function mode above copytrace's makes one
    such entry per mode: each is passed (at most 8)."""
    frame: Any = sys._getframe(2)
    for _ in range(8):
        while frame is not None and frame.f_code.co_name != _ENTRY:
            frame = frame.f_back
        if frame is None or frame.f_back is None:
            return
        frame = frame.f_back  # the torch function that handed its call on
        site = _callsite.call_site(frame.f_back)
        if site is None:
            return
        _callsite.put_site(ev, site)
        if site[3] != _ENTRY:  # (file, line, function, via, library)
            return


def _reads_tensors(args: tuple, kwargs: dict | None) -> bool:
    """Whether ``torch.as_tensor(*args, **kwargs)`` (or a legacy constructor, ``args`` its
    arguments after the class) reads tensors value by value: its data a (nested) list or tuple
    holding a tensor. Of one tensor as_tensor returns that tensor, an alias or an aten
    conversion (``_to_copy``, recorded as it runs), and ``torch.Tensor(t)`` an alias
    (``aten::alias``), never a copy of their own."""
    data = args[0] if args else (kwargs or _NO_KWARGS).get("data")
    return isinstance(data, _SEQUENCES) and _first_tensor(data) is not None


def _first_tensor(data: Any, depth: int = 0) -> Any:
    """The first tensor in a (nested) list or tuple given to ``torch.tensor``, or None."""
    for item in data:
        if isinstance(item, _Tensor):
            return item
        if isinstance(item, (list, tuple)) and depth < 32:
            found = _first_tensor(item, depth + 1)
            if found is not None:
                return found
        else:
            return None  # numbers: torch.tensor reads no tensor at this level
    return None


def _end_fold(native: Any) -> tuple:
    return native.end_fold() if native is not None else ()


def _tag_grad_fn(tags: NodeTags, grad_fn: Any, ev: CopyEvent) -> None:
    """Tag the copy's grad_fn (in ``tags``, nothing on the node) so that the copy its backward
    makes names this forward call: ``(module, "file:line", version)``, ``version`` the version
    counter of the leaf it copied (:func:`leaf_version`) when the copy was made, or None."""
    if ev.file is None:
        return
    try:
        tags.put(grad_fn, (ev.module, f"{ev.file}:{ev.line}", leaf_version(grad_fn)))
    except Exception:  # not an autograd node
        pass


def leaf_version(node: Any) -> int | None:
    """The version counter of the leaf (a parameter) a copy's ``node`` (its grad_fn, e.g.
    ``ToCopyBackward0``) reads straight from, through its first edge's ``AccumulateGrad``;
    None when that edge leads elsewhere. Reads no data and keeps no reference."""
    try:
        nxt = node.next_functions
        acc = nxt[0][0] if nxt else None
        leaf = getattr(acc, "variable", None)
        return None if leaf is None else leaf._version  # type: ignore[no-any-return]
    except Exception:  # a node without edges, an inference tensor (no version counter)
        return None
