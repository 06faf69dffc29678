"""One method, two clocks (issue 51): every kind of cell and experiment measured by the same Measurer over HTTP on
the simulator at time scale 5 (the wall clock, a server process) and in simulated time (the simulator in this
process on its own clock, measure.simulated), on the same launch profile. The figures a run publishes agree
within 10%: the simulated clock is the same method, not a model of it.

What may differ, and why the bound is 10% and not equality: over HTTP a request reaches the server a little
later than its send (the socket, the other process's loop) and the host may stall the client; in simulated time
neither happens. Tail percentiles of a few requests move by whole engine steps, so the checks read the figures
a verdict reads: rates, means and medians.

One difference is the server's, not the method's: requests sent together (a fixed round, agents in lockstep)
reach the engine at one instant in simulated time and are prefilled in one step, while over HTTP at 5x their
sends spread by about a wall millisecond, five simulated ones, and the first starts a step alone (measured on
a fixed C4 round at 1,024 tokens: first tokens after 1,041 ms instead of 2,044 for the first request, TPOT 24.9
against 28.8 ms). Throughput agrees (75.5 against 75.8 tok/s); stream tok/s and TPOT of such rounds are not
compared. A real GPU's client spreads its sends by the same millisecond, unmagnified. The same split moves
a sustained cell's requests where replacements queue for a prefill step far longer than a decode step (the
A5000 pair at 1,024-token prompts: 1-2 s against 26 ms): each request's TPOT and stream tok/s move by whole
prefill steps, and the medians of one 20 s window's requests read 14.7 or 17.4 tok/s, 50 or 58 ms, from
identical servers as the client's timing fell (their own errors say so; the verdict reads them,
analysis/verdicts.MEDIAN_OF_REQUESTS). Those are compared where prefills are short.

Short enough is measured, not guessed: at 256-token prompts a sustained C8 cell's requests all end together on
the simulated clock, and over HTTP about one reading in six (unloaded, here and in CI) saw a generation's
replacements split across a step boundary; from then on each request's life held the other group's prefill step,
and the median TPOT read 29.5 ms against 25.5. A request can hold at most the prefills of the C-1 other streams
in its life, so the split moves its TPOT by at most (C-1) prefills over its replies' gaps: 54% at 256 tokens,
3.2% at 16 (the simulator's own step costs, held by the test beside the cells)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from fakes import simulated as http_sim

from campaign.bench import truth
from campaign.core import aio
from campaign.measure import capacity, slo, study, traces
from campaign.measure.cells import CellResult, CellSpec, Reason
from campaign.measure.runner import SIM_BEHIND_NOTE, Measurer, Target
from campaign.measure.simulated import start
from campaign.server.profiles import load_profile
from campaign.sim import truth as sim_truth
from campaign.sim.model import step_seconds

T = TypeVar("T")
TIME_SCALE = 5.0
PROFILE = "a5000-tp2"
FLAGS: dict[str, Any] = {"max-num-seqs": 16}
AGREE = 0.10
# The HTTP client's largest loop stall a reading may have had (wall ms; unloaded here 2.8-4.3 ms): at 5x, 10 ms
# is 50 simulated ms, two decode steps of the A5000 pair.
STALL_MS = 10.0
# ... or more, where the figures compared are long: a stall delays a stamp by at most its own length (times the
# scale), so one under 1% of every latency compared moves none of them by more than that, and leaves 9% of the
# 10% to the clocks. (A trace cell's mean TTFT is about 27 s: 54 wall ms. Under two CPU hogs its readings
# stalled 12-22 ms, and agreed within 0.1%.)
STALL_SHARE = 0.01
# The sustained cell whose every request's figures are compared (see the module's docstring).
SHORT_PROMPTS = CellSpec(phase="decode", context_tokens=16, concurrency=8, max_tokens=128, window_s=10.0,
                         warmup_s=2.0)
MOONCAKE = Path(__file__).parent.parent / "matrices" / "traces" / "mooncake-conversation-1k.jsonl"


@dataclass
class Side:
    """One clock's server and the one Measurer that measures it all module long, as a night's launch has one:
    its prompts go on from cell to cell, so no cell finds an earlier cell's prompt in the prefix cache."""

    call: Callable[[Coroutine[Any, Any, Any]], Any]
    measurer: Measurer

    @property
    def target(self) -> Target:
        return self.measurer.target


