"""Grouping integer codes without sorting: what ``np.unique`` gives, in O(n + range) time when
the values span a range no wider than a few times their number (row positions, dictionary
codes, step numbers, storage ids as the tracer numbers them), else by ``np.unique``.

On 1M codes ``np.unique(..., return_inverse=True)`` sorts (about 60-100 ms each); a rule
groups several columns, so these add up to seconds on a trace whose every event is a
candidate. Here a table of the range marks each value present, and its running count is
each value's rank.
"""

from __future__ import annotations

import numpy as np

__all__ = ["dense", "distinct", "first_rows"]

#: The fast path's largest range, as a multiple of the number of values (plus a floor).
_SPAN = 4
_FLOOR = 1 << 16


def _bounded(values: np.ndarray) -> tuple[int, int] | None:
    """``(min, max)`` of ``values`` when their range is small enough for a table, else None."""
    lo, hi = int(values.min()), int(values.max())
    return (lo, hi) if hi - lo <= max(_SPAN * len(values), _FLOOR) else None


def dense(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_inverse=True)`` of an integer array: the distinct values
    (ascending, int64) and each value's index among them (int64, aligned with ``values``)."""
    values = np.asarray(values, dtype=np.int64)
    if not len(values):
        return values[:0], np.zeros(0, dtype=np.int64)
    bounds = _bounded(values)
    if bounds is None:
        uniq, inverse = np.unique(values, return_inverse=True)
        return uniq, inverse.ravel().astype(np.int64, copy=False)
    lo, hi = bounds
    shifted = values - lo
    present = np.zeros(hi - lo + 1, dtype=bool)
    present[shifted] = True
    rank = np.cumsum(present, dtype=np.int64) - 1
    return np.flatnonzero(present) + lo, rank[shifted]


def distinct(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)`` of an integer array (int64, ascending)."""
    values = np.asarray(values, dtype=np.int64)
    if not len(values):
        return values[:0]
    bounds = _bounded(values)
    if bounds is None:
        return np.unique(values)
    lo, hi = bounds
    present = np.zeros(hi - lo + 1, dtype=bool)
    present[values - lo] = True
    return np.flatnonzero(present) + lo


def first_rows(codes: np.ndarray, k: int | None = None) -> np.ndarray:
    """The position of the first occurrence of each code ``0 .. k-1`` in ``codes`` (every code
    present; ``k``: the largest code + 1 by default): ``np.unique(codes,
    return_index=True)[1]`` for dense codes."""
    if k is None:
        k = int(codes.max()) + 1 if len(codes) else 0
    first = np.full(k, len(codes), dtype=np.int64)
    np.minimum.at(first, codes, np.arange(len(codes), dtype=np.int64))
    return first
