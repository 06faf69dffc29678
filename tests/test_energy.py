"""Joules per token: the simulator's power model, its fit by `campaign calibrate`, and `campaign tune` minimising
it, checked against the simulator's own records.

The rig is a made-up GPU-like machine: the demo's measured entry (its KV cache and scheduler, as the CPU build's
log said) with GPU-like step costs and a power model stated here, the truth of these tests (the launch's GPUs
draw 230 W while computing and 170 W while reading memory). No table of this project holds a
power model (a datasheet TDP says what a card may draw, not what a step does), and this machine has no GPU to
measure one: on a real GPU the figures come from NVML's energy counter (measure.runner), and calibrate fits
them the same way it fits them here.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from campaign.cli import run_cli
from campaign.core.errors import ConfigError
from campaign.measure.cells import CellSpec
from campaign.plan import replay
from campaign.sim import measured as sim_measured
from campaign.sim.model import StepCosts, StepPower
from campaign.stored.store import RunDir
from campaign.tune import tuning

ROOT = Path(__file__).resolve().parents[1]
COSTS = {"fixed_s": 0.006, "decode_s_per_token": 3e-5, "prefill_s_per_token": 4e-5,
         "attention_s_per_token_ctx": 2e-9, "kv_read_s_per_token": 2e-7}
POWER = StepPower(compute_w=230.0, memory_w=170.0)


def run_cli_out(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = run_cli(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture()
def rig(tmp_path: Path) -> Path:
    """A profile naming the made-up machine's measured entry (format 2, with its power model)."""
    raw = yaml.safe_load((ROOT / "launch_profiles" / "measured" / "cpu-tiny.yaml").read_text())
    raw.update(schema_version=2, name="gpu-like", description="made up for tests/test_energy.py", step=COSTS,
               power={"compute_w": POWER.compute_w, "memory_w": POWER.memory_w, "cells": 0, "determined": 2,
                      "median_abs_error": None, "max_abs_error": None})
    entry = tmp_path / "gpu-like.yaml"
    entry.write_text(yaml.safe_dump(raw))
    profile = yaml.safe_load((ROOT / "launch_profiles" / "cpu-tiny.yaml").read_text())
    profile.update(hardware=str(entry), description="the made-up GPU-like machine")
    path = tmp_path / "gpu-like-profile.yaml"
    path.write_text(yaml.safe_dump(profile))
    return path


def records_energy(costs: StepCosts, power: StepPower, cell: replay.VirtualCell) -> float:
    """The cell's energy from the engine's step records, written out here by the model's definition."""
    compute_s = memory_s = 0.0
    for step in cell.steps:
        compute = (costs.decode_s_per_token * step.decode_tokens + costs.prefill_s_per_token * step.prefill_tokens
                   + costs.attention_s_per_token_ctx * step.prefill_weight)
        memory = costs.fixed_s + costs.kv_read_s_per_token * step.context_read
        compute_s += step.model_s * compute / (compute + memory)
        memory_s += step.model_s * memory / (compute + memory)
    return power.compute_w * compute_s + power.memory_w * memory_s


def test_energy_per_token_is_what_the_engines_steps_drew(rig: Path) -> None:
    """Truth: a replayed decode cell's energy per token is the energy its steps drew by the model (compute and
    memory power over each step's shares of its time, its drain after the window included) over the tokens it
    measured; the engine never idles
    inside a cell, so the GPUs' mean power lies between the two; batching spreads a step's fixed cost over more
    tokens, so more streams cost fewer joules each."""
    config = replay.profile_config(str(rig), {})
    assert config.power == POWER
    figures = {}
    for streams in (1, 8):
        spec = CellSpec(phase="decode", mode="sustained", context_tokens=512, concurrency=streams, max_tokens=64,
                        window_s=4, warmup_s=0.5)
        cell = replay.run_cell(config, spec)
        assert cell.status == "Valid" and cell.energy_j_per_token is not None
        # Over the whole step, as the runner counts NVML's: the drain after the window too (its tokens and its
        # steps), which the cell's window-time records do not hold.
        assert cell.energy_tokens is not None and cell.energy_tokens > sum(r.tokens for r in cell.requests)
        tokens = cell.energy_tokens
        energy = records_energy(config.costs, POWER, cell)
        assert cell.energy_j_per_token == pytest.approx(energy / tokens, rel=1e-9)
        span = cell.steps[-1].end - cell.steps[0].start
        assert span == pytest.approx(sum(s.model_s for s in cell.steps), rel=1e-9)   # no idle gap
        assert POWER.memory_w < energy / span < POWER.compute_w
        figures[streams] = cell.energy_j_per_token
    assert figures[8] < figures[1] / 3, figures
    prefill = replay.run_cell(config, CellSpec(phase="prefill", mode="fixed", context_tokens=512, concurrency=1))
    assert prefill.energy_j_per_token is None   # NVML's energy is judged per decode token only
    # The tables carry no power model: no energy figure, not a guessed one.
    assert replay.profile_config("a5000-tp2", {}).power is None


