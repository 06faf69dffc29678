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


Z95 = 1.959964  # the normal quantile of a two-sided 95% interval


def median_standard_error(values: Sequence[float]) -> float | None:
    """The standard error of a sample's median, distribution-free: the median's 95% interval runs between
    the order statistics of ranks (n - 1.96 sqrt(n)) / 2 and 1 + (n + 1.96 sqrt(n)) / 2 (the binomial count of
    values below the true median, which holds for any distribution), and its width over 2 x 1.96 is the
    error. A bimodal sample, whose median could as well have landed in the other mode, gets the distance
    between the modes; a tight one a fraction of its spread. None below 3 values (no interval)."""
    n = len(values)
    if n < 3:
        return None
    ordered = sorted(values)
    low = max(1, math.floor((n - Z95 * math.sqrt(n)) / 2))
    high = min(n, math.ceil(1 + (n + Z95 * math.sqrt(n)) / 2))
    return (ordered[high - 1] - ordered[low - 1]) / (2 * Z95)
