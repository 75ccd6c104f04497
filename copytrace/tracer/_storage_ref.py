"""A tensor's storage, named without a Python storage object, and torch's own weak handle on it:
how copytrace follows a storage's life without a reference to any tensor.

A storage is named by its *key*, the address of its StorageImpl (``UntypedStorage._cdata``).
With the C++ observer the key is read from the TensorImpl (``storage_of``,
``_native/facts.cpp``) and no Python storage object is ever made: once torch has made one
(``t.untyped_storage()``) it preserves it with the StorageImpl for the storage's whole life,
holding a strong reference (``c10/util/intrusive_ptr.h``, "PyObject preservation for Tensor
and Storages"), so ``torch._C._storage_Use_Count`` reads one more from then on and autograd,
which adds the gradients that reach one input in place only while that count is 1
(``torch/csrc/autograd/input_buffer.cpp``, ``can_accumulate_inplace``), adds them out of place:
the program's version counters change. The Python fallback (no observer) has no other way to
read a key than ``untyped_storage()``.

A :class:`StorageRef` holds torch's weak handle on the StorageImpl (a c10
``weak_intrusive_ptr``, as ``UntypedStorage._weak_ref()`` makes; ``torch.multiprocessing.
reductions.StorageWeakRef`` wraps the same calls for torch's shared-memory cache), its address
being the key. It puts nothing on the tensor: no Python weak reference (``torch.utils.
swap_tensors`` refuses a tensor that has one) and no weak count on the TensorImpl
(``torch._C._swap_tensor_impl`` checks that one). A StorageImpl's weak count is read by nothing
in torch, and the storage's memory is freed when the last strong reference goes (only the small
StorageImpl object waits for the weak handle). While the handle lives no other StorageImpl can
be allocated at its address: a live storage whose key is ``ref.cdata`` is the one the handle
was made on (:meth:`StorageRef.holds`). The handle is given back in ``__del__``.
"""

from __future__ import annotations

from typing import Any

import torch

from copytrace.tracer import _native

__all__ = ["StorageRef", "hold", "storage_key", "storage_of", "storage_ref"]

_Storage = torch.UntypedStorage
_NoTorchFunction = torch._C.DisableTorchFunction
_use_count = torch._C._storage_Use_Count


def storage_of(t: Any) -> tuple[int, int | None] | None:
    """``(key, bytes)`` of ``t``'s storage (bytes None where symbolic); None when ``t`` has no
    single storage (sparse, nested on the fallback, functorch's wrappers, some subclasses).
    Call with torch function handling disabled on the fallback (``untyped_storage()``)."""
    native = _native.loaded()
    if native is not None:
        return native.storage_of(t)
    try:
        storage = t.untyped_storage()
    except Exception:
        return None
    try:
        nbytes = storage.nbytes()
    except Exception:  # symbolic sizes
        nbytes = None
    return storage._cdata, nbytes


def storage_key(t: Any) -> int | None:
    """The key of ``t``'s storage (its StorageImpl's address), None where it has none."""
    found = storage_of(t)
    return None if found is None else found[0]


def hold(key: int) -> int:
    """Take torch's weak handle on the live storage ``key`` names (read from a tensor the caller
    still holds); ``UntypedStorage._free_weak_ref(key)`` gives it back. Returns ``key``."""
    native = _native.loaded()
    if native is not None:
        return native.storage_hold(key)
    # the fallback: the storage object untyped_storage() made (torch keeps it), then its handle
    storage = _Storage._new_with_weak_ptr(key)
    if storage is None:
        raise ValueError("storage_ref: the storage is gone")
    return storage._weak_ref()


class StorageRef:
    """A weak handle on one StorageImpl (made from its ``key``): :meth:`expired` once no tensor
    (nor storage object) holds it, :meth:`use_count` its strong references (0 once expired)."""

    __slots__ = ("cdata", "_free", "_owners")

    def __init__(self, key: int) -> None:
        self._free = _Storage._free_weak_ref  # kept: the module may be cleared at shutdown
        self.cdata: int = hold(key)
        native = _native.loaded()
        # not counting torch's own Python storage object (made by the program or not: the same
        # count either way); the fallback made one for every storage it follows
        self._owners = native.storage_owners if native is not None else None

    def expired(self) -> bool:
        return _Storage._expired(self.cdata)

    def holds(self, key: int) -> bool:
        """Whether the live storage named ``key`` is the one this handle was made on."""
        return key == self.cdata

    def use_count(self) -> int:
        """The storage's strong references, torch's Python storage object not counted (with the
        C++ observer; on the fallback, which makes one for every storage, counted)."""
        owners = self._owners
        if owners is not None:
            return owners(self.cdata)
        try:
            return _use_count(self.cdata)
        except Exception:  # a torch without this private API
            return -1

    def __del__(self) -> None:
        cdata = getattr(self, "cdata", None)  # unset where hold() raised
        if cdata is not None:
            self._free(cdata)


def storage_ref(t: Any) -> StorageRef | None:
    """A :class:`StorageRef` on ``t``'s storage; None when ``t`` has no single storage (sparse,
    nested, some wrapper subclasses)."""
    try:
        with _NoTorchFunction():
            key = storage_key(t)
            return None if key is None else StorageRef(key)
    except Exception:
        return None
