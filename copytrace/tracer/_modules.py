"""Which ``nn.Module`` a copy was made in, read from the frames at event time.

copytrace installs no ``nn.Module`` hooks: a global forward hook would send every module call
through ``Module._call_impl``'s hooked path (one more frame, ``inner``, in tracebacks; another
line of ``module.py`` for a warning whose stacklevel reaches past the call) and cost a Python
call per module per forward. Events are rare compared with module calls, so the module is
found when an event is recorded instead: the ``Module._call_impl`` frames on the current
thread's stack are the module calls in progress, and their ``self`` is the module.

* forward: the module calls on the stack name the event, the outermost one being the root
  (named by its class, ``#2`` for a second root of the same class met at another address) and
  each inner one by its attribute path under the call outside it (``Root.child.leaf``);
  none: no module.
* backward: the autograd node running now names it. A forward copy's ``grad_fn`` is tagged
  when the copy is recorded (see ``_recorder._tag_grad_fn``); an implicit forward copy (an
  autocast cast) notes the sequence number of the node autograd made for it. A backward copy
  of a node that no recorded forward copy made has no module.

Nothing here refers to a module, strongly or weakly (``weakref.getweakrefcount`` of a module
reads as untraced): a path below the root is checked at every event against the live modules
on the stack (``parent._modules[name] is child``), so a module that takes the address of a
dead one is never named after it; only ``id`` and class name a root (its ``#n``).
"""

from __future__ import annotations

import gc
from types import FrameType
from typing import Any

import torch

from copytrace.tracer._storage_ref import StorageRef, storage_key, storage_ref

__all__ = ["Modules"]

_Module = torch.nn.Module
_CALL_IMPL = torch.nn.Module._call_impl.__code__
CALL_IMPL = _CALL_IMPL  # the C++ observer's record finds the innermost frame running it
_MAX_NODES = 200_000  # node sequence numbers kept for backward attribution
_MAX_SEARCHES = 32  # heap searches for a parameter's owner per trace (each about 0.1 s)
_MAX_RELATIONS = 100_000  # (parent, child) paths kept; cleared past it
_NOT_UNDER = ()  # a relation's value: the child is no descendant of the parent


def _first_tensor(module: torch.nn.Module) -> torch.Tensor | None:
    """The first parameter, else the first buffer, of ``module`` or its submodules."""
    with torch._C.DisableTorchFunction():
        for tensors in (module.parameters(), module.buffers()):
            for t in tensors:
                if t is not None:
                    return t
    return None


def _resolve(parent: Any, names: tuple[str, ...]) -> Any:
    """The module ``parent._modules[names[0]]._modules[names[1]]...`` (None: no such)."""
    module = parent
    for name in names:
        table = getattr(module, "_modules", None)
        if type(table) is not dict:
            return None
        module = table.get(name)
    return module


