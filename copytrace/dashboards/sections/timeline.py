"""Timeline: which events the page draws (a sample of at most about ``max_points``), with
the templates (everything about an event but its time) they use.

Kept: every event whose op raised; every hazard, with up to
``max(20, max_points // (10 * hazards))`` of its events spread over time; every copy of at
least ``large_bytes`` bytes copied (the threshold is raised, largest sizes first, until the
large copies fit in half of the budget left); and, with what remains, an even share for
every (run, call site, op, kind) group, each group's events spread evenly over time. Only
counts per group reach Python; the events themselves are picked in DuckDB.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from copytrace.dashboards._format import format_bytes
from copytrace.dashboards._pack import Strings, rounded
from copytrace.dashboards._query import Query
from copytrace.dashboards._rows import KINDS, LARGE_EVENT_BYTES, EventTemplate

__all__ = ["payload_timeline", "SampleInfo", "Sample", "sample", "spread_positions"]

# Each event's class (``c``: 0 error, 1 hazard, 2 large copy, 3 the rest) and bucket key (the
# hazard; the size of a large copy; a hash of (run, call site, op, kind)), from ``ev`` and the
# events hazards name (``hzev``, joined by row). No table of 10M classes, and no sort of them
# by time: each bucket's count and first event (in run, then time order) are enough to plan,
# and only the picking numbers events, within their buckets.
_KEYS = """
SELECT e.rowid AS r, e.run_idx, e.start_ns, e.end_ns, e.span_id, e.bl,
  CASE WHEN e.err = 1 THEN 0 WHEN h.hz IS NOT NULL THEN 1
       WHEN e.kind = 'copy' AND e.bl >= $large THEN 2 ELSE 3 END AS c,
  h.hz, hash(e.run_idx, e.site, e.op, e.kind) AS g
FROM ev e LEFT JOIN hzev h ON h.r = e.rowid
"""
_COUNTS = f"""
SELECT c, CASE WHEN c = 1 THEN hz ELSE -1 END AS hz, CASE WHEN c = 2 THEN bl ELSE -1 END AS bl,
  CASE WHEN c >= 2 THEN g END AS g, count(*) AS n,
  min((run_idx, start_ns, end_ns, span_id)) AS o
FROM ({_KEYS}) GROUP BY ALL
"""
# The events the plan keeps: each bucket's events numbered in run, then time order (a large
# copy at most ``$t`` bytes is in its (run, call site, op, kind) bucket).
_PICK = f"""
CREATE OR REPLACE TEMP TABLE picked AS
WITH keyed AS (
  SELECT r, run_idx, start_ns, end_ns, span_id,
    CASE WHEN c = 2 AND bl <= $t THEN 3 ELSE c END AS c, hz, bl, g
  FROM ({_KEYS}) WHERE c > 0
), numbered AS (
  SELECT r, c, CASE c WHEN 1 THEN CAST(hz AS UBIGINT) WHEN 2 THEN CAST(bl AS UBIGINT)
    ELSE g END AS k,
    row_number() OVER (PARTITION BY c, k ORDER BY run_idx, start_ns, end_ns, span_id) - 1
      AS pos
  FROM keyed
)
SELECT rowid AS r FROM ev WHERE err = 1
UNION ALL
SELECT n.r FROM numbered n JOIN want w USING (c, k, pos)
"""
# The picked events' other fields, from a scan of the spans filtered on their ids (a plain
# join lets DuckDB build its hash table on the million spans instead of the picked few).
_PICKED_SPANS_SQL = """
CREATE OR REPLACE TEMP TABLE picked_spans AS
SELECT r.run_idx, span_id, shape, dtype, src_dtype, grad_fn, aten, thread_name, error, origin
FROM spans JOIN runs r USING (run)
WHERE span_id IN (SELECT {span_id} FROM ev e JOIN picked p ON e.rowid = p.r)
"""
# (``{span_id}``: the picked events' span ids as text, :meth:`Query.span_text`)
_TEMPLATE_SQL = """
WITH chosen AS (SELECT e.* REPLACE ({span_id} AS span_id), e.rowid AS r
  FROM ev e JOIN picked p ON e.rowid = p.r)
SELECT e.op, e.kind, e.ba, e.bl, COALESCE(s.shape, []), COALESCE(s.dtype, ''),
  COALESCE(s.src_dtype, ''), e.src_device, e.dst_device, e.transfer, e.non_blocking,
  e.pinned, e.graph, COALESCE(s.grad_fn, ''), e.phase, e.module, e.site,
  COALESCE(s.aten, []), COALESCE(s.thread_name, ''), e.grp, COALESCE(s.error, ''), e.via,
  COALESCE(s.origin, ''), e.run_idx, e.start_ns - ru.start_ns, e.dur, e.step, e.span_id,
  COALESCE(h.hz, -1), e.entry
