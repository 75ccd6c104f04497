"""Find the call sites of a copy: the user's line (the first Python frame outside copytrace,
torch, the stdlib and installed packages) and the library's line (the innermost frame of an
installed package other than torch, between the copy and the user's line).

Which code is whose (decided once per code object, by its file's real path):

- copytrace itself and the standard library: neither; passed over.
- torch (its package directory, and ``functorch``, ``torchgen`` and ``typing_extensions``
  installed beside it): a frame that names the ``via`` only.
- a *library*: a file under a ``site-packages`` or ``dist-packages`` directory (an installed
  package: transformers, accelerate, lightning...), or under one of the path prefixes in
  ``COPYTRACE_LIBRARY_PATHS`` (``os.pathsep``-separated: a library installed editable or
  vendored into the project). Its innermost frame is the event's library site.
- code compiled from a string (``<string>``: a dataclass's generated ``__init__``): the kind
  of the module whose globals it runs in (a library's dataclass is the library's).
- everything else (the script, the project's own modules, ``python -c``): the user's code.

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
from typing import Any

from copytrace._env import COPYTRACE_LIBRARY_PATHS

__all__ = ["call_site", "put_site", "user_frame", "user_frame_object", "is_library_file"]


def _dir_of(module_file: str | None) -> str | None:
    if not module_file:
        return None
    return os.path.dirname(os.path.realpath(module_file)) + os.sep


def _extra_libraries() -> tuple[str, ...]:
    """The prefixes of ``COPYTRACE_LIBRARY_PATHS`` (real paths, each ending in a separator)."""
    text = os.environ.get(COPYTRACE_LIBRARY_PATHS, "")
    return tuple(
        os.path.join(os.path.realpath(p.strip()), "") for p in text.split(os.pathsep) if p.strip()
    )


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
_EXTRA: tuple[str, ...] | None = None
# _LIB: torch (names the via); _OTHER: copytrace, the stdlib; _MODE: a mode's handler, passed
# through; _PKG: an installed package other than torch (names the via and the library site).
# The C walk (frames.cpp's call_site) reads the same numbers.
# _STRING: code compiled from a string (`<string>`: dataclasses' and namedtuple's generated
# methods, `python -c`): of the kind of the file whose globals it runs in, the user's code when
# there is none; resolved at its first frame (see _resolve).
_USER, _LIB, _OTHER, _MODE, _PKG, _STRING = 0, 1, 2, 3, 4, 5
# id(code object) -> (code object, kind): keyed by identity, since hashing a code object hashes
# its whole contents (constants, names, bytecode: ~2k instructions per lookup); the entry
# holds the code object, so its id is not reused while the entry lives.
_KIND: dict[int, tuple[CodeType, int]] = {}
_SITE_MARKERS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
# Installed packages that count as torch (the via only, never the library site): torch's
# siblings in its wheel, and typing_extensions, whose `deprecated` wrapper sits around some
# torch functions.
_TORCH_LIKE = frozenset(("torch", "functorch", "torchgen", "typing_extensions.py"))
_MODE_HANDLERS = frozenset(("__torch_function__", "__torch_dispatch__"))


def _kind(filename: str) -> int:
    global _PREFIXES, _EXTRA
    if _PREFIXES is None:
        _PREFIXES = _library_prefixes()
        _EXTRA = _extra_libraries()
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
    for marker in _SITE_MARKERS:
        at = path.find(marker)
        if at >= 0:
            top = path[at + len(marker) :].split(os.sep, 1)[0]
            return _LIB if top in _TORCH_LIKE else _PKG
    if _EXTRA and path.startswith(_EXTRA):
        return _PKG
    for prefix in stdlib:
        if path.startswith(prefix):
            return _OTHER
    return _USER


def _code_kind(code: CodeType, globals_file: Any = None) -> int:
    """The kind of ``code``; for code compiled from a string, :data:`_STRING`, or with
    ``globals_file`` (the ``__file__`` of the globals it runs in) that file's kind."""
    if code.co_name in _MODE_HANDLERS:
        return _MODE
    if code.co_filename == "<string>":
        if globals_file is None:
            return _STRING
        return _kind(globals_file) if isinstance(globals_file, str) else _USER
    return _kind(code.co_filename)


