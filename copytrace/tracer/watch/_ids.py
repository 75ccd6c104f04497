"""Trace-unique storage ids (the C++ observer's ``record`` reads and extends the same table:
``_ids``, ``_next`` and ``_limit`` are read there by name)."""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["StorageIds"]


class StorageIds:
    """Trace-unique ids for storages, by identity (weak references; ids are never reused).

    torch keeps one Python object per live storage, so identity is stable while the storage
    lives; a storage allocated later at the same address gets a new id.
    """

    def __init__(self) -> None:
        self._ids: dict[int, tuple[weakref.ref, int]] = {}
        self._next = 1
        self._limit = 4096

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
        entry = self._ids.get(key)
        if entry is not None and entry[0]() is storage:
            return entry[1]
        uid = self._next
        self._next += 1
        if len(self._ids) >= self._limit:
            self._ids = {k: v for k, v in self._ids.items() if v[0]() is not None}
            self._limit = max(4096, 2 * len(self._ids))
        self._ids[key] = (weakref.ref(storage), uid)
        return uid
