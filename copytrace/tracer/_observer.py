"""Engage the C++ observer (``copytrace/tracer/_native``) for a :class:`Recorder`.

Two parts, both in C, both optional:

* :class:`NativeFunctionMode`, the API level: a ``TorchFunctionMode`` whose
  ``__torch_function__`` is the extension's C handler. A call not in the recorder's API table
  costs one dict lookup and runs from C, so warnings torch raises keep the caller's frame; a
  copy or alias call is recorded by :meth:`Recorder.api_before`/:meth:`Recorder.api_after`.
* The aten level (``level="full"``): boxed kernels on the BackendSelect key for the copy and
  alias ops of :func:`copytrace.tracer._rules.aten_table` (``_to_copy``'s on the backend keys
  where torch has no kernel of its own: no registration overrides torch's). They fold the aten ops an API
  call ran into its event, count autograd's own detaches, and hand implicit copies to
  :func:`_implicit`.

At level ``lean`` there is no function mode: :func:`install_wrappers` hot-patches torch's own C
function pointers behind the API table's callables (``Tensor.clone``, ``torch.clone``,
``Tensor.to``..., and ``Tensor.data``'s get and set) so that each call is recorded by a C
function of the extension as the mode's handler would record it; the few with no C pointer
(``Tensor.__deepcopy__``, ``Tensor.backward``, ``Tensor.__getitem__``) are replaced as
attributes by C wrappers. Every other torch call runs untouched. The in-place writes the
``data-inplace`` and ``lost-inplace-write`` hazards need are seen by the C++ write watch
(``_native/watch_cb.cpp``: a RecordFunction callback registered only while a ``.data`` alias
or an index result lives), so nothing joins torch's mode stacks.

Where the extension cannot be had, :mod:`copytrace.tracer._recorder`'s Python modes do the
same work (see :func:`copytrace.tracer._native.load`).
"""

from __future__ import annotations

import atexit
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from copytrace.tracer import _patches, _recorder, _rules, _warnshim
from copytrace.tracer._storage_ref import StorageRef
from copytrace.tracer.watch._retained import _Attached

__all__ = ["NativeFunctionMode", "engage", "disengage", "aten_ops", "install_wrappers"]

_perf_ns = _recorder._perf_ns
_graph_task_id = torch._C._current_graph_task_id
_current_node = torch._C._current_autograd_node


class NativeFunctionMode(TorchFunctionMode):
    """copytrace's API-level mode with its handler in C (``_native/api_mode.cpp``)."""

    def __init__(self, native: Any) -> None:
        super().__init__()
        # An instance attribute wins over the class's method: torch looks the handler up on
        # the mode object (python_arg_parser.cpp, dispatch_on_mode).
        # torch also requires the handler's __self__ to be the mode object.
        self.__torch_function__ = native.bind_torch_function(self)  # type: ignore[method-assign]


def aten_ops() -> list[tuple[str, str, int, str]]:
    """``(qualified name, overload, kind, display name)`` of every aten copy and alias op
    overload the observer registers a kernel for."""
    ops = []
    for op, kind in _rules.aten_table().items():
        schema = op._schema
        name, overload = str(schema.name), schema.overload_name
        full = f"{name}.{overload}" if overload else name
        try:
            if not torch._C._dispatch_has_kernel_for_dispatch_key(full, "CompositeImplicitAutograd"):
                ops.append((name, overload, kind, _rules.aten_name(op)))
        except RuntimeError:  # a TorchScript-only overload (aten::copy.Dict_str ...)
            continue
    return ops


def _implicit(name: str, kind: int, args: tuple, kwargs: dict, out: Any, start: int, end: int):
    """The observer's callback for an implicit copy (with the GIL, torch function off)."""
    rec = _patches._ACTIVE
    if rec is None:
        return
    if threading.get_ident() != _patches._THREAD and _graph_task_id() < 0:
        return
    if rec.compiled_depth:
        return  # inside a compiled region: its copies are listed from its graph instead
    node = _current_node()
    if node is not None and type(node).__name__ == "CompiledFunctionBackward":
        return
    try:
        rec.implicit(name, kind, args, kwargs, out, start, end)
    except Exception as err:
        rec.note_error(err)
    rec.overhead_ns += _perf_ns() - end


_OPS: list[tuple[str, str, int, str]] | None = None