class Modules:
    """Module paths of one trace: root names, the module calls in progress, autograd nodes."""

    def __init__(self) -> None:
        #: id(root) -> (its class, its name): only ids and names, no reference to a module
        self.names: dict[int, tuple[type, str]] = {}
        self._root_counts: dict[str, int] = {}
        #: (id(parent), id(child)) -> the child's attribute path under the parent, checked on
        #: every use against the live modules; ``_NOT_UNDER`` (kept one step): not a descendant
        self._relations: dict[tuple[int, int], tuple[str, ...]] = {}
        self._paths: dict[tuple[str, Any], str] = {}
        #: id(module) -> (its class, its path, torch's weak handle on the storage of its first
        #: parameter or buffer or None): a module met under a root, for when it is called
        #: outside it (a checkpoint's recomputation, ``model.block(x)``)
        self._seen: dict[int, tuple[type, str, StorageRef | None]] = {}
        # autograd node sequence number -> module path of the forward copy that made the node
        self._nodes: dict[int, str] = {}
        # (id(tensor), TensorImpl address) -> name of the owners found by a heap search
        self._owners: dict[tuple[int, int], str | None] = {}
        #: the C++ observer's ``module_calls`` while it is engaged (the ``self`` of each
        #: module call on the stack, in one walk in C), else None
        self.module_calls: Any = None

    def name(self, module: torch.nn.Module) -> str:
        """Name of ``module`` as a root: its class, ``#n`` for the n-th root of that class
        met at another address."""
        entry = self.names.get(id(module))
        cls = type(module)
        if entry is not None and entry[0] is cls:
            return entry[1]
        root = cls.__name__
        n = self._root_counts.get(root, 0) + 1
        self._root_counts[root] = n
        if n > 1:
            root = f"{root}#{n}"
        self.names[id(module)] = (cls, root)
        return root

    def release(self) -> None:
        """Let go of the storage handles and the tables (the trace is written)."""
        self.names.clear()
        self._seen.clear()
        self._relations.clear()
        self._paths.clear()

    def step(self) -> None:
        """A step boundary: forget which modules were found not under their callers."""
        relations = self._relations
        for key in [k for k, v in relations.items() if v is _NOT_UNDER]:
            del relations[key]

    def current(self, frame: FrameType | None) -> str | None:
        """Path of the innermost module whose call is in progress at or above ``frame``
        (``None``: not inside a module call)."""
        if frame is None:
            return None
        module_calls = self.module_calls
        if module_calls is not None:  # the C++ observer: one walk in C
            calls = module_calls(frame, _CALL_IMPL)
        else:
            calls = []
            while frame is not None:
                if frame.f_code is _CALL_IMPL:
                    calls.append(frame.f_locals.get("self"))
                frame = frame.f_back
            calls.reverse()
        if not calls:
            return None
        path = parent = None
        relations, paths, seen, names_of = self._relations, self._paths, self._seen, self.names
        for module in calls:  # outermost first: each names the call inside it
            if not isinstance(module, _Module):
                continue
            if parent is None:
                root = names_of.get(id(module))
                if root is not None and root[0] is type(module) and id(module) not in seen:
                    path = root[1]  # the usual case: a root named before
                else:
                    path = self._outermost(module)
                parent = module
                continue
            names = relations.get((id(parent), id(module)))
            # the usual case, a direct child named before: checked on the live parent
            if names is None or len(names) != 1 or parent._modules.get(names[0]) is not module:
                names = self._under(parent, module)
            if names is _NOT_UNDER:  # called from a module it does not belong to: a root
                path = self.name(module)
            elif names:  # (): the same module called again inside its own call
                joined = paths.get((path, names[0])) if len(names) == 1 else None
                path = joined if joined is not None else self._join(path, names)
                known = seen.get(id(module))
                if known is None or known[1] is not path or known[0] is not type(module):
                    self._note(module, path)
            parent = module
        return path

    def _outermost(self, module: torch.nn.Module) -> str:
        """Name of the outermost module call on the stack: the path it was met at under a
        root, when it holds the same storage as then (its first parameter or buffer, whose
        address no other storage can take while copytrace's handle lives), else a root's."""
        seen = self._seen.get(id(module))
        if seen is not None and seen[0] is type(module) and seen[2] is not None:
            first = _first_tensor(module)
            if first is not None:
                with torch._C.DisableTorchFunction():
                    if seen[2].holds(storage_key(first)):
                        return seen[1]
        return self.name(module)

    def _note(self, module: torch.nn.Module, path: str) -> None:
        seen = self._seen
        if len(seen) >= _MAX_RELATIONS:
            seen.clear()
        first = _first_tensor(module)
        seen[id(module)] = (type(module), path, storage_ref(first) if first is not None else None)

    def _join(self, path: Any, names: tuple[str, ...]) -> str:
        """``path.names...``, one string object per path (cached by ``(path, first name)``
        for a direct child, so that the same path is the same object)."""
        key = (path, names[0]) if len(names) == 1 else (path, names)
        out = self._paths.get(key)
        if out is None:
            if len(self._paths) >= _MAX_RELATIONS:
                self._paths.clear()
            out = self._paths[key] = ".".join((path, *names))
        return out

    def _under(self, parent: torch.nn.Module, child: torch.nn.Module) -> tuple[str, ...]:
        """``child``'s attribute path under ``parent`` (``()``: the parent itself;
        ``_NOT_UNDER``: not a descendant). A path found before is used only when it still
        leads from ``parent`` to ``child``."""
        if child is parent:
            return ()
        key = (id(parent), id(child))
        relations = self._relations
        names = relations.get(key)
        if names is _NOT_UNDER or (names is not None and _resolve(parent, names) is child):
            return names
        names = _NOT_UNDER
        for sub_name, sub in parent.named_modules():
            if sub is child:
                names = tuple(sub_name.split("."))
                break
        if len(relations) >= _MAX_RELATIONS:
            relations.clear()
        relations[key] = names
        return names

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

        The module holding ``t`` (and the modules holding that one) are found through the
        garbage collector's referrers, which scans the heap: only for a hazard's message,
        never per event (at most ``_MAX_SEARCHES`` per trace, each cached by ``t``'s
        identity)."""
        key = (id(t), t._cdata)  # identity while t lives; nothing held on t
        if key in self._owners:
            return self._owners[key]
        if len(self._owners) >= _MAX_SEARCHES:
            return None
        name = self._owners[key] = self._search(t)
        return name

    def owner_name_by_identity(self, key: int, cdata: int) -> str | None:
        """:meth:`owner_name` of the live tensor with ``id`` ``key`` and TensorImpl address
        ``cdata`` (found on the garbage collector's heap: only for a hazard's message); None
        when it is gone or is no parameter or buffer."""
        for obj in gc.get_objects():
            if id(obj) == key and issubclass(type(obj), torch.Tensor) and obj._cdata == cdata:
                return self.owner_name(obj)
        return None

    def _search(self, t: torch.Tensor) -> str | None:
        owner = _holder(t, ("_parameters", "_buffers"))
        if owner is None:
            return None
        module, name = owner
        chain = [module]
        for _ in range(16):  # climb to the root, which names its submodules
            parent = _holder(chain[-1], ("_modules",))
            if parent is None:
                break
            chain.append(parent[0])
        root = chain[-1]
        names = self._under(root, module)
        path = self.name(root)
        if names:  # not _NOT_UNDER: the chain leads from the root to the module
            path = self._join(path, names)
        return f"{path}.{name}"


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
