"""Make a warning torch raises in C++ name the program's line on the Python fallback.

torch turns a C++ warning (``TORCH_WARN``) into a Python warning when the C++ call returns to
Python: the binding's ``PyWarningHandler`` buffers it and its destructor calls
``PyErr_WarnEx(category, message, 1)`` (torch's ``torch/csrc/Exceptions.cpp``). Stacklevel 1
is the top Python frame at that moment: the frame that called the C function. Untraced that
is the program's frame. On the fallback copytrace's function mode re-issues the call from its
own Python frame, so the warning would name copytrace's file and line, be matched against
filters as copytrace's module, and be recorded in copytrace's ``__warningregistry__`` (a
"once" or "default" warning then repeats differently).

:func:`call_placed` makes that call from a one-line trampoline whose code carries the
program frame's file name, line and function name and which runs in the program frame's
globals: CPython's ``setup_context`` (``Python/_warnings.c``) reads exactly those (the code's
``co_filename``, the frame's line, ``__name__`` and ``__warningregistry__`` of its globals),
so the warning is filtered, shown and registered as untraced. The warnings filters are not
touched. The trampoline is one more frame in a traceback through the call (it shows the
program's line), next to the mode's own frames the fallback already shows there. Python
callables are called directly: their C calls run from their own frames, as untraced.
"""

from __future__ import annotations

import os
import sys
from types import CodeType, FunctionType
from typing import Any

__all__ = ["call_placed"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # copytrace/
_LAMBDA: CodeType = compile("lambda f, a, k: f(*a, **k)", "<copytrace>", "eval").co_consts[0]
#: (file name, line, function name) -> the trampoline's code; strings and ints only
_CODES: dict[tuple[str, int, str], CodeType] = {}
_MAX_CODES = 4096
_QUALNAME = sys.version_info >= (3, 11)  # code objects carry co_qualname from 3.11


def call_placed(func: Any, args: Any, kwargs: Any) -> Any:
    """``func(*args, **kwargs)``; for a C callable, from a frame that a C++ warning raised
    inside it attributes to the first caller outside copytrace (see the module docstring).
    Returns what ``func`` returns and raises what it raises."""
    if hasattr(func, "__code__"):  # a Python function or method: its own frame places it
        return func(*args, **kwargs)
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
    if frame is None or not frame.f_lineno:
        return func(*args, **kwargs)
    key = (frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
    code = _CODES.get(key)
    if code is None:
        if len(_CODES) >= _MAX_CODES:
            _CODES.clear()
        names = {"co_name": key[2]}
        if _QUALNAME:
            names["co_qualname"] = key[2]
        code = _CODES[key] = _LAMBDA.replace(co_filename=key[0], co_firstlineno=key[1], **names)
    trampoline = FunctionType(code, frame.f_globals)
    del frame
    return trampoline(func, args, kwargs)