@pytest.fixture(scope="module")
def in_simulated_time() -> Iterator[Side]:
    """Made before `over_http` (each test names it first): that fixture's environment would hand this launch
    its truth file."""
    launch = start(load_profile(PROFILE)[0], FLAGS, seed=0)
    with launch.serve() as server:
        side = Side(server.call, Measurer(server.target()))
        side.call(_ready(side))
        yield side


@pytest.fixture(scope="module")
def over_http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Side]:
    with http_sim.with_truth(tmp_path_factory.mktemp("two-clocks"), PROFILE, FLAGS, TIME_SCALE) as (server, _):
        side = Side(aio.run, Measurer(server.target()))
        side.call(_ready(side))
        yield side


async def _ready(side: Side) -> None:
    """As a night's launch begins: the server's time scale read, then the warm-up (first-use costs: over HTTP a
    cold client's first connections, magnified five times, spread the first cell's sends)."""
    await side.measurer.warm_up([CellSpec(phase="prefill", context_tokens=4096),
                                 CellSpec(phase="decode", context_tokens=1024, concurrency=8, max_tokens=64)])


def both(http: Side, sim: Side, work: Callable[[Side], Coroutine[Any, Any, T]]) -> tuple[T, T]:
    """`work(side)` over HTTP at 5x, then in simulated time."""
    wall: T = http.call(work(http))
    virtual: T = sim.call(work(sim))
    return wall, virtual


def agree(http: float | None, virtual: float | None, what: str) -> None:
    assert http is not None and virtual is not None, what
    assert http == pytest.approx(virtual, rel=AGREE), (what, http, virtual)


def cells(http: Side, sim: Side, spec: CellSpec, latencies: tuple[str, ...] = ()) -> tuple[CellResult, CellResult]:
    """The cell on both clocks. Over HTTP the premise is the client's: a stall of its loop past STALL_MS is five
    times that on the server's clock, several engine steps, and moves which step a request lands in; such a
    reading (its own largest recorded lag says so) is measured again, at most three times, never compared.
    Where every latency compared (`latencies`, ms figures of the cell) is long, a stall under STALL_SHARE of the
    shortest of them is allowed too. So is a reading the tool itself calls a host's stall (the caveats
    client_stalled and sim_behind: a simulator its host starved ran its steps late; twice a loaded run read
    TPOT 16% long so, with the client's lag within bounds)."""
    async def cell(side: Side) -> CellResult:
        return await side.measurer.run_cell(spec)

    virtual = sim.call(cell(sim))
    shortest = min((getattr(virtual, name) or 0.0 for name in latencies), default=0.0)
    allowed_ms = max(STALL_MS, STALL_SHARE * shortest / TIME_SCALE)
    stalls: list[float | None] = []
    for _ in range(3):
        wall = http.call(cell(http))
        stalled = {Reason.CLIENT_STALLED, Reason.SIM_BEHIND} & set(wall.reason_codes)
        if wall.client_lag_max_ms is not None and wall.client_lag_max_ms <= allowed_ms and not stalled:
            break
        stalls.append(wall.client_lag_max_ms)
    else:
        pytest.fail(f"the host stalled the HTTP client past {allowed_ms:.1f} ms in every try: {stalls} ms")
    assert wall.status == virtual.status == "Valid", (wall.reasons, virtual.reasons)
    assert wall.time_scale == TIME_SCALE and virtual.time_scale == 1.0
    return wall, virtual


