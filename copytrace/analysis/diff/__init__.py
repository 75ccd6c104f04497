"""Compare two runs: which call sites, modules and ops copy more or less per step, and which
hazards appeared or went away (``copytrace diff``, ``copytrace check --baseline``, the pytest
plugin's ``--copytrace-baseline``).

Typical use::

    from copytrace.analysis.diff import compare, load_run, to_json
    from copytrace.tracefile import event_table

    d = compare(load_run(event_table("base"), "base"), load_run(event_table("new"), "new"))
    print(to_json(d)["added"])

- :mod:`._profile`: a run's per-step aggregates per call site, module and op;
- :mod:`._source`: the source line of each site, kept beside the trace;
- :mod:`._match`: call sites matched across edits (moved, renamed, duplicated lines);
- :mod:`._stats`: copy time compared with a rank test over the steps;
- :mod:`._compare`, :mod:`._output`, :mod:`._gate`: the comparison, its forms, the gate;
- :mod:`._baseline`: a profile as a small JSON file (the pytest plugin's baselines);
- :mod:`._ranks`: the ranks of one run side by side (``copytrace diff RUN --ranks``).

``docs/diff.md`` documents the JSON form and the gate.
"""

from __future__ import annotations

from typing import Any

from copytrace.analysis.diff._baseline import (
    profile_from_json,
    profile_to_json,
    read_baseline,
    write_baseline,
)
from copytrace.analysis.diff._compare import Diff, Item, compare, number, triple
from copytrace.analysis.diff._gate import Increase, gate, parse_increase
from copytrace.analysis.diff._match import match_sites
from copytrace.analysis.diff._output import (
    FORMAT_VERSION,
    format_markdown,
    format_terminal,
    item_json,
    short_paths,
    site_counts,
    to_json,
)
from copytrace.analysis.diff._profile import (
    KeyStats,
    RunProfile,
    add_hazards,
    profile_events,
    profile_table,
)
from copytrace.analysis.diff._ranks import RankDiff, compare_ranks, format_ranks, ranks_json
from copytrace.analysis.diff._source import normalize, parse_site, read_sources, snapshot_sources
from copytrace.analysis.diff._stats import ALPHA, TimeTest, compare_times

__all__ = [
    "ALPHA", "Diff", "FORMAT_VERSION", "Increase", "Item", "KeyStats", "RankDiff", "RunProfile",
    "TimeTest", "add_hazards", "compare", "compare_ranks", "compare_times", "format_markdown",
    "format_ranks", "format_terminal", "gate", "item_json", "load_run", "match_sites", "normalize",
    "number", "parse_increase", "parse_site", "profile_events", "profile_from_json",
    "profile_table", "profile_to_json", "ranks_json", "read_baseline", "read_sources",
    "short_paths", "site_counts", "snapshot_sources", "to_json", "triple", "write_baseline",
]  # fmt: skip


def load_run(
    table: Any, label: str, trace_ids: list[str] | None = None, hazards: bool = True
) -> RunProfile:
    """A run as the diff sees it: aggregates, hazards and source lines.

    Args:
        table: A :class:`copytrace.tracefile.EventTable` restricted to one run.
        label: Names the run in the output.
        trace_ids: Only these processes of it (one rank); default all.
        hazards: Run the hazard analysis (:func:`copytrace.analysis.analyze`).
    """
    prof = profile_table(table, label, trace_ids)
    if hazards:
        from copytrace.analysis import analyze

        source = table.only(trace_ids) if trace_ids is not None else table
        add_hazards(prof, analyze(source))
    prof.sources = read_sources(list(table.files), list(prof.sites), prof.start_ns)
    return prof
