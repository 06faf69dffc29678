"""Open-loop load (issue 16): service levels, arrival schedules, the driver, the capacity search, rate cells'
arithmetic, their verdict, matrices and diffs; then on the simulated H200 the issue's "Done when", goodput
past the knee and every rate figure against the simulator's own truth records, the CLI's capacity search,
agent sessions, a campaign and a launch. (Every figure of a capacity search against the truth, latencies
judged, is in tests/test_truth.py.)"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
from fakes import builders, simulated
from pydantic import ValidationError
from typer.testing import CliRunner, Result

from campaign.analysis.recommend import diff_run, recommend
from campaign.analysis.verdicts import VariantDiff
from campaign.bench import truth
from campaign.cli import app
from campaign.core.errors import ConfigError
from campaign.http.client import RequestRecord
from campaign.measure import capacity, cells, figures, openloop, slo
from campaign.measure.cells import CellResult, CellSpec, Reason
from campaign.measure.figures import behind_schedule, rate_metrics
from campaign.measure.runner import HOST_STALLS, Measurer
from campaign.night.launcher import LaunchedServer
from campaign.sim import truth as sim_truth
from campaign.spec.matrix import load_matrix
from campaign.stored import store


# --- service levels -------------------------------------------------------------------------------------
def test_an_slo_is_bounds_at_percentiles_and_a_speed_floor_is_a_tpot_bound() -> None:
    """An SLO is bounds at percentiles (their order kept), needs as many requests as its highest percentile,
    a speed floor is a TPOT p99 bound, and its key tells apart limits that differ."""
    service = slo.parse("ttft_p99_ms=2000, tpot_p90_ms=50,e2e_p50_ms=9000")
    assert [(b.metric, b.percentile, b.limit_ms) for b in service.bounds] == [
        ("ttft", 99, 2000), ("tpot", 90, 50), ("e2e", 50, 9000)]
    assert service.min_requests == 100  # a p99 rests on 100 requests
    assert slo.parse({"tpot_p90_ms": 40}).min_requests == 10
    floor = slo.parse({"floor_tok_s": 20})
    assert floor.bounds[0].name == "tpot_p99_ms" and floor.bounds[0].limit_ms == 50  # seed 000's 20 tok/s
    assert slo.parse("ttft_p99_ms=2000").key == "ttft99_2000"
    assert slo.parse("ttft_p99_ms=1000000").key != slo.parse("ttft_p99_ms=1000001").key  # two cells, not one
    with pytest.raises(ValueError, match="'99' is not a bound"):
        slo.parse({99: 2000})  # YAML's int key: named, not a TypeError


@pytest.mark.parametrize("text, says", [
    ("ttft_p99=2000", "'ttft_p99' is not a bound"),
    ("itl_p99_ms=5", "'itl_p99_ms' is not a bound"),
    ("ttft_p99_ms=-1", "must be a number above 0"),
    ("ttft_p99_ms=fast", "is not a number"),
    ("ttft_p99_ms=1,ttft_p99_ms=2", "given twice"),
    ("ttft_p99_ms", "expected NAME=VALUE"),
    ("", "at least one bound"),
])
def test_a_bad_slo_says_what_is_accepted(text: str, says: str) -> None:
    """Each malformed SLO is refused with a message that says what is accepted."""
    with pytest.raises(ValueError, match=says):
        slo.parse(text)


def test_a_failed_request_counts_as_infinitely_late() -> None:
    """A failed request misses every bound: it counts against the percentiles as infinitely late."""
    service = slo.parse("ttft_p50_ms=100")
    ok = [slo.RequestLatency(ok=True, ttft_ms=10.0, tpot_ms=1.0, e2e_ms=20.0) for _ in range(3)]
    failed = [slo.RequestLatency(ok=False, ttft_ms=None, tpot_ms=None, e2e_ms=None) for _ in range(3)]
    assert slo.evaluate(service, ok).passed
    mixed = slo.evaluate(service, ok + failed)
    assert not mixed.passed and mixed.good == 3 and mixed.met_fraction == 0.5
    assert mixed.bounds[0].value_ms == slo.STORED_INFINITY and mixed.bounds[0].violations == 3
    assert slo.percentile([1.0, 2.0, math.inf], 50) == 2.0 and slo.percentile([1.0, 2.0, math.inf], 75) == math.inf


def test_certain_failure_never_calls_a_load_that_could_still_pass() -> None:
    """Over many prefixes of a load: whenever the early stop says "failed", the whole load (the rest of its
    requests as fast as possible) fails too; and it does say so as soon as no outcome could rescue it."""
    service = slo.parse("ttft_p90_ms=100")
    slow = slo.RequestLatency(ok=True, ttft_ms=500.0, tpot_ms=1.0, e2e_ms=600.0)
    fast = slo.RequestLatency(ok=True, ttft_ms=5.0, tpot_ms=1.0, e2e_ms=6.0)
    planned = 40
    for violations in range(planned + 1):
        seen = [slow] * violations
        best_case = slo.evaluate(service, seen + [fast] * (planned - violations))
        if slo.certain_to_fail(service, planned, seen):
            assert not best_case.passed, violations
        else:
            assert violations < 5, violations  # p90 of 40: the fifth slow request decides it
    assert slo.certain_to_fail(service, planned, [slow] * 5)


# --- arrival schedules ----------------------------------------------------------------------------------
def test_arrivals_offer_exactly_the_rate_asked_for_and_keep_their_distribution() -> None:
    """Arrival schedules hold exactly rate x span requests, seeded (the same every time), with the gaps'
    coefficient of variation of their distribution (Poisson 1, gamma 1/sqrt(shape)); a minimum count stretches
    the span at the same rate."""
    constant = openloop.arrivals(2.0, 10.0, arrival="constant")
    assert constant == [i * 0.5 for i in range(20)]
    poisson = openloop.arrivals(2.0, 10.0, seed=7)
    assert len(poisson) == 20 and poisson[0] == 0.0 and poisson == sorted(poisson) and poisson[-1] < 10.0
    assert poisson == openloop.arrivals(2.0, 10.0, seed=7) != openloop.arrivals(2.0, 10.0, seed=8)
    # Over many gaps the shape shows: exponential gaps have a coefficient of variation of 1; gamma gaps of
    # shape k have 1/sqrt(k) (burstiness 0.25: twice as variable; 4: half).
    for arrival, shape, cv in (("poisson", 1.0, 1.0), ("gamma", 0.25, 2.0), ("gamma", 4.0, 0.5)):
        times = openloop.arrivals(100.0, 200.0, arrival=arrival, burstiness=shape, seed=1)  # type: ignore[arg-type]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(cv, rel=0.1), arrival
    # A minimum count stretches the span at the same rate.
    assert len(openloop.arrivals(0.5, 20.0, min_requests=100)) == 100
    assert openloop.arrivals(0.5, 20.0, min_requests=100)[-1] < 200.0


def test_rates_of_one_shape_draw_the_same_gaps_scaled_to_their_rate() -> None:
    """Common random numbers: a capacity search's probes (and a matrix's rates) differ by their rate alone.
    Rate cells that differ only in rate or early_stop share a seed, so with the same count their schedules
    are one sequence scaled by the rates' ratio; any other part of the shape draws another sequence."""
    probe = CellSpec(phase="rate", context_tokens=2048, max_tokens=128, request_rate=3.0, min_requests=100,
                     duration_s=30.0)
    faster = probe.model_copy(update={"request_rate": 3.2, "early_stop": True})
    assert probe.key != faster.key and probe.seed == faster.seed
    slow = openloop.arrivals(3.0, 30.0, seed=probe.seed, min_requests=100)
    fast = openloop.arrivals(3.2, 30.0, seed=faster.seed, min_requests=100)
    assert len(slow) == len(fast) == 100
    assert all(f == pytest.approx(s * 3.0 / 3.2) for s, f in zip(slow, fast, strict=True))
    for other in ({"context_tokens": 4096}, {"arrival": "constant"}, {"duration_s": 60.0}, {"min_requests": 50}):
        assert probe.model_copy(update=other).seed != probe.seed, other
    closed = probe.model_copy(update={"request_rate": None, "max_concurrency": 8})
    assert closed.seed != probe.seed


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


