"""`campaign calibrate RUN`: the simulator's step costs fitted to a stored run's cells, so that a machine the
hardware tables do not know (a new card, the CPU build) can be simulated after one real run.

What is fitted: the five terms one engine step's time is linear in (campaign.sim.model.StepCosts: a fixed cost
per step, per decode position, per prompt token, per prompt token x context, per token of KV read). What is
taken as measured: the KV cache, its page size and the scheduler's limits, from each launch's startup log.

How: each cell is replayed on the engine (plan.replay, the tool's own method in simulated time) with trial
costs; every step the replay ran is a row of what its time is linear in (StepTruth.features), so a cell's figure
is linear in the costs *for that schedule*: a TTFT is the sum of its steps' times; a rate is its tokens over the
sum of its steps' times. Non-negative least squares (scipy's NNLS) on the relative errors gives new costs, the
cells are replayed with them (the schedule may shift: who shares a step with whom), and so on until the new
costs move no cell's figure by 0.2% on the last schedule (at most 8 rounds; the report says when it did not
settle). The final figures are replayed with the final costs. The replay is the only model: no hand-written
formula of a cell's figure stands between the costs and what the simulator will publish, so the fit's error
per cell is the simulator's own. Terms the cells cannot tell apart (rows in proportion: one context, one load)
are split arbitrarily by NNLS; the report says how many of the five the cells determine.

Cells used: prefill (its TTFT) and decode cells of random-token prompts (total tok/s), each the median over the
run's repeats, with their spread (the machine's own noise, which no fit can beat). Rate, trace and agent cells and
the study's experiments are open-loop or multi-step and are not replayed (plan.replay): they are listed as
skipped. Held-out cells are predicted by the fit, never fitted: the honest test of it.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import numpy as np
from scipy.optimize import nnls

from campaign.core.errors import CampaignError
from campaign.core.vllm_flags import human_int, value_of
from campaign.measure.cells import CellSpec
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
TERMS = ("fixed_s", "decode_s_per_token", "prefill_s_per_token", "attention_s_per_token_ctx", "kv_read_s_per_token")
MAX_ITERATIONS = 8
SETTLED = 0.002          # the fit has settled when no fitted cell's figure moves by more than this share
# A starting point only (the iterations leave it behind): a few milliseconds a step, a small model's token costs.
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

    def summary(self, held_out: bool, figures: tuple[str, ...] = ("ttft_s", "total_tok_s")) -> ErrorSummary:
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
        return _summed(steps) if steps else None
    first_arrival = min(r.arrival for r in cell.requests)
    start, end = cell.window if cell.window is not None else (first_arrival, math.inf)
    steps = [s for s in cell.steps if s.start >= start and s.end <= end]
    busy = sum(s.model_s for s in steps)
    if not steps or busy <= 0:
        return None
    return _summed(steps) / (simulated * busy)


def _summed(steps: Sequence[StepTruth]) -> np.ndarray:
    summed: np.ndarray = np.array([s.features() for s in steps], dtype=float).sum(axis=0)
    return summed


def _target(obs: Observation) -> float:
    """The measured figure in the row's units: seconds for a TTFT, seconds per token for a rate."""
    return obs.measured if obs.figure == "ttft_s" else 1.0 / obs.measured


def _costs(vector: Sequence[float]) -> StepCosts:
    return StepCosts(**{name: float(value) for name, value in zip(TERMS, vector, strict=True)})


def _vector(costs: StepCosts) -> np.ndarray:
    return np.array([getattr(costs, name) for name in TERMS])


def _replay(obs: Observation, costs: StepCosts) -> replay.VirtualCell:
    return replay.run_cell(replace(obs.config, costs_override=costs), obs.spec)


def fit(observations: Sequence[Observation], start: StepCosts = START) -> Fitted:
    """The costs that make the replayed cells read as measured (relative least squares over the fitted cells),
    and every cell's prediction with them: fitted cells are the fit's error, held-out ones its prediction's."""
    fitted = [o for o in observations if not o.held_out]
    if not any(o.figure == "ttft_s" for o in fitted) or not any(o.figure == "total_tok_s" for o in fitted):
        raise CampaignError("calibrate needs a prefill cell and a decode cell to fit (prefill fixes a prompt "
                            "token's cost, decode a step's)",
                            hint="calibrate from a run with both (the demo matrix has both), or hold fewer out")
    costs, iterations, used, settled, determined = start, 0, np.zeros(len(TERMS), dtype=bool), False, 0
    for iterations in range(1, MAX_ITERATIONS + 1):   # noqa: B007 (the count is reported)
        rows, targets = [], []
        for obs in fitted:
            row = _row(_replay(obs, costs), obs)
            if row is not None:
                rows.append(row)
                targets.append(_target(obs))
        if not rows:
            raise CampaignError("no cell could be replayed with trial costs (every one over capacity or invalid)",
                                hint="calibrate from a run whose prefill and decode cells are Valid")
        a = np.array(rows) / np.array(targets)[:, None]
        used = a.max(axis=0) > 0
        scale = np.where(used, a.max(axis=0), 1.0)
        solution, _ = nnls(a / scale, np.ones(len(rows)))
        new = _costs(solution / scale)
        moved = np.abs((a @ _vector(new)) / (a @ _vector(costs)) - 1)
        costs = new
        # Terms whose rows are (nearly) proportional cannot be told apart by these cells: NNLS splits them
        # arbitrarily, which predicts the measured shapes well and others (another context, load) less so.
        determined = int(np.linalg.matrix_rank(a / scale, tol=1e-3 * np.linalg.svd(a / scale, compute_uv=False)[0]))
        settled = float(moved.max()) < SETTLED
        if settled:
            break
    cells = []
    replayed = [(obs, _replay(obs, costs)) for obs in observations]
    for obs, cell in replayed:
        predicted = figure_of(cell, obs.figure) if cell.status == "Valid" else None
        cells.append(FitCell(variant=obs.variant, key=obs.spec.key, figure=obs.figure, measured=obs.measured,
                             spread=obs.spread, predicted=predicted,
                             error=None if predicted is None else predicted / obs.measured - 1, held_out=obs.held_out))
    power, energy_cells = fit_power(costs, replayed)
    return Fitted(costs=costs, cells=cells + energy_cells, iterations=iterations,
                  unmeasured=[name for name, seen in zip(TERMS, used, strict=True) if not seen], settled=settled,
                  determined=determined, power=power)


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
    observations: list[Observation]
    skipped: list[str]                       # cells not used, each with why
    servers: dict[str, ServerRecord]         # each variant's first ready launch


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