def test_calibrate_finds_the_power_model_again_from_a_runs_energy(
        rig: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A campaign in simulated time on the machine stores each decode cell's energy per token (as the runner
    stores NVML's); `campaign calibrate` on that run fits the step costs and the two power terms from a start
    that knows neither, prints the fit, and writes them. The simulator's own truth: within 1%, and the
    held-out cell's energy predicted within 1%. Warm cells (cached prompts: decode steps) at two contexts and
    three loads pin the costs; cold ones add prompt arithmetic, so compute and memory power are told apart."""
    matrix = {
        "schema_version": 1, "name": "energy-fit", "profile": str(rig), "baseline": "baseline",
        "variants": [{"name": "baseline"}],
        "workloads": [{"kind": "prefill", "contexts": [256, 1536]},
                      {"kind": "decode", "mode": "sustained", "contexts": [256, 1536], "concurrency": [1, 4, 16],
                       "max_tokens": 64, "warmup_s": 0.5, "ttft": "warm"},
                      {"kind": "decode", "mode": "sustained", "contexts": [1536], "concurrency": [2, 8],
                       "max_tokens": 64, "warmup_s": 0.5}],
        "repeats": 1, "window_s": 4}
    path = tmp_path / "energy-fit.yaml"
    path.write_text(yaml.safe_dump(matrix))
    runs = tmp_path / "runs"
    code, _, err = run_cli_out(capsys, "run", "--no-report", str(path), "--engine", "sim", "--clock", "virtual",
                               "--out", str(runs),
                               "--plain")
    assert code == 0, err[-2000:]
    (run,) = [RunDir(p) for p in (runs / "energy-fit").iterdir() if p.is_dir()]
    stored = [c.result.energy_j_per_token for c in run.cells() if c.result.spec.phase == "decode"]
    assert len(stored) == 8 and all(e is not None and e > 0 for e in stored)
    held = "decode-sustained-L1536-C4-N64-W4-Twarm"
    code, out, err = run_cli_out(capsys, "calibrate", str(run.root), "--hold-out", held, "--name", "refit",
                                 "--dir", str(tmp_path / "measured"))
    assert code == 0, err
    entry = sim_measured.load(tmp_path / "measured" / "refit.yaml")
    assert entry.schema_version == sim_measured.MEASURED_SCHEMA_VERSION and entry.power is not None
    costs = entry.step.model_dump()
    for name, true in COSTS.items():   # the speed costs too, from the same start that knew neither
        assert costs[name] == pytest.approx(true, rel=0.01), (name, costs)
    found = entry.power.power()
    for name in ("compute_w", "memory_w"):
        assert getattr(found, name) == pytest.approx(getattr(POWER, name), rel=0.01), (name, found)
    assert entry.power.determined == 2 and entry.power.cells == 7
    energy = [c for c in entry.fit if c.figure == "energy_j_per_token"]
    assert len(energy) == 8 and all(c.error is not None and abs(c.error) <= 0.01 for c in energy), energy
    assert [c.key for c in energy if c.held_out] == [held]
    line = next(x for x in out.splitlines() if "power (all GPUs)" in x)
    assert re.search(r"power \(all GPUs\): 2[23]\d W while computing, 1[67]\d W while reading memory, fitted to 7 "
                     r"decode cell\(s\)' energy per token: median \|error\| 0\.\d%", line), line
    # The speed figures' error summaries are over speed cells only: the energy rows are the power's.
    assert entry.fitted_error.cells == 9 and entry.held_out_error.cells == 1


def test_a_run_without_energy_says_joules_cannot_be_predicted(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The demo's real CPU run measured no energy (no NVML): its entry has no power model, and says so."""
    run = tmp_path / "run"   # a copy: calibrate keeps its fit in the run it read (calibrations/)
    shutil.copytree(ROOT / "tests" / "fixtures" / "runs" / "cpu-demo", run)
    code, out, err = run_cli_out(capsys, "calibrate", str(run), "--dir", str(tmp_path))
    assert code == 0, err
    assert "power: the run measured no energy" in out
    assert sim_measured.load(tmp_path / "cpu-tiny.yaml").power is None


def tune_matrix(tmp_path: Path, rig: Path, confirm: int = 1, max_repeats: int | None = None) -> Path:
    """Joules per token at 8 agents over prefix caching x the chunk x max-num-seqs (12 configurations); the
    baseline caches nothing, so every turn prefills its agent's whole context again."""
    raw = {
        "schema_version": 1, "name": "energy-tune", "profile": str(rig), "baseline": "baseline",
        "variants": [{"name": "baseline", "flags": {"enable-prefix-caching": False, "max-num-batched-tokens": 256}}],
        "workloads": [{"kind": "prefill", "contexts": [512]}], "window_s": 4,
        "search": {"flags": {"enable-prefix-caching": [False, True], "max-num-batched-tokens": [256, 1024, 2048],
                             "max-num-seqs": [8, 16]},
                   "objective": {"kind": "joules-per-token", "context": 512, "max_tokens": 64, "concurrency": 8,
                                 "window_s": 8},
                   "trials": 6, "confirm": confirm}}
    if max_repeats is not None:   # the confirmation night's rounds at most (default 4)
        raw.update(repeats="auto", max_repeats=max_repeats)
    path = tmp_path / "energy-tune.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_tune_minimises_joules_per_token_and_confirms_it(rig: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The search finds the grid's least energy per token (prefix caching on: an agent's turn prefills only what
    is new) in half the grid, and phase 2 measures it against the baseline on the machine, launches 2% apart:
    energy per token measured as predicted, kept, settled, with the winning flags written."""
    monkeypatch.setenv("CAMPAIGN_SIM_FAULTS", "launch-noise:0.02")
    code, out, err = run_cli_out(capsys, "tune", str(tune_matrix(tmp_path, rig)), "--engine", "sim", "--clock",
                                 "virtual", "--exhaustive", "--out", str(tmp_path), "--plain")
    assert code == 0, err[-3000:]
    best = re.search(r"the grid's best: ([\d.]+) J/token .*; the search's pick: ([\d.]+) J/token \(([+-][\d.]+)%\)",
                     out)
    assert best is not None, out
    assert float(best[2]) <= float(best[1]) * 1.01
    # The entry's power, as its file states it: no fit error shown as a perfect 0.0% (review).
    assert "power as the entry states it (0 cell(s) fitted: no fit error to show)" in out
    phase2 = out[out.index("Round 1, phase 2"):]
    assert "Predicted J/token" in phase2
    rows = {line.split()[0]: line for line in phase2.splitlines() if line.startswith(("baseline ", "candidate-"))}
    errors = [float(e) for e in re.findall(r"\s([+-]\d+\.\d)%\s+Valid", phase2)]
    assert len(errors) == 2 and all(abs(e) <= 5 for e in errors), phase2
    assert rows["candidate-1"].rstrip().endswith("keep"), phase2
    final = out.strip().splitlines()[-1]
    assert final.startswith("tune: keep candidate-1 (settled): "), final
    written = yaml.safe_load(Path(final.split(": ", 2)[2]).read_text())
    assert written["flags"]["enable-prefix-caching"] is True


def test_a_power_model_missed_is_fitted_again(rig: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The real machine decodes 30% slower than its entry says: energy per token measured well above the
    prediction, so the costs and the power are fitted again to the confirmation run, and round 2's prediction
    of the energy reads within a few percent of what round 2 measures."""
    monkeypatch.setenv("CAMPAIGN_SIM_FAULTS", "launch-noise:0.02,decode-speed:0.7")
    code, out, err = run_cli_out(capsys, "tune", str(tune_matrix(tmp_path, rig)), "--engine", "sim", "--clock",
                                 "virtual", "--out", str(tmp_path), "--plain")
    assert code == 0, err[-3000:]
    first = out[out.index("Round 1, phase 2"):out.index("Round 2, phase 1")]
    assert re.search(r"the model missed: \S+: predicted [\d.]+ J/token, measured [\d.]+ \(-\d+%\)", first), first
    second = out[out.index("Round 2, phase 1"):]
    assert "power fitted to the last confirmation run's energy" in second
    phase2 = second[second.index("Round 2, phase 2"):]
    errors = [float(e) for e in re.findall(r"\s([+-]\d+\.\d)%\s+Valid", phase2)]
    assert errors and all(abs(e) <= 5 for e in errors), phase2


