"""Keep ``torch.Tensor``'s sequence slot as torch made it while ``__getitem__`` is wrapped.

At level ``lean`` copytrace puts a C wrapper at ``torch.Tensor.__getitem__`` (see
``_observer.install_wrappers``). CPython then fills *both* slots named ``__getitem__`` of
``torch.Tensor`` and of every subclass that inherits it: ``mp_subscript`` (what ``x[i]``
calls) and ``sq_item`` (Objects/typeobject.c, ``update_one_slot``), which torch's
``TensorBase`` leaves NULL. A tensor then passes ``PySequence_Check``: ``torch.tensor([a, b])``
of 0-d tensors asks ``len(a)`` (torch/csrc/utils/tensor_new.cpp, ``compute_sizes``) and raises
``TypeError: len() of a 0-d tensor``. Removing the wrapper does not clear ``sq_item`` again
(both slots are set by then, so CPython keeps the generic one), so the error outlived the trace.

:func:`settle` puts ``sq_item`` back to ``TensorBase``'s (NULL) on every tensor class whose
``__getitem__`` comes from ``torch.Tensor`` or ``TensorBase``; ``x[i]`` still reaches the
wrapper through ``mp_subscript``. It is called after the wrapper is installed and after it is
removed. A class that defines its own ``__getitem__`` (or gets it from another base) is left
alone. The slot is written through ctypes at the offset of ``tp_as_sequence`` in
``PyTypeObject``, checked once against ``PyType_GetSlot`` on ``list``; where that check fails
nothing is written (:func:`settle` returns False).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

__all__ = ["settle", "settle_new", "sq_item", "tp_new", "tp_call", "call_offset", "generic_call"]

_PY_SQ_ITEM = 44  # Include/typeslots.h
_PTR = ctypes.sizeof(ctypes.c_void_p)
_AS_SEQUENCE = 13 * _PTR  # PyVarObject head (3), tp_name .. tp_as_number (10) before it
_SQ_ITEM = 3 * _PTR  # sq_length, sq_concat, sq_repeat before it

_get_slot = ctypes.pythonapi.PyType_GetSlot
_get_slot.restype = ctypes.c_void_p
_get_slot.argtypes = [ctypes.py_object, ctypes.c_int]
_LAYOUT_OK: list[bool] = []


def sq_item(cls: type) -> int:
    """The address in ``cls``'s ``sq_item`` slot (0: NULL), read by CPython's API."""
    return _get_slot(cls, _PY_SQ_ITEM) or 0


def _slot_address(cls: type) -> int | None:
    methods = ctypes.c_void_p.from_address(id(cls) + _AS_SEQUENCE).value
    return None if not methods else methods + _SQ_ITEM


def _layout_ok() -> bool:
    if not _LAYOUT_OK:
        where = _slot_address(list)
        _LAYOUT_OK.append(
            where is not None and ctypes.c_void_p.from_address(where).value == sq_item(list)
        )
    return _LAYOUT_OK[0]


def _subclasses(root: type) -> list[type]:
    out, todo, seen = [], [root], set()
    while todo:
        cls = todo.pop()
        if id(cls) in seen:
            continue
        seen.add(id(cls))
        out.append(cls)
        try:
            todo.extend(type.__subclasses__(cls))
        except TypeError:
            continue
    return out


def _owner(cls: type, name: str) -> Any:
    """The class of ``cls``'s MRO whose own dict holds ``name`` (None: none)."""
    for base in cls.__mro__:
        if name in base.__dict__:
            return base
    return None


def settle() -> bool:
    """Give every tensor class whose ``__getitem__`` is torch's (or copytrace's wrapper of it)
    ``TensorBase``'s ``sq_item`` again. Returns False where the slot layout is not the one
    expected (nothing written)."""
    if not _layout_ok():
        return False
    base = torch._C.TensorBase
    want = sq_item(base)
    torch_owned = (base, torch.Tensor)
    for cls in _subclasses(base):
        if sq_item(cls) == want or _owner(cls, "__getitem__") not in torch_owned:
            continue
        where = _slot_address(cls)
        if where is not None:
            ctypes.c_void_p.from_address(where).value = want or None
    return True


