"""The recording side's output: recorded events become OpenTelemetry spans, off the hot path.

- :mod:`.pipeline`: the export thread (:class:`~.pipeline.ExportPipeline`), the chunks the
  session hands it and the :class:`~.pipeline.Sink` protocol its sinks follow;
- :mod:`.otlp_json`: the OTLP/JSON encoder and the attribute code generated from
  :mod:`copytrace.schema`'s field table;
- :mod:`.file_sink`: the trace file (OTLP/JSON lines, gzip) and its sink;
- :mod:`.columnar`: the file sink's bulk path: a run of events as Arrow columns (the
  sidecar's rows) and their spans' OTLP/JSON text built from those columns;
- :mod:`.sidecar`: the columnar sidecar's writer (the event table, as Parquet parts);
- :mod:`.sdk_sink`: real SDK spans for SDK exporters or the user's ``TracerProvider``, the
  resource and the ``OTEL_*`` exporters and sampler;
- :mod:`.hazard_span`: the run's ``copytrace.hazards`` span, from plain dicts;
- :mod:`._osthread`: copytrace's worker threads (export, gzip, a window's report), bare OS
  threads the program's ``threading`` module does not see.

This package imports only :mod:`copytrace.schema` and the ground modules: never the tracer,
the readers, the analysis or the dashboards (an import-linter contract in ``pyproject.toml``
keeps it so). The span model and the attributes are documented in ``docs/trace-format.md``.
"""
