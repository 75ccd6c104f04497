"""Write a trace's events as one Parquet file, or as a Hive-partitioned Parquet dataset.

The file holds the columnar event table (docs/trace-format.md, "The event table"): one row
per copy or alias event and deepcopy group, columns named as the ``CopyEvent`` fields. The
dataset (``--dataset OUT``) holds the same rows, one file per traced process, under
``OUT/run_id=<id>/host=<host>/rank=<rank>/`` (docs/trace-format.md, "The dataset").
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
    if args.dataset is not None:
        return _dataset(args)
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


def _dataset(args: argparse.Namespace) -> int:
    """Write ``args.dataset`` from the trace at ``args.path``; say how many rows and runs."""
    from copytrace._errors import CopytraceError
    from copytrace.tracefile import event_table
    from copytrace.tracefile._dataset import write_dataset

    out = Path(args.dataset)
    if out.exists() and not out.is_dir():
        raise CopytraceError(f"--dataset must name a directory, not a file: {out}")
    path = Path(args.path)
    table = event_table(path)
    warn_unreadable(table, path)
    try:
        parts = write_dataset(table, out)
    except OSError as err:
        raise CopytraceError(f"cannot write {out}: {err.strerror or err}") from err
    runs = sorted({p.run_id for p in parts})
    print(f"copytrace: {sum(p.rows for p in parts)} events of {len(parts)} process(es) written "
          f"to {out} (run_id {', '.join(runs)})")
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``export`` subcommand to ``subparsers``."""
    parser = add_trace_command(subparsers, "export", __doc__)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--parquet", metavar="OUT.parquet", help="the Parquet file to write")
    where.add_argument(
        "--dataset", metavar="OUT", default=None,
        help="the Hive-partitioned dataset folder to write into (run_id=/host=/rank=); "
        "other runs in it are kept",
    )  # fmt: skip
    parser.set_defaults(handler=handle)
    return parser
