"""Where from: the cube (run x module x call site x op x kind x graph x phase x via x entry)
and the per call site, per module and per op tables summed from it.

The call site is the one the report groups by (the query's ``group_by``: by default the
library's call site where an event has one, else the user's line); ``entry`` is the other
(the user's line that reached the library site)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from copytrace.dashboards._format import site_labels, source_line
from copytrace.dashboards._pack import Strings
from copytrace.dashboards._query import Query
from copytrace.dashboards._rows import KINDS, NO_MODULE, CubeRow, OpRow, RunInfo, SiteRow

__all__ = ["MAX_SITES", "OTHER_SITES", "OP_PALETTE", "op_colors", "payload_cube", "payload_sites", "Sources", "sources"]

#: At most this many call sites by name (by bytes copied, then time); the events of the
#: others are summed under :data:`OTHER_SITES`, so that a trace with a call site per event
#: makes a page of bounded size, in bounded time.
MAX_SITES = 2000
#: The call-site key of the events of the sites beyond :data:`MAX_SITES`.
OTHER_SITES = "(other call sites)"

_CUBE = """
WITH per_site AS (SELECT site, sum(bc) AS b, sum(dur) AS t FROM ev GROUP BY site),
named AS (SELECT site FROM per_site ORDER BY b DESC, t DESC, site LIMIT $max)
SELECT run_idx, module,
  CASE WHEN site IS NULL OR site IN (SELECT site FROM named) THEN site ELSE $other END,
  op, kind, graph, phase, via, count(*), sum(bc), sum(ba), sum(bl), sum(dur), sum(err), entry
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
        if c.entry:
            row = sites[c.call_site]
            row.entries[c.entry] = row.entries.get(c.entry, 0) + c.count
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
    rows = q.sql(_CUBE, {"max": MAX_SITES, "other": OTHER_SITES})
    cube = [CubeRow(*r[:8], *(int(x) for x in r[8:14]), r[14]) for r in rows]
    cube.sort(key=lambda c: (c.run, -c.bytes_copied, -c.time_ns, c.call_site, c.op, c.kind))
    out.cube = cube
    sites, modules, ops = _tables(cube)
    entries = {e for row in sites.values() for e in row.entries}
    out.labels = site_labels([*sites, *(e for e in entries if e not in sites)])
    first_start = min((r.start_ns for r in runs if r.start_ns), default=None)
    out.sources = (
        {k: source_line(k, first_start) for k in sites} if read_sources
        else dict.fromkeys(sites, "")
    )  # fmt: skip
    for k in entries:  # the user's lines beside library sites: their source too
        if k not in out.sources:
            out.sources[k] = source_line(k, first_start) if read_sources else ""
    for k, row in sites.items():
        row.label = out.labels[k]
        row.source = out.sources[k]
    for k, row in modules.items():
        row.label = k
    out.call_sites = _by_copied(sites.values())
    out.modules = _by_copied(modules.values())
    out.ops = _by_copied(ops.values())
    return out


# --- the page's payload ------------------------------------------------------------------------
#: Op colours, assigned to ops in order of bytes copied, then count.
OP_PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
    "#17becf", "#bcbd22", "#7f7f7f", "#393b79", "#ad494a", "#637939", "#7b4173",
    "#3182bd", "#e6550d", "#31a354", "#756bb1",
)  # fmt: skip
_CUBE_COLUMNS = ("run", "module", "site", "op", "kind", "graph", "phase", "via", "n", "bc", "ba", "bl",
         "t", "err", "entry")  # fmt: skip


def op_colors(model: Any) -> dict[str, str]:
    """A colour per op, in order of bytes copied, then events."""
    ops_sorted = sorted(model.ops, key=lambda o: (-o.bytes_copied, -o.count, o.op))
    return {o.op: OP_PALETTE[i % len(OP_PALETTE)] for i, o in enumerate(ops_sorted)}


def payload_cube(model: Any, S: Strings) -> dict[str, list[Any]]:
    """The cube (counts and bytes per run, module, call site, op, kind...) as columns."""
    cols: dict[str, list[Any]] = {k: [] for k in _CUBE_COLUMNS}
    kinds = list(KINDS)
    for c in model.cube:
        row = (c.run, S(c.module), S(c.call_site), S(c.op), kinds.index(c.kind), S(c.graph),
               S(c.phase), S(c.via), c.count, c.bytes_copied, c.bytes_allocated,
               c.bytes_logical, c.time_ns, c.errors, S(c.entry))  # fmt: skip
        for key, value in zip(_CUBE_COLUMNS, row, strict=True):
            cols[key].append(value)
    return cols


def payload_sites(model: Any, S: Strings) -> dict[int, dict[str, int]]:
    """Label and source line of each call site and entry line, keyed by the site's ``S``
    index."""
    out = {S(row.key): {"label": S(row.label), "source": S(row.source)}
           for row in model.call_sites}  # fmt: skip
    labels, sources = model.site_labels, model.site_sources
    for row in model.call_sites:
        for e in row.entries:
            if S(e) not in out:
                out[S(e)] = {"label": S(labels.get(e, e)), "source": S(sources.get(e, ""))}
    return out
