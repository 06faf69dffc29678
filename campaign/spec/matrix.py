"""Campaign matrices (`matrices/*.yaml`): which flag sets to launch and what to measure on each.

Validated into frozen models; every error names the file, the key path and a suggestion. The expansion into
variants and cells is deterministic, so a resumed run finds the same cell keys.

Long (about 730 lines): the matrix's models (variants, grid, nine workload kinds with their validators)
and its expansion into the schedule; every error names the file and key, so each validator is beside its
field.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from campaign.core.errors import ConfigError, PromptError, did_you_mean
from campaign.core.vllm_flags import normalize_flag
from campaign.http.endpoint import Timeouts
from campaign.measure import corpus, traces
from campaign.measure import slo as slos
from campaign.measure.capacity import search_key  # the experiment names its own results
from campaign.measure.cells import SESSIONS_CHAT, CellSpec, Sessions
from campaign.measure.judged import MIN_EFFECT
from campaign.measure.openloop import Arrival, rate_value
from campaign.measure.prompts import prompt_source
from campaign.measure.slo import Slo
from campaign.measure.study import agents_key  # the experiment names its own results
from campaign.server import flag_list
from campaign.server.profiles import (
    PROJECT_ROOT,
    FlagValue,
    LaunchProfile,
    flag_problems,
    load_yaml,
    raise_flag_problems,
    resolve_named,
)
from campaign.spec.search_spec import SearchBlock, TraceSource
from campaign.spec.token_counts import session_tokens, tokens

MATRIX_SCHEMA_VERSION = 1
MATRICES_DIR = PROJECT_ROOT / "matrices"
SUGGESTED = "suggested"  # `gpu-memory-utilization: suggested` takes the baseline log's recommendation ...
# ... less a safety margin, as seed 000 advises ("keeping a safety margin"): 0.01 unless `suggested-0.02`.
SUGGESTED_MARGIN = 0.01
_SUGGESTED = re.compile(r"^suggested(?:-(\d*\.\d+|0))?$")


def suggested_margin(value: object) -> float | None:
    """The margin of a `suggested` / `suggested-0.02` value; None for any other value."""
    match = _SUGGESTED.match(value) if isinstance(value, str) else None
    if match is None:
        return None
    return float(match.group(1)) if match.group(1) is not None else SUGGESTED_MARGIN


TokenList = list[int]


def _token_list(value: Any) -> Any:
    if isinstance(value, list):
        return [tokens(v) for v in value]
    return value


class _Workload(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _TextWorkload(_Workload):
    """What the prompts are made of (random token ids; code or prose from the standard library; the texts of
    a FILE.jsonl next to the matrix) and the endpoint they go to (chat: the chat template and the server's
    reasoning and tool-call parsers)."""

    prompts: str = "random"
    endpoint: Literal["completions", "chat"] = "completions"

    _prompts = field_validator("prompts")(prompt_source)

    @property
    def text(self) -> dict[str, Any]:
        return {"prompts": self.prompts, "endpoint": self.endpoint}


class PrefillWorkload(_TextWorkload):
    kind: Literal["prefill"]
    contexts: TokenList

    _contexts = field_validator("contexts", mode="before")(_token_list)

    def cells(self, window_s: float) -> list[CellSpec]:
        return [CellSpec(phase="prefill", context_tokens=c, **self.text) for c in self.contexts]


class DecodeWorkload(_TextWorkload):
    """Seed 004's sustained decode (fixed window) or seed 000's fixed count (every request emits N tokens)."""

    kind: Literal["decode"]
    mode: Literal["sustained", "fixed"] = "sustained"
    contexts: TokenList
    concurrency: list[int] = Field(min_length=1)
    max_tokens: int = Field(default=256, gt=0)
    window_s: float | None = Field(default=None, gt=0)
    warmup_s: float = Field(default=2.0, ge=0)
    ttft: Literal["cold", "warm"] = "cold"
    # Fixed mode: rounds of C requests until at least this many requests and seconds.
    min_requests: int = Field(default=1, ge=1)
    min_seconds: float = Field(default=0.0, ge=0)

    _contexts = field_validator("contexts", mode="before")(_token_list)

    def cells(self, window_s: float) -> list[CellSpec]:
        return [
            CellSpec(phase="decode", context_tokens=ctx, concurrency=conc, mode=self.mode,
                     max_tokens=self.max_tokens, window_s=self.window_s or window_s, warmup_s=self.warmup_s,
                     ttft=self.ttft, min_requests=self.min_requests, min_seconds=self.min_seconds, **self.text)
            for ctx in self.contexts for conc in self.concurrency
        ]


def _rate_input(value: Any) -> Any:
    """`inf` (as fast as the cap allows) is None; every other rate a number of requests a second above 0."""
    return [rate_value(v) for v in value] if isinstance(value, list) else value


class _LoadShape(_TextWorkload):
    """What an open-loop request looks like and how requests arrive (openloop.py)."""

    max_tokens: int = Field(default=256, gt=0)
    duration_s: float | None = Field(default=None, gt=0)   # default: the matrix's window_s
    arrival: Arrival = "poisson"
    burstiness: float = Field(default=1.0, gt=0)
    range_ratio: float = Field(default=0.0, ge=0, lt=1)
    slo: Slo | None = None                              # default: the matrix's slo
    sessions: Sessions | None = None                    # agent traffic: the lengths come from its turns

    _slo = field_validator("slo", mode="before")(slos.field_input)

    _session_tokens = field_validator("sessions", mode="before")(session_tokens)

    @model_validator(mode="after")
    def _chat_lengths_fixed(self) -> _LoadShape:
        if self.range_ratio and self.endpoint == "chat":
            raise ValueError("range_ratio with endpoint: chat: a chat prompt is fitted once per length, so its "
                             "lengths are fixed; use the completions endpoint, or range_ratio: 0")
        if self.sessions is not None and self.endpoint == "chat":
            raise ValueError(SESSIONS_CHAT)
        if self.sessions is not None and self.range_ratio:
            raise ValueError("range_ratio with sessions: each turn has its own length; drop range_ratio")
        return self

    def _check_lengths(self, given: bool, what: str) -> None:
        """Prompt lengths come from `what` or from the sessions' turns, never both."""
        if self.sessions is not None and given:
            raise ValueError(f"{what} with sessions: the lengths come from the sessions' turns; drop {what}")
        if self.sessions is None and not given:
            raise ValueError(f"give {what} (prompt lengths in tokens), or sessions")

    def rate_spec(self, context: int, rate: float | None, *, window_s: float, matrix_slo: Slo | None,
                  **more: Any) -> CellSpec:
        if self.sessions is not None:
            context = self.sessions.length(0, self.max_tokens)
        return CellSpec(phase="rate", context_tokens=context, max_tokens=self.max_tokens, request_rate=rate,
                        duration_s=self.duration_s or window_s, arrival=self.arrival, burstiness=self.burstiness,
                        range_ratio=self.range_ratio, slo=self.slo or matrix_slo, sessions=self.sessions,
                        **self.text, **more)


