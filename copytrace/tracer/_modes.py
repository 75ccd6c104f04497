"""copytrace's two torch modes (the Python path): a TorchFunctionMode and a TorchDispatchMode.

* :class:`FunctionMode` sees the user's API call: one dict lookup per torch call (the API
  table, :func:`copytrace.tracer._rules.api_table`), and for a copy or alias call
  :meth:`Recorder.api_call <copytrace.tracer._api_events.ApiEvents.api_call>`.
* :class:`DispatchMode` sees aten ops: a copy op inside an API call is folded into that call's
  event; one with no API call around it is an implicit copy
  (:mod:`copytrace.tracer._implicit`); a bare ``aten::detach``/``aten::alias`` is autograd's
  own bookkeeping, counted in ``Recorder.internal_detaches``.

Where the C++ observer is built, its C handler and kernels replace both (see
:mod:`copytrace.tracer._observer`). Neither mode is re-entered by its own handler: torch pops a
mode from its stack while the mode's handler runs.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from copytrace.tracer._rules import _ALIAS, _BASIC_INDEX, _GETITEM, _aten_name, _basic_index
from copytrace.tracer.compiled.stepaside import call_without

if TYPE_CHECKING:
    from copytrace.tracer._recorder import Recorder

__all__ = ["FunctionMode", "DispatchMode", "warm_up"]

_perf_ns = time.perf_counter_ns
_NoTorchFunction = torch._C.DisableTorchFunction
_Tensor = torch.Tensor
# torch functions whose forward kernel computes more while any dispatch mode is on: torch's
# _may_require_fw_or_bw_grad (aten/src/ATen/native/BatchLinearAlgebra.cpp, LinearAlgebra.cpp)
# is true for every input then (isTensorSubclassLike: c10::impl::dispatch_mode_enabled()), so
# svdvals/eigvalsh ask LAPACK for the vectors too and return other bits. The Python fallback
# runs them with its dispatch mode stepped aside (their implicit copies go unrecorded).
_MODE_SENSITIVE = frozenset(
    (
        torch.linalg.svdvals, torch.linalg.eigvalsh, torch.linalg.eigvals, torch.linalg.cond,
        torch.linalg.matrix_rank, torch.linalg.matrix_norm, torch.linalg.norm,
        torch.nuclear_norm, torch.norm, _Tensor.norm, torch.svd, _Tensor.svd,
    )
)  # fmt: skip


#: torch's record scope calls (``torch.autograd.profiler.record_function``): the optimizer steps
_SCOPE_ENTER = torch.ops.profiler._record_function_enter_new
_SCOPE_EXIT = torch.ops.profiler._record_function_exit._RecordFunction


class FunctionMode(TorchFunctionMode):
    """API-level interception: one dict lookup per torch call, a record for copy/alias calls."""

    def __init__(self, rec: Recorder) -> None:
        super().__init__()
        self._rec = rec
        #: the Python fallback's DispatchMode while it is on the stack (set by _engage.py)
        self.dispatch: DispatchMode | None = None
        self._table = rec.api_table
        self._copies = rec.watch.copies  # in-place writes into fresh copies (_fresh.py)
        self._fresh = self._copies.fresh  # both dicts live as long as the watch
        self._written = self._copies.written
        self._steps: list[int] = []  # ids of the open Optimizer.step# record handles

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if self.dispatch is not None and func in _MODE_SENSITIVE:
            return call_without(self.dispatch, func, args, kwargs)
        try:
            op = self._table.get(func)
        except TypeError:  # an unhashable callable
            op = None
        fresh = self._fresh
        if fresh and args and (id(args[0]) in fresh or self._written):
            self._copies.call(func, args, kwargs)  # a write into (or use of) a fresh copy
        if op is None or self._rec.active is not None:
            if func is _SCOPE_ENTER or func is _SCOPE_EXIT:
                return self._scope(func, args, kwargs)
            return func(*args, **kwargs)
        if func is _GETITEM and (type(args[1]) in _BASIC_INDEX or _basic_index(args)):
            return func(*args, **kwargs)  # x[i], x[a:b]: a view, no event
        return self._rec.api_call(op, func, args, kwargs)

    def _scope(self, func, args, kwargs):
        """torch's record scope ``Optimizer.step#<Class>.step`` around an optimizer's
        ``step()`` (``Optimizer.profile_hook_step``, profiler or not): the recorder's
        ``step_scope`` begins after it opens and ends before it closes (the Python fallback's
        optimizer steps, with nothing in torch's hook dicts)."""
        hooks = self._rec.step_scope
        if hooks is None:
            return func(*args, **kwargs)
        if func is _SCOPE_ENTER:
            out = func(*args, **kwargs)
            name = args[0] if args else kwargs.get("name")
            if isinstance(name, str) and name.startswith("Optimizer.step#"):
                self._steps.append(id(out))  # the handle lives until its exit
                _call_hook(self._rec, hooks[0])
            return out
        steps = self._steps
        if steps and args and id(args[0]) == steps[-1]:
            steps.pop()
            _call_hook(self._rec, hooks[1])
        return func(*args, **kwargs)


def _call_hook(rec: Recorder, hook) -> None:
    try:
        hook()
    except Exception as err:
        rec.note_error(err)


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
        watch = self._watch
        if watch.aliases or watch.snap_watch:  # while a `.data` or state_dict() alias is watched
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
