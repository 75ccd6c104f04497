"""Compiled regions: ``torch.compile``d code runs compiled while tracing, and shows as such.

Every call of a ``torch.compile``d function or module goes through dynamo's
``compile_wrapper`` (``torch/_dynamo/eval_frame.py``), which calls the ``enter_exit_hooks`` of
its ``_TorchDynamoContext`` before it sets the frame-evaluation callback (so before any guard
is checked or any frame compiled) and their cleanups in a ``finally``. While tracing,
copytrace puts a data descriptor for ``enter_exit_hooks`` on that class (it wins over the
instance attribute, so it also covers callables compiled before tracing started) whose value
is the context's own hooks plus copytrace's. On the traced thread, copytrace's hook takes
everything of copytrace that dynamo could see out of the way for the duration of the call:

* its TorchFunctionMode and TorchDispatchMode, wherever they are on torch's mode stacks (the
  modes above them are popped and pushed back; a user's own modes stay where they were);
* its global optimizer step hooks (dynamo would inline them) and its patches of
  ``copy.deepcopy``, ``copy.copy``, ``torch.from_numpy``, ``torch.utils.swap_tensors``,
  ``nn.Parameter.__deepcopy__``, the ``state_dict``/``load_state_dict`` wrappers and level
  ``lean``'s wrappers of ``torch`` functions. Swapping these at every call is costly (each
  ``setattr`` on a class invalidates the type caches of all its subclasses), and dynamo only
  looks at them when it traces a frame (a cache miss: it calls the callback that copytrace
  wraps, see ``Compiled._wrapped``) or evaluates guards that read them. So they stay in place
  and stand aside by themselves while ``Recorder.compiled_depth`` is set (dynamo skips their
  own frames), and are taken away from dynamo's first callback to the end of the outermost
  call. Once a compiled frame's guards read one of them (``Compiled._sensitive``, also run at
  engage over frames compiled before tracing started), they are taken away at every call
  (``Compiled.sticky``), as the guards would otherwise fail.

The cleanup puts everything back exactly as it was. So dynamo compiles the same graphs with
the same guards, and compiled code runs compiled. The backward of a compiled graph (autograd
node ``CompiledFunctionBackward``) runs with copytrace's modes off the stacks too (copytrace
wraps ``torch.autograd.function.BackwardCFunction._get_user_fn`` while tracing); on the C++
observer's path, ``Recorder.compiled_depth`` (or :func:`suspended`) tells the observer to stand
aside. copytrace has no ``nn.Module`` hooks (see :mod:`copytrace.tracer._modules`), so
``OptimizedModule.__call__`` finds none of copytrace's to warn about.

What runs inside a compiled region is not traced op by op. Instead each outermost call
becomes a :class:`CompiledCall` (a ``copytrace.compiled`` span) with the graphs it ran: a
compiled graph is called through a ``torch._dynamo.disable`` wrapper, which asks
``eval_frame._callback_from_stance`` for the callback to restore; copytrace wraps that function
to note which dynamo-generated code called it (its compile id, from dynamo's cache entries).
The copies each graph contains come from torch's structured compile log
(:mod:`copytrace.tracer._graphs`).

Where the C++ observer is built, the per-call parts are its C functions (``observer.cpp``:
``compiled_enter``/``compiled_leave``, ``callback_from_stance``, the ``_get_user_fn`` instance
method and ``compiled_backward``), so that a compiled call adds no Python frame of copytrace's
in the common case (the traced thread, not nested, no mode on torch's stacks, not ``sticky``);
every other call goes to :meth:`Compiled.enter`. Both record an ended call as the same tuple
in ``Compiled._raw``, made a :class:`CompiledCall` when the calls are read.

Any error here is counted on the recorder (``note_error``), never raised.
"""

from __future__ import annotations

import functools
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from types import MethodType
from typing import Any

import torch

from copytrace.tracer import _handover, _recorder
from copytrace.tracer._graphs import CompiledCall, CompiledGraphSpan, GraphLogHandler
from copytrace.tracer._stepaside import (
    DISPATCH_STACK,
    FUNCTION_STACK,
    hide_hooks,
    hook_dicts,
    lift,
    lower,
    show_hooks,
)

__all__ = ["Compiled", "CompiledCall", "CompiledGraphSpan", "suspended"]

