"""What every program of the unchanged-program corpus prints besides its own results.

``tests/test_unchanged.py`` runs each corpus program untraced, under ``COPYTRACE=1`` and under
``copytrace run``, and compares the three stdouts exactly. These helpers make everything that
must not change visible on stdout, deterministically:

* :func:`watch_warnings` prints every warning Python shows, when it is shown, as
  ``warning <module>.<Category> <file>:<line> <message>`` (so the category, the file and line
  it is attributed to, the message, and the once-per-location registry all take part);
* :func:`show` prints a tensor's type, dtype, shape, strides, autograd facts and a SHA-256 of
  its bytes (bit-exact values without printing them);
* :func:`section` runs one part of a program, printing the exception it raises, if any, as
  ``raised <Type>: <message>``;
* :func:`dynamo_counters` prints torch.compile's counters: frames, graphs, graph breaks,
  recompiles (not the cache hit/miss counters, which depend on the on-disk cache).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import sysconfig
import warnings
from collections.abc import Iterator
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_PATHS = sysconfig.get_paths()
_ROOTS = [_HERE] + [os.path.abspath(_PATHS[k]) for k in ("purelib", "platlib", "stdlib")]
# site-packages reached through a .pth file (a venv layered over another one's packages)
_ROOTS += [os.path.abspath(p) for p in sys.path if os.path.basename(p) == "site-packages"]


def where(filename: str) -> str:
    """A file name without the machine's prefix: relative to the corpus, site-packages or stdlib."""
    if not filename or filename.startswith("<"):
        return filename
    path = os.path.abspath(filename)
    for root in _ROOTS:
        if path.startswith(root + os.sep):
            return os.path.relpath(path, root)
    return path


def format_warning(message: Any, category: type, filename: str, lineno: int) -> str:
    name = f"{category.__module__}.{category.__qualname__}"
    return f"warning {name} {where(filename)}:{lineno} {message}"


def watch_warnings() -> None:
    """Print each warning Python shows (after filters and the registry), as it is shown."""

    def show(message, category, filename, lineno, file=None, line=None):
        print(format_warning(message, category, filename, lineno), flush=True)

    warnings.showwarning = show


def _own_dispatch(cls: type) -> bool:
    import torch

    return getattr(cls, "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__


def digest(t: Any) -> str:
    """SHA-256 (16 hex digits) of a dense tensor's bytes in row-major order; ``-`` for a meta
    tensor or a wrapper subclass (one with its own ``__torch_dispatch__``), which hold none.

    A subclass's own ``__torch_function__`` is not called (it would count these reads).
    """
    import torch

    if t.device.type == "meta" or _own_dispatch(type(t)):
        return "-"
    with torch._C.DisableTorchFunctionSubclass():
        flat = t.detach().cpu().contiguous().reshape(-1)
        if flat.dtype == torch.bool:
            flat = flat.to(torch.uint8)
        raw = flat.view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()[:16]


def describe(t: Any) -> str:
    """Type, dtype, shape, strides, requires_grad, is_leaf, grad_fn and values' digest."""
    import torch

    with torch._C.DisableTorchFunctionSubclass():
        grad_fn = type(t.grad_fn).__name__ if t.grad_fn is not None else None
        return (
            f"{type(t).__name__} {str(t.dtype).removeprefix('torch.')} {tuple(t.shape)} "
            f"stride={t.stride()} dev={t.device} rg={t.requires_grad} leaf={t.is_leaf} "
            f"grad_fn={grad_fn} sha={digest(t)}"
        )


def show(name: str, t: Any) -> None:
    print(f"{name}: {describe(t)}", flush=True)


@contextlib.contextmanager
def section(name: str) -> Iterator[None]:
    """Run one part of a program; print its exception (type and full message) and go on."""
    print(f"== {name}", flush=True)
    try:
        yield
    except Exception as err:  # the corpus compares what each part raises
        print(f"raised {type(err).__module__}.{type(err).__qualname__}: {err}", flush=True)


def dynamo_counters() -> None:
    """Print torch.compile's counters that say what compiled: frames, graphs, breaks, recompiles."""
    from torch._dynamo.utils import counters

    for group in ("frames", "stats", "graph_break", "recompiles"):
        print(f"counters[{group!r}] = {sorted(counters[group].items())}", flush=True)
    aot = {k: v for k, v in counters["aot_autograd"].items() if "cache" not in k}
    print(f"counters['aot_autograd'] = {sorted(aot.items())}", flush=True)
