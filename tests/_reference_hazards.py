"""Reference: the hazard rules as they ran before the columnar analyser (one Python object
per event, :class:`copytrace.analysis._view.Ev`), kept only for the differential test
(tests/test_hazard_diff.py). ``analyze_reference`` gives the findings the analyser gave then.

The rules are split by family: ``_reference_hazards_pairs.py`` (rules that pair or compare
events), ``_reference_hazards_sites.py`` (rules that group events by call site), over the
shared part ``_reference_hazards_base.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from _reference_hazards_pairs import (
    aliasing_snapshot,
    clone_detach_order,
    data_inplace,
    redundant_copy,
    round_trip,
)
from _reference_hazards_sites import (
    alias_write,
    deepcopy_in_loop,
    deepcopy_nonleaf,
    graph_retaining_copy,
    lost_inplace_write,
    noop_conversion,
    pageable_transfer,
    stale_kept_copy,
    tensor_ctor_copy,
)

from copytrace.analysis._findings import HAZARDS, Finding
from copytrace.analysis._view import Ev

__all__ = ["RULES", "analyze_reference"]


#: The rules, in report order.
RULES: tuple[Callable[[list[Ev]], list[Finding]], ...] = (
    data_inplace,
    lost_inplace_write,
    graph_retaining_copy,
    alias_write,
    aliasing_snapshot,
    stale_kept_copy,
    redundant_copy,
    round_trip,
    pageable_transfer,
    deepcopy_in_loop,
    deepcopy_nonleaf,
    tensor_ctor_copy,
    clone_detach_order,
    noop_conversion,
)


_ORDER = {code: i for i, code in enumerate(HAZARDS)}


def analyze_reference(source: Any) -> list[Finding]:
    """The findings of ``source`` (as for :func:`copytrace.analysis.analyze`), sorted as the
    analyser sorts them, computed by the rules above over :func:`runs_of`'s views."""
    from copytrace.analysis._findings import SEVERITIES
    from copytrace.analysis._view import runs_of

    findings = [f for events in runs_of(source) for rule in RULES for f in rule(events)]
    return sorted(
        findings,
        key=lambda f: (
            SEVERITIES.index(f.severity),
            _ORDER.get(f.code, len(_ORDER)),
            -f.bytes,
            f.run,
            f.event_seqs[:1],
        ),
    )
