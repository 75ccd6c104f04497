"""What copytrace knows of the autograd nodes of the copies it recorded, held beside the nodes.

A copy's backward (``ToCopyBackward0`` casting the gradient back) is named after its forward
call: the node running when a backward copy is recorded is looked up here for the forward's
module path and ``file:line``, and for the version counter of the leaf the forward copied then
(a kept cast used after its leaf changed in place is ``stale``). Nothing is written on the node
(its ``metadata`` dict is the program's) and nothing holds it: the key is the node's sequence
number and type name (a thread's sequence numbers only grow, so a dead node's key is never
taken by a new node of the same thread). Entries of dead nodes are dropped when the table
doubles (at 4,096 entries at least), by a walk of the live tensors' graphs.
"""

from __future__ import annotations

from typing import Any

from copytrace.tracer.watch._graph import _live_node_keys

__all__ = ["NodeTags"]

_MIN = 4096


class NodeTags:
    """``(module, "file:line" or None, leaf version or None)`` by node."""

    def __init__(self) -> None:
        self._tags: dict[tuple[int, str], tuple[Any, Any, Any]] = {}
        self._limit = _MIN

    def put(self, node: Any, tag: tuple[Any, Any, Any]) -> None:
        tags = self._tags
        tags[(node._sequence_nr(), type(node).__name__)] = tag
        if len(tags) >= self._limit:
            live = _live_node_keys()
            self._tags = {k: v for k, v in tags.items() if k in live}
            self._limit = max(_MIN, 2 * len(self._tags))

    def get(self, node: Any) -> tuple[Any, Any, Any] | None:
        tags = self._tags
        if not tags:
            return None
        return tags.get((node._sequence_nr(), type(node).__name__))
