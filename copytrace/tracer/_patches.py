"""The running trace's recorder, and the patches installed while a trace is active.

Some copies reach neither torch mode as one call: ``copy.deepcopy`` of an object that holds
tensors (one group event over its tensor copies), ``copy.copy`` of a tensor (an alias through
``__reduce_ex__``), ``torch.from_numpy`` (only an ``aten::lift_fresh``),
``torch.utils.swap_tensors`` and ``nn.Parameter.__deepcopy__`` (its ``__torch_function__`` is
disabled). copytrace replaces those functions while it traces (:func:`install_patches`) and
puts the originals back (:func:`remove_patches`). The patches are process-wide but record only
on the traced thread, outside compiled regions (:func:`_here`).

A module first imported while they stand may bind them at import (``from copy import
deepcopy``, a default argument ``deepcopy=copy.deepcopy``, a class attribute): when the patches
go, such names in the modules imported meanwhile are bound to the originals again
(:func:`_unbind_new_modules`), so that nothing of copytrace stays in the program after stop.
"""

from __future__ import annotations

import copy
import functools
import sys
import threading
import time
import types
from typing import TYPE_CHECKING, Any

import torch

from copytrace.tracer import _handover, _slots, _warnshim
from copytrace.tracer._hide import hide_frames

if TYPE_CHECKING:
    from copytrace.tracer._recorder import Recorder

__all__ = [
    "active_recorder", "set_active", "install_patches", "remove_patches", "PATCH_FUNCTIONS",
    "EXTRA_PATCHES", "MISSING",
]  # fmt: skip

