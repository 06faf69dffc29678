"""Service levels: a set of latency bounds, which requests met them, and whether a load held them. Pure.

An SLO is a set of bounds `<metric>_p<q>_ms=<limit>`: TTFT (send to first token), TPOT ((last token - first
token) / (tokens - 1), the mean gap a reader sees) or end-to-end latency, at percentile q, in milliseconds.
Seed 000's speed floors are TPOT bounds: a reader who needs 20 tok/s needs TPOT <= 50 ms, so `floor_tok_s=20`
is written `tpot_p99_ms=50` (every request but one in a hundred at the floor or faster).

Two figures come from it, as vLLM's `bench serve --goodput` and AIPerf define goodput:
- a request is *good* when it succeeded and each of its own values is within every bound; goodput is good
  requests per second, and `met_fraction` good requests over all sent;
- the load *holds* the SLO when, for each bound, the q-th percentile over every request sent is within the
  limit. A request that failed has no latency: it counts as infinitely late, so errors can never help a load
  pass.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Metric = Literal["ttft", "tpot", "e2e"]
METRICS: tuple[Metric, ...] = ("ttft", "tpot", "e2e")
METRIC_TEXT = {"ttft": "TTFT", "tpot": "TPOT", "e2e": "end-to-end"}
_BOUND = re.compile(r"^(ttft|tpot|e2e)_p(\d+(?:\.\d+)?)_ms$")
FLOOR_KEY = "floor_tok_s"
FLOOR_PERCENTILE = 99.0


class Bound(BaseModel):
    """One bound: the metric's q-th percentile over the requests of a load at most `limit_ms`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    metric: Metric
    percentile: float = Field(gt=0, le=100)
    limit_ms: float = Field(gt=0)

    @property
    def name(self) -> str:
        return f"{self.metric}_p{self.percentile:g}_ms"

    @property
    def text(self) -> str:
        return f"{METRIC_TEXT[self.metric]} p{self.percentile:g} <= {self.limit_ms:g} ms"


