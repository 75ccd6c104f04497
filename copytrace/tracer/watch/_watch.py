"""The watch: storage facts for every event, and the watches that annotate events later.

:class:`Watch` is called by the recorder for every recorded event (:meth:`Watch.event`, or
:meth:`Watch.follow` after the C++ observer's ``record`` set the storage facts) and at step
boundaries. It talks to the recorder only through :class:`~copytrace.tracer.watch.WatchHost`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from copytrace.tracer import _facts as _F
from copytrace.tracer._fresh import INDEX_OPS as _INDEX_OPS
from copytrace.tracer._fresh import Fresh
from copytrace.tracer._rules import RULES
from copytrace.tracer._storage_ref import storage_ref
from copytrace.tracer.watch._ids import StorageIds
from copytrace.tracer.watch._retained import _PRUNE_ATTACHED, Retention, _Attached, _Snapshot
from copytrace.tracer.watch._surprise import SurpriseAliases
from copytrace.tracer.watch._writes import AliasWrites, _Alias, _identity, _Pending

if TYPE_CHECKING:
    from copytrace.schema import CopyEvent
    from copytrace.tracer._handover import Handovers
    from copytrace.tracer.watch import WatchHost

__all__ = ["Watch", "BACKWARD_FUNCTIONS"]

_Tensor = torch.Tensor

#: Entry points of a backward pass as the function mode sees them (``Tensor.backward`` calls
#: ``torch.autograd.backward`` with the mode popped, so one backward is seen once).
BACKWARD_FUNCTIONS = (_Tensor.backward, torch.autograd.backward, torch.autograd.grad)

# Caps that keep the cold-path work bounded on huge graphs and long programs.
_MAX_ATTACHED = 100_000
_MAX_SNAPSHOTS = 100_000
# The rule table's share of the watch (the C observer's fast_finish reads the same sets).
_NOT_FRESH = RULES.not_fresh
_WATCHED_OPS = RULES.watched  # see Watch._special
_ALIAS_WATCHED = RULES.alias_watched  # see SurpriseAliases._watch_surprise
_UNREAD = object()  # Watch.follow: the result's grad_fn is not read yet


class Watch(AliasWrites, Retention, SurpriseAliases):
    """Runtime facts for :mod:`copytrace.analysis`; one per recorder.

    Args:
        host: what the watch needs of its recorder (errors counted, writes watched, names).
        handovers: the recorder's ``state_dict()`` handovers (:mod:`copytrace.tracer._handover`),
            checked at step boundaries with the other watches.
    """

    def __init__(self, host: WatchHost, handovers: Handovers) -> None:
        self.host = host
        self.ids = StorageIds()
        #: id(alias tensor) -> entry; the dispatch mode checks writes only while non-empty.
        self.aliases: dict[int, _Alias] = {}
        self.alias_counters: dict[int, _Alias] = {}  # level lean: by C++ write-watch key
        self._alias_calls = 0  # watched calls since the last prune_aliases (many aliases)
        self.writes: dict[int, _Pending] = {}  # storage key -> pending write
        self.rebinds: dict[int, _Pending] = {}  # storage key -> pending `.data =` rebinding
        # this step's attached copies (watch/_retained.py _Attached)
        self.attached: list[_Attached] = []
        self.sites: dict = {}  # call site -> its attached copies (watch/_accumulate.py)
        self.pending: list[_Attached] = []  # copies whose retained bytes wait for step end
        self._attached_prune = _PRUNE_ATTACHED  # list length at which dead entries are dropped
        self._backward_seq = -1  # newest backward root of this step (autograd sequence nr)
        self._scan_skip = 0  # steps left before the next search for live derived tensors
        self._scan_backoff = 1
        # state_dict() aliases, followed by their version counter (C++ observer) or their
        # identities (the fallback: snap_watch, identity -> the snapshots a write there marks)
        self.snapshots: list[_Snapshot] = []
        self.snap_watch: dict[tuple[int, int], list[_Snapshot]] = {}
        self._written: dict[Any, tuple[tuple[int, str], ...]] = {}
        self.copies = Fresh(host.note_error)  # in-place writes into fresh copies
        self.handovers = handovers  # state_dict() handovers between live holders
        self._init_surprise()  # alias results watched for a write (watch/_surprise.py)

    def live_events(self) -> list[CopyEvent]:
        """Events whose late facts (:data:`~copytrace.tracer.watch.LATE_FIELDS`) a later check
        may still change: the session holds them back from the export (``HeldEvents``)."""
        self.prune_aliases()
        events = [entry.ev for entry in self.aliases.copy().values()]
        for table in (self.writes, self.rebinds):
            events.extend(p.alias.ev for p in table.values())
        events.extend(entry.ev for entry in self.attached)
        events.extend(entry.ev for entry in self.pending)
        events.extend(snap.ev for snap in self.snapshots)
        events.extend(self.copies.events())
        events.extend(self.handovers.events())
        events.extend(e.ev for entries in self.surprise.values() for e in entries)
        return events

    # -- every event ----------------------------------------------------------------------
    def event(
        self, ev: CopyEvent, op: str, src: Any, out: Any, fs: _F.Facts | None = None,
        fo: _F.Facts | None = None,
    ) -> None:  # fmt: skip
        """Add storage facts to ``ev`` and start the watches it calls for. ``fs``, ``fo``: the
        facts (``copytrace.tracer._facts``) of ``src`` and ``out`` when already read. Never
        raises."""
        try:
            self._event(ev, op, src, out, fs, fo)
        except Exception as err:
            self.host.note_error(err)

    def _event(
        self, ev: CopyEvent, op: str, src: Any, out: Any, fs: _F.Facts | None, fo: _F.Facts | None
    ) -> None:
        # The facts are read by index here, not by name: every event the Python side records
        # passes through this method, and a named field of the C observer's Facts (a struct
        # sequence) costs about 40% more than an index (Python 3.11: ~22 vs ~16 ns a read).
        ids = self.ids
        if fs is None:
            fs = _F.py_facts(src)
        known = ids._ids  # StorageIds.of_storage's hit, inlined (a new storage calls it)
        storage = fs[7]  # _facts.STORAGE: its key
        sid = known.get(storage)
        if sid is None:
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
                dst = known.get(storage)
                ev.dst_storage = dst if dst is not None else ids.of_storage(storage)
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
            if op in _ALIAS_WATCHED:
                self._watch_surprise(ev, op, src, out)
            return
        attached = self.attached
        if ev.graph == "attached" and len(attached) < _MAX_ATTACHED:
            if grad_fn is _UNREAD:
                grad_fn = out.grad_fn
            entry = _Attached.of(out, grad_fn, ev, self.copies.nodes)
            if entry is not None:
                attached.append(entry)
                self._note_site(entry, grad_fn)
            if len(attached) >= self._attached_prune:
                self._prune_attached()
        if out is not src and op not in _NOT_FRESH and (ev.bytes_allocated > 0 or op in _INDEX_OPS):
            self.copies.watch(out, ev, op in _INDEX_OPS)

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
                self._snapshot(ev, src, out)

    def _snapshot(self, ev: CopyEvent, src: Any, out: Any) -> None:
        """Follow a ``state_dict()`` alias ``out`` of ``src``: nothing held on either tensor.
        detach() shares the source's version counter: with the C++ observer a handle on that
        counter sees every write through the source, the alias or their views; on the Python
        fallback the dispatch mode notes the writes into a tensor (or a view of one) with the
        identity of the source or the alias (:meth:`AliasWrites.before_op`)."""
        ref = storage_ref(out)
        if ref is None:
            return
        version_of = self.copies.version_of  # the C++ observer's counter handles
        handle = version_of(out) if version_of is not None else None
        snap = _Snapshot(handle, ev, ref, ref.use_count() - 1)  # the count without the alias
        if handle is None:  # the Python fallback
            if version_of is not None:
                return  # an inference tensor: no counter to follow
            snap.idents = (_identity(out), _identity(src))
            for ident in snap.idents:
                self.snap_watch.setdefault(ident, []).append(snap)
        self.snapshots.append(snap)

    def step_end(self, final: bool = False) -> None:
        """A step boundary: drop the dead ``.data`` aliases, then the retention checks."""
        self.prune_aliases()
        self.end_surprise()
        super().step_end(final)

    def finish(self) -> None:
        """Last checks when tracing stops; then drop every watch."""
        self.step_end(final=True)
        self.aliases.clear()
        self.alias_counters.clear()  # the C++ watch's keys go with set_watch_hook(None)
        self.writes.clear()
        self.rebinds.clear()
        self.snapshots.clear()
        self.snap_watch.clear()
        self.copies.finish()  # final in-place write counts of the copies still alive
        self.handovers.clear()
        self.surprise.clear()
        self.surprise_counters.clear()
        self.surprise_sites.clear()


def _from_state_dict(ev: CopyEvent) -> bool:
    """Whether a ``detach`` event was made by ``Module._save_to_state_dict``."""
    via = ev.via
    return isinstance(via, str) and via.endswith("_save_to_state_dict")
