"""Every figure the tool publishes, against what the simulated server really did (its truth records): the
check `make truth` runs, at a size for the suite (every kind of cell and experiment once, short windows and
replies), the simulator at 20x (it keeps up, or says it did not), and the truth's own arithmetic and
tolerances on constructed records."""

from __future__ import annotations

import asyncio
import math
import os
import re
from collections.abc import Awaitable
from pathlib import Path

import pytest

from campaign.bench import truth
from campaign.core.runqueue import SCHEDSTAT, RunQueueWait
from campaign.http.client import RequestRecord
from campaign.measure import capacity, figures, runner, slo, study
from campaign.measure.cells import CellResult, CellSpec
from campaign.measure.runner import SIM_BEHIND_NOTE, Measurer
from campaign.night.launcher import LaunchedServer, launched
from campaign.server.profiles import load_profile
from campaign.sim import config as sim_config
from campaign.sim import engine as sim_engine
from campaign.sim import server as sim
from campaign.sim import truth as sim_truth
from campaign.sim.truth import RequestTruth

# --- the whole check, as `make truth` runs it, at a size for the suite -------------------------------------
# `make truth` (campaign/bench/truth.py) is the benchmark: 10 s windows, replies of hundreds of tokens, a
# capacity search of eight probes, about three minutes at time scale 1. Here the same driver, the same
# matching and the same tolerances run every kind of cell and experiment of that run once, at time scale 1
# (latencies judged), with 4 s windows (a step of about 15 ms misread at an edge is 0.4% of one, inside the 1%)
# and replies of tens of tokens, so requests end and are replaced inside every window. Sustained cells open
# their window once every stream has its first token, with no warm-up: the truth counts the same window.
SUITE_WINDOW_S = 4.0
SUITE_WARMUP_S = 0.0


def suite_launches() -> tuple[truth.Launch, ...]:
    """`make truth`'s two launches at the suite's size. The H200 (MTP: chunks of 1-3 tokens) runs every kind of
    cell: prefill, two sustained streams, the fixed cell (two rounds of four 64-token replies: some 500 per-token
    gaps, so its ITL p99 is not one gap's, though it may be two moments': see the test of one moment's tail
    below), an open-loop load (ten requests at 4 a second, below the knee) and a trace (22 requests of the
    Mooncake excerpt in three bursts, lengths a tenth, twice as fast), then long context, repeat and the
    capacity search; the A5000 pair (800-token blocks, four seats) context window, overload and prefix order."""
    return (
        truth.Launch("h200", {"max-model-len": 16384}, cells=(
            CellSpec(phase="prefill", context_tokens=8192),
            truth._sustained(2048, 2, 64),
            truth._fixed(1024, 4, 64),
            CellSpec(phase="rate", context_tokens=2048, max_tokens=32, request_rate=4.0, duration_s=2.5,
                     slo=truth.TRUTH_SLO),
            truth.trace_cell(120, 6, length_scale=0.1, speed=2),
        ), experiments=("long-context", "repeat", "slo-search")),
        truth.Launch("a5000-tp2", {"max-model-len": 1024, "max-num-seqs": 4}, cells=(),
                     experiments=("context-window", "overload", "prefix-order")),
    )


def suite_experiment(kind: study.ExperimentKind, server: LaunchedServer) -> Awaitable[study.ExperimentResult]:
    """Each experiment of `make truth` with fewer and shorter requests."""
    target = server.target()
    if kind == "long-context":
        # Longer prompts than `make truth`'s 2K and 6K, and replies of 96 tokens: a prompt rate is judged within
        # 1%, which is 1% of its TTFT (6 ms at 6K, 2 ms at 2K), and a generation rate 1% of its reply's time
        # (6 ms for 96 tokens, 2 ms for 32); a few milliseconds of either process waiting for a CPU on a busy
        # machine are not the tool's error.
        return study.long_context(target, [6144, 8192], reply_tokens=96)
    if kind == "repeat":
        return study.repeat_cell(target, truth._sustained(512, 2, 32), times=2)
    if kind == "slo-search":
        # 2K prompts, 32-token replies: the SLO holds at 4 a second and fails at 8 (a probe of ten requests
        # takes 2-3 s), bisected once, to a bracket within 50%. Its TTFT p90s, 0.7-1.2 s, are judged within
        # 14-24 ms; a probe of 1K prompts reads 0.2 s, within 4 ms, which one request delayed by a busy
        # machine can spend.
        shape = CellSpec(phase="rate", context_tokens=2048, max_tokens=32, request_rate=1.0, duration_s=1.0,
                         slo=truth.TRUTH_SLO)
        return capacity.slo_search(Measurer(target), shape, start_rps=4.0, resolution=0.5, max_probes=4,
                                   concurrency=False)
    if kind == "context-window":
        return study.context_window(target, reply_tokens=32)
    if kind == "overload":
        return study.overload(target, max_num_seqs=4, factor=2, prompt_tokens=128, reply_tokens=12)
    assert kind == "prefix-order", kind
    # The A5000 pair's 800-token blocks: the shared text is one whole block. Its prefills make each arm's wall
    # 1-2 s, so the client's own few milliseconds per arm (connecting, its last read) stay inside the 2% a
    # wall is judged by (on the H200 an arm of these prompts took 0.15 s, and read 9 ms long).
    return study.prefix_order(target, block_size=server.facts.block_size, agents=2, shared_tokens=800,
                              task_tokens=32, reply_tokens=8)


