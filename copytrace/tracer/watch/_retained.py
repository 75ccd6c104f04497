"""Step-boundary checks: attached copies that retain a graph, stale ``state_dict()`` aliases.

At each step boundary (:meth:`Retention.step_end`) and when tracing stops:

* the attached copies of the step that are still alive (or whose graph lives on in a tensor
  derived from them) with a graph that still holds saved tensors, that is no backward ran
  through it: their event's ``retained_bytes``;
* ``state_dict()`` aliases whose source was changed in place while they were kept: their
  event's ``stale``.

Both are late facts (:data:`copytrace.tracer.watch.LATE_FIELDS`): written on events already
recorded, which the session holds back from the export while they are watched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from copytrace.tracer._storage_ref import StorageRef, storage_ref
from copytrace.tracer.watch._accumulate import Accumulation
from copytrace.tracer.watch._graph import (
    _live_graph_roots,
    _live_node_keys,
    _saved_storages,
    _walk,
)

if TYPE_CHECKING:
    from copytrace.schema import CopyEvent
    from copytrace.tracer._fresh import Fresh
    from copytrace.tracer._handover import Handovers
    from copytrace.tracer.watch import WatchHost

__all__ = ["Retention"]

_NoTorchFunction = torch._C.DisableTorchFunction
_PRUNE_ATTACHED = 64  # attached copies listed before the first prune (_prune_attached)


class Retention(Accumulation):
    """The step-boundary checks of :class:`~copytrace.tracer.watch.Watch` (a mixin: the state
    is the watch's, set up in its ``__init__``); copies noted within the step by
    :class:`~copytrace.tracer.watch._accumulate.Accumulation` are committed here."""

    host: WatchHost
    attached: list[_Attached]
    pending: list[_Attached]
    snapshots: list[_Snapshot]
    snap_watch: dict[tuple[int, int], list[_Snapshot]]
    copies: Fresh
    handovers: Handovers
    _attached_prune: int
    _backward_seq: int
    _scan_skip: int
    _scan_backoff: int

    def _prune_attached(self) -> None:
        """Drop the attached copies that can retain nothing: their ``grad_fn`` gone
        (:meth:`_check_retained` skips them too). Run when the list doubles (64 entries at
        least), so that a loop with no step boundary keeps a short list (amortised O(1) per
        event). On the Python fallback (no weak pointer on a node) the live nodes are found by
        a search of the heap, and the list's limit doubles at each search."""
        nodes = self.copies.nodes
        if nodes is not None:
            alive = nodes[2]
            kept = [a for a in self.attached if alive(a.node)]
            self._attached_prune = max(_PRUNE_ATTACHED, 2 * len(kept))
        else:
            live = _live_node_keys()
            kept = [a for a in self.attached if (a.seq, a.kind) in live]
            self._attached_prune = max(_PRUNE_ATTACHED, 2 * len(kept), 2 * self._attached_prune)
        self.attached = kept

    def step_end(self, final: bool = False) -> None:
        """Check this step's attached copies and the kept ``state_dict()`` aliases."""
        if not (final or self.attached or self.pending or self.snapshots or self.handovers.watched):
            self._backward_seq = -1  # nothing to check: what _check_retained would leave
            self.sites = {}
            return
        try:
            with _NoTorchFunction():  # no other mode sees copytrace's reads
                self._step_end(final)
        except Exception as err:
            self.host.note_error(err)

    def _step_end(self, final: bool) -> None:
        try:
            self._check_retained(final)
            self._check_snapshots()
            self.handovers.check()
        except Exception as err:
            self.host.note_error(err)

    def _check_retained(self, final: bool) -> None:
        attached, self.attached = self.attached, []
        seen: set[int] = set()
        keep_alive: list[Any] = []  # node wrappers, so that ids in `seen` stay unique
        leaves: set[int] = set()
        found: list[tuple[CopyEvent, dict[int, Any]]] = []
        derived: dict[int, _Attached] = {}  # the fallback: seq nr -> entry, found on the heap
        newest_backward, self._backward_seq = self._backward_seq, -1
        nodes = self.copies.nodes
        for a in attached:
            # A gone copy's graph may live on in a tensor derived from it (a running total):
            # only nodes no backward of this step can have run through (newer than its newest
            # root) are followed then.
            if not a.copy_alive() and a.seq <= newest_backward:
                continue
            if a.node is None:
                derived[a.seq] = a
                continue
            grad_fn = nodes[1](a.node) if nodes is not None else None
            if grad_fn is not None:
                found.append((a.ev, _saved_storages(grad_fn, seen, keep_alive, leaves)))
            del grad_fn
        if derived:
            found.extend(self._derived(derived, seen, keep_alive, leaves))
        walked = {id(ev) for ev, _ in found}
        counted = leaves  # a storage kept alive by several graphs counts once, first
        retained: list[tuple[CopyEvent, int]] = []
        for ev, saved in found:
            nbytes = 0
            for key, storage_bytes in saved.items():
                if key not in counted:
                    counted.add(key)
                    nbytes += storage_bytes
            if nbytes > 0:
                retained.append((ev, nbytes))
        retained.extend(self._commit_pending(walked, newest_backward))
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
        self, derived: dict[int, _Attached], seen: set, keep: list, leaves: set
    ) -> list[tuple[CopyEvent, dict[int, Any]]]:
        """The Python fallback: the nodes of the attached copies, found by walking the graphs
        of the live tensors that have a grad_fn (a search of the heap, matched by sequence
        number and node type; it backs off while it finds nothing and no copy lives)."""
        alive = any(a.copy_alive() for a in derived.values())
        if self._scan_skip > 0 and not alive:
            self._scan_skip -= 1
            return []
        out = []
        search: set[int] = set()
        hold: list[Any] = []
        for root in _live_graph_roots():
            for node in _walk([root], search, hold):
                seq = node._sequence_nr()
                entry = derived.get(seq)
                if entry is not None and type(node).__name__ == entry.kind:
                    del derived[seq]
                    out.append((entry.ev, _saved_storages(node, seen, keep, leaves)))
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
        delta = self.copies.version_delta
        for snap in self.snapshots:
            count = snap.storage.use_count()
            if count < 0 or count <= snap.alone:
                continue  # nobody but the source holds the storage any more
            written = snap.written if snap.version is None else delta(snap.version) != 0
            if written:
                snap.ev.stale = True
                continue
            keep.append(snap)
        self.snapshots = keep
        watch: dict[tuple[int, int], list[_Snapshot]] = {}
        for snap in keep:
            for ident in snap.idents:
                watch.setdefault(ident, []).append(snap)
        self.snap_watch = watch


