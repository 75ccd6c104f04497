"""Hazard analysis: turn a copytrace trace into findings, and check copy budgets.

Typical use::

    import copytrace
    from copytrace.analysis import analyze

    with copytrace.trace() as t:
        train()
    for finding in analyze(t.events):          # or analyze("copytrace-out")
        print(finding.one_line())
        print("  fix:", finding.fix)

Each :class:`Finding` has a stable ``code`` (documented with a minimal example in
``docs/hazards.md``), a severity, a message with the numbers, the fix in one sentence, the
call sites, the bytes at stake, the steps and the events that show it. The rules only read
facts the tracer recorded (``docs/trace-format.md``); this package never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from copytrace._units import format_bytes_exact
from copytrace.analysis._budget import (
    Budget,
    StepTotal,
    _column_totals,
    _is_views,
    _totals,
    check_budget,
    parse_bytes,
    severity_codes,
    step_totals,
)
from copytrace.analysis._columns import columns_of
from copytrace.analysis._findings import HAZARDS, SEVERITIES, Finding, Hazard, normalize_codes
from copytrace.analysis._rules import RULE_COLUMNS, RULES, is_hot

__all__ = [
    "HAZARDS",
    "SEVERITIES",
    "Budget",
    "Finding",
    "Hazard",
    "StepTotal",
    "analyze",
    "analyze_with_totals",
    "check",
    "format_findings",
    "normalize_codes",
    "parse_bytes",
    "severity_codes",
    "step_totals",
]

_ORDER = {code: i for i, code in enumerate(HAZARDS)}


def _sort(findings: list[Finding]) -> list[Finding]:
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


def _analyze(
    source: Any,
    codes: Iterable[str] | None,
    each_run: Callable[[Any], None] | None = None,
) -> list[Finding]:
    """The findings of ``source``; ``each_run(columns)`` is called with each run's columns
    once its rules ran (see :func:`analyze_with_totals`)."""
    wanted = set(normalize_codes(list(codes))) if codes is not None else None
    findings: list[Finding] = []
    # one rule per code, in the codes' order: a rule whose code is not wanted is not run
    rules = [rule for code, rule in zip(HAZARDS, RULES, strict=True)
             if wanted is None or code in wanted]  # fmt: skip
    for rc in columns_of(source):  # one run's columns at a time
        if wanted is None:
            rc.prefetch(RULE_COLUMNS)
        for rule in rules:
            for f in rule(rc):
                if wanted is None or f.code in wanted:
                    findings.append(f)
        if each_run is not None:
            each_run(rc)
    _release_columns()
    return _sort(findings)


def analyze_with_totals(source: Any) -> tuple[list[Finding], tuple[list[StepTotal], int]]:
    """:func:`analyze` and the per-step totals of ``source`` (:func:`step_totals`) from one read of its columns
    (what ``copytrace check`` needs; on a 1M-event trace this saves reading and ordering
    the columns a second time, about 1.4 s).

    Args:
        source: as for :func:`analyze`.

    Returns:
        ``(findings, (step totals, number of runs))``.

    Raises:
        TraceFileError: as :func:`analyze`.
    """
    if _is_views(source):
        return _analyze(source, None), _totals(source)
    totals: dict[tuple[int, int], StepTotal] = {}
    runs = 0

    def add(rc: Any) -> None:
        nonlocal runs
        _column_totals(rc, totals)
        runs += 1

    findings = _analyze(source, None, add)
    return findings, ([totals[k] for k in sorted(totals)], runs)


def _release_columns() -> None:
    """Hand the memory the columns used back to the system (pyarrow's allocator keeps freed
    memory for reuse: the report's DuckDB, or the traced program after stop, would not get
    it)."""
    try:
        import pyarrow as pa

        pa.default_memory_pool().release_unused()
    except Exception:  # an older pyarrow: the memory is only kept for reuse
        pass


def analyze(source: Any, *, codes: Iterable[str] | None = None) -> list[Finding]:
    """Find the hazards in a trace.

    Args:
        source: the events of a trace (``t.events``, a list of :class:`copytrace.CopyEvent`),
            a :class:`copytrace.Trace`, a loaded :class:`copytrace.tracefile.TraceData`, or a
            trace file / directory path.
        codes: only these hazard codes (default: all); see :func:`normalize_codes`.

    Returns:
        The findings, most severe first, then by code, then by bytes.

    Raises:
        TraceFileError: when ``source`` is a path that holds no readable trace.
    """
    return _analyze(source, codes)


def check(
    source: Any,
    budget: Budget,
    findings: list[Finding] | None = None,
    totals: tuple[list[StepTotal], int] | None = None,
) -> tuple[list[str], list[Finding]]:
    """Check ``source`` against ``budget``.

    Args:
        source: as for :func:`analyze`.
        budget: the limits and forbidden hazard codes.
        findings: the findings of ``source`` when already computed.
        totals: ``(step totals, number of runs)`` of ``source`` when already computed
            (:func:`analyze_with_totals`).

    Returns:
        ``(violations, findings)``: one line per violated limit or forbidden finding (empty
        when within budget), and all findings.
    """
    if findings is None:
        findings = _analyze(source, None)
    return check_budget(source, findings, budget, totals), findings


def format_findings(
    findings: Sequence[Finding], limit: int | None = None, notes: Sequence[str] = ()
) -> str:
    """Findings as plain text for terminals and ``copytrace summary``.

    Args:
        findings: what :func:`analyze` returned.
        limit: show at most this many findings (the rest are counted).
        notes: one more line under each finding, in order (``""``: none); ``copytrace
            check`` names there the ``copytrace fix`` command of a finding that has a patch.

    Returns:
        The text, ending with a newline; ``"hazards: none found\\n"`` without findings.
    """
    if not findings:
        return "hazards: none found\n"
    counts = {s: sum(1 for f in findings if f.severity == s) for s in SEVERITIES}
    head = ", ".join(f"{n} {s}{'s' if n != 1 and s != 'info' else ''}" for s, n in counts.items())
    lines = [f"hazards: {head}"]
    shown = findings if limit is None else findings[:limit]
    for i, f in enumerate(shown):
        steps = f"{len(f.steps)} step{'s' if len(f.steps) != 1 else ''}"
        lines.append(f"  {f.severity:<7} {f.code}: {f.message}")
        where = "; ".join(f.call_sites[:3]) or "(unknown call site)"
        lines.append(f"          at {where}; {format_bytes_exact(f.bytes)}, {steps}")
        lines.append(f"          fix: {f.fix}")
        if i < len(notes) and notes[i]:
            lines.append(f"          {notes[i]}")
    if len(shown) < len(findings):
        lines.append(f"  ... and {len(findings) - len(shown)} more")
    return "\n".join(lines) + "\n"


# Re-exported helper for the CLI and the pytest plugin.
is_hot = is_hot
