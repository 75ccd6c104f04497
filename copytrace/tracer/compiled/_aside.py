"""Stepping aside for a compiled call: copytrace's modes off torch's stacks, its optimizer
hooks and patches out of dynamo's sight, only while dynamo may look at them (see the package's
docstring: ``sticky``, ``_sensitive``); and the code objects dynamo is told to skip."""

from __future__ import annotations

import re
import threading
from typing import Any

import torch

from copytrace.tracer import _handover, _patches
from copytrace.tracer.compiled.stepaside import (
    DISPATCH_STACK,
    FUNCTION_STACK,
    hide_hooks,
    lift,
    lower,
    show_hooks,
)

_MAX_CALLBACKS = 64  # dynamo callbacks kept with their wrapper


class StepAside:
    """Stepping aside for :class:`~copytrace.tracer.compiled.Compiled` (a mixin: the state is
    its, set up in its ``__init__``)."""

    rec: Any
    engaged: bool
    depth: int
    thread: int | None
    sticky: bool
    _modes: tuple[Any, Any]
    _hook_entries: list[tuple[dict[Any, Any], Any]]
    _aside: tuple[Any, bool] | None
    _callbacks: dict[int, tuple[Any, Any]]
    _names: Any

    def _suspend(self) -> tuple[Any, Any, Any]:
        """Take copytrace's modes off torch's stacks (cheap C calls, at every compiled call):
        its function mode, or inside backward the fallback's ``ValueMode`` in its place
        (``_modes.run_with_value_mode``), and its dispatch mode. Returns what :meth:`_resume`
        takes."""
        fmode, dmode = self._modes
        f_above = lift(*FUNCTION_STACK, fmode) if fmode is not None else None
        values = getattr(fmode, "values", None)
        if f_above is None and values is not None:
            fmode, f_above = values, lift(*FUNCTION_STACK, values)
        d_above = lift(*DISPATCH_STACK, dmode) if dmode is not None else None
        return f_above, d_above, fmode

    def _resume(self, saved: tuple[Any, Any, Any]) -> None:
        f_above, d_above, fmode = saved
        dmode = self._modes[1]
        if d_above is not None:
            length, _, pop, push = DISPATCH_STACK
            lower(length, pop, push, dmode, d_above)
        if f_above is not None:
            length, _, pop, push = FUNCTION_STACK
            lower(length, pop, push, fmode, f_above)

    # -- patches and hooks: off only while dynamo may look at them -----------------------------
    def _step_aside(self) -> None:
        """Take the optimizer step hooks and the module-level patches away until the outermost
        compiled call ends. Otherwise they stay in place during compiled calls and stand aside
        by themselves (``Recorder.compiled_depth``): dynamo sees them only when it evaluates
        guards (cached code) or traces a frame (a cache miss, which calls its callback first).
        A guard that reads one of them makes the swap happen at every call (``sticky``)."""
        if self._aside is not None:
            return
        hidden = hide_hooks(self._hook_entries)
        patched = copy_patched()
        if patched:
            _patches.remove_patches(stepping_aside=True)
        self._aside = (hidden, patched)

    def _step_back(self) -> None:
        hidden, patched = self._aside
        self._aside = None
        if not self.engaged:  # the trace ended inside the compiled call
            return
        if patched:
            _patches.install_patches(stepping_aside=True)
        show_hooks(hidden)

    def _wrapped(self, callback: Any) -> Any:
        """``callback`` (dynamo's frame callback) stepping aside before dynamo looks at a frame
        (one made per callback and kept: dynamo's cache lookup unwraps it through
        ``_torchdynamo_orig_backend``, as for torch's own stance wrappers)."""
        hit = self._callbacks.get(id(callback))
        if hit is not None and hit[0] is callback:
            return hit[1]

        def _copytrace_callback(*args: Any, **kwargs: Any) -> Any:
            if self.engaged and self.depth and threading.get_ident() == self.thread:
                try:
                    self._step_aside()
                except Exception as err:
                    self.rec.note_error(err)
            result = callback(*args, **kwargs)
            try:
                code = getattr(result, "guarded_code", None)
                if code is not None and not self.sticky:
                    self.sticky = self._sensitive(code.guard_manager)
            except Exception as err:
                self.rec.note_error(err)
                self.sticky = True
            return result

        _copytrace_callback._torchdynamo_orig_backend = callback  # type: ignore[attr-defined]
        skip_codes([_copytrace_callback.__code__], recursive=True)
        if len(self._callbacks) >= _MAX_CALLBACKS:  # many torch.compile calls: keep none alive
            self._callbacks.clear()
        self._callbacks[id(callback)] = (callback, _copytrace_callback)
        return _copytrace_callback

    def _sensitive(self, guard_manager: Any) -> bool:
        """Whether a compiled frame's guards read an attribute copytrace patches (then they
        would fail with the patches in place: a recompile the untraced program never has).
        Read afresh each time (at each compile, and for every cached frame at engage until
        one is found): nothing is kept about torch's guard manager."""
        text = str(guard_manager)
        return any(self._names.search(line.split("#", 1)[0]) for line in text.splitlines())

    def _any_cached_sensitive(self) -> bool:
        """:meth:`_sensitive` over every frame compiled so far (at engage: code compiled before
        tracing started)."""
        try:
            from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
            from torch._dynamo.utils import orig_code_map

            codes = {id(c): c for c in list(orig_code_map.values.values())}
            for code in codes.values():
                for entry in _debug_get_cache_entry_list(code):
                    if self._sensitive(entry.guard_manager):
                        return True
        except Exception as err:
            self.rec.note_error(err)
            return True
        return False


