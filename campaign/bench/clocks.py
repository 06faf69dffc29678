"""`make bench-clocks`: one matrix measured by the same Measurer on both clocks, side by side.

The matrix's baseline is launched on the simulator over HTTP at a time scale (default 5: a server process, the
wall clock, the hardware's figures converted back) and served from this process in simulated time
(measure.simulated: the server's own events handed to the same parser without a socket, one event loop whose
clock jumps to the next timer). Each side gets the night's warm-up, then every cell of the matrix in order, by
one Measurer (its prompts go on from cell to cell, as a launch's do), then each capacity search of the matrix
(`--searches-only`: those alone). Printed: per cell, the figures a verdict reads on each clock and their
difference; per search, its brackets on each clock; then each side's wall time. Nothing is judged here:
tests/test_two_clocks.py holds the bound (10%) and says which figures a time scale moves (requests sent
together, spread by a wall millisecond times the scale).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from campaign.bench.truth import environment
from campaign.core import aio
from campaign.measure.cells import CellResult, CellSpec
from campaign.measure.runner import Measurer
from campaign.measure.simulated import start
from campaign.measure.study import ExperimentResult
from campaign.night.launch import slo_search
from campaign.night.launcher import launched
from campaign.server.profiles import load_profile
from campaign.spec.matrix import Matrix, SloSearchExperiment, load_matrix

FIGURES = {"prefill": ("prompt_tok_s", "ttft_ms"),
           "decode": ("total_tok_s", "per_request_tok_s", "tpot_ms", "ttft_ms"),
           "rate": ("achieved_rate_rps", "goodput_rps", "total_tok_s", "ttft_ms", "tpot_ms", "e2e_ms")}


Measured = tuple[list[CellResult], list[ExperimentResult]]


async def _measured(measurer: Measurer, matrix: Matrix, specs: list[CellSpec],
                    searches: list[SloSearchExperiment]) -> Measured:
    """The cells in order, then each capacity search as the night runs it (its SLO, probes and ceiling)."""
    await measurer.warm_up(specs)
    cells = [await measurer.run_cell(spec) for spec in specs]
    found = [await slo_search(measurer, search, matrix, ceiling=measurer.target.max_num_seqs)
             for search in searches]
    return cells, found


def _timed(call: Any, work: Coroutine[Any, Any, Measured]) -> tuple[Measured, float]:
    began = time.perf_counter()
    measured: Measured = call(work)
    return measured, time.perf_counter() - began


def _bracket(result: ExperimentResult) -> str:
    """A capacity search's answer: the rate bracket (held, failed) and the concurrency's, or why it has none."""
    if result.status != "Valid":
        return f"{result.status}: {'; '.join(result.reasons)[:80]}"
    rate = result.details["slo_search"]
    streams = result.details.get("concurrency_search") or {}
    return (f"held {_value(rate['last_pass_rps'])}, failed {_value(rate['first_fail_rps'])} req/s; "
            f"held {_value(streams.get('last_pass'))}, failed {_value(streams.get('first_fail'))} streams")


def _difference(wall: float | None, virtual: float | None) -> str:
    if wall is None or virtual is None or virtual == 0:
        return "-"
    return f"{100 * (wall / virtual - 1):+.1f}%"


def _value(value: float | None) -> str:
    return "-" if value is None else f"{value:,.4g}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench-clocks", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("matrix", nargs="?", default="a5000-slo", help="a shipped matrix or a path")
    parser.add_argument("--scale", type=float, default=5.0, help="the HTTP simulator's time scale")
    parser.add_argument("--searches-only", action="store_true",
                        help="only the matrix's capacity searches (slo-search), not its cells")
    args = parser.parse_args(argv)
    matrix, _, _ = load_matrix(args.matrix)
    baseline = next(v for v in matrix.variants if v.name == matrix.baseline)
    flags = dict(baseline.flags)
    profile = load_profile(matrix.profile)[0]
    specs = [] if args.searches_only else matrix.cells()
    searches = [e for e in matrix.experiments() if isinstance(e, SloSearchExperiment)]

    launch = start(profile, flags, seed=0)
    with launch.serve() as server:
        (virtual, virtual_found), virtual_s = _timed(
            server.call, _measured(Measurer(server.target()), matrix, specs, searches))
    with tempfile.TemporaryDirectory() as folder, \
            environment(CAMPAIGN_SIM_TIME_SCALE=f"{args.scale:g}"), \
            launched(profile, Path(folder) / "server.log", flags, engine="sim") as http:
        (wall, wall_found), wall_s = _timed(
            aio.run, _measured(Measurer(http.target(matrix.timeouts.timeouts())), matrix, specs, searches))

    print(f"{matrix.name}, variant {baseline.name}: over HTTP at {args.scale:g}x beside simulated time")  # noqa: T201
    print(f"{'cell':<58} {'figure':<20} {'HTTP':>12} {'simulated':>12} {'diff':>8}")  # noqa: T201
    for w, v in zip(wall, virtual, strict=True):
        status = "" if w.status == v.status == "Valid" else f" ({w.status} / {v.status})"
        for name in FIGURES[w.spec.phase]:
            print(f"{w.spec.key[:57] + status:<58} {name:<20} {_value(getattr(w, name)):>12} "  # noqa: T201
                  f"{_value(getattr(v, name)):>12} {_difference(getattr(w, name), getattr(v, name)):>8}")
    for search, w_found, v_found in zip(searches, wall_found, virtual_found, strict=True):
        print(f"{search.key}: HTTP {_bracket(w_found)} | simulated {_bracket(v_found)}")  # noqa: T201
    print(f"wall time: HTTP at {args.scale:g}x {wall_s:.1f} s, simulated time {virtual_s:.1f} s "  # noqa: T201
          f"({len(specs)} cells and {len(searches)} capacity search(es) each, warm-up included)")


if __name__ == "__main__":
    main()
