"""Runtime facts for the hazard analyser that an event, once recorded, cannot carry by itself.

The recorder owns one :class:`Watch` per trace and calls it at five points:

* :meth:`Watch.event`, for every recorded event: storage identity as trace-unique ids (never
  addresses, which the allocator reuses), the input's view (offset, strides) and version
  counter, the result's storage id and version. It also starts the few watches below; every watch holds weak references only.
* :meth:`Watch.before_op`, from the dispatch mode, **only while** a ``.data`` alias of a tensor
  that requires grad is alive (``Watch.aliases`` non-empty): an in-place aten op whose written
  tensor is that alias (or a view of it) is a write autograd cannot see, since ``.data`` has
  its own version counter. The write's storage and the autograd sequence number at that
  moment are kept as a *pending write*.
* :meth:`Watch.backward`, for ``Tensor.backward``, ``torch.autograd.backward`` and
  ``torch.autograd.grad``: when a pending write (or a ``.data =`` rebinding) exists, the graph
  about to run is walked before it runs; a node created before the write (smaller sequence
  number) whose saved tensor lives in the written storage computes a silently wrong gradient.
  Saved tensors are read through ``SavedTensor.data``, which neither runs saved-tensor hooks
  nor checks versions; hooked (checkpointed, offloaded) tensors are skipped.
* :meth:`Watch.step_end`, at each step boundary, and :meth:`Watch.finish` when tracing
  stops: attached copies of the step that are still alive with a graph that still holds saved
  tensors (no backward ran through it), and ``state_dict()`` aliases whose source was changed
  in place while they were kept.

Nothing here reads tensor data or syncs a device: storages, offsets, strides, version
counters, autograd node metadata only. Any error is counted by the recorder and swallowed.
"""

from __future__ import annotations

import sys
import weakref
from typing import TYPE_CHECKING, Any

import torch

from copytrace.tracer import _facts as _F
from copytrace.tracer._callsite import user_frame
from copytrace.tracer._fresh import INDEX_OPS as _INDEX_OPS
from copytrace.tracer._fresh import Fresh
from copytrace.tracer._handover import Handovers

if TYPE_CHECKING:
    from copytrace.schema import CopyEvent
    from copytrace.tracer._recorder import Recorder

__all__ = ["Watch", "BACKWARD_FUNCTIONS", "StorageIds"]

_Tensor = torch.Tensor
_NoTorchFunction = torch._C.DisableTorchFunction
_seq_nr = torch._C._autograd._get_sequence_nr

#: Entry points of a backward pass as the function mode sees them (``Tensor.backward`` calls
#: ``torch.autograd.backward`` with the mode popped, so one backward is seen once).
BACKWARD_FUNCTIONS = (_Tensor.backward, torch.autograd.backward, torch.autograd.grad)

# Caps that keep the cold-path work bounded on huge graphs and long programs.
_MAX_NODES = 200_000
_MAX_ATTACHED = 100_000
_PRUNE_ATTACHED = 64  # attached copies listed before the first prune (_prune_attached)
_MAX_SNAPSHOTS = 100_000
#: Results that are not a fresh copy the program goes on using: copy_ writes into its dst,
#: deepcopy results are independent state, implicit copies are internal to torch.
_NOT_FRESH = frozenset(("copy_", "deepcopy", "implicit", "data_set", "swap_tensors"))
_WATCHED_OPS = frozenset(("data_get", "data_set", "detach"))  # see Watch._special
_UNREAD = object()  # Watch.follow: the result's grad_fn is not read yet


def _site(frame: Any) -> str | None:
    found = user_frame(frame)
    if found is None:
        return None
    return f"{found[0]}:{found[1]} {found[2]}"


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


class _Alias:
    """A live ``.data`` alias of a tensor that requires grad."""

    __slots__ = ("ref", "src", "ev")

    def __init__(self, ref: weakref.ref, src: weakref.ref, ev: CopyEvent) -> None:
        self.ref = ref
        self.src = src
        self.ev = ev


class _Pending:
    """An in-place write through a ``.data`` alias, or a ``.data =`` rebinding, not yet
    checked against a backward pass."""

    __slots__ = ("ref", "marker", "site", "alias")

    def __init__(self, ref: weakref.ref, marker: int, site: str | None, alias: _Alias) -> None:
        self.ref = ref  # the written storage (write) or the rebound tensor (rebind)
        self.marker = marker  # autograd sequence number at the write: older nodes are < it
        self.site = site
        self.alias = alias


