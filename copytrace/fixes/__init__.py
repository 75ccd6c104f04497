"""From finding to patch: the code change for each finding that has a mechanical fix.

Typical use::

    from copytrace.fixes import plan_fixes, format_diff, apply_plan

    plan = plan_fixes("copytrace-out")          # a trace file or directory, or t.events
    print(format_diff(plan))                    # applies with `git apply` / `patch -p1`
    apply_plan(plan)                            # or write the files in place

Rewrites go through LibCST (comments and formatting kept; only the call the finding pins is
changed, and a line where that call is ambiguous is refused). Files outside ``root`` (the
current directory), in installed packages or in the standard library are never touched.
``copytrace.fixes._verify`` checks a plan by tracing the program again. ``docs/fix.md``
lists each fix and whether it keeps values bit for bit.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from copytrace.fixes._diff import format_diff, format_unfixed
from copytrace.fixes._plan import FIXES, Fix, FixRule, Plan, Unfixed, make_plan

__all__ = [
    "FIXES",
    "Fix",
    "FixRule",
    "Plan",
    "Unfixed",
    "apply_plan",
    "format_diff",
    "format_unfixed",
    "make_plan",
    "plan_findings",
    "plan_fixes",
]


def plan_fixes(source: Any, *, codes: Any = None, root: str | os.PathLike | None = None) -> Plan:
    """Analyse ``source`` and plan a patch for each finding that has a safe fix.

    Args:
        source: what :func:`copytrace.analysis.analyze` takes (a trace path, a loaded trace,
            ``t.events``).
        codes: only these hazard codes (``"tensor-ctor-copy,noop-conversion"`` or a list).
        root: the project root (default: the current directory).

    Returns:
        The :class:`Plan` (nothing is written).

    Raises:
        TraceFileError: when ``source`` is a path that holds no readable trace.
        ValueError: for an unknown hazard code.
    """
    from copytrace.analysis import analyze, normalize_codes

    if isinstance(source, (str, os.PathLike)):
        from copytrace.tracefile import event_table

        source = event_table(source)
    wanted = normalize_codes(codes) if codes is not None else None
    return plan_findings(analyze(source, codes=wanted), source, root=root)


def plan_findings(
    findings: Any, source: Any, *, root: str | os.PathLike | None = None
) -> Plan:
    """Plan the patches of findings already made (``check``, the report), from ``source``.

    The run's events are read (:func:`copytrace.analysis._view.runs_of`, which reuses the
    views the analysis left on an event table) only for the runs where a finding whose code
    has a fix names a file of the project (a trace from another machine reads none), and each
    line is rewritten once however many findings (steps, parameters) share it.

    Args:
        findings: :class:`copytrace.analysis.Finding` objects, or their ``as_dict()`` dicts
            (the report's cache).
        source: what the findings were made from (as for :func:`plan_fixes`).
        root: the project root (default: the current directory).

    Returns:
        The :class:`Plan` (nothing is written).
    """
    from copytrace.analysis import Finding
    from copytrace.analysis._view import runs_of
    from copytrace.fixes._plan import _pin, outside

    found = [Finding(**f) if isinstance(f, dict) else f for f in findings or ()]
    base = Path(root if root is not None else Path.cwd()).resolve()
    here: dict[Path, bool] = {}  # a trace from another machine names no file here: no events read
    for f in found:
        pin = _pin(f) if f.code in FIXES else None
        if pin is not None and pin[0] not in here:
            here[pin[0]] = outside(pin[0], base) is None
    need = {f.run for f in found if f.code in FIXES and here.get((_pin(f) or (None,))[0])}
    # list(): a large table's views are cleared once the iteration moves past them
    runs = [list(r) if i in need else [] for i, r in enumerate(runs_of(source))] if need else []
    return make_plan(found, runs, base)


def apply_plan(plan: Plan) -> list[Path]:
    """Write the plan's new file texts in place.

    Returns:
        The files written.
    """
    written = []
    for rel, (_, new) in sorted(plan.files.items()):
        path = plan.root / rel
        with open(path, "w", encoding="utf-8", newline="") as fh:
            fh.write(new)
        written.append(path)
    return written
