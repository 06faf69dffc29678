"""What a cell is, what it produced, and the pure arithmetic from raw request records to its columns.

Long (about 870 lines): the cell's typed reasons (each with its message and hint, a closed set), the step
evidence and the queue diagnosis that reads it, and the spec and result models; the arithmetic from records
to columns is figures.py."""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from campaign.core import stats
from campaign.http.client import RequestRecord
from campaign.measure import slo
from campaign.measure.cachestate import CacheState
from campaign.measure.judged import MIN_EFFECT
from campaign.measure.openloop import Arrival
from campaign.measure.prompts import prompt_source
from campaign.measure.slo import Slo
from campaign.measure.steady import Steadiness
from campaign.measure.traces import TraceRequest, TraceSlice, mean_rate

# rate: open-loop arrivals at a request rate (openloop.py), judged against a service level (slo.py).
Phase = Literal["prefill", "decode", "rate"]
DecodeMode = Literal["sustained", "fixed"]
# cold: every request a fresh prompt, so TTFT is its prefill plus queueing behind the other prefills.
# warm (seed 004's): each stream's prompt is cached by a one-token request first and reused, so TTFT mostly
# excludes prefill and a replacement request costs almost no prefill.
TTFTMode = Literal["cold", "warm"]
PromptEndpoint = Literal["completions", "chat"]
SESSIONS_CHAT = ("sessions go to the completions endpoint (token ids, each turn exactly its length); the "
                 "agents experiment runs chat sessions with the server's own replies")
TTFT_MODE_TEXT = {"cold": "cold TTFT: fresh prompts, prefill and queueing included",
                  "warm": "warm TTFT: prompts cached first, prefill mostly excluded (seed 004's method)"}
Status = Literal["Valid", "Over capacity", "Contaminated", "Failed", "Invalid"]

# A client that used more than this share of one core may have measured itself, not the server.
CLIENT_CPU_LIMIT = 0.90
# A sustained window whose client's stalls could move its figures by more than this share (figures.stall_error:
# a token stamped late by a stall may cross an edge of the window, a stream's rate moves with its own ends'
# stamps) as much as the smallest change a verdict acts on (judged.MIN_EFFECT). Seen at time scale 5 on a host
# starved by three CPU hogs: stalls of 90-180 ms in a 0.8 s wall window read stream tok/s 6-34% low, while
# windows whose longest stall was 1-4 ms read within 0.5% of simulated time.
STALL_SHARE = MIN_EFFECT


class Reason(StrEnum):
    """Why a cell is not Valid (or, a caveat, what a Valid cell cannot say): a closed set of cases
    (hyperfine's warnings are the model). Each finding carries
    its code, a message built from the step's own figures, and the code's hint; consumers match codes, never text.
    """

    REQUEST_ERRORS = "request_errors"
    CLAMPED = "clamped"
    PREFIX_CACHE_HITS = "prefix_cache_hits"
    PREEMPTIONS = "preemptions"
    ABOVE_MAX_NUM_SEQS = "above_max_num_seqs"
    QUEUED_SCHEDULER_CAP = "queued_scheduler_cap"
    QUEUED_KV_CACHE = "queued_kv_cache"
    QUEUED = "queued"   # queued, and the cause could not be told (format 2 stored every queued cell so)
    FEWER_ACTIVE = "fewer_active"
    CLIENT_SATURATED = "client_saturated"
    # A caveat (format 19): a sustained window whose client's stalls could move its figures past a verdict's
    # smallest change (measured again, up to three times; the cleanest attempt stands, saying how far).
    CLIENT_STALLED = "client_stalled"
    # A caveat (format 19): a time-scaled simulator that fell behind its clock past a verdict's smallest change.
    SIM_BEHIND = "sim_behind"
    GPU_THROTTLED = "gpu_throttled"
    OVER_CAPACITY = "over_capacity"
    OVER_WINDOW = "over_window"
    CONTAMINATED = "contaminated"
    SERVER_DIED = "server_died"
    PROMPTS_UNAVAILABLE = "prompts_unavailable"
    SCHEDULE_BEHIND = "schedule_behind"
    CACHE_NOT_RESET = "cache_not_reset"
    # Experiments (study.py): the client did not deliver the step's premise, or the server's gauges contradict
    # what the client read.
    SENDS_SPREAD = "sends_spread"
    READS_UNORDERED = "reads_unordered"
    GAUGES_DISAGREE = "gauges_disagree"
    # Caveats a Valid cell may carry (CAVEATS): its figures stand, but a conclusion must not be drawn from them.
    SPEC_RANDOM_PROMPTS = "spec_random_prompts"
    NOT_STEADY = "not_steady"
    # A sustained window in which no stream received a token (format 18 and on).
    NO_TOKENS_IN_WINDOW = "no_tokens_in_window"
    # A caveat (format 19): a rate cell whose server fell behind the arrivals; its latencies are a growing queue's.
    SERVER_FELL_BEHIND = "server_fell_behind"
    # A caveat (format 20): the client's mean TTFT is past the server's own by more than a client's path adds.
    CLIENT_TTFT_OVER_SERVER = "client_ttft_over_server"


