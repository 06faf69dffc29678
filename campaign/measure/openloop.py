"""Open-loop load: requests that arrive on a schedule, whether or not the earlier ones have finished.

A closed-loop cell (C streams, each sending its next request when one ends) lets a slow server slow its own
load; a service's users do not wait for each other. Here the arrival times are drawn before the first request
(`arrivals`, pure and seeded), and `drive` sends each at its time, optionally holding at most `cap` in flight
(vLLM bench serve's `--max-concurrency`). Every request records when it was meant to go (`scheduled_t`), when
the cap let it go (`released_t`) and when its bytes went to the socket (`send_t`), so a client that cannot keep
up shows as lag, never as a silently lower load.

Arrivals over a span T at rate r are n = round(r x T) requests:
- poisson (the default, as in vLLM bench serve and MLPerf's server scenario): exponential gaps;
- gamma: gamma gaps of shape `burstiness` (1 is Poisson; below 1 burstier, above 1 more regular);
- constant: one every 1/r.
Gaps are drawn, then scaled so that the n arrivals span exactly T with the first at 0: a Poisson process
conditioned on its count (its arrival times are then uniform order statistics), so the rate offered is
exactly r while the gaps keep their distribution. Without that, 10 Poisson arrivals would offer a rate 30%
off the one asked for as often as not, and two variants would be measured at different loads.
A rate of None is "as fast as the cap allows": `cap` streams, each sending its next request when one ends
(closed loop), for the span; only the cap limits it, so it needs one.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from campaign.core.clock import now as measuring_clock

Arrival = Literal["poisson", "gamma", "constant"]
ARRIVALS: tuple[Arrival, ...] = ("poisson", "gamma", "constant")


def rate_value(value: object) -> float | None:
    """A rate as written: requests a second above 0, or `inf` (None: as fast as a cap allows). ValueError
    otherwise."""
    if isinstance(value, str) and value.strip().lower() in {"inf", ".inf"}:
        return None
    try:
        rate = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is not a rate (requests a second, or inf)") from None
    if rate == float("inf"):
        return None
    if not rate > 0:
        raise ValueError(f"{value!r}: a rate is above 0 requests a second (or inf)")
    return rate


def request_count(rate: float, span_s: float, min_requests: int = 1) -> int:
    return max(min_requests, round(rate * span_s), 1)


def arrivals(rate: float, span_s: float, *, arrival: Arrival = "poisson", burstiness: float = 1.0,
             seed: int = 0, min_requests: int = 1) -> list[float]:
    """Arrival offsets (seconds from the start) of request_count(rate, span_s, min_requests) requests, the
    first at 0, spanning n / rate seconds (more than `span_s` when `min_requests` asks for more)."""
    if rate <= 0:
        raise ValueError("a request rate is above 0")
    if burstiness <= 0:
        raise ValueError("burstiness is above 0")
    n = request_count(rate, span_s, min_requests)
    span = n / rate
    if arrival == "constant":
        return [i * span / n for i in range(n)]
    rng = random.Random(seed)
    shape = 1.0 if arrival == "poisson" else burstiness
    gaps = [rng.gammavariate(shape, 1.0) for _ in range(n)]   # n gaps: after each arrival, the next one's
    total = sum(gaps)
    if total <= 0:
        # A tiny burstiness (shape 0.001) can draw every gap below the smallest float: the burst's limit,
        # all at once.
        return [0.0] * n
    out, t = [], 0.0
    for gap in gaps:
        out.append(min(span, span * t / total))   # rounding may not carry one past the span
        t += gap
    return out


@dataclass(frozen=True)
class Sent:
    """When one request was meant to go and when it was free to: its due time, or later when the cap held it
    back (the measuring clock's seconds)."""

    index: int
    scheduled_t: float
    released_t: float


Send = Callable[[Sent], Awaitable[None]]


async def drive(offsets: list[float], send: Send, *, time_scale: float = 1.0, cap: int | None = None,
                stop: asyncio.Event | None = None, clock: Callable[[], float] = measuring_clock,
                sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> float:
    """Send request i at offsets[i] / time_scale wall seconds after the start (the offsets are in the
    hardware's seconds; a simulator running `time_scale` times faster needs them that much sooner), at most
    `cap` at a time; stop releasing when `stop` is set (the requests in flight are drained, never aborted).
    Returns the start on `clock`. `send` records the request; drive only times it."""
    slots = asyncio.Semaphore(cap) if cap else None
    tasks: list[asyncio.Task[None]] = []
    start = clock()

    async def one(sent: Sent) -> None:
        try:
            await send(sent)
        finally:
            if slots is not None:
                slots.release()

    try:
        for index, offset in enumerate(offsets):
            due = start + offset / time_scale
            wait = due - clock()
            if wait > 0:
                await sleep(wait)
            if stop is not None and stop.is_set():
                break
            # Free to go when due, unless the cap held it back: a late wake-up of this loop is lag behind the
            # schedule (send_lags counts from here), never a wait for the cap.
            released = due
            if slots is not None:
                held = slots.locked()
                await slots.acquire()   # arrivals queue at the client in order, as a gateway's would
                if stop is not None and stop.is_set():
                    slots.release()
                    break
                if held:
                    released = max(due, clock())
            tasks.append(asyncio.create_task(one(Sent(index, due, released))))
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return start


async def closed(streams: int, span_s: float, send: Send, *, min_requests: int = 1, time_scale: float = 1.0,
                 stop: asyncio.Event | None = None, clock: Callable[[], float] = measuring_clock) -> float:
    """`streams` at once, each sending its next request when one ends, until span_s / time_scale wall seconds
    have passed and at least `min_requests` were sent (then the ones in flight are drained)."""
    start = clock()
    end = start + span_s / time_scale
    sent = 0

    async def stream() -> None:
        nonlocal sent
        while not (stop is not None and stop.is_set()) and (clock() < end or sent < min_requests):
            index, sent = sent, sent + 1
            now = clock()
            await send(Sent(index, now, now))

    await asyncio.gather(*(stream() for _ in range(streams)))
    return start
