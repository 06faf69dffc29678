"""`campaign tune`'s phase 1: a matrix's `search:` space searched on the simulator in simulated time.

Each configuration (the baseline's flags with the trial's on top) is evaluated as the tool would measure it,
on the engine's own clock (plan.replay): agents-at-floor bisects the concurrency of sustained streams (each
re-sending its context, so the prefix cache serves it, as an agent's loop does) for the most that each still
get the floor, within the KV cache and max-num-seqs; total-tok-s measures one such cell. Goodput is a rate
cell measured by the Measurer itself against the simulator in simulated time (measure.simulated). A configuration the
server would refuse (no memory for the KV cache, weights that do not fit, a window the cache cannot hold) or one
that breaks a constraint is infeasible: it scores 0 (it serves no agent) and says why.

The search is Optuna's TPE (seeded: the same matrix searches the same way), asked for configurations until
`trials` distinct ones have been evaluated; a configuration asked again is answered from the first
evaluation and not counted. Choices are ordinal (their index) where they are numbers, categorical otherwise;
ranges are Optuna's float or int distributions. `exhaustive` evaluates every configuration of a finite space,
the yardstick the search is tested against. Every figure is a prediction of the simulator (the profile's
hardware: the tables' calibration or a measured entry's fit), and is labelled so wherever it is shown.
Objectives where lower is better (joules per token) are searched on their inverse (Objective.score).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import optuna

from campaign.measure import simulated
from campaign.measure.answers import agents_that_fit
from campaign.measure.cells import CellResult, CellSpec
from campaign.measure.runner import Measurer
from campaign.plan import replay
from campaign.server.profiles import FlagValue
from campaign.sim.config import SimConfig
from campaign.spec.search_spec import MAX_AGENTS, Objective, Range, SearchBlock

WARMUP_S = 2.0   # simulated seconds after every stream's first token before the window opens


@dataclass(frozen=True)
class Evaluation:
    """One configuration on the simulator: the objective's value (0 where infeasible) and the evidence."""

    flags: dict[str, FlagValue]                 # the trial's own flags (on top of the baseline's)
    value: float
    infeasible: str | None = None               # why it cannot serve (start-up failure kind, broken constraint)
    kv_cache_tokens: int | None = None
    concurrency: int | None = None              # where the objective was read (agents-at-floor: the count)
    per_request_tok_s: float | None = None
    total_tok_s: float | None = None
    ttft_p99_s: float | None = None
    energy_j_per_token: float | None = None     # at the objective's load, where the hardware has a power model
    probes: int = 0                             # cells replayed to evaluate it

    @property
    def feasible(self) -> bool:
        return self.infeasible is None


@dataclass
class SearchResult:
    objective: Objective
    evaluations: list[Evaluation] = field(default_factory=list)   # in the order evaluated, distinct
    asked: int = 0                                                # configurations the optimiser proposed

    def score(self, e: Evaluation) -> float:
        return self.objective.score(e.value, e.feasible)

    def best(self) -> Evaluation | None:
        feasible = [e for e in self.evaluations if e.feasible]
        return max(feasible, key=lambda e: (self.score(e), e.kv_cache_tokens or 0)) if feasible else None

    def ranked(self) -> list[Evaluation]:
        return sorted(self.evaluations, key=lambda e: (e.feasible, self.score(e), e.kv_cache_tokens or 0),
                      reverse=True)

    def pareto(self) -> list[Evaluation]:
        """The feasible configurations no other beats on both the objective and the KV cache (more agents, or
        room for longer contexts): the trade a user picks from."""
        feasible = [e for e in self.evaluations if e.feasible]
        front = [e for e in feasible if not any(
            self.score(o) >= self.score(e) and (o.kv_cache_tokens or 0) >= (e.kv_cache_tokens or 0)
            and (o.value, o.kv_cache_tokens) != (e.value, e.kv_cache_tokens) for o in feasible)]
        unique: dict[tuple[float, int | None], Evaluation] = {}
        for e in front:
            unique.setdefault((e.value, e.kv_cache_tokens), e)
        return sorted(unique.values(), key=self.score, reverse=True)


