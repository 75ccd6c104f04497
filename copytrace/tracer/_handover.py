"""``state_dict()`` handovers that leave two live holders sharing storage.

``Optimizer.state_dict()`` returns references to the live state tensors, and
``Optimizer.load_state_dict()`` keeps them when device and dtype already match (a no-op
``.to``); ``Module.load_state_dict(sd, assign=True)`` makes parameters over the storages of
``sd``; ``LRScheduler.load_state_dict`` takes the values as they are. After
``b.load_state_dict(a.state_dict())`` the two objects then share tensors, and an in-place
update by one (``a.step()``) silently changes the other.

While tracing, ``state_dict`` and ``load_state_dict`` of ``nn.Module``, ``Optimizer`` and
``LRScheduler`` (and of every subclass that calls them) are wrapped:

* ``state_dict()`` (the outermost call) notes, for each tensor it returns, its storage and
  the object it came from (the *source*), by ``(id, class)``: nothing refers to it;
* ``load_state_dict(sd)`` then looks for tensors of the receiver that share storage with a
  tensor of ``sd`` whose source is another live object: a *handover*. The events of the
  load that made those aliases (the no-op ``.to`` of the optimizer's load path) are marked
  ``snapshot``; where the load made none, the ``state_dict()`` aliases are; where neither
  exists, one ``load_state_dict`` alias event is recorded.

A write into a shared storage is seen by version counter (the C++ observer's handles on the
counters of the tensors the load left there) or, on the Python fallback, by the dispatch
mode (a write into one of those tensors, by identity, or into a view of one). At a step end
after such a write the two holders are found again on the garbage collector's heap (by
``(id, class)``; whichever object is found must itself hold a tensor on the storage, whose
address copytrace's weak handle keeps from reuse): while both still hold one, the events are
marked ``stale``. The source is found the same way at the load (a source that is gone hands
nothing over). Nothing here refers to a tensor, a storage or a holder (no weak reference
either); errors are counted, never raised.
"""

from __future__ import annotations

import functools
import gc
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from copytrace._threads import current_name
from copytrace.schema import CopyEvent
from copytrace.tracer._callsite import user_frame
from copytrace.tracer._hide import hide_frames
from copytrace.tracer._storage_ref import StorageRef, storage_key

if TYPE_CHECKING:
    from copytrace.tracer._recorder import Recorder

__all__ = ["Handovers", "install", "remove"]

_Tensor = torch.Tensor
_NoTorchFunction = torch._C.DisableTorchFunction
_MAX_TENSORS = 100_000  # per state dict walked
_MAX_HANDOVERS = 10_000
_DEPTH = 6  # container nesting followed inside a state dict or a holder


def _tensors_in(obj: Any, depth: int = _DEPTH, out: list | None = None) -> list[_Tensor]:
    """Tensors inside nested dicts, lists and tuples (not inside other objects)."""
    out = [] if out is None else out
    if len(out) >= _MAX_TENSORS:
        return out
    if isinstance(obj, _Tensor):
        out.append(obj)
    elif depth > 0 and isinstance(obj, dict):
        for value in list(obj.values()):
            _tensors_in(value, depth - 1, out)
    elif depth > 0 and isinstance(obj, (list, tuple)):
        for value in obj:
            _tensors_in(value, depth - 1, out)
    return out


def _held_by(holder: Any) -> list[_Tensor]:
    """The tensors ``holder`` keeps: a module's parameters and buffers, an optimizer's state
    and param-group values, and tensors in containers among an object's attributes."""
    out: list[_Tensor] = []
    if isinstance(holder, torch.nn.Module):
        out.extend(holder.parameters())
        out.extend(b for b in holder.buffers() if b is not None)
    elif isinstance(holder, torch.optim.Optimizer):
        _tensors_in(list(holder.state.values()), 3, out)
        for group in holder.param_groups:
            _tensors_in([v for k, v in group.items() if k != "params"], 2, out)
        return out
    attrs = getattr(holder, "__dict__", None)
    if isinstance(attrs, dict):
        for name, value in list(attrs.items()):
            if not name.startswith("_") or name == "_last_lr":
                _tensors_in(value, 3, out)
    return out


def _storage(t: _Tensor) -> int | None:
    """The key of ``t``'s storage (its StorageImpl's address; no Python storage object made,
    :mod:`copytrace.tracer._storage_ref`); None where it has no single storage."""
    return storage_key(t)


