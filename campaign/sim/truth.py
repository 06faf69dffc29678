"""What the simulated server really did: truth records, and the figures they imply.

The simulator (`--truth FILE`) writes JSON lines on its own clock, in simulated seconds, so the truth is the
same at any time scale:

    {"kind": "start", "format": 1, "time_scale": S, "anchor": A,
     "clock": "clock_gettime(CLOCK_MONOTONIC)", ...}
    {"kind": "step", "start": t, "end": t, "model_s": d, "decode_seqs": n, "decode_tokens": n,
     "prefill_tokens": n, "prefill_seqs": n, "running": n, "waiting": n, "kv_used_blocks": n,
     "drafts": n, "draft_tokens": n, "accepted": n}
    {"kind": "request", "id": "cmpl-sim-7", "arrival": t, "prompt_tokens": n, "max_tokens": n,
     "emits": [[t, tokens], ...], "finish": t, "reason": "length" | "abort", "admitted": t, "queried": n,
     "hits": n, "preemptions": n, "cached": n}

A request's tokens are stamped when they left: on the wall clock the server wakes a little after a step's
planned `end`, and that later time is recorded (on a virtual clock the two are equal). `anchor` maps the
client's clock onto the simulated one: a `time.perf_counter()` reading p (CLOCK_MONOTONIC on Linux, shared
by every process of the machine) is the simulated time (p - anchor) x time_scale. Requests are written
(and flushed) when they end, once the tokens of the step they ended in have gone out; a request still
running when the server stops, or when it crashes on purpose, is written then, without `finish`.
With the `launch-noise` fault the start record carries the launch's `speed_factor`, already in every `model_s`.
Prefix-cache `queried` and `hits` are the engine's own bookkeeping, the same that feeds its counters (as vLLM's,
they stop counting at a request's first preemption): they check that the tool attributes the counter to the right
requests, not the counter itself. `cached` is what the cache held when the request was first scheduled (vLLM's
num_cached_tokens; absent in files written before it was added, read as None).

The figures below are computed from the truth alone, by their definitions, not by the tool's arithmetic
(cells.py), so a mistake there shows up as a difference.
"""

from __future__ import annotations

import bisect
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from campaign.core import stats
from campaign.sim.engine import Request, Step
from campaign.sim.model import StepCosts, StepPower

FORMAT = 1


@dataclass
class RequestTruth:
    id: str
    arrival: float
    prompt_tokens: int
    max_tokens: int
    emits: list[tuple[float, int]] = field(default_factory=list)
    finish: float | None = None
    reason: str | None = None
    admitted: float | None = None
    queried: int = 0
    hits: int = 0
    preemptions: int = 0
    cached: int | None = None   # prompt tokens the prefix cache held at its first scheduling (None: never)

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.emits)

    @property
    def ttft(self) -> float | None:
        return self.emits[0][0] - self.arrival if self.emits else None

    def waited_until(self, end: float) -> float:
        """When it stopped waiting for a first token: its first emission, else its finish (an abort), else
        `end` (still waiting)."""
        if self.emits:
            return self.emits[0][0]
        return self.finish if self.finish is not None else end

    @property
    def prompt_tok_s(self) -> float | None:
        ttft = self.ttft
        return self.prompt_tokens / ttft if ttft else None


@dataclass
class StepTruth:
    start: float
    end: float
    model_s: float
    decode_seqs: int
    decode_tokens: int
    prefill_tokens: int
    prefill_seqs: int
    running: int
    waiting: int
    kv_used_blocks: int
    drafts: int = 0                   # speculative decoding: sequences that verified drafts this step
    draft_tokens: int = 0
    accepted: int = 0
    prefill_weight: int = 0           # prefill tokens x the mean context they attend to (whole tokens)
    context_read: int = 0             # decoding context read from the KV cache

    def features(self) -> tuple[float, float, float, float, float]:
        """What the step's time is linear in (StepCosts' terms, in their order): 1 step, decode positions,
        prefill tokens, prefill x context, KV context read. Speed faults, launch noise and drafters aside, the
        step's model_s is StepCosts' coefficients dotted with these."""
        return (1.0, float(self.decode_tokens), float(self.prefill_tokens), float(self.prefill_weight),
                float(self.context_read))


