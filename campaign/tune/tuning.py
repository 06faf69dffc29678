"""`campaign tune MATRIX`: reconfigure, don't just compare. Searches a matrix's `search:` space on the simulator,
then proves its pick on the real server against the baseline, with the usual verdicts.

- Phase 1 (plan.search): Optuna's TPE over the space in simulated time on the profile's simulated hardware (the
  tables' calibration, or a measured entry `campaign calibrate` fitted); every figure is a prediction and is
  labelled with what it rests on.
- Phase 2: the top `confirm` candidates and the baseline become a campaign (a matrix written to the tune's
  folder: a prefill cell and the objective's cell at the best candidate's load, `repeats: auto`), run as
  `campaign run` runs one (the engine, clock, GPU pool or Ray of the command line), and diffed: each candidate's
  keep / revert / no difference / not settled, with the predicted and the measured figure side by side.
- Where the prediction missed (a measured figure more than MISS away from its prediction, or a candidate
  predicted to hold the floor that did not), the step costs (and the power model, where the run measured
  energy) are fitted again to what phase 2 measured (analysis.calibrate, on the confirmation run) and the search
  runs again on them: at most ROUNDS rounds.
- The result: a launch profile with the winning flags (tuned-profile.yaml in the tune's folder) when a candidate
  is kept, settled; otherwise the report says the pick is unsettled, or that nothing beat the baseline.

It sits above the report layer because it runs campaigns and reads their verdicts (night, analysis); the
command line only prints what it returns.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import yaml

from campaign.analysis import calibrate as calibration
from campaign.analysis import recommend
from campaign.core.errors import CampaignError, ConfigError
from campaign.core.hardware import hardware_label
from campaign.core.vllm_flags import merge
from campaign.night import orchestrate
from campaign.plan import replay
from campaign.plan import search as phase_one
from campaign.server.profiles import FlagValue, LaunchProfile, load_profile
from campaign.sim import model as sim_model
from campaign.sim.config import Faults, SimConfig
from campaign.sim.model import StepCosts, StepPower
from campaign.spec.matrix import Matrix, load_matrix
from campaign.spec.search_spec import Objective, SearchBlock
from campaign.stored.records import TunePrediction, TuneRecord
from campaign.stored.store import RunDir, replace_text

ROUNDS = 2      # search, confirm; at most once more on costs fitted to what the confirmation measured
MISS = 0.10     # a measured per-agent speed this far from its prediction: the model missed; calibrate again


@dataclass(frozen=True)
class Measured:
    """One variant of a confirmation round at the objective's load: predicted and measured side by side."""

    variant: str
    flags: dict[str, FlagValue]            # its own flags on top of the baseline's
    predicted: float | None                # the objective's figure (Objective.figure), on the simulator
    measured: float | None                 # the same, the median over the round's repeats
    status: str                            # the cell's status (worst over repeats)
    outcome: str | None = None             # keep / revert / no difference / not settled (None: the baseline)
    recommendation: str = ""

    @property
    def error(self) -> float | None:
        if self.predicted is None or not self.measured:
            return None
        return self.predicted / self.measured - 1


@dataclass
class Round:
    number: int
    basis: str                                            # what the simulator's figures rest on this round
    search: phase_one.SearchResult
    baseline: phase_one.Evaluation
    load: int | None = None                               # the objective's concurrency phase 2 measured at
    run: Path | None = None
    measured: list[Measured] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)       # why the model is fitted again after this round


@dataclass
class Outcome:
    matrix: str
    objective: str
    folder: Path
    figure: str                               # what phase 2 compares (Objective.figure)
    rounds: list[Round] = field(default_factory=list)
    exhaustive: phase_one.SearchResult | None = None
    grid: int | None = None                   # the space's size where it is a grid
    winner: Measured | None = None
    settled: bool = False
    profile: Path | None = None
    verdict: str = ""


def _power_basis(config: SimConfig) -> str:
    if config.power_override is not None:
        return "; power fitted to the last confirmation run's energy"
    power = config.measured.power if config.measured is not None else None
    if power is None:
        return ""
    if power.median_abs_error is None or power.max_abs_error is None:   # written by hand, not fitted
        return f"; power as the entry states it ({power.cells} cell(s) fitted: no fit error to show)"
    return (f"; power fitted to {power.cells} cell(s)' energy (median error {power.median_abs_error:.1%}, "
            f"worst {power.max_abs_error:.1%})")


