"""Launch-to-launch noise and a known true effect on the simulator (docs/faults.md, docs/simulator.md):
`launch-noise:SIGMA` draws one lognormal speed factor per launch from the seed and the launch's identity
(`variant/repeat`), the same every time the night runs; `prefill-speed:FACTOR` / `decode-speed:FACTOR` slow one
kind of step by a known amount, set for one variant by its flags (`fault: ...`) and combined with
CAMPAIGN_SIM_FAULTS. In simulated time (the engine in this process) except where the launcher's process is the
point; the command line runs in this process (test_sim_night's helpers)."""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

import pytest
from test_sim_night import campaign, night

from campaign.core.errors import LaunchError
from campaign.core.progress import Progress
from campaign.measure import simulated
from campaign.measure.cells import CellSpec
from campaign.measure.runner import Measurer
from campaign.night import launch as night_launch
from campaign.night.launcher import launched
from campaign.plan import replay as sim_virtual
from campaign.server import argv, flag_list
from campaign.server.profiles import load_profile
from campaign.sim import config as sim_config
from campaign.sim import model as sim_model
from campaign.sim import truth as sim_truth
from campaign.sim.engine import Virtual, engine_for
from campaign.spec.matrix import load_matrix
from campaign.stored import store

# A figure measured in simulated time is exact to the simulated loop's tick: each stamp is a whole nanosecond
# (measure.simulated.RESOLUTION_S), so a TTFT of 0.2 s, the shortest prefill here, to 1e-8 of itself.
STAMP_REL = 2e-8

PREFILL = CellSpec(phase="prefill", context_tokens=8192, concurrency=1)
NOISE_LINE = re.compile(r"launch noise: speed factor ([0-9.]+) \(sigma ([0-9.]+), launch (\S+)\)")

# A prefill A/B whose variant carries the known true effect: prompt processing 20% slower.
SPEED_MATRIX = """\
name: speed
profile: h200
baseline: baseline
repeats: 2
variants:
  - {name: baseline}
  - {name: slow-prefill, flags: {fault: "prefill-speed:0.8"}}
workloads:
  - {kind: prefill, contexts: [2048, 8192]}
"""


def prompt_tok_s(flags: dict[str, str], *, launch: str = "baseline/0", profile: str = "h200",
                 context: int = 8192) -> float:
    """A prefill cell's prompt tok/s on one launch in simulated time."""
    started = simulated.start(load_profile(profile)[0], flags, seed=0, launch=launch)
    with started.serve() as server:
        figure = server.call(Measurer(server.target()).run_cell(
            CellSpec(phase="prefill", context_tokens=context, concurrency=1))).prompt_tok_s
    assert figure is not None
    return figure


# --- (a) launch noise ---------------------------------------------------------------------------------------
def test_each_launch_draws_its_own_speed_and_the_same_launch_draws_it_again() -> None:
    """Two launches of the same flags differ, two variants' launches differ, and the same launch identity draws
    the same factor; the factor is the engine's physics (prompt tok/s divided by it), said in the startup log."""
    noisy = {"fault": "launch-noise:0.1"}
    profile = load_profile("h200")[0]
    first, second, other = (simulated.start(profile, noisy, seed=0, launch=name)
                            for name in ("baseline/0", "baseline/1", "memory/0"))
    factors = {first.config.speed_factor, second.config.speed_factor, other.config.speed_factor}
    assert len(factors) == 3 and 1.0 not in factors
    again = simulated.start(profile, noisy, seed=0, launch="baseline/0")
    assert again.config.speed_factor == first.config.speed_factor
    # The profile's --seed is part of the draw: another seed, another night.
    assert sim_config.parse([*first.command[first.command.index("campaign.sim") + 1:], "--seed", "7"],
                            launch="baseline/0").speed_factor != first.config.speed_factor
    # Not the engine's seed (a repeat's): the same launch draws the same whichever engine seed it runs.
    assert simulated.start(profile, noisy, seed=5, launch="baseline/0").config.speed_factor == \
        first.config.speed_factor
    quiet = prompt_tok_s({})
    for started in (first, second, other):
        figure = sim_virtual.run_cell(started.config, PREFILL).prompt_tok_s
        assert figure == pytest.approx(quiet / started.config.speed_factor, rel=STAMP_REL)
        (line,) = [m for m in map(NOISE_LINE.search, started.log.splitlines()) if m]
        assert float(line[1]) == pytest.approx(started.config.speed_factor, abs=5e-5)
        assert (line[2], line[3]) == ("0.1", started.config.launch)