def test_the_driver_keeps_to_the_schedule_and_the_cap_holds_arrivals_back_in_order() -> None:
    """Five arrivals at once and a cap of two: two go at once, each later one when a slot frees, in order; a
    stop releases nothing more and drains what is in flight. On a clock the test owns."""
    async def scenario(stop_after: int | None) -> tuple[list[openloop.Sent], int]:
        clock = _Clock()
        done = [asyncio.Event() for _ in range(5)]
        sent: list[openloop.Sent] = []
        stop = asyncio.Event()
        in_flight = peak = 0

        async def send(s: openloop.Sent) -> None:
            nonlocal in_flight, peak
            sent.append(s)
            in_flight += 1
            peak = max(peak, in_flight)
            if stop_after is not None and len(sent) == stop_after:
                stop.set()
            await done[s.index].wait()
            in_flight -= 1

        async def finish_in_order() -> None:
            for event in done:
                await asyncio.sleep(0.001)
                clock.now += 1.0
                event.set()

        finisher = asyncio.create_task(finish_in_order())
        await openloop.drive([0.0] * 5, send, cap=2, stop=stop, clock=clock, sleep=clock.sleep)
        finisher.cancel()
        return sent, peak

    sent, peak = asyncio.run(scenario(None))
    assert [s.index for s in sent] == [0, 1, 2, 3, 4] and peak == 2
    assert [s.released_t for s in sent] == [0.0, 0.0, 1.0, 2.0, 3.0]   # each waited for a slot
    assert all(s.scheduled_t == 0.0 for s in sent)
    stopped, _ = asyncio.run(scenario(3))
    assert [s.index for s in stopped] == [0, 1, 2]


def test_a_burst_too_tight_for_floats_arrives_all_at_once() -> None:
    """Gamma gaps of shape 0.001 underflow to 0 for many seeds: the schedule is then the burst's limit."""
    for seed in range(200):
        assert openloop.arrivals(0.2, 5.0, arrival="gamma", burstiness=0.001, seed=seed) == [0.0]
        offsets = openloop.arrivals(2.0, 5.0, arrival="gamma", burstiness=0.0005, seed=seed)
        assert len(offsets) == 10 and offsets == sorted(offsets) and all(0.0 <= o <= 5.0 for o in offsets)


def test_a_late_wake_up_is_lag_behind_the_schedule_not_a_wait_for_the_cap() -> None:
    """A driver loop that wakes 30 ms late at 100 req/s (three arrival gaps) is behind its schedule: each
    request is free to go when due, so the lag from then to its send is what the reason reads; with a cap
    that never fills, nothing waited for it."""
    class LateClock(_Clock):
        async def sleep(self, seconds: float) -> None:
            await super().sleep(seconds + 0.030)

    for cap in (None, 1000):
        clock = LateClock()
        sent: list[tuple[openloop.Sent, float]] = []

        async def send(s: openloop.Sent, sent: list[tuple[openloop.Sent, float]] = sent,
                       clock: LateClock = clock) -> None:
            sent.append((s, clock.now))

        offsets = openloop.arrivals(100.0, 2.0, arrival="constant")
        asyncio.run(openloop.drive(offsets, send, cap=cap, clock=clock, sleep=clock.sleep))
        assert all(s.released_t == s.scheduled_t for s, _ in sent)   # nothing waited for a cap
        records = [RequestRecord(id=str(s.index), prompt_tokens=8, max_tokens=4, send_t=at,
                                 scheduled_t=s.scheduled_t, released_t=s.released_t) for s, at in sent]
        assert max(figures.send_lags(records)) >= 0.030   # the wake-up's 30 ms, and the send task's turn
        why = behind_schedule(records, wall_rate=100.0, achieved_share=0.985)
        assert why is not None and "after they were due" in why, why


def test_the_driver_converts_hardware_seconds_for_a_faster_simulator() -> None:
    """Against a simulator at 10x the driver sends on a schedule ten times faster (offsets in the hardware's
    seconds), on a clock the test owns."""
    clock = _Clock()
    sent: list[openloop.Sent] = []

    async def send(s: openloop.Sent) -> None:
        sent.append(s)

    asyncio.run(openloop.drive([0.0, 1.0, 2.5], send, time_scale=10.0, clock=clock, sleep=clock.sleep))
    assert [round(s.scheduled_t, 9) for s in sent] == [0.0, 0.1, 0.25]


# --- the search -----------------------------------------------------------------------------------------
def _threshold(limit: float, seen: list[float] | None = None) -> Any:
    async def probe(value: float) -> capacity.Probe:
        if seen is not None:
            seen.append(value)
        return capacity.Probe(value, passed=value <= limit, requests=10)
    return probe


@pytest.mark.parametrize("limit, start", [(6.1, 1.0), (6.1, 20.0), (0.3, 1.0), (47.0, 0.5)])
def test_the_rate_search_brackets_the_limit_within_its_resolution(limit: float, start: float) -> None:
    """Against a probe that holds up to a known limit, the rate search from any start ends with the limit
    between its last pass and first fail, within its resolution, in at most its probes."""
    result = asyncio.run(capacity.search(_threshold(limit), axis="rate", start=start, floor=0.01))
    assert result.resolved and result.max == result.last_pass
    assert result.last_pass is not None and result.first_fail is not None
    assert result.last_pass <= limit < result.first_fail <= result.last_pass * 1.05
    assert result.requests == 10 * len(result.probes) and len(result.probes) <= capacity.DEFAULT_MAX_PROBES


def test_the_concurrency_search_stops_at_neighbours_or_the_ceiling() -> None:
    """The concurrency search probes whole numbers and stops at neighbours (held at N, failed at N + 1), or
    says it held at the ceiling."""
    found = asyncio.run(capacity.search(_threshold(30), axis="concurrency", start=1, floor=1, ceiling=256))
    assert found.last_pass is not None and found.first_fail is not None
    assert found.last_pass <= 30 < found.first_fail and found.resolved
    assert all(float(p["value"]).is_integer() for p in found.probes)
    held = asyncio.run(capacity.search(_threshold(1000), axis="concurrency", start=1, floor=1, ceiling=64))
    assert held.max == 64 and held.first_fail is None and "held at the ceiling" in held.stopped and held.resolved


@pytest.mark.parametrize("limit", [3, 30, 47, 200])
def test_the_concurrency_search_from_littles_law_finds_the_bracket_it_finds_from_one(limit: int) -> None:
    """Started where the rate search says the answer lies, the concurrency search ends with the same answer as
    from one stream (neighbours around the limit, or within 5%), and never probes the slow single-digit
    concurrencies far below it. From one, a limit of 200 spends the whole probe budget before it resolves."""
    seen: list[float] = []
    from_one = asyncio.run(capacity.search(_threshold(limit), axis="concurrency", start=1, floor=1, ceiling=256))
    near = asyncio.run(capacity.search(_threshold(limit, seen), axis="concurrency", start=round(limit * 0.8),
                                       floor=1, ceiling=256))
    for found in (from_one, near):
        assert found.last_pass is not None and found.first_fail is not None
        assert found.last_pass <= limit < found.first_fail
    assert near.resolved and near.last_pass is not None and from_one.last_pass is not None
    assert from_one.resolved == (limit != 200), from_one.stopped
    assert abs(near.last_pass - from_one.last_pass) <= 0.05 * limit
    assert min(seen) >= round(limit * 0.8) // 2   # nothing far below the start


def test_littles_law_starts_the_concurrency_search_at_the_rate_times_the_mean_latency() -> None:
    """L = lambda x W on the rate probe that held: 4 req/s at a mean latency of 2.5 hardware seconds is 10 in
    flight; with the wall's records at time scale 5 the latency is five times the wall's. It says what the
    search will cost before it starts; without a passing rate it starts at one stream."""
    spec = CellSpec(phase="rate", context_tokens=64, request_rate=4.0)
    records = [_record(i, send=i * 0.05, ttft=0.1, tokens=10, gap=0.04) for i in range(8)]   # ends at 0.461 s
    cell = CellResult(spec=spec, phase="rate", context_tokens=64, concurrency=1, label=spec.label, status="Valid",
                      requests=[r.to_dict() for r in records])
    start = capacity.little_start(4.0, cell, time_scale=5.0, ceiling=256)
    assert start.latency_s == pytest.approx(5 * 0.461) and start.streams == round(4.0 * 5 * 0.461) == 9
    line = start.line(need=100, resolution=0.05, time_scale=5.0)
    assert line.startswith("concurrency search: starting at 9 streams (Little's law: 4 req/s x 2.30 s mean ")
    assert not start.near
    assert "about 7 probes of 100 requests, ~3.0 min, 0.6 min of wall time" in line
    assert capacity.little_start(4.0, cell, time_scale=5.0, ceiling=4).streams == 4   # never past the ceiling
    assert capacity.little_start(None, None, time_scale=1.0, ceiling=256).streams == 1


