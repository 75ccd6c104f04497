"""copytrace: see every PyTorch tensor copy and alias, what it costs, and where it came from.

Usage::

    import copytrace

    with copytrace.trace("copytrace-out") as t:
        for batch in loader:
            ...
            t.step()
    t.report("report.html")

Importing copytrace imports torch lazily: ``import copytrace`` alone is cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from copytrace._errors import CopytraceError, TraceFileError

__version__ = "0.1.0"

__all__ = ["CopyEvent", "CopytraceError", "Trace", "TraceFileError", "__version__", "trace"]

if TYPE_CHECKING:
    from copytrace.tracer import CopyEvent, Trace, trace


def __getattr__(name: str) -> Any:
    if name in ("trace", "Trace", "CopyEvent"):
        from copytrace import tracer

        return getattr(tracer, name)
    raise AttributeError(f"module 'copytrace' has no attribute {name!r}")
