"""`campaign calibrate RUN`: the simulator's step costs fitted to a stored run's cells, so that a machine the
hardware tables do not know (a new card, the CPU build) can be simulated after one real run.

What is fitted: the five terms one engine step's time is linear in (campaign.sim.model.StepCosts: a fixed cost
per step, per decode position, per prompt token, per prompt token x context, per token of KV read), and each
request's time with the API server before the engine can seat it (`request_s`: part of every TTFT, no step's;
public H100 runs at TP 2 and 4 show a near-constant 45-65 ms first token that no step cost explains). What is
taken as measured: the KV cache, its page size and the scheduler's limits, from each launch's startup log (for
a peer's export, which has none, as the simulator sizes the launch profile the user names).

How: each cell is replayed on the engine (plan.replay, the tool's own method in simulated time) with trial
costs; every step the replay ran is a row of what its time is linear in (StepTruth.features), so a cell's figure
is linear in the costs *for that schedule*: a TTFT is the sum of its steps' times; a rate is its tokens over the
sum of its steps' times (for a load replayed at its own arrival times, with the engine's idle time before each
busy period as a constant: analysis.arrivals). Non-negative least squares (scipy's NNLS) on the relative errors
gives new costs, the cells are replayed with them (the schedule may shift: who shares a step with whom), and so
on until the new costs move no cell's figure by 0.2% on the last schedule (at most 8 rounds; the report says when
it did not settle). The final figures are replayed with the final costs. The replay is the only model: no hand-written
formula of a cell's figure stands between the costs and what the simulator will publish, so the fit's error
per cell is the simulator's own. Terms the cells cannot tell apart (rows in proportion: one context, one load)
are split arbitrarily by NNLS; the report says how many of the six the cells determine.

Evidence used:
- a run's prefill cells (their TTFT) and decode cells of random-token prompts (total tok/s), each the median over
  the run's repeats, with their spread (the machine's own noise, which no fit can beat);
- a run's rate and trace cells of random-token prompts, each repeat's requests replayed at their own send times
  with their own lengths (analysis.arrivals: the mean TTFT, the mean TPOT and output tok/s, as vLLM's bench
  defines them), a trace's prompts sharing the blocks its hash ids name (read again from the trace file, which
  must be the one the run read), so the prefix cache serves the replay what it served the run;
- a run's agent-session cells the same way, each turn's prompt the system prompt every session shares and its
  session's history so far, as the Measurer built it (measure.prompts.SessionTurns), so the replay's prefix
  cache serves each turn its history as the measured server's did;
- a run's long-context and overload experiments the same way (unique random-token prompts, each alone or all at
  once), and each probe of a capacity search (a rate cell of its own), where `--fit-experiments` asks for them
  (run_cells says why not by default); the study's other experiments are then listed as skipped, each with why;
- peers' per-request exports (`campaign calibrate --export`, analysis.exports: vLLM's `bench serve
  --save-detailed`, GuideLLM's benchmarks.json, AIPerf's profile_export.jsonl), replayed the same way on the
  launch profile the user names.
Held-out cells and exports are predicted by the fit, never fitted: the honest test of it.

Long (about 900 lines): the fit, the power fit and the four sources of its evidence are one method; split, the
rules a cell is used by would be read in several places.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import ValidationError

# scipy.optimize is imported where a fit runs: importing it took 0.4 s of the 1.5 s every command's start
# paid (the command line imports this module), as analysis/statistics.py imports scipy.stats.
from campaign.analysis import exports as peer_exports
from campaign.analysis.arrivals import FIGURES as OPEN_FIGURES
from campaign.analysis.arrivals import (
    RATES,
    TERMS,
    Arrivals,
    Replayed,
    Row,
    Sent,
    Timed,
    in_row_units,
    measured_figures,
    vector,
)
from campaign.core.errors import CampaignError, ConfigError
from campaign.core.vllm_flags import human_int, value_of
from campaign.http.client import RequestRecord
from campaign.measure import traces
from campaign.measure.cells import CellResult, CellSpec
from campaign.measure.study import ExperimentResult
from campaign.plan import replay
from campaign.sim import config as sim_config
from campaign.sim import measured as sim_measured
from campaign.sim import truth as sim_truth
from campaign.sim.config import Faults, SimConfig
from campaign.sim.measured import ErrorSummary, FitCell, MeasuredHardware, MemoryRecord, PowerRecord, StepCostsRecord
from campaign.sim.model import GIB, StepCosts, StepPower
from campaign.sim.truth import StepTruth
from campaign.stored.records import ServerRecord
from campaign.stored.store import RunDir, StoredCell, replace_text

Figure = Literal["ttft_s", "total_tok_s"]
MAX_ITERATIONS = 20
PRIOR_WEIGHT = 0.03      # a prior's pull on a term, as one fitted figure's relative error of this size (fit)
REFINE_STEP = 0.02       # a term's relative change for its slope on the replay (_refined)
REFINE_EVALUATIONS = 40  # replays of the whole evidence the refinement may spend (slopes not counted)
SETTLED = 0.002          # the fit has settled when no fitted cell's figure moves by more than this share
REQUEST_SCALE_S = 1e-3   # the API server's time per request, refined in steps of 2% of this from 0 (_refined)
# A starting point only (the iterations leave it behind): a few milliseconds a step, a small model's token costs,
# no time with the API server.
START = StepCosts(fixed_s=0.005, decode_s_per_token=1e-4, prefill_s_per_token=1e-4, attention_s_per_token_ctx=1e-9,
                  kv_read_s_per_token=1e-7)


@dataclass(frozen=True)
class Observation:
    """One measured cell: the spec replayed, the configuration of the launch that measured it, and each repeat's
    value of its figure (in the hardware's units)."""

    variant: str
    spec: CellSpec
    config: SimConfig
    figure: Figure
    values: tuple[float, ...]
    held_out: bool = False
    # A decode cell's measured energy per token, each repeat that had one (NVML's counter); () without.
    energy: tuple[float, ...] = ()

    @property
    def measured(self) -> float:
        return statistics.median(self.values)

    @property
    def spread(self) -> float | None:
        """(max - min) / median over the repeats: the machine's own noise on this cell; None with one."""
        return (max(self.values) - min(self.values)) / self.measured if len(self.values) > 1 else None


@dataclass(frozen=True)
class Fitted:
    costs: StepCosts
    cells: list[FitCell]
    iterations: int
    unmeasured: list[str]      # cost terms no fitted cell exercised (left at 0: the run says nothing of them)
    settled: bool = True       # the last round moved no fitted cell's figure by SETTLED (on its schedule)
    determined: int = len(TERMS)   # how many of the terms the cells tell apart (the rank of their rows)
    power: PowerRecord | None = None   # fitted to the cells' energy per token; None: no cell measured energy
    # Why a load's replay with the final costs published no figure (shown as "-" in the table), one line each.
    unreplayed: list[str] = field(default_factory=list)
    leaned: bool = False       # the fit started from a prior and leaned on it (fit's `prior`)

    def summary(self, held_out: bool, figures: tuple[str, ...] = ("ttft_s", "total_tok_s", *OPEN_FIGURES)
                ) -> ErrorSummary:
        errors = [abs(c.error) for c in self.cells
                  if c.held_out is held_out and c.error is not None and c.figure in figures]
        return ErrorSummary(cells=len(errors), median_abs=statistics.median(errors) if errors else None,
                            max_abs=max(errors) if errors else None)


def figure_of(cell: replay.VirtualCell, figure: Figure) -> float | None:
    return cell.ttft_s if figure == "ttft_s" else cell.total_tok_s


def _row(cell: replay.VirtualCell, obs: Observation) -> np.ndarray | None:
    """What the cell's figure is linear in, for the schedule this replay ran: a TTFT, its steps' features
    summed; a rate, the inverse of it (the steps' features over the tokens they made). None: no figure."""
    simulated = figure_of(cell, obs.figure)
    if cell.status != "Valid" or not simulated:
        return None
    if obs.figure == "ttft_s":
        (request,) = cell.requests
        first = request.arrival + simulated
        steps = [s for s in cell.steps if s.start >= request.arrival - 1e-12 and s.end <= first + 1e-12]
        return np.append(_summed(steps), 1.0) if steps else None   # and its time with the API server
    first_arrival = min(r.arrival for r in cell.requests)
    start, end = cell.window if cell.window is not None else (first_arrival, math.inf)
    steps = [s for s in cell.steps if s.start >= start and s.end <= end]
    busy = sum(s.model_s for s in steps)
    if not steps or busy <= 0:
        return None
    return np.append(_summed(steps) / (simulated * busy), 0.0)   # a window's rate: no API server's time


def _summed(steps: Sequence[StepTruth]) -> np.ndarray:
    summed: np.ndarray = np.array([s.features() for s in steps], dtype=float).sum(axis=0)
    return summed


def _costs(values: Sequence[float]) -> StepCosts:
    return StepCosts(**{name: float(value) for name, value in zip(TERMS, values, strict=True)})


def _replay(obs: Observation, costs: StepCosts) -> replay.VirtualCell:
    return replay.run_cell(replace(obs.config, costs_override=costs), obs.spec)


Evidence = Observation | Arrivals     # a closed-loop cell, or a load replayed at its own arrival times
PREFILL_FIGURES = ("ttft_s", "mean_ttft_s")
DECODE_FIGURES = ("total_tok_s", "mean_tpot_s", "output_tok_s")


def _figures(item: Evidence) -> set[str]:
    return set(item.measured) if isinstance(item, Arrivals) else {item.figure}


def _rows(item: Evidence, costs: StepCosts) -> list[Row]:
    """What the item's figures are linear in on the schedule a replay with `costs` ran ([]: no figure)."""
    if isinstance(item, Arrivals):
        return item.replay(costs).rows
    row = _row(_replay(item, costs), item)
    return [] if row is None else [Row(item.figure, row, 0.0, in_row_units(item.figure, item.measured))]


def _fit_cell(variant: str, key: str, figure: str, measured: float, spread: float | None,
              predicted: float | None, held_out: bool) -> FitCell:
    return FitCell.model_validate({"variant": variant, "key": key, "figure": figure, "measured": measured,
                                   "spread": spread, "predicted": predicted, "held_out": held_out,
                                   "error": None if predicted is None else predicted / measured - 1})


def _cells(item: Evidence, replayed: replay.VirtualCell | Replayed) -> list[FitCell]:
    """The item's figures, measured and as its replay with the final costs predicts them."""
    if isinstance(item, Arrivals):
        assert isinstance(replayed, Replayed)
        return [_fit_cell(item.variant, item.key, figure, item.measured[figure], None, replayed.predicted[figure],
                          item.held_out) for figure in OPEN_FIGURES if figure in item.measured]
    assert isinstance(replayed, replay.VirtualCell)
    cell = replayed
    value = figure_of(cell, item.figure) if cell.status == "Valid" else None
    return [_fit_cell(item.variant, item.spec.key, item.figure, item.measured, item.spread, value, item.held_out)]


def _system(fitted: Sequence[Evidence], costs: StepCosts) -> dict[tuple[int, str], Row]:
    """Every fitted figure's row on the schedule a replay with `costs` ran, by (evidence, figure)."""
    return {(i, row.figure): row for i, obs in enumerate(fitted) for row in _rows(obs, costs)}


def _relative(rows: dict[tuple[int, str], Row]) -> tuple[np.ndarray, np.ndarray]:
    """The rows as relative equations: (features / target) . costs + offset / target = 1."""
    targets = np.array([r.target for r in rows.values()])
    return (np.array([r.features for r in rows.values()]) / targets[:, None],
            np.array([r.offset for r in rows.values()]) / targets)


def _moved(rows: dict[tuple[int, str], Row], old: StepCosts, new: StepCosts) -> float:
    """The largest share by which `new` moves a fitted figure from `old` on these rows' schedule."""
    a, offsets = _relative(rows)
    before = a @ vector(old) + offsets
    if (before <= 0).any():
        return math.inf
    return float(np.abs((a @ vector(new) + offsets) / before - 1).max())


def _residual(rows: dict[tuple[int, str], Row], costs: StepCosts) -> float:
    """The relative errors' root sum of squares, each as the replay with `costs` read it."""
    a, offsets = _relative(rows)
    return float(np.linalg.norm(a @ vector(costs) + offsets - 1.0))


def fit(observations: Sequence[Evidence], start: StepCosts = START, prior: StepCosts | None = None) -> Fitted:
    """The costs that make the replayed cells and loads read as measured (relative least squares over the
    fitted ones), and every figure's prediction with them: fitted ones are the fit's error, held-out ones its
    prediction's.

    Each round solves the rows of the current schedule (NNLS) and moves toward that solution only as far as the
    replay confirms: the whole way where the replayed figures' error falls, else half as far, and so on (at most
    five halvings). A load that queues changes its schedule sharply with the costs (too slow a step and every
    request waits behind the last): the rows of one schedule then overshoot, and an undamped round would chase
    the queue instead of the costs.

    `prior`: costs the physics already suggests (the hardware tables' for the profile's card and model), which
    the fit starts from and leans on, weakly (PRIOR_WEIGHT, as one figure's error of 3%), along the directions
    the evidence does not determine: one load's shape cannot split a step's fixed cost from its per-token
    cost, and NNLS would split them arbitrarily. None: the evidence alone (a run's own machine, which no table
    may know)."""
    from scipy.optimize import nnls  # see the note at the imports: 0.4 s, paid only by a fit

    fitted = [o for o in observations if not o.held_out]
    seen = {figure for o in fitted for figure in _figures(o)}
    if not seen & set(PREFILL_FIGURES) or not seen & set(DECODE_FIGURES):
        raise CampaignError("calibrate needs a figure of prefill and one of decode to fit (a prefill cell's or a "
                            "load's TTFT fixes a prompt token's cost; a decode cell's tok/s or a load's TPOT a "
                            "step's)", hint="calibrate from a run with both (the demo matrix has both), or hold "
                                            "fewer out")
    if prior is not None:
        start = prior
    costs, iterations, settled, determined = start, 0, False, 0
    rows = _system(fitted, costs)
    if not rows:
        raise CampaignError("no cell could be replayed with trial costs (every one over capacity or invalid)",
                            hint="calibrate from a run whose prefill and decode cells are Valid")
    # The API server's time is told apart only by loads (a light one, whose first tokens it is a large share
    # of); a run's closed-loop cells prefill one request at a time, where it and a step's fixed cost are one
    # direction: without a load it stays at 0, as the tables have it.
    pinned = [] if any(isinstance(o, Arrivals) for o in fitted) else [TERMS.index("request_s")]
    used = np.zeros(len(TERMS), dtype=bool)   # the terms some round's rows exercised
    for iterations in range(1, MAX_ITERATIONS + 1):   # noqa: B007 (the count is reported)
        a, offsets = _relative(rows)
        a[:, pinned] = 0.0
        used |= a.max(axis=0) > 0
        scale = np.where(a.max(axis=0) > 0, a.max(axis=0), 1.0)
        lean = _prior_rows(prior)
        solution, _ = nnls(np.vstack([a, lean]) / scale, np.concatenate([1.0 - offsets,
                                                                         np.full(len(lean), PRIOR_WEIGHT)]))
        # Terms whose rows are (nearly) proportional cannot be told apart by these cells: NNLS splits them
        # arbitrarily, which predicts the measured shapes well and others (another context, load) less so.
        determined = int(np.linalg.matrix_rank(a / scale, tol=1e-3 * np.linalg.svd(a / scale, compute_uv=False)[0]))
        error, step = _residual(rows, costs), 1.0
        # Settled: the rows' own best moves no fitted figure by SETTLED on this schedule; it is taken.
        settled = _moved(rows, costs, _costs(solution / scale)) < SETTLED
        if settled:
            costs = _costs(solution / scale)
            break
        for _ in range(6):
            trial = _costs(vector(costs) + step * (solution / scale - vector(costs)))
            trial_rows = _system(fitted, trial)
            if trial_rows.keys() == rows.keys() and _residual(trial_rows, trial) <= error:
                break
            step /= 2
        else:
            break          # no move the replay confirms: a local best on these schedules
        costs, rows = trial, trial_rows
    if any(isinstance(o, Arrivals) for o in fitted):
        costs, converged = _refined(fitted, costs, prior)
        settled = settled or converged
    final = [(obs, _replay(obs, costs) if isinstance(obs, Observation) else obs.replay(costs))
             for obs in observations]
    cells = [c for obs, replayed in final for c in _cells(obs, replayed)]
    unreplayed = [f"{obs.variant}:{obs.key}: not predicted: {replayed.problem}" for obs, replayed in final
                  if isinstance(obs, Arrivals) and isinstance(replayed, Replayed) and replayed.problem is not None]
    power, energy_cells = fit_power(costs, [(obs, cell) for obs, cell in final
                                            if isinstance(obs, Observation) and isinstance(cell, replay.VirtualCell)])
    return Fitted(costs=costs, cells=cells + energy_cells, iterations=iterations,
                  unmeasured=[name for name, seen in zip(TERMS, used, strict=True) if not seen], settled=settled,
                  determined=determined, power=power, unreplayed=unreplayed, leaned=prior is not None)


def _errors(fitted: Sequence[Evidence], costs: StepCosts, keys: Sequence[tuple[int, str]]) -> np.ndarray:
    """The rows `keys`' relative errors as the replay with `costs` reads them (a row the replay does not
    publish counts as a tenfold miss)."""
    rows = _system(fitted, costs)
    out = []
    for key in keys:
        row = rows.get(key)
        value = 0.0 if row is None else float(row.features @ vector(costs)) + row.offset
        if row is None or value <= 0:
            out.append(10.0)
        else:   # a rate's row is its inverse
            out.append(row.target / value - 1 if row.figure in RATES else value / row.target - 1)
    return np.array(out)


def _prior_rows(prior: StepCosts | None) -> np.ndarray:
    """PRIOR_WEIGHT x cost / prior's cost = PRIOR_WEIGHT, one row a term the prior gives (none without one)."""
    if prior is None:
        return np.zeros((0, len(TERMS)))
    p = vector(prior)
    given = p > 0
    return np.diag(np.where(given, PRIOR_WEIGHT / np.where(given, p, 1.0), 0.0))[given]


def _refined(fitted: Sequence[Evidence], costs: StepCosts,
             prior: StepCosts | None = None) -> tuple[StepCosts, bool]:
    """The costs refined on the replay itself, for loads that arrived at their own times: least squares over the
    replayed figures' relative errors (scipy's trust-region reflective, non-negative, each term's slope from a
    replay with it 2% larger), from the rows' fit. The rows hold a schedule still; a queue's does not (slower
    steps gather more arrivals each), so their slopes can point past the best, and the replay is the judge.
    Kept only where it reads the figures better; also says whether it converged (scipy's tolerances met before
    its budget of replays ran out)."""
    from scipy.optimize import least_squares  # see the note at the imports: 0.4 s, paid only by a fit

    base = vector(costs)
    # Each term in units of its value (a term at 0 in units of START's, or of a millisecond for the API
    # server's time, which START leaves at 0): a slope's 2% step is then a step of that size.
    floor = np.maximum(vector(START), [*([1e-12] * (len(TERMS) - 1)), REQUEST_SCALE_S])
    scale = np.where(base > 0, base, floor)
    start = np.where((base > 0) | (vector(START) > 0), 1.0, 0.0)
    keys = list(_system(fitted, costs))
    lean = _prior_rows(prior)

    def errors(x: np.ndarray) -> np.ndarray:
        c = np.maximum(x, 0.0) * scale
        return np.concatenate([_errors(fitted, _costs(c), keys), lean @ c - PRIOR_WEIGHT])

    before = errors(start)
    found = least_squares(errors, start, bounds=(0.0, np.inf), diff_step=REFINE_STEP,
                          max_nfev=REFINE_EVALUATIONS)
    better = float(np.linalg.norm(found.fun)) < float(np.linalg.norm(before))
    converged = bool(found.status > 0)
    return (_costs(np.maximum(found.x, 0.0) * scale), converged) if better else (costs, converged)


def _energy_row(costs: StepCosts, cell: replay.VirtualCell) -> np.ndarray | None:
    """What a replayed decode cell's energy per token is linear in (StepPower's terms), or None: no figure."""
    generated = cell.energy_tokens or sum(r.tokens for r in cell.requests)
    if cell.status != "Valid" or not generated or not cell.steps:
        return None
    return np.array(sim_truth.energy_terms(costs, cell.steps)) / generated


def fit_power(costs: StepCosts, replayed: Sequence[tuple[Observation, replay.VirtualCell]]
              ) -> tuple[PowerRecord | None, list[FitCell]]:
    """The power model (StepPower: watts while computing and while reading memory) whose energy per token over
    each decode cell's replayed steps reads as measured (relative least squares, NNLS), on the fitted costs'
    schedule; and every such cell's prediction (held-out ones predicted, not fitted). None where no fitted cell measured
    energy (a run without NVML: the CPU build, a machine without a GPU)."""
    from scipy.optimize import nnls  # see the note at the imports: 0.4 s, paid only by a fit

    rows, targets = [], []
    usable = [(obs, cell, _energy_row(costs, cell)) for obs, cell in replayed if obs.energy]
    for obs, _, row in usable:
        if row is not None and not obs.held_out:
            rows.append(row)
            targets.append(statistics.median(obs.energy))
    if not rows:
        return None, []
    a = np.array(rows) / np.array(targets)[:, None]
    scale = np.where(a.max(axis=0) > 0, a.max(axis=0), 1.0)
    solution, _ = nnls(a / scale, np.ones(len(rows)))
    watts = solution / scale
    power = StepPower(compute_w=float(watts[0]), memory_w=float(watts[1]))
    singular = np.linalg.svd(a / scale, compute_uv=False)
    determined = int(np.linalg.matrix_rank(a / scale, tol=1e-3 * singular[0])) if singular[0] > 0 else 0
    cells = []
    for obs, _, row in usable:
        measured = statistics.median(obs.energy)
        predicted = None if row is None else float(row @ watts)
        spread = (max(obs.energy) - min(obs.energy)) / measured if len(obs.energy) > 1 else None
        cells.append(FitCell(variant=obs.variant, key=obs.spec.key, figure="energy_j_per_token", measured=measured,
                             spread=spread, predicted=predicted,
                             error=None if predicted is None else predicted / measured - 1, held_out=obs.held_out))
    errors = [abs(c.error) for c in cells if not c.held_out and c.error is not None]
    return PowerRecord(compute_w=power.compute_w, memory_w=power.memory_w, cells=len(rows),
                       determined=determined, median_abs_error=statistics.median(errors) if errors else None,
                       max_abs_error=max(errors) if errors else None), cells


# --- a stored run's cells as observations ----------------------------------------------------------------

@dataclass(frozen=True)
class RunCells:
    observations: list[Evidence]
    skipped: list[str]                       # cells not used, each with why
    servers: dict[str, ServerRecord]         # each variant's first ready launch
    baseline: ServerRecord                   # the launch whose memory the entry keeps: the baseline's


def _flag(server: ServerRecord, name: str) -> Any:
    """A launch flag however it was spelled (max_num_seqs, --max-num-seqs); None when not given."""
    return value_of(server.flags, name)


def _speculative(server: ServerRecord) -> dict[str, Any]:
    spec = _flag(server, "speculative-config")
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError:
            raise CampaignError(f"{server.launch_dir}: its speculative-config is not JSON: {spec!r}") from None
    return spec if isinstance(spec, dict) else {}


# vLLM's KV page size on CUDA and ROCm where nothing chose another (vllm/platforms/cuda.py: `block_size = 16` when
# the cache config has none). A V1 log prints the size only where something overrides it (a hybrid model's
# "Setting attention block size", MLA's "Forcing kv cache block size"), so a dense model's log prints none.
GPU_DEFAULT_BLOCK = 16


def block_size(server: ServerRecord) -> tuple[int | None, str | None]:
    """The launch's KV page size: as its log printed it, else as its `--block-size` flag set it, else vLLM's GPU
    default where the log says the cache is on a GPU; and, where it was not printed, what it rests on."""
    if server.facts.block_size:
        return server.facts.block_size, None
    flag = _flag(server, "block-size")
    if flag is not None:
        return int(flag), f"its page size of {int(flag)} tokens from its --block-size (the log prints none)"
    if server.facts.device == "GPU":
        return GPU_DEFAULT_BLOCK, (f"its page size vLLM's GPU default of {GPU_DEFAULT_BLOCK} tokens (the log prints "
                                   "none: nothing overrode it)")
    return None, None


def _memory(server: ServerRecord) -> MemoryRecord:
    facts = server.facts
    block, _ = block_size(server)
    missing = [name for name in ("kv_cache_tokens", "max_num_batched_tokens", "max_model_len")
               if not getattr(facts, name)] + ([] if block else ["block_size"])
    if missing:
        raise CampaignError(f"{server.launch_dir}: the startup log gave no {', '.join(missing)}; the simulator "
                            "cannot be sized without them", hint="calibrate from a run whose launches logged them "
                            "(campaign parse-log LOG shows what a log gives)")
    assert facts.kv_cache_tokens is not None and block is not None
    assert facts.max_num_batched_tokens is not None
    cache_bytes = _flag(server, "kv-cache-memory-bytes")
    exact = human_int(str(cache_bytes)) if cache_bytes is not None else None
    per_token = (exact / facts.kv_cache_tokens if exact else facts.available_kv_cache_gib * GIB / facts.kv_cache_tokens
                 if facts.available_kv_cache_gib else None)
    spec = _speculative(server)
    return MemoryRecord(
        kv_cache_tokens=facts.kv_cache_tokens, kv_cache_gib=facts.available_kv_cache_gib, kv_bytes_per_token=per_token,
        block_size=block, tensor_parallel_size=server.tensor_parallel_size(),
        kv_cache_dtype=str(_flag(server, "kv-cache-dtype") or "auto"),
        gpu_memory_utilization=facts.gpu_memory_utilization, max_num_batched_tokens=facts.max_num_batched_tokens,
        max_num_seqs=int(facts.max_num_seqs or _flag(server, "max-num-seqs") or 256),
        speculative=(f"{spec.get('method') or 'draft_model'}:{spec['num_speculative_tokens']}"
                     if spec.get("num_speculative_tokens") else None),
        model_weights_gib=facts.model_weights_gib)


def _entry(name: str, server: ServerRecord, memory: MemoryRecord, window: int, costs: StepCosts,
           source: str = "") -> MeasuredHardware:
    facts = server.facts
    none = ErrorSummary(cells=0, median_abs=None, max_abs=None)
    return MeasuredHardware(
        name=name, description=f"{facts.device or 'device unknown'}, vLLM {facts.vllm_version or 'unknown'}: "
                               f"fitted to {source or 'a run'}",
        source=source, fitted_utc=datetime.now(UTC).isoformat(timespec="seconds"), vllm_version=facts.vllm_version,
        device=facts.device, window=window, step=StepCostsRecord.of(costs), memory=memory, fit=[],
        fitted_error=none, held_out_error=none)


def launch_config(server: ServerRecord, window: int) -> SimConfig:
    """The simulator standing in for this launch: its KV cache, page and scheduler limits as its log said."""
    facts = server.facts
    memory = _memory(server)
    assert facts.max_model_len is not None
    argv = ["--model", "measured", "--hardware", "measured.yaml",
            "--max-num-batched-tokens", str(memory.max_num_batched_tokens), "--max-model-len", str(facts.max_model_len),
            "--tensor-parallel-size", str(memory.tensor_parallel_size), "--max-num-seqs", str(memory.max_num_seqs),
            "--kv-cache-dtype", memory.kv_cache_dtype]
    if memory.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(memory.gpu_memory_utilization)]
    spec = _speculative(server)
    if spec:
        argv += ["--speculative-config", json.dumps(spec)]
    if _flag(server, "enable-prefix-caching") is False or _flag(server, "no-enable-prefix-caching") is True:
        argv.append("--no-enable-prefix-caching")
    entry = _entry("trial", server, memory, window, START)
    try:
        config = sim_config.parse_checked(argv, measured=entry, launch="")
        # The machine's physics only: a fault the environment sets for a simulated "real" server
        # (CAMPAIGN_SIM_FAULTS) is what the fitted costs must absorb, not something to replay on top of them.
        return replace(config, faults=Faults(), speed_factor=1.0)
    except ValueError as exc:
        raise CampaignError(f"{server.launch_dir}: the simulator cannot stand in for this launch: {exc}",
                            hint="calibrate from a run without it") from None


