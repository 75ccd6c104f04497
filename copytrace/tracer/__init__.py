"""Recording: torch modes, the C++ observer, attribution, and the session that streams the
records to :mod:`copytrace.export`'s export thread.

Nothing here imports the trace-file readers, the analysis or the dashboards: the public
:class:`copytrace.Trace` (:mod:`copytrace._trace`) hands those in as hooks.
"""

from copytrace.schema import CopyEvent
from copytrace.tracer._schedule import Schedule
from copytrace.tracer.session import Session

__all__ = ["CopyEvent", "Schedule", "Session"]
