"""The pure arithmetic from a cell's raw request records to its columns: window, fixed-count, prefill and
open-loop rate figures, latency distributions, and the conversion of time-scaled figures into the hardware's
units. No I/O and no clock: every function takes the records (and the window) it reads."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from typing import Any

from campaign.core import stats
from campaign.http.client import RequestRecord
from campaign.measure import slo
from campaign.measure.slo import Slo


def _reads(rec: RequestRecord) -> list[tuple[float, int]]:
    """(arrival time, tokens) per socket read: chunks that arrived in one read share its timestamp."""
    reads: list[tuple[float, int]] = []
    for t, n in zip(rec.chunk_t, rec.chunk_tokens, strict=True):
        if reads and t == reads[-1][0]:
            reads[-1] = (t, reads[-1][1] + n)
        else:
            reads.append((t, n))
    return reads


def itl_per_token(records: list[RequestRecord], start: float, end: float) -> list[float]:
    """Inter-token latency per token inside [start, end]: a read carrying k tokens after a gap g from the
    previous read counts as k gaps of g/k. Reads, not chunks, so events sharing a read never yield 0 ms."""
    samples: list[float] = []
    for rec in records:
        reads = _reads(rec)
        for (t0, _), (t1, k) in zip(reads, reads[1:], strict=False):
            if start <= t0 and t1 <= end and k > 0:
                samples.extend([(t1 - t0) / k] * k)
    return samples


def tpot_per_request(records: list[RequestRecord]) -> list[float]:
    """(last token time - first token time) / (tokens - 1), for every request with two tokens or more."""
    return [t for r in records if (t := _tpot_s(r)) is not None]


# A cell's figures measured on a wall clock that runs `time_scale` times faster than the hardware's (a
# time-scaled simulator): rates read that many times higher, times that much lower. Stored and published in
# the hardware's units (format 10); the client's own event-loop lag (client_lag_p99_ms) stays the wall's.
SCALED_RATES = ("total_tok_s", "per_request_tok_s", "prompt_tok_s")
SCALED_TIMES = ("measured_s", "ttft_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_ms", "itl_p90_ms", "itl_p99_ms", "tpot_ms",
                "tpot_p90_ms", "tpot_p99_ms", "e2e_ms", "e2e_p90_ms", "e2e_p99_ms")


def hardware_units(values: dict[str, Any], scale: float) -> dict[str, Any]:
    """A decode or prefill cell's figures (as the metric functions above return them, on the wall clock) in
    the hardware's units, with the `time_scale` they were converted from. Counts, shares and averages of
    streams are the same on either clock."""
    out = dict(values)
    for name in SCALED_RATES:
        if out.get(name) is not None:
            out[name] = out[name] / scale
    for name in SCALED_TIMES:
        if out.get(name) is not None:
            out[name] = out[name] * scale
    out["time_scale"] = scale
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def latency_distributions(records: list[RequestRecord], start: float, end: float) -> dict[str, Any]:
    """p50/p90/p99 of TTFT, per-token ITL (inside [start, end]), TPOT and end-to-end latency, in ms."""
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
    itls = itl_per_token(records, start, end)
    tpots = tpot_per_request(records)
    e2es = [r.end_t - r.send_t for r in records if r.ok and r.end_t is not None]
    out: dict[str, Any] = {"latency_requests": len(ttfts), "itl_samples": len(itls)}
    for name, values in (("ttft", ttfts), ("itl", itls), ("tpot", tpots), ("e2e", e2es)):
        out[f"{name}_ms"] = _ms(stats.median(values))
        out[f"{name}_p90_ms"] = _ms(stats.percentile(values, 90))
        out[f"{name}_p99_ms"] = _ms(stats.percentile(values, 99))
    return out


def stream_speeds(records: list[RequestRecord], window: tuple[float, float] | None) -> list[float]:
    """Each request's stream tok/s, the samples a decode cell's `per_request_tok_s` is the median of: in a
    sustained cell its rate while it streamed inside the window (stats.streaming_rate), in a fixed round its
    decode rate after the first token. Requests with no such rate are left out. The verdict reads the same
    samples for the median's own error (analysis/verdicts.py)."""
    if window is None:
        return [r.decode_tok_s for r in records if r.decode_tok_s is not None]
    rates = (stats.streaming_rate(list(zip(r.chunk_t, r.chunk_tokens, strict=True)), *window) for r in records)
    return [rate for rate in rates if rate is not None]


