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
  the object it came from (the *source*), weakly;
* ``load_state_dict(sd)`` then looks for tensors of the receiver that share storage with a
  tensor of ``sd`` whose source is another live object: a *handover*. The events of the
  load that made those aliases (the no-op ``.to`` of the optimizer's load path) are marked
  ``snapshot``; where the load made none, the ``state_dict()`` aliases are; where neither
  exists, one ``load_state_dict`` alias event is recorded.

At each step end a handover is checked by storage and version counter, not by the objects
``state_dict()`` returned (they are usually gone): while both holders still hold a tensor on
the shared storage, a moved version counter on either side marks the events ``stale``.
Nothing here keeps a tensor, a storage or a holder alive; errors are counted, never raised.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch

from copytrace.schema import CopyEvent
from copytrace.tracer._callsite import user_frame
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


def _versions(holder: Any, keys: set[int]) -> dict[int, int]:
    """``storage key -> sum of the version counters`` of ``holder``'s tensors on ``keys``."""
    out: dict[int, int] = {}
    seen: set[int] = set()
    for t in _held_by(holder):
        if id(t) in seen:
            continue
        seen.add(id(t))
        storage = _storage(t)
        if storage is None or storage not in keys:
            continue
        try:
            version = t._version
        except Exception:  # inference tensors have no version counter
            continue
        out[storage] = out.get(storage, 0) + version
    return out


class _Handover:
    __slots__ = ("src", "dst", "storages", "base", "events")

    def __init__(self, src: Any, dst: Any, storages: dict[int, StorageRef]) -> None:
        self.src = weakref.ref(src)
        self.dst = weakref.ref(dst)
        self.storages = storages  # storage key -> torch's weak handle on it
        self.base: dict[int, int] = {}
        self.events: list[CopyEvent] = []


class Handovers:
    """The ``state_dict()`` sources seen and the handovers being watched, of one trace."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        #: storage key -> (weak handle on the storage, weakref to its source, snapshot events)
        self.sources: dict[int, tuple[StorageRef, weakref.ref, list[CopyEvent]]] = {}
        self._limit = 4096
        self.watched: list[_Handover] = []

    def events(self) -> list[CopyEvent]:
        return [ev for h in self.watched for ev in h.events]

    # -- state_dict() -------------------------------------------------------------------------
    def returned(self, source: Any, result: Any, first_event: int) -> None:
        """``source.state_dict()`` returned ``result``; events from ``first_event`` on (in
        the recorder's buffer) were made by it."""
        try:
            src_ref = weakref.ref(source)
        except TypeError:
            return
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
                sources[storage] = (StorageRef(storage), src_ref, snaps.get(sid, []))

    # -- load_state_dict() ----------------------------------------------------------------------
    def loaded(self, receiver: Any, given: dict[int, _Tensor], buffer: list, first: int) -> None:
        """``receiver.load_state_dict(sd)`` returned; ``given`` maps the storages of ``sd``'s
        tensors; ``buffer[first:]`` are the events the load made."""
        by_source: dict[int, tuple[Any, dict[int, StorageRef], list[_Tensor]]] = {}
        site = user_frame(sys._getframe(1))  # the user's load_state_dict call
        load_site = f"{site[0]}:{site[1]} {site[2]}" if site is not None else None
        for t in _held_by(receiver):
            storage = _storage(t)
            if storage is None or storage not in given:
                continue
            entry = self.sources.get(storage)
            if entry is None or not entry[0].holds(storage):
                continue  # not from a live state_dict() (torch.load, a copy...)
            source = entry[1]()
            if source is None or source is receiver:
                continue
            group = by_source.setdefault(id(source), (source, {}, []))
            group[1][storage] = entry[0]
            group[2].append(t)
        for source, storages, tensors in by_source.values():
            if len(self.watched) >= _MAX_HANDOVERS:
                return
            h = _Handover(source, receiver, storages)
            keys = set(storages)
            src_v, dst_v = _versions(source, keys), _versions(receiver, keys)
            h.base = {k: src_v.get(k, 0) + dst_v.get(k, 0) for k in keys}
            h.events = self._evidence(receiver, tensors, buffer[first:], storages)
            for ev in h.events:
                ev.snapshot = True
                ev.load_site = load_site
            self.watched.append(h)

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
        thread = threading.current_thread()
        ev.thread_id, ev.thread_name = thread.ident, thread.name
        rec._append(ev)
        return ev

    # -- step ends ------------------------------------------------------------------------------
    def check(self) -> None:
        """Mark handovers whose shared storage changed in place while both held it."""
        keep = []
        for h in self.watched:
            src, dst = h.src(), h.dst()
            if src is None or dst is None:
                continue
            keys = {k for k, ref in h.storages.items() if not ref.expired()}
            src_v, dst_v = _versions(src, keys), _versions(dst, keys)
            common = set(src_v) & set(dst_v)
            if not common:
                continue  # one side let go of every shared tensor
            if any(src_v[k] + dst_v[k] != h.base.get(k) for k in common):
                for ev in h.events:
                    ev.stale = True
                continue
            keep.append(h)
        self.watched = keep

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


def _wrap_state_dict(orig: Any, here: Any) -> Any:
    def state_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
        rec = here()
        if rec is None or _BUSY[0] or rec.active is not None:
            return orig(self, *args, **kwargs)
        buffer, first = rec.events, len(rec.events)
        _BUSY[0] += 1
        try:
            result = orig(self, *args, **kwargs)
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


def _wrap_load(orig: Any, here: Any) -> Any:
    def load_state_dict(self: Any, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        rec = here()
        if rec is None or _BUSY[0] or rec.active is not None:
            return orig(self, state_dict, *args, **kwargs)
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


def install(here: Any) -> None:
    """Wrap ``state_dict`` / ``load_state_dict``; ``here()`` gives the active recorder on
    the traced thread, or None."""
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
                made = _WRAPPERS[(cls, name)] = (orig, here, wrap(orig, here))
            setattr(cls, name, made[2])


def remove() -> None:
    for (cls, name), orig in list(_ORIGINALS.items()):
        setattr(cls, name, orig)
    _ORIGINALS.clear()
