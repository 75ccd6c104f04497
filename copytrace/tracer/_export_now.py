"""A session's buffered events written as spans all at once (:meth:`Session.export`): to a
new trace file, or to an OpenTelemetry exporter the program hands over."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from copytrace.export.file_sink import FileSink
from copytrace.export.pipeline import Chunk, ExportPipeline, RunEnd, RunIds, epoch_offset
from copytrace.export.sdk_sink import SdkSink, make_resource
from copytrace.tracer import _schedule as S
from copytrace.tracer._buffer import NATIVE_CODECS, new_trace_path

__all__ = ["export_buffered"]


def export_buffered(session: Any, exporter: Any, directory: Path | None) -> Path | None:
    """Write ``session``'s buffered events, its step spans and its run span through one
    pipeline: to a new trace file in ``directory`` (else the session's ``output_dir``) when
    ``exporter`` is None, else to ``exporter`` (an OpenTelemetry ``SpanExporter``). Returns the
    new file's path (None for an exporter)."""
    rec = session._rec
    end = session._end_ns or time.perf_counter_ns()
    resource = session._resource if session._resource is not None else make_resource()
    run = RunIds(session._start_ns or end, session._epoch_offset or epoch_offset(), resource)
    path = None
    if exporter is None:
        path = new_trace_path(directory or session.output_dir, session.compression)
        sink: Any = FileSink(path, compression=session.compression, **NATIVE_CODECS)
    else:
        sink = SdkSink([exporter], resource=resource)
    recording = session._action in S.RECORDING
    steps = session._buf.steps_until(rec.step_index, recording, end, run.start_ns)
    pipeline = ExportPipeline(run, [sink])
    pipeline.begin()
    final = RunEnd(end, session.run_attributes(), session._exit_error)
    chunk = Chunk(list(rec.events), steps, final=final)
    compiled = session._engagement.compiled
    if compiled is not None:
        chunk.compiled = [*compiled.calls, *compiled.graph_spans()]
    pipeline.close(chunk)
    return path
