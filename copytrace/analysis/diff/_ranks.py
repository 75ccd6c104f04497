"""The ranks (processes) of one run side by side (``copytrace diff RUN --ranks``).

A straggler rank is a diff between ranks: each rank's copies, bytes and copy time per step
(counted as :mod:`._profile` counts a run), the slowest rank (the most copy time per step;
the lowest rank on a tie), the imbalance of each figure (max over ranks / median over
ranks; None when the median is 0), the copy time of each step per rank, and the slowest
rank compared with the median rank (the lower median by copy time of the other ranks) by
:func:`~._compare.compare`, call site by call site.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from copytrace._units import format_bytes, format_ns
from copytrace.analysis.diff._compare import Diff, compare, number
from copytrace.analysis.diff._output import format_terminal, to_json
from copytrace.analysis.diff._profile import RunProfile

__all__ = ["RankDiff", "compare_ranks", "format_ranks", "ranks_json"]

#: The per-step figures compared across ranks: name -> :class:`KeyStats` attribute.
FIGURES = {"copies_per_step": "copies", "bytes_per_step": "bytes", "time_per_step_ns": "time_ns"}


@dataclass
class RankDiff:
    """The ranks of one run.

    Attributes:
        label: The run.
        ranks: ``(rank name, trace id, profile)`` per process, by rank.
        slowest: Index into ``ranks`` of the slowest rank.
        median: Index of the median rank (compared with the slowest).
        diff: The slowest rank against the median rank (None for one rank).
    """

    label: str
    ranks: list[tuple[str, str, RunProfile]]
    slowest: int
    median: int
    diff: Diff | None

    def per_step(self, i: int, figure: str) -> Fraction:
        """Rank ``i``'s per-step ``figure`` (a key of :data:`FIGURES`), exact."""
        prof = self.ranks[i][2]
        return Fraction(getattr(prof.totals(), FIGURES[figure]), prof.n_steps)

    def imbalance(self, figure: str) -> float | None:
        """max / median over the ranks of ``figure`` (None when the median is 0)."""
        values = [self.per_step(i, figure) for i in range(len(self.ranks))]
        med = statistics.median(values)
        return round(float(max(values) / med), 3) if med else None

    def steps(self) -> list[int]:
        """The step numbers of any rank's steps, sorted."""
        return sorted({s for _, _, p in self.ranks for s in p.steps})


def compare_ranks(label: str, ranks: list[tuple[str, str, RunProfile]], warmup: int = 1) -> RankDiff:
    """Compare the ranks of a run.

    Args:
        label: The run, for the output.
        ranks: ``(rank name, trace id, profile)`` per process, in rank order; each profile
            with its sources (for the call-site comparison).
        warmup: As :func:`~._compare.compare`.

    Raises:
        ValueError: For no ranks.
    """
    if not ranks:
        raise ValueError("no ranks to compare")
    rd = RankDiff(label, ranks, 0, 0, None)
    times = [rd.per_step(i, "time_per_step_ns") for i in range(len(ranks))]
    rd.slowest = max(range(len(ranks)), key=lambda i: (times[i], -i))
    others = sorted((i for i in range(len(ranks)) if i != rd.slowest), key=lambda i: (times[i], i))
    rd.median = others[(len(others) - 1) // 2] if others else rd.slowest
    if others:
        rd.diff = compare(ranks[rd.median][2], ranks[rd.slowest][2], warmup=warmup)
    return rd


def _step_figures(prof: RunProfile, step: int) -> dict[str, int] | None:
    if step not in prof.steps:
        return None
    k = prof.per_step.get(step)
    return {"copies": k.copies if k else 0, "bytes": k.bytes if k else 0,
            "time_ns": k.time_ns if k else 0}  # fmt: skip


def ranks_json(rd: RankDiff) -> dict[str, Any]:
    """The comparison as one JSON-ready object (see ``docs/diff.md``)."""
    ranks = []
    for i, (name, tid, prof) in enumerate(rd.ranks):
        ranks.append({"rank": name, "trace_id": tid, "steps": prof.n_steps,
                      **{f: number(rd.per_step(i, f)) for f in FIGURES},
                      "per_step": [{"step": s, **(_step_figures(prof, s) or {})}
                                   for s in prof.steps]})  # fmt: skip
    return {
        "version": 1, "label": rd.label, "ranks": ranks,
        "slowest": {"rank": rd.ranks[rd.slowest][0],
                    "time_per_step_ns": number(rd.per_step(rd.slowest, "time_per_step_ns"))},
        "imbalance": {f: rd.imbalance(f) for f in FIGURES},
        "against": None if rd.diff is None else {
            "base_rank": rd.ranks[rd.median][0], "new_rank": rd.ranks[rd.slowest][0],
            "diff": to_json(rd.diff)},
    }  # fmt: skip


def _ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def format_ranks(rd: RankDiff) -> str:
    """The comparison as terminal text: one row per rank, the imbalance, the copy time of
    each step per rank, and the slowest rank's call sites against the median rank's."""
    n = len(rd.ranks)
    lines = [f"copytrace diff --ranks: {rd.label} ({n} rank(s))"]
    rows = [("rank", "steps", "copies/step", "bytes/step", "copy time/step", "")]
    for i, (name, _, prof) in enumerate(rd.ranks):
        rows.append((name, str(prof.n_steps), str(number(rd.per_step(i, "copies_per_step"))),
                     format_bytes(float(rd.per_step(i, "bytes_per_step"))),
                     format_ns(float(rd.per_step(i, "time_per_step_ns"))),
                     "<- slowest" if i == rd.slowest and n > 1 else ""))  # fmt: skip
    lines += _columns(rows)
    lines.append("imbalance (max/median over ranks): " + ", ".join(
        f"{w} {_ratio(rd.imbalance(f))}" for w, f in (("copies", "copies_per_step"),
        ("bytes", "bytes_per_step"), ("copy time", "time_per_step_ns"))))  # fmt: skip
    steps = rd.steps()
    if steps:
        lines.append("copy time per step:")
        table = [("step", *(f"rank {r[0]}" for r in rd.ranks), "max/median")]
        for s in steps:
            figs = [_step_figures(p, s) for _, _, p in rd.ranks]
            times = [f["time_ns"] for f in figs if f is not None]
            med = statistics.median(times) if times else 0
            table.append((str(s), *("-" if f is None else format_ns(f["time_ns"]) for f in figs),
                          _ratio(round(max(times) / med, 3) if med else None)))  # fmt: skip
        lines += ["  " + line for line in _columns(table)]
    if rd.diff is not None:
        lines.append(f"slowest rank {rd.ranks[rd.slowest][0]} against rank "
                     f"{rd.ranks[rd.median][0]} (the median):")  # fmt: skip
        lines += ["  " + line for line in format_terminal(rd.diff).splitlines()[1:]]
    return "\n".join(lines) + "\n"


def _columns(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
