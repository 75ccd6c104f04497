"""At a glance: the copy-time share of a step per stage (warm-up, steady state, tail)."""

from __future__ import annotations

from typing import Any

from copytrace.dashboards._pack import rounded
from copytrace.dashboards._rows import STAGES, StageStats, StepRow
from copytrace.dashboards.sections.steps import median

__all__ = ["payload_stages", "stage_stats"]


def stage_stats(steps: list[StepRow]) -> dict[str, StageStats]:
    """Copy overhead over the steps of each stage, all runs together."""
    out = {s: StageStats(s) for s in STAGES}
    shares: dict[str, list[float]] = {s: [] for s in STAGES}
    for r in steps:
        st = out[r.stage]
        st.steps += 1
        st.step_time_ns += r.duration_ns or 0
        st.copy_time_ns += r.copy_time_ns
        st.bytes_copied += r.bytes_copied
        st.events_per_step += r.events
        if r.copy_time_share_pct is not None:
            shares[r.stage].append(r.copy_time_share_pct)
    for s, st in out.items():
        if st.steps:
            st.share_pct = st.copy_time_ns / st.step_time_ns * 100.0 if st.step_time_ns else 0.0
            st.median_share_pct = median(shares[s])
            st.bytes_per_step = st.bytes_copied / st.steps
            st.events_per_step = st.events_per_step / st.steps
    return out


# --- the page's payload ------------------------------------------------------------------------
def payload_stages(model: Any) -> dict[str, dict[str, Any]]:
    """Copy-time share and bytes per stage (``share`` / ``median`` in percent)."""
    return {
        name: {
            "steps": st.steps,
            "step_t": st.step_time_ns,
            "ct": st.copy_time_ns,
            "share": rounded(st.share_pct, 4),
            "median": None if st.median_share_pct is None else rounded(st.median_share_pct, 4),
            "bc": st.bytes_copied,
            "bc_step": rounded(st.bytes_per_step, 1),
            "ev_step": rounded(st.events_per_step, 2),
        }
        for name, st in model.stages.items()
    }
