"""Per step: one :class:`StepRow` per step of each run, with its stage."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from copytrace.dashboards._pack import rounded
from copytrace.dashboards._query import Query
from copytrace.dashboards._rows import STAGES, WARMUP_FACTOR, RunInfo, StepRow

__all__ = ["payload_steps", "step_rows", "median"]

_PER_STEP = """
SELECT run_idx, step, count(*), count(*) FILTER (WHERE kind = 'copy' AND err = 0),
  count(*) FILTER (WHERE kind = 'alias'), count(*) FILTER (WHERE kind = 'noop'),
  sum(bc), sum(ba), sum(dur)
FROM ev WHERE step >= 0 GROUP BY run_idx, step
"""


def median(values: Sequence[float]) -> float | None:
    """The median of ``values`` (None when empty)."""
    if not values:
        return None
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def _assign_stages(rows: list[StepRow]) -> None:
    """Mark warm-up, steady and tail steps of one run (rows sorted by step)."""
    timed = [r for r in rows if r.duration_ns is not None]
    for r in rows:
        r.stage = "steady"
    if len(timed) < 3:
        return  # too few steps to tell warm-up from steady state
    timed[0].stage = "warmup"
    timed[-1].stage = "tail"
    middle = timed[1:-1]
    reference = median([r.duration_ns or 0 for r in middle[len(middle) // 2 :]]) or 0
    limit = max(1, len(timed) // 10)
    for r in middle[:limit]:
        if reference and (r.duration_ns or 0) > WARMUP_FACTOR * reference:
            r.stage = "warmup"
        else:
            break


def step_rows(q: Query, runs: list[RunInfo]) -> list[StepRow]:
    """Steps of every run, ordered by run then step (bytes in bytes, times in ns)."""
    per_run: list[dict[int, StepRow]] = []
    for meta, info in zip(q.runs, runs, strict=True):
        per_run.append({
            s.step: StepRow(run=info.label, step=s.step, duration_ns=max(0, s.end_ns - s.start_ns),
                            start_ms=(s.start_ns - meta.start_ns) / 1e6,
                            end_ms=(s.end_ns - meta.start_ns) / 1e6)
            for s in meta.steps
        })  # fmt: skip
    for run_idx, step, n, nc, na, nn, bc, ba, ct in q.sql(_PER_STEP):
        rows = per_run[run_idx]
        row = rows.get(step)
        if row is None:
            row = rows[step] = StepRow(run=runs[run_idx].label, step=step, duration_ns=None)
        row.events, row.copy_count, row.alias_count, row.noop_count = n, nc, na, nn
        row.bytes_copied, row.bytes_allocated, row.copy_time_ns = int(bc), int(ba), int(ct)
    out: list[StepRow] = []
    for rows in per_run:
        ordered = sorted(rows.values(), key=lambda r: r.step)
        for row in ordered:
            if row.duration_ns:
                row.copy_time_share_pct = row.copy_time_ns / row.duration_ns * 100.0
        _assign_stages(ordered)
        out.extend(ordered)
    return out


# --- the page's payload ------------------------------------------------------------------------
_STEP = ("run", "step", "dur", "stage", "ev", "nc", "na", "nn", "bc", "ba", "ct", "start", "end")


def payload_steps(model: Any, run_index: dict[str, int]) -> dict[str, list[Any]]:
    """The per-step rows as columns (``run``: the run's index; ``start`` / ``end`` in ms)."""
    cols: dict[str, list[Any]] = {k: [] for k in _STEP}
    stages = list(STAGES)
    for s in model.steps:
        row = (run_index[s.run], s.step, s.duration_ns, stages.index(s.stage), s.events,
               s.copy_count, s.alias_count, s.noop_count, s.bytes_copied, s.bytes_allocated,
               s.copy_time_ns, None if s.start_ms is None else rounded(s.start_ms),
               None if s.end_ms is None else rounded(s.end_ms))  # fmt: skip
        for key, value in zip(_STEP, row, strict=True):
            cols[key].append(value)
    return cols
