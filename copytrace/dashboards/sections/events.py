"""Events: the deepcopy groups (the events table itself reads the timeline's sample)."""

from __future__ import annotations

from typing import Any

from copytrace.dashboards._pack import Strings
from copytrace.dashboards._query import Query
from copytrace.dashboards._rows import GroupRow, RunInfo

__all__ = ["payload_groups", "groups"]

_GROUPS = """
SELECT r.run_idx, COALESCE(g.step, ps.step), g.object_type, g.tensors,
  count(e.span_id), COALESCE(sum(e.ba), 0), greatest(g.end_ns - g.start_ns, 0), g.site
FROM grp g JOIN runs r USING (run)
LEFT JOIN steps ps ON ps.run = g.run AND ps.span_id = g.parent_id
LEFT JOIN ev e ON e.run_idx = r.run_idx AND e.grp_id = g.span_id
GROUP BY r.run_idx, g.step, ps.step, g.object_type, g.tensors, g.start_ns, g.end_ns,
  g.site, g.span_id
ORDER BY r.run_idx, g.start_ns, g.end_ns, g.span_id
"""


def groups(q: Query, runs: list[RunInfo]) -> list[GroupRow]:
    """One row per deepcopy group, by run then time (bytes in bytes, durations in ns)."""
    return [
        GroupRow(run=runs[run_idx].label, step=step, object_type=otype,
                 tensors=tensors if tensors is not None else children, children=children,
                 bytes_allocated=int(ba), duration_ns=dur, call_site=site)
        for run_idx, step, otype, tensors, children, ba, dur, site in q.sql(_GROUPS)
    ]  # fmt: skip


# --- the page's payload ------------------------------------------------------------------------
def payload_groups(model: Any, S: Strings, run_index: dict[str, int]) -> list[dict[str, Any]]:
    """The first 500 deepcopy groups."""
    return [
        {
            "run": run_index[g.run],
            "step": g.step,
            "type": S(g.object_type),
            "tensors": g.tensors,
            "ba": g.bytes_allocated,
            "t": g.duration_ns,
            "site": S(g.call_site),
        }
        for g in model.groups[:500]
    ]