class Watch:
    """Runtime facts for :mod:`copytrace.analysis`; one per :class:`Recorder`."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.ids = StorageIds()
        #: id(alias tensor) -> entry; the dispatch mode checks writes only while non-empty.
        self.aliases: dict[int, _Alias] = {}
        self.writes: dict[int, _Pending] = {}  # id(storage) -> pending write
        self.rebinds: dict[int, _Pending] = {}  # id(tensor) -> pending `.data =` rebinding
        # this step's attached copies: (result, event, life token of its grad_fn, its seq nr)
        self.attached: list[tuple[weakref.ref, CopyEvent, Any, int]] = []
        self._attached_prune = _PRUNE_ATTACHED  # list length at which dead entries are dropped
        self._backward_seq = -1  # newest backward root of this step (autograd sequence nr)
        self._scan_skip = 0  # steps left before the next search for live derived tensors
        self._scan_backoff = 1
        # state_dict() aliases: (alias, version, event, storage, source, storage use count
        # without the alias); followed by the storage once the alias is gone
        self.snapshots: list[tuple[Any, ...]] = []
        self._written: dict[Any, tuple[tuple[int, str], ...]] = {}
        self.copies = Fresh(rec.note_error)  # in-place writes into fresh copies
        self.handovers = Handovers(rec)  # state_dict() handovers between live holders

    def live_events(self) -> list[CopyEvent]:
        """Events whose facts a later check may still change (an exporter holds them back)."""
        # copy() first: weakref callbacks (an alias dying during a GC) may change the dict
        events = [entry.ev for entry in self.aliases.copy().values()]
        for table in (self.writes, self.rebinds):
            events.extend(p.alias.ev for p in table.values())
        events.extend(entry[1] for entry in self.attached)
        events.extend(entry[2] for entry in self.snapshots)
        events.extend(self.copies.events())
        events.extend(self.handovers.events())
        return events

    # -- every event ----------------------------------------------------------------------
    def event(
        self, ev: CopyEvent, op: str, src: Any, out: Any, fs: tuple | None = None,
        fo: tuple | None = None,
    ) -> None:  # fmt: skip
        """Add storage facts to ``ev`` and start the watches it calls for. ``fs``, ``fo``: the
        facts (``copytrace.tracer._facts``) of ``src`` and ``out`` when already read. Never
        raises."""
        try:
            self._event(ev, op, src, out, fs, fo)
        except Exception as err:
            self.rec.note_error(err)

    def _event(
        self, ev: CopyEvent, op: str, src: Any, out: Any, fs: tuple | None, fo: tuple | None
    ) -> None:
        ids = self.ids
        if fs is None:
            fs = _F.py_facts(src)
        known = ids._ids  # StorageIds.of_storage's hit, inlined (a new storage calls it)
        storage = fs[7]  # _facts.STORAGE
        entry = known.get(id(storage))
        if entry is not None and entry[0]() is storage:
            sid = entry[1]
        else:
            sid = ids.of_storage(storage)
        ev.src_storage = sid
        offset = fs[10]  # _facts.OFFSET: None for nested tensors (no single view)
        if sid is not None and offset is not None:
            ev.src_offset = offset
            ev.src_stride = fs[11]  # _facts.STRIDE
            ev.src_version = fs[12]  # _facts.VERSION
        if ev.error is not None:
            return
        if isinstance(out, _Tensor):
            if out is src:
                ev.dst_storage = sid
                ev.dst_version = fs[12] if fo is None else fo[12]
            else:
                if fo is None:
                    fo = _F.py_facts(out)
                storage = fo[7]
                entry = known.get(id(storage))
                if entry is not None and entry[0]() is storage:
                    ev.dst_storage = entry[1]
                else:
                    ev.dst_storage = ids.of_storage(storage)
                ev.dst_version = fo[12]
        else:
            if ev.alias:
                ev.dst_storage = sid  # numpy(): an ndarray on the same memory
            return
        self.follow(ev, op, src, out, _UNREAD if fo is None else fo[5])  # _facts.GRAD_FN

    def follow(self, ev: CopyEvent, op: str, src: Any, out: Any, grad_fn: Any = None) -> None:
        """Start the watches event ``ev`` (its storage facts set) calls for: ``.data`` and
        ``state_dict()`` aliases, attached copies, fresh copies. ``grad_fn``: the result's,
        as already read (``_UNREAD``: read it here if needed)."""
        if op in _WATCHED_OPS and (op != "detach" or ev.via is not None):
            self._special(ev, op, src, out)  # (a detach only from state_dict())
        if ev.alias:
            return
        attached = self.attached
        if ev.graph == "attached" and len(attached) < _MAX_ATTACHED:
            if grad_fn is _UNREAD:
                grad_fn = out.grad_fn
            attached.append((weakref.ref(out), ev, *_life_token(grad_fn)))
            if len(attached) >= self._attached_prune:
                self._prune_attached()
        if out is not src and op not in _NOT_FRESH and (ev.bytes_allocated > 0 or op in _INDEX_OPS):
            self.copies.watch(out, ev, op in _INDEX_OPS)

    def _prune_attached(self) -> None:
        """Drop the attached copies that can retain nothing: the copy and its ``grad_fn`` both
        gone (:meth:`_check_retained` skips them too). Run when the list doubles (64 entries
        at least), so that a loop with no step boundary keeps a short list: most dead
        entries (a tuple and two weak references each) go before the cycle collector
        promotes them, whose full collections walk torch's whole heap (amortised O(1) per
        event)."""
        kept = [
            entry for entry in self.attached
            if entry[0]() is not None or (entry[2] is not None and entry[2]() is not None)
        ]  # fmt: skip
        self.attached = kept
        self._attached_prune = max(_PRUNE_ATTACHED, 2 * len(kept))

    def _special(self, ev: CopyEvent, op: str, src: Any, out: Any) -> None:
        """``.data`` reads and writes, ``state_dict()`` snapshots: start their watches."""
        if op == "data_get":
            if ev.src_requires_grad and out is not src:
                self._watch_alias(out, src, ev)
        elif op == "data_set":
            self._watch_rebind(out, ev)
        elif op == "detach" and _from_state_dict(ev):
            ev.snapshot = True
            if len(self.snapshots) < _MAX_SNAPSHOTS:
                storage = out.untyped_storage()
                self.snapshots.append((
                    weakref.ref(out), _F.version(out), ev, weakref.ref(storage),
                    weakref.ref(src), _use_count(storage) - 1,
                ))  # fmt: skip
                del storage

    def _watch_alias(self, alias: torch.Tensor, src: torch.Tensor, ev: CopyEvent) -> None:
        key = id(alias)
        aliases = self.aliases

        def gone(ref: weakref.ref, key: int = key) -> None:
            entry = aliases.get(key)
            if entry is not None and entry.ref is ref:
                del aliases[key]
                if not aliases:
                    self._watch_writes(False)

        ev.inplace_writes = 0
        aliases[key] = _Alias(weakref.ref(alias, gone), weakref.ref(src), ev)
        self._watch_writes(True)

    def _watch_writes(self, on: bool) -> None:
        """Have the C handler call :meth:`before_api` for every torch call (only while a
        ``.data`` alias of a tensor that requires grad is alive)."""
        native = self.rec.native
        if native is not None:
            try:
                native.set_watch_writes(on)
                lean = getattr(self.rec, "lean_watch", None)
                if lean is not None:  # level lean: a mode only while writes are watched
                    lean.watch(on)
            except Exception as err:  # interpreter shutdown
                self.rec.note_error(err)

    def _watch_rebind(self, dst: torch.Tensor, ev: CopyEvent) -> None:
        site = f"{ev.file}:{ev.line} {ev.function}" if ev.file else None
        entry = _Alias(weakref.ref(dst), weakref.ref(dst), ev)
        self.rebinds[id(dst)] = _Pending(entry.ref, _seq_nr(), site, entry)

    # -- dispatch mode, only while a `.data` alias is alive --------------------------------
    def before_op(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Note an in-place write through a watched ``.data`` alias. Never raises."""
        try:
            written = self._written.get(func)
            if written is None:
                written = self._written[func] = _written_args(func)
            if not written:
                return
            aliases = self.aliases
            for index, name in written:
                value = args[index] if index < len(args) else kwargs.get(name)
                targets = value if isinstance(value, (list, tuple)) else (value,)
                for t in targets:
                    if not isinstance(t, _Tensor):
                        continue
                    base = t._base
                    root = t if base is None else base
                    entry = aliases.get(id(root))
                    if entry is not None and entry.ref() is root:
                        self._note_write(entry, root)
        except Exception as err:
            self.rec.note_error(err)

    def before_api(self, func: Any, args: tuple, kwargs: dict | None) -> None:
        """The API-level form of :meth:`before_op` (the C++ observer's path): a torch call
        that writes in place (``add_``, ``zero_``, ``__setitem__``, ``__iadd__``, ``out=``)
        into a watched ``.data`` alias. Never raises."""
        try:
            written = self._written.get(func)
            if written is None:
                written = self._written[func] = _written_api(func)
            aliases = self.aliases
            if not aliases:
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
                base = t._base
                root = t if base is None else base
                entry = aliases.get(id(root))
                if entry is not None and entry.ref() is root:
                    self._note_write(entry, root)
        except Exception as err:
            self.rec.note_error(err)

    def _note_write(self, entry: _Alias, alias: torch.Tensor) -> None:
        ev = entry.ev
        ev.inplace_writes = (ev.inplace_writes or 0) + 1
        storage = alias.untyped_storage()
        site = _site(sys._getframe(2))
        self.writes[id(storage)] = _Pending(weakref.ref(storage), _seq_nr(), site, entry)

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
            self.rec.note_error(err)
        if self.writes or self.rebinds:
            try:
                self._check_backward(func, args, kwargs)
            except Exception as err:
                self.rec.note_error(err)

    def _note_backward(self, func: Any, args: tuple, kwargs: dict) -> None:
        for root in _backward_roots(func, args, kwargs):
            seq = root._sequence_nr()
            if seq > self._backward_seq:
                self._backward_seq = seq

    def _check_backward(self, func: Any, args: tuple, kwargs: dict) -> None:
        roots = _backward_roots(func, args, kwargs)
        writes = {k: w for k, w in self.writes.items() if w.ref() is not None}
        rebinds: dict[int, tuple[torch.Tensor, _Pending]] = {}
        for pending in self.rebinds.values():
            t = pending.ref()
            if t is not None:
                rebinds[id(t.untyped_storage())] = (t, pending)
        markers = [p.marker for p in writes.values()] + [p[1].marker for p in rebinds.values()]
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
                storage = saved.untyped_storage()
                key = id(storage)
                write = writes.get(key)
                if write is not None and seq < write.marker and write.ref() is storage:
                    self._hazard(write, node, name)
                    hits.add(id(write))
                found = rebinds.get(key)
                if found is not None and seq < found[1].marker:
                    dst, pending = found
                    if _unpacked(node, name) is dst:
                        self._hazard(pending, node, name)
                        hits.add(id(pending))

        def keep(p: _Pending) -> bool:
            # Drop what was found, what died, and what only newer graphs could use.
            if id(p) in hits or p.ref() is None:
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
            src = pending.alias.src()
            if src is not None:
                ev.src_name = self._name_of(src)

    def _name_of(self, t: torch.Tensor) -> str | None:
        """``Module.path.param`` of a parameter or buffer of a module (see
        :meth:`copytrace.tracer._modules.Modules.owner_name`)."""
        return self.rec.modules.owner_name(t)

    # -- step boundaries ----------------------------------------------------------------------
    def step_end(self, final: bool = False) -> None:
        """Check this step's attached copies and the kept ``state_dict()`` aliases."""
        if not (final or self.attached or self.snapshots or self.handovers.watched):
            self._backward_seq = -1  # nothing to check: what _check_retained would leave
            return
        try:
            with _NoTorchFunction():  # no other mode sees copytrace's reads
                self._step_end(final)
        except Exception as err:
            self.rec.note_error(err)

    def _step_end(self, final: bool) -> None:
        try:
            self._check_retained(final)
            self._check_snapshots()
            self.handovers.check()
        except Exception as err:
            self.rec.note_error(err)

    def finish(self) -> None:
        """Last checks when tracing stops; then drop every watch."""
        self.step_end(final=True)
        self.aliases.clear()
        self.writes.clear()
        self.rebinds.clear()
        self.snapshots.clear()
        self.copies.finish()  # final in-place write counts of the copies still alive
        self.handovers.clear()

    def _check_retained(self, final: bool) -> None:
        attached, self.attached = self.attached, []
        seen: set[int] = set()
        keep_alive: list[Any] = []  # node wrappers, so that ids in `seen` stay unique
        leaves: set[int] = set()
        found: list[tuple[CopyEvent, dict[int, Any]]] = []
        derived: dict[int, tuple[CopyEvent, Any]] = {}  # seq nr -> (event, life token)
        newest_backward, self._backward_seq = self._backward_seq, -1
        for ref, ev, life, seq in attached:
            t = ref()
            if t is None:
                # The copy is gone; its graph may live on in a tensor derived from it (a
                # running total). Only nodes no backward of this step can have run through
                # (newer than its newest root) are searched for.
                if life is not None and life() is not None and seq > newest_backward:
                    derived[seq] = (ev, life)
                continue
            grad_fn = t.grad_fn
            del t
            if grad_fn is not None:
                found.append((ev, _saved_storages(grad_fn, seen, keep_alive, leaves)))
        if derived:
            found.extend(self._derived(derived, seen, keep_alive, leaves))
        counted = leaves  # a storage kept alive by several graphs counts once, first
        retained: list[tuple[CopyEvent, int]] = []
        for ev, saved in found:
            nbytes = 0
            for key, storage in saved.items():
                if key not in counted:
                    counted.add(key)
                    nbytes += storage.nbytes()
            if nbytes > 0:
                retained.append((ev, nbytes))
        if final:
            # When tracing stops mid-step, one attached result still waiting for its backward
            # (a forward output) is normal; several from one line are being accumulated.
            per_site: dict[tuple, int] = {}
            for ev, _ in retained:
                per_site[(ev.file, ev.line)] = per_site.get((ev.file, ev.line), 0) + 1
            retained = [(ev, n) for ev, n in retained if per_site[(ev.file, ev.line)] > 1]
        for ev, nbytes in retained:
            ev.retained_bytes = (ev.retained_bytes or 0) + nbytes

    def _derived(
        self, derived: dict[int, tuple[CopyEvent, Any]], seen: set, keep: list, leaves: set
    ) -> list[tuple[CopyEvent, dict[int, Any]]]:
        """Graphs of gone copies still reachable from a live tensor: found by walking the
        graphs of the live tensors that have a grad_fn (a search of the heap, so it backs
        off while it finds nothing)."""
        if self._scan_skip > 0:
            self._scan_skip -= 1
            return []
        out = []
        search: set[int] = set()
        hold: list[Any] = []
        for root in _live_graph_roots():
            for node in _walk([root], search, hold):
                entry = derived.get(node._sequence_nr())
                if entry is None:
                    continue
                try:
                    mine = node.metadata.get(_LIFE) is entry[1]()
                except Exception:
                    mine = False
                if mine:
                    del derived[node._sequence_nr()]
                    out.append((entry[0], _saved_storages(node, seen, keep, leaves)))
            if not derived:
                break
        if any(saved for _, saved in out):
            self._scan_backoff = 1
        else:
            self._scan_skip = self._scan_backoff
            self._scan_backoff = min(2 * self._scan_backoff, 64)
        return out

    def _check_snapshots(self) -> None:
        keep = []
        for entry in self.snapshots:
            ref, version, ev, storage_ref, src_ref, alone = entry
            t = ref()
            if t is None:
                # The alias is gone; another tensor may still hold its storage (a Parameter
                # made from it, a view): follow the storage and the source's version counter.
                storage, t = storage_ref(), src_ref()
                count = _use_count(storage) if storage is not None else -1
                del storage
                if t is None or count < 0 or count <= alone:
                    continue  # nobody but the source holds the storage any more
            if _F.version(t) != version:
                ev.stale = True
                continue
            del t
            keep.append(entry)
        self.snapshots = keep


