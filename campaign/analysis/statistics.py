"""The statistics of one metric, baseline against variant: Welch's test and intervals over the repeats of
each side (with each measurement's own error as a floor on its side's spread), Holm's step-down adjustment over
a family of tests, and the verdict one metric gets at a look:
- better / worse: the change reaches the minimum effect and Holm's adjusted p is under the look's alpha;
- no difference: shown, not assumed: the interval at the family's level (two one-sided tests, each at
  alpha/m) lies inside +-the minimum effect;
- not settled: anything else, with how many launches a side would confirm the change seen and how many would
  show no difference;
- not judged (one measurement a side), no data.
A night run until settled looks after every round; each look spends its share of the family's alpha by
O'Brien-Fleming (Lan-DeMets) spending, so the looks together keep the false-verdict rate at or under it.
Pure: numbers in, numbers and sentences out; it reads no files and knows nothing of stored runs.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass, replace
from typing import Literal

from campaign.measure.judged import FAMILY_ALPHA, MIN_EFFECT

# scipy is imported where a figure needs it (scipy.special, and scipy.optimize for the boundaries), as in
# core/stats.py: the command line imports this module, and every command's start paid for scipy.special. The
# normal law is scipy.special's (ndtr, ndtri), not scipy.stats.norm: the same functions, without scipy.stats'
# import (0.84 s against 0.21 here), which every diff, report and night's end paid once.
Verdict = Literal["better", "worse", "no difference", "not settled", "not judged", "not comparable", "no data"]

MAX_ADVISED_REPEATS = 100  # beyond this the advice is to find the noise, not to repeat


def sample_variance(values: list[float]) -> float:
    """The sample variance (n - 1) of two or more floats, two-pass with fsum. The standard library's
    `statistics.variance` sums exactly in Fractions: profiled, it was 26 s of the 44 s that 1,000 simulated A/A
    nights took to judge (tests/test_verdict_promises.py), and with this the same nights take 14 s and read
    the same rates. It agrees with the exact sum to about 1e-15 relative on such data."""
    # From the first value (exact for values this close): equal values give exactly 0, as the exact sum does,
    # so a side that never varied is still told apart from one that barely did.
    shifted = [v - values[0] for v in values]
    mean = math.fsum(shifted) / len(shifted)
    return math.fsum((d - mean) ** 2 for d in shifted) / (len(shifted) - 1)


def _spread(values: list[float], floor: float) -> float:
    """A side's variance of one measurement: what its repeats show, and never less than `floor`, the variance
    each measurement carries on its own (a median's error from its requests): two repeats that land close by
    chance say nothing about how far a third would land."""
    return max(sample_variance(values), floor)


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order: reject where adjusted < alpha, and the chance of
    any false rejection in the family stays below alpha under any dependence between the tests (a variant's
    metrics are correlated: total tok/s and stream tok/s move together), which Bonferroni also gives, less
    powerfully."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


@dataclass(frozen=True)
class Look:
    """The level one judgment is made at. `alpha`: the family's level at this look (all of FAMILY_ALPHA for a
    night of fixed repeats; for a night run until settled, this look's nominal level under O'Brien-Fleming
    spending, `sequential_alpha`); `tests`: the family's size m (Holm for better/worse, and each equivalence
    test at alpha/m); `min_effect`: the smallest change that matters, as a fraction."""

    alpha: float = FAMILY_ALPHA
    tests: int = 1
    min_effect: float = MIN_EFFECT
    # For the sentence: which look of how many (None: a night of fixed repeats, one look).
    rounds: int | None = None
    max_rounds: int | None = None

    @property
    def per_test(self) -> float:
        return self.alpha / max(1, self.tests)

    def describe(self) -> str:
        if self.rounds is None:
            return f"family-wise {100 * self.alpha:g}%"
        return (f"round {self.rounds} of at most {self.max_rounds} (O'Brien-Fleming boundary: nominal "
                f"{100 * self.alpha:.2g}% at this look, {100 * FAMILY_ALPHA:g}% over all of them)")


def obrien_fleming(fraction: float, alpha: float = FAMILY_ALPHA) -> float:
    """Lan and DeMets' O'Brien-Fleming-type spending function: the error spent by information fraction t,
    2 - 2 Phi(z_{1-alpha/2} / sqrt(t)). Almost nothing early, all of alpha at t = 1."""
    if fraction <= 0:
        return 0.0
    from scipy import special

    t = min(1.0, fraction)
    return float(2 - 2 * special.ndtr(special.ndtri(1 - alpha / 2) / math.sqrt(t)))


def sequential_alpha(rounds: int, max_rounds: int, first: int = 2, alpha: float = FAMILY_ALPHA) -> float:
    """The nominal two-sided level of the look after `rounds` rounds, when a night looks after every round from
    `first` up to `max_rounds`: the group-sequential boundary of O'Brien-Fleming-type spending (Lan and DeMets,
    1983), so that over all the looks together the chance of a false verdict is alpha. The boundaries are
    found in turn from the joint normal law of the looks' statistics (the look after r rounds correlates
    with the one after s >= r as sqrt(r / s)); a look's t statistic is then held to the same nominal level,
    as group-sequential t-tests usually are, and tests/test_verdict_promises.py checks the rate it gives."""
    if rounds < first or max_rounds < first:
        return 0.0
    return _boundaries(max_rounds, first, alpha)[min(rounds, max_rounds) - first]


GRID = 801   # points of the numerical integration over a look's continuation region


@functools.lru_cache(maxsize=64)
def _boundaries(max_rounds: int, first: int, alpha: float) -> tuple[float, ...]:
    """The nominal two-sided level of each look from `first` to `max_rounds` rounds, by the recursive numerical
    integration of Armitage, McPherson and Rowe (Jennison and Turnbull, 2000, ch. 19): the score S_k (the
    statistic times the square root of the information, here the rounds) has independent normal increments;
    carry the density of S over the region where no look has stopped yet, and at each look find the bound
    whose crossing spends exactly that look's share of alpha."""
    import numpy as np
    from scipy import optimize, special

    info = [float(r) for r in range(first, max_rounds + 1)]
    levels: list[float] = []
    grid = np.array([0.0])
    density = np.array([1.0])      # S_0 = 0 with probability one: a point mass, weight 1
    weights = np.array([1.0])
    previous_info = 0.0
    spent = 0.0
    for k, now in enumerate(info):
        step = math.sqrt(now - previous_info)
        target = obrien_fleming(now / info[-1], alpha) - spent

        def crossing(c: float, grid: object = grid, mass: object = density * weights, step: float = step,
                     now: float = now) -> float:
            b = c * math.sqrt(now)
            u = np.asarray(grid)
            return float(np.sum(np.asarray(mass) * (special.ndtr((u - b) / step) + special.ndtr((-b - u) / step))))

        if crossing(12.0) >= target:
            bound = 12.0
        else:
            bound = float(optimize.brentq(lambda c, t=target: crossing(c) - t, 0.0, 12.0, xtol=1e-7))
        spent += crossing(bound)
        levels.append(float(2 * special.ndtr(-bound)))
        if k + 1 == len(info):
            break
        b = bound * math.sqrt(now)
        new_grid = np.linspace(-b, b, GRID)
        new_weights = np.full(GRID, 2 * b / (GRID - 1))
        new_weights[0] = new_weights[-1] = b / (GRID - 1)   # the trapezoid rule
        z = (new_grid[:, None] - grid[None, :]) / step
        kernel = np.exp(-0.5 * z * z) / (math.sqrt(2 * math.pi) * step)   # the normal density
        density = kernel @ (density * weights)
        grid, weights = new_grid, new_weights
        previous_info = now
    return tuple(levels)


