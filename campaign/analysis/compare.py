"""A/B analysis of stored runs: flag and facts diffs, per-cell verdicts that know what noise is, drift.

Reads stored files only (through store.RunDir), so any run can be re-analysed later without a server.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from campaign.core import stats
from campaign.core.errors import ResultFormatError
from campaign.http.client import RequestRecord
from campaign.measure.answers import agents_that_fit
from campaign.measure.cells import REASON_HINTS, Reason, primary_metric
from campaign.night.records import (
    CellRecord,
    DriftRecord,
    GuardRecord,
    Manifest,
    OutcomeRecord,
    ShortAnswers,
    SummaryRecord,
)
from campaign.night.store import RunDir, StoredCell, read_record
from campaign.server import gpu

Verdict = Literal["better", "worse", "inside noise", "not judged", "not comparable", "no data"]
# What a variant's diff concludes: one of four, `provisional` when it rests on launch facts alone.
Outcome = Literal["keep", "revert", "no difference", "not settled"]

# (metric, +1 when higher is better, -1 when lower is better)
# energy_j_per_token (NVIDIA GPUs only): a flag that saves energy at equal speed is a result too.
DECODE_METRICS = (("total_tok_s", 1), ("per_request_tok_s", 1), ("ttft_ms", -1), ("energy_j_per_token", -1),
                  ("ttft_p99_ms", -1), ("itl_p99_ms", -1))
# Tail latencies are judged only where every measurement's p99 rests on enough samples: below that a p99 is
# little more than the largest value seen, and its interval over repeats would flatter it.
TAIL_METRICS = {"ttft_p99_ms": "latency_requests", "itl_p99_ms": "itl_samples", "tpot_p99_ms": "latency_requests",
                "e2e_p99_ms": "latency_requests"}
TAIL_MIN_SAMPLES = 100
THROUGHPUT_METRICS = {"total_tok_s", "per_request_tok_s", "prompt_tok_s", "goodput_rps"}
# ... and only on three measurements a side: a p99 moves between launches far more than a mean (on the
# simulated A5000 pair, one cell's ITL p99 read 5.9-8.7 ms over six launches of identical servers), and two
# values a side can come out close by chance and make Welch's test call a difference that is not there (a
# CI run read a Holm-significant "better" ITL p99 between two identical flag sets this way).
TAIL_MIN_REPEATS = 3
# ... and only where the client's own timing noise (its event loop's p99 lateness, which every token time it
# stamps carries) is under MIN_EFFECT of the tail itself: a 6 ms ITL p99 stamped by a loop that runs 0.5 ms
# late one time in a hundred moves by more than a 3% change on the host's whim, not the server's.
# Measured only where NVML is: no row at all for a cell where neither side has the value (a CPU run, the simulator).
TELEMETRY_METRICS = {"energy_j_per_token"}
PREFILL_METRICS = (("prompt_tok_s", 1), ("ttft_ms", -1))
# An open-loop rate cell: what a service gets at that load. The achieved rate is what was offered, not judged.
RATE_METRICS = (("goodput_rps", 1), ("slo_met_fraction", 1), ("total_tok_s", 1), ("ttft_ms", -1), ("tpot_ms", -1),
                ("ttft_p99_ms", -1), ("tpot_p99_ms", -1), ("e2e_p99_ms", -1))
PHASE_METRICS = {"decode": DECODE_METRICS, "prefill": PREFILL_METRICS, "rate": RATE_METRICS}
FACT_FIELDS = ("kv_cache_tokens", "max_concurrency", "block_size", "max_num_batched_tokens",
               "gpu_memory_utilization", "max_model_len")
MAX_ADVISED_REPEATS = 100  # beyond this the advice is to find the noise, not to repeat
MIN_EFFECT = 0.03        # changes smaller than 3% are inside noise even when the interval excludes zero
FAMILY_ALPHA = 0.05      # the family-wise error rate of one variant's tests (Holm)
DRIFT_LIMIT = 0.05       # the baseline moving more than this between first and last launch is drift
CLOCK_DRIFT_LIMIT = 0.05  # ... and its median SM clock (GPU telemetry) moving more than this
POWER_DRIFT_LIMIT = 0.10  # ... and its median power (it follows the load, so a wider limit)
AGENT_CONTEXT = 8000     # the seed's "agents at 8K context" row
KV_DECISIVE_PCT = 1.0    # a KV-cache change this large decides keep/revert like a measured one
# Experiment values that describe the server but should not decide keep or revert on their own (they are
# still tested, and Holm-adjusted, with the rest of the variant's family).
DIAGNOSTIC_METRICS = {"generation_tok_s_drop_pct", "speedup", "shared_first_hit_rate", "silence_s_per_1k_prompt_tokens",
                      "mean_total_tok_s", "peak_waiting", "peak_running", "completed", "queued",
                      "ran_concurrently"}


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


def family_wise(cells: list[CellDiff], *, alpha: float = FAMILY_ALPHA) -> int:
    """Holm over every tested cell and metric of one variant, in place: a better/worse verdict stands only where
    the adjusted p-value is below alpha; the rest read inside noise, saying why. Returns the family's size."""
    tested = [(c, i) for c in cells for i, m in enumerate(c.metrics) if m.p_value is not None]
    adjusted = holm([c.metrics[i].p_value or 0.0 for c, i in tested])
    for (cell, index), p_holm in zip(tested, adjusted, strict=True):
        m = cell.metrics[index]
        m = replace(m, p_holm=p_holm)
        if m.verdict in {"better", "worse"} and p_holm >= alpha:
            note = (f"{m.verdict} on its own (p={m.p_value:.3f}), inside noise across the variant's {len(tested)} "
                    f"tests (Holm p={p_holm:.2f})")
            m = replace(m, verdict="inside noise", note=note)
        cell.metrics[index] = m
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
    # How the variant's `gpu-memory-utilization: suggested` was resolved: suggested, margin, resolved.
    suggested: dict[str, Any] | None = None
    outcome: Outcome = "not settled"
    provisional: bool = False     # rests on launch facts alone: one measurement a side
    tests: int = 0                # the family: cells and metrics tested, Holm-adjusted together
    alpha: float = FAMILY_ALPHA

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
        if not self.comparable:
            return f"no test: not comparable ({self.not_comparable_reason})"
        if not self.tests:
            return ("no test: no cell and metric has two or more Valid measurements on both sides, so no better or "
                    "worse verdict is possible")
        line = (f"{self.tests} tests (cells x metrics), better/worse only where Holm's adjusted p < "
                f"{self.alpha:g} (family-wise error {100 * self.alpha:g}%)")
        if self.aa:
            judged = sum(1 for c in self.cells for m in c.metrics if m.verdict in {"better", "worse"})
            line += (f"; A/A (the baseline's own flags): {judged} of {self.tests} beyond noise after Holm, "
                     f"{self.beyond_noise_alone} on their own 95% intervals (this rig's per-test false positives)")
        return line


