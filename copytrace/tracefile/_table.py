"""The columnar event table: every span of a trace as one row of a pyarrow table.

The OTLP/JSON file stays the source of truth. When the tracer wrote its columnar sidecar
(``.copytrace-cache/<file>.events/``, :mod:`._sidecar`), the table is read from it and only
the bytes of the file beyond it are parsed (the hazards span appended at stop); a sidecar
that is cut, unreadable or does not match the file is used up to its last consistent part,
with one line saying so (:attr:`EventTable.notes`). Otherwise the table is built once per
trace file by pyarrow's native JSON reader (a whole block of lines at a time; a block with a bad line is
read line by line, and a line pyarrow cannot type, e.g. an ``intValue`` written as a JSON
number by another writer, goes through the Python reader, so nothing readable is lost) and
cached beside the file as ``.copytrace-cache/<file>.events.parquet``, keyed by the file's
size and mtime.
When the folder is not writable the cache goes to the user's cache folder.

Columns (``docs/trace-format.md`` documents them): ``run`` (the OTLP trace id), ``span_id``,
``parent_id``, ``name``, ``start_ns``, ``end_ns`` (ns since the epoch), then one column per
:class:`copytrace.CopyEvent` field (``op``, ``bytes_allocated``, ``file``, ``line``, ``step``...;
absent attributes take the defaults of :data:`copytrace.schema.FIELD_DEFAULTS`), and
``attrs_json`` / ``events_json``: the full attributes and span events as JSON text, set only
on spans that are not copy events (run, step, hazards, compiled regions).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from copytrace._errors import TraceFileError
from copytrace.schema import CACHE_DIR, SPAN_HAZARDS, SPAN_RUN, SPAN_STEP
from copytrace.tracefile import _reader, _sidecar
from copytrace.tracefile._parse import (
    EVENT_SCHEMA,
    META_SPANS,
    TABLE_VERSION,
    Builder,
    iter_blocks,
    row_of_raw,
)

__all__ = [
    "CACHE_DIR",
    "EVENT_SCHEMA", "META_SPANS", "EventTable", "FileTable", "event_table", "table_from_trace",
]  # fmt: skip


@dataclass
class FileTable:
    """The spans of one trace file.

    Attributes:
        path: The trace file.
        parquet: The Parquet file holding its rows (the cache), or None.
        table: Rows kept in memory: all of them (no cache), those after the sidecar's, or
            None.
        resources: Resource attributes per run (trace id).
        bad_lines: Lines that could not be read.
        rows: Number of rows.
        runs: Trace ids seen.
        sidecar: The tracer's sidecar parts holding the first rows (then ``table`` the rest).
        notes: One line per problem with the sidecar (see :func:`open_sidecar`).
    """

    path: Path
    parquet: Path | None = None
    table: pa.Table | None = None
    resources: dict[str, dict[str, Any]] = field(default_factory=dict)
    bad_lines: int = 0
    rows: int = 0
    runs: list[str] = field(default_factory=list)
    sidecar: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    _footers: list[Any] = field(default_factory=list, repr=False, compare=False)

    def _sidecar_columns(self, columns: list[str], dictionary: list[str] | None) -> pa.Table:
        """``columns`` of the sidecar's parts, each part's footer read once (a part has
        exactly the event table's columns: see
        :func:`~copytrace.tracefile._sidecar.open_sidecar`). Reading one column of a
        1M-event sidecar (16 parts) so takes about 10 ms of CPU, against 20-35 ms through
        ``pq.read_table``, which discovers and inspects every part again; no file stays
        open between reads (64 ranks make thousands of parts)."""
        if not self._footers:
            self._footers = [pq.read_metadata(p) for p in self.sidecar]
        tabs = []
        for path, footer in zip(self.sidecar, self._footers, strict=True):
            with pq.ParquetFile(path, metadata=footer, read_dictionary=dictionary) as f:
                tabs.append(f.read(columns=columns).replace_schema_metadata(None))
        return pa.concat_tables(tabs) if len(tabs) != 1 else tabs[0]

    def read(
        self,
        columns: list[str] | None = None,
        filters: Any = None,
        dictionary: list[str] | None = None,
    ) -> pa.Table:
        """The rows (optionally only ``columns``; ``filters`` as for ``pyarrow.parquet``).

        ``dictionary``: string columns to return dictionary-encoded (``int32`` indices):
        Parquet keeps them so, and reading them so is about 4x faster than decoding every
        value (measured on a 1M-event sidecar: 24 ms against 104 ms for one call-site
        column)."""
        tabs = []
        if self.sidecar and columns is not None and filters is None:
            tabs.append(self._sidecar_columns(columns, dictionary))
        elif self.sidecar:
            schema = EVENT_SCHEMA
            for name in dictionary or ():  # the dataset reads by the schema's types
                i = schema.get_field_index(name)
                schema = schema.set(i, pa.field(name, pa.dictionary(pa.int32(), pa.string())))
            tabs.append(pq.read_table([str(p) for p in self.sidecar], columns=columns,
                                      filters=filters, schema=schema,
                                      read_dictionary=dictionary))  # fmt: skip
        if self.parquet is not None:
            tabs.append(pq.read_table(self.parquet, columns=columns, filters=filters,
                                      read_dictionary=dictionary))  # fmt: skip
        if self.table is not None:
            tab = self.table
            if filters is not None:
                tab = tab.filter(filters)
            tab = tab.select(columns) if columns is not None else tab
            for name in dictionary or ():
                i = tab.schema.get_field_index(name)
                if i >= 0 and not pa.types.is_dictionary(tab.schema.field(i).type):
                    tab = tab.set_column(i, name, pc.dictionary_encode(tab.column(i)))
            tabs.append(tab)
        if len(tabs) == 1:
            return tabs[0]
        if not tabs:
            empty = EVENT_SCHEMA.empty_table()
            return empty.select(columns) if columns is not None else empty
        return pa.concat_tables([t.replace_schema_metadata(None) for t in tabs])

    def stamp_files(self) -> list[Path] | None:
        """Files whose size and mtime identify the rows (to key caches of results), or None
        for rows held in memory only."""
        if self.parquet is not None:
            return [self.parquet]
        if self.sidecar:
            return [self.path, *self.sidecar]
        return None


@dataclass
class EventTable:
    """Every span of a trace file or directory, one :class:`FileTable` per file.

    Attributes:
        files: The trace files, sorted.
        parts: One entry per file.
    """

    files: list[Path]
    parts: list[FileTable]
    analysis_views: Any = None

    def only(self, trace_ids: list[str]) -> EventTable:
        """The same table restricted to the processes ``trace_ids`` (files without any of
        them left out)."""
        keep = set(trace_ids)
        parts = []
        for p in self.parts:
            runs = [r for r in p.runs if r in keep]
            if not runs:
                continue
            if len(runs) == len(p.runs):
                parts.append(p)
                continue
            rows = p.read(filters=pc.is_in(pc.field("run"), pa.array(runs)))
            parts.append(FileTable(p.path, table=rows, rows=rows.num_rows, runs=runs,
                                   resources={r: p.resources.get(r, {}) for r in runs},
                                   bad_lines=p.bad_lines))  # fmt: skip
        return EventTable(sorted({p.path for p in parts}), parts)

    @property
    def bad_lines(self) -> int:
        """Unreadable lines over all files."""
        return sum(p.bad_lines for p in self.parts)

    @property
    def notes(self) -> list[str]:
        """One line per problem met while reading (e.g. a cut columnar sidecar)."""
        return [n for p in self.parts for n in p.notes]

    @property
    def empty_files(self) -> list[Path]:
        """Files without a copytrace span."""
        return [p.path for p in self.parts if p.rows == 0]

    @property
    def resources(self) -> dict[str, dict[str, Any]]:
        """Resource attributes per run (trace id), merged over files."""
        out: dict[str, dict[str, Any]] = {}
        for p in self.parts:
            for run, res in p.resources.items():
                out.setdefault(run, {}).update(res)
        return out

    def unfinished_runs(self) -> list[str]:
        """Runs (trace ids) without a ``copytrace.run`` span: killed, cut or still running."""
        done: set[str] = set()
        for p in self.parts:
            tab = p.read(["run"], filters=pc.equal(pc.field("name"), SPAN_RUN))
            done.update(tab.column("run").to_pylist())
        return sorted({r for p in self.parts for r in p.runs} - done)

    def read(self, columns: list[str] | None = None, filters: Any = None) -> pa.Table:
        """All rows of all files as one table (for small traces and tests)."""
        tables = [p.read(columns, filters) for p in self.parts]
        return pa.concat_tables(tables) if tables else EVENT_SCHEMA.empty_table()



# --- caching ---------------------------------------------------------------------------------
def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{TABLE_VERSION}:{st.st_size}:{st.st_mtime_ns}"


def _cache_paths(path: Path) -> list[Path]:
    beside = path.parent / CACHE_DIR / (path.name + ".events.parquet")
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "copytrace"
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:16]
    return [beside, home / f"{digest}.events.parquet"]


def _load_cached(path: Path, stamp: str) -> FileTable | None:
    for cache in _cache_paths(path):
        try:
            meta = pq.read_schema(cache).metadata or {}
        except (OSError, pa.ArrowInvalid):
            continue
        if meta.get(b"copytrace.source") != stamp.encode():
            continue
        info = json.loads(meta[b"copytrace.info"])
        return FileTable(
            path, parquet=cache, resources=info["resources"], bad_lines=info["bad_lines"],
            rows=info["rows"], runs=info["runs"],
        )  # fmt: skip
    return None


def _store(part: FileTable, table: pa.Table, stamp: str) -> None:
    """Write ``table`` as the part's Parquet cache (beside the file, else the user cache)."""
    info = {"resources": part.resources, "bad_lines": part.bad_lines, "rows": part.rows,
            "runs": part.runs}  # fmt: skip
    meta = {b"copytrace.source": stamp.encode(), b"copytrace.info": json.dumps(info, default=str)}
    table = table.replace_schema_metadata(meta)
    for cache in _cache_paths(part.path):
        tmp = cache.with_name(cache.name + f".{os.getpid()}.tmp")
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(table, tmp, compression="zstd", row_group_size=1 << 20)
            os.replace(tmp, cache)
        except OSError:
            tmp.unlink(missing_ok=True)
            continue
        part.parquet = cache
        return


