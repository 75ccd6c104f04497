"""A tensor's facts for one event, read in one call.

:func:`facts` returns one tuple per tensor (indexes below). The C++ observer's ``facts``
(``_native/observer.cpp``) reads it for plain tensors (``torch.Tensor`` and ``nn.Parameter``,
strided, not nested, no symbolic sizes) without going through torch's Python bindings; for
every other tensor, and where the observer is not loaded, :func:`py_facts` reads the same
tuple with the Python readers below. Both read metadata only: no tensor data, no device sync,
and the tuple holds the tensor's storage object and grad_fn for as long as the caller keeps
it (never beyond the event being recorded).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["facts", "py_facts"]

# Indexes into a facts tuple.
SHAPE, DTYPE, DEVICE, REQUIRES_GRAD, IS_LEAF, GRAD_FN, GRAD_FN_NAME = 0, 1, 2, 3, 4, 5, 6
#: the storage's Python object (``untyped_storage()``), None where there is none
STORAGE = 7
STORAGE_BYTES, LOGICAL_BYTES = 8, 9  # bytes
#: storage offset (elements) and strides; None for nested tensors and where no storage is
OFFSET, STRIDE = 10, 11
VERSION = 12  # version counter, None for inference tensors
FAKE = 13  # a FakeTensor or a meta tensor (read with with_grad_fn only, else False)

_Tensor = torch.Tensor
_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))
_DTYPE_NAMES: dict[torch.dtype, str] = {}
_DEVICE_NAMES: dict[torch.device, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def device_str(device: torch.device) -> str:
    """``"cpu"``, ``"cuda:0"``, ``"meta"`` (interned)."""
    name = _DEVICE_NAMES.get(device)
    if name is None:
        name = _DEVICE_NAMES[device] = sys.intern(str(device))
    return name


def shape(t: torch.Tensor) -> tuple[int, ...]:
    try:
        return tuple(t.shape)
    except Exception:  # nested tensors have no single shape
        return ()


def nbytes(t: torch.Tensor) -> int:
    """Logical bytes: numel x element size (0 when the layout has no numel)."""
    try:
        return t.numel() * t.element_size()
    except Exception:
        return 0


def is_fake(t: torch.Tensor) -> bool:
    """A FakeTensor (no real memory) or a meta tensor."""
    if type(t) not in _PLAIN:
        fake_module = sys.modules.get("torch._subclasses.fake_tensor")
        if fake_module is not None and isinstance(t, fake_module.FakeTensor):
            return True
    try:
        return bool(t.is_meta)
    except Exception:
        return False


def version(t: Any) -> int | None:
    try:
        return t._version
    except Exception:  # inference tensors have no version counter
        return None


def py_facts(t: torch.Tensor, with_grad_fn: bool = False) -> tuple:
    """The facts tuple read with torch's Python bindings (any tensor, subclasses included).

    ``IS_LEAF``, ``GRAD_FN``, ``GRAD_FN_NAME`` and ``FAKE`` are read only with ``with_grad_fn``
    (the facts of a call's result; reading a view's ``grad_fn`` may regenerate its node); they
    are None (``FAKE``: False) otherwise."""
    logical = nbytes(t)
    try:
        storage = t.untyped_storage()
    except Exception:  # sparse, nested, some subclasses: no single storage
        storage = None
    storage_bytes = logical
    offset = stride = None
    if storage is not None:
        try:
            storage_bytes = storage.nbytes()
        except Exception:
            pass
        if not t.is_nested:  # nested tensors have no single view
            offset = t.storage_offset()
            stride = tuple(t.stride())
    if with_grad_fn:
        grad_fn = t.grad_fn
        is_leaf = t.is_leaf
        grad_fn_name = type(grad_fn).__name__ if grad_fn is not None else None
        fake = is_fake(t)
    else:
        grad_fn = is_leaf = grad_fn_name = None
        fake = False
    return (
        shape(t), dtype_name(t.dtype), device_str(t.device), t.requires_grad, is_leaf,
        grad_fn, grad_fn_name, storage, storage_bytes, logical, offset, stride, version(t),
        fake,
    )  # fmt: skip


def facts(native: Any, t: torch.Tensor, with_grad_fn: bool = False) -> tuple:
    """The facts of tensor ``t``: from the C++ observer ``native`` where it can read them,
    else from :func:`py_facts`. Call with torch function handling disabled."""
    if native is not None:
        found = native.facts(t, with_grad_fn)
        if found is not None:
            return found
    return py_facts(t, with_grad_fn)