ConfigFor = Callable[[Mapping[str, FlagValue]], SimConfig]


class Probes:
    """Probe cells already replayed. A configuration that seats every agent (max-num-seqs at least the probe's
    concurrency) runs the same engine steps whatever its max-num-seqs: the engine never runs more requests than
    were sent. So such probes are keyed with max-num-seqs set to the concurrency, and only cells without a
    finding are kept (a finding's words may name the configuration's own max-num-seqs)."""

    def __init__(self) -> None:
        self._cells: dict[str, replay.VirtualCell] = {}
        self.replayed = 0

    def cell(self, config: SimConfig, objective: Objective, concurrency: int) -> replay.VirtualCell:
        seated = config.max_num_seqs >= concurrency
        key = repr((replace(config, max_num_seqs=concurrency, non_default={}) if seated else config, objective,
                    concurrency))
        found = self._cells.get(key)
        if found is None:
            found = probe(config, objective, concurrency)
            self.replayed += 1
            if seated and not found.findings:
                self._cells[key] = found
        return found


def probe(config: SimConfig, objective: Objective, concurrency: int) -> replay.VirtualCell:
    """The objective's cell (sustained agents at its context, re-sending it) at `concurrency`, replayed."""
    spec = CellSpec(phase="decode", mode="sustained", context_tokens=objective.context, concurrency=concurrency,
                    max_tokens=objective.max_tokens, ttft="warm", window_s=objective.window(), warmup_s=WARMUP_S)
    return replay.run_cell(config, spec)


@dataclass(frozen=True)
class OpenLoop:
    """The objective's rate cell as the tool measured it on the simulator, and the figures the search reads."""

    cell: CellResult

    @property
    def goodput_rps(self) -> float | None:
        return self.cell.goodput_rps

    @property
    def held(self) -> bool:
        return bool(self.cell.slo_passed)

    @property
    def ttft_p99_s(self) -> float | None:
        return None if self.cell.ttft_p99_ms is None else self.cell.ttft_p99_ms / 1000

    @property
    def requests(self) -> int:
        return self.cell.scheduled_requests or 0

    def why_none(self) -> str:
        """Why the cell has no goodput (it was not measured, or nothing it sent was judged)."""
        return f"the rate cell: {self.cell.status}" + (f": {self.cell.reasons[0]}" if self.cell.reasons else "")


def open_loop(config: SimConfig, objective: Objective, seed: int = 0) -> OpenLoop:
    """Fresh requests arriving at the objective's rate (Poisson) for its window (or its agent sessions' turns, or
    its trace's slice at the trace's own times), measured as the tool measures any rate cell: the Measurer
    against the simulator serving this configuration from this process, in simulated time (measure.simulated);
    goodput, the SLO's verdict and TTFT p99 are the cell's own. Until 2026-12-07 the engine alone replayed the
    arrivals here by rules of its own, and read 0.046-0.076 good req/s where the Measurer on the same engine read
    0.1-0.2 (a5000-tune at 0.5 req/s, TTFT p99 <= 5 s), so phase 2 in simulated time was refused."""
    assert objective.rate_rps is not None and objective.slo is not None
    spec = objective.trace.cell(objective.slo) if objective.trace is not None else CellSpec(
        phase="rate", context_tokens=objective.context, max_tokens=objective.max_tokens,
        request_rate=objective.rate_rps, duration_s=objective.window(), slo=objective.slo,
        sessions=objective.sessions)
    with simulated.boot(replace(config, seed=seed)).serve() as server:
        return OpenLoop(server.call(Measurer(server.target()).run_cell(spec)))


def figure_at(config: SimConfig, objective: Objective, load: int | None) -> float | None:
    """The figure phase 2 compares, as the simulator predicts it: per-agent tok/s at `load` agents (agents-
    at-floor), total tok/s or energy per token at the objective's concurrency, or goodput at its rate."""
    if objective.kind == "goodput":
        return open_loop(config, objective).goodput_rps
    cell = probe(config, objective, objective.concurrency or load or 1)
    if objective.kind == "joules-per-token":
        return cell.energy_j_per_token
    return cell.per_request_tok_s if objective.kind == "agents-at-floor" else cell.total_tok_s