@pytest.mark.parametrize("axis, limit, start, expected", [
    ("concurrency", 21, 23, [23, 21, 22]),          # just past the answer: one probe below it, then neighbours
    ("concurrency", 21, 20, [20, 22, 21]),          # just below: one step up past it
    # Rates: the resolution squared (1.1025), then 3.14 over 2.99 is 5.02%, over the 5%: one probe more.
    ("rate", 3.1, 3.3, [3.3, 2.99, 3.14, 3.06]),
])
def test_a_search_started_near_the_answer_opens_its_bracket_by_small_steps(
        axis: Literal["rate", "concurrency"], limit: float, start: float, expected: list[float]) -> None:
    """Started at an estimate of the answer (`near`), the bracket opens by the resolution squared, not by
    halving: a start just past the answer costs one probe below it (where halving would probe at half the
    load, the slowest probe of a search), and the answer is the same as without."""
    seen: list[float] = []
    ceiling = 256 if axis == "concurrency" else None
    floor = 1 if axis == "concurrency" else 0.01
    near = asyncio.run(capacity.search(_threshold(limit, seen), axis=axis, start=start, floor=floor,
                                       ceiling=ceiling, near=True))
    far = asyncio.run(capacity.search(_threshold(limit), axis=axis, start=start, floor=floor, ceiling=ceiling))
    assert seen == expected and near.resolved and far.resolved
    assert near.last_pass is not None and near.first_fail is not None and far.last_pass is not None
    assert near.last_pass <= limit < near.first_fail
    assert abs(near.last_pass - far.last_pass) <= 0.05 * limit
    assert len(near.probes) < len(far.probes)
    # Far from it, each step is 1.1025 times the last, up to doubling: x1.1025, x1.2155, x1.34, x1.477.
    wide: list[float] = []
    asyncio.run(capacity.search(_threshold(5.0, wide), axis="rate", start=2.0, floor=0.01, near=True))
    assert wide[:5] == [2.0, 2.21, 2.69, 3.6, 5.32]


@pytest.mark.parametrize("low, high, resolved", [
    (9.99, 10.5, False),    # 5.1% apart: rounding 9.99 x 1.05 = 10.4895 up to 10.5 once let it through
    (9.99, 10.4, True),     # 4.1%
    (9.51, 9.99, False),    # 5.05%: 9.51 x 1.05 = 9.9855 read 9.99
    (2.97, 3.11, True),     # 4.7%
    (2.0, 2.1, True),       # exactly 5%, float noise and all
    (0.3, 0.316, False),    # 5.3%
])
def test_a_rate_bracket_is_resolved_only_within_the_resolution(low: float, high: float, resolved: bool) -> None:
    """Resolved means the first fail is at most 5% above the last pass, a decade boundary or not."""
    assert capacity._resolved(low, high, integer=False, resolution=0.05) is resolved


def test_a_search_across_a_decade_boundary_ends_within_its_resolution() -> None:
    """Started at its limit just below 10 req/s, the search used to stop at 9.99 and 10.5 (5.1%); it now
    probes between them until the first fail is within 5%."""
    result = asyncio.run(capacity.search(_threshold(9.99), axis="rate", start=9.99, floor=0.01, near=True))
    assert result.resolved and result.last_pass == 9.99 and result.first_fail is not None
    assert result.first_fail <= 9.99 * 1.05


def test_a_resolution_finer_than_three_figures_ends_at_the_next_probed_value() -> None:
    """Rates are probed at three significant figures: at a 0.1% resolution no value lies between 6.1 and 6.11
    (0.16% apart), so the search ends there, resolved, rather than spend its budget on unrounded midpoints."""
    result = asyncio.run(capacity.search(_threshold(6.1), axis="rate", start=1.0, floor=0.01, resolution=0.001,
                                         max_probes=40))
    assert result.resolved and (result.last_pass, result.first_fail) == (6.1, 6.11), result.probes
    assert capacity._resolved(9.99, 10.0, integer=False, resolution=0.001)
    assert not capacity._resolved(9.99, 10.1, integer=False, resolution=0.001)


def _curved(edge: float, seen: list[float], *, power: float = 3.0, noise: float = 1.0) -> Any:
    """A server whose tightest bound sits at (load / edge) ** power of its limit: it holds up to `edge`.
    A failing probe's margin is that times `noise` (an early stop judges the few requests it sent, and stops
    once two were over: its tail reads high)."""
    async def probe(value: float) -> capacity.Probe:
        seen.append(value)
        margin = (value / edge) ** power
        return capacity.Probe(value, passed=margin <= 1, requests=10, margin=margin * (noise if margin > 1 else 1))
    return probe


@pytest.mark.parametrize("axis, edge, start, near", [
    ("rate", 2.75, 4.38, True), ("rate", 6.1, 1.0, False), ("rate", 0.3, 20.0, False),
    ("concurrency", 22, 18, True), ("concurrency", 150, 12, False), ("concurrency", 7, 30, True)])
@pytest.mark.parametrize("noise", [1.0, 1.3, 2.0])
def test_the_probes_margins_place_the_next_probe_and_pass_or_fail_still_decides(
        axis: Literal["rate", "concurrency"], edge: float, start: float, near: bool, noise: float) -> None:
    """The simulated H200's case: the rate search walked down from 4.38 through three failures, then bisected
    with two passing probes (each a full 100 requests) to 2.72/2.82. The failures' margins (how far over the
    tightest bound each was) say where the edge is: the next probe goes there (within the walk's step and a
    halving, or the bracket's middle half), and the answer is the same bracket as without them, in fewer
    probes. A margin read high (an early stop's few requests) still ends at the same answer."""
    ceiling = 256 if axis == "concurrency" else None
    floor = 1 if axis == "concurrency" else 0.01
    guided: list[float] = []
    blind: list[float] = []
    found = asyncio.run(capacity.search(_curved(edge, guided, noise=noise), axis=axis, start=start, floor=floor,
                                        ceiling=ceiling, near=near))
    before = asyncio.run(capacity.search(_threshold(edge, blind), axis=axis, start=start, floor=floor,
                                         ceiling=ceiling, near=near))
    for result in (found, before):
        assert result.resolved and result.last_pass is not None and result.first_fail is not None
        assert result.last_pass <= edge < result.first_fail
    assert len(guided) <= len(blind), (guided, blind)
    assert abs(found.last_pass - before.last_pass) <= 0.05 * edge  # type: ignore[operator]
    if axis == "rate" and edge == 2.75 and noise == 1.0:
        assert len(guided) < len(blind)


def test_margins_all_but_equal_give_no_guess_rather_than_an_overflow() -> None:
    """Two passing probes whose margins differ by a hair (decode-bound TPOT at low load) put the edge beyond
    any float: no guess, and the walk goes on as without margins."""
    low = capacity.Probe(2.0, passed=True, requests=100, margin=0.5)
    high = capacity.Probe(4.0, passed=True, requests=100, margin=0.5003)
    assert capacity._crossing(low, high) is None
    seen: list[float] = []

    async def flat(value: float) -> capacity.Probe:
        seen.append(value)
        return capacity.Probe(value, passed=value <= 6.1, requests=10, margin=0.5 + 1e-5 * value)

    found = asyncio.run(capacity.search(flat, axis="rate", start=1.0, floor=0.01))
    assert found.resolved and found.last_pass is not None and found.last_pass <= 6.1 < (found.first_fail or 0)


def test_a_batch_pass_starts_the_rate_search_at_its_throughput() -> None:
    """The batch pass: `need` requests of the search's shape at once, no SLO; its throughput (completed over its
    measured span, the hardware's) bounds any rate the server sustains, and the search starts there, walking
    down by small steps. One that measured nothing (a request failed) says why and starts at 1 req/s."""
    shape = CellSpec(phase="rate", context_tokens=2048, max_tokens=128, request_rate=1.0,
                     slo=slo.parse("ttft_p99_ms=2000,tpot_p99_ms=50"))
    spec = capacity.batch_spec(shape, 100)
    assert spec.request_rate is None and spec.max_concurrency == 100 and spec.slo is None
    assert spec.key == "rate-L2048-N128-Qinf-poisson-D0.001-C100"

    def cell(status: str, completed: int | None, measured: float | None) -> CellResult:
        return CellResult(spec=spec, phase="rate", context_tokens=2048, concurrency=100, label=spec.label,
                          status=status, completed=completed, measured_s=measured,
                          reasons=["1 of 101 requests failed: HTTP 500"] if status == "Failed" else [])
    batch = capacity.batch_start(cell("Valid", 101, 23.0), 100)
    assert batch.throughput_rps == pytest.approx(101 / 23.0) and batch.start_rps == 4.39
    assert batch.line() == ("batch pass: 100 requests at once completed at 4.39 req/s; the rate search starts "
                            "there, walking down while it fails")
    failed = capacity.batch_start(cell("Failed", 100, 23.0), 100)
    assert failed.throughput_rps is None and failed.start_rps == capacity.DEFAULT_START_RPS
    assert failed.line() == ("batch pass: no throughput (1 of 101 requests failed: HTTP 500); the rate search "
                             "starts at 1 req/s")
    assert capacity.batch_start(cell("Valid", 0, None), 100).throughput_rps is None