def test_launch_noise_has_the_sigma_it_was_given() -> None:
    """Over 200 launch identities the log of the factor has mean 0 (median 1) and standard deviation sigma,
    each within four standard errors of its sample size: sigma/sqrt(n) for the mean, sigma/sqrt(2(n-1)) for
    the standard deviation of a normal sample."""
    sigma, n = 0.1, 200
    logs = [math.log(sim_config.launch_speed(sigma, 0, f"variant-{i % 20}/{i // 20}")) for i in range(n)]
    assert len(set(logs)) == n
    assert abs(statistics.fmean(logs)) < 4 * sigma / math.sqrt(n)
    assert abs(statistics.stdev(logs) - sigma) < 4 * sigma / math.sqrt(2 * (n - 1))


def test_the_launcher_gives_a_simulated_launch_its_identity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over HTTP the launcher passes the launch's identity to the simulator's process (CAMPAIGN_SIM_LAUNCH in
    its environment; never to a vLLM), and the process draws what the same launch draws in simulated time; a
    night's launches are named `variant/repeat` (launch.launch_identity)."""
    profile = load_profile("a5000-tp2")[0]
    assert argv.build(profile, engine="sim", launch="baseline/1").env_overrides[sim_config.LAUNCH_ENV] == "baseline/1"
    assert sim_config.LAUNCH_ENV not in argv.build(profile, engine="vllm", launch="baseline/1").env_overrides
    assert night_launch.launch_identity("baseline", 1) == "baseline/1"
    monkeypatch.setenv("CAMPAIGN_SIM_FAULTS", "launch-noise:0.1")
    with launched(profile, tmp_path / "server.log", engine="sim", launch="baseline/1"):
        pass
    (line,) = [m for m in map(NOISE_LINE.search, (tmp_path / "server.log").read_text().splitlines()) if m]
    expected = simulated.start(profile, {}, seed=0, launch="baseline/1").config.speed_factor
    assert line[3] == "baseline/1" and float(line[1]) == pytest.approx(expected, abs=5e-5)


