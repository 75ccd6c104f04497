"""Write a trace's events as one Parquet file, or as a Chrome trace for Perfetto.

``--parquet OUT``: the columnar event table (docs/trace-format.md, "The event table"): one
row per copy or alias event and deepcopy group, columns named as the ``CopyEvent`` fields,
to open in pandas, Polars or DuckDB.

``--chrome-trace OUT.json``: Chrome trace-event JSON (Perfetto, ``chrome://tracing``), one
track per thread, each copy a slice; with ``--merge PROFILER.json`` (torch.profiler's
``export_chrome_trace`` of the same run) one file with both on the profiler's clock
(docs/production.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from copytrace._errors import CopytraceError
from copytrace.cli._common import add_trace_command, warn_unreadable

__all__ = ["handle", "register"]


def handle(args: argparse.Namespace) -> int:
    """Write ``args.parquet`` from the trace at ``args.path`` and say how many rows.

    Returns:
        0 on success.

    Raises:
        TraceFileError: If the trace path is missing, empty or unreadable.
        CopytraceError: If the output cannot be written.
    """
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from copytrace.tracefile import META_SPANS, event_table

    if args.chrome_trace is not None:
        return _chrome(args)
    if args.merge is not None:
        raise CopytraceError("--merge goes with --chrome-trace OUT.json")
    if args.parquet is None:
        raise CopytraceError("say what to write: --parquet OUT.parquet or --chrome-trace OUT.json")
    out = Path(args.parquet)
    if out.is_dir():
        raise CopytraceError(f"--parquet must name a file, not a directory: {out}")
    path = Path(args.path)
    table = event_table(path)
    warn_unreadable(table, path)
    import pyarrow as pa

    meta = pa.array(sorted(META_SPANS))
    n = 0
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        writer = None
        for part in table.parts:  # one file at a time: memory stays bounded
            rows = part.read()
            rows = rows.filter(pc.invert(pc.is_in(rows.column("name"), meta)))
            rows = rows.drop_columns(["attrs_json", "events_json"])
            if writer is None:
                writer = pq.ParquetWriter(out, rows.schema, compression="zstd")
            writer.write_table(rows)
            n += rows.num_rows
        if writer is not None:
            writer.close()
    except OSError as err:
        raise CopytraceError(f"cannot write {out}: {err.strerror or err}") from err
    print(f"copytrace: {n} events written to {out}")
    return 0


def _chrome(args: argparse.Namespace) -> int:
    """``--chrome-trace`` (and ``--merge``): see the module docstring."""
    from copytrace.tracefile import event_table
    from copytrace.tracefile.chrome import merge_into_profiler, write_chrome_trace

    out = Path(args.chrome_trace)
    if out.is_dir():
        raise CopytraceError(f"--chrome-trace must name a file, not a directory: {out}")
    profiler = Path(args.merge) if args.merge is not None else None
    if profiler is not None and not profiler.is_file():
        raise CopytraceError(f"--merge: no such file: {profiler}")
    path = Path(args.path)
    table = event_table(path)
    warn_unreadable(table, path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if profiler is None:
            n = write_chrome_trace(table, out)
        else:
            n = merge_into_profiler(table, profiler, out)
    except ValueError as err:
        raise CopytraceError(str(err)) from err
    except OSError as err:
        raise CopytraceError(f"cannot write {out}: {err.strerror or err}") from err
    merged = f", merged into {profiler}'s timeline" if profiler is not None else ""
    print(f"copytrace: {n} copy slices written to {out}{merged}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``export`` subcommand to ``subparsers``."""
    parser = add_trace_command(subparsers, "export", __doc__)
    parser.add_argument("--parquet", metavar="OUT.parquet", help="the Parquet file to write")
    parser.add_argument(
        "--chrome-trace", metavar="OUT.json",
        help="write a Chrome trace-event file (Perfetto, chrome://tracing)",
    )  # fmt: skip
    parser.add_argument(
        "--merge", metavar="PROFILER.json",
        help="with --chrome-trace: add the copies to torch.profiler's export_chrome_trace "
        "file of the same run, on its clock",
    )  # fmt: skip
    parser.set_defaults(handler=handle)
    return parser
