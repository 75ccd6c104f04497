"""Trace-unique storage ids (the C++ observer's ``record`` reads and extends the same table:
``_ids``, ``_next`` and ``_limit`` are read there by name, ``record.cpp`` ``storage_id``)."""

from __future__ import annotations

from typing import Any

import torch

from copytrace.tracer._storage_ref import hold, storage_key

__all__ = ["StorageIds"]

_Storage = torch.UntypedStorage


class StorageIds:
    """Trace-unique ids for storages (ids are never reused).

    ``_ids`` maps a storage's key (its StorageImpl's address, :mod:`copytrace.tracer.
    _storage_ref`; ``Facts.storage``) to its id. Each entry holds torch's weak handle on the
    StorageImpl (its address is the key), nothing a program can count: while it is listed no
    other StorageImpl is allocated at its address, so a live storage whose key is listed is
    the one that got the id; a storage allocated later gets a new one. Handles are given back
    when their entries go (:meth:`close`, pruning a full table of the storages that died).
    """

    def __init__(self) -> None:
        self._ids: dict[int, int] = {}
        self._next = 1
        self._limit = 4096
        self._free = _Storage._free_weak_ref  # kept: the module may be cleared at shutdown

    def of(self, t: Any) -> int | None:
        """The id of tensor ``t``'s storage; None where it has no single one."""
        return self.of_storage(storage_key(t))

    def of_storage(self, key: int | None) -> int | None:
        """The id of the live storage named ``key`` (``Facts.storage``); None for None."""
        if key is None:
            return None
        ids = self._ids
        uid = ids.get(key)
        if uid is not None:
            return uid
        if len(ids) >= self._limit:
            expired = _Storage._expired
            dead = [k for k in ids if expired(k)]
            for k in dead:
                del ids[k]
                self._free(k)
            self._limit = max(4096, 2 * len(ids))
        uid = self._next
        ids[hold(key)] = uid
        self._next = uid + 1
        return uid

    def close(self) -> None:
        """Give back every handle (the table is empty after)."""
        ids, self._ids = self._ids, {}
        for key in ids:
            self._free(key)

    def __del__(self) -> None:
        self.close()
