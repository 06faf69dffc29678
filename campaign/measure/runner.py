"""Measure one cell against a running server, with the study's hygiene.

Every step is bracketed by the server's cumulative counters. With ignore_eos and min_tokens = max_tokens our
own output is known exactly (requests straddling the window are drained, not aborted, so their tokens are
counted too), so any excess is foreign traffic: the step is discarded and rerun with fresh prompts, and after
`max_attempts` the cell is Contaminated. A step designed to share nothing must see zero prefix-cache hits.

Long (about 1,050 lines): the Measurer runs every kind of cell (prefill, sustained and fixed decode, rate)
with the same bracketing, contamination checks, retries and (open-loop steps) the prefix cache emptied first;
its steps share the target's state and one client, so they are one class.
"""

from __future__ import annotations

import asyncio
import gc
import random
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from campaign.core import clock, stats
from campaign.core.errors import MetricMissingError
from campaign.core.runqueue import RunQueueWait
from campaign.http.client import RequestRecord, new_client, stream_completion
from campaign.http.endpoint import Endpoint
from campaign.http.streams import Streams
from campaign.http.tokenizer import ServerTokenizer
from campaign.measure import cachestate, openloop, shard, slo, steady, traces
from campaign.measure.cells import (
    CAVEATS,
    STALL_SHARE,
    TTFT_MODE_TEXT,
    Attempt,
    CellResult,
    CellSpec,
    Finding,
    Reason,
    StepEvidence,
    client_ttft_finding,
    findings_fields,
    longest_request,
    over_capacity,
    queue_note,
    result_base,
    spec_random_prompts,
    template_hits,
    verdict,
)
from campaign.measure.figures import (
    behind_schedule,
    fell_behind,
    fixed_metrics,
    hardware_units,
    prefill_metrics,
    rate_metrics,
    request_latencies,
    stall_error,
    window_metrics,
)
from campaign.measure.prompts import Prompt, Prompts, PromptSource, SessionTurns
from campaign.server import metrics as m
from campaign.server.gpu import StepMonitor, StepTelemetry
from campaign.server.startup_log import StartupFacts

SETTLE_S = 3.0  # how long the counters may lag the last streamed chunk
MAX_ROUNDS = 1000  # a fixed-mode cell's rounds, whatever its minimums ask
# Findings that say the client offered less than asked, or stamped late what it got, because its own host
# stalled it, the one that moves the load most first: in a sustained window every pause between a stream's reply
# and its next request is the client's, and every token that arrived while its loop stood still was stamped
# late; on a schedule, every late send.
CLIENT_STALLS = (Reason.FEWER_ACTIVE, Reason.SCHEDULE_BEHIND, Reason.CLIENT_STALLED)
# Every host stall an attempt is measured again for: the client's, and a time-scaled simulator's that fell
# behind its clock (its host starved it: its steps ran late, and the reading is not its hardware's).
HOST_STALLS = (*CLIENT_STALLS, Reason.SIM_BEHIND)
WARMUP_PREFILLS = 3  # the warm-up sends the longest prompt this many times
# Rendering /metrics blocks vLLM's API server (the process that streams every token) for a noticeable time,
# so sampling the queue gauges during a window perturbs what is measured: on the 2-core CPU build, scraping
# every 0.5 s turned smooth 2-3 ms token gaps into 130 ms bursts. Sample sparsely, inside the window only.
SAMPLE_EVERY_S = 5.0
SIMULATED_NOTE = ("measured in simulated time: this method against the simulator serving from this process on its "
                  "own clock (measure.simulated), no client stall and no wall clock")


@dataclass(kw_only=True)
class Target:
    """A running server and what is known of it (from the startup log or from /metrics)."""

    endpoint: Endpoint
    model: str
    kv_cache_tokens: int | None = None
    block_size: int | None = None
    max_model_len: int | None = None
    server_version: str | None = None
    # The scheduler cap, when the launch passed it (vLLM logs it only then) or a probed server told it (or its
    # option said it): exact, unlike a sampled gauge.
    max_num_seqs: int | None = None
    # The chunk (prompt tokens plus decodes per engine step): tells replacements queueing for it from the rest.
    max_num_batched_tokens: int | None = None
    num_speculative_tokens: int | None = None   # draft tokens per step: each decode takes 1 + this from the chunk
    # Simulated seconds per wall second (the simulator says so in /metrics; 1 for a real server): open-loop
    # schedules and service levels are in the hardware's seconds, and converted with it.
    time_scale: float = 1.0
    # Whether this tool launched the server: only then is its prefix cache reset before an open-loop step (a
    # probed server's cache is its other users').
    launched: bool = False

    @classmethod
    def launched_as(cls, endpoint: Endpoint, model: str, facts: StartupFacts, *, max_num_seqs: int | None,
                    max_num_batched_tokens: int | None) -> Target:
        """A server this tool launched, as its startup log told it; the chunk from the log, else as launched."""
        return cls(endpoint=endpoint, model=model, kv_cache_tokens=facts.kv_cache_tokens,
                   block_size=facts.block_size, max_model_len=facts.max_model_len,
                   server_version=facts.vllm_version, max_num_seqs=max_num_seqs,
                   max_num_batched_tokens=facts.max_num_batched_tokens or max_num_batched_tokens,
                   num_speculative_tokens=facts.num_speculative_tokens, launched=True)

    @property
    def base_url(self) -> str:
        return self.endpoint.root

    def wall_s(self, seconds: float) -> float:
        """A matrix's seconds (a window, a warm-up, a minimum) are the hardware's: against a simulator running
        `time_scale` times faster they pass in that much less wall time, so a time-scaled cell lives the same
        simulated span as the real one (a 30 s window at 5x is 6 wall seconds, not 150 simulated ones)."""
        return seconds / self.time_scale

    def wall_endpoint(self) -> Endpoint:
        """The endpoint with its reply timeouts in wall seconds (see Timeouts.at_speed)."""
        return replace(self.endpoint, timeouts=self.endpoint.timeouts.at_speed(self.time_scale))


@dataclass(frozen=True)
class _Gauges:
    """One sample of the server's queue gauges."""

    t: float
    running: float
    waiting: float
    kv_usage: float | None
    sim_clock: tuple[float, float] | None = None   # the simulator's (busy, behind) seconds; None elsewhere


@dataclass
class _Step:
    records: list[RequestRecord]
    priming: list[RequestRecord]   # warm TTFT: the one-token requests that cached each stream's prompt
    window: tuple[float, float] | None
    running: list[float]
    waiting: list[float]
    kv_usage: list[float | None]   # aligned with running and waiting; None where the gauge is not exported
    cpu: float | None          # the busiest client event loop thread's share of one core
    processes: int = 1
    sim_clock: list[tuple[float, float]] = field(default_factory=list)  # in-window (busy, behind) samples
    load: _Load | None = None      # a rate cell's schedule
    telemetry: StepTelemetry | None = None
    lag: list[float] = field(default_factory=list)   # the controller's event-loop lateness, seconds
    cache: cachestate.CacheState | None = None     # a rate cell's prefix cache when its step began
    queue: list[tuple[float, float]] = field(default_factory=list)   # (sample time, waiting), as `waiting`
    stalls: list[tuple[float, float]] = field(default_factory=list)  # the loop probe's (when, lag), the whole step