def _figure(cell: StoredCell) -> tuple[Figure, float | None] | str:
    """The figure a stored closed-loop cell is fitted on, or why it is not used (a rate cell: _load)."""
    result, spec = cell.result, cell.result.spec
    if result.status != "Valid":
        return f"{result.status}, not a measurement to fit"
    if spec.phase == "prefill":
        return "ttft_s", None if result.ttft_ms is None else result.ttft_ms / 1000
    if spec.phase == "decode":
        if spec.prompts != "random" or spec.endpoint != "completions":
            return "text prompts through a template are not replayed token for token"
        return "total_tok_s", result.total_tok_s
    return f"a {spec.phase} cell is multi-step and is not replayed"


def _load(result: CellResult) -> list[Timed] | str:
    """A stored rate cell's requests (a night's cell, or a capacity search's probe) as a measured load at their
    own send times (in the hardware's seconds), or why it is not used."""
    spec = result.spec
    if result.status != "Valid":
        return f"{result.status}, not a measurement to fit"
    if spec.prompts != "random" or spec.endpoint != "completions":
        return "text prompts through a template are not replayed token for token"
    records = _served(result.requests or [])
    if isinstance(records, str):
        return records
    shared: dict[str, tuple[int, ...]] | str = {}
    if spec.trace is not None:
        shared = _trace_blocks(spec.trace, records)
    elif spec.sessions is not None:
        shared = _session_blocks(spec, records)
    if isinstance(shared, str):
        return shared
    return _seen(_timed(records, result.time_scale or 1.0, shared))