def _facts_by_variant(run: RunDir) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """The first successful launch's facts and flags per variant."""
    facts: dict[str, dict[str, Any]] = {}
    flags: dict[str, dict[str, Any]] = {}
    for server in run.ready_servers():
        if server.variant not in facts:
            facts[server.variant] = server.facts.model_dump()
            flags[server.variant] = server.flags
    return facts, flags


def _suggested(run: RunDir, variant: str) -> dict[str, Any] | None:
    return next((s.suggested for s in run.ready_servers() if s.variant == variant), None)


def _pct(before: Any, after: Any) -> float | None:
    if isinstance(before, int | float) and isinstance(after, int | float) and before:
        return 100.0 * (after - before) / before
    return None


def diff_run(run: RunDir, *, baseline: str | None = None, other: RunDir | None = None,
             force: bool = False) -> list[VariantDiff]:
    """Every variant against the baseline (in one run), or every variant of `other` against `run`'s baseline."""
    manifest = run.manifest()
    planned = manifest.matrix_model()
    base_name = baseline or planned.baseline
    # Per-variant references (compare_to) apply when no baseline is forced on the command line.
    references = {} if baseline else {v.name: v.compare_to for v in planned.variants if v.compare_to}
    cells = run.cells()
    facts, flags = _facts_by_variant(run)
    if other is not None:
        other_cells = other.cells()
        other_facts, other_flags = _facts_by_variant(other)
        # Name the other run's variants apart so the same names can be compared across runs.
        cells += [StoredCell(f"{c.variant}@B", c.repeat, c.result, c.path, c.launch) for c in other_cells]
        facts.update({f"{k}@B": v for k, v in other_facts.items()})
        flags.update({f"{k}@B": v for k, v in other_flags.items()})
    by_variant: dict[str, list[StoredCell]] = defaultdict(list)
    for cell in cells:
        by_variant[cell.variant].append(cell)
    experiments: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for stored in run.experiments():
        experiments[stored.variant].append(stored.result.model_dump())
    if other is not None:
        for stored in other.experiments():
            experiments[f"{stored.variant}@B"].append(stored.result.model_dump())
    if base_name not in by_variant and base_name not in facts:
        from campaign.core.errors import CampaignError

        raise CampaignError(f"baseline {base_name!r} has no measurements in {run.root}",
                            hint=f"variants measured: {', '.join(sorted(by_variant)) or 'none'}")
    diffs = []
    default_base = base_name
    models = _gpu_models(run) | ({f"{k}@B": v for k, v in _gpu_models(other).items()} if other is not None else {})
    # A variant that never became ready has failure records only: its start-up failure is a result too.
    failed = {s.variant for s in run.failures()} - set(facts)
    for name in failed:
        flags.setdefault(name, next((dict(v.flags) for v in planned.variants if v.name == name), {}))
    for variant in sorted(set(by_variant) | set(facts) | failed):
        base_name = references.get(variant) or default_base
        if variant == base_name or (variant == default_base and variant not in references):
            continue
        reason = _incomparable(facts.get(base_name), facts.get(variant), manifest,
                               other.manifest() if other is not None and variant.endswith("@B") else manifest)
        reason = reason or _gpu_models_differ(models.get(base_name), models.get(variant))
        comparable = force or not reason
        diff = VariantDiff(
            variant=variant, baseline=base_name,
            flag_changes=_flag_changes(flags.get(base_name, {}), flags.get(variant, {})),
            fact_changes=[(f, (facts.get(base_name) or {}).get(f), (facts.get(variant) or {}).get(f),
                           _pct((facts.get(base_name) or {}).get(f), (facts.get(variant) or {}).get(f)))
                          for f in FACT_FIELDS
                          if (facts.get(base_name) or {}).get(f) != (facts.get(variant) or {}).get(f)],
            cells=_cell_diffs(by_variant.get(base_name, []), by_variant.get(variant, []), comparable)
            + _experiment_diffs(experiments.get(base_name, []), experiments.get(variant, []), comparable),
            comparable=comparable, not_comparable_reason=reason,
        )
        diff.suggested = _suggested(other if other is not None and variant.endswith("@B") else run,
                                    variant.removesuffix("@B"))
        diff.tests = family_wise(diff.cells) if comparable else 0
        diff.outcome, diff.provisional, diff.recommendation = recommend(diff, facts.get(base_name),
                                                                        facts.get(variant))
        diffs.append(diff)
    return diffs


