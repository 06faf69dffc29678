"""Pure statistics on plain numbers. Undefined -> None, never 0."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return None
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def mean_ci95(values: Sequence[float]) -> tuple[float, float] | None:
    """Student-t 95% confidence interval of the mean; None with fewer than two values."""
    if len(values) < 2:
        return None
    from scipy import stats as sps

    m = statistics.fmean(values)
    half = float(sps.t.ppf(0.975, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))
    return m - half, m + half
