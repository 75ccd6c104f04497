"""Compiled regions: torch.compile'd code that ran while tracing (``copytrace.compiled`` and
``copytrace.compiled_graph`` spans), summarised by :mod:`copytrace.dashboards._compiled`.
Traces without such spans give None and the page leaves the section out. The page draws the
section from :func:`payload_compiled`."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from copytrace.dashboards._query import Query

__all__ = ["MAX_ROWS", "compiled_regions", "payload_compiled"]

#: Most graph-copy rows shipped to the page (biggest total first).
MAX_ROWS = 200


def compiled_regions(q: Query) -> Any:
    """The compiled-regions section (a ``CompiledSection``), or None without compiled spans."""
    from copytrace.dashboards._compiled import compiled_section

    runs = [
        SimpleNamespace(attrs=meta.attrs, compiled_calls=meta.compiled,
                        compiled_graphs=meta.compiled_graphs)
        for meta in q.runs
    ]  # fmt: skip
    return compiled_section(SimpleNamespace(runs=runs))  # type: ignore[arg-type]


def payload_compiled(model: Any, max_rows: int = MAX_ROWS) -> dict[str, Any] | None:
    """The section's part of the page's data, or None when the trace has no compiled region.

    Returns:
        ``{"mode": "compiled" | "eager" | None, "calls", "graphs", "time_ns",
        "unknown_graph_runs", "graph_copy_bytes", "observed_bytes", "share_pct" (graph-copy
        bytes / (graph-copy + observed) x 100, or None), "rows": [{"graph", "kind", "op",
        "input_mutation", "shape", "dtype", "device", "bytes" (per run, None: symbolic),
        "runs", "total_bytes", "site", "code"}], "n_rows"}``; bytes in bytes, times in ns.
    """
    section = getattr(model, "compiled", None)
    if section is None:
        return None
    observed = int(model.totals.bytes_copied)
    rows = [
        {"graph": r.graph, "kind": r.kind, "op": r.op, "input_mutation": r.input_mutation,
         "shape": [str(d) for d in r.shape], "dtype": r.dtype, "device": r.device,
         "bytes": r.bytes, "runs": r.runs, "total_bytes": r.total_bytes, "site": r.site,
         "code": r.code}
        for r in section.rows[:max_rows]
    ]  # fmt: skip
    return {
        "mode": section.mode,
        "calls": section.calls,
        "graphs": section.graphs,
        "time_ns": section.time_ns,
        "unknown_graph_runs": section.unknown_graph_runs,
        "graph_copy_bytes": section.graph_copy_bytes,
        "observed_bytes": observed,
        "share_pct": section.share_pct(observed),
        "rows": rows,
        "n_rows": len(section.rows),
    }
