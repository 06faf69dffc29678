"""Do the verdicts keep their promises? `make verdict-check` (no server): constructed campaigns with a known
truth, judged round after round by the diff's own statistics and recommendation, as a night with `repeats:
auto` judges its stored rounds.

Each campaign: a baseline and one variant, three decode cells, each judged on total tok/s (higher is better)
and TTFT (lower is better). Every launch carries one speed factor for all its cells (launch-to-launch noise,
lognormal), every measurement its own 1% error, and the night drifts (the whole rig slows a little each
round, the same for both sides, as the interleaved rounds assume). After every round from the second the
variant is judged at that look (statistics.sequential_alpha: O'Brien-Fleming spending of the family's 5%),
each metric by Welch or, from three rounds, by the rounds' paired differences where that interval is narrower;
the night stops it once its outcome is keep, revert or no difference, or at `max_rounds`.

Printed, per scenario: how often each outcome was reached, and the rounds it took. The promises, checked by
tests/test_verdict_promises.py:
- an A/A is called keep or revert (a false verdict) in at most 5% of nights, however many looks;
- "no difference" is never the outcome of a true change of three times the minimum effect;
- a true -20% change under 10% launch noise is called revert within the rounds, at a power printed here.

Then issue 54's nights: three launches a side judged once, over a family of 37 tests (a5000-tuning's size),
where the variant has a certain cost (0.8% less KV cache, seed 000's batch change) or none. Printed with their
bounds, at the shipped profiles' stated noise (2% between launches) and at the noise `campaign plan` reads
from the last run of a matrix (`--matrix`, `--out`):
- a true null with a cost is reverted in at least 90% of nights;
- a true benefit of twice the minimum effect on one deciding figure, with the cost, is reverted in at most 5%;
- a variant with no cost and no change gets keep or revert in at most 5%.
What they rest on is printed too, without a bound (cost_promises). A promise not kept exits 1.
"""

from __future__ import annotations

import argparse
import math
import random
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from campaign.analysis.recommend import recommend
from campaign.analysis.statistics import Look, sequential_alpha, verdict_for
from campaign.analysis.verdicts import CellDiff, Outcome, VariantDiff, family_wise
from campaign.core.errors import CampaignError
from campaign.measure.judged import FAMILY_ALPHA, MIN_EFFECT
from campaign.plan.planning import launch_noise
from campaign.server.profiles import load_profile
from campaign.spec.matrix import load_matrix
from campaign.stored.store import latest_run

CELLS = 3
MEASUREMENT_ERROR = 0.01
FACTS = {"kv_cache_tokens": 100_000}   # the same launch facts a side: only the measured figures decide
COSTLY = {"kv_cache_tokens": 99_200}   # seed 000's batch change: 0.8% of the cache
SHIPPED_NOISE = 0.02                   # the shipped profiles' stated noise between launches
FAMILY = 37                            # a5000-tuning's family: cells x metrics tested


@dataclass(frozen=True)
class Scenario:
    name: str
    effect: float          # the variant's true change of tok/s (its TTFT changes by the inverse)
    launch_noise: float    # sigma of one launch's lognormal speed factor
    drift: float = 0.005   # the rig's slowdown per round, both sides
    max_rounds: int = 10
    tests: int = 2 * CELLS  # the family: two metrics a cell (the last has tok/s alone where it is odd)
    figure_effect: float = 0.0   # a true change of the first cell's tok/s alone (toward better when > 0)
    cost: bool = False     # the variant's launches have 0.8% less KV cache
    fixed: int | None = None   # judged once after this many launches a side, instead of round after round
    figure_noise: float = 0.0  # each figure's own launch-to-launch noise on top of the launch's shared factor

    @property
    def cells(self) -> int:
        return (self.tests + 1) // 2


@dataclass
class Tally:
    scenario: Scenario
    outcomes: Counter[str] = field(default_factory=Counter)
    rounds: list[int] = field(default_factory=list)
    nights: int = 0

    def share(self, *outcomes: str) -> float:
        return sum(self.outcomes[o] for o in outcomes) / self.nights if self.nights else math.nan

    def line(self) -> str:
        parts = ", ".join(f"{o} {100 * self.share(o):.1f}%" for o in ("keep", "revert", "no difference",
                                                                        "not settled"))
        mean_rounds = sum(self.rounds) / len(self.rounds) if self.rounds else math.nan
        return (f"{self.scenario.name:<34} {self.nights} nights: {parts}; rounds used {mean_rounds:.1f} on "
                f"average (at most {self.scenario.max_rounds})")


