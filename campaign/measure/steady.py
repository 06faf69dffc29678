"""Whether an open-loop step's window was steady: a trend test on its per-interval throughput and TPOT.

A figure averaged over a window in which the server changed (warming up, a cache filling, a card throttling
as it heats) describes neither regime. The schedule's span, once the open loop has filled (for the first
median request lifetime after the first arrival requests only arrive, and throughput rises from nothing on any
server), is cut into equal intervals; in each, the output tokens that arrived (tok/s, the hardware's) and their
TPOT: the time since each one's request's previous token over the tokens it brought (a request's first token
has no previous: it counts in the throughput only; a burst of speculative tokens shares its gap), so every
decoding stream's pace in the interval, hundreds of gaps each rather than a dozen requests' whole lives.
Mann-Kendall's test says whether a series moves one way across the window, Sen's slope how far, and the
coefficient of variation how much it scatters. A series drifts when its trend is significant (p below ALPHA)
and the Sen line moves at least MIN_DRIFT of the series' median from the first interval to the last: a Valid
cell then carries the caveat NOT_STEADY with both regimes' numbers, rather than one average over them. A
Poisson load's intervals are noisy (a burst moves one interval's TPOT by up to 40% on the simulated H200 at 2
req/s), so the test finds a drift that dominates its window, not a few percent.

Intervals are at least LIFETIMES median request lifetimes long (up to INTERVALS; fewer than MIN_INTERVALS and
nothing is told): an open loop's requests in flight are the arrivals of the last lifetime, a count that wanders
over that long, so shorter intervals are not independent and the test would read trends into a steady Poisson
load. Measured on synthetic steady Poisson loads (constant TPOT; 4 req/s over 300 s of 256-token replies,
2 req/s over 60 s of 128, 1 req/s over 1,200 s of 1,024; 200 seeds each): at most 2% of windows flagged
(one-lifetime intervals: 3%), where the two series' 1% tests allow about 2%.

A trace replay's load is the trace's own, which may rise and fall over the slice, and agent sessions' prompts
grow turn by turn: their series and trends are stored and stated, never a caveat.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from campaign.core import stats
from campaign.http.client import RequestRecord

INTERVALS = 10        # at most; fewer where a request lives long (LIFETIMES)
MIN_INTERVALS = 6     # fewer, and no trend can be told (Mann-Kendall's smallest p at 5 points is 0.027)
LIFETIMES = 2         # an interval is at least this many median request lifetimes long (see the module's doc)
MIN_REQUESTS = 50     # fewer, and an interval holds a handful: no trend can be told from noise
ALPHA = 0.01          # a trend this unlikely without one (two-sided), with ten intervals: |tau| >= 0.64
MIN_DRIFT = 0.10      # and at least this change across the window, relative to the series' median


class Trend(BaseModel):
    """One series' trend across the window."""

    model_config = ConfigDict(extra="forbid")
    tau: float = Field(description="Mann-Kendall's tau: +1 every later interval higher, -1 every one lower")
    p: float = Field(description="two-sided p of tau (normal approximation with ties' correction)")
    start: float = Field(description="Sen's line at the first interval, the series' unit")
    end: float = Field(description="Sen's line at the last interval, the series' unit")
    cv: float | None = Field(description="coefficient of variation of the intervals' values")
    drifting: bool = Field(description=f"p below {ALPHA} and the line moved at least {MIN_DRIFT:.0%} of the median")


class Steadiness(BaseModel):
    """A long open-loop step's window, interval by interval, and whether it was steady (format 14)."""

    model_config = ConfigDict(extra="forbid")
    settled_s: float = Field(default=0.0, description="hardware seconds left out at the schedule's start: the "
                                                     "open loop filling up (the median request's lifetime)")
    interval_s: float = Field(description="each interval's length, the hardware's seconds")
    throughput_tok_s: list[float] = Field(description="output tokens that arrived in each interval, per second")
    tpot_ms: list[float | None] = Field(
        description="time per output token in each interval: the gaps to the tokens that arrived in it (each "
                    "from its request's token before) over those tokens, ms (None: no such token)")
    throughput: Trend | None = Field(description="the throughput series' trend; None: none can be told (a "
                                                 "median of 0)")
    tpot: Trend | None = Field(description="the TPOT series' trend, over the intervals that have one; None: "
                                           "more than two intervals without a token gap")
    judged: bool = Field(description="whether a drift is a caveat of the cell (False for a trace's own load)")

    @property
    def drifting(self) -> bool:
        return self.judged and any(t is not None and t.drifting for t in (self.throughput, self.tpot))

    def describe(self) -> str:
        """Both series' regimes and their tests, e.g. for the caveat or the note."""
        parts = []
        for name, unit, trend in (("output throughput", "tok/s", self.throughput), ("TPOT", "ms", self.tpot)):
            if trend is not None:
                moved = "rose" if trend.end > trend.start else "fell"
                scatter = "n/a" if trend.cv is None else f"{trend.cv:.2f}"
                parts.append(f"{name} {moved} from {trend.start:,.4g} to {trend.end:,.4g} {unit} (Mann-Kendall tau "
                             f"{trend.tau:+.2f}, p {trend.p:.2g}; CV {scatter})")
        return (f"across {len(self.throughput_tok_s)} intervals of {self.interval_s:.3g} s, " + "; ".join(parts)
                if parts else "too few intervals to tell")