def _basis(config: SimConfig) -> str:
    if config.costs_override is not None:
        return "step costs fitted to the last confirmation run (campaign calibrate's fit)" + _power_basis(config)
    if config.measured is not None:
        held, fitted = config.measured.held_out_error, config.measured.fitted_error
        error = held if held.cells else fitted
        return (f"measured entry {config.measured.name} ({'held-out' if held.cells else 'fitted'} median error "
                f"{(error.median_abs or 0):.1%}, worst {(error.max_abs or 0):.1%})" + _power_basis(config))
    pair = f"{hardware_label(config.hardware)} / {config.model_shape}"
    if sim_model.fitted(config.hardware, config.model_shape):
        return (f"the tables' {pair} calibration (fitted to the seeds: seed 000's ladder within 10%, seed 004's "
                "table within 8%, median 2%)")
    return (f"the tables' {pair}, not fitted to any measurement (datasheet figures and default efficiencies; "
            "its error on real runs is not known: calibrate from a run of this card, campaign calibrate RUN)")


def _config_for(profile: LaunchProfile, profile_path: Path, base: Mapping[str, FlagValue],
                costs: StepCosts | None, power: StepPower | None = None) -> phase_one.ConfigFor:
    """The simulator phase 1 predicts with: the machine's physics only (a fault or a launch's noise, set for the
    real server's simulator, is not the model's), with fitted costs (and power) once a confirmation has been
    measured."""
    def config_for(flags: Mapping[str, FlagValue]) -> SimConfig:
        config = replay.loaded_profile_config(profile, profile_path, merge(dict(base), dict(flags)))
        return replace(config, faults=Faults(), speed_factor=1.0, costs_override=costs, power_override=power)
    return config_for


