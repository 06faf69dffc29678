"""Seed 000's experiments, each measured against a running server and stored like any cell.

- context window: does prompt + reply over max_model_len get a 400, or a silently clamped reply?
- long-context cost: time to first token and generation speed after prompts of growing size
- scheduler cap and overload: more simultaneous requests than max-num-seqs; peak running and waiting
- prefix order: shared block first, task first, unrelated; wall time and prefix-cache hit rate
- repeat: one cell measured N times, to see bimodal behaviour instead of averaging it away
- agents: N chat sessions on a shared system prompt with growing histories; the largest N above speed floors

(Capacity at a service level, the `slo-search` experiment, is capacity.py's.)

Each experiment sends its requests, then hands the records to a pure `*_result` function that judges them.
In simulated time the same functions run against the simulator serving from this process (measure.simulated).

Long (about 730 lines) so that an experiment's two halves are read together.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx
from pydantic import BaseModel, ConfigDict, Field

from campaign.core import clock, stats
from campaign.http.client import RequestRecord, new_client, stream_completion
from campaign.http.tokenizer import ServerTokenizer
from campaign.measure import answers, runner
from campaign.measure.cells import Attempt, CellResult, CellSpec, Finding, Reason
from campaign.measure.figures import max_in_flight
from campaign.measure.prompts import Prompts, PromptSource
from campaign.measure.runner import Measurer, Target
from campaign.server import metrics as m

ExperimentKind = Literal["context-window", "long-context", "overload", "prefix-order", "repeat", "agents",
                         "slo-search"]


class ExperimentResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: ExperimentKind
    key: str
    status: Literal["Valid", "Invalid", "Failed", "Contaminated"]
    reasons: list[str] = Field(default_factory=list)
    # The Reason code of each finding among `reasons`, in their order (format 16; older files none): a reason
    # that is no finding (a failed request's error, quoted) has no code.
    reason_codes: list[Reason] = Field(default_factory=list)
    # Headline numbers, compared across variants like cell metrics (None when undefined).
    values: dict[str, float | None] = Field(default_factory=dict)
    verdict: str = ""
    details: dict[str, Any] = Field(default_factory=dict)
    requests: list[dict[str, Any]] = Field(default_factory=list)
    # Every step bracketed by the server's counters like a cell: the attempts, and those discarded.
    attempts: list[Attempt] = Field(default_factory=list)
    discarded_steps: int = 0


# Direction of each headline value for diffs: +1 higher is better, -1 lower is better.
VALUE_DIRECTIONS = {
    "prompt_tok_s": 1, "silence_s_per_1k_prompt_tokens": -1, "generation_tok_s_drop_pct": -1,
    "ran_concurrently": 1, "queued": -1, "peak_running": 1, "peak_waiting": -1, "errored": -1, "completed": 1,
    "shared_first_wall_s": -1, "shared_first_hit_rate": 1, "speedup": 1,
    "mean_total_tok_s": 1,
    # Capacity at a service level (capacity.py): the highest rate and concurrency that held it.
    "max_rate_rps": 1, "max_concurrency": 1,
}


T = TypeVar("T")
MAX_ATTEMPTS = 3
# The overload experiment's burst is simultaneous only if its sends all left within
# this share of the first request's life (from the first send to the first request's last token). Past it the
# first requests may be done before the last are sent, and "ran concurrently" measures the client's host: a
# demo burst of 80 once left over 3.6 s on a busy host and read "1 ran concurrently, 79 queued" (the idle
# host's burst leaves within 1 ms).
SEND_SPREAD_SHARE = 0.10


class _Contaminated(Exception):
    def __init__(self, step: str, attempts: list[Attempt]) -> None:
        foreign = [a for a in attempts if a.code == Reason.CONTAMINATED]
        some = "all" if len(foreign) == len(attempts) else f"{len(foreign)} of the"
        super().__init__(f"foreign traffic in {some} {len(attempts)} attempts at {step} "
                         f"({', '.join(str(a.excess_tokens) for a in foreign)} extra tokens)")


class _NotDelivered(Exception):
    """Every attempt at a step missed its premise (a burst that did not leave together): the last one's value
    is kept, so that what was measured is stored beside why it cannot be read."""

    def __init__(self, value: object) -> None:
        super().__init__("the step's premise was missed in every attempt")
        self.value = value


def send_spread(records: list[RequestRecord]) -> tuple[float | None, float | None]:
    """A burst's sends: how far apart its first and last left, and the first request's life (the first send to
    the earliest last token of a completed request), in the records' seconds; None where undefined."""
    if not records:
        return None, None
    first = min(r.send_t for r in records)
    lasts = [r.chunk_t[-1] for r in records if r.ok and r.chunk_t]
    return max(r.send_t for r in records) - first, (min(lasts) - first if lasts else None)


