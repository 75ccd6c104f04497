"""A tensor's facts for one event, read in one call.

:func:`facts` returns one :class:`Facts` per tensor: a tuple whose items also have names (the
indexes below name the same items). The C++ observer's ``facts`` (``_native/facts.cpp``: a
struct sequence with the same fields) reads it for plain tensors (``torch.Tensor`` and
``nn.Parameter``, strided, not nested, no symbolic sizes) without going through torch's Python
bindings; for every other tensor, and where the observer is not loaded, :func:`py_facts` reads
the same fields with the Python readers below. Both read metadata only: no tensor data, no device sync,
and the tuple holds the tensor's grad_fn for as long as the caller keeps it (never beyond the
event being recorded). The storage is named by its key, its StorageImpl's address
(:mod:`copytrace.tracer._storage_ref`): with the C++ observer no Python storage object is made
(torch would keep it for the storage's whole life, one more strong reference, which changes
what autograd does in place).
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import torch

from copytrace.tracer import _native
from copytrace.tracer._storage_ref import storage_of

__all__ = [
    "Facts", "batch_size", "facts", "is_wrapped", "own_sizes", "py_facts", "strides_in_python",
    "unbatched",
]


class Facts(NamedTuple):
    """A tensor's facts. ``is_leaf``, ``grad_fn``, ``grad_fn_name`` and ``fake`` are read only
    with ``with_grad_fn`` (else None, None, None, False). The C++ observer's ``Facts`` has these
    fields in this order (tests/test_native_stub.py checks it)."""

    shape: tuple[int, ...]
    dtype: str  #: "float32"
    device: str  #: "cpu", "cuda:0"
    requires_grad: bool
    is_leaf: bool | None
    grad_fn: Any  #: the autograd node, or None
    grad_fn_name: str | None  #: "CloneBackward0"
    storage: int | None  #: the storage's key (its StorageImpl's address), None where none
    storage_bytes: int  #: bytes
    logical_bytes: int  #: numel x element size, bytes
    offset: int | None  #: storage offset (elements); None for nested tensors, no storage
    #: None also where a tensor subclass answers its strides in Python (strides_in_python)
    stride: tuple[int, ...] | None
    version: int | None  #: version counter; None for inference tensors
    fake: bool  #: a FakeTensor or a meta tensor


_new_facts = tuple.__new__  # Facts from a tuple without NamedTuple's per-call __new__

# Indexes into Facts (for the readers that index).
SHAPE, DTYPE, DEVICE, REQUIRES_GRAD, IS_LEAF, GRAD_FN, GRAD_FN_NAME = 0, 1, 2, 3, 4, 5, 6
#: the storage's key (its StorageImpl's address, ``_storage_ref``), None where there is none
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
    """``t``'s shape; ``()`` where it has no single one (nested tensors) or where a tensor
    subclass answers it in Python and the C++ observer cannot read it (:func:`own_sizes`)."""
    if type(t) not in _PLAIN:
        own = own_sizes(t)
        if own is not _ASK:
            return () if own is None else own[0]
    return _asked_shape(t)


def _asked_shape(t: torch.Tensor) -> tuple[int, ...]:
    try:
        return tuple(t.shape)
    except Exception:  # nested tensors have no single shape
        return ()


def nbytes(t: torch.Tensor) -> int:
    """Logical bytes: numel x element size (0 when the layout has no numel, or where a tensor
    subclass answers its sizes in Python and the C++ observer cannot read them)."""
    if type(t) not in _PLAIN:
        own = own_sizes(t)
        if own is not _ASK:
            return 0 if own is None else own[1] * t.element_size()
    return _asked_nbytes(t)


def _asked_nbytes(t: torch.Tensor) -> int:
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


_TENSOR_DISPATCH = torch.Tensor.__torch_dispatch__


def strides_in_python(t: torch.Tensor) -> bool:
    """Whether a tensor subclass answers ``t``'s strides in Python
    (``_make_wrapper_subclass(..., dispatch_sizes_strides_policy="strides"`` or ``"sizes")``):
    ``t.stride()`` would then reach its ``__torch_dispatch__`` as ``aten.sym_stride``, a call
    the program did not make. Read from the TensorImpl's policy by the C++ observer
    (``sizes_strides_policy``, no dispatch); without it, assumed of every tensor subclass
    defined outside torch with its own ``__torch_dispatch__``."""
    cls = type(t)
    if cls in _PLAIN:
        return False
    native = _native.loaded()
    if native is not None:
        return native.sizes_strides_policy(t) > 0
    return _own_dispatch(cls)


#: :func:`own_sizes`: torch answers the tensor's sizes itself; ask it
_ASK: Any = object()


def _own_dispatch(cls: type) -> bool:
    """A tensor subclass defined outside torch with its own ``__torch_dispatch__``."""
    dispatch = getattr(cls, "__torch_dispatch__", _TENSOR_DISPATCH)
    return getattr(dispatch, "__func__", dispatch) is not _TENSOR_DISPATCH and not (
        cls.__module__ or ""
    ).startswith("torch.")


_functorch = torch._C._functorch
_is_batched = _functorch.is_batchedtensor
_is_grad_tracking = _functorch.is_gradtrackingtensor
#: a functorch wrapper (vmap's batched tensor, grad's grad-tracking tensor, ...)
is_wrapped = _functorch.is_functorch_wrapped_tensor


def unbatched(t: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """The physical tensor under functorch's wrappers (``torch.func.vmap``'s batched tensors,
    ``torch.func.grad``'s grad-tracking tensors) and the batch size: the product of the
    vmap levels' sizes, None without a vmap level. A batched tensor has no storage of its own
    (``aten/src/ATen/functorch/BatchedTensorImpl.h``); the physical tensor is what the
    dispatch level (a ``TorchDispatchMode``) sees, with the batch dimensions in it."""
    size = None
    for _ in range(64):  # functorch levels
        if _is_batched(t):
            bdim = _functorch.maybe_get_bdim(t)
            t = _functorch.get_unwrapped(t)
            size = (size or 1) * t.shape[bdim]
        elif _is_grad_tracking(t):
            t = _functorch.get_unwrapped(t)
        else:
            break
    return t, size


def batch_size(t: torch.Tensor) -> int | None:
    """How many vmap members a functorch-wrapped tensor ``t`` holds (:func:`unbatched`),
    None when it is no batched tensor."""
    try:
        return unbatched(t)[1]
    except Exception:  # a wrapper whose level has exited
        return None


def own_sizes(t: torch.Tensor) -> Any:
    """For a tensor subclass that answers its sizes in Python
    (``_make_wrapper_subclass(..., dispatch_sizes_strides_policy="sizes")``, where ``t.shape``,
    ``t.numel()`` and ``t.storage_offset()`` reach its ``__torch_dispatch__`` as
    ``aten.sym_size``, ``sym_numel``, ``sym_storage_offset``: calls the program did not make):
    ``(shape, numel, storage_offset)`` as its TensorImpl holds them, read by the C++ observer
    (``sizes_default``, no dispatch), or None where they cannot be read so (no observer: assumed
    of every subclass outside torch with its own ``__torch_dispatch__``; symbolic sizes).
    :data:`_ASK` for every other tensor: torch answers, read them as usual."""
    native = _native.loaded()
    if native is not None:
        if native.sizes_strides_policy(t) < 2:
            return _ASK
        return native.sizes_default(t)
    return None if _own_dispatch(type(t)) else _ASK


def py_facts(t: torch.Tensor, with_grad_fn: bool = False) -> Facts:
    """The facts read with torch's Python bindings (any tensor, subclasses included).

    ``IS_LEAF``, ``GRAD_FN``, ``GRAD_FN_NAME`` and ``FAKE`` are read only with ``with_grad_fn``
    (the facts of a call's result; reading a view's ``grad_fn`` may regenerate its node); they
    are None (``FAKE``: False) otherwise."""
    real = t
    if is_wrapped(t):  # vmap, grad: the physical tensor's memory (what a dispatch mode sees)
        try:
            real = unbatched(t)[0]
        except Exception:
            real = t
    own = _ASK if type(real) in _PLAIN else own_sizes(real)
    if own is _ASK:
        dims, logical = _asked_shape(t), _asked_nbytes(real)
    else:  # a subclass answers its sizes in Python: never ask it (None: unknown)
        dims, numel, own_offset = own if own is not None else ((), 0, None)
        logical = numel * real.element_size()
    found = storage_of(real)  # sparse, nested, some subclasses: no single storage (None)
    storage = storage_bytes = None
    if found is not None:
        storage, storage_bytes = found
    if storage_bytes is None:
        storage_bytes = logical
    offset = stride = None
    if storage is not None:
        if not real.is_nested:  # nested tensors have no single view
            offset = real.storage_offset() if own is _ASK else own_offset
            # not read where the subclass answers it in Python: the read would reach it
            stride = None if strides_in_python(real) else tuple(real.stride())
    if with_grad_fn:
        grad_fn = t.grad_fn
        is_leaf = t.is_leaf
        grad_fn_name = type(grad_fn).__name__ if grad_fn is not None else None
        fake = is_fake(t)
    else:
        grad_fn = is_leaf = grad_fn_name = None
        fake = False
    return _new_facts(Facts, (
        dims, dtype_name(t.dtype), device_str(t.device), t.requires_grad, is_leaf,
        grad_fn, grad_fn_name, storage, storage_bytes, logical, offset, stride, version(t),
        fake,
    ))  # fmt: skip


def facts(native: Any, t: torch.Tensor, with_grad_fn: bool = False) -> Facts:
    """The facts of tensor ``t``: from the C++ observer ``native`` where it can read them,
    else from :func:`py_facts`. Call with torch function handling disabled."""
    if native is not None:
        found = native.facts(t, with_grad_fn)
        if found is not None:
            return found
    return py_facts(t, with_grad_fn)

