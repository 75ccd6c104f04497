"""The flight recorder (``COPYTRACE_RING=N``): only the last N records are kept, and written
when something goes wrong.

A ring session never flushes at step boundaries: its records stay in the recorder's buffer,
and at a step boundary where ``2 N`` are buffered the oldest are let go (:func:`trim`),
keeping the last ``N`` (and the steps they belong to); so memory stays within ``2 N``
records (plus one step's) however long the run, at an amortized cost of one pass per ``N``
records. They are written, with the run span, when the run ends: on an uncaught exception
(``torch.cuda.OutOfMemoryError`` and ``MemoryError`` included), on ``SIGTERM`` (the handler
of :mod:`copytrace.tracer._process`) and at a normal end. ``COPYTRACE_RING_SIGNAL``
(``SIGUSR1``) writes the ring at the next step boundary into a trace file of its own, a
complete trace with its run span, and recording goes on (:func:`dump`).

The run span says so: ``copytrace.ring`` (N), ``copytrace.ring_reason`` (the exception's or
signal's name, or ``the end of the run``) and ``copytrace.ring_skipped`` (older records let
go).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from copytrace.export.file_sink import FileSink
from copytrace.export.pipeline import Chunk, ExportPipeline, RunEnd, RunIds
from copytrace.tracer._buffer import NATIVE_CODECS, new_trace_path

__all__ = ["dump", "trim"]


def trim(rec: Any, buf: Any, keep: int) -> None:
    """Let go of all but the last ``keep`` records (when ``2 keep`` are buffered, between
    two records), and of the steps before the oldest record kept. The records kept are
    shifted down (``seq``, and ``parent`` where the group is kept; else -1), as the recorder
    numbers its buffer."""
    events = rec.events
    if len(events) < 2 * keep or rec.group is not None or rec.active is not None:
        return
    cut = len(events) - keep
    del events[:cut]
    buf.ring_skipped += cut
    # the recorder numbers a record len(events) + dropped: shift the kept ones down by cut
    for ev in events:
        ev.seq -= cut
        if ev.parent is not None and ev.parent >= 0:
            ev.parent = ev.parent - cut if ev.parent >= cut else -1
    first = events[0].step if events else rec.step_index
    buf.step_log = [s for s in buf.step_log if s[0] >= first]


def dump(session: Any, reason: str) -> Path | None:
    """Write the ring now, with a run span, into a trace file of its own (synchronously, on
    the calling thread: the records are not touched by anything else meanwhile); recording
    goes on. Returns the file, or None (``write=False``)."""
    if not session.write:
        return None
    rec, buf = session._rec, session._buf
    path = new_trace_path(session.output_dir, session.compression)
    run = RunIds(session._start_ns, session._epoch_offset, session._resource)
    pipeline = ExportPipeline(run, [FileSink(path, compression=session.compression, **NATIVE_CODECS)])
    pipeline.begin()
    end = time.perf_counter_ns()
    attrs = session.run_attributes()
    attrs["copytrace.ring_reason"] = reason
    steps = [*buf.step_log, (rec.step_index, buf.cur_step_start, end)]
    pipeline.close(Chunk(list(rec.events), steps, final=RunEnd(end, attrs, None)))
    return path