class Slo(BaseModel):
    """A service level: every bound must hold."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bounds: tuple[Bound, ...] = Field(min_length=1)

    @property
    def key(self) -> str:
        """Part of a cell key: what it judges changes its goodput, so two SLOs never share a stored cell."""
        # 12 digits: `:g`'s six would give 1,000,000 and 1,000,001 ms one key (and one stored cell).
        return ".".join(f"{b.metric}{b.percentile:.12g}_{b.limit_ms:.12g}" for b in self.bounds)

    @property
    def text(self) -> str:
        return ", ".join(b.text for b in self.bounds)

    @property
    def min_requests(self) -> int:
        """Requests a load needs for its highest percentile to rest on more than its largest value: a p99
        means something from 100 requests (one may be late), a p90 from 10."""
        top = max(b.percentile for b in self.bounds)
        return 1 if top >= 100 else max(1, math.ceil(100.0 / (100.0 - top) - 1e-9))

    def as_mapping(self) -> dict[str, float]:
        return {b.name: b.limit_ms for b in self.bounds}


def parse(items: dict[str, object] | str) -> Slo:
    """`ttft_p99_ms=2000,tpot_p99_ms=50` or the same as a mapping; `floor_tok_s=20` is `tpot_p99_ms=50`.
    Raises ValueError naming the key and what is accepted."""
    if isinstance(items, str):
        pairs: dict[str, object] = {}
        for part in (p.strip() for p in items.split(",")):
            if not part:
                continue
            name, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"{part!r}: expected NAME=VALUE, e.g. ttft_p99_ms=2000")
            if name.strip() in pairs:
                raise ValueError(f"{name.strip()} is given twice")
            pairs[name.strip()] = value.strip()
        items = pairs
    bounds: list[Bound] = []
    for name, raw in items.items():
        name = str(name)   # YAML reads `99: 2000` as an int key; it is then named as a wrong bound, not a crash
        try:
            limit = float(str(raw))
        except ValueError:
            raise ValueError(f"{name}: {raw!r} is not a number") from None
        if not math.isfinite(limit) or limit <= 0:
            raise ValueError(f"{name}: {raw!r} must be a number above 0")
        if name == FLOOR_KEY:
            bounds.append(Bound(metric="tpot", percentile=FLOOR_PERCENTILE, limit_ms=1000.0 / limit))
            continue
        match = _BOUND.match(name)
        if match is None or not 0 < float(match.group(2)) <= 100:
            raise ValueError(f"{name!r} is not a bound: write ttft_p99_ms, tpot_p90_ms, e2e_p50_ms (metric ttft, "
                             f"tpot or e2e; percentile above 0 and up to 100; milliseconds) or {FLOOR_KEY}")
        bounds.append(Bound.model_validate({"metric": match.group(1), "percentile": float(match.group(2)),
                                            "limit_ms": limit}))
    if not bounds:
        raise ValueError("an SLO needs at least one bound, e.g. ttft_p99_ms=2000,tpot_p99_ms=50")
    names = [b.name for b in bounds]
    if len(set(names)) != len(names):
        raise ValueError(f"{next(n for n in names if names.count(n) > 1)} is given twice")
    return Slo(bounds=tuple(bounds))


def field_input(value: object) -> object:
    """What a model's `slo` field takes: an SLO as written (`{ttft_p99_ms: 2000, floor_tok_s: 20}` or
    "ttft_p99_ms=2000,..."), parsed; or as stored (an Slo, or its dump: a mapping of `bounds`), as it is."""
    if value is None or isinstance(value, Slo) or (isinstance(value, dict) and "bounds" in value):
        return value
    if isinstance(value, dict | str):
        return parse(value)
    raise ValueError("an SLO is a mapping of bounds, e.g. {ttft_p99_ms: 2000, tpot_p99_ms: 50}")


@dataclass(frozen=True)
class RequestLatency:
    """One request's values in ms (None: undefined; `ok` False: the request failed, and meets nothing)."""

    ok: bool
    ttft_ms: float | None
    tpot_ms: float | None
    e2e_ms: float | None

    def value(self, metric: Metric) -> float:
        """What a bound compares: a failed request is infinitely late; TPOT of a one-token reply is 0 (it has
        no gap to be slow in)."""
        if not self.ok:
            return math.inf
        value = {"ttft": self.ttft_ms, "tpot": self.tpot_ms, "e2e": self.e2e_ms}[metric]
        if value is None:
            return 0.0 if metric == "tpot" else math.inf
        return value

    def meets(self, slo: Slo) -> bool:
        return all(self.value(b.metric) <= b.limit_ms for b in slo.bounds)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The linear-interpolated percentile of stats.percentile, exact where values are infinite (a failed
    request): the percentile is infinite as soon as it interpolates towards one."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    if math.isinf(ordered[low]) or (high > low and math.isinf(ordered[high])):
        return math.inf
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class BoundResult(BaseModel):
    """One bound over one load."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="the bound, e.g. ttft_p99_ms")
    limit_ms: float = Field(description="its limit, ms")
    value_ms: float | None = Field(description="the percentile over every request sent, ms (None: no request; "
                                               "a very large number: failed requests decided it)")
    violations: int = Field(description="requests over the limit, failed ones included")
    passed: bool = Field(description="value_ms within the limit")


@dataclass(frozen=True)
class Outcome:
    passed: bool
    bounds: list[BoundResult]
    good: int
    sent: int

    @property
    def met_fraction(self) -> float | None:
        return self.good / self.sent if self.sent else None


# JSON has no infinity: a percentile decided by failed requests is stored as this, and reads as "over".
STORED_INFINITY = 1e12


def evaluate(slo: Slo, requests: Sequence[RequestLatency]) -> Outcome:
    results = []
    for bound in slo.bounds:
        values = [r.value(bound.metric) for r in requests]
        value = percentile(values, bound.percentile)
        results.append(BoundResult(
            name=bound.name, limit_ms=bound.limit_ms,
            value_ms=None if value is None else min(value, STORED_INFINITY),
            violations=sum(1 for v in values if v > bound.limit_ms),
            passed=value is not None and value <= bound.limit_ms))
    return Outcome(passed=bool(requests) and all(b.passed for b in results), bounds=results,
                   good=sum(1 for r in requests if r.meets(slo)), sent=len(requests))


def certain_to_fail(slo: Slo, planned: int, seen: Iterable[RequestLatency]) -> bool:
    """Whether a load of `planned` requests has already failed, whatever its remaining requests do: for some
    bound, so many requests are over the limit that the percentile's lower neighbour in the sorted values is
    one of them even if every request still to come is fast. MLPerf stops a run early on the same reasoning;
    here it saves a search from measuring a rate it already knows is too high."""
    seen = list(seen)
    for bound in slo.bounds:
        over = sum(1 for r in seen if r.value(bound.metric) > bound.limit_ms)
        rank = math.floor((planned - 1) * bound.percentile / 100.0)
        if planned > 0 and over >= planned - rank:
            return True
    return False