def _served(stored: Sequence[dict[str, Any]]) -> list[RequestRecord] | str:
    """A stored cell's or experiment's request records, or why they are no load to fit: none stored, or some
    failed (a replay would serve them)."""
    records = [RequestRecord.from_dict(r) for r in stored]
    failed = sum(1 for r in records if not r.ok)
    if not records:
        return "no request records stored"
    return f"{failed} of {len(records)} requests failed: a replay would serve them" if failed else records


def _seen(timed: list[Timed]) -> list[Timed] | str:
    """The load, or why it cannot be fitted: a reply of two tokens or more that arrived whole (its last token
    with its first, as the real CPU build's overloaded API server once sent a queued reply in one chunk) shows
    no decode time, and its TPOT of 0 is no step's."""
    whole = sum(1 for t in timed if t.sent.output_tokens >= 2 and t.last_s <= t.ttft_s)
    if whole:
        return (f"{whole} of {len(timed)} replies arrived whole (every token at once): the server's decode "
                "time was not seen")
    return timed


def _timed(records: Sequence[RequestRecord], scale: float, shared: dict[str, tuple[int, ...]] | None = None
           ) -> list[Timed]:
    """Measured requests as a load at their own send times, in the hardware's seconds (`scale`: the run's time
    scale), each with the blocks it shares (by record id)."""
    # In the order they were sent (a stored cell keeps them as they ended): requests sent at one instant (a
    # trace's arrivals in one millisecond) reach the engine, and are seated, in it; the replay seats them so.
    return [Timed(Sent(r.send_t * scale, r.usage_prompt_tokens or r.prompt_tokens, r.tokens,
                       (shared or {}).get(r.id, ())),
                  (r.chunk_t[0] - r.send_t) * scale, (r.chunk_t[-1] - r.send_t) * scale)
            for r in sorted(records, key=_sent_order) if r.chunk_t]


