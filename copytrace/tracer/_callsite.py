"""Find the user's call site: the first Python frame outside copytrace, torch, the stdlib and
installed packages (``site-packages`` / ``dist-packages``).

A ``__torch_function__`` / ``__torch_dispatch__`` handler on the way (torch's own modes such
as ``with torch.device(...)``'s ``DeviceContext``, or a mode the program defines) is passed
through: it neither names the ``via`` nor counts as the user's frame, since the call it
handles is the user's.

Only called for copy/alias events, never for the ordinary ops that pass through the modes.
Whether a code object belongs to user code is decided once per code object and cached.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from types import CodeType, FrameType

__all__ = ["user_frame", "user_frame_object", "is_library_file"]


def _dir_of(module_file: str | None) -> str | None:
    if not module_file:
        return None
    return os.path.dirname(os.path.realpath(module_file)) + os.sep


def _library_prefixes() -> tuple[tuple[str, ...], tuple[str, ...]]:
    import torch

    own = (
        _dir_of(os.path.join(os.path.dirname(__file__), "..", "__init__.py")),  # copytrace
        _dir_of(torch.__file__),
    )
    stdlib = {
        os.path.realpath(path) + os.sep
        for key in ("stdlib", "platstdlib")
        if (path := sysconfig.get_paths().get(key))
    }
    return tuple(p for p in own if p), tuple(stdlib)


_PREFIXES: tuple[tuple[str, ...], tuple[str, ...]] | None = None
# _LIB: torch or an installed package (names the via); _OTHER: copytrace, the stdlib;
# _MODE: a mode's handler, passed through.
_USER, _LIB, _OTHER, _MODE = 0, 1, 2, 3
# id(code object) -> (code object, kind): keyed by identity, since hashing a code object hashes
# its whole contents (constants, names, bytecode: ~2k instructions per lookup); the entry
# holds the code object, so its id is not reused while the entry lives.
_KIND: dict[int, tuple[CodeType, int]] = {}
_SITE_MARKERS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
_MODE_HANDLERS = frozenset(("__torch_function__", "__torch_dispatch__"))


def _kind(filename: str) -> int:
    global _PREFIXES
    if _PREFIXES is None:
        _PREFIXES = _library_prefixes()
    if filename.startswith("<"):
        # <frozen runpy> is stdlib; <string>, <stdin>, <ipython-input-..> are user code.
        return _OTHER if filename.startswith("<frozen") else _USER
    path = os.path.realpath(filename)
    own, stdlib = _PREFIXES
    if path.startswith(own[0]) if own else False:
        return _OTHER  # copytrace itself
    if path.startswith(own[1:]):
        return _LIB
    # An installed package (also when site-packages lies below the stdlib dir): not the
    # user's code, e.g. typing_extensions' `deprecated` wrapper around a torch function.
    if any(marker in path for marker in _SITE_MARKERS):
        return _LIB
    for prefix in stdlib:
        if path.startswith(prefix):
            return _OTHER
    return _USER


def _code_kind(code: CodeType) -> int:
    if code.co_name in _MODE_HANDLERS:
        return _MODE
    return _kind(code.co_filename)


def is_library_file(filename: str) -> bool:
    """True when ``filename`` belongs to copytrace, torch, the standard library or an
    installed package."""
    return _kind(filename) != _USER


def _walk(frame: FrameType | None) -> tuple[FrameType | None, str | None]:
    """The innermost user-code frame at or above ``frame``, and the qualified name of the
    innermost torch function met on the way (``None`` if none)."""
    kinds = _KIND
    via = None
    while frame is not None:
        code = frame.f_code
        entry = kinds.get(id(code))
        if entry is None or entry[0] is not code:
            entry = kinds[id(code)] = (code, _code_kind(code))
        kind = entry[1]
        if kind == _USER:
            return frame, via
        if kind == _LIB and via is None:
            via = getattr(code, "co_qualname", code.co_name)
        frame = frame.f_back
    return None, via


def user_frame(frame: FrameType | None = None) -> tuple[str, int, str, str | None] | None:
    """Return ``(file, line, function, via)`` of the innermost frame that is user code.

    ``via`` is the qualified name of the innermost torch function between the user's frame
    and copytrace (``clip_grad_norm_``, ``Module._save_to_state_dict``), or ``None`` when the
    user called the copying API directly.

    Args:
        frame: where to start walking outwards; default: the caller's caller.

    Returns:
        The call site, or ``None`` when every frame on the stack is library code (e.g. a copy
        made by autograd's engine with no Python frame above it).
    """
    found, via = _walk(sys._getframe(2) if frame is None else frame)
    if found is None:
        return None
    code = found.f_code
    return code.co_filename, found.f_lineno, code.co_name, via


def user_frame_object(frame: FrameType | None) -> FrameType | None:
    """The innermost user-code frame at or above ``frame`` (see :func:`user_frame`)."""
    return _walk(frame)[0]
