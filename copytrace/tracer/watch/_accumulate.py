"""Graphs accumulated within one step: attached copies from one call site kept alive together.

The step-boundary check (``watch/_retained.py``) finds the attached copies still alive when a
step ends. A program with no step boundary (no ``optimizer.step()``, no ``t.step()``), or one
long step, may keep many copies with their graphs (a history list of ``loss.clone()``) and let
them all go before tracing stops: nothing is alive when the check runs. This mixin finds them
while they live:

* each attached copy is listed under its call site (``file``, ``line``); the list starts again
  when a backward ran since the site's last copy (the watch's newest backward root moved: the
  backward may have gone through that copy's graph, as in ``losses.append(loss.clone());
  loss.backward()``), and that copy's noted bytes are forgotten;
* when a site's count since that start reaches 4, 8, 16... (doubling: amortised O(1) per copy)
  the site's listed copies whose ``grad_fn`` still lives are counted (the C++ observer's weak
  pointer on the node; on the Python fallback a search of the live graphs, matched by sequence
  number and node type). More than half of them alive, and at least 3, is an accumulation (a
  variable rebound each iteration keeps 2 alive at a time): the site is *flagged*, and the
  bytes the graph of each live copy still saves are noted on it (``pending``); each later copy
  from a flagged site has its bytes noted when recorded. A later check that finds fewer alive
  (a bounded window of copies) unflags the site and forgets what it noted;
* at the step boundary, or when tracing stops, the noted bytes of each copy with no backward
  root newer than it (gathered copies then backwarded: gradient accumulation) become its
  event's ``retained_bytes``, except those of a site's last copy when a backward ran after
  it; a copy still alive then is measured by the step-boundary check instead.

Bytes per copy: storages saved by its graph, once each within that graph, leaving out the
leaves that require grad (parameters, alive anyway); a storage saved by several kept graphs
(a shared input) counts in each, as it does across steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from copytrace.tracer.watch._graph import _live_graph_roots, _saved_storages, _walk

if TYPE_CHECKING:
    from copytrace.tracer._fresh import Fresh
    from copytrace.tracer.watch import WatchHost
    from copytrace.tracer.watch._retained import _Attached

__all__ = ["Accumulation"]

_NoTorchFunction = torch._C.DisableTorchFunction
_FIRST_CHECK = 4  # copies from one site (since its last backward) before its first check
_MAX_SITES = 10_000  # call sites followed per step
_MAX_PENDING = 100_000  # copies with noted bytes per step


class _Site:
    """One call site's attached copies since the last backward through them."""

    __slots__ = ("count", "next_check", "flagged", "mark", "last", "first")

    def __init__(self, mark: int) -> None:
        self.count = 0  # copies recorded since the site (re)started
        self.next_check = _FIRST_CHECK
        self.flagged = False
        self.mark = mark  # the watch's newest backward root when the site's last copy came
        self.last: _Attached | None = None  # the site's last copy
        self.first = -1  # sequence nr of the site's first copy since it (re)started


class Accumulation:
    """Mixin of :class:`~copytrace.tracer.watch.Watch` (its state is set up in the watch's
    ``__init__``): ``sites``, call site -> :class:`_Site`; ``pending``, copies whose retained
    bytes are noted and wait for the step boundary."""

    host: WatchHost
    copies: Fresh
    sites: dict[tuple[Any, Any], _Site]
    pending: list[_Attached]
    _backward_seq: int

    def _note_site(self, a: _Attached, grad_fn: Any) -> None:
        """List attached copy ``a`` (``grad_fn`` its node) under its call site; check the site
        when its count doubles, note ``a``'s bytes when the site is flagged."""
        key = (a.ev.file, a.ev.line)
        site = self.sites.get(key)
        if site is None:
            if len(self.sites) >= _MAX_SITES:
                return
            site = self.sites[key] = _Site(self._backward_seq)
        elif site.mark != self._backward_seq:  # a backward since the site's last copy
            if site.last is not None:
                site.last.pending = None  # it may have run through that copy's graph
            site.__init__(self._backward_seq)
        site.last = a
        if site.count == 0:
            site.first = a.seq
        site.count += 1
        if site.count >= site.next_check:
            site.next_check = 2 * site.count
            with _NoTorchFunction():  # no other mode sees copytrace's reads
                self._check_site(key, site)
        elif site.flagged and len(self.pending) < _MAX_PENDING:
            with _NoTorchFunction():
                a.pending = _graph_bytes(grad_fn)
            self.pending.append(a)

    def _check_site(self, key: tuple[Any, Any], site: _Site) -> None:
        # the site's copies since it (re)started, among the step's listed attached copies
        # (``_prune_attached`` keeps that list about twice its live entries)
        file, line, first = key[0], key[1], site.first
        mine = [a for a in self.attached if a.ev.line == line and a.seq >= first and a.ev.file == file]
        live = self._live_nodes(mine, site.count)
        accumulating = len(live) >= 3 and 2 * len(live) > site.count
        if not accumulating:
            if site.flagged:
                site.flagged = False
                self.pending = [p for p in self.pending if (p.ev.file, p.ev.line) != key]
                for a, _ in live:
                    a.pending = None
            return
        site.flagged = True
        for a, node in live:
            if a.pending is None and len(self.pending) < _MAX_PENDING:
                a.pending = _graph_bytes(node)
                self.pending.append(a)

    def _live_nodes(self, entries: list[_Attached], count: int) -> list[tuple[_Attached, Any]]:
        """The entries whose node lives, each with its node (held by the caller only); on the
        fallback none unless more than half of ``count`` copies (and 3) are alive."""
        nodes = self.copies.nodes
        if nodes is not None:
            grad_fn_of = nodes[1]
            out = [(a, grad_fn_of(a.node)) for a in entries]
            return [(a, node) for a, node in out if node is not None]
        # the fallback: the copies alive first (a storage handle, cheap), so that a site whose
        # copies die (a rebound variable) costs no search of the heap
        alive = [a for a in entries if a.copy_alive()]
        if len(alive) < 3 or 2 * len(alive) <= count:
            return []
        wanted = {(a.seq, a.kind): a for a in alive}
        found: list[tuple[_Attached, Any]] = []
        seen: set[int] = set()
        hold: list[Any] = []
        for root in _live_graph_roots():
            for node in _walk([root], seen, hold):
                a = wanted.pop((node._sequence_nr(), type(node).__name__), None)
                if a is not None:
                    found.append((a, node))
            if not wanted:
                break
        return found

    def _commit_pending(self, walked: set[int], newest_backward: int) -> list[tuple[Any, int]]:
        """``(event, bytes)`` of the noted copies the step-boundary walk did not measure and
        that no backward may have gone through; empties ``pending`` and ``sites``."""
        for site in self.sites.values():
            if site.mark != newest_backward and site.last is not None:
                site.last.pending = None  # a backward after a site's last copy
        pending, self.pending = self.pending, []
        self.sites = {}
        return [
            (a.ev, a.pending)
            for a in pending
            if a.pending and id(a.ev) not in walked and a.seq > newest_backward
        ]


def _graph_bytes(grad_fn: Any) -> int:
    """Bytes of the storages the graph under ``grad_fn`` still saves (each once), leaving out
    leaves that require grad."""
    leaves: set[int] = set()
    keep: list[Any] = []
    saved = _saved_storages(grad_fn, set(), keep, leaves)
    return sum(nbytes for key, nbytes in saved.items() if key not in leaves)
