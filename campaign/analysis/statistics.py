"""The statistics of one metric, baseline against variant: Welch's test and 95% interval over the repeats
of each side (with each measurement's own error as a floor on its side's spread), Holm's step-down adjustment
over a family of tests, the verdict one metric gets (better, worse, inside noise, not judged, no data) and how
many repeats a side would resolve a change of MIN_EFFECT. Pure: numbers in, numbers and sentences out; it reads
no files and knows nothing of stored runs.
"""

from __future__ import annotations

import math
import statistics
import warnings
from dataclasses import dataclass
from typing import Literal

from campaign.core import stats
from campaign.measure.judged import MIN_EFFECT

Verdict = Literal["better", "worse", "inside noise", "not judged", "not comparable", "no data"]

MAX_ADVISED_REPEATS = 100  # beyond this the advice is to find the noise, not to repeat


def _spread(values: list[float], floor: float) -> float:
    """A side's variance of one measurement: what its repeats show, and never less than `floor`, the variance
    each measurement carries on its own (a median's error from its requests): two repeats that land close by
    chance say nothing about how far a third would land."""
    return max(statistics.variance(values), floor)


def welch_p(base: list[float], other: list[float], floors: tuple[float, float] = (0.0, 0.0)) -> float | None:
    """Two-sided p-value of Welch's t-test for equal means; None with fewer than two values a side. `floors`:
    the least variance of one measurement on each side (see `_spread`)."""
    if len(base) < 2 or len(other) < 2:
        return None
    from scipy import stats as sps

    diff = statistics.fmean(other) - statistics.fmean(base)
    vb, vo = _spread(base, floors[0]), _spread(other, floors[1])
    if vb == 0 and vo == 0:
        return 1.0 if diff == 0 else 0.0
    with warnings.catch_warnings():
        # Nearly identical values (a capacity search landing on the same rate every repeat) make scipy warn of
        # precision loss on the console; the p-value it returns is still the test's, and NaN is handled below.
        warnings.simplefilter("ignore", RuntimeWarning)
        p = float(sps.ttest_ind_from_stats(statistics.fmean(other), math.sqrt(vo), len(other),
                                           statistics.fmean(base), math.sqrt(vb), len(base),
                                           equal_var=False).pvalue)
    return (1.0 if diff == 0 else 0.0) if math.isnan(p) else p


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order: reject where adjusted < alpha, and the chance of
    any false rejection in the family stays below alpha under any dependence between the tests (a variant's
    metrics are correlated: total and per-request tok/s move together), which Bonferroni also gives, less
    powerfully."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


def welch_ci95(base: list[float], other: list[float],
               floors: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float] | None:
    """95% interval of mean(other) - mean(base) (Welch); None with fewer than two values a side. `floors`:
    the least variance of one measurement on each side (see `_spread`)."""
    if len(base) < 2 or len(other) < 2:
        return None
    from scipy import stats as sps

    vb, vo = _spread(base, floors[0]) / len(base), _spread(other, floors[1]) / len(other)
    diff = statistics.fmean(other) - statistics.fmean(base)
    se = math.sqrt(vb + vo)
    if se == 0:
        return diff, diff
    df = (vb + vo) ** 2 / ((vb**2) / (len(base) - 1) + (vo**2) / (len(other) - 1))
    half = float(sps.t.ppf(0.975, df)) * se
    return diff - half, diff + half


@dataclass(frozen=True)
class MetricVerdict:
    metric: str
    baseline: float | None
    variant: float | None
    change_pct: float | None
    ci95_pct: tuple[float, float] | None
    n_baseline: int
    n_variant: int
    verdict: Verdict
    note: str = ""
    # Inside noise: how many measurements a side would resolve a MIN_EFFECT change at the observed noise.
    repeats_needed: int | None = None
    # Welch's p-value, and Holm's adjustment over every test of the variant (None: not tested).
    p_value: float | None = None
    p_holm: float | None = None

    @property
    def beyond_noise_alone(self) -> bool:
        """Would this test alone (95% interval, minimum effect) call a change? The A/A false-positive count."""
        return (self.ci95_pct is not None and self.change_pct is not None and abs(self.change_pct) >= 100 * MIN_EFFECT
                and not self.ci95_pct[0] <= 0 <= self.ci95_pct[1])


