"""The report's view of a trace: the event table in DuckDB, plus the runs' metadata.

Every report section computes its part with SQL over the table ``ev`` built here (one row
per copy or alias event, deepcopy groups left out), so aggregation runs in DuckDB's
vectorised engine and out of core: the Parquet caches are scanned, not loaded into Python,
and DuckDB spills to disk past :data:`MEMORY_LIMIT`.

Columns of ``ev``: ``run_idx`` (index into :attr:`Query.runs`; table ``runs`` gives its trace
id, ``run``, and start, ``start_ns``), ``span_id`` (when every event's id is 16 lower-case hex
digits, as OTLP and the tracer write them, its value as ``UBIGINT``, which orders as the text
does; else the text: see :attr:`Query.numeric_ids` and :meth:`Query.span_text`), ``dur`` (ns,
never negative), ``step`` (-1 if unknown),
``kind`` (``copy``/``alias``/``noop``), ``op``, ``module``, ``site`` (``file:line function``
of the site the report groups by: with ``group_by="library"`` the library's call site where
the event has one, else the user's; with ``"user"`` the user's), ``entry`` (the other site:
the user's line beside a library site, the library site beside a user's line; '' if none),
``graph``, ``phase``, ``via``, ``err`` (1 when the op raised), ``bc`` (bytes copied),
``ba`` (bytes allocated; ``bc`` is 0 for a call that raised and for a copy of a meta or
fake tensor, ``copytrace.fake``, which moves no data), ``bl`` (bytes logical), ``src_device``, ``dst_device``,
``transfer``, ``non_blocking``, ``pinned``, ``grp`` (object type of the enclosing deepcopy
group, '' if none), ``grp_id`` (that group's span id, else null), ``start_ns`` and
``end_ns``. The other fields of an event are read from the view ``spans`` for the few events
that need them (each column stored costs CPU: 10M events over 64 ranks are stored
compressed).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb

from copytrace.schema import (
    SPAN_COMPILED,
    SPAN_COMPILED_GRAPH,
    SPAN_HAZARDS,
    SPAN_RUN,
    SPAN_STEP,
)
from copytrace.tracefile import META_SPANS, Event, EventTable

__all__ = ["GROUP_BY", "LARGE_MEMORY_LIMIT", "LARGE_ROWS", "MEMORY_LIMIT", "Query", "RunMeta",
           "StepSpan", "UNKNOWN_SITE"]  # fmt: skip

#: DuckDB's memory cap; beyond it, it spills to a temporary folder.
MEMORY_LIMIT = "512MB"
#: From this many rows on, DuckDB's own tables are stored compressed in a database file
#: (see :class:`Query`), under :data:`LARGE_MEMORY_LIMIT`.
LARGE_ROWS = 3_000_000
LARGE_MEMORY_LIMIT = "320MB"
UNKNOWN_SITE = "(unknown call site)"

#: What the "where from" tables group by: the library's call site (where the event has one,
#: else the user's line; the default) or the user's line. ``--group-by`` of ``copytrace
#: summary`` and ``copytrace report``.
GROUP_BY: tuple[str, ...] = ("library", "user")


def _site_sql(p: str = "", lib: bool = False) -> str:
    """SQL for the ``file:line function`` call-site key of columns prefixed ``p``: the
    user's (``file``, ``line``, ``function``) or the library's (``lib_*``)."""
    f, n, fn = (f"{p}lib_file", f"{p}lib_line", f"{p}lib_function") if lib else (
        f"{p}file", f"{p}line", f"{p}function")  # fmt: skip
    return (
        f"CASE WHEN {f} IS NULL OR {f} = '' THEN '{UNKNOWN_SITE}' ELSE {f}"
        f" || COALESCE(':' || CAST({n} AS VARCHAR), '')"
        f" || COALESCE(' ' || NULLIF({fn}, ''), '') END"
    )


#: Columns the ``ev`` table reads that caches of older table versions may lack, with their
#: SQL types.
_LATER_COLUMNS = (("lib_file", "VARCHAR"), ("lib_line", "BIGINT"), ("lib_function", "VARCHAR"))


def _keys_sql(p: str, group_by: str) -> tuple[str, str]:
    """SQL for the ``site`` and ``entry`` keys of columns prefixed ``p`` (see the module
    docstring)."""
    has_lib = f"COALESCE({p}lib_file, '') <> ''"
    user, lib = _site_sql(p), _site_sql(p, lib=True)
    if group_by == "user":
        return user, f"CASE WHEN {has_lib} THEN {lib} ELSE '' END"
    return (f"CASE WHEN {has_lib} THEN {lib} ELSE {user} END",
            f"CASE WHEN {has_lib} THEN {user} ELSE '' END")  # fmt: skip


def hex_id_sql(col: str) -> str:
    """SQL: whether text column ``col`` is a span id of 16 lower-case hex digits (OTLP's form,
    as the tracer writes it), which :func:`id_value_sql` keys by its value."""
    return (f"length({col}) = 16 AND {col} = lower({col}) AND NOT contains({col}, '_') AND "
            f"TRY_CAST('0x' || {col} AS UBIGINT) IS NOT NULL")  # fmt: skip


def id_value_sql(col: str) -> str:
    """SQL: the ``UBIGINT`` value of span id ``col`` (16 hex digits; ``_`` would be skipped
    by the cast, so :func:`hex_id_sql` refuses it)."""
    return f"TRY_CAST('0x' || {col} AS UBIGINT)"


@dataclass
class StepSpan:
    """One ``copytrace.step`` span (times in ns since the epoch)."""

    step: int
    start_ns: int
    end_ns: int
    span_id: str = ""


@dataclass
class RunMeta:
    """What the report knows of one run besides its events.

    Attributes:
        trace_id: OTLP trace id.
        resource: Resource attributes.
        attrs: Attributes of the ``copytrace.run`` span (empty without one).
        has_run_span: Whether the run span was read.
        start_ns: Run start (run span, else the earliest span), ns since the epoch.
        end_ns: Run end, ns since the epoch.
        steps: Step spans, by step number.
        hazards: Attributes of the ``copytrace.hazard`` span events the tracer wrote.
        compiled: The ``copytrace.compiled`` spans (calls into compiled code), by start.
        compiled_graphs: The ``copytrace.compiled_graph`` spans (with their span events).
        files: Trace files the run was read from.
        spans: Event and group spans read.
    """

    trace_id: str
    resource: dict[str, Any] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)
    has_run_span: bool = False
    start_ns: int = 0
    end_ns: int = 0
    steps: list[StepSpan] = field(default_factory=list)
    hazards: list[dict[str, Any]] = field(default_factory=list)
    compiled: list[Any] = field(default_factory=list)
    compiled_graphs: list[Any] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    spans: int = 0

    @property
    def duration_ns(self) -> int:
        """Run duration in ns (never negative)."""
        return max(0, self.end_ns - self.start_ns)


def _quote(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


class Query:
    """A DuckDB connection over one :class:`~copytrace.tracefile.EventTable`.

    Args:
        table: The trace's table.
        group_by: One of :data:`GROUP_BY`: the call site the ``site`` column holds.

    Raises:
        ValueError: ``group_by`` is not one of :data:`GROUP_BY`.

    Attributes:
        con: The connection (tables ``spans``, ``ev``, ``grp``).
        runs: The runs, by start time until :meth:`build_events` puts them in report order.
        bad_lines: Unreadable lines skipped.
        files: Trace files read.
    """

    def __init__(self, table: EventTable, group_by: str = GROUP_BY[0]) -> None:
        import pyarrow as pa

        if group_by not in GROUP_BY:
            raise ValueError(f"group_by: not {group_by!r}; use {' or '.join(GROUP_BY)}")
        self.group_by = group_by
        # what pyarrow freed (the hazard analysis' columns) goes back to the system before
        # DuckDB builds its tables: the two never add up in the peak
        pa.default_memory_pool().release_unused()
        _trim_heap()
        self.table = table
        self.bad_lines = table.bad_lines
        self.files = list(table.files)
        self._spill = Path(tempfile.mkdtemp(prefix="copytrace-duckdb-"))
        config: dict[str, Any] = {"memory_limit": MEMORY_LIMIT,
                                  "temp_directory": str(self._spill)}  # fmt: skip
        where = ":memory:"
        if sum(p.rows for p in table.parts) >= LARGE_ROWS:
            # a database file in the spill folder: the large tables (``ev``, the hazards'
            # ``hz``, the timeline's ``cls``) are then stored compressed (dictionary,
            # bit-packing), several times smaller than in memory (10M events over 64 ranks:
            # an in-memory ``ev`` is about 3 GB); compressing costs CPU, so a smaller trace
            # keeps them in memory. Small tables stay TEMP (in memory).
            where = str(self._spill / "report.duckdb")
            config.update(memory_limit=LARGE_MEMORY_LIMIT, preserve_insertion_order=False)
        self.con = duckdb.connect(where, config=config)
        self._spans_view()
        self.runs: list[RunMeta] = self._run_metas()
        #: The trace ids by start (run span's, else earliest span's), then trace id: the
        #: analysis' run order over files (``Finding.run`` indexes it) ...
        self.start_order: list[str] = [m.trace_id for m in self.runs]
        #: ... when each file holds one run (a table of a trace loaded in memory: set False)
        self.start_order_known = all(len(p.runs) == 1 for p in table.parts) and len(
            {p.runs[0] for p in table.parts}) == len(table.parts)  # fmt: skip
        #: Whether ``ev.span_id`` holds each id's value (``UBIGINT``), set by
        #: :meth:`build_events`: every event's id is 16 lower-case hex digits.
        self.numeric_ids = False

    def build_events(self, order: list[int]) -> None:
        """Put the runs in report order (``order``: indices into :attr:`runs`) and build
        the ``ev`` table."""
        self.runs = [self.runs[i] for i in order]
        self._events_table()

    def close(self) -> None:
        """Close the connection and remove DuckDB's spill folder."""
        self.con.close()
        shutil.rmtree(self._spill, ignore_errors=True)

    def sql(self, query: str, params: Any = None) -> list[tuple[Any, ...]]:
        """Run ``query`` and return its rows."""
        return self.con.execute(query, params).fetchall()

    def put(self, name: str, columns: dict[str, tuple[Any, list[Any]]]) -> None:
        """Create (or replace) temporary table ``name`` from Python columns
        ``{column: (pyarrow type, values)}``, through Arrow (row inserts are slow)."""
        import pyarrow as pa

        data = pa.table({c: pa.array(v, type=t) for c, (t, v) in columns.items()})
        self.con.register("_put", data)
        self.con.execute(f"CREATE OR REPLACE TEMP TABLE {name} AS SELECT * FROM _put")
        self.con.unregister("_put")

    def _spans_view(self) -> None:
        """The view ``spans``: one scan of every sidecar part, one of every Parquet cache
        and one of the rows held in memory (a scan per file of 64 rank files ran out of
        DuckDB's memory limit on 10M events)."""
        import pyarrow as pa

        seen: set[str] = set()
        overlap = False
        sides = [str(f) for part in self.table.parts for f in part.sidecar]
        caches = [str(part.parquet) for part in self.table.parts if part.parquet is not None]
        mems = [part.table for part in self.table.parts if part.table is not None]
        for part in self.table.parts:
            overlap |= bool(seen & set(part.runs))
            seen |= set(part.runs)
        parts = [f"SELECT * FROM read_parquet([{', '.join(_quote(f) for f in files)}], "
                 "union_by_name=true)" for files in (sides, caches) if files]  # fmt: skip
        if mems:
            self.con.register("mem", pa.concat_tables(
                [t.replace_schema_metadata(None) for t in mems], promote_options="permissive"))
            parts.append("SELECT * FROM mem")
        body = " UNION ALL BY NAME ".join(parts)  # caches of older layouts lack new columns
        if overlap:  # a run split over files: keep each span once
            body = (f"SELECT * FROM ({body}) QUALIFY row_number() OVER "
                    "(PARTITION BY run, span_id) = 1")  # fmt: skip
        have = {r[0] for r in self.sql(f"DESCRIBE SELECT * FROM ({body})")}
        missing = [f"CAST(NULL AS {t}) AS {c}" for c, t in _LATER_COLUMNS if c not in have]
        if missing:  # a cache written before these columns: they read as absent
            body = f"SELECT *, {', '.join(missing)} FROM ({body})"
        self.con.execute(f"CREATE VIEW spans AS {body}")

    def _run_metas(self) -> list[RunMeta]:
        metas: dict[str, RunMeta] = {}
        resources = self.table.resources
        for part in self.table.parts:
            for run in part.runs:
                meta = metas.setdefault(run, RunMeta(run, dict(resources.get(run, {}))))
                meta.files.append(part.path)
        meta_names = ", ".join(_quote(n) for n in sorted(META_SPANS))
        rows = self.sql(
            f"SELECT run, name, span_id, start_ns, end_ns, step, CASE WHEN name <> "
            f"{_quote(SPAN_STEP)} THEN attrs_json END, CASE WHEN name <> {_quote(SPAN_STEP)} "
            f"THEN events_json END FROM spans WHERE name IN ({meta_names}) "
            f"ORDER BY start_ns, span_id"
        )
        for run, name, span_id, start, end, step, attrs_json, events_json in rows:
            meta = metas.setdefault(run, RunMeta(run))
            if name == SPAN_STEP:  # the most of them (100k on 64 ranks): no attributes read
                meta.steps.append(StepSpan(-1 if step is None else step, start, end, span_id))
            elif name == SPAN_RUN:
                meta.attrs.update(json.loads(attrs_json) if attrs_json else {})
                meta.has_run_span, meta.start_ns, meta.end_ns = True, start, end
            elif name == SPAN_HAZARDS and events_json:
                meta.hazards.extend(a for n, _t, a in json.loads(events_json)
                                    if n == "copytrace.hazard")  # fmt: skip
            elif name in (SPAN_COMPILED, SPAN_COMPILED_GRAPH):
                attrs = json.loads(attrs_json) if attrs_json else {}
                events = tuple(tuple(e) for e in json.loads(events_json)) if events_json else ()
                span = Event(name, span_id, None, start, end, attrs, events)
                (meta.compiled if name == SPAN_COMPILED else meta.compiled_graphs).append(span)
        bounds = self.sql(
            f"SELECT run, min(start_ns), max(end_ns), count(*) FILTER (WHERE name NOT IN "
            f"({meta_names})) FROM spans GROUP BY run"
        )
        for run, lo, hi, n in bounds:
            meta = metas.setdefault(run, RunMeta(run))
            meta.spans = n
            if not meta.has_run_span:
                meta.start_ns, meta.end_ns = lo or 0, hi or lo or 0
        for meta in metas.values():
            _number_steps(meta.steps)
        return sorted(metas.values(), key=lambda m: (m.start_ns, m.trace_id))

    def _events_table(self) -> None:
        import pyarrow as pa

        con = self.con
        s, i64 = pa.string(), pa.int64()
        self.put("runs", {
            "run": (s, [m.trace_id for m in self.runs]),
            "run_idx": (pa.int32(), list(range(len(self.runs)))),
            "start_ns": (i64, [m.start_ns for m in self.runs]),
        })  # fmt: skip
        steps = [(m.trace_id, st) for m in self.runs for st in m.steps]
        self.put("steps", {
            "run": (s, [r for r, _ in steps]), "step": (i64, [st.step for _, st in steps]),
            "span_id": (s, [st.span_id for _, st in steps]),
            "start_ns": (i64, [st.start_ns for _, st in steps]),
            "end_ns": (i64, [st.end_ns for _, st in steps]),
        })  # fmt: skip
        meta_names = ", ".join(_quote(n) for n in sorted(META_SPANS))
        con.execute(
            "CREATE TEMP TABLE grp AS SELECT run, span_id, parent_id, start_ns, end_ns, step,"
            " COALESCE(NULLIF(object_type, ''), '?') AS object_type, tensors, file, line,"
            f" function, {_keys_sql('', self.group_by)[0]} AS site FROM spans"
            f" WHERE COALESCE(\"group\", false) AND name NOT IN ({meta_names})"
        )
        site, entry = _keys_sql("e.", self.group_by)
        # span ids by value: 8 bytes stored instead of 16 characters, and what the hazards'
        # join and the timeline's order compare (10M events: 2.5 s of CPU less to build)
        sid = (f"CASE WHEN length(e.span_id) = 16 AND e.span_id = lower(e.span_id) AND NOT "
               f"contains(e.span_id, '_') THEN {id_value_sql('e.span_id')} END")  # fmt: skip
        con.execute(_EVENTS_SQL.format(meta=meta_names, site=site, entry=entry, sid=sid))
        self.numeric_ids = not self.sql("SELECT count(*) FROM ev WHERE span_id IS NULL")[0][0]
        if not self.numeric_ids:  # an id of another form: all of them as text
            con.execute("DROP TABLE ev")
            con.execute(_EVENTS_SQL.format(meta=meta_names, site=site, entry=entry,
                                           sid="e.span_id"))  # fmt: skip
        if self.sql("SELECT count(*) FROM ev WHERE step < 0")[0][0]:
            # events without a step number or step parent: the step span they fall in
            con.execute(
                "UPDATE ev SET step = s.step FROM steps s JOIN runs r USING (run) "
                "WHERE ev.step < 0 AND r.run_idx = ev.run_idx "
                "AND ev.start_ns >= s.start_ns AND ev.start_ns < s.end_ns"
            )

    def span_text(self, col: str) -> str:
        """SQL for the text of ``ev``'s span id column ``col`` (16 lower-case hex digits when
        the table holds its value: :attr:`numeric_ids`)."""
        return f"format('{{:016x}}', {col})" if self.numeric_ids else col

    def count(self) -> int:
        """Number of events (groups not counted)."""
        return self.sql("SELECT count(*) FROM ev")[0][0]


