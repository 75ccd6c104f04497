"""What copytrace knows of the autograd nodes of the copies it recorded, held beside the nodes.

A copy's backward (``ToCopyBackward0`` casting the gradient back) is named after its forward
call: the node running when a backward copy is recorded is looked up here for the forward's
module path and ``file:line``, and for the version counter of the leaf the forward copied then
(a kept cast used after its leaf changed in place is ``stale``). Nothing is written on the node
(its ``metadata`` dict is the program's) and nothing holds it: the key is the node's sequence
number and type name (a thread's sequence numbers only grow, so a dead node's key is never
taken by a new node of the same thread).

Dead nodes' entries are dropped when the table doubles (at 4,096 entries at least). With the
C++ observer each entry keeps a weak pointer on its node (``grad_fn_ref``,
``tracer/_native/versions.cpp``: a ``c10::weak_intrusive_ptr<Node>``, nothing Python can see,
the node's saved tensors freed as usual when its last strong reference goes), and an entry
whose node is gone is dropped without any search. On the Python fallback (no weak pointer on
a node exists in Python) the live nodes are found by a walk of the live tensors' graphs.
"""

from __future__ import annotations

from typing import Any

from copytrace.tracer.watch._graph import _live_node_keys

__all__ = ["NodeTags"]

_MIN = 4096


class NodeTags:
    """``(module, "file:line" or None, leaf version or None)`` by node.

    ``owner`` is the recorder: its ``native`` (the C++ observer while engaged, else None) makes
    the weak pointers."""

    def __init__(self, owner: Any) -> None:
        self._owner = owner
        # (sequence nr, type name) -> (weak pointer on the node or None, tag)
        self._tags: dict[tuple[int, str], tuple[Any, tuple[Any, Any, Any]]] = {}
        self._unreferenced = 0  # entries without a weak pointer (put on the Python fallback)
        self._limit = _MIN

    def put(self, node: Any, tag: tuple[Any, Any, Any]) -> None:
        tags = self._tags
        native = self._owner.native
        ref = native.grad_fn_ref(node) if native is not None else None
        if ref is None:
            self._unreferenced += 1
        tags[(node._sequence_nr(), type(node).__name__)] = (ref, tag)
        if len(tags) >= self._limit:
            self._prune(native)

    def _prune(self, native: Any) -> None:
        """Drop dead nodes' entries: by their weak pointers; by a walk of the live graphs only
        while entries without one are kept."""
        tags = self._tags
        if self._unreferenced:
            live = _live_node_keys()
            alive = native.grad_fn_alive if native is not None else None
            kept = {
                k: v for k, v in tags.items()
                if (k in live if v[0] is None or alive is None else alive(v[0]))
            }  # fmt: skip
            self._unreferenced = sum(1 for v in kept.values() if v[0] is None)
        else:
            alive = native.grad_fn_alive if native is not None else _alive
            kept = {k: v for k, v in tags.items() if alive(v[0])}
        self._tags = kept
        self._limit = max(_MIN, 2 * len(kept))

    def get(self, node: Any) -> tuple[Any, Any, Any] | None:
        tags = self._tags
        if not tags:
            return None
        entry = tags.get((node._sequence_nr(), type(node).__name__))
        return entry[1] if entry is not None else None


def _alive(ref: Any) -> bool:
    """Whether a weak pointer's node lives, the observer no longer engaged (loaded: it made
    ``ref``)."""
    from copytrace.tracer import _native

    native = _native.loaded()
    return native is None or native.grad_fn_alive(ref)