FROM chosen e
JOIN runs ru ON ru.run_idx = e.run_idx
JOIN picked_spans s ON s.run_idx = e.run_idx AND s.span_id = e.span_id
LEFT JOIN hzev h ON h.r = e.r
ORDER BY e.run_idx, e.start_ns, e.end_ns, e.span_id
"""


@dataclass
class SampleInfo:
    """What the sample kept.

    Attributes:
        large_bytes: The effective "large copy" threshold, bytes: every copy at least this
            large was kept.
        per_hazard: Most events kept per hazard.
    """

    large_bytes: int = LARGE_EVENT_BYTES
    per_hazard: int = 0


@dataclass
class Sample:
    """The sampled events as columns (in run then time order) and their templates."""

    info: SampleInfo = field(default_factory=SampleInfo)
    templates: list[EventTemplate] = field(default_factory=list)
    ev_run: list[int] = field(default_factory=list)
    ev_t_ns: list[int] = field(default_factory=list)
    ev_dur_ns: list[int] = field(default_factory=list)
    ev_step: list[int] = field(default_factory=list)
    ev_tpl: list[int] = field(default_factory=list)
    ev_span_id: list[str] = field(default_factory=list)
    ev_hazard: list[int] = field(default_factory=list)


def spread_positions(n: int, k: int) -> list[int]:
    """Positions of ``k`` of ``n`` items spread evenly (all of them if ``k >= n``)."""
    if k >= n:
        return list(range(n))
    if k <= 0:
        return []
    step = n / k
    return [int(j * step + step / 2) for j in range(k)]


def _plan(
    q: Query, max_points: int, info: SampleInfo
) -> tuple[list[tuple[int, Any, list[int]]], int]:
    """``(class, bucket key, positions)`` to keep, from the counts per bucket (table
    ``cnt``: :data:`_COUNTS`), and the size up to which large copies join the rest (-1:
    none)."""
    plan: list[tuple[int, Any, list[int]]] = []
    n_must = q.sql("SELECT COALESCE(sum(n), 0) FROM cnt WHERE c = 0")[0][0]
    hz_counts = q.sql("SELECT hz, sum(n) FROM cnt WHERE c = 1 GROUP BY hz")
    info.per_hazard = max(20, max_points // (10 * max(1, len(hz_counts))))
    for hz, n in hz_counts:
        kept = spread_positions(int(n), info.per_hazard)
        plan.append((1, hz, kept))
        n_must += len(kept)
    budget = max(0, int(max_points - n_must))
    room, threshold = budget // 2, None
    for size, n in q.sql("SELECT bl, sum(n) FROM cnt WHERE c = 2 GROUP BY bl "
                         "ORDER BY bl DESC"):  # fmt: skip
        n = int(n)
        if threshold is None and n <= room:
            plan.append((2, size, list(range(n))))
            room -= n
            budget -= n
        elif threshold is None:
            threshold = size
    if threshold is not None:
        info.large_bytes = threshold + 1
    # (run, call site, op, kind) groups, told apart by a hash of the four (column g); the
    # large copies at most ``threshold`` bytes among them
    buckets = q.con.execute(
        "SELECT g, sum(n)::BIGINT AS n FROM cnt WHERE c = 3 OR (c = 2 AND bl <= $t) "
        "GROUP BY g ORDER BY n, min(o)", {"t": -1 if threshold is None else threshold}
    ).fetchnumpy()  # one group per call site on a trace of 1M sites: no row per group
    counts = np.asarray(buckets["n"], dtype=np.int64)
    takes = water_fill(counts, budget)
    for i in np.flatnonzero(takes).tolist():
        plan.append((3, int(buckets["g"][i]), spread_positions(int(counts[i]),
                                                                 int(takes[i]))))
    q.con.execute("DROP TABLE cnt")
    return plan, -1 if threshold is None else threshold


def water_fill(counts: np.ndarray, budget: int) -> np.ndarray:
    """How many events each group keeps, ``counts`` ascending: in turn, each group takes an
    even share of what is left (``left budget // groups left``), or all of its events when
    they are fewer. Computed at once: the groups up to the first that cannot take all keep
    all, and the rest split what remains evenly, the last ones one more (what the turn by
    turn floor division gives)."""
    n = len(counts)
    takes = counts.copy()
    if not n:
        return takes
    before = np.concatenate([[0], np.cumsum(counts)[:-1]])  # taken by the smaller groups
    left = n - np.arange(n)
    short = np.flatnonzero(counts * left > budget - before)
    if len(short):
        k = int(short[0])
        share, extra = divmod(max(0, budget - int(before[k])), n - k)
        takes[k:] = share
        if extra:
            takes[n - extra:] += 1
    return takes


def _pick(q: Query, plan: list[tuple[int, Any, list[int]]], threshold: int,
          large_bytes: int) -> None:
    """Table ``picked`` (r): the rows in ``ev`` of the events the plan keeps, and of every
    event whose op raised. ``threshold``: large copies of at most so many bytes are in
    their (run, call site, op, kind) bucket (-1: none)."""
    import pyarrow as pa

    rows = [(c, key, p) for c, key, positions in plan for p in positions]
    cols = list(zip(*rows, strict=True)) if rows else [[]] * 3
    q.put("want", {name: (typ, list(col)) for (name, typ), col in zip(
        (("c", pa.int32()), ("k", pa.uint64()), ("pos", pa.int64())), cols,
        strict=True)})  # fmt: skip
    q.con.execute(_PICK, {"large": large_bytes, "t": threshold})


def sample(q: Query, max_points: int, large_bytes: int = LARGE_EVENT_BYTES) -> Sample:
    """Choose the events the timeline draws and return them as columns.

    Args:
        q: The trace, with the events its hazards name registered (table ``hzev``: ``r``,
            the event's row in ``ev``, and ``hz``, the hazard).
        max_points: Point budget (>= 0); error and hazard events are kept beyond it.
        large_bytes: Copies at least this large (bytes copied) count as large.
    """
    out = Sample(info=SampleInfo(large_bytes=large_bytes))
    if q.count() <= max_points:
        q.con.execute("CREATE OR REPLACE TEMP TABLE picked AS SELECT rowid AS r FROM ev")
    else:
        q.con.execute(f"CREATE OR REPLACE TEMP TABLE cnt AS {_COUNTS}", {"large": large_bytes})
        plan, threshold = _plan(q, max_points, out.info)
        _pick(q, plan, threshold, large_bytes)
    span_id = q.span_text("e.span_id")
    q.con.execute(_PICKED_SPANS_SQL.format(span_id=span_id))
    index: dict[tuple[Any, ...], int] = {}
    for row in q.sql(_TEMPLATE_SQL.format(span_id=span_id)):
        key = (*row[:4], tuple(row[4]), *row[5:17], tuple(row[17]), *row[18:23], row[29])
        ti = index.get(key)
        if ti is None:
            ti = index[key] = len(out.templates)
            out.templates.append(EventTemplate(*key))
        out.ev_run.append(row[23])
        out.ev_t_ns.append(row[24])
        out.ev_dur_ns.append(row[25])
        out.ev_step.append(row[26])
        out.ev_tpl.append(ti)
        out.ev_span_id.append(row[27])
        out.ev_hazard.append(row[28])
    return out


# --- the page's payload ------------------------------------------------------------------------
_TEMPLATE_STR_FIELDS = (
    "op", "dtype", "src_dtype", "src_device", "dst_device", "transfer", "graph", "grad_fn",
    "phase", "module", "call_site", "thread", "group", "error", "via", "origin", "entry",
)  # fmt: skip


def _points(model: Any, chosen: list[int]) -> tuple[dict[str, list[Any]], list[Any]]:
    """The chosen events as columns (``tpl``: index into the templates they use, which are
    returned in order of first use; ``t`` in ms)."""
    tpl_map: dict[int, int] = {}
    tpl_rows: list[Any] = []
    pts: dict[str, list[Any]] = {k: [] for k in ("run", "t", "d", "step", "tpl", "hz")}
    for i in chosen:
        ti = model.ev_tpl[i]
        j = tpl_map.get(ti)
        if j is None:
            j = tpl_map[ti] = len(tpl_rows)
            tpl_rows.append(model.templates[ti])
        pts["run"].append(model.ev_run[i])
        pts["t"].append(rounded(model.ev_t_ns[i] / 1e6))
        pts["d"].append(model.ev_dur_ns[i])
        pts["step"].append(model.ev_step[i])
        pts["tpl"].append(j)
        pts["hz"].append(model.ev_hazard[i])
    return pts, tpl_rows


def _templates(tpl_rows: list[Any], S: Strings) -> dict[str, list[Any]]:
    cols: dict[str, list[Any]] = {f: [] for f in _TEMPLATE_STR_FIELDS}
    cols.update(kind=[], ba=[], bl=[], shape=[], nb=[], pinned=[], aten=[])
    kinds = list(KINDS)
    for t in tpl_rows:
        for f in _TEMPLATE_STR_FIELDS:
            cols[f].append(S(getattr(t, f)))
        cols["kind"].append(kinds.index(t.kind))
        cols["ba"].append(t.bytes_allocated)
        cols["bl"].append(t.bytes_logical)
        cols["shape"].append(S("[" + ", ".join(str(d) for d in t.shape) + "]"))
        cols["nb"].append(1 if t.non_blocking else 0)
        cols["pinned"].append(None if t.pinned is None else int(t.pinned))
        cols["aten"].append(S(", ".join(t.aten)))
    return cols


def payload_timeline(model: Any, S: Strings, max_points: int) -> dict[str, Any]:
    """The timeline's sample of at most ``max_points`` events (hazard and error events kept
    beyond it): ``tpl`` (event templates as columns), ``pts`` (the events) and ``sample``
    (what was shown of how many)."""
    from copytrace.dashboards._model import sample_events

    info = SampleInfo()
    chosen = sample_events(model, max_points, info=info)
    pts, tpl_rows = _points(model, chosen)
    large = (f"at least {format_bytes(info.large_bytes)}" if info.large_bytes == LARGE_EVENT_BYTES
             else f"larger than {format_bytes(info.large_bytes - 1)}")  # fmt: skip
    return {
        "tpl": _templates(tpl_rows, S),
        "pts": pts,
        "sample": {"shown": len(chosen), "total": model.n_events, "max_points": max_points,
                   "large": large, "per_hazard": info.per_hazard},  # fmt: skip
    }