REASON_HINTS: dict[Reason, str] = {
    Reason.REQUEST_ERRORS: "the first error is quoted; the raw request records hold every one",
    Reason.CLAMPED: "prompt + reply exceed the context window: lower the context or max_tokens",
    Reason.PREFIX_CACHE_HITS: "another client may be sending the same prompts, or the cache held them before the step: "
                              "the step was meant to share nothing beyond what it shares on purpose",
    Reason.PREEMPTIONS: "the KV cache ran out: fewer streams, shorter contexts, or more gpu-memory-utilization",
    Reason.ABOVE_MAX_NUM_SEQS: "raise max-num-seqs, or measure at most that many streams",
    Reason.QUEUED_SCHEDULER_CAP: "raise max-num-seqs, or measure at most as many streams as it runs",
    Reason.QUEUED_KV_CACHE: "fewer streams, a shorter context, or more KV cache (gpu-memory-utilization)",
    Reason.QUEUED: "pass max-num-batched-tokens and max-num-seqs in the profile (to `campaign probe`: its options "
                   "of those names), and check for other clients",
    Reason.FEWER_ACTIVE: "the client could not keep every stream busy (errors, or a slow client)",
    Reason.CLIENT_SATURATED: "run the client on a quieter or bigger machine, or on more client processes",
    Reason.SIM_BEHIND: "lower the time scale (CAMPAIGN_SIM_TIME_SCALE), or measure on a quieter host (the window "
                       "was measured up to three times; this is the cleanest)",
    Reason.CLIENT_STALLED: "measure on a quieter or bigger client machine, or at a lower time scale against the "
                           "simulator (the window was measured up to three times; this is the cleanest)",
    Reason.GPU_THROTTLED: "check cooling and power limits (nvidia-smi -q -d PERFORMANCE) and measure again",
    Reason.OVER_CAPACITY: "not run: fewer streams or a shorter context fit the KV cache",
    Reason.OVER_WINDOW: "not run: the prompt and reply do not fit max_model_len",
    Reason.CONTAMINATED: "another client used the server during every attempt: measure when it is idle",
    Reason.SERVER_DIED: "see the server log of the launch",
    Reason.PROMPTS_UNAVAILABLE: "text and chat prompts need vLLM's /tokenize and /detokenize; use prompts: random "
                                "(and the completions endpoint) against this server",
    Reason.SCHEDULE_BEHIND: "the client could not send requests at the rate asked for: a lower rate, fewer "
                            "client-side costs (random prompts), or a quieter or bigger client machine",
    Reason.CACHE_NOT_RESET: "the step's prefix hits may include blocks cached before it: launch the server afresh "
                            "before the cell (a new repeat), or check for other clients holding requests",
    Reason.SENDS_SPREAD: "the client's host was too busy to send the requests together: measure on a quieter or "
                         "bigger client machine (the burst was measured again, up to three times)",
    Reason.READS_UNORDERED: "the client's host stalled while the burst's first requests ended and the queued ones "
                            "were seated: measure on a quieter or bigger client machine (the burst was measured "
                            "again, up to three times)",
    Reason.GAUGES_DISAGREE: "the server ran more requests at once than the client had in flight, which its "
                            "gauges cannot over-read: the client's timestamps are wrong (a stalled client host); "
                            "measure again on a quieter client machine",
    Reason.NO_TOKENS_IN_WINDOW: "the window fell inside the streams' prefill: lengthen window_s past one request's "
                                "prefill and reply, or use ttft: warm (the prompts cached first)",
    Reason.NOT_STEADY: "the window's average spans two regimes: a server still settling (measure after a warm-up "
                       "cell), a cooler or power-capped card (nvidia-smi -q -d PERFORMANCE), or a longer or lower "
                       "rate the server holds steadily",
    Reason.SERVER_FELL_BEHIND: "the offered load is past what this server holds: its latencies grow with the "
                               "schedule's length. A lower rate, or more capacity (KV cache, max-num-seqs, "
                               "max-num-batched-tokens); --find-max-rate brackets the rate it holds",
    Reason.CLIENT_TTFT_OVER_SERVER: "the TTFT is what a user sees through this path, not the server's: a proxy that "
                                    "buffers the stream (nginx's proxy_buffering), or a host too busy to pass it on "
                                    "(the client's, or the API server's before it counts the request); measure "
                                    "from a quieter host, or turn the buffering off",
    Reason.SPEC_RANDOM_PROMPTS: "measure speculative decoding on text: prompts: code or prose (or a FILE.jsonl of your "
                                "own), where the drafter has something to predict",
}


@dataclass(frozen=True)
class Finding:
    code: Reason
    message: str

    @property
    def hint(self) -> str:
        return REASON_HINTS[self.code]


@dataclass(frozen=True, kw_only=True)
class StepEvidence:
    """Everything the verdict on one measured step may look at; built without a server in tests."""

    phase: Phase
    mode: DecodeMode
    concurrency: int
    records: list[RequestRecord]
    prefix_cache_hits: float | None = None     # counter deltas over the step (None: not exported)
    preemptions: float | None = None
    waiting: tuple[float, ...] = ()            # sampled vllm:num_requests_waiting inside the window
    avg_active: float | None = None            # time-averaged streams in flight (the client's clock)
    avg_before_first_token: float | None = None  # ... of which sent but without a token yet (queued or prefill)
    client_cpu: float | None = None            # the busiest client event loop thread's share of one core
    max_num_seqs: int | None = None            # the scheduler cap as launched
    shares_prefixes: bool = False              # warm TTFT: prompts are cached on purpose, hits are expected
    # Chat: prompt-cache hits the chat template itself earns (a default system prompt or date header that every
    # request starts with, in whole blocks): expected, not another client's traffic.
    template_hits: float = 0.0
    gpu_throttled: str | None = None           # why NVML says the GPU was held back during the step
    context_tokens: int = 0                    # each request's prompt
    max_num_batched_tokens: int | None = None  # the chunk: prompt tokens plus decodes one engine step may take
    running: tuple[float, ...] = ()            # sampled vllm:num_requests_running inside the window
    kv_usage: tuple[float | None, ...] = ()    # vllm:kv_cache_usage_perc (0-1) of the same samples (None: absent)
    decode_tokens_per_seq: int = 1             # tokens a decoding sequence takes from the chunk: 1 + draft tokens
    behind_schedule: str | None = None         # rate cells: how the client fell behind its arrival schedule
    cache_problem: str | None = None           # rate cells: why the prefix cache was not left empty before it
    implied_hits: int | None = None            # trace cells: the most its shared blocks let the cache serve
    prefix_cache_queries: float | None = None  # the server's prompt tokens looked up (a re-query counts again)
    window_tokens: float | None = None         # sustained cells: tokens the streams received inside the window
    window_s: float | None = None              # ... and the window's length, in the hardware's seconds
    # ... how far the client loop's stalls could move its figures, as a share (figures.stall_error), and its
    # longest stall inside it, in the hardware's seconds
    stall_error: float | None = None
    client_stall_s: float | None = None


# The first cell of a launch measured again at its end: slower by more than this, and it was measured cold.
WARM_TOLERANCE = 0.05


def primary_metric(phase: Phase) -> str:
    """The figure a cell is judged on first: prompt tok/s for prefill, total tok/s for decode, goodput (requests
    a second that met the service level) for an open-loop rate."""
    return {"prefill": "prompt_tok_s", "decode": "total_tok_s", "rate": "goodput_rps"}[phase]