def _resolve(frame: FrameType) -> int:
    """The kind of a :data:`_STRING` frame's code, from its globals' ``__file__``."""
    return _code_kind(frame.f_code, frame.f_globals.get("__file__", 0))


def is_library_file(filename: str) -> bool:
    """True when ``filename`` belongs to copytrace, torch, the standard library or an
    installed package."""
    return _kind(filename) != _USER


def _walk(frame: FrameType | None) -> tuple[FrameType | None, str | None, FrameType | None]:
    """The innermost user-code frame at or above ``frame``, the qualified name of the
    innermost torch or library function met on the way (``None`` if none) and the innermost
    library frame met on the way (``None`` if none)."""
    kinds = _KIND
    via = lib = None
    while frame is not None:
        code = frame.f_code
        entry = kinds.get(id(code))
        if entry is None or entry[0] is not code:
            entry = kinds[id(code)] = (code, _code_kind(code))
        kind = entry[1]
        if kind == _STRING:
            kind = _resolve(frame)
            kinds[id(code)] = (code, kind)
        if kind == _USER:
            return frame, via, lib
        if kind == _PKG:
            if via is None:
                via = getattr(code, "co_qualname", code.co_name)
            if lib is None:
                lib = frame
        elif kind == _LIB and via is None:
            via = getattr(code, "co_qualname", code.co_name)
        frame = frame.f_back
    return None, via, lib


def _triple(frame: FrameType | None, qualified: bool = False) -> tuple[str, int, str] | None:
    if frame is None:
        return None
    code = frame.f_code
    name = getattr(code, "co_qualname", code.co_name) if qualified else code.co_name
    return code.co_filename, frame.f_lineno, name


def call_site(frame: FrameType) -> tuple[Any, ...] | None:
    """Both sites of a copy made below ``frame``: ``(file, line, function, via, library)``,
    as the C observer's ``call_site`` returns it.

    ``file``, ``line``, ``function`` are the user's line (``None`` each when no frame on the
    stack is user code); ``via`` as :func:`user_frame` names it; ``library`` is ``(file, line,
    qualified function name)`` of the innermost library frame between the copy and the
    user's line (transformers' ``sdpa_attention_forward``, ``Trainer._prepare_input``), or
    ``None``.

    Returns:
        The sites, or ``None`` when the stack holds neither a user nor a library frame.
    """
    found, via, lib = _walk(frame)
    if found is None and lib is None:
        return None
    user = _triple(found) or (None, None, None)
    return (*user, via, _triple(lib, True))


def put_site(ev: Any, site: tuple[Any, ...]) -> None:
    """Set the sites :func:`call_site` (or the C observer's) found on event ``ev``."""
    ev.file, ev.line, ev.function, ev.via, lib = site
    if lib is not None:
        ev.lib_file, ev.lib_line, ev.lib_function = lib


def user_frame(frame: FrameType | None = None) -> tuple[str, int, str, str | None] | None:
    """Return ``(file, line, function, via)`` of the innermost frame that is user code.

    ``via`` is the qualified name of the innermost torch or library function between the
    user's frame and copytrace (``clip_grad_norm_``, ``Module._save_to_state_dict``), or ``None`` when the
    user called the copying API directly.

    Args:
        frame: where to start walking outwards; default: the caller's caller.

    Returns:
        The call site, or ``None`` when every frame on the stack is library code (e.g. a copy
        made by autograd's engine with no Python frame above it).
    """
    found, via, _ = _walk(sys._getframe(2) if frame is None else frame)
    if found is None:
        return None
    code = found.f_code
    return code.co_filename, found.f_lineno, code.co_name, via


def user_frame_object(frame: FrameType | None) -> FrameType | None:
    """The innermost user-code frame at or above ``frame`` (see :func:`user_frame`)."""
    return _walk(frame)[0]
