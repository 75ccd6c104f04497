"""The summary's and the check's aggregates as SQL, written once in DuckDB's dialect and run on
DuckDB (embedded) or on Apache Spark (the same text transpiled by SQLGlot).

The input is a dataset written by ``copytrace export TRACE --dataset OUT`` (Hive-partitioned
Parquet, ``OUT/run_id=/host=/rank=/part-*.parquet``), read as the table ``events``. The view
``ev`` (:data:`EV_SQL`) holds one row per event, deepcopy groups left out, with the report's
derived columns: ``kind`` (``copy``/``alias``/``noop``), ``bc`` (bytes copied: logical bytes of
a copy that did not raise), ``ba`` (bytes allocated), ``bl`` (bytes logical), ``dur`` (ns, never
negative), ``site`` (``file:line function``), ``step`` (the event's, else its deepcopy group's,
else -1) and ``rnk`` (the rank). Each query of :data:`QUERIES` returns rows sorted on all
their columns, so two engines' answers compare as lists.

The query ``hazards`` is every hazard rule (:data:`SQL_HAZARDS`), one row per finding, over
the view ``hz`` of :mod:`copytrace.analysis._sql_hazards` (every event in its run's order):
filters and group-bys, the hot-loop test over a group's steps, and the pair rules' joins on
storage and version along the event order, as window functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from copytrace.analysis._sql_hazards import HAZARDS_SQL, HZ_SQL, SQL_CODES

__all__ = ["EV_SQL", "QUERIES", "SQL_HAZARDS", "duckdb_results", "spark_sql", "transpile"]

_SITE = (
    "CASE WHEN e.file IS NULL OR e.file = '' THEN '(unknown call site)' ELSE e.file"
    " || COALESCE(':' || CAST(e.line AS VARCHAR), '')"
    " || COALESCE(' ' || NULLIF(e.function, ''), '') END"
)

#: The view ``ev`` over the dataset's table ``events`` (see the module docstring).
EV_SQL = f"""
SELECT e.run_id, e.host, CAST(e."rank" AS BIGINT) AS rnk, e.run,
  COALESCE(e.step, g.step, -1) AS step,
  CASE WHEN e.noop THEN 'noop' WHEN e.alias THEN 'alias' ELSE 'copy' END AS kind,
  COALESCE(e.op, '') AS op, COALESCE(e.module, '') AS module, {_SITE} AS site,
  CASE WHEN e.end_ns > e.start_ns THEN e.end_ns - e.start_ns ELSE 0 END AS dur,
  COALESCE(e.bytes_allocated, 0) AS ba, COALESCE(e.bytes_logical, 0) AS bl,
  CASE WHEN e.noop OR e.alias OR COALESCE(e.error, '') <> '' THEN 0
       ELSE COALESCE(e.bytes_logical, 0) END AS bc,
  CASE WHEN COALESCE(e.error, '') <> '' THEN 1 ELSE 0 END AS err,
  COALESCE(e.via, '') AS via, COALESCE(e.write_site, '') AS write_site,
  COALESCE(e.retained_bytes, 0) AS retained
FROM events AS e
LEFT JOIN (SELECT run, span_id, step FROM events WHERE COALESCE("group", FALSE)) AS g
  ON g.run = e.run AND g.span_id = e.parent_id