def test_with_a_per_token_bound_littles_law_takes_the_latency_at_that_bound() -> None:
    """A closed loop queues nothing: streams are added until the per-token time reaches its bound, the
    throughput staying about the capacity rate. So with a TPOT bound the start is the rate times a request's
    latency at that bound (its mean TTFT plus the bound for each later token), an estimate the search walks
    from by small steps; seen on the simulated H200 (2K prompts, 128 tokens, TPOT p99 50 ms): 3.08 req/s x
    2.9 s mean latency said 9 streams, the answer was 21, and 3.08 x (0.4 + 0.05 x 127) says 21."""
    spec = CellSpec(phase="rate", context_tokens=64, request_rate=4.0)
    records = [_record(i, send=i * 0.05, ttft=0.1, tokens=10, gap=0.04) for i in range(8)]
    cell = CellResult(spec=spec, phase="rate", context_tokens=64, concurrency=1, label=spec.label, status="Valid",
                      requests=[r.to_dict() for r in records])
    bound = slo.parse("ttft_p99_ms=2000,tpot_p99_ms=80")
    start = capacity.little_start(4.0, cell, time_scale=5.0, ceiling=256, service=bound)
    assert start.latency_s == pytest.approx(5 * 0.1 + 0.08 * 9) and start.near
    assert start.streams == round(4.0 * (0.5 + 0.72)) == 5
    assert "(Little's law: 4 req/s x 1.22 s a request at the 80 ms per-token bound)" in start.line(
        need=100, resolution=0.05, time_scale=5.0)
    ttft_only = capacity.little_start(4.0, cell, time_scale=5.0, ceiling=256, service=slo.parse("ttft_p99_ms=500"))
    assert not ttft_only.near and ttft_only.streams == 9   # the mean latency, a floor to double from


def test_a_search_that_never_passes_or_cannot_tell_says_so() -> None:
    """A search that fails down to its floor has no capacity and says so; a probe that cannot tell ends the
    search there, never guessed past."""
    none = asyncio.run(capacity.search(_threshold(0.001), axis="rate", start=1.0, floor=0.01))
    assert none.max is None and none.first_fail is not None and "failed down to" in none.stopped

    async def unclear(value: float) -> capacity.Probe:
        return capacity.Probe(value, passed=False, requests=3, inconclusive="Invalid: the client fell behind")
    stopped = asyncio.run(capacity.search(unclear, axis="rate", start=1.0, floor=0.01))
    assert len(stopped.probes) == 1 and stopped.max is None and "could not tell" in stopped.stopped


def test_a_probes_verdict_comes_from_its_status_and_its_slo() -> None:
    """A probe held only when its cell is Valid and its SLO passed; a Failed cell met nothing, an Invalid one
    cannot tell (and says why)."""
    def cell(status: str, passed: bool | None) -> CellResult:
        spec = CellSpec(phase="rate", context_tokens=64, request_rate=1.0)
        return CellResult(spec=spec, phase="rate", context_tokens=64, concurrency=1, label=spec.label,
                          status=status, slo_passed=passed, reasons=["why"] if status != "Valid" else [])  # type: ignore[arg-type]
    assert capacity.probe_outcome(1.0, cell("Valid", True)).passed
    assert not capacity.probe_outcome(1.0, cell("Failed", True)).passed          # errors met nothing
    assert capacity.probe_outcome(1.0, cell("Invalid", None)).inconclusive == "Invalid: why"


# --- rate cells: arithmetic and verdict ------------------------------------------------------------------
def _record(i: int, send: float, ttft: float, tokens: int, gap: float, *, due: float | None = None,
            released: float | None = None, ok: bool = True) -> RequestRecord:
    times = [send + ttft + k * gap for k in range(tokens)]
    return RequestRecord(id=f"r{i}", prompt_tokens=100, max_tokens=tokens, send_t=send,
                         chunk_t=times if ok else [], chunk_tokens=[1] * tokens if ok else [],
                         end_t=times[-1] + 0.001 if ok else send + 0.5, status=200 if ok else 500,
                         error=None if ok else "HTTP 500", usage_completion_tokens=tokens if ok else None,
                         scheduled_t=send if due is None else due, released_t=send if released is None else released)


def test_rate_metrics_from_raw_records_in_the_hardwares_time() -> None:
    """Four requests due every 0.5 s from t=100 on a 2x simulator (so 0.25 wall s apart), one failed, one a
    little late; every figure by hand."""
    service = slo.parse("ttft_p50_ms=500,tpot_p50_ms=50")
    records = [_record(0, 100.0, 0.1, 11, 0.01), _record(1, 100.25, 0.1, 11, 0.01),
               _record(2, 100.5, 0.3, 11, 0.01, ok=False), _record(3, 100.76, 0.1, 11, 0.04, due=100.75,
                                                                     released=100.75)]
    out = rate_metrics(records, start=100.0, span_s=2.0, planned=4, early_stopped=False, request_rate=2.0,
                       service=service, scale=2.0)
    # Sent over max(span, last send - start) = max(2.0, 0.76 x 2): exactly the rate asked for.
    assert out["achieved_rate_rps"] == pytest.approx(2.0)
    # TTFT 0.1 wall s = 200 ms; TPOT 10 ms wall = 20 ms, the last 40 ms wall = 80 ms: over the TPOT bound.
    assert out["ttft_ms"] == pytest.approx(200.0)
    assert out["slo_met_fraction"] == pytest.approx(0.5)  # two of four: a failure and a slow one miss
    measured = (records[3].end_t - 100.0) * 2.0  # type: ignore[operator]
    assert out["measured_s"] == pytest.approx(measured)
    assert out["goodput_rps"] == pytest.approx(2 / measured)
    assert out["slo_passed"] is True  # the medians: TTFT 200 ms (the failure is one of four), TPOT 20 ms
    # Lags 0, 0, 0 and 10 ms wall: the interpolated p99 is 0.97 of 10 ms, in hardware ms.
    assert out["send_lag_p99_ms"] == pytest.approx(1000 * 0.01 * 0.97 * 2.0)
    assert out["max_in_flight"] == 2 and out["completed"] == 3 and out["cap_waits"] == 0  # the failure and r3
    assert out["in_flight"][0] == (0.0, 1)


def test_a_closed_loops_goodput_counts_its_first_wave_in_the_requests_as_in_the_time() -> None:
    """8 streams, each request 1 s, for 10 s: 80 requests, all within the SLO. The first wave is left out of
    the latencies but is in the load's time, so it counts at the judged requests' share: 8 req/s, not 7.2."""
    service = slo.parse("ttft_p99_ms=5000")
    records = [_record(8 * w + s, 100.0 + w, 0.05, 10, 0.1) for w in range(10) for s in range(8)]
    out = rate_metrics(records, start=100.0, span_s=10.0, planned=None, early_stopped=False, request_rate=None,
                       service=service, ramp=frozenset(f"r{i}" for i in range(8)))
    assert out["slo_met_fraction"] == 1.0 and out["ramp_requests"] == 8
    assert out["goodput_rps"] == pytest.approx(80 / out["measured_s"])


def test_a_client_behind_its_schedule_makes_the_cell_invalid_never_a_lower_load() -> None:
    """Requests sent a gap late, or under 95% of the rate, are a reason the cell is Invalid (not a lower load);
    a closed loop has no schedule, and a few milliseconds of host noise are not a reason."""
    on_time = [_record(i, 10.0 + i, 0.1, 4, 0.01) for i in range(10)]
    assert behind_schedule(on_time, wall_rate=1.0, achieved_share=1.0) is None
    late = [_record(i, 10.0 + i + 1.5, 0.1, 4, 0.01, due=10.0 + i, released=10.0 + i) for i in range(10)]
    assert "after they were due" in (behind_schedule(late, wall_rate=1.0, achieved_share=1.0) or "")
    assert "90% of the rate" in (behind_schedule(on_time, wall_rate=1.0, achieved_share=0.9) or "")
    assert behind_schedule(late, wall_rate=None, achieved_share=None) is None  # a closed loop has no schedule
    # A few milliseconds of host noise at a slow rate are not a reason.
    noisy = [_record(i, 10.0 + i + 0.02, 0.1, 4, 0.01, due=10.0 + i, released=10.0 + i) for i in range(10)]
    assert behind_schedule(noisy, wall_rate=1.0, achieved_share=1.0) is None
    # A trace's bursts (Mooncake: up to 17 at one stamp, stamps 3 s apart): at 4 req/s on average a burst sent
    # over 0.4 s is later than a mean gap (0.25 s), but well before the next instant: the trace's shape kept.
    # A burst still going when the next one is due is behind.
    bursts = [_record(12 * b + k, 10.0 + 3 * b + 0.033 * k, 0.1, 4, 0.01, due=10.0 + 3 * b, released=10.0 + 3 * b)
              for b in range(5) for k in range(12)]
    assert behind_schedule(bursts, wall_rate=4.0, achieved_share=1.0) is None
    slow = [_record(12 * b + k, 10.0 + 3 * b + 0.3 * k, 0.1, 4, 0.01, due=10.0 + 3 * b, released=10.0 + 3 * b)
            for b in range(5) for k in range(12)]
    assert "the limit here is 3000.0 ms" in (behind_schedule(slow, wall_rate=4.0, achieved_share=1.0) or "")
    assert Reason.SCHEDULE_BEHIND.value == "schedule_behind"