# The study's experiments whose requests are a load like a rate cell's: unique random-token prompts on the
# completions endpoint, each alone (long context: one prompt after another) or all at once (overload: a burst
# past max-num-seqs), replayed at their own send times; and a capacity search, whose every probe is a rate cell
# (open loop at a rate, or a closed loop at a concurrency). The others say why not.
REPLAYED_EXPERIMENTS = ("long-context", "overload", "slo-search")
_NOT_REPLAYED = {
    "prefix-order": "its arms share a prompt prefix by design, in blocks the replay does not rebuild",
    "agents": "its agents re-send their growing histories, which the replay does not rebuild",
    "context-window": "it measures how the server treats an oversized prompt, not a speed",
    "repeat": "its runs are sustained decode windows, fitted where the night measured them as cells",
}


@dataclass(frozen=True)
class _ExperimentLoad:
    """One load of a stored experiment: its name among the evidence, its requests, and a closed loop's streams."""

    key: str
    timed: list[Timed]
    max_concurrency: int | None = None
    block: int | None = None


def _experiment_loads(result: ExperimentResult, scale: float) -> list[_ExperimentLoad] | str:
    """A stored experiment's requests as measured loads (REPLAYED_EXPERIMENTS; a capacity search's probes one
    each, named `<key> at <rate> req/s` or `<key> at <n> streams`), or why it is not used."""
    if result.kind not in REPLAYED_EXPERIMENTS:
        return _NOT_REPLAYED.get(result.kind, f"a {result.kind} experiment is not replayed")
    if result.kind == "slo-search":
        loads, why = [], "no probe stored"
        for stored in result.details.get("probes") or []:
            try:
                probe = CellResult.model_validate(stored)
            except ValidationError:   # a probe kept in another format than this tool's cells
                why = "its probes are stored in a format this version does not read as cells"
                continue
            timed = _load(probe)
            spec = probe.spec
            if isinstance(timed, str):
                why = timed
                continue
            at = f"{spec.request_rate:g} req/s" if spec.request_rate is not None else f"{spec.max_concurrency} streams"
            loads.append(_ExperimentLoad(f"{result.key} at {at}", timed,
                                         spec.max_concurrency if spec.request_rate is None else None,
                                         shared_block(spec)))
        return loads or why
    if result.status != "Valid":
        return f"{result.status}, not a measurement to fit"
    records = _served(result.requests)
    if isinstance(records, str):
        return records
    timed = _seen(_timed(records, scale))
    return timed if isinstance(timed, str) else [_ExperimentLoad(result.key, timed)]


