"""Grouping without sorting (``copytrace.analysis._dense``) gives what ``np.unique`` gives, and
the timeline's water-filling at once gives what the turn-by-turn loop gave."""

from __future__ import annotations

import random

import numpy as np
import pytest

from copytrace.analysis._dense import dense, distinct, first_rows
from copytrace.dashboards.sections.timeline import water_fill

_MIN = np.iinfo(np.int64).min


@pytest.mark.parametrize("seed", range(6))
def test_dense_is_np_unique(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 3000))
    # a narrow range (the table), a wide one (np.unique), and absent values as INT64_MIN
    values = [rng.integers(-5, 50, n), rng.integers(-(2**62), 2**62, n),
              np.where(rng.random(n) < 0.2, _MIN, rng.integers(0, 9, n))][seed % 3]  # fmt: skip
    uniq, inverse = np.unique(values, return_inverse=True)
    got_uniq, got_inverse = dense(values)
    assert got_uniq.tolist() == uniq.tolist()
    assert got_inverse.tolist() == inverse.ravel().tolist()
    assert distinct(values).tolist() == uniq.tolist()
    assert first_rows(got_inverse).tolist() == np.unique(values, return_index=True)[1].tolist()


def test_empty() -> None:
    empty = np.zeros(0, dtype=np.int64)
    assert dense(empty)[0].tolist() == [] and dense(empty)[1].tolist() == []
    assert distinct(empty).tolist() == [] and first_rows(empty).tolist() == []


def _turns(counts: list[int], budget: int) -> list[int]:
    """The loop it replaces: each group in turn takes an even share of what is left."""
    out, left = [], len(counts)
    for n in counts:
        take = min(n, budget // left)
        out.append(take)
        budget -= take
        left -= 1
    return out


def test_water_fill_is_the_turn_by_turn_loop() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        counts = sorted(rng.randint(1, 60) for _ in range(rng.randint(0, 50)))
        budget = rng.randint(0, 1500)
        assert water_fill(np.array(counts, dtype=np.int64), budget).tolist() == \
            _turns(counts, budget)  # fmt: skip
