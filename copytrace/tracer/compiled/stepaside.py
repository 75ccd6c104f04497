"""Taking copytrace out of dynamo's sight for a compiled call, and putting it back exactly.

Helpers of :mod:`copytrace.tracer.compiled`: a mode taken off torch's (thread-local) mode
stacks wherever it is, the others left in order; copytrace's hooks taken out of torch's global
hook dicts and put back in their order. The Python fallback's function mode also runs a few
mode-sensitive linalg calls with its dispatch mode stepped aside (:func:`call_without`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "DISPATCH_STACK",
    "FUNCTION_STACK",
    "call_without",
    "hide_hooks",
    "hook_dicts",
    "lift",
    "lower",
    "show_hooks",
]


# --- mode stacks ------------------------------------------------------------------------------
def lift(length: Any, at: Any, pop: Any, push: Any, mode: Any) -> int | None:
    """Take ``mode`` off a mode stack, leaving the others in order; return how many modes
    were above it (``None``: not on the stack)."""
    n = length()
    if n and at(n - 1) is mode:  # the usual case: on top
        pop()
        return 0
    for i in range(n - 1, -1, -1):
        if at(i) is mode:
            above = [pop() for _ in range(n - 1 - i)]  # top first
            pop()
            for m in reversed(above):
                push(m)
            return len(above)
    return None


def lower(length: Any, pop: Any, push: Any, mode: Any, above: int) -> None:
    """Put ``mode`` back with ``above`` modes over it (undoes :func:`lift`)."""
    if not above:
        push(mode)
        return
    above = min(above, length())
    popped = [pop() for _ in range(above)]
    push(mode)
    for m in reversed(popped):
        push(m)


_C = torch._C
FUNCTION_STACK = (
    _C._len_torch_function_stack, _C._get_function_stack_at,
    _C._pop_torch_function_stack, _C._push_on_torch_function_stack,
)  # fmt: skip
DISPATCH_STACK = (
    _C._len_torch_dispatch_stack, _C._get_dispatch_stack_at,
    lambda: _C._pop_torch_dispatch_stack(None), _C._push_on_torch_dispatch_stack,
)  # fmt: skip


def call_without(mode: Any, func: Any, args: Any, kwargs: Any) -> Any:
    """``func(*args, **kwargs)`` with dispatch ``mode`` taken off torch's dispatch mode stack
    (the others left in order), and put back after, also when ``func`` raises."""
    length, at, pop, push = DISPATCH_STACK
    above = lift(length, at, pop, push, mode)
    try:
        return func(*args, **kwargs)
    finally:
        if above is not None:
            lower(length, pop, push, mode, above)


# --- global hooks -----------------------------------------------------------------------------
def hook_dicts(handle: Any) -> list[dict[Any, Any]]:
    out = []
    ref = getattr(handle, "hooks_dict_ref", None)
    d = ref() if ref is not None else None
    if d is not None:
        out.append(d)
    for extra in getattr(handle, "extra_dict_ref", ()) or ():
        d = extra()
        if d is not None:
            out.append(d)
    return out


def hide_hooks(entries: Sequence[tuple[dict[Any, Any], Any]]) -> list[Any]:
    """Remove copytrace's hooks (``(dict, key)`` pairs) from torch's global hook dicts; return
    what restores them: ``(dict, key, value)`` for a hook that was last in its dict (put back
    at the end: the same order), else ``(dict, items before, our keys)``."""
    out: list[Any] = []
    slow: list[tuple[dict[Any, Any], Any]] = []
    for d, key in entries:
        if key not in d:
            continue
        if next(reversed(d)) == key and not slow:
            out.append((d, key, d.pop(key)))
        else:
            slow.append((d, key))
    if slow:
        out.reverse()  # put back what was popped first (it was after the rest)
        for entry in out:
            entry[0][entry[1]] = entry[2]
        out = _hide_slow(entries)
    return out


def _hide_slow(entries: Sequence[tuple[dict[Any, Any], Any]]) -> list[Any]:
    saved: dict[int, tuple[dict[Any, Any], list[Any], set[Any]]] = {}
    for d, key in entries:
        if key not in d:
            continue
        entry = saved.get(id(d))
        if entry is None:
            entry = saved[id(d)] = (d, list(d.items()), set())
        entry[2].add(key)
        del d[key]
    return list(saved.values())


def show_hooks(saved: list[Any]) -> None:
    for entry in reversed(saved):
        if not isinstance(entry[1], list):
            entry[0][entry[1]] = entry[2]  # (dict, key, value): it was last
            continue
        d, items, ours = entry
        if list(d) == [k for k, _ in items if k not in ours]:
            d.clear()  # unchanged meanwhile: the exact order of before
            d.update(items)
        else:
            for k, v in items:
                if k in ours:
                    d[k] = v