def _place(where: str) -> str:
    """A figure's kind of place: "h200 decode-fixed-L256-C2-N64-R4" -> "decode-fixed", "h200 rate-L1024-..." ->
    "rate", "h200 repeat run 1" -> "repeat", "h200 slo-search L1024-..." (one probe) -> "slo-search probe"."""
    parts = where.split()   # the launch's profile, then a cell's key, or an experiment and which part of it
    if parts[1] == "slo-search" and len(parts) > 2:
        return "slo-search probe"
    if parts[1].startswith("decode-"):
        return "-".join(parts[1].split("-")[:2])
    return parts[1].split("-L")[0]


@pytest.mark.wall_timed
def test_every_published_figure_matches_the_simulators_truth(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`make truth` at the suite's size: every kind of cell (prefill, sustained, fixed, open-loop rate) and
    every experiment (long context, repeat, prefix order, a capacity search, context window, overload) of the
    full run, measured over HTTP by the tool's own code on the simulated H200 and A5000 pair at time scale 1,
    and every figure they publish within its tolerance of the simulator's truth records, latencies judged.
    The capacity search finds, probe for probe, the verdicts the truth gives, and the same bracketed maximum."""
    full = truth.launches()
    monkeypatch.setattr(truth, "WINDOW_SIM_S", SUITE_WINDOW_S)
    monkeypatch.setattr(truth, "WARMUP_SIM_S", SUITE_WARMUP_S)
    monkeypatch.setattr(truth, "launches", suite_launches)
    monkeypatch.setattr(truth, "_experiment", suite_experiment)
    suite = truth.launches()

    def kinds(launches: tuple[truth.Launch, ...]) -> set[str]:
        return {f"{c.phase} {c.mode if c.phase == 'decode' else 'trace' if c.trace else ''}" for launch in launches
                for c in launch.cells} \
            | {e for launch in launches for e in launch.experiments}
    assert kinds(suite) == kinds(full)   # nothing `make truth` measures is left out here

    report = truth.run(truth.DEFAULT_SCALE)
    lines = truth.lines(report)
    with capsys.disabled():
        print("\n" + "\n".join(lines))  # the figures stay in the test log, as `make truth` prints them
    out = [f"{f.where} {f.name}: tool {f.tool} truth {f.truth}" for f in report.figures if not f.ok]
    assert not out, out
    assert re.fullmatch(r"max_error_pct=[\d.]+ max_latency_error_ms=[\d.]+ figures=\d+", lines[-1])
    assert len(report.figures) >= 40
    assert report.latencies_judged
    assert {f.kind for f in report.figures} == {"rate", "count", "latency"}
    # Every kind of figure is there: window rates, per-token latency tails, prompt rates, draft acceptance,
    # the open-loop load's service levels, every experiment's numbers.
    names = {(_place(f.where), f.name) for f in report.figures}
    for expected in (("decode-sustained", "itl_p99"), ("decode-sustained", "avg_before_first_token"),
                     ("decode-fixed", "tpot_p99"), ("prefill", "prompt_tok_s"), ("rate", "goodput_rps"),
                     ("rate", "ttft_p90_ms"), ("long-context", "generation_tok_s"), ("repeat", "mean_total_tok_s"),
                     ("prefix-order", "hit_rate"), ("slo-search probe", "slo_passed"),
                     ("slo-search", "max_rate_rps"), ("context-window", "completion_tokens"),
                     ("overload", "queued")):
        assert expected in names, expected
    assert any(f.name == "spec_acceptance_rate" and f.truth for f in report.figures)   # MTP's drafts judged
    # The search bracketed the SLO (a probe held, a higher one failed, within its 50%) and the truth's own
    # verdicts on its probes give the same maximum.
    found = {f.name: f for f in report.figures if f.where.endswith(" slo-search")}
    capacity_found, first_fail = found["max_rate_rps"], found["first_fail_rps"]
    assert capacity_found.tool is not None and capacity_found.tool == capacity_found.truth, capacity_found
    assert first_fail.tool is not None and capacity_found.tool < first_fail.tool <= 1.5 * capacity_found.tool


@pytest.mark.wall_timed
def test_at_twenty_times_throughput_holds_or_the_cell_says_the_simulator_fell_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seed 004's 64-wide 8K cell, the one that read 1,731 tok/s at 20x against the seed's 3,104: at 20x its
    throughput is the seed's within 10%, or the cell says the simulator fell behind its clock; either way its
    rates and counts are the truth's."""
    scale = 20.0
    path = tmp_path / "truth.jsonl"
    monkeypatch.setenv("CAMPAIGN_SIM_TIME_SCALE", f"{scale:g}")
    monkeypatch.setenv("CAMPAIGN_SIM_TRUTH", str(path))
    profile, _ = load_profile("h200")
    # Replies of 2,048 tokens: the first stream holds about 1,050 when the window closes (64 8K prefills take
    # some 50 simulated seconds), so none ends inside the window, as in the seed's cell with 4,096, and the
    # drain after it is half as long.
    spec = CellSpec(phase="decode", context_tokens=8192, concurrency=64, max_tokens=2048, window_s=20.0,
                    warmup_s=1.0)  # the hardware's seconds: 1 s and 0.05 s of wall time at 20x
    with launched(profile, tmp_path / "server.log", engine="sim") as server:
        cell = asyncio.run(Measurer(server.target()).run_cell(spec))
    assert cell.status == "Valid", cell.reasons
    assert cell.completed == 0   # no reply ended, no replacement prefill, inside the window
    figures, _ = truth.cell_figures(cell, truth.Matched(sim_truth.read(path)))
    rates = {f.name: f for f in figures if f.kind != "latency"}
    for name in ("total_tok_s", "per_request_tok_s", "output_tokens", "completed"):
        assert rates[name].ok, rates[name]
    behind = (cell.sim_behind_share or 0.0) > SIM_BEHIND_NOTE   # the cell says so (a note, or sim_behind)
    assert cell.total_tok_s is not None
    assert behind or cell.total_tok_s == pytest.approx(3_104.6, rel=0.10)


# --- the truth's arithmetic, on records written by hand ------------------------------------------------------
def request(arrival: float, emits: list[tuple[float, int]], *, finish: float | None = None) -> RequestTruth:
    return RequestTruth(id="x", arrival=arrival, prompt_tokens=100, max_tokens=sum(n for _, n in emits),
                        emits=emits, finish=finish if finish is not None else emits[-1][0], reason="length")


def test_window_counts_what_was_emitted_inside_it() -> None:
    """A sustained window's truth, by hand: the tokens emitted inside it, the streams held and those still
    waiting for a first token (time-averaged), the per-request rate as the client times it (a request streaming
    across an edge from or to that edge, else from its first in-window emission), and the completions inside it."""
    a = request(0.0, [(1.0, 1), (2.0, 3), (3.0, 1), (4.0, 1)])
    b = request(0.5, [(2.5, 1), (3.5, 2)], finish=3.5)
    figures = sim_truth.window_figures([a, b], 2.0, 3.5)
    assert figures["output_tokens"] == 3 + 1 + 1 + 2
    assert figures["avg_active"] == pytest.approx((1.5 + 1.5) / 1.5)        # both held all through the window
    assert figures["avg_before_first_token"] == pytest.approx(0.5 / 1.5)    # b waited from 2.0 to 2.5
    assert figures["total_tok_s"] == pytest.approx(7 / 1.5)
    # a streams across both edges: its 4 tokens inside over the window's 1.5 s; b starts and ends inside: the
    # 2 tokens after its first in-window emission over (3.5 - 2.5).
    assert figures["per_request_tok_s"] == pytest.approx((4 / 1.5 + 2 / 1.0) / 2)
    assert figures["completed"] == 1


def test_a_stall_after_the_window_opens_moves_per_request_rates_no_more_than_the_total() -> None:
    """The 20x H200 cell under two CPU hogs read per-request rates 1-4% off the truth in 3 of 36 runs while its
    totals held: a stall just after the window opened delivered the tokens made during it in one burst, and
    a request timed from its own first token inside began its span that late. Replayed by hand: 8 streams, a
    token each per millisecond, delivered 0.3 ms later except during a 30 ms stall that began 2 ms before
    the window's start. Timed by each request's first token inside, the per-request rate is off by the whole
    stall over the window (over 3%); timed from the edge it streams across, by the 2 ms before the edge, as
    the total is."""
    delay, stall, window = 0.0003, (1.008, 1.038), (1.01, 1.9)
    emits = [(i / 1000, 1) for i in range(1, 2001)]
    truths = [request(0.0, emits, finish=2.0) for _ in range(8)]

    def delivered(t: float) -> float:
        return (stall[1] if stall[0] <= t <= stall[1] else t) + delay

    records = [RequestRecord(id=f"r{k}", prompt_tokens=100, max_tokens=2000, send_t=0.0,
                             chunk_t=[delivered(t) for t, _ in emits], chunk_tokens=[n for _, n in emits],
                             end_t=2.0 + delay, status=200) for k in range(8)]
    tool = figures.window_metrics(records, *window)
    true = sim_truth.window_figures(truths, window[0] - delay, window[1] - delay)
    assert tool["per_request_tok_s"] is not None and true["per_request_tok_s"] is not None
    off = {name: tool[name] / true[name] - 1 for name in ("total_tok_s", "per_request_tok_s")}
    assert 0 < off["total_tok_s"] < 0.005   # the 2 ms of the stall before the edge: 16 tokens of 7,120
    assert off["per_request_tok_s"] == pytest.approx(off["total_tok_s"], abs=0.0005)

    # The rule before: each request from its own first token inside to its last.
    inside = [[(t, n) for t, n in zip(r.chunk_t, r.chunk_tokens, strict=True) if window[0] <= t <= window[1]]
              for r in records]
    before = sorted(sum(n for _, n in c[1:]) / (c[-1][0] - c[0][0]) for c in inside)[len(inside) // 2]
    assert before / true["per_request_tok_s"] - 1 > 0.03


def test_a_stall_across_a_windows_edge_is_judged_with_the_clients_largest_lag() -> None:
    """Issue 50, under two CPU hogs: the 20x H200 cell read its total 2,208.8 tok/s against a truth of 2,175.7
    (1.5% over): tokens emitted just before its window opened were read inside it after a client stall.
    Replayed by hand: 8 streams, a token each per millisecond, read 0.3 ms later except during a 30 ms stall
    that began 10 ms before the window opened. The total is over 1% off the truth; the window's counts with
    each edge moved by the stall the cell recorded (a read is late, never early) hold it; a shorter stall
    recorded, or none, does not."""
    delay, stall, window = 0.0003, (0.990, 1.020), (1.0, 1.9)
    emits = [(i / 1000, 1) for i in range(1, 2001)]
    truths = [RequestTruth(id=f"cmpl-{k}", arrival=0.0, prompt_tokens=100, max_tokens=2000, emits=emits,
                           finish=2.0, reason="length") for k in range(8)]

    def read(t: float) -> float:
        return (stall[1] if stall[0] <= t <= stall[1] else t) + delay

    records = [RequestRecord(id=f"r{k}", prompt_tokens=100, max_tokens=2000, send_t=0.0,
                             chunk_t=[read(t) for t, _ in emits], chunk_tokens=[n for _, n in emits],
                             end_t=2.0 + delay, status=200, server_id=f"cmpl-{k}") for k in range(8)]
    spec = CellSpec(phase="decode", mode="sustained", context_tokens=100, concurrency=8, max_tokens=2000)
    matched = truth.Matched(sim_truth.Truth(header={"anchor": 0.0, "time_scale": 1.0}, requests=truths, steps=[]))

    def total(lag_ms: float | None) -> truth.Figure:
        cell = CellResult(spec=spec, phase="decode", context_tokens=100, concurrency=8, label=spec.label,
                          status="Valid", requests=[r.to_dict() for r in records], window=window,
                          client_lag_p99_ms=lag_ms, client_lag_max_ms=lag_ms,
                          **figures.window_metrics(records, *window))
        found, _ = truth.cell_figures(cell, matched)
        return next(f for f in found if f.name == "total_tok_s")

    unrecorded = total(None)
    assert unrecorded.tool is not None and unrecorded.truth is not None
    assert unrecorded.tool / unrecorded.truth - 1 > 0.01 and not unrecorded.ok
    assert total(31.0).ok and not total(5.0).ok


def test_a_tail_that_rests_on_one_moment_is_judged_with_the_clients_largest_lag() -> None:
    """The suite's fixed cell read its ITL p99 1.9 ms long on a busy host while the client's lag p99 stayed
    under 1 ms: four streams in step read their tokens at once, so the top 1% of its 504 per-token gaps (six)
    can all be two moments', and a stall the lag's p99 (a few from the top of some hundreds of samples) skips
    moves the whole tail. Replayed by hand: two rounds of four 64-token replies, a token every 16.7 ms, read
    0.3 ms later except twice, when the client's loop stalled 2.5 ms and all four streams read late. The p99
    is 2.5 ms long: outside the latency tolerance plus the lag's p99, inside it plus the largest lag, which
    the cell stores (format 13). A tail of many more gaps than moments a stall can reach keeps the lag's p99."""
    gap, delay, stall = 0.0167, 0.0003, 0.0025
    stalls = {20, 45}   # the emissions whose reads the stalls delayed, on every stream
    truths: list[RequestTruth] = []
    records: list[RequestRecord] = []
    for k in range(8):
        start = (k // 4) * 1.2
        emits = [(start + i * gap, 1) for i in range(64)]
        truths.append(request(start, emits))
        reads = [t + delay + (stall if i in stalls else 0.0) for i, (t, _) in enumerate(emits)]
        records.append(RequestRecord(id=f"r{k}", prompt_tokens=100, max_tokens=64, send_t=start, chunk_t=reads,
                                     chunk_tokens=[1] * 64, end_t=reads[-1], status=200))
    true = sim_truth.latency_figures(truths, -math.inf, math.inf)
    spec = CellSpec(phase="decode", mode="fixed", context_tokens=1024, concurrency=4, max_tokens=64)
    cell = CellResult(spec=spec, phase="decode", context_tokens=1024, concurrency=4, label=spec.label,
                      status="Valid", requests=[r.to_dict() for r in records], client_lag_p99_ms=0.3,
                      **figures.latency_distributions(records, -math.inf, math.inf))
    assert cell.itl_samples == 504 and cell.itl_p99_ms is not None and true["itl_p99"] is not None
    assert cell.itl_p99_ms / 1000 - true["itl_p99"] == pytest.approx(stall, abs=1e-4)

    def itl_p99(judged: CellResult) -> truth.Figure:
        return next(f for f in truth._latency_figures("h200 fixed", judged, true, 1.0) if f.name == "itl_p99")
    assert not itl_p99(cell).ok                                              # the lag's p99 cannot cover it
    assert itl_p99(cell.model_copy(update={"client_lag_max_ms": 2.6})).ok   # its largest lag does
    # 2.3 s of lag samples (some 450, p99 their 5th largest); 504 gaps' top 1% (6) is 2 moments of 4 streams.
    stored = cell.model_copy(update={"client_lag_max_ms": 2.6})
    assert truth._lag_slack_s(stored, "itl", 1.0) == pytest.approx(0.0026)
    assert truth._lag_slack_s(stored, "ttft", 2.0) == pytest.approx(0.0052)   # the wall's lag, simulated at 2x
    many = stored.model_copy(update={"itl_samples": 5000})   # top 1%: 50 gaps, 13 moments of 4 streams
    assert truth._lag_slack_s(many, "itl", 1.0) == pytest.approx(0.0003)
    assert truth._lag_slack_s(cell, "itl", 1.0) == pytest.approx(0.0003)     # no largest lag stored: the p99


def _probe_read_through_a_stall(stall: float, *, metric: str, lag_ms: float | None) -> list[truth.Figure]:
    """An open-loop probe of six 16-token requests a second against TTFT p90 <= 1500 ms and TPOT p90 <= 40 ms,
    every token read 0.3 ms after the engine emitted it; the server served each one within both bounds
    (TTFT 1 s, TPOT 30 ms), request 3 with a TTFT of 1460 ms and request 4 with a TPOT of 38 ms, whose
    first token (TTFT) or last (TPOT) the client read `stall` seconds late; `lag_ms` is the largest loop
    lag the cell stored. Its goodput and met share beside their truth."""
    delay, service = 0.0003, slo.parse("ttft_p90_ms=1500,tpot_p90_ms=40")
    truths: list[RequestTruth] = []
    records: list[RequestRecord] = []
    for k in range(6):
        ttft, tpot = (1.46 if k == 3 else 1.0), (0.038 if k == 4 else 0.03)
        emits = [(k + ttft + i * tpot, 1) for i in range(16)]
        truths.append(RequestTruth(id=f"cmpl-{k}", arrival=float(k), prompt_tokens=100, max_tokens=16,
                                   emits=emits, finish=emits[-1][0], reason="length"))
        reads = [t + delay for t, _ in emits]
        if k == 3 and metric == "ttft":
            reads[0] += stall
        if k == 4 and metric == "tpot":
            reads[-1] += stall
        records.append(RequestRecord(id=f"r{k}", prompt_tokens=100, max_tokens=16, send_t=float(k),
                                     chunk_t=reads, chunk_tokens=[1] * 16, end_t=reads[-1], status=200,
                                     server_id=f"cmpl-{k}"))
    spec = CellSpec(phase="rate", context_tokens=100, max_tokens=16, request_rate=1.0, duration_s=6.0,
                    slo=service)
    values = figures.rate_metrics(records, start=0.0, span_s=6.0, planned=6, early_stopped=False,
                                  request_rate=1.0, service=service)
    cell = CellResult(spec=spec, phase="rate", context_tokens=100, concurrency=1, label=spec.label,
                      status="Valid", requests=[r.to_dict() for r in records], window=(0.0, 6.0),
                      client_lag_p99_ms=0.3, client_lag_max_ms=lag_ms, **values)
    matched = truth.Matched(sim_truth.Truth(header={"anchor": 0.0, "time_scale": 1.0}, requests=truths, steps=[]))
    out = truth.rate_cell_figures(cell, matched, matched.delivery(records, matched.of(records)))
    return [f for f in out if f.name in ("goodput_rps", "slo_met_fraction")]


@pytest.mark.parametrize(("metric", "stall"), [("ttft", 0.045), ("tpot", 0.036)])
def test_a_request_read_past_its_bound_through_a_recorded_stall_may_be_judged_out(metric: str, stall: float) -> None:
    """Issue 50: under two CPU hogs the suite's H200 search read goodput 2.135 rps at 4.76 rps against a truth
    of 2.563: one request of six judged out that the server served within its bounds, by more than the
    latency tolerance and the delivery delay allow. A stall reads one request's first token or its end that
    much late: its TTFT by the whole stall, its TPOT by the stall over its gaps. Replayed by hand: request 3
    (TTFT 1460 ms) read 45 ms late, or request 4 (TPOT 38 ms over 15 gaps) read 36 ms late at its end, each
    then past its bound. The truth allows it where the client recorded a stall that long, and not where the
    client recorded none (a reading late for no reason the client saw is still an error)."""
    for figure in _probe_read_through_a_stall(stall, metric=metric, lag_ms=None):
        assert figure.truth is not None
        assert figure.tool == pytest.approx(figure.truth * 5 / 6, rel=1e-3)   # one of six judged out ...
        assert not figure.ok, figure                                   # ... which the tolerances alone refuse
    for figure in _probe_read_through_a_stall(stall, metric=metric, lag_ms=1000 * stall + 1):
        assert figure.ok, figure
    # A shorter stall than the recorded lag leaves it inside its bound, and the truth still matches.
    for figure in _probe_read_through_a_stall(0.001, metric=metric, lag_ms=1000 * stall + 1):
        assert figure.tool == pytest.approx(figure.truth, rel=1e-3) and figure.ok, figure


def _burst_sent_late(sends: list[float], arrivals: list[float], tool_span: float | None = None) -> truth.Figure:
    """An open-loop cell of len(sends) 4-token requests scheduled over 3 s, each token read 0.3 ms after the
    engine emitted it; the client stamped request k's send at sends[k], the engine saw it at arrivals[k]. Its
    achieved rate beside its truth; `tool_span` replaces the tool's sending span (a tool that misreads it)."""
    truths: list[RequestTruth] = []
    records: list[RequestRecord] = []
    for k, (sent, arrival) in enumerate(zip(sends, arrivals, strict=True)):
        emits = [(arrival + 0.1 + 0.01 * i, 1) for i in range(4)]
        truths.append(RequestTruth(id=f"cmpl-{k}", arrival=arrival, prompt_tokens=100, max_tokens=4,
                                   emits=emits, finish=emits[-1][0], reason="length"))
        reads = [t + 0.0003 for t, _ in emits]
        records.append(RequestRecord(id=f"r{k}", prompt_tokens=100, max_tokens=4, send_t=sent, chunk_t=reads,
                                     chunk_tokens=[1] * 4, end_t=reads[-1], status=200, server_id=f"cmpl-{k}"))
    spec = CellSpec(phase="rate", context_tokens=100, max_tokens=4, request_rate=1.0, duration_s=3.0,
                    slo=slo.parse("ttft_p90_ms=1500"))
    values = figures.rate_metrics(records, start=0.0, span_s=3.0, planned=len(sends), early_stopped=False,
                                  request_rate=1.0, service=spec.slo)
    if tool_span is not None:
        values["achieved_rate_rps"] = len(sends) / tool_span
    cell = CellResult(spec=spec, phase="rate", context_tokens=100, concurrency=1, label=spec.label,
                      status="Valid", requests=[r.to_dict() for r in records], window=(0.0, 3.0), **values)
    matched = truth.Matched(sim_truth.Truth(header={"anchor": 0.0, "time_scale": 1.0}, requests=truths, steps=[]))
    out = truth.rate_cell_figures(cell, matched, matched.delivery(records, matched.of(records)))
    return next(f for f in out if f.name == "achieved_rate_rps")


def test_a_bursts_last_send_is_dated_by_the_request_that_arrived_last() -> None:
    """Stop 63's CI failure, replayed by hand: the Mooncake excerpt's bursts leave at one instant and reach the
    engine one after another on a busy host. A burst of two stamped at 3.2 s (the schedule said 3.0) arrives
    at 3.21 and 3.26 s; the client's rate is 5 over 3.2 s. The truth's fast end is the latest arrival less its
    own transport (3.2 s), not less the first sibling's (which read 3.25 s and refused the right figure); its
    slow end is the arrivals' own span. A tool that stretched or shortened its span by 0.1 s is refused."""
    sends, arrivals = [0.0, 1.0, 2.0, 3.2, 3.2], [0.002, 1.002, 2.002, 3.21, 3.26]
    figure = _burst_sent_late(sends, arrivals)
    assert figure.tool == pytest.approx(5 / 3.2) and figure.ok, figure
    assert figure.truth == pytest.approx(5 / (3.26 + 0.0003), rel=1e-6)
    assert figure.allowed is not None and figure.allowed[1] == pytest.approx(5 / 3.2)
    assert not _burst_sent_late(sends, arrivals, tool_span=3.1).ok
    assert not _burst_sent_late(sends, arrivals, tool_span=3.4).ok


class HeldOffTheCpu:
    """A fake of the kernel's run-queue account (core/runqueue.RunQueueWait): the loop's thread waited `stall`
    seconds for a CPU once, between the probe's `at`-th and next reading, and never otherwise."""

    def __init__(self, stall: float, at: int = 2) -> None:
        self.stall, self.at, self.reads = stall, at, 0

    def __enter__(self) -> HeldOffTheCpu:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def seconds(self) -> float:
        self.reads += 1
        return self.stall if self.reads > self.at else 0.0


def test_a_stall_between_the_lag_probes_timers_is_in_the_clients_lag(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 50: the suite's fixed cell read its ITL p99 2.3 ms long with the client's largest lag under 1.3 ms
    (18.93 ms against 16.61). The probe timed its own timers every 5 ms, less a millisecond of timer rounding:
    a host that held the client's thread off its CPU for 5 ms between two due timers delayed every token read
    meanwhile, on all four streams (one moment: the whole tail), and the probe saw at most the part after its
    next due time, often nothing. Measured on this cell under one CPU hog (/proc/thread-self/schedstat beside
    the probe): the thread once waited 5.6 ms for a CPU inside one probe interval, the probe's largest lag was
    3.2 ms, and the p99 read 5.2 ms long. Each sample is now at least the kernel's count of that wait since the
    last one (a fake here: the loop itself stays idle, so no timer runs late), so the largest lag holds the
    stall the tail rests on, and the truth allows exactly that."""
    stall = 0.005
    monkeypatch.setattr(runner, "RunQueueWait", lambda: HeldOffTheCpu(stall))

    async def probe() -> list[tuple[float, float]]:
        samples: list[tuple[float, float]] = []
        stop = asyncio.Event()
        task = asyncio.create_task(runner.loop_lag(samples, stop, interval_s=0.002))
        for _ in range(10_000):   # four samples, however late the host runs this loop
            if len(samples) >= 4:
                break
            await asyncio.sleep(0.002)
        stop.set()
        await task
        return samples

    lags = [lag for _, lag in asyncio.run(probe())]
    assert lags[1] >= stall   # the wait lands whole in the sample after it, whatever the loop's timers did
    lag_max_ms = runner._lag_max_ms(lags)
    assert lag_max_ms is not None and lag_max_ms >= 1000 * stall
    # The tail of the test above (four streams in step, two rounds), stretched by this stall once a round: the
    # p99 reads the stall long, and judged with the largest lag the client recorded, it holds.
    gap, delay = 0.0167, 0.0003
    truths: list[RequestTruth] = []
    records: list[RequestRecord] = []
    for k in range(8):
        start = (k // 4) * 1.2
        emits = [(start + i * gap, 1) for i in range(64)]
        truths.append(request(start, emits))
        reads = [t + delay + (stall if i == 30 else 0.0) for i, (t, _) in enumerate(emits)]
        records.append(RequestRecord(id=f"r{k}", prompt_tokens=100, max_tokens=64, send_t=start, chunk_t=reads,
                                     chunk_tokens=[1] * 64, end_t=reads[-1], status=200))
    true = sim_truth.latency_figures(truths, -math.inf, math.inf)
    spec = CellSpec(phase="decode", mode="fixed", context_tokens=1024, concurrency=4, max_tokens=64)
    cell = CellResult(spec=spec, phase="decode", context_tokens=1024, concurrency=4, label=spec.label,
                      status="Valid", requests=[r.to_dict() for r in records], client_lag_p99_ms=0.3,
                      client_lag_max_ms=lag_max_ms, **figures.latency_distributions(records, -math.inf, math.inf))
    judged = next(f for f in truth._latency_figures("h200 fixed", cell, true, 1.0) if f.name == "itl_p99")
    assert judged.error_ms is not None and judged.error_ms > 1000 * stall - 0.1 and judged.ok, judged


def test_the_run_queue_wait_is_the_kernels_count() -> None:
    """On Linux, this thread's /proc/thread-self/schedstat second field (nanoseconds), which never falls;
    elsewhere 0 (unknown, so the lag probe's timers alone count); closed, it reads nothing."""
    with RunQueueWait() as wait:
        first = wait.seconds()
        kernel = int(Path(SCHEDSTAT).read_text().split()[1]) / 1e9 if Path(SCHEDSTAT).exists() else 0.0
        last = wait.seconds()
        assert 0.0 <= first <= kernel <= last
    assert wait.seconds() == 0.0


def test_itl_counts_a_multi_token_emission_as_that_many_gaps() -> None:
    """An emission carrying k tokens (MTP) is k per-token gaps of a k-th of its interval, as the tool counts
    them; TTFT and TPOT by their definitions."""
    latency = sim_truth.latency_figures([request(0.0, [(1.0, 1), (1.3, 3), (1.4, 1)])], 0.0, 2.0)
    # 0.3 s carrying 3 tokens: three gaps of 0.1 s; then one of 0.1 s.
    assert latency["itl_p50"] == pytest.approx(0.1) and latency["itl_p99"] == pytest.approx(0.1)
    assert latency["ttft_p50"] == pytest.approx(1.0)
    assert latency["tpot_p50"] == pytest.approx(0.4 / 4)


def test_a_finished_requests_truth_is_written_after_its_last_tokens_went_out(tmp_path: Path) -> None:
    """Writing a finished request's truth takes milliseconds; done before the streams wrote that step's tokens,
    it delayed the very tokens it says had left (the A5000 cell's ITL p99 read 1.6 ms long in CI)."""
    config = sim_config.parse(["m", "--hardware", "h200", "--model-shape", "qwen3.5-27b-gptq-int4",
                               "--time-scale", "50"])
    path = tmp_path / "truth.jsonl"
    writer = sim_truth.Writer(path, {"time_scale": 50.0, "anchor": 0.0})
    events: list[str] = []

    def flushed() -> None:
        writer.flush()
        if '"kind":"request"' in path.read_text(encoding="utf-8"):
            events.append("truth written")

    engine = sim_engine.engine_for(config, writer)
    driver = sim.Driver(engine, sim.WallClock(50.0), sim.Log(config), after_send=flushed)

    async def stream() -> None:
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        driver.submit(sim_engine.Request(id="cmpl-1", prompt=[1] * 64, max_tokens=3, sink=queue.put_nowait), 0.0)
        running = asyncio.create_task(driver.run())
        while (produced := await queue.get()) is not None:
            events.append(f"sent {produced}")  # where the server writes the chunk
        events.append("ended")
        await asyncio.sleep(0.05)
        running.cancel()

    asyncio.run(stream())
    assert events[:4] == ["sent 1", "sent 1", "sent 1", "ended"] and "truth written" in events[4:], events
    assert [r.tokens for r in sim_truth.read(path).requests] == [3]


def test_a_time_averaged_wait_may_be_off_by_each_waits_tolerance() -> None:
    """The slack a time-averaged count of waiting requests is judged with: each overlapping wait's latency
    tolerance (1 ms or 2%) over the window, and none for an empty window."""
    # Waits of 0.5 s (inside) and 0.2 s (half inside) over a 10 s window: 2% of each, the 1 ms floor below that.
    waits = [request(1.0, [(1.5, 1)]), request(9.9, [(10.1, 1)]), request(12.0, [(12.1, 1)])]
    assert truth._waiting_slack(waits, 0.0, 10.0) == pytest.approx((0.010 + 0.004) / 10.0)
    assert truth._waiting_slack(waits, 5.0, 5.0) is None


def test_tolerances() -> None:
    """Rates and counts within 1%, latencies within 1 ms or 2% (whichever is larger), undefined agreeing only
    with undefined."""
    assert truth.Figure("c", "total_tok_s", "rate", 100.9, 100.0).ok
    assert not truth.Figure("c", "total_tok_s", "rate", 101.1, 100.0).ok
    assert truth.Figure("c", "ttft", "latency", 0.0109, 0.010).ok          # 0.9 ms: within 1 ms
    assert not truth.Figure("c", "ttft", "latency", 0.0111, 0.010).ok
    assert truth.Figure("c", "e2e", "latency", 2.039, 2.0).ok              # 39 ms of 2 s: within 2%
    assert not truth.Figure("c", "e2e", "latency", 2.041, 2.0).ok
    assert truth.Figure("c", "per_request_tok_s", "rate", None, None).ok   # undefined on both sides agrees
    assert not truth.Figure("c", "per_request_tok_s", "rate", None, 5.0).ok
    assert not truth.Figure("c", "completed", "count", 1.0, 0.0).ok


def test_above_twice_real_time_latencies_are_reported_not_judged() -> None:
    """Above time scale 2 a latency out of tolerance is reported, not judged (the client's own fraction of a
    millisecond is several simulated ones); at 1x it fails the report."""
    late = truth.Figure("c", "ttft", "latency", 0.020, 0.010)
    rate = truth.Figure("c", "total_tok_s", "rate", 100.0, 100.0)
    fast = truth.Report(figures=[late, rate], delivery_ms=[2.0], time_scale=5.0, behind_s=0.0)
    assert fast.ok and "latencies not judged above time scale 2" in "\n".join(truth.lines(fast))
    assert not truth.Report(figures=[late, rate], delivery_ms=[0.2], time_scale=1.0, behind_s=0.0).ok


def test_simulator_config_faults_and_versions() -> None:
    """The simulator's options: faults parsed (and a bad one refused with exit 2), and version styles compared
    as versions, not strings."""
    base = ["m", "--hardware", "h200", "--model-shape", "qwen3.5-27b-gptq-int4"]
    config = sim_config.parse([*base, "--fault", "crash-after:3", "--fault", "foreign:50", "--version-style", "0.9"])
    assert config.faults.crash_after == 3 and config.faults.foreign_tok_s == 50
    # As strings, "0.9" >= "0.32" and "0.9" >= "0.29": the clamp and the log prefixes came with 0.32 and 0.29.
    assert not config.clamps_max_tokens and not config.process_prefixes
    assert sim_config.parse([*base, "--version-style", "0.33.0"]).clamps_max_tokens
    with pytest.raises(SystemExit) as exc:
        sim_config.parse([*base, "--fault", "crash-after"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        sim_config.parse([*base, "--fault", "melt"])


def test_a_truth_file_is_never_overwritten(tmp_path: Path) -> None:
    """--truth DIR gets a file per process; an existing file is refused (exit 2), never overwritten."""
    base = ["m", "--hardware", "a5000x2", "--model-shape", "qwen-27b-hybrid", "--truth"]
    assert sim_config.parse([*base, str(tmp_path)]).truth == tmp_path / f"truth-{os.getpid()}.jsonl"
    (tmp_path / "old.jsonl").write_text("")
    with pytest.raises(SystemExit) as exc:
        sim_config.parse([*base, str(tmp_path / "old.jsonl")])
    assert exc.value.code == 2
