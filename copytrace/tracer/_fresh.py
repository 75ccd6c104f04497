"""In-place writes into fresh copies.

Every API-level copy into new storage (``clone``, ``.to``, ``x[idx]``...) is watched while its
result lives (no strong reference), and its event gets ``inplace_writes``:

* with the C++ observer (levels ``full``, ``api`` and ``lean``): how far the copy's version
  counter advanced while it lived. The counter is shared by the tensor and all its views and
  torch bumps it for every in-place op, so a write through a view or by ``out=`` counts, one
  op counts once, and the copy lives as long as one of its views does. The observer keeps a
  handle on the counter (not on the tensor or its storage) and reads it after the copy died;
  the count is final once no tensor shares the counter (:meth:`Fresh.events`, at each flush)
  or when tracing stops;
* with the Python fallback (no extension; Python cannot read a dead tensor's counter) and for
  inference tensors (no counter): the in-place calls on the copy itself that the function
  mode sees (a method or function whose name ends in ``_``, an in-place operator,
  ``__setitem__``, or ``inplace=True``); writes through a view or by ``out=`` are not seen.
  The copy is then followed by its identity and by torch's own weak handle on its storage
  (``UntypedStorage._weak_ref``, a c10 ``weak_intrusive_ptr`` on the StorageImpl, as
  ``torch.multiprocessing.reductions.StorageWeakRef``): nothing on the tensor (no Python
  weak reference, which ``torch.utils.swap_tensors`` refuses), and a storage's weak count is
  read by nothing in torch (``torch._C._storage_Use_Count`` counts strong references). The
  copy is taken for dead once its storage is (the copy and all its views are gone), found at
  the next watched call, step boundary, flush or stop (:meth:`Fresh.reap`).

Two hazards read that fact:

* ``redundant-copy``: a copy that was written is not interchangeable with another copy of the
  same source, so neither is redundant;
* ``lost-inplace-write``: advanced indexing returns a fresh gather, not a view, so
  ``x[idx].zero_()`` writes into a temporary. When such a result dies after an in-place write
  and no torch call used it after that write, the event gets ``write_site``, the
  ``file:line function`` of the first lost write.

The write site and the uses need the torch calls on the result. At levels ``full`` and
``api``, the function mode's: ``args[0]`` of every call while an index result (or a copy
counted by calls) is alive, and every argument (one level into lists and tuples, and keyword
values) only while a written index result waits for a use; a write made by ``out=`` or by C++
code below a torch call gives no write site there. At level ``lean`` (no mode), the C++
observer's write watch (``_native/watch_cb.cpp``, :meth:`Fresh.watched_op`): each outermost
aten op on the result or a view of it, written where the op's schema marks the argument
``Tensor(a!)`` (``out=`` included), read otherwise; inference tensors that are not index
results are counted by the API's own calls only.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch

from copytrace.tracer._callsite import user_frame
from copytrace.tracer._storage_ref import storage_ref

if TYPE_CHECKING:
    from copytrace.schema import CopyEvent

__all__ = ["Fresh", "INDEX_OPS", "WATCH_ALIAS", "WATCH_INDEX", "is_inplace"]

#: Ops whose result is a fresh gather of selected elements (``x[idx]`` is ``index``).
INDEX_OPS = ("index", "index_select", "masked_select", "take", "gather", "take_along_dim")

_Tensor = torch.Tensor
_NoTorchFunction = torch._C.DisableTorchFunction
_MAX_FRESH = 100_000
_MIN_KEPT = 4096
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
#: kinds of the C++ write watch (``watch_tensor``): a ``.data`` alias, an index result
WATCH_ALIAS, WATCH_INDEX = 1, 2


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


class _Entry:
    """A fresh copy that must see torch calls (an index result, or a copy without a version
    counter), with what is known of its writes: one object per such copy.

    Nothing is held on the copy itself where the C++ observer gives a handle on its version
    counter (``version``): the copy is named by ``key`` (its ``id``) and ``cdata`` (its
    TensorImpl's address), and is alive while another holder shares the counter; its death is
    found at the next watched call, step boundary, flush or stop (:meth:`Fresh.reap`). ``ref``:
    only for a copy without a counter (the Python fallback, inference tensors), torch's weak
    handle on its storage (:class:`~copytrace.tracer._storage_ref.StorageRef`): alive while
    the storage is. ``counter``: at level ``lean``, the key under which the C++ write watch
    knows the result (its version counter's address), else None."""

    __slots__ = ("key", "cdata", "ev", "index", "site", "used", "version", "ref", "counter")

    def is_(self, t: Any, final: Any) -> bool:
        """Whether this entry's copy is ``t`` (``final``: the observer's ``version_final``)."""
        with _NoTorchFunction():
            cdata = t._cdata
        return cdata == self.cdata and self.alive(final)

    def alive(self, final: Any) -> bool:
        ref = self.ref
        if ref is not None:
            return not ref.expired()
        return final(self.version) is None


class Fresh:
    """The fresh copies being watched.

    * ``kept``: ``(version counter handle, event)`` of the copies whose writes the C++
      observer's version counter gives (``version_of``/``version_final``/``version_delta``,
      set by ``_observer.engage``): no weak reference and no callback; an entry is final once
      no tensor shares the counter, found by :meth:`events` and when ``kept`` doubles;
    * ``fresh``: the others, by ``id(tensor)``, as :class:`_Entry` (index results, whose
      writes need a site and a use, and copies without a version counter: the Python fallback,
      inference tensors); ``written``: the written index results that no call has used since;
      ``index``: the live index results; ``counters``: at level lean, the index results by
      their key in the C++ write watch (``lean``: ``(watch_tensor, unwatch)`` of the observer).

    The dicts are never replaced (the C++ observer holds ``fresh`` and ``written``)."""

    def __init__(self, note_error: Any) -> None:
        self.kept: list[tuple[Any, CopyEvent]] = []
        self._limit = _MIN_KEPT
        self.fresh: dict[int, _Entry] = {}
        self.index: dict[int, _Entry] = {}
        self.written: dict[int, _Entry] = {}
        self.version_of: Any = None
        self.version_final: Any = None
        self.version_delta: Any = None
        #: builds ``kept``'s pairs: the observer's ``kept_pair`` (a pair the cycle collector
        #: does not track: the handle and the record are untracked), set with ``version_of``
        self.kept_pair: Any = None
        self.lean: tuple[Any, Any] | None = None
        #: the C++ observer's weak pointers on grad_fn nodes: (grad_fn_ref, grad_fn_of,
        #: grad_fn_alive), for the attached copies (watch/_retained.py); None on the fallback
        self.nodes: tuple[Any, Any, Any] | None = None
        self.counters: dict[int, _Entry] = {}
        self._note_error = note_error
        self._fresh_limit = _MIN_KEPT  # fresh entries listed before dead ones are dropped
        self._calls = 0  # watched calls since the last reap (many index results alive)

    def events(self) -> list[CopyEvent]:
        """The events of the copies still alive (their ``inplace_writes`` may still grow)."""
        self._prune()
        self.reap()
        return [entry.ev for entry in list(self.fresh.values())] + [ev for _, ev in self.kept]

    def watch(self, out: torch.Tensor, ev: CopyEvent, index: bool) -> None:
        """Watch the result ``out`` of copy event ``ev`` until it dies."""
        version_of = self.version_of
        if version_of is None:
            version = None
        else:
            version = version_of(out)
            if version is not None and not index:
                ev.inplace_writes = 0
                kept = self.kept
                kept.append(self.kept_pair(version, ev))
                if len(kept) >= self._limit:
                    self._prune()
                return
        fresh = self.fresh
        if len(fresh) >= _MAX_FRESH:
            return
        ev.inplace_writes = 0
        entry = _Entry()
        entry.key = key = id(out)
        entry.ev = ev
        entry.index = index
        entry.site = None  # first in-place write
        entry.used = False  # a torch call used the result after its first write
        entry.version = version
        entry.counter = None
        if version is None:  # no counter to follow it by: torch's weak handle on its storage
            entry.ref = storage_ref(out)
            if entry.ref is None:  # no single storage (sparse, nested): not followed
                return
        else:
            entry.ref = None
        with _NoTorchFunction():
            entry.cdata = out._cdata
        table = self.index
        if table and key in table:  # the same tensor watched again: its old entry ends now
            self._drop(table[key])
        fresh[key] = entry  # (a dead copy's entry under a reused id is replaced)
        if len(fresh) >= self._fresh_limit:
            self._prune_fresh()
        if index:
            table[key] = entry
            lean = self.lean
            if lean is not None and version is not None:  # the C++ write watch (level lean)
                entry.counter = counter = lean[0](out, WATCH_INDEX)
                if counter is not None:
                    self.counters[counter] = entry

    def _prune(self) -> None:
        """Give the copies that are gone (with all their views) their final count."""
        kept = self.kept
        if not kept:
            return
        final = self.version_final
        alive = []
        try:
            for item in kept:
                writes = final(item[0])
                if writes is None:
                    alive.append(item)
                else:
                    item[1].inplace_writes = writes
        except Exception as err:
            self._note_error(err)
            return
        self.kept = alive
        self._limit = max(_MIN_KEPT, 2 * len(alive))

    def _prune_fresh(self) -> None:
        """Drop the entries of copies found dead (amortised: run when ``fresh`` doubles)."""
        final = self.version_final
        for entry in [e for e in self.fresh.values() if not e.alive(final)]:
            if self.fresh.get(entry.key) is entry:
                if entry.index or entry.version is not None:
                    self._drop(entry)
                else:  # a copy counted by calls: done
                    del self.fresh[entry.key]
        self._fresh_limit = max(_MIN_KEPT, 2 * len(self.fresh))

    def reap(self) -> None:
        """Stop watching the index results found dead (no tensor shares their version counter,
        or on the Python fallback their storage, any more): their final count, a lost write's
        site, level lean's mode. Never raises."""
        final = self.version_final
        index = self.index
        if not index:
            return
        try:
            for entry in [e for e in index.values() if not e.alive(final)]:
                if self.fresh.get(entry.key) is entry:
                    self._drop(entry)
        except Exception as err:
            self._note_error(err)

    def _tick(self) -> None:
        if len(self.index) <= 8:
            self.reap()
            return
        self._calls += 1
        if self._calls >= 64:
            self._calls = 0
            self.reap()

    def _drop(self, entry: _Entry) -> None:
        """Stop watching ``entry`` (its copy died, or another event took its tensor)."""
        key = entry.key
        del self.fresh[key]
        if entry.version is not None:
            entry.ev.inplace_writes = self.version_delta(entry.version)
        written = self.written
        if written.get(key) is entry:
            del written[key]
            if not entry.used and not entry.alive(self.version_final):  # written, unused: lost
                entry.ev.write_site = entry.site
        table = self.index
        if table.get(key) is entry:
            del table[key]
        counter = entry.counter
        if counter is not None and self.counters.get(counter) is entry:
            del self.counters[counter]
            if self.lean is not None:
                self.lean[1](counter, WATCH_INDEX)

    def call(self, func: Any, args: tuple, kwargs: dict) -> None:
        """A torch call with a watched tensor among its arguments. Never raises."""
        try:
            if self.index:
                self._tick()
            target = args[0]
            inplace = is_inplace(func, kwargs)
            if self.written:
                self._uses(args, kwargs, target if inplace else None)
            entry = self.fresh.get(id(target))
            if entry is None or not inplace or not entry.is_(target, self.version_final):
                return
            if entry.version is None:  # no version counter: count the calls
                entry.ev.inplace_writes = (entry.ev.inplace_writes or 0) + 1
            if entry.index and entry.site is None:
                found = user_frame(sys._getframe(1))
                entry.site = f"{found[0]}:{found[1]} {found[2]}" if found else "?"
                self.written[id(target)] = entry
        except Exception as err:
            self._note_error(err)

    def watched_op(self, hits: tuple[tuple[int, bool, Any], ...]) -> None:
        """Level lean: an outermost aten op on watched tensors (the C++ write watch's
        ``(key, written, storage)`` hits): a write into an index result notes its site, a read
        of a written one is its use. Called from the watch's hook; never raises."""
        try:
            counters = self.counters
            if self.index:
                self._tick()
            written = self.written
            for key, wrote, _ in hits:
                entry = counters.get(key)
                if entry is None:
                    continue
                if wrote:
                    if entry.site is None:
                        found = user_frame(sys._getframe(2))
                        entry.site = f"{found[0]}:{found[1]} {found[2]}" if found else "?"
                        written[entry.key] = entry
                elif written.get(entry.key) is entry:
                    entry.used = True
                    del written[entry.key]
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
                if entry is not None and entry.is_(item, self.version_final):
                    entry.used = True
                    del written[id(item)]

    def finish(self) -> None:
        """Tracing stops: the final counts of the copies still alive; then watch nothing."""
        self.reap()  # lost writes into index results that died since the last call
        try:
            delta = self.version_delta
            for version, ev in self.kept:
                ev.inplace_writes = delta(version)
            for entry in list(self.fresh.values()):
                if entry.version is not None:
                    entry.ev.inplace_writes = delta(entry.version)
        except Exception as err:
            self._note_error(err)
        self.clear()

    def clear(self) -> None:
        self.kept = []
        self._limit = _MIN_KEPT
        self.fresh.clear()
        self._fresh_limit = _MIN_KEPT
        self.written.clear()
        self.index.clear()
        self.counters.clear()  # the C++ watch's keys go with set_watch_hook(None)
