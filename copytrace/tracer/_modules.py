"""Which ``nn.Module`` a copy was made in, read from the frames at event time.

copytrace installs no ``nn.Module`` hooks: a global forward hook would send every module call
through ``Module._call_impl``'s hooked path (one more frame, ``inner``, in tracebacks; another
line of ``module.py`` for a warning whose stacklevel reaches past the call) and cost a Python
call per module per forward. Events are rare compared with module calls, so the module is
found when an event is recorded instead: the ``Module._call_impl`` frames on the current
thread's stack are the module calls in progress, and their ``self`` is the module.

* forward: the innermost module call on the stack names the event (``Root.child.leaf``, the
  root named by its class, ``#2`` for a second root of the same class); none: no module.
* backward: the autograd node running now names it. A forward copy's ``grad_fn`` is tagged
  when the copy is recorded (see ``_recorder._tag_grad_fn``); an implicit forward copy (an
  autocast cast) notes the sequence number of the node autograd made for it. A backward copy
  of a node that no recorded forward copy made has no module.

Nothing here holds a module or a tensor alive (weak references only).
"""

from __future__ import annotations

import gc
import weakref
from types import FrameType
from typing import Any

import torch

__all__ = ["Modules"]

_CALL_IMPL = torch.nn.Module._call_impl.__code__
CALL_IMPL = _CALL_IMPL  # the C++ observer's record finds the innermost frame running it
_MAX_NODES = 200_000  # node sequence numbers kept for backward attribution
_MAX_SEARCHES = 32  # heap searches for a parameter's owner per trace (each about 0.1 s)


class Modules:
    """Module paths of one trace: names, the module call in progress, autograd nodes."""

    def __init__(self) -> None:
        # id(module) -> (weakref to module, path); the weakref guards against id reuse.
        self.names: dict[int, tuple[weakref.ref, str]] = {}
        self._root_counts: dict[str, int] = {}
        # autograd node sequence number -> module path of the forward copy that made the node
        self._nodes: dict[int, str] = {}
        # id(tensor) -> (weakref to tensor, name) of the owners found by a heap search
        self._owners: dict[int, tuple[Any, str | None]] = {}

    def name(self, module: torch.nn.Module) -> str:
        """Path of ``module``: ``Root.child.grandchild``, the root named by its class."""
        entry = self.names.get(id(module))
        if entry is not None and entry[0]() is module:
            return entry[1]
        root = type(module).__name__
        n = self._root_counts.get(root, 0) + 1
        self._root_counts[root] = n
        if n > 1:
            root = f"{root}#{n}"
        names = self.names
        for sub_name, sub in module.named_modules():
            known = names.get(id(sub))
            if known is None or known[0]() is not sub:
                names[id(sub)] = (weakref.ref(sub), f"{root}.{sub_name}" if sub_name else root)
        return names[id(module)][1]

    def current(self, frame: FrameType | None) -> str | None:
        """Path of the innermost module whose call is in progress at or above ``frame``
        (``None``: not inside a module call)."""
        calls = []
        while frame is not None:
            if frame.f_code is _CALL_IMPL:
                module = frame.f_locals.get("self")
                entry = self.names.get(id(module))
                if not calls and entry is not None and entry[0]() is module:
                    return entry[1]  # the usual case: a module named before
                calls.append(module)
            frame = frame.f_back
        if not calls:
            return None
        path = None
        for module in reversed(calls):  # outermost first: it names its submodules
            if isinstance(module, torch.nn.Module):
                path = self.name(module)
        return path

    def note_node(self, seq: int, path: str) -> None:
        """The autograd node with sequence number ``seq`` was made in module ``path``."""
        nodes = self._nodes
        if len(nodes) >= _MAX_NODES:
            nodes.clear()  # bound memory on long runs; only old graphs lose their module
        nodes[seq] = path

    def of_node(self, node: Any) -> str | None:
        """Module of the forward copy that made autograd ``node``, if one was recorded."""
        try:
            return self._nodes.get(node._sequence_nr())
        except Exception:
            return None

    def owner_name(self, t: torch.Tensor) -> str | None:
        """``Module.path.param`` of a parameter or buffer ``t`` (``None``: not one).

        Modules named at events are searched first; otherwise the module holding ``t`` (and
        the modules holding that one) are found through the garbage collector's referrers,
        which scans the heap: only for a hazard's message, never per event."""
        for entry in list(self.names.values()):
            module, path = entry[0](), entry[1]
            if module is None:
                continue
            for table in (module._parameters, module._buffers):
                for name, value in table.items():
                    if value is t:
                        return f"{path}.{name}"
        known = self._owners.get(id(t))
        if known is not None and known[0]() is t:
            return known[1]
        if len(self._owners) >= _MAX_SEARCHES:
            return None
        name = self._search(t)
        try:
            self._owners[id(t)] = (weakref.ref(t), name)
        except TypeError:
            pass
        return name

    def _search(self, t: torch.Tensor) -> str | None:
        owner = _holder(t, ("_parameters", "_buffers"))
        if owner is None:
            return None
        module, name = owner
        chain = [module]
        for _ in range(16):  # climb to the root, so that it names its submodules
            parent = _holder(chain[-1], ("_modules",))
            if parent is None:
                break
            chain.append(parent[0])
        for m in reversed(chain):
            self.name(m)
        return f"{self.name(module)}.{name}"


def _holder(value: Any, tables: tuple[str, ...]) -> tuple[torch.nn.Module, str] | None:
    """A module whose ``tables`` dicts hold ``value``, and its key there."""
    for table in gc.get_referrers(value):
        if type(table) is not dict:
            continue
        for attrs in gc.get_referrers(table):
            # the module's instance dict holds the table (or the module itself, where
            # CPython keeps its attributes inline)
            owners = [attrs] if isinstance(attrs, torch.nn.Module) else (
                gc.get_referrers(attrs) if type(attrs) is dict else []
            )
            for owner in owners:
                if not isinstance(owner, torch.nn.Module):
                    continue
                own = getattr(owner, "__dict__", {})
                if any(own.get(name) is table for name in tables):
                    for key, item in table.items():
                        if item is value:
                            return owner, key
    return None
