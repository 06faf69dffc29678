"""The verdict on a measured step, one row per rule, from constructed records and counters: no server."""

from __future__ import annotations

from typing import Any

import pytest

from campaign.core import stats
from campaign.http.client import RequestRecord
from campaign.measure import figures
from campaign.measure.cells import REASON_HINTS, Reason, StepEvidence, verdict


def rec(tokens: int = 8, *, max_tokens: int = 8, status: int = 200, error: str | None = None) -> RequestRecord:
    times = [0.1 + 0.01 * i for i in range(tokens)]
    return RequestRecord(id="r", prompt_tokens=100, max_tokens=max_tokens, send_t=0.0, chunk_t=times,
                         chunk_tokens=[1] * tokens, end_t=times[-1] if times else 0.1, status=status, error=error,
                         usage_completion_tokens=tokens if status == 200 else None)


def evidence(**changes: Any) -> StepEvidence:
    base: dict[str, Any] = {"phase": "decode", "mode": "sustained", "concurrency": 4,
                            "records": [rec() for _ in range(4)], "prefix_cache_hits": 0.0, "preemptions": 0.0,
                            "waiting": (0.0, 0.0), "avg_active": 4.0, "client_cpu": 0.2, "max_num_seqs": 64}
    base.update(changes)
    return StepEvidence(**base)


# A prompt that fills the chunk: each step prefills less than one fresh prompt beside the decodes.
CHUNK_BOUND: dict[str, Any] = {"context_tokens": 2048, "max_num_batched_tokens": 2048, "waiting": (1.0, 1.0, 1.0),
                               "running": (15.0, 15.0, 15.0), "kv_usage": (0.14, 0.14, 0.15)}
# Short prompts: one step prefills every replacement, so a persistent queue is a cap or the cache.
SHORT_PROMPTS: dict[str, Any] = {"context_tokens": 128, "max_num_batched_tokens": 2048, "waiting": (2.0, 2.0, 2.0),
                                 "running": (2.0, 2.0, 2.0), "kv_usage": (0.10, 0.11, 0.10)}
CLAMP_400 = "min_tokens must be less than or equal to max_tokens=48, got 100."

