"""``--engine spark`` for ``summary`` and ``check``: the aggregates of
:mod:`copytrace.analysis._sql` computed on Apache Spark (or on DuckDB over the same dataset),
and the summary they print.

The input is a dataset folder (``copytrace export TRACE --dataset OUT``) or a trace, which is
written to a temporary dataset first. The session comes from ``SPARK_REMOTE`` (Spark Connect)
or from ``--spark-master`` (e.g. ``local[1]``, ``spark://host:7077``); everything that can be
checked before Spark starts (pyspark and sqlglot installed, a Java runtime, a master given and
well formed) is checked first, and each failure is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["CHECK_QUERIES", "SUMMARY_QUERIES", "add_engine_options", "engine_results",
           "engine_violations", "format_engine_summary", "is_dataset"]

#: Spark master URLs accepted by ``--spark-master`` (Spark's own forms).
_MASTER = re.compile(
    r"^(local(\[(\*|\d+)(,\d+)?\])?|local-cluster\[\d+,\d+,\d+\]|yarn"
    r"|(spark|mesos|k8s)://\S+)$"
)
_INSTALL = "pip install 'copytrace[spark]'"


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--engine`` and ``--spark-master`` to a trace subcommand."""
    parser.add_argument(
        "--engine", choices=("duckdb", "spark"), default="duckdb",
        help="where the aggregates run: duckdb (embedded, default) or spark (a Spark session "
        "from SPARK_REMOTE or --spark-master); PATH may then also be a dataset folder "
        "(copytrace export --dataset)",
    )  # fmt: skip
    parser.add_argument(
        "--spark-master", metavar="URL", default=None,
        help="Spark master for --engine spark, e.g. local[1] or spark://host:7077 "
        "(default: SPARK_REMOTE)",
    )  # fmt: skip


def _preflight(master: str | None) -> None:
    """Everything checkable before a Spark session starts.

    Raises:
        CopytraceError: naming what is missing or wrong.
    """
    import importlib.util

    from copytrace._errors import CopytraceError

    for module in ("pyspark", "sqlglot"):
        if importlib.util.find_spec(module) is None:
            raise CopytraceError(f"--engine spark needs {module}, not installed: {_INSTALL}")
    remote = os.environ.get("SPARK_REMOTE")
    if master is None and not remote:
        raise CopytraceError("--engine spark needs --spark-master URL (e.g. local[1]) or "
                             "SPARK_REMOTE")  # fmt: skip
    if master is not None and not _MASTER.match(master):
        raise CopytraceError(f"--spark-master {master!r} is not a Spark master URL (local[N], "
                             "spark://host:port, yarn, k8s://...)")  # fmt: skip
    if master is not None:  # Spark Connect needs no local Java
        java_home = os.environ.get("JAVA_HOME")
        java = Path(java_home, "bin", "java") if java_home else shutil.which("java")
        if not java or not Path(java).exists():
            raise CopytraceError("--engine spark with --spark-master needs a Java runtime "
                                 "(17 or later): none on PATH or in JAVA_HOME")  # fmt: skip


def _partitions(master: str) -> str:
    """Shuffle partitions for ``master``: ``N`` of ``local[N]`` (one task per core and stage),
    else 4."""
    cores = re.match(r"^local\[(\d+)", master)
    return cores.group(1) if cores and int(cores.group(1)) > 0 else "4"


def spark_session(master: str | None) -> Any:
    """A Spark session: ``master`` (a local or cluster master URL), else ``SPARK_REMOTE``.

    Raises:
        CopytraceError: if the session cannot start.
    """
    from pyspark.sql import SparkSession

    from copytrace._errors import CopytraceError

    builder = SparkSession.builder.appName("copytrace")
    if master is not None:
        builder = (
            builder.master(master)
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", _partitions(master))
            .config("spark.sql.session.timeZone", "UTC")
        )
        if master.startswith("local"):  # one machine, few partitions: re-planning each
            # stage costs more than it saves (the hazards query: about 20 % of its JVM CPU)
            builder = builder.config("spark.sql.adaptive.enabled", "false")
    try:
        spark = builder.getOrCreate()
        spark.sparkContext.setLogLevel("ERROR")
        return spark
    except Exception as err:  # noqa: BLE001 - py4j and Spark raise many kinds
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise CopytraceError(f"Spark session did not start: {first}") from None


def is_dataset(path: Path) -> bool:
    """Whether ``path`` is a dataset folder (holds ``run_id=*`` folders)."""
    return path.is_dir() and any(p.name.startswith("run_id=") for p in path.iterdir())


@contextlib.contextmanager
def _dataset(path: Path, args: Any, err: Any) -> Iterator[Path]:
    """``path`` as a dataset: itself, or the selected runs of the trace in a temporary one."""
    if is_dataset(path):
        yield path
        return
    from copytrace.cli._common import select_runs, warn_unreadable
    from copytrace.tracefile import event_table
    from copytrace.tracefile._dataset import write_dataset

    trace = select_runs(event_table(path), args, path, err)
    warn_unreadable(trace, path, err)
    tmp = Path(tempfile.mkdtemp(prefix="copytrace-dataset-"))
    try:
        write_dataset(trace, tmp)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


#: The queries each command reads.
SUMMARY_QUERIES = ("totals", "steps", "sites", "modules", "ops", "ranks", "hazards")
CHECK_QUERIES = ("budget", "hazards")