class _Attached:
    """An attached copy (``graph == "attached"``) of this step, held by nothing on the copy or
    its node: ``node``, the C++ observer's weak pointer on its grad_fn (``grad_fn_ref``; None on
    the Python fallback, which finds the node on the heap by ``seq``, its sequence number, and
    ``kind``, its type's name); ``storage``, torch's weak handle on the copy's storage (the
    copy, or a view of it, is alive while the storage is)."""

    __slots__ = ("node", "ev", "seq", "kind", "storage", "pending")

    @classmethod
    def of(cls, out: Any, grad_fn: Any, ev: CopyEvent, nodes: Any) -> _Attached | None:
        if grad_fn is None:
            return None
        try:
            seq = grad_fn._sequence_nr()
        except Exception:  # not an autograd node
            return None
        a = cls()
        a.node = nodes[0](out) if nodes is not None else None
        if nodes is not None and a.node is None:
            return None
        a.ev, a.seq, a.kind = ev, seq, type(grad_fn).__name__
        a.pending = None  # retained bytes noted within the step (watch/_accumulate.py)
        a.storage = storage_ref(out)
        return a

    def copy_alive(self) -> bool:
        return self.storage is not None and not self.storage.expired()


class _Snapshot:
    """A ``state_dict()`` alias being followed: ``version``, the C++ observer's handle on the
    version counter it shares with its source (None on the Python fallback); ``storage``, a
    :class:`~copytrace.tracer._storage_ref.StorageRef` on its storage and ``alone`` the
    storage's use count without the alias; on the fallback ``idents``, the identities
    ``(id, TensorImpl address)`` of the alias and its source, and ``written``, set when the
    dispatch mode saw a write into either (or a view of either)."""

    __slots__ = ("version", "ev", "storage", "alone", "idents", "written")

    def __init__(self, version: Any, ev: CopyEvent, storage: StorageRef, alone: int) -> None:
        self.version = version
        self.ev = ev
        self.storage = storage
        self.alone = alone
        self.idents: tuple[tuple[int, int], ...] = ()
        self.written = False