def _sent_order(record: RequestRecord) -> tuple[float, int]:
    """A record's place in the order it was sent: its send time, then its id's number (the Measurer numbers
    requests as it sends them: r1, r2, ...; another id ranks as 0, so its stored order stands)."""
    number = record.id[1:]
    return record.send_t, int(number) if record.id.startswith("r") and number.isdigit() else 0


def shared_block(spec: CellSpec) -> int | None:
    """Prompt tokens a hash id of the cell's replayed requests stands for (arrivals.run_load), where its prompts
    share blocks: a trace's own block; for agent sessions the largest block that divides the system prompt, a
    user message and a reply, so that every part is whole blocks; None where prompts share nothing."""
    if spec.trace is not None:
        return spec.trace.block_tokens
    if spec.sessions is not None:
        return math.gcd(spec.sessions.system_tokens, spec.sessions.user_tokens, spec.max_tokens)
    return None


def _session_blocks(spec: CellSpec, records: Sequence[RequestRecord]) -> dict[str, tuple[int, ...]] | str:
    """Each stored request's blocks (by record id, of shared_block's size) as the Measurer built its prompt
    (measure.prompts.SessionTurns): the system prompt every session shares, then its session's parts so far (user
    message, reply, user message, ...); turn k of a session extends turn k - 1's prompt. The request sent i-th is
    turn shape.turn(i); its stored length must be that turn's, or the cell is not used."""
    shape, reply_tokens, block = spec.sessions, spec.max_tokens, shared_block(spec)
    assert shape is not None and block is not None
    system = tuple(range(shape.system_tokens // block))
    parts: dict[tuple[int, int], tuple[int, ...]] = {}
    next_id = len(system)
    out: dict[str, tuple[int, ...]] = {}
    for index, record in enumerate(sorted(records, key=_sent_order)):
        session, turn = shape.turn(index)
        if record.prompt_tokens != shape.length(turn, reply_tokens):
            return (f"its stored requests are not its sessions' turns in the order they were sent (the {index + 1}"
                    f"-th has {record.prompt_tokens} prompt tokens, turn {turn + 1} has "
                    f"{shape.length(turn, reply_tokens)})")
        ids = list(system)
        for j in range(2 * turn + 1):
            if (session, j) not in parts:
                count = (shape.user_tokens if j % 2 == 0 else reply_tokens) // block
                parts[session, j] = tuple(range(next_id, next_id + count))
                next_id += count
            ids += parts[session, j]
        out[record.id] = tuple(ids)
    return out


def _trace_blocks(trace: traces.TraceSlice, records: Sequence[RequestRecord]) -> dict[str, tuple[int, ...]] | str:
    """Each stored request's hash ids (by record id), read again from the trace slice the cell replayed, or why
    they cannot be: the file is gone or changed, or the stored requests are not the slice's. A record is the
    slice's request of the same place in the order they were sent (the schedule's, which is the slice's) and
    must have the same lengths."""
    try:
        requests = trace.load()
    except (ConfigError, OSError) as exc:
        return f"its trace's shared prefixes cannot be read again ({exc})"
    if len(requests) != len(records) or any(r.scheduled_t is None for r in records):
        return (f"{len(records)} requests stored of its trace slice's {len(requests)} (stopped early): the replay "
                "would send the others")
    by_time = sorted(records, key=lambda r: (r.scheduled_t, *_sent_order(r)[1:]))
    in_trace = sorted(requests, key=lambda q: q.at_s)   # stable: the slice's order, in which they were sent
    if any((r.prompt_tokens, r.max_tokens) != (q.input_tokens, q.output_tokens)
           for r, q in zip(by_time, in_trace, strict=True)):
        return "its stored requests are not its trace slice's (their lengths differ in the arrival order)"
    return {r.id: q.hash_ids for r, q in zip(by_time, in_trace, strict=True)}


def run_cells(run: RunDir, held_out: Iterable[str] = (), *, fit_experiments: bool = False) -> RunCells:
    """The run's cells as observations, each on its variant's launch, and with `fit_experiments` its replayed
    experiments too; `held_out`: cell keys, or VARIANT:KEY, to predict rather than fit. Experiments are asked
    for, not taken by default: a few requests each, on the real CPU build they read the host's contention more
    than the engine's steps (the demo's overload burst: TTFT 160 ms where its cells' fit predicts 15 ms; some
    of its replies arrived whole), and fitted there they moved its cells from 32% at worst to 71%."""
    servers: dict[str, ServerRecord] = {}
    for server in run.ready_servers():
        first = servers.setdefault(server.variant, server)
        if server.flags != first.flags:
            raise CampaignError(f"{run.root}: variant {server.variant}'s launches ran different flags "
                                f"({first.launch_dir} and {server.launch_dir}); its cells cannot be replayed as one",
                                hint="calibrate from a run whose variants kept their flags (not resumed with --set)")
    if not servers:
        raise CampaignError(f"{run.root}: no launch of this run became ready; nothing was measured to fit",
                            hint="calibrate from a run that measured cells (campaign run MATRIX)")
    window = max(s.facts.max_model_len or 0 for s in servers.values())
    configs = {variant: launch_config(server, window) for variant, server in servers.items()}
    wanted = set(held_out)
    grouped: dict[tuple[str, str], list[StoredCell]] = {}
    for cell in run.cells():
        grouped.setdefault((cell.variant, cell.result.spec.key), []).append(cell)
    observations: list[Evidence] = []
    skipped, seen = [], set()
    for (variant, key), cells in sorted(grouped.items()):
        if cells[0].result.spec.phase == "rate" and variant in configs:
            out = {f"{variant}:{key}", key} & wanted
            loads = [(c, _load(c.result)) for c in cells]
            used = [(c, load) for c, load in loads if not isinstance(load, str) and load]
            spec = cells[0].result.spec
            closed = spec.max_concurrency if spec.request_rate is None else None   # a closed loop's streams
            for _, load in used:
                observations.append(Arrivals(variant, key, configs[variant], tuple(t.sent for t in load),
                                             measured_figures(load), held_out=bool(out), max_concurrency=closed,
                                             block=shared_block(spec)))
            if used:
                seen |= out
            else:
                skipped.append(f"{variant}:{key}: {next(w for _, w in loads if isinstance(w, str))}")
            continue
        reasons = [_figure(c) for c in cells]
        values = [r[1] for r in reasons if isinstance(r, tuple) and r[1] is not None and r[1] > 0]
        kinds = {r[0] for r in reasons if isinstance(r, tuple)}
        if not values or variant not in configs:
            why = next((r for r in reasons if isinstance(r, str)), "no figure stored")
            skipped.append(f"{variant}:{key}: {why if variant in configs else 'no ready launch'}")
            continue
        out = {f"{variant}:{key}", key} & wanted
        seen |= out
        energy = tuple(c.result.energy_j_per_token for c in cells
                       if c.result.status == "Valid" and c.result.energy_j_per_token)
        observations.append(Observation(variant=variant, spec=cells[0].result.spec, config=configs[variant],
                                        figure=kinds.pop(), values=tuple(values), held_out=bool(out),
                                        energy=energy))
    scale = run.manifest().time_scale if run.manifest_path.exists() else 1.0
    for item in run.experiments() if fit_experiments else []:
        variant = item.variant
        replayed = _experiment_loads(item.result, scale) if variant in configs else "no ready launch"
        if isinstance(replayed, str):
            line = f"{variant}:{item.result.key}: {replayed}"
            if line not in skipped:
                skipped.append(line)
            continue
        for exp in replayed:
            out = {f"{variant}:{exp.key}", exp.key, f"{variant}:{item.result.key}", item.result.key} & wanted
            seen |= out
            observations.append(Arrivals(variant, exp.key, configs[variant], tuple(t.sent for t in exp.timed),
                                         measured_figures(exp.timed), held_out=bool(out),
                                         max_concurrency=exp.max_concurrency, block=exp.block))
    unknown = wanted - seen
    skipped_keys = {line.split(": ", 1)[0]: line for line in skipped}
    for name in sorted(unknown):
        hit = next((line for key, line in skipped_keys.items() if name in {key, key.split(":", 1)[1]}), None)
        if hit is not None:
            raise CampaignError(f"--hold-out {name}: that cell is not used, so it cannot be held out ({hit})")
    if unknown:
        keys = ", ".join(sorted({f"{o.variant}:{o.key if isinstance(o, Arrivals) else o.spec.key}"
                                 for o in observations}))
        raise CampaignError(f"--hold-out {sorted(unknown)[0]}: no such cell of this run to hold out",
                            hint=f"cells that can be: {keys}")
    baseline = run.manifest().matrix_model().baseline if run.manifest_path.exists() else None
    return RunCells(observations=observations, skipped=skipped, servers=servers,
                    baseline=servers.get(baseline or "") or next(iter(servers.values())))


def tables_prior(run: RunDir) -> StepCosts | None:
    """What the hardware tables (or the measured entry the profile names) say the run's machine costs, at its
    baseline's flags: calibrate's prior. None where they do not know its card and model (the CPU build) or the
    run has no manifest."""
    if not run.manifest_path.exists():
        return None
    manifest = run.manifest()
    profile, matrix = manifest.profile_model(), manifest.matrix_model()
    if not profile.simulatable:
        return None
    flags = next((v.flags for v in matrix.variants if v.name == matrix.baseline), {})
    try:
        return replay.loaded_profile_config(profile, Path(manifest.profile.path), flags).costs
    except (CampaignError, ValueError):   # a profile the simulator cannot stand in for: the evidence alone
        return None


def calibrate(run: RunDir, name: str, held_out: Iterable[str] = (), *, fit_experiments: bool = False
              ) -> tuple[MeasuredHardware, Fitted, RunCells]:
    """The measured hardware entry for `run`: costs fitted to its cells (and its experiments, with
    `fit_experiments`), memory from its baseline's launch."""
    cells = run_cells(run, held_out, fit_experiments=fit_experiments)
    fitted = fit(cells.observations, prior=tables_prior(run))
    window = max(s.facts.max_model_len or 0 for s in cells.servers.values())
    entry = _entry(name, cells.baseline, _memory(cells.baseline), window, fitted.costs,
                   source=str(run.root)).model_copy(update={
        "fit": fitted.cells, "fitted_error": fitted.summary(held_out=False),
        "held_out_error": fitted.summary(held_out=True), "power": fitted.power})
    return entry, fitted, cells


# --- a peer's per-request exports as observations -----------------------------------------------------------

def _memory_of(config: SimConfig) -> MemoryRecord:
    """The KV cache and scheduler of a profile's launch as the simulator sizes it (an export has no log)."""
    mem = config.memory()
    return MemoryRecord(
        kv_cache_tokens=mem.kv_tokens, kv_cache_gib=round(mem.kv_gib, 2),
        kv_bytes_per_token=mem.kv_gib * GIB / mem.kv_tokens if mem.kv_tokens > 0 else None,
        block_size=config.block(), tensor_parallel_size=config.tensor_parallel_size,
        kv_cache_dtype=config.kv_cache_dtype, gpu_memory_utilization=config.gpu_memory_utilization,
        max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
        speculative=(f"{config.speculative_method or 'draft_model'}:{config.num_speculative_tokens}"
                     if config.num_speculative_tokens else None),
        model_weights_gib=mem.weights_gib)


def calibrate_exports(exports: Sequence[Path], config: SimConfig, profile: str, name: str,
                      held_out: Iterable[Path] = ()) -> tuple[MeasuredHardware, Fitted, list[str]]:
    """The measured hardware entry fitted to peers' per-request exports (analysis.exports.read) of a server
    launched as `config` (the profile's, which sizes its KV cache: an export has no startup log); `held_out`:
    exports to predict rather than fit. Also returns what was left out of each export."""
    config = replace(config, faults=Faults(), speed_factor=1.0)
    held = {p.resolve() for p in held_out}
    unknown = held - {p.resolve() for p in exports}
    if unknown:
        raise CampaignError(f"--hold-out {sorted(unknown)[0]}: not one of the --export files",
                            hint="hold out a file that is also given with --export")
    observations: list[Evidence] = []
    notes: list[str] = []
    tools: set[str] = set()
    names = [p.name for p in exports]
    for path in exports:
        loads = peer_exports.read(path)
        # Its folder too where two files share a name (every GuideLLM run writes benchmarks.json).
        label = path.name if names.count(path.name) == 1 else f"{path.parent.name}/{path.name}"
        for k, export in enumerate(loads, 1):
            key = label if len(loads) == 1 else f"{label}#{k}"   # a GuideLLM sweep: a load a benchmark
            tools.add(export.tool)
            notes += export.notes
            if export.failed:
                notes.append(f"{key}: {export.failed} failed request(s) left out (a failure says nothing of "
                             "speed)")
            observations.append(Arrivals(profile, key, config, tuple(t.sent for t in export.timed),
                                         measured_figures(export.timed), held_out=path.resolve() in held,
                                         max_concurrency=export.max_concurrency))
    fitted = fit(observations, prior=config.costs)
    none = ErrorSummary(cells=0, median_abs=None, max_abs=None)
    entry = MeasuredHardware(
        name=name, description=f"{config.hardware}, {config.model} (vLLM {config.version_style}): fitted to "
                               f"{len(exports)} export(s) of {', '.join(sorted(tools))}",
        source=", ".join(str(p) for p in exports), fitted_utc=datetime.now(UTC).isoformat(timespec="seconds"),
        vllm_version=str(config.version_style), device=config.hardware, window=config.max_model_len,
        step=StepCostsRecord.of(fitted.costs), memory=_memory_of(config), fit=fitted.cells,
        fitted_error=none, held_out_error=none).model_copy(update={
            "fitted_error": fitted.summary(held_out=False), "held_out_error": fitted.summary(held_out=True)})
    return entry, fitted, notes


def write(entry: MeasuredHardware, folder: Path) -> Path:
    """launch_profiles/measured/<name>.yaml (replaced if it exists: a calibration is redone, not accumulated)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{entry.name}.yaml"
    replace_text(path, sim_measured.dump(entry))
    return path