RULES = [
    # (rule, evidence changes, status, code, words in the message)
    ("a clean step", {}, "Valid", None, ""),
    ("request errors", {"records": [rec(), rec(0, status=500, error="EngineCore encountered an issue")]},
     "Failed", Reason.REQUEST_ERRORS, "1 of 2 requests failed: EngineCore"),
    ("replies clamped short (silently)", {"records": [rec(5, max_tokens=8)]}, "Invalid", Reason.CLAMPED,
     "max_tokens 8 clamped to 5"),
    ("replies clamped short (400 naming the clamp)", {"records": [rec(0, max_tokens=100, status=400, error=CLAMP_400)]},
     "Invalid", Reason.CLAMPED, "clamped to 48"),
    ("prefix-cache hits in a no-sharing step", {"prefix_cache_hits": 2048.0}, "Invalid", Reason.PREFIX_CACHE_HITS,
     "2048 tokens"),
    ("a trace served within the reuse it implies", {"phase": "rate", "shares_prefixes": True, "implied_hits": 4800,
                                                   "prefix_cache_hits": 4800.0}, "Valid", None, ""),
    ("a trace served more than its shared blocks allow", {"phase": "rate", "shares_prefixes": True,
                                                          "implied_hits": 4800, "prefix_cache_hits": 6400.0},
     "Invalid", Reason.PREFIX_CACHE_HITS, "6400 tokens, more than the 4800 the trace's shared blocks"),
    ("a trace's waiting requests looked up again: their hits count again", {
        "phase": "rate", "shares_prefixes": True, "implied_hits": 4800, "prefix_cache_hits": 6400.0,
        "prefix_cache_queries": 400.0 + 2048.0}, "Valid", None, ""),
    ("a prefix-cache reset that did not hold", {"phase": "rate", "cache_problem": "the server said it reset"},
     "Invalid", Reason.CACHE_NOT_RESET, "the server said it reset"),
    ("preemptions", {"preemptions": 3.0}, "Invalid", Reason.PREEMPTIONS, "3 preemption"),
    ("queued, the chunk size not known", {"waiting": (2.0, 3.0, 2.0)}, "Invalid", Reason.QUEUED,
     "cause cannot be told"),
    ("one queued sample means nothing", {"waiting": (0.0, 1.0, 0.0)}, "Valid", None, ""),
    # Issue 19's false Invalid: 16 streams of 2,048-token prompts with a 2,048-token chunk, one replacement
    # prefilled per step, the next one waiting for it.
    ("replacements queued for the chunk", {**CHUNK_BOUND, "concurrency": 16, "avg_active": 15.996}, "Valid", None,
     ""),
    ("queued for KV-cache blocks", {**CHUNK_BOUND, "kv_usage": (0.97, 0.99)}, "Invalid", Reason.QUEUED_KV_CACHE,
     "99% full"),
    ("queued under the scheduler cap", {**SHORT_PROMPTS, "max_num_seqs": None}, "Invalid",
     Reason.QUEUED_SCHEDULER_CAP, "capped the running requests near 2"),
    ("queued, neither chunk nor cap nor cache explains it", SHORT_PROMPTS, "Invalid", Reason.QUEUED,
     "max-num-seqs 64 seats them all"),
    # Every sample caught fresh arrivals, but the client's clock says streams almost never lacked a token: a cap
    # holding C - k streams back would have kept at least one tokenless all along.
    ("samples that caught arrivals, the client's clock says so", {**SHORT_PROMPTS, "max_num_seqs": None,
                                                                   "avg_before_first_token": 0.2},
     "Valid", None, ""),
    ("a cap the client's clock confirms", {**SHORT_PROMPTS, "max_num_seqs": None, "avg_before_first_token": 2.0},
     "Invalid", Reason.QUEUED_SCHEDULER_CAP, "2.0 of 4 streams on average had no token yet"),
    ("requests that had just arrived", {**SHORT_PROMPTS, "waiting": (1.0, 0.0, 1.0), "running": (3.0, 4.0, 3.0)},
     "Valid", None, ""),
    # Prompts that fill the chunk, but the server ran half of C in every sample: the default cap, not the chunk.
    ("queued under a cap the profile did not pass", {**CHUNK_BOUND, "concurrency": 512, "avg_active": 512.0,
                                                       "max_num_seqs": None, "waiting": (256.0, 256.0),
                                                       "running": (256.0, 256.0), "kv_usage": (0.3, 0.3)},
     "Invalid", Reason.QUEUED_SCHEDULER_CAP, "fewer than 512 ran in every sample"),
    # The cache was full only in a sample where nobody waited: the waiting was not for blocks.
    ("a full cache while nobody waited", {**CHUNK_BOUND, "waiting": (1.0, 0.0, 1.0), "kv_usage": (0.5, 0.97, 0.5)},
     "Valid", None, ""),
    # 126-token prompts, 16 streams, a 2,048-token chunk: 16 fresh prompts fit beside 15 plain decodes ...
    ("a queue the chunk does not explain", {**SHORT_PROMPTS, "concurrency": 16, "avg_active": 16.0,
                                            "context_tokens": 126, "waiting": (1.0, 1.0), "running": (15.0, 15.0)},
     "Invalid", Reason.QUEUED, "prefills all 16 fresh prompts in one step"),
    # ... but not beside 15 decodes that each verify 2 draft tokens (MTP): then the chunk explains it.
    ("speculative decodes take more of the chunk", {**SHORT_PROMPTS, "concurrency": 16, "avg_active": 16.0,
                                                    "context_tokens": 126, "waiting": (1.0, 1.0),
                                                    "running": (15.0, 15.0), "decode_tokens_per_seq": 3},
     "Valid", None, ""),
    ("fewer than C running", {"avg_active": 3.1}, "Invalid", Reason.FEWER_ACTIVE, "3.1 of 4"),
    ("under 95% of C active", {"avg_active": 3.7}, "Invalid", Reason.FEWER_ACTIVE, "95%"),
    ("concurrency above max-num-seqs", {"max_num_seqs": 2, "waiting": (2.0, 2.0)}, "Invalid",
     Reason.ABOVE_MAX_NUM_SEQS, "exceed max-num-seqs 2"),
    ("a saturated client", {"client_cpu": 0.97}, "Invalid", Reason.CLIENT_SATURATED, "97% of a core"),
    ("GPU throttled", {"gpu_throttled": "HW power brake on GPU 0 in 3 of 10 samples"}, "Invalid",
     Reason.GPU_THROTTLED, "power brake"),
    # Every stream in a long prefill through the whole window: 0 tok/s is a wait, not a decode speed.
    ("no token inside the window", {"window_tokens": 0.0, "window_s": 10.0, "avg_before_first_token": 4.0,
                                    "context_tokens": 32_000}, "Invalid", Reason.NO_TOKENS_IN_WINDOW,
     "no stream received a token inside the 10 s window"),
    ("one token inside the window", {"window_tokens": 1.0, "window_s": 10.0}, "Valid", None, ""),
    # The client's stalls could move the window's figures by 5%: more than a verdict's smallest change.
    # A caveat: the cell stays Valid (measured again, the cleanest attempt standing), saying how far.
    ("a client that stood still", {"stall_error": 0.05, "client_stall_s": 0.2}, "Valid", Reason.CLIENT_STALLED,
     "stood still as the window's tokens arrived (its longest 200 ms, the hardware's): stamped late, they could "
     "move the window's rates by up to 5%"),
    ("a stall as long as a stream", {"stall_error": float("inf")}, "Valid", Reason.CLIENT_STALLED,
     "they could move the window's rates by any amount"),
    ("a client whose stalls move nothing", {"stall_error": 0.01, "client_stall_s": 0.2}, "Valid", None, ""),
]


