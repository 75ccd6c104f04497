"""The columnar sidecar's writer: the event table, written beside the trace file at each flush.

``.copytrace-cache/<trace file>.events/`` beside the trace file holds Parquet parts
``part-000000.parquet``, ``part-000001.parquet``... with exactly the columns of the event
table (:data:`copytrace.schema.TABLE_COLUMNS`), the same rows in the same order as the spans
of the OTLP/JSON file. The file sink hands each flush's spans to :class:`SidecarWriter`,
which builds Arrow columns from the records of the whole flush (never per event) and writes
a part once :data:`PART_ROWS` rows are buffered, and the rest when tracing stops. Each part
is written to a temporary name and renamed, so a part is whole or absent; its key-value
metadata (``copytrace.schema.SIDECAR_KEY_*``) says how many bytes of the trace file its rows
and the parts before it cover, a digest of the 4 KiB before that point
(:func:`copytrace.schema.json_tail`), the table version and the run's resource attributes.

The reader is ``copytrace.tracefile._sidecar``. This module imports pyarrow: the file sink
imports it at its first flush.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from copytrace.schema import (
    ATTRIBUTE_OF,
    PREFIX,
    SIDECAR_KEY_BYTES,
    SIDECAR_KEY_RESOURCES,
    SIDECAR_KEY_TAIL,
    SIDECAR_KEY_VERSION,
    TABLE_COLUMNS,
    TABLE_VERSION,
    event_schema,
    json_tail,
    sidecar_dir,
)

__all__ = ["PART_ROWS", "FlushRows", "SidecarWriter", "event_batch", "meta_row"]

#: Rows buffered before a part is written (bounded memory in the traced process, few parts).
PART_ROWS = 65536
_INT64 = (-(2**63), 2**63 - 1)
_FIELDS = tuple(ATTRIBUTE_OF.items())
_KIND = dict(TABLE_COLUMNS)


# --- values as the OTLP/JSON file stores and the table reads them ----------------------------------
def _roundtrip(value: Any, nested: bool = False) -> Any:
    """``value`` written as an OTLP ``AnyValue`` and read back (tuples become lists, ints
    beyond int64 strings, other objects their ``str``; arrays in arrays are not read)."""
    if value is None or isinstance(value, (bool, str, float)):
        return value
    if isinstance(value, int):
        return value if _INT64[0] <= value <= _INT64[1] else str(value)
    if isinstance(value, (list, tuple)):
        return None if nested else [_roundtrip(v, True) for v in value]
    return str(value)


def _cell(kind: str, value: Any) -> Any:
    """The table's value for an attribute ``value`` in a column of ``kind``: null when the
    file stores it as another OTLP type than the column reads."""
    value = _roundtrip(value)
    if value is None:
        return None
    if kind == "str":
        return value if isinstance(value, str) else None
    if kind == "int":
        return value if type(value) is int else None
    if kind == "bool":
        return value if isinstance(value, bool) else None
    if not isinstance(value, list):
        return None
    inner = "int" if kind == "int_list" else "str"
    return [_cell(inner, v) for v in value]


def _column(name: str, values: list[Any]) -> pa.Array:
    typ = event_schema().field(name).type
    try:
        return pa.array(values, typ)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, ValueError):
        kind = _KIND[name]
        return pa.array([_cell(kind, v) for v in values], typ)


def meta_row(
    trace: str,
    span_id: str,
    parent: str | None,
    name: str,
    start: int,
    end: int,
    attrs: dict[str, Any],
    events: Sequence[tuple[str, int, dict[str, Any]]] = (),
) -> dict[str, Any]:
    """One table row of a span that is not a copy event (run, step, compiled region), as the
    table reads it from the file: attributes and span events as JSON text."""
    decoded = {k: _roundtrip(v) for k, v in attrs.items()}
    row: dict[str, Any] = {"run": trace, "span_id": span_id, "parent_id": parent or None,
                           "name": name, "start_ns": start, "end_ns": end}  # fmt: skip
    for fname, key in _FIELDS:
        row[fname] = _cell(_KIND[fname], attrs.get(key))
    if not row["op"]:
        row["op"] = name[len(PREFIX) :] if name.startswith(PREFIX) else name
    row["attrs_json"] = json.dumps(decoded)
    evs = [[n, t, {k: _roundtrip(v) for k, v in a.items()}] for n, t, a in events]
    row["events_json"] = json.dumps(evs) if evs else None
    return row


def event_batch(
    trace: str,
    ids: list[str],
    parents: list[str],
    names: list[str],
    starts: list[int],
    ends: list[int],
    attrs: list[dict[str, Any]],
) -> pa.RecordBatch:
    """The rows of copy-event spans from their span attributes, as written to the file
    (``event_attributes``: left-out values are absent, hence null), converted by pyarrow
    in one call for the whole flush. A value whose type its column cannot hold is read as
    the file's reader reads it (one value at a time: slower, the same rows)."""
    n = len(ids)
    cols: dict[str, pa.Array] = {
        "run": pa.array([trace] * n, pa.string()),
        "span_id": pa.array(ids, pa.string()),
        "parent_id": pa.array([p or None for p in parents], pa.string()),
        "name": pa.array(names, pa.string()),
        "start_ns": pa.array(starts, pa.int64()),
        "end_ns": pa.array(ends, pa.int64()),
    }
    try:
        fields = pa.RecordBatch.from_pylist(attrs, schema=_key_schema())
        cols.update(zip(ATTRIBUTE_OF, fields.columns, strict=True))
    except (pa.ArrowException, OverflowError, TypeError, ValueError):
        for fname, key in _FIELDS:
            cols[fname] = _column(fname, [a.get(key) for a in attrs])
    if cols["op"].null_count:  # no op attribute: the span name's
        ops = cols["op"].to_pylist()
        cols["op"] = pa.array(
            [o if o else nm[len(PREFIX) :] for o, nm in zip(ops, names, strict=True)], pa.string()
        )
    cols["attrs_json"] = pa.nulls(n, pa.string())
    cols["events_json"] = pa.nulls(n, pa.string())
    return pa.RecordBatch.from_pydict(cols, schema=event_schema())


