"""Copy budgets: per-step and total limits on bytes and copies, and forbidden hazards.

Used by ``copytrace check`` and by the pytest plugin; each violation is one line naming the
call sites responsible.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from copytrace._units import format_bytes_exact
from copytrace.analysis._findings import SEVERITIES, Finding, normalize_codes
from copytrace.analysis._sitecopies import SiteCopies, column_sites, top_sites, whole_trace
from copytrace.analysis._view import Ev

__all__ = ["Budget", "StepTotal", "step_totals", "check_budget", "parse_bytes"]


class StepTotal:
    """Copies of one step of one run.

    Attributes:
        run: run index (0 in memory).
        step: step number.
        bytes: bytes of new storage allocated by copies (``bytes_allocated``, groups excluded).
        copies: copies (not aliases, not no-ops, not groups, not failed calls).
        sites: ``call site -> [bytes, copies]`` (read from a run's columns, it is built when
            first asked for: :meth:`top_sites` names the top sites without it).
    """

    __slots__ = ("run", "step", "bytes", "copies", "_sites", "_groups", "_span")

    def __init__(self, run: int, step: int, bytes: int = 0, copies: int = 0,
                 sites: dict[str, list[int]] | None = None, groups: SiteCopies | None = None,
                 span: tuple[int, int] = (0, 0)) -> None:  # fmt: skip
        self.run = run
        self.step = step
        self.bytes = bytes
        self.copies = copies
        self._sites = sites if sites is not None or groups is not None else {}
        self._groups = groups  # the run's groups by (step, site); this step's: span
        self._span = span

    @property
    def sites(self) -> dict[str, list[int]]:
        if self._sites is None:
            assert self._groups is not None
            self._sites = self._groups.sites(*self._span)
        return self._sites

    def top_sites(self, n: int = 3) -> str:
        """The ``n`` call sites with the most bytes (then copies, then by name), formatted."""
        if self._sites is None and self._groups is not None:
            return top_sites(self._groups.top(*self._span, n))
        rows = sorted(self.sites.items(), key=lambda kv: (-kv[1][0], -kv[1][1], kv[0]))[:n]
        return top_sites([(site, b, c) for site, (b, c) in rows])

    def _key(self) -> tuple[Any, ...]:
        return (self.run, self.step, self.bytes, self.copies, self.sites)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepTotal):
            return NotImplemented
        return self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"StepTotal(run={self.run}, step={self.step}, bytes={self.bytes}, "
                f"copies={self.copies}, sites={self.sites!r})")  # fmt: skip


@dataclass
class Budget:
    """Limits; ``None`` means unlimited.

    Attributes:
        max_bytes_per_step, max_copies_per_step: per step of each run.
        max_bytes, max_copies: over the whole trace.
        forbid: hazard codes that must not be found (see :func:`normalize_codes`).
        warmup_steps: steps (from 0) left out of the per-step limits.
    """

    max_bytes_per_step: int | None = None
    max_copies_per_step: int | None = None
    max_bytes: int | None = None
    max_copies: int | None = None
    forbid: Sequence[str] = ()
    warmup_steps: int = 0


def _copies(n: int) -> str:
    return f"{n} copy" if n == 1 else f"{n} copies"


def _is_counted(e: Ev) -> bool:
    return not e.group and not e.alias and not e.noop and e.error is None


def _is_views(source: Any) -> bool:
    """Whether ``source`` is already one list of :class:`Ev` per run."""
    from copytrace.analysis._table_view import TableRuns

    if isinstance(source, TableRuns):
        return True
    return isinstance(source, list) and all(
        isinstance(run, list) and all(isinstance(e, Ev) for e in run[:1]) for run in source
    )


def _view_totals(runs: list[list[Ev]], totals: dict[tuple[int, int], StepTotal]) -> None:
    for events in runs:
        for e in events:
            if not _is_counted(e):
                continue
            key = (e.run or 0, e.step or 0)
            total = totals.get(key)
            if total is None:
                total = totals[key] = StepTotal(run=key[0], step=key[1])
            total.bytes += e.bytes_allocated
            total.copies += 1
            row = total.sites.setdefault(e.site or "(unknown call site)", [0, 0])
            row[0] += e.bytes_allocated
            row[1] += 1


def _column_totals(rc: Any, totals: dict[tuple[int, int], StepTotal]) -> None:
    """Add the counted copies of one run's columns, grouped by (step, call site) at once and
    kept as columns (:class:`SiteCopies`): one :class:`StepTotal` per step."""
    import numpy as np

    found = column_sites(rc)
    if found is None:
        return
    steps, groups = found
    starts = np.flatnonzero(np.diff(steps, prepend=steps[0] - 1))
    ends = np.append(starts[1:], len(steps))
    nbytes = np.add.reduceat(groups.bytes, starts).tolist()
    copies = np.add.reduceat(groups.copies, starts).tolist()
    run = rc.run or 0
    for step, b, c, lo, hi in zip(steps[starts].tolist(), nbytes, copies, starts.tolist(),
                                  ends.tolist(), strict=True):  # fmt: skip
        total = totals.get((run, step))
        if total is None:
            totals[(run, step)] = StepTotal(run, step, b, c, None, groups, (lo, hi))
            continue
        total.bytes += b  # a run index seen before (events from memory): merged by text
        total.copies += c
        for site, (sb, sc) in groups.sites(lo, hi).items():
            row = total.sites.setdefault(site, [0, 0])
            row[0] += sb
            row[1] += sc


def step_totals(source: Any) -> list[StepTotal]:
    """Per-step totals of every run, in (run, step) order (steps without copies omitted).

    Args:
        source: what :func:`copytrace.analysis.analyze` takes (read column by column), or
            one list of :class:`Ev` per run.
    """
    return _totals(source)[0]


def _totals(source: Any) -> tuple[list[StepTotal], int]:
    """:func:`step_totals`, and the number of runs."""
    totals: dict[tuple[int, int], StepTotal] = {}
    if _is_views(source):
        _view_totals(source, totals)
        runs = len(source)
    else:
        from copytrace.analysis._columns import columns_of

        runs = 0
        for rc in columns_of(source):
            _column_totals(rc, totals)
            runs += 1
    return [totals[k] for k in sorted(totals)], runs


def _whole(totals: list[StepTotal]) -> StepTotal:
    """All steps' copies as one total (call sites summed over the steps and runs)."""
    whole = StepTotal(run=0, step=0)
    whole.bytes = sum(t.bytes for t in totals)
    whole.copies = sum(t.copies for t in totals)
    if totals and all(t._sites is None and t._groups is not None for t in totals):
        groups = whole_trace([(t._groups, *t._span) for t in totals])  # type: ignore[misc]
        return StepTotal(0, 0, whole.bytes, whole.copies, None, groups, (0, len(groups.bytes)))
    for t in totals:
        for site, (b, c) in t.sites.items():
            row = whole.sites.setdefault(site, [0, 0])
            row[0] += b
            row[1] += c
    return whole