def spread_finding(spread_s: float | None, life_s: float | None, *, sends: int, what: str) -> Finding | None:
    """Why a burst was not one, from `send_spread`'s two figures (in the hardware's seconds); None when it was
    (or it cannot be told: nothing completed)."""
    if spread_s is None or life_s is None or life_s <= 0 or spread_s <= SEND_SPREAD_SHARE * life_s:
        return None
    return Finding(Reason.SENDS_SPREAD, (
        f"{what}: its {sends} sends left over {1000 * spread_s:,.1f} ms, {100 * spread_s / life_s:.0f}% of the "
        f"first request's life ({1000 * life_s:,.1f} ms), beyond the {100 * SEND_SPREAD_SHARE:g}% that keeps "
        "them simultaneous"))


def burst_finding(records: list[RequestRecord], *, what: str, time_scale: float = 1.0) -> Finding | None:
    """`spread_finding` of a burst's own records."""
    spread, life = send_spread(records)
    return spread_finding(_scaled(spread, time_scale), _scaled(life, time_scale), sends=len(records), what=what)


def _ran_and_queued(records: list[RequestRecord]) -> tuple[int | None, int | None]:
    """A burst's requests that ran at once and those that queued, on the client's clock (None, None: none
    completed). A request admitted at once sees its first token after its prefill, before any request of the
    burst has its last token (that takes the prefill and a whole reply); one that waited for a seat gets it,
    and so its first token, only in a step after another request's last. The last token, not the end of its
    stream: the stream's end can reach the client after the next step's tokens. (Half the shortest request,
    the rule before, called a prefill-heavy burst queued: the simulator's truth records showed it.)"""
    lasts = [r.chunk_t[-1] for r in records if r.ok and r.chunk_t]
    if not lasts:
        return None, None
    first_end = min(lasts)
    queued = sum(1 for r in records if r.chunk_t and r.chunk_t[0] > first_end)
    return len(records) - queued, queued


def over_cap_finding(records: list[RequestRecord], cap: int | None) -> Finding | None:
    """Why a burst's reading of what ran at once cannot stand: the client's clock read more first tokens before
    the first request's last than the server's cap (its max-num-seqs) lets run. A stall that makes the client
    read the step that ends the first requests and the next step, which seats the queued ones, in one go
    stamps their reads in whatever order the event loop runs them (seen unloaded on the real CPU build: 66 of
    128 against a cap of 64). None when the reading is within the cap or the cap is not known."""
    ran, _ = _ran_and_queued(records)
    if ran is None or cap is None or ran <= cap:
        return None
    return Finding(Reason.READS_UNORDERED, (
        f"the burst: the client read {ran} first tokens before the first request's last, more than max-num-seqs "
        f"({cap}) lets run at once, so its clock lost the order of the server's steps"))


def _with_findings(result: ExperimentResult, findings: list[Finding]) -> ExperimentResult:
    """`result` Invalid for `findings` (its figures kept, for the reader, never for a verdict: the diff judges
    Valid experiments only)."""
    if not findings or result.status != "Valid":
        return result
    return result.model_copy(update={"status": "Invalid", "reasons": [f.message for f in findings],
                                     "reason_codes": [f.code for f in findings]})


async def _bracketed(target: Target, control: httpx.AsyncClient, step: Callable[[], Awaitable[T]],
                     records_of: Callable[[T], list[RequestRecord]], attempts: list[Attempt], *,
                     name: str, premise: Callable[[T], Finding | None] | None = None) -> tuple[T, m.Delta]:
    """One experiment step between two counter readings, like a cell's: a step with foreign tokens is
    discarded, counted and rerun (`step` makes fresh prompts each call); after MAX_ATTEMPTS, _Contaminated.
    `premise`: why a step the client did not deliver as meant cannot be read (None: it can); such a step is
    discarded and rerun as well, and after MAX_ATTEMPTS of them, _NotDelivered with the last one's value."""
    measurer = Measurer(target)
    # The server's families, and a simulator's time scale, which the step's figures are converted by: an
    # experiment may be the first thing measured on this target.
    await measurer.check_metrics(control)
    tries: list[Attempt] = []
    for _ in range(MAX_ATTEMPTS):
        before = await measurer.scrape(control)
        value = await step()
        after, attempt = await measurer.bracket(control, before, records_of(value))
        missed = premise(value) if attempt.accepted and premise is not None else None
        if missed is not None:
            attempt = attempt.model_copy(update={"accepted": False, "reason": missed.message, "code": missed.code})
        tries.append(attempt)
        attempts.append(attempt)
        if attempt.accepted:
            return value, m.Delta(before, after)
    if tries[-1].code == Reason.SENDS_SPREAD:
        raise _NotDelivered(value)
    raise _Contaminated(name, tries)


def _contaminated(kind: ExperimentKind, key: str, exc: _Contaminated, attempts: list[Attempt]) -> ExperimentResult:
    return ExperimentResult(kind=kind, key=key, status="Contaminated", reasons=[str(exc)],
                            reason_codes=[Reason.CONTAMINATED], attempts=attempts,
                            discarded_steps=sum(1 for a in attempts if not a.accepted))


