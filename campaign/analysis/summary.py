"""What a finished run concluded beyond its diffs, from stored files only: Drift (did the baseline, and where
GPU telemetry exists its SM clock and power, move between its first and last launch?), GpuEffect (on a GPU
pool, did one set of GPUs read faster than another?) and summary_record, which writes drift, short answers
and each variant's recommendation and outcome into summary.json.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from campaign.analysis.verdicts import VariantDiff
from campaign.core.errors import ResultFormatError
from campaign.measure.cells import primary_metric
from campaign.server import gpu
from campaign.stored.records import (
    CellRecord,
    DriftRecord,
    GuardRecord,
    OutcomeRecord,
    ShortAnswers,
    SummaryRecord,
)
from campaign.stored.store import RunDir, StoredCell, read_record

DRIFT_LIMIT = 0.05       # the baseline moving more than this between first and last launch is drift
CLOCK_DRIFT_LIMIT = 0.05  # ... and its median SM clock (GPU telemetry) moving more than this
POWER_DRIFT_LIMIT = 0.10  # ... and its median power (it follows the load, so a wider limit)


@dataclass(frozen=True)
class Drift:
    checked: bool
    drifted: bool
    median_change_pct: float | None
    message: str
    # GPU telemetry of the same cells (None without it): did the GPU itself change through the night?
    sm_clock_change_pct: float | None = None
    power_change_pct: float | None = None
    moved: tuple[str, ...] = ()   # what moved beyond its limit: "throughput", "SM clock", "power"


def _gpu_medians(cell: StoredCell) -> tuple[float | None, float | None]:
    """Median SM clock and power of a stored cell's raw GPU samples; None where it has none."""
    try:
        # A warm guard's re-measurement that stands in for the cell carries its own samples.
        record: CellRecord | GuardRecord = (read_record(cell.path, GuardRecord) if cell.path.name.startswith("guard-")
                                            else read_record(cell.path, CellRecord))
        samples = record.gpu_telemetry
    except (OSError, ResultFormatError):
        return None, None
    if not samples:
        return None, None
    return gpu.sm_clock_median(samples), gpu.power_median(samples)


def _median_change(pairs: list[tuple[float | None, float | None]]) -> tuple[float | None, int]:
    changes = [(b - a) / a for a, b in pairs if a and b is not None]
    return (statistics.median(changes), len(changes)) if changes else (None, 0)


def drift(run: RunDir) -> Drift:
    """The baseline's first launch against its last: did the machine change through the night? Throughput, and
    where GPU telemetry exists the median SM clock and power of the same cells (a GPU that warmed up and clocks
    down, or one whose power limit changed, shows there before it hides in a throughput difference)."""
    baseline = run.manifest().matrix_model().baseline
    cells = [c for c in run.cells() if c.variant == baseline and c.result.status == "Valid"]
    repeats = sorted({c.repeat for c in cells})
    if len(repeats) < 2:
        return Drift(False, False, None, "drift not checked: the baseline was measured once")
    first, last = repeats[0], repeats[-1]
    changes = []
    clocks: list[tuple[float | None, float | None]] = []
    powers: list[tuple[float | None, float | None]] = []
    for cell in (c for c in cells if c.repeat == first):
        metric = primary_metric(cell.result.phase)
        later = [c for c in cells if c.repeat == last and c.result.spec.key == cell.result.spec.key]
        a, b = getattr(cell.result, metric), getattr(later[0].result, metric) if later else None
        if a and b is not None:
            changes.append((b - a) / a)
            (clock_a, power_a), (clock_b, power_b) = _gpu_medians(cell), _gpu_medians(later[0])
            clocks.append((clock_a, clock_b))
            powers.append((power_a, power_b))
    if not changes:
        return Drift(False, False, None, "drift not checked: no cell measured in both the first and last launch")
    median = statistics.median(changes)
    clock, clock_n = _median_change(clocks)
    power, power_n = _median_change(powers)
    moved = tuple(name for name, change, limit in (("throughput", median, DRIFT_LIMIT),
                                                   ("SM clock", clock, CLOCK_DRIFT_LIMIT),
                                                   ("power", power, POWER_DRIFT_LIMIT))
                  if change is not None and abs(change) > limit)
    drifted = bool(moved)
    gpu_part = ""
    if clock is not None or power is not None:
        figures = [f"{name} {100 * change:+.1f}%" for name, change in (("SM clock", clock), ("power", power))
                   if change is not None]
        gpu_part = f", {', '.join(figures)} (GPU telemetry of {max(clock_n, power_n)} cells)"
    limits = f"{100 * DRIFT_LIMIT:.0f}% drift limit" if not gpu_part else (
        f"drift limits ({100 * DRIFT_LIMIT:.0f}% throughput, {100 * CLOCK_DRIFT_LIMIT:.0f}% SM clock, "
        f"{100 * POWER_DRIFT_LIMIT:.0f}% power)")
    message = (f"baseline moved {100 * median:+.1f}% (median over {len(changes)} cells){gpu_part} between its first "
               f"and last launch; " + (f"DRIFTED ({' and '.join(moved)} moved): differences below this size are not "
                                       "trustworthy" if drifted else f"within the {limits}"))
    return Drift(True, drifted, 100 * median, message,
                 sm_clock_change_pct=None if clock is None else 100 * clock,
                 power_change_pct=None if power is None else 100 * power, moved=moved)


