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
"""

from __future__ import annotations

import argparse
import math
import random
from collections import Counter
from dataclasses import dataclass, field

from campaign.analysis.recommend import recommend
from campaign.analysis.statistics import Look, sequential_alpha, verdict_for
from campaign.analysis.verdicts import CellDiff, Outcome, VariantDiff, family_wise
from campaign.measure.judged import MIN_EFFECT

CELLS = 3
MEASUREMENT_ERROR = 0.01
FACTS = {"kv_cache_tokens": 100_000}   # the same launch facts a side: only the measured figures decide


@dataclass(frozen=True)
class Scenario:
    name: str
    effect: float          # the variant's true change of tok/s (its TTFT changes by the inverse)
    launch_noise: float    # sigma of one launch's lognormal speed factor
    drift: float = 0.005   # the rig's slowdown per round, both sides
    max_rounds: int = 10


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
    for cell in range(CELLS):
        speed = 100.0 * (cell + 1) * factor * (1 + rng.gauss(0.0, MEASUREMENT_ERROR))
        ttft = 50.0 * (cell + 1) / factor * (1 + rng.gauss(0.0, MEASUREMENT_ERROR))
        out.append((speed, ttft))
    return out


def judge(base: list[list[tuple[float, float]]], other: list[list[tuple[float, float]]], look: Look) -> Outcome:
    """The variant's outcome at a look, by the diff's own code: per-cell verdicts, the family, the sentence."""
    cells = []
    for index in range(CELLS):
        diff = CellDiff(key=f"decode-{index}", phase="decode", context_tokens=1024, concurrency=index + 1,
                        label="aggregate")
        for position, (metric, direction) in enumerate((("total_tok_s", 1), ("ttft_ms", -1))):
            mine = [launch[index][position] for launch in base]
            theirs = [launch[index][position] for launch in other]
            pairs = list(zip(mine, theirs, strict=True))   # one launch a side per round
            diff.metrics.append(verdict_for(mine, theirs, direction, metric, pairs=pairs))
        cells.append(diff)
    variant = VariantDiff(variant="v", baseline="b", flag_changes=[("x", 1, 2)], fact_changes=[], cells=cells,
                          comparable=True, look=look)
    variant.tests = family_wise(cells, look)
    outcome, _, _ = recommend(variant, FACTS, FACTS)
    return outcome


def night(rng: random.Random, scenario: Scenario, min_effect: float = MIN_EFFECT) -> tuple[Outcome, int]:
    """One night run until settled: rounds of one launch a side, judged after each from the second."""
    base: list[list[tuple[float, float]]] = []
    other: list[list[tuple[float, float]]] = []
    outcome: Outcome = "not settled"
    for round_ in range(scenario.max_rounds):
        base.append(_launch(rng, scenario, False, round_))
        other.append(_launch(rng, scenario, True, round_))
        rounds = round_ + 1
        if rounds < 2:
            continue
        look = Look(alpha=sequential_alpha(rounds, scenario.max_rounds), min_effect=min_effect, rounds=rounds,
                    max_rounds=scenario.max_rounds)
        outcome = judge(base, other, look)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nights", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for scenario in SCENARIOS:
        print(run(scenario, args.nights, args.seed).line(), flush=True)  # noqa: T201


if __name__ == "__main__":
    main()
