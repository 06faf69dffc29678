"""Power before the night: the smallest change a plan's launches can tell at the rig's noise, from the last
run's launches, else the profile's stated noise, and the plan's warning where it is above the minimum effect."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from fakes import builders
from scipy import stats as sps

from campaign.core.stats import detectable_change
from campaign.measure.cells import CellResult, CellSpec
from campaign.measure.judged import FAMILY_ALPHA
from campaign.plan import planning
from campaign.report import text as report
from campaign.server.profiles import LaunchProfile, RateHints
from campaign.spec.matrix import Matrix
from campaign.stored import store

WORKLOADS: list[dict[str, Any]] = [{"kind": "prefill", "contexts": [1024]},
                                   {"kind": "decode", "contexts": [512], "concurrency": [1, 4]}]


def matrix(**extra: Any) -> Matrix:
    return Matrix.model_validate({"name": "t", "profile": "p", "baseline": "baseline",
                                  "variants": [{"name": "baseline"},
                                               {"name": "small-chunk", "flags": {"max-num-batched-tokens": 64}}],
                                  "workloads": WORKLOADS, **extra})


def plan_text(plan: planning.Plan, repeats: int) -> str:
    return report.text(report.plan_tables(plan, repeats=repeats))


# --- the formula -------------------------------------------------------------------------------------------
def test_the_detectable_change_is_the_two_quantiles_times_the_spread_of_a_difference() -> None:
    # 3 launches a side (4 degrees of freedom), 5% noise, 10 tests at family-wise 5% (0.25% each, two-sided).
    by_hand = (sps.t.ppf(1 - 0.05 / 20, 4) + sps.t.ppf(0.8, 4)) * 0.05 * math.sqrt(2 / 3)
    assert detectable_change(3, 0.05, tests=10) == pytest.approx(by_hand, rel=1e-9)
    assert by_hand == pytest.approx((5.5976 + 0.9410) * 0.05 * 0.8165, rel=1e-3)  # the t table's values
    # One test at 95% and 80% power, df 2: t(0.975) 4.3027, t(0.8) 1.0607.
    assert detectable_change(2, 0.1, tests=1) == pytest.approx((4.3027 + 1.0607) * 0.1, rel=1e-4)


def test_the_detectable_change_shrinks_with_launches_and_grows_with_noise_and_tests() -> None:
    by_n = [detectable_change(n, 0.05, tests=12) for n in range(2, 31)]
    assert all(isinstance(x, float) for x in by_n)
    assert all(a > b for a, b in zip(by_n, by_n[1:], strict=False))  # type: ignore[operator]
    by_cv = [detectable_change(4, cv, tests=12) for cv in (0.01, 0.02, 0.05, 0.13)]
    assert all(a < b for a, b in zip(by_cv, by_cv[1:], strict=False))  # type: ignore[operator]
    assert detectable_change(4, 0.05, tests=1) < detectable_change(4, 0.05, tests=40)  # type: ignore[operator]
    assert detectable_change(4, 0.05, tests=12, alpha=FAMILY_ALPHA) == detectable_change(4, 0.05, tests=12)


def test_one_launch_a_side_or_no_test_tells_nothing() -> None:
    assert detectable_change(1, 0.05, tests=12) is None
    assert detectable_change(0, 0.05, tests=12) is None
    assert detectable_change(3, 0.05, tests=0) is None
    with pytest.raises(ValueError, match="never negative"):
        detectable_change(3, -0.01, tests=1)


def test_the_tests_are_cells_times_deciding_metrics_with_tails_from_three_launches() -> None:
    cells = matrix().cells()  # a prefill cell and two decode cells
    # prefill: prompt tok/s and TTFT; decode: total and per-request tok/s, TTFT (no energy: NVML only).
    assert planning.judged_tests(cells, 2) == 2 + 2 * 3
    assert planning.judged_tests(cells, 3) == 2 + 2 * 5  # the p99s of TTFT and ITL from 3 launches a side
    rate = CellSpec(phase="rate", context_tokens=1024, request_rate=2.0, max_tokens=64)
    assert planning.judged_tests([rate], 2) == 3  # no SLO: no goodput or SLO fraction; total tok/s, TTFT, TPOT


# --- the plan ----------------------------------------------------------------------------------------------
def noisy_run(tmp_path: Path, cv: float) -> store.RunDir:
    """Two launches a side, each cell's headline figure 100 x (1 -+ d), d set so that the pair's relative
    sample spread is `cv` (sd = 2d x 100 / sqrt 2, mean 100)."""
    run = store.RunDir.create(tmp_path / "runs", "t")
    builders.manifest(run, baseline="baseline", variants=["small-chunk"])
    d = cv / math.sqrt(2)
    for variant in ("baseline", "small-chunk"):
        for repeat, sign in enumerate((-1, 1)):
            launch = run.new_launch_dir(variant)
            builders.server(launch, variant=variant, repeat=repeat)
            for spec in matrix().cells():
                value = 100.0 * (1 + sign * d)
                run.write_cell(variant, repeat, CellResult(
                    spec=spec, phase=spec.phase, context_tokens=spec.context_tokens, concurrency=spec.concurrency,
                    label=spec.label, status="Valid", total_tok_s=value if spec.phase == "decode" else None,
                    prompt_tok_s=value if spec.phase == "prefill" else None), launch=launch.name, telemetry=None)
    return run


def test_a_plan_after_a_noisy_run_warns_at_two_launches_a_side_naming_the_noise_and_its_run(tmp_path: Path) -> None:
    run = noisy_run(tmp_path, 0.13)
    assert planning.run_noise(run).cv == pytest.approx(0.13)  # type: ignore[union-attr]
    plan = planning.make_plan(matrix(repeats=2), LaunchProfile(model="m"), run)
    [power] = plan.estimate.power  # the baseline is judged against nobody
    assert (power.variant, power.launches_a_side, power.tests) == ("small-chunk", 2, 8)
    expected = detectable_change(2, 0.13, tests=8)
    assert power.detectable_change == pytest.approx(expected)
    said = plan_text(plan, 2)
    assert (f"warning: small-chunk: with 2 launches a side this rig tells only changes beyond "
            f"±{100 * expected:.0f}% (its noise: 13% between launches, from run {run.root}") in said  # type: ignore[operator]
    # 13% against 3% would take hundreds of launches a side: the plan says the noise is the limit.
    assert "the minimum effect is 3%: no number of launches up to 50 a side would tell it" in said
    stored = plan.estimate.to_json()["power"]
    assert stored == [{"variant": "small-chunk", "launches_a_side": 2, "until_settled": False, "tests": 8,
                       "noise_cv": 0.13, "noise_source": power.noise.source,
                       "detectable_change": round(expected, 4), "min_effect": 0.03}]  # type: ignore[arg-type]


def test_enough_launches_at_a_quiet_rig_tell_the_minimum_effect_without_a_warning(tmp_path: Path) -> None:
    plan = planning.make_plan(matrix(repeats=12), LaunchProfile(model="m"), noisy_run(tmp_path, 0.01))
    said = plan_text(plan, 12)
    assert "small-chunk: with 12 launches a side this rig tells changes beyond ±" in said
    assert "within the minimum effect of 3%" in said and "warning: small-chunk" not in said


def test_without_a_run_the_profile_s_stated_noise_is_used() -> None:
    profile = LaunchProfile(model="m", rates=RateHints(launch_noise=0.02, measured="assumed, not measured"))
    plan = planning.make_plan(matrix(repeats=3), profile, None)
    [power] = plan.estimate.power
    assert power.noise == planning.Noise(0.02, "stated in the profile: assumed, not measured")
    assert power.detectable_change == pytest.approx(detectable_change(3, 0.02, tests=12))
    said = plan_text(plan, 3)
    assert "(its noise: 2% between launches, stated in the profile: assumed, not measured; 12 tests" in said
    needed = next(n for n in range(3, 51) if detectable_change(n, 0.02, tests=12) <= 0.03)  # type: ignore[operator]
    assert f"the minimum effect is 3%: more repeats ({needed} a side would tell it), or `repeats: auto`" in said
    # A profile that states its noise alone leaves the speeds to the guesses.
    assert plan.estimate.rates.source == planning.GUESSED.source


def test_a_run_that_measured_no_cell_twice_or_launches_that_read_alike_leave_the_profile_s_noise(
        tmp_path: Path) -> None:
    profile = LaunchProfile(model="m", rates=RateHints(launch_noise=0.05, measured="assumed"))
    stated = planning.Noise(0.05, "stated in the profile: assumed")
    run = store.RunDir.create(tmp_path / "runs", "t")
    builders.manifest(run, baseline="baseline", variants=["small-chunk"])
    assert planning.launch_noise(run, profile) == stated
    # A simulator without its launch-noise fault reads the same every launch: that is no rig's noise.
    assert planning.launch_noise(noisy_run(tmp_path / "alike", 0.0), profile) == stated


def test_with_neither_a_run_nor_a_stated_noise_the_plan_says_it_is_unknown() -> None:
    plan = planning.make_plan(matrix(repeats=2), LaunchProfile(model="m"), None)
    [power] = plan.estimate.power
    assert power.noise.cv is None and power.detectable_change is None
    assert plan.estimate.to_json()["power"][0]["detectable_change"] is None  # never 0
    said = plan_text(plan, 2)
    assert "small-chunk: the smallest change 2 launches a side can tell is unknown" in said
    assert "2 launches a side are needed to learn it" in said


def test_repeats_auto_is_judged_at_its_max_repeats() -> None:
    profile = LaunchProfile(model="m", rates=RateHints(launch_noise=0.02, measured="assumed"))
    plan = planning.make_plan(matrix(repeats="auto", max_repeats=6), profile, None)
    [power] = plan.estimate.power
    assert (power.launches_a_side, power.until_settled, power.tests) == (6, True, 12)
    assert power.detectable_change == pytest.approx(detectable_change(6, 0.02, tests=12))
    said = plan_text(plan, 2)
    assert "small-chunk: with up to 6 launches a side (`repeats: auto`) this rig tells only changes beyond" in said
    assert "max_repeats: " in said and "would tell it" in said
    default = planning.make_plan(matrix(repeats="auto"), profile, None).estimate.power[0]
    assert default.launches_a_side == 10


def test_one_launch_a_side_adds_no_power_line_beside_the_one_repeat_warning() -> None:
    profile = LaunchProfile(model="m", rates=RateHints(launch_noise=0.02, measured="assumed"))
    plan = planning.make_plan(matrix(repeats=1), profile, None)
    assert plan.estimate.power[0].detectable_change is None
    said = plan_text(plan, 1)
    assert "repeats: 1 with more than one variant" in said and "launches a side this rig" not in said


def test_a_profile_s_rates_state_something() -> None:
    with pytest.raises(ValueError, match="state at least one of"):
        RateHints(measured="nothing")
