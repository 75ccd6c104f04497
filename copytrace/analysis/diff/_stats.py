"""Copy time compared honestly: a rank test over the steady-state steps.

Bytes and counts are exact; copy time is noisy (allocator, caches, other processes). The
time of a call site in one step is one sample; the samples of BASE and NEW are compared with
the two-sided Mann-Whitney U test (``scipy.stats.mannwhitneyu``), and the shift is estimated
by Hodges-Lehmann: the median of every NEW - BASE difference, with the distribution-free
confidence interval from the order statistics of those differences (Hollander & Wolfe,
*Nonparametric Statistical Methods*, 3rd ed., section 4.3; normal approximation for the
rank). A time is called changed only when p < :data:`ALPHA`; with few steps no change can
be shown (at 3 + 3 steps the smallest two-sided p is 0.1), and the output says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ALPHA", "TimeTest", "compare_times", "steady_samples"]

#: Significance level of the time test (two-sided).
ALPHA = 0.05


@dataclass(frozen=True)
class TimeTest:
    """The comparison of one key's copy time per step.

    Attributes:
        significant: The test says the time changed (p < :data:`ALPHA`).
        p_value: Two-sided Mann-Whitney U p-value (None: too few steps to test).
        shift_ns: Hodges-Lehmann estimate of NEW - BASE per step, ns.
        low_ns, high_ns: Its 95% confidence interval, ns (None when it cannot be formed).
        n_base, n_new: Steady-state steps compared.
    """

    significant: bool
    p_value: float | None
    shift_ns: float
    low_ns: float | None
    high_ns: float | None
    n_base: int
    n_new: int

    def as_dict(self) -> dict[str, object]:
        """JSON-ready fields."""
        return {
            "significant": self.significant,
            "p_value": None if self.p_value is None else round(self.p_value, 6),
            "shift_ns": round(self.shift_ns, 1),
            "interval_ns": None if self.low_ns is None else [round(self.low_ns, 1),
                                                             round(self.high_ns or 0, 1)],
            "steps": [self.n_base, self.n_new],
        }  # fmt: skip


def steady_samples(step_time: dict[int, int], steps: list[int], warmup: int) -> list[int]:
    """One sample per steady-state step: the key's copy time in it (0 when it copied
    nothing there), for ``steps`` after the first ``warmup`` of them."""
    return [step_time.get(s, 0) for s in steps[warmup:]]


def _hodges_lehmann(x: list[int], y: list[int]) -> tuple[float, float | None, float | None]:
    import numpy as np

    d = np.sort(np.subtract.outer(np.asarray(y, dtype=np.float64),
                                  np.asarray(x, dtype=np.float64)).ravel())  # fmt: skip
    shift = float(np.median(d))
    n, m = len(x), len(y)
    z = 1.959963984540054  # the 97.5% point of the standard normal
    k = math.floor(n * m / 2 - z * math.sqrt(n * m * (n + m + 1) / 12))
    if k < 1:
        return shift, None, None
    return shift, float(d[k - 1]), float(d[n * m - k])


def compare_times(base: list[int], new: list[int]) -> TimeTest:
    """Test whether the per-step samples ``new`` differ from ``base``.

    Args:
        base, new: Copy time per steady-state step, ns.

    Returns:
        The test; ``p_value`` None when there are too few samples for any result to be
        significant (fewer than 2 a side, or 2 / C(n + m, n) >= :data:`ALPHA`: 4 + 4 steps
        are the fewest that can show a change) or all the samples are equal.
    """
    if len(base) < 2 or len(new) < 2:
        shift = (sum(new) / len(new) if new else 0.0) - (sum(base) / len(base) if base else 0.0)
        return TimeTest(False, None, shift, None, None, len(base), len(new))
    shift, lo, hi = _hodges_lehmann(base, new)
    if len(set(base) | set(new)) == 1:
        return TimeTest(False, None, shift, lo, hi, len(base), len(new))
    from scipy.stats import mannwhitneyu

    if 2 / math.comb(len(base) + len(new), len(base)) >= ALPHA:
        # even fully separated samples would not be significant: too few steps to tell
        return TimeTest(False, None, shift, lo, hi, len(base), len(new))
    p = float(mannwhitneyu(new, base, alternative="two-sided").pvalue)
    return TimeTest(p < ALPHA, p, shift, lo, hi, len(base), len(new))