def test_rate_cell_keys_name_what_they_send_and_inf_needs_a_cap() -> None:
    """A rate cell's key names what it sends (lengths, rate, arrivals, span, SLO, cap), its seed survives a
    round trip, and an unbounded rate needs a concurrency cap."""
    spec = CellSpec(phase="rate", context_tokens=8192, max_tokens=128, request_rate=2.0, duration_s=20,
                    slo=slo.parse("ttft_p99_ms=2000"))
    assert spec.key == "rate-L8192-N128-Q2-poisson-D20-Sttft99_2000" and spec.label == "open-loop"
    assert spec.seed == CellSpec.model_validate(spec.model_dump()).seed  # the same arrivals on every launch
    capped = CellSpec(phase="rate", context_tokens=512, request_rate=None, max_concurrency=8, arrival="gamma",
                      burstiness=0.5)
    assert capped.key == "rate-L512-N256-Qinf-gamma0.5-D30-C8"
    with pytest.raises(ValidationError, match="needs max_concurrency"):
        CellSpec(phase="rate", context_tokens=512, request_rate=None)


def test_a_matrix_names_rates_and_a_search_and_an_slo_they_share(tmp_path: Path) -> None:
    """A matrix's rate and slo-search workloads share its SLO and window, and each mistake in them is refused
    with where it is."""
    matrix = tmp_path / "m.yaml"
    matrix.write_text(
        "name: m\nprofile: h200\nbaseline: a\nvariants: [{name: a}]\nwindow_s: 20\n"
        "slo: {ttft_p99_ms: 2000, floor_tok_s: 20}\n"
        "workloads:\n"
        "  - {kind: rate, contexts: [8k], rates: [0.5, 2, inf], max_concurrency: 16}\n"
        "  - {kind: slo-search, context: 8k, max_tokens: 128}\n")
    loaded, _, _ = load_matrix(str(matrix))
    cells = loaded.cells()
    assert [c.request_rate for c in cells] == [0.5, 2.0, None]
    assert all(c.slo is not None and c.slo.text == "TTFT p99 <= 2000 ms, TPOT p99 <= 50 ms" and c.duration_s == 20
               for c in cells)
    (search,) = loaded.experiments()
    assert search.key == "slo-search-L8192-N128-poisson-D20-Sttft99_2000.tpot99_50-conc"
    for body, key in (("  - {kind: slo-search, context: 8k}\n", "no SLO to search against"),
                      ("  - {kind: rate, contexts: [1k], rates: [1], slo: {ttft_p99: 5}}\n", "workloads[0].slo"),
                      ("  - {kind: rate, contexts: [1k], rates: [inf]}\n", "needs max_concurrency"),
                      ("  - {kind: rate, contexts: [1k], rates: [1], arival: gamma}\n", "did you mean arrival")):
        matrix.write_text("name: m\nprofile: h200\nbaseline: a\nvariants: [{name: a}]\nworkloads:\n" + body)
        with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
            load_matrix(str(matrix))


def test_the_shipped_slo_matrices_search_each_variant_at_seed_000s_floor() -> None:
    """The shipped SLO matrices search every variant at seed 000's floor (TTFT p99 2 s, 20 tok/s)."""
    for name in ("a5000-slo", "h200-slo"):
        loaded, _, _ = load_matrix(name)
        (search,) = [e for e in loaded.experiments() if e.kind == "slo-search"]
        assert search.slo is not None and search.slo.as_mapping() == {"ttft_p99_ms": 2000.0, "tpot_p99_ms": 50.0}
        assert len(loaded.all_variants()) >= 2, name


# --- agent sessions at a rate ----------------------------------------------------------------------------
def _sessions_spec(**more: Any) -> CellSpec:
    shape = cells.Sessions(count=2, turns=3, system_tokens=100, user_tokens=10)
    return CellSpec.model_validate({"phase": "rate", "context_tokens": 110, "max_tokens": 5, "request_rate": 1.0,
                                    "sessions": shape, **more})


def test_agent_sessions_give_each_request_its_sessions_turn_and_length() -> None:
    """Agent sessions: which session and turn each request is, each turn's length, the key, and the shapes
    sessions refuse."""
    spec = _sessions_spec()
    shape = spec.sessions
    assert shape is not None
    # Two live sessions alternate; after three turns each, sessions 2 and 3 take their places.
    assert [shape.turn(i) for i in range(8)] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (2, 0), (3, 0)]
    assert [shape.length(k, 5) for k in range(3)] == [110, 125, 140]
    assert spec.lengths_range() == ((110, 5), (140, 5))
    assert spec.key == "rate-L110-N5-Q1-poisson-D30-A2x3s100u10"
    for more, says in (({"endpoint": "chat"}, "agents experiment"), ({"range_ratio": 0.5}, "range_ratio is 0"),
                       ({"context_tokens": 100}, "first turn's length")):
        with pytest.raises(ValidationError, match=says):
            _sessions_spec(**more)
    with pytest.raises(ValidationError, match="not one"):
        CellSpec(phase="decode", context_tokens=110, sessions=shape)


def test_a_sessions_turn_extends_its_previous_turn_and_shares_only_the_system_prompt() -> None:
    """Turn k's prompt is turn k - 1's, a reply standing in for the model's, and a new user message; sessions
    share the system prompt and nothing else; each part starts uniquely. Asked for from many streams at once
    (a closed loop), the prompts come out the same as asked for one by one."""
    from campaign.measure.prompts import Prompt, PromptSource, SessionTurns

    spec = _sessions_spec()
    assert spec.sessions is not None

    def make() -> SessionTurns:
        source = PromptSource(seed=7)

        async def part(n: int) -> Prompt:
            return Prompt(tokens=n, ids=source.unique(n))
        return SessionTurns(spec.sessions, reply_tokens=5, part=part)  # type: ignore[arg-type]

    async def in_order() -> list[list[int]]:
        turns = make()
        return [(await turns.prompt(i)).ids or [] for i in range(8)]

    async def at_once() -> list[list[int]]:
        turns = make()
        return [p.ids or [] for p in await asyncio.gather(*(turns.prompt(i) for i in range(8)))]

    ids = asyncio.run(in_order())
    assert [len(p) for p in ids] == [make().length(i) for i in range(8)] == [110, 110, 125, 125, 140, 140, 110, 110]
    assert all(ids[i + 2][:len(ids[i])] == ids[i] for i in (0, 1, 2, 3))  # each turn extends the one before
    system = ids[0][:100]
    assert all(p[:100] == system for p in ids)                               # one system prompt for the step
    assert len({tuple(p[100:106]) for p in (ids[0], ids[1], ids[6], ids[7])}) == 4   # sessions' own histories
    assert asyncio.run(at_once()) == ids


def test_a_matrix_gives_rates_of_agent_sessions_without_contexts(tmp_path: Path) -> None:
    """A matrix's agent sessions give rate cells and a search their lengths (no contexts), and each mistake in
    them is refused with a hint."""
    matrix = tmp_path / "m.yaml"
    head = "name: m\nprofile: h200\nbaseline: a\nvariants: [{name: a}]\nslo: {ttft_p99_ms: 2000}\nworkloads:\n"
    matrix.write_text(head + "  - {kind: rate, rates: [1, 2], max_tokens: 64,\n"
                             "     sessions: {count: 4, turns: 3, system_tokens: 2k, user_tokens: 200}}\n"
                             "  - {kind: slo-search, max_tokens: 64, sessions: {count: 4}}\n")
    loaded, _, _ = load_matrix(str(matrix))
    first, second = loaded.cells()
    assert first.sessions == cells.Sessions(count=4, turns=3, system_tokens=2048, user_tokens=200)
    assert first.context_tokens == 2248 and first.lengths_range()[1] == (2248 + 2 * 264, 64)
    assert second.request_rate == 2.0 and first.key != second.key
    (search,) = loaded.experiments()
    assert "-A4x4s2000u200" in search.key
    for body, says in (("  - {kind: rate, rates: [1]}\n", "give contexts"),
                       ("  - {kind: rate, contexts: [1k], rates: [1], sessions: {count: 2}}\n", "drop contexts"),
                       ("  - {kind: rate, rates: [1], endpoint: chat, sessions: {count: 2}}\n", "agents experiment"),
                       ("  - {kind: slo-search, sessions: {count: 2, turn: 3}}\n", "did you mean turns"),
                       ("  - {kind: slo-search}\n", "give context")):
        matrix.write_text(head + body)
        with pytest.raises(ConfigError, match=says):
            load_matrix(str(matrix))


# --- the diff: capacity at the SLO is the line that matters ----------------------------------------------
def _search_result(rate: float, first_fail: float) -> dict[str, Any]:
    return {"kind": "slo-search", "key": "slo-search-x", "status": "Valid",
            "values": {"max_rate_rps": rate}, "details": {"slo_text": "TTFT p99 <= 2000 ms",
                                                          "slo_search": {"last_pass_rps": rate,
                                                                         "first_fail_rps": first_fail}}}


