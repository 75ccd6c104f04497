"""Where from: the cube (run x module x call site x op x kind x graph x phase x via) and the
per call site, per module and per op tables summed from it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from copytrace.dashboards._format import site_labels, source_line
from copytrace.dashboards._query import Query
from copytrace.dashboards._rows import NO_MODULE, CubeRow, OpRow, RunInfo, SiteRow

__all__ = ["Sources", "sources"]

_CUBE = """
SELECT run_idx, module, site, op, kind, graph, phase, via, count(*), sum(bc), sum(ba),
  sum(bl), sum(dur), sum(err)
FROM ev GROUP BY ALL
"""


class Sources:
    """The section's tables.

    Attributes:
        cube: Cube rows by run, then bytes copied and time (desc).
        call_sites: Per call site, by bytes copied (desc).
        modules: Per module (``(no module)`` outside any), by bytes copied (desc).
        ops: Per op, by bytes copied (desc).
        labels: Short display label per call-site key.
        sources: Source line per call-site key ('' if unavailable).
    """

    def __init__(self) -> None:
        self.cube: list[CubeRow] = []
        self.call_sites: list[SiteRow] = []
        self.modules: list[SiteRow] = []
        self.ops: list[OpRow] = []
        self.labels: dict[str, str] = {}
        self.sources: dict[str, str] = {}


def _add(row: Any, c: CubeRow) -> None:
    row.count += c.count
    if c.kind == "copy":
        row.copy_count += c.count - c.errors  # a failed call is not a copy
    elif c.kind == "alias":
        row.alias_count += c.count
    else:
        row.noop_count += c.count
    row.bytes_copied += c.bytes_copied
    row.bytes_allocated += c.bytes_allocated
    row.bytes_logical += c.bytes_logical
    row.time_ns += c.time_ns


def _by_copied(rows: Iterable[Any]) -> list[Any]:
    return sorted(
        rows,
        key=lambda r: (-r.bytes_copied, -r.bytes_allocated, -r.time_ns,
                       str(getattr(r, "key", getattr(r, "op", "")))),
    )  # fmt: skip


def _tables(cube: list[CubeRow]) -> tuple[dict[str, SiteRow], dict[str, SiteRow], dict]:
    sites: dict[str, SiteRow] = {}
    modules: dict[str, SiteRow] = {}
    ops: dict[str, OpRow] = {}
    for c in cube:
        mod = c.module or NO_MODULE
        for table, key, other in ((sites, c.call_site, mod), (modules, mod, c.call_site)):
            row = table.get(key)
            if row is None:
                row = table[key] = SiteRow(key)
            _add(row, c)
            row.ops[c.op] = row.ops.get(c.op, 0) + c.count
            row.others[other] = row.others.get(other, 0) + c.count
            if c.via:
                row.vias[c.via] = row.vias.get(c.via, 0) + c.count
        orow = ops.get(c.op)
        if orow is None:
            orow = ops[c.op] = OpRow(c.op)
        _add(orow, c)
        g = c.graph or "?"
        orow.graph[g] = orow.graph.get(g, 0) + c.count
    return sites, modules, ops


def sources(q: Query, runs: list[RunInfo], read_sources: bool = True) -> Sources:
    """Aggregate the events by source (bytes in bytes, times in ns).

    Args:
        q: The trace.
        runs: The runs, in report order.
        read_sources: Read each call site's source line when the file is here and has not
            changed since the run started.
    """
    out = Sources()
    cube = [CubeRow(*r[:8], *(int(x) for x in r[8:])) for r in q.sql(_CUBE)]
    cube.sort(key=lambda c: (c.run, -c.bytes_copied, -c.time_ns, c.call_site, c.op, c.kind))
    out.cube = cube
    sites, modules, ops = _tables(cube)
    out.labels = site_labels(sites)
    first_start = min((r.start_ns for r in runs if r.start_ns), default=None)
    out.sources = (
        {k: source_line(k, first_start) for k in sites} if read_sources
        else dict.fromkeys(sites, "")
    )  # fmt: skip
    for k, row in sites.items():
        row.label = out.labels[k]
        row.source = out.sources[k]
    for k, row in modules.items():
        row.label = k
    out.call_sites = _by_copied(sites.values())
    out.modules = _by_copied(modules.values())
    out.ops = _by_copied(ops.values())
    return out
