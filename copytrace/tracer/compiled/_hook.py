"""The hook on dynamo's ``_TorchDynamoContext``: a data descriptor for ``enter_exit_hooks``
whose value is the context's own hooks plus copytrace's enter hook (see the package's
docstring). The hook is compiled.cpp's ``compiled_enter`` where the observer is built, else
:func:`_enter`."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from copytrace.tracer.compiled._compiled import Compiled

_HOOKS_ATTR = "enter_exit_hooks"


def _nothing() -> None:
    return None



# --- the hook on _TorchDynamoContext ----------------------------------------------------------
_STATE: list[Compiled | None] = [None]
_ENTER: list[Callable[[], Callable[[], None]]] = []  # the hook: compiled.cpp's, or _enter


def _suppress(rec: Any, on: bool) -> None:
    """Have the C++ observer's kernels (thread-local) ignore a compiled region's aten ops,
    compile-time and run-time, without a call into Python for each."""
    native = rec.native
    if native is not None:
        if on:
            native.suppress()
        else:
            native.unsuppress()


def _enter() -> Callable[[], None]:
    """copytrace's enter hook: runs at every call of a compiled callable."""
    state = _STATE[0]
    if state is None:
        return _nothing
    return state.enter()


_ENTER.append(_enter)


class _WithHook:
    """A context's own ``enter_exit_hooks`` list, iterated with copytrace's hook at the end;
    everything else (``append`` in ``__init__``...) goes to the context's own list."""

    __slots__ = ("own",)

    def __init__(self, own: list[Any]) -> None:
        self.own = own

    def __iter__(self) -> Any:
        return iter([*self.own, _ENTER[0]])

    def __len__(self) -> int:
        return len(self.own) + 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.own, name)


def _hooks_get(obj: Any) -> Any:
    try:
        own = obj.__dict__[_HOOKS_ATTR]
    except KeyError:
        raise AttributeError(_HOOKS_ATTR) from None
    if obj.__dict__.get("callback") is None:  # torch.compiler.disable: nothing compiled
        return own
    return _WithHook(own)


def _hooks_set(obj: Any, value: Any) -> None:
    obj.__dict__[_HOOKS_ATTR] = value


def _hooks_del(obj: Any) -> None:
    del obj.__dict__[_HOOKS_ATTR]


def _hookable() -> Any:
    """dynamo's ``_TorchDynamoContext`` when its ``compile_wrapper`` runs ``enter_exit_hooks``
    the way this module relies on, else ``None`` (other torch versions)."""
    try:
        from torch._dynamo import eval_frame
    except Exception:
        return None
    cls = getattr(eval_frame, "_TorchDynamoContext", None)
    if cls is None or _HOOKS_ATTR in cls.__dict__:
        return None
    init_names = cls.__init__.__code__.co_names
    wrapper = [
        c for c in cls.__call__.__code__.co_consts
        if getattr(c, "co_name", None) == "compile_wrapper"
    ]  # fmt: skip
    if _HOOKS_ATTR not in init_names or not wrapper:
        return None
    if _HOOKS_ATTR not in _all_names(wrapper[0]):
        return None
    if not callable(getattr(eval_frame, "_callback_from_stance", None)):
        return None
    return cls


def _all_names(code: Any) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _all_names(const)
    return names



class Pending:
    """Stands for a trace's compiled-call hooks when ``torch._dynamo`` was imported on another
    thread than the traced one (:mod:`copytrace.tracer._dynamo_import`): compiled.cpp's hooks
    are installed on the traced thread (a thread-local flag), so the hook on
    ``_TorchDynamoContext`` waits for the traced thread's first compiled call, which runs it
    before dynamo looks at a frame (``compile_wrapper`` calls ``enter_exit_hooks`` before
    ``_callback_from_stance``); ``finish`` then engages there, and the call is recorded.

    Args:
        cls: dynamo's ``_TorchDynamoContext`` (:func:`_hookable`).
        thread: the traced thread's ident.
        finish: engages the compiled-call hooks on the calling thread.
    """

    depth = 0

    def __init__(self, cls: Any, thread: int | None, finish: Callable[[], None]) -> None:
        self.cls = cls
        self.thread = thread
        self.finish = finish
        self.prop = property(_hooks_get, _hooks_set, _hooks_del)

    def install(self) -> None:
        setattr(self.cls, _HOOKS_ATTR, self.prop)
        _STATE[0] = self  # type: ignore[assignment]

    def remove(self) -> None:
        if _STATE[0] is self:
            _STATE[0] = None
        if self.cls.__dict__.get(_HOOKS_ATTR) is self.prop:
            delattr(self.cls, _HOOKS_ATTR)

    def enter(self) -> Callable[[], None]:
        if threading.get_ident() != self.thread:
            return _nothing
        self.remove()
        self.finish()
        state = _STATE[0]
        if state is None or state is self:  # type: ignore[comparison-overlap]
            return _nothing
        return state.enter()


def suspended() -> bool:
    """True while the traced thread runs compiled code (copytrace's observers stand aside)."""
    state = _STATE[0]
    return state is not None and state.depth > 0 and threading.get_ident() == state.thread