@pytest.mark.wall_timed
@pytest.mark.parametrize(("spec", "names"), [
    (CellSpec(phase="prefill", context_tokens=4096), ["prompt_tok_s", "ttft_ms"]),
    (CellSpec(phase="decode", context_tokens=1024, concurrency=4, max_tokens=128, mode="fixed", min_requests=8),
     ["total_tok_s"]),
    (CellSpec(phase="decode", context_tokens=1024, concurrency=8, max_tokens=128, window_s=20.0, warmup_s=2.0),
     ["total_tok_s", "itl_ms"]),
    (SHORT_PROMPTS, ["total_tok_s", "per_request_tok_s", "tpot_ms", "itl_ms"]),
], ids=["prefill", "fixed", "sustained", "sustained-short-prompts"])
def test_prefill_and_decode_cells_agree_on_both_clocks(in_simulated_time: Side, over_http: Side,
                                                       spec: CellSpec, names: list[str]) -> None:
    """Two sustained cells. At 1,024-token prompts replacements queue for the prefill chunk, and a step that
    prefills one takes 1-2 s against 26 ms for a decode step: there each request's TPOT and stream tok/s hang
    on which of those steps fall in its life, so they are compared where prefills are short (16 tokens, the
    next test), and at 1,024 only the figures of every token (total tok/s, ITL). See the module's docstring."""
    wall, virtual = cells(over_http, in_simulated_time, spec)
    for name in names:
        agree(getattr(wall, name), getattr(virtual, name), name)
    # Simulated time has no client to stall: its lag is zero, its core share undefined.
    assert virtual.client_lag_max_ms == 0.0 and virtual.client_cpu is None