def _launch(rng: random.Random, scenario: Scenario, variant: bool, round_: int) -> list[tuple[float, float]]:
    """One launch's (tok/s, TTFT ms) per cell."""
    factor = math.exp(rng.gauss(0.0, scenario.launch_noise)) * (1 - scenario.drift * round_)
    if variant:
        factor *= 1 + scenario.effect
    out = []
    def own() -> float:
        return math.exp(rng.gauss(0.0, scenario.figure_noise)) if scenario.figure_noise else 1.0

    for cell in range(scenario.cells):
        speed = 100.0 * (cell + 1) * factor * own() * (1 + rng.gauss(0.0, MEASUREMENT_ERROR))
        if variant and cell == 0:
            speed *= 1 + scenario.figure_effect
        ttft = 50.0 * (cell + 1) / (factor * own()) * (1 + rng.gauss(0.0, MEASUREMENT_ERROR))
        out.append((speed, ttft))
    return out


def judge(base: list[list[tuple[float, float]]], other: list[list[tuple[float, float]]], look: Look,
          tests: int | None = None, cost: bool = False) -> Outcome:
    """The variant's outcome at a look, by the diff's own code: per-cell verdicts (with their values by
    launch, as the diff keeps them), the family, the sentence. `tests`: the family's size (default: two
    metrics for every cell measured); `cost`: the variant's launches have 0.8% less KV cache."""
    tests = 2 * len(base[0]) if tests is None else tests
    cells = []
    for index in range(len(base[0])):
        diff = CellDiff(key=f"decode-{index}", phase="decode", context_tokens=1024, concurrency=index + 1,
                        label="aggregate")
        metrics = (("total_tok_s", 1), ("ttft_ms", -1))[:max(1, min(2, tests - 2 * index))]
        for position, (metric, direction) in enumerate(metrics):
            mine = [launch[index][position] for launch in base]
            theirs = [launch[index][position] for launch in other]
            pairs = list(zip(mine, theirs, strict=True))   # one launch a side per round
            verdict = verdict_for(mine, theirs, direction, metric, pairs=pairs)
            diff.metrics.append(replace(verdict, by_launch=(dict(enumerate(mine)), dict(enumerate(theirs)))))
        cells.append(diff)
    variant = VariantDiff(variant="v", baseline="b", flag_changes=[("x", 1, 2)], fact_changes=[], cells=cells,
                          comparable=True, look=look)
    variant.tests = family_wise(cells, look)
    return recommend(variant, FACTS, COSTLY if cost else FACTS).outcome


def night(rng: random.Random, scenario: Scenario, min_effect: float = MIN_EFFECT) -> tuple[Outcome, int]:
    """One night run until settled: rounds of one launch a side, judged after each from the second."""
    base: list[list[tuple[float, float]]] = []
    other: list[list[tuple[float, float]]] = []
    outcome: Outcome = "not settled"
    if scenario.fixed is not None:
        # A night of fixed repeats: judged once, at the family's whole alpha.
        base = [_launch(rng, scenario, False, r) for r in range(scenario.fixed)]
        other = [_launch(rng, scenario, True, r) for r in range(scenario.fixed)]
        return judge(base, other, Look(alpha=FAMILY_ALPHA, min_effect=min_effect), scenario.tests,
                     scenario.cost), scenario.fixed
    for round_ in range(scenario.max_rounds):
        base.append(_launch(rng, scenario, False, round_))
        other.append(_launch(rng, scenario, True, round_))
        rounds = round_ + 1
        if rounds < 2:
            continue
        look = Look(alpha=sequential_alpha(rounds, scenario.max_rounds), min_effect=min_effect, rounds=rounds,
                    max_rounds=scenario.max_rounds)
        outcome = judge(base, other, look, scenario.tests, scenario.cost)
        if outcome != "not settled":
            return outcome, rounds
    return outcome, scenario.max_rounds


def run(scenario: Scenario, nights: int, seed: int = 0) -> Tally:
    tally = Tally(scenario)
    rng = random.Random(seed)
    for _ in range(nights):
        outcome, rounds = night(rng, scenario)
        tally.outcomes[outcome] += 1
        tally.rounds.append(rounds)
        tally.nights += 1
    return tally


SCENARIOS = (
    Scenario("A/A, 2% launch noise", 0.0, 0.02),
    Scenario("A/A, 10% launch noise", 0.0, 0.10),
    Scenario("A/A, 2% noise, drift 3%/round", 0.0, 0.02, drift=0.03),
    Scenario("true -9% (3x the minimum), 2% noise", -0.09, 0.02),
    Scenario("true -9% (3x the minimum), 10% noise", -0.09, 0.10),
    Scenario("true -9%, 2% noise, drift 3%/round", -0.09, 0.02, drift=0.03),
    Scenario("true -20%, 10% launch noise", -0.20, 0.10),
)