class RateWorkload(_LoadShape):
    """Open-loop load: requests arriving at each rate (req/s; `inf`: as fast as `max_concurrency` allows) for
    duration_s, at each context; judged against the SLO where one is given."""

    kind: Literal["rate"]
    contexts: TokenList = Field(default_factory=list)   # none with sessions
    rates: list[float | None] = Field(min_length=1)
    max_concurrency: int | None = Field(default=None, gt=0)
    min_requests: int = Field(default=1, ge=1)

    _contexts = field_validator("contexts", mode="before")(_token_list)
    _rates = field_validator("rates", mode="before")(_rate_input)

    @model_validator(mode="after")
    def _inf_needs_a_cap(self) -> RateWorkload:
        if None in self.rates and self.max_concurrency is None:
            raise ValueError("a rate of inf needs max_concurrency (the requests in flight at once)")
        self._check_lengths(bool(self.contexts), "contexts")
        return self

    def cells(self, window_s: float, matrix_slo: Slo | None = None) -> list[CellSpec]:
        return [self.rate_spec(ctx, rate, window_s=window_s, matrix_slo=matrix_slo,
                               max_concurrency=self.max_concurrency, min_requests=self.min_requests)
                for ctx in self.contexts or [0] for rate in self.rates]   # 0: rate_spec takes the sessions'