_perf_ns = time.perf_counter_ns
_get_ident = threading.get_ident
_getframe = sys._getframe
_function_stack_len = FUNCTION_STACK[0]
_dispatch_stack_len = DISPATCH_STACK[0]
_HOOKS_ATTR = "enter_exit_hooks"
_MISSING = object()
_MAX_CALLS = 1_000_000  # calls buffered between two flushes; beyond it they are counted only
_MAX_CALLBACKS = 64  # dynamo callbacks kept with their wrapper


def _nothing() -> None:
    return None


# --- the hook on _TorchDynamoContext ----------------------------------------------------------
_STATE: list[Compiled | None] = [None]
_ENTER: list[Callable[[], Callable[[], None]]] = []  # the hook: observer.cpp's, or _enter


def _suppress(rec: Any, on: bool) -> None:
    """Have the C++ observer's kernels (thread-local) ignore a compiled region's aten ops,
    compile-time and run-time, without a call into Python for each."""
    native = rec.native
    if native is not None:
        if on:
            native.suppress()
        else:
            native.unsuppress()


def _enter() -> Callable[[], None]:
    """copytrace's enter hook: runs at every call of a compiled callable."""
    state = _STATE[0]
    if state is None:
        return _nothing
    return state.enter()


_ENTER.append(_enter)


class _WithHook:
    """A context's own ``enter_exit_hooks`` list, iterated with copytrace's hook at the end;
    everything else (``append`` in ``__init__``...) goes to the context's own list."""

    __slots__ = ("own",)

    def __init__(self, own: list[Any]) -> None:
        self.own = own

    def __iter__(self) -> Any:
        return iter([*self.own, _ENTER[0]])

    def __len__(self) -> int:
        return len(self.own) + 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.own, name)


def _hooks_get(obj: Any) -> Any:
    try:
        own = obj.__dict__[_HOOKS_ATTR]
    except KeyError:
        raise AttributeError(_HOOKS_ATTR) from None
    if obj.__dict__.get("callback") is None:  # torch.compiler.disable: nothing compiled
        return own
    return _WithHook(own)


def _hooks_set(obj: Any, value: Any) -> None:
    obj.__dict__[_HOOKS_ATTR] = value


def _hooks_del(obj: Any) -> None:
    del obj.__dict__[_HOOKS_ATTR]


def _hookable() -> Any:
    """dynamo's ``_TorchDynamoContext`` when its ``compile_wrapper`` runs ``enter_exit_hooks``
    the way this module relies on, else ``None`` (other torch versions)."""
    try:
        from torch._dynamo import eval_frame
    except Exception:
        return None
    cls = getattr(eval_frame, "_TorchDynamoContext", None)
    if cls is None or _HOOKS_ATTR in cls.__dict__:
        return None
    init_names = cls.__init__.__code__.co_names
    wrapper = [
        c for c in cls.__call__.__code__.co_consts
        if getattr(c, "co_name", None) == "compile_wrapper"
    ]  # fmt: skip
    if _HOOKS_ATTR not in init_names or not wrapper:
        return None
    if _HOOKS_ATTR not in _all_names(wrapper[0]):
        return None
    if not callable(getattr(eval_frame, "_callback_from_stance", None)):
        return None
    return cls


def _all_names(code: Any) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _all_names(const)
    return names


def _source_of(fn: Any) -> tuple[str, int, str] | None:
    """File, first line and name of the function a compiled callable compiles."""
    for _ in range(8):
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, torch.nn.Module) and getattr(fn, "__name__", "") in (
            "__call__", "_call_impl", "_wrapped_call_impl",
        ):  # fmt: skip
            fn = type(owner).forward
            continue
        if isinstance(fn, torch.nn.Module):
            fn = type(fn).forward
            continue
        wrapped = getattr(fn, "__wrapped__", None)
        if wrapped is None:
            break
        fn = wrapped
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    return code.co_filename, code.co_firstlineno, code.co_name


