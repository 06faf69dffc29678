"""`campaign simulate MATRIX`: one variant of a matrix measured in simulated time by the night's own launch, so
every kind the matrix holds (prefill, fixed and sustained decode, rates, traces, agent sessions, the searches
and the study's experiments) is measured by the Measurer against the simulator serving from this process on
its own clock (measure.simulated), warm-up and warm check included, exactly as `campaign run --clock virtual`
measures it; then the decode cells once more with the other TTFT mode (seed 004's warm prompt cache against
fresh prompts), for the table that shows what the mode costs.

The two nights are stored as any run is (in a temporary folder unless the caller names one), and the tables
are read back from their stored cells: what is printed is what a run directory holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from campaign.core.errors import CampaignError
from campaign.measure.cells import CellResult, TTFTMode
from campaign.night import orchestrate
from campaign.server.profiles import load_profile
from campaign.spec.matrix import DecodeWorkload, Matrix
from campaign.stored.records import ExperimentRecord, FailureRecord
from campaign.stored.store import RunDir


@dataclass(frozen=True)
class Simulated:
    """What `campaign simulate` measured: the variant's cells and experiments as the matrix says, its decode
    cells with the other TTFT mode (empty where it has none), and the launches that failed to start."""

    variant: str
    cells: list[CellResult]
    experiments: list[ExperimentRecord]
    flipped: list[CellResult]
    flipped_mode: TTFTMode | None
    failures: list[FailureRecord]
    runs: list[RunDir]


def one_variant(matrix: Matrix, variant: str | None) -> Matrix:
    """The matrix cut to one of its variants (the baseline by default), as its own baseline, launched once."""
    name = variant or matrix.baseline
    chosen = next((v for v in matrix.all_variants() if v.name == name), None)
    if chosen is None:
        raise CampaignError(f"{matrix.name}: no variant {name!r}",
                            hint=f"variants: {', '.join(v.name for v in matrix.all_variants())}")
    return matrix.model_copy(update={"variants": [chosen], "baseline": chosen.name, "grid": {}, "aa": False,
                                     "repeats": 1, "until_settled": False, "max_repeats": None, "budget_s": None})


def flipped(matrix: Matrix) -> tuple[Matrix, TTFTMode] | None:
    """The matrix's decode workloads alone, each with the other TTFT mode (cold where every one is warm, else
    warm); None where it has no decode workload."""
    decode = [w for w in matrix.workloads if isinstance(w, DecodeWorkload)]
    if not decode:
        return None
    mode: TTFTMode = "cold" if {w.ttft for w in decode} == {"warm"} else "warm"
    return matrix.model_copy(update={"name": f"{matrix.name}-ttft-{mode}",
                                     "workloads": [w.model_copy(update={"ttft": mode}) for w in decode]}), mode


def simulate(one: Matrix, matrix_path: Path, out: Path, *, live: bool | None = False,
             note: Callable[[str], None] | None = None) -> Simulated:
    """Both nights of `campaign simulate` in simulated time, stored under `out`, for a matrix cut to one
    variant (`one_variant`)."""
    profile, profile_path = load_profile(one.profile)
    runs: list[RunDir] = []
    other = flipped(one)
    for night in [one] + ([other[0]] if other else []):
        with orchestrate.started(night, matrix_path, profile, profile_path, engine="sim", out=out,
                                 clock="virtual") as tonight:
            if note is not None:
                for line in tonight.notices:
                    note(line)
            tonight.execute_pending(live)
            runs.append(tonight.run)
    first = runs[0]
    return Simulated(
        variant=one.baseline,
        cells=[c.result for c in first.cells()],
        experiments=first.experiments(),
        flipped=[c.result for c in runs[1].cells()] if other else [],
        flipped_mode=other[1] if other else None,
        failures=[s for run in runs for s in run.servers() if isinstance(s, FailureRecord)],
        runs=runs)