@dataclass(frozen=True)
class Estimate:
    """One metric's change with its standard error, in the baseline mean's units (Welch)."""

    diff: float          # mean(variant) - mean(baseline)
    se: float            # its standard error
    df: float            # Welch-Satterthwaite degrees of freedom
    pooled_sd: float     # one measurement's standard deviation, pooled over both sides
    spread: tuple[float, float]   # each side's relative standard deviation of one measurement (baseline, variant)
    paired: bool = False  # from the rounds' differences (one launch a side per round), not the two sides apart

    @property
    def method(self) -> str:
        return "paired over rounds" if self.paired else "Welch"

    def interval(self, two_sided_alpha: float) -> tuple[float, float]:
        from scipy import special

        half = float(special.stdtrit(self.df, 1 - two_sided_alpha / 2)) * self.se if self.se > 0 else 0.0
        return self.diff - half, self.diff + half

    @property
    def p_value(self) -> float:
        """Welch's two-sided p-value (scipy's ttest_ind_from_stats with equal_var=False, by its own formula)."""
        if self.se == 0:
            return 1.0 if self.diff == 0 else 0.0
        from scipy import special

        return float(2 * special.stdtr(self.df, -abs(self.diff) / self.se))


def estimate(base: list[float], other: list[float], floors: tuple[float, float] = (0.0, 0.0)) -> Estimate | None:
    """Welch's estimate of mean(other) - mean(base); None with fewer than two values a side."""
    if len(base) < 2 or len(other) < 2:
        return None
    sb, so = _spread(base, floors[0]), _spread(other, floors[1])
    vb, vo = sb / len(base), so / len(other)
    se = math.sqrt(vb + vo)
    df = ((vb + vo) ** 2 / ((vb**2) / (len(base) - 1) + (vo**2) / (len(other) - 1))) if se > 0 else float(
        len(base) + len(other) - 2)
    pooled = _pooled_sd(base, other, floors)
    assert pooled is not None   # both sides have two
    mb, mo = statistics.fmean(base), statistics.fmean(other)
    spread = (math.sqrt(sb) / abs(mb) if mb else math.inf, math.sqrt(so) / abs(mo) if mo else math.inf)
    return Estimate(mo - mb, se, df, pooled, spread)


