"""One module per report section, each computing its part of the report model from the
event table (:class:`copytrace.dashboards._query.Query`), in the page's order:

- :mod:`.glance`: at a glance (copy-time share per stage);
- :mod:`.hazards`: hazards (the analyser's findings, or those the tracer wrote);
- :mod:`.steps`: per step;
- :mod:`.sources`: where from (call sites, modules, ops);
- :mod:`.timeline`: the timeline's sample of events;
- :mod:`.kinds`: kinds and the totals;
- :mod:`.transfers`: device transfers;
- :mod:`.compiled`: compiled regions (``copytrace.compiled`` spans, when the trace has them);
- :mod:`.events`: deepcopy groups (the events table reads the timeline's sample);
- :mod:`.ranks`: ranks side by side (a run of several processes);
- :mod:`.run`: run details;
- :mod:`.pyspy`: py-spy's sampled view (profiles beside the trace files, when there are).
"""

from copytrace.dashboards.sections import (  # noqa: E402
    compiled,
    events,
    glance,
    hazards,
    kinds,
    pyspy,
    ranks,
    run,
    sources,
    steps,
    timeline,
    transfers,
)

__all__ = ["compiled", "events", "glance", "hazards", "kinds", "pyspy", "ranks", "run", "sources",
           "steps", "timeline", "transfers"]  # fmt: skip