def energy_terms(costs: StepCosts, steps: Sequence[StepTruth]) -> tuple[float, float]:
    """What a span of engine steps' energy is linear in (StepPower's terms, in their order): the seconds its
    steps ran compute work and memory work. A step's model seconds (speed faults and launch noise in) are
    shared between the two as its costs split it."""
    compute_s = memory_s = 0.0
    for step in steps:
        compute, memory = costs.split(step.features())
        share = compute / (compute + memory) if compute + memory > 0 else 0.0
        compute_s += step.model_s * share
        memory_s += step.model_s * (1 - share)
    return compute_s, memory_s


def energy_j(power: StepPower, costs: StepCosts, steps: Sequence[StepTruth]) -> float:
    """The energy the launch's GPUs drew over a span of steps (StepPower's model)."""
    return sum(w * s for w, s in zip(power.terms(), energy_terms(costs, steps), strict=True))


class Recorder:
    """A TruthSink that keeps everything in memory (the virtual clock's runs read it directly)."""

    def __init__(self) -> None:
        self.requests: list[RequestTruth] = []
        self.steps: list[StepTruth] = []
        self._live: dict[int, RequestTruth] = {}

    def arrival(self, req: Request, t: float) -> None:
        self._live[id(req)] = RequestTruth(id=req.id, arrival=t, prompt_tokens=len(req.prompt),
                                           max_tokens=req.max_tokens)

    def emit(self, req: Request, t: float, tokens: int) -> None:
        self._live[id(req)].emits.append((t, tokens))

    def finish(self, req: Request, t: float, reason: str) -> None:
        truth = self._live.pop(id(req), None)
        if truth is not None:
            truth.finish, truth.reason = t, reason
            self._keep_request(_filled(truth, req))

    def step(self, step: Step, start: float, end: float, *, running: int, waiting: int, kv_used: int) -> None:
        self._keep_step(StepTruth(start=start, end=end, model_s=step.duration, decode_seqs=len(step.decoding),
                                  decode_tokens=step.decode_tokens, prefill_tokens=step.prefill_tokens,
                                  prefill_seqs=step.prefill_seqs, running=running, waiting=waiting,
                                  kv_used_blocks=kv_used, drafts=step.drafts, draft_tokens=step.draft_tokens,
                                  accepted=step.accepted, prefill_weight=step.prefill_weight,
                                  context_read=step.context_read))

    def all_requests(self) -> list[RequestTruth]:
        """Finished requests and those still running, by arrival."""
        return sorted([*self.requests, *self._live.values()], key=lambda r: r.arrival)

    def _keep_request(self, truth: RequestTruth) -> None:
        self.requests.append(truth)

    def _keep_step(self, step: StepTruth) -> None:
        self.steps.append(step)


def _filled(truth: RequestTruth, req: Request) -> RequestTruth:
    """The request's bookkeeping, copied onto its truth record when it is written."""
    truth.admitted, truth.queried, truth.hits, truth.preemptions = req.admitted, req.queried, req.hits, req.preemptions
    truth.cached = req.cached
    return truth


class Writer(Recorder):
    """A Recorder that writes each record as a JSON line once it is complete, and keeps none of them. Complete
    records wait for `flush`, which the server calls once a step's tokens have gone out: serialising a
    finished request takes milliseconds, and before its tokens were written that delayed the very tokens the
    record says had left (an ITL p99 read 1.6 ms long against its truth)."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        super().__init__()
        self._pending_requests: list[RequestTruth] = []
        self._pending_steps: list[StepTruth] = []
        self._file: IO[str] = path.open("x", encoding="utf-8")  # a truth file is never overwritten
        self._write({"kind": "start", "format": FORMAT, "clock": time.get_clock_info("perf_counter").implementation,
                     **header})

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def _keep_request(self, truth: RequestTruth) -> None:
        self._pending_requests.append(truth)

    def _keep_step(self, step: StepTruth) -> None:
        self._pending_steps.append(step)

    def flush(self) -> None:
        """Write the records completed since the last flush."""
        if self._file.closed:
            return
        for step in self._pending_steps:
            self._write({"kind": "step", **asdict(step)})
        for truth in self._pending_requests:
            self._write({"kind": "request", **asdict(truth)})
        if self._pending_requests:
            self._file.flush()  # requests are what a reader matches: never left in a buffer
        self._pending_steps.clear()
        self._pending_requests.clear()

    def close(self, live: list[Request]) -> None:
        """Write what is still running (without `finish`), then close the file."""
        if self._file.closed:
            return
        for req in live:
            truth = self._live.pop(id(req), None)
            if truth is not None:
                self._keep_request(_filled(truth, req))
        self.flush()
        self._file.close()


@dataclass
class Truth:
    header: dict[str, Any]
    requests: list[RequestTruth]
    steps: list[StepTruth]

    def sim_time(self, perf_counter_t: float) -> float:
        """A client's `time.perf_counter()` reading on the simulated clock."""
        return (perf_counter_t - float(self.header["anchor"])) * float(self.header["time_scale"])

    def by_id(self) -> dict[str, RequestTruth]:
        return {r.id: r for r in self.requests}

    def behind_s(self) -> float:
        """Simulated time the engine had work but no step ran: the simulator fell behind its clock. A request
        with the API server (the header's `request_s`) is not yet work: after a step that left only waiting
        requests, the engine could start no sooner than the first of them was ready."""
        request_s = float(self.header.get("request_s", 0.0))
        by_arrival = sorted(self.requests, key=lambda r: r.arrival)
        arrivals = [r.arrival for r in by_arrival]
        behind = 0.0
        for a, b in zip(self.steps, self.steps[1:], strict=False):
            if not (a.running or a.waiting):
                continue
            start = a.end
            if not a.running and request_s > 0:
                # The head of the queue: the first to have arrived by then and not been seated or ended.
                head = next((r.arrival for r in by_arrival[:bisect.bisect_right(arrivals, a.end)]
                             if (r.admitted is None or r.admitted > a.end) and (r.finish is None or r.finish > a.end)),
                            None)
                if head is not None:
                    start = max(start, head + request_s)
            behind += max(0.0, b.start - start)
        return behind