# --- helpers -------------------------------------------------------------------------------------
_LIFE = "copytrace.life"  # key in grad_fn.metadata: a token that lives as long as the node


class _Life:
    """Put into a grad_fn's metadata: a weak reference to it tells whether the node (which
    cannot be weakly referenced itself) is still alive, without keeping it alive."""

    __slots__ = ("__weakref__",)


def _life_token(grad_fn: Any) -> tuple[Any, int]:
    """``(weakref to a token in grad_fn.metadata, grad_fn's sequence nr)``, or (None, -1)."""
    if grad_fn is None:
        return None, -1
    try:
        token = _Life()
        grad_fn.metadata[_LIFE] = token
        return weakref.ref(token), grad_fn._sequence_nr()
    except Exception:  # nodes without metadata (custom C++ functions)
        return None, -1


def _live_graph_roots() -> list[Any]:
    """grad_fn of every live tensor that has one (type() only: isinstance() would run
    ``__class__`` of lazy proxies found on the heap)."""
    import gc

    roots = []
    for obj in gc.get_objects():
        if issubclass(type(obj), _Tensor):
            try:
                grad_fn = obj.grad_fn
            except Exception:
                continue
            if grad_fn is not None:
                roots.append(grad_fn)
    return roots


def _use_count(storage: Any) -> int:
    """References to the storage (tensors on it, and its Python object); -1 if unknown."""
    try:
        return torch._C._storage_Use_Count(storage._cdata)
    except Exception:  # a torch without this private API: never followed past the alias
        return -1


