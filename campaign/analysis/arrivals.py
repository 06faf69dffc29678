"""Loads as calibration evidence: requests that arrived at their own times (a stored run's rate or trace cell, a
peer's per-request export such as vLLM's `bench serve --save-detailed`, a public measurement's load) replayed on
the engine at those times, with their figures written as linear forms in the step costs. A trace's prompts
share the blocks its hash ids name, as the Measurer sent them (measure.traces.BlockPrompts).

Why linear: on a fixed schedule (which requests share which step) the engine's clock is piecewise. It idles until
a request arrives, then runs steps back to back; a step ends at the arrival that began its busy period plus the
summed costs of that period's steps so far. So a request's TTFT (its first token's step end less its arrival),
its TPOT (its last token's step end less its first's, over its gaps) and the run's output tok/s (as its inverse,
seconds per token) are each features . costs + a constant. calibrate fits the rows, replays with the new costs
(the schedule may shift) and fits again until it holds still: one loop for these and the closed-loop cells
(analysis/calibrate.py).

The figures, as vLLM's `bench serve` defines them (and this tool's measure/figures.py): the mean TTFT over the
requests; the mean TPOT over requests of two tokens or more, (last - first) / (tokens - 1); output tok/s, every
output token over the span from the first arrival to the last token.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from campaign.measure import traces
from campaign.plan import replay
from campaign.sim import truth as sim_truth
from campaign.sim.config import SimConfig
from campaign.sim.engine import Virtual, engine_for
from campaign.sim.model import StepCosts
from campaign.sim.truth import RequestTruth, StepTruth

# The cost terms a figure is linear in: a step's (StepTruth.features, in its order), then each request's time with
# the API server before the engine can seat it (StepCosts.request_s: a busy period begins that long after the
# arrival that began it, so every step of it ends that much later).
STEP_TERMS = ("fixed_s", "decode_s_per_token", "prefill_s_per_token", "attention_s_per_token_ctx",
              "kv_read_s_per_token")
TERMS = (*STEP_TERMS, "request_s")
OpenFigure = Literal["mean_ttft_s", "mean_tpot_s", "output_tok_s"]
FIGURES: tuple[OpenFigure, ...] = ("mean_ttft_s", "mean_tpot_s", "output_tok_s")


@dataclass(frozen=True)
class Sent:
    """One request of a load: when it arrived (seconds from any origin), its prompt and its reply in tokens,
    and the prefix blocks it shares with the load's other prompts (a trace's hash ids; empty: none, its prompt
    is its own)."""

    at_s: float
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Timed:
    """One measured request: the load's request, and its first and last tokens' times after its arrival."""

    sent: Sent
    ttft_s: float
    last_s: float


def measured_figures(timed: Sequence[Timed]) -> dict[OpenFigure, float]:
    """The figures of measured requests (those with a first token); a figure that is undefined (no request of
    two tokens, a zero span) is left out."""
    if not timed:
        return {}
    out: dict[OpenFigure, float] = {"mean_ttft_s": statistics.fmean(t.ttft_s for t in timed)}
    tpots = [(t.last_s - t.ttft_s) / (t.sent.output_tokens - 1) for t in timed if t.sent.output_tokens >= 2]
    if tpots:
        out["mean_tpot_s"] = statistics.fmean(tpots)
    span = max(t.sent.at_s + t.last_s for t in timed) - min(t.sent.at_s for t in timed)
    if span > 0:
        out["output_tok_s"] = sum(t.sent.output_tokens for t in timed) / span
    return out


@dataclass(frozen=True)
class Row:
    """One figure, linear in the step costs on the schedule its replay ran: features . costs + offset, in the
    row's units (seconds; output tok/s as seconds per token), against the measured `target` in the same."""

    figure: str
    features: np.ndarray
    offset: float
    target: float


RATES = ("output_tok_s", "total_tok_s")   # figures whose row is their inverse (seconds per token)


def in_row_units(figure: str, value: float) -> float:
    """A figure's value in its row's units (a rate as its inverse)."""
    return 1.0 / value if figure in RATES else value