def test_capacity_is_judged_beyond_the_searchs_resolution_only(tmp_path: Path) -> None:
    """A capacity change beyond the searches' brackets is judged (better, keep); one bisection step apart on
    every repeat is not settled, by the search's resolution (5% brackets, over the 3% minimum effect)."""
    from campaign.measure.study import ExperimentResult

    def run_with(base: list[float], other: list[float], name: str) -> VariantDiff:
        run = store.RunDir.create(tmp_path / name, "t")
        builders.manifest(run, baseline="a", variants=["b"])
        for variant, rates in (("a", base), ("b", other)):
            launch = run.new_launch_dir(variant)
            builders.server(launch, variant=variant, facts={"kv_cache_tokens": 1000}, flags={"x": variant})
            for repeat, rate in enumerate(rates):
                run.write_experiment(variant, repeat, "slo-search-x", ExperimentResult.model_validate(
                    _search_result(rate, rate * 1.05)), launch=launch.name)
        (diff,) = diff_run(run)
        return diff

    clear = run_with([6.1, 6.0, 6.2], [7.4, 7.5, 7.3], "clear")
    (metric,) = [m for c in clear.cells for m in c.metrics if m.metric == "max_rate_rps"]
    assert metric.verdict == "better"
    line = recommend(clear, {"kv_cache_tokens": 1000}, {"kv_cache_tokens": 1000})[2]
    assert "capacity at SLO 6.1 -> 7.4 req/s (better)" in line and line.endswith(": keep")
    # One bisection step apart, every repeat: no more than the search can resolve.
    step = run_with([6.0, 6.0, 6.0], [6.2, 6.2, 6.2], "step")
    (metric,) = [m for c in step.cells for m in c.metrics if m.metric == "max_rate_rps"]
    assert metric.verdict == "not settled" and "resolution" in metric.note


def test_short_answers_carry_the_capacity_at_the_slo() -> None:
    """The short answers carry the capacity at the SLO: the median over Valid searches, with its bracket."""
    from campaign.measure import answers
    from campaign.report import text as report

    found = answers.capacity_at_slo([_search_result(6.0, 6.3), _search_result(7.0, 7.3),
                                     {**_search_result(9.0, 9.3), "status": "Invalid"}])
    assert found is not None and found["max_rate_rps"] == 6.5 and found["searches"] == 2
    assert report.capacity_text(found) == "6.5 req/s (held at 6, failed at 6.3)"


# --- on the simulated H200 -------------------------------------------------------------------------------
TIME_SCALE = 5.0


@pytest.fixture(scope="module")
def h200(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LaunchedServer, Path]]:
    with simulated.with_truth(tmp_path_factory.mktemp("rate"), "h200", {"max-model-len": 16384}, TIME_SCALE) as launch:
        yield launch


def _cli(*args: str, env: dict[str, str | None] | None = None) -> Result:
    """`campaign ARGS` in this process (the HTTP client, the servers and the output are the real ones; the
    interpreter's start, about 1.4 s a command, is saved), failing with its stderr if it failed."""
    out = CliRunner().invoke(app, list(args), env=env)
    assert out.exit_code == 0, f"campaign {' '.join(args[:2])}: {out.stderr[-3000:]} {out.exception!r}"
    return out


def _probe(server: LaunchedServer, *args: str) -> dict[str, Any]:
    out = _cli("probe", server.spec.base_url, "--api-key-env", "H200_KEY", "--json", *args,
               env={"H200_KEY": server.spec.api_key or ""})
    data: dict[str, Any] = json.loads(out.stdout)
    return data


@pytest.mark.wall_timed
def test_done_when_two_rates_report_their_achieved_rate_and_goodput(h200: tuple[LaunchedServer, Path]) -> None:
    """Done when: `campaign probe URL --rate 0.5,2 --duration 20 --slo ttft_p99_ms=3000,tpot_p99_ms=60 --json`
    on the simulated H200 reports both rate cells with achieved rates within 15% of the requested ones and
    goodput fields (the simulator runs 5x faster; the figures are the hardware's). Run with 10 s of arrivals,
    5 and 20 requests, not 20 s: the same command and every check, at half the wall time."""
    server, _ = h200
    seconds = 10
    data = _probe(server, "--rate", "0.5,2", "--duration", f"{seconds}", "--slo", "ttft_p99_ms=3000,tpot_p99_ms=60")
    cells = data["cells"]
    assert [c["request_rate"] for c in cells] == [0.5, 2.0]
    for cell in cells:
        assert cell["status"] == "Valid", cell["reasons"]
        assert cell["phase"] == "rate" and cell["time_scale"] == TIME_SCALE
        assert cell["achieved_rate_rps"] == pytest.approx(cell["request_rate"], rel=0.15)
        assert len(cell["requests"]) == round(seconds * cell["request_rate"])
        for name in ("goodput_rps", "slo_met_fraction", "slo_passed", "ttft_p99_ms", "tpot_p99_ms", "e2e_p99_ms",
                     "ttft_p90_ms", "itl_p99_ms", "in_flight", "send_lag_p99_ms"):
            assert cell[name] is not None, name
        assert cell["slo_passed"] and cell["slo_met_fraction"] == 1.0
        assert [b["name"] for b in cell["slo_bounds"]] == ["ttft_p99_ms", "tpot_p99_ms"]
        assert all(r["scheduled_t"] is not None and r["released_t"] is not None for r in cell["requests"])


@pytest.mark.wall_timed
def test_goodput_falls_past_the_knee_as_the_truth_says(h200: tuple[LaunchedServer, Path]) -> None:
    """At 4K-token prompts the simulated H200 prefills about 2.5 requests a second: below that every request
    meets a p90 TTFT of 1.5 s, above it the queue grows and goodput collapses; every rate figure of both
    cells (achieved rate, goodput, the share meeting the SLO and whether it held, requests in flight) is
    what the simulator's truth records give. (That a capacity search finds, probe for probe, the verdicts
    the truth gives, and the same bracketed maximum, is tests/test_truth.py's whole check at time scale 1.)"""
    server, truth_path = h200
    service = slo.parse("ttft_p90_ms=1500,tpot_p90_ms=40")
    shape = CellSpec(phase="rate", context_tokens=4096, max_tokens=64, request_rate=1.0, duration_s=10,
                     slo=service)

    async def measure() -> list[CellResult]:
        measurer = Measurer(server.target())
        # Ten requests at 1 a second; twenty at 4, faster than the server prefills them, so its queue grows.
        return [await measurer.run_cell(shape.model_copy(update={"request_rate": rate, "duration_s": seconds}))
                for rate, seconds in ((1.0, 10.0), (4.0, 5.0))]

    low, high = asyncio.run(measure())
    assert low.status == high.status == "Valid", (low.reasons, high.reasons)
    assert low.slo_met_fraction == 1.0 and low.slo_passed
    assert high.slo_passed is False and (high.slo_met_fraction or 0) < 0.5
    assert (high.goodput_rps or 0) < (low.goodput_rps or 0)
    matched = truth.Matched(sim_truth.read(truth_path))
    for cell in (low, high):
        figures = truth.rate_cell_figures(cell, matched, matched.delivery(cell.records, matched.of(cell.records)))
        wrong = [f for f in figures if f.kind != "latency" and not f.ok]
        assert not wrong, wrong


@pytest.mark.wall_timed
def test_find_max_rate_brackets_the_capacity_with_the_concurrency_beside_it(
        h200: tuple[LaunchedServer, Path]) -> None:
    """`campaign probe --find-max-rate` returns the rate search's bracket (the highest rate that held, below
    the lowest that failed, every probe of at least the ten requests a p90 needs unless it stopped early as
    certain to fail) and, beside it, the
    concurrency search's, up to --max-concurrency; no rate cells. 1K prompts and 16-token replies: the
    search's probes from 1 a second up to the knee near 4 take about 30 simulated seconds."""
    server, _ = h200
    data = _probe(server, "--contexts", "1k", "--max-tokens", "16", "--duration", "2", "--find-max-rate",
                  "--slo", "ttft_p90_ms=1500,tpot_p90_ms=40", "--max-concurrency", "2")
    assert data["cells"] == []
    cli = data["slo_search"]
    assert cli["status"] == "Valid" and cli["max_rate_rps"] == cli["last_pass_rps"]
    assert cli["last_pass_rps"] < cli["first_fail_rps"]
    # Every probe sent the ten requests a p90 needs, unless it stopped early because it had certainly failed
    # (a loaded machine's slower replies can fail a probe before its tenth request is due).
    assert all(p["requests"] >= 10 or (p["early_stopped"] and not p["passed"]) for p in cli["probes"]), cli
    assert cli["requests"] == sum(p["requests"] for p in cli["probes"])
    assert set(cli) >= {"max_rate_rps", "last_pass_rps", "first_fail_rps", "requests"}
    streams = data["concurrency_search"]
    assert streams["max"] is not None and streams["max"] <= 2


