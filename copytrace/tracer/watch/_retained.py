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

from copytrace.tracer import _facts as _F
from copytrace.tracer.watch._graph import (
    _LIFE,
    _live_graph_roots,
    _saved_storages,
    _use_count,
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


class Retention:
    """The step-boundary checks of :class:`~copytrace.tracer.watch.Watch` (a mixin: the state
    is the watch's, set up in its ``__init__``)."""

    host: WatchHost
    attached: list[tuple[Any, CopyEvent, Any, int]]
    snapshots: list[tuple[Any, ...]]
    copies: Fresh
    handovers: Handovers
    _attached_prune: int
    _backward_seq: int
    _scan_skip: int
    _scan_backoff: int

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

    def step_end(self, final: bool = False) -> None:
        """Check this step's attached copies and the kept ``state_dict()`` aliases."""
        if not (final or self.attached or self.snapshots or self.handovers.watched):
            self._backward_seq = -1  # nothing to check: what _check_retained would leave
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
        delta = self.copies.version_delta
        for entry in self.snapshots:
            if len(entry) == 4:  # (counter handle, event, storage, its use count without the alias)
                handle, ev, storage_ref, alone = entry
                storage = storage_ref()
                count = _use_count(storage) if storage is not None else -1
                del storage
                if count < 0 or count <= alone:
                    continue  # nobody but the source holds the storage any more
                if delta(handle) != 0:
                    ev.stale = True
                    continue
                keep.append(entry)
                continue
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