def engine_results(args: Any, names: Any, err: Any = None) -> dict[str, list[tuple[Any, ...]]]:
    """The aggregates ``names`` of :data:`copytrace.analysis._sql.QUERIES` for ``args.path`` on
    ``args.engine`` (``spark``: checked first, see :func:`_preflight`; ``duckdb``: the same
    SQL over the same dataset, in-process).

    Raises:
        CopytraceError: for a missing pyspark/sqlglot/Java, a bad master, or a session that
            does not start.
        TraceFileError: if the trace is missing, empty or unreadable.
    """
    from copytrace.analysis._sql import duckdb_results, spark_sql

    master = getattr(args, "spark_master", None)
    if args.engine == "spark":
        _preflight(master)
    with _dataset(Path(args.path), args, err) as root:
        if args.engine != "spark":
            return duckdb_results(root, names)
        from pyspark.sql import SparkSession

        ours = SparkSession.getActiveSession() is None  # a caller's session is left running
        spark = spark_session(master)
        try:
            return spark_sql(spark, root, names)
        finally:
            if ours and master is not None:
                spark.stop()


def format_engine_summary(res: dict[str, list[tuple[Any, ...]]], top_n: int) -> str:
    """The summary's tables from :func:`engine_results`: the headline, the top call sites and
    modules by bytes copied and by copy time, the ops, the ranks side by side and the hazards
    (one line per finding: code, events, bytes, call sites). Ends with a newline."""
    from copytrace.cli.summary import _pct, _table, rank_lines
    from copytrace.dashboards._model import NO_MODULE, format_bytes, format_ns

    (events, copies, aliases, noops, copied, alloc, time_ns, procs), = res["totals"]
    lines = [
        f"events: {events} = {copies} copies + {aliases} aliases + {noops} no-ops "
        f"({procs} process(es))",
        f"bytes copied {format_bytes(copied or 0)} ({copied or 0} B), allocated "
        f"{format_bytes(alloc or 0)}, copy time {format_ns(time_ns or 0)}",
    ]
    numbered = [r for r in res["steps"] if r[1] >= 0]  # (rank, step, counts..., bytes, ...)
    if numbered:
        worst = max(numbered, key=lambda r: (r[6], -r[0], -r[1]))
        lines.append(f"steps: {len(numbered)} (over all ranks); most copied: rank {worst[0]} "
                     f"step {worst[1]}, {format_bytes(worst[6])} in {worst[3]} copies, "
                     f"{format_ns(worst[8])} copy time")  # fmt: skip
    headers = ["#", "bytes copied", "%", "time", "%", "events", "copies", "aliases", "no-ops"]
    for what, rows in (("call sites", res["sites"]), ("modules", res["modules"])):
        for col, label in ((5, "bytes copied"), (7, "copy time")):
            chosen = sorted((r for r in rows if r[col]), key=lambda r: (-r[col], r[0]))[:top_n]
            table = [[str(i), format_bytes(r[5]), _pct(r[5], copied), format_ns(r[7]),
                      _pct(r[7], time_ns), str(r[1]), str(r[2]), str(r[3]), str(r[4]),
                      r[0] or NO_MODULE] for i, r in enumerate(chosen, 1)]  # fmt: skip
            lines += ["", f"top {what} by {label}:"]
            lines += _table(headers + [what[:-1]], table, set(range(9)))
    lines += ["", "by op:"]
    lines += _table(
        ["op", "events", "copies", "aliases", "no-ops", "bytes copied", "allocated", "time"],
        [[r[0], str(r[1]), str(r[2]), str(r[3]), str(r[4]), format_bytes(r[5]),
          format_bytes(r[6]), format_ns(r[7])] for r in res["ops"]],
        right=set(range(1, 8)),
    )  # fmt: skip
    lines += rank_lines([(f"rank {r[2]} on {r[1]}", r[3], r[4], r[5]) for r in res["ranks"]])
    if res["hazards"]:
        lines += ["", "hazards:"]
        lines += _table(["code", "events", "bytes", "call site"],
                        [[c, str(n), format_bytes(b), s] for c, _run, s, n, b in res["hazards"]],
                        right={1, 2})  # fmt: skip
    return "\n".join(lines) + "\n"


def engine_violations(res: dict[str, list[tuple[Any, ...]]], budget: Any) -> tuple[list[str], Any]:
    """``check``'s violations from :func:`engine_results`: the budget's limits over the
    per-step totals, and the forbidden codes among the hazards (every rule, in SQL).

    Returns:
        ``(violations, step totals)``.
    """
    from copytrace.analysis import check_budget
    from copytrace.analysis._budget import StepTotal
    from copytrace.analysis._findings import HAZARDS, Finding

    runs = {run: i for i, run in enumerate(sorted({r[0] for r in res["budget"]}))}
    totals: dict[tuple[int, int], StepTotal] = {}
    for run, step, site, nbytes, copies in res["budget"]:
        t = totals.setdefault((runs[run], step), StepTotal(runs[run], step))
        t.bytes += nbytes
        t.copies += copies
        t.sites[site] = [nbytes, copies]
    steps = [totals[k] for k in sorted(totals)]
    findings = [
        Finding(code=code, severity=HAZARDS[code].severity,
                message=f"{n} event(s), {b} B (computed in SQL)", fix="", call_sites=[site],
                bytes=b)
        for code, _run, site, n, b in res["hazards"]
    ]  # fmt: skip
    return check_budget(None, findings, budget, (steps, max(len(runs), 1))), steps