# Two GPU sets of one pool reading further apart than this (median over the same variant's same cells) are
# worth a look (clocks, power limits, PCIe width, cooling), as drift beyond its limit is.
GPU_EFFECT_LIMIT = DRIFT_LIMIT


@dataclass(frozen=True)
class GpuEffect:
    checked: bool
    message: str
    # Each GPU set against the first: median change of the primary metric, percent.
    changes_pct: dict[str, float] = field(default_factory=dict)
    balanced: bool = True     # every variant measured as often on each GPU set: the effect cancels in its diff


def gpu_effect(run: RunDir) -> GpuEffect:
    """On a GPU pool: did one set of GPUs read faster than another? For every variant and cell measured on
    two GPU sets, the median of its repeats on each; the effect of a set is the median change against the
    first set. The pool swaps each variant's repeats across the sets, so where every variant has as many
    launches on each set, the effect cancels in the variant-against-baseline diffs the way drift does."""
    # By launch folder: a relaunch, a lost node's retry or a resume on another pool each has its own placement.
    where: dict[tuple[str, str], str] = {}
    for launch_dir, placed in run.placements():
        if placed.executor == "pool" and placed.gpus:
            where[(placed.variant, Path(launch_dir).name)] = ",".join(str(g.index) for g in placed.gpus)
    sets = sorted(set(where.values()), key=lambda s: [int(i) for i in s.split(",")])
    if len(sets) < 2:
        return GpuEffect(False, "GPU effect not checked: the launches ran on one set of GPUs")
    values: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for cell in run.cells():
        placed_on = where.get((cell.variant, cell.launch or ""))
        value = getattr(cell.result, primary_metric(cell.result.phase))
        if placed_on is not None and cell.result.status == "Valid" and value:
            values[(cell.variant, cell.result.spec.key)][placed_on].append(float(value))
    first = sets[0]
    changes: dict[str, list[float]] = defaultdict(list)
    for per_set in values.values():
        if first not in per_set:
            continue
        reference = statistics.median(per_set[first])
        for other in sets[1:]:
            if other in per_set:
                changes[other].append(statistics.median(per_set[other]) / reference - 1)
    if not changes:
        return GpuEffect(False, "GPU effect not checked: no cell was measured on two sets of GPUs")
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for (variant, _), placed_on in where.items():
        counts[variant][placed_on] += 1  # launches a variant had on each set (a relaunch counts too)
    balanced = all(len(set(c.values())) == 1 and len(c) == len(sets) for c in counts.values())
    pct = {other: 100 * statistics.median(found) for other, found in changes.items()}
    parts = [f"GPUs {other} read {value:+.1f}% against GPUs {first} (median over {len(changes[other])} cells)"
             for other, value in pct.items()]
    beyond = [other for other, value in pct.items() if abs(value) > 100 * GPU_EFFECT_LIMIT]
    verdict = (f"beyond {100 * GPU_EFFECT_LIMIT:.0f}% on GPUs {', '.join(beyond)}: check their clocks, power "
               "limits and cooling" if beyond else f"within {100 * GPU_EFFECT_LIMIT:.0f}%")
    cancel = ("each variant ran as often on each set, so it cancels in the diffs" if balanced else
              "some variants ran more often on one set: the diffs carry part of it")
    return GpuEffect(True, f"{'; '.join(parts)}; {verdict}; {cancel}", pct, balanced)


def summary_record(run: RunDir, *, drift_: Drift, diffs: list[VariantDiff],
                   short: dict[str, dict[str, Any]]) -> SummaryRecord:
    """summary.json: what a finished run concluded (drift, short answers, each variant's verdict)."""
    return SummaryRecord(
        drift=DriftRecord(checked=drift_.checked, drifted=drift_.drifted, median_change_pct=drift_.median_change_pct,
                          message=drift_.message, sm_clock_change_pct=drift_.sm_clock_change_pct,
                          power_change_pct=drift_.power_change_pct, moved=list(drift_.moved)),
        short_answers={v: ShortAnswers.model_validate(a) for v, a in short.items()},
        vllm_versions=sorted({str(s.facts.vllm_version) for s in run.ready_servers()}),
        recommendations={d.variant: d.recommendation for d in diffs},
        outcomes={d.variant: OutcomeRecord(outcome=d.outcome, provisional=d.provisional, tests=d.tests,
                                           family_wise_alpha=d.alpha, aa=d.aa) for d in diffs})
