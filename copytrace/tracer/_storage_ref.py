"""torch's own weak handle on a tensor's storage: the Python fallback's way to follow a tensor's
life without a reference to the tensor.

``UntypedStorage._weak_ref()`` makes a c10 ``weak_intrusive_ptr`` on the StorageImpl and
returns its address (``torch/csrc/StorageMethods.cpp``; ``torch.multiprocessing.reductions.
StorageWeakRef`` wraps the same three calls for torch's shared-memory cache). It puts nothing on
the tensor: no Python weak reference (``torch.utils.swap_tensors`` refuses a tensor that has
one) and no weak count on the TensorImpl (``torch._C._swap_tensor_impl`` checks that one). A
StorageImpl's weak count is read by nothing in torch: ``torch._C._storage_Use_Count`` counts
strong references only, and the storage's memory is freed when the last strong reference goes
(only the small StorageImpl object waits for the weak handle). The handle is given back in
``__del__``.

While the handle lives, ``torch._C._storage_Use_Count(ref.cdata)`` reads the storage's strong
count (the address stays valid; 0 once the storage is gone), and no other StorageImpl can be
allocated at its address: a live storage object whose ``_cdata`` is ``ref.cdata`` is the one
the handle was made on (:meth:`StorageRef.holds`). Neither ``weakref.getweakrefcount`` of the
storage object nor ``torch._C._storage_Use_Count`` counts the handle.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["StorageRef", "storage_ref"]

_Storage = torch.UntypedStorage
_NoTorchFunction = torch._C.DisableTorchFunction


class StorageRef:
    """A weak handle on one StorageImpl: :meth:`expired` once no tensor (nor storage object)
    holds it, :meth:`use_count` its strong references (0 once expired)."""

    __slots__ = ("cdata", "_free")

    def __init__(self, storage: Any) -> None:
        self.cdata: int = storage._weak_ref()
        self._free = _Storage._free_weak_ref  # kept: the module may be cleared at shutdown

    def expired(self) -> bool:
        return _Storage._expired(self.cdata)

    def holds(self, storage: Any) -> bool:
        """Whether ``storage`` (a live storage object) is the one this handle was made on."""
        return storage._cdata == self.cdata

    def use_count(self) -> int:
        try:
            return torch._C._storage_Use_Count(self.cdata)
        except Exception:  # a torch without this private API
            return -1

    def __del__(self) -> None:
        self._free(self.cdata)


def storage_ref(t: Any) -> StorageRef | None:
    """A :class:`StorageRef` on ``t``'s storage; None when ``t`` has no single storage (sparse,
    nested, some wrapper subclasses)."""
    try:
        with _NoTorchFunction():
            return StorageRef(t.untyped_storage())
    except Exception:
        return None