@functools.lru_cache(maxsize=4096)
def _t(p: float, df: int) -> float:
    from scipy import special

    return float(special.stdtrit(df, p))


def paired_estimate(pairs: list[tuple[float, float]], floors: tuple[float, float] = (0.0, 0.0)) -> Estimate | None:
    """The change from rounds that measured both sides once each (baseline, variant): the mean of the rounds'
    differences, its standard error from their spread (never below the two measurements' own errors), n - 1
    degrees of freedom. A round's drift (the whole rig slower that round) is in both of its launches and
    cancels in its difference, which Welch over the two sides apart counts as noise. None under 3 rounds."""
    if len(pairs) < 3:
        return None
    base, other = [b for b, _ in pairs], [o for _, o in pairs]
    differences = [o - b for b, o in pairs]
    variance = max(sample_variance(differences), floors[0] + floors[1])
    n = len(pairs)
    mb, mo = statistics.fmean(base), statistics.fmean(other)
    spread = (math.sqrt(sample_variance(base)) / abs(mb) if mb else math.inf,
              math.sqrt(sample_variance(other)) / abs(mo) if mo else math.inf)
    return Estimate(statistics.fmean(differences), math.sqrt(variance / n), float(n - 1),
                    math.sqrt(variance / 2), spread, paired=True)


def launches_to(target: float, sd: float, *, alpha: float, power: float = 0.8, one_sided: bool = False,
                have: int = 0, paired: bool = False) -> int | None:
    """The fewest launches a side n for which a t-test of `alpha` (per test; two-sided unless one_sided) reaches
    `target` (an absolute difference) with `power` at one measurement's standard deviation `sd`:
    2 (t_a + t_b)^2 sd^2 / target^2 <= n, the quantiles at 2n - 2 degrees of freedom. None: more than
    MAX_ADVISED_REPEATS beyond `have` (not reachable at this noise)."""
    if target <= 0:
        return None
    if sd == 0:
        return max(2, have)
    a = alpha if one_sided else alpha / 2

    def enough(n: int) -> bool:
        df = n - 1 if paired else 2 * n - 2   # paired: sd is a round's difference over sqrt(2)
        return 2 * (_t(1 - a, df) + _t(power, df)) ** 2 * sd**2 / target**2 <= n

    low, high = (3 if paired else 2), max(2, have) + MAX_ADVISED_REPEATS
    if not enough(high):
        return None
    while low < high:   # the left side falls and the right rises with n: the first n that is enough
        middle = (low + high) // 2
        if enough(middle):
            high = middle
        else:
            low = middle + 1
    return low


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
    # Not settled: how many measurements a side would (a) confirm the observed change if it is real and
    # (b) show no difference within the minimum effect if there is none (None: not reachable at this noise).
    repeats_needed: int | None = None
    confirm_repeats: int | None = None
    equivalence_repeats: int | None = None
    # Welch's p-value, and Holm's adjustment over every test of the variant (None: not tested).
    p_value: float | None = None
    p_holm: float | None = None
    # The interval the verdict used (at the family's level), in % of the baseline; the sides' spreads (%).
    verdict_ci_pct: tuple[float, float] | None = None
    spread_pct: tuple[float, float] | None = None
    estimate: Estimate | None = None
    direction: int = 1            # +1: higher is better; -1: lower is better
    # A capacity search answers to within its bracket: a change no wider than this (%) is not a verdict.
    resolution_pct: float | None = None
    # The Valid values by launch (the repeat each was measured in), baseline's and variant's: what
    # benefit.py takes each launch's shared speed out of (None: not kept, as for a verdict built by hand).
    by_launch: tuple[dict[int, float], dict[int, float]] | None = None

    @property
    def beyond_noise_alone(self) -> bool:
        """Would this test alone (95% interval, minimum effect) call a change? The A/A false-positive count."""
        return (self.ci95_pct is not None and self.change_pct is not None and abs(self.change_pct) >= 100 * MIN_EFFECT
                and not self.ci95_pct[0] <= 0 <= self.ci95_pct[1])