def not_warm(first: CellResult, again: CellResult, *, tolerance: float = WARM_TOLERANCE) -> str | None:
    """Why the launch's first cell was measured cold, from its re-measurement at the launch's end; None if it
    was not (or the two cannot be compared). One-sided: a cold server is slower, never faster."""
    metric = primary_metric(first.phase)
    a, b = getattr(first, metric), getattr(again, metric)
    if first.status != "Valid" or again.status != "Valid" or not a or not b:
        return None
    change = (a - b) / b
    if change >= -tolerance:
        return None
    return (f"{metric} {a:,.1f} when measured first, {b:,.1f} when measured again at the end of the launch "
            f"({100 * change:+.1f}%, beyond the {100 * tolerance:g}% a warm server allows)")


# Findings that leave a cell Valid: its figures stand, with what they cannot be read as.
CAVEATS = frozenset({Reason.SPEC_RANDOM_PROMPTS, Reason.NOT_STEADY, Reason.SERVER_FELL_BEHIND, Reason.CLIENT_STALLED,
                     Reason.SIM_BEHIND, Reason.CLIENT_TTFT_OVER_SERVER})

# What a client's own path may add to the server's TTFT (vLLM's histogram counts from when its front end takes
# the request in, after the API server parsed and tokenized it, to the first token's output): the socket, that
# parsing, the stream's framing and the client's loop. On this machine the simulator's gap is 0; the real CPU
# build's 2-4 ms in prefill and fixed cells, but 2-78 ms in sustained ones (its API server waits for the busy
# host before it counts a replacement request in; the demo, 2026-12-07), and 94 ms once beside the suite's two
# workers. A proxy that buffers the stream holds the first token for the reply's length, a starved client host
# as long as it stalls: past 200 ms, and past 10%, it is no server's own work.
CLIENT_TTFT_SLACK_MS = 200.0
CLIENT_TTFT_SLACK_SHARE = 0.10


def client_ttft_finding(server_ttft_ms: float | None, client_ttft_ms: float | None,
                        time_scale: float = 1.0) -> Finding | None:
    """The caveat `client_ttft_over_server` where the client's mean TTFT over a step's requests is past the
    server's own over the same requests by more than CLIENT_TTFT_SLACK_MS (of the client's wall clock: a
    time-scaled simulator's hardware ms are `time_scale` of them) and CLIENT_TTFT_SLACK_SHARE of it; None
    where either is unknown or the gap is within that. Both in the hardware's ms."""
    if server_ttft_ms is None or client_ttft_ms is None:
        return None
    gap = client_ttft_ms - server_ttft_ms
    allowed = max(CLIENT_TTFT_SLACK_MS * time_scale, CLIENT_TTFT_SLACK_SHARE * server_ttft_ms)
    if gap <= allowed:
        return None
    return Finding(Reason.CLIENT_TTFT_OVER_SERVER,
                   f"the client's mean TTFT, {client_ttft_ms:,.0f} ms, is {gap:,.0f} ms over the server's own "
                   f"{server_ttft_ms:,.0f} ms for the same requests (its TTFT histogram), more than the "
                   f"{allowed:,.0f} ms a client's path adds")


def spec_random_prompts() -> Finding:
    """Speculative decoding measured on random token ids (measure's and the virtual replay's reason)."""
    return Finding(Reason.SPEC_RANDOM_PROMPTS, (
        "speculative decoding measured on random token ids: a drafter has nothing to predict in them, so the "
        "acceptance and the speed here are not what text will get"))