def _compile_id(code: Any) -> str | None:
    """Compile id of the graph whose dynamo-generated code is ``code`` (``None``: not one)."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import orig_code_map

    orig = orig_code_map.get(code)
    if orig is None:
        return None
    for entry in _debug_get_cache_entry_list(orig):
        if entry.code is code:
            return str(entry.compile_id)
    return None


def suspended() -> bool:
    """True while the traced thread runs compiled code (copytrace's observers stand aside)."""
    state = _STATE[0]
    return state is not None and state.depth > 0 and threading.get_ident() == state.thread


class Compiled:
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
        #: _leave or by observer.cpp's cc_leave (the same list object for the whole trace)
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
        self._checked: Any = weakref.WeakSet()
        self._code_graphs: dict[Any, Any] = {}
        self._sources: dict[int, tuple[Any, Any]] = {}
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
        names = _patched_names()
        if self._names is None or names.pattern != self._names.pattern:
            self._checked = weakref.WeakSet()  # checked against other names
        self._names = names
        self.sticky = self.sticky or self._any_cached_sensitive()
        self.thread = threading.get_ident()
        self._cls = cls
        self._prop = property(_hooks_get, _hooks_set, _hooks_del)
        setattr(cls, _HOOKS_ATTR, self._prop)
        self.engaged = True  # from here on, disengage() undoes whatever was installed
        self._prev_cfs = eval_frame._callback_from_stance
        native = self.rec.native
        if native is not None:  # observer.cpp's hooks: no Python frame per call or graph run
            native.cfs_install(self._prev_cfs, self, self._wrapped)
            native.cc_install(
                self, self.rec, self._raw, self._code_graphs, self.graph_runs, self._sources,
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
            if native is not None:  # observer.cpp's: no Python frame per custom backward
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
                    self.depth = 0  # tracing stopped inside a call observer.cpp entered
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
        self._sources.clear()

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
                native = self._cfs_native  # observer.cpp's compiled_backward, where built
                run = native.compiled_backward if native is not None else self._run_backward
                return functools.partial(run, fn)
            return fn

        _get_user_fn._copytrace = True  # type: ignore[attr-defined]
        return _get_user_fn

    def _run_backward(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a compiled graph's backward with copytrace's modes off this thread's stacks."""
        fmode, dmode = self._modes
        lifted: tuple[Any, Any] = (None, None)
        on_thread = _get_ident() == self.thread
        rec = self.rec
        try:
            if (fmode is not None and _function_stack_len()) or (
                dmode is not None and _dispatch_stack_len()
            ):
                lifted = (
                    lift(*FUNCTION_STACK, fmode) if fmode is not None else None,
                    lift(*DISPATCH_STACK, dmode) if dmode is not None else None,
                )
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
                if lifted[1] is not None:
                    length, _, pop, push = DISPATCH_STACK
                    lower(length, pop, push, dmode, lifted[1])
                if lifted[0] is not None:
                    length, _, pop, push = FUNCTION_STACK
                    lower(length, pop, push, fmode, lifted[0])
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

    def _wrapper_source(self, frame: Any, native: Any) -> tuple[str, int, str] | None:
        """:func:`_source_of` the callable that torch.compile's ``compile_wrapper`` (``frame``
        or one of the next frames out) wraps, cached per callable (checked by weak reference).
        The wrapper's ``fn`` is read with the observer's ``frame_var`` (no f_locals dict)."""
        for _ in range(4):
            if frame is None or frame.f_code.co_name == "compile_wrapper":
                break
            frame = frame.f_back
        if frame is None:
            return None
        fn = None
        if native is not None:
            try:
                fn = native.frame_var(frame, "fn")
            except NameError:
                return None
        if fn is None:
            fn = frame.f_locals.get("fn")
        return self._source_for(fn)

    def _source_for(self, fn: Any) -> tuple[str, int, str] | None:
        """:func:`_source_of`, cached per callable (checked by weak reference; observer.cpp's
        cc_enter reads the same cache)."""
        hit = self._sources.get(id(fn))
        target = fn.__self__ if type(fn) is MethodType else fn
        if hit is not None and hit[0]() is target:
            return hit[1]
        src = _source_of(fn)
        try:
            self._sources[id(fn)] = (weakref.ref(target), src)
        except TypeError:  # not weakly referenceable: not cached
            pass
        return src

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

    def resolve(self, codes: list[Any]) -> None:
        """Find the graph ids of codes not seen before (observer.cpp's cc_leave calls this for
        a call that ran one; it reads ``_code_graphs`` for the rest)."""
        known = self._code_graphs
        for code in codes:
            if code not in known:
                # None (cached too): a disabled function called from code that is not a
                # dynamo graph's (dynamo installs a graph's cache entry before it first runs)
                known[code] = _compile_id(code)

    def _drain(self) -> None:
        """Make the ended calls CompiledCall objects, in their order."""
        raw = self._raw
        if not raw:
            return
        items = raw[:]
        del raw[:]  # the same list: observer.cpp appends to it
        for start, end, step, src, ids, new_graphs, copies, nbytes, unknown in items:
            self._calls_total += 1
            if len(self._calls) >= _MAX_CALLS:
                self.calls_dropped += 1
                continue
            call = CompiledCall(start, step)
            call.end_ns = end
            if src is not None:
                call.file, call.line, call.function = src
            call.graphs = ids
            call.new_graphs = new_graphs
            call.copies = copies
            call.copy_bytes = nbytes
            call.unknown_graphs = unknown
            self._calls.append(call)

    @property
    def calls(self) -> list[CompiledCall]:
        """The calls recorded (since the last :meth:`take_calls`)."""
        self._drain()
        return self._calls

    @property
    def calls_total(self) -> int:
        """Calls recorded since tracing started (kept or dropped)."""
        self._drain()
        return self._calls_total

    def _graph_ids(self, codes: list[Any]) -> list[str]:
        """The graph ids of the dynamo-generated codes whose graphs ran in a call (noted by the
        ``torch._dynamo.disable`` wrapper's callback), each run counted in ``graph_runs``."""
        ids = []
        self.resolve(codes)
        known = self._code_graphs
        runs = self.graph_runs
        for code in codes:
            gid = known[code]
            if gid is not None:
                ids.append(gid)
                runs[gid] = runs.get(gid, 0) + 1
        return ids

    def _suspend(self) -> tuple[Any, Any]:
        """Take copytrace's modes off torch's stacks (cheap C calls, at every compiled call)."""
        fmode, dmode = self._modes
        f_above = lift(*FUNCTION_STACK, fmode) if fmode is not None else None
        d_above = lift(*DISPATCH_STACK, dmode) if dmode is not None else None
        return f_above, d_above

    def _resume(self, saved: tuple[Any, Any]) -> None:
        f_above, d_above = saved
        fmode, dmode = self._modes
        if d_above is not None:
            length, _, pop, push = DISPATCH_STACK
            lower(length, pop, push, dmode, d_above)
        if f_above is not None:
            length, _, pop, push = FUNCTION_STACK
            lower(length, pop, push, fmode, f_above)

    # -- patches and hooks: off only while dynamo may look at them -----------------------------
    def _step_aside(self) -> None:
        """Take the optimizer step hooks and the module-level patches away until the outermost
        compiled call ends. Otherwise they stay in place during compiled calls and stand aside
        by themselves (``Recorder.compiled_depth``): dynamo sees them only when it evaluates
        guards (cached code) or traces a frame (a cache miss, which calls its callback first).
        A guard that reads one of them makes the swap happen at every call (``sticky``)."""
        if self._aside is not None:
            return
        hidden = hide_hooks(self._hook_entries)
        patched = copy_patched()
        if patched:
            _recorder.remove_patches(stepping_aside=True)
        self._aside = (hidden, patched)

    def _step_back(self) -> None:
        hidden, patched = self._aside
        self._aside = None
        if not self.engaged:  # the trace ended inside the compiled call
            return
        if patched:
            _recorder.install_patches(stepping_aside=True)
        show_hooks(hidden)

    def _wrapped(self, callback: Any) -> Any:
        """``callback`` (dynamo's frame callback) stepping aside before dynamo looks at a frame
        (one made per callback and kept: dynamo's cache lookup unwraps it through
        ``_torchdynamo_orig_backend``, as for torch's own stance wrappers)."""
        hit = self._callbacks.get(id(callback))
        if hit is not None and hit[0] is callback:
            return hit[1]

        def _copytrace_callback(*args: Any, **kwargs: Any) -> Any:
            if self.engaged and self.depth and threading.get_ident() == self.thread:
                try:
                    self._step_aside()
                except Exception as err:
                    self.rec.note_error(err)
            result = callback(*args, **kwargs)
            try:
                code = getattr(result, "guarded_code", None)
                if code is not None and not self.sticky:
                    self.sticky = self._sensitive(code.guard_manager)
            except Exception as err:
                self.rec.note_error(err)
                self.sticky = True
            return result

        _copytrace_callback._torchdynamo_orig_backend = callback  # type: ignore[attr-defined]
        _skip_codes([_copytrace_callback.__code__], recursive=True)
        if len(self._callbacks) >= _MAX_CALLBACKS:  # many torch.compile calls: keep none alive
            self._callbacks.clear()
        self._callbacks[id(callback)] = (callback, _copytrace_callback)
        return _copytrace_callback

    def _sensitive(self, guard_manager: Any) -> bool:
        """Whether a compiled frame's guards read an attribute copytrace patches (then they
        would fail with the patches in place: a recompile the untraced program never has)."""
        try:
            if guard_manager in self._checked:
                return False
        except TypeError:
            pass
        text = str(guard_manager)
        found = any(self._names.search(line.split("#", 1)[0]) for line in text.splitlines())
        if not found:
            try:
                self._checked.add(guard_manager)
            except TypeError:
                pass
        return found

    def _any_cached_sensitive(self) -> bool:
        """:meth:`_sensitive` over every frame compiled so far (at engage: code compiled before
        tracing started)."""
        try:
            from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
            from torch._dynamo.utils import orig_code_map

            codes = {id(c): c for c in list(orig_code_map.values.values())}
            for code in codes.values():
                for entry in _debug_get_cache_entry_list(code):
                    if self._sensitive(entry.guard_manager):
                        return True
        except Exception as err:
            self.rec.note_error(err)
            return True
        return False

    # -- export -------------------------------------------------------------------------------
    def take_calls(self) -> list[CompiledCall]:
        """The calls recorded since the last take (handed to the export)."""
        self._drain()
        calls, self._calls = self._calls, []
        return calls

    def discard_calls(self, keep: int) -> int:
        """Drop the calls recorded after the first ``keep`` (untraced steps); return how many."""
        self._drain()
        dropped = max(0, len(self._calls) - keep)
        if dropped:
            del self._calls[keep:]
            self._calls_total -= dropped
        return dropped

    def graph_spans(self) -> list[CompiledGraphSpan]:
        """One span per graph whose AOT graphs were logged while tracing."""
        self._drain()
        return [
            CompiledGraphSpan(info, self.graph_runs.get(gid, 0))
            for gid, info in self.handler.graphs.items()
            if info.kinds
        ]

    def run_attributes(self) -> dict[str, Any]:
        attrs: dict[str, Any] = {
            "copytrace.compiled_calls": self.calls_total,
            "copytrace.compiled_graphs": sum(1 for i in self.handler.graphs.values() if i.kinds),
        }
        if self.calls_dropped:
            attrs["copytrace.compiled_calls_dropped"] = self.calls_dropped
        return attrs


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
    codes += [f.__code__ for f in vars(Compiled).values() if hasattr(f, "__code__")]
    for code in list(codes):
        codes.extend(c for c in code.co_consts if hasattr(c, "co_code"))
    _skip_codes(codes, recursive=True)


def _skip_codes(codes: Any, recursive: bool) -> None:
    try:
        from torch._dynamo.eval_frame import (
            FrameAction,
            FrameExecStrategy,
            set_code_exec_strategy,
        )
    except Exception:
        return
    inner = FrameAction.SKIP if recursive else FrameAction.DEFAULT
    for code in codes:
        set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, inner))


def _skip_patch_codes(hooks: Any) -> None:
    """Have dynamo skip the frames of copytrace's patches and hooks themselves (they stand
    aside inside a compiled region), not those they call: inside a compiled region a patched
    ``copy.deepcopy`` shows dynamo the frames of the original, exactly as untraced."""
    codes = [_recorder._here.__code__]
    codes += [f.__code__ for f in _recorder.PATCH_FUNCTIONS]
    codes += _handover.wrapper_codes()
    for hook in hooks:
        code = getattr(getattr(hook, "__func__", hook), "__code__", None)
        if code is not None:
            codes.append(code)
    _skip_codes(codes, recursive=False)


_PATCHED_NAMES = (
    "deepcopy", "copy", "from_numpy", "swap_tensors", "__deepcopy__", "state_dict",
    "load_state_dict", "_global_optimizer_pre_hooks", "_global_optimizer_post_hooks",
)  # fmt: skip


def _patched_names() -> Any:
    """A pattern for a guard's source that reads one of the attributes copytrace patches
    (``G['copy'].deepcopy``, ``dict(...__dict__)['state_dict']``...)."""
    names = set(_PATCHED_NAMES)
    names.update(name for owner, name, _, _ in _recorder.EXTRA_PATCHES if owner is not torch.Tensor)
    alt = "|".join(re.escape(n) for n in sorted(names))
    return re.compile(rf"(?:\.(?:{alt})\b|\['(?:{alt})'\])")


def copy_patched() -> bool:
    """Whether copytrace's patches of ``copy``/``torch`` functions are installed now."""
    import copy

    return copy.deepcopy is _recorder._traced_deepcopy