def _incomparable(base: dict[str, Any] | None, other: dict[str, Any] | None, manifest_a: Manifest,
                  manifest_b: Manifest) -> str:
    if base is None or other is None:
        return ""
    for key, label in (("vllm_version", "vLLM version"), ("device", "device")):
        if base.get(key) != other.get(key):
            return f"different {label}: {base.get(key)} vs {other.get(key)}"
    model_a = manifest_a.profile_model().model
    model_b = manifest_b.profile_model().model
    if model_a != model_b:
        return f"different model: {model_a} vs {model_b}"
    gpus_a = manifest_a.machine.gpu_names()
    gpus_b = manifest_b.machine.gpu_names()
    if gpus_a != gpus_b:
        return f"different GPUs: {gpus_a} vs {gpus_b}"
    return ""


def _gpu_models(run: RunDir) -> dict[str, frozenset[str]]:
    """The GPU models (NVML names) each variant's launches ran on, from their placements (pool runs)."""
    out: dict[str, set[str]] = defaultdict(set)
    for _, placed in run.placements():
        out[placed.variant].update(g.name for g in placed.gpus or [] if g.name)
    return {variant: frozenset(names) for variant, names in out.items() if names}


def _gpu_models_differ(base: frozenset[str] | None, other: frozenset[str] | None) -> str:
    if not base or not other or base == other:
        return ""
    return f"different GPUs: {', '.join(sorted(base))} vs {', '.join(sorted(other))}"