@dataclass(frozen=True)
class Promise:
    """One of issue 54's rates: the share of nights with these outcomes, and its bound."""

    scenario: Scenario
    outcomes: tuple[Outcome, ...]
    at_least: float | None = None
    at_most: float | None = None

    def line(self, tally: Tally) -> str:
        share = tally.share(*self.outcomes)
        what = " or ".join(self.outcomes)
        if self.at_least is not None:
            bound, ok = f"at least {100 * self.at_least:g}%", share >= self.at_least
        elif self.at_most is not None:
            bound, ok = f"at most {100 * self.at_most:g}%", share <= self.at_most
        else:
            return f"{self.scenario.name:<72} {what} in {100 * share:5.1f}% of {tally.nights} nights (no bound)"
        return (f"{self.scenario.name:<72} {what} in {100 * share:5.1f}% of {tally.nights} nights "
                f"(bound: {bound}): {'PASS' if ok else 'FAIL'}")


def cost_promises(noise: float) -> tuple[Promise, ...]:
    """Issue 54's rates at this noise between launches: three launches a side, a family of 37 tests. The
    first three are promised; the rest say what the promises rest on: a benefit on every figure at once is
    a launch's shared speed as far as three launches tell; where each figure also moves on its own between
    launches (half the noise shared, as much again its own), taking the shared part out leaves more; and a
    night run until settled (up to 6 rounds) looks at every round from the third."""
    def at(name: str, *, cost: bool = False, effect: float = 0.0, figure_effect: float = 0.0,
           figure_noise: float = 0.0, fixed: int | None = 3) -> Scenario:
        return Scenario(f"{name}, {100 * noise:.2g}% noise", effect, noise, drift=0.0, tests=FAMILY, fixed=fixed,
                        figure_effect=figure_effect, cost=cost, figure_noise=figure_noise, max_rounds=6)

    twice = 2 * MIN_EFFECT
    one = f"true +{100 * twice:g}% on one figure"
    return (Promise(at("cost, true null", cost=True), ("revert",), at_least=0.90),
            Promise(at(f"cost, {one}", cost=True, figure_effect=twice), ("revert",), at_most=0.05),
            Promise(at("no cost, no change"), ("keep", "revert"), at_most=0.05),
            Promise(at(f"cost, true +{100 * twice:g}% on every figure", cost=True, effect=twice), ("revert",)),
            Promise(at(f"cost, {one}, each figure its own noise too", cost=True, figure_effect=twice,
                       figure_noise=noise), ("revert",)),
            Promise(at("cost, true null, each figure its own noise too", cost=True, figure_noise=noise),
                    ("revert",)),
            Promise(at(f"cost, {one}, until settled", cost=True, figure_effect=twice, fixed=None), ("revert",)))


def planned_noise(matrix: str, out: Path) -> tuple[float | None, str]:
    """The noise between launches `campaign plan` reads for this matrix: its last run's, else its profile's."""
    try:
        planned, _, _ = load_matrix(matrix)
        profile, _ = load_profile(planned.profile)
    except CampaignError as exc:
        return None, f"matrix {matrix!r} not read: {exc}"
    noise = launch_noise(latest_run(out, planned.name), profile)
    return noise.cv, noise.source or "nothing says"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nights", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--matrix", default="a5000-tuning", help="whose last run's noise to measure at too")
    parser.add_argument("--out", type=Path, default=Path("runs"), help="where its runs are stored")
    args = parser.parse_args()
    for scenario in SCENARIOS:
        print(run(scenario, args.nights, args.seed).line(), flush=True)  # noqa: T201
    sigma, source = planned_noise(args.matrix, args.out)
    print(f"\nA certain cost and no benefit shown (issue 54): 3 launches a side, {FAMILY} tests")  # noqa: T201
    noises = [(SHIPPED_NOISE, "the shipped profiles' stated noise")]
    if sigma is None:
        print(f"  the plan's noise for {args.matrix}: unknown ({source})")  # noqa: T201
    elif sigma == SHIPPED_NOISE:
        print(f"  the noise `campaign plan` reads for {args.matrix} is the same ({source})")  # noqa: T201
    else:
        noises.append((sigma, f"the noise `campaign plan` reads for {args.matrix}: {source}"))
    failed = 0
    for noise, where in noises:
        print(f"  at {100 * noise:.2g}% between launches ({where}):", flush=True)  # noqa: T201
        for promise in cost_promises(noise):
            line = promise.line(run(promise.scenario, args.nights, args.seed))
            failed += line.endswith("FAIL")
            print("    " + line, flush=True)  # noqa: T201
    if failed:
        raise SystemExit(f"Error: {failed} promised rate(s) not kept (FAIL above)")


if __name__ == "__main__":
    main()