@pytest.mark.parametrize(("rule", "changes", "status", "code", "words"), RULES, ids=[r[0] for r in RULES])
def test_each_rule(rule: str, changes: dict[str, Any], status: str, code: Reason | None, words: str) -> None:
    got_status, findings = verdict(evidence(**changes))
    assert got_status == status
    assert [f.code for f in findings] == ([code] if code else [])
    if code is not None:
        assert words in findings[0].message
        assert findings[0].hint == REASON_HINTS[code] and findings[0].hint


def test_queueing_and_the_client_rules_apply_to_sustained_decode_only() -> None:
    fixed = evidence(mode="fixed", waiting=(3.0, 3.0), avg_active=1.0, stall_error=1.0)
    assert verdict(fixed) == ("Valid", [])
    prefill = evidence(phase="prefill", concurrency=1, records=[rec(1, max_tokens=1)], waiting=(3.0,), avg_active=None)
    assert verdict(prefill) == ("Valid", [])


def test_findings_add_up_and_errors_win_the_status() -> None:
    status, findings = verdict(evidence(records=[rec(0, status=500, error="boom")], preemptions=1.0, client_cpu=0.95))
    assert status == "Failed"
    assert [f.code for f in findings] == [Reason.REQUEST_ERRORS, Reason.PREEMPTIONS, Reason.CLIENT_SATURATED]


def test_every_code_has_a_hint() -> None:
    assert set(REASON_HINTS) == set(Reason)


def test_a_valid_queue_is_reported_in_a_note() -> None:
    from campaign.measure.cells import queue_note

    chunk = evidence(**CHUNK_BOUND, concurrency=16, avg_active=15.996, avg_before_first_token=3.0)
    note = queue_note(chunk)
    assert note is not None and "queued for the prefill chunk" in note
    assert "3.0 of 16 streams on average had no token yet" in note and "gauges read 15.0 running" in note
    assert "less than one fresh prompt of 2,048" in note
    arrived = evidence(**{**SHORT_PROMPTS, "waiting": (1.0, 0.0, 1.0), "running": (3.0, 4.0, 3.0)})
    assert "just arrived" in (queue_note(arrived) or "")
    assert queue_note(evidence(**SHORT_PROMPTS)) is None       # Invalid: the reason says it, not a note
    assert queue_note(evidence()) is None                       # nothing queued