def judge(verdict: MetricVerdict, look: Look, p_holm: float | None = None) -> MetricVerdict:
    """One tested metric's verdict at a look: better or worse where the change reaches the minimum effect and
    Holm's adjusted p (or, alone, its own p) is under the look's alpha; no difference where the interval at the
    family's level (TOST: each side at alpha/m, the 1 - 2 alpha/m interval) lies inside +-the minimum effect;
    otherwise not settled, with what would settle it."""
    est, mb, direction = verdict.estimate, verdict.baseline, verdict.direction
    if verdict.p_value is None:
        return verdict
    p = verdict.p_value if p_holm is None else p_holm
    if est is None or not mb or verdict.change_pct is None:
        # Made without its estimate (a verdict built by hand): only the family's correction can apply.
        if verdict.verdict in {"better", "worse"} and p >= look.alpha:
            return replace(verdict, p_holm=p_holm, verdict="not settled", note=(
                f"{verdict.verdict} on its own (p={verdict.p_value:.3f}), not across the variant's {look.tests} "
                f"tests (Holm p={p:.2f})"))
        return replace(verdict, p_holm=p_holm)
    delta = look.min_effect * abs(mb)
    change = est.diff / mb
    lo, hi = est.interval(2 * look.per_test)
    family_ci = (100 * min(lo, hi) / abs(mb), 100 * max(lo, hi) / abs(mb))
    base = replace(verdict, p_holm=p_holm, verdict_ci_pct=family_ci,
                   spread_pct=(100 * est.spread[0], 100 * est.spread[1]), confirm_repeats=None,
                   equivalence_repeats=None, repeats_needed=None)
    if verdict.resolution_pct is not None and abs(100 * change) <= verdict.resolution_pct:
        if verdict.resolution_pct <= 100 * look.min_effect:
            return replace(base, verdict="no difference", note=(
                f"within the search's resolution ({verdict.resolution_pct:.0f}%), under the "
                f"{100 * look.min_effect:g}% minimum effect"))
        return replace(base, verdict="not settled", note=(
            f"within the search's resolution (its brackets are up to {verdict.resolution_pct:.0f}% wide): a finer "
            "search (a smaller `resolution`) would settle it"))
    if abs(change) >= look.min_effect and p < look.alpha:
        return replace(base, verdict="better" if change * direction > 0 else "worse",
                       note="paired over rounds" if est.paired else "")
    if -delta < lo and hi < delta:
        return replace(base, verdict="no difference",
                       note=f"shown within +-{100 * look.min_effect:g}% ({_pct_range(family_ci)} at {look.describe()}, "
                            f"{est.method})")
    have = min(verdict.n_baseline, verdict.n_variant)
    confirm = launches_to(abs(est.diff), est.pooled_sd, alpha=look.per_test, have=have, paired=est.paired) \
        if abs(change) >= look.min_effect else None
    equal = launches_to(delta, est.pooled_sd, alpha=look.per_test, power=0.9, one_sided=True, have=have,
                        paired=est.paired)
    parts = [f"not settled at {look.describe()}: {_pct_range(family_ci)} ({est.method})"]
    if p_holm is not None and verdict.p_value < look.alpha <= p_holm and abs(change) >= look.min_effect:
        parts.append(f"{'better' if change * direction > 0 else 'worse'} on its own (p={verdict.p_value:.3f}), "
                     f"not across the variant's {look.tests} tests (Holm p={p_holm:.2f})")
    parts.append(settle_advice(change, confirm, equal, have, look.min_effect))
    return replace(base, verdict="not settled", note="; ".join(parts), confirm_repeats=confirm,
                   equivalence_repeats=equal, repeats_needed=min((n for n in (confirm, equal) if n is not None),
                                                                 default=None))