# --- tp_new: after the fallback's torch.Tensor.__new__ (tracer/_tensor_new.py) ---------------
_PY_TP_NEW = 65  # Include/typeslots.h
_NEW_OFFSET: list[int | None] = []


def tp_new(cls: type) -> int:
    """The address in ``cls``'s ``tp_new`` slot, read by CPython's API."""
    return _get_slot(cls, _PY_TP_NEW) or 0


def _new_offset() -> int | None:
    """The offset of ``tp_new`` in ``PyTypeObject``: the one word of ``list``'s type object
    that holds its ``tp_new``, checked on ``dict`` and ``TensorBase`` (None: not found)."""
    if not _NEW_OFFSET:
        words = 64  # PyTypeObject is about 50 words long
        want = tp_new(list)
        found = [i * _PTR for i in range(words)
                 if ctypes.c_void_p.from_address(id(list) + i * _PTR).value == want]  # fmt: skip
        ok = len(found) == 1 and all(
            ctypes.c_void_p.from_address(id(cls) + found[0]).value == tp_new(cls)
            for cls in (dict, torch._C.TensorBase)
        )
        _NEW_OFFSET.append(found[0] if ok else None)
    return _NEW_OFFSET[0]


def settle_new() -> bool:
    """Give every tensor class whose ``__new__`` is ``TensorBase``'s again ``TensorBase``'s
    ``tp_new``: assigning ``torch.Tensor.__new__`` and deleting it leaves CPython's generic
    ``slot_tp_new`` there (``update_one_slot`` in Objects/typeobject.c keeps the type's
    current ``tp_new`` for ``tp_new_wrapper``), a Python-level lookup at each construction.
    Returns False where the slot's offset was not found (nothing written)."""
    offset = _new_offset()
    if offset is None:
        return False
    base = torch._C.TensorBase
    want = tp_new(base)
    for cls in _subclasses(base):
        if tp_new(cls) != want and _owner(cls, "__new__") is base:
            ctypes.c_void_p.from_address(id(cls) + offset).value = want
    return True


# --- tp_call: torch.tensortype's while the fallback records the legacy constructors ----------
_PY_TP_CALL = 50  # Include/typeslots.h
_CALL_OFFSET: list[int | None] = []
_GENERIC_CALL: list[int] = []


def tp_call(cls: type) -> int:
    """The address in ``cls``'s ``tp_call`` slot, read by CPython's API."""
    return _get_slot(cls, _PY_TP_CALL) or 0


def call_offset() -> int | None:
    """The offset of ``tp_call`` in ``PyTypeObject``: the one word of ``type``'s type object
    that holds its ``tp_call`` (``type_call``), checked on ``torch.tensortype``, which
    inherits it (None: not found)."""
    if not _CALL_OFFSET:
        words = 64
        want = tp_call(type)
        found = [i * _PTR for i in range(words)
                 if ctypes.c_void_p.from_address(id(type) + i * _PTR).value == want]  # fmt: skip
        meta = type(torch.FloatTensor)
        ok = len(found) == 1 and ctypes.c_void_p.from_address(id(meta) + found[0]).value == tp_call(meta)
        _CALL_OFFSET.append(found[0] if ok else None)
    return _CALL_OFFSET[0]


def generic_call() -> int:
    """CPython's generic ``slot_tp_call`` (calls ``type(obj).__call__``), read from a class
    that defines ``__call__`` (0: not found)."""
    if not _GENERIC_CALL:

        class _Callable:
            def __call__(self) -> None:
                return None

        _GENERIC_CALL.append(tp_call(_Callable))
    return _GENERIC_CALL[0]
