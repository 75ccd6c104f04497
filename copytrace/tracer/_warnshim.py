"""Keep ``warnings.warn(..., stacklevel=N)`` from torch's Python functions where it lands
untraced.

Any active ``TorchFunctionMode`` re-enters a Python-level torch function (``F.softmax``) from
``handle_torch_function``: two frames more (``handle_torch_function`` and the outer call of
the same function) sit between the warning and the user's code, so a warning with a
stacklevel names ``torch/overrides.py`` instead of the caller. While copytrace's C handler
re-enters such a function it keeps that frame; the C ``warn`` from the observer extension,
installed as ``warnings.warn`` while tracing, does not count those two frames. Being a C
function it adds no frame to tracebacks. Warnings raised in C++ do not pass through
``warnings.warn`` and need nothing (the C handler adds no frame either).

The Python fallback (no C++ observer) has no C function to install: :func:`install_python`
installs :func:`_python_warn`, which counts the stacklevel the same way, past the frames of
copytrace's Python function mode, ``handle_torch_function`` and the outer call of the same
torch function, so that the warning names the file and line it names untraced. Being a
Python function it is one frame more in the traceback of a warning turned into an error
(``-W error``), a traceback that on the fallback already shows the mode's frames. A warning
torch raises in C++ inside a call the fallback's function mode re-issues is placed by
:mod:`copytrace.tracer._warnplace`.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

__all__ = ["install", "install_python", "remove"]

_ORIG_WARN = warnings.warn
_SHIM: list[Any] = []
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # copytrace/
_HANDLE: list[Any] = []  # the code of torch.overrides.handle_torch_function, once read


def install(native: Any) -> None:
    """Route ``warnings.warn`` through the observer's C shim (idempotent)."""
    if warnings.warn is not _ORIG_WARN:
        return  # the program (or another tool) replaced it: leave it alone
    if not _SHIM:
        _SHIM.append(native.make_warn(_ORIG_WARN))
    warnings.warn = _SHIM[0]


def install_python() -> None:
    """The Python fallback: route ``warnings.warn`` through :func:`_python_warn`
    (idempotent)."""
    if warnings.warn is not _ORIG_WARN:
        return  # the program (or another tool) replaced it: leave it alone
    if not _HANDLE:
        from torch import overrides

        _HANDLE.append(overrides.handle_torch_function.__code__)
    if _python_warn not in _SHIM:
        _SHIM.append(_python_warn)
    warnings.warn = _python_warn


def remove() -> None:
    """Put the original ``warnings.warn`` back if a shim is still installed."""
    if warnings.warn in _SHIM:
        warnings.warn = _ORIG_WARN


def aside() -> Any:
    """Put the original ``warnings.warn`` back for an import that keeps what it sees
    (``torch._dynamo``: :mod:`._dynamo_import`); returns the shim for :func:`back`, or None."""
    shim = warnings.warn
    if shim in _SHIM:
        warnings.warn = _ORIG_WARN
        return shim
    return None


def back(shim: Any) -> None:
    """Undo :func:`aside` (unless the program replaced ``warnings.warn`` meanwhile)."""
    if shim is not None and warnings.warn is _ORIG_WARN:
        warnings.warn = shim


def _past_reentry(frame: Any) -> tuple[Any, int]:
    """Where ``frame`` is copytrace's function mode re-entering a torch function: the frame
    that called that function from outside (past the mode's frames, ``handle_torch_function``
    and the outer call) and the frames passed; else ``(frame, 0)``."""
    f, passed = frame, 0
    while f is not None and f.f_code.co_filename.startswith(_PACKAGE):
        f, passed = f.f_back, passed + 1
    if passed == 0 or f is None or f.f_code is not _HANDLE[0]:
        return frame, 0
    outer = f.f_back  # the outer call of the same torch function
    if outer is None or outer.f_back is None:
        return frame, 0
    return outer.f_back, passed + 2


def _python_warn(message: Any, category: Any = None, stacklevel: int = 1, *args: Any,
                 **kwargs: Any) -> None:  # fmt: skip
    """``warnings.warn``, its stacklevel counted as untraced (see the module docstring)."""
    if type(stacklevel) is not int:  # refused by warnings.warn as untraced
        return _ORIG_WARN(message, category, stacklevel, *args, **kwargs)
    if stacklevel > 1:
        frame, steps, counted = sys._getframe(1), 0, 1  # the caller: stacklevel 1
        while frame is not None and counted < stacklevel:
            frame, steps = frame.f_back, steps + 1
            if frame is not None:
                frame, passed = _past_reentry(frame)
                steps += passed
            counted += 1
        stacklevel = steps + 1
    # one more: this function's own frame (0 and 1 both name the caller)
    return _ORIG_WARN(message, category, max(stacklevel, 1) + 1, *args, **kwargs)