@dataclass(frozen=True)
class _Load:
    """How a rate cell's requests were scheduled: its start (on the measuring clock), the span its arrivals were drawn
    over and the requests they held (hardware seconds; None for a closed loop), and whether it stopped early."""

    start: float
    span_s: float
    planned: int | None
    early_stopped: bool
    ramp: frozenset[str] = frozenset()   # a closed loop's first wave (request ids): not judged
    implied_hits: int | None = None      # a trace's reusable prompt tokens (traces.implied_hits)


SIM_BEHIND_NOTE = 0.01   # a simulator behind its clock for over 1% of a cell says so in the cell's notes
RATE_SAMPLES = 20         # a long rate cell's queue gauge, sampled this many times over its schedule
LAG_EVERY_S = 0.005      # the controller's event-loop lag probe wakes this often (a few hundred cheap wake-ups)
TIMER_RESOLUTION_S = 0.001  # event-loop timers fire up to this late on an idle loop: not the client's noise


async def loop_lag(samples: list[tuple[float, float]], stop: asyncio.Event, interval_s: float = LAG_EVERY_S) -> None:
    """How long this process's event loop takes to run a callback that is ready: (when, seconds) every
    `interval_s`. A token's arrival is stamped by a callback waiting in the same queue, so this delay is the
    client's own timing noise: a busy client, or a host that lends its cores elsewhere, shows here and nowhere
    in the server's counters. Timers are rounded to the millisecond (uvloop, and asyncio's epoll timeouts), so a
    timer's lateness counts only beyond that (a loop blocked outright shows there), and a ready callback's wait
    (a queue of other callbacks ahead of it) is added. A sample is at least the time the loop's thread waited
    for a CPU since the last one (the kernel's count, core/runqueue): a host that held the thread off its cores
    between two due timers delayed every token that arrived meanwhile, and no timer saw it."""
    loop = asyncio.get_running_loop()
    with RunQueueWait() as waited:
        before = waited.seconds()
        while not stop.is_set():
            due = clock.now() + interval_s
            await asyncio.sleep(interval_s)
            woke = clock.now()
            ready = loop.create_future()
            loop.call_soon(ready.set_result, None)
            await ready
            now, after = clock.now(), waited.seconds()
            samples.append((now, max(max(0.0, woke - due - TIMER_RESOLUTION_S) + (now - woke), after - before)))
            before = after


def sim_behind_share(window: list[tuple[float, float]], delta: m.Delta) -> float | None:
    """The share of simulated time the simulator fell behind: between the first and last sample inside a
    window where there are two, else over the whole step; None against a real server."""
    if len(window) >= 2:
        busy, behind = window[-1][0] - window[0][0], window[-1][1] - window[0][1]
    else:
        busy_delta, behind_delta = delta.optional(m.SIM_BUSY), delta.optional(m.SIM_BEHIND)
        if busy_delta is None or behind_delta is None:
            return None
        busy, behind = busy_delta, behind_delta
    return behind / (busy + behind) if busy + behind > 0 else None


def server_view(delta: m.Delta, records: list[RequestRecord], scale: float) -> dict[str, Any]:
    """The server's own mean TTFT and inter-token gap over the step (vLLM's histograms between its scrapes, in
    the server's seconds: the hardware's, a simulator's included) and the client's mean TTFT over the same
    requests, converted to the hardware's time; empty where the server exports no TTFT histogram."""
    ttft = m.histogram_mean(delta, m.TTFT_HISTOGRAM)
    if ttft is None:
        return {}
    itl = m.histogram_mean(delta, m.ITL_HISTOGRAM)
    queue = m.histogram_mean(delta, m.QUEUE_HISTOGRAM)
    firsts = [r.ttft_s for r in records if r.ttft_s is not None]
    client = stats.mean(firsts)
    return {"server_first_tokens": ttft[0], "server_ttft_mean_ms": None if ttft[1] is None else ttft[1] * 1000,
            "server_itl_mean_ms": None if itl is None or itl[1] is None else itl[1] * 1000,
            "server_queue_mean_ms": None if queue is None or queue[1] is None else queue[1] * 1000,
            "client_ttft_mean_ms": None if client is None else client * 1000 * scale}


def _stalled(attempt: Attempt, stall: tuple[str, Reason]) -> Attempt:
    """The attempt discarded for its client's stall, or its simulator's."""
    whose = "the simulator's" if stall[1] is Reason.SIM_BEHIND else "the client's"
    return attempt.model_copy(update={"accepted": False, "code": stall[1],
                                      "reason": f"{whose} host stalled it: {stall[0]}"})


def _cleanest(stalled: list[tuple[int, CellResult, tuple[str, Reason]]], attempts: list[Attempt]) -> CellResult:
    """The result a cell stands on when its client's host stalled every attempt: a Valid one (the stall only a
    caveat: client_stalled) before an Invalid one (its load not kept), then the one whose stalls could move its
    figures least, then the latest; every other attempt discarded, saying why."""
    best = min(range(len(stalled)), key=lambda k: (stalled[k][1].status != "Valid",
                                                   max(stalled[k][1].client_stall_bound or 0.0,
                                                       stalled[k][1].sim_behind_share or 0.0), -k))
    final = list(attempts)
    for k, (index, _, stall) in enumerate(stalled):
        final[index] = (attempts[index].model_copy(update={"accepted": True, "code": None, "reason": None})
                        if k == best else _stalled(attempts[index], stall))
    discarded = [a for a in final if not a.accepted]
    return stalled[best][1].model_copy(update={"attempts": final, "discarded_steps": len(discarded),
                                               "discarded_tokens": sum(a.excess_tokens for a in discarded)})


@dataclass(frozen=True)
class _Queue:
    """A rate cell's queue over its schedule, from the server's waiting gauge (figures.fell_behind)."""

    waiting_max: float | None = None
    avg_waiting: float | None = None
    fell_behind_s: float | None = None     # the hardware's seconds from the schedule's start
    waiting_at_end: float | None = None
    finding: Finding | None = None         # the caveat, where it fell behind


def _queue(samples: list[tuple[float, float]], load: _Load, scale: float, queue_mean_ms: float | None) -> _Queue:
    """What the server's own gauge says of a rate cell's queue while its schedule ran: its longest and mean
    queue, and whether and from when it fell behind the arrivals, as a caveat naming the server's figures
    (the client's timeouts are not the finding: a queue the server works through is waited for)."""
    end = load.start + load.span_s / scale
    inside = [w for t, w in samples if load.start <= t <= end]
    if not inside:
        return _Queue()
    behind = fell_behind(samples, load.start, end)
    if behind is None:
        return _Queue(waiting_max=max(inside), avg_waiting=stats.mean(inside))
    began, longest, last = behind
    since = (began - load.start) * scale
    waited = (f", and the requests it seated waited {queue_mean_ms / 1000:.1f} s on average for a seat (its "
              "queue-time histogram)") if queue_mean_ms is not None else ""
    return _Queue(waiting_max=max(inside), avg_waiting=stats.mean(inside), fell_behind_s=since, waiting_at_end=last,
                  finding=Finding(Reason.SERVER_FELL_BEHIND, (
                      f"the server fell behind the arrivals {since:.1f} s into the {load.span_s:.0f} s schedule: "
                      f"its queue grew from then on, to {longest:.0f} requests waiting (its gauge), {last:.0f} "
                      f"still waiting when the schedule ended{waited}; the latencies are a growing queue's, not a "
                      "rate it holds")))