def template_hits(requests: int, template_prefix: int, block: int | None) -> float:
    """Cache hits a chat step may get from its template's fixed opening: whole blocks of it per request."""
    return float(requests * (template_prefix // block * block if block else template_prefix))


def result_base(spec: CellSpec) -> dict[str, Any]:
    """The fields every CellResult of `spec` starts from, whatever came of it (a prefill asks one token)."""
    return {"spec": spec, "phase": spec.phase, "context_tokens": spec.context_tokens,
            "concurrency": spec.concurrency, "label": spec.label,
            "max_tokens": 1 if spec.phase == "prefill" else spec.max_tokens}


def longest_request(spec: CellSpec) -> tuple[int, int]:
    """The longest prompt and the longest reply one request of `spec` asks for (a rate cell's lengths vary)."""
    if spec.phase == "rate":
        return spec.lengths_range()[1]
    return spec.context_tokens, result_base(spec)["max_tokens"]


def past_model_window(spec: CellSpec, model_window: int | None) -> str:
    """Why a server that died under `spec` may have: its longest request reaches past the model's own window
    (the startup log's `model_window`, stated where max-model-len was stretched past it with
    VLLM_ALLOW_LONG_MAX_MODEL_LEN), where positions can crash the engine (public reports: a CUDA device-side
    assert at the first such request). "" when it does not, or the window is not known."""
    prompt, reply = longest_request(spec)
    if model_window is None or prompt + reply <= model_window:
        return ""
    return (f"; its longest request (prompt {prompt:,} + reply {reply:,} tokens) reaches past the model's own "
            f"window of {model_window:,} tokens, which max-model-len stretches with VLLM_ALLOW_LONG_MAX_MODEL_LEN: "
            "positions past it can crash the engine")


def findings_fields(findings: list[Finding]) -> dict[str, Any]:
    """`reasons` and `reason_codes` of a CellResult from findings."""
    return {"reasons": [f.message for f in findings], "reason_codes": [f.code for f in findings]}


# A sustained cell keeps C streams in the server's hands: on average at least this share of them.
ACTIVE_SHARE = 0.95
# KV-cache usage at or above this while requests wait: they wait for blocks.
KV_FULL = 0.95
# Streams without a first token, time-averaged on the client's clock, below which no request was held back
# through the window: a cap of k < C seats, or a queue for blocks, keeps C - k >= 1 streams tokenless all along.
HELD_BACK_STREAMS = 0.5


def replacements_per_step(e: StepEvidence) -> int | None:
    """How many fresh prompts one engine step can prefill beside C - 1 decodes (None: chunk not known)."""
    if e.max_num_batched_tokens is None or e.context_tokens <= 0:
        return None
    decodes = (e.concurrency - 1) * e.decode_tokens_per_seq
    return max(0, (e.max_num_batched_tokens - decodes) // e.context_tokens)


def queue_figures(e: StepEvidence) -> str:
    """The queue inside the window: streams without a first token on the client's clock (exact), and the
    server's gauges as sampled (a few samples: a rough split of those into waiting and running)."""
    running, waiting = stats.mean(e.running), stats.mean(e.waiting)
    parts = [f"{running:.1f} running" if running is not None else "",
             f"{waiting:.1f} waiting" if waiting is not None else "",
             f"up to {max(e.waiting):g} waiting" if e.waiting else ""]
    exact = (f"{e.avg_before_first_token:.1f} of {e.concurrency} streams on average had no token yet (queued or in "
             "prefill, client clock); " if e.avg_before_first_token is not None else "")
    return f"{exact}the server's gauges read " + ", ".join(p for p in parts if p) + f" ({len(e.waiting)} samples)"


def queue_cause(e: StepEvidence) -> Finding | None:
    """Requests waited in the server's queue through a sustained window: why, and whether that breaks the cell.

    A finished request's replacement must be prefilled. When C fresh prompts do not fit one step's chunk
    beside the decodes, replacements that arrive together wait for the chunk, one step each, while the server
    runs (about) all the others: that is how the server works at this shape, so the cell stays Valid (the note
    reports the queue). Requests waiting for KV blocks, or for a seat under the scheduler cap, are requests
    the server will not run: Invalid, saying which. None: Valid."""
    figures = queue_figures(e)
    # KV use while requests waited: a full cache then means they waited for blocks.
    kv_waiting = [kv for kv, w in zip(e.kv_usage, e.waiting, strict=False) if kv is not None and w > 0]
    kv_max = max(kv_waiting) if kv_waiting else None
    if kv_max is not None and kv_max >= KV_FULL:
        return Finding(Reason.QUEUED_KV_CACHE, f"requests waited for KV-cache blocks: the cache was "
                                               f"{100 * kv_max:.0f}% full while they waited; {figures}")
    per_step = replacements_per_step(e)
    if per_step is None:
        return Finding(Reason.QUEUED, f"requests waited in the server queue through the window, {figures}; the "
                                      "chunk size (max-num-batched-tokens) is not known, so the cause cannot be told")
    seated = _seated(e)
    if _chunk_explains(e, per_step):
        return None
    if _transient(e):
        return None  # requests that had just arrived waited for the next step
    chunk = (f"the {e.max_num_batched_tokens:,}-token chunk prefills all {e.concurrency} fresh prompts in one step"
             if per_step >= e.concurrency else
             f"fewer than {e.concurrency} ran in every sample, more than the {e.max_num_batched_tokens:,}-token "
             "chunk explains")
    if kv_max is None or seated:
        known = [chunk, f"max-num-seqs {e.max_num_seqs} seats them all" if seated else "",
                 f"the KV cache had room ({100 * kv_max:.0f}% used)" if kv_max is not None else
                 "KV-cache usage was not sampled"]
        return Finding(Reason.QUEUED, "requests waited in the server queue through the window and nothing known "
                                      f"explains it: {'; '.join(k for k in known if k)}; {figures}")
    running = stats.mean(e.running)
    return Finding(Reason.QUEUED_SCHEDULER_CAP,
                   f"requests waited for a seat: {chunk} and the KV cache had room ({100 * kv_max:.0f}% used), so "
                   "the scheduler capped the running requests" + (f" near {running:.0f}" if running is not None else "")
                   + f"; {figures}")


def _chunk_explains(e: StepEvidence, per_step: int) -> bool:
    """The chunk cannot prefill every replacement at once, and the server still ran about all C (or the cap
    seats them all): the queue is replacements waiting for the chunk."""
    near_c = bool(e.running) and (max(e.running) >= e.concurrency - 1
                                  or (stats.mean(e.running) or 0.0) >= ACTIVE_SHARE * e.concurrency)
    return per_step < e.concurrency and (_seated(e) or near_c or not e.running)


def _seated(e: StepEvidence) -> bool:
    """The launched scheduler cap seats all C streams (False when it was left to vLLM's default)."""
    return e.max_num_seqs is not None and e.concurrency <= e.max_num_seqs


def _transient(e: StepEvidence) -> bool:
    """Requests that had just arrived wait for the next engine step: a sample catches some now and then, but
    the server ran all C at other samples. Requests held back by a cap wait in every sample, C never running.
    The client's exact figure outweighs a few samples: a held-back request has no token all the while, so
    fewer than half a stream without one on average means the samples each caught fresh arrivals (two
    samples of a one-second window on a loaded host did, and called it the scheduler cap)."""
    exact = e.avg_before_first_token
    return (min(e.waiting, default=0.0) == 0 or (bool(e.running) and max(e.running) >= e.concurrency)
            or (exact is not None and exact < HELD_BACK_STREAMS))


def queue_note(e: StepEvidence) -> str | None:
    """For a Valid sustained cell whose requests queued: why that is how the server works, and the figures."""
    if e.phase != "decode" or e.mode != "sustained" or not stats.median(list(e.waiting)):
        return None
    per_step = replacements_per_step(e)
    if per_step is None or queue_cause(e) is not None:
        return None
    if not _chunk_explains(e, per_step):
        return f"requests that had just arrived waited for the next engine step: {queue_figures(e)}"
    fit = f"{per_step} fresh prompt(s)" if per_step else "less than one fresh prompt"
    return (f"replacement requests queued for the prefill chunk ({e.max_num_batched_tokens:,} tokens hold {fit} of "
            f"{e.context_tokens:,} beside the decodes), as the server is meant to: {queue_figures(e)}")


def requeried(e: StepEvidence) -> float:
    """Prompt tokens the server looked up more than once: a request that waited for blocks, or was preempted, is
    looked up again, its prompt counted again in the queries and its cached blocks in the hits (hits the trace
    does not imply)."""
    sent = sum(r.counted_prompt_tokens for r in e.records if r.status == 200)
    return max(0.0, (e.prefix_cache_queries or 0.0) - sent)


def verdict(e: StepEvidence) -> tuple[Status, list[Finding]]:
    """Pure: a step's evidence -> its status and the findings behind it (Failed for request errors, Invalid
    for any other finding, else Valid)."""
    found: list[Finding] = []
    records = e.records
    clamped = [r for r in records if r.clamped_to is not None]
    errors = [r for r in records if not r.ok and r.clamped_to is None]
    if errors:
        found.append(Finding(Reason.REQUEST_ERRORS,
                             f"{len(errors)} of {len(records)} requests failed: {errors[0].error}"))
    if clamped:
        found.append(Finding(Reason.CLAMPED, f"{len(clamped)} request(s) cut short by the server: max_tokens "
                                             f"{clamped[0].max_tokens} clamped to {clamped[0].clamped_to} because "
                                             "prompt + reply exceed the context window"))
    if e.prefix_cache_hits and e.prefix_cache_hits > e.template_hits and not e.shares_prefixes:
        found.append(Finding(Reason.PREFIX_CACHE_HITS, f"prefix cache served {e.prefix_cache_hits:.0f} tokens in "
                                                       "a step designed to share nothing" + (
                                                           f" (the chat template's own prefix explains "
                                                           f"{e.template_hits:.0f})" if e.template_hits else "")))
    if e.prefix_cache_hits and e.implied_hits is not None and (
            e.prefix_cache_hits > e.implied_hits + e.template_hits + requeried(e)):
        found.append(Finding(Reason.PREFIX_CACHE_HITS, f"prefix cache served {e.prefix_cache_hits:.0f} tokens, more "
                                                       f"than the {e.implied_hits} the trace's shared blocks make "
                                                       "reusable: blocks cached before the step were served"))
    if e.preemptions and e.phase != "rate":  # at an offered rate, preemption is how the server copes: a result
        found.append(Finding(Reason.PREEMPTIONS,
                             f"{e.preemptions:.0f} preemption(s) during the step: the KV cache ran out"))
    sustained = e.phase == "decode" and e.mode == "sustained"
    cap = e.max_num_seqs
    if e.phase == "decode" and cap is not None and e.concurrency > cap:
        found.append(Finding(Reason.ABOVE_MAX_NUM_SEQS, f"{e.concurrency} requests at once exceed max-num-seqs "
                                                        f"{cap}: at most {cap} run, the rest queue"))
    elif sustained and stats.median(list(e.waiting)):
        cause = queue_cause(e)
        if cause is not None:
            found.append(cause)
    if sustained and e.window_tokens == 0:
        # Zero is what the server sent then, not its decode speed: the window measured a wait, not a decode.
        waited = (f"; {e.avg_before_first_token:.1f} of {e.concurrency} streams on average had no token yet"
                  if e.avg_before_first_token is not None else "")
        found.append(Finding(Reason.NO_TOKENS_IN_WINDOW, "no stream received a token inside the "
                             + (f"{e.window_s:g} s " if e.window_s is not None else "") + "window, so it measured "
                             f"no decode{waited} (fresh {e.context_tokens:,}-token prompts in prefill)"))
    # First of the client's findings: a loop that stood still also leaves streams idle (fewer_active).
    if sustained and e.stall_error is not None and e.stall_error > STALL_SHARE:
        longest = f" (its longest {1000 * e.client_stall_s:.0f} ms, the hardware's)" if e.client_stall_s else ""
        by = "by any amount" if math.isinf(e.stall_error) else f"by up to {e.stall_error:.0%}"
        found.append(Finding(Reason.CLIENT_STALLED,
                             f"the client's event loop stood still as the window's tokens arrived{longest}: "
                             f"stamped late, they could move the window's rates {by}"))
    if sustained and e.avg_active is not None and e.avg_active < ACTIVE_SHARE * e.concurrency:
        found.append(Finding(Reason.FEWER_ACTIVE,
                             f"the client kept only {e.avg_active:.1f} of {e.concurrency} streams active "
                             f"(a sustained cell needs {100 * ACTIVE_SHARE:g}% of them on average)"))
    if e.client_cpu is not None and e.client_cpu > CLIENT_CPU_LIMIT:
        found.append(Finding(Reason.CLIENT_SATURATED,
                             f"the client used {e.client_cpu:.0%} of a core: it may have measured itself"))
    if e.gpu_throttled:
        found.append(Finding(Reason.GPU_THROTTLED, f"the GPU was throttled during the step: {e.gpu_throttled}"))
    if e.behind_schedule:
        found.append(Finding(Reason.SCHEDULE_BEHIND, e.behind_schedule))
    if e.cache_problem:
        found.append(Finding(Reason.CACHE_NOT_RESET, e.cache_problem))
    status: Status = "Failed" if errors else ("Invalid" if any(f.code not in CAVEATS for f in found) else "Valid")
    return status, found


class Sessions(BaseModel):
    """Open-loop agent traffic (format 8): a rate cell's requests are the turns of `count` sessions at a time,
    each turn the cell's one shared system prompt, the session's history so far and a new user message.
    Request i is turn (i // count) mod turns of live session i mod count; after its last turn a session gives
    way to a fresh one. A reply in the history is text standing in for the model's (the schedule never waits
    for a reply), so a turn's prompt extends the previous turn's prompt and the prefix cache can serve it, as
    it serves a coding agent's growing conversation. Turn k is system + k x (user + reply) + user tokens long,
    the reply being the cell's max_tokens."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    count: int = Field(default=8, gt=0, description="sessions live at once (each arrival goes to the next one)")
    turns: int = Field(default=4, gt=0, description="turns of one session, then a fresh session takes its place")
    system_tokens: int = Field(default=2000, gt=0, description="the system prompt every session shares")
    user_tokens: int = Field(default=200, gt=0, description="each new user message")

    def turn(self, index: int) -> tuple[int, int]:
        """Request `index`'s (session, turn): sessions numbered from 0 in the order they start."""
        slot, round_ = index % self.count, index // self.count
        return (round_ // self.turns) * self.count + slot, round_ % self.turns

    def length(self, turn: int, reply_tokens: int) -> int:
        return self.system_tokens + turn * (self.user_tokens + reply_tokens) + self.user_tokens

    @property
    def key(self) -> str:
        return f"A{self.count}x{self.turns}s{self.system_tokens}u{self.user_tokens}"


class CellSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    phase: Phase
    context_tokens: int = Field(gt=0)
    concurrency: int = Field(default=1, gt=0)
    mode: DecodeMode = "sustained"
    max_tokens: int = Field(default=256, gt=0)
    window_s: float = Field(default=30.0, gt=0)
    warmup_s: float = Field(default=2.0, ge=0)
    ttft: TTFTMode = "cold"
    # Fixed mode: rounds of C requests until at least this many requests and seconds (MLPerf sets minimums
    # too), so a single-stream cell rests on more than one request.
    min_requests: int = Field(default=1, ge=1)
    min_seconds: float = Field(default=0.0, ge=0)
    # What the prompts are made of (random token ids, code, prose, or a FILE.jsonl's texts) and which endpoint
    # they go to (chat: through the chat template and the server's parsers). Format 5.
    prompts: str = "random"
    endpoint: PromptEndpoint = "completions"
    # Rate cells (format 6): requests arrive at `request_rate` a second (None: as fast as `max_concurrency`
    # allows, a closed loop) for `duration_s`, in the hardware's seconds; `min_requests` raises the count. An
    # optional cap on requests in flight; prompt and reply lengths drawn uniformly within +-`range_ratio` of
    # context_tokens and max_tokens (vLLM bench's random-range-ratio); an SLO that judges them; early_stop: stop
    # sending once the SLO has certainly failed (a capacity search's probes; the requests sent are drained; a
    # closed loop that stops early is decided by its count, its first wave and min_requests more, not a span).
    request_rate: float | None = Field(default=None, gt=0)
    arrival: Arrival = "poisson"
    burstiness: float = Field(default=1.0, gt=0)
    duration_s: float = Field(default=30.0, gt=0)
    max_concurrency: int | None = Field(default=None, gt=0)
    range_ratio: float = Field(default=0.0, ge=0, lt=1)
    slo: Slo | None = None
    early_stop: bool = False
    # Rate cells of agent traffic (format 8): prompt lengths come from the sessions' turns, context_tokens is
    # the first turn's.
    sessions: Sessions | None = None
    # Trace cells (format 14): a rate cell whose arrivals and lengths are a trace's (traces.py); request_rate
    # is the slice's mean rate, duration_s its span, context_tokens and max_tokens its mean lengths.
    trace: TraceSlice | None = None

    _prompts = field_validator("prompts")(prompt_source)

    @model_validator(mode="after")
    def _trace_shape(self) -> CellSpec:
        if self.trace is None:
            return self
        if self.phase != "rate" or self.request_rate is None:
            raise ValueError("a trace shapes a rate cell's arrivals; this cell is not one")
        if self.sessions is not None or self.range_ratio:
            raise ValueError("a trace gives each request its own length: no sessions or range_ratio with it")
        if self.endpoint == "chat" or self.prompts != "random":
            raise ValueError("a trace's prompts are token ids of its exact lengths: prompts random, endpoint "
                             "completions")
        return self

    @model_validator(mode="after")
    def _sessions_shape(self) -> CellSpec:
        if self.sessions is None:
            return self
        if self.phase != "rate":
            raise ValueError("sessions shape a rate cell's requests; this cell is not one")
        if self.endpoint == "chat":
            raise ValueError(SESSIONS_CHAT)
        if self.range_ratio:
            raise ValueError("sessions give each turn its own length: range_ratio is 0 with them")
        if self.context_tokens != self.sessions.length(0, self.max_tokens):
            raise ValueError("a sessions cell's context_tokens is its first turn's length (system + user tokens)")
        return self

    @classmethod
    def from_trace(cls, sliced: TraceSlice, requests: list[TraceRequest], *, slo: Slo | None = None,
                   max_concurrency: int | None = None) -> CellSpec:
        """A trace slice's cell (traces.plan): its mean rate, the span that rate gives its requests, its mean
        lengths."""
        rate = mean_rate(requests)
        return cls(phase="rate", trace=sliced, request_rate=rate, duration_s=len(requests) / rate,
                   context_tokens=max(1, round(sum(r.input_tokens for r in requests) / len(requests))),
                   max_tokens=max(1, round(sum(r.output_tokens for r in requests) / len(requests))),
                   max_concurrency=max_concurrency, slo=slo)

    @property
    def shares_prefixes(self) -> bool:
        """Its prompts share prefixes on purpose (agent sessions, a trace's shared blocks): cache hits are what
        it measures, not contamination."""
        return self.sessions is not None or (self.trace is not None and self.trace.block_size is not None)

    def lengths_range(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """The shortest and longest (prompt, reply) a rate cell sends: within +-range_ratio of its lengths, or
        from a session's first turn to its last."""
        if self.sessions is not None:
            longest = self.sessions.length(self.sessions.turns - 1, self.max_tokens)
            return (self.context_tokens, self.max_tokens), (longest, self.max_tokens)
        if self.trace is not None and self.trace.longest is not None:
            # Its mean lengths, and its longest prompt with that prompt's reply (what the window must hold).
            return (self.context_tokens, self.max_tokens), self.trace.longest
        r = self.range_ratio

        def span(n: int) -> tuple[int, int]:
            return max(1, math.ceil(n * (1 - r))), max(1, math.floor(n * (1 + r)))

        (p_lo, p_hi), (n_lo, n_hi) = span(self.context_tokens), span(self.max_tokens)
        return (p_lo, n_lo), (p_hi, n_hi)

    @model_validator(mode="after")
    def _rate_has_a_limit(self) -> CellSpec:
        if self.phase == "rate" and self.request_rate is None and self.max_concurrency is None:
            raise ValueError("a rate of inf (as fast as possible) needs max_concurrency: the requests in flight at "
                             "once, or nothing limits it")
        return self

    @property
    def label(self) -> str:
        """Every number is labelled: one stream is what a user feels, many is what the card produces, and an
        offered rate is what a service sees."""
        if self.phase == "rate":
            return "open-loop"
        return "single-stream" if self.concurrency == 1 else "aggregate"

    @property
    def seed(self) -> int:
        """The arrival schedule's and the lengths' seed, from what the cell sends: every launch (and every
        variant) of a rate cell sees the same arrivals, as an A/B should. The rate and early_stop are left out
        (common random numbers): rate cells of one shape draw the same unit-rate gaps, scaled to each rate, so
        a capacity search's probes, or a matrix's rates, differ by their rate alone, and a verdict near the
        edge moves with the rate, not with the draw."""
        shape = self.key
        if self.phase == "rate" and self.request_rate is not None:
            shape = self.model_copy(update={"request_rate": 1.0, "early_stop": False}).key
        return int.from_bytes(hashlib.sha256(shape.encode()).digest()[:8], "big")

    @property
    def key(self) -> str:
        if self.phase == "prefill":
            return f"prefill-L{self.context_tokens}{self._text_suffix}"
        if self.phase == "rate" and self.trace is not None:
            base = f"rate-{self.trace.key}" + (f"-C{self.max_concurrency}" if self.max_concurrency else "")
            base += f"-S{self.slo.key}" if self.slo else ""
            return base + ("-X" if self.early_stop else "")
        if self.phase == "rate":
            rate = "inf" if self.request_rate is None else f"{self.request_rate:g}"
            base = f"rate-L{self.context_tokens}-N{self.max_tokens}-Q{rate}-{self.arrival}"
            base += f"{self.burstiness:g}" if self.arrival == "gamma" else ""
            base += f"-D{self.duration_s:g}"
            base += f"-C{self.max_concurrency}" if self.max_concurrency else ""
            base += f"-R{self.min_requests}" if self.min_requests > 1 else ""
            base += f"-V{self.range_ratio:g}" if self.range_ratio else ""
            base += f"-{self.sessions.key}" if self.sessions else ""
            base += f"-S{self.slo.key}" if self.slo else ""
            base += "-X" if self.early_stop else ""
            return base + self._text_suffix
        base = f"decode-{self.mode}-L{self.context_tokens}-C{self.concurrency}-N{self.max_tokens}"
        # The window is part of a sustained cell's definition: 10 s and 30 s windows are not comparable.
        base = f"{base}-W{self.window_s:g}" if self.mode == "sustained" else base
        if self.mode == "fixed" and (self.min_requests > 1 or self.min_seconds > 0):
            base += f"-R{self.min_requests}" + (f"s{self.min_seconds:g}" if self.min_seconds else "")
        base = f"{base}-Twarm" if self.ttft == "warm" else base
        return base + self._text_suffix

    @property
    def _text_suffix(self) -> str:
        """Random ids on /v1/completions (every key before format 5) add nothing; text and chat are named."""
        stem = re.sub(r"[^A-Za-z0-9_.]+", "_", Path(self.prompts).name.removesuffix(".jsonl"))
        source = "" if self.prompts == "random" else f"-P{stem}"
        return source + ("-Echat" if self.endpoint == "chat" else "")


class Attempt(BaseModel):
    """One try at a step; a discarded one says why and by how many tokens."""

    model_config = ConfigDict(extra="forbid")

    accepted: bool = Field(description="whether the cell stands on this attempt")
    reason: str | None = Field(default=None, description="why it was discarded, in words")
    code: Reason | None = Field(
        default=None, description="why it was discarded, as a code (format 14): contaminated for foreign traffic; "
                                  "fewer_active, schedule_behind or client_stalled (format 19) where the client's "
                                  "host stalled it; None when "
                                  "accepted (and in older files)")
    expected_generation_tokens: int = Field(description="the tokens our requests were served (their usage)")
    counted_generation_tokens: float | None = Field(
        default=None, description="the server's generation-token counter over the attempt")
    expected_prompt_tokens: int = Field(description="our requests' prompt tokens (the server's count where it said it)")
    counted_prompt_tokens: float | None = Field(
        default=None, description="the server's prompt-token counter over the attempt")
    excess_tokens: int = Field(default=0, description="counted beyond ours: another client's tokens")


class CellResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    spec: CellSpec
    phase: Phase
    context_tokens: int
    concurrency: int
    label: str
    status: Status
    reasons: list[str] = Field(default_factory=list)
    # The Reason code of each entry of `reasons`, in the same order (cells stored before format 2 have none).
    reason_codes: list[Reason] = Field(default_factory=list)
    # What a reader should know that does not make the cell Invalid (e.g. tokens counted per chunk).
    notes: list[str] = Field(default_factory=list)
    total_tok_s: float | None = None
    # Median over requests of each one's tokens per second while it streamed: in a sustained window, one that
    # streams across an edge is timed from or to that edge, else from its first token inside (format 12).
    # Shown as "stream tok/s" (campaign/report/names.py), never "per request": it is neither seed 000's per
    # request figure (total_tok_s / concurrency, "total ÷ streams", prefill included) nor 1000 / tpot_ms.
    per_request_tok_s: float | None = None
    prompt_tok_s: float | None = None
    # Latency distributions (ms): the unsuffixed field is the median, then p90 and p99. TTFT per request;
    # inter-token latency per token (a read carrying k tokens after a gap g counts k gaps of g/k); time per
    # output token per request, (last token - first token) / (tokens - 1) over its whole reply, shown as TPOT
    # in ms and never as a rate (1000 / tpot_ms is not per_request_tok_s); end-to-end per request.
    ttft_ms: float | None = None
    ttft_p90_ms: float | None = None
    ttft_p99_ms: float | None = None
    itl_ms: float | None = None
    itl_p90_ms: float | None = None
    itl_p99_ms: float | None = None
    tpot_ms: float | None = None
    tpot_p90_ms: float | None = None
    tpot_p99_ms: float | None = None
    e2e_ms: float | None = None
    e2e_p90_ms: float | None = None
    e2e_p99_ms: float | None = None
    # What the latency figures rest on: requests with a first token, and inter-token gaps (one per token).
    latency_requests: int | None = None
    itl_samples: int | None = None
    avg_active: float | None = None
    # Sustained cells: streams sent but without a token yet (queued or in prefill), time-averaged over the
    # window on the client's clock; exact, unlike the server's sampled gauges below.
    avg_before_first_token: float | None = None
    completed: int | None = None
    output_tokens: int | None = None
    measured_s: float | None = None
    # Sustained cells: the window's bounds on the request records' clock (core.clock's seconds), so every
    # window figure can be recomputed from the raw records (format 4; None before, and for other modes).
    # Rate cells (format 6): the schedule's start and its nominal end (start + span) on the same clock.
    window: tuple[float, float] | None = None
    discarded_steps: int = 0
    discarded_tokens: int = 0
    max_tokens: int | None = None
    client_cpu: float | None = None
    # p99 of the client's stall samples, in ms, over the window (the step where there is none): each sample is
    # how late the controller's event loop ran a due timer, or the time the host kept its thread off a CPU since
    # the last sample (the kernel's count; from format 16's tool on), whichever is larger: the client's own
    # timing noise, which every latency it stamps carries (format 5).
    client_lag_p99_ms: float | None = None
    # The largest of them (format 13): one stall a p99 of a few hundred samples skips, yet all of a tail when
    # the tail is one moment's (streams in step read their tokens at once; see bench/truth._lag_slack_s).
    client_lag_max_ms: float | None = None
    # The server's own view of the step (format 15): vLLM's request histograms between the step's two scrapes,
    # each its sum over its count, in the hardware's ms (a simulator's are in simulated seconds): the mean
    # time to first token and the mean gap between a request's engine outputs, with how many first tokens they
    # counted (every request of the step, priming included); beside them the client's mean TTFT over the same
    # requests, so the difference is what the client's side adds (network, a proxy, its own loop). None where
    # the server exports no such histogram.
    server_first_tokens: int | None = None
    server_ttft_mean_ms: float | None = None
    server_itl_mean_ms: float | None = None
    client_ttft_mean_ms: float | None = None
    # The server's mean wait in its queue (format 19): vLLM's request_queue_time_seconds (from arrival to first
    # scheduled, observed as each request ends) over the same scrapes, in the hardware's ms; None where the
    # server exports no such histogram or nothing ended.
    server_queue_mean_ms: float | None = None
    running_median: float | None = None
    # A sustained window (format 19): how far the client's own stalls could move its figures, as a share
    # (figures.stall_error: tokens its event loop stamped late, carried across the window's edges or moving a
    # stream's ends); None where not measured (no window, client worker processes, a simulated clock).
    client_stall_bound: float | None = None
    # A time-scaled simulator's share of the window (or step) it fell behind its clock (format 19; its
    # behind_seconds_total against its busy seconds): past 3% the caveat sim_behind. None against a real server.
    sim_behind_share: float | None = None
    # The most requests the server's waiting gauge showed in a sustained window's samples, or (format 19) over
    # a rate cell's schedule.
    waiting_max: float | None = None
    # The server's gauges sampled inside a sustained window (a few samples; see `notes` for how many): mean
    # running and waiting requests, peak KV-cache use (0-1); a rate cell's mean waiting over its schedule.
    avg_running: float | None = None
    avg_waiting: float | None = None
    # Rate cells (format 19): when the server fell behind the arrivals for good, in the hardware's seconds
    # from the schedule's start (figures.fell_behind: its waiting gauge non-empty from then to the schedule's
    # end, and growing), and the requests still waiting at the schedule's end; None where it kept up.
    fell_behind_s: float | None = None
    waiting_at_end: float | None = None
    kv_usage_max: float | None = None
    preemptions: float | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    # A trace cell (format 14): the prompt tokens its shared blocks make reusable by a cache that keeps
    # everything and a prefix computed before the next arrives (traces.implied_hits, in the server's blocks),
    # beside the hits the server's counters saw; None for other cells or a trace without hash ids.
    trace_implied_hits: int | None = None
    # Rate cells (format 14): the prefix cache's state when the step began, and how it was known.
    cache_state: CacheState | None = None
    # Rate cells (format 14): the schedule's span interval by interval and whether it was steady (steady.py);
    # None for fewer than 50 requests, a closed loop decided by its count, or an early stop.
    steadiness: Steadiness | None = None
    # Energy per output token over the step, all GPUs (NVML's energy counter, else sampled power); None without
    # a GPU. Lower is better: a flag that saves energy at equal speed shows here.
    energy_j_per_token: float | None = None
    # Speculative decoding over the step, from the server's counters (bracketed like the token counters):
    # accepted / drafted tokens, 1 + accepted / drafts (vLLM's acceptance length), accepted / drafts.
    spec_acceptance_rate: float | None = None
    spec_mean_acceptance_length: float | None = None
    spec_mean_accepted: float | None = None
    # Every cell's rates, latencies and durations are the hardware's (rate cells from format 6, the others from
    # format 10; see hardware_units): a time-scaled simulator's figures converted back, and `time_scale` says
    # from what. The request records and `window` stay on the client's clock (core.clock), as measured.
    # Rate cells (format 6):
    # the rate asked for (None: as fast as the cap allows) and the rate the requests were sent at (requests
    # sent over the time their schedule took, as sent); requests planned (None: a closed loop), whether an
    # early stop ended the load, and a closed loop's first wave (left out of the latencies and the SLO);
    # goodput (requests a second that met every bound of the SLO, first send to last end; a closed loop's
    # first wave counts at the judged requests' share) and the share of the requests judged that met it;
    # whether the load held the SLO and each bound's figures; the client's lag behind its schedule (p99, ms)
    # and the requests the cap held back; requests in flight
    # (time-averaged, peak, and a series of (seconds from the first send, count)).
    request_rate: float | None = None
    achieved_rate_rps: float | None = None
    scheduled_requests: int | None = None
    early_stopped: bool | None = None
    ramp_requests: int | None = None
    goodput_rps: float | None = None
    slo_met_fraction: float | None = None
    slo_passed: bool | None = None
    slo_bounds: list[slo.BoundResult] = Field(default_factory=list)
    send_lag_p99_ms: float | None = None
    cap_waits: int | None = None
    avg_in_flight: float | None = None
    max_in_flight: int | None = None
    in_flight: list[tuple[float, int]] = Field(default_factory=list)
    time_scale: float = 1.0
    attempts: list[Attempt] = Field(default_factory=list)
    requests: list[dict[str, Any]] = Field(default_factory=list)

    @property
    def records(self) -> list[RequestRecord]:
        return [RequestRecord.from_dict(r) for r in self.requests]

    @property
    def stood_on(self) -> Attempt | None:
        """The attempt whose step the figures come from: the accepted one. When a host stalled every attempt the
        cleanest stands, which is not always the last; None where none was accepted (Contaminated)."""
        return next((a for a in self.attempts if a.accepted), None)


def kv_tokens_needed(*, context_tokens: int, output_tokens: int, concurrency: int, block_size: int | None) -> int:
    """The KV cache C streams of L + N tokens hold at once, each sequence rounded up to whole KV blocks (none
    where the block size is unknown)."""
    block = block_size or 1
    return concurrency * math.ceil((context_tokens + output_tokens) / block) * block


def over_capacity(*, context_tokens: int, output_tokens: int, concurrency: int, kv_cache_tokens: int | None,
                  block_size: int | None) -> bool:
    """C x (L + N) tokens, each sequence rounded up to whole KV blocks, more than the cache holds."""
    if kv_cache_tokens is None:
        return False
    return kv_tokens_needed(context_tokens=context_tokens, output_tokens=output_tokens, concurrency=concurrency,
                            block_size=block_size) > kv_cache_tokens
