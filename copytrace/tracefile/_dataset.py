"""A trace's events as a Hive-partitioned Parquet dataset, for engines that read one
(DuckDB, Spark, Trino, Polars...): ``OUT/run_id=<id>/host=<host>/rank=<rank>/part-<trace
id>.parquet``.

One file per traced process. The partition keys are also ordinary columns of every file,
with ``schema_version`` (the event table's version), so a file read alone says where it
belongs. ``run_id`` is torchelastic's run id (``copytrace.torchelastic_run_id``) when the
process had one, else the launch's id: ``<pid>-<start ns>``, the lowest process id of the launch (its
root's, as a rule) and its start
(``copytrace.tracefile.run_groups``). Writing a run replaces that run's folder only: the
other runs of the dataset are left as they are, and exporting the same trace twice gives the
same files.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from copytrace.schema import META_SPANS, TABLE_VERSION

__all__ = ["DatasetPart", "write_dataset"]

#: The partition keys, outermost first (low-cardinality only: never the step).
PARTITION_KEYS = ("run_id", "host", "rank")


@dataclass
class DatasetPart:
    """One file written: its partition keys, path and number of rows (events)."""

    run_id: str
    host: str
    rank: int
    path: Path
    rows: int


def _safe(value: str) -> str:
    """A partition value as a folder name: no ``/``, ``=`` or control characters."""
    return re.sub(r"[/\\=\x00-\x1f]", "_", value) or "_"


def _launch_ids(table: Any) -> dict[str, str]:
    """The run id of each process (trace id)."""
    from copytrace.tracefile._runs import run_groups

    out: dict[str, str] = {}
    for group in run_groups(table):
        pids = [table.resources.get(t, {}).get("process.pid") for t in group.trace_ids]
        pid = min((p for p in pids if isinstance(p, int)), default=0)
        launch = f"{pid}-{group.start_ns}"
        for trace in group.trace_ids:
            elastic = table.resources.get(trace, {}).get("copytrace.torchelastic_run_id")
            out[trace] = str(elastic) if elastic else launch
    return out


def _keys(resource: dict[str, Any], run_id: str) -> tuple[str, str, int]:
    rank = resource.get("copytrace.rank")
    return run_id, str(resource.get("host.name") or "unknown"), rank if isinstance(rank, int) else 0


def write_dataset(table: Any, out: Path) -> list[DatasetPart]:
    """Write the events of ``table`` (an :class:`~copytrace.tracefile.EventTable`) under
    ``out``, one Parquet file (zstd) per process.

    Args:
        table: the trace's event table.
        out: the dataset's root folder (created; other runs in it are kept).

    Returns:
        The files written, in the table's order.

    Raises:
        OSError: when a file cannot be written.
    """
    run_ids = _launch_ids(table)
    meta = pa.array(sorted(META_SPANS))
    written: list[DatasetPart] = []
    cleared: set[Path] = set()
    for part in table.parts:
        rows = part.read()
        rows = rows.filter(pc.invert(pc.fill_null(pc.is_in(rows.column("name"), meta), False)))
        rows = rows.drop_columns(["attrs_json", "events_json"]).replace_schema_metadata(None)
        for trace in part.runs:
            mine = rows.filter(pc.equal(rows.column("run"), trace)) if len(part.runs) > 1 \
                else rows  # fmt: skip
            run_id, host, rank = _keys(table.resources.get(trace, {}), run_ids.get(trace, trace))
            n = mine.num_rows
            mine = mine.append_column("run_id", pa.array([run_id] * n, pa.string()))
            mine = mine.append_column("host", pa.array([host] * n, pa.string()))
            mine = mine.append_column("rank", pa.array([rank] * n, pa.int64()))
            mine = mine.append_column("schema_version", pa.array([TABLE_VERSION] * n, pa.string()))
            run_dir = out / f"run_id={_safe(run_id)}"
            if run_dir not in cleared:  # the run is written afresh, the others are kept
                shutil.rmtree(run_dir, ignore_errors=True)
                cleared.add(run_dir)
            folder = run_dir / f"host={_safe(host)}" / f"rank={rank}"
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"part-{_safe(trace)}.parquet"
            pq.write_table(mine, path, compression="zstd")
            written.append(DatasetPart(run_id, host, rank, path, n))
    return written