class TraceWorkload(_Workload, TraceSource):
    """A production trace replayed (traces.py): its requests at their own times (divided by each of `speeds`),
    with their own lengths and shared blocks, open loop; judged against the SLO where one is given. Which part
    of which file: search_spec.TraceSource (a goodput objective's trace says it the same way)."""

    kind: Literal["trace"]
    speeds: list[float] = Field(default_factory=lambda: [1.0], min_length=1)
    max_concurrency: int | None = Field(default=None, gt=0)
    slo: Slo | None = None

    _slo = field_validator("slo", mode="before")(slos.field_input)

    @field_validator("speeds")
    @classmethod
    def _positive(cls, value: list[float]) -> list[float]:
        if any(not v > 0 for v in value):
            raise ValueError("a speed is above 0 (2: the trace's arrivals twice as fast)")
        return value

    def cells(self, window_s: float, matrix_slo: Slo | None = None) -> list[CellSpec]:
        return [self.cell_at(speed, self.slo or matrix_slo, self.max_concurrency) for speed in self.speeds]


class _Experiment(_Workload):
    """A workload of the study issue: measured after the cells of each launch, stored under experiments/."""

    def cells(self, window_s: float) -> list[CellSpec]:
        return []

    @property
    def key(self) -> str:
        raise NotImplementedError


class ContextWindowExperiment(_Experiment):
    kind: Literal["context-window"]
    reply_tokens: int = Field(default=200, gt=1)

    @property
    def key(self) -> str:
        return "context-window"


class LongContextExperiment(_Experiment):
    kind: Literal["long-context"]
    contexts: TokenList = Field(min_length=1)
    reply_tokens: int = Field(default=128, gt=1)

    _contexts = field_validator("contexts", mode="before")(_token_list)

    @property
    def key(self) -> str:
        return "long-context"


class OverloadExperiment(_Experiment):
    kind: Literal["overload"]
    factor: float = Field(default=1.25, gt=1.0)
    max_num_seqs: int | None = Field(default=None, gt=0)  # default: the launched flags' max-num-seqs
    prompt_tokens: int = Field(default=64, gt=0)
    reply_tokens: int = Field(default=64, gt=0)

    @property
    def key(self) -> str:
        return f"overload-x{self.factor:g}"


class PrefixOrderExperiment(_Experiment):
    kind: Literal["prefix-order"]
    agents: int = Field(default=4, ge=2)
    shared_tokens: int = Field(default=2400, gt=0)
    task_tokens: int = Field(default=200, gt=0)
    reply_tokens: int = Field(default=64, gt=0)

    @property
    def key(self) -> str:
        return f"prefix-order-K{self.agents}"


class RepeatExperiment(_Experiment):
    """One decode cell measured `times` times in a row, to see bimodal behaviour (seed 000's 4-wide runs)."""

    kind: Literal["repeat"]
    context: int
    concurrency: int = Field(gt=0)
    mode: Literal["sustained", "fixed"] = "fixed"
    max_tokens: int = Field(default=256, gt=0)
    window_s: float | None = Field(default=None, gt=0)
    times: int = Field(default=4, ge=2)

    _context = field_validator("context", mode="before")(tokens)

    def spec(self, window_s: float) -> CellSpec:
        return CellSpec(phase="decode", context_tokens=self.context, concurrency=self.concurrency, mode=self.mode,
                        max_tokens=self.max_tokens, window_s=self.window_s or window_s)

    @property
    def key(self) -> str:
        # Matrix.experiments() fills window_s of a sustained repeat; 30 s only names a fixed-count one's key.
        return f"repeat-{self.spec(30.0).key}"