def settle_advice(change: float, confirm: int | None, equal: int | None, have: int, min_effect: float) -> str:
    """What would settle one metric: launches a side to confirm the change seen, and to show none."""
    def more(n: int | None) -> str:
        if n is None:
            return f"not reachable at this noise (over {MAX_ADVISED_REPEATS} more launches a side)"
        return f"{max(1, n - have)} more launch(es) a side"

    if abs(change) >= min_effect:
        first = f"if the {100 * change:+.1f}% is real, {more(confirm)} would confirm it"
    else:
        first = f"the {100 * change:+.1f}% seen is under the {100 * min_effect:g}% minimum effect"
    return f"{first}; to show no difference within +-{100 * min_effect:g}%: {more(equal)}"


def _pct_range(ci: tuple[float, float]) -> str:
    return f"[{ci[0]:+.1f}%, {ci[1]:+.1f}%]"


def verdict_for(base: list[float], other: list[float], direction: int, metric: str = "",
                floors: tuple[float, float] = (0.0, 0.0), look: Look | None = None,
                pairs: list[tuple[float, float]] | None = None) -> MetricVerdict:
    """Baseline vs variant samples of one metric -> change, 95% interval and a verdict judged alone (a family
    of one; family_wise re-judges it within the variant's family). `floors`: the least variance of one
    measurement on each side (its own error, where the metric has one; see `_spread`). `pairs`: the same
    values by round (baseline, variant), where the night interleaved them: from three rounds the paired
    estimate is used where its 95% interval is the narrower (the verdict says which; the constructed nights of
    tests/test_verdict_promises.py check that choosing keeps the false-verdict rate)."""
    look = look or Look()
    if not base or not other:
        return MetricVerdict(metric, statistics.fmean(base) if base else None,
                             statistics.fmean(other) if other else None, None, None, len(base), len(other),
                             "no data")
    mb, mo = statistics.fmean(base), statistics.fmean(other)
    if mb == 0:
        return MetricVerdict(metric, mb, mo, None, None, len(base), len(other), "no data", "baseline is zero")
    change = (mo - mb) / mb
    est = estimate(base, other, floors)
    if est is None:
        # One measurement is not evidence: a fixed noise floor is not an interval (issue 20). What would settle
        # it is judged from the other side's spread, for the change that is there and for none.
        sd = _pooled_sd(base, other, floors)
        if sd is None:
            note = ("one measurement: not judged; at least 2 repeats a side are needed to know the noise (campaign "
                    "run --resume RUN --repeats 2)")
            return MetricVerdict(metric, mb, mo, 100 * change, None, len(base), len(other), "not judged", note)
        confirm = launches_to(abs(mo - mb), sd, alpha=look.per_test, have=1) if abs(change) >= look.min_effect \
            else None
        equal = launches_to(look.min_effect * abs(mb), sd, alpha=look.per_test, power=0.9, one_sided=True, have=1)
        note = ("one measurement: not judged; " + settle_advice(change, confirm, equal, 1, look.min_effect)
                + " (from the other side's spread)")
        return MetricVerdict(metric, mb, mo, 100 * change, None, len(base), len(other), "not judged", note,
                             min((n for n in (confirm, equal) if n is not None), default=None), confirm, equal)
    paired = paired_estimate(pairs or [], floors)
    if paired is not None and _width(paired) < _width(est):
        est = paired
    lo, hi = est.interval(0.05)
    ci_pct = (100 * lo / mb, 100 * hi / mb) if mb > 0 else (100 * hi / mb, 100 * lo / mb)
    tested = MetricVerdict(metric, mb, mo, 100 * change, ci_pct, len(base), len(other), "not settled",
                           p_value=est.p_value, estimate=est, direction=direction)
    return judge(tested, look)


def _pooled_sd(base: list[float], other: list[float], floors: tuple[float, float]) -> float | None:
    """One measurement's standard deviation, pooled over the sides that have two or more (None: neither has)."""
    sides = [(values, floor) for values, floor in zip((base, other), floors, strict=True) if len(values) >= 2]
    if not sides:
        return None
    return math.sqrt(sum((len(v) - 1) * _spread(v, f) for v, f in sides) / sum(len(v) - 1 for v, _ in sides))


def _width(est: Estimate) -> float:
    lo, hi = est.interval(0.05)
    return hi - lo
