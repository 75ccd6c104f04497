"""Write a trace's events as one Parquet file, to open in pandas, Polars or DuckDB.

The file holds the columnar event table (docs/trace-format.md, "The event table"): one row
per copy or alias event and deepcopy group, columns named as the ``CopyEvent`` fields.
"""

from __future__ import annotations

import argparse
from pathlib import Path

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

    from copytrace._errors import CopytraceError
    from copytrace.tracefile import META_SPANS, event_table

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


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``export`` subcommand to ``subparsers``."""
    parser = add_trace_command(subparsers, "export", __doc__)
    parser.add_argument(
        "--parquet", required=True, metavar="OUT.parquet", help="the Parquet file to write"
    )
    parser.set_defaults(handler=handle)
    return parser