class AgentsExperiment(_Experiment):
    """N concurrent chat sessions on a shared system prompt, histories growing turn by turn (study.agents)."""

    kind: Literal["agents"]
    sessions: list[int] = Field(min_length=1)
    turns: int = Field(default=4, ge=1)
    system_tokens: int = Field(default=2000, gt=0)
    user_tokens: int = Field(default=200, gt=0)
    reply_tokens: int = Field(default=128, gt=1)
    prompts: str = "prose"
    floors: list[float] = Field(default_factory=lambda: [40.0, 30.0, 20.0], min_length=1)

    @field_validator("sessions")
    @classmethod
    def _positive(cls, value: list[int]) -> list[int]:
        if any(n < 1 for n in value):
            raise ValueError("every number of sessions is at least 1")
        return value

    _prompts = field_validator("prompts")(prompt_source)

    @property
    def key(self) -> str:
        return agents_key(sessions=self.sessions, turns=self.turns, system_tokens=self.system_tokens,
                          user_tokens=self.user_tokens, reply_tokens=self.reply_tokens, prompts=self.prompts)


class SloSearchExperiment(_LoadShape, _Experiment):
    """Capacity at the SLO (capacity.py): the highest request rate of open-loop probes shaped like this, and
    (concurrency: true) the highest number of streams at once, at which every bound holds."""

    kind: Literal["slo-search"]
    context: int | None = None   # none with sessions
    # Where the rate search starts; none: at the throughput of a batch pass, walking down (capacity.BatchStart).
    start_rps: float | None = Field(default=None, gt=0)
    resolution: float = Field(default=0.05, gt=0, lt=1)
    max_probes: int = Field(default=12, ge=2)
    concurrency: bool = True
    max_concurrency: int | None = Field(default=None, gt=0)   # the concurrency search's ceiling

    _context = field_validator("context", mode="before")(lambda v: None if v is None else tokens(v))

    @model_validator(mode="after")
    def _one_length(self) -> SloSearchExperiment:
        self._check_lengths(self.context is not None, "context")
        return self

    def spec(self, window_s: float = 30.0, matrix_slo: Slo | None = None) -> CellSpec:
        """The probes' shape (each probe sets its own rate)."""
        return self.rate_spec(self.context or 0, 1.0, window_s=window_s, matrix_slo=matrix_slo)

    @property
    def key(self) -> str:
        # Matrix.experiments() fills duration_s and slo from the matrix; the key names both.
        return search_key(self.spec(), concurrency=self.concurrency)


Experiment = ContextWindowExperiment | LongContextExperiment | OverloadExperiment | PrefixOrderExperiment | \
    RepeatExperiment | AgentsExperiment | SloSearchExperiment
WORKLOAD_KINDS = ("prefill", "decode", "rate", "trace", "context-window", "long-context", "overload", "prefix-order",
                  "repeat", "agents", "slo-search")
Workload = Annotated[PrefillWorkload | DecodeWorkload | RateWorkload | TraceWorkload | ContextWindowExperiment |
                     LongContextExperiment | OverloadExperiment | PrefixOrderExperiment | RepeatExperiment |
                     AgentsExperiment | SloSearchExperiment, Field(discriminator="kind")]


class Variant(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._=,+-]*$")
    flags: dict[str, FlagValue] = Field(default_factory=dict)
    description: str = ""
    # Compare this variant with another than the baseline: a chain of changes (seed 000 judged the bigger
    # chunk against the memory change it was made on top of).
    compare_to: str | None = None


DEFAULT_TIMEOUTS = Timeouts()


class TimeoutsConfig(BaseModel):
    """The measured path's timeouts, seconds: connecting, the first byte of a reply, silence inside a reply.
    The idle one also covers the wait for the first token (prefill plus queueing)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    connect_s: float = Field(default=DEFAULT_TIMEOUTS.connect_s, gt=0)
    first_byte_s: float = Field(default=DEFAULT_TIMEOUTS.first_byte_s, gt=0)
    idle_s: float = Field(default=DEFAULT_TIMEOUTS.idle_s, gt=0)

    def timeouts(self) -> Timeouts:
        return Timeouts(connect_s=self.connect_s, first_byte_s=self.first_byte_s, idle_s=self.idle_s)


AUTO_FIRST_ROUNDS = 2    # `repeats: auto` starts with two launches a side: the fewest that show the noise
AUTO_MAX_REPEATS = 10    # ... and stops at this many unless `max_repeats` says otherwise


def duration_s(value: Any) -> float:
    """A wall-clock span as written: seconds, or a number with s, m or h (`8h`, `90m`). ValueError otherwise."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", str(value))
    if match is None:
        raise ValueError(f"{value!r} is not a duration: write seconds, or a number with s, m or h (8h, 90m)")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]


class Matrix(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    schema_version: int = MATRIX_SCHEMA_VERSION
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    description: str = ""
    profile: str
    baseline: str
    variants: list[Variant] = Field(default_factory=list)
    # A grid expands into one variant per combination, named by its values (e.g. max-num-seqs=8).
    grid: dict[str, list[FlagValue]] = Field(default_factory=dict)
    workloads: list[Workload] = Field(min_length=1)
    # Launches a side, in interleaved rounds. `repeats: auto` runs rounds until every variant's verdict is
    # settled (docs/verdicts.md): from AUTO_FIRST_ROUNDS, at most `max_repeats`, within `budget` of wall time.
    repeats: int = Field(default=1, ge=1)
    until_settled: bool = False
    max_repeats: int | None = Field(default=None, ge=2)
    budget_s: float | None = Field(default=None, gt=0, alias="budget")
    # The smallest change worth acting on, as a fraction (0.03: 3%): "no difference" promises every deciding
    # figure is shown within it, and a change inside it is never better or worse.
    min_effect: float = Field(default=MIN_EFFECT, gt=0, lt=1)
    window_s: float = Field(default=30.0, gt=0)
    # Speed floors (tok/s per request) for "how many agents are useful"; the first is the headline one.
    floors: list[float] = Field(default_factory=lambda: [40.0, 30.0, 20.0], min_length=1)
    max_attempts: int = Field(default=3, ge=1)
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig)
    # Before the first measured cell of every launch: requests of each shape the matrix uses (never measured).
    warmup: bool = True
    # Add an exact copy of the baseline, `<baseline>-aa`, launched and measured like any variant: its diff
    # against the baseline is this rig's false-positive check (an A/A must come out "no difference").
    aa: bool = False
    # The service level rate cells and SLO searches are judged against, unless a workload gives its own.
    slo: Slo | None = None
    # `campaign tune`: the flags it may set, what it maximises, its constraints (spec.search_spec).
    search: SearchBlock | None = None

    _slo = field_validator("slo", mode="before")(slos.field_input)

    @model_validator(mode="before")
    @classmethod
    def _auto_repeats(cls, data: Any) -> Any:
        """`repeats: auto` is rounds until settled; `budget: 8h` a wall-clock budget (s, m or h)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if isinstance(data.get("repeats"), str) and data["repeats"].strip().lower() == "auto":
            data["repeats"], data["until_settled"] = AUTO_FIRST_ROUNDS, True
            data.setdefault("max_repeats", AUTO_MAX_REPEATS)
        if "budget" in data:
            data["budget"] = duration_s(data["budget"])
        return data

    @model_validator(mode="after")
    def _settling(self) -> Matrix:
        if (self.max_repeats is not None or self.budget_s is not None) and not self.until_settled:
            raise ValueError("max_repeats and budget apply to `repeats: auto` (rounds until settled); "
                             "with a fixed number of repeats, remove them")
        if self.max_repeats is not None and self.max_repeats < self.repeats:
            raise ValueError(f"max_repeats {self.max_repeats} is below repeats {self.repeats}")
        return self

    @model_validator(mode="after")
    def _baseline_exists(self) -> Matrix:
        names = [v.name for v in self.all_variants()]
        if len(set(names)) != len(names):
            duplicate = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"variant name {duplicate!r} appears twice")
        for variant in self.variants:
            if variant.compare_to is not None and variant.compare_to not in names:
                raise ValueError(f"variant {variant.name!r}: compare_to {variant.compare_to!r} is not a variant")
        if self.baseline not in names:
            suggestion = did_you_mean(self.baseline, names)
            raise ValueError(f"baseline {self.baseline!r} is not a variant"
                             + (f"; did you mean {suggestion}?" if suggestion else f" (variants: {', '.join(names)})"))
        for index, workload in enumerate(self.workloads):
            if isinstance(workload, SloSearchExperiment) and workload.slo is None and self.slo is None:
                raise ValueError(f"workloads[{index}] (slo-search): no SLO to search against: give `slo:` to the "
                                 "matrix or the workload, e.g. {ttft_p99_ms: 2000, floor_tok_s: 20}")
        return self

    def all_variants(self) -> list[Variant]:
        variants = list(self.variants)
        if self.grid:
            keys = list(self.grid)
            for values in itertools.product(*(self.grid[k] for k in keys)):
                flags = dict(zip(keys, values, strict=True))
                name = ",".join(f"{normalize_flag(k)}={v}" for k, v in flags.items())
                variants.append(Variant(name=name.replace(" ", ""), flags=flags))
        baseline = next((v for v in variants if v.name == self.baseline), None)
        if self.aa and baseline is not None:
            variants.append(Variant(name=aa_name(self.baseline), flags=dict(baseline.flags),
                                    description="A/A: the baseline's exact flags, to measure this rig's false "
                                                "positives"))
        return variants

    def ordered_variants(self) -> list[Variant]:
        """Baseline first: it is measured first and its log resolves `suggested` values."""
        variants = self.all_variants()
        return sorted(variants, key=lambda v: v.name != self.baseline)

    def experiments(self) -> list[Experiment]:
        """The experiments as they will run: a sustained `repeat` carries the window it is measured over, so
        its key (which names the window) is the same when it is planned, stored and looked up on resume."""
        out: list[Experiment] = []
        for w in self.workloads:
            if isinstance(w, RepeatExperiment) and w.mode == "sustained" and w.window_s is None:
                out.append(w.model_copy(update={"window_s": self.window_s}))
            elif isinstance(w, SloSearchExperiment):
                out.append(w.model_copy(update={"duration_s": w.duration_s or self.window_s, "slo": w.slo or self.slo}))
            elif isinstance(w, _Experiment):
                out.append(w)
        return out

    def cells(self) -> list[CellSpec]:
        seen: dict[str, CellSpec] = {}
        for workload in self.workloads:
            specs = workload.cells(self.window_s, self.slo) if isinstance(workload, RateWorkload | TraceWorkload) \
                else workload.cells(self.window_s)
            for spec in specs:
                seen.setdefault(spec.key, spec)
        return list(seen.values())


def aa_name(baseline: str) -> str:
    """The name of the baseline's A/A copy (`aa: true`)."""
    return f"{baseline}-aa"


def schedule(matrix: Matrix, retired: Mapping[str, int] | None = None) -> list[tuple[str, int]]:
    """Launch order (variant, repeat): rounds alternate direction (A B C, C B A, ...) so slow drift through
    the night does not read as a difference; a final baseline launch is the drift sentinel where the last
    round does not already end on the baseline (except in a night run until settled, whose every round has
    the baseline). `retired`: variants a night run until settled has retired, with the rounds they ran; they
    are in no later round."""
    names = [v.name for v in matrix.ordered_variants()]
    retired = retired or {}
    order: list[tuple[str, int]] = []
    for repeat in range(matrix.repeats):
        round_names = names if repeat % 2 == 0 else list(reversed(names))
        order.extend((name, repeat) for name in round_names if repeat < retired.get(name, matrix.repeats))
    # A night run until settled has the baseline in every round it runs: no sentinel after it.
    if len(names) > 1 and order[-1][0] != matrix.baseline and not matrix.until_settled:
        order.append((matrix.baseline, matrix.repeats))
    return order


def resolve_matrix_path(name_or_path: str) -> Path:
    return resolve_named(name_or_path, MATRICES_DIR, "matrix")


def load_matrix(name_or_path: str) -> tuple[Matrix, Path, dict[str, Any]]:
    """The validated matrix, its path, and the raw mapping as written (stored with the run)."""
    path = resolve_matrix_path(name_or_path)
    data = load_yaml(path)
    version = data.get("schema_version", MATRIX_SCHEMA_VERSION)
    if isinstance(version, int) and version > MATRIX_SCHEMA_VERSION:
        raise ConfigError(str(path), "schema_version", f"version {version} is newer than this tool understands",
                          hint="upgrade vllm-campaign")
    for index, workload in enumerate(data.get("workloads") or []):
        kind = workload.get("kind") if isinstance(workload, dict) else None
        if isinstance(kind, str) and kind not in WORKLOAD_KINDS:
            suggestion = did_you_mean(kind, WORKLOAD_KINDS)
            hint = f"did you mean {suggestion}?" if suggestion else f"kinds: {', '.join(WORKLOAD_KINDS)}"
            raise ConfigError(str(path), f"workloads[{index}].kind", f"unknown workload kind {kind!r}", hint=hint)
    try:
        # `base`: where a search objective's trace file is read from (trace workloads' files: below).
        matrix = Matrix.model_validate(data, context={"base": str(path.parent)})
    except ValidationError as exc:
        _raise_matrix_error(str(path), exc)
        raise
    matrix = matrix.model_copy(update={"profile": _profile_relative_to(path, matrix.profile),
                                       "workloads": _prompt_files_relative_to(path, matrix.workloads)})
    raise_flag_problems(str(path), [
        *(problem for index, variant in enumerate(matrix.variants)
          for problem in flag_problems(f"variants[{index}].flags", variant.flags)),
        *flag_problems("grid", matrix.grid, grid=True),
        *flag_problems("search.flags", {name: space if isinstance(space, list) else [space.low, space.high]
                                        for name, space in (matrix.search.flags if matrix.search else {}).items()},
                       grid=True)])
    for index, variant in enumerate(matrix.variants):
        for key, value in variant.flags.items():
            margin = suggested_margin(value)
            if margin is not None and normalize_flag(key) != "gpu-memory-utilization":
                raise ConfigError(str(path), f"variants[{index}].flags.{key}",
                                  "only gpu-memory-utilization can be `suggested`")
            if margin is not None and not 0 <= margin < 0.5:
                raise ConfigError(str(path), f"variants[{index}].flags.{key}",
                                  f"a margin of {margin:g} below the suggestion is out of range",
                                  hint="e.g. suggested (0.01 below) or suggested-0.02")
            if isinstance(value, str) and value.startswith(SUGGESTED) and margin is None:
                raise ConfigError(str(path), f"variants[{index}].flags.{key}", f"{value!r} is not understood",
                                  hint="write suggested (0.01 below vLLM's advice) or suggested-0.02")
    return matrix, path, data


def _prompt_files_relative_to(matrix_path: Path, workloads: list[Any]) -> list[Any]:
    """A prompts FILE.jsonl is the matrix file's neighbour unless absolute; it must exist before the night."""
    out = []
    for index, workload in enumerate(workloads):
        if isinstance(workload, TraceWorkload):
            file = Path(workload.file).expanduser()
            file = file if file.is_absolute() else (matrix_path.parent / file).resolve()
            if not file.is_file():
                raise ConfigError(str(matrix_path), f"workloads[{index}].file", f"no such file: {file}",
                                  hint="give a trace file (JSONL or CSV), relative to the matrix file or absolute")
            workload = workload.model_copy(update={"file": str(file)})
            try:
                workload.cells(1.0)   # a malformed line (its file and line), or an empty slice, before the night
            except traces.EmptySlice as exc:
                raise ConfigError(str(matrix_path), f"workloads[{index}]", str(exc),
                                  hint="widen the slice: start_s, duration_s, sample, max_requests") from None
            out.append(workload)
            continue
        prompts = getattr(workload, "prompts", "random")
        if prompts.endswith(".jsonl"):
            file = Path(prompts).expanduser()
            file = file if file.is_absolute() else (matrix_path.parent / file).resolve()
            if not file.is_file():
                raise ConfigError(str(matrix_path), f"workloads[{index}].prompts", f"no such file: {file}",
                                  hint="give a .jsonl file of prompts, relative to the matrix file or absolute")
            try:
                corpus.jsonl(file)  # a bad line is found before the night, not at its first text cell
            except PromptError as exc:
                raise ConfigError(str(matrix_path), f"workloads[{index}].prompts", exc.message,
                                  hint=exc.hint) from None
            workload = workload.model_copy(update={"prompts": str(file)})
        out.append(workload)
    return out