def read(path: Path) -> Truth:
    header: dict[str, Any] = {}
    requests: list[RequestTruth] = []
    steps: list[StepTruth] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        kind = record.pop("kind")
        if kind == "start":
            if record.get("format") != FORMAT:
                raise ValueError(f"{path}:{number}: truth format {record.get('format')!r}, this reader knows {FORMAT}")
            header = record
        elif kind == "request":
            record["emits"] = [(float(t), int(n)) for t, n in record["emits"]]
            requests.append(RequestTruth(**record))
        elif kind == "step":
            steps.append(StepTruth(**record))
    return Truth(header=header, requests=requests, steps=steps)


# --- figures by their definitions -------------------------------------------------------------------------
def _pcts(values: list[float], prefix: str) -> dict[str, float | None]:
    return {f"{prefix}_p50": stats.median(values), f"{prefix}_p90": stats.percentile(values, 90),
            f"{prefix}_p99": stats.percentile(values, 99)}


def latency_figures(requests: list[RequestTruth], start: float, end: float) -> dict[str, float | None]:
    """TTFT, per-token ITL (both emissions inside [start, end]), TPOT and end-to-end, in seconds."""
    ttfts = [r.ttft for r in requests if r.ttft is not None]
    itls: list[float] = []
    for r in requests:
        for (t0, _), (t1, k) in zip(r.emits, r.emits[1:], strict=False):
            if start <= t0 and t1 <= end:
                itls.extend([(t1 - t0) / k] * k)
    tpots = [(r.emits[-1][0] - r.emits[0][0]) / (r.tokens - 1) for r in requests
             if r.reason == "length" and r.tokens >= 2 and r.emits[-1][0] > r.emits[0][0]]
    e2es = [r.finish - r.arrival for r in requests if r.reason == "length" and r.finish is not None]
    return {**_pcts(ttfts, "ttft"), **_pcts(itls, "itl"), **_pcts(tpots, "tpot"), **_pcts(e2es, "e2e")}


def window_figures(requests: list[RequestTruth], start: float, end: float) -> dict[str, float | None]:
    """A sustained window: what the engine emitted inside [start, end], per second of simulated time, and how
    many requests it held on average (all of them, and those without a first token yet)."""
    span = end - start
    tokens = 0
    rates: list[float] = []
    completed = 0
    held = waiting = 0.0
    for r in requests:
        tokens += sum(n for t, n in r.emits if start <= t <= end)
        rate = stats.streaming_rate(r.emits, start, end)   # as the client times each request (measure.figures)
        if rate is not None:
            rates.append(rate)
        if r.reason == "length" and r.finish is not None and start <= r.finish <= end:
            completed += 1
        finish = r.finish if r.finish is not None else end
        held += max(0.0, min(finish, end) - max(r.arrival, start))
        first = r.waited_until(end)
        waiting += max(0.0, min(first, end) - max(r.arrival, start))
    if span <= 0:
        return dict.fromkeys(("total_tok_s", "per_request_tok_s", "output_tokens", "completed", "avg_active",
                              "avg_before_first_token"))
    return {"total_tok_s": tokens / span, "per_request_tok_s": stats.median(rates), "output_tokens": float(tokens),
            "completed": float(completed), "avg_active": held / span, "avg_before_first_token": waiting / span}


