"""Is a benefit shown, once each launch's shared speed is taken out? The test that stands between a change
with a certain cost and its revert (issue 54).

A launch that happens to run fast makes every one of its figures better at once (the simulator draws one speed
factor a launch, `launch_noise`; a real rig's clocks and memory placement do the same), so with three launches
a side the best of ~37 figures looks better by the minimum effect in about a fifth of nights where nothing
changed, and no per-figure test can both catch a true 6% benefit on one figure and stay quiet on those
nights. The launches' shared part is measured instead:

- each launch's factor is the median, over the cells it measured, of its value against that cell's mean over
  every launch of both sides (in logs, turned so that higher is better; a cell's figures first reduced to
  their median, since they move together); for a figure, its own cell is left out of the median, so that its
  own change cannot move the factor taken out of it;
- the launches as a whole: the variant's factors against the baseline's (a change that speeds up everything);
- each figure on its own: its values with its launch's factor taken out (a change that helps one thing).

Either shows a benefit where it reaches the minimum effect toward better and Welch's one-sided test alone
gives p under 5% (no family correction: the launches' shared part is gone, and here an error costs a revert,
not a keep). `make verdict-check` measures what that buys (campaign/bench/verdicts.py prints the rates).
Pure: numbers in, findings out.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from campaign.analysis.statistics import estimate
from campaign.measure.judged import FAMILY_ALPHA

# Fewer cells than this a launch (besides the figure's own) and a median is no launch factor: a benefit in one
# of them would move it. Cells, not figures: one cell's figures move together (per-stream tok/s is the total
# divided by the streams), so a cell counts once.
NORMALIZE_MIN_CELLS = 5
# Fewer launches a side than this and a cost is not reverted on the absence of a benefit: the guarantee
# (a true benefit of twice the minimum effect thrown away in at most 5% of nights) is measured at three.
COST_REVERT_MIN_LAUNCHES = 3
EVERYTHING = "every figure together"


@dataclass(frozen=True)
class Figure:
    """One deciding figure's values by launch (the repeat it was measured in) on each side."""

    name: str
    cell: str                      # the cell (or experiment) it belongs to
    direction: int                 # +1: higher is better; -1: lower is better
    base: dict[int, float]
    variant: dict[int, float]


@dataclass(frozen=True)
class Benefit:
    """A benefit shown on its own: the figure (or EVERYTHING), its change in % toward better, its one-sided p."""

    figure: str
    change_pct: float
    p_value: float


Logs = tuple[dict[int, float], dict[int, float]]


def _logs(figure: Figure) -> Logs | None:
    """The figure's values as direction x log, centred on their mean over both sides (None: a value <= 0)."""
    values = list(figure.base.values()) + list(figure.variant.values())
    if not values or min(values) <= 0:
        return None
    mean = statistics.fmean(figure.direction * math.log(v) for v in values)
    return ({k: figure.direction * math.log(v) - mean for k, v in figure.base.items()},
            {k: figure.direction * math.log(v) - mean for k, v in figure.variant.items()})


def _median_by_launch(logs: Sequence[Logs], minimum: int = 1) -> Logs:
    """Each side's launches, each the median of its values over `logs` (0 where fewer than `minimum` have it)."""
    sides: list[dict[int, float]] = []
    for side in (0, 1):
        launches = sorted({k for pair in logs for k in pair[side]})
        medians = {}
        for launch in launches:
            seen = [pair[side][launch] for pair in logs if launch in pair[side]]
            medians[launch] = statistics.median(seen) if len(seen) >= minimum else 0.0
        sides.append(medians)
    return sides[0], sides[1]


def _cell_logs(figures: Sequence[tuple[Figure, Logs | None]]) -> dict[str, Logs]:
    """Per cell, each launch's median over the cell's figures of their centred logs (a cell counts once)."""
    by_cell: dict[str, list[Logs]] = {}
    for figure, logs in figures:
        if logs is not None:
            by_cell.setdefault(figure.cell, []).append(logs)
    return {cell: _median_by_launch(pairs) for cell, pairs in by_cell.items()}


def launch_factors(figures: Sequence[Figure], leave_out: str | None = None) -> Logs:
    """Each launch's shared speed in log units, toward better: the median over the cells it measured (but
    `leave_out`, the cell of the figure it is taken out of, so that figure's own change cannot move it); 0
    where fewer than NORMALIZE_MIN_CELLS cells say."""
    return _factors(_cell_logs([(f, _logs(f)) for f in figures]), leave_out)


def _factors(cell_logs: dict[str, Logs], leave_out: str | None) -> Logs:
    return _median_by_launch([logs for cell, logs in cell_logs.items() if cell != leave_out], NORMALIZE_MIN_CELLS)


def _shown(name: str, base: list[float], variant: list[float], min_effect: float) -> Benefit | None:
    est = estimate(base, variant)
    # One-sided: the two-sided p halved, the change already toward better.
    if est is None or est.diff < math.log1p(min_effect) or est.p_value / 2 >= FAMILY_ALPHA:
        return None
    return Benefit(name, 100 * math.expm1(est.diff), est.p_value / 2)


def fewest_launches(figures: Sequence[Figure]) -> int:
    """The fewest launches a side among the figures (0: none)."""
    return min((min(len(f.base), len(f.variant)) for f in figures), default=0)


def normalizable(figures: Sequence[Figure]) -> bool:
    """Whether each figure's launch factor can be taken from enough other cells: without it a lucky launch
    reads as a benefit on every figure, and no per-figure test can both catch a real one and stay quiet."""
    return len({f.cell for f in figures}) > NORMALIZE_MIN_CELLS


def benefits_shown(figures: Sequence[Figure], min_effect: float) -> list[Benefit]:
    """The benefits shown on their own once each launch's shared speed is taken out: every figure together
    first, then each figure; empty when none is."""
    logged = [(f, _logs(f)) for f in figures]   # each figure's logs once, for every factor taken from them
    cell_logs = _cell_logs(logged)
    base_f, variant_f = _factors(cell_logs, None)
    found = []
    normalized = [f for f in (*base_f.values(), *variant_f.values()) if f != 0.0]
    if normalized:
        together = _shown(EVERYTHING, list(base_f.values()), list(variant_f.values()), min_effect)
        if together is not None:
            found.append(together)
    factors = {cell: _factors(cell_logs, cell) for cell in {f.cell for f in figures}}
    for figure, logs in logged:
        if logs is None:
            continue
        base_f, variant_f = factors[figure.cell]
        base = [v - base_f.get(k, 0.0) for k, v in logs[0].items()]
        variant = [v - variant_f.get(k, 0.0) for k, v in logs[1].items()]
        shown = _shown(figure.name, base, variant, min_effect)
        if shown is not None:
            found.append(shown)
    return found
