"""``.data`` aliases and rebindings, and the backward passes that may read what they changed.

* A ``.data`` read of a tensor that requires grad is an alias with its own version counter:
  autograd cannot see an in-place write through it. While one is alive
  (:attr:`AliasWrites.aliases` non-empty) each in-place write into it is noted as a *pending
  write*: the dispatch mode calls :meth:`AliasWrites.before_op`, the C handler
  :meth:`AliasWrites.before_api`, and at level ``lean`` (no mode) the C++ observer's write
  watch :meth:`AliasWrites.watched_op` (``_native/watch_cb.cpp``: a RecordFunction callback,
  registered only while an alias or an index result is watched, reading each aten op's schema).
* A ``.data =`` rebinding is noted as a pending rebinding.
* At ``Tensor.backward``, ``torch.autograd.backward`` or ``torch.autograd.grad``
  (:meth:`AliasWrites.check_backward`), while one is pending, the graph about to run is walked
  before it runs: a node created before the write (smaller sequence number) whose saved tensor
  lives in the written storage computes a silently wrong gradient. The finding is written on
  the alias's event (``saved_by``, ``write_site``, ``src_name``: late facts, see
  :data:`copytrace.tracer.watch.LATE_FIELDS`).

The C++ observer reads ``writes``, ``rebinds`` and ``_backward_seq`` of the watch by name.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch

from copytrace.tracer._callsite import user_frame
from copytrace.tracer._fresh import WATCH_ALIAS
from copytrace.tracer._storage_ref import StorageRef, storage_key, storage_ref
from copytrace.tracer.watch._graph import (
    _backward_roots,
    _live_identities,
    _saved_tensors,
    _unpacked,
    _walk,
)

if TYPE_CHECKING:
    from copytrace.schema import CopyEvent
    from copytrace.tracer._fresh import Fresh
    from copytrace.tracer.watch import WatchHost

__all__ = ["AliasWrites"]

_Tensor = torch.Tensor
_seq_nr = torch._C._autograd._get_sequence_nr
_NoTorchFunction = torch._C.DisableTorchFunction


def _site(frame: Any) -> str | None:
    found = user_frame(frame)
    if found is None:
        return None
    return f"{found[0]}:{found[1]} {found[2]}"


def _identity(t: torch.Tensor) -> tuple[int, int]:
    """``(id(t), address of its TensorImpl)``: names ``t`` while it lives, holding nothing on it
    (``torch.utils.swap_tensors`` refuses a tensor with a weak reference, Python's or c10's)."""
    with _NoTorchFunction():
        return id(t), t._cdata


class _Alias:
    """A live ``.data`` alias of a tensor that requires grad (or, for a pending rebinding,
    the rebound tensor), held by nothing on the tensor itself: ``ident`` is its
    :func:`_identity`, ``version`` the C++ observer's handle on its version counter (the
    alias is alive while another holder shares the counter: ``version_final`` is None).
    ``ref``: only on the Python fallback, which has no counter handle, torch's weak handle on
    its storage (:class:`~copytrace.tracer._storage_ref.StorageRef`).
    ``src``: the :func:`_identity` of the alias's source. ``counter``: at level lean, its key in
    the C++ write watch."""

    __slots__ = ("ident", "version", "ref", "src", "ev", "counter")

    def __init__(
        self, ident: tuple[int, int], version: Any, ref: Any, src: tuple[int, int], ev: CopyEvent
    ) -> None:
        self.ident = ident
        self.version = version
        self.ref = ref
        self.src = src
        self.ev = ev
        self.counter: int | None = None


class _Pending:
    """An in-place write through a ``.data`` alias, or a ``.data =`` rebinding, not yet
    checked against a backward pass."""

    __slots__ = ("ref", "marker", "site", "alias")

    def __init__(self, ref: StorageRef, marker: int, site: str | None, alias: _Alias) -> None:
        self.ref = ref  # the written storage (write) or the rebound tensor's (rebind)
        self.marker = marker  # autograd sequence number at the write: older nodes are < it
        self.site = site
        self.alias = alias


def _written_args(func: Any) -> tuple[tuple[int, str], ...]:
    try:
        arguments = func._schema.arguments
    except AttributeError:
        return ()
    return tuple(
        (i, a.name)
        for i, a in enumerate(arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )


def _written_api(func: Any) -> bool:
    """Whether torch API callable ``func`` writes into its first argument (PyTorch's naming:
    a trailing underscore is in place; ``__setitem__`` and the ``__i*__`` operators too)."""
    name = getattr(func, "__name__", "") or ""
    if name.startswith("__"):
        return name in _INPLACE_DUNDERS
    return name.endswith("_")


_INPLACE_DUNDERS = frozenset(
    "__setitem__ __iadd__ __isub__ __imul__ __itruediv__ __ifloordiv__ __imod__ __ipow__ "
    "__imatmul__ __iand__ __ior__ __ixor__ __ilshift__ __irshift__".split()
)


class AliasWrites:
    """The ``.data`` watches of :class:`~copytrace.tracer.watch.Watch` (a mixin: the state is
    the watch's, set up in its ``__init__``)."""

    host: WatchHost
    aliases: dict[int, _Alias]
    alias_counters: dict[int, _Alias]
    writes: dict[int, _Pending]
    rebinds: dict[int, _Pending]
    _written: dict[Any, Any]
    snap_watch: dict[tuple[int, int], list[Any]]
    _backward_seq: int
    copies: Fresh
    _alias_calls: int
    surprise: dict
    surprise_counters: dict
    surprise_write: Any
    surprise_counter_write: Any

    def _watch_alias(self, alias: torch.Tensor, src: torch.Tensor, ev: CopyEvent) -> None:
        ident = _identity(alias)
        key = ident[0]
        aliases = self.aliases
        copies = self.copies
        version_of = copies.version_of
        version = version_of(alias) if version_of is not None else None
        ev.inplace_writes = 0
        # the source (a parameter, which the program may swap_tensors) by identity only
        if version is not None:
            # the alias by identity and its own version counter
            entry = aliases[key] = _Alias(ident, version, None, _identity(src), ev)
            if copies.lean is not None:  # level lean: the C++ write watch sees its writes
                entry.counter = counter = copies.lean[0](alias, WATCH_ALIAS)
                if counter is not None:
                    self.alias_counters[counter] = entry
        else:
            # the Python fallback (no counter handle): its identity and torch's weak handle on
            # its storage; found dead by a search of the heap (prune_aliases)
            ref = storage_ref(alias)
            if ref is None:
                return
            aliases[key] = _Alias(ident, None, ref, _identity(src), ev)
        self._watch_writes(True)

    def _alias_of(self, t: torch.Tensor) -> _Alias | None:
        """The watched alias ``t`` is, if any (a dead one found on the way is dropped)."""
        entry = self.aliases.get(id(t))
        if entry is None:
            return None
        with _NoTorchFunction():
            cdata = t._cdata
        if entry.ref is not None:  # the Python fallback: by identity while its storage lives
            return entry if entry.ident[1] == cdata and not entry.ref.expired() else None
        if self.copies.version_final(entry.version) is not None:  # its tensor died
            self.prune_aliases()
            return None
        return entry if entry.ident[1] == cdata else None

    def prune_aliases(self) -> None:
        """Drop the aliases that died (no tensor shares their version counter any more); stop
        watching writes when none is left. No callback tells an alias's death: with the C++
        observer this runs at every watched call (every 64th while more than 8 aliases live),
        at step boundaries and at each flush; on the Python fallback (no counter) at step
        boundaries and flushes, by a search of the heap for the aliases' identities."""
        aliases = self.aliases
        if not aliases:
            return
        final = self.copies.version_final
        if final is None:
            live = _live_identities()
            dead = [k for k, e in aliases.items() if e.ref.expired() or e.ident not in live]
        else:
            dead = [k for k, e in aliases.items() if final(e.version) is not None]
        for key in dead:
            self._unwatch_counter(aliases.pop(key))
        if dead and not aliases and not self.surprise:
            self._watch_writes(False)

    def _unwatch_counter(self, entry: _Alias) -> None:
        counter = entry.counter
        if counter is not None and self.alias_counters.get(counter) is entry:
            del self.alias_counters[counter]
            lean = self.copies.lean
            if lean is not None:
                lean[1](counter, WATCH_ALIAS)

    def _tick_aliases(self) -> None:
        if len(self.aliases) <= 8:
            self.prune_aliases()
            return
        self._alias_calls += 1
        if self._alias_calls >= 64:
            self._alias_calls = 0
            self.prune_aliases()

    def _watch_writes(self, on: bool) -> None:
        """Have every torch call checked for a write (only while a ``.data`` alias of a tensor
        that requires grad is alive): the recorder tells its C handler and level lean's mode."""
        try:
            self.host.watch_writes(on)
        except Exception as err:  # interpreter shutdown
            self.host.note_error(err)

    def _watch_rebind(self, dst: torch.Tensor, ev: CopyEvent) -> None:
        """A ``.data =`` rebinding of ``dst`` (a parameter, which the program may
        ``swap_tensors``): followed by the storage it now holds and its identity."""
        site = f"{ev.file}:{ev.line} {ev.function}" if ev.file else None
        ident = _identity(dst)
        with _NoTorchFunction():
            key = storage_key(dst)  # no Python storage object (_storage_ref)
        if key is None:
            return
        entry = _Alias(ident, None, None, ident, ev)
        self.rebinds[key] = _Pending(StorageRef(key), _seq_nr(), site, entry)

    # -- dispatch mode, only while a `.data` alias is alive --------------------------------
    def before_op(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Note an in-place write through a watched ``.data`` alias. Never raises."""
        try:
            written = self._written.get(func)
            if written is None:
                written = self._written[func] = _written_args(func)
            if self.copies.version_final is not None:
                self._tick_aliases()
            if not written:
                return
            aliases, snaps = self.aliases, self.snap_watch
            for index, name in written:
                value = args[index] if index < len(args) else kwargs.get(name)
                targets = value if isinstance(value, (list, tuple)) else (value,)
                for t in targets:
                    if not isinstance(t, _Tensor):
                        continue
                    if snaps or aliases:
                        self._root_write(t, snaps, aliases)
                    if self.surprise:  # an alias result watched for alias-write
                        # no local of this frame refers to t's base: surprise_write counts
                        # the references to a view's input (_surprise._held)
                        self.surprise_write(t, sys._getframe(1))
        except Exception as err:
            self.host.note_error(err)

    def _root_write(self, t: torch.Tensor, snaps: dict, aliases: dict) -> None:
        """A write into ``t`` seen by the dispatch mode: into its root (``t._base`` or ``t``),
        a watched ``state_dict()`` alias or source (``snaps``) or ``.data`` alias
        (``aliases``). Its references to the root end when it returns."""
        base = t._base
        root = t if base is None else base
        if snaps:  # the fallback's state_dict() aliases and their sources
            for snap in snaps.get(_identity(root), ()):
                snap.written = True
        entry = self._alias_of(root) if aliases else None
        if entry is not None:
            self._note_write(entry, root)

    def before_api(self, func: Any, args: tuple, kwargs: dict | None) -> None:
        """The API-level form of :meth:`before_op` (the C++ observer's path): a torch call
        that writes in place (``add_``, ``zero_``, ``__setitem__``, ``__iadd__``, ``out=``)
        into a watched ``.data`` alias. Never raises."""
        try:
            written = self._written.get(func)
            if written is None:
                written = self._written[func] = _written_api(func)
            if self.copies.version_final is not None:
                self._tick_aliases()
            if not self.aliases and not self.surprise:
                return
            targets: list[Any] = []
            if written and args:
                targets.append(args[0])
            if kwargs:
                out = kwargs.get("out")
                targets.extend(out if isinstance(out, (list, tuple)) else (out,))
            for t in targets:
                if not isinstance(t, _Tensor):
                    continue
                if self.surprise:  # an alias result watched for alias-write
                    self.surprise_write(t, sys._getframe(1))
                if not self.aliases:
                    continue
                base = t._base
                root = t if base is None else base
                entry = self._alias_of(root)
                if entry is not None:
                    self._note_write(entry, root)
        except Exception as err:
            self.host.note_error(err)

    def _note_write(self, entry: _Alias, alias: torch.Tensor) -> None:
        with _NoTorchFunction():
            key = storage_key(alias)
        self._pending_write(entry, key, _site(sys._getframe(2)))

    def _pending_write(self, entry: _Alias, key: int | None, site: str | None) -> None:
        """A write through ``entry``'s alias into the storage named ``key`` (its StorageImpl's
        address, :mod:`copytrace.tracer._storage_ref`; None: counted, not followed)."""
        ev = entry.ev
        ev.inplace_writes = (ev.inplace_writes or 0) + 1
        if key is not None:
            self.writes[key] = _Pending(StorageRef(key), _seq_nr(), site, entry)

    # -- the C++ write watch (level lean) -----------------------------------------------------
    def watched_op(self, hits: tuple[tuple[int, bool, Any], ...]) -> None:
        """An outermost aten op on watched tensors (``_native/watch_cb.cpp``): ``(key, written,
        storage)`` per watched version counter among its inputs, ``storage`` the written
        alias's key (its StorageImpl's address; else None). A write into a ``.data`` alias is a pending write; the index
        results' hits go to :meth:`Fresh.watched_op`. Never raises."""
        try:
            if self.aliases:
                self._tick_aliases()
            counters = self.alias_counters
            surprise = self.surprise_counters
            for key, written, storage in hits:
                entry = counters.get(key)
                if entry is not None and written and storage is not None:
                    self._pending_write(entry, storage, _site(sys._getframe(1)))
                if written and surprise and key in surprise:  # alias-write (watch/_surprise.py)
                    self.surprise_counter_write(key, sys._getframe(1))
        except Exception as err:
            self.host.note_error(err)
        if self.copies.counters:
            self.copies.watched_op(hits)

    # -- backward ---------------------------------------------------------------------------
    def backward(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run a backward entry point; first check the graph against pending writes."""
        self.check_backward(func, args, kwargs)
        return func(*args, **kwargs)

    def check_backward(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Check the graph a backward entry point is about to run. Never raises."""
        try:
            self._note_backward(func, args, kwargs)
        except Exception as err:
            self.host.note_error(err)
        if self.writes or self.rebinds:
            try:
                self._check_backward(func, args, kwargs)
            except Exception as err:
                self.host.note_error(err)

    def _note_backward(self, func: Any, args: tuple, kwargs: dict) -> None:
        for root in _backward_roots(func, args, kwargs):
            seq = root._sequence_nr()
            if seq > self._backward_seq:
                self._backward_seq = seq

    def _check_backward(self, func: Any, args: tuple, kwargs: dict) -> None:
        roots = _backward_roots(func, args, kwargs)
        writes = {k: w for k, w in self.writes.items() if not w.ref.expired()}
        rebinds = {k: p for k, p in self.rebinds.items() if not p.ref.expired()}
        markers = [p.marker for p in writes.values()] + [p.marker for p in rebinds.values()]
        if not markers:
            self.writes, self.rebinds = {}, {}
            return
        newest = max(markers)
        hits: set[int] = set()
        min_seq = None
        for node in _walk(roots):
            if type(node).__name__ == "AccumulateGrad":
                continue
            seq = node._sequence_nr()
            if min_seq is None or seq < min_seq:
                min_seq = seq
            if seq >= newest:
                continue
            for name, saved in _saved_tensors(node):
                key = storage_key(saved)
                write = writes.get(key)
                if write is not None and seq < write.marker and write.ref.holds(key):
                    self._hazard(write, node, name)
                    hits.add(id(write))
                pending = rebinds.get(key)
                if pending is not None and seq < pending.marker and pending.ref.holds(key):
                    unpacked = _unpacked(node, name)
                    if unpacked is not None and _identity(unpacked) == pending.alias.ident:
                        self._hazard(pending, node, name)
                        hits.add(id(pending))

        def keep(p: _Pending) -> bool:
            # Drop what was found, what died, and what only newer graphs could use.
            if id(p) in hits or p.ref.expired():
                return False
            return min_seq is not None and min_seq < p.marker

        self.writes = {k: p for k, p in self.writes.items() if keep(p)}
        self.rebinds = {k: p for k, p in self.rebinds.items() if keep(p)}

    def _hazard(self, pending: _Pending, node: Any, name: str) -> None:
        ev = pending.alias.ev
        label = f"{type(node).__name__}.{name}"
        if label not in ev.saved_by:
            ev.saved_by = (*ev.saved_by, label)
        if ev.write_site is None:
            ev.write_site = pending.site
        if ev.src_name is None:
            # the alias's source, or the rebound tensor: (id, TensorImpl address)
            ev.src_name = self.host.owner_name_by_identity(*pending.alias.src)