def fixed_figures(requests: list[RequestTruth]) -> dict[str, float | None]:
    """Every request to its end: tokens over the span from the first arrival to the last finish."""
    finishes = [r.finish for r in requests if r.finish is not None]
    span = max(finishes) - min(r.arrival for r in requests) if requests and finishes else 0.0
    if span <= 0:
        return dict.fromkeys(("total_tok_s", "per_request_tok_s", "output_tokens", "completed", "avg_active"))
    rates = [(r.tokens - r.emits[0][1]) / (r.emits[-1][0] - r.emits[0][0]) for r in requests
             if len(r.emits) >= 2 and r.emits[-1][0] > r.emits[0][0]]
    return {"total_tok_s": sum(r.tokens for r in requests) / span, "per_request_tok_s": stats.median(rates),
            "output_tokens": float(sum(r.tokens for r in requests)),
            "completed": float(sum(1 for r in requests if r.reason == "length")),
            "avg_active": sum((r.finish or r.arrival) - r.arrival for r in requests) / span}


def hit_rate(requests: list[RequestTruth]) -> float | None:
    queried = sum(r.queried for r in requests)
    return sum(r.hits for r in requests) / queried if queried else None


def rate_figures(requests: list[RequestTruth], start: float, span: float,
                 bounds: Sequence[tuple[str, float, float]],
                 margin_ms: Callable[[str, float], float] = lambda metric, limit: 0.0) -> dict[str, float | None]:
    """An open-loop load, from the requests that arrived for it (simulated seconds; `start` is when its
    schedule began, `span` how long its arrivals were meant to take): the rate they arrived at; goodput, the
    requests a second whose own TTFT (arrival to first emission), TPOT (first to last emission over the
    tokens between) and end-to-end time (arrival to finish) were each within every bound (metric, percentile,
    limit in ms), over first arrival to last finish; the share of requests that did; whether each bound's
    percentile held; requests in the server on average. Where a value lies within `margin_ms(metric, limit)` of
    its limit, a measurement may honestly read it either side: `good_low` counts requests good by every bound
    less that margin, `good_high` by every bound plus it, and `slo_borderline` says a percentile was that
    close to its limit."""
    if not requests:
        return {}
    arrivals = [r.arrival for r in requests]
    last = max([r.finish for r in requests if r.finish is not None] + arrivals)
    measured = last - min(arrivals)

    def value(r: RequestTruth, metric: str) -> float:
        if r.reason != "length" or not r.emits or r.finish is None:
            return float("inf")
        if metric == "ttft":
            return 1000.0 * (r.emits[0][0] - r.arrival)
        if metric == "tpot":
            return 1000.0 * (r.emits[-1][0] - r.emits[0][0]) / (r.tokens - 1) if r.tokens >= 2 else 0.0
        return 1000.0 * (r.finish - r.arrival)

    def good_by(extra: float) -> float | None:
        if not bounds:
            return None
        return float(sum(1 for r in requests
                         if all(value(r, m) <= limit + extra * margin_ms(m, limit) for m, _, limit in bounds)))

    good = good_by(0.0)
    out: dict[str, float | None] = {
        "good": good, "good_low": good_by(-1.0), "good_high": good_by(1.0),
        "achieved_rate_rps": len(requests) / max(span, max(arrivals) - start),
        "goodput_rps": good / measured if good is not None and measured > 0 else None,
        "slo_met_fraction": good / len(requests) if good is not None else None,
        "avg_in_flight": sum((r.finish if r.finish is not None else last) - r.arrival for r in requests) / measured
        if measured > 0 else None,
        "completed": float(sum(1 for r in requests if r.reason == "length")),
        "output_tokens": float(sum(r.tokens for r in requests)),
        "measured_s": measured,
    }
    held, borderline = True, False
    for metric, q, limit in bounds:
        values = sorted(value(r, metric) for r in requests)
        finite = all(v != float("inf") for v in values)
        p = stats.percentile(values, q) if finite else None
        out[f"{metric}_p{q:g}_ms"] = p
        held = held and p is not None and p <= limit
        borderline = borderline or (p is not None and abs(p - limit) <= margin_ms(metric, limit))
    out["slo_passed"] = float(held) if bounds else None
    out["slo_borderline"] = float(borderline)
    return out
