"""``torch._dynamo`` imported when the program imports it, not when tracing starts.

copytrace's compiled-call hooks (:mod:`copytrace.tracer.compiled`) live in dynamo's modules,
and dynamo keeps some of the torch functions it sees when imported (``_engage``: one imported
while copytrace's ``torch.from_numpy`` stood kept the patch and graph-broke on it after the
trace). Importing it at every trace start cost a program that never compiles about 1.7 s of
CPU and 117k objects (0.35-0.4 s more of the interpreter's teardown, and more heap for each
full collection of the cycle collector; ``docs/performance.md``).

Nothing compiled can run before ``torch._dynamo`` is imported (``torch.compile``,
``torch._dynamo.optimize`` and ``torch.export`` import it). So while something waits for it
(:func:`wait`: a trace's compiled-call hooks, the launch's skip of its audit hook), a
``sys.meta_path`` finder, first in the list, waits for the import of ``torch._dynamo``. It
finds the module's spec through the finders after it and wraps that spec's loader's
``exec_module`` for this one import (the instance attribute is deleted when it returns, so
the module's ``__loader__`` is the loader it would have been). Around the module's code, each
waiter's ``aside`` takes copytrace out of the way (the patches out, on the traced thread its
modes off torch's stacks and its observer suppressed: dynamo's modules see what they would see
with no trace); after it, each waiter's ``ready`` runs, once. Then the finder leaves
``sys.meta_path``. An import that fails leaves the finder waiting for the next one.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Waiter", "cancel", "imported", "wait", "waiting"]

_NAME = "torch._dynamo"

#: Puts back what an ``aside`` took away (called once the module's code has run).
Undo = Callable[[], None]


class Waiter:
    """What waits for ``torch._dynamo``: ``ready()`` once it is imported; ``aside()`` (optional)
    just before its modules run, returning what puts things back after them."""

    __slots__ = ("aside", "ready")

    def __init__(self, ready: Callable[[], None], aside: Callable[[], Undo] | None) -> None:
        self.ready = ready
        self.aside = aside


_WAITERS: list[Waiter] = []
_LOCK = threading.Lock()


def imported() -> bool:
    """``torch._dynamo`` is imported: in ``sys.modules`` and its code run to the end."""
    module = sys.modules.get(_NAME)
    if module is None:
        return False
    return not getattr(getattr(module, "__spec__", None), "_initializing", False)


def wait(ready: Callable[[], None], aside: Callable[[], Undo] | None = None) -> Waiter | None:
    """Call ``ready`` now if ``torch._dynamo`` is imported (returns None), else right after the
    program imports it, with ``aside`` around the import (returns the waiter for
    :func:`cancel`). ``ready`` and ``aside`` must not raise."""
    if imported():
        ready()
        return None
    waiter = Waiter(ready, aside)
    with _LOCK:
        _WAITERS.append(waiter)
        _FINDER.install()
    return waiter


def cancel(waiter: Waiter | None) -> None:
    """Stop ``waiter`` waiting; the finder leaves ``sys.meta_path`` when none waits."""
    if waiter is None:
        return
    with _LOCK:
        try:
            _WAITERS.remove(waiter)
        except ValueError:
            pass
        if not _WAITERS:
            _FINDER.remove()


def waiting() -> int:
    """How many waiters wait (for tests)."""
    return len(_WAITERS)


class _Finder:
    """The ``sys.meta_path`` finder; answers for ``torch._dynamo`` only, never finds a module
    itself (the spec is the next finder's)."""

    def __init__(self) -> None:
        self.busy = threading.local()

    def install(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def remove(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != _NAME or getattr(self.busy, "on", False):
            return None
        self.busy.on = True
        try:
            spec = _next_spec(self, fullname, path, target)
        finally:
            self.busy.on = False
        loader = getattr(spec, "loader", None) if spec is not None else None
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_with_aside(module: Any) -> None:
            try:
                del loader.exec_module  # the class's own method again
            except AttributeError:
                pass
            _run_import(exec_module, module)

        try:
            loader.exec_module = exec_with_aside
        except Exception:  # a loader without an instance dict: dynamo imported as is
            pass
        return spec


def _next_spec(finder: _Finder, fullname: str, path: Any, target: Any) -> Any:
    """The spec the finders after ``finder`` give (what the import would use without it)."""
    for other in list(sys.meta_path):
        if other is finder:
            continue
        find = getattr(other, "find_spec", None)
        if find is None:
            continue
        spec = find(fullname, path, target)
        if spec is not None:
            return spec
    return None


def _run_import(exec_module: Callable[[Any], None], module: Any) -> None:
    """Run dynamo's module code with every waiter's ``aside`` around it, then the waiters'
    ``ready`` (the module's own errors go to the program, as untraced)."""
    with _LOCK:
        waiters = list(_WAITERS)
    undo = [w.aside() for w in waiters if w.aside is not None]
    try:
        exec_module(module)
    finally:
        for put_back in reversed(undo):
            put_back()
    with _LOCK:
        for w in waiters:
            if w in _WAITERS:
                _WAITERS.remove(w)
        if not _WAITERS:
            _FINDER.remove()
    for w in waiters:
        w.ready()


_FINDER = _Finder()