_perf_ns = time.perf_counter_ns
_NoTorchFunction = torch._C.DisableTorchFunction
_Tensor = torch.Tensor

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
    through (dynamo skips their own frames, see ``compiled._aside._skip_patch_codes``).
    """
    rec = _ACTIVE
    if rec is not None and threading.get_ident() == _THREAD and not rec.compiled_depth:
        return rec
    return None  # or inside a compiled region, where the patches stand aside


# --- patches installed while a trace is active ----------------------------------------------
_ORIG_DEEPCOPY = copy.deepcopy
_ORIG_COPY = copy.copy
_ORIG_SWAP = torch.utils.swap_tensors
_ORIG_FROM_NUMPY = torch.from_numpy
_ORIG_PARAM_DEEPCOPY = torch.nn.Parameter.__deepcopy__


def _traced_deepcopy(x, memo=None, _nil=[]):  # noqa: B006 - same signature as copy.deepcopy
    try:
        rec = _here()
        if rec is None or rec.group is not None or rec.active is not None:
            return _ORIG_DEEPCOPY(x, memo, _nil)
        if isinstance(x, _Tensor):
            # Recorded here rather than at Tensor.__deepcopy__: a mode above copytrace's
            # (torch's FakeCopyMode) may answer __deepcopy__ without calling down to copytrace.
            return rec.api_call("deepcopy", _ORIG_DEEPCOPY, (x, memo, _nil), {})
        return rec.deepcopy_group(_ORIG_DEEPCOPY, x, memo, _nil)
    except BaseException as err:  # the program's error: its traceback as untraced (_hide.py)
        hide_frames(err, _ACTIVE)
        raise


def _traced_copy(x):
    # Tensor has no __copy__: copy.copy rebuilds a new tensor on the same storage through
    # __reduce_ex__ (an alias), which neither mode sees as one call.
    try:
        rec = _here()
        if rec is None or rec.active is not None or not isinstance(x, _Tensor):
            return _ORIG_COPY(x)
        return rec.api_call("copy", _ORIG_COPY, (x,), {})
    except BaseException as err:
        hide_frames(err, _ACTIVE)
        raise


def _traced_from_numpy(array):
    # torch.from_numpy reaches neither mode as itself (only an aten::lift_fresh): record it
    # as an alias of the array's memory.
    rec = _here()
    if rec is None or rec.active is not None:
        try:
            return _ORIG_FROM_NUMPY(array)
        except BaseException as err:
            hide_frames(err, _ACTIVE)
            raise
    start = _perf_ns()
    try:
        out = _ORIG_FROM_NUMPY(array)
    except BaseException as err:
        hide_frames(err, _ACTIVE)
        raise
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
    try:
        rec = _here()
        if rec is None or rec.active is not None:
            return _ORIG_SWAP(t1, t2)
        return rec.api_call("swap_tensors", _ORIG_SWAP, (t1, t2), {})
    except BaseException as err:
        hide_frames(err, _ACTIVE)
        raise


def _traced_param_deepcopy(self, memo):
    # nn.Parameter.__deepcopy__ never reaches the function mode (its __torch_function__ is
    # disabled); it shows as `.data` + `clone`. Record it as one deepcopy of the parameter.
    try:
        rec = _here()
        if rec is None or rec.active is not None:
            return _ORIG_PARAM_DEEPCOPY(self, memo)
        return rec.api_call("deepcopy", _ORIG_PARAM_DEEPCOPY, (self, memo), {})
    except BaseException as err:
        hide_frames(err, _ACTIVE)
        raise


#: the Python functions patched in (their frames are skipped by dynamo)
PATCH_FUNCTIONS = (
    _traced_deepcopy, _traced_copy, _traced_from_numpy, _traced_swap_tensors,
    _traced_param_deepcopy,
)  # fmt: skip

# Each patch reads as its original: ``functools.update_wrapper`` gives it the original's
# ``__module__``, ``__name__``, ``__qualname__``, ``__doc__``, ``__annotations__`` (3.12+:
# ``__type_params__``) and ``__dict__``, and ``__wrapped__``, through which
# ``inspect.signature``, ``inspect.unwrap`` and ``inspect.getsource`` answer the original's
# (``torch.from_numpy``, a builtin, has no signature: ``ValueError`` as untraced). Pickling
# goes by module and qualified name, so ``pickle.dumps(copy.deepcopy)`` is the original's
# bytes. The code objects stay copytrace's (dynamo skips them, tracebacks leave them out).
for _patch, _original in zip(
    PATCH_FUNCTIONS,
    (_ORIG_DEEPCOPY, _ORIG_COPY, _ORIG_FROM_NUMPY, _ORIG_SWAP, _ORIG_PARAM_DEEPCOPY),
    strict=True,
):
    functools.update_wrapper(_patch, _original)
del _patch, _original

#: ``(owner, attribute, original, replacement)`` patched with the others (level ``lean``: the
#: API's C wrappers, see ``_observer.install_wrappers``); ``MISSING``: not in the owner's dict
EXTRA_PATCHES: list[tuple[Any, str, Any, Any]] = []
MISSING = object()


#: names in ``sys.modules`` when the patches went in, until they go (:func:`_unbind_new_modules`)
_MODULES_BEFORE: set[str] | None = None


def install_patches(stepping_aside: bool = False, tensor_too: bool = False) -> None:
    """Install copytrace's patches (``stepping_aside``: back after a compiled call, where the
    ``torch.Tensor`` ones stayed, or with ``tensor_too`` after an import, where they went too)."""
    global _MODULES_BEFORE
    if not stepping_aside and _MODULES_BEFORE is None:
        _MODULES_BEFORE = set(sys.modules)  # ~3,000 names: tens of microseconds
    getitem = False
    for owner, name, _, new in EXTRA_PATCHES:
        if tensor_too or not (stepping_aside and owner is _Tensor):
            setattr(owner, name, new)
            getitem = getitem or name == "__getitem__"
    if getitem:  # CPython also fills Tensor's sq_item for a __getitem__ attribute: clear it
        _slots.settle()
    copy.deepcopy = _traced_deepcopy
    copy.copy = _traced_copy
    torch.utils.swap_tensors = _traced_swap_tensors
    torch.from_numpy = _traced_from_numpy
    torch.nn.Parameter.__deepcopy__ = _traced_param_deepcopy
    _handover.install(_here, active_recorder)


def remove_patches(stepping_aside: bool = False, tensor_too: bool = False) -> None:
    """Remove copytrace's patches (``stepping_aside``: for a compiled call, which sees
    ``torch.Tensor``'s own methods through the wrappers' descriptors and whose wrappers stand
    aside by themselves; changing ``torch.Tensor``'s attributes costs a type-cache flush each.
    ``tensor_too``: those of ``torch.Tensor`` as well, for the import of a module that keeps
    what it sees, ``torch._dynamo``: :mod:`._dynamo_import`)."""
    getitem = new_slot = False
    for owner, name, orig, new in EXTRA_PATCHES:
        if stepping_aside and owner is _Tensor and not tensor_too:
            continue
        if owner.__dict__.get(name) is new:
            if orig is MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, orig)
            getitem = getitem or name == "__getitem__"
            new_slot = new_slot or name == "__new__"
    if getitem:  # removing the attribute leaves CPython's generic sq_item: clear it
        _slots.settle()
    if new_slot:  # and its generic tp_new (the fallback's torch.Tensor.__new__)
        _slots.settle_new()
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
    if not stepping_aside and _MODULES_BEFORE is not None:
        try:
            _unbind_new_modules(_patched_to_original())
        except Exception as err:  # counted on the trace, never raised into the program
            if _ACTIVE is not None:
                _ACTIVE.note_error(err)


def _patched_to_original() -> dict[int, Any]:
    """id of each callable copytrace patches in -> the original it stands for."""
    out = {
        id(_traced_deepcopy): _ORIG_DEEPCOPY,
        id(_traced_copy): _ORIG_COPY,
        id(_traced_swap_tensors): _ORIG_SWAP,
        id(_traced_from_numpy): _ORIG_FROM_NUMPY,
        id(_traced_param_deepcopy): _ORIG_PARAM_DEEPCOPY,
    }
    for orig, _, wrapper in _handover._WRAPPERS.values():
        out[id(wrapper)] = orig
    for shim in _warnshim._SHIM:  # warnings.warn while tracing (the observer's C shim)
        out[id(shim)] = _warnshim._ORIG_WARN
    for owner, name, orig, new in EXTRA_PATCHES:  # MISSING: the attribute was inherited
        out[id(new)] = getattr(owner, name) if orig is MISSING else orig
    return out


def _unbind_new_modules(patched: dict[int, Any]) -> int:
    """In every module imported since :func:`install_patches`, bind the names that hold one
    of copytrace's patched callables (``patched``: id -> original) to the original: module
    globals, the attributes of the classes the module defines, and the default arguments of
    its functions and of those classes' functions. Only modules new in ``sys.modules`` are
    read (a module imported before the trace saw the originals). Returns how many names were
    bound again."""
    global _MODULES_BEFORE
    before, _MODULES_BEFORE = _MODULES_BEFORE or set(), None
    rebound = 0
    for name, module in list(sys.modules.items()):
        if name in before or not isinstance(module, types.ModuleType):
            continue
        space = getattr(module, "__dict__", None)
        if isinstance(space, dict):
            rebound += _unbind_namespace(space, patched, name, module)
    return rebound


def _unbind_namespace(space: dict, patched: dict[int, Any], module_name: str, owner: Any) -> int:
    rebound = 0
    for key, value in list(space.items()):
        orig = patched.get(id(value))
        if orig is not None:
            if isinstance(owner, type):
                setattr(owner, key, orig)
            else:
                space[key] = orig
            rebound += 1
        elif isinstance(value, types.FunctionType):
            rebound += _unbind_defaults(value, patched)
        elif isinstance(value, (classmethod, staticmethod)):
            inner = value.__func__
            if id(inner) in patched:  # staticmethod(deepcopy)
                setattr(owner, key, type(value)(patched[id(inner)]))
                rebound += 1
            elif isinstance(inner, types.FunctionType):
                rebound += _unbind_defaults(inner, patched)
        elif (
            isinstance(value, type)
            and value is not owner
            and getattr(value, "__module__", None) == module_name
            and not isinstance(owner, type)  # the module's own classes, one level deep
        ):
            rebound += _unbind_namespace(dict(vars(value)), patched, module_name, value)
    return rebound


def _unbind_defaults(fn: types.FunctionType, patched: dict[int, Any]) -> int:
    rebound = 0
    defaults = fn.__defaults__
    if defaults and any(id(v) in patched for v in defaults):
        fn.__defaults__ = tuple(patched.get(id(v), v) for v in defaults)
        rebound += 1
    kwdefaults = fn.__kwdefaults__
    if kwdefaults and any(id(v) in patched for v in kwdefaults.values()):
        fn.__kwdefaults__ = {k: patched.get(id(v), v) for k, v in kwdefaults.items()}
        rebound += 1
    return rebound