def from_row_units(figure: str, value: float) -> float | None:
    """A row's value as the figure (None: a rate of no time)."""
    if figure not in RATES:
        return value
    return 1.0 / value if value > 0 else None


def vector(costs: StepCosts) -> np.ndarray:
    """The costs' terms in TERMS' order."""
    return np.array([getattr(costs, name) for name in TERMS])


@dataclass(frozen=True)
class Replayed:
    rows: list[Row]                   # the load's figures
    predicted: dict[str, float | None]
    problem: str | None = None        # why the replay published no figure (a request it could not serve)


@dataclass(frozen=True)
class Arrivals:
    """A load replayed at its own arrival times on a launch's engine, and the figures measured of it."""

    variant: str
    key: str
    config: SimConfig
    load: tuple[Sent, ...]
    measured: Mapping[OpenFigure, float]
    held_out: bool = False
    # A closed loop of this many requests in flight (run_load); None: each request arrived at its own time.
    max_concurrency: int | None = None
    # Prompt tokens a hash id stands for, where the load's prompts share blocks (a trace's, agent sessions');
    # None: they share none.
    block: int | None = None

    def replay(self, costs: StepCosts) -> Replayed:
        requests, steps = run_load(self.config, self.load, costs, self.max_concurrency, self.block)
        served = [r for r in requests if r is not None and r.emits]
        if len(served) < len(requests):
            return Replayed([], dict.fromkeys(FIGURES), f"{len(requests) - len(served)} of {len(requests)} "
                                                        "requests got no token on the replay")
        line = _Timeline(steps, costs)
        rows = [row for figure in FIGURES if figure in self.measured
                if (row := _row(figure, served, line, self.measured[figure])) is not None]
        predicted: dict[str, float | None] = dict.fromkeys(FIGURES)
        for row in rows:
            predicted[row.figure] = from_row_units(row.figure, float(row.features @ vector(costs)) + row.offset)
        return Replayed(rows, predicted)


def run_load(config: SimConfig, load: Sequence[Sent], costs: StepCosts, max_concurrency: int | None = None,
             block: int | None = None) -> tuple[list[RequestTruth | None], list[StepTruth]]:
    """The load on a fresh engine of `config` with `costs`, with fresh random-id prompts and exactly each
    request's reply length; each request's truth (in the load's order; None: it never finished) and every step.

    With `block`, a request's hash ids are shared blocks of that many tokens (the trace replay's own
    traces.BlockPrompts, so the engine's prefix cache serves what the measured server's could), and only the
    tokens past them are its own.

    Each request arrives at its own time (from the first). With `max_concurrency` (a closed loop, as vLLM's
    bench runs `--max-concurrency C` at an unlimited rate) the first C do, and each later one, in the order
    they were sent, when one ends: a closed loop's sends follow the server, so a replay faster or slower than
    the measured server sends them earlier or later, as the real client would have. Such a request arrives
    while the next step runs, never in it: the engine schedules that step the moment the last ends (vLLM
    schedules it before the last's tokens even reach the client), and the client sends only once it has read
    the reply's end. (Seated in that step instead, vLLM's bench at 4 streams replayed its second wave half a
    second late: one request's prefill slowed the three still decoding.)"""
    truth = sim_truth.Recorder()
    sim = Virtual(engine_for(replace(config, costs_override=costs), truth))
    prompts = replay.Prompts()
    blocks = None if block is None else traces.BlockPrompts(block, salt=0)
    order = sorted(range(len(load)), key=lambda i: load[i].at_s)
    origin = load[order[0]].at_s if order else 0.0
    index: dict[str, int] = {}
    waiting = deque(order[max_concurrency:] if max_concurrency else [])

    room = min(config.max_model_len, config.memory().kv_tokens)

    def send(i: int, at: float | None = None) -> None:
        if load[i].prompt_tokens + load[i].output_tokens > room:
            ended(sim.now)        # refused, as vLLM refuses a request past its window: it never reaches the engine
            return
        sent = load[i]
        ids = (blocks.ids(sent.hash_ids, sent.prompt_tokens) if blocks is not None and sent.hash_ids
               else prompts.fresh(sent.prompt_tokens))
        request = sim.submit(ids, sent.output_tokens, at=at, on_finish=ended)
        index[request.id] = i

    def ended(_t: float) -> None:
        # The closed loop's next request, sent as the client hears this one end: after the engine planned its
        # next step (Virtual's rule, the Measurer's in simulated time).
        if waiting:
            send(waiting.popleft())

    for i in order[:max_concurrency] if max_concurrency else order:
        at = load[i].at_s - origin
        sim.run(until=at)
        sim.now = max(sim.now, at)     # an idle engine waits for it
        send(i, at)
    sim.run()
    out: list[RequestTruth | None] = [None] * len(load)
    for request in truth.requests:
        out[index[request.id]] = request
    return out, truth.steps