def engage(rec: Any, native: Any, full: bool) -> NativeFunctionMode:
    """Connect ``native`` to ``rec`` and return the (not yet entered) function mode."""
    global _OPS
    rec.native = native
    rec.modules.module_calls = native.module_calls  # the module calls on the stack, in C
    watch = rec.watch
    native.set_api_hooks(rec.api_table, rec.api_before, rec.api_after, watch.before_api)
    fast = frozenset(op for op in rec.api_table.values()) - _rules.BEFORE_OPS
    native.set_fast_api(fast, (torch.Tensor, torch.nn.Parameter), rec.api_fast)
    native.set_fast_events(rec, watch.copies, rec.api_tail, fast - _rules.NOT_C_EVENT_OPS)
    native.set_watch_writes(bool(watch.aliases))
    native.set_record_rules(_rules.RULES)  # record.cpp's record reads the rules as data
    _warnshim.install(native)
    copies = watch.copies  # in-place writes into fresh copies (_fresh.py)
    copies.version_of, copies.version_final = native.version_of, native.version_final
    copies.version_delta, copies.kept_pair = native.version_delta, native.kept_pair
    copies.nodes = (native.grad_fn_ref, native.grad_fn_of, native.grad_fn_alive)
    # an attached copy's tag and entry made in C (attached.cpp): the classes Python makes them of
    native.set_attached(_Attached, StorageRef, torch.UntypedStorage._free_weak_ref,
                        native.storage_owners)  # fmt: skip
    native.set_copy_hooks(copies.fresh, copies.written, copies.call, torch.Tensor.__getitem__)
    if full:
        if _OPS is None:
            _OPS = aten_ops()
        native.internal_detaches()  # reset
        native.install(_OPS, _implicit)
        native.set_owner(True)
        native.set_enabled(True)
    return NativeFunctionMode(native)


def disengage(rec: Any) -> None:
    """Disconnect the observer from ``rec``: deregister the kernels, clear the hooks, and add
    the counts kept in C (autograd's detaches, errors) to the recorder's."""
    native = rec.native
    if native is None:
        return
    _warnshim.remove()
    native.set_enabled(False)
    native.set_owner(False)
    native.set_watch_writes(False)
    native.set_api_hooks(None, None, None, None)
    native.set_fast_api(None, None, None)
    native.set_fast_events(None, None, None, None)
    native.set_attached(None, None, None, None)
    native.set_copy_hooks(None, None, None, None)
    rec.internal_detaches += native.internal_detaches()
    errors = native.errors()
    if errors:
        rec.errors += errors
        rec.last_error = rec.last_error or "error in the C++ observer's callback"
        rec.first_error = rec.first_error or "error in the C++ observer's callback (no traceback)"
    native.uninstall()
    rec.native = None
    rec.modules.module_calls = None


# --- level "lean": the API table's callables wrapped in C --------------------------------------
_DUNDERS = frozenset(("__getitem__", "__deepcopy__"))
_PATCHES: tuple[Any, list[tuple[Any, str, Any, Any]]] | None = None