def build_file_table(
    path: Path, progress: Callable[[int], None] | None = None, cache: bool = True
) -> FileTable:
    """The rows of one trace file, from its cache when it is current, else parsed (and cached).

    Args:
        path: A trace file.
        progress: Called with bytes read from disk, now and then.
        cache: Read and write the Parquet cache.

    Raises:
        OSError: If the file cannot be read.
    """
    size = path.stat().st_size
    side = _sidecar.open_sidecar(path, size)
    notes = [side.note] if side is not None and side.note else []
    if side is not None and side.parts:
        return _with_sidecar(path, side, notes, progress)
    stamp = _stamp(path)
    if cache:
        found = _load_cached(path, stamp)
        if found is not None:
            if progress is not None:
                progress(path.stat().st_size)
            return found
    builder = Builder()
    for block, nbytes in iter_blocks(path):
        if block is None:
            builder.bad_lines += 1
        else:
            builder.add_block(block)
        if progress is not None:
            progress(nbytes)
    table = builder.finish()
    part = FileTable(path, resources=builder.resources, bad_lines=builder.bad_lines, notes=notes)
    part.rows = table.num_rows
    part.runs = sorted(set(pc.unique(table.column("run")).to_pylist())) if table.num_rows else []
    if cache and table.num_rows:
        _store(part, table, stamp)
    if part.parquet is None:
        part.table = table
    return part