def repeats_to_resolve(base: list[float], other: list[float], *, effect: float = MIN_EFFECT,
                       floors: tuple[float, float] = (0.0, 0.0)) -> int | None:
    """Measurements a side for a change of `effect` (a fraction of the baseline mean) to come out of the noise
    with 80% power at the 95% level, from the pooled spread of what was measured (normal approximation:
    n = 2 (z_0.975 + z_0.8)^2 s^2 / d^2). With one measurement on a side, the other side's spread stands for
    both; None where neither side has two (no spread yet)."""
    sides = [(values, floor) for values, floor in zip((base, other), floors, strict=True) if len(values) >= 2]
    if not sides or not base:
        return None
    mean = statistics.fmean(base)
    pooled = sum((len(v) - 1) * _spread(v, f) for v, f in sides) / sum(len(v) - 1 for v, _ in sides)
    d = abs(effect * mean)
    if d == 0:
        return None
    if pooled == 0:
        return 2
    return max(2, math.ceil(2 * (stats.Z95 + 0.841621) ** 2 * pooled / d**2))


def verdict_for(base: list[float], other: list[float], direction: int, metric: str = "",
                floors: tuple[float, float] = (0.0, 0.0)) -> MetricVerdict:
    """Baseline vs variant samples of one metric -> change, 95% interval and a verdict. `floors`: the least
    variance of one measurement on each side (its own error, where the metric has one; see `_spread`)."""
    if not base or not other:
        return MetricVerdict(metric, statistics.fmean(base) if base else None,
                             statistics.fmean(other) if other else None, None, None, len(base), len(other),
                             "no data")
    mb, mo = statistics.fmean(base), statistics.fmean(other)
    if mb == 0:
        return MetricVerdict(metric, mb, mo, None, None, len(base), len(other), "no data", "baseline is zero")
    change = (mo - mb) / mb
    ci = welch_ci95(base, other, floors)
    ci_pct = None if ci is None else (100 * ci[0] / mb, 100 * ci[1] / mb)
    if ci is None:
        # One measurement is not evidence: a fixed noise floor is not an interval (issue 20).
        needed = repeats_to_resolve(base, other, floors=floors)
        note = "one measurement: not judged; " + (
            repeats_advice(needed, 1) + " (from the other side's spread)" if needed is not None else
            "at least 2 repeats a side are needed to know the noise (campaign run --resume RUN --repeats 2)")
        return MetricVerdict(metric, mb, mo, 100 * change, None, len(base), len(other), "not judged", note, needed)
    inside = ci[0] <= 0 <= ci[1] or abs(change) < MIN_EFFECT
    verdict: Verdict = "inside noise" if inside else ("better" if change * direction > 0 else "worse")
    needed = repeats_to_resolve(base, other, floors=floors) if verdict == "inside noise" else None
    note = repeats_advice(needed, min(len(base), len(other))) if needed is not None else ""
    return MetricVerdict(metric, mb, mo, 100 * change, ci_pct, len(base), len(other), verdict, note, needed,
                         p_value=welch_p(base, other, floors))


def repeats_advice(needed: int, have: int) -> str:
    more = needed - have
    if more > MAX_ADVISED_REPEATS:
        return (f"over {MAX_ADVISED_REPEATS} more repeats a side would be needed to resolve a {100 * MIN_EFFECT:g}% "
                "change: this noise is too large for repeats to settle; find its cause")
    if more > 0:
        return f"about {more} more repeat(s) a side would resolve a {100 * MIN_EFFECT:g}% change at this noise"
    return f"enough repeats to resolve a {100 * MIN_EFFECT:g}% change: none is there"