def window_metrics(records: list[RequestRecord], start: float, end: float) -> dict[str, Any]:
    """Seed 004's sustained-decode columns, counting only tokens that arrived inside [start, end]."""
    span = end - start
    in_window = 0
    active_time = 0.0
    before_first = 0.0
    completed = 0
    for rec in records:
        in_window += sum(n for t, n in zip(rec.chunk_t, rec.chunk_tokens, strict=True) if start <= t <= end)
        finish = rec.end_t if rec.end_t is not None else end
        active_time += max(0.0, min(finish, end) - max(rec.send_t, start))
        first = rec.chunk_t[0] if rec.chunk_t else finish
        before_first += max(0.0, min(first, end) - max(rec.send_t, start))
        if rec.ok and rec.end_t is not None and start <= rec.end_t <= end:
            completed += 1
    return {
        "total_tok_s": in_window / span if span > 0 else None,
        "per_request_tok_s": stats.median(stream_speeds(records, (start, end))),
        **latency_distributions(records, start, end),
        "avg_active": active_time / span if span > 0 else None,
        "avg_before_first_token": before_first / span if span > 0 else None,
        "completed": completed,
        "output_tokens": in_window,
        "measured_s": span,
    }


def fixed_metrics(records: list[RequestRecord]) -> dict[str, Any]:
    """Seed 000's fixed-count columns: every request emits exactly N tokens; the step is its whole wall time."""
    sends = [r.send_t for r in records]
    ends = [r.end_t for r in records if r.end_t is not None]
    if not sends or not ends:
        return {}
    wall = max(ends) - min(sends)
    tokens = sum(r.tokens for r in records)
    active = sum((r.end_t or max(ends)) - r.send_t for r in records)
    return {
        "total_tok_s": tokens / wall if wall > 0 else None,
        "per_request_tok_s": stats.median(stream_speeds(records, None)),
        **latency_distributions(records, min(sends), max(ends)),
        "avg_active": active / wall if wall > 0 else None,
        "completed": sum(1 for r in records if r.ok),
        "output_tokens": tokens,
        "measured_s": wall,
    }


def prefill_metrics(records: list[RequestRecord]) -> dict[str, Any]:
    rec = records[0]
    ttft = rec.ttft_s
    return {
        "prompt_tok_s": rec.prompt_tokens / ttft if ttft else None,
        "ttft_ms": _ms(ttft),
        "completed": 1 if rec.ok else 0,
        "measured_s": ttft,
    }


# --- open-loop rate cells --------------------------------------------------------------------------------
# The client is behind its schedule when requests leave later than they were due (after the cap let them go)
# by more than the mean gap between arrivals (or 10 ms, whichever is larger), one time in a hundred: the
# arrival process it offered is then not the one asked for (at 100 req/s a 10 ms lag is a whole gap; at
# 0.5 req/s 200 ms is a tenth of one). A late request's own latencies are still exact (they count from its
# send), so a few milliseconds of host scheduling noise are not a reason. Or when the requests left at below
# this share of the rate asked for (lag that piled up): a lower load, never reported as the one asked for.
# A schedule whose requests share instants (a trace's: Mooncake stamps its arrivals in 3-second buckets, up
# to 17 a bucket) keeps its shape if a burst leaves before the next instant is due: there the gap is the mean
# gap between its distinct instants, the trace's own resolution.
SCHEDULE_LAG_FLOOR_S = 0.010
SCHEDULE_LAG_GAPS = 1.0
SCHEDULE_RATE_SHARE = 0.95
IN_FLIGHT_POINTS = 120   # the in-flight series: at most this many samples of the load