@pytest.mark.wall_timed
def test_a_closed_loop_probe_is_decided_by_its_count_and_stops_once_certain_to_fail(
        h200: tuple[LaunchedServer, Path]) -> None:
    """A concurrency probe of the search (a closed loop that may stop early) sends its first wave and its count
    of judged requests, whatever its span says (a span would let later requests dilute a failure already
    certain); against a bound no request meets it stops once the p90 of its ten judged requests is decided
    (the second over the bound: the p90 of ten is the ninth), drains what it sent, and says so."""
    server, _ = h200
    shape = CellSpec(phase="rate", context_tokens=1024, max_tokens=16, request_rate=None, max_concurrency=4,
                     duration_s=capacity.COUNT_SPAN_S, min_requests=10, early_stop=True,
                     slo=slo.parse("ttft_p90_ms=1500,tpot_p90_ms=40"))

    async def measure() -> list[CellResult]:
        measurer = Measurer(server.target())
        return [await measurer.run_cell(shape), await measurer.run_cell(
            shape.model_copy(update={"slo": slo.parse("tpot_p90_ms=0.01")}))]

    held, failed = asyncio.run(measure())
    assert held.status == failed.status == "Valid", (held.reasons, failed.reasons)
    assert len(held.requests) == 4 + 10 and not held.early_stopped and held.slo_passed
    assert failed.early_stopped and failed.slo_passed is False
    assert 4 + 2 <= len(failed.requests) < 4 + 10   # the first wave, the two that decided it, what was in flight
    judged = len(failed.requests) - 4
    assert (f"stopped early: the service level had failed for certain after {judged} of 10 judged requests (after "
            "its first wave of 4), so the rest were never sent (those sent were drained, not aborted)") in failed.notes