def _with_sidecar(
    path: Path, side: _sidecar.Sidecar, notes: list[str], progress: Callable[[int], None] | None
) -> FileTable:
    """The rows of ``path`` from its sidecar, and from the file's bytes beyond it."""
    builder = Builder()
    builder.resources = {run: dict(res) for run, res in side.resources.items()}
    for block, nbytes in iter_blocks(path, side.covered):
        if block is None:
            builder.bad_lines += 1
        else:
            builder.add_block(block)
        if progress is not None:
            progress(nbytes)
    tail = builder.finish()
    if progress is not None:
        progress(side.covered)
    runs = set(side.resources) if side.rows else set()
    if tail.num_rows:
        runs |= set(pc.unique(tail.column("run")).to_pylist())
    return FileTable(path, table=tail if tail.num_rows else None, resources=builder.resources,
                     bad_lines=builder.bad_lines, rows=side.rows + tail.num_rows,
                     runs=sorted(runs), sidecar=side.parts, notes=notes)  # fmt: skip


def event_table(
    path: str | Path,
    *,
    progress: Callable[[int], None] | None = None,
    cache: bool = True,
) -> EventTable:
    """Read a trace file, or every trace file of a directory, as a columnar table.

    Args:
        path: A ``*.otlp.jsonl[.gz]`` file or a directory of them.
        progress: Called with the bytes just read from disk (compressed bytes for gzip).
        cache: Use and write the ``.copytrace-cache/<file>.events.parquet`` caches.

    Returns:
        The table, one part per file (see :class:`EventTable`).

    Raises:
        TraceFileError: If ``path`` is missing, a directory without trace files, or no
            copytrace span could be read from it.
    """
    path = Path(path)
    files = _reader._trace_files(path)
    parts = []
    for file in files:
        try:
            parts.append(build_file_table(file, progress, cache))
        except OSError as err:
            raise TraceFileError(f"cannot read trace file {file}: {err.strerror or err}") from err
    table = EventTable(files, parts)
    if not any(p.rows for p in parts):
        where = files[0] if len(files) == 1 else path
        bad = table.bad_lines
        detail = f" ({bad} unreadable line(s))" if bad else ""
        raise TraceFileError(f"no readable copytrace spans in {where}{detail}")
    return table