def _from_state_dict(ev: CopyEvent) -> bool:
    """Whether a ``detach`` event was made by ``Module._save_to_state_dict``."""
    via = ev.via
    return isinstance(via, str) and via.endswith("_save_to_state_dict")


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


def _backward_roots(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    if func is _Tensor.backward:
        tensors = args[0] if args else kwargs.get("self")
    elif func is torch.autograd.grad:
        tensors = args[0] if args else kwargs.get("outputs")
    else:
        tensors = args[0] if args else kwargs.get("tensors")
    if isinstance(tensors, _Tensor):
        tensors = (tensors,)
    roots = []
    for t in tensors or ():
        grad_fn = getattr(t, "grad_fn", None)
        if grad_fn is not None:
            roots.append(grad_fn)
    return roots


def _walk(roots: list[Any], seen: set[int] | None = None, keep: list[Any] | None = None):
    """Yield each autograd node reachable from ``roots`` once (bounded)."""
    seen = set() if seen is None else seen
    keep = [] if keep is None else keep
    stack = []
    for root in roots:
        if id(root) not in seen:
            seen.add(id(root))
            keep.append(root)
            stack.append(root)
    count = 0
    while stack and count < _MAX_NODES:
        node = stack.pop()
        count += 1
        yield node
        for nxt, _ in node.next_functions:
            if nxt is not None and id(nxt) not in seen:
                seen.add(id(nxt))
                keep.append(nxt)
                stack.append(nxt)


_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def _saved_tensors(node: Any):
    """Yield ``(name, tensor)`` for each saved tensor of ``node`` still held, without running
    saved-tensor hooks (hooked entries are skipped) and without version checks."""
    names = _SAVED_NAMES.get(type(node))
    if names is None:
        names = _SAVED_NAMES[type(node)] = tuple(
            n for n in dir(node) if n.startswith("_raw_saved_")
        )
    for attr in names:
        try:
            raw = getattr(node, attr)
        except Exception:  # freed (after backward) or not applicable
            continue
        name = attr[len("_raw_saved_") :]
        many = isinstance(raw, (list, tuple))
        for i, saved in enumerate(raw if many else (raw,)):
            if saved is None or getattr(saved, "unpack_hook", None) is not None:
                continue
            data = saved.data
            if isinstance(data, _Tensor):
                yield (f"{name}[{i}]" if many else name), data


def _unpacked(node: Any, name: str) -> Any:
    """The saved tensor as autograd unpacks it (the original object for a saved leaf); None
    when unpacking would run a saved-tensor hook."""
    base, _, index = name.partition("[")
    try:
        raw = getattr(node, "_raw_saved_" + base)
        items = raw if isinstance(raw, (list, tuple)) else (raw,)
        if any(getattr(r, "unpack_hook", None) is not None for r in items if r is not None):
            return None
        if hasattr(node, "_saved_" + base):
            value = getattr(node, "_saved_" + base)
        else:  # a custom autograd.Function: ctx.saved_tensors
            value = node.saved_tensors
        return value[int(index.rstrip("]"))] if index else value
    except Exception:  # freed, or modified in place (autograd's own check refuses)
        return None


def _saved_storages(root: Any, seen: set[int], keep: list[Any], leaves: set[int]) -> dict[int, Any]:
    """Storages saved by the graph under ``root`` (nodes not in ``seen``) and not yet freed,
    by id; adds the storages of leaves that require grad (AccumulateGrad) to ``leaves``."""
    saved: dict[int, Any] = {}
    for node in _walk([root], seen, keep):
        variable = getattr(node, "variable", None)
        if isinstance(variable, _Tensor):  # AccumulateGrad: a parameter, alive anyway
            leaves.add(id(variable.untyped_storage()))
            keep.append(variable.untyped_storage())
            continue
        for _, tensor in _saved_tensors(node):
            storage = tensor.untyped_storage()
            saved[id(storage)] = storage
    return saved
