"""The baseline gate: may NEW cost more than BASE?

``--max-increase`` takes a share (``10%``: per-step copies and bytes may grow by at most a
tenth of BASE's) or a size (``64KiB``: per-step bytes may grow by at most that many bytes;
copies are then not limited by count). A hazard code that NEW shows and BASE did not always
fails. The run totals per step decide; each call site whose copies or bytes per step grew is
then named on a line of its own, largest growth first.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from copytrace.analysis._budget import parse_bytes
from copytrace.analysis.diff._compare import Diff, number
from copytrace.analysis.diff._source import parse_site

__all__ = ["Increase", "gate", "parse_increase"]


@dataclass(frozen=True)
class Increase:
    """An allowed growth: ``share`` (a fraction of BASE) or ``size`` (bytes), one set."""

    share: Fraction | None = None
    size: int | None = None

    def __str__(self) -> str:
        if self.share is not None:
            return f"{number(self.share * 100)}%"
        return f"{self.size} B"


def parse_increase(text: str) -> Increase:
    """``"10%"`` -> a share of 1/10; ``"64KiB"``, ``"4096"`` -> a size in bytes.

    Raises:
        ValueError: For anything else, or a negative value.
    """
    t = str(text).strip()
    if t.endswith("%"):
        try:
            share = Fraction(t[:-1].strip())
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"not a percentage: {text!r} (e.g. 10%)") from None
        if share < 0:
            raise ValueError(
                f"must be >= 0, got {text!r} (a share such as 10% or a size such as 64KiB)"
            )
        return Increase(share=share / 100)
    try:
        return Increase(size=parse_bytes(t))
    except ValueError:
        raise ValueError(f"not a percentage or a size: {text!r} (e.g. 10%, 64KiB)") from None


def _over(base: Fraction, new: Fraction, limit: Increase, is_bytes: bool) -> bool:
    if limit.share is not None:
        return new > base * (1 + limit.share)
    return is_bytes and new - base > (limit.size or 0)


def _site(key: tuple[str, int, str]) -> str:
    file, line, func = key
    return f"{file}:{line}" + (f" {func}" if func else "") if file else "(unknown call site)"


def gate(d: Diff, limit: Increase) -> list[str]:
    """One line per reason NEW fails against BASE; empty when it passes.

    Lines: the per-step total that grew beyond ``limit`` (copies, bytes), then one per call
    site that grew (``file:line function: +N copies, +B bytes per step``), then one per new
    hazard code with its first call site.
    """
    lines: list[str] = []
    totals = d.totals()
    for field, what, is_bytes in (("copies_per_step", "copies", False),
                                  ("bytes_per_step", "bytes", True)):  # fmt: skip
        b, n = totals[field]
        if _over(b, n, limit, is_bytes):
            unit = " B" if is_bytes else ""
            lines.append(f"{what} per step grew from {number(b)}{unit} to {number(n)}{unit} "
                         f"(+{number(n - b)}{unit}), over --max-increase {limit}")  # fmt: skip
    if lines:
        grown = [i for i in d.sites if i.delta("copies_per_step") > 0
                 or i.delta("bytes_per_step") > 0]  # fmt: skip
        grown.sort(key=lambda i: (-i.delta("bytes_per_step"), -i.delta("copies_per_step")))
        for i in grown:
            lines.append(f"{_site(i.key)}: {i.status}, {number(i.delta('copies_per_step')):+} "
                         f"copies, {number(i.delta('bytes_per_step')):+} B per step"
                         + (f": {i.code}" if i.code else ""))  # fmt: skip
    base_codes = {h[0] for h in d.base.hazards}
    seen: set[str] = set()
    for code, sev, site, _n, msg in d.hazards_added:
        if code in base_codes or code in seen:
            continue
        seen.add(code)
        where = _site(parse_site(site)) if site else "(no call site)"
        lines.append(f"{where}: new hazard {code} ({sev}): {msg}")
    return lines
