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
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["install", "remove"]

_ORIG_WARN = warnings.warn
_SHIM: list[Any] = []


def install(native: Any) -> None:
    """Route ``warnings.warn`` through the observer's C shim (idempotent)."""
    if warnings.warn is not _ORIG_WARN:
        return  # the program (or another tool) replaced it: leave it alone
    if not _SHIM:
        _SHIM.append(native.make_warn(_ORIG_WARN))
    warnings.warn = _SHIM[0]


def remove() -> None:
    """Put the original ``warnings.warn`` back if the shim is still installed."""
    if _SHIM and warnings.warn is _SHIM[0]:
        warnings.warn = _ORIG_WARN