# --- how far the client's own stalls could move a sustained window's figures (figures.stall_error) ------------
def _stream(first: float, tokens: int, gap: float = 0.01) -> RequestRecord:
    times = [first + gap * i for i in range(tokens)]
    return RequestRecord(id="s", prompt_tokens=100, max_tokens=tokens, send_t=first - 0.05, chunk_t=times,
                         chunk_tokens=[1] * tokens, end_t=times[-1], status=200, usage_completion_tokens=tokens)


def _ladder() -> list[RequestRecord]:
    """Four streams through a window of [1, 3] s, a token every 10 ms, each request 0.5 s long and the next
    sent 10 ms after it ends, starting 0.1 s apart: requests begin and end all through the window."""
    return [_stream(0.5 + 0.1 * lane + 0.51 * k, 50) for lane in range(4) for k in range(6)]


def test_a_stall_over_the_windows_end_bounds_the_rate_of_a_request_it_cut_short() -> None:
    """A request ending as the window closes, whose last tokens a stall held until after the end: stamped late,
    they fall outside, and its rate inside reads 40 tok/s where it streamed at 100. With one other request at
    100, stream tok/s (their median) reads 70 against a truth of 100; the bound must reach that 30%. Bounding a
    request by its ends alone said 6% (only the total's moved tokens), and the truth test on the simulated H200
    drew the like: stream tok/s 12% under its truth with a bound of 6.6%."""
    def request(times: list[float]) -> RequestRecord:
        return RequestRecord(id="r", prompt_tokens=100, max_tokens=len(times), send_t=times[0] - 0.05,
                             chunk_t=times, chunk_tokens=[1] * len(times), end_t=times[-1], status=200)

    steady = request([1.0 + 0.01 * i for i in range(101)])
    true = [round(2.9 + 0.01 * i, 2) for i in range(16)]                  # 2.90 .. 3.05, one every 10 ms
    stamped = [t if t < 2.95 else 3.06 for t in true]                      # a stall held 2.95 on until 3.06
    window = (1.0, 3.0)
    measured = stats.median(figures.stream_speeds([steady, request(stamped)], window))
    truth = stats.median(figures.stream_speeds([steady, request(true)], window))
    assert measured == pytest.approx(70.0) and truth == pytest.approx(100.0)
    bound = figures.stall_error([steady, request(stamped)], window, [(3.06, 0.12)], 0.005)
    assert bound is not None and bound >= abs(measured / truth - 1), bound


def test_a_stall_mid_window_moves_nothing_and_one_at_an_edge_moves_the_total() -> None:
    """A stall's tokens are stamped late. Mid-window, away from any request's ends, it moves no figure; where
    one stream of many ends, or even 600 ms of a 2 s window (a few of the sixteen rates' ends), the median's
    bounds are its neighbours' (here all alike: 0). Across the window's end, the tokens it held could have
    arrived inside: 100 ms of a 2 s window reads about 5% (each of the four streams' 10 tokens of it), past
    the 3% a verdict acts on."""
    records, window = _ladder(), (1.0, 3.0)
    assert figures.stall_error(records, window, [], 0.005) == 0.0
    assert figures.stall_error(records, window, [(1.95, 0.03)], 0.005) == 0.0
    ends = sorted(r.chunk_t[-1] for r in records if 1.0 < r.chunk_t[-1] < 3.0)
    assert figures.stall_error(records, window, [(ends[3] + 0.001, 0.08)], 0.005) == 0.0
    long = figures.stall_error(records, window, [(2.5, 0.6)], 0.005)
    assert long is not None and long < 1e-9, long
    edge = figures.stall_error(records, window, [(3.1, 0.1)], 0.005)
    assert edge is not None and 0.04 < edge < 0.06, edge
    verdict_of = verdict(evidence(records=records, stall_error=edge, client_stall_s=0.1))
    assert verdict_of[0] == "Valid" and [f.code for f in verdict_of[1]] == [Reason.CLIENT_STALLED]
