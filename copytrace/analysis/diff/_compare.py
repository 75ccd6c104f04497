"""The comparison of two :class:`~._profile.RunProfile`: added, removed and changed call
sites, modules and ops, hazards by code and site, and the run totals.

Per-step values are exact fractions (a run's total over its steps, :mod:`._profile`); they
are written as integers when whole, else rounded to 3 decimals, and each delta is computed
exactly before rounding. Copy time is compared per steady-state step (:mod:`._stats`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from copytrace.analysis.diff._match import match_sites
from copytrace.analysis.diff._profile import KeyStats, RunProfile, SiteKey
from copytrace.analysis.diff._source import defined_functions, parse_site
from copytrace.analysis.diff._stats import TimeTest, compare_times, steady_samples

__all__ = ["Diff", "Item", "compare", "number"]

#: Exact metrics compared per step (item field -> :class:`KeyStats` attribute).
EXACT = {
    "copies_per_step": "copies", "bytes_per_step": "bytes", "aliases_per_step": "aliases",
    "noops_per_step": "noops", "bytes_logical_per_step": "bytes_logical",
}  # fmt: skip


def number(x: Fraction | int) -> int | float:
    """An exact per-step value for output: an int when whole, else rounded to 3 decimals."""
    x = Fraction(x)
    return int(x) if x.denominator == 1 else round(float(x), 3)


def triple(base: Fraction | int, new: Fraction | int) -> dict[str, int | float]:
    """``{"base": x, "new": y, "delta": y - x}`` (the delta computed exactly)."""
    return {"base": number(base), "new": number(new), "delta": number(Fraction(new) - base)}


@dataclass
class Item:
    """One call site (or module, or op) of the comparison.

    Attributes:
        status: ``added``, ``removed``, ``changed`` (an exact count or byte figure differs),
            ``time`` (only its copy time changed, by the rank test) or ``same``.
        base_key, new_key: Its key in each run (None where absent).
        base, new: Its totals in each run (zeros where absent).
        code: Its source line ('' if unknown).
        time: The copy-time test.
    """

    status: str
    base_key: Any
    new_key: Any
    base: KeyStats
    new: KeyStats
    code: str = ""
    time: TimeTest | None = None
    per_step: dict[str, tuple[Fraction, Fraction]] = field(default_factory=dict)

    @property
    def key(self) -> Any:
        """NEW's key for added and changed items, BASE's for removed ones."""
        return self.new_key if self.new_key is not None else self.base_key

    def delta(self, name: str) -> Fraction:
        """NEW - BASE of per-step field ``name`` (e.g. ``bytes_per_step``), exact."""
        b, n = self.per_step[name]
        return n - b


@dataclass
class Diff:
    """BASE against NEW.

    Attributes:
        base, new: The two runs.
        sites, modules, ops: One item per key, changed first, largest byte delta first.
        hazards_added, hazards_removed: ``(code, severity, site, bytes, message)`` (site in
            NEW's terms for added, BASE's for removed).
        warmup: Steps left out of the time test.
    """

    base: RunProfile
    new: RunProfile
    sites: list[Item]
    modules: list[Item]
    ops: list[Item]
    hazards_added: list[tuple[str, str, str, int, str]]
    hazards_removed: list[tuple[str, str, str, int, str]]
    warmup: int = 1

    def of(self, status: str) -> list[Item]:
        """The call-site items with ``status``."""
        return [i for i in self.sites if i.status == status]

    def totals(self) -> dict[str, tuple[Fraction, Fraction]]:
        """Per-step run totals: field -> (base, new)."""
        b, n = self.base.totals(), self.new.totals()
        out = {f: (Fraction(getattr(b, a), self.base.n_steps),
                   Fraction(getattr(n, a), self.new.n_steps)) for f, a in EXACT.items()}  # fmt: skip
        out["time_per_step_ns"] = (Fraction(b.time_ns, self.base.n_steps),
                                   Fraction(n.time_ns, self.new.n_steps))  # fmt: skip
        return out


def _item(
    base_key: Any, new_key: Any, diff_b: RunProfile, diff_n: RunProfile, table: str, warmup: int
) -> Item:
    b = getattr(diff_b, table).get(base_key, KeyStats()) if base_key is not None else KeyStats()
    n = getattr(diff_n, table).get(new_key, KeyStats()) if new_key is not None else KeyStats()
    item = Item("same", base_key, new_key, b, n)
    nb, nn = diff_b.n_steps, diff_n.n_steps
    for f, attr in EXACT.items():
        item.per_step[f] = (Fraction(getattr(b, attr), nb), Fraction(getattr(n, attr), nn))
    item.per_step["time_per_step_ns"] = (Fraction(b.time_ns, nb), Fraction(n.time_ns, nn))
    for d in sorted(set(b.transfers) | set(n.transfers)):
        item.per_step[f"transfers.{d}"] = (Fraction(b.transfers.get(d, 0), nb),
                                           Fraction(n.transfers.get(d, 0), nn))  # fmt: skip
    item.time = compare_times(steady_samples(b.step_time_ns, diff_b.steps, warmup),
                              steady_samples(n.step_time_ns, diff_n.steps, warmup))  # fmt: skip
    if base_key is None:
        item.status = "added"
    elif new_key is None:
        item.status = "removed"
    elif any(n_ != b_ for k, (b_, n_) in item.per_step.items() if k != "time_per_step_ns"):
        item.status = "changed"
    elif item.time.significant:
        item.status = "time"
    return item


def _order(items: list[Item]) -> list[Item]:
    rank = {"added": 0, "changed": 0, "removed": 0, "time": 1, "same": 2}
    return sorted(items, key=lambda i: (
        rank[i.status], -abs(i.delta("bytes_per_step")), -abs(i.delta("copies_per_step")),
        -abs(i.delta("time_per_step_ns")), str(i.key)))  # fmt: skip


def _keyed(base: RunProfile, new: RunProfile, table: str, warmup: int) -> list[Item]:
    """Items of a table matched by equal keys (modules, ops)."""
    b, n = getattr(base, table), getattr(new, table)
    keys = sorted(set(b) | set(n))
    return _order([_item(k if k in b else None, k if k in n else None, base, new, table, warmup)
                   for k in keys])  # fmt: skip


def _hazard_changes(
    base: RunProfile, new: RunProfile, pairs: dict[SiteKey, SiteKey]
) -> tuple[list[Any], list[Any]]:
    def key(h: Any, mapping: dict[SiteKey, SiteKey] | None) -> tuple[str, Any]:
        site = parse_site(h[2]) if h[2] else None
        if mapping is not None and site is not None:
            site = mapping.get(site, ("<removed>",) + site)
        return (h[0], site)

    bkeys = {key(h, pairs) for h in base.hazards}
    nkeys = {key(h, None) for h in new.hazards}
    added = [h for h in new.hazards if key(h, None) not in bkeys]
    removed = [h for h in base.hazards if key(h, pairs) not in nkeys]
    return _unique(added), _unique(removed)


def _unique(hazards: list[Any]) -> list[Any]:
    seen, out = set(), []
    for h in hazards:
        if (h[0], h[2]) not in seen:
            seen.add((h[0], h[2]))
            out.append(h)
    return out


def compare(base: RunProfile, new: RunProfile, warmup: int = 1) -> Diff:
    """Compare two runs.

    Args:
        base, new: The runs, with their sources and hazards filled in.
        warmup: Steps at the start of each run left out of the copy-time test.

    Returns:
        The :class:`Diff`.
    """
    defs = defined_functions([k[0] for k in new.sites], new.start_ns)
    pairs = match_sites(base.sites, new.sites, base.sources, new.sources, defs)
    matched_new = set(pairs.values())
    items = [_item(b, pairs.get(b), base, new, "sites", warmup) for b in base.sites]
    items += [_item(None, n, base, new, "sites", warmup) for n in new.sites
              if n not in matched_new]  # fmt: skip
    for i in items:
        i.code = (new.sources.get(i.new_key, "") if i.new_key is not None
                  else base.sources.get(i.base_key, ""))  # fmt: skip
    added, removed = _hazard_changes(base, new, pairs)
    return Diff(base, new, _order(items), _keyed(base, new, "modules", warmup),
                _keyed(base, new, "ops", warmup), added, removed, warmup)  # fmt: skip
