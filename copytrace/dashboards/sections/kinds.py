"""Kinds: real copies, aliases and no-ops, and the totals over every event."""

from __future__ import annotations

from typing import Any

from copytrace.dashboards._query import Query
from copytrace.dashboards._rows import BYTES_DEFINITION, KINDS, Totals

__all__ = ["payload_totals", "totals"]

_BY_KIND = """
SELECT kind, count(*), sum(err), sum(bc), sum(ba), sum(bl), sum(dur) FROM ev GROUP BY kind
"""
_CROSS = """
SELECT count(*), COALESCE(sum(bl), 0) FROM ev
WHERE src_device <> '' AND dst_device <> '' AND src_device <> dst_device
"""


def totals(q: Query) -> Totals:
    """Sums over all events (groups counted apart; ``hazard_count`` left 0)."""
    t = Totals()
    for kind, n, err, bc, ba, bl, dur in q.sql(_BY_KIND):
        t.events += n
        t.error_count += int(err)
        t.bytes_copied += int(bc)
        t.bytes_allocated += int(ba)
        t.bytes_logical += int(bl)
        t.copy_time_ns += int(dur)
        t.time_by_kind_ns[kind] += int(dur)
        # a failed call is not a copy (it is counted in error_count)
        counted = n - int(err) if kind == "copy" else n
        setattr(t, f"{kind}_count", getattr(t, f"{kind}_count") + counted)
    n, nbytes = q.sql(_CROSS)[0]
    t.cross_device_count, t.cross_device_bytes = n, int(nbytes)
    t.group_count = q.sql("SELECT count(*) FROM grp")[0][0]
    return t


# --- the page's payload ------------------------------------------------------------------------
def payload_totals(model: Any) -> dict[str, Any]:
    """The totals over every event (``t_kind``: copy time per kind, in :data:`KINDS` order)."""
    t = model.totals
    return {
        "events": t.events,
        "copies": t.copy_count,
        "aliases": t.alias_count,
        "noops": t.noop_count,
        "errors": t.error_count,
        "groups": t.group_count,
        "bc": t.bytes_copied,
        "ba": t.bytes_allocated,
        "bl": t.bytes_logical,
        "t": t.copy_time_ns,
        "t_kind": [t.time_by_kind_ns[k] for k in KINDS],
        "xdev_n": t.cross_device_count,
        "xdev_b": t.cross_device_bytes,
        "hazards": t.hazard_count,
        "bytes_defs": BYTES_DEFINITION,  # what "bytes copied" and "allocated" mean
    }
