"""The compiled regions of one trace: :class:`Compiled` installs the hook and the C or Python
callbacks, and records each outermost compiled call (see the package's docstring)."""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from copytrace.tracer.compiled._aside import (
    StepAside,
    _patched_names,
    _skip_patch_codes,
    skip_codes,
)
from copytrace.tracer.compiled._calls import CallLog
from copytrace.tracer.compiled._hook import (
    _ENTER,
    _HOOKS_ATTR,
    _STATE,
    _enter,
    _hookable,
    _hooks_del,
    _hooks_get,
    _hooks_set,
    _nothing,
    _suppress,
    _WithHook,
)
from copytrace.tracer.compiled.graphs import CompiledCall, GraphLogHandler
from copytrace.tracer.compiled.stepaside import (
    DISPATCH_STACK,
    FUNCTION_STACK,
    hook_dicts,
)

__all__ = ["Compiled"]

_perf_ns = time.perf_counter_ns
_get_ident = threading.get_ident
_getframe = sys._getframe
_function_stack_len = FUNCTION_STACK[0]
_dispatch_stack_len = DISPATCH_STACK[0]


class Compiled(StepAside, CallLog):
    """Compiled regions of one trace: the hook, the graph log and the calls recorded.

    Args:
        rec: the trace's recorder (errors are counted there; ``rec.compiled_depth`` mirrors
            the nesting depth of compiled calls on the traced thread).
    """

    def __init__(self, rec: Any) -> None:
        self.rec = rec
        self.thread: int | None = None
        self.depth = 0
        self.engaged = False
        self._calls: list[CompiledCall] = []
        self._calls_total = 0
        self.calls_dropped = 0
        #: calls ended but not yet made CompiledCall objects: (start ns, end ns, step, source,
        #: graph ids, new graphs, graph copies, graph copy bytes, unknown graphs), appended by
        #: _leave or by compiled.cpp's cc_leave (the same list object for the whole trace)
        self._raw: list[tuple[Any, ...]] = []
        self.graph_runs: dict[str, int] = {}
        self.handler = GraphLogHandler(rec.note_error)
        self._logging = False
        self._modes: tuple[Any, Any] = (None, None)
        self._handles: list[Any] = []
        self._hook_entries: list[tuple[dict[Any, Any], Any]] = []
        self._call: tuple[int, int, Any, int] | None = None  # start, step, source, graphs
        self._saved: Any = None
        #: step aside at every compiled call (a guard reads a patched attribute); else only
        #: from dynamo's first callback (a frame to compile) to the end of the outermost call
        self.sticky = False
        self._aside: tuple[Any, bool] | None = None  # (hidden hooks, patches removed)
        self._callbacks: dict[int, tuple[Any, Any]] = {}
        self._names: Any = None
        self._code_graphs: dict[Any, Any] = {}
        self._cls: Any = None
        self._prop: Any = None
        self._prev_cfs: Any = None
        self._cfs: Any = None  # the _callback_from_stance installed (C or Python)
        self._cfs_native: Any = None  # the observer whose cfs is installed
        self._codes: list[Any] | None = None  # the open call's graph codes
        self._prev_user_fn: Any = None
        self._user_fn: Any = None  # the _get_user_fn installed (C or Python)

    # -- install / remove ---------------------------------------------------------------------
    def engage(self, modes: Sequence[Any], handles: Sequence[Any]) -> bool:
        """Install the hook while copytrace's modes are on.

        Args:
            modes: copytrace's function mode and, at level ``full``, its dispatch mode.
            handles: copytrace's global optimizer hook handles.

        Returns:
            False when this torch has no suitable hook point (nothing installed).
        """
        cls = _hookable()
        if cls is None:
            return False
        from torch._dynamo import eval_frame

        _skip_dynamo()
        self._modes = (modes[0] if modes else None, modes[1] if len(modes) > 1 else None)
        self._handles = list(handles)
        self._hook_entries = [(d, h.id) for h in self._handles for d in hook_dicts(h)]
        _skip_patch_codes(d[key] for d, key in self._hook_entries if key in d)
        self._names = _patched_names()
        self.sticky = self.sticky or self._any_cached_sensitive()
        self.thread = threading.get_ident()
        self._cls = cls
        self._prop = property(_hooks_get, _hooks_set, _hooks_del)
        setattr(cls, _HOOKS_ATTR, self._prop)
        self.engaged = True  # from here on, disengage() undoes whatever was installed
        self._prev_cfs = eval_frame._callback_from_stance
        native = self.rec.native
        if native is not None:  # compiled.cpp's hooks: no Python frame per call or graph run
            native.cfs_install(self._prev_cfs, self, self._wrapped)
            native.cc_install(
                self, self.rec, self._raw, self._code_graphs, self.graph_runs, torch.nn.Module,
                self.handler.graphs, _nothing,
            )  # fmt: skip
            _ENTER[0] = native.compiled_enter
            self._cfs_native = native
            self._cfs = native.callback_from_stance
        else:
            self._cfs = self._make_cfs(self._prev_cfs)
        eval_frame._callback_from_stance = self._cfs
        from torch.autograd.function import BackwardCFunction

        if "_get_user_fn" in BackwardCFunction.__dict__:
            self._prev_user_fn = BackwardCFunction.__dict__["_get_user_fn"]
            if native is not None:  # compiled.cpp's: no Python frame per custom backward
                self._user_fn = native.user_fn_install(
                    self._prev_user_fn, functools.partial, native.compiled_backward
                )
            else:
                self._user_fn = self._make_user_fn(self._prev_user_fn)
            BackwardCFunction._get_user_fn = self._user_fn
        if not self._logging:
            from torch._logging._internal import trace_log

            trace_log.addHandler(self.handler)
            self._logging = True
        _STATE[0] = self
        return True

    def disengage(self) -> None:
        """Remove the hook (the graph log stays until :meth:`close`)."""
        if not self.engaged:
            return
        self.engaged = False
        if _STATE[0] is self:
            _STATE[0] = None
        self._callbacks.clear()
        try:
            if self._cls is not None and self._cls.__dict__.get(_HOOKS_ATTR) is self._prop:
                delattr(self._cls, _HOOKS_ATTR)
            from torch._dynamo import eval_frame

            if eval_frame._callback_from_stance is self._cfs:
                eval_frame._callback_from_stance = self._prev_cfs
            self._cfs = None
            native = self._cfs_native
            if native is not None:
                self._cfs_native = None
                _ENTER[0] = _enter
                native.cfs_install(None, None, None)
                if native.cc_install(None, None, None, None, None, None, None, None):
                    self.depth = 0  # tracing stopped inside a call compiled.cpp entered
                    self.rec.compiled_depth = 0
            from torch.autograd.function import BackwardCFunction

            if BackwardCFunction.__dict__.get("_get_user_fn") is self._user_fn is not None:
                BackwardCFunction._get_user_fn = self._prev_user_fn
            self._user_fn = None
            if native is not None:
                native.user_fn_install(None, None, None)
        except Exception as err:
            self.rec.note_error(err)

    def close(self) -> None:
        """Remove everything; the recorded calls and graphs stay readable."""
        self.disengage()
        if self._logging:
            from torch._logging._internal import trace_log

            trace_log.removeHandler(self.handler)
            self._logging = False
        self._code_graphs.clear()

    def _make_cfs(self, orig: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def _callback_from_stance(callback: Any) -> Any:
            # Called with None by the torch._dynamo.disable wrapper of every compiled graph,
            # with the context's callback by compile_wrapper as it starts a compiled call.
            if callback is None:
                codes = self._codes
                if codes is not None and _get_ident() == self.thread:
                    # the graph's dynamo-generated code: its graph id is found at the call's end
                    codes.append(_getframe(2).f_code)
                return orig(callback)
            out = orig(callback)
            if out is None or out is False or not self.depth or self.sticky:
                return out
            if _get_ident() != self.thread:
                return out
            return self._wrapped(out)

        _callback_from_stance._copytrace = True  # type: ignore[attr-defined]
        return _callback_from_stance

    def _make_user_fn(self, orig: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def _get_user_fn(node: Any) -> Any:
            fn = orig(node)
            if self.engaged and type(node).__name__ == "CompiledFunctionBackward":
                native = self._cfs_native  # compiled.cpp's compiled_backward, where built
                run = native.compiled_backward if native is not None else self._run_backward
                return functools.partial(run, fn)
            return fn

        _get_user_fn._copytrace = True  # type: ignore[attr-defined]
        return _get_user_fn

    def _run_backward(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a compiled graph's backward with copytrace's modes off this thread's stacks."""
        fmode, dmode = self._modes
        lifted: tuple[Any, Any, Any] = (None, None, fmode)
        on_thread = _get_ident() == self.thread
        rec = self.rec
        try:
            if (fmode is not None and _function_stack_len()) or (
                dmode is not None and _dispatch_stack_len()
            ):
                lifted = self._suspend()
            if on_thread:
                self.depth += 1
                rec.compiled_depth = self.depth
                _suppress(rec, True)
        except Exception as err:
            rec.note_error(err)
        try:
            return fn(*args)
        finally:
            try:
                if on_thread:
                    self.depth = max(0, self.depth - 1)
                    rec.compiled_depth = self.depth
                    _suppress(rec, False)
                self._resume(lifted)
            except Exception as err:
                self.rec.note_error(err)

    # -- a compiled call ----------------------------------------------------------------------
    def enter(self) -> Callable[[], None]:
        if not self.engaged or _get_ident() != self.thread:
            return _nothing
        depth = self.depth = self.depth + 1
        rec = self.rec
        rec.compiled_depth = depth
        if depth > 1:
            return self._leave_nested
        _suppress(rec, True)
        start = _perf_ns()
        try:
            fmode, dmode = self._modes
            if (fmode is not None and _function_stack_len()) or (
                dmode is not None and _dispatch_stack_len()
            ):
                self._saved = self._suspend()
            if self.sticky:
                self._step_aside()
        except Exception as err:
            rec.note_error(err)
        src = None
        try:
            src = self._wrapper_source(_getframe(2), rec.native)
        except Exception as err:
            rec.note_error(err)
        self._call = (start, rec.step_index, src, len(self.handler.graphs))
        codes = self._codes = []
        if self._cfs_native is not None:
            self._cfs_native.cfs_begin(codes)
        return self._leave

    def _leave_nested(self) -> None:
        self.depth = max(0, self.depth - 1)
        self.rec.compiled_depth = self.depth

    def _leave(self) -> None:
        end = _perf_ns()
        call, self._call = self._call, None
        codes, self._codes = self._codes, None
        if self._cfs_native is not None:
            self._cfs_native.cfs_begin(None)
        depth = self.depth = max(0, self.depth - 1)
        rec = self.rec
        rec.compiled_depth = depth
        _suppress(rec, False)
        saved, self._saved = self._saved, None
        if saved is not None or self._aside is not None:
            try:
                if self._aside is not None:
                    self._step_back()
                if saved is not None:
                    self._resume(saved)
            except Exception as err:
                rec.note_error(err)
        if call is None:
            return
        try:
            start, step, src, base = call
            graphs = self.handler.graphs
            ids = self._graph_ids(codes) if codes else []
            copies = nbytes = unknown = 0
            for gid in ids:
                info = graphs.get(gid)
                if info is None:
                    unknown += 1
                else:
                    copies += len(info.copies)
                    nbytes += info.copy_bytes
            self._raw.append((start, end, step, src, ids, len(graphs) - base, copies, nbytes, unknown))
        except Exception as err:
            rec.note_error(err)


_SKIPPED = [False]


def _skip_dynamo() -> None:
    """Tell dynamo to skip copytrace's hook code (and what it calls): a frame of it evaluated
    under a compiled region's callback (the setter runs when torch creates a context inside
    one) would otherwise be counted, and perhaps compiled, as the program's own frame."""
    if _SKIPPED[0]:
        return
    _SKIPPED[0] = True
    codes = [_enter.__code__, _hooks_get.__code__, _hooks_set.__code__, _hooks_del.__code__]
    codes += [f.__code__ for f in vars(_WithHook).values() if hasattr(f, "__code__")]
    for cls in Compiled.__mro__[:-1]:  # its mixins' methods too
        codes += [f.__code__ for f in vars(cls).values() if hasattr(f, "__code__")]
    for code in list(codes):
        codes.extend(c for c in code.co_consts if hasattr(c, "co_code"))
    skip_codes(codes, recursive=True)