def _tpot_s(rec: RequestRecord) -> float | None:
    if not rec.ok or rec.tokens < 2 or len(rec.chunk_t) < 2 or rec.chunk_t[-1] <= rec.chunk_t[0]:
        return None
    return (rec.chunk_t[-1] - rec.chunk_t[0]) / (rec.tokens - 1)


def request_latencies(records: list[RequestRecord], scale: float = 1.0) -> list[slo.RequestLatency]:
    """Each request's TTFT, TPOT and end-to-end latency in the hardware's ms (wall ms x `scale`)."""
    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else seconds * 1000.0 * scale

    return [slo.RequestLatency(ok=r.ok, ttft_ms=ms(r.ttft_s), tpot_ms=ms(_tpot_s(r)),
                               e2e_ms=ms(r.end_t - r.send_t if r.end_t is not None else None)) for r in records]


def send_lags(records: list[RequestRecord]) -> list[float]:
    """Wall seconds from when each request was free to go (its arrival, or the cap's slot) to its send."""
    return [max(0.0, r.send_t - r.released_t) for r in records if r.released_t is not None]


def behind_schedule(records: list[RequestRecord], *, wall_rate: float | None, achieved_share: float | None
                    ) -> str | None:
    """Why the load sent was not the load asked for, from the requests' own times; None: on schedule. A closed
    loop (no rate) has no schedule to keep."""
    if not wall_rate:
        return None
    lag = stats.percentile(send_lags(records), 99)
    gap = 1 / wall_rate
    due = [r.scheduled_t for r in records if r.scheduled_t is not None]
    instants = sorted({round(t, 6) for t in due})
    if 1 < len(instants) < len(due):   # bursts: one gap is the mean between its distinct instants
        gap = max(gap, (instants[-1] - instants[0]) / (len(instants) - 1))
    limit = max(SCHEDULE_LAG_FLOOR_S, SCHEDULE_LAG_GAPS * gap)
    problems = []
    if lag is not None and lag > limit:
        problems.append(f"requests left a p99 {1000 * lag:.1f} ms after they were due (the limit here is "
                        f"{1000 * limit:.1f} ms of wall time)")
    if achieved_share is not None and achieved_share < SCHEDULE_RATE_SHARE:
        problems.append(f"they were sent at {100 * achieved_share:.0f}% of the rate asked for")
    return "; ".join(problems) or None


def in_flight_series(records: list[RequestRecord], start: float, end: float, scale: float = 1.0,
                     points: int = IN_FLIGHT_POINTS) -> list[tuple[float, int]]:
    """Requests sent and not yet ended at evenly spaced moments of [start, end] (seconds from `start`, in the
    hardware's time)."""
    if end <= start or not records:
        return []
    step = (end - start) / (points - 1)
    spans = [(r.send_t, r.end_t if r.end_t is not None else end) for r in records]
    out = []
    for i in range(points):
        t = start + i * step
        out.append(((t - start) * scale, sum(1 for a, b in spans if a <= t < b)))
    return out


def max_in_flight(records: list[RequestRecord]) -> int:
    """The most requests in flight at once: every send and end, in order (an end before a send at a tie)."""
    events = sorted([(r.send_t, 1) for r in records] + [(r.end_t, -1) for r in records if r.end_t is not None])
    peak = now = 0
    for _, change in events:
        now += change
        peak = max(peak, now)
    return peak