def _memory(server: ServerRecord) -> MemoryRecord:
    facts = server.facts
    missing = [name for name in ("kv_cache_tokens", "block_size", "max_num_batched_tokens", "max_model_len")
               if not getattr(facts, name)]
    if missing:
        raise CampaignError(f"{server.launch_dir}: the startup log gave no {', '.join(missing)}; the simulator "
                            "cannot be sized without them", hint="calibrate from a run whose launches logged them "
                            "(campaign parse-log LOG shows what a log gives)")
    assert facts.kv_cache_tokens is not None and facts.block_size is not None
    assert facts.max_num_batched_tokens is not None
    cache_bytes = _flag(server, "kv-cache-memory-bytes")
    exact = human_int(str(cache_bytes)) if cache_bytes is not None else None
    per_token = (exact / facts.kv_cache_tokens if exact else facts.available_kv_cache_gib * GIB / facts.kv_cache_tokens
                 if facts.available_kv_cache_gib else None)
    spec = _speculative(server)
    tp = facts.tensor_parallel_size or _flag(server, "tensor-parallel-size") or 1
    return MemoryRecord(
        kv_cache_tokens=facts.kv_cache_tokens, kv_cache_gib=facts.available_kv_cache_gib, kv_bytes_per_token=per_token,
        block_size=facts.block_size, tensor_parallel_size=int(tp),
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
    """The figure a stored cell is fitted on, or why it is not used."""
    result, spec = cell.result, cell.result.spec
    if result.status != "Valid":
        return f"{result.status}, not a measurement to fit"
    if spec.phase == "prefill":
        return "ttft_s", None if result.ttft_ms is None else result.ttft_ms / 1000
    if spec.phase == "decode":
        if spec.prompts != "random" or spec.endpoint != "completions":
            return "text prompts through a template are not replayed token for token"
        return "total_tok_s", result.total_tok_s
    return f"a {spec.phase} cell is open-loop or multi-step and is not replayed"


def run_cells(run: RunDir, held_out: Iterable[str] = ()) -> RunCells:
    """The run's prefill and decode cells as observations, each on its variant's launch; `held_out`: cell keys,
    or VARIANT:KEY, to predict rather than fit."""
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
    observations, skipped, seen = [], [], set()
    for (variant, key), cells in sorted(grouped.items()):
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
    unknown = wanted - seen
    skipped_keys = {line.split(": ", 1)[0]: line for line in skipped}
    for name in sorted(unknown):
        hit = next((line for key, line in skipped_keys.items() if name in {key, key.split(":", 1)[1]}), None)
        if hit is not None:
            raise CampaignError(f"--hold-out {name}: that cell is not used, so it cannot be held out ({hit})")
    if unknown:
        keys = ", ".join(sorted({f"{o.variant}:{o.spec.key}" for o in observations}))
        raise CampaignError(f"--hold-out {sorted(unknown)[0]}: no such cell of this run to hold out",
                            hint=f"cells that can be: {keys}")
    return RunCells(observations=observations, skipped=skipped, servers=servers)


def calibrate(run: RunDir, name: str, held_out: Iterable[str] = ()) -> tuple[MeasuredHardware, Fitted, RunCells]:
    """The measured hardware entry for `run`: costs fitted to its cells, memory from its baseline's launch."""
    cells = run_cells(run, held_out)
    fitted = fit(cells.observations)
    baseline = run.manifest().matrix_model().baseline if run.manifest_path.exists() else None
    server = cells.servers.get(baseline or "") or next(iter(cells.servers.values()))
    window = max(s.facts.max_model_len or 0 for s in cells.servers.values())
    entry = _entry(name, server, _memory(server), window, fitted.costs, source=str(run.root)).model_copy(update={
        "fit": fitted.cells, "fitted_error": fitted.summary(held_out=False),
        "held_out_error": fitted.summary(held_out=True), "power": fitted.power})
    return entry, fitted, cells


def write(entry: MeasuredHardware, folder: Path) -> Path:
    """launch_profiles/measured/<name>.yaml (replaced if it exists: a calibration is redone, not accumulated)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{entry.name}.yaml"
    replace_text(path, sim_measured.dump(entry))
    return path
