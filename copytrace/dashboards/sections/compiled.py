"""Compiled regions: torch.compile'd code that ran while tracing (``copytrace.compiled`` and
``copytrace.compiled_graph`` spans), summarised by :mod:`copytrace.dashboards._compiled`.
Traces without such spans give None and the page leaves the section out."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from copytrace.dashboards._query import Query

__all__ = ["compiled_regions"]


def compiled_regions(q: Query) -> Any:
    """The compiled-regions section (a ``CompiledSection``), or None without compiled spans."""
    from copytrace.dashboards._compiled import compiled_section

    runs = [
        SimpleNamespace(attrs=meta.attrs, compiled_calls=meta.compiled,
                        compiled_graphs=meta.compiled_graphs)
        for meta in q.runs
    ]  # fmt: skip
    return compiled_section(SimpleNamespace(runs=runs))  # type: ignore[arg-type]
