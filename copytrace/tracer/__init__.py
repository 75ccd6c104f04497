"""The hot path: torch modes, deepcopy wrapper, attribution and span export.

Public names are re-exported from :mod:`copytrace`.
"""

from copytrace.schema import CopyEvent
from copytrace.tracer._session import Trace, trace

__all__ = ["CopyEvent", "Trace", "trace"]