def _confirmation_matrix(matrix: Matrix, profile_path: Path, block: SearchBlock, base: Mapping[str, FlagValue],
                         candidates: list[phase_one.Evaluation], load: int, number: int) -> dict[str, Any]:
    objective = block.objective
    variants = [{"name": matrix.baseline, "flags": dict(base), "description": "the baseline"}]
    for index, candidate in enumerate(candidates, 1):
        variants.append({"name": f"candidate-{index}", "flags": merge(dict(base), candidate.flags),
                         "description": f"predicted {candidate.value:g} {objective.unit}"})
    return {
        "schema_version": 1, "name": f"{matrix.name}-confirm-{number}", "profile": str(profile_path),
        "description": f"campaign tune {matrix.name}, round {number}: the search's candidates against the baseline",
        "baseline": matrix.baseline, "variants": variants, "min_effect": matrix.min_effect,
        "window_s": objective.window(), "floors": [objective.floor_tok_s or matrix.floors[0]],
        "repeats": "auto", "max_repeats": matrix.max_repeats or 4,
        "workloads": [
            {"kind": "prefill", "contexts": [objective.context]},
            # A lighter load beside the objective's: a refit from this run can then tell a step's fixed cost
            # from its cost per agent (one load alone cannot), should the prediction have missed.
            {"kind": "decode", "mode": "sustained", "contexts": [objective.context],
             "concurrency": sorted({max(1, load // 4), load}),
             "max_tokens": objective.max_tokens, "ttft": "warm", "warmup_s": phase_one.WARMUP_S},
            *([_open_loop_workload(objective)] if objective.kind == "goodput" and objective.slo is not None else []),
        ],
    }


def _open_loop_workload(objective: Objective) -> dict[str, Any]:
    """The goodput objective's load as the confirmation night's workload: the very cell phase 1 measured (fresh
    prompts or agent sessions at its rate, or its trace's slice at the trace's own times)."""
    assert objective.slo is not None
    slo = {b.name: b.limit_ms for b in objective.slo.bounds}
    if objective.trace is not None:
        return {"kind": "trace", **objective.trace.model_dump(exclude={"speed"}, exclude_none=True),
                "speeds": [objective.trace.speed], "slo": slo}
    return {"kind": "rate", "rates": [objective.rate_rps], "max_tokens": objective.max_tokens,
            "duration_s": objective.window(), "slo": slo,
            **({"contexts": [objective.context]} if objective.sessions is None else
               {"sessions": objective.sessions.model_dump()})}


@dataclass(frozen=True)
class Launching:
    """How phase 2 launches: as `campaign run` does (its --engine, --clock, --gpus, --executor)."""

    engine: str | None = None
    clock: Literal["wall", "virtual"] = "wall"
    gpus: list[int] | None = None
    ray: bool = False
    ray_address: str | None = None
    live: bool | None = False


def _run(matrix_file: Path, folder: Path, how: Launching) -> RunDir:
    loaded, matrix_path, profile, profile_path = orchestrate.load_night(str(matrix_file), None, None, None)
    with orchestrate.started(loaded, matrix_path, profile, profile_path, engine=how.engine, out=folder,
                             gpus=how.gpus, ray=how.ray, ray_address=how.ray_address, clock=how.clock) as night:
        night.execute_pending(how.live)
        return night.run


def _measured(run: RunDir, objective: Objective, load: int) -> dict[str, tuple[float | None, str]]:
    """Each variant's figure at the objective's load (the median over repeats) and its worst status."""
    phase = "rate" if objective.kind == "goodput" else "decode"
    by_variant: dict[str, list[Any]] = {}
    for cell in run.cells():
        spec = cell.result.spec
        if spec.phase == phase and (phase == "rate" or spec.concurrency == load):
            by_variant.setdefault(cell.variant, []).append(cell.result)
    name = {"agents-at-floor": "per_request_tok_s", "total-tok-s": "total_tok_s", "goodput": "goodput_rps",
            "joules-per-token": "energy_j_per_token"}
    out = {}
    for variant, results in by_variant.items():
        values = [getattr(r, name[objective.kind]) for r in results if r.status == "Valid"]
        values = [v for v in values if v is not None]
        worst = next((r.status for r in results if r.status != "Valid"), "Valid")
        out[variant] = (statistics.median(values) if values else None, worst)
    return out


def _write_profile(profile_path: Path, flags: Mapping[str, FlagValue], folder: Path, lines: list[str]) -> Path:
    raw = yaml.safe_load(profile_path.read_text())
    raw["flags"] = merge(dict(raw.get("flags") or {}), dict(flags))
    raw["description"] = f"{raw.get('description', '')} (tuned: {', '.join(f'{k} {v}' for k, v in flags.items())})"
    path = folder / "tuned-profile.yaml"
    head = "".join(f"# {line}\n" for line in ["Written by `campaign tune`: the winning flags, and the evidence.",
                                              *lines])
    replace_text(path, head + yaml.safe_dump(raw, sort_keys=False))
    return path


def tune(matrix_name: str, *, out: Path, how: Launching, trials: int | None = None, confirm: int | None = None,
         exhaustive: bool = False) -> Outcome:
    matrix, matrix_path, _ = load_matrix(matrix_name)
    if matrix.search is None:
        raise ConfigError(str(matrix_path), "search", "the matrix has no search: block for campaign tune to search",
                          hint="add search: {flags: ..., objective: ...} (docs/tune.md)")
    block = matrix.search
    profile, profile_path = load_profile(matrix.profile)
    if not profile.simulatable:
        raise ConfigError(str(profile_path), "hardware", "the profile names no simulated hardware, so phase 1 has "
                          "nothing to search on", hint="give it hardware: (the tables') and model_shape:, or "
                          "calibrate it from a real run: campaign calibrate RUN_DIR")
    baseline = next(v for v in matrix.variants if v.name == matrix.baseline)
    base = dict(baseline.flags)
    stamp = f"tune-{matrix.name}-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    folder = next(out / name for name in (stamp, *(f"{stamp}-{i}" for i in range(2, 1000)))
                  if not (out / name).exists())
    folder.mkdir()
    result = Outcome(matrix.name, block.objective.describe(), folder, block.objective.figure, grid=block.grid_size())
    costs: StepCosts | None = None
    power: StepPower | None = None
    refused: dict[str, phase_one.Evaluation] = {}     # what the real server would not start, fed back
    wanted = confirm if confirm is not None else block.confirm
    for number in range(1, ROUNDS + 1):
        config_for = _config_for(profile, profile_path, base, costs, power)
        base_config = config_for({})
        if block.objective.lower_is_better and base_config.power is None:
            raise ConfigError(str(profile_path), "hardware", "joules per token needs a power model, and this "
                              "profile's hardware has none (the tables know speeds, not power; a measured entry "
                              "has one only where its run measured energy)",
                              hint="calibrate from a run on the GPU with NVML energy: campaign calibrate RUN_DIR")
        baseline_eval = phase_one.evaluate(base_config, {}, block)
        kv = baseline_eval.kv_cache_tokens
        found = phase_one.search(block, config_for, trials=trials, baseline_kv=kv, known=refused)
        current = Round(number, _basis(base_config), found, baseline_eval)
        result.rounds.append(current)
        if exhaustive and number == 1:
            result.exhaustive = phase_one.exhaustive(block, config_for, baseline_kv=kv, known=found)
        better = [e for e in found.ranked() if e.feasible and found.score(e) > found.score(baseline_eval)
                  ][:max(1, wanted)]
        if not better or not wanted:
            result.verdict = ("nothing the search found beats the baseline's predicted "
                              f"{baseline_eval.value:g} {block.objective.unit}" if not better
                              else "phase 2 not asked for (--confirm 0): every figure above is a prediction")
            if result.winner is None:
                return result
            break
        load = block.objective.concurrency or (4 if block.objective.kind == "goodput" else int(better[0].value))
        current.load = load
        matrix_file = folder / f"confirm-{number}.yaml"
        matrix_file.write_text(yaml.safe_dump(_confirmation_matrix(matrix, profile_path, block, base, better,
                                                                   load, number), sort_keys=False))
        run = _run(matrix_file, folder, how)
        current.run = run.root
        diffs = {d.variant: d for d in recommend.diff_run(run)}
        measured = _measured(run, block.objective, load)
        failed = {f.variant: f"launch failed: {f.failure_kind}" for f in run.failures()}
        predicted = {matrix.baseline: phase_one.figure_at(base_config, block.objective, load)}
        names: dict[str, dict[str, FlagValue]] = {matrix.baseline: {}}
        names |= {f"candidate-{i}": e.flags for i, e in enumerate(better, 1)}
        for name, flags in names.items():
            if name != matrix.baseline:
                predicted[name] = phase_one.figure_at(config_for(flags), block.objective, load)
            speed, status = measured.get(name, (None, failed.get(name, "not measured")))
            if name in failed and name != matrix.baseline:   # infeasible from now on: the real server said so
                refused[phase_one.key(flags)] = phase_one.Evaluation(flags, 0.0, infeasible=f"the real server: "
                                                                     f"{failed[name]}")
            diff = diffs.get(name)
            current.measured.append(Measured(name, dict(flags), predicted[name], speed, status,
                                             diff.outcome if diff else None, diff.recommendation if diff else ""))
        # The night keeps what was predicted for it beside what it measured: its report shows the tune's evidence.
        run.write_tune(TuneRecord(
            round=number, objective=result.objective, figure=result.figure, load=load, basis=current.basis,
            predictions=[TunePrediction(variant=m.variant, flags=dict(m.flags), predicted=m.predicted,
                                        measured=m.measured, status=m.status, outcome=m.outcome)
                         for m in current.measured]))
        floor = block.objective.floor_tok_s
        speeds_missed = False
        for row in current.measured:
            if row.variant in failed:
                current.missed.append(f"{row.variant}: the real server would not start it ({failed[row.variant]})")
            elif row.error is not None and abs(row.error) > MISS:
                speeds_missed = True
                shown = ".3g" if block.objective.lower_is_better else ".1f"
                current.missed.append(f"{row.variant}: predicted {row.predicted:{shown}} {block.objective.figure}, "
                                      f"measured {row.measured:{shown}} ({row.error:+.0%})")
            elif floor and (row.predicted or 0) >= floor > (row.measured or 0):
                speeds_missed = True
                current.missed.append(f"{row.variant}: predicted to hold {floor:g} tok/s per agent, measured "
                                      f"{row.measured or 0:.1f}")
        # An energy objective the real server measured no energy for (no NVML there, or the simulator on the
        # wall clock) is not confirmed: a keep would rest on the other figures only.
        unmeasured = block.objective.kind == "joules-per-token" and not any(   # whatever a cell's status
            c.result.energy_j_per_token is not None for c in run.cells() if c.result.spec.phase == "decode")
        if unmeasured:
            current.missed.append("no energy was measured in this round (no NVML on the measured machine, or the "
                                  "simulator on the wall clock): joules per token is not confirmed, and a keep "
                                  "rests on the other figures only")
        kept = [row for row in current.measured if row.outcome == "keep" and row.variant not in failed]
        started = [row for row in current.measured if row.variant not in failed and row.variant != matrix.baseline]
        if kept or (result.winner is None and started):   # measured evidence stands; a later keep replaces it
            result.winner = kept[0] if kept else started[0]
            result.settled = bool(kept) and not unmeasured
        if not current.missed or unmeasured:   # another round would measure no energy either
            break
        if speeds_missed:   # the costs were wrong: fit them to what was measured (a refusal alone is not)
            try:
                refit = calibration.fit(calibration.run_cells(run).observations)
                costs = refit.costs
                power = refit.power.power() if refit.power is not None else power   # no energy: keep the last
            except CampaignError as exc:   # what was measured stands; the search is not run on a guess
                current.missed.append(f"no refit from {run.root.name}: {exc.message}")
                break
    searched_again = f"; then {result.verdict}" if result.verdict else ""
    if result.winner is not None and result.settled:
        evidence = [f"{result.objective}; {matrix.name}'s search, {len(result.rounds)} round(s)",
                    f"{result.winner.variant}: {result.winner.recommendation}"]
        result.profile = _write_profile(profile_path, merge(dict(base), result.winner.flags), folder, evidence)
        result.verdict = f"keep {result.winner.variant} (settled): {result.profile}{searched_again}"
    elif result.winner is not None:
        result.verdict = (f"unsettled: {result.winner.variant} is the search's pick, but no candidate was kept "
                          f"against the baseline ({result.winner.outcome}); no profile written{searched_again}")
    else:
        result.verdict = ("no candidate was measured: the real server started none "
                          + (f"({'; '.join(m for r in result.rounds for m in r.missed)})" if result.rounds else "")
                          + searched_again)
    return result