def table_from_trace(trace: _reader.TraceData) -> EventTable:
    """The table of an already loaded :class:`~copytrace.tracefile.TraceData` (kept in memory)."""
    parts = []
    for run in trace.runs:
        rows = []
        spans: list[Any] = [*run.events, *run.compiled_calls, *run.compiled_graphs]
        for ev in spans:
            rows.append(row_of_raw(_AsRaw(run.trace_id, ev)))
        for s in run.steps:
            attrs = dict(s.attrs)
            attrs.setdefault("copytrace.step", s.step)
            rows.append(row_of_raw(_AsRaw(run.trace_id, _reader.Event(
                SPAN_STEP, s.span_id, None, s.start_ns, s.end_ns, attrs))))  # fmt: skip
        if run.has_run_span:
            rows.append(row_of_raw(_AsRaw(run.trace_id, _reader.Event(
                SPAN_RUN, "", None, run.start_ns, run.end_ns, dict(run.attrs)))))  # fmt: skip
        if run.hazards:
            rows.append(row_of_raw(_AsRaw(run.trace_id, _reader.Event(
                SPAN_HAZARDS, "", None, run.end_ns, run.end_ns, {},
                tuple(("copytrace.hazard", run.end_ns, h) for h in run.hazards))))) # fmt: skip
        tab = pa.Table.from_pylist(rows, schema=EVENT_SCHEMA)
        path = run.files[0] if run.files else Path("<memory>")
        parts.append(FileTable(path, table=tab, resources={run.trace_id: dict(run.resource)},
                               rows=tab.num_rows, runs=[run.trace_id]))  # fmt: skip
    if parts:
        parts[0].bad_lines = trace.bad_lines
    return EventTable(list(trace.files), parts)


class _AsRaw:
    """A loaded span seen as the reader's raw span (for :func:`_row_of_raw`)."""

    def __init__(self, trace_id: str, ev: Any) -> None:
        self.trace_id = trace_id
        self.span_id = ev.span_id
        self.parent_id = ev.parent_id
        self.name = ev.name
        self.start_ns = ev.start_ns
        self.end_ns = ev.end_ns
        self.attrs = ev.attrs
        self.span_events = ev.span_events

