"""Turn a :class:`~copytrace.dashboards._model.ReportModel` into the compact JSON the page reads.

The page (``report.js``) builds every figure in the browser from this payload, so the HTML
file holds each fact once: strings sit in one table (``S``) and everything else refers to
them by index; events are columns of numbers that index a table of event templates. Only a
sample of the events is shipped (see :func:`~copytrace.dashboards._model.sample_events`);
all counts, bytes and times come from aggregates over every event.
"""

from __future__ import annotations

import datetime as _dt
import json
from typing import Any

from copytrace.dashboards import sections as sec
from copytrace.dashboards._model import KINDS, MAX_TIMELINE_POINTS, STAGES, ReportModel
from copytrace.dashboards._pack import Strings
from copytrace.dashboards.sections.sources import OP_PALETTE

__all__ = ["build_payload", "dump_payload", "MAX_TIMELINE_POINTS", "OP_PALETTE"]


def build_payload(
    model: ReportModel,
    *,
    title: str,
    max_points: int = MAX_TIMELINE_POINTS,
    version: str = "",
) -> dict[str, Any]:
    """Build the page's data: strings table, aggregates, steps, sampled events, hazards.

    Each section's part comes from its module in :mod:`copytrace.dashboards.sections`
    (``payload_*`` functions); strings go into one table, ``S``, in the order the parts are
    built.

    Args:
        model: What :func:`~copytrace.dashboards.build_model` returned.
        title: Page title.
        max_points: Timeline point budget (hazard and error events are kept beyond it).
        version: copytrace version for the footer.

    Returns:
        A JSON-serialisable dict (times in ns unless a key ends in ``_ms``, bytes in bytes).
        ``compiled`` (:func:`~.sections.compiled.payload_compiled`) and ``pyspy``
        (:func:`~.sections.pyspy.payload_pyspy`) are plain JSON, outside the strings table.
    """
    S = Strings()
    S("")  # index 0 is the empty string
    run_index = {r.label: i for i, r in enumerate(model.runs)}
    runs = sec.run.payload_runs(model, S)
    cube = sec.sources.payload_cube(model, S)
    sites = sec.sources.payload_sites(model, S)
    steps = sec.steps.payload_steps(model, run_index)
    transfers = sec.transfers.payload_transfers(model, S)
    timeline = sec.timeline.payload_timeline(model, S, max_points)
    hazards = sec.hazards.payload_hazards(model, S)
    groups = sec.events.payload_groups(model, S, run_index)
    compiled, pyspy = _optional_parts(model)
    files = [S(f) for f in model.files]
    op_colors = {S(op): c for op, c in sec.sources.op_colors(model).items()}
    payload: dict[str, Any] = {
        "v": 1,
        "title": title,
        "version": version,
        "generated": _dt.datetime.now(tz=_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "files": files,
        "warnings": sec.run.payload_warnings(model),
        "analysis": model.analysis,
        "kinds": list(KINDS),
        "stages": list(STAGES),
        "runs": runs,
        "totals": sec.kinds.payload_totals(model),
        "stage_stats": sec.glance.payload_stages(model),
        "op_colors": op_colors,
        "cube": cube,
        "sites": sites,
        "group_by": getattr(model, "group_by", "library"),
        "steps": steps,
        "transfers": transfers,
        **timeline,
        "hazards": hazards,
        "groups": groups,
        "n_groups": len(model.groups),
        "ranks": sec.ranks.payload_ranks(model, S),
        "compiled": compiled,
        "pyspy": pyspy,
    }
    payload["S"] = S.items
    return payload


def _optional_parts(model: ReportModel) -> tuple[Any, list[dict[str, Any]]]:
    """The compiled-regions and py-spy parts; a failure in either leaves a note in its place
    (the rest of the report does not depend on them)."""
    try:
        compiled = sec.compiled.payload_compiled(model)
    except Exception as err:
        compiled = {"error": f"compiled regions left out: {type(err).__name__}: {err}"}
    try:
        pyspy = sec.pyspy.payload_pyspy(model)
    except Exception as err:
        pyspy = [{"name": "", "error": f"py-spy view left out: {type(err).__name__}: {err}"}]
    return compiled, pyspy


def dump_payload(payload: dict[str, Any]) -> str:
    """Serialise the payload for a ``<script type="application/json">`` element.

    ``<``, ``>`` and ``&`` are written as ``\\u003c``, ``\\u003e``, ``\\u0026`` (and U+2028,
    U+2029 escaped), so no string from the trace can close the element or start markup.

    Args:
        payload: What :func:`build_payload` returned.

    Returns:
        Compact JSON text, safe inside a script element.
    """
    text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return (
        text.replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )
