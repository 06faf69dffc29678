"""A matrix's `search:` block: the flags `campaign tune` may set (choices or ranges), what it maximises and what
it must not break. A model only (night.tune searches it); matrix.Matrix carries it.

```yaml
search:
  flags:
    max-num-batched-tokens: [512, 1024, 2048, 4096, 8192]    # choices (in order: the search treats them as ordinal)
    gpu-memory-utilization: {low: 0.80, high: 0.95, step: 0.05}   # a range (step: a grid; log: a log scale)
  objective: {kind: agents-at-floor, context: 16K, max_tokens: 256, floor_tok_s: 20}
  # or goodput on a production trace's slice (its file next to the matrix), at the trace's own times:
  # objective: {kind: goodput, trace: {file: traces/t.jsonl, start_s: 0, duration_s: 60}, slo: {ttft_p99_ms: 2000}}
  constraints: {kv_at_least_baseline: true, ttft_p99_s: 2.0}
  trials: 20          # evaluations on the simulator (default: a fifth of a finite grid, at least 10)
  confirm: 2          # candidates launched against the baseline on the real server
```
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from campaign.measure import traces
from campaign.measure.cells import CellSpec, Sessions
from campaign.measure.slo import Slo
from campaign.measure.slo import field_input as slo_field_input
from campaign.server.profiles import FlagValue
from campaign.spec.token_counts import session_tokens, tokens

MAX_AGENTS = 512   # agents-at-floor searches concurrency up to this (and the KV cache's and max-num-seqs' limits)


class Range(BaseModel):
    """Every value from `low` to `high`: on a grid of `step`, or continuous (then the space is not a grid)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    low: float
    high: float
    step: float | None = Field(default=None, gt=0)
    log: bool = False

    @model_validator(mode="after")
    def _ordered(self) -> Range:
        if self.high <= self.low:
            raise ValueError(f"high {self.high:g} must be above low {self.low:g}")
        if self.log and (self.step is not None or self.low <= 0):
            raise ValueError("log: a scale of positive values without a step")
        return self

    @property
    def integral(self) -> bool:
        return all(float(v).is_integer() for v in (self.low, self.high, self.step or 0.5))

    def cast(self, value: float) -> int | float:
        """A value of the range as the flag takes it: whole where the range is, else to 10 decimals."""
        return int(value) if self.integral else round(float(value), 10)

    def values(self) -> list[float] | None:
        """The grid's values, low to high; None where the range is continuous."""
        if self.step is None:
            return None
        count = int(math.floor((self.high - self.low) / self.step + 1e-9)) + 1
        return [round(self.low + i * self.step, 10) for i in range(count)]


class TraceSource(BaseModel):
    """Which part of a trace file is replayed, and how (measure.traces.plan): a matrix's trace workload and a
    goodput objective's trace both say it so. `file` is the matrix file's neighbour unless absolute."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    file: str = Field(min_length=1)
    format: traces.TraceFormat | None = None     # None: told from the file's first line
    start_s: float = Field(default=0.0, ge=0)
    duration_s: float | None = Field(default=None, gt=0)
    sample: float = Field(default=1.0, gt=0, le=1)
    length_scale: float = Field(default=1.0, gt=0)
    max_requests: int | None = Field(default=None, gt=0)
    block_size: int | None = Field(default=None, gt=0)   # tokens a hash id stands for; None: the format's

    def plan(self, speed: float) -> tuple[traces.TraceSlice, list[traces.TraceRequest]]:
        """The slice at `speed` (its arrivals that much faster): its stored description and its requests."""
        return traces.plan(Path(self.file), self.format, start_s=self.start_s, duration_s=self.duration_s,
                           speed=speed, sample=self.sample, length_scale=self.length_scale,
                           max_requests=self.max_requests, block_size=self.block_size)

    def cell_at(self, speed: float, slo: Slo | None, max_concurrency: int | None = None) -> CellSpec:
        """The slice's rate cell at `speed` (CellSpec.from_trace): a trace workload's, and an objective's."""
        return CellSpec.from_trace(*self.plan(speed), slo=slo, max_concurrency=max_concurrency)


class ObjectiveTrace(TraceSource):
    """A goodput objective's load: a trace's slice at its own times (divided by `speed`)."""

    speed: float = Field(default=1.0, gt=0)

    def cell(self, slo: Slo | None) -> CellSpec:
        """The slice's rate cell, as a matrix's trace workload makes it."""
        return self.cell_at(self.speed, slo)


class Objective(BaseModel):
    """What a configuration is worth, measured on the simulator (phase 1) and on the real server (phase 2):
    - agents-at-floor: the most concurrent agents (sustained streams re-sending their context, so the prefix
      cache serves it, as an agent's loop does) that each still get `floor_tok_s`, within the KV cache and
      max-num-seqs; the study's "how many agents can run against it at once".
    - total-tok-s: the total output rate with `concurrency` such streams.
    - goodput: requests a second that meet every bound of `slo` (the tool's definition: first send to last
      end) when fresh requests of `context` tokens arrive open-loop (Poisson) at `rate_rps`; with `sessions`,
      the requests are the turns of agent sessions instead (a rate workload's sessions: a shared system
      prompt, each turn the session's history so far, so the prefix cache serves it), `context` their first
      turn's length; with `trace`, the requests of a trace's slice at their own times, with their own lengths
      and shared blocks, `context`, `max_tokens`, `rate_rps` and the window the slice's (its mean lengths,
      its mean rate, its span).
    - joules-per-token: the energy all the launch's GPUs draw per output token while their steps run (idle
      time between steps is not modelled) with `concurrency` such streams; lower is better. It needs a power
      model: a measured entry fitted to a run that measured energy (NVML); the hardware tables know speeds,
      not power."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["agents-at-floor", "total-tok-s", "goodput", "joules-per-token"]
    context: int = Field(gt=0)
    max_tokens: int = Field(default=256, gt=0)
    floor_tok_s: float | None = Field(default=None, gt=0)
    concurrency: int | None = Field(default=None, gt=0)
    rate_rps: float | None = Field(default=None, gt=0)
    slo: Slo | None = None
    sessions: Sessions | None = None
    trace: ObjectiveTrace | None = None
    # Each probe's window, in the hardware's seconds (default: three request lifetimes at the floor, at least
    # 20 s): agents that start together finish together, and a window shorter than a lifetime can miss the
    # moment they all send again (a 10 s window read every chunk size alike where 40 s tells them apart).
    window_s: float | None = Field(default=None, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _sessions_lengths(cls, data: Any) -> Any:
        """With sessions, the prompt lengths are their turns': `context` is the first turn's (system + user)."""
        if not isinstance(data, dict) or not isinstance(data.get("sessions"), dict):
            return data
        sessions = session_tokens(data["sessions"])
        if data.get("kind") != "goodput":
            raise ValueError(f"sessions with kind {data.get('kind')!r}: agent sessions are an open-loop load, "
                             "for kind goodput")
        if "context" in data:
            raise ValueError("context with sessions: the prompt lengths come from the sessions' turns; drop context")
        try:
            first = Sessions.model_validate(sessions).length(0, 0)
        except ValidationError:   # the sessions field's own validation says what is wrong, and nothing else
            return {**data, "sessions": sessions, "context": 1}
        return {**data, "sessions": sessions, "context": first}

    @model_validator(mode="before")
    @classmethod
    def _trace_load(cls, data: Any, info: ValidationInfo) -> Any:
        """With a trace, the lengths, the rate and the window are the slice's, read from the file (relative to
        the matrix's folder, which load_matrix gives as the validation context's `base`)."""
        if not isinstance(data, dict) or not isinstance(data.get("trace"), dict):
            return data
        if data.get("kind") != "goodput":
            raise ValueError(f"trace with kind {data.get('kind')!r}: a trace is an open-loop load, for kind goodput")
        if data.get("sessions") is not None:
            raise ValueError("sessions with trace: the requests are the trace's; drop sessions")
        given = [key for key in ("context", "max_tokens", "rate_rps", "window_s") if data.get(key) is not None]
        if len(given) == 4:
            return data   # resolved from its slice already: a stored run's matrix (Manifest.matrix_model)
        if given:
            raise ValueError(f"{given[0]} with trace: the lengths, arrivals and span come from the trace's slice; "
                             f"drop {given[0]}")
        try:
            trace = ObjectiveTrace.model_validate(data["trace"])
        except ValidationError:   # the trace field's own validation says what is wrong, and nothing else
            return data
        base = Path((info.context or {}).get("base", "."))
        path = Path(trace.file).expanduser()
        path = path if path.is_absolute() else (base / path).resolve()
        if not path.is_file():
            raise ValueError(f"trace.file: no such file: {path} (relative to the matrix file, or absolute)")
        trace = trace.model_copy(update={"file": str(path)})
        try:
            cell = trace.cell(None)
        except traces.EmptySlice as exc:
            raise ValueError(f"trace: {exc}; widen the slice (start_s, duration_s, sample, max_requests)") from None
        assert cell.request_rate is not None and cell.duration_s is not None
        return {**data, "trace": trace, "context": cell.context_tokens, "max_tokens": cell.max_tokens,
                "rate_rps": cell.request_rate, "window_s": cell.duration_s}

    @field_validator("context", mode="before")
    @classmethod
    def _count(cls, value: Any) -> Any:
        return tokens(value)

    _slo = field_validator("slo", mode="before")(slo_field_input)

    @model_validator(mode="after")
    def _needs(self) -> Objective:
        if self.kind == "agents-at-floor" and self.floor_tok_s is None:
            raise ValueError("agents-at-floor needs floor_tok_s (each agent's speed floor, tok/s)")
        if self.kind in ("total-tok-s", "joules-per-token") and self.concurrency is None:
            raise ValueError(f"{self.kind} needs concurrency (the streams it is measured with)")
        if self.kind == "goodput" and (self.rate_rps is None or self.slo is None):
            raise ValueError("goodput needs rate_rps (the offered load, req/s) and slo (e.g. {ttft_p99_ms: 2000, "
                             "tpot_p99_ms: 50})")
        return self

    def window(self) -> float:
        if self.window_s is not None:
            return self.window_s
        if self.kind == "goodput" and self.rate_rps:
            return max(60.0, 50 / self.rate_rps)   # at least 50 requests
        lifetime = self.max_tokens / self.floor_tok_s if self.floor_tok_s else 0.0
        return max(20.0, 3 * lifetime)

    @property
    def unit(self) -> str:
        return {"agents-at-floor": "agents", "total-tok-s": "tok/s", "goodput": "good req/s",
                "joules-per-token": "J/token"}[self.kind]

    @property
    def figure(self) -> str:
        """What phase 2 compares, predicted and measured, at the objective's load."""
        return {"agents-at-floor": "tok/s per agent", "total-tok-s": "total tok/s", "goodput": "good req/s",
                "joules-per-token": "J/token"}[self.kind]

    @property
    def lower_is_better(self) -> bool:
        return self.kind == "joules-per-token"

    def score(self, value: float, feasible: bool = True) -> float:
        """What the search maximises: the value, or for energy its inverse (tokens per joule); 0 where
        infeasible or undefined, the worst score."""
        if not feasible or value <= 0:
            return 0.0
        return 1 / value if self.lower_is_better else value

    def describe(self) -> str:
        if self.kind == "agents-at-floor":
            return (f"agents at {self.floor_tok_s:g} tok/s each, {self.context:,}-token context, "
                    f"{self.max_tokens}-token replies")
        if self.kind == "goodput":
            assert self.slo is not None
            load = f"{self.context:,}-token prompts" if self.sessions is None else (
                f"agent sessions' turns ({self.sessions.count} at once, {self.sessions.turns} turns, a "
                f"{self.sessions.system_tokens:,}-token system prompt, {self.sessions.user_tokens:,}-token "
                "messages)")
            if self.trace is not None:
                span = "to its end" if self.trace.duration_s is None else f"for {self.trace.duration_s:g} s"
                load = (f"the trace {Path(self.trace.file).name} from {self.trace.start_s:g} s {span}"
                        + (f" at {self.trace.speed:g}x" if self.trace.speed != 1 else "")
                        + f" (mean {self.context:,}-token prompts")
                return (f"goodput at {self.rate_rps:.3g} req/s of {load}, {self.max_tokens}-token replies), "
                        f"SLO {self.slo.text}")
            return (f"goodput at {self.rate_rps:g} req/s of {load} and {self.max_tokens}-token replies, "
                    f"SLO {self.slo.text}")
        if self.kind == "joules-per-token":
            return (f"joules per output token at {self.concurrency} streams, {self.context:,}-token context, "
                    f"{self.max_tokens}-token replies")
        return f"total tok/s at {self.concurrency} streams, {self.context:,}-token context"


class Constraints(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kv_at_least_baseline: bool = False          # a candidate's KV cache may not be smaller than the baseline's
    ttft_p99_s: float | None = Field(default=None, gt=0)   # every agent's TTFT p99 at the objective's load


class SearchBlock(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    flags: dict[str, list[FlagValue] | Range] = Field(min_length=1)
    objective: Objective
    constraints: Constraints = Field(default_factory=Constraints)
    trials: int | None = Field(default=None, ge=2)
    confirm: int = Field(default=2, ge=0)
    seed: int = 0

    @field_validator("flags")
    @classmethod
    def _choices(cls, value: dict[str, list[FlagValue] | Range]) -> dict[str, list[FlagValue] | Range]:
        for name, space in value.items():
            if isinstance(space, list) and len(space) < 2:
                raise ValueError(f"{name}: give at least two choices (one is a fixed flag: put it in the profile "
                                 "or the baseline)")
        return value

    def grid_size(self) -> int | None:
        """How many configurations a finite space holds; None where a range is continuous."""
        size = 1
        for space in self.flags.values():
            values = space if isinstance(space, list) else space.values()
            if values is None:
                return None
            size *= len(values)
        return size

    def planned_trials(self) -> int:
        """The evaluations phase 1 makes: as given, else a fifth of a finite grid (at least 10), else 30."""
        if self.trials is not None:
            return self.trials
        size = self.grid_size()
        return 30 if size is None else max(min(10, size), math.ceil(size / 5))
