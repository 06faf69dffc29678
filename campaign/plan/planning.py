"""How long a campaign will take, launch by launch, and how long the last one really took.

An estimate is built from token counts and rates: what each cell and each experiment sends (the
context-window probe on a 131K-token window sends two prompts of about 131K tokens), at the prefill and
decode rates and the start-up time the last run of the same campaign measured, or at stated guesses when
there is none. After a run, each launch's actual time (start to stopped, from server.json and stop.json)
stands beside its estimate, and the next plan scales its estimate by how far off the last one was. A launch's
estimate leaves out the cells it will not run, as far as the last run says what its server became: over
capacity at its variant's KV cache (skipped), or past its window (max-model-len).

A plan also says, per variant, the smallest change its launches can tell apart from the rig's noise (how much
a cell's headline figure moves between launches: measured by the last run, else stated in the profile), given
how many tests the variant's verdicts will rest on, and warns when that is above the matrix's minimum effect.

Long (about 580 lines): the estimate, what each launch will not run, the rig's noise and the plan that prints
them read the same last run, and are kept in one place so that the plan and the night's ETA agree.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from campaign.core import stats
from campaign.core.errors import CampaignError
from campaign.core.progress import fmt_duration
from campaign.core.vllm_flags import BOUNDS, merge, number_of, value_of
from campaign.measure.cells import CellSpec, Finding, Reason, kv_tokens_needed, over_capacity, primary_metric
from campaign.measure.judged import FAMILY_ALPHA, PHASE_METRICS, TAIL_METRICS, TAIL_MIN_REPEATS, TELEMETRY_METRICS
from campaign.plan.limits import reach
from campaign.server.profiles import LaunchProfile
from campaign.server.startup_log import StartupFacts
from campaign.spec.matrix import (
    AUTO_MAX_REPEATS,
    AgentsExperiment,
    ContextWindowExperiment,
    Experiment,
    LongContextExperiment,
    Matrix,
    OverloadExperiment,
    PrefixOrderExperiment,
    RepeatExperiment,
    SloSearchExperiment,
    schedule,
)
from campaign.stored.store import RunDir

# Stated guesses where no earlier run measured the server: about the A5000 pair's prefill (seed 000's ~1,000
# prompt tokens/s) and a slow single stream; a GPU server's start-up (weights, compile, CUDA graphs).
GUESS_PREFILL_TOK_S = 1000.0
GUESS_DECODE_TOK_S = 30.0
GUESS_LAUNCH_S = 90.0
STEP_OVERHEAD_S = 2.0  # per bracketed step: the /metrics scrapes before and after, a request's round trip


@dataclass(frozen=True)
class Noise:
    """How much a cell's headline figure (cells.primary_metric) moves between launches of the same server: the
    relative sample spread of one launch's value (0.13: 13%), and where that figure comes from, a phrase read
    after "13% between launches, " ("from run ...", "stated in the profile: ..."). None: unknown."""

    cv: float | None = None
    source: str | None = None


UNKNOWN_NOISE = Noise()


@dataclass(frozen=True)
class Rates:
    prefill_tok_s: float
    decode_tok_s: float  # one stream's generation rate
    launch_s: float  # from starting the process to ready
    source: str  # said with every estimate: measured where, or guessed
    correction: float = 1.0  # the last run's actual / estimated time per launch (its median)
    noise: Noise = UNKNOWN_NOISE  # between launches, from the same run (or profile) as the rates
    # Each variant's server as the last run found it (KV cache, block size, window): what its launches skip.
    servers: dict[str, StartupFacts] = field(default_factory=dict)


GUESSED = Rates(GUESS_PREFILL_TOK_S, GUESS_DECODE_TOK_S, GUESS_LAUNCH_S,
                "guessed: there is no earlier run of this campaign to measure them from")


@dataclass(frozen=True)
class Power:
    """The smallest change one variant's verdicts can tell from the rig's noise: `launches_a_side` launches a
    side (with `repeats: auto`, the most it will run), `tests` judged together at family-wise FAMILY_ALPHA."""

    variant: str
    launches_a_side: int
    until_settled: bool  # `repeats: auto`: launches_a_side is its max_repeats, the most it runs
    tests: int
    noise: Noise
    min_effect: float

    @property
    def detectable_change(self) -> float | None:
        """A fraction of the baseline (0.05: +-5%); None where the noise is unknown or there is no interval."""
        if self.noise.cv is None:
            return None
        return stats.detectable_change(self.launches_a_side, self.noise.cv, tests=self.tests, alpha=FAMILY_ALPHA)

    def launches_needed(self, cells: list[CellSpec], most: int = 50) -> int | None:
        """The fewest launches a side that tell the minimum effect at this noise (None: not within `most`)."""
        if self.noise.cv is None:
            return None
        for n in range(2, most + 1):
            change = stats.detectable_change(n, self.noise.cv, tests=judged_tests(cells, n), alpha=FAMILY_ALPHA)
            if change is not None and change <= self.min_effect:
                return n
        return None

    def to_json(self) -> dict[str, Any]:
        change = self.detectable_change
        return {"variant": self.variant, "launches_a_side": self.launches_a_side,
                "until_settled": self.until_settled, "tests": self.tests,
                "noise_cv": None if self.noise.cv is None else round(self.noise.cv, 4),
                "noise_source": self.noise.source,
                "detectable_change": None if change is None else round(change, 4), "min_effect": self.min_effect}


SLO_METRICS = {"goodput_rps", "slo_met_fraction"}  # a rate cell has them only against a service level


def judged_tests(cells: list[CellSpec], launches_a_side: int) -> int:
    """How many (cell, deciding metric) pairs a variant's verdicts will rest on, as analysis/verdicts.py judges
    them: a p99 only with TAIL_MIN_REPEATS launches a side (counted then, though its sample count may still
    leave it out), no GPU telemetry (it exists only where NVML does, or a measured entry's power model), a rate
    cell's SLO figures only where it has an SLO. Every cell counts, even one a variant will skip as over
    capacity: fewer tests would only narrow the change told. Experiments are left out: their headline values
    are named by their results (and directed by analysis/recommend.py, above this layer), so the count is a
    floor for a matrix with experiments."""
    count = 0
    for cell in cells:
        for metric, _ in PHASE_METRICS[cell.phase]:
            if metric in TELEMETRY_METRICS or (metric in TAIL_METRICS and launches_a_side < TAIL_MIN_REPEATS):
                continue
            if metric in SLO_METRICS and cell.slo is None:
                continue
            count += 1
    return count



def power(matrix: Matrix, noise: Noise) -> list[Power]:
    """Each variant judged against another (every one but the baseline): its launches a side, tests, noise."""
    if matrix.until_settled:
        launches = matrix.max_repeats or AUTO_MAX_REPEATS
    else:
        launches = matrix.repeats
    tests = judged_tests(matrix.cells(), launches)
    return [Power(v.name, launches, matrix.until_settled, tests, noise, matrix.min_effect)
            for v in matrix.ordered_variants() if v.name != matrix.baseline]


@dataclass(frozen=True)
class Estimate:
    launches: int
    launch_s: float
    # The cells of one launch, warm-up and warm check included, each launch without the cells it will not run:
    # the mean over the schedule's launches (variant_cells_s: each variant's).
    cells_s: float
    experiments_s: dict[str, float] = field(default_factory=dict)  # per experiment key, one launch
    rates: Rates = GUESSED
    power: list[Power] = field(default_factory=list)  # per variant judged: the smallest change it can tell
    variant_cells_s: dict[str, float] = field(default_factory=dict)   # per variant: its launches' cells_s
    # Per variant, the cells its launches will not run (key: why, Reason.OVER_CAPACITY or OVER_WINDOW as the
    # runner's own finding for them), left out of its estimate.
    not_run: dict[str, dict[str, Finding]] = field(default_factory=dict)

    @property
    def per_launch_s(self) -> float:
        """A launch of the schedule, on average (variant_launch_s: one variant's)."""
        return (self.launch_s + self.cells_s + sum(self.experiments_s.values())) * self.rates.correction

    def uncorrected_launch_s(self, variant: str) -> float:
        """One launch of `variant` as the rates give it, before the last run's correction."""
        cells = self.variant_cells_s.get(variant, self.cells_s)
        return self.launch_s + cells + sum(self.experiments_s.values())

    def variant_launch_s(self, variant: str) -> float:
        return self.uncorrected_launch_s(variant) * self.rates.correction

    def schedule_s(self, variants: list[str]) -> float:
        """Launches of these variants in turn (a schedule's names), each at its own variant's estimate."""
        return sum(self.variant_launch_s(v) for v in variants)

    @property
    def total_s(self) -> float:
        return self.launches * self.per_launch_s

    def to_json(self) -> dict[str, Any]:
        return {"launches": self.launches, "per_launch_s": round(self.per_launch_s, 1),
                "launch_s": round(self.launch_s, 1), "cells_s": round(self.cells_s, 1),
                "experiments_s": {k: round(v, 1) for k, v in self.experiments_s.items()},
                "correction": round(self.rates.correction, 3), "rates_source": self.rates.source,
                "power": [p.to_json() for p in self.power],
                "variant_launch_s": {v: round(self.variant_launch_s(v), 1) for v in self.variant_cells_s},
                "not_run": {v: {key: {"code": str(why.code), "message": why.message} for key, why in keys.items()}
                            for v, keys in self.not_run.items() if keys}}


def stored_launch_s(stored: Mapping[str, Any], variant: str) -> float | None:
    """One launch of `variant` as a run's stored estimate (its manifest's) put it: its variant's figure
    (variant_launch_s), else, for a run stored before those, the schedule's mean (per_launch_s); None: a run
    stored before estimates (format < 5)."""
    own = stored.get("variant_launch_s")
    value = own.get(variant) if isinstance(own, dict) else None
    if not isinstance(value, int | float):
        value = stored.get("per_launch_s")
    return float(value) if isinstance(value, int | float) else None


def cell_s(spec: CellSpec, rates: Rates) -> float:
    if spec.phase == "prefill":
        return STEP_OVERHEAD_S + spec.context_tokens / rates.prefill_tok_s
    if spec.phase == "rate":
        # The schedule (its span, or its minimum count at the rate), then the last requests' replies.
        span = spec.duration_s if spec.request_rate is None else max(
            spec.duration_s, spec.min_requests / spec.request_rate)
        longest = spec.lengths_range()[1][0]
        if spec.request_rate is not None:
            # Every prompt is prefilled: a load beyond the prefill rate queues, and the cell lasts until the
            # queue drains (a Mooncake trace's 13.8K-token prompts on a 2-GPU pair: far longer than its span).
            span = max(span, round(spec.request_rate * span) * spec.context_tokens / rates.prefill_tok_s)
        return STEP_OVERHEAD_S + span + longest / rates.prefill_tok_s + spec.max_tokens / rates.decode_tok_s
    prompts = spec.concurrency * spec.context_tokens / rates.prefill_tok_s
    if spec.mode == "sustained":
        # The window, the warm-up before it, and the requests in flight when it closes run to their end.
        return STEP_OVERHEAD_S + prompts + spec.warmup_s + spec.window_s + spec.max_tokens / rates.decode_tok_s
    return STEP_OVERHEAD_S + prompts + spec.max_tokens / rates.decode_tok_s


def experiment_s(experiment: Experiment, matrix: Matrix, profile: LaunchProfile, rates: Rates) -> float:
    """What the experiment sends, at the rates (bracketed steps may be repeated: this is one try each)."""
    prefill, decode = rates.prefill_tok_s, rates.decode_tok_s
    if isinstance(experiment, ContextWindowExperiment):
        window = _int_flag(profile.flags, "max-model-len") or 0  # unknown: vLLM takes the model's own
        return 2 * STEP_OVERHEAD_S + 2 * window / prefill + experiment.reply_tokens / decode
    if isinstance(experiment, LongContextExperiment):
        return sum(STEP_OVERHEAD_S + c / prefill + experiment.reply_tokens / decode for c in experiment.contexts)
    if isinstance(experiment, OverloadExperiment):
        seqs = experiment.max_num_seqs or _int_flag(profile.flags, "max-num-seqs") or 256
        n = math.ceil(experiment.factor * seqs)
        return (STEP_OVERHEAD_S + n * experiment.prompt_tokens / prefill
                + math.ceil(experiment.factor) * experiment.reply_tokens / decode)
    if isinstance(experiment, PrefixOrderExperiment):  # three arms, none cached at worst
        prompt = experiment.shared_tokens + experiment.task_tokens
        return 3 * (STEP_OVERHEAD_S + experiment.agents * prompt / prefill + experiment.reply_tokens / decode)
    if isinstance(experiment, AgentsExperiment):  # every turn prefilled whole (no cache) at worst, decoded at 1x
        total = 0.0
        for n in experiment.sessions:
            for turn in range(experiment.turns):
                history = (experiment.system_tokens + (turn + 1) * experiment.user_tokens
                           + turn * experiment.reply_tokens)
                total += STEP_OVERHEAD_S + n * history / prefill + experiment.reply_tokens / decode
        return total
    if isinstance(experiment, SloSearchExperiment):
        return search_s(experiment, matrix, rates)
    assert isinstance(experiment, RepeatExperiment)
    return experiment.times * cell_s(experiment.spec(matrix.window_s), rates)


def search_s(experiment: SloSearchExperiment, matrix: Matrix, rates: Rates) -> float:
    """A capacity search, about: where prefill alone saturates (prompt tok/s over the context) stands for the
    capacity. Without a start, a batch pass, then probes walking down from there and bisecting about it (six,
    each at full cost); with one, rates doubling from it to there and four bisections. Each probe sends at least
    its minimum of requests over at least its span. Then, if asked, the concurrency search: three closed loops
    (its Little's-law start, a small step, the neighbour), each its first wave and `need` more, with no span."""
    spec = experiment.spec(matrix.window_s, matrix.slo)
    need = max(spec.min_requests, spec.slo.min_requests if spec.slo else 1)
    saturated = rates.prefill_tok_s / spec.context_tokens
    reply = spec.context_tokens / rates.prefill_tok_s + spec.max_tokens / rates.decode_tok_s
    total = 0.0
    probes: list[float] = []
    if experiment.start_rps is None:   # the batch pass: its prompts' prefill, then one reply
        total += STEP_OVERHEAD_S + need * spec.context_tokens / rates.prefill_tok_s + reply
        probes = [saturated] * min(6, experiment.max_probes)
    else:
        limit = max(experiment.start_rps, saturated)
        rate = experiment.start_rps
        while rate < limit and len(probes) < experiment.max_probes:
            probes.append(rate)
            rate *= 2
        probes += [limit] * min(4, max(0, experiment.max_probes - len(probes)))   # the bisections, about there
    total += sum(STEP_OVERHEAD_S + max(spec.duration_s, need / r) + reply for r in probes)
    if experiment.concurrency:
        ceiling = experiment.max_concurrency or 256
        streams = max(1, min(ceiling, round(saturated * reply)))   # Little's law at that capacity
        total += 3 * (STEP_OVERHEAD_S + (need + streams) * reply / streams)
    return total


def window_of(profile: LaunchProfile, flags: dict[str, Any], facts: StartupFacts) -> int | None:
    """A launch's max-model-len: as its flags ask, else as the last run's server had it; None: unknown."""
    asked = merge(profile.flags, flags).get("max-model-len")
    read = None if asked is None else number_of(BOUNDS["max-model-len"], asked)
    return int(read) if read is not None else facts.max_model_len


def not_run(cells: list[CellSpec], facts: StartupFacts, window: int | None) -> dict[str, Finding]:
    """The cells a launch of a server with these facts will not run (key: why, with the runner's code for it),
    as the runner decides it: a decode cell over capacity at its KV cache is skipped, any cell whose longest
    prompt and reply pass its window is not sent."""
    out: dict[str, Finding] = {}
    for c in cells:
        if c.phase == "decode" and over_capacity(context_tokens=c.context_tokens, output_tokens=c.max_tokens,
                                                 concurrency=c.concurrency, kv_cache_tokens=facts.kv_cache_tokens,
                                                 block_size=facts.block_size):
            out[c.key] = Finding(Reason.OVER_CAPACITY,
                                 f"over capacity at its KV cache of {facts.kv_cache_tokens or 0:,} tokens")
        elif window is not None and reach(c) > window:
            out[c.key] = Finding(Reason.OVER_WINDOW,
                                 f"over the window: {reach(c):,} tokens past its max-model-len of {window:,}")
    return out


def launch_cells_s(cells: list[CellSpec], matrix: Matrix, rates: Rates) -> float:
    """One launch's cells (those it runs), with the warm-up's long prompts and the first cell measured again."""
    total = sum(cell_s(c, rates) for c in cells)
    if cells and matrix.warmup:
        longest = max(c.context_tokens for c in cells)
        total += 2 * longest / rates.prefill_tok_s + cell_s(cells[0], rates)
    return total


def estimate(matrix: Matrix, profile: LaunchProfile, launches: int, rates: Rates = GUESSED) -> Estimate:
    """`launches` launches of the matrix at the rates; each variant's without the cells it will not run (where
    rates.servers says what its server became), so a launch's figure is the schedule's mean."""
    cells = matrix.cells()
    skipped: dict[str, dict[str, Finding]] = {}
    per_variant: dict[str, float] = {}
    for variant in matrix.ordered_variants():
        facts = rates.servers.get(variant.name, StartupFacts())
        skipped[variant.name] = not_run(cells, facts, window_of(profile, dict(variant.flags), facts))
        per_variant[variant.name] = launch_cells_s([c for c in cells if c.key not in skipped[variant.name]],
                                                   matrix, rates)
    order = [name for name, _ in schedule(matrix)]
    mean = statistics.fmean(per_variant[name] for name in order) if order else launch_cells_s(cells, matrix, rates)
    return Estimate(launches=launches, launch_s=rates.launch_s, cells_s=mean,
                    experiments_s={e.key: experiment_s(e, matrix, profile, rates) for e in matrix.experiments()},
                    rates=rates, power=power(matrix, rates.noise), variant_cells_s=per_variant, not_run=skipped)


def _int_flag(flags: dict[str, Any], name: str) -> int | None:
    value = value_of(flags, name)
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


# --- after a run ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LaunchTime:
    launch_dir: str
    variant: str
    repeat: int
    actual_s: float
    estimated_s: float | None  # None: the run was stored before estimates were (format < 5)


def launch_times(run: RunDir) -> list[LaunchTime]:
    """Each launch that became ready and stopped: its actual time, beside its variant's estimate stored with the
    run (stored_launch_s)."""
    stored = run.manifest().estimate or {}
    out = []
    for server in run.ready_servers():
        stop = run.stop(server.launch_dir or "")
        if stop is None or stop.stopped_utc is None:
            continue  # stored before format 5, or the stop itself was not recorded (killed controller)
        began = datetime.fromisoformat(server.started_utc)
        actual = server.ready_s + (datetime.fromisoformat(stop.stopped_utc) - began).total_seconds()
        out.append(LaunchTime(server.launch_dir or "", server.variant, server.repeat, actual,
                              stored_launch_s(stored, server.variant)))
    return out


def rates_from(run: RunDir | None, profile: LaunchProfile | None = None) -> Rates:
    """The rates the last run measured (its median prefill rate, single-stream decode rate, start-up time) and
    how far its own estimate was off; before any run, the profile's stated rates, or the guesses. With them,
    the noise between launches (launch_noise)."""
    return replace(_speeds_from(run, profile), noise=launch_noise(run, profile))


def launch_noise(run: RunDir | None, profile: LaunchProfile | None = None) -> Noise:
    """The rig's noise between launches as the last run measured it (run_noise), else as the profile states it
    (`rates: launch_noise`), else unknown."""
    measured = None
    if run is not None:
        try:
            measured = run_noise(run)
        except (CampaignError, ValidationError):
            measured = None  # a last run this version cannot read measures nothing
    if measured is not None:
        return measured
    hints = profile.rates if profile is not None else None
    if hints is not None and hints.launch_noise is not None:
        return Noise(hints.launch_noise, f"stated in the profile: {hints.launch_noise_measured or hints.measured}")
    return UNKNOWN_NOISE


def run_noise(run: RunDir) -> Noise | None:
    """Per cell and variant measured Valid on two or more launches, the relative sample spread of its headline
    figure across them; the rig's noise is their median (robust to one cell that drifted). None where no cell
    was measured twice, or where the launches read alike (a simulator without its launch-noise fault: the
    same launch every time, which says nothing of a rig's noise, so the profile's stated one stands)."""
    values: dict[tuple[str, str], list[float]] = {}
    for cell in run.cells():
        result = cell.result
        value = getattr(result, primary_metric(result.phase))
        if result.status == "Valid" and isinstance(value, int | float) and value > 0:
            values.setdefault((cell.variant, result.spec.key), []).append(float(value))
    spreads = [statistics.stdev(v) / statistics.fmean(v) for v in values.values() if len(v) >= 2]
    if not spreads or statistics.median(spreads) == 0:
        return None
    return Noise(statistics.median(spreads),
                 f"from run {run.root} (the median over {len(spreads)} cell{'s' if len(spreads) != 1 else ''} "
                 "measured on two or more launches)")


def _speeds_from(run: RunDir | None, profile: LaunchProfile | None) -> Rates:
    servers: dict[str, StartupFacts] = {}
    try:
        cells = [c.result for c in run.cells() if c.result.status == "Valid"] if run is not None else []
        launched = run.ready_servers() if run is not None else []
        ready = [s.ready_s for s in launched]
        for server in launched:
            servers.setdefault(server.variant, server.facts)
        # A simulator's run at a time scale lived its launches that many times faster than the hardware (its
        # stored figures are the hardware's already, format 10); in simulated time the launches took no time to
        # speak of, and calibrate nothing.
        scale = run.manifest().time_scale if run is not None else 1.0
        virtual = run is not None and run.manifest().clock == "virtual"
    except (CampaignError, ValidationError):
        run = None  # a last run this version cannot read (a newer format): as if there were none
    if run is None:
        hints = profile.rates if profile is not None else None
        stated = (hints.prefill_tok_s, hints.decode_tok_s, hints.launch_s) if hints is not None else (None,) * 3
        if hints is None or stated == (None,) * 3:
            return GUESSED  # a profile may state its noise alone
        return Rates(hints.prefill_tok_s or GUESS_PREFILL_TOK_S, hints.decode_tok_s or GUESS_DECODE_TOK_S,
                     hints.launch_s or GUESS_LAUNCH_S, f"stated in the profile: {hints.measured}"
                     + ("" if None not in stated else " (partly guessed)"))
    prefill = [c.prompt_tok_s for c in cells if c.phase == "prefill" and c.prompt_tok_s]
    decode = [c.per_request_tok_s for c in cells
              if c.phase == "decode" and c.concurrency == 1 and c.per_request_tok_s]
    measured = Rates(
        prefill_tok_s=statistics.median(prefill) if prefill else GUESS_PREFILL_TOK_S,
        decode_tok_s=statistics.median(decode) if decode else GUESS_DECODE_TOK_S,
        launch_s=statistics.median(ready) if ready else GUESS_LAUNCH_S,
        source=f"measured in {run.root}" + ("" if prefill and decode and ready else " (partly guessed)"),
        servers=servers)
    try:
        times = launch_times(run)
        # How far this model is off even at the measured rates (overheads it does not see): each of the last
        # run's launches, estimated again at its own rates as its variant's, against what it took.
        manifest = run.manifest()
        again = estimate(manifest.matrix_model(), manifest.profile_model(), 1, measured)
    except (CampaignError, ValidationError, ValueError):
        return measured  # a last run this version cannot fully read calibrates nothing; it never stops a plan
    ratios = [t.actual_s * scale / again.variant_launch_s(t.variant) for t in times
              if again.variant_launch_s(t.variant) > 0]
    if not ratios or virtual:
        return measured
    return replace(measured, correction=statistics.median(ratios))


# --- the plan --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PredictedServer:
    """A variant's server as the simulator's memory model predicts it before any launch (vLLM's accounting for
    the profile's card, model and flags): its startup facts, or why vLLM would not start."""

    facts: StartupFacts
    refused: str | None = None   # e.g. "start-up: the weights do not fit (out of memory)"


@dataclass(frozen=True)
class VariantPlan:
    name: str
    flags: dict[str, Any]
    kv_cache_tokens: int | None  # as the last run found it, else as predicted; None: unknown until launched
    skipped: list[str]  # cells over capacity at that KV cache: will be skipped
    launches: int = 0   # in the schedule
    not_run: dict[str, Finding] = field(default_factory=dict)   # key: why; skipped, or past the window
    unsure: list[str] = field(default_factory=list)   # cells whose fit in an unknown KV cache decides the estimate
    predicted: bool = False      # kv_cache_tokens is the simulator's memory model's, not a launch's
    refused: str | None = None   # predicted: vLLM would not start with these flags, and why


@dataclass(frozen=True)
class Plan:
    """What `campaign plan` says: launches in order, variants, cells, experiments, the estimate, and how the
    last run's launches compared with its estimate."""

    launches: list[tuple[str, int]]
    variants: list[VariantPlan]
    cells: list[CellSpec]
    estimate: Estimate
    previous: RunDir | None
    previous_times: list[LaunchTime]
    # `repeats: auto`: the first rounds are `launches`; if no variant settles: (rounds, launches, seconds), and
    # the budget that may stop it sooner (s).
    at_most: tuple[int, int, float] | None = None
    budget_s: float | None = None


def make_plan(matrix: Matrix, profile: LaunchProfile, previous: RunDir | None,
              predicted: Mapping[str, PredictedServer] | None = None) -> Plan:
    """The plan; `predicted`: each variant's server as the simulator's memory model sizes it (plan.replay's
    predict_servers, for a profile it can simulate), used where the last run did not launch that variant."""
    order = schedule(matrix)
    cells = matrix.cells()
    previous_times: list[LaunchTime] = []
    if previous is not None:
        try:
            previous_times = launch_times(previous)
        except CampaignError:
            previous = None  # unreadable by this version: planned as if there were no last run
    rates = rates_from(previous, profile)
    guessed = {name: p for name, p in (predicted or {}).items()
               if rates.servers.get(name, StartupFacts()).kv_cache_tokens is None}
    if guessed:
        rates = replace(rates, servers={**rates.servers, **{name: p.facts for name, p in guessed.items()}})
    planned = estimate(matrix, profile, len(order), rates)
    variants = []
    for variant in matrix.ordered_variants():
        facts = planned.rates.servers.get(variant.name, StartupFacts())
        left = planned.not_run.get(variant.name, {})
        guess = guessed.get(variant.name)
        variants.append(VariantPlan(variant.name, dict(variant.flags), facts.kv_cache_tokens,
                                    [k for k, why in left.items() if why.code == Reason.OVER_CAPACITY],
                                    sum(name == variant.name for name, _ in order), left,
                                    [c.key for c in hinges_on_kv(planned, variant.name, cells)],
                                    predicted=guess is not None, refused=guess.refused if guess else None))
    at_most = None
    if matrix.until_settled:
        rounds = max(matrix.max_repeats or matrix.repeats, matrix.repeats)
        longest = schedule(matrix.model_copy(update={"repeats": rounds}))
        at_most = (rounds, len(longest), planned.schedule_s([name for name, _ in longest]))
    return Plan(launches=order, variants=variants, cells=cells, estimate=planned, previous=previous,
                previous_times=previous_times, at_most=at_most, budget_s=matrix.budget_s)


def kv_need(spec: CellSpec) -> int:
    """The KV cache tokens a decode cell's streams hold at once, C x (L + N) (the block size unknown too)."""
    return kv_tokens_needed(context_tokens=spec.context_tokens, output_tokens=spec.max_tokens,
                            concurrency=spec.concurrency, block_size=None)


def hinges_on_kv(planned: Estimate, variant: str, cells: list[CellSpec]) -> list[CellSpec]:
    """Where `variant`'s KV cache is unknown (no last run launched it, or its log did not say), the cells whose
    fit in it decides the estimate: decode cells (the kind the runner skips over capacity) each estimated at
    more than the rest of the launch together, so that, skipped, the launch takes less than half its estimate.
    (A bound from the cards' memory would need the model's KV bytes per token and the weights' share, which a
    profile need not state; this needs only the estimate it qualifies.)"""
    if planned.rates.servers.get(variant, StartupFacts()).kv_cache_tokens is not None:
        return []
    left = planned.not_run.get(variant, {})
    launch = planned.uncorrected_launch_s(variant)
    return [c for c in cells if c.phase == "decode" and c.key not in left
            and cell_s(c, planned.rates) > launch - cell_s(c, planned.rates)]


def kv_unknown(plan: Plan) -> str | None:
    """The line said beside the estimate where it rests on cells a KV cache unknown before a launch may not
    hold (hinges_on_kv); None where it does not."""
    unsure = [v for v in plan.variants if v.unsure]
    if not unsure:
        return None
    keys = set().union(*(v.unsure for v in unsure))
    cells = [c for c in plan.cells if c.key in keys]
    largest = max(cells, key=kv_need)
    whose = "" if len(unsure) == len(plan.variants) else f" of {', '.join(v.name for v in unsure)}"
    many = len(cells) != 1
    return (f"not known before a launch: whether {len(cells)} cell{'s' if many else ''} fit{'' if many else 's'} "
            f"the KV cache{whose} (the largest, {largest.key}, needs {kv_need(largest):,} tokens); the estimate "
            f"includes {'them' if many else 'it'}")


def left_out(plan: Plan) -> list[str]:
    """What the estimate leaves out, a line a variant that will not run every cell: those cells and why, and
    what its launches are estimated at without them."""
    lines = []
    for v in plan.variants:
        if not v.not_run:
            continue
        cells = "; ".join(f"{key} ({why.message})" for key, why in v.not_run.items())
        lines.append(f"not in the estimate: {v.name}'s launches ({v.launches}, "
                     f"{fmt_duration(plan.estimate.variant_launch_s(v.name))} each) will not run {cells}")
    return lines