def _lag_ms(lags: list[float]) -> float | None:
    p99 = stats.percentile(lags, 99)
    return None if p99 is None else 1000.0 * p99


def _lag_max_ms(lags: list[float]) -> float | None:
    return 1000.0 * max(lags) if lags else None


async def scrape(target: Target, client: httpx.AsyncClient, *,
                 only: frozenset[str] | None = None) -> m.MetricsSnapshot:
    """The server's /metrics, parsed (a connection refused or reset is tried again for 10 s: a scrape is never
    a measured request); with `only`, just those samples (the server answers in full: vLLM 0.32's /metrics
    ignores prometheus_client's `?name[]=` query, checked on the real CPU build). A server in this process
    (the simulator in simulated time) hands its samples over without the text: the same samples, the same
    snapshot (tests/test_in_process.py)."""
    direct = target.endpoint.in_process
    if direct is not None:
        return m.snapshot(direct.samples(only), server_version=target.server_version)
    async for attempt in AsyncRetrying(
        retry=retry_if_exception_type(httpx.TransportError), stop=stop_after_delay(10),
        wait=wait_exponential(multiplier=0.1, max=1.0), reraise=True,
    ):
        with attempt:
            response = await client.get("/metrics")
            response.raise_for_status()
            return m.parse(response.text, server_version=target.server_version, only=only)
    raise AssertionError("unreachable")


