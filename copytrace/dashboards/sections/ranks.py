"""Ranks side by side: each rank's (process's) copy bytes and copy time per step, the slowest
rank and the imbalance, so that a straggler in a merged multi-rank run is one glance away.

The figures are those of ``copytrace summary``'s rank table: a rank's bytes copied and copy
time summed over its steps (the per-step rows of the model), divided by its number of steps
(those with a number; a rank without one counts as one step). The slowest rank has the most
copy time per step; the imbalance is its copy time per step over the median rank's.
"""

from __future__ import annotations

import statistics
from typing import Any

from copytrace.dashboards._pack import Strings

__all__ = ["payload_ranks", "rank_view"]


def rank_totals(model: Any) -> list[tuple[str, int, int, int]]:
    """``(label, steps, bytes copied, copy time ns)`` of each run (process, rank), from the
    model's per-step rows (steps: those with a number)."""
    sums: dict[str, list[int]] = {}
    for s in model.steps:
        acc = sums.setdefault(s.run, [0, 0, 0])
        acc[0] += s.step >= 0
        acc[1] += s.bytes_copied
        acc[2] += s.copy_time_ns
    return [(r.label, *sums.get(r.label, (0, 0, 0))) for r in model.runs]  # type: ignore[misc]


def rank_view(model: Any) -> dict[str, Any] | None:
    """The ranks side by side, or None for a single process.

    Returns:
        ``{"rows": [(label, steps, bytes per step, ns per step, vs median)], "slowest":
        index into rows, "median_ns": median copy time per step (ns), "imbalance":
        slowest / median (None without copy time)}``; bytes and ns per step as floats.
    """
    if len(model.runs) < 2:
        return None
    per = [(label, n, nbytes / max(n, 1), ns / max(n, 1))
           for label, n, nbytes, ns in rank_totals(model)]  # fmt: skip
    median = statistics.median(p[3] for p in per)
    slowest = max(range(len(per)), key=lambda i: per[i][3])
    rows = [(*p, p[3] / median if median else None) for p in per]
    return {"rows": rows, "slowest": slowest, "median_ns": median,
            "imbalance": per[slowest][3] / median if median else None}  # fmt: skip


def payload_ranks(model: Any, S: Strings) -> dict[str, Any] | None:
    """The page's part: :func:`rank_view` with labels in the strings table (``ns`` and
    ``bytes`` per step rounded to integers)."""
    view = rank_view(model)
    if view is None:
        return None
    return {
        "rows": [{"label": S(label), "steps": n, "bytes": round(b), "ns": round(t),
                  "vs": None if vs is None else round(vs, 4)}
                 for label, n, b, t, vs in view["rows"]],
        "slowest": view["slowest"],
        "median_ns": round(view["median_ns"]),
        "imbalance": None if view["imbalance"] is None else round(view["imbalance"], 4),
    }  # fmt: skip