def _trim_heap() -> None:
    """Give the C heap's free memory back to the system (glibc's ``malloc_trim``; nothing
    elsewhere): numpy's freed arrays of the hazard analysis stay in the heap otherwise, and
    add up with DuckDB's tables in the peak."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _number_steps(steps: list[StepSpan]) -> None:
    """Sort step spans; a step without its number takes its position if free."""
    steps.sort(key=lambda s: (s.start_ns, s.step))
    known = {s.step for s in steps if s.step >= 0}
    for i, s in enumerate(steps):
        if s.step < 0:
            s.step = i if i not in known else max(known | {-1}) + 1
            known.add(s.step)
    steps.sort(key=lambda s: s.step)


# Events with their step filled in from the parent step or group span, else by time.
_EVENTS_SQL = """
CREATE TABLE ev AS
WITH base AS (
  SELECT s.*, r.run_idx
  FROM spans s JOIN runs r USING (run)
  WHERE s.name NOT IN ({meta}) AND NOT COALESCE(s."group", false)
),
stepped AS (
  SELECT b.*, COALESCE(b.step, ps.step, g.step, gs.step) AS step0
  FROM base b
  LEFT JOIN steps ps ON ps.run = b.run AND ps.span_id = b.parent_id
  LEFT JOIN grp g ON g.run = b.run AND g.span_id = b.parent_id
  LEFT JOIN steps gs ON gs.run = b.run AND gs.span_id = g.parent_id
)
SELECT
  e.run_idx, {sid} AS span_id, greatest(e.end_ns - e.start_ns, 0) AS dur,
  COALESCE(e.step0, -1) AS step,
  CASE WHEN e.noop THEN 'noop' WHEN e.alias THEN 'alias' ELSE 'copy' END AS kind,
  COALESCE(e.op, '') AS op, COALESCE(e.module, '') AS module, {site} AS site,
  {entry} AS entry,
  COALESCE(e.graph, '') AS graph, COALESCE(e.phase, '') AS phase,
  COALESCE(e.via, '') AS via, CASE WHEN COALESCE(e.error, '') <> '' THEN 1 ELSE 0 END AS err,
  COALESCE(e.bytes_allocated, 0) AS ba, COALESCE(e.bytes_logical, 0) AS bl,
  CASE WHEN e.noop OR e.alias OR COALESCE(e.error, '') <> '' OR COALESCE(e.fake, false)
       THEN 0 ELSE COALESCE(e.bytes_logical, 0) END AS bc,
  COALESCE(e.src_device, '') AS src_device, COALESCE(e.dst_device, '') AS dst_device,
  COALESCE(NULLIF(e.transfer, ''), 'none') AS transfer,
  COALESCE(e.non_blocking, false) AS non_blocking, e.pinned,
  COALESCE(g.object_type, '') AS grp, g.span_id AS grp_id, e.start_ns, e.end_ns
FROM stepped e
LEFT JOIN grp g ON g.run = e.run AND g.span_id = e.parent_id
"""