def _profile_relative_to(matrix_path: Path, profile: str) -> str:
    """A profile named by a relative path is the matrix file's neighbour (or, as before, the project's), never
    whatever the current directory happens to hold."""
    candidate = Path(profile).expanduser()
    if candidate.is_absolute() or (candidate.suffix not in {".yaml", ".yml"} and "/" not in profile):
        return profile  # absolute, or a name in launch_profiles/
    for base in (matrix_path.resolve().parent, PROJECT_ROOT):
        if (base / candidate).exists():
            return str(base / candidate)
    raise ConfigError(str(matrix_path), "profile", f"{profile}: no such file next to the matrix",
                      hint="relative paths are the matrix file's; or name a profile in launch_profiles/")


def _raise_matrix_error(path: str, exc: ValidationError) -> None:
    # An unknown key is usually the cause of a "missing" one (a misspelling): report it first.
    first = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")[0]
    loc = list(first["loc"])
    # Workload errors carry the union tag in their location (workloads.0.decode.concurrency): drop it.
    if len(loc) > 2 and loc[0] == "workloads" and loc[2] in WORKLOAD_KINDS:
        del loc[2]
    key = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(loc))
    if first["type"] == "extra_forbidden":
        fields: set[str] = set(Matrix.model_fields)
        if loc[0] == "workloads":
            fields = {f for model in (PrefillWorkload, DecodeWorkload, RateWorkload, TraceWorkload,
                                      ContextWindowExperiment, LongContextExperiment, OverloadExperiment,
                                      PrefixOrderExperiment, RepeatExperiment, AgentsExperiment, SloSearchExperiment)
                      for f in model.model_fields}
        elif loc[0] == "variants":
            fields = set(Variant.model_fields)
        elif loc[0] == "timeouts":
            fields = set(TimeoutsConfig.model_fields)
        suggestion = did_you_mean(str(loc[-1]), fields)
        hint = f"did you mean {suggestion}?" if suggestion else f"known keys: {', '.join(sorted(fields))}"
        raise ConfigError(path, key, "unknown key", hint=hint)
    if first["type"] == "missing":
        raise ConfigError(path, key, "required key is missing")
    raise ConfigError(path, key or "matrix", str(first["msg"]).removeprefix("Value error, "))


def definition_hash(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def night_uses(profile: LaunchProfile, profile_path: Path, matrix: Matrix | None = None,
               matrix_path: Path | None = None, overrides: Iterable[str] = ()) -> list[flag_list.FlagUse]:
    """Every flag a campaign (or one `launch`) will pass, with where it is written."""
    found = flag_list.uses(str(profile_path), "flags", profile.flags)
    if matrix is not None:
        where = str(matrix_path or matrix.name)
        for index, variant in enumerate(matrix.variants):
            found += flag_list.uses(where, f"variants[{index}].flags", variant.flags)
        found += flag_list.uses(where, "grid", matrix.grid)
    found += flag_list.uses("launch", "--set", overrides)
    return found