def rate_metrics(records: list[RequestRecord], *, start: float, span_s: float, planned: int | None,
                 early_stopped: bool, request_rate: float | None, service: Slo | None,
                 scale: float = 1.0, ramp: frozenset[str] = frozenset()) -> dict[str, Any]:
    """An open-loop load's columns, in the hardware's time (wall seconds x `scale`): `start` is the schedule's
    start on the records' clock, `span_s` the span its arrivals were drawn over (hardware seconds); `planned`
    the requests the schedule held (None: a closed loop, which has no fixed count); `ramp` the ids of a closed
    loop's first wave (sent together, so queued behind each other as no later request is), which count in
    the load but not in its latencies and service level."""
    out: dict[str, Any] = {"scheduled_requests": planned, "request_rate": request_rate, "time_scale": scale,
                           "early_stopped": early_stopped, "ramp_requests": len(ramp) if ramp else None}
    if not records:
        return out
    judged = [r for r in records if r.id not in ramp]
    sends = [r.send_t for r in records]
    last = max([r.end_t for r in records if r.end_t is not None] + sends)
    # Sending took the schedule's span, or longer if the last request left late.
    sending = max(span_s, (max(sends) - start) * scale)
    measured = (last - min(sends)) * scale
    achieved = len(records) / sending if sending > 0 else None
    tokens = sum(r.tokens for r in records)
    latency = latency_distributions(judged, -math.inf, math.inf)
    for name in list(latency):
        if name.endswith("_ms") and latency[name] is not None:
            latency[name] *= scale
    active = sum((r.end_t if r.end_t is not None else last) - r.send_t for r in records)
    lags = send_lags(records)
    lag = stats.percentile(lags, 99)
    out |= {
        **latency,
        "achieved_rate_rps": achieved,
        "total_tok_s": tokens / measured if measured > 0 else None,
        "per_request_tok_s": stats.median([r.decode_tok_s / scale for r in judged if r.decode_tok_s is not None]),
        "completed": sum(1 for r in records if r.ok),
        "output_tokens": tokens,
        "measured_s": measured,
        "send_lag_p99_ms": None if lag is None else 1000.0 * lag * scale,
        "cap_waits": sum(1 for r in records if r.released_t is not None and r.scheduled_t is not None
                         and r.released_t - r.scheduled_t > SCHEDULE_LAG_FLOOR_S),
        "avg_in_flight": active * scale / measured if measured > 0 else None,
        "in_flight": in_flight_series(records, min(sends), last, scale),
        "max_in_flight": max_in_flight(records),
    }
    if service is not None:
        outcome = slo.evaluate(service, request_latencies(judged, scale))
        # The load's requests a second times the share of the judged ones that met the SLO: a closed loop's
        # first wave is in the load's time, so it is counted in its requests too, at the judged ones' share.
        met = outcome.met_fraction
        out |= {"goodput_rps": met * len(records) / measured if measured > 0 and met is not None else None,
                "slo_met_fraction": outcome.met_fraction, "slo_passed": outcome.passed,
                "slo_bounds": outcome.bounds}
    return out


# A queue that stays non-empty through at least this share of a schedule's end, and ends longer than it began,
# is a server that fell behind the arrivals (not the moment's wait of a burst, which empties again).
BEHIND_MIN_SHARE = 0.10
BEHIND_MIN_SAMPLES = 3


def fell_behind(queue: list[tuple[float, float]], start: float, end: float) -> tuple[float, float, float] | None:
    """When the server fell behind the arrivals for good, from its waiting-requests gauge over a schedule
    [start, end] ((time, waiting) samples, in time order): (the first time of the run of samples with a queue
    that lasts to the schedule's end, the longest queue in it, the queue at the end). None when the queue was
    empty at the end, or its last run is shorter than BEHIND_MIN_SHARE of the schedule (or BEHIND_MIN_SAMPLES),
    or it did not grow over that run: the server kept up, queueing only for moments. tests/test_fell_behind.py
    reads the simulator's own steps with the same rule."""
    inside = [(t, w) for t, w in queue if start <= t <= end]
    first = len(inside)
    while first > 0 and inside[first - 1][1] > 0:
        first -= 1
    run = inside[first:]
    if len(run) < BEHIND_MIN_SAMPLES or end - run[0][0] < BEHIND_MIN_SHARE * (end - start):
        return None
    if run[-1][1] <= run[0][1]:
        return None
    return run[0][0], max(w for _, w in run), run[-1][1]


