"""Former home of the trace reader, now :mod:`copytrace.tracefile` (kept for old imports)."""

from copytrace.tracefile._reader import (  # noqa: F401
    TRACE_GLOBS,
    Event,
    Run,
    Step,
    TraceData,
    decode_value,
    load_trace,
)