class Measurer:
    def __init__(
        self,
        target: Target,
        *,
        max_attempts: int = 3,
        prompts: PromptSource | None = None,
        on_event: Callable[[str], None] | None = None,
        client_processes: int | None = None,
        gpu_monitor: StepMonitor | None = None,
    ) -> None:
        self.target = target
        # Sustained cells beyond one core's streams run on several client processes (None: shard's auto rule).
        self.client_processes = client_processes
        # GPU telemetry around each step (None: no GPU, or not asked for): throttling and energy per token.
        self.gpu_monitor = gpu_monitor
        self.max_attempts = max_attempts
        self._prompts = prompts
        # Text and chat prompt sources, made on first use (the corpus tokenized once by the server).
        self._sources: dict[tuple[str, str], Prompts] = {}
        self.on_event = on_event or (lambda _msg: None)
        self._ids = 0
        self._checked_metrics = False
        self._reset_available: bool | None = None   # whether the server exposes /reset_prefix_cache

    @property
    def prompts(self) -> PromptSource:
        """The random ids of every cell, made at their first use: inside the loop that measures, whose context
        says where a new source's salt comes from (measure.prompts.salted_by)."""
        if self._prompts is None:
            self._prompts = PromptSource()
        return self._prompts

    # --- control plane -----------------------------------------------------------------------------------
    async def scrape(self, client: httpx.AsyncClient, *, only: frozenset[str] | None = None) -> m.MetricsSnapshot:
        return await scrape(self.target, client, only=only)

    async def check_metrics(self, control: httpx.AsyncClient) -> None:
        """Before measuring: every family the run relies on must exist; a missing one is an error, not 0."""
        snapshot = await self.scrape(control)
        snapshot.require(m.MEASUREMENT_METRICS)
        if snapshot.has(m.SIM_TIME_SCALE):
            self.target.time_scale = snapshot.value(m.SIM_TIME_SCALE)
        info = snapshot.info(m.CACHE_CONFIG_INFO)
        if info is not None:
            if self.target.kv_cache_tokens is None and info.get("kv_cache_size_tokens", "None") != "None":
                self.target.kv_cache_tokens = int(float(info["kv_cache_size_tokens"]))
            if self.target.block_size is None and info.get("block_size", "None") != "None":
                self.target.block_size = int(float(info["block_size"]))
        self._checked_metrics = True

    async def warm_up(self, specs: list[CellSpec], *, reply_tokens: int = 16) -> dict[str, Any]:
        """Before a launch's first measured cell, the shapes its cells will use, so first-use work (kernels
        compiled or tuned for new shapes, allocator growth, the first long chunked prefill) lands here, not in
        a cell: the longest prompt the cells send, then one short round at each decode concurrency. Never
        measured, never bracketed; what it did is returned for the launch record."""
        if not self._checked_metrics:  # the time scale first: the warm-up's timeouts depend on it
            try:
                async with self.target.endpoint.async_control() as control:
                    await self.check_metrics(control)
            except httpx.HTTPError:
                pass  # a server gone already: the first cell finds out, where a dead server is handled
        began = clock.now()
        records: list[RequestRecord] = []
        window = self.target.max_model_len
        contexts = sorted({s.context_tokens for s in specs if window is None or s.context_tokens < window})
        concurrencies = sorted({s.concurrency for s in specs if s.phase == "decode"})
        short = min([256, *contexts])
        async with new_client(self.target.wall_endpoint()) as client:
            # The longest prompt more than once: on the real CPU build the first two long prefills of a fresh
            # server both ran slow (make bench-cold), and the guard caught cells after a single one.
            for _ in range(WARMUP_PREFILLS if contexts else 0):
                records.append(await self._one(client, contexts[-1], 1))
            for concurrency in concurrencies:
                records += await asyncio.gather(*(self._one(client, short, reply_tokens) for _ in range(concurrency)))
        failed = [r for r in records if not r.ok]
        return {"kind": "warmup", "requests": len(records), "seconds": clock.now() - began,
                "longest_prompt_tokens": contexts[-1] if contexts else None, "concurrencies": concurrencies,
                "errors": len(failed), "first_error": failed[0].error if failed else None}

    def _next_id(self) -> str:
        self._ids += 1
        return f"r{self._ids}"

    # --- one cell ----------------------------------------------------------------------------------------
    async def run_cell(self, spec: CellSpec) -> CellResult:
        base = result_base(spec)
        max_tokens: int = base["max_tokens"]
        if spec.phase == "decode" and over_capacity(
            context_tokens=spec.context_tokens, output_tokens=max_tokens, concurrency=spec.concurrency,
            kv_cache_tokens=self.target.kv_cache_tokens, block_size=self.target.block_size,
        ):
            return CellResult(**base, status="Over capacity", **findings_fields([Finding(
                Reason.OVER_CAPACITY, f"not run: {spec.concurrency} x ({spec.context_tokens:,} + {max_tokens:,}) "
                f"tokens exceed the server's KV cache of {self.target.kv_cache_tokens:,} tokens")]))
        longest, longest_reply = longest_request(spec)
        if self.target.max_model_len is not None and longest + longest_reply > self.target.max_model_len:
            return CellResult(**base, status="Invalid", **findings_fields([Finding(
                Reason.OVER_WINDOW, f"not run: prompt {longest:,} + reply {longest_reply:,} tokens exceed "
                f"max_model_len {self.target.max_model_len:,}")]))

        async with self.target.endpoint.async_control() as control:
            if not self._checked_metrics:
                await self.check_metrics(control)  # the time scale first: the client's timeouts depend on it
            async with new_client(self.target.wall_endpoint()) as client:
                return await self._attempts(spec, base, max_tokens, client, control)

    async def _attempts(self, spec: CellSpec, base: dict[str, Any], max_tokens: int, client: Streams,
                        control: httpx.AsyncClient) -> CellResult:
        """Measure the cell until an attempt's bracket shows no foreign traffic and the client kept its load (on
        a schedule, its times; in a sustained window, every stream busy), at most max_attempts times. A client
        its host stalled offered another load than the one asked for: that attempt is discarded, saying so, as
        foreign traffic's is; the last one stands as measured (Invalid, with why). A step with any other finding
        (failed requests, a queue, a clamp) stands at once: that finding would come back on every attempt."""
        attempts: list[Attempt] = []
        stalled: list[tuple[int, CellResult, tuple[str, Reason]]] = []   # (attempt's index, result, the stall)
        source = self._source(spec, control)
        if source is not None:
            await source.prepare(spec.context_tokens)
        for number in range(1, self.max_attempts + 1):
            cache = await self.empty_prefix_cache(client, control) if spec.phase == "rate" else None
            before = await self.scrape(control)
            step = await self._run_step(spec, max_tokens, client, control, source)
            step.cache = cache
            after, attempt = await self.bracket(control, before, step.records + step.priming)
            attempts.append(attempt)
            if attempt.accepted:
                result = self._result(base, spec, step, m.Delta(before, after), attempts)
                # The stall that moved the load most names the attempt (HOST_STALLS' order): streams left
                # idle, then sends late, then stamps late (a loaded host adds the last to any of them).
                found = dict(zip(result.reason_codes, result.reasons, strict=True))
                stall = next(((found[c], c) for c in HOST_STALLS if c in found), None)
                # Only a stall alone: a finding that would come back on every attempt (errors, a queue, a
                # clamp) stands at once, never measured three times over.
                others = set(result.reason_codes) - set(HOST_STALLS) - CAVEATS
                if stall is None or others:
                    return result
                stalled.append((len(attempts) - 1, result, stall))
                if number == self.max_attempts:
                    return _cleanest(stalled, attempts)
                attempts[-1] = _stalled(attempt, stall)
            self.on_event(f"{spec.key}: attempt {number} discarded ({attempts[-1].reason}); "
                          "rerunning with fresh prompts")
        discarded = [a for a in attempts if not a.accepted]
        return CellResult(
            **base, status="Contaminated", attempts=attempts, discarded_steps=len(discarded),
            discarded_tokens=sum(a.excess_tokens for a in discarded),
            **findings_fields([Finding(Reason.CONTAMINATED, f"foreign traffic in all {len(attempts)} attempts "
                                       f"({', '.join(str(a.excess_tokens) for a in discarded)} extra tokens)")]),
        )

    async def bracket(self, control: httpx.AsyncClient, before: m.MetricsSnapshot,
                       records: list[RequestRecord]) -> tuple[m.MetricsSnapshot, Attempt]:
        expected_gen = sum(r.completion_tokens for r in records)
        # The server's own count of each of our prompts where it said it (a chat prompt's template included).
        expected_prompt = sum(r.counted_prompt_tokens for r in records if r.status == 200)
        # A request of ours that failed after it was sent (timed out waiting in an overloaded queue, cut off)
        # may have been counted in full or in part: up to its prompt and its max_tokens are ours, not foreign.
        ours_prompt = expected_prompt + sum(r.prompt_tokens for r in records if r.status != 200)
        ours_gen = expected_gen + sum(max(0, r.max_tokens - r.completion_tokens) for r in records if not r.ok)
        after = await self.settled(control, before, generation=expected_gen, prompt=expected_prompt)
        delta = m.Delta(before, after)
        gen, prompt = delta(m.GENERATION_TOKENS), delta(m.PROMPT_TOKENS)
        excess = int(round(max(0.0, gen - ours_gen) + max(0.0, prompt - ours_prompt)))
        reason = None
        if excess > 0:
            reason = (f"server counted {gen:.0f} generated / {prompt:.0f} prompt tokens, ours were "
                      f"{expected_gen} / {expected_prompt}: {excess} foreign tokens")
        return after, Attempt(
            accepted=excess == 0, reason=reason, code=Reason.CONTAMINATED if excess else None,
            expected_generation_tokens=expected_gen,
            counted_generation_tokens=gen, expected_prompt_tokens=expected_prompt,
            counted_prompt_tokens=prompt, excess_tokens=excess,
        )

    async def settled(self, control: httpx.AsyncClient, before: m.MetricsSnapshot, *, generation: int = 0,
                      prompt: int = 0) -> m.MetricsSnapshot:
        """The counters once they have counted at least these tokens since `before`, or after SETTLE_S (they lag
        the last streamed chunk)."""
        deadline = clock.now() + SETTLE_S
        while True:
            after = await self.scrape(control)
            delta = m.Delta(before, after)
            if (delta(m.GENERATION_TOKENS) >= generation and delta(m.PROMPT_TOKENS) >= prompt) or (
                    clock.now() > deadline):
                return after
            await asyncio.sleep(0.1)

    async def empty_prefix_cache(self, client: Streams, control: httpx.AsyncClient) -> cachestate.CacheState:
        """Before an open-loop step: the prefix cache emptied and checked with a canary of whole KV blocks, whose
        hits are read from the server's counters once they have counted its prompt (see cachestate)."""
        if not self.target.launched:
            return cachestate.CacheState(method="unique-prompts", why_not_reset=cachestate.NOT_LAUNCHED)
        tokens = cachestate.CANARY_BLOCKS * (self.target.block_size or 16) + 1
        if self.target.max_model_len is not None:
            tokens = min(tokens, self.target.max_model_len - 1)
        ids = self.prompts.unique(tokens)

        async def canary() -> float | None:
            before = await self.scrape(control)
            record = await self._one(client, tokens, 1, prompt=Prompt(tokens=tokens, ids=ids))
            if not record.ok:
                return None   # nothing to check with: the state says so
            return m.Delta(before, await self.settled(control, before, prompt=tokens)).optional(m.PREFIX_HITS)

        state = await cachestate.bring_to_empty(control, canary, tokens=tokens, available=self._reset_available)
        # Absent is asked once a launch; a reset that failed to connect is asked again next time.
        self._reset_available = True if state.method == "reset" else (
            False if state.endpoint_status in cachestate.ABSENT or state.why_not_reset == cachestate.NOT_SERVED
            else None)
        return state

    async def _sampler(self, control: httpx.AsyncClient, samples: list[_Gauges], window_open: asyncio.Event,
                       stop: asyncio.Event, interval_s: float) -> None:
        """Running/waiting (and KV-usage, where exported) gauges: first at half an interval into the window,
        then every interval, each stamped with the midpoint of its scrape on the window's clock."""
        await window_open.wait()
        delay = interval_s / 2
        while True:
            try:
                await asyncio.wait_for(stop.wait(), delay)
                return
            except TimeoutError:
                pass
            try:
                before = clock.now()
                snap = await self.scrape(control, only=m.GAUGES)
                samples.append(_Gauges(t=(before + clock.now()) / 2, running=snap.value(m.RUNNING),
                                       waiting=snap.value(m.WAITING),
                                       kv_usage=snap.value(m.KV_USAGE) if snap.has(m.KV_USAGE) else None,
                                       sim_clock=(snap.value(m.SIM_BUSY), snap.value(m.SIM_BEHIND))
                                       if snap.has(m.SIM_BEHIND) else None))
            except (httpx.HTTPError, MetricMissingError):
                pass  # a missed sample is a missing sample, never a zero
            delay = interval_s

    def _source(self, spec: CellSpec, control: httpx.AsyncClient) -> Prompts | None:
        """The cell's text or chat prompts (None: random ids on /v1/completions, the PromptSource as ever).
        A source made earlier keeps its tokenized corpus; it talks to the server through this cell's client."""
        if spec.prompts == "random" and spec.endpoint == "completions":
            return None
        tokenizer = ServerTokenizer(control, self.target.model)
        source = self._sources.get((spec.prompts, spec.endpoint))
        if source is None:
            source = Prompts(spec.prompts, spec.endpoint, tokenizer=tokenizer)
            self._sources[(spec.prompts, spec.endpoint)] = source
        source.use(tokenizer)
        return source

    async def _run_step(self, spec: CellSpec, max_tokens: int, client: Streams,
                        control: httpx.AsyncClient, source: Prompts | None = None) -> _Step:
        records: list[RequestRecord] = []
        samples: list[_Gauges] = []
        window_open = asyncio.Event()
        stop_sampling = asyncio.Event()
        wall = self.target.wall_s
        # Every interval of the hardware's time, so a time-scaled cell's verdict rests on as many samples.
        # A rate cell's queue is sampled through its schedule, where its server may fall behind the arrivals: as
        # sparsely as a window's, and at most RATE_SAMPLES times.
        interval = wall(max(SAMPLE_EVERY_S, spec.duration_s / RATE_SAMPLES) if spec.phase == "rate" else
                        min(SAMPLE_EVERY_S, spec.window_s / 2) if spec.mode == "sustained" else SAMPLE_EVERY_S)
        sampler = asyncio.create_task(self._sampler(control, samples, window_open, stop_sampling, interval))
        # On a simulated clock the client's stamps are exact: its lag is zero, and a probe waking every few
        # milliseconds would only cost the host time.
        simulated = clock.simulated()
        lags: list[tuple[float, float]] = []
        lag_probe = None if simulated else asyncio.create_task(loop_lag(lags, stop_sampling))
        lag_applies = True
        # The event loop's own thread: a process's CPU counts other threads (NVML sampling, name lookups), and
        # /proc's times come in 10 ms ticks, so a 0.1 s prefill step read as 101% of a core.
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        if self.gpu_monitor is not None:
            self.gpu_monitor.start()
        telemetry: StepTelemetry | None = None
        load: _Load | None = None
        priming: list[RequestRecord] = []
        window: tuple[float, float] | None = None
        processes = 1
        worker_cpu: list[float] = []
        # No cyclic garbage collection while a step is timed (timeit does the same, for the same reason): a
        # full collection walks every live object, and a controller holding a capacity search's thousands of
        # request records paused for about 2 ms at a time, which `make truth` caught as the next launch's ITL
        # p99 reading 1.1-1.7 ms high against the truth (0.01 ms without them). Collected after the step.
        collecting = gc.isenabled()
        gc.disable()
        try:
            warm = spec.phase == "decode" and spec.ttft == "warm"
            streams = 1 if spec.phase == "prefill" else spec.concurrency
            prompts = [await self._prompt(spec.context_tokens, source) for _ in range(streams)] if warm else None
            if prompts is not None:
                # Seed 004's method: cache every stream's prompt with a one-token request, then reuse it.
                priming = list(await asyncio.gather(*(self._one(client, spec.context_tokens, 1, prompt=p)
                                                      for p in prompts)))
            if spec.phase == "rate":
                window_open.set()
                load = await self._rate(spec, client, records, source)
            elif spec.phase == "prefill" or spec.mode == "fixed":
                if spec.phase == "decode":
                    window_open.set()
                began = clock.now()
                for _ in range(MAX_ROUNDS):
                    records += await asyncio.gather(*(
                        self._one(client, spec.context_tokens, max_tokens,
                                  prompt=prompts[i] if prompts else None, source=source)
                        for i in range(streams)))
                    if spec.phase == "prefill" or any(not r.ok for r in records):
                        break
                    if len(records) >= spec.min_requests and clock.now() - began >= wall(spec.min_seconds):
                        break
            else:
                # The worker processes draw fresh random prompts; a warm-TTFT cell keeps its cached prompts, and a
                # text or chat cell its server-tokenized corpus, in one process.
                # In simulated time one loop holds the clock: no other process can stamp on it.
                processes = 1 if prompts or source or simulated else shard.client_processes(
                    spec.concurrency, self.client_processes)
                if processes > 1:
                    self._ids += 1
                    sharded = await shard.sustained_sharded(
                        self.target.wall_endpoint(), model=self.target.model, context_tokens=spec.context_tokens,
                        max_tokens=max_tokens, concurrency=spec.concurrency, processes=processes,
                        warmup_s=wall(spec.warmup_s), window_s=wall(spec.window_s), window_open=window_open,
                        id_prefix=f"s{self._ids}")
                    records.extend(sharded.records)
                    window, worker_cpu = sharded.window, sharded.cpu
                    lag_applies = False  # the workers stamp the tokens; this loop's lag says nothing of them
                else:
                    window = await self._sustained(spec, max_tokens, client, records, window_open, prompts, source)
        finally:
            stop_sampling.set()
            window_open.set()  # a step that never opened its window (prefill, a failure) ends the sampler too
            await sampler
            if lag_probe is not None:
                await lag_probe
            if self.gpu_monitor is not None:
                telemetry = self.gpu_monitor.stop()
            if collecting:
                gc.enable()
        # On a simulated clock the client's work costs no measured time, so its share of a core measures nothing.
        cpu = None if simulated else max(
            [(time.thread_time() - cpu0) / max(1e-9, time.perf_counter() - wall0), *worker_cpu])
        stalls = list(lags)   # a stall just past a window's end may carry its tokens out of it
        if window is not None:
            # The drain after a sustained window runs fewer than C: its samples say nothing of the window.
            samples = [g for g in samples if window[0] <= g.t <= window[1]]
            lags = [lag for lag in lags if window[0] <= lag[0] <= window[1]]
        return _Step(records=records, priming=priming, window=window, running=[g.running for g in samples],
                     waiting=[g.waiting for g in samples],
                     kv_usage=[g.kv_usage for g in samples], cpu=cpu,
                     processes=processes, telemetry=telemetry,
                     sim_clock=[g.sim_clock for g in samples if g.sim_clock is not None],
                     queue=[(g.t, g.waiting) for g in samples], stalls=stalls if lag_applies else [],
                     lag=[0.0] if simulated else [lag for _, lag in lags] if lag_applies else [], load=load)

    def _template_hits(self, spec: CellSpec, requests: int) -> float:
        """Cache hits a chat step may get from its template's fixed opening (whole blocks of it per request)."""
        source = self._sources.get((spec.prompts, spec.endpoint))
        return template_hits(requests, source.template_prefix if source is not None else 0, self.target.block_size)

    async def _prompt(self, context: int, source: Prompts | None) -> Prompt:
        if source is None:
            return Prompt(tokens=context, ids=self.prompts.unique(context))
        return await source.next(context)

    async def _one(self, client: Streams, context: int, max_tokens: int,
                   first_token: asyncio.Event | None = None, *, prompt: Prompt | None = None,
                   source: Prompts | None = None, request_id: str | None = None) -> RequestRecord:
        """One request: a fresh unique prompt (random ids, or from the cell's text source), or the given one
        (warm TTFT reuses a stream's cached prompt)."""
        if prompt is None:
            prompt = await self._prompt(context, source)
        return await stream_completion(client, model=self.target.model, prompt=prompt.ids or [],
                                       messages=prompt.messages, prompt_tokens=prompt.tokens,
                                       max_tokens=max_tokens, request_id=request_id or self._next_id(),
                                       first_token=first_token)

    async def _sustained(self, spec: CellSpec, max_tokens: int, client: Streams,
                         records: list[RequestRecord], window_open: asyncio.Event,
                         prompts: list[Prompt] | None = None, source: Prompts | None = None) -> tuple[float, float]:
        """Keep exactly C streams busy; the window opens once every first stream has produced a token and
        the warm-up has passed; at its end no new request starts and the running ones are drained."""
        stop = asyncio.Event()
        first_round = [asyncio.Event() for _ in range(spec.concurrency)]
        failed = asyncio.Event()

        async def worker(index: int) -> None:
            first: asyncio.Event | None = first_round[index]
            # A text or chat prompt is made while the request before it streams (a chat prompt takes calls to
            # /tokenize), so that the stream is never idle waiting for its next prompt.
            upcoming = asyncio.create_task(self._prompt(spec.context_tokens, source)) if (
                source is not None and not prompts) else None
            try:
                while not stop.is_set():
                    prompt = prompts[index] if prompts else await upcoming if upcoming else None
                    if upcoming is not None:
                        upcoming = asyncio.create_task(self._prompt(spec.context_tokens, source))
                    rec = await self._one(client, spec.context_tokens, max_tokens, first, prompt=prompt,
                                          source=source)
                    first = None
                    records.append(rec)
                    first_round[index].set()  # also when the request failed before any token
                    if not rec.ok:
                        failed.set()
                        return
            except BaseException:
                failed.set()  # a prompt that could not be made ends the step, never a wait for its first token
                first_round[index].set()
                raise
            finally:
                if upcoming is not None:
                    upcoming.cancel()
                    await asyncio.gather(upcoming, return_exceptions=True)

        started = asyncio.Event()  # every stream has a token, or one failed

        async def watch(event: asyncio.Event) -> None:
            await event.wait()
            if failed.is_set() or all(e.is_set() for e in first_round):
                started.set()

        watchers = [asyncio.create_task(watch(e)) for e in [*first_round, failed]]
        tasks = [asyncio.create_task(worker(i)) for i in range(spec.concurrency)]
        try:
            try:
                await started.wait()
            finally:
                for watcher in watchers:
                    watcher.cancel()
            await asyncio.sleep(self.target.wall_s(spec.warmup_s))
            start = clock.now()
            window_open.set()
            try:
                await asyncio.wait_for(failed.wait(), self.target.wall_s(spec.window_s))
            except TimeoutError:
                pass
            end = clock.now()
            stop.set()
            await asyncio.gather(*tasks)
        except BaseException:
            stop.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return start, end

    async def _rate(self, spec: CellSpec, client: Streams, records: list[RequestRecord],
                    source: Prompts | None) -> _Load:
        """Requests on an arrival schedule (or, without a rate, as fast as the cap lets them), each a fresh
        prompt of its drawn length, never waiting for the ones before it. Scheduled prompts are all made
        before the first is due, so making them never delays the schedule. With early_stop, no request is
        released once the SLO has certainly failed; the ones in flight end normally."""
        scale = self.target.time_scale
        rng = random.Random(spec.seed)
        (p_lo, n_lo), (p_hi, n_hi) = spec.lengths_range()
        turns = None if spec.sessions is None else SessionTurns(
            spec.sessions, reply_tokens=spec.max_tokens, part=lambda n: self._prompt(n, source))

        def lengths(index: int) -> tuple[int, int]:
            if turns is not None:
                return turns.length(index), spec.max_tokens
            if not spec.range_ratio:
                return spec.context_tokens, spec.max_tokens
            return rng.randint(p_lo, p_hi), rng.randint(n_lo, n_hi)

        async def make_prompt(index: int, length: int) -> Prompt:
            return await (turns.prompt(index) if turns is not None else self._prompt(length, source))

        service = spec.slo
        stop = asyncio.Event() if spec.early_stop and service is not None else None
        # A closed loop that stops early is decided by its count, not its span (requests after a span would
        # dilute a failure already certain): min_requests judged, its first wave besides.
        counted = spec.request_rate is None and stop is not None
        seen: list[slo.RequestLatency] = []
        shapes: list[tuple[int, int]] = []
        prompts: list[Prompt] = []
        offsets: list[float] = []
        implied: int | None = None
        if spec.trace is not None:
            # The trace's own arrivals and lengths; shared hash ids are shared blocks, under a fresh salt.
            replay = spec.trace.load()
            offsets = [r.at_s for r in replay]
            shapes = [(r.input_tokens, r.output_tokens) for r in replay]
            block = spec.trace.block_tokens
            blocks = None if block is None else traces.BlockPrompts(block, secrets.randbits(60))
            prompts = [Prompt(tokens=r.input_tokens, ids=blocks.prompt(r)) if blocks is not None and r.hash_ids
                       else await make_prompt(i, r.input_tokens) for i, r in enumerate(replay)]
            implied = None if block is None else sum(traces.implied_hits(replay, block, self.target.block_size or 1))
        elif spec.request_rate is not None:
            offsets = openloop.arrivals(spec.request_rate, spec.duration_s, arrival=spec.arrival,
                                        burstiness=spec.burstiness, seed=spec.seed, min_requests=spec.min_requests)
            shapes = [lengths(i) for i in range(len(offsets))]
            prompts = [await make_prompt(i, length) for i, (length, _) in enumerate(shapes)]

        ramp: set[str] = set()

        async def send(sent: openloop.Sent) -> None:
            released = sent.released_t
            if sent.index < len(shapes):
                (length, reply), prompt = shapes[sent.index], prompts[sent.index]
            else:  # a closed loop makes each prompt as it goes; it has no schedule to be late for
                length, reply = lengths(sent.index)
                prompt = await make_prompt(sent.index, length)
                released = clock.now()
            request_id = self._next_id()
            if spec.request_rate is None and spec.max_concurrency and sent.index < spec.max_concurrency:
                ramp.add(request_id)
            rec = await self._one(client, length, reply, prompt=prompt, request_id=request_id)
            rec.scheduled_t, rec.released_t = sent.scheduled_t, released
            records.append(rec)
            if stop is not None and service is not None and not stop.is_set() and request_id not in ramp:
                seen.extend(request_latencies([rec], scale))
                if slo.certain_to_fail(service, spec.min_requests if counted else len(offsets), seen):
                    stop.set()

        if spec.request_rate is None:
            assert spec.max_concurrency is not None  # CellSpec refuses a rate of inf without a cap
            # The first wave does not count towards the minimum: that many requests are judged.
            span = 0.0 if counted else spec.duration_s
            start = await openloop.closed(spec.max_concurrency, span, send, stop=stop,
                                          min_requests=spec.min_requests + spec.max_concurrency, time_scale=scale)
            # Stopped early only if a request it would have sent was not: certain after the last one is not early.
            early = stop is not None and stop.is_set() and len(records) < spec.min_requests + spec.max_concurrency
            return _Load(start=start, span_s=span, planned=None, early_stopped=early, ramp=frozenset(ramp))
        start = await openloop.drive(offsets, send, time_scale=scale, cap=spec.max_concurrency, stop=stop)
        return _Load(start=start, span_s=len(offsets) / spec.request_rate, planned=len(offsets),
                     early_stopped=len(records) < len(offsets), implied_hits=implied)

    def _rate_result(self, base: dict[str, Any], spec: CellSpec, step: _Step, delta: m.Delta,
                     attempts: list[Attempt]) -> CellResult:
        load = step.load
        assert load is not None
        scale = self.target.time_scale
        records = step.records
        values = rate_metrics(records, start=load.start, span_s=load.span_s, planned=load.planned,
                              early_stopped=load.early_stopped, request_rate=spec.request_rate,
                              service=spec.slo, scale=scale, ramp=load.ramp)
        # The schedule's start and nominal end on the records' clock, so the rate can be recomputed from them.
        values["window"] = (load.start, load.start + load.span_s / scale)
        achieved = values.get("achieved_rate_rps")
        share = achieved / spec.request_rate if achieved is not None and spec.request_rate else None
        # An early stop sends fewer requests on purpose: only their lag says whether the client kept up.
        evidence = StepEvidence(
            phase="rate", mode=spec.mode, concurrency=spec.concurrency, records=records,
            prefix_cache_hits=delta.optional(m.PREFIX_HITS), preemptions=delta.optional(m.PREEMPTIONS),
            client_cpu=step.cpu, gpu_throttled=step.telemetry.throttled if step.telemetry else None,
            template_hits=self._template_hits(spec, len(records)), shares_prefixes=spec.shares_prefixes,
            cache_problem=step.cache.problem if step.cache is not None else None, implied_hits=load.implied_hits,
            prefix_cache_queries=delta.optional(m.PREFIX_QUERIES),
            behind_schedule=behind_schedule(
                records, wall_rate=spec.request_rate * scale if spec.request_rate else None,
                achieved_share=None if load.early_stopped else share))
        status, findings = verdict(evidence)
        notes = self._rate_notes(spec, values, delta, scale, sent=len(records), implied_hits=load.implied_hits)
        if step.cache is not None:
            notes.append(step.cache.note())
        # An early stop leaves the schedule's later intervals empty on purpose: no trend to tell there.
        steadiness = None if load.early_stopped else steady.steadiness(
            records, values["window"], scale=scale, judged=spec.trace is None and spec.sessions is None)
        view = server_view(delta, records, scale)
        queue = _queue(step.queue, load, scale, view.get("server_queue_mean_ms"))
        if queue.finding is not None:
            findings.append(queue.finding)
        over = client_ttft_finding(view.get("server_ttft_mean_ms"), view.get("client_ttft_mean_ms"), scale)
        if over is not None:
            findings.append(over)
        if steadiness is not None and steadiness.drifting:
            findings.append(Finding(Reason.NOT_STEADY, f"the window was not steady: {steadiness.describe()}"))
        elif steadiness is not None and not steadiness.judged and any(
                t is not None and t.drifting for t in (steadiness.throughput, steadiness.tpot)):
            moving = "the trace's own load" if spec.trace is not None else "the sessions' growing prompts"
            notes.append(f"{moving} moved over the window, and the server with it: {steadiness.describe()} (stated, "
                         "not a caveat: the load is meant to move)")
        discarded = [a for a in attempts if not a.accepted]
        acceptance_rate, acceptance_length = m.spec_decode(delta)
        return CellResult(
            **base, status=status, **findings_fields(findings), notes=notes, **values,
            discarded_steps=len(discarded), discarded_tokens=sum(a.excess_tokens for a in discarded),
            client_cpu=step.cpu, client_lag_p99_ms=_lag_ms(step.lag),
            client_lag_max_ms=_lag_max_ms(step.lag),
            preemptions=delta.optional(m.PREEMPTIONS), prefix_cache_queries=delta.optional(m.PREFIX_QUERIES),
            prefix_cache_hits=delta.optional(m.PREFIX_HITS),
            spec_acceptance_rate=acceptance_rate, spec_mean_acceptance_length=acceptance_length,
            spec_mean_accepted=m.spec_mean_accepted(delta), attempts=attempts, trace_implied_hits=load.implied_hits,
            **view, waiting_max=queue.waiting_max, avg_waiting=queue.avg_waiting, fell_behind_s=queue.fell_behind_s,
            waiting_at_end=queue.waiting_at_end,
            cache_state=step.cache, steadiness=steadiness,
            requests=[r.to_dict() for r in records])

    @staticmethod
    def _rate_notes(spec: CellSpec, values: dict[str, Any], delta: m.Delta, scale: float, *, sent: int,
                    implied_hits: int | None = None) -> list[str]:
        notes = []
        if spec.trace is not None:
            notes.append(trace_note(spec, delta, sent, implied_hits))
        if scale != 1.0:
            notes.append(f"against a simulator running {scale:g}x faster than its hardware: the schedule, the rates "
                         "and the latencies here are in the hardware's seconds")
        if clock.simulated():
            notes.append(SIMULATED_NOTE)
        if values.get("early_stopped"):
            planned = values.get("scheduled_requests")
            wave = values.get("ramp_requests") or 0
            done = (f"{sent} of {planned} requests" if planned is not None else
                    f"{sent - wave} of {spec.min_requests} judged requests (after its first wave of {wave})")
            notes.append(f"stopped early: the service level had failed for certain after {done}, so the rest were "
                         "never sent (those sent were drained, not aborted)")
        if values.get("ramp_requests"):
            notes.append(f"a closed loop of {spec.max_concurrency} streams: its first {values['ramp_requests']} "
                         "requests, sent together, count in the load but not in the latencies or the service level "
                         "(no later request queues behind a whole wave)")
        if values.get("cap_waits"):
            notes.append(f"{values['cap_waits']} request(s) waited for the cap of {spec.max_concurrency} in flight: "
                         "above that load the cap, not the rate, decides when requests go")
        if spec.sessions is not None:
            shape = spec.sessions
            hits, queries = delta.optional(m.PREFIX_HITS), delta.optional(m.PREFIX_QUERIES)
            served = f"{100 * hits / queries:.0f}%" if hits is not None and queries else "an unknown share"
            notes.append(f"agent sessions: {shape.count} at a time, {shape.turns} turn(s) each on one "
                         f"{shape.system_tokens}-token system prompt, prompts of {spec.context_tokens} to "
                         f"{spec.lengths_range()[1][0]} tokens; the prefix cache served {served} of the prompt "
                         "tokens (the server's counters)")
        preempted = delta.optional(m.PREEMPTIONS)
        if preempted:
            notes.append(f"{preempted:.0f} preemption(s): at this rate the KV cache ran out and requests were "
                         "recomputed, which their latencies include")
        return notes

    # --- verdict -----------------------------------------------------------------------------------------
    def _result(self, base: dict[str, Any], spec: CellSpec, step: _Step, delta: m.Delta,
                attempts: list[Attempt]) -> CellResult:
        if spec.phase == "rate":
            return self._rate_result(base, spec, step, delta, attempts)
        records = step.records
        if spec.phase == "prefill":
            values = prefill_metrics(records)
        elif step.window is not None:
            values = window_metrics(records, *step.window)
            values["window"] = step.window
        else:
            values = fixed_metrics(records)
        hits = delta.optional(m.PREFIX_HITS)
        queries = delta.optional(m.PREFIX_QUERIES)
        preemptions = delta.optional(m.PREEMPTIONS)
        evidence = StepEvidence(
            phase=spec.phase, mode=spec.mode, concurrency=spec.concurrency, records=records,
            prefix_cache_hits=hits, preemptions=preemptions, waiting=tuple(step.waiting),
            running=tuple(step.running), kv_usage=tuple(step.kv_usage), context_tokens=spec.context_tokens,
            max_num_batched_tokens=self.target.max_num_batched_tokens,
            decode_tokens_per_seq=1 + (self.target.num_speculative_tokens or 0),
            avg_active=values.get("avg_active"), avg_before_first_token=values.get("avg_before_first_token"),
            window_tokens=values.get("output_tokens") if step.window is not None else None,
            window_s=(step.window[1] - step.window[0]) * self.target.time_scale if step.window is not None else None,
            stall_error=stall_error(records, step.window, step.stalls, LAG_EVERY_S)
            if step.window is not None and step.stalls else None,
            client_stall_s=max(step.lag) * self.target.time_scale if step.window is not None and step.lag else None,
            client_cpu=step.cpu, max_num_seqs=self.target.max_num_seqs,
            gpu_throttled=step.telemetry.throttled if step.telemetry else None,
            shares_prefixes=spec.phase == "decode" and spec.ttft == "warm",
            template_hits=self._template_hits(spec, len(records) + len(step.priming)))
        status, findings = verdict(evidence)
        if spec.phase == "decode" and spec.prompts == "random" and (
                m.speculative(delta) or self.target.num_speculative_tokens):
            findings.append(spec_random_prompts())
        view = server_view(delta, records + step.priming, self.target.time_scale)
        over = client_ttft_finding(view.get("server_ttft_mean_ms"), view.get("client_ttft_mean_ms"),
                                   self.target.time_scale)
        if over is not None:
            findings.append(over)
        energy = step.telemetry.energy_j if step.telemetry else None
        generated = sum(r.tokens for r in records)
        if energy is not None and generated and spec.phase == "decode":
            # The step's energy over the step's tokens: a sustained step runs longer than its window (ramp-up,
            # drain), so both are counted over the whole step, not the window.
            values["energy_j_per_token"] = energy / generated
        running_median = stats.median(step.running)
        waiting_max = max(step.waiting) if step.waiting else None
        notes: list[str] = []
        queued = queue_note(evidence)
        if queued:
            notes.append(queued)
        if spec.phase == "decode" and spec.ttft == "warm":
            notes.append(f"{TTFT_MODE_TEXT['warm']}; {len(step.priming)} priming request(s) not counted")
        scale = self.target.time_scale
        sustained = spec.mode == "sustained"
        if scale != 1.0:
            span, seconds = ((f"{spec.window_s:g} s window after a {spec.warmup_s:g} s warm-up", spec.window_s)
                             if sustained else (f"{spec.min_seconds:g} s minimum", spec.min_seconds))
            lived = (f": the {span} is the hardware's time, {self.target.wall_s(seconds):.3g} s of wall time"
                     if spec.phase == "decode" and (sustained or spec.min_seconds) else "")
            notes.append(f"against a simulator running {scale:g}x faster than its hardware{lived}; the rates and "
                         f"latencies here are the hardware's (the wall clock's, converted by {scale:g}x)")
        if clock.simulated():
            notes.append(SIMULATED_NOTE)
        values = hardware_units(values, scale)
        if step.processes > 1:
            notes.append(f"streams split over {step.processes} client processes (the busiest used "
                         f"{step.cpu or 0:.0%} of a core)")
        per_chunk = sum(1 for r in records if r.token_count == "chunks")
        if per_chunk:
            notes.append(f"tokens counted per chunk in {per_chunk} of {len(records)} requests: the server sent no "
                         "continuous usage stats, so a chunk carrying several tokens (speculative decoding) "
                         "would be undercounted")
        off = sorted({r.usage_prompt_tokens for r in records
                      if r.usage_prompt_tokens is not None and r.usage_prompt_tokens != spec.context_tokens})
        if off:
            notes.append(f"the server counted {len(off)} prompt length(s) other than {spec.context_tokens:,} tokens "
                         f"({', '.join(f'{n:,}' for n in off[:3])}): its tokenizer split a prompt differently "
                         "from the way the prompt was fitted")
        behind = sim_behind_share(step.sim_clock, delta)
        if behind is not None and behind > SIM_BEHIND_NOTE:
            said = (f"the simulator fell behind its clock for {behind:.1%} of the "
                    f"{'window' if len(step.sim_clock) >= 2 else 'step'}: its rates read up to that much low "
                    "for the hardware it imitates")
            # Past a verdict's smallest change the reading is not the hardware's: measured again, as a stall.
            if behind > STALL_SHARE:
                findings.append(Finding(Reason.SIM_BEHIND, said))
            else:
                notes.append(f"{said}; lower CAMPAIGN_SIM_TIME_SCALE")
        acceptance_rate, acceptance_length = m.spec_decode(delta)
        discarded = [a for a in attempts if not a.accepted]
        return CellResult(
            **base, status=status, **findings_fields(findings), notes=notes, **values,
            discarded_steps=len(discarded), discarded_tokens=sum(a.excess_tokens for a in discarded),
            client_cpu=step.cpu, client_lag_p99_ms=_lag_ms(step.lag),
            client_lag_max_ms=_lag_max_ms(step.lag), client_stall_bound=evidence.stall_error,
            sim_behind_share=behind,
            running_median=running_median, waiting_max=waiting_max,
            avg_running=stats.mean(step.running), avg_waiting=stats.mean(step.waiting),
            kv_usage_max=max((kv for kv in step.kv_usage if kv is not None), default=None),
            preemptions=preemptions, prefix_cache_queries=queries, prefix_cache_hits=hits,
            spec_acceptance_rate=acceptance_rate, spec_mean_acceptance_length=acceptance_length,
            spec_mean_accepted=m.spec_mean_accepted(delta),
            attempts=attempts, requests=[r.to_dict() for r in records],
            **view,
        )


def trace_note(spec: CellSpec, delta: m.Delta, sent: int, implied_hits: int | None) -> str:
    """What a trace cell replayed, and the reuse its shared blocks imply beside what the server's cache served."""
    trace = spec.trace
    assert trace is not None and spec.request_rate is not None
    out = (f"trace {Path(trace.path).name} ({trace.format}): {sent} of its slice's {trace.requests} requests at "
           f"their own times ({spec.request_rate:.3g} req/s on average), prompts {spec.context_tokens:,} tokens "
           "on average")
    if trace.length_scale != 1:
        out += f" (lengths x{trace.length_scale:g})"
    hits, queries = delta.optional(m.PREFIX_HITS), delta.optional(m.PREFIX_QUERIES)
    if implied_hits is not None:
        share = f" ({100 * implied_hits / queries:.1f}% of the prompt tokens)" if queries else ""
        out += (f"; its shared blocks ({trace.block_tokens} tokens a hash id) make {implied_hits:,} prompt tokens "
                f"reusable{share}")
        served = "the server's counters were not read" if hits is None else f"the server's cache served {hits:,.0f}"
        out += f", and {served}"
    else:
        out += "; no shared blocks: every prompt is unique"
    return out