def test_a_nights_launches_over_http_are_named_by_variant_and_repeat(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The night's HTTP path (launch.Campaign) launches each (variant, repeat) with that identity; the launches
    here are stopped at their start (recorded as failures), since what they are given is the point."""
    given: list[str | None] = []

    def refused(*args: object, launch: str | None = None, **kwargs: object) -> object:
        given.append(launch)
        raise LaunchError("refused by the test", kind="bad_argument")

    monkeypatch.setattr(night_launch, "launched", refused)
    path = tmp_path / "m.yaml"
    path.write_text(SPEED_MATRIX)
    matrix, _, _ = load_matrix(str(path))
    run = store.RunDir.create(tmp_path, "speed")
    with Progress(total_cells=0, estimate_s=1.0, live=False) as progress:
        night_launch.Campaign(run, matrix, load_profile("h200")[0], options=night_launch.Options(engine="sim"),
                              progress=progress).execute()
    assert given == ["baseline/0", "slow-prefill/0", "slow-prefill/1", "baseline/1"]


# --- (b) without the faults, nothing changes -------------------------------------------------------------
def test_without_the_faults_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """No fault: the factor is exactly 1, the log has no line of it, and a launch's identity changes nothing:
    every figure and engine record the same to the last digit whatever the launch is called, and the same as
    with a sigma of 0 and speeds of 1; the step time is the roofline's, summed as it always was."""
    monkeypatch.setenv(sim_config.LAUNCH_ENV, "memory/3")   # as the launcher sets it: nothing to draw
    profile = load_profile("a5000-tp2")[0]
    decode = CellSpec(phase="decode", mode="fixed", context_tokens=32, concurrency=16, max_tokens=256,
                      min_requests=32)

    def stored(flags: dict[str, str], launch: str) -> str:
        started = simulated.start(profile, flags, seed=0, launch=launch)
        assert started.config.speed_factor == 1.0
        assert "launch noise" not in started.log and "speed faults" not in started.log
        return repr([sim_virtual.run_cell(started.config, spec) for spec in (PREFILL, decode)])

    plain = stored({}, "baseline/0")
    assert stored({}, "other/7") == plain
    assert stored({"fault": "launch-noise:0,prefill-speed:1,decode-speed:1"}, "other/7") == plain
    config = sim_config.parse(["--model", "m", "--hardware", "h200-nvl", "--model-shape", "qwen3.5-27b-gptq-int4"])
    assert config.launch == "memory/3" and config.speed_factor == 1.0 and config.faults == sim_config.Faults()
    step = {"hardware": "h200-nvl", "model": "qwen3.5-27b-gptq-int4", "tp": 1, "decode_tokens": 8,
            "prefill_tokens": 2048, "prefill_context": 1024, "context_tokens_read": 9000}
    assert sim_model.step_seconds(**step) == sim_model.step_seconds(**step, prefill_speed=1.0, decode_speed=1.0)


# --- (c) the known true effect, on one launch --------------------------------------------------------------
def test_prefill_speed_reads_in_a_prefill_cell_as_the_factor_it_was_given() -> None:
    """prefill-speed:0.8 reads 0.8x the prompt tok/s of the same launch without it (a prefill step is all
    prefill), and decode-speed leaves it alone."""
    quiet = prompt_tok_s({})
    assert prompt_tok_s({"fault": "prefill-speed:0.8"}) == pytest.approx(0.8 * quiet, rel=STAMP_REL)
    assert prompt_tok_s({"fault": "decode-speed:0.5"}) == pytest.approx(quiet, rel=STAMP_REL)
    assert prompt_tok_s({"fault": "prefill-speed:0.8"}, profile="a5000-tp2") == pytest.approx(
        0.8 * prompt_tok_s({}, profile="a5000-tp2"), rel=STAMP_REL)


def test_decode_speed_slows_every_decode_step_by_the_factor() -> None:
    """decode-speed:0.8: a step that only decodes takes 1/0.8 as long, one of prefill alone as long as before
    (the engine's truth: the same steps, each as long as the physics says)."""

    def steps(flags: dict[str, str]) -> list[sim_truth.StepTruth]:
        truth = sim_truth.Recorder()
        sim = Virtual(engine_for(simulated.start(load_profile("a5000-tp2")[0], flags, seed=0).config, truth))
        for _ in range(4):
            sim.submit(list(range(1000, 1512)), 16)
        sim.run()
        return truth.steps

    pairs = list(zip(steps({}), steps({"fault": "decode-speed:0.8"}), strict=True))
    decode_only = [(b, a) for b, a in pairs if b.decode_tokens and not b.prefill_tokens]
    prefill_only = [(b, a) for b, a in pairs if b.prefill_tokens and not b.decode_tokens]
    assert decode_only and prefill_only
    assert all((b.decode_tokens, b.prefill_tokens) == (a.decode_tokens, a.prefill_tokens) for b, a in pairs)
    assert all(a.model_s == pytest.approx(b.model_s / 0.8, rel=1e-12) for b, a in decode_only)
    assert all(a.model_s == pytest.approx(b.model_s, rel=1e-12) for b, a in prefill_only)


def test_a_bad_speed_or_sigma_is_one_clear_error() -> None:
    """A speed of 0 or less, or a sigma below 0, names the fault and what it expects."""
    for spec, expected in (("prefill-speed:0", "fault prefill-speed:0: expected prefill-speed:FACTOR, a number "
                                               "above 0 (e.g. prefill-speed:0.8, 20% slower)"),
                           ("decode-speed:fast", "fault decode-speed:fast: expected decode-speed:FACTOR"),
                           ("launch-noise:-0.1", "fault launch-noise:-0.1: expected launch-noise:SIGMA, a number "
                                                 "of 0 or more")):
        with pytest.raises(ValueError) as bad:
            sim_config.Faults.parse([spec])
        assert str(bad.value).startswith(expected)


# --- (d) a matrix variant carrying the effect, in simulated time --------------------------------------------
def _factors(run: store.RunDir) -> dict[tuple[str, int], float]:
    """Each launch's speed factor as its stored server.log says it, by (variant, repeat)."""
    out: dict[tuple[str, int], float] = {}
    for launch_dir in run.launches():
        server = json.loads((launch_dir / "server.json").read_text())
        (line,) = [m for m in map(NOISE_LINE.search, (launch_dir / "server.log").read_text().splitlines()) if m]
        assert line[3] == f"{server['variant']}/{server['repeat']}"
        out[(server["variant"], server["repeat"])] = float(line[1])
    return out


def test_a_variant_carrying_prefill_speed_reads_20_percent_slower_in_a_virtual_night(tmp_path: Path) -> None:
    """The variant's flags `{fault: prefill-speed:0.8}` reach its launches only: every prefill cell it stores
    reads 0.8x the baseline's prompt tok/s."""
    path = tmp_path / "speed.yaml"
    path.write_text(SPEED_MATRIX)
    run = night(*load_matrix(str(path))[:2], tmp_path / "out")
    cells = run.cells()
    assert len(cells) == 8 and all(c.result.status == "Valid" for c in cells)
    baseline = {(c.result.spec.key, c.repeat): c.result.prompt_tok_s for c in cells if c.variant == "baseline"}
    for cell in (c for c in cells if c.variant == "slow-prefill"):
        assert cell.result.prompt_tok_s == pytest.approx(0.8 * baseline[cell.result.spec.key, cell.repeat],
                                                         rel=STAMP_REL)


def test_environment_noise_and_a_variants_fault_both_apply_and_a_night_run_again_reads_the_same(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CAMPAIGN_SIM_FAULTS=launch-noise:0.05 and the variant's prefill-speed:0.8 both apply: every launch of the
    night draws its own factor, in its log, and every stored figure is the quiet one x the variant's effect /
    the launch's factor; the same night run again draws the same factors and stores the same figures."""
    monkeypatch.setenv("CAMPAIGN_SIM_FAULTS", "launch-noise:0.05")
    path = tmp_path / "speed.yaml"
    path.write_text(SPEED_MATRIX)
    matrix, matrix_path = load_matrix(str(path))[:2]
    runs = [night(matrix, matrix_path, tmp_path / name) for name in ("first", "again")]
    factors = _factors(runs[0])
    assert len(factors) == 4 and len(set(factors.values())) == 4
    assert _factors(runs[1]) == factors
    figures = [{(c.variant, c.repeat, c.result.spec.key): c.result.prompt_tok_s for c in run.cells()} for run in runs]
    assert figures[0] == figures[1] and len(figures[0]) == 8
    monkeypatch.delenv("CAMPAIGN_SIM_FAULTS")
    quiet = {f"prefill-L{context}": prompt_tok_s({}, context=context) for context in (2048, 8192)}
    for (variant, repeat, key), figure in figures[0].items():
        exact = sim_config.launch_speed(0.05, 0, f"{variant}/{repeat}")
        assert factors[variant, repeat] == pytest.approx(exact, abs=5e-5)
        effect = 0.8 if variant == "slow-prefill" else 1.0
        assert figure == pytest.approx(quiet[key] * effect / exact, rel=STAMP_REL)


# --- (e) not a vLLM flag ----------------------------------------------------------------------------------
def test_a_real_vllm_refuses_the_fault_flag_in_one_line(tmp_path: Path) -> None:
    """`fault` is the simulator's own flag: a night on a vLLM refuses it before anything starts, in one line
    that says so, whether the flag list is a vLLM's own --help=all or the shipped stand-in (which lets other
    far-off names through); on the simulator it is a flag like any other."""
    uses = flag_list.uses("m.yaml", "variants[1].flags", {"fault": "prefill-speed:0.8"})
    for listed in (flag_list.FlagList(flag_list.shipped(), "vLLM 0.32.0 (its --help=all)", authoritative=True),
                   flag_list.FlagList(flag_list.shipped(), "the shipped list", authoritative=False)):
        with pytest.raises(flag_list.FlagError) as refused:
            flag_list.check(uses, listed)
        assert refused.value.message == ("1 unknown flag: m.yaml: variants[1].flags.fault (the simulator's own flag: "
                                      "only with --engine sim)")
    flag_list.check(uses, flag_list.for_profile(load_profile("h200")[0], "sim"))
    # Through the command line: a vLLM profile (its executable not here: the shipped list stands in).
    profile = tmp_path / "vllm.yaml"
    profile.write_text(Path(load_profile("h200")[1]).read_text().replace("executable: vllm",
                                                                         f"executable: {tmp_path / 'no-vllm'}"))
    matrix = tmp_path / "speed.yaml"
    matrix.write_text(SPEED_MATRIX.replace("profile: h200", f"profile: {profile}"))
    result = campaign("plan", str(matrix))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert errors == [f"Error: 1 unknown flag: {matrix}: variants[1].flags.fault (the simulator's own flag: only "
                      "with --engine sim)"], result.stderr
    assert campaign("plan", str(matrix), "--engine", "sim").returncode == 0
