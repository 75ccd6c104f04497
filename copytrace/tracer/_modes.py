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

Inside backward, and inside a saved-tensor pack hook, the fallback's function mode is
:class:`ValueMode`, which records nothing and keeps only what torch computes as untraced
(:mod:`copytrace.tracer._mode_values`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from copytrace.tracer import _mode_values
from copytrace.tracer._mode_values import (
    BACKWARD,
    GRAD_NODE,
    VALUE_CALLS,
    steps_aside,
)
from copytrace.tracer._rules import _ALIAS, _BASIC_INDEX, _GETITEM, _aten_name, _basic_index
from copytrace.tracer._warnplace import call_placed
from copytrace.tracer.compiled.stepaside import FUNCTION_STACK, call_without, lift

if TYPE_CHECKING:
    from copytrace.tracer._recorder import Recorder

__all__ = [
    "FunctionMode",
    "DispatchMode",
    "ValueMode",
    "lift_for_node",
    "run_with_value_mode",
    "warm_up",
]

_perf_ns = time.perf_counter_ns
_NoTorchFunction = torch._C.DisableTorchFunction
_Tensor = torch.Tensor
_C = torch._C
_is_compiling = torch.compiler.is_compiling
_len_function_stack = _C._len_torch_function_stack
_push_function_mode = _C._push_on_torch_function_stack
#: the saved-tensor hooks on top of this thread's stack (``saved_tensors_hooks``), or None
_top_saved_hooks = _C._autograd._top_saved_tensors_default_hooks
#: the sequence number the next autograd node made on this thread gets
_sequence_nr = _C._autograd._get_sequence_nr
#: calls a function skipping one ``has_torch_function`` check (``torch.overrides.
#: redispatch_function``; None on a torch without it: backward runs as before)
_skip_one_hop = getattr(_C, "_skip_one_hop_torch_function", None)
_peek_skip = getattr(_C, "_peek_should_skip_torch_function", None)
_set_skip = getattr(_C, "_set_skip_next_torch_function", None)
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
        #: the function mode on the stack inside backward (with ``dispatch``; _engage.py)
        self.values: ValueMode | None = None
        self._table = rec.api_table
        self._copies = rec.watch.copies  # in-place writes into fresh copies (_fresh.py)
        self._fresh = self._copies.fresh  # both dicts live as long as the watch
        self._written = self._copies.written
        self._steps: list[int] = []  # ids of the open Optimizer.step# record handles

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        dispatch = self.dispatch
        if dispatch is not None and func in VALUE_CALLS:  # see _mode_values
            if steps_aside(func, args, kwargs):
                return call_without(dispatch, call_placed, (func, args, kwargs), {})
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
            if dispatch is not None and _top_saved_hooks(False) is not None:
                out = self._saving(dispatch, func, types, args, kwargs)
            else:
                out = call_placed(func, args, kwargs)  # a C++ warning names the program's line
            if dispatch is not None and dispatch.grad_since is not None:
                self._hook_nodes(dispatch, out)
            return out
        if func is _GETITEM and (type(args[1]) in _BASIC_INDEX or _basic_index(args)):
            return call_placed(func, args, kwargs)  # x[i], x[a:b]: a view, no event
        if func in BACKWARD and self.values is not None:
            with _NoTorchFunction():
                self._rec.api_before(op, func, args, kwargs)  # checks the graph; no event
            return run_with_value_mode(self.values, func, types, args, kwargs)
        return self._rec.api_call(op, func, args, kwargs)

    def _hook_nodes(self, dispatch: DispatchMode, out) -> None:
        _hook_nodes(self._rec, dispatch, out)

    def _saving(self, dispatch: DispatchMode, func, types, args, kwargs):
        """``func(*args, **kwargs)`` while saved-tensor hooks are set: with ``ValueMode`` on
        the stack for the pack hooks it calls (:func:`run_with_value_mode`, ``placed``). A pack
        hook's own calls reach ``ValueMode``, which hooks the nodes made since the dispatch mode
        last noted one and forgets the note, also the one this call's own ``prod`` made: so
        every node this call made (numbered from the sequence number before it,
        ``torch._C._autograd._get_sequence_nr``) is looked at after it returns."""
        since = _sequence_nr()
        out = run_with_value_mode(self.values, func, types, args, kwargs, placed=True)
        if _sequence_nr() > since:  # the call made autograd nodes
            dispatch.grad_since = since
        return out

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


def _hook_nodes(rec: Recorder, dispatch: DispatchMode, out) -> None:
    """The call made nodes whose backward branches on the dispatch mode: hook them
    (:func:`copytrace.tracer._mode_values.hook_nodes`). Never raises."""
    since = dispatch.grad_since
    dispatch.grad_since = None
    try:
        with _NoTorchFunction():
            _mode_values.hook_nodes(out, since, lift_for_node)
    except Exception as err:
        rec.note_error(err)


class ValueMode(TorchFunctionMode):
    """The Python fallback's function mode inside backward: records nothing, and keeps what
    torch computes there as untraced.

    torch runs a mode's handler with the mode off its stack, and the autograd engine runs every
    node under the mode stacks its entry point was called with (``GraphTask::thread_locals_``,
    put back around each node in engine.cpp ``thread_main``). So the backward a program starts
    under :class:`FunctionMode` would run its Python code (hooks, a custom ``Function``'s
    backward, a reentrant checkpoint's forward run again, a saved-tensor unpack hook) with the
    dispatch mode alone on the stack: a :data:`~copytrace.tracer._mode_values.MATMUL` or
    ``MODE_SENSITIVE`` call there would compute other bits and a ``prod`` node made there
    would get no lift. :func:`run_with_value_mode` puts this mode on the function stack for the
    engine's run; it steps the dispatch mode aside for those calls and hooks the nodes, like
    :class:`FunctionMode`, and is put there again for a backward started inside backward.
    The same holds in forward for a saved-tensor pack hook, which the autograd kernel calls
    inside the op: :class:`FunctionMode` runs an op with this mode on the stack while
    saved-tensor hooks are set. This mode does not do so itself (a binding that checks the
    stack twice, ``torch._C._set_grad_enabled``, would come back to it without end)."""

    def __init__(self, rec: Recorder, dispatch: DispatchMode) -> None:
        super().__init__()
        self._rec = rec
        self._dispatch = dispatch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        dispatch = self._dispatch
        if func in VALUE_CALLS:
            if steps_aside(func, args, kwargs):
                return call_without(dispatch, call_placed, (func, args, kwargs), {})
        elif func in BACKWARD:
            return run_with_value_mode(self, func, types, args, kwargs)
        out = call_placed(func, args, kwargs)
        if dispatch.grad_since is not None:
            _hook_nodes(self._rec, dispatch, out)
        return out


def run_with_value_mode(
    mode: ValueMode, func, types, args: tuple, kwargs: dict, placed: bool = False
):
    """``func(*args, **kwargs)``, a call made from a function mode's handler, with ``mode``
    on torch's function stack while it runs; taken off after, also when ``func`` raises.

    Two callers: a backward entry point (the engine then runs the nodes with ``mode``, see
    :class:`ValueMode`), and an op called while saved-tensor hooks are set
    (``saved_tensors_hooks``; ``placed``). The autograd kernel calls the pack hook inside the
    op (``SavedVariable``'s constructor, ``PySavedVariableHooks::call_pack_hook``), where torch
    has popped the calling mode for its handler: without ``mode`` there a pack hook's
    :data:`~copytrace.tracer._mode_values.MATMUL` or ``MODE_SENSITIVE`` call would run with
    the dispatch mode alone on the stack and compute other bits. ``placed``: the call is made
    through :func:`~copytrace.tracer._warnplace.call_placed`, so that a C++ warning of the op
    names the program's line.

    Only where the stack is otherwise empty (a program's own function mode below copytrace's
    sees the call as untraced) and no argument's type has a ``__torch_function__`` of its own
    (``types``): the call skips the one ``has_torch_function`` check it would now hit
    (torch's ``_skip_one_hop_torch_function``), which would skip those too. Anywhere else, and
    on a torch without it, the call runs as untraced with no mode. Returns what ``func``
    returns, raises what it raises."""
    if _skip_one_hop is None or _len_function_stack() or any(t is not _Tensor for t in types):
        return call_placed(func, args, kwargs)
    _push_function_mode(mode)
    try:
        if placed:
            return call_placed(_skip_one_hop, (func, types, args, kwargs), {})
        return _skip_one_hop(func, types, args, kwargs)
    finally:
        lift(*FUNCTION_STACK, mode)
        if placed and _peek_skip is not None and _peek_skip():
            _set_skip(False)  # a binding that checked no torch function: skip nothing later


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
        # the copy and alias ops, and the ops whose node's backward branches on the mode
        self._table = {**rec.aten_table, **_mode_values.grad_node_ops()}
        self._watch = rec.watch
        #: the sequence number of the first such node made since the function mode last
        #: looked (None: none)
        self.grad_since: int | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # ``func`` is called with torch function off: an ``OpOverload`` called from Python
        # asks the function modes and the ``__torch_function__`` of its arguments' types
        # (torch/csrc/jit/python/init.cpp ``_get_operation_for_overload_or_packet``), which the
        # dispatcher never does untraced. Most ops come here from a function mode's handler,
        # which runs with its mode off; those that reach the dispatcher past the modes did
        # not: a program's function mode saw ``aten.set_.source_Storage_storage_offset`` of
        # ``copy.copy(t)`` (``Tensor.set_`` does not call the function modes)
        if kwargs is None:
            kwargs = {}
        with _NoTorchFunction():
            watch = self._watch
            if watch.aliases or watch.snap_watch or watch.surprise:  # while an alias is watched
                self._watch.before_op(func, args, kwargs)
            kind = self._table.get(func)
            if kind is None:
                return func(*args, **kwargs)
            if kind == GRAD_NODE:  # its autograd node exists already, the newest on this thread
                if self.grad_since is None:
                    self.grad_since = _mode_values.sequence_nr()
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
                rec.implicit(_aten_name(func), kind, args, kwargs, out, start, end)
            except Exception as err:
                rec.note_error(err)
            rec.overhead_ns += _perf_ns() - end
            return out


def lift_for_node(grad_outputs):
    """Pre-hook of a node whose backward formula branches on the dispatch mode
    (:data:`copytrace.tracer._mode_values.GRAD_NODES`): takes the fallback's dispatch mode off
    torch's stack while the node runs, so it computes what it computes untraced.

    Only where the mode is alone on the stack (another mode would make torch take the same
    branch untraced) and the engine runs the node under its per-node guard, which puts the
    thread-local state, mode stack included, back after the node, also when it raises
    (``NodeGuard`` and ``ThreadLocalStateGuard`` in engine.cpp ``thread_main``; a node run
    by compiled autograd has no current node and is left alone). Returns None: the gradients
    pass unchanged. Compiled autograd traces it as a hook returning None (dynamo's
    ``is_compiling()``: no mode to lift in a compiled graph, and nothing it cannot trace)."""
    if _is_compiling() or _C._len_torch_dispatch_stack() != 1:
        return None
    mode = _C._get_dispatch_stack_at(0)
    if type(mode) is DispatchMode:
        try:
            if _C._current_autograd_node() is not None:
                _C._pop_torch_dispatch_stack(None)
        except Exception as err:
            mode._rec.note_error(err)
    return None


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