def _p99(values: list[float]) -> float | None:
    """The nearest-rank 99th percentile (a value some request had); None without values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)] if ordered else None


def _ttft_p99(cell: replay.VirtualCell) -> float | None:
    return _p99([r.ttft for r in cell.requests if r.ttft is not None])


def evaluate(config: SimConfig, flags: Mapping[str, FlagValue], block: SearchBlock,
             baseline_kv: int | None = None, cells: Probes | None = None) -> Evaluation:
    objective, limits = block.objective, block.constraints
    replayed = cells or Probes()
    own = dict(flags)
    refused = replay.refused(config)
    if refused is not None:
        return Evaluation(own, 0.0, infeasible=refused)
    kv = config.memory().kv_tokens
    if limits.kv_at_least_baseline and baseline_kv is not None and kv < baseline_kv:
        return Evaluation(own, 0.0, infeasible=f"constraint: KV cache {kv:,} tokens, below the baseline's "
                                                f"{baseline_kv:,}", kv_cache_tokens=kv)

    def meets(cell: replay.VirtualCell) -> bool:
        speed_ok = objective.floor_tok_s is None or (cell.per_request_tok_s or 0.0) >= objective.floor_tok_s
        ttft = _ttft_p99(cell)
        ttft_ok = limits.ttft_p99_s is None or (ttft is not None and ttft <= limits.ttft_p99_s)
        return cell.status == "Valid" and speed_ok and ttft_ok

    if objective.kind == "goodput":
        run = open_loop(config, objective)
        if run.goodput_rps is None:
            return Evaluation(own, 0.0, infeasible=run.why_none(), kv_cache_tokens=kv, probes=1)
        if limits.ttft_p99_s is not None and (run.ttft_p99_s is None or run.ttft_p99_s > limits.ttft_p99_s):
            return Evaluation(own, 0.0, infeasible=f"TTFT p99 over {limits.ttft_p99_s:g} s", kv_cache_tokens=kv,
                              ttft_p99_s=run.ttft_p99_s, probes=1)
        return Evaluation(own, run.goodput_rps, kv_cache_tokens=kv, ttft_p99_s=run.ttft_p99_s, probes=1)
    if objective.kind in ("total-tok-s", "joules-per-token"):
        assert objective.concurrency is not None
        cell = replayed.cell(config, objective, objective.concurrency)
        if not meets(cell):
            why = cell.reasons[0] if cell.reasons else f"{cell.status}, or over the TTFT bound"
            return Evaluation(own, 0.0, infeasible=f"at {objective.concurrency} streams: {why}", kv_cache_tokens=kv,
                              probes=1)
        energy = cell.energy_j_per_token
        if objective.kind == "joules-per-token" and energy is None:
            return Evaluation(own, 0.0, infeasible="no energy figure: the hardware has no power model",
                              kv_cache_tokens=kv, probes=1)
        value = energy if objective.kind == "joules-per-token" else cell.total_tok_s
        return Evaluation(own, value or 0.0, kv_cache_tokens=kv, concurrency=objective.concurrency,
                          per_request_tok_s=cell.per_request_tok_s, total_tok_s=cell.total_tok_s,
                          ttft_p99_s=_ttft_p99(cell), energy_j_per_token=energy, probes=1)
    fit = agents_that_fit(kv, objective.context + objective.max_tokens, config.block()) or 0
    low, high, best, probes = 1, min(fit, config.max_num_seqs, MAX_AGENTS), None, 0   # asked, cached or not
    while low <= high:   # per-agent speed falls as agents are added: the largest count that meets the floor
        middle = (low + high) // 2
        cell = replayed.cell(config, objective, middle)
        probes += 1
        if meets(cell):
            best, low = (middle, cell), middle + 1
        else:
            high = middle - 1
    if best is None:
        return Evaluation(own, 0.0, kv_cache_tokens=kv, probes=probes,
                          infeasible=f"not even one agent gets {objective.floor_tok_s:g} tok/s"
                          + (" within the TTFT bound" if limits.ttft_p99_s is not None else ""))
    count, cell = best
    return Evaluation(own, float(count), kv_cache_tokens=kv, concurrency=count,
                      per_request_tok_s=cell.per_request_tok_s, total_tok_s=cell.total_tok_s,
                      ttft_p99_s=_ttft_p99(cell), energy_j_per_token=cell.energy_j_per_token, probes=probes)


def _numeric(values: list[FlagValue]) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)


def distributions(block: SearchBlock) -> dict[str, optuna.distributions.BaseDistribution]:
    out: dict[str, optuna.distributions.BaseDistribution] = {}
    for name, space in block.flags.items():
        if isinstance(space, Range):
            if space.integral:
                out[name] = optuna.distributions.IntDistribution(int(space.low), int(space.high), log=space.log,
                                                                 step=int(space.step or 1))
            else:
                out[name] = optuna.distributions.FloatDistribution(space.low, space.high, log=space.log,
                                                                   step=space.step)
        elif _numeric(space):
            out[name] = optuna.distributions.IntDistribution(0, len(space) - 1)   # ordinal: the index
        else:
            out[name] = optuna.distributions.CategoricalDistribution([str(i) for i in range(len(space))])
    return out


def _flags(block: SearchBlock, params: Mapping[str, Any]) -> dict[str, FlagValue]:
    out: dict[str, FlagValue] = {}
    for name, space in block.flags.items():
        value = params[name]
        if isinstance(space, Range):
            out[name] = space.cast(value)
        else:
            out[name] = space[int(value)]
    return out


def key(flags: Mapping[str, FlagValue]) -> str:
    """A configuration's identity (its flags, in name order)."""
    return repr(sorted(flags.items(), key=lambda item: item[0]))


