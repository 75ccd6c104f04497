"""Trace-unique storage ids (the C++ observer's ``record`` reads and extends the same table:
``_ids``, ``_next`` and ``_limit`` are read there by name, ``record.cpp`` ``storage_id``)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["StorageIds"]

_Storage = torch.UntypedStorage


class StorageIds:
    """Trace-unique ids for storages (ids are never reused).

    ``_ids`` maps ``id(storage)`` to ``(handle, uid)``: ``handle`` is torch's weak handle on the
    StorageImpl (``UntypedStorage._weak_ref()``, the StorageImpl's address; see
    :mod:`copytrace.tracer._storage_ref`), nothing a program can count. While the handle lives
    no other StorageImpl is allocated at its address, so an entry is the storage's own when its
    handle equals the storage's ``_cdata``; a storage allocated later gets a new id. Handles are
    given back when their entries go (:meth:`close`, pruning a full table).
    """

    def __init__(self) -> None:
        self._ids: dict[int, tuple[int, int]] = {}
        self._next = 1
        self._limit = 4096
        self._free = _Storage._free_weak_ref  # kept: the module may be cleared at shutdown

    def of(self, t: Any) -> int | None:
        try:
            storage = t.untyped_storage()
        except Exception:  # sparse, nested, some wrapper subclasses: no single storage
            return None
        return self.of_storage(storage)

    def of_storage(self, storage: Any) -> int | None:
        """The id of a storage object (``untyped_storage()``); None for None."""
        if storage is None:
            return None
        key = id(storage)
        ids = self._ids
        entry = ids.get(key)
        cdata = storage._cdata
        if entry is not None:
            if entry[0] == cdata:
                return entry[1]
            del ids[key]  # a storage now dead: its object's address is another storage's
            self._free(entry[0])
        uid = self._next
        self._next += 1
        if len(ids) >= self._limit:
            expired = _Storage._expired
            dead = [k for k, v in ids.items() if expired(v[0])]
            for k in dead:
                self._free(ids.pop(k)[0])
            self._limit = max(4096, 2 * len(ids))
        ids[key] = (storage._weak_ref(), uid)
        return uid

    def close(self) -> None:
        """Give back every handle (the table is empty after)."""
        ids, self._ids = self._ids, {}
        for handle, _ in ids.values():
            self._free(handle)

    def __del__(self) -> None:
        self.close()
