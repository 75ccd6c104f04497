"""Transfers: events per (source device, destination device), over all runs and per run."""

from __future__ import annotations

from typing import Any

from copytrace.dashboards._pack import Strings
from copytrace.dashboards._query import Query
from copytrace.dashboards._rows import TransferRow

__all__ = ["payload_transfers", "transfers"]

_PAIRS = """
SELECT run_idx, COALESCE(NULLIF(src_device, ''), '?') AS src,
  COALESCE(NULLIF(dst_device, ''), '?') AS dst, transfer, count(*),
  count(*) FILTER (WHERE kind = 'copy' AND err = 0), sum(ba), sum(bl),
  count(*) FILTER (WHERE non_blocking), count(*) FILTER (WHERE pinned),
  count(*) FILTER (WHERE pinned IS NOT NULL), sum(dur)
FROM ev WHERE src_device <> '' OR dst_device <> '' GROUP BY ALL
"""


def _add(row: TransferRow, r: tuple) -> None:
    row.count += r[4]
    row.copy_count += r[5]
    row.bytes_allocated += int(r[6])
    row.bytes_logical += int(r[7])
    row.non_blocking_count += r[8]
    row.pinned_count += r[9]
    row.pinned_known += r[10]
    row.time_ns += int(r[11])


def transfers(q: Query) -> tuple[list[TransferRow], list[tuple[int, TransferRow]]]:
    """Device-pair rows over all runs (by logical bytes, desc) and ``(run index, row)`` per
    run. A row's ``transfer`` is the most common kind among its events."""
    total: dict[tuple[str, str], TransferRow] = {}
    by_run: dict[tuple[int, str, str], TransferRow] = {}
    kinds: dict[tuple, dict[str, int]] = {}
    for r in q.sql(_PAIRS):
        run, src, dst, kind = r[:4]
        for table, key in ((total, (src, dst)), (by_run, (run, src, dst))):
            row = table.get(key)  # type: ignore[call-overload]
            if row is None:
                row = table[key] = TransferRow(src, dst)  # type: ignore[index]
            _add(row, r)
            counts = kinds.setdefault(key, {})
            counts[kind] = counts.get(kind, 0) + r[4]
    for table in (total, by_run):
        for key, row in table.items():  # type: ignore[attr-defined]
            counts = kinds[key]
            row.transfer = max(sorted(counts), key=lambda k: counts[k])
    rows = sorted(total.values(), key=lambda t: (-t.bytes_logical, -t.count, t.src_device,
                                                  t.dst_device))  # fmt: skip
    per_run = [(k[0], row) for k, row in sorted(by_run.items(),
                                                key=lambda kv: (kv[0][0], -kv[1].bytes_logical,
                                                                kv[0]))]  # fmt: skip
    return rows, per_run


# --- the page's payload ------------------------------------------------------------------------
def payload_transfers(model: Any, S: Strings) -> list[dict[str, Any]]:
    """One dict per (run, source device, destination device, transfer kind)."""
    return [
        {
            "run": run,
            "src": S(t.src_device),
            "dst": S(t.dst_device),
            "kind": S(t.transfer),
            "n": t.count,
            "nc": t.copy_count,
            "ba": t.bytes_allocated,
            "bl": t.bytes_logical,
            "nb": t.non_blocking_count,
            "pin": t.pinned_count,
            "pin_known": t.pinned_known,
            "t": t.time_ns,
        }
        for run, t in model.transfers_by_run
    ]