async def _scrape(target: Target, client: httpx.AsyncClient, *,
                  only: frozenset[str] | None = None) -> m.MetricsSnapshot:
    return await runner.scrape(target, client, only=only)


# --- context window -----------------------------------------------------------------------------------
async def context_window(target: Target, *, reply_tokens: int = 200) -> ExperimentResult:
    """Two requests a user would send: prompt + reply just over the window, and a prompt alone over it.
    Sent without min_tokens, as an ordinary client would, so a silent clamp shows as a short reply."""
    if target.max_model_len is None:
        return ExperimentResult(kind="context-window", key="context-window", status="Invalid",
                                reasons=["max_model_len unknown: nothing to probe"])
    window = target.max_model_len
    prompts = PromptSource()
    attempts: list[Attempt] = []

    async def step() -> tuple[httpx.Response, httpx.Response, list[RequestRecord]]:
        over_total = prompts.unique(window - reply_tokens // 2)
        over_prompt = prompts.unique(window + 16)
        a = await client.post("/v1/completions", json={"model": target.model, "prompt": over_total,
                                                       "max_tokens": reply_tokens, "ignore_eos": True})
        b = await client.post("/v1/completions", json={"model": target.model, "prompt": over_prompt,
                                                       "max_tokens": 1})
        # What the server should count for these two: the bracket's expectation.
        sent = [RequestRecord(id=f"window{i}", prompt_tokens=len(p), max_tokens=n, send_t=0.0, status=r.status_code,
                              usage_completion_tokens=_usage(r)) for i, (p, n, r) in
                enumerate(((over_total, reply_tokens, a), (over_prompt, 1, b)))]
        return a, b, sent

    try:
        async with target.endpoint.async_control(timeout_s=600) as client:
            (a, b, _), _ = await _bracketed(target, client, step, lambda v: v[2], attempts, name="the window probe")
    except _Contaminated as exc:
        return _contaminated("context-window", "context-window", exc, attempts)
    return context_window_result(window, reply_tokens, over_total=(a.status_code, _usage(a)),
                                 over_prompt=(b.status_code, _message(b)), attempts=attempts)


def context_window_result(window: int, reply_tokens: int, *, over_total: tuple[int, int | None],
                          over_prompt: tuple[int, str | None], attempts: list[Attempt]) -> ExperimentResult:
    """What the two answers say: `over_total` (status, completion tokens of a 200) for prompt + reply just
    over the window, `over_prompt` (status, error message) for a prompt alone over it."""
    status, got = over_total
    if status == 400:
        behaviour = "refuses with 400"
        verdict = (f"prompt + reply over the {window:,}-token window: the server refuses with a 400, rather than "
                   "quietly truncating (what you want)")
    elif status == 200 and got is not None and got < reply_tokens:
        behaviour = "clamps silently"
        verdict = (f"prompt + reply over the {window:,}-token window: the server answered 200 with {got} of "
                   f"{reply_tokens} tokens: it silently clamps the reply (vLLM >= 0.32 does). Check "
                   "usage.completion_tokens on every reply you depend on")
    else:
        behaviour = f"HTTP {status}"
        verdict = f"prompt + reply over the window: unexpected answer HTTP {status}"
    prompt_status, message = over_prompt
    verdict += ("; a prompt alone over the window is refused with 400" if prompt_status == 400
                else f"; a prompt alone over the window got HTTP {prompt_status}")
    return ExperimentResult(
        kind="context-window", key="context-window", status="Valid", verdict=verdict, attempts=attempts,
        discarded_steps=sum(1 for x in attempts if not x.accepted),
        values={"clamped": 1.0 if behaviour == "clamps silently" else 0.0},
        details={"max_model_len": window, "over_total": {"status": status, "completion_tokens": got,
                                                         "asked": reply_tokens, "behaviour": behaviour},
                 "over_prompt": {"status": prompt_status, "message": message}},
    )


def _usage(response: httpx.Response) -> int | None:
    """completion_tokens of a non-streamed 200 reply; None otherwise."""
    if response.status_code != 200:
        return None
    try:
        value = response.json().get("usage", {}).get("completion_tokens")
    except ValueError:
        return None
    return value if isinstance(value, int) else None


def _message(response: httpx.Response) -> str | None:
    try:
        error = response.json().get("error")
    except ValueError:
        return None
    return str(error.get("message") if isinstance(error, dict) else error)[:300] if error else None


# --- long-context cost ---------------------------------------------------------------------------------
async def long_context(target: Target, contexts: list[int], *, reply_tokens: int = 128) -> ExperimentResult:
    """TTFT against prompt size and the generation speed after it (seed 000's 6.6K / 26K / 82K table)."""
    prompts = PromptSource()
    rows: list[dict[str, Any]] = []
    records: list[RequestRecord] = []
    attempts: list[Attempt] = []
    async with new_client(target.endpoint) as client, target.endpoint.async_control() as control:
        for i, context in enumerate(sorted(contexts)):
            if target.max_model_len is not None and context + reply_tokens > target.max_model_len:
                rows.append({"context_tokens": context, "skipped": "over max_model_len"})
                continue

            async def one(context: int = context, i: int = i) -> RequestRecord:
                return await stream_completion(client, model=target.model, prompt=prompts.unique(context),
                                               max_tokens=reply_tokens, request_id=f"long{i}")

            try:
                rec, _ = await _bracketed(target, control, one, lambda r: [r], attempts,
                                          name=f"the {context:,}-token prompt")
            except _Contaminated as exc:
                return _contaminated("long-context", "long-context", exc, attempts)
            records.append(rec)
            rows.append(long_context_row(context, rec, target.time_scale))
    return long_context_result(rows, records, attempts, time_scale=target.time_scale)


def long_context_row(context: int, rec: RequestRecord, time_scale: float = 1.0) -> dict[str, Any]:
    """One prompt's row, in the hardware's units (a simulator at a time scale lived it that much faster)."""
    ttft = _scaled(rec.ttft_s, time_scale)
    return {"context_tokens": context, "ttft_s": ttft, "generation_tok_s": _scaled(rec.decode_tok_s, 1 / time_scale),
            "prompt_tok_s": context / ttft if ttft else None, "error": rec.error}


def long_context_result(rows: list[dict[str, Any]], records: list[RequestRecord], attempts: list[Attempt], *,
                        time_scale: float = 1.0) -> ExperimentResult:
    """The rows' median prompt rate, the silence it means per 1,000 prompt tokens, and how much generation
    slows from the shortest prompt to the longest."""
    measured = [r for r in rows if r.get("ttft_s")]
    reasons = [f"{r['context_tokens']:,}: {r['error']}" for r in rows if r.get("error")]
    if not measured:
        return ExperimentResult(kind="long-context", key="long-context", status="Failed",
                                reasons=reasons or ["nothing measured"], details={"rows": rows})
    rate = stats.median([r["prompt_tok_s"] for r in measured if r["prompt_tok_s"]])
    silence = 1000.0 / rate if rate else None
    gens = [r["generation_tok_s"] for r in measured if r["generation_tok_s"]]
    drop = 100.0 * (gens[0] - gens[-1]) / gens[0] if len(gens) >= 2 and gens[0] else None
    verdict = (f"prompt processing about {rate:,.0f} tok/s: budget {silence:.2f} s of silence per 1,000 prompt "
               "tokens" if rate and silence else "no prompt rate")
    if drop is not None:
        verdict += f"; generation slows {drop:.0f}% from the shortest to the longest prompt"
    return ExperimentResult(
        kind="long-context", key="long-context", status="Failed" if reasons else "Valid", reasons=reasons,
        attempts=attempts, discarded_steps=sum(1 for a in attempts if not a.accepted),
        verdict=verdict, values={"prompt_tok_s": rate, "silence_s_per_1k_prompt_tokens": silence,
                                 "generation_tok_s_drop_pct": drop},
        details={"rows": rows, "time_scale": time_scale}, requests=[r.to_dict() for r in records])


# --- scheduler cap and overload ------------------------------------------------------------------------
def burst_size(max_num_seqs: int, factor: float) -> int:
    """The overload burst: factor x max-num-seqs requests, and always at least one over the cap."""
    return max(max_num_seqs + 1, math.ceil(max_num_seqs * factor))


async def overload(target: Target, *, max_num_seqs: int, factor: float = 1.25, prompt_tokens: int = 64,
                   reply_tokens: int = 64, sample_every_s: float = 0.25) -> ExperimentResult:
    """Fire factor x max-num-seqs requests at once; sample running and waiting during the burst."""
    n = burst_size(max_num_seqs, factor)
    prompts = PromptSource()
    running: list[float] = []
    waiting: list[float] = []
    sampled_t: list[float] = []   # the measuring clock at each sample (the report draws the gauges over time)
    done = asyncio.Event()

    async def sampler(client: httpx.AsyncClient) -> None:
        while not done.is_set():
            try:
                snap = await _scrape(target, client, only=m.GAUGES)
                running.append(snap.value(m.RUNNING))
                waiting.append(snap.value(m.WAITING))
                sampled_t.append(clock.now())
            except httpx.HTTPError:
                pass
            try:
                await asyncio.wait_for(done.wait(), sample_every_s)
            except TimeoutError:
                pass

    attempts: list[Attempt] = []

    async def burst() -> tuple[list[RequestRecord], float]:
        running.clear()
        waiting.clear()
        sampled_t.clear()
        done.clear()
        await client.open_idle(n)   # the sends then only write: their spread is the client's, not its connects'
        task = asyncio.create_task(sampler(control))
        began = clock.now()
        records = list(await asyncio.gather(*(
            stream_completion(client, model=target.model, prompt=prompts.unique(prompt_tokens),
                              max_tokens=reply_tokens, request_id=f"burst{i}") for i in range(n))))
        wall = (clock.now() - began) * target.time_scale   # the hardware's seconds
        done.set()
        await task
        return records, wall

    def missed(value: tuple[list[RequestRecord], float]) -> Finding | None:
        return (burst_finding(value[0], what="the burst", time_scale=target.time_scale)
                or over_cap_finding(value[0], target.max_num_seqs))

    try:
        async with new_client(target.endpoint) as client, target.endpoint.async_control() as control:
            (records, wall), _ = await _bracketed(target, control, burst, lambda v: v[0], attempts,
                                                  name="the burst", premise=missed)
    except _Contaminated as exc:
        return _contaminated("overload", f"overload-x{factor:g}", exc, attempts)
    except _NotDelivered as exc:   # the last burst, Invalid by overload_result's own reading of its sends
        records, wall = exc.value  # type: ignore[misc]
    return overload_result(records, max_num_seqs=max_num_seqs, factor=factor, wall_s=wall,
                           gauges=list(zip(sampled_t, running, waiting, strict=True)), attempts=attempts,
                           time_scale=target.time_scale, server_cap=target.max_num_seqs)


def overload_result(records: list[RequestRecord], *, max_num_seqs: int, factor: float, wall_s: float,
                    gauges: list[tuple[float, float, float]], attempts: list[Attempt],
                    time_scale: float = 1.0, server_cap: int | None = None) -> ExperimentResult:
    """The burst's records (one per request sent) and the server's gauges as sampled, (time on the records'
    clock, running, waiting): what ran at once, what queued, what completed. `server_cap`: the server's
    max-num-seqs as launched (None: not known), which no reading of what ran at once may exceed."""
    n = len(records)
    running, waiting = [g[1] for g in gauges], [g[2] for g in gauges]
    completed = sum(1 for r in records if r.ok and not r.short)
    errored = sum(1 for r in records if not r.ok)
    # From the client's own clock, which no slow /metrics scrape can miss (_ran_and_queued).
    ran, queued_or_none = _ran_and_queued(records)
    queued = queued_or_none or 0
    peak_running = max(running) if running else None
    peak_waiting = max(waiting) if waiting else None
    spread, life = (_scaled(x, time_scale) for x in send_spread(records))
    findings = [f for f in (spread_finding(spread, life, sends=n, what="the burst"),
                            over_cap_finding(records, server_cap),
                            _gauges_finding(max_in_flight(records), peak_running)) if f is not None]
    verdict = (f"{n} simultaneous requests against max-num-seqs {max_num_seqs}: {_g(ran)} ran concurrently, "
               f"{queued} queued, {completed} completed, {errored} errors")
    if findings:
        # Not the client's reading beside the gauges' as if both stood: why neither answers the question.
        verdict = f"not measured: {'; '.join(f.message for f in findings)}"
    elif errored == 0 and queued:
        verdict += ("; overload degrades into queueing rather than failure, so a load test can report total "
                    "success while hiding a queue")
    if peak_running is not None and not findings:
        verdict += f" (server gauges: up to {peak_running:g} running, {_g(peak_waiting)} waiting"
        if ran is not None and peak_running > ran:
            # No contradiction (_gauges_finding): vLLM counts a request in its prefill chunks as running.
            verdict += "; the gauge counts requests still in their prefill as running, this reading as queued"
        verdict += ")"
    result = ExperimentResult(
        kind="overload", key=f"overload-x{factor:g}", status="Valid" if ran is not None else "Failed",
        reasons=[] if ran is not None else ["no request of the burst completed"], verdict=verdict,
        values={"ran_concurrently": None if ran is None else float(ran),
                "queued": None if queued_or_none is None else float(queued_or_none),
                "completed": float(completed), "errored": float(errored), "peak_running": peak_running,
                "peak_waiting": peak_waiting},
        # The server's gauges as sampled, [clock, running, waiting]: on the requests' clock (send_t).
        # send_spread_s and first_life_s (the hardware's seconds): how far apart the burst's sends left, and
        # the first request's life, which the spread must be a small part of (SEND_SPREAD_SHARE).
        details={"requests": n, "max_num_seqs": max_num_seqs, "wall_s": wall_s, "time_scale": time_scale,
                 "samples": len(running), "gauges": [list(g) for g in gauges], "send_spread_s": spread,
                 "first_life_s": life},
        requests=[r.to_dict() for r in records], attempts=attempts,
        discarded_steps=sum(1 for a in attempts if not a.accepted))
    return _with_findings(result, findings)


def _gauges_finding(in_flight: int, peak_running: float | None) -> Finding | None:
    """The server's sampled running gauge against the client's own timestamps: the server cannot run more of
    the burst at once than the client had in flight at once, and sampling can miss a peak, never add one. A
    gauge above it says the client's timestamps are wrong (its host stalled between stamping and sending or
    reading). (Not against "ran concurrently": requests the server holds in a chunked prefill when the first
    request ends are running to its gauge and queued to that reading, without any contradiction.)"""
    if peak_running is None or peak_running <= in_flight:
        return None
    return Finding(Reason.GAUGES_DISAGREE, (
        f"the server's gauge saw {peak_running:g} requests running at once where the client never had more than "
        f"{in_flight} in flight by its own timestamps; a sampled gauge can miss a peak, never add one"))


def _g(value: float | None) -> str:
    return "?" if value is None else f"{value:g}"


# --- prefix order --------------------------------------------------------------------------------------
def shared_block_tokens(shared_tokens: int, block: int) -> int:
    """The shared text of prefix order as whole KV blocks, at least one: a cached block needs all of it."""
    return max(block, math.ceil(shared_tokens / block) * block)


async def prefix_order(target: Target, *, block_size: int | None, agents: int = 4, shared_tokens: int = 2400,
                       task_tokens: int = 200, reply_tokens: int = 64) -> ExperimentResult:
    """Same tokens, three layouts. The shared block is a whole number of KV blocks (at least one), sized from
    the server's real block size, and new for every arm so no arm is served by another's cache."""
    block = block_size or 16
    shared_len = shared_block_tokens(shared_tokens, block)
    prompts = PromptSource()
    arms: dict[str, dict[str, Any]] = {}
    attempts: list[Attempt] = []
    async with new_client(target.endpoint) as client, target.endpoint.async_control() as control:
        for arm in ("shared-first", "task-first", "unrelated"):
            async def run_arm(arm: str = arm) -> tuple[list[RequestRecord], float]:
                shared = prompts.shared_block(shared_len)  # new for every try: no arm is served by another's cache
                tasks = [prompts.unique(task_tokens) for _ in range(agents)]
                if arm == "shared-first":
                    batch = [shared + t for t in tasks]
                elif arm == "task-first":
                    batch = [t + shared for t in tasks]
                else:
                    batch = [prompts.unique(shared_len + task_tokens) for _ in range(agents)]
                await client.open_idle(agents)   # the arm's agents arrive together: no connect among the sends
                began = clock.now()
                records = await asyncio.gather(*(
                    stream_completion(client, model=target.model, prompt=p, max_tokens=reply_tokens,
                                      request_id=f"{arm}{i}") for i, p in enumerate(batch)))
                return list(records), (clock.now() - began) * target.time_scale   # the hardware's s

            try:
                (records, wall), delta = await _bracketed(target, control, run_arm, lambda v: v[0], attempts,
                                                          name=f"the {arm} arm")
            except _Contaminated as exc:
                return _contaminated("prefix-order", f"prefix-order-K{agents}", exc, attempts)
            arms[arm] = prefix_arm(records, wall, queries=delta(m.PREFIX_QUERIES), hits=delta(m.PREFIX_HITS),
                                   time_scale=target.time_scale)
    return prefix_order_result(arms, agents=agents, block=block, shared_len=shared_len, task_tokens=task_tokens,
                               attempts=attempts, time_scale=target.time_scale)


def prefix_arm(records: list[RequestRecord], wall_s: float, *, queries: float, hits: float,
               time_scale: float = 1.0) -> dict[str, Any]:
    """One arm: its wall time (the hardware's seconds), the prefix cache's hits over its queries, and how far
    apart its sends left beside its first request's life (the hardware's seconds: its agents arrive together)."""
    spread, life = (_scaled(x, time_scale) for x in send_spread(records))
    return {"wall_s": wall_s, "hit_rate": hits / queries if queries else None, "hits": hits, "queries": queries,
            "errors": [r.error for r in records if not r.ok], "server_ids": [r.server_id for r in records],
            "sends": len(records), "send_spread_s": spread, "first_life_s": life}


def prefix_order_result(arms: dict[str, dict[str, Any]], *, agents: int, block: int, shared_len: int,
                        task_tokens: int, attempts: list[Attempt], time_scale: float = 1.0) -> ExperimentResult:
    """The three arms side by side: how much faster the shared text first is, and its cache hits. Each arm
    carries how far apart its sends left (`send_spread_s`): stored for the reader, not a premise as the overload
    burst's is (an arm's hits and wall time are read whatever its spread; under two CPU hogs four sends spread
    over 28 ms against a 270 ms first request, three times in a row, on the real CPU build)."""
    sf, tf, un = arms["shared-first"], arms["task-first"], arms["unrelated"]
    speedup = min(tf["wall_s"], un["wall_s"]) / sf["wall_s"] if sf["wall_s"] else None
    verdict = (f"{agents} agents, {shared_len:,}-token shared block ({shared_len // block} blocks of {block}): "
               f"shared first {sf['wall_s']:.2f} s / {_pct(sf['hit_rate'])} cache hits, task first "
               f"{tf['wall_s']:.2f} s / {_pct(tf['hit_rate'])}, unrelated {un['wall_s']:.2f} s / "
               f"{_pct(un['hit_rate'])}")
    if speedup is not None:
        verdict += (f": putting the shared text first is {speedup:.1f}x faster" if speedup >= 1.1 else
                    ": prompt order made no measurable difference here")
    errors = [e for a in arms.values() for e in a["errors"]]
    return ExperimentResult(
        kind="prefix-order", key=f"prefix-order-K{agents}", status="Failed" if errors else "Valid",
        reasons=[f"{len(errors)} request(s) failed: {errors[0]}"] if errors else [], verdict=verdict,
        values={"shared_first_wall_s": sf["wall_s"], "shared_first_hit_rate": sf["hit_rate"], "speedup": speedup},
        attempts=attempts, discarded_steps=sum(1 for a in attempts if not a.accepted),
        details={"block_size": block, "shared_tokens": shared_len, "task_tokens": task_tokens, "arms": arms,
                 "time_scale": time_scale})


def _pct(value: float | None) -> str:
    return "?" if value is None else f"{100 * value:.1f}%"


# --- repeat a cell: bimodality -------------------------------------------------------------------------
async def repeat_cell(target: Target, spec: CellSpec, *, times: int = 4) -> ExperimentResult:
    """Measure one cell `times` times; report two modes when there are two, never their average."""
    measurer = Measurer(target)
    results = [await measurer.run_cell(spec) for _ in range(times)]
    return repeat_result(spec, results, time_scale=target.time_scale)


def repeat_result(spec: CellSpec, results: list[CellResult], *, time_scale: float = 1.0) -> ExperimentResult:
    """The runs' total tok/s (the hardware's): two modes where there are two, never their average."""
    values = [r.total_tok_s for r in results if r.status == "Valid" and r.total_tok_s is not None]
    modes = answers.bimodality(values)
    if modes.bimodal:
        verdict = (f"{spec.key}: BIMODAL: {modes.low_count} of {len(values)} runs near {modes.low:,.0f} tok/s and "
                   f"{modes.high_count} near {modes.high:,.0f} tok/s ({modes.ratio:.1f}x apart); no single average "
                   "describes it")
        mean = None
    else:
        mean = stats.mean(values)
        verdict = f"{spec.key}: one mode over {len(values)} runs" + (f", {mean:,.1f} tok/s" if mean else "")
    invalid = [r for r in results if r.status != "Valid"]
    return ExperimentResult(
        kind="repeat", key=f"repeat-{spec.key}", status="Valid" if values else "Failed",
        reasons=[f"run {i + 1}: {r.status}: {'; '.join(r.reasons)}" for i, r in enumerate(results) if r in invalid],
        verdict=verdict, values={"mean_total_tok_s": mean},
        # Each Valid run's window on the client's clock, so its rate can be recomputed (`make truth` does).
        details={"runs": values, "windows": [r.window for r in results if r.status == "Valid"
                                             and r.total_tok_s is not None],
                 "bimodal": modes.bimodal, "low": modes.low, "high": modes.high, "time_scale": time_scale,
                 "low_count": modes.low_count, "high_count": modes.high_count, "spec": spec.model_dump()})


# --- agent sessions --------------------------------------------------------------------------------------
AGENT_FLOORS = (40.0, 30.0, 20.0)   # seed 000: "if each agent needs 40 tok/s you can run 8; at 30, 16; at 20, 32"


async def agents(target: Target, *, sessions: list[int], turns: int = 4, system_tokens: int = 2000,
                 user_tokens: int = 200, reply_tokens: int = 128, prompts: str = "prose",
                 floors: tuple[float, ...] = AGENT_FLOORS, time_scale: float = 1.0) -> ExperimentResult:
    """N coding agents at once, for each N: every session a conversation on the chat endpoint that shares one
    system prompt with the others, and whose history grows by each reply and a new user turn. Turns run in
    lockstep (all N sessions send turn t, then t + 1), so each turn's prefix-cache hit rate comes from the
    server's own counters. Per N: each agent's decode speed (tokens after its first over their time, averaged
    over its turns), the slowest agent's, and the median TTFT of every turn. Then, per speed floor, the
    largest N whose agents all stayed above it: seed 000's "how many agents can run against it at once", from
    conversations instead of the synthetic ladder. Against a simulator running `time_scale` times faster than
    the hardware it imitates, speeds and times are given for that hardware (the floors are a user's)."""

    key = agents_key(sessions=sessions, turns=turns, system_tokens=system_tokens, user_tokens=user_tokens,
                     reply_tokens=reply_tokens, prompts=prompts)
    attempts: list[Attempt] = []
    by_n: dict[int, dict[str, Any]] = {}
    all_records: list[RequestRecord] = []
    async with new_client(target.endpoint) as client, target.endpoint.async_control() as control:
        source = Prompts(prompts, "chat", tokenizer=ServerTokenizer(control, target.model))
        await source.prepare(system_tokens)
        await source.prepare(user_tokens)
        for n in sorted(set(sessions)):

            async def conversation(n: int = n) -> tuple[list[list[RequestRecord]], list[dict[str, Any]]]:
                system = (await source.next(system_tokens)).messages
                assert system is not None
                shared = {"role": "system", "content": system[0]["content"]}  # fresh per try: no earlier cache
                histories: list[list[dict[str, Any]]] = [[shared] for _ in range(n)]
                per_turn: list[list[RequestRecord]] = []
                turn_cache: list[dict[str, Any]] = []
                for turn in range(turns):
                    for history in histories:
                        user = (await source.next(user_tokens)).messages
                        assert user is not None
                        history.append(user[0])
                    before = await _scrape(target, control)
                    replies: list[list[str]] = [[] for _ in range(n)]
                    records = await asyncio.gather(*(
                        stream_completion(client, model=target.model, prompt=[], messages=list(history),
                                          max_tokens=reply_tokens, request_id=f"a{n}-{i}-t{turn}", answer=reply)
                        for i, (history, reply) in enumerate(zip(histories, replies, strict=True))))
                    delta = m.Delta(before, await _scrape(target, control))
                    queries, hits = delta.optional(m.PREFIX_QUERIES), delta.optional(m.PREFIX_HITS)
                    turn_cache.append({"queries": queries, "hits": hits,
                                       "hit_rate": hits / queries if hits is not None and queries else None})
                    per_turn.append(list(records))
                    for history, reply in zip(histories, replies, strict=True):
                        history.append({"role": "assistant", "content": "".join(reply)})
                return per_turn, turn_cache

            try:
                (per_turn, turn_cache), _ = await _bracketed(
                    target, control, conversation, lambda v: [r for turn in v[0] for r in turn], attempts,
                    name=f"{n} agent(s)")
            except _Contaminated as exc:
                return _contaminated("agents", key, exc, attempts)
            records = [r for turn in per_turn for r in turn]
            all_records += records
            speeds = [_scaled(stats.mean([s for s in (per_turn[t][i].decode_tok_s for t in range(turns))
                                          if s is not None]), 1 / time_scale) for i in range(n)]
            by_n[n] = {
                "agent_tok_s": speeds,
                # An agent without a measured speed (a reply in one chunk) holds no floor: None, never skipped.
                "slowest_tok_s": None if None in speeds else min((s for s in speeds if s is not None), default=None),
                "ttft_ms_by_turn": [_scaled(_ms(stats.median([r.ttft_s for r in turn if r.ttft_s is not None])),
                                            time_scale) for turn in per_turn],
                "prompt_tokens_by_turn": [stats.median([float(r.usage_prompt_tokens) for r in turn
                                                        if r.usage_prompt_tokens is not None]) for turn in per_turn],
                "cache_by_turn": turn_cache,
                "errors": [r.error for r in records if not r.ok],
            }
    errors = [e for v in by_n.values() for e in v["errors"]]
    values: dict[str, float | None] = {}
    fits: list[str] = []
    for floor in floors:
        above = [n for n, v in by_n.items() if v["slowest_tok_s"] is not None and v["slowest_tok_s"] >= floor]
        # The largest N tried whose every agent held the floor, and every smaller N tried held it too.
        held = max((n for n in above if all(k in above for k in by_n if k <= n)), default=0)
        values[agents_value(floor)] = float(held)
        fits.append(f"{held} at {floor:g} tok/s")
    for n, v in by_n.items():
        values[f"slowest_agent_tok_s_N{n}"] = v["slowest_tok_s"]
    largest = max(by_n)
    last = by_n[largest]
    verdict = (f"agents that all stay above a speed floor ({', '.join(fits)}; tried {sorted(by_n)}); at "
               f"{largest}: slowest agent {_g1(last['slowest_tok_s'])} tok/s, TTFT by turn "
               f"{', '.join(_g1(t) for t in last['ttft_ms_by_turn'])} ms, prefix-cache hits by turn "
               f"{', '.join(_pct(c['hit_rate']) for c in last['cache_by_turn'])}")
    return ExperimentResult(
        kind="agents", key=key, status="Failed" if errors else "Valid",
        reasons=[f"{len(errors)} request(s) failed: {errors[0]}"] if errors else [], verdict=verdict,
        values=values, attempts=attempts, discarded_steps=sum(1 for a in attempts if not a.accepted),
        requests=[r.to_dict() for r in all_records],
        details={"sessions": {str(n): v for n, v in by_n.items()}, "turns": turns, "system_tokens": system_tokens,
                 "user_tokens": user_tokens, "reply_tokens": reply_tokens, "prompts": prompts,
                 "floors": list(floors), "time_scale": time_scale})


def agents_key(*, sessions: list[int], turns: int, system_tokens: int, user_tokens: int, reply_tokens: int,
               prompts: str) -> str:
    """Everything that defines what the experiment sends (the floors only read its results)."""
    source = Path(prompts).name.removesuffix(".jsonl")
    return (f"agents-P{source}-T{turns}-S{system_tokens}-U{user_tokens}-N{reply_tokens}-"
            f"n{'_'.join(str(n) for n in sorted(set(sessions)))}")


def agents_value(floor: float) -> str:
    return f"agents_above_{floor:g}_tok_s"


def value_direction(name: str) -> int | None:
    """+1 where higher is better, -1 where lower is, None for a value that is not compared."""
    if name.startswith(("agents_above_", "slowest_agent_tok_s_")):
        return 1
    return VALUE_DIRECTIONS.get(name)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000.0 * seconds


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def _g1(value: float | None) -> str:
    return "?" if value is None else f"{value:,.1f}"
