"""The sampled shares beside the traced ones: what the trace itself says of copy time and of
its own overhead, for the same process (:func:`traced_numbers`), and both on one line
(:func:`summary_line`, printed by ``copytrace run --py-spy``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from copytrace.pyspy.profile import SampleStats

__all__ = ["pid_of", "summary_line", "traced_numbers"]


def traced_numbers(model: Any, pid: Any) -> dict[str, float | None]:
    """Copy time and overhead the trace itself reports, for the run of ``pid`` (or all).

    Returns:
        ``copy_share`` (summed event duration / run duration), ``overhead_share``
        (copytrace's own recording time / run duration, None when not recorded),
        ``duration_s`` and ``copy_s``.
    """
    runs = list(getattr(model, "runs", []) or [])
    pids = set() if pid is None else ({pid} if isinstance(pid, int) else set(pid))
    chosen = [r for r in runs if getattr(r, "pid", None) in pids] or runs
    labels = {getattr(r, "label", None) for r in chosen}
    duration = sum(int(getattr(r, "duration_ns", 0) or 0) for r in chosen)
    steps = [s for s in getattr(model, "steps", []) or [] if getattr(s, "run", None) in labels]
    if steps:
        copy_ns = sum(int(getattr(s, "copy_time_ns", 0) or 0) for s in steps)
    else:
        copy_ns = int(getattr(getattr(model, "totals", None), "copy_time_ns", 0) or 0)
    overheads = [getattr(r, "overhead_ns", None) for r in chosen]
    overhead = (
        sum(o for o in overheads if o is not None)
        if any(o is not None for o in overheads)
        else None
    )
    return {
        "duration_s": duration / 1e9,
        "copy_s": copy_ns / 1e9,
        "copy_share": copy_ns / duration if duration else None,
        "overhead_share": overhead / duration if (duration and overhead is not None) else None,
    }


def pid_of(path: Path) -> int | None:
    m = re.search(r"-(\d+)(?:\.speedscope\.json|\.pyspy\.txt)$", path.name)
    return int(m.group(1)) if m else None


def summary_line(stats: SampleStats, traced: dict[str, float | None] | None = None) -> str:
    """One line: the sampled shares, and the traced ones beside them."""
    unit = "s" if stats.unit == "seconds" else " samples"
    line = (
        f"py-spy: {stats.samples} samples ({stats.weight:.3g}{unit}, {stats.scope}): "
        f"copy work {stats.copy_work_share:.1%}"
    )
    if traced and traced.get("copy_share") is not None:
        line += f" (traced copy time: {traced['copy_share']:.1%})"
    line += (
        f" + copytrace recording them {stats.copy_call_tracer_share:.1%}; "
        f"copytrace in all {stats.tracer_share:.1%}"
    )
    if traced and traced.get("overhead_share") is not None:
        line += f" (traced overhead: {traced['overhead_share']:.1%})"
    line += (
        f"; copy kernels {stats.kernel_share:.1%}, of which {stats.kernel_in_ops_share:.1%} "
        "inside other ops (not traced)"
    )
    return line


