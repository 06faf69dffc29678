"""Capacity at a service level: the highest request rate, and the highest concurrency, at which an SLO holds.

The question a service asks before keeping a flag ("at what rate does it still meet our latency targets?"),
answered the way vLLM's SLA sweep and MLPerf's server scenario do: measure a load, ask whether it held the
SLO, move. `search` is pure bracketing and bisection over a probe it is given:

1. from `start`, double while the SLO holds (or halve while it fails) until one rate passes and a higher one
   fails (the bracket), or the ceiling holds, or the floor fails;
2. bisect the bracket (geometrically for rates, which span decades) until the first failing value is within
   `resolution` of the last passing one (for concurrency, or their neighbour).

Each probe also says how far it was from its tightest bound (its `margin`: the value over the limit). Two
probes' margins, on a line in log load and log margin, say where the edge is (`_crossing`): the next probe
goes there, kept within the walk's step and a halving, or inside the bracket's middle half (regula falsi with
bisection's guarantee: after two guesses that moved the same end, the middle). A margin only places a probe;
pass or fail decides it, so a margin read off (an early stop's few requests read its tail high) costs probes,
never the answer.

The answer is the last passing value, with the first failing one beside it: the truth lies between, and the
result says so. Each rate probe is an open-loop rate cell (`cells`, `openloop`) of at least the requests its
highest percentile needs (100 for a p99: `Slo.min_requests`), stopped as soon as its SLO has certainly failed
(`slo.certain_to_fail`); a concurrency probe is a closed loop at C, its first wave and then the requests its
percentile needs, stopped the same way. A probe that cannot say (Invalid: the client fell behind, foreign
traffic) ends the search there, never guessed past.

Where the searches start decides what they cost: a passing probe sends all of its requests, a failing one
stops early, the sooner the further above the answer it is. So the rate search starts at the throughput of a
batch pass (`BatchStart`) and walks down by small steps, and the concurrency search starts at Little's law on
the rate it found (`ConcurrencyStart`).

Every rate probe of one shape draws the same unit-rate arrival gaps, scaled to its rate (common random
numbers, `CellSpec.seed`): probes differ by their rate alone, so a p99 of 100 requests near the edge moves with
the rate, not with each rate's own draw (before, 3.04 req/s failed where 3.08 had held).

On the simulated H200 (2K prompts, 128-token replies, TTFT p99 2 s, TPOT p99 50 ms, time scale 1), measured
side by side on one machine with those common draws: the search from 1 req/s with Little's law on the mean
latency (c985ba9) took 751 s and held at 2.71 req/s (failed at 2.83) and 21 streams (failed at 22); the batch
pass and Little's law on the per-token bound, 347 s (2.72/2.82 req/s, 22/23 streams); with the margins placing
the probes, 243 s: the batch pass 24 s, the rate search 136 s (five probes: 4.38, 3.97, 2.86 failed, 2.63 and
2.75 held), the concurrency search 83 s (19 and 21 held, 22 failed). The rate brackets share 2.75-2.82 req/s;
the concurrency ones agree within a stream (22 held once, at exactly its 50 ms bound, and failed twice, at 54
and 56 ms: a closed loop has no arrival draw, only the host's timing).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field

from campaign.measure.cells import CellResult, CellSpec
from campaign.measure.runner import Measurer
from campaign.measure.slo import STORED_INFINITY, Slo
from campaign.measure.study import ExperimentResult

DEFAULT_RESOLUTION = 0.05   # a rate bracket this narrow (5%) is an answer
DEFAULT_MAX_PROBES = 12
DEFAULT_START_RPS = 1.0     # where the rate search starts when a batch pass measured nothing
COUNT_SPAN_S = 1e-3         # the span of a closed loop whose count, not a time, decides when it ends
MIN_RATE_RPS = 0.01         # below this a service is not serving
CONCURRENCY_CEILING = 256   # vLLM's default max-num-seqs on most cards


@dataclass(frozen=True)
class Probe:
    """One load measured in a search: whether it held the SLO, or why it could not tell."""

    value: float
    passed: bool
    requests: int
    early_stopped: bool = False
    inconclusive: str | None = None   # why this probe says nothing about the SLO (the search ends here)
    # The SLO's tightest bound's value over its limit (above 1: failed; an early stop's is from the requests it
    # sent); None where no bound has a finite value. It places the next probe, never decides one.
    margin: float | None = None


class SearchResult(BaseModel):
    """Where a search ended: the highest value that held the SLO, the lowest that failed, and why it stopped."""

    model_config = ConfigDict(extra="forbid")

    axis: Literal["rate", "concurrency"] = Field(description="what was searched")
    last_pass: float | None = Field(description="the highest value that held the SLO (None: none did)")
    first_fail: float | None = Field(description="the lowest value that failed (None: none did, up to the ceiling)")
    resolved: bool = Field(description="the bracket is within the resolution asked for")
    requests: int = Field(description="requests sent by every probe together")
    probes: list[dict[str, Any]] = Field(default_factory=list, description="each probe: value, passed, requests, "
                                         "early_stopped, inconclusive, margin (format 14)")
    stopped: str = Field(description="why the search stopped, in words")
    inconclusive: str | None = Field(default=None, description="why a probe could not tell, where one ended it")

    @computed_field  # type: ignore[prop-decorator]
    @property
    def max(self) -> float | None:
        """The answer: the bracket's lower end, the highest value that held."""
        return self.last_pass