def search(block: SearchBlock, config_for: ConfigFor, *, trials: int | None = None,
           baseline_kv: int | None = None, seed: int | None = None,
           known: Mapping[str, Evaluation] | None = None) -> SearchResult:
    """Phase 1: Optuna's TPE over the space until `trials` distinct configurations are evaluated. `known`:
    configurations already answered (by `key`), such as one the real server refused to start: the optimiser is
    told their value and they are not evaluated again (nor counted)."""
    wanted = trials or block.planned_trials()
    size = block.grid_size()
    wanted = min(wanted, size - len(known or {})) if size is not None else wanted
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=block.seed if seed is None else seed, multivariate=True,
                                         n_startup_trials=max(2, min(10, wanted // 2)))
    study = optuna.create_study(direction="maximize", sampler=sampler)
    space = distributions(block)
    result = SearchResult(block.objective)
    replayed = Probes()
    seen: dict[str, Evaluation] = dict(known or {})
    evaluated = 0
    while evaluated < wanted and result.asked < 20 * wanted:
        trial = study.ask(space)
        result.asked += 1
        flags = _flags(block, trial.params)
        name = key(flags)
        if name not in seen:
            seen[name] = evaluate(config_for(flags), flags, block, baseline_kv, replayed)
            result.evaluations.append(seen[name])
            evaluated += 1
        study.tell(trial, result.score(seen[name]))
    return result


def grid(block: SearchBlock) -> list[dict[str, FlagValue]]:
    """Every configuration of a finite space (ValueError where a range is continuous)."""
    axes: list[list[tuple[str, FlagValue]]] = []
    for name, space in block.flags.items():
        if isinstance(space, list):
            axes.append([(name, v) for v in space])
            continue
        values = space.values()
        if values is None:
            raise ValueError(f"{name}: a continuous range has no grid; give it a step")
        axes.append([(name, space.cast(v)) for v in values])
    return [dict(combo) for combo in itertools.product(*axes)]


def exhaustive(block: SearchBlock, config_for: ConfigFor, *, baseline_kv: int | None = None,
               known: SearchResult | None = None) -> SearchResult:
    """Every configuration of the grid (those in `known`, a search's, are not evaluated again)."""
    done = {key(e.flags): e for e in (known.evaluations if known else [])}
    result = SearchResult(block.objective)
    replayed = Probes()
    for flags in grid(block):
        found = done.get(key(flags))
        result.evaluations.append(found or evaluate(config_for(flags), flags, block, baseline_kv, replayed))
        result.asked += 1
    return result