def _lateness(stalls: list[tuple[float, float]], reach_s: float) -> Callable[[float], float]:
    """How late a stamp may be: a stamp at `t` inside a stall (the loop probe's sample (when, lag): the loop
    stood still for `lag` up to `when`, somewhere within `reach_s` before that) may have arrived that much
    earlier; 0 outside every stall."""
    spans = sorted((when, when - lag - reach_s, lag) for when, lag in stalls if lag > 0)
    ends = [end for end, _, _ in spans]
    longest = max((end - begin for end, begin, _ in spans), default=0.0)

    def late(t: float) -> float:
        most = 0.0
        # The stalls ending at or after t (by their ends, in order) that began before it: none ends later than
        # the longest stall's length past t.
        for _end, begin, lag in spans[bisect.bisect_left(ends, t):bisect.bisect_right(ends, t + longest)]:
            if begin <= t:
                most = max(most, min(lag, t - begin))
        return most

    return late


def stall_error(records: list[RequestRecord], window: tuple[float, float], stalls: list[tuple[float, float]],
                reach_s: float) -> float | None:
    """How far the client's own stalls could move a sustained window's figures, as a share of them: a token
    stamped inside a stall may have arrived up to that stall earlier. The total moves by the tokens a stall
    could carry across an edge of the window (one stamped just inside the start may have arrived before it;
    one stamped after the end, inside it). Stream tok/s, the median of the streams' rates, moves no further
    than the medians of their lowest and highest possible rates: a stream's rate over its time inside the
    window, whose ends (its own first and last stamps there, or the window's edges) may each be early by their
    stamps' lateness, and whose count may be short of the tokens a stall carried past the window's end (or long
    by those it carried in past the start). So a stall mid-stream moves nothing, and a few streams' ends in a
    stall move the median by no more than its neighbours' spread. Measured on the simulated A5000 pair at time
    scale 5 (8 streams, a 4 s window): 0.8-1.9% on a quiet host, 63% to many times over on one starved by three
    CPU hogs, whose cells read stream tok/s 12-50% off the simulator's own records. None without tokens in the window.
    `stalls`: the loop probe's (when, lag) samples over the step, on the records' clock; `reach_s`: how far
    before a sample its stall may lie (the probe's interval)."""
    start, end = window
    late = _lateness(stalls, reach_s)
    counted = moved_out = moved_in = 0
    rates: list[float] = []
    lower: list[float] = []
    upper: list[float] = []
    for rec in records:
        chunks = list(zip(rec.chunk_t, rec.chunk_tokens, strict=True))
        out_n = in_n = 0   # this stream's tokens a stall may have carried across an edge
        for t, n in chunks:
            if start <= t <= end:
                counted += n
                out_n += n if t - late(t) < start else 0
            elif t > end and t - late(t) <= end:
                in_n += n
        moved_out += out_n
        moved_in += in_n
        rate = stats.streaming_rate(chunks, start, end)
        if rate is None:
            continue
        inside = [t for t, _ in chunks if start <= t <= end]
        across_start, across_end = any(t < start for t, _ in chunks), any(t > end for t, _ in chunks)
        begin, finish = start if across_start else inside[0], end if across_end else inside[-1]
        early_begin, early_finish = (0.0 if across_start else late(begin)), (0.0 if across_end else late(finish))
        span = finish - begin
        tokens = rate * span
        rates.append(rate)
        # Its ends early by their stamps' lateness, and its count short of the tokens a stall carried out past
        # the end (or long by those it carried in past the start): a stall over the window's end once left
        # stream tok/s 12% under the truth with the ends alone bounding it at 6.6%.
        lower.append(max(0.0, tokens - out_n) / (span + early_begin))
        upper.append((tokens + in_n) / (span - early_finish) if span > early_finish else math.inf)
    if not counted:
        return None
    total = max(moved_out, moved_in) / counted
    mid, low, high = stats.median(rates), stats.median(lower), stats.median(upper)   # rates: stream_speeds
    if mid is None or low is None or high is None:
        return total
    return max(total, high / mid - 1, 1 - low / mid)