def _trend(series: Sequence[float | None]) -> Trend | None:
    """The trend of the intervals that have a value, each at its own interval's place."""
    at = [i for i, v in enumerate(series) if v is not None]
    # Six significant digits: a constant pace read as 40.0000001 and 39.9999999 is a tie, not a trend.
    values = [float(f"{v:.6g}") for v in series if v is not None]
    if len(values) >= 3 and len(set(values)) == 1:   # constant: no trend at all (Mann-Kendall is undefined)
        return Trend(tau=0.0, p=1.0, start=values[0], end=values[0], cv=0.0, drifting=False)
    test, slope, centre = stats.mann_kendall(values), stats.sen_slope(values, at), stats.median(values)
    if test is None or slope is None or not centre:
        return None
    tau, p = test
    intercept = stats.median([v - slope * i for i, v in zip(at, values, strict=True)]) or 0.0
    start, end = intercept, intercept + slope * (len(series) - 1)
    return Trend(tau=tau, p=p, start=start, end=end, cv=stats.cv(values),
                 drifting=p < ALPHA and abs(end - start) >= MIN_DRIFT * abs(centre))


def interval_sums(requests: Iterable[Iterable[tuple[float, int]]], start: float, width: float, count: int
                  ) -> tuple[list[int], list[float], list[int]]:
    """Each request's token events (time, tokens), in `count` intervals of `width` from `start`: per interval,
    the tokens that arrived, and the gaps to them from their request's event before with the tokens those
    gaps brought (a request's first event has no gap). The tool's records and the simulator's truth alike."""
    tokens, gaps, gapped = [0] * count, [0.0] * count, [0] * count
    for events in requests:
        previous: float | None = None
        for t, n in events:
            index = math.floor((t - start) / width)
            if 0 <= index < count:
                tokens[index] += n
                if previous is not None:
                    gaps[index] += t - previous
                    gapped[index] += n
            previous = t
    return tokens, gaps, gapped


def steadiness(records: list[RequestRecord], window: tuple[float, float], *, scale: float = 1.0,
               judged: bool = True) -> Steadiness | None:
    """The window [start, end) on the records' clock (the schedule's span) after the open loop has filled (the
    first median request lifetime, in which throughput rises from nothing whatever the server does), in up to
    INTERVALS intervals each at least LIFETIMES lifetimes long; `scale` converts wall seconds to the
    hardware's. None when fewer than MIN_REQUESTS requests streamed, or fewer than MIN_INTERVALS fit."""
    done = [r for r in records if r.ok and r.chunk_t]
    lifetime = stats.median([r.end_t - r.send_t for r in done if r.end_t is not None])
    if len(done) < MIN_REQUESTS or lifetime is None or lifetime <= 0:
        return None
    start, end = window[0] + lifetime, window[1]
    count = min(INTERVALS, int((end - start) // (LIFETIMES * lifetime)))
    if count < MIN_INTERVALS:
        return None
    width = (end - start) / count
    tokens, gaps, gapped = interval_sums((zip(r.chunk_t, r.chunk_tokens, strict=True) for r in done),
                                         start, width, count)
    throughput = [n / (width * scale) for n in tokens]
    tpot = [gap / count * scale * 1000.0 if count else None for gap, count in zip(gaps, gapped, strict=True)]
    present = sum(1 for v in tpot if v is not None)
    return Steadiness(settled_s=lifetime * scale, interval_s=width * scale, throughput_tok_s=throughput,
                      tpot_ms=tpot, throughput=_trend(throughput),
                      tpot=_trend(tpot) if present >= count - 2 else None, judged=judged)