def _find(idents: set[tuple[int, type]]) -> dict[int, Any]:
    """The live objects named by ``(id, class)`` in ``idents``, found on the garbage
    collector's heap (a pass over it: only at an aliased load and at the step end after a
    write into a handed-over storage). ``id -> object``; a name whose object is gone is
    missing (one of the same class that took its address is found instead: every caller
    then checks what it holds)."""
    want = dict(idents)
    found: dict[int, Any] = {}
    for obj in gc.get_objects():
        cls = want.get(id(obj))
        if cls is not None and type(obj) is cls:
            found[id(obj)] = obj
    return found


def _holds(holder: Any, keys: set[int]) -> set[int]:
    """Which of the storages ``keys`` (each kept from reuse by copytrace's handle) a tensor
    of ``holder`` is on."""
    out: set[int] = set()
    for t in _held_by(holder):
        storage = _storage(t)
        if storage is not None and storage in keys:
            out.add(storage)
    return out


class _Shared:
    """One storage of a handover: torch's weak handle on it, and how a write into it is seen:
    with the C++ observer its handles on the version counters of the tensors the load left
    on it (``versions``); on the Python fallback ``written``, set by the dispatch mode when it
    sees a write into a tensor with one of the identities ``idents`` (``(id, TensorImpl
    address)``) or into a view of one."""

    __slots__ = ("ref", "versions", "idents", "written")

    def __init__(self, ref: StorageRef) -> None:
        self.ref = ref
        self.versions: list[Any] = []
        self.idents: list[tuple[int, int]] = []
        self.written = False


class _Handover:
    """A load that left ``src`` and ``dst`` (each named by ``(id, class)``: nothing refers
    to either) sharing the storages ``shared``; ``events`` are marked ``stale`` when one is
    written while both still hold a tensor on it."""

    __slots__ = ("src", "dst", "shared", "events")

    def __init__(self, src: tuple[int, type], dst: tuple[int, type]) -> None:
        self.src = src
        self.dst = dst
        self.shared: dict[int, _Shared] = {}
        self.events: list[CopyEvent] = []