class _Timeline:
    """When each step ended, as features . costs + a constant: the engine's busy periods (module docstring).
    A busy period begins when a request's time with the API server (`request_s`, the replay's) is over: its
    base is that request's arrival, and request_s one of its terms. What a step took beyond its terms at the
    replay's costs (a mixture's routed experts' read, which grows with the step's tokens as no term does; a
    drafter's passes) is in the constant: a fit holds it as the replay's costs had it."""

    def __init__(self, steps: Sequence[StepTruth], costs: StepCosts) -> None:
        self._at = {s.end: k for k, s in enumerate(steps)}
        self._base: list[float] = []
        self._prefix: list[np.ndarray] = []
        self._period: list[int] = []
        terms = vector(costs)
        for k, step in enumerate(steps):
            features = np.array([*step.features(), 0.0], dtype=float)
            beyond = (step.end - step.start) - float(features @ terms)
            if k == 0 or step.start != steps[k - 1].end:   # the engine idled before it: a busy period begins
                features[-1] = 1.0
                self._base.append(step.start - costs.request_s + beyond)
                self._prefix.append(features)
                self._period.append(k)
            else:
                self._base.append(self._base[-1] + beyond)
                self._prefix.append(self._prefix[-1] + features)
                self._period.append(self._period[-1])

    def at(self, t: float) -> tuple[np.ndarray, float]:
        """The step that ended at `t`: its end's features and constant."""
        k = self._at[t]
        return self._prefix[k], self._base[k]

    def ttft(self, r: RequestTruth) -> tuple[np.ndarray, float]:
        features, start = self.at(r.emits[0][0])
        # Sent as a step ended (a closed loop's next request), in the busy period its first token ended: on the
        # timeline too. (One that found the engine idle began a period of its own, from its own arrival.)
        if r.arrival in self._at and self._period[self._at[r.arrival]] == self._period[self._at[r.emits[0][0]]]:
            sent, sent_base = self.at(r.arrival)
            return features - sent, start - sent_base
        return features, start - r.arrival

    def tpot(self, r: RequestTruth) -> tuple[np.ndarray, float]:
        (last, last_base), (first, first_base) = self.at(r.emits[-1][0]), self.at(r.emits[0][0])
        return (last - first) / (r.tokens - 1), (last_base - first_base) / (r.tokens - 1)


def _row(figure: OpenFigure, requests: Sequence[RequestTruth], line: _Timeline, measured: float) -> Row | None:
    """The figure over the replayed requests as features . costs + offset (module docstring)."""
    terms: list[tuple[np.ndarray, float]] = []
    if figure == "mean_ttft_s":
        terms = [line.ttft(r) for r in requests]
    elif figure == "mean_tpot_s":
        terms = [line.tpot(r) for r in requests if r.tokens >= 2]
    else:
        tokens = sum(r.tokens for r in requests)
        end = max((r.emits[-1][0] for r in requests), default=None)
        if tokens and end is not None:
            features, start = line.at(end)
            terms.append((features / tokens, (start - min(r.arrival for r in requests)) / tokens))
    if not terms:
        return None
    return Row(figure, np.mean([t[0] for t in terms], axis=0), statistics.fmean(t[1] for t in terms),
               in_row_units(figure, measured))
