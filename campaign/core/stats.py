"""Pure statistics on plain numbers. Undefined -> None, never 0."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

# scipy.special's quantile rather than scipy.stats', imported where it is used: core is imported by every
# process the tool starts (each command, each simulated server, each pool or Ray worker), and scipy.stats
# alone would add over half a second to each start, scipy.special 0.15-0.18 s (measured here, 2026-12-07: a
# simulated server's imports took 0.55 s with it).


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


def streaming_rate(chunks: Sequence[tuple[float, int]], start: float, end: float) -> float | None:
    """One request's tokens per second while it streamed inside [start, end], from its (time, tokens) chunks in
    order. A request already streaming when the window opened is timed from `start`, and one still streaming
    when it closed until `end`; otherwise from its first chunk inside (whose tokens were made before it, so
    they are not counted) or to its last. Timing a request that streams across an edge by its own first or
    last chunk there instead made every such request's rate move with how late those few chunks came: a host
    stall just after the window opened delayed every stream's first chunk inside alike, and on the simulated
    H200's 64-stream cell at 20x (a 1 s window) under two CPU hogs, 3 cells in 36 read stream tok/s 1-4%
    off the simulator's truth while their total rates stayed within 0.5% (one session's check, not stored);
    timed this way, an edge's stall moves a request's rate no more than the window's total, which
    tests/test_truth.py shows on a stall replayed by hand. None with nothing inside or no time between its
    ends."""
    inside = [(t, n) for t, n in chunks if start <= t <= end]
    if not inside:
        return None
    across_start = any(t < start for t, _ in chunks)
    across_end = any(t > end for t, _ in chunks)
    begin = start if across_start else inside[0][0]
    finish = end if across_end else inside[-1][0]
    tokens = sum(n for _, n in inside) - (0 if across_start else inside[0][1])
    return tokens / (finish - begin) if finish > begin else None


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


def detectable_change(n: int, cv: float, *, tests: int, alpha: float = 0.05, power: float = 0.8) -> float | None:
    """The smallest relative change that n measurements a side detect with the given power, where one
    measurement's relative spread (its coefficient of variation) is cv and the change is one of `tests` judged
    together at family-wise `alpha` (Bonferroni: alpha / tests each, two-sided): (t at 1 - alpha/(2 tests) +
    t at power, each with 2n - 2 degrees of freedom, Welch's with equal spreads) x cv x sqrt(2/n). A fraction
    of the baseline (0.05: 5%). None below two measurements a side (no spread, no interval) or without a test.
    alpha's default is measure/judged.py's FAMILY_ALPHA (core imports nothing above itself)."""
    if n < 2 or tests < 1:
        return None
    if cv < 0:
        raise ValueError(f"a coefficient of variation is never negative (got {cv})")
    from scipy.special import stdtrit

    df = 2 * n - 2
    quantiles = float(stdtrit(df, 1 - alpha / (2 * tests))) + float(stdtrit(df, power))
    return quantiles * cv * math.sqrt(2 / n)


def mann_kendall(values: Sequence[float]) -> tuple[float, float] | None:
    """Mann-Kendall's trend test of a series in time order: (tau, two-sided p). tau is S over the n(n-1)/2
    pairs (+1 a later value above an earlier, -1 below); p is S's normal approximation with ties' variance
    correction, without continuity correction: the same as scipy.stats.kendalltau(range(n), values,
    method="asymptotic") on a series without ties (tested), here without scipy.stats' import time. None below
    three values, or for a constant series."""
    n = len(values)
    if n < 3:
        return None
    s = sum((values[j] > values[i]) - (values[j] < values[i]) for i in range(n) for j in range(i + 1, n))
    ties = [values.count(v) for v in set(values)]
    var = (n * (n - 1) * (2 * n + 5) - sum(t * (t - 1) * (2 * t + 5) for t in ties)) / 18
    if var <= 0:
        return None
    return s / (n * (n - 1) / 2), math.erfc(abs(s) / math.sqrt(var) / math.sqrt(2))


def sen_slope(values: Sequence[float], at: Sequence[float] | None = None) -> float | None:
    """Sen's slope: the median of the slopes between every pair of a series' points, robust to a few
    outliers as a least-squares line is not; `at`: the points' positions (default 0, 1, 2, ...; a series with
    gaps keeps its points where they were). None below two values."""
    n = len(values)
    x = list(range(n)) if at is None else list(at)
    slopes = [(values[j] - values[i]) / (x[j] - x[i]) for i in range(n) for j in range(i + 1, n) if x[j] != x[i]]
    return median(slopes)


def cv(values: Sequence[float]) -> float | None:
    """Coefficient of variation (sample standard deviation over the mean); None below two values or a mean of 0."""
    if len(values) < 2:
        return None
    centre = statistics.fmean(values)
    return statistics.stdev(values) / abs(centre) if centre else None