def _label(t: StepTotal, many_runs: bool) -> str:
    return f"run {t.run} step {t.step}" if many_runs else f"step {t.step}"


def check_budget(
    source: Any,
    findings: list[Finding],
    budget: Budget,
    totals: tuple[list[StepTotal], int] | None = None,
) -> list[str]:
    """One line per violated limit or forbidden finding; empty when within budget.

    Args:
        source: as for :func:`step_totals`.
        findings: the findings of ``source``.
        budget: the limits.
        totals: ``(step totals, number of runs)`` of ``source`` when already computed
            (:func:`copytrace.analysis.analyze_with_totals`).
    """
    lines: list[str] = []
    totals, runs = totals if totals is not None else _totals(source)
    many = runs > 1
    per_step = [t for t in totals if t.step >= budget.warmup_steps]
    for limit, attr, what, flag in (
        (budget.max_bytes_per_step, "bytes", "bytes", "max-bytes-per-step"),
        (budget.max_copies_per_step, "copies", "copies", "max-copies-per-step"),
    ):
        if limit is None:
            continue
        over = [t for t in per_step if getattr(t, attr) > limit]
        if not over:
            continue
        worst = max(over, key=lambda t: (getattr(t, attr), -t.step))
        shown = format_bytes_exact(limit) if attr == "bytes" else str(limit)
        lines.append(
            f"{what} per step over {flag} {shown} in {len(over)} of {len(per_step)} step(s) "
            f"with copies; worst {_label(worst, many)}: {format_bytes_exact(worst.bytes)} in "
            f"{_copies(worst.copies)}, top call sites: {worst.top_sites()}"
        )
    if budget.max_bytes is not None or budget.max_copies is not None:
        whole = _whole(totals)
        if budget.max_bytes is not None and whole.bytes > budget.max_bytes:
            lines.append(
                f"bytes allocated {format_bytes_exact(whole.bytes)} over max-bytes "
                f"{format_bytes_exact(budget.max_bytes)} ({_copies(whole.copies)}), top call sites: "
                f"{whole.top_sites()}"
            )
        if budget.max_copies is not None and whole.copies > budget.max_copies:
            lines.append(
                f"copies {whole.copies} over max-copies {budget.max_copies} "
                f"({format_bytes_exact(whole.bytes)}), top call sites: {whole.top_sites()}"
            )
    forbidden = set(normalize_codes(budget.forbid))
    for f in findings:
        if f.code in forbidden:
            sites = ", ".join(f.call_sites[:3]) or "(unknown call site)"
            lines.append(f"forbidden hazard {f.code} ({f.severity}) at {sites}: {f.message}")
    return lines


_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}


def parse_bytes(text: Any) -> int:
    """``"4096"``, ``"4KiB"``, ``"1.5MB"``, ``"2G"`` -> bytes (``K``/``KB`` = 1000, ``KiB``
    = 1024).

    Raises:
        ValueError: for anything else, or a negative value.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"byte count must be >= 0, got {text}")
        return text
    m = _BYTES.match(str(text))
    if not m:
        raise ValueError(f"not a byte count: {text!r} (e.g. 4096, 64KiB, 1.5MB)")
    number, unit = float(m.group(1)), (m.group(2) or "").lower()
    binary = "i" in unit
    base = unit[:1] if unit[:1] in "kmgt" and unit else ""
    scale = 1024 ** ("kmgt".index(base) + 1) if binary and base else _UNITS[base]
    return int(number * scale)


def severity_codes(level: str) -> list[str]:
    """Codes at ``level`` or more severe (``warning`` -> error and warning codes)."""
    if level not in SEVERITIES:
        raise ValueError(f"unknown severity {level!r}; one of {', '.join(SEVERITIES)}")
    return normalize_codes(SEVERITIES[: SEVERITIES.index(level) + 1])