def _next_bracketing(x: float, *, up: bool, integer: bool, factor: float = 2.0) -> float:
    """The next load out from `x` while the bracket is open: `factor` times it (or over it), at least one stream
    away for concurrency."""
    if factor >= 2.0:
        if integer:
            return float(int(x) * 2 if up else int(x) // 2)
        return x * 2 if up else x / 2
    if integer:
        return float(max(int(x) + 1, round(x * factor)) if up else min(int(x) - 1, round(x / factor)))
    return float(f"{x * factor if up else x / factor:.3g}")


def _midpoint(low: float, high: float, *, integer: bool) -> float:
    """The bracket's middle: for rates the geometric one, to three significant figures (a rate of 2.83, not
    2.8284271), kept strictly inside the bracket."""
    if integer:
        return float((int(low) + int(high)) // 2)
    middle = math.sqrt(low * high)
    rounded = float(f"{middle:.3g}")
    return rounded if low < rounded < high else middle


def _crossing(a: Probe, b: Probe) -> float | None:
    """Where the line through two probes' (log load, log margin) reaches a margin of 1: the load at which the
    tightest bound would sit at its limit; None where their margins do not rise with the load."""
    points = sorted((math.log(p.value), math.log(p.margin)) for p in (a, b)
                    if p.margin is not None and p.value > 0)
    if len(points) < 2 or points[0][0] == points[1][0]:
        return None
    (x0, y0), (x1, y1) = points
    if y1 <= y0:
        return None
    at = x0 - y0 * (x1 - x0) / (y1 - y0)
    # Margins all but equal put the edge beyond any load a float holds: no guess (the walk goes on).
    return math.exp(at) if abs(at) < 700 else None


def _placed(guess: float | None, low: float, high: float, fallback: float, *, integer: bool) -> float:
    """A guessed load, kept between `low` and `high` (geometric bounds of where the next probe may go) and
    rounded as loads are probed; `fallback` where there is no guess or no room."""
    if guess is None or not low <= high:
        return fallback
    x = min(max(guess, low), high)
    return float(round(x)) if integer else float(f"{x:.3g}")


def _next_probed(x: float) -> float:
    """The smallest value of three significant figures above `x` (rates are probed at three: 9.99 -> 10.0)."""
    unit = 10.0 ** (math.floor(math.log10(x)) - 2)
    steps = math.floor(float(f"{x / unit:.9g}")) + 1   # x / unit in [100, 1000), read past float noise
    return float(f"{steps * unit:.3g}")


def _resolved(low: float, high: float, *, integer: bool, resolution: float) -> bool:
    """The first failing value truly within `resolution` of the last passing one (high / low at most 1.05, a
    hair of float noise allowed: rounding the bound to three figures let 9.99 and 10.5, 5.1% apart, through),
    or no value of three figures left strictly between them to probe (a resolution finer than the figures
    allow still ends); for concurrency, that or neighbours."""
    if integer and high - low <= 1:
        return True
    if high <= low * (1 + resolution) * (1 + 1e-9):
        return True
    return not integer and low > 0 and high <= _next_probed(low)


async def search(probe: Callable[[float], Awaitable[Probe]], *, axis: Literal["rate", "concurrency"],
                 start: float, floor: float, ceiling: float | None = None, resolution: float = DEFAULT_RESOLUTION,
                 max_probes: int = DEFAULT_MAX_PROBES, near: bool = False) -> SearchResult:
    """Bracket, then bisect, the largest value whose probe passes (see the module's text). `near`: the start is
    an estimate of the answer, so the bracket opens by small steps first (the resolution squared, 1.1025, each
    step that much larger than the last: 1.1025, 1.2155, 1.34, 1.477, ... up to doubling): a start just past
    the answer then costs one probe below it, where halving would cost a probe at half the load, the slowest
    kind, and the answer under a start four times too high is reached in five steps, four of them failing
    early."""
    integer = axis == "concurrency"
    last_pass: float | None = None
    first_fail: float | None = None
    done: list[Probe] = []
    best: dict[bool, Probe] = {}   # the highest passing and the lowest failing probe
    guided = False                 # the probe just made was placed by a guess inside the bracket
    x = min(start, ceiling) if ceiling is not None else start
    step = (1 + resolution) ** 2
    factor = min(2.0, step) if near else 2.0
    stopped = f"the probe budget ({max_probes}) was spent"
    unclear: str | None = None
    while len(done) < max_probes:
        outcome = await probe(x)
        done.append(outcome)
        if outcome.inconclusive:
            unclear = stopped = f"the probe at {x:g} could not tell: {outcome.inconclusive}"
            break
        previous = best.get(outcome.passed)
        if outcome.passed:
            last_pass = x if last_pass is None else max(last_pass, x)
        else:
            first_fail = x if first_fail is None else min(first_fail, x)
        if x == (last_pass if outcome.passed else first_fail):
            best[outcome.passed] = outcome
        # Where the last two probes' margins say the edge is: while every probe passed (or failed), by the two
        # of them; once bracketed, by its two ends. A guess only places a probe, within the walk's step and
        # a halving (or inside the bracket); pass or fail still decides.
        if first_fail is None:          # every probe passed: go up
            if ceiling is not None and x >= ceiling:
                stopped = f"the SLO held at the ceiling, {ceiling:g}"
                break
            walk = _next_bracketing(x, up=True, integer=integer, factor=factor)
            guess = _crossing(previous, outcome) if previous is not None else None
            x = _placed(guess, max(x * (1 + resolution), x + integer), 2 * x, walk, integer=integer)
            x = min(x, ceiling) if ceiling is not None else x
            factor = min(2.0, factor * step)
        elif last_pass is None:         # every probe failed: go down
            walk = _next_bracketing(x, up=False, integer=integer, factor=factor)
            guess = _crossing(previous, outcome) if previous is not None else None
            lower = _placed(guess, max(x / 2, floor), min(x / (1 + resolution), x - integer), walk,
                            integer=integer)
            if lower < floor:
                stopped = f"the SLO failed down to {x:g}"
                break
            x = lower
            factor = min(2.0, factor * step)
        else:
            if _resolved(last_pass, first_fail, integer=integer, resolution=resolution):
                stopped = "the bracket is resolved"
                break
            middle = _midpoint(last_pass, first_fail, integer=integer)
            # Inside the bracket's middle half (in log terms): each probe narrows it by a quarter at least; and
            # after two guesses that moved the same end (a margin read off, as an early stop's tail reads
            # high), the middle, so that a bias never slows the search below bisection for long.
            quarter = (first_fail / last_pass) ** 0.25
            guess = None if len(done) > 1 and done[-2].passed == outcome.passed and guided else \
                _crossing(best[True], best[False])
            x = _placed(guess, last_pass * quarter, first_fail / quarter, middle, integer=integer)
            if not last_pass < x < first_fail:
                x = middle
            guided = guess is not None
    resolved = last_pass is not None and first_fail is not None and _resolved(
        last_pass, first_fail, integer=integer, resolution=resolution)
    return SearchResult(
        axis=axis, last_pass=last_pass, first_fail=first_fail, inconclusive=unclear,
        resolved=resolved or (first_fail is None and last_pass is not None and last_pass == ceiling),
        requests=sum(p.requests for p in done), stopped=stopped,
        probes=[{"value": p.value, "passed": p.passed, "requests": p.requests, "early_stopped": p.early_stopped,
                 "inconclusive": p.inconclusive, "margin": p.margin} for p in done])


# --- the experiment ---------------------------------------------------------------------------------------
def probe_outcome(value: float, cell: CellResult) -> Probe:
    """A measured probe as the search sees it. Failed requests fail the SLO (a failed request met nothing),
    so a Failed cell is a failing probe; an Invalid or Contaminated one cannot tell."""
    sent = len(cell.requests)
    if cell.status in {"Valid", "Failed"} and cell.slo_passed is not None:
        ratios = [b.value_ms / b.limit_ms for b in cell.slo_bounds
                  if b.value_ms is not None and b.limit_ms > 0 and b.value_ms < STORED_INFINITY]
        margin = max(ratios) if ratios and len(ratios) == len(cell.slo_bounds) and max(ratios) > 0 else None
        return Probe(value, passed=cell.status == "Valid" and cell.slo_passed, requests=sent,
                     early_stopped=bool(cell.early_stopped), margin=margin)
    why = "; ".join(cell.reasons) or f"the probe is {cell.status}"
    return Probe(value, passed=False, requests=sent, inconclusive=f"{cell.status}: {why}")


def search_key(spec: CellSpec, *, concurrency: bool) -> str:
    """Everything that defines what the search sends: the probe's shape (its rate is what varies)."""
    probe = spec.model_copy(update={"request_rate": 1.0, "early_stop": False, "max_concurrency": None})
    shape = probe.key.removeprefix("rate-").replace("-Q1-", "-")
    return f"slo-search-{shape}" + ("-conc" if concurrency else "")


async def slo_search(measurer: Measurer, spec: CellSpec, *, start_rps: float | None = None,
                     resolution: float = DEFAULT_RESOLUTION, max_probes: int = DEFAULT_MAX_PROBES,
                     concurrency: bool = True, concurrency_ceiling: int | None = None,
                     on_probe: Callable[[str], None] | None = None) -> ExperimentResult:
    """Capacity at `spec.slo`: the highest rate (open-loop probes shaped like `spec`, uncapped), then, if
    asked, the highest concurrency (closed loops at C, up to `concurrency_ceiling`, else the spec's
    max_concurrency, else the server's max-num-seqs), at which the SLO holds. Rates in the hardware's seconds.
    Without `start_rps` the rate search starts at the throughput of a batch pass (see BatchStart)."""
    service = spec.slo
    key = search_key(spec, concurrency=concurrency)
    if service is None:
        return ExperimentResult(kind="slo-search", key=key, status="Invalid",
                                reasons=["no SLO: give the bounds to search against (slo: ...)"])
    cells: list[CellResult] = []
    rate_cells: dict[float, CellResult] = {}
    need = max(spec.min_requests, service.min_requests)

    async def measured(axis: str, value: float, shape: dict[str, Any]) -> Probe:
        cell = await measurer.run_cell(spec.model_copy(update={"min_requests": need, **shape}))
        cells.append(cell)
        if axis == "rate":
            rate_cells[value] = cell
        outcome = probe_outcome(value, cell)
        if on_probe is not None:
            on_probe(_probe_line(axis, value, outcome, cell))
        return outcome

    async def rate_probe(rate: float) -> Probe:
        # Open loop, uncapped; stopped once its SLO has certainly failed.
        return await measured("rate", rate, {"request_rate": rate, "early_stop": True, "max_concurrency": None})

    async def concurrency_probe(streams: float) -> Probe:
        # A closed loop at C, decided by its count (its first wave, then `need` judged), stopped once its SLO
        # has certainly failed: it is steady once its first wave is out, and needs no span to let a queue grow.
        return await measured("concurrency", streams, {"request_rate": None, "max_concurrency": int(streams),
                                                       "early_stop": True, "duration_s": COUNT_SPAN_S})

    batch: BatchStart | None = None
    if start_rps is None:
        batch_cell = await measurer.run_cell(batch_spec(spec, need))
        batch = batch_start(batch_cell, need)
        if on_probe is not None:
            on_probe(batch.line())
    start = start_rps if start_rps is not None else batch.start_rps if batch is not None else DEFAULT_START_RPS
    by_rate = await search(rate_probe, axis="rate", start=start, floor=MIN_RATE_RPS, resolution=resolution,
                           max_probes=max_probes, near=batch is not None and batch.throughput_rps is not None)
    by_concurrency = None
    if concurrency:
        ceiling = (concurrency_ceiling or spec.max_concurrency or measurer.target.max_num_seqs
                   or CONCURRENCY_CEILING)
        held = rate_cells.get(by_rate.max) if by_rate.max is not None else None
        little = little_start(by_rate.max, held, measurer.target.time_scale, ceiling, service)
        if on_probe is not None:
            on_probe(little.line(need=need, resolution=resolution, time_scale=measurer.target.time_scale))
        by_concurrency = await search(concurrency_probe, axis="concurrency", start=little.streams, floor=1,
                                      ceiling=ceiling, max_probes=max_probes, near=little.near)
    return _result(key, spec, by_rate, by_concurrency, cells, need, batch)


def batch_spec(spec: CellSpec, need: int) -> CellSpec:
    """The batch pass: `need` requests of the search's shape sent at once (a closed loop of that many streams,
    which sends one more when the first ends), no SLO judged."""
    return spec.model_copy(update={"request_rate": None, "max_concurrency": need, "min_requests": 1,
                                   "early_stop": False, "duration_s": COUNT_SPAN_S, "slo": None})


@dataclass(frozen=True)
class BatchStart:
    """Where the rate search starts: at the throughput of a batch pass, walking down by small steps. A server
    cannot sustain more requests a second than it completes with a batch waiting, and an SLO holds below
    that. A failing probe stops early and costs seconds, the further above the answer the sooner, while a
    passing one sends all of its requests (100 at 1 req/s: 100 s, the slowest probe of a search started at 1,
    and 46 s at half the batch throughput on the simulated H200); so the search starts above the answer and
    meets it from there. vLLM's `sweep serve_workload` and GuideLLM's sweep measure the same batch pass to
    span their rates."""

    cell: CellResult
    requests: int
    throughput_rps: float | None    # completed / the pass's span, hardware seconds (None: it did not measure)

    @property
    def start_rps(self) -> float:
        if self.throughput_rps is None:
            return DEFAULT_START_RPS
        return max(MIN_RATE_RPS, float(f"{self.throughput_rps:.3g}"))

    def line(self) -> str:
        if self.throughput_rps is None:
            why = "; ".join(self.cell.reasons) or f"it is {self.cell.status}"
            return f"batch pass: no throughput ({why}); the rate search starts at {DEFAULT_START_RPS:g} req/s"
        return (f"batch pass: {self.requests} requests at once completed at {self.throughput_rps:.3g} req/s; the "
                "rate search starts there, walking down while it fails")


def batch_start(cell: CellResult, requests: int) -> BatchStart:
    """The batch pass's throughput (its completed requests over its measured span, both the hardware's), or
    None where a request failed or it measured nothing. Whatever else its verdict says, it only decides where
    the search starts, never its answer."""
    done, span = cell.completed, cell.measured_s
    measured = cell.status != "Failed" and done is not None and done > 0 and span is not None and span > 0
    return BatchStart(cell, requests, done / span if measured and done is not None and span else None)


@dataclass(frozen=True)
class ConcurrencyStart:
    """Where the concurrency search starts: Little's law on the rate search's answer, L = lambda x W, streams
    = the capacity rate times a request's latency. With a per-token bound in the SLO, W is the latency of a
    request at that bound (its mean TTFT plus the bound for each token after the first): a closed loop
    queues nothing, so streams are added until the per-token time reaches its bound while the throughput
    stays about the capacity rate, and that estimate starts the search near the answer (small steps). Without
    one, W is the mean latency at the capacity rate, a floor (the search doubles from it). Starting at one
    stream instead cost the probes below it, the slowest of all (100 requests one at a time took minutes on
    the simulated H200 at 2K prompts)."""

    streams: int
    rate_rps: float | None = None       # the capacity rate (hardware seconds)
    latency_s: float | None = None      # W (hardware seconds)
    near: bool = False                  # W from the SLO's per-token bound: an estimate of the answer
    basis: str = ""

    def line(self, *, need: int, resolution: float, time_scale: float) -> str:
        """What the search will cost, said before it starts (hardware time, and wall time if scaled)."""
        if self.rate_rps is None or self.latency_s is None:
            return f"concurrency search: starting at {self.streams} stream(s) (no rate held the SLO to start from)"
        # From an estimate: it, a small step, the neighbour; else bracket, then bisect to the resolution.
        probes = 3 if self.near else 2 + math.ceil(math.log2(max(2.0, 1 / resolution)))
        seconds = probes * need * self.latency_s / self.streams       # a closed loop at C: C / W requests a second
        wall = "" if time_scale == 1 else f", {seconds / time_scale / 60:.1f} min of wall time"
        return (f"concurrency search: starting at {self.streams} streams (Little's law: {self.rate_rps:g} req/s x "
                f"{self.latency_s:.2f} s {self.basis}); about {probes} probes of {need} requests, "
                f"~{seconds / 60:.1f} min{wall}")


def little_start(rate_rps: float | None, cell: CellResult | None, time_scale: float, ceiling: int,
                 service: Slo | None = None) -> ConcurrencyStart:
    """The concurrency search's first probe (see ConcurrencyStart); one stream where no rate held."""
    done = [r for r in (cell.records if cell is not None else []) if r.ok and r.end_t is not None]
    if rate_rps is None or not done:
        return ConcurrencyStart(1)
    per_token = [b for b in (service.bounds if service is not None else ()) if b.metric == "tpot"]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    if per_token and ttfts:
        bound_s = min(b.limit_ms for b in per_token) / 1000.0
        tokens = sum(r.tokens for r in done) / len(done)
        latency = sum(ttfts) / len(ttfts) * time_scale + bound_s * max(0.0, tokens - 1)
        basis, near = f"a request at the {bound_s * 1000:g} ms per-token bound", True
    else:
        latency = sum(r.end_t - r.send_t for r in done if r.end_t is not None) / len(done) * time_scale
        basis, near = "mean latency", False
    return ConcurrencyStart(max(1, min(ceiling, round(rate_rps * latency))), rate_rps, latency, near, basis)


def _probe_line(axis: str, value: float, outcome: Probe, cell: CellResult) -> str:
    unit = "req/s" if axis == "rate" else "streams"
    verdict = outcome.inconclusive or ("held" if outcome.passed else "failed")
    bounds = ", ".join(f"{b.name} {b.value_ms:,.0f}" for b in cell.slo_bounds if b.value_ms is not None
                       and b.value_ms < STORED_INFINITY)
    return (f"SLO probe at {value:g} {unit}: {verdict} ({outcome.requests} requests"
            + (", stopped early" if outcome.early_stopped else "") + (f"; {bounds}" if bounds else "") + ")")


def _result(key: str, spec: CellSpec, by_rate: SearchResult, by_concurrency: SearchResult | None,
            cells: list[CellResult], need: int, batch: BatchStart | None = None) -> ExperimentResult:
    assert spec.slo is not None
    searches = [s for s in (by_rate, by_concurrency) if s is not None]
    inconclusive = [s.inconclusive for s in searches if s.inconclusive is not None]
    failed = [c for c in cells if c.status == "Failed"]
    verdict = f"capacity at SLO ({spec.slo.text}): " + _answer(by_rate, "req/s")
    if by_concurrency is not None:
        verdict += "; " + _answer(by_concurrency, "streams at once")
    verdict += f"; {by_rate.requests + (by_concurrency.requests if by_concurrency else 0)} requests in " \
               f"{len(cells)} probes of at least {need} requests each"
    if batch is not None:
        verdict += f", after a batch pass of {batch.requests} at once"
    return ExperimentResult(
        kind="slo-search", key=key, status="Invalid" if inconclusive else "Valid", reasons=inconclusive,
        verdict=verdict,
        values={"max_rate_rps": by_rate.max,
                **({"max_concurrency": by_concurrency.max} if by_concurrency is not None else {})},
        details={"slo": spec.slo.as_mapping(), "slo_text": spec.slo.text, "min_requests": need,
                 "slo_search": {"max_rate_rps": by_rate.max, "last_pass_rps": by_rate.last_pass,
                                "first_fail_rps": by_rate.first_fail, "requests": by_rate.requests,
                                "resolved": by_rate.resolved, "stopped": by_rate.stopped, "probes": by_rate.probes},
                 "concurrency_search": by_concurrency.model_dump() if by_concurrency is not None else None,
                 "failed_probes": len(failed),
                 "probes": [c.model_dump(mode="json") for c in cells],
                 "batch_pass": None if batch is None else {
                     "requests": batch.requests, "throughput_rps": batch.throughput_rps, "start_rps": batch.start_rps,
                     "cell": batch.cell.model_dump(mode="json")}},
        attempts=[a for c in ([batch.cell] if batch is not None else []) + cells for a in c.attempts],
        discarded_steps=sum(c.discarded_steps for c in ([batch.cell] if batch is not None else []) + cells))


def _answer(result: SearchResult, unit: str) -> str:
    if result.max is None:
        return f"none: it failed at {result.first_fail:g} {unit}" if result.first_fail is not None else (
            f"unknown ({result.stopped})")
    text = f"{result.max:g} {unit}"
    if result.first_fail is not None:
        text += f" (held at {result.last_pass:g}, failed at {result.first_fail:g})"
    else:
        text += f" ({result.stopped})"
    return text