_KEY_SCHEMA: list[pa.Schema] = []


def _key_schema() -> pa.Schema:
    """The CopyEvent columns named by their span attribute keys."""
    if not _KEY_SCHEMA:
        schema = event_schema()
        _KEY_SCHEMA.append(pa.schema([(key, schema.field(name).type)
                                      for name, key in _FIELDS]))  # fmt: skip
    return _KEY_SCHEMA[0]


class FlushRows:
    """One flush's spans for the columnar sidecar, in file order: runs of copy events (span
    ids, parents, names, times, span attributes), the other spans as ``meta_row`` arguments."""

    __slots__ = ("segments", "ids", "parents", "names", "starts", "ends", "attrs")

    def __init__(self) -> None:
        self.segments: list[tuple[str, Any]] = []
        self._new()

    def _new(self) -> None:
        self.ids: list[str] = []
        self.parents: list[str] = []
        self.names: list[str] = []
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.attrs: list[dict[str, Any]] = []

    def event(self, sid: str, parent: str, name: str, start: int, end: int, attrs: Any) -> None:
        self.ids.append(sid)
        self.parents.append(parent)
        self.names.append(name)
        self.starts.append(start)
        self.ends.append(end)
        self.attrs.append(attrs)

    def batch(self, batch: Any) -> None:
        """A run of copy events already as the table's columns (a ``pyarrow.RecordBatch``)."""
        self.done()
        self.segments.append(("batch", batch))

    def meta(self, *args: Any) -> None:
        self.done()
        if self.segments and self.segments[-1][0] == "meta":
            self.segments[-1][1].append(args)
        else:
            self.segments.append(("meta", [args]))

    def done(self) -> None:
        if self.ids:
            self.segments.append(("events", (self.ids, self.parents, self.names, self.starts,
                                             self.ends, self.attrs)))  # fmt: skip
            self._new()


# --- writer ------------------------------------------------------------------------------------------
class SidecarWriter:
    """Writes the sidecar of one trace file (see the module docstring).

    Args:
        trace: The trace file.
        trace_id: The run's trace id (hex).
        resource: The run's resource attributes.

    Raises:
        OSError: From :meth:`commit` / :meth:`close` when a part cannot be written.
    """

    def __init__(self, trace: Path, trace_id: str, resource: dict[str, Any]) -> None:
        self.trace = trace
        self.dir = sidecar_dir(trace)
        self.trace_id = trace_id
        self._resources = json.dumps({trace_id: {k: _roundtrip(v) for k, v in resource.items()}})
        self._batches: list[pa.RecordBatch] = []
        self._rows = 0
        self._parts = 0
        self._covered = -1
        self._started = False
        self.rows = 0

    def add(self, batch: pa.RecordBatch) -> None:
        """Buffer rows of the current flush (in file order)."""
        if batch.num_rows:
            self._batches.append(batch)
            self._rows += batch.num_rows

    def add_rows(self, rows: list[dict[str, Any]]) -> None:
        """Buffer rows given as dicts (see :func:`meta_row`)."""
        if rows:
            self.add(pa.RecordBatch.from_pylist(rows, schema=event_schema()))

    def commit(self, json_bytes: int, final: bool = False) -> None:
        """The trace file now holds ``json_bytes`` bytes, every buffered row among them:
        write a part when enough rows are buffered (or ``final``)."""
        if not self._started:
            self._start()
        if self._rows >= PART_ROWS or (final and json_bytes != self._covered):
            self._write_part(json_bytes)

    def close(self, json_bytes: int) -> None:
        """Write the buffered rows: the trace file is closed at ``json_bytes`` bytes."""
        self.commit(json_bytes, final=True)

    def remove(self) -> None:
        """Delete the parts written (and the ``.copytrace-cache`` folder when nothing else
        is left in it); a file that cannot be removed is left."""
        for part in [*self.dir.glob("part-*.parquet"), *self.dir.glob("part-*.parquet.tmp")]:
            part.unlink(missing_ok=True)
        for folder in (self.dir, self.dir.parent):
            try:
                folder.rmdir()
            except OSError:  # not empty (another trace file's cache), or gone
                return

    def _start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for old in self.dir.glob("part-*.parquet"):  # the trace file was replaced
            old.unlink()
        self._started = True

    def _write_part(self, json_bytes: int) -> None:
        schema = event_schema()
        table = pa.Table.from_batches(self._batches, schema=schema)
        meta = {
            SIDECAR_KEY_BYTES: str(json_bytes).encode(),
            SIDECAR_KEY_TAIL: json_tail(self.trace, json_bytes).encode(),
            SIDECAR_KEY_VERSION: TABLE_VERSION.encode(),
            SIDECAR_KEY_RESOURCES: self._resources.encode(),
        }
        table = table.replace_schema_metadata(meta)
        path = self.dir / f"part-{self._parts:06d}.parquet"
        tmp = path.with_name(path.name + ".tmp")
        pq.write_table(table, tmp, compression="snappy", write_statistics=False,
                       row_group_size=max(1, table.num_rows))  # fmt: skip
        os.replace(tmp, path)
        self._parts += 1
        self.rows += table.num_rows
        self._covered = json_bytes
        self._batches, self._rows = [], 0
