"""The legacy constructors of a list of tensors: ``torch.Tensor([a, b])``, ``torch.FloatTensor([a, b])``.

Like ``torch.tensor([a, b])``, they read each tensor's value into a new tensor cut from the
autograd graph (``legacy_new_from_sequence`` in torch/csrc/utils/tensor_new.cpp), but no
function mode sees them: ``torch.Tensor(...)`` runs ``TensorBase``'s ``tp_new``
(``THPVariable_pynew``), and ``torch.FloatTensor(...)``, ``torch.LongTensor(...)``... (type
objects of torch's immutable metaclass ``torch.tensortype``, listed in
``torch._tensor_classes``) their type's ``tp_new``. copytrace records them as op
``legacy_ctor`` (:data:`~copytrace.tracer._rules.LEGACY_CTOR`), its data the second argument
of ``(cls, data)``; only a single positional (nested) list or tuple holding a tensor is
recorded (``api_before``): ``torch.Tensor(3)``, ``torch.Tensor(2, 3)``,
``torch.Tensor([1.0, 2.0])`` and ``torch.Tensor(t)`` (an alias, ``aten::alias``, seen as
such at the aten level) pass straight through.

On the C++ observer (``_native/legacy.cpp``) the ``tp_new`` slot of ``TensorBase``, of every
subclass that holds the same pointer (``torch.Tensor`` and the subclasses that inherit it:
``TensorBase.__new__``'s safety check compares them) and of each legacy type object is
swapped for a C trampoline while tracing, and put back at stop (:func:`install_native`,
:func:`remove_native`); no attribute changes.

On the Python fallback ``torch.Tensor`` goes through the fallback's ``torch.Tensor.__new__``
(``_tensor_new.py``), and the legacy types through ``torch.tensortype``'s ``tp_call``: while
tracing it is CPython's generic ``slot_tp_call`` and ``tensortype``'s own dict holds
:func:`_traced_typed_call` as ``__call__`` (:func:`install_python`); both are put back at
stop (:func:`remove_python`). The slots are written through ctypes at offsets found and
checked on ``type`` (:mod:`copytrace.tracer._slots`); where a check fails nothing is written
and these constructors stay unrecorded.
"""

from __future__ import annotations

import ctypes
import gc
from typing import Any

import torch

from copytrace.tracer import _patches, _slots
from copytrace.tracer._hide import hide_frames
from copytrace.tracer._rules import LEGACY_CTOR
from copytrace.tracer._warnplace import call_placed

__all__ = [
    "legacy_types", "install_native", "remove_native", "install_python", "remove_python",
    "tensor_call",
]  # fmt: skip

_Tensor = torch.Tensor
_META = type(torch.FloatTensor)  # torch.tensortype
_TYPE_CALL = type.__call__  # type_call: the type's tp_new, then its tp_init
_SEQUENCES = (list, tuple)
_modified = ctypes.pythonapi.PyType_Modified
_modified.argtypes = [ctypes.py_object]
_modified.restype = None


def legacy_types() -> tuple[type, ...]:
    """torch's legacy typed constructors (``torch.FloatTensor``, ``torch.cuda.LongTensor``,
    ``torch.sparse.DoubleTensor``...): the type objects of ``torch.tensortype`` in
    ``torch._tensor_classes``, by name."""
    return tuple(sorted((c for c in torch._tensor_classes if type(c) is _META), key=str))


def _one_list(args: tuple) -> bool:
    return len(args) == 1 and isinstance(args[0], _SEQUENCES)


# --- the C++ observer ------------------------------------------------------------------------
def install_native(native: Any) -> int:
    """Swap the ``tp_new`` slots for the observer's trampolines; how many were swapped."""
    return int(native.legacy_install(LEGACY_CTOR, torch._C.TensorBase, _Tensor, legacy_types()))


def remove_native(native: Any) -> int:
    """Put every swapped ``tp_new`` back (also of subclasses made while tracing, which
    inherited a trampoline); how many were put back."""
    return int(native.legacy_restore(torch._C.TensorBase, legacy_types()))


# --- the Python fallback ---------------------------------------------------------------------
def tensor_call(rec: Any, orig_new: Any, args: tuple, kwargs: dict) -> Any:
    """``torch.Tensor(*args, **kwargs)`` through the fallback's ``torch.Tensor.__new__``
    (``orig_new``: ``TensorBase.__new__``): recorded by ``rec`` (the running trace's recorder,
    or None) for a list of tensors on the traced thread, else run as it is, from a frame
    placed at the program's line (a warning torch raises names it, as untraced)."""
    here = _patches._here() if rec is not None else None
    if here is not None and _one_list(args):
        return here.api_call(LEGACY_CTOR, orig_new, (_Tensor, *args), kwargs)
    return call_placed(orig_new, (_Tensor, *args), kwargs)


def _traced_typed_call(cls: Any, *args: Any, **kwargs: Any) -> Any:
    """``torch.tensortype.__call__`` while the fallback traces: ``cls(*args, **kwargs)`` as
    ``type.__call__`` runs it, recorded for a list of tensors. Returns and raises what it
    does; a program's error carries the untraced traceback (``_hide.py``)."""
    try:
        rec = _patches._here()
        if rec is None or not _one_list(args):
            return call_placed(_TYPE_CALL, (cls, *args), kwargs)
        return rec.api_call(LEGACY_CTOR, _TYPE_CALL, (cls, *args), kwargs)
    except BaseException as err:
        hide_frames(err, _patches._ACTIVE)
        raise


#: tensortype's own tp_call while :func:`install_python` stands (empty: not installed)
_SAVED: list[int] = []


def _own_dict(cls: type) -> dict | None:
    """The dict behind ``cls.__dict__`` (a mappingproxy refers to exactly one), or None."""
    found = [d for d in gc.get_referents(cls.__dict__) if type(d) is dict]
    return found[0] if len(found) == 1 else None


def install_python() -> bool:
    """Record the legacy typed constructors on the fallback (see the module docstring).
    False: not installed (the slot's offset not found, or ``__call__`` already there)."""
    offset = _slots.call_offset()
    space = _own_dict(_META)
    if _SAVED or offset is None or space is None or "__call__" in space:
        return False
    generic = _slots.generic_call()
    if not generic:
        return False
    slot = ctypes.c_void_p.from_address(id(_META) + offset)
    _SAVED.append(slot.value or 0)
    space["__call__"] = _traced_typed_call
    _modified(_META)  # type attribute caches: the new entry is seen
    slot.value = generic
    return True


def remove_python() -> None:
    """Undo :func:`install_python`: ``tp_call`` and ``tensortype``'s dict as they were."""
    if not _SAVED:
        return
    offset = _slots.call_offset()
    space = _own_dict(_META)
    orig = _SAVED.pop()
    if offset is not None:
        ctypes.c_void_p.from_address(id(_META) + offset).value = orig or None
    if space is not None and space.get("__call__") is _traced_typed_call:
        del space["__call__"]
    _modified(_META)