def _flag_changes(base: dict[str, Any], other: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    keys = sorted(set(base) | set(other))
    return [(k, base.get(k), other.get(k)) for k in keys if base.get(k) != other.get(k)]


def _values(cells: list[StoredCell], key: str, metric: str) -> list[float]:
    values = []
    for cell in cells:
        value = getattr(cell.result, metric)
        if cell.result.spec.key == key and cell.result.status == "Valid" and value is not None:
            values.append(float(value))
    return values


# Medians over a measurement's requests (phase, metric -> each request's value), whose own error is the
# least variance a measurement of them carries (`_spread`). In a decode cell of streams in lockstep, each
# wave's replacements reach the server within a step of each other; whether they are prefilled in one step
# or split over two is decided by the client's timing to the microsecond, so one measurement's TTFT median
# can land in either mode: the simulated A5000 pair read 208, 209 ms against 159, 160 ms for identical flags
# in a CI run, and Welch's test on two close values a side called that "better". The requests of the
# 159 ms measurements spanned both modes, which their median's error says.
MEDIAN_OF_REQUESTS: dict[tuple[str, str], Callable[[RequestRecord], float | None]] = {
    ("decode", "ttft_ms"): lambda r: r.ttft_s}


def _median_floor(cells: list[StoredCell], key: str, metric: str) -> float:
    """The mean over a side's Valid measurements of its median's squared error, from its stored requests, in
    the metric's own units (0 where the metric is no such median or no requests were stored)."""
    errors = []
    for cell in cells:
        r = cell.result
        value_of = MEDIAN_OF_REQUESTS.get((r.phase, metric))
        value = getattr(r, metric, None)
        if r.spec.key != key or r.status != "Valid" or value_of is None or value is None:
            continue
        samples = [v for v in map(value_of, r.records) if v is not None]
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


def _cell_diffs(base: list[StoredCell], other: list[StoredCell], comparable: bool) -> list[CellDiff]:
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
        if statuses or base_statuses:
            diff.status_note = "; ".join(
                part for part in (
                    f"variant: {', '.join(sorted(statuses))}" if statuses else "",
                    f"baseline: {', '.join(sorted(base_statuses))}" if base_statuses else "") if part)
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
            diff.metrics.append(verdict_for(_values(base, key, metric), _values(other, key, metric), direction,
                                            metric, floors))
        out.append(diff)
    return out


def _experiment_diffs(base: list[dict[str, Any]], other: list[dict[str, Any]], comparable: bool) -> list[CellDiff]:
    """Experiments compare like cells, on their headline values."""
    from campaign.measure.study import value_direction

    keys = sorted({r["key"] for r in base + other})
    out = []
    for key in keys:
        diff = CellDiff(key=key, phase="experiment", context_tokens=0, concurrency=0, label="experiment")
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
            diff.metrics.append(_within_resolution(verdict, [r for r in base + other if r["key"] == key]))
        out.append(diff)
    return out


def _within_resolution(verdict: MetricVerdict, results: list[dict[str, Any]]) -> MetricVerdict:
    """A capacity search answers to within its bracket (the last passing and first failing values): two
    searches that land one bisection step apart in every repeat differ by no more than that step, so a change
    no larger than the widest bracket on either side is inside the search's resolution, never better or
    worse."""
    axis = {"max_rate_rps": "slo_search", "max_concurrency": "concurrency_search"}.get(verdict.metric)
    if axis is None or verdict.verdict not in {"better", "worse"} or verdict.change_pct is None:
        return verdict
    widths = []
    for result in results:
        found = (result.get("details") or {}).get(axis) or {}
        low = found.get("last_pass_rps", found.get("last_pass"))
        high = found.get("first_fail_rps", found.get("first_fail"))
        if low and high:
            widths.append(100.0 * (high - low) / low)
    width = max(widths, default=0.0)
    if abs(verdict.change_pct) > width:
        return verdict
    return replace(verdict, verdict="inside noise",
                   note=f"within the search's resolution (its brackets are up to {width:.0f}% wide)")


def _experiment_values(results: list[dict[str, Any]], key: str, name: str) -> list[float]:
    return [float(r["values"][name]) for r in results
            if r["key"] == key and r["status"] == "Valid" and r["values"].get(name) is not None]


def _fmt_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


# A cell neither side could measure for a reason other than capacity leaves the comparison open.
_UNJUDGED = {"Invalid", "Contaminated", "Failed"}


def _kv_text(base_facts: dict[str, Any] | None, facts: dict[str, Any], kv_change: float) -> str:
    kv_base, kv = (base_facts or {}).get("kv_cache_tokens"), facts.get("kv_cache_tokens")
    text = f"KV cache {kv_change:+.1f}%"
    windows = [w for w in ((base_facts or {}).get("max_model_len"), facts.get("max_model_len")) if isinstance(w, int)]
    agents_a = agents_that_fit(kv_base, AGENT_CONTEXT, (base_facts or {}).get("block_size"),
                               (base_facts or {}).get("max_model_len"))
    agents_b = agents_that_fit(kv, AGENT_CONTEXT, facts.get("block_size"), facts.get("max_model_len"))
    if windows and AGENT_CONTEXT > min(windows):
        text += f" (agents at 8K context: none, beyond the {min(windows):,}-token window)"
    elif agents_a is not None and agents_b is not None and agents_a != agents_b:
        text += f", agents at 8K context {agents_a} -> {agents_b}"
    return text


def _listed(items: list[str], limit: int = 3) -> str:
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _settle_advice(diff: VariantDiff) -> str:
    """How many repeats would settle it, from the noise seen on the cells' primary metrics: "run N repeats"."""
    needed = sorted(m.repeats_needed for c in diff.cells for m in c.metrics
                    if m.repeats_needed is not None and m.metric in {"total_tok_s", "prompt_tok_s"})
    if not needed:
        return "run at least 2 repeats a side to know the noise (campaign run --resume RUN --repeats 2)"
    typical = needed[len(needed) // 2]
    if typical > MAX_ADVISED_REPEATS:
        return f"find the noise's cause: over {MAX_ADVISED_REPEATS} repeats a side would be needed to resolve 3%"
    return (f"run {typical} repeats (campaign run --resume RUN --repeats {typical}; at this noise {typical} a side "
            f"resolve a {100 * MIN_EFFECT:g}% change)")


CAPACITY_UNITS = {"max_rate_rps": "req/s", "max_concurrency": "streams"}


def _capacity_texts(diff: VariantDiff) -> list[str]:
    """Capacity at the SLO, baseline -> variant, from the slo-search experiments: for a service, the line that
    matters ("capacity at SLO 6.1 -> 7.4 req/s"), with what the test said of it."""
    out = []
    for cell in diff.cells:
        for m in cell.metrics:
            unit = CAPACITY_UNITS.get(m.metric)
            if unit is None or m.baseline is None or m.variant is None:
                continue
            what = "capacity at SLO" if m.metric == "max_rate_rps" else "concurrency at SLO"
            out.append(f"{what} {m.baseline:.3g} -> {m.variant:.3g} {unit} ({m.verdict})")
    return out


def recommend(diff: VariantDiff, base_facts: dict[str, Any] | None,
              facts: dict[str, Any] | None) -> tuple[Outcome, bool, str]:
    """Keep, revert, no difference or not settled, for the variant as a whole, in one plain sentence.

    Better/worse verdicts are family-wise (Holm) already. Revert needs evidence of harm (a metric worse, the KV
    cache 1% or more smaller, cells newly over capacity) or of cost without benefit (a smaller KV loss and
    nothing better: seed 000 reverted a chunk change whose only effect was -0.8% of cache); keep needs a
    benefit and no harm; harm and benefit together are a trade-off, unless the only benefit is a latency tail
    and the harm is not (a tail does not buy back throughput or capacity: revert); a speculative-decoding
    change is not judged on the speed of random-id cells at all; cells that could not be measured leave it
    not settled; an A/A can only come out "no difference". With one measurement a side nothing measured is
    judged, and the launch facts decide provisionally. Returns (outcome, provisional, sentence)."""
    changes = ", ".join(f"{k} {_fmt_value(a)} -> {_fmt_value(b)}" for k, a, b in diff.flag_changes) or (
        "no flag change (A/A)")
    if not diff.comparable:
        return "not settled", False, f"{changes}: not comparable ({diff.not_comparable_reason}): not settled"
    if facts is None:
        if base_facts is None:
            return "not settled", False, f"{changes}: neither server became ready; nothing to compare: not settled"
        return "revert", False, f"{changes}: the server never became ready with these flags: revert"
    # A change of speculative decoding measured on random token ids: their speed says nothing of text, so those
    # cells decide nothing (other changes on a speculative server are measured like any other).
    spec_changed = any(k.replace("_", "-").lstrip("-") == "speculative-config" for k, _, _ in diff.flag_changes)
    random_spec = [c.key for c in diff.cells if spec_changed
                   and Reason.SPEC_RANDOM_PROMPTS in c.variant_reasons + c.baseline_reasons]
    decisive = [(c, m) for c in diff.cells for m in c.metrics
                if m.metric not in DIAGNOSTIC_METRICS and c.key not in random_spec]
    text_judged = any(m.p_value is not None for c, m in decisive if c.phase == "decode")
    # A cell whose throughput is worse is not better because one of its latency tails is: a faster p99 gap
    # where tokens per second fell is the same change seen through a percentile, not a second benefit.
    slower = {c.key for c, m in decisive if m.metric in THROUGHPUT_METRICS and m.verdict == "worse"}
    better = [f"{m.metric} at {c.key}" for c, m in decisive if m.verdict == "better"
              and not (m.metric in TAIL_METRICS and c.key in slower)]
    worse = [f"{m.metric} at {c.key}" for c, m in decisive if m.verdict == "worse"]
    judged = any(m.p_value is not None for c in diff.cells for m in c.metrics)
    one_measurement = any(m.verdict == "not judged" and m.n_baseline and m.n_variant
                          for c in diff.cells for m in c.metrics)
    # Over capacity is exact without repeats: a cell the baseline ran and the variant cannot is lost capacity.
    lost = [c.key for c in diff.cells if "Over capacity" in c.variant_statuses and "Over capacity" not in
            c.baseline_statuses]
    gained = [c.key for c in diff.cells if "Over capacity" in c.baseline_statuses and "Over capacity" not in
              c.variant_statuses]
    unjudged = [c for c in diff.cells if _UNJUDGED & set(c.variant_statuses + c.baseline_statuses)]
    kv_change = _pct((base_facts or {}).get("kv_cache_tokens"), facts.get("kv_cache_tokens"))
    kv_gain = kv_change is not None and kv_change >= KV_DECISIVE_PCT
    kv_loss = kv_change is not None and kv_change <= -KV_DECISIVE_PCT

    parts: list[str] = []
    if better:
        parts.append(f"better: {_listed(better)}")
    if worse:
        parts.append(f"worse: {_listed(worse)}")
    if kv_change is not None and abs(kv_change) >= 0.05:
        parts.append(_kv_text(base_facts, facts, kv_change))
    if lost:
        parts.append(f"over capacity now in {_listed(lost)}")
    if gained:
        parts.append(f"no longer over capacity in {_listed(gained)}")
    parts += _capacity_texts(diff)
    if random_spec:
        parts.append(f"speculative decoding measured on random prompts in {_listed(random_spec)}, not judged on "
                     f"speed ({REASON_HINTS[Reason.SPEC_RANDOM_PROMPTS]})")
    if unjudged:
        codes = sorted({code for c in unjudged for code in c.variant_reasons + c.baseline_reasons})
        why = "; ".join(f"{code.value}: {REASON_HINTS[code]}" for code in codes) or "see the cells' reasons"
        parts.append(f"{len(unjudged)} cell(s) not valid ({_listed([c.key for c in unjudged])}; {why})")

    def sentence(verdict: str) -> str:
        return f"{changes}: {'; '.join(parts)}: {verdict}" if parts else f"{changes}: {verdict}"

    gain, loss = kv_gain or bool(gained), kv_loss or bool(lost)
    if diff.aa and (better or worse or gain or loss):
        return "not settled", False, sentence(
            "not settled: an A/A cannot differ, so these are false positives or launch-to-launch variation "
            "(noise this rig's intervals do not capture)")
    if not judged:
        # Issue 20: one measurement a side is not evidence (nor are cells never Valid on both sides); only the
        # launch facts are exact, so they decide, provisionally.
        why = "one measurement" if one_measurement else "no cell measured on both sides"
        advice = _settle_advice(diff)
        if gain and not loss:
            return "keep", True, sentence(f"keep, provisionally ({why}: {advice} to confirm)")
        if loss and not gain:
            return "revert", True, sentence(f"revert, provisionally ({why}: {advice} to confirm)")
        if one_measurement:
            return "not settled", False, sentence(f"not settled (one measurement a side: {advice} to settle it)")
    # 1% or more of the KV cache counts like a faster or slower cell; a smaller loss is still a cost.
    harm = bool(worse) or kv_loss or bool(lost)
    benefit = bool(better) or kv_gain or bool(gained)
    # A faster latency tail alone does not buy back lost throughput or capacity: only a rate, a first-token
    # time or more cache can stand against a harm (issue 15: a drafter model, p99 gaps shorter at 8 streams,
    # the cache cut 5x and 64 streams no longer served).
    rate_benefit = kv_gain or bool(gained) or any(
        m.verdict == "better" and m.metric not in TAIL_METRICS for _, m in decisive)
    rate_harm = kv_loss or bool(lost) or any(m.verdict == "worse" and m.metric not in TAIL_METRICS
                                             for _, m in decisive)
    cost = kv_change is not None and kv_change <= -0.05 and not diff.aa
    # Streams the baseline served that the variant cannot hold at all (over capacity now, and a smaller cache)
    # are not weighed against a faster cell elsewhere: seed 000 reverted a drafter that cut the cache 5x.
    if lost and kv_loss and not gained and not kv_gain:
        return "revert", False, sentence("revert (it can no longer serve what the baseline served)")
    if harm and (rate_benefit or (benefit and not rate_harm)):
        return "not settled", False, sentence("not settled: a trade-off, decide by which matters more")
    if harm and benefit:
        return "revert", False, sentence("revert (a better latency tail does not buy back what was lost)")
    if harm:
        return "revert", False, sentence("revert")
    if random_spec and not text_judged:
        return "not settled", False, sentence(
            "not settled: speculative decoding cannot be judged on random prompts alone")
    if unjudged:
        return "not settled", False, sentence("not settled until those cells are measured")
    if benefit:
        return "keep", False, sentence("keep")
    if cost:
        return "revert", False, sentence("revert (a cost with no benefit)")
    if not judged:
        return "not settled", False, sentence("not settled: no comparable measurements")
    noise = f"no difference: nothing beyond noise in {diff.tests} tests at family-wise {100 * diff.alpha:g}%"
    # Values that describe the server but do not decide (DIAGNOSTIC_METRICS) may still have moved: saying
    # "nothing beyond noise" over a 250% longer queue at overload would be a plausible wrong sentence.
    moved = [f"{m.metric} at {c.key} {m.verdict}" for c in diff.cells for m in c.metrics
             if m.metric in DIAGNOSTIC_METRICS and m.verdict in {"better", "worse"}]
    if moved:
        noise = (f"no difference: no deciding metric beyond noise in {diff.tests} tests at family-wise "
                 f"{100 * diff.alpha:g}%; moved, but describing the server rather than deciding: {_listed(moved)}")
    return "no difference", False, sentence(noise)


def short_answers_by_variant(run: RunDir) -> dict[str, dict[str, Any]]:
    """The study's short answers per variant, from stored files only (measured variants first)."""
    from campaign.measure import answers

    facts, flags = _facts_by_variant(run)
    cells: dict[str, list[Any]] = defaultdict(list)
    for stored in run.cells():
        cells[stored.variant].append(stored.result)
    manifest = run.manifest()
    profile = manifest.profile_model()
    floors = manifest.matrix_model().floors or answers.DEFAULT_FLOORS
    searches: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in run.experiments():
        if record.result.kind == "slo-search":
            searches[record.variant].append(record.result.model_dump(mode="json"))
    return {v: answers.short_answers(cells=cells.get(v, []), facts=facts.get(v), flags=flags.get(v, {}),
                                     floors=floors, hardware=profile.hardware,
                                     model_shape=profile.model_shape, time_scale=manifest.time_scale,
                                     searches=searches.get(v, []))
            for v in sorted(set(facts) | set(cells), key=lambda name: name not in cells)}


@dataclass(frozen=True)
class Drift:
    checked: bool
    drifted: bool
    median_change_pct: float | None
    message: str
    # GPU telemetry of the same cells (None without it): did the GPU itself change through the night?
    sm_clock_change_pct: float | None = None
    power_change_pct: float | None = None
    moved: tuple[str, ...] = ()   # what moved beyond its limit: "throughput", "SM clock", "power"


def _gpu_medians(cell: StoredCell) -> tuple[float | None, float | None]:
    """Median SM clock and power of a stored cell's raw GPU samples; None where it has none."""
    try:
        # A warm guard's re-measurement that stands in for the cell carries its own samples.
        record: CellRecord | GuardRecord = (read_record(cell.path, GuardRecord) if cell.path.name.startswith("guard-")
                                            else read_record(cell.path, CellRecord))
        samples = record.gpu_telemetry
    except (OSError, ResultFormatError):
        return None, None
    if not samples:
        return None, None
    return gpu.sm_clock_median(samples), gpu.power_median(samples)


def _median_change(pairs: list[tuple[float | None, float | None]]) -> tuple[float | None, int]:
    changes = [(b - a) / a for a, b in pairs if a and b is not None]
    return (statistics.median(changes), len(changes)) if changes else (None, 0)


def drift(run: RunDir) -> Drift:
    """The baseline's first launch against its last: did the machine change through the night? Throughput, and
    where GPU telemetry exists the median SM clock and power of the same cells (a GPU that warmed up and clocks
    down, or one whose power limit changed, shows there before it hides in a throughput difference)."""
    baseline = run.manifest().matrix_model().baseline
    cells = [c for c in run.cells() if c.variant == baseline and c.result.status == "Valid"]
    repeats = sorted({c.repeat for c in cells})
    if len(repeats) < 2:
        return Drift(False, False, None, "drift not checked: the baseline was measured once")
    first, last = repeats[0], repeats[-1]
    changes = []
    clocks: list[tuple[float | None, float | None]] = []
    powers: list[tuple[float | None, float | None]] = []
    for cell in (c for c in cells if c.repeat == first):
        metric = primary_metric(cell.result.phase)
        later = [c for c in cells if c.repeat == last and c.result.spec.key == cell.result.spec.key]
        a, b = getattr(cell.result, metric), getattr(later[0].result, metric) if later else None
        if a and b is not None:
            changes.append((b - a) / a)
            (clock_a, power_a), (clock_b, power_b) = _gpu_medians(cell), _gpu_medians(later[0])
            clocks.append((clock_a, clock_b))
            powers.append((power_a, power_b))
    if not changes:
        return Drift(False, False, None, "drift not checked: no cell measured in both the first and last launch")
    median = statistics.median(changes)
    clock, clock_n = _median_change(clocks)
    power, power_n = _median_change(powers)
    moved = tuple(name for name, change, limit in (("throughput", median, DRIFT_LIMIT),
                                                   ("SM clock", clock, CLOCK_DRIFT_LIMIT),
                                                   ("power", power, POWER_DRIFT_LIMIT))
                  if change is not None and abs(change) > limit)
    drifted = bool(moved)
    gpu_part = ""
    if clock is not None or power is not None:
        figures = [f"{name} {100 * change:+.1f}%" for name, change in (("SM clock", clock), ("power", power))
                   if change is not None]
        gpu_part = f", {', '.join(figures)} (GPU telemetry of {max(clock_n, power_n)} cells)"
    limits = f"{100 * DRIFT_LIMIT:.0f}% drift limit" if not gpu_part else (
        f"drift limits ({100 * DRIFT_LIMIT:.0f}% throughput, {100 * CLOCK_DRIFT_LIMIT:.0f}% SM clock, "
        f"{100 * POWER_DRIFT_LIMIT:.0f}% power)")
    message = (f"baseline moved {100 * median:+.1f}% (median over {len(changes)} cells){gpu_part} between its first "
               f"and last launch; " + (f"DRIFTED ({' and '.join(moved)} moved): differences below this size are not "
                                       "trustworthy" if drifted else f"within the {limits}"))
    return Drift(True, drifted, 100 * median, message,
                 sm_clock_change_pct=None if clock is None else 100 * clock,
                 power_change_pct=None if power is None else 100 * power, moved=moved)


# Two GPU sets of one pool reading further apart than this (median over the same variant's same cells) are
# worth a look (clocks, power limits, PCIe width, cooling), as drift beyond its limit is.
GPU_EFFECT_LIMIT = DRIFT_LIMIT


@dataclass(frozen=True)
class GpuEffect:
    checked: bool
    message: str
    # Each GPU set against the first: median change of the primary metric, percent.
    changes_pct: dict[str, float] = field(default_factory=dict)
    balanced: bool = True     # every variant measured as often on each GPU set: the effect cancels in its diff


def gpu_effect(run: RunDir) -> GpuEffect:
    """On a GPU pool: did one set of GPUs read faster than another? For every variant and cell measured on
    two GPU sets, the median of its repeats on each; the effect of a set is the median change against the
    first set. The pool swaps each variant's repeats across the sets, so where every variant has as many
    launches on each set, the effect cancels in the variant-against-baseline diffs the way drift does."""
    # By launch folder: a relaunch, a lost node's retry or a resume on another pool each has its own placement.
    where: dict[tuple[str, str], str] = {}
    for launch_dir, placed in run.placements():
        if placed.executor == "pool" and placed.gpus:
            where[(placed.variant, Path(launch_dir).name)] = ",".join(str(g.index) for g in placed.gpus)
    sets = sorted(set(where.values()), key=lambda s: [int(i) for i in s.split(",")])
    if len(sets) < 2:
        return GpuEffect(False, "GPU effect not checked: the launches ran on one set of GPUs")
    values: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for cell in run.cells():
        placed_on = where.get((cell.variant, cell.launch or ""))
        value = getattr(cell.result, primary_metric(cell.result.phase))
        if placed_on is not None and cell.result.status == "Valid" and value:
            values[(cell.variant, cell.result.spec.key)][placed_on].append(float(value))
    first = sets[0]
    changes: dict[str, list[float]] = defaultdict(list)
    for per_set in values.values():
        if first not in per_set:
            continue
        reference = statistics.median(per_set[first])
        for other in sets[1:]:
            if other in per_set:
                changes[other].append(statistics.median(per_set[other]) / reference - 1)
    if not changes:
        return GpuEffect(False, "GPU effect not checked: no cell was measured on two sets of GPUs")
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for (variant, _), placed_on in where.items():
        counts[variant][placed_on] += 1  # launches a variant had on each set (a relaunch counts too)
    balanced = all(len(set(c.values())) == 1 and len(c) == len(sets) for c in counts.values())
    pct = {other: 100 * statistics.median(found) for other, found in changes.items()}
    parts = [f"GPUs {other} read {value:+.1f}% against GPUs {first} (median over {len(changes[other])} cells)"
             for other, value in pct.items()]
    beyond = [other for other, value in pct.items() if abs(value) > 100 * GPU_EFFECT_LIMIT]
    verdict = (f"beyond {100 * GPU_EFFECT_LIMIT:.0f}% on GPUs {', '.join(beyond)}: check their clocks, power "
               "limits and cooling" if beyond else f"within {100 * GPU_EFFECT_LIMIT:.0f}%")
    cancel = ("each variant ran as often on each set, so it cancels in the diffs" if balanced else
              "some variants ran more often on one set: the diffs carry part of it")
    return GpuEffect(True, f"{'; '.join(parts)}; {verdict}; {cancel}", pct, balanced)


def summary_record(run: RunDir, *, drift_: Drift, diffs: list[VariantDiff],
                   short: dict[str, dict[str, Any]]) -> SummaryRecord:
    """summary.json: what a finished run concluded (drift, short answers, each variant's verdict)."""
    return SummaryRecord(
        drift=DriftRecord(checked=drift_.checked, drifted=drift_.drifted, median_change_pct=drift_.median_change_pct,
                          message=drift_.message, sm_clock_change_pct=drift_.sm_clock_change_pct,
                          power_change_pct=drift_.power_change_pct, moved=list(drift_.moved)),
        short_answers={v: ShortAnswers.model_validate(a) for v, a in short.items()},
        vllm_versions=sorted({str(s.facts.vllm_version) for s in run.ready_servers()}),
        recommendations={d.variant: d.recommendation for d in diffs},
        outcomes={d.variant: OutcomeRecord(outcome=d.outcome, provisional=d.provisional, tests=d.tests,
                                           family_wise_alpha=d.alpha, aa=d.aa) for d in diffs})