WHERE NOT COALESCE(e."group", FALSE)
"""

_COUNTS = (
    "count(*) AS events, sum(CASE WHEN kind = 'copy' THEN 1 ELSE 0 END) AS copies, "
    "sum(CASE WHEN kind = 'alias' THEN 1 ELSE 0 END) AS aliases, "
    "sum(CASE WHEN kind = 'noop' THEN 1 ELSE 0 END) AS noops, "
    "sum(bc) AS bytes_copied, sum(ba) AS bytes_allocated, sum(dur) AS time_ns"
)
# a copy that counts against a budget (copytrace.analysis._budget): not an alias, a no-op, a
# group or a failed call
_COUNTED = "kind = 'copy' AND err = 0"

#: The hazard codes computed in SQL (all of them: :mod:`copytrace.analysis._sql_hazards`).
SQL_HAZARDS = SQL_CODES


#: name -> DuckDB SQL over ``ev``. Rows come sorted on every column.
QUERIES = {
    "totals": f"SELECT {_COUNTS}, count(DISTINCT run) AS processes FROM ev",
    "steps": f"SELECT rnk, step, {_COUNTS} FROM ev GROUP BY rnk, step ORDER BY 1, 2",
    "sites": f"SELECT site, {_COUNTS} FROM ev GROUP BY site ORDER BY 1",
    "modules": f"SELECT module, {_COUNTS} FROM ev GROUP BY module ORDER BY 1",
    "ops": f"SELECT op, {_COUNTS} FROM ev GROUP BY op ORDER BY 1",
    # each rank's steps (those with a number), its copy bytes and its copy time
    "ranks": (
        "SELECT run_id, host, rnk, count(DISTINCT CASE WHEN step >= 0 THEN step END) AS steps, "
        "sum(bc) AS bytes_copied, sum(dur) AS time_ns FROM ev GROUP BY run_id, host, rnk "
        "ORDER BY 1, 2, 3"
    ),
    # check's budget: per (run, step, call site) the bytes allocated and the counted copies
    "budget": (
        f"SELECT run, step, site, sum(ba) AS bytes, count(*) AS copies FROM ev "
        f"WHERE {_COUNTED} GROUP BY run, step, site ORDER BY 1, 2, 3"
    ),
    "hazards": HAZARDS_SQL,
}


def transpile(sql: str, dialect: str) -> str:
    """``sql`` (DuckDB's dialect) in ``dialect`` (a SQLGlot dialect name, e.g. ``spark``).

    Raises:
        ImportError: without ``sqlglot``.
        sqlglot.errors.ParseError: if ``sql`` does not parse.
    """
    if dialect == "duckdb":
        return sql
    import sqlglot

    return sqlglot.transpile(sql, read="duckdb", write=dialect)[0]  # type: ignore[no-any-return]


def _dataset_glob(root: Path) -> str:
    return str(root / "*" / "*" / "*" / "*.parquet").replace("'", "''")


def duckdb_results(root: Path, names: Any = None) -> dict[str, list[tuple[Any, ...]]]:
    """The queries ``names`` of :data:`QUERIES` (default: all) run on DuckDB over the dataset
    at ``root``.

    Returns:
        ``{name: rows}``, integers as Python ints.

    Raises:
        duckdb.Error: if the dataset cannot be read.
    """
    import duckdb

    con = duckdb.connect()
    try:
        con.execute(
            f"CREATE VIEW events AS SELECT * FROM read_parquet('{_dataset_glob(root)}', "
            "hive_partitioning=true, union_by_name=true)"
        )
        con.execute(f"CREATE VIEW ev AS {EV_SQL}")
        con.execute(f"CREATE VIEW hz AS {HZ_SQL}")
        return {name: [tuple(_plain(v) for v in row)
                       for row in con.execute(QUERIES[name]).fetchall()]
                for name in names or QUERIES}  # fmt: skip
    finally:
        con.close()


def spark_sql(spark: Any, root: Path, names: Any = None) -> dict[str, list[tuple[Any, ...]]]:
    """The queries ``names`` of :data:`QUERIES` (default: all), transpiled to Spark SQL, run in
    session ``spark`` over the dataset at ``root``.

    Returns:
        ``{name: rows}`` as :func:`duckdb_results` returns them.

    Raises:
        pyspark.errors.PySparkException: if Spark cannot read the dataset or run a query.
    """
    # the keys are columns of every file: read them there, not from the folder names
    frame = spark.read.options(recursiveFileLookup="true", mergeSchema="true").parquet(str(root))
    frame.createOrReplaceTempView("events")
    spark.sql("DROP VIEW IF EXISTS ev")
    spark.sql(f"CACHE TABLE ev AS {transpile(EV_SQL, 'spark')}")
    names = list(names or QUERIES)
    spark.sql("DROP VIEW IF EXISTS hz")
    if "hazards" in names:  # read by each rule: computed once
        spark.sql(f"CACHE TABLE hz AS {transpile(HZ_SQL, 'spark')}")
    out = {}
    for name in names:
        rows = spark.sql(transpile(QUERIES[name], "spark")).collect()
        out[name] = [tuple(_plain(v) for v in row) for row in rows]
    spark.sql("UNCACHE TABLE IF EXISTS ev")
    spark.sql("DROP VIEW IF EXISTS ev")
    spark.sql("UNCACHE TABLE IF EXISTS hz")
    spark.sql("DROP VIEW IF EXISTS hz")
    return out


def _plain(value: Any) -> Any:
    """A value as both engines give it: decimals and floats of whole numbers as ints."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    try:
        as_int = int(value)
    except (TypeError, ValueError):
        return value
    return as_int if as_int == value else float(value)
