"""In-place writes into fresh copies, seen from the function mode.

Every API-level copy into new storage (``clone``, ``.to``, ``x[idx]``...) is watched, weakly,
while its result lives: an in-place call on it (a method or function whose name ends in
``_``, an in-place operator, ``__setitem__``, or ``inplace=True``) adds one to the event's
``inplace_writes``. Two hazards read that fact:

* ``redundant-copy``: a copy that was written is not interchangeable with another copy of the
  same source, so neither is redundant;
* ``lost-inplace-write``: advanced indexing returns a fresh gather, not a view, so
  ``x[idx].zero_()`` writes into a temporary. When such a result dies after an in-place write
  and no torch call used it after that write, the event gets ``write_site``, the
  ``file:line function`` of the first lost write.

Only the function mode's own arguments are looked at: ``args[0]`` of every call while some
copy is alive, and every argument (one level into lists and tuples, and keyword values)
only while a written index result waits for a use. A write made by ``out=`` into a copy,
or by C++ code below a torch call, is not seen. Nothing here keeps a tensor alive.
"""

from __future__ import annotations

import sys
import weakref
from typing import TYPE_CHECKING, Any

import torch

from copytrace.tracer._callsite import user_frame

if TYPE_CHECKING:
    from copytrace.tracer._events import CopyEvent

__all__ = ["Fresh", "INDEX_OPS", "is_inplace"]

#: Ops whose result is a fresh gather of selected elements (``x[idx]`` is ``index``).
INDEX_OPS = ("index", "index_select", "masked_select", "take", "gather", "take_along_dim")

_Tensor = torch.Tensor
_MAX_FRESH = 100_000
_INPLACE_DUNDERS = frozenset((
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
    "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
    "__imatmul__",
))  # fmt: skip
# Underscore-named calls that change metadata or bookkeeping, not the tensor's values.
_NOT_WRITES = frozenset((
    "requires_grad_", "share_memory_", "detach_", "rename_", "retain_grad_", "record_stream_",
    "_fix_weakref", "register_hook_",
))  # fmt: skip
_INPLACE: dict[Any, bool] = {}


def is_inplace(func: Any, kwargs: dict | None = None) -> bool:
    """Whether calling ``func`` writes into its first argument (by torch's naming)."""
    try:
        known = _INPLACE.get(func)
    except TypeError:  # an unhashable callable
        known = None
    if known is None:
        name = getattr(func, "__name__", "") or ""
        known = name in _INPLACE_DUNDERS or (
            name.endswith("_") and not name.startswith("__") and name not in _NOT_WRITES
        )
        try:
            _INPLACE[func] = known
        except TypeError:
            pass
    return known or bool(kwargs and kwargs.get("inplace") is True)


class _Entry(weakref.ref):
    """A weak reference to a fresh copy, with what is known of its writes: one object per
    watched copy (its callback is :meth:`Fresh._gone`)."""

    __slots__ = ("key", "ev", "index", "site", "used")
    # No __new__/__init__ of its own: weakref.ref's C ones are 8x faster (Fresh.watch sets
    # the fields).


class Fresh:
    """The fresh copies alive now (``fresh``) and the written index results that no call has
    used since (``written``); both dicts are keyed by ``id(tensor)`` and never replaced."""

    def __init__(self, note_error: Any) -> None:
        self.fresh: dict[int, _Entry] = {}
        self.written: dict[int, _Entry] = {}
        self._note_error = note_error
        self._callback = self._gone

    def events(self) -> list[CopyEvent]:
        return [entry.ev for entry in list(self.fresh.values())]

    def watch(self, out: torch.Tensor, ev: CopyEvent, index: bool) -> None:
        """Watch the result ``out`` of copy event ``ev`` until it dies."""
        fresh = self.fresh
        if len(fresh) >= _MAX_FRESH:
            return
        ev.inplace_writes = 0
        entry = _Entry(out, self._callback)
        entry.key = key = id(out)
        entry.ev = ev
        entry.index = index
        entry.site = None  # first in-place write
        entry.used = False  # a torch call used the result after its first write
        fresh[key] = entry

    def _gone(self, entry: _Entry) -> None:
        key = entry.key
        fresh = self.fresh
        if fresh.get(key) is not entry:
            return
        del fresh[key]
        written = self.written
        if written.get(key) is entry:
            del written[key]
            if not entry.used:  # written, then dropped unused: the write is lost
                entry.ev.write_site = entry.site

    def call(self, func: Any, args: tuple, kwargs: dict) -> None:
        """A torch call with a watched tensor among its arguments. Never raises."""
        try:
            target = args[0]
            inplace = is_inplace(func, kwargs)
            if self.written:
                self._uses(args, kwargs, target if inplace else None)
            entry = self.fresh.get(id(target))
            if entry is None or entry() is not target or not inplace:
                return
            entry.ev.inplace_writes = (entry.ev.inplace_writes or 0) + 1
            if entry.index and entry.site is None:
                found = user_frame(sys._getframe(1))
                entry.site = f"{found[0]}:{found[1]} {found[2]}" if found else "?"
                self.written[id(target)] = entry
        except Exception as err:
            self._note_error(err)

    def _uses(self, args: tuple, kwargs: dict, target: Any) -> None:
        written = self.written
        values = list(args)
        if kwargs:
            values.extend(kwargs.values())
        for value in values:
            items = value if isinstance(value, (list, tuple)) else (value,)
            for item in items:
                if item is target or not isinstance(item, _Tensor):
                    continue
                entry = written.get(id(item))
                if entry is not None and entry() is item:
                    entry.used = True
                    del written[id(item)]

    def clear(self) -> None:
        self.fresh.clear()
        self.written.clear()
