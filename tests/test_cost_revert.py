"""Issue 54: a change with a certain cost and no benefit shown is reverted at three launches a side, not left
"not settled" until 18 launches a side show equivalence; a benefit that shows on its own once each launch's
shared speed is taken out holds the revert off. On stored runs built here (no server), with the noise of the
verdict-check's nights: one speed factor a launch (2%) and 1% error on each figure."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
from fakes import builders

from campaign.analysis.benefit import EVERYTHING, Figure, benefits_shown, launch_factors
from campaign.analysis.recommend import diff_run
from campaign.bench import verdicts
from campaign.measure.cells import CellResult, CellSpec
from campaign.stored import store

CONCURRENCY = (1, 2, 4, 8, 16, 32)
KV = {"baseline": 100_000, "batch": 99_200}    # seed 000's batch change: 0.8% of the cache


def _cell(concurrency: int, speed: float) -> CellResult:
    spec = CellSpec(phase="decode", context_tokens=512, concurrency=concurrency, max_tokens=128, window_s=4)
    total = 100.0 * concurrency * speed
    return CellResult(spec=spec, phase="decode", context_tokens=512, concurrency=concurrency, label=spec.label,
                      status="Valid", total_tok_s=total, per_request_tok_s=total / concurrency,
                      ttft_ms=40.0 * math.sqrt(concurrency) / speed)


def _night(tmp_path: Path, launches: int, *, seed: int, benefit_at: int | None = None) -> store.RunDir:
    """Baseline against `batch` (0.8% less cache), `launches` a side; `benefit_at`: batch is 8% faster there."""
    rng = random.Random(seed)
    run = store.RunDir.create(tmp_path, "t")
    builders.manifest(run, baseline="baseline", variants=["baseline", "batch"])
    flags = {"baseline": {"max-num-batched-tokens": 2048}, "batch": {"max-num-batched-tokens": 8192}}
    for repeat in range(launches):
        for variant in ("baseline", "batch"):
            launch = run.new_launch_dir(variant)
            builders.server(launch, variant=variant, repeat=repeat, flags=flags[variant], facts={
                "kv_cache_tokens": KV[variant], "block_size": 16, "vllm_version": "0.32.0", "device": "GPU",
                "max_model_len": 32768})
            shared = math.exp(rng.gauss(0, 0.02))
            for c in CONCURRENCY:
                speed = shared * (1 + rng.gauss(0, 0.01)) * (1.08 if variant == "batch" and c == benefit_at else 1)
                run.write_cell(variant, repeat, _cell(c, speed), launch=launch.name, telemetry=None)
    return run


def test_a_cost_with_no_benefit_shown_is_reverted_at_three_launches_and_says_why(tmp_path: Path) -> None:
    (diff,) = diff_run(_night(tmp_path, 3, seed=5))
    assert diff.outcome == "revert" and not diff.provisional, diff.recommendation
    assert diff.tests == 2 * len(CONCURRENCY) + len(CONCURRENCY)   # total, per-request and TTFT a cell
    assert not [m for c in diff.cells for m in c.metrics if m.verdict in {"better", "worse"}]
    text = diff.recommendation
    assert text.startswith("max-num-batched-tokens 2,048 -> 8,192: KV cache -0.8%")
    assert (f"revert (a cost with no benefit shown: it costs 0.8% KV cache; no figure better in {diff.tests} tests, "
            "nor on its own once each launch's shared speed is taken out; the largest benefit still possible: ") in text
    assert " launches a side would show no difference within +-3%)" in text or "not reachable" in text


def test_two_launches_a_side_are_not_enough_to_revert_on_a_cost_alone(tmp_path: Path) -> None:
    """The guarantee (a true benefit of twice the minimum effect thrown away at most 5% of the time) is
    measured at three launches a side: at two the same cost stays open, with what would settle it."""
    (diff,) = diff_run(_night(tmp_path, 2, seed=5))
    assert diff.outcome == "not settled", diff.recommendation
    assert diff.recommendation.endswith("; it costs 0.8% KV cache, but a cost with no benefit shown is reverted "
                                        "only from 3 launches a side (this has 2)")


def test_a_benefit_on_one_figure_holds_the_revert_off_and_is_named(tmp_path: Path) -> None:
    (diff,) = diff_run(_night(tmp_path, 3, seed=5, benefit_at=8))
    assert diff.outcome == "not settled", diff.recommendation
    assert "it costs 0.8% KV cache, but " in diff.recommendation
    assert " at decode-sustained-L512-C8-N128-W4 is better by " in diff.recommendation
    assert "on its own once each launch's shared speed is taken out" in diff.recommendation


def _figure(name: str, base: list[float], variant: list[float], direction: int = 1) -> Figure:
    """A figure that is a cell of its own."""
    return Figure(name, name, direction, dict(enumerate(base)), dict(enumerate(variant)))


def test_a_lucky_launch_is_no_benefit_but_a_figure_that_moves_alone_is() -> None:
    """One variant launch 5% fast on every figure: each figure's change is that launch's, and taken out it is
    none (and the launches as a whole moved under the minimum effect). A figure 6% better on every launch
    of the variant while the rest stand still is shown, with its change."""
    rows = [100.0, 200.0, 50.0, 80.0, 120.0, 60.0]
    wobble = [1.0, 1.004, 0.996]
    figures = [_figure(f"f{i}", [v * w for w in wobble], [v * w * (1.05 if k == 2 else 1.0)
                                                        for k, w in enumerate(wobble)])
               for i, v in enumerate(rows)]
    base_f, variant_f = launch_factors(figures)
    assert variant_f[2] == pytest.approx(math.log(1.05) + base_f[2], abs=1e-9)
    assert benefits_shown(figures, 0.03) == []
    steady = [_figure(f"f{i}", [v * w for w in wobble], [v * w for w in reversed(wobble)])
              for i, v in enumerate(rows[:5])]
    helped = [*steady, _figure("f5", [60 * w for w in wobble], [63.6 * w for w in wobble])]
    (shown,) = benefits_shown(helped, 0.03)
    assert shown.figure == "f5" and shown.change_pct == pytest.approx(6.0, abs=0.2) and shown.p_value < 0.05
    # Lower is better: a latency 6% shorter on every launch is the same benefit.
    faster = [*steady, _figure("f5", [60 * w for w in wobble], [60 / 1.06 * w for w in wobble], -1)]
    assert [b.figure for b in benefits_shown(faster, 0.03)] == ["f5"]
    # Every figure 8% better on every launch: the launches as a whole moved, and that is a benefit.
    whole = [_figure(f.name, list(f.base.values()), [v * 1.08 for v in f.base.values()]) for f in steady]
    assert EVERYTHING in [b.figure for b in benefits_shown(whole, 0.03)]


def test_with_too_few_figures_nothing_is_taken_out() -> None:
    """Under five figures a launch, a median would move with a benefit on one of them: no factor."""
    few = [_figure("a", [100, 101, 99], [106, 107, 105]), _figure("b", [50, 50.5, 49.5], [50, 50.5, 49.5])]
    assert launch_factors(few) == ({0: 0.0, 1: 0.0, 2: 0.0}, {0: 0.0, 1: 0.0, 2: 0.0})
    assert [b.figure for b in benefits_shown(few, 0.03)] == ["a"]


def test_the_cost_promises_hold_at_the_shipped_noise(capsys: pytest.CaptureFixture[str]) -> None:
    """`make verdict-check`'s issue-54 nights at 2% between launches, 3 launches a side, 37 tests (200 nights
    each here, seeded; the make target runs 1,000): a true null with a cost is reverted in at least 90%, a
    true benefit of twice the minimum effect on one figure in at most 5%, and a change of nothing with no
    cost gets keep or revert in at most 5%."""
    promises = verdicts.cost_promises(verdicts.SHIPPED_NOISE)[:3]
    for promise in promises:
        tally = verdicts.run(promise.scenario, 200, seed=0)
        line = promise.line(tally)
        with capsys.disabled():
            print(f"\n{line}")  # noqa: T201 -- the figure the issue asks to see
        assert line.endswith("PASS"), line
