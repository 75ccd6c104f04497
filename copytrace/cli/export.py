"""Write a trace's events as one Parquet file, or as a Hive-partitioned Parquet dataset.

The file holds the columnar event table (docs/trace-format.md, "The event table"): one row
per copy or alias event and deepcopy group, columns named as the ``CopyEvent`` fields. An
attribute the trace leaves out because it holds its common value (a false flag, 0 new bytes,
no transfer) is written as that value, never null, so ``WHERE NOT noop AND NOT alias`` and
pandas' ``~df.alias`` work. A deepcopy group row has 0 in ``bytes_allocated`` and
``bytes_logical`` (its child rows carry them; its totals are in ``group_bytes_allocated`` /
``group_bytes_logical``), so a sum over all rows counts each byte once. The
dataset (``--dataset OUT``) holds the same rows, one file per traced process, under
``OUT/run_id=<id>/host=<host>/rank=<rank>/`` (docs/trace-format.md, "The dataset").
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from copytrace.cli._common import add_trace_command, select_runs, warn_unreadable

__all__ = ["export_rows", "handle", "register"]

#: The columns a group row's totals move to (null on the other rows), in bytes.
GROUP_TOTALS = (("bytes_allocated", "group_bytes_allocated"),
                ("bytes_logical", "group_bytes_logical"))  # fmt: skip


def export_rows(rows: Any) -> Any:
    """The export's form of event-table rows (copy events and groups): absent attributes as
    the values they stand for (:data:`copytrace.schema.FIELD_DEFAULTS`), and each deepcopy
    group's bytes moved from ``bytes_allocated`` / ``bytes_logical`` (0 there) to
    :data:`GROUP_TOTALS`'s columns.

    Args:
        rows: A ``pyarrow.Table`` with the event table's columns, without meta spans.

    Returns:
        A ``pyarrow.Table``: the same rows and columns, plus the two group-total columns.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    from copytrace.schema import FIELD_DEFAULTS

    for name, value in FIELD_DEFAULTS.items():
        i = rows.schema.get_field_index(name)
        if i < 0:
            continue
        kind = rows.schema.field(i).type
        filled = pc.fill_null(rows.column(i), pa.scalar(list(value) if isinstance(value, tuple)
                                                         else value, kind))  # fmt: skip
        rows = rows.set_column(i, name, filled)
    group = pc.fill_null(rows.column("group"), False)
    for name, total in GROUP_TOTALS:
        col = rows.column(name)
        rows = rows.append_column(total, pc.if_else(group, col, pa.scalar(None, col.type)))
        rows = rows.set_column(rows.schema.get_field_index(name), name,
                               pc.if_else(group, pa.scalar(0, col.type), col))  # fmt: skip
    return rows


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
    table = select_runs(event_table(path), args, path)
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
            rows = export_rows(rows.drop_columns(["attrs_json", "events_json"]))
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