def test_joules_per_token_on_the_tables_is_refused_by_name(tmp_path: Path) -> None:
    raw = yaml.safe_load((ROOT / "matrices" / "a5000-tune.yaml").read_text())
    raw["profile"] = "a5000-tp2"
    raw["search"]["objective"] = {"kind": "joules-per-token", "context": 2048, "concurrency": 8}
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="joules per token needs a power model"):
        tuning.tune(str(path), out=tmp_path, how=tuning.Launching(engine="sim", clock="virtual"))


def test_an_energy_tune_whose_machine_measures_no_energy_is_not_settled(
        rig: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: phase 2 on the wall clock (the simulator over HTTP has no NVML, as a CPU build or a GPU
    without energy readings has not) measured no energy, yet a keep on the other figures was written as settled
    for an energy objective. Now the round says energy was not measured, and the pick is not settled."""
    monkeypatch.setenv("CAMPAIGN_SIM_TIME_SCALE", "20")
    # Two rounds at most: a night that measures no energy never settles it, however many it runs.
    code, out, err = run_cli_out(capsys, "tune", str(tune_matrix(tmp_path, rig, max_repeats=2)), "--engine", "sim",
                                 "--out", str(tmp_path), "--plain")
    assert code == 0, err[-3000:]
    assert "no energy was measured in this round" in out, out[-3000:]
    assert "Round 2, phase 1" not in out   # another round would measure no energy either
    final = out.strip().splitlines()[-1]
    assert "(settled)" not in final, final
