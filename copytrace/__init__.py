"""copytrace: see every PyTorch tensor copy and alias, what it costs, and where it came from.

Usage::

    import copytrace

    with copytrace.trace("copytrace-out") as t:
        for batch in loader:
            ...
            t.step()
    t.report("report.html")

Importing copytrace imports torch lazily: ``import copytrace`` alone is cheap.

PYTEST_DONT_REWRITE: under ``COPYTRACE=1`` the start-up hook imports this package before
pytest starts; the marker tells pytest's assertion rewriter (``mark_rewrite``) that the package
is not one to rewrite, so it does not warn "Module already imported so cannot be rewritten".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from copytrace._errors import CopytraceError, SettingError, TraceFileError
from copytrace._version import __version__

__all__ = [
    "CopyEvent",
    "CopytraceError",
    "Finding",
    "Schedule",
    "SettingError",
    "Trace",
    "TraceFileError",
    "__version__",
    "analyze",
    "load_trace",
    "trace",
]

if TYPE_CHECKING:
    from copytrace._trace import Schedule, Trace, trace
    from copytrace.analysis import Finding, analyze
    from copytrace.tracefile import load_trace
    from copytrace.tracer import CopyEvent

_LAZY = {
    "trace": "copytrace._trace",
    "Trace": "copytrace._trace",
    "CopyEvent": "copytrace.schema",
    "Schedule": "copytrace._trace",
    "analyze": "copytrace.analysis",
    "Finding": "copytrace.analysis",
    "load_trace": "copytrace.dashboards",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'copytrace' has no attribute {name!r}")
    import importlib

    from copytrace._threads import unlisted

    with unlisted():  # torch's and the SDK's imports on a thread threading did not start
        return getattr(importlib.import_module(module), name)
