"""Write a trace's events as one Parquet file, a Hive-partitioned Parquet dataset, or a Chrome
trace for Perfetto.

``--parquet OUT``: the columnar event table (docs/trace-format.md, "The event table"): one row
per copy or alias event and deepcopy group, columns named as the ``CopyEvent`` fields. An
attribute the trace leaves out because it holds its common value (a false flag, 0 new bytes,
no transfer) is written as that value, never null, so ``WHERE NOT noop AND NOT alias`` and
pandas' ``~df.alias`` work. A deepcopy group row has 0 in ``bytes_allocated`` and
``bytes_logical`` (its child rows carry them; its totals are in ``group_bytes_allocated`` /
``group_bytes_logical``), so a sum over all rows counts each byte once.

``--dataset OUT``: the same rows, one file per traced process, under
``OUT/run_id=<id>/host=<host>/rank=<rank>/`` (docs/trace-format.md, "The dataset").

``--chrome-trace OUT.json``: Chrome trace-event JSON (Perfetto, ``chrome://tracing``), one
track per thread, each copy a slice; with ``--merge PROFILER.json`` (torch.profiler's
``export_chrome_trace`` of the same run) one file with both on the profiler's clock
(docs/production.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from copytrace._errors import CopytraceError
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
    if args.chrome_trace is not None:
        return _chrome(args)
    if args.merge is not None:
        raise CopytraceError("--merge goes with --chrome-trace OUT.json")
    if args.dataset is not None:
        return _dataset(args)
    if args.parquet is None:
        raise CopytraceError(
            "say what to write: --parquet OUT.parquet, --dataset OUT or --chrome-trace OUT.json")
    return _parquet(args)


def _parquet(args: argparse.Namespace) -> int:
    """Write ``args.parquet``: see the module docstring."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

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


def _chrome(args: argparse.Namespace) -> int:
    """``--chrome-trace`` (and ``--merge``): see the module docstring."""
    from copytrace.tracefile import event_table
    from copytrace.tracefile.chrome import merge_into_profiler, read_profiler, write_chrome_trace

    out = Path(args.chrome_trace)
    if out.is_dir():
        raise CopytraceError(f"--chrome-trace must name a file, not a directory: {out}")
    profiler = Path(args.merge) if args.merge is not None else None
    if profiler is not None and not profiler.is_file():
        raise CopytraceError(f"--merge: no such file: {profiler}")
    try:  # the profiler's file is checked before the trace, which may be large, is read
        doc = read_profiler(profiler) if profiler is not None else None
    except (ValueError, OSError) as err:
        raise CopytraceError(f"--merge: {err}") from err
    path = Path(args.path)
    table = event_table(path)
    warn_unreadable(table, path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if doc is None:
            n = write_chrome_trace(table, out)
        else:
            n = merge_into_profiler(table, doc, out)
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
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--parquet", metavar="OUT.parquet", help="the Parquet file to write")
    where.add_argument(
        "--chrome-trace", metavar="OUT.json",
        help="write a Chrome trace-event file (Perfetto, chrome://tracing)",
    )  # fmt: skip
    parser.add_argument(
        "--merge", metavar="PROFILER.json",
        help="with --chrome-trace: add the copies to torch.profiler's export_chrome_trace "
        "file of the same run, on its clock",
    )  # fmt: skip
    where.add_argument(
        "--dataset", metavar="OUT", default=None,
        help="the Hive-partitioned dataset folder to write into (run_id=/host=/rank=); "
        "other runs in it are kept",
    )  # fmt: skip
    parser.set_defaults(handler=handle)
    return parser
