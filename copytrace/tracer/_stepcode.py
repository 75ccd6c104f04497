"""Optimizer steps counted at torch's profiler hook point while an armed session is idle.

``Optimizer.profile_hook_step`` (torch/optim/optimizer.py) calls the empty method
``Optimizer._optimizer_step_code`` after every ``step()``: torch's documented entry point for
its profiler's Python tracer, "a workaround due to lack of a proper step hook". While an
armed session runs (``trigger="signal"``), that function's ``__code__`` is copytrace's::

    def _optimizer_step_code(self):
        if not torch.compiler.is_compiling():
            <the C++ observer>.optimizer_step_seen()

so the idle session counts its steps there, in C, and takes its RecordFunction callback off:
any registered callback costs at every autograd node, not at the step (see
``tracer/_native/steps.cpp``). The function object, its name, qualified name, signature,
file, first line and docstring stay torch's; the observer is a constant of the code, so
nothing is added to torch's module globals. Under ``torch.compile`` the branch is dead
(``is_compiling`` is constant-folded by dynamo), so a compiled ``step()`` traces nothing new
and counts nothing, as the record scope it ignores. The original code is put back at stop
(where copytrace's is still there).
"""

from __future__ import annotations

import types
from typing import Any

__all__ = ["install", "remove", "standing"]

_MARK = "copytrace.optimizer_step_seen"
_TEMPLATE = (
    "def _optimizer_step_code(self):\n"
    "    if not torch.compiler.is_compiling():\n"
    f"        {_MARK!r}.optimizer_step_seen()\n"
)
_saved: tuple[Any, types.CodeType, types.CodeType] | None = None  # (function, torch's, ours)


def _code_for(original: types.CodeType, native: Any) -> types.CodeType:
    module = compile(_TEMPLATE, original.co_filename, "exec")
    (code,) = [c for c in module.co_consts if isinstance(c, types.CodeType)]
    consts = tuple(native if c == _MARK else c for c in code.co_consts)
    extra = {"co_qualname": original.co_qualname} if hasattr(original, "co_qualname") else {}
    return code.replace(co_consts=consts, co_firstlineno=original.co_firstlineno, **extra)


def install(native: Any) -> types.CodeType | None:
    """Put copytrace's code at ``Optimizer._optimizer_step_code``; return the code object of
    ``profile_hook_step``'s wrapper (what the observer looks for on the stack), or None where
    this torch has no such plain method (idle then counts with the callback)."""
    global _saved
    import torch
    from torch.optim import Optimizer

    if _saved is not None:
        return None
    fn = Optimizer.__dict__.get("_optimizer_step_code")
    hook = getattr(Optimizer, "profile_hook_step", None)
    compiler = getattr(torch, "compiler", None)
    if (
        not isinstance(fn, types.FunctionType) or fn.__closure__ is not None or hook is None
        or not hasattr(compiler, "is_compiling")
    ):  # fmt: skip
        return None
    wrapper = hook(_noop).__code__  # every wrapper of profile_hook_step runs this code
    original = fn.__code__
    ours = _code_for(original, native)
    fn.__code__ = ours
    _saved = (fn, original, ours)
    return wrapper  # type: ignore[no-any-return]


def remove() -> None:
    """Put torch's code back (where copytrace's still stands)."""
    global _saved
    if _saved is None:
        return
    fn, original, ours = _saved
    _saved = None
    if fn.__code__ is ours:
        fn.__code__ = original


def standing() -> bool:
    """copytrace's code is at ``Optimizer._optimizer_step_code``."""
    return _saved is not None


def _noop(*_: Any, **__: Any) -> None:
    return None