def skip_codes(codes: Any, recursive: bool) -> None:
    """Tell dynamo to skip each code object in ``codes`` (an iterable of ``types.CodeType``):
    a frame of one runs as plain Python, also inside a compiled region, is never traced into
    a graph and is not counted as one of the program's frames (``counters["frames"]``).
    ``recursive``: the frames it calls are skipped too (``FrameAction.SKIP`` for both the
    frame and what it calls); otherwise only the frame itself, and those it calls are seen by
    dynamo as untraced (``FrameAction.DEFAULT`` inside).

    Through ``torch._dynamo.eval_frame.set_code_exec_strategy`` (a C function of
    ``torch._C._dynamo.eval_frame``), which keeps the strategy in dynamo's extra state on the
    code object: no Python state a program could observe. Does nothing on a torch without
    that function. Raises nothing of its own; an item that is not a code object raises what
    torch raises."""
    try:
        from torch._dynamo.eval_frame import (
            FrameAction,
            FrameExecStrategy,
            set_code_exec_strategy,
        )
    except Exception:
        return
    inner = FrameAction.SKIP if recursive else FrameAction.DEFAULT
    for code in codes:
        set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, inner))


def _skip_patch_codes(hooks: Any) -> None:
    """Have dynamo skip the frames of copytrace's patches and hooks themselves (they stand
    aside inside a compiled region), not those they call: inside a compiled region a patched
    ``copy.deepcopy`` shows dynamo the frames of the original, exactly as untraced."""
    codes = [_patches._here.__code__]
    codes += [f.__code__ for f in _patches.PATCH_FUNCTIONS]
    codes += _handover.wrapper_codes()
    for hook in hooks:
        code = getattr(getattr(hook, "__func__", hook), "__code__", None)
        if code is not None:
            codes.append(code)
    skip_codes(codes, recursive=False)


_PATCHED_NAMES = (
    "deepcopy", "copy", "from_numpy", "swap_tensors", "__deepcopy__", "state_dict",
    "load_state_dict", "_global_optimizer_pre_hooks", "_global_optimizer_post_hooks",
)  # fmt: skip


def _patched_names() -> Any:
    """A pattern for a guard's source that reads one of the attributes copytrace patches
    (``G['copy'].deepcopy``, ``dict(...__dict__)['state_dict']``...)."""
    names = set(_PATCHED_NAMES)
    names.update(name for owner, name, _, _ in _patches.EXTRA_PATCHES if owner is not torch.Tensor)
    alt = "|".join(re.escape(n) for n in sorted(names))
    return re.compile(rf"(?:\.(?:{alt})\b|\['(?:{alt})'\])")


def copy_patched() -> bool:
    """Whether copytrace's patches of ``copy``/``torch`` functions are installed now."""
    import copy

    return copy.deepcopy is _patches._traced_deepcopy