def _api_callables(table: dict[Any, str]) -> list[tuple[Any, str, Any]]:
    """``(owner, attribute, callable)`` of every public attribute of ``torch.Tensor`` and
    ``torch`` whose value is in the API table (``data``: the descriptor itself).

    ``torch.clone`` and the other functions of ``torch`` are safe to replace: torch hands a
    mode ``torch._C._VariableFunctions``' own callable, never the module attribute."""
    import warnings

    found = []
    # not torch.autograd.backward/grad: a mode would receive the replacement as `func` (they
    # pass themselves, read from their module, to handle_torch_function)
    owners = (torch.Tensor, torch)
    from copytrace._warnstate import frozen_warnings

    # deprecated torch attributes warn when read; frozen: no filters-version bump
    with frozen_warnings(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for owner in owners:
            for name in dir(owner):
                if name.startswith("__") and name not in _DUNDERS:
                    continue
                try:
                    value = getattr(owner, name)
                    if owner is torch.Tensor and name == "data":
                        found.append((owner, name, value))
                    elif value in table and callable(value):
                        found.append((owner, name, value))
                except Exception:  # an unhashable or unreadable attribute
                    continue
    return found


def _hot_keys(table: dict[Any, str]) -> list[Any]:
    """The API table's callables implemented in C (Tensor methods, functions of ``torch``):
    candidates for :func:`install_wrappers`' hot patch."""
    kinds = (type(torch._C.TensorBase.clone), type(torch.clone))  # method_descriptor, builtin
    return [fn for fn in table if type(fn) in kinds]


def install_wrappers(rec: Any, native: Any) -> int:
    """Level ``lean``: have copytrace's C code record the API table's callables and
    ``Tensor.data``. Where torch implements them in C, by hot-patching torch's own function
    pointers (``hot_install``, ``_native/hotpatch.cpp``: the objects stay torch's, and a method
    bound or a function imported before tracing is recorded too); the Python-level callables
    (``Tensor.__deepcopy__``, ``Tensor.backward``) and the slot wrapper ``Tensor.__getitem__``
    (what ``x[i]`` reaches through the type slot) by C wrappers put in place of the attributes,
    installed and removed with copytrace's other patches (``_recorder.install_patches``).
    Returns how many callables are recorded this way."""
    global _PATCHES
    data = torch._C.TensorBase.__dict__["data"]
    keys = _hot_keys(rec.api_table)
    try:
        done = native.hot_install(keys, data, data.__get__, data.__set__)
    except Exception:
        native.hot_restore()  # hot_install stores nothing before every check passed
        raise
    hot = {id(fn) for fn, ok in zip(keys, done, strict=False) if ok}
    if _PATCHES is None or _PATCHES[0] != (hot, done[-1]):
        patches = []
        for owner, name, value in _api_callables(rec.api_table):
            if owner is torch.Tensor and name == "data":
                if done[-1]:
                    continue  # hot-patched
                new = native.data_descriptor(data, data.__get__, data.__set__)
            elif id(value) in hot:
                continue
            else:
                new = native.wrap_api(name, value, owner is torch.Tensor)
            patches.append((owner, name, owner.__dict__.get(name, _recorder.MISSING), new))
        _PATCHES = ((hot, done[-1]), patches)
    _recorder.EXTRA_PATCHES[:] = _PATCHES[1]
    # no mode: writes into `.data` aliases and index results are seen by the C++ write watch
    rec.lean = True
    rec.watch.copies.lean = (native.watch_tensor, native.unwatch)
    native.set_watch_hook(rec.watch.watched_op)
    native.set_quiet_codes(_quiet_codes())
    native.set_wrappers(True)
    return len(hot) + int(done[-1]) + len(_PATCHES[1])


@atexit.register
def _restore_at_exit() -> None:
    """Put torch's pointers back if tracing is still on when the interpreter exits
    (registered at import, so it runs after the handlers registered later: LIFO)."""
    from copytrace.tracer import _native

    native = _native._state.get("module")
    if native is not None and hasattr(native, "hot_restore"):
        native.hot_restore()
    if native is not None and hasattr(native, "legacy_restore"):
        from copytrace.tracer import _legacy

        _legacy.remove_native(native)


_QUIET: set[Any] | None = None


#: torch's Python kernels, run by the dispatcher below the level a mode sees: decompositions,
#: references, prims and meta functions (``torch/_decomp/decompositions.py``'s ``uniform_``
#: writes ``self.copy_(...)`` for a meta tensor). Only modules already imported are read.
KERNEL_MODULES = (
    "torch._decomp", "torch._decomp.decompositions", "torch._refs", "torch._refs.nn.functional",
    "torch._prims", "torch._prims_common", "torch._prims_common.wrappers",
    "torch._meta_registrations",
)  # fmt: skip


def _kernel_codes() -> set[Any]:
    """Code objects of the functions of :data:`KERNEL_MODULES` (and of the functions they
    wrap): a copy made in one of them is a kernel's, not the user's (a dispatch mode sees the
    op that ran the kernel, never the calls inside it)."""
    import os
    import sys

    root = os.path.dirname(torch.__file__)
    # their own files only: a module's namespace also holds what it imported
    own = tuple(
        os.path.join(root, *name.split(".")[1:]) for name in KERNEL_MODULES if "." in name
    )
    codes: set[Any] = set()
    for name in KERNEL_MODULES:
        module = sys.modules.get(name)
        if module is None:
            continue
        for value in list(vars(module).values()):
            for _ in range(8):  # a decorator's chain of __wrapped__
                code = getattr(value, "__code__", None)
                if code is not None and code.co_filename.startswith(own):
                    codes.add(code)
                value = getattr(value, "__wrapped__", None)
                if value is None:
                    break
    return codes


def _quiet_codes() -> set[Any]:
    """Code objects of torch's Python-level functions that dispatch through
    ``handle_torch_function`` (``torch.overrides.get_overridable_functions()``): a function
    mode sees each call of one as one call and none of the torch calls inside it (torch runs
    the mode's handler with the mode off its stack), so the wrappers record nothing inside
    them either (their aten copies are implicit copies, as at level ``full``); and those of
    torch's Python kernels (:func:`_kernel_codes`), whose calls no mode sees at all."""
    global _QUIET
    if _QUIET is None:
        from torch.overrides import get_overridable_functions

        codes = set()
        for functions in get_overridable_functions().values():
            for fn in functions:
                code = getattr(getattr(fn, "__func__", fn), "__code__", None)
                if code is not None:
                    codes.add(code)
        codes |= _kernel_codes()
        _QUIET = codes
    return _QUIET


def remove_wrappers(rec: Any, native: Any) -> None:
    """Undo :func:`install_wrappers` (the patches themselves go with ``remove_patches``)."""
    if rec.lean:
        native.set_watch_hook(None)  # unwatches every key; the callback goes on this thread
        rec.watch.copies.lean = None
        rec.lean = False
    native.set_wrappers(False)
    native.hot_restore()
    native.set_quiet_codes(None)
    _recorder.remove_patches()
    _recorder.EXTRA_PATCHES.clear()
