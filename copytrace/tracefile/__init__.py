"""The copytrace trace format: its names, its reader and its columnar event table.

The tracer writes OTLP/JSON-lines files (``docs/trace-format.md``); everything that reads
them (reports, ``copytrace summary``/``check``, hazard analysis) reads them through here,
with the span names, attribute keys and defaults of :mod:`copytrace.schema` (shared with the
writer):

- :func:`load_trace`: the spans as Python objects whose events have the field names of
  :class:`copytrace.CopyEvent`;
- :func:`event_table`: every event as one row of a pyarrow table (columns named as the
  ``CopyEvent`` fields, see ``docs/trace-format.md``), built once by a native JSON parser and
  cached as Parquet beside each trace file.

This module imports nothing heavy: pyarrow is imported when a table is asked for.
"""

from __future__ import annotations

from typing import Any

from copytrace.schema import META_SPANS, TRACE_GLOBS
from copytrace.tracefile._reader import Event, Run, Step, TraceData, decode_value, load_trace

__all__ = [
    "META_SPANS",
    "TRACE_GLOBS",
    "Event",
    "EventTable",
    "Run",
    "RunGroup",
    "Step",
    "TraceData",
    "decode_value",
    "event_table",
    "load_trace",
    "program_args",
    "resource_command",
    "run_groups",
    "table_from_trace",
]


def __getattr__(name: str) -> Any:
    if name in ("EventTable", "event_table", "table_from_trace"):
        from copytrace.tracefile import _table

        return getattr(_table, name)
    if name in ("RunGroup", "program_args", "resource_command", "run_groups"):
        from copytrace.tracefile import _runs

        return getattr(_runs, name)
    raise AttributeError(f"module 'copytrace.tracefile' has no attribute {name!r}")