def test_no_grouping_of_the_short_cells_replacements_moves_its_tpot_by_half_the_bound() -> None:
    """The premise of comparing the short-prompt cell's medians: however the client's sends split its streams
    into groups, a request's life holds at most the C-1 other streams' prefills (the simulator's step costs)."""
    loaded = load_profile(PROFILE)[0]
    spec, c = SHORT_PROMPTS, SHORT_PROMPTS.concurrency
    tp = loaded.flags["tensor-parallel-size"]
    assert loaded.hardware is not None and spec.max_tokens is not None and isinstance(tp, int)

    def step(prefills: int) -> float:
        return step_seconds(hardware=loaded.hardware or "", model=loaded.shape_name, tp=tp, decode_tokens=c - prefills,
                            prefill_tokens=prefills * spec.context_tokens, prefill_context=0,
                            context_tokens_read=c * (spec.context_tokens + spec.max_tokens // 2))

    decode, with_one = step(0), step(1)
    worst = (c - 1) * (with_one - decode) / (spec.max_tokens - 1) / decode
    assert 0 < worst < AGREE / 2, worst


@pytest.mark.wall_timed
def test_a_rate_cell_agrees_on_both_clocks(in_simulated_time: Side, over_http: Side) -> None:
    spec = CellSpec(phase="rate", context_tokens=512, max_tokens=64, request_rate=1.0, duration_s=20.0,
                    slo=slo.parse("ttft_p90_ms=2000,tpot_p90_ms=100"))
    wall, virtual = cells(over_http, in_simulated_time, spec)
    assert wall.scheduled_requests == virtual.scheduled_requests   # the same schedule, from the same seed
    for name in ("achieved_rate_rps", "total_tok_s", "ttft_ms", "tpot_ms", "e2e_ms", "goodput_rps"):
        agree(getattr(wall, name), getattr(virtual, name), name)


@pytest.mark.wall_timed
def test_a_trace_cell_agrees_on_both_clocks(in_simulated_time: Side, over_http: Side) -> None:
    sliced, requests = traces.plan(MOONCAKE, start_s=120, duration_s=20, length_scale=0.1)
    spec = CellSpec.from_trace(sliced, requests, slo=slo.parse("ttft_p99_ms=3600000"))
    wall, virtual = cells(over_http, in_simulated_time, spec, latencies=("ttft_ms", "e2e_ms"))
    assert wall.scheduled_requests == virtual.scheduled_requests == len(requests)
    for name in ("total_tok_s", "ttft_ms", "e2e_ms"):
        agree(getattr(wall, name), getattr(virtual, name), name)
    agree(wall.prefix_cache_hits, virtual.prefix_cache_hits, "prefix_cache_hits")


@pytest.mark.wall_timed
def test_agent_sessions_agree_on_both_clocks(in_simulated_time: Side, over_http: Side) -> None:
    async def agents(side: Side) -> study.ExperimentResult:
        return await study.agents(side.target, sessions=[2, 4], turns=3, system_tokens=800, user_tokens=100,
                                  reply_tokens=64, prompts="random", floors=(5.0,), time_scale=side.target.time_scale)

    wall, virtual = both(over_http, in_simulated_time, agents)
    assert wall.status == virtual.status == "Valid", (wall.reasons, virtual.reasons)
    assert wall.values.keys() == virtual.values.keys()
    # The answer (how many agents held the floor) is the same; each N's slowest agent is not compared, for the
    # reason a fixed round's stream tok/s is not (see the module's docstring).
    held = [name for name in wall.values if not name.startswith("slowest_agent")]
    assert held and all(wall.values[name] == virtual.values[name] for name in held), (wall.values, virtual.values)


@pytest.mark.wall_timed
def test_an_slo_search_brackets_the_same_rate_on_both_clocks(in_simulated_time: Side,
                                                              over_http: Side) -> None:
    spec = CellSpec(phase="rate", context_tokens=1024, max_tokens=64, request_rate=1.0, duration_s=10.0,
                    slo=slo.parse("ttft_p90_ms=4000,tpot_p90_ms=100"))

    async def search(side: Side) -> study.ExperimentResult:
        return await capacity.slo_search(side.measurer, spec, start_rps=1.0, resolution=0.25, max_probes=6,
                                         concurrency=False, concurrency_ceiling=None)

    wall, virtual = both(over_http, in_simulated_time, search)
    assert wall.status == virtual.status == "Valid", (wall.reasons, virtual.reasons)
    assert wall.values.get("max_rate_rps") and virtual.values.get("max_rate_rps"), (wall, virtual)
    agree(wall.values["max_rate_rps"], virtual.values["max_rate_rps"], "max_rate_rps")


@pytest.mark.wall_timed
def test_the_h200s_rate_search_brackets_the_same_rate_on_both_clocks(tmp_path: Path) -> None:
    """`--find-max-rate`'s search (capacity.slo_search) on the simulated H200, seed 004's card, in simulated time
    and over HTTP at 5x: the same probes, each held or failed alike, so the same bracket. 8K prompts, 64-token
    replies, TTFT p90 within 2.4 s and TPOT p90 within 50 ms, from 0.5 req/s to a resolution of 2x: on the
    engine's clock 0.5 holds with its TTFT p90 36% inside the bound and 1.0 fails with its TPOT p90 40% over,
    margins the client's jitter at 5x does not reach. (A bracket at 0.25 resolution ends where a probe is a few
    percent from the bound: there, under two CPU hogs, 3 HTTP searches in 10 read a held probe as failed, the
    client's stalls magnified five times; h200-slo's own search, whose edge is flat to 0.5%, is `make
    bench-clocks`' and docs/simulator.md's.)"""
    spec = CellSpec(phase="rate", context_tokens=8192, max_tokens=64, request_rate=1.0, duration_s=10.0,
                    slo=slo.parse("ttft_p90_ms=2400,tpot_p90_ms=50"))
    flags = {"max-model-len": 16384}

    async def search(measurer: Measurer) -> study.ExperimentResult:
        return await capacity.slo_search(measurer, spec, start_rps=0.5, resolution=1.0, max_probes=6,
                                         concurrency=False, concurrency_ceiling=None)

    with http_sim.in_simulated_time("h200", flags) as served:
        virtual = served.server.call(search(Measurer(served.server.target())))
    # Over HTTP the simulator keeps its clock only if the host lets it: where its engine's own records say it fell
    # behind by more than the tool's own 1% of the search's span (runner.SIM_BEHIND_NOTE), its TTFTs are the
    # host's, not the card's, and the search runs again on a fresh launch (at most three times).
    behind: list[float] = []
    for attempt in range(3):
        with http_sim.with_truth(tmp_path / f"try-{attempt}", "h200", flags, TIME_SCALE) as (server, truth_path):
            measurer = Measurer(server.target())
            aio.run(measurer.warm_up([CellSpec(phase="prefill", context_tokens=8192)]))
            wall = aio.run(search(measurer))
            recorded = sim_truth.read(truth_path)
        span = max(r.finish or r.arrival for r in recorded.requests) - min(r.arrival for r in recorded.requests)
        behind.append(round(recorded.behind_s() / span, 4))
        if behind[-1] <= SIM_BEHIND_NOTE:
            break
    else:
        pytest.fail(f"the simulator fell behind its clock in every try (share of the search's span): {behind}")
    assert wall.status == virtual.status == "Valid", (wall.reasons, virtual.reasons)

    def probes(result: study.ExperimentResult) -> list[tuple[float, bool]]:
        return [(p["value"], p["passed"]) for p in result.details["slo_search"]["probes"]]

    assert probes(wall) == probes(virtual) == [(0.5, True), (1.0, False)], (
        wall.details["slo_search"]["probes"], virtual.details["slo_search"]["probes"], wall.reasons)
    assert wall.values["max_rate_rps"] == virtual.values["max_rate_rps"] == 0.5


@pytest.mark.wall_timed
def test_seed_000s_experiments_agree_on_both_clocks(in_simulated_time: Side,
                                                    over_http: Side) -> None:
    async def experiments(side: Side) -> list[study.ExperimentResult]:
        target = side.target
        return [await study.long_context(target, [2048, 8192], reply_tokens=64),
                await study.prefix_order(target, block_size=target.block_size, agents=4, shared_tokens=2400,
                                         task_tokens=200, reply_tokens=64),
                await study.overload(target, max_num_seqs=16, factor=1.5, prompt_tokens=64, reply_tokens=64)]

    wall, virtual = both(over_http, in_simulated_time, experiments)
    for w, v in zip(wall, virtual, strict=True):
        assert w.status == v.status == "Valid", (w.kind, w.reasons, v.reasons)
    for w_row, v_row in zip(wall[0].details["rows"], virtual[0].details["rows"], strict=True):
        for name in ("ttft_s", "generation_tok_s", "prompt_tok_s"):
            agree(w_row[name], v_row[name], f"long context {w_row['context_tokens']} {name}")
    for name in ("shared_first_hit_rate", "shared_first_wall_s", "speedup"):
        agree(wall[1].values[name], virtual[1].values[name], f"prefix order {name}")
    for name in ("ran_concurrently", "queued", "completed"):
        assert wall[2].values[name] == virtual[2].values[name], name


def test_in_simulated_time_every_figure_is_the_engines_own_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """The truth of the simulated clock: with no socket delay and no client stall, a sustained decode cell's and
    a rate cell's every published figure (rates, counters, percentiles, steadiness intervals, SLO) equals what
    the engine recorded (sim_truth), to rounding: a delivery delay of exactly zero."""
    for name in ("CAMPAIGN_SIM_TRUTH", "CAMPAIGN_SIM_TIME_SCALE"):   # `over_http`'s, if it is alive
        monkeypatch.delenv(name, raising=False)
    launch = start(load_profile("h200")[0], {}, seed=0)
    recorded = sim_truth.Recorder()
    specs = [CellSpec(phase="decode", context_tokens=1024, concurrency=8, max_tokens=128, window_s=20.0, warmup_s=2.0),
             CellSpec(phase="rate", context_tokens=1024, max_tokens=64, request_rate=4.0, duration_s=30.0,
                      slo=slo.parse("ttft_p90_ms=500,tpot_p90_ms=30"))]
    with launch.serve(truth=recorded) as server:
        measurer = Measurer(server.target())
        sustained, rate = (server.call(measurer.run_cell(spec)) for spec in specs)
        anchor = server.anchor
    matched = truth.Matched(sim_truth.Truth(header={"time_scale": 1.0, "anchor": anchor},
                                            requests=recorded.requests, steps=recorded.steps))
    figures, delay = truth.cell_figures(sustained, matched)
    assert delay == 0.0
    figures += truth.rate_cell_figures(rate, matched, matched.delivery(rate.records, matched.of(rate.records)))
    assert len(figures) > 60 and {"total_tok_s", "ttft_p99", "slo_passed", "interval_0_tpot"} <= {
        f.name for f in figures}
    off = [(f.name, f.tool, f.truth) for f in figures if not f.ok or (
        f.tool is not None and f.truth is not None and f.tool != pytest.approx(f.truth, rel=1e-9, abs=1e-9))]
    assert not off, off
