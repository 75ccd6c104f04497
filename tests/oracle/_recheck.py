"""Second looks at a value difference: is it copytrace's, or torch's own?

A value (an output, a gradient, a state) that differs traced from untraced is copytrace's
difference unless torch's kernel computes it from something other than its inputs. Two such
sources are told apart here, in this order:

1. **Uninitialised memory** (:func:`uninitialised`). A kernel that reads memory it allocated
   with ``at::empty`` and never wrote computes from whatever the allocator hands back, and
   copytrace's own allocations change that. Example: on torch 2.13 ``linalg.lstsq(driver=
   "gelsy")`` on the CPU allocates LAPACK's ``jpvt`` with ``at::empty`` and does not zero it
   (pytorch/pytorch#187411, fixed by #187436); non-zero entries mark columns that ``?gelsy``
   must not pivot, so its solutions differ in their last bits from call to call. The group is
   run again, untraced twice and traced once, with torch's
   ``torch.utils.deterministic.fill_uninitialized_memory`` in force (under
   ``torch.use_deterministic_algorithms(True, warn_only=True)``: ``at::empty`` then fills
   floats with NaN and integers with their largest value). A difference on which all three of
   those runs agree is torch's reading of uninitialised memory: counted apart, not as
   copytrace's. One that persists with the memory filled stays a difference.
2. **Other run-to-run nondeterminism** (:func:`confirm`): :data:`RECHECK` more untraced runs;
   a key on which they disagree with the first is unstable.

See docs/oracle.md ("Known torch nondeterminism").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._harness import UNTRACED, Case, Config, Difference, Observation, observe

__all__ = ["RECHECK", "VALUE_KINDS", "FilledMemory", "uninitialised", "confirm"]

#: untraced runs more, made only for a group with a value difference left unexplained
RECHECK = 3
#: the kinds of difference that are about values
VALUE_KINDS = ("output", "grad", "state")
_ABSENT = "<absent>"


class FilledMemory:
    """``torch.use_deterministic_algorithms(True, warn_only=True)`` with
    ``torch.utils.deterministic.fill_uninitialized_memory = True``, restored after: every
    ``at::empty`` (a kernel's own workspaces too) returns NaN-filled floats and integers at
    their largest value (torch docs, ``torch.use_deterministic_algorithms``)."""

    def __enter__(self) -> None:
        det = torch.utils.deterministic
        self.saved = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            det.fill_uninitialized_memory,  # type: ignore[attr-defined]
        )
        torch.use_deterministic_algorithms(True, warn_only=True)
        det.fill_uninitialized_memory = True  # type: ignore[attr-defined]

    def __exit__(self, *exc: Any) -> None:
        enabled, warn_only, fill = self.saved
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill  # type: ignore[attr-defined]


def _values(diffs: list[Difference], base: Observation) -> list[Difference]:
    return [d for d in diffs if d.kind in VALUE_KINDS and d.case in base.records]


def uninitialised(
    diffs: list[Difference], base: Observation, config: Config, build: Callable[[], list[Case]],
    group: str, filled: list[Observation],
) -> tuple[list[Difference], list[Difference]]:
    """Split ``diffs`` into (kept, torch's reads of uninitialised memory): a value difference
    is torch's when, with memory filled (:class:`FilledMemory`), two untraced runs (made once
    per group, kept in ``filled``) and a run under ``config`` all see the key, and see it
    equal."""
    values = _values(diffs, base)
    if not values:
        return diffs, []
    with FilledMemory():
        if not filled:
            filled.extend(observe(UNTRACED, build, group) for _ in range(2))
        traced = observe(config, build, group)
    kept, explained = [], []
    for d in diffs:
        if d in values:
            seen = [o.records.get(d.case, {}).get(d.key, _ABSENT) for o in (*filled, traced)]
            if seen[0] != _ABSENT and seen.count(seen[0]) == len(seen):
                explained.append(d)
                continue
        kept.append(d)
    return kept, explained


def confirm(
    diffs: list[Difference], base: Observation, extra: list[Observation], build: Callable[[], list[Case]],
    group: str,
) -> tuple[list[Difference], int]:
    """Keep the value differences on which :data:`RECHECK` more untraced runs (made once per
    group, in ``extra``) agree with the first: a kernel whose bits change from run to run now
    and then may agree with itself in the first two untraced runs. Returns the differences
    kept and how many were unstable."""
    kept, flaky = [], 0
    values = _values(diffs, base)
    for d in diffs:
        if d in values:
            if not extra:
                extra.extend(observe(UNTRACED, build, group) for _ in range(RECHECK))
            first = base.records[d.case].get(d.key, _ABSENT)
            if any(o.records.get(d.case, {}).get(d.key, _ABSENT) != first for o in extra):
                flaky += 1
                continue
        kept.append(d)
    return kept, flaky