class Handovers:
    """The ``state_dict()`` sources seen and the handovers being watched, of one trace."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        #: storage key -> (weak handle on the storage, (id, class) of its source, snapshot
        #: events)
        self.sources: dict[int, tuple[StorageRef, tuple[int, type], list[CopyEvent]]] = {}
        self._limit = 4096
        self.watched: list[_Handover] = []

    def events(self) -> list[CopyEvent]:
        return [ev for h in self.watched for ev in h.events]

    # -- state_dict() -------------------------------------------------------------------------
    def returned(self, source: Any, result: Any, first_event: int) -> None:
        """``source.state_dict()`` returned ``result``; events from ``first_event`` on (in
        the recorder's buffer) were made by it."""
        src = (id(source), type(source))
        snaps: dict[int, list[CopyEvent]] = {}
        ids = self.rec.watch.ids
        for ev in self.rec.events[first_event:]:
            if ev.snapshot and ev.dst_storage is not None:
                snaps.setdefault(ev.dst_storage, []).append(ev)
        sources = self.sources
        if len(sources) >= self._limit:
            self.sources = sources = {k: v for k, v in sources.items() if not v[0].expired()}
            self._limit = max(4096, 2 * len(sources))
        for t in _tensors_in(result):
            storage = _storage(t)
            if storage is not None:
                sid = ids.of(t)
                sources[storage] = (StorageRef(storage), src, snaps.get(sid, []))

    # -- load_state_dict() ----------------------------------------------------------------------
    def loaded(self, receiver: Any, given: dict[int, _Tensor], buffer: list, first: int) -> None:
        """``receiver.load_state_dict(sd)`` returned; ``given`` maps the storages of ``sd``'s
        tensors; ``buffer[first:]`` are the events the load made."""
        by_source: dict[tuple[int, type], tuple[dict[int, StorageRef], list[_Tensor]]] = {}
        for t in _held_by(receiver):
            storage = _storage(t)
            if storage is None or storage not in given:
                continue
            entry = self.sources.get(storage)
            if entry is None or not entry[0].holds(storage):
                continue  # not from a live state_dict() (torch.load, a copy...)
            if entry[1][0] == id(receiver):
                continue  # the receiver's own state (or a dead source's at its address)
            group = by_source.setdefault(entry[1], ({}, []))
            group[0][storage] = entry[0]
            group[1].append(t)
        if not by_source:
            return
        live = _find(set(by_source))  # a source that is gone hands nothing over
        site = user_frame(sys._getframe(1))  # the user's load_state_dict call
        load_site = f"{site[0]}:{site[1]} {site[2]}" if site is not None else None
        dst = (id(receiver), type(receiver))
        for src, (storages, tensors) in by_source.items():
            if len(self.watched) >= _MAX_HANDOVERS:
                return
            source = live.get(src[0])
            if source is None:
                continue
            h = _Handover(src, dst)
            held = _holds(source, set(storages))
            for key, ref in storages.items():
                if key in held:
                    h.shared[key] = self._follow(ref, key, tensors, given)
            del source
            if not h.shared:
                continue
            h.events = self._evidence(receiver, tensors, buffer[first:], storages)
            for ev in h.events:
                ev.snapshot = True
                ev.load_site = load_site
            self.watched.append(h)
            self._watch_idents([h])

    def _follow(
        self, ref: StorageRef, key: int, tensors: list[_Tensor], given: dict[int, _Tensor]
    ) -> _Shared:
        """Watch the writes into storage ``key``: through the receiver's tensors on it and the
        state dict's (which share the source's version counters, or are its tensors)."""
        shared = _Shared(ref)
        version_of = self.rec.watch.copies.version_of  # the C++ observer's counter handles
        on = [t for t in tensors if _storage(t) == key] + [given[key]]
        for t in on:
            if version_of is not None:
                handle = version_of(t)
                if handle is not None:  # None: an inference tensor, no counter
                    shared.versions.append(handle)
            else:
                shared.idents.append((id(t), t._cdata))
        return shared

    def _evidence(
        self, receiver: Any, tensors: list[_Tensor], made: list, storages: dict[int, Any]
    ) -> list[CopyEvent]:
        ids = self.rec.watch.ids
        wanted = {ids.of(t): t for t in tensors}
        found: list[CopyEvent] = []
        for ev in made:
            if ev.dst_storage in wanted and ev.alias and not ev.group:
                found.append(ev)
                wanted.pop(ev.dst_storage)
        for key in list(wanted):
            entry = self.sources.get(_storage(wanted[key]))
            snaps = [e for e in entry[2] if not e.stale] if entry is not None else []
            if snaps:
                found.extend(snaps)
                wanted.pop(key)
        for t in wanted.values():
            found.append(self._alias_event(receiver, t))
        return found

    def _alias_event(self, receiver: Any, t: _Tensor) -> CopyEvent:
        """An event for an alias the load made without any recorded call."""
        from copytrace.tracer._recorder import _device_str, _dtype_name, _nbytes, _shape

        rec = self.rec
        ev = CopyEvent(op="load_state_dict", alias=True)
        ev.seq = len(rec.events) + rec.dropped
        ev.start_ns = ev.end_ns = time.perf_counter_ns()
        ev.shape = _shape(t)
        ev.dtype = ev.src_dtype = _dtype_name(t.dtype)
        ev.src_device = ev.dst_device = _device_str(t.device)
        ev.bytes_logical = _nbytes(t)
        ev.src_storage = ev.dst_storage = rec.watch.ids.of(t)
        ev.src_version = ev.dst_version = t._version
        site = user_frame(sys._getframe(1))
        if site is not None:
            ev.file, ev.line, ev.function, _ = site
        ev.via = f"{type(receiver).__name__}.load_state_dict"
        ev.step = rec.step_index
        ev.module = rec.modules.current(sys._getframe(1))
        ev.phase = "other"
        ev.thread_id, ev.thread_name = threading.get_ident(), current_name()
        rec._append(ev)
        return ev

    # -- step ends ------------------------------------------------------------------------------
    def check(self) -> None:
        """Mark handovers whose shared storage was written while both sides held it: the sides
        are found again (on the heap) only after such a write."""
        delta = self.rec.watch.copies.version_delta
        written: list[tuple[_Handover, set[int]]] = []
        keep = []
        for h in self.watched:
            h.shared = {k: s for k, s in h.shared.items() if not s.ref.expired()}
            if not h.shared:
                continue  # every shared storage is gone
            keys = {
                k for k, s in h.shared.items()
                if s.written or any(delta(v) != 0 for v in s.versions)
            }  # fmt: skip
            if keys:
                written.append((h, keys))
            else:
                keep.append(h)
        if written:
            live = _find({side for h, _ in written for side in (h.src, h.dst)})
            for h, keys in written:
                src, dst = live.get(h.src[0]), live.get(h.dst[0])
                if src is None or dst is None:
                    continue  # one side is gone
                if _holds(src, keys) & _holds(dst, keys):
                    for ev in h.events:
                        ev.stale = True
                    continue
                # the writer held it alone (the other side let go): the rest stays watched
                h.shared = {k: s for k, s in h.shared.items() if k not in keys}
                if h.shared:
                    keep.append(h)
            del live, src, dst
        self.watched = keep
        self._watch_idents(keep)

    def _watch_idents(self, handovers: list[_Handover]) -> None:
        """The Python fallback: put the identities of the handed-over tensors in the
        watch's write table (rebuilt from its own snapshots at each step end)."""
        table = self.rec.watch.snap_watch
        for h in handovers:
            for shared in h.shared.values():
                for ident in shared.idents:
                    table.setdefault(ident, []).append(shared)

    def clear(self) -> None:
        self.sources.clear()
        self.watched.clear()


# --- the wrappers installed while a trace is active ------------------------------------------
_ORIGINALS: dict[tuple[type, str], Any] = {}
_BUSY = [0]


def _classes() -> list[type]:
    out: list[type] = [torch.nn.Module, torch.optim.Optimizer]
    scheduler = getattr(torch.optim.lr_scheduler, "LRScheduler", None)
    if scheduler is not None:
        out.append(scheduler)
    return out


def _wrap_state_dict(orig: Any, here: Any, active: Any) -> Any:
    def state_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
        rec = here()
        if rec is None or _BUSY[0] or rec.active is not None:
            try:
                return orig(self, *args, **kwargs)
            except BaseException as err:  # the program's: its traceback as untraced
                hide_frames(err, active())
                raise
        buffer, first = rec.events, len(rec.events)
        _BUSY[0] += 1
        try:
            result = orig(self, *args, **kwargs)
        except BaseException as err:
            hide_frames(err, active())
            raise
        finally:
            _BUSY[0] -= 1
        try:
            if rec.events is buffer:
                with _NoTorchFunction():  # no other mode sees copytrace's reads
                    rec.watch.handovers.returned(self, result, first)
        except Exception as err:
            rec.note_error(err)
        return result

    return functools.wraps(orig)(state_dict)


def _wrap_load(orig: Any, here: Any, active: Any) -> Any:
    def load_state_dict(self: Any, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        rec = here()
        if rec is None or _BUSY[0] or rec.active is not None:
            try:
                return orig(self, state_dict, *args, **kwargs)
            except BaseException as err:  # the program's: its traceback as untraced
                hide_frames(err, active())
                raise
        given: dict[int, _Tensor] = {}
        try:
            with _NoTorchFunction():  # no other mode sees copytrace's reads
                for t in _tensors_in(state_dict):
                    storage = _storage(t)
                    if storage is not None:
                        given[storage] = t
        except Exception as err:
            rec.note_error(err)
        buffer, first = rec.events, len(rec.events)
        _BUSY[0] += 1
        try:
            result = orig(self, state_dict, *args, **kwargs)
        except BaseException as err:
            hide_frames(err, active())
            raise
        finally:
            _BUSY[0] -= 1
        try:
            if given and rec.events is buffer:
                with _NoTorchFunction():
                    rec.watch.handovers.loaded(self, given, buffer, first)
        except Exception as err:
            rec.note_error(err)
        finally:
            given.clear()
        return result

    return functools.wraps(orig)(load_state_dict)


_WRAPPERS: dict[tuple[type, str], tuple[Any, Any, Any]] = {}


def wrapper_codes() -> list[Any]:
    """Code objects of the wrappers (dynamo skips their frames inside compiled regions)."""
    return [
        c for f in (_wrap_state_dict, _wrap_load) for c in f.__code__.co_consts
        if hasattr(c, "co_code")
    ]  # fmt: skip


def install(here: Any, active: Any) -> None:
    """Wrap ``state_dict`` / ``load_state_dict``; ``here()`` gives the active recorder on
    the traced thread, or None; ``active()`` the running trace's recorder on any thread (it
    counts a traceback the wrappers cannot relink, :func:`~copytrace.tracer._hide.hide_frames`)."""
    for cls in _classes():
        for name, wrap in (("state_dict", _wrap_state_dict), ("load_state_dict", _wrap_load)):
            orig = cls.__dict__.get(name)
            if orig is None or (cls, name) in _ORIGINALS:
                continue
            _ORIGINALS[(cls, name)] = orig
            # made once per original and ``here``: installing again (after each compiled
            # call, see _compiled.py) only sets the attribute
            made = _WRAPPERS.get((cls, name))
            if made is None or made[0] is not orig or made[1] is not here:
                made = _WRAPPERS[(cls, name)] = (orig, here, wrap(orig, here, active))
            setattr(cls, name, made[2])


def remove() -> None:
    for (cls, name), orig in list(_ORIGINALS.items()):
        setattr(cls, name, orig)
    _ORIGINALS.clear()
