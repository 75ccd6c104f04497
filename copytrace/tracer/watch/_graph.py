"""Autograd graph reads for the watch: walking nodes, their saved tensors and storages, the
live tensors and nodes found on the heap (the Python fallback), a storage's use count.

Reads metadata only (``SavedTensor.data`` runs no saved-tensor hook and checks no version;
hooked entries are skipped); bounded by ``_MAX_NODES`` nodes per walk. Sources (torch 2.13):
``torch/csrc/autograd/python_cpp_function.cpp`` (``_raw_saved_*``, ``next_functions``,
``metadata``), ``torch/csrc/autograd/python_saved_variable_hooks.cpp``.
"""

from __future__ import annotations

from typing import Any

import torch

from copytrace.tracer._storage_ref import storage_key, storage_of

_Tensor = torch.Tensor
_NoTorchFunction = torch._C.DisableTorchFunction
_NODE = torch.autograd.graph.Node  # autograd's C++ nodes and BackwardCFunction (an ABC)
_MAX_NODES = 200_000  # nodes walked at most from one set of roots


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


def _live_node_keys() -> set[tuple[int, str]]:
    """``(sequence nr, type name)`` of every node of the live tensors' graphs (the Python
    fallback's way to tell that an attached copy's node lives, without holding it)."""
    keys: set[tuple[int, str]] = set()
    seen: set[int] = set()
    hold: list[Any] = []
    for root in _live_graph_roots():
        for node in _walk([root], seen, hold):
            keys.add((node._sequence_nr(), type(node).__name__))
    return keys


def _live_identities() -> set[tuple[int, int]]:
    """``(id, TensorImpl address)`` of every live tensor (a search of the heap: the Python
    fallback's way to tell that a tensor it follows by identity is gone)."""
    import gc

    out = set()
    with _NoTorchFunction():
        for obj in gc.get_objects():
            if issubclass(type(obj), _Tensor):
                try:
                    out.add((id(obj), obj._cdata))
                except Exception:
                    continue
    return out


def _backward_roots(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    if func is _Tensor.backward:
        tensors = args[0] if args else kwargs.get("self")
    elif func is torch.autograd.grad:
        tensors = args[0] if args else kwargs.get("outputs")
    else:
        tensors = args[0] if args else kwargs.get("tensors")
    if isinstance(tensors, _Tensor):
        tensors = (tensors,)
    elif not isinstance(tensors, (list, tuple)):
        return []  # None, or a tensor-like of __torch_function__ (torch hands it the call)
    roots = []
    for t in tensors:
        if not isinstance(t, _Tensor):
            continue  # a tensor-like's `grad_fn` may be anything (a function...): not read
        with _NoTorchFunction():  # a subclass's __torch_function__ does not see the read
            grad_fn = t.grad_fn
        if isinstance(grad_fn, _NODE):
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


def _saved_storages(root: Any, seen: set[int], keep: list[Any], leaves: set[int]) -> dict[int, int]:
    """Storages saved by the graph under ``root`` (nodes not in ``seen``) and not yet freed:
    their bytes by key (the StorageImpl's address, :mod:`copytrace.tracer._storage_ref`: no
    Python storage object made); adds the keys of leaves that require grad (AccumulateGrad) to
    ``leaves``. The nodes walked are added to ``keep``: they hold their saved tensors, and
    so the keys, while the caller keeps it."""
    saved: dict[int, int] = {}
    for node in _walk([root], seen, keep):
        variable = getattr(node, "variable", None)
        if isinstance(variable, _Tensor):  # AccumulateGrad: a parameter, alive anyway
            key = storage_key(variable)
            if key is not None:
                leaves.add(key)
            continue
        for _, tensor in _saved_tensors(node):
            found = storage_of(tensor)
            if found is not None:
                saved[found[0]] = found[1] or 0
    return saved
