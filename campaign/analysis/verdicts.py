"""Per-cell verdicts of a stored run's A/B diff: the metrics each phase is judged on and when a latency tail
can be judged at all, CellDiff (one cell's metrics, baseline against variant, with its statuses and reasons) and
VariantDiff (one variant's flag and fact changes, cells and outcome), the cell and experiment diffs computed
from stored cells and experiment records, and family_wise, which holds a variant's better/worse verdicts to
Holm's family-wise error rate. The statistics themselves are in statistics.py; the keep/revert decision that
fills in a VariantDiff's outcome is in recommend.py.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from campaign.analysis.statistics import Look, MetricVerdict, holm, judge, verdict_for
from campaign.core import stats
from campaign.measure.cells import CellResult, Reason
from campaign.measure.figures import stream_speeds
from campaign.measure.judged import (
    MIN_EFFECT,
    PHASE_METRICS,
    TAIL_METRICS,
    TAIL_MIN_REPEATS,
    TAIL_MIN_SAMPLES,
    TELEMETRY_METRICS,
)
from campaign.measure.study import value_direction
from campaign.stored.store import StoredCell

# What a variant's diff concludes: one of four, `provisional` when it rests on launch facts alone.
Outcome = Literal["keep", "revert", "no difference", "not settled"]



def family_wise(cells: list[CellDiff], look: Look | None = None) -> int:
    """Judge every tested cell and metric of one variant as one family, in place: Holm over their p-values at
    the look's alpha for better/worse, and each equivalence test at alpha/m. Returns the family's size m."""
    look = look or Look()
    tested = [(c, i) for c in cells for i, m in enumerate(c.metrics) if m.p_value is not None]
    adjusted = holm([c.metrics[i].p_value or 0.0 for c, i in tested])
    family = replace(look, tests=len(tested))
    for (cell, index), p_holm in zip(tested, adjusted, strict=True):
        cell.metrics[index] = judge(cell.metrics[index], family, p_holm)
    return len(tested)


@dataclass
class CellDiff:
    key: str
    phase: str
    context_tokens: int
    concurrency: int
    label: str
    metrics: list[MetricVerdict] = field(default_factory=list)
    status_note: str = ""
    # Typed, for decisions: the statuses other than Valid on each side, and the variant's reason codes.
    variant_statuses: list[str] = field(default_factory=list)
    baseline_statuses: list[str] = field(default_factory=list)
    variant_reasons: list[Reason] = field(default_factory=list)
    baseline_reasons: list[Reason] = field(default_factory=list)


@dataclass
class VariantDiff:
    variant: str
    baseline: str
    flag_changes: list[tuple[str, Any, Any]]
    fact_changes: list[tuple[str, Any, Any, float | None]]
    cells: list[CellDiff]
    comparable: bool
    not_comparable_reason: str = ""
    recommendation: str = ""
    headline: str = ""            # the recommendation in one sentence: what decided it (recommend.Recommendation)
    # How the variant's `gpu-memory-utilization: suggested` was resolved: suggested, margin, resolved.
    suggested: dict[str, Any] | None = None
    outcome: Outcome = "not settled"
    provisional: bool = False     # rests on launch facts alone: one measurement a side
    tests: int = 0                # the family: cells and metrics tested, Holm-adjusted together
    look: Look = field(default_factory=Look)   # the level it was judged at (a look of a night run until settled)
    rounds_note: str = ""         # a night run until settled: when it settled, or that it is still open

    @property
    def alpha(self) -> float:
        return self.look.alpha

    @property
    def aa(self) -> bool:
        """An A/A comparison: the variant runs the baseline's exact flags in the same run, so every difference
        is noise (the same flags in another run, "@B", may differ in everything else)."""
        return not self.flag_changes and not self.variant.endswith("@B")

    @property
    def beyond_noise_alone(self) -> int:
        """Tests that alone would have called a change (the rig's per-test false positives in an A/A)."""
        return sum(1 for c in self.cells for m in c.metrics if m.beyond_noise_alone)

    @property
    def family_line(self) -> str:
        """How many tests the verdicts rest on, and at what family-wise level."""
        if self.rounds_note:
            return f"{self.rounds_note}; {replace(self, rounds_note='').family_line}"
        if not self.comparable:
            return f"no test: not comparable ({self.not_comparable_reason})"
        if not self.tests:
            return ("no test: no cell and metric has two or more Valid measurements on both sides, so no better or "
                    "worse verdict is possible")
        line = (f"{self.tests} tests (cells x metrics) at {self.look.describe()}: better/worse only where Holm's "
                f"adjusted p < {self.alpha:.2g} and the change reaches {100 * self.look.min_effect:g}%; no "
                f"difference only where the interval at that level lies within +-{100 * self.look.min_effect:g}%")
        if self.aa:
            judged = sum(1 for c in self.cells for m in c.metrics if m.verdict in {"better", "worse"})
            line += (f"; A/A (the baseline's own flags): {judged} of {self.tests} beyond noise after Holm, "
                     f"{self.beyond_noise_alone} on their own 95% intervals (this rig's per-test false positives)")
        return line

def _values(cells: list[StoredCell], key: str, metric: str) -> list[float]:
    values = []
    for cell in cells:
        value = getattr(cell.result, metric)
        if cell.result.spec.key == key and cell.result.status == "Valid" and value is not None:
            values.append(float(value))
    return values


def _by_round(cells: list[StoredCell], key: str, metric: str) -> dict[int, float]:
    """The metric's Valid values by round (repeat): one launch a side each."""
    return {c.repeat: float(getattr(c.result, metric)) for c in cells if c.result.spec.key == key
            and c.result.status == "Valid" and getattr(c.result, metric) is not None}


def _pairs(mine: dict[int, float], theirs: dict[int, float]) -> list[tuple[float, float]]:
    """The values by round where both sides measured it in that round."""
    return [(mine[r], theirs[r]) for r in sorted(mine.keys() & theirs.keys())]


# Medians over a measurement's requests (phase, metric -> the requests' values), whose own error is the
# least variance a measurement of them carries (`_median_floor`). In a decode cell of streams in lockstep, each
# wave's replacements reach the server within a step of each other; whether they are prefilled in one step
# or split over two is decided by the client's timing to the microsecond, so one measurement's TTFT median
# can land in either mode: the simulated A5000 pair read 208, 209 ms against 159, 160 ms for identical flags
# in a CI run, and Welch's test on two close values a side called that "better". The requests of the
# 159 ms measurements spanned both modes, which their median's error says.
# Stream tok/s is such a median too: on the same pair at 1,024-token prompts a step that prefills a prompt
# takes 1-2 s against 26 ms for a decode step, so a request's rate hangs on how many of those steps fall in
# its life, and its requests read 0.3 to 40 tok/s; the median of a 20 s window's 21 requests read 14.7 or
# 17.4 (18% apart) from identical servers as the client's timing fell (the median's own error: 16%).
MEDIAN_OF_REQUESTS: dict[tuple[str, str], Callable[[CellResult], list[float]]] = {
    ("decode", "ttft_ms"): lambda r: [t for t in (q.ttft_s for q in r.records) if t is not None],
    ("decode", "per_request_tok_s"): lambda r: stream_speeds(r.records, r.window)}


def _median_floor(cells: list[StoredCell], key: str, metric: str) -> float:
    """The mean over a side's Valid measurements of its median's squared error, from its stored requests, in
    the metric's own units (0 where the metric is no such median or no requests were stored)."""
    errors = []
    for cell in cells:
        r = cell.result
        samples_of = MEDIAN_OF_REQUESTS.get((r.phase, metric))
        value = getattr(r, metric, None)
        if r.spec.key != key or r.status != "Valid" or samples_of is None or value is None:
            continue
        samples = samples_of(r)
        se, middle = stats.median_standard_error(samples), stats.median(samples)
        if se is not None and middle:
            errors.append((se / middle * value) ** 2)  # relative: the stored value may be in scaled time
    return statistics.fmean(errors) if errors else 0.0


def _samples(cells: list[StoredCell], key: str, field_name: str) -> list[int]:
    """How many samples each Valid measurement of a cell rests on (its latency_requests or itl_samples)."""
    return [int(getattr(c.result, field_name) or 0) for c in cells
            if c.result.spec.key == key and c.result.status == "Valid"]


def _tail_unjudged(cells: list[StoredCell], key: str, metric: str, fewest_repeats: int) -> str | None:
    """Why a tail metric of this cell cannot be judged (samples, repeats, the client's noise), or None."""
    fewest = min(_samples(cells, key, TAIL_METRICS[metric]), default=0)
    if fewest < TAIL_MIN_SAMPLES:
        return (f"not judged: a p99 of {fewest} sample(s) is close to the largest value "
                f"(needs {TAIL_MIN_SAMPLES} a measurement)")
    if fewest_repeats < TAIL_MIN_REPEATS:
        return (f"not judged: a p99 needs {TAIL_MIN_REPEATS} measurements a side to show how much it moves "
                f"between launches (has {fewest_repeats})")
    return _client_noise(cells, key, metric)


def _client_noise(cells: list[StoredCell], key: str, metric: str) -> str | None:
    """Why a tail metric cannot be judged from the client's own timing noise, or None: each Valid
    measurement's p99 must exceed its client's loop-lag p99 by 1/MIN_EFFECT (files before format 5 have no
    lag and are judged as they were)."""
    worst: tuple[float, float] | None = None
    for cell in cells:
        r = cell.result
        value, lag = getattr(r, metric), r.client_lag_p99_ms
        if r.spec.key != key or r.status != "Valid" or value is None or lag is None or value <= 0:
            continue
        lag *= r.time_scale   # the cell's latencies are in the hardware's ms, the loop's lag in wall ms
        if worst is None or lag / value > worst[0] / worst[1]:
            worst = (lag, value)
    if worst is None or worst[0] < MIN_EFFECT * worst[1]:
        return None
    return (f"not judged: the client's own timing noise (event-loop lag p99 {worst[0]:.2f} ms) is "
            f"{worst[0] / worst[1]:.0%} of a {worst[1]:.1f} ms p99, more than the {100 * MIN_EFFECT:g}% a change "
            "must reach; a quieter client host, or fewer streams a client process, would let it be judged")


def _status_note(statuses: Collection[str], base_statuses: Collection[str]) -> str:
    """Which side of a cell or experiment was not Valid, in words ("" when both were)."""
    return "; ".join(part for part in (
        f"variant: {', '.join(sorted(statuses))}" if statuses else "",
        f"baseline: {', '.join(sorted(base_statuses))}" if base_statuses else "") if part)


def _cell_diffs(base: list[StoredCell], other: list[StoredCell], comparable: bool,
                paired: bool = True) -> list[CellDiff]:
    """Each cell's diff; `paired`: the two sides' repeats are the rounds of one night (not two runs)."""
    specs = {c.result.spec.key: c.result for c in base + other}
    out = []
    for key in sorted(specs, key=lambda k: (specs[k].phase, specs[k].context_tokens, specs[k].concurrency)):
        result = specs[key]
        diff = CellDiff(key=key, phase=result.phase, context_tokens=result.context_tokens,
                        concurrency=result.concurrency, label=result.label)
        statuses = {c.result.status for c in other if c.result.spec.key == key} - {"Valid"}
        base_statuses = {c.result.status for c in base if c.result.spec.key == key} - {"Valid"}
        diff.variant_statuses, diff.baseline_statuses = sorted(statuses), sorted(base_statuses)
        diff.variant_reasons = sorted({code for c in other if c.result.spec.key == key
                                       for code in c.result.reason_codes})
        diff.baseline_reasons = sorted({code for c in base if c.result.spec.key == key
                                        for code in c.result.reason_codes})
        diff.status_note = _status_note(statuses, base_statuses)
        metrics = PHASE_METRICS[result.phase]
        for metric, direction in metrics:
            if metric in TELEMETRY_METRICS and not (_values(base, key, metric) or _values(other, key, metric)):
                continue
            if not comparable:
                diff.metrics.append(MetricVerdict(metric, None, None, None, None, 0, 0, "not comparable"))
                continue
            if metric in TAIL_METRICS:
                base_v, other_v = _values(base, key, metric), _values(other, key, metric)
                if not (base_v or other_v):
                    continue  # stored before latency distributions existed
                why = _tail_unjudged(base + other, key, metric, min(len(base_v), len(other_v)))
                if why is not None:
                    diff.metrics.append(MetricVerdict(
                        metric, statistics.fmean(base_v) if base_v else None,
                        statistics.fmean(other_v) if other_v else None, None, None, len(base_v), len(other_v),
                        "no data", why))
                    continue
            floors = (_median_floor(base, key, metric), _median_floor(other, key, metric))
            rounds = (_by_round(base, key, metric), _by_round(other, key, metric))
            verdict = verdict_for(_values(base, key, metric), _values(other, key, metric), direction, metric,
                                  floors, pairs=_pairs(*rounds) if paired else None)
            diff.metrics.append(replace(verdict, by_launch=rounds))
        out.append(diff)
    return out


def _experiment_diffs(base: list[dict[str, Any]], other: list[dict[str, Any]], comparable: bool) -> list[CellDiff]:
    """Experiments compare like cells, on their headline values."""
    keys = sorted({r["key"] for r in base + other})
    out = []
    for key in keys:
        diff = CellDiff(key=key, phase="experiment", context_tokens=0, concurrency=0, label="experiment")
        # As a cell's: which side was not Valid and why (a burst the client did not send at once is Invalid,
        # and never judged: _experiment_values reads Valid results only).
        statuses = {r["status"] for r in other if r["key"] == key} - {"Valid"}
        base_statuses = {r["status"] for r in base if r["key"] == key} - {"Valid"}
        diff.variant_statuses, diff.baseline_statuses = sorted(statuses), sorted(base_statuses)
        diff.variant_reasons = sorted({Reason(c) for r in other if r["key"] == key for c in r.get("reason_codes", [])})
        diff.baseline_reasons = sorted({Reason(c) for r in base if r["key"] == key for c in r.get("reason_codes", [])})
        diff.status_note = _status_note(statuses, base_statuses)
        names = sorted({n for r in base + other if r["key"] == key for n in r.get("values", {})})
        for name in names:
            direction = value_direction(name)
            if direction is None:
                continue
            if not comparable:
                diff.metrics.append(MetricVerdict(name, None, None, None, None, 0, 0, "not comparable"))
                continue
            verdict = verdict_for(_experiment_values(base, key, name), _experiment_values(other, key, name),
                                  direction, name)
            verdict = replace(verdict, by_launch=(_experiment_rounds(base, key, name),
                                                  _experiment_rounds(other, key, name)))
            diff.metrics.append(_within_resolution(verdict, [r for r in base + other if r["key"] == key]))
        out.append(diff)
    return out


def _within_resolution(verdict: MetricVerdict, results: list[dict[str, Any]]) -> MetricVerdict:
    """A capacity search answers to within its bracket (the last passing and first failing values): two
    searches that land one bisection step apart in every repeat differ by no more than that step, so a change
    no larger than the widest bracket on either side is inside the search's resolution, never better or
    worse (statistics.judge reads it)."""
    axis = {"max_rate_rps": "slo_search", "max_concurrency": "concurrency_search"}.get(verdict.metric)
    if axis is None:
        return verdict
    widths = []
    for result in results:
        found = (result.get("details") or {}).get(axis) or {}
        low = found.get("last_pass_rps", found.get("last_pass"))
        high = found.get("first_fail_rps", found.get("first_fail"))
        if low and high:
            widths.append(100.0 * (high - low) / low)
    if not widths:
        return verdict
    return judge(replace(verdict, resolution_pct=max(widths)), Look())


def _experiment_values(results: list[dict[str, Any]], key: str, name: str) -> list[float]:
    return [float(r["values"][name]) for r in results
            if r["key"] == key and r["status"] == "Valid" and r["values"].get(name) is not None]


def _experiment_rounds(results: list[dict[str, Any]], key: str, name: str) -> dict[int, float]:
    """An experiment value's Valid values by round, for results that say their repeat (diff_run adds it)."""
    return {int(r["repeat"]): float(r["values"][name]) for r in results
            if r["key"] == key and r["status"] == "Valid" and r["values"].get(name) is not None
            and r.get("repeat") is not None}