@pytest.mark.wall_timed
def test_an_attempt_the_client_fell_behind_on_is_measured_again_and_says_so(
        h200: tuple[LaunchedServer, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A host that stalls the client (here: its event loop blocked for 1.5 s before the second request of the
    first attempt, as a busy machine does) sends a load other than the one asked for. The attempt is
    discarded with the client's lateness as its reason, and the cell measured again; the cell stands on the
    attempt that kept the schedule (a loaded test machine once failed a whole capacity search on one stall)."""
    server, _ = h200
    drives: list[int] = []
    real_drive = openloop.drive

    async def stalled_once(offsets: list[float], send: openloop.Send, **kwargs: Any) -> float:
        drives.append(len(offsets))

        async def late(sent: openloop.Sent) -> None:
            if len(drives) == 1 and sent.index == 1:
                time.sleep(1.5)  # noqa: ASYNC251 -- the loop blocked on purpose: every later request leaves late
            await send(sent)

        return await real_drive(offsets, late if len(drives) == 1 else send, **kwargs)

    monkeypatch.setattr(openloop, "drive", stalled_once)
    spec = CellSpec(phase="rate", context_tokens=1024, max_tokens=16, request_rate=0.5, duration_s=8)
    cell = asyncio.run(Measurer(server.target()).run_cell(spec))
    assert len(drives) == 2
    first, second = cell.attempts
    assert not first.accepted and first.reason is not None
    assert first.code == Reason.SCHEDULE_BEHIND and "requests left a p99 " in first.reason
    assert second.accepted and cell.status == "Valid" and cell.discarded_steps == 1, cell.reasons
    assert len(cell.records) == 4 and max(figures.send_lags(cell.records)) < 0.4   # the schedule kept


def _stood_on_one(cell: CellResult) -> None:
    """The cell stands on one attempt; every other was discarded for a host's stall. A loaded host may stall
    later attempts too (the client's, or a time-scaled simulator's falling behind its clock): each such one is
    discarded the same way, and after three the cleanest stands (not always the last)."""
    stood = [a for a in cell.attempts if a.accepted]
    assert len(stood) == 1 and stood[0].code is None, [(a.accepted, a.code) for a in cell.attempts]
    assert all(a.code in HOST_STALLS for a in cell.attempts if not a.accepted), [a.code for a in cell.attempts]
    assert cell.discarded_steps == len(cell.attempts) - 1, cell.reasons


@pytest.mark.wall_timed
def test_a_sustained_window_the_client_left_idle_is_measured_again_and_says_so(
        h200: tuple[LaunchedServer, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The sustained twin of the late schedule: in the first attempt one stream waits a second before its
    second request (as a client its host stalls does), so the window's two streams are busy about 1.2 of 2 on
    average. Every such pause is the client's, never the server's: the attempt is discarded with the code
    `fewer_active` and its reason, and the cell stands on the attempt that kept both streams busy (a loaded CI
    machine once left a real-build cell at 1.7 of 2 and the cell Invalid)."""
    server, _ = h200
    calls: list[int] = []
    real_one = Measurer._one

    async def one_stalls_once(self: Measurer, *args: Any, **kwargs: Any) -> RequestRecord:
        calls.append(1)
        if len(calls) == 3:  # the first stream to finish, going for its second request inside the window
            await asyncio.sleep(1.0)
        return await real_one(self, *args, **kwargs)

    monkeypatch.setattr(Measurer, "_one", one_stalls_once)
    spec = CellSpec(phase="decode", context_tokens=1024, concurrency=2, max_tokens=64, window_s=3, warmup_s=0.2)
    cell = asyncio.run(Measurer(server.target()).run_cell(spec))
    first = cell.attempts[0]
    assert not first.accepted and first.code == Reason.FEWER_ACTIVE and first.reason is not None
    assert "streams active" in first.reason
    _stood_on_one(cell)
    assert cell.status == "Valid", cell.reasons
    assert cell.avg_active is not None and cell.avg_active >= 1.9


def _starved_once(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The client's whole event loop made to stand still for 15 ms of every 45 (wall) through the window of the
    first sustained step (as a host that lends its cores elsewhere holds it); the steps, counted."""
    steps: list[int] = []
    real_sustained = Measurer._sustained

    async def starved_once(self: Measurer, spec: CellSpec, max_tokens: int, client: Any, records: Any,
                           window_open: asyncio.Event, *args: Any) -> tuple[float, float]:
        steps.append(1)

        async def starve() -> None:
            await window_open.wait()
            for _ in range(int(spec.window_s / TIME_SCALE / 0.045)):
                time.sleep(0.015)  # noqa: ASYNC251 -- the loop blocked on purpose, as a starved host blocks it
                await asyncio.sleep(0.03)

        starver = asyncio.create_task(starve()) if len(steps) == 1 else None
        try:
            return await real_sustained(self, spec, max_tokens, client, records, window_open, *args)
        finally:
            if starver is not None:
                await starver

    monkeypatch.setattr(Measurer, "_sustained", starved_once)
    return steps


STARVED = CellSpec(phase="decode", context_tokens=1024, concurrency=2, max_tokens=64, window_s=3, warmup_s=0.2)


@pytest.mark.wall_timed
def test_a_sustained_window_whose_client_stood_still_is_measured_again_and_says_so(
        h200: tuple[LaunchedServer, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A starved host (_starved_once) in the first attempt: every token that arrives while the loop stands still
    is stamped late, so the requests' ends are uncertain by more than a verdict's smallest change. The loop's
    own probe sees the stalls; the attempt is discarded as `client_stalled` and the cell stands on one whose
    loop kept up (a CI machine once read stream tok/s 12% low on seed 000's A/B this way, the cell Valid with
    nothing said)."""
    server, _ = h200
    _starved_once(monkeypatch)
    cell = asyncio.run(Measurer(server.target()).run_cell(STARVED))
    _stood_on_one(cell)
    assert cell.status == "Valid" and cell.client_stall_bound is not None, cell.reasons
    first = cell.attempts[0]
    if Reason.CLIENT_STALLED in cell.reason_codes:
        # A host loaded past the starving (three CPU hogs on two cores did it here) stalled every attempt: the
        # cleanest stands, saying so; it may be the starved one.
        assert len(cell.attempts) == 3 and cell.client_stall_bound > cells.STALL_SHARE, cell.reasons
        said = first.reason if not first.accepted else cell.reasons[cell.reason_codes.index(Reason.CLIENT_STALLED)]
    elif first.accepted:
        # The stalls fell where no stream's end nor an edge's token was stamped (the two streams run in lockstep,
        # and may both be prefilling through them): nothing they could move, so nothing to measure again. (Drawn
        # on a loaded machine once in a few dozen.)
        assert cell.attempts == [first] and cell.client_stall_bound <= cells.STALL_SHARE, cell.reasons
        return
    else:
        assert first.code == Reason.CLIENT_STALLED, first
        assert cell.client_stall_bound <= cells.STALL_SHARE, cell.reasons
        said = first.reason
    assert said is not None and "event loop stood still as the window's tokens arrived" in said, said


@pytest.mark.wall_timed
def test_a_stalled_windows_figures_are_off_the_truth_by_no_more_than_its_bound(
        h200: tuple[LaunchedServer, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound's truth: the starved window measured once (no attempt to spare) stands Valid with a bound on
    how far its figures could be off, and its stream tok/s and total tok/s are off the simulator's own records
    of the same requests by no more than that, the simulator's own lag added (measure.figures.stall_error;
    three runs here: bounds of 9.5-12.5% over errors of -2.2% to +7.3% on stream tok/s, the total exact). The
    caveat `client_stalled` stands exactly when the bound passes a verdict's smallest change: a stall moves a
    stream's rate only where one of its ends is stamped in it, so a window whose ends all fell between the
    15 ms stalls is rightly not flagged (CI once drew one: the probe saw the stalls, the bound stayed under 3%)."""
    server, truth_path = h200
    _starved_once(monkeypatch)
    cell = asyncio.run(Measurer(server.target(), max_attempts=1).run_cell(STARVED))
    assert cell.status == "Valid", cell.reasons
    assert cell.client_lag_max_ms is not None and cell.client_lag_max_ms >= 10   # the probe saw the starving
    bound = cell.client_stall_bound
    assert bound is not None and (Reason.CLIENT_STALLED in cell.reason_codes) == (bound > cells.STALL_SHARE)
    allowed = bound + (cell.sim_behind_share or 0.0)
    figures_, _ = truth.cell_figures(cell, truth.Matched(sim_truth.read(truth_path)))
    for name in ("per_request_tok_s", "total_tok_s"):
        (figure,) = [f for f in figures_ if f.name == name]
        assert figure.tool is not None and figure.truth
        assert abs(figure.tool / figure.truth - 1) <= allowed, (name, figure, bound, cell.sim_behind_share)


@pytest.mark.wall_timed
def test_agent_sessions_at_a_rate_are_served_from_the_prefix_cache_as_the_truth_says(
        h200: tuple[LaunchedServer, Path]) -> None:
    """Four live sessions of three turns on a shared 2K system prompt, at 2 requests a second: the step's
    prefix-cache hits (the server's counters) equal the simulator's own records, request for request, and are
    most of the prompt tokens (a later turn finds its history cached, a new session the system prompt); the
    cell is Valid, since sharing is what it is for, and its note says how much was served."""
    server, truth_path = h200
    spec = CellSpec(phase="rate", context_tokens=2248, max_tokens=64, request_rate=2.0, duration_s=12,
                    slo=slo.parse("ttft_p99_ms=3000"),
                    sessions=cells.Sessions(count=4, turns=3, system_tokens=2048, user_tokens=200))
    cell = asyncio.run(Measurer(server.target()).run_cell(spec))
    assert cell.status == "Valid", cell.reasons
    # Records are kept in the order they finished; in the order they were due, turn by turn.
    due = sorted(cell.records, key=lambda r: r.scheduled_t or 0.0)
    assert [r.usage_prompt_tokens for r in due[:12]] == [2248] * 4 + [2512] * 4 + [2776] * 4
    matched = truth.Matched(sim_truth.read(truth_path))
    figures = truth.rate_cell_figures(cell, matched, matched.delivery(cell.records, matched.of(cell.records)))
    wrong = [f for f in figures if f.kind != "latency" and not f.ok]
    assert not wrong, wrong
    (hits,) = [f for f in figures if f.name == "prefix_cache_hits"]
    assert hits.tool == hits.truth and cell.prefix_cache_queries
    assert (cell.prefix_cache_hits or 0) / cell.prefix_cache_queries > 0.6
    assert any(n.startswith("agent sessions: 4 at a time, 3 turn(s)") and "the prefix cache served" in n
               for n in cell.notes)


def test_a_campaign_stores_rate_cells_and_a_search_and_the_diff_reads_capacity(tmp_path: Path) -> None:
    """The whole path through `campaign run` on the simulator: a rate cell and a capacity search per launch,
    stored, exported with their fields, in the short answers, and in the recommendation's capacity line.
    2 s of arrivals per rate cell and a search of two probes (2 a second fails at 4K, 1 holds), in simulated
    time: the same Measurer as over HTTP (test_two_clocks compares the two), with no host to wake it late."""
    matrix = tmp_path / "slo.yaml"
    matrix.write_text(
        "name: slo-sim\nprofile: h200\nbaseline: seed\nrepeats: 1\nwarmup: false\nwindow_s: 2\n"
        "variants:\n  - {name: seed, flags: {max-model-len: 16384}}\n"
        "  - {name: chunk, flags: {max-model-len: 16384, max-num-batched-tokens: 16384}}\n"
        "slo: {ttft_p90_ms: 1500, tpot_p90_ms: 40}\n"
        "workloads:\n"
        "  - {kind: rate, contexts: [4k], rates: [1], max_tokens: 64}\n"
        "  - {kind: slo-search, context: 4k, max_tokens: 64, start_rps: 2, max_probes: 2, resolution: 0.5,\n"
        "     concurrency: false}\n")
    out = _cli("run", "--no-report", str(matrix), "--engine", "sim", "--clock", "virtual", "--out",
               str(tmp_path / "runs"),
               "--plain", env={"CAMPAIGN_SIM_TRUTH": None})
    assert "Capacity at the SLO (TTFT p90 <= 1500 ms, TPOT p90 <= 40 ms)" in out.stdout
    assert "Open-loop rates (SLO: TTFT p90 <= 1500 ms, TPOT p90 <= 40 ms)" in out.stdout
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("recommendation:") and "max-num-batched" in x]
    assert "capacity at SLO" in line and "req/s (not judged)" in line, line  # one launch a side
    (run_dir,) = (tmp_path / "runs" / "slo-sim").iterdir()
    exported = _cli("export", str(run_dir), "--format", "json")
    rows = [r for r in json.loads(exported.stdout)["rows"] if r["phase"] == "rate"]
    # Each rate cell's two arrivals are due at 0 and 0.66 s of its 2 s: a Valid cell sent each within a gap (1 s)
    # of its time, so all of them inside the span, at exactly the rate asked for.
    assert len(rows) == 3 and all(r["goodput_rps"] is not None and r["achieved_rate_rps"] == pytest.approx(1.0)
                                  for r in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    for variant in ("seed", "chunk"):
        found = summary["short_answers"][variant]["capacity_at_slo"]
        assert found["max_rate_rps"] is not None and found["searches"] >= 1, found


@pytest.mark.wall_timed
def test_launch_measures_rates_on_the_server_it_started(tmp_path: Path) -> None:
    """`campaign launch PROFILE --rate ...` takes the same options as probe: here on the simulated H200, one
    rate cell, then the server is stopped."""
    out = _cli("launch", "h200", "--engine", "sim", "--set", "max-model-len=16384", "--rate", "2", "--duration", "4",
               "--arrival", "constant", "--slo", "ttft_p99_ms=3000", "--json", "--log", str(tmp_path / "server.log"),
               env={"CAMPAIGN_SIM_TIME_SCALE": f"{TIME_SCALE:g}", "CAMPAIGN_SIM_TRUTH": None})
    (cell,) = json.loads(out.stdout)["cells"]
    # Evenly spaced arrivals, the last one a whole gap before the span ends: a Valid cell sent every request
    # within a gap of its time (the cell's own limit), so it sent exactly the rate asked for, however late a
    # busy machine woke the client. (This cell's Poisson schedule ends 0.35 s before its span, 70 ms of wall
    # time at 5x: a wake-up later than that read 1.98 req/s.)
    assert cell["phase"] == "rate" and cell["status"] == "Valid" and cell["achieved_rate_rps"] == pytest.approx(2.0)
    assert "stopped:" in out.stderr


@pytest.mark.wall_timed
def test_a_rate_cells_tail_is_weighed_against_the_clients_lag_in_the_same_time(tmp_path: Path) -> None:
    """A rate cell's latencies are in the hardware's ms (wall x the simulator's time scale), the client's
    event-loop lag in wall ms: a 2 ms lag under a 100 ms TTFT p99 at 5x is 10 ms of the hardware's, 10% of
    the tail, so not judged; the same cell at 1x (2%) is judged."""
    for scale, judged in ((5.0, False), (1.0, True)):
        run = store.RunDir.create(tmp_path / str(scale), "t")
        builders.manifest(run, baseline="a", variants=["b"])
        spec = CellSpec(phase="rate", context_tokens=64, request_rate=1.0)
        for variant, p99s in (("a", [100.0, 101.0, 99.0]), ("b", [140.0, 141.0, 139.0])):
            launch = run.new_launch_dir(variant)
            builders.server(launch, variant=variant, ready_s=1.0, facts={"kv_cache_tokens": 1000})
            for repeat, p99 in enumerate(p99s):
                result = CellResult(spec=spec, phase="rate", context_tokens=64, concurrency=1, label=spec.label,
                                    status="Valid", ttft_p99_ms=p99, latency_requests=500, time_scale=scale,
                                    client_lag_p99_ms=2.0, goodput_rps=1.0)
                run.write_cell(variant, repeat, result, launch=launch.name, telemetry=None)
        ttft = next(m for c in diff_run(run)[0].cells for m in c.metrics if m.metric == "ttft_p99_ms")
        assert (ttft.verdict == "worse") if judged else (ttft.verdict == "no data" and "10% of a" in ttft.note)
