"""What a session installs while its steps are traced, and removes in between.

On the native path (copytrace's C++ observer, :mod:`copytrace.tracer._observer`): at level
``lean`` C wrappers on the copying API and a function mode pushed only while a write must be
seen; at ``full`` and ``api`` the observer's function mode on torch's stack. On the Python
path: :class:`~copytrace.tracer._recorder.FunctionMode` and, unless ``api``,
:class:`~copytrace.tracer._recorder.DispatchMode`. Both paths patch ``copy.deepcopy`` and
friends (``_recorder.install_patches``) and let ``torch.compile``'d code run compiled,
stepping aside at each compiled call (:mod:`copytrace.tracer.compiled`); where this torch
offers no hook for that and a Python dispatch mode is on, torch.compile is put in its
``force_eager`` stance instead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from copytrace.tracer import _dynamo_import, _legacy, _observer, _recorder, _tensor_new, _warnshim
from copytrace.tracer import compiled as _compiled
from copytrace.tracer.compiled._compiled import _skip_dynamo
from copytrace.tracer.compiled._hook import Pending, _hookable, _suppress
from copytrace.tracer.compiled.stepaside import DISPATCH_STACK, FUNCTION_STACK, lift, lower

__all__ = ["Engagement"]


def _force_eager() -> Any:
    """Fallback for a torch whose compiled callables offer no hook (see ``_compiled``): put
    torch.compile in its ``force_eager`` stance while the dispatch mode is active.

    Any active TorchDispatchMode makes compiled frames run eagerly; but with ``fullgraph=True``
    torch then raises "found no compiled frames". In the ``force_eager`` stance compiled
    functions simply run as Python, traced op by op. Returns the stance object (its
    ``__exit__`` restores the previous stance), or None.
    """
    try:
        return torch.compiler.set_stance("force_eager")
    except Exception:  # a torch without stances
        return None


class Engagement:
    """The modes, wrappers, patches and compiled-call hooks of one session.

    Attributes:
        engaged: they are in place.
        modes: copytrace's modes on torch's stacks, bottom first.
        lean_mode: level lean's function mode, pushed only while writes are watched.
        stance: the ``force_eager`` stance where compiled regions cannot be hooked.
        compiled: the compiled regions' records (from the first engage to :meth:`close`).
        compiled_mode: ``"compiled"``, or ``"eager"`` (the ``force_eager`` fallback).
    """

    def __init__(self, level: str) -> None:
        self.level = level
        self.engaged = False
        self.modes: list[Any] = []
        self.lean_mode: Any = None
        self.stance: Any = None
        self.compiled: _compiled.Compiled | None = None
        self.compiled_mode: str | None = None
        self._thread: int | None = None  # the traced thread (where engage() is called)
        self._waiter: Any = None  # waiting for torch._dynamo's import (_dynamo_import.wait)
        self._pending: Pending | None = None  # imported on another thread: see ready()

    def engage(self, rec: Any, native: Any, optim_hooks: list[Any]) -> None:
        """Install everything for ``rec`` (no-op when installed)."""
        if self.engaged:
            return
        self.engaged = True
        self._thread = threading.get_ident()
        _recorder.set_active(rec)
        if native is not None:
            fmode = _observer.engage(rec, native, full=self.level != "api")
            if self.level == "lean":  # no mode: the API's callables are wrapped in C instead
                _observer.install_wrappers(rec, native)
                _recorder.install_patches()
                self.lean_mode = fmode
            else:
                _recorder.install_patches()
                fmode.__enter__()
                self.modes = [fmode]
            try:  # torch.Tensor([a, b]), torch.FloatTensor([a, b]): tp_new trampolines
                _legacy.install_native(native)
            except Exception as err:
                rec.note_error(err)
            self._compiled_with_dynamo(rec, optim_hooks, eager_fallback=False)
            return
        dmode = _recorder.DispatchMode(rec) if self.level != "api" else None
        # S(t) of a tensor subclass runs with dmode aside; torch.Tensor([a, b]) is recorded
        _recorder.EXTRA_PATCHES[:] = [_tensor_new.patch(dmode, rec, _recorder.MISSING)]
        _legacy.install_python()  # torch.FloatTensor([a, b]) and the other typed ones
        _recorder.install_patches()
        _warnshim.install_python()  # a stacklevel warning lands where it lands untraced
        fmode = _recorder.FunctionMode(rec)
        fmode.__enter__()
        self.modes = [fmode]
        if dmode is not None:
            dmode.__enter__()
            self.modes.append(dmode)
            fmode.dispatch = dmode
            fmode.values = _recorder.ValueMode(rec, dmode)  # its function mode in backward
        self._compiled_with_dynamo(rec, optim_hooks, eager_fallback=self.level != "api")

    def _compiled_with_dynamo(self, rec: Any, optim_hooks: list[Any], eager_fallback: bool) -> None:
        """:meth:`_engage_compiled` now if ``torch._dynamo`` is imported, else right after the
        program imports it (nothing compiled runs before): a program that never compiles does
        not import it (about 1.7 s of CPU at start and 0.35-0.4 s at teardown). Its import
        then runs with copytrace out of the way (:meth:`_aside_for_import`): dynamo keeps some
        of the torch functions it sees when imported; one imported under copytrace's
        ``torch.from_numpy`` patch kept it and graph-broke on ``torch.from_numpy`` after the
        trace (``docs/observer-effects.md``)."""
        if self.compiled is None:  # its run attributes (0 calls) are written in any case
            self.compiled = _compiled.Compiled(rec)
        if _dynamo_import.imported():
            self._engage_compiled(rec, optim_hooks, eager_fallback)
            return

        def ready() -> None:
            if not self.engaged or self._waiter is None:
                return
            self._waiter = None
            try:
                cls = _hookable()
                if threading.get_ident() == self._thread or cls is None:
                    self._engage_compiled(rec, optim_hooks, eager_fallback)
                    return
                # imported on another thread: engaged at the traced thread's first compiled call
                _skip_dynamo()
                self._pending = Pending(cls, self._thread, lambda: self._engage_compiled(
                    rec, optim_hooks, eager_fallback))  # fmt: skip
                self._pending.install()
            except Exception as err:
                rec.note_error(err)

        self._waiter = _dynamo_import.wait(ready, lambda: self._aside_for_import(rec))

    def _aside_for_import(self, rec: Any) -> Callable[[], None]:
        """Take copytrace out of the way while ``torch._dynamo``'s modules run, as if no trace
        were on: every patch (``torch.Tensor``'s too) and the warnings shim out; on the traced
        thread the modes off torch's stacks and the observer suppressed (nothing of dynamo's
        own import is recorded). Returns what puts them back. Never raises."""
        undo: list[Callable[[], None]] = []

        def patches_back() -> None:  # unless the trace stopped meanwhile (another thread's import)
            if self.engaged:
                _recorder.install_patches(stepping_aside=True, tensor_too=True)

        try:
            if _compiled.copy_patched():
                _recorder.remove_patches(stepping_aside=True, tensor_too=True)
                undo.append(patches_back)
            shim = _warnshim.aside()
            undo.append(lambda: _warnshim.back(shim) if self.engaged else None)
            if threading.get_ident() == self._thread:
                undo.append(self._lift_modes(rec))
        except Exception as err:
            rec.note_error(err)

        def put_back() -> None:
            for step in reversed(undo):
                try:
                    step()
                except Exception as err:
                    rec.note_error(err)

        return put_back

    def _lift_modes(self, rec: Any) -> Callable[[], None]:
        """copytrace's modes off this thread's stacks and its observer suppressed (as for a
        compiled call's backward); returns what undoes it."""
        lifted = []
        for mode in [*self.modes, self.lean_mode]:
            for stack in (FUNCTION_STACK, DISPATCH_STACK):
                above = lift(*stack, mode) if mode is not None else None
                if above is not None:
                    lifted.append((stack, mode, above))
        rec.compiled_depth += 1
        _suppress(rec, True)

        def lower_them() -> None:
            _suppress(rec, False)
            rec.compiled_depth = max(0, rec.compiled_depth - 1)
            for (length, _, pop, push), mode, above in reversed(lifted):
                lower(length, pop, push, mode, above)

        return lower_them

    def _engage_compiled(self, rec: Any, optim_hooks: list[Any], eager_fallback: bool) -> None:
        """Let torch.compile'd code run compiled (copytrace steps aside at each compiled call);
        where this torch offers no hook for it and a Python dispatch mode is on
        (``eager_fallback``), fall back to the ``force_eager`` stance."""
        if self.compiled is None:
            self.compiled = _compiled.Compiled(rec)
        try:
            modes = self.modes or ([self.lean_mode] if self.lean_mode is not None else [])
            ok = self.compiled.engage(modes, optim_hooks)
        except Exception as err:
            rec.note_error(err)
            self.compiled.disengage()
            ok = False
        if ok:
            self.compiled_mode = "compiled"
        elif eager_fallback:
            self.compiled_mode = "eager"
            self.stance = _force_eager()

    def disengage(self, rec: Any, force: bool = False) -> bool:
        """Remove everything; False (nothing removed) when the program pushed modes of its
        own above copytrace's and ``force`` is not set (the end of the run)."""
        if not self.engaged:
            return True
        if not force and self.modes and not self._modes_on_top():
            return False
        self.engaged = False
        _dynamo_import.cancel(self._waiter)
        self._waiter = None
        if self._pending is not None:
            self._pending.remove()
            self._pending = None
        if self.compiled is not None:
            self.compiled.disengage()
        for mode in reversed(self.modes):
            try:
                mode.__exit__(None, None, None)
            except Exception as err:  # the user's code left the mode stack unbalanced
                rec.note_error(err)
        self.modes = []
        if rec.native is not None:
            try:
                _legacy.remove_native(rec.native)
                if self.level == "lean":
                    _observer.remove_wrappers(rec, rec.native)
                _observer.disengage(rec)
            except Exception as err:
                rec.note_error(err)
        if self.stance is not None:
            try:
                self.stance.__exit__(None, None, None)  # back to the program's own stance
            except Exception as err:
                rec.note_error(err)
            self.stance = None
        _warnshim.remove()
        _recorder.remove_patches()
        if rec.native is None:  # the fallback's torch.Tensor.__new__ (_tensor_new.py)
            _recorder.EXTRA_PATCHES.clear()
            _tensor_new.end()
            _legacy.remove_python()
        _recorder.set_active(None)
        return True

    def _modes_on_top(self) -> bool:
        from torch.overrides import _get_current_function_mode_stack
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        fstack = _get_current_function_mode_stack()
        dstack = _get_current_dispatch_mode_stack()
        if not (fstack and fstack[-1] is self.modes[0]):
            return False
        return len(self.modes) < 2 or bool(dstack and dstack[-1] is self.modes[1])

    def close(self) -> None:
        """The run ended: release the compiled regions' hooks for good."""
        if self.compiled is not None:
            self.compiled.close()
