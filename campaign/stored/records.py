"""Every file a run stores, as a typed, versioned model with a description on every field.

The run directory's API (store.RunDir) returns these; nothing reads a result file by string paths.
docs/results-format.md is generated from them (`python -m campaign.stored.records > docs/results-format.md`; a test
keeps it current). Each file carries `schema_version`; an older one is brought to the current version by the
explicit steps in MIGRATIONS, one version at a time, and a newer one is refused with a hint to upgrade.

Format history:
1 - first format (vllm-campaign 0.1.0).
2 - cells carry `notes` and latency distributions (ttft/itl/tpot/e2e at p50, p90, p99 in ms), request
    records `token_count` and `error_kind`; experiments carry their `attempts`; a launch may have
    warmup.json, a first cell its guard-<n>.json, a run repeats-<n>.json.
3 - sustained cells carry the server's sampled queue (`avg_running`, `avg_waiting`, `kv_usage_max`); a
    queued cell's reason code names its cause.
4 - request records carry `server_id`; sustained cells carry their `window`.
5 - stop.json carries `stopped_utc`, the manifest the plan's `estimate`; cells their client's timing noise
    (`client_lag_p99_ms`) and `spec_mean_accepted`; cell specs their `prompts` and `endpoint` (keys of text or
    chat cells end in -P<source> and -Echat); request records `reasoning_tokens` (chat).
6 - open-loop load: cells of phase `rate` (specs carry request_rate, arrival, burstiness, duration_s,
    max_concurrency, range_ratio, slo, early_stop; results the achieved rate, goodput, slo_met_fraction,
    slo_passed, slo_bounds, send lag, requests in flight, time_scale, and `window` as the schedule's span);
    request records `scheduled_t` and `released_t`; experiments of kind `slo-search`; short answers
    `capacity_at_slo`.
7 - a launch may have placement.json: where it ran (executor, host, Ray node, GPU indices with NVML UUIDs and
    names, the client's cores) and from when to when; the manifest its `executor` and GPU `pool`; a launch
    failure may be `node_lost` (a Ray node died under it); a guard its `gpu_telemetry` (it can stand in for
    the cell it re-measured).
8 - a rate cell's spec may carry `sessions` (count, turns, system_tokens, user_tokens): open-loop agent traffic
    whose prompts are the turns of sessions on one shared system prompt (keys add -A<count>x<turns>s<S>u<U>);
    an overload experiment's details its sampled `gauges` ([perf_counter, running, waiting]).
9 - the manifest carries its `clock` (wall, or virtual: a whole campaign replayed in simulated time, figures in
    the hardware's units) and what a virtual run left out of its matrix (`not_replayed`).
10 - every figure is the hardware's: a time-scaled simulator's decode and prefill cells (and guards) store
    rates, latencies and `measured_s` converted from the wall clock, with their `time_scale` (rate cells did
    from format 6); long-context, overload, prefix-order and repeat experiments likewise (their details carry
    `time_scale`). Older files of a time-scaled run are converted on read by the manifest's time scale; their
    verdict sentences keep the numbers they were written with.
11 - a night run until settled (`repeats: auto`) stores, per variant it retired, variants/<variant>/settled.json:
    after how many rounds, its outcome and sentence at that look; older runs have none (fixed repeats).
12 - a sustained cell's `per_request_tok_s` times a request that streams across an edge of the window from or
    to that edge (before: from its own first token inside, or to its last), so that a stall at an edge moves
    it no more than the total rate; without a stall the two agree within a token gap over the window, and
    older files keep the figures they were computed with. Startup facts may carry `assumed`: what a fact
    rests on that the log does not print (V0's "# GPU blocks: N" read with vLLM's default block size of 16);
    older files have none (None).
13 - cells carry `client_lag_max_ms`, the largest of the client's event-loop lag samples beside their p99: one
    stall moves a whole tail that rests on one moment (streams in step read their tokens at once), which the
    p99 of a few hundred samples skips. Older cells have none (None). A capacity search's details carry its
    `batch_pass` (requests, throughput_rps, start_rps, cell; None where the matrix gave start_rps), and its
    concurrency probes are closed loops decided by their count that stop early (keys -D0.001 ... -X); older
    searches have neither.
14 - a rate cell's spec may carry `trace` (a production trace replayed at its own times: file, digest, format,
    slice, speed, sample, length_scale, block_size, requests; keys rate-T<stem>.<digest>...), its result
    `trace_implied_hits` (the prompt tokens the trace's shared blocks make reusable). Rate cells of one shape
    draw one unit-rate sequence of gaps scaled to their rate (common random numbers), so a rate cell's arrivals
    differ from format 13's: a run resumed across the change, or diffed against an older run, compares two
    draws of the same cell. A search's probes are placed by the last probes' margins (stored with each probe).
    An attempt carries the `code` of why it was discarded (contaminated; fewer_active or schedule_behind when
    the client's host stalled it): a sustained window whose streams were busy less than 95% of it is now
    measured again, as a late schedule was. A rate cell carries its `cache_state`: before its step the prefix
    cache was emptied through POST /reset_prefix_cache and checked with a canary sent before and after, or
    (no such endpoint) its prompts stood on a fresh salt; a reset the canary saw fail is `cache_not_reset`.
    A rate cell of 50 requests or more carries its `steadiness`: after the open loop fills, up to ten intervals
    (each two request lifetimes or more) of throughput and TPOT with Mann-Kendall's trend, Sen's line and the
    CV of each; a drift is the caveat `not_steady` on a Valid cell.
    Older files have none of these fields (None).
15 - cells carry the server's own view of their step: `server_first_tokens`, `server_ttft_mean_ms` and
    `server_itl_mean_ms` from vLLM's request histograms (vllm:time_to_first_token_seconds,
    vllm:inter_token_latency_seconds) between the step's two scrapes, in the hardware's ms, and beside them
    `client_ttft_mean_ms`, the client's mean TTFT over the same requests. Older cells, a server without the
    histograms and a campaign replayed on a virtual clock have none (None).
16 - experiments carry `reason_codes` beside their reasons, as cells do: `sends_spread` where the overload
    experiment's burst left over more than a tenth of its first request's life, measured again up to three
    times, then Invalid; `gauges_disagree` where the server's running gauge
    saw more requests at once than the client had in flight by its own timestamps; `contaminated`. The
    overload experiment's details and each prefix-order arm carry `send_spread_s` and `first_life_s` (the
    hardware's seconds).
    Startup facts carry `model_window`, the model's own window where the log states it (max-model-len asked
    past it). Older files have none (no codes, None). A cell's client lag samples (`client_lag_p99_ms`,
    `client_lag_max_ms`) now also count the time the host kept the client's thread off a CPU (the kernel's
    run-queue wait), so on a loaded host they read higher than format 15's for the same stalls. The
    manifest's `estimate` carries `variant_launch_s` (each variant's launch, without the cells it will not
    run) and `not_run` (per variant, the cells left out of its estimate: key to `code`, over_capacity or
    over_window, and `message`), and its `cells_s` is the mean over the schedule's launches (before: every
    cell of one launch); a launch is compared with its variant's estimate where stored, else `per_launch_s`.
17 - an overload experiment may be Invalid for `reads_unordered`: its client read more first tokens before the
    first request's last than the launch's max-num-seqs lets run at once (a stall read two of the server's
    steps together), measured again up to three times as for `sends_spread`. Older files have no such code.
18 - a sustained decode cell in whose window no stream received a token (its window fell inside the streams'
    prefill) is Invalid for `no_tokens_in_window`, its 0 tok/s no longer a Valid decode figure. Older files
    have no such code (such a cell was stored Valid).
19 - a sustained decode cell carries `client_stall_bound`, how far its client's stalls could move its figures
    (figures.stall_error: tokens stamped late by the client's event loop, carried across the window's edges or
    moving a stream's ends); past 3% the attempt is discarded (`client_stalled`) and the window measured
    again, up to three times, the cleanest standing, Valid with the caveat `client_stalled` where that is its
    only stall; likewise `sim_behind` where a time-scaled simulator fell behind its clock for over 3% of the
    window (`sim_behind_share`: under that, a note as before). Older files have no such code, bound or share
    (None). Cells carry `server_queue_mean_ms` (vLLM's
    request_queue_time_seconds between the step's scrapes); rate cells their queue over the schedule from the
    server's waiting gauge (`waiting_max`, `avg_waiting`) and, where the server fell behind the arrivals for
    good, `fell_behind_s` and `waiting_at_end` with the caveat `server_fell_behind`. Older files have none
    (None).
20 - a cell may carry the caveat `client_ttft_over_server`: its client's mean TTFT is past the server's own
    (`server_ttft_mean_ms`, the same requests) by more than 200 ms and 10% of it, more than a client's path
    adds (a proxy that buffers the stream, a client host too busy to read it). Older files have no such code.
    A night `campaign tune` ran to confirm its search stores tune.json: each variant's predicted and measured
    figure and what the predictions rest on. Older tune nights have none. `campaign calibrate RUN` leaves in
    the run calibrations/<name>-<time>.json, the entry it wrote with its table's facts, for the run's report.

Long (about 670 lines): every stored record's model with a description per field, and the generator of
docs/results-format.md from them; one file so that the format and its documentation cannot drift apart.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from campaign.core.errors import LaunchFailureKind
from campaign.core.vllm_flags import value_of
from campaign.measure.cachestate import CacheState
from campaign.measure.cells import Attempt, CellResult
from campaign.measure.figures import hardware_units
from campaign.measure.steady import Steadiness, Trend
from campaign.measure.study import ExperimentResult
from campaign.server.profiles import LaunchProfile
from campaign.server.startup_log import StartupFacts
from campaign.sim.measured import MeasuredHardware
from campaign.spec.matrix import Matrix

SCHEMA_VERSION = 20
_VERSION = Field(default=SCHEMA_VERSION, description="the format version this file is written in (see history)")


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- manifest.json ---------------------------------------------------------------------------------------
class Definition(_Record):
    path: str = Field(description="the file as named when the run began")
    raw: dict[str, Any] = Field(description="its validated content, as run (resume rebuilds from this)")
    hash: str = Field(description="a hash of `raw`: two runs of the same definition have the same hash")


class ToolInfo(_Record):
    name: str = Field(description="vllm-campaign")
    version: str = Field(description="its version")
    git_commit: str | None = Field(description="the checkout's commit, where it is a git checkout")
    git_dirty: bool | None = Field(description="uncommitted changes in campaign/, matrices/ or launch_profiles/")


class MachineInfo(_Record):
    hostname: str = Field(description="the controller's host name")
    os: str = Field(description="operating system and kernel release")
    python: str = Field(description="the controller's Python version")
    cpu: str | None = Field(description="CPU model name")
    cpu_count: int | None = Field(description="logical CPUs")
    memory_gib: float = Field(description="memory, GiB")
    gpu: dict[str, Any] | None = Field(description="NVML's view of the GPUs (names, memory, driver); None: no NVML")

    def gpu_names(self) -> list[str | None]:
        return [g.get("name") for g in (self.gpu or {}).get("gpus", [])]


class ScheduleEntry(_Record):
    variant: str = Field(description="the variant launched")
    repeat: int = Field(description="the repeat, from 0; one past the last repeat is the drift sentinel")


class Manifest(_Record):
    """manifest.json: what was run, on what, by which tool version. Written once, first."""

    schema_version: int = _VERSION
    kind: Literal["manifest"] = Field(default="manifest", description="this file's kind")
    campaign: str = Field(description="the matrix's name")
    created_utc: str = Field(description="when the run began, ISO 8601 UTC")
    tool: ToolInfo = Field(description="the tool that wrote the run")
    matrix: Definition = Field(description="the matrix as run")
    profile: Definition = Field(description="the launch profile as run")
    engine: str = Field(description="vllm, or sim (the simulator)")
    time_scale: float = Field(default=1.0, description="the simulator's speed-up (its rates read this many times "
                                                       "higher); 1 on vLLM")
    machine: MachineInfo = Field(description="the controller's machine")
    schedule: list[ScheduleEntry] = Field(description="every launch, in order")
    cells: list[dict[str, Any]] = Field(description="every cell of a launch (CellSpec fields and its key)")
    estimate: dict[str, Any] | None = Field(
        default=None, description="what the plan said the run would take (planning.Estimate.to_json), and its "
                                  "`power`: per variant judged, launches_a_side, tests, noise_cv, noise_source and "
                                  "detectable_change, the smallest change those launches tell at that noise (a "
                                  "fraction; None where the noise is unknown); None before format 5")
    executor: Literal["serial", "pool", "ray"] = Field(
        default="serial", description="serial: one launch at a time; pool: launches side by side on a GPU pool; "
                                      "ray: launches as Ray tasks on a cluster's nodes")
    pool: list[int] | None = Field(default=None, description="the pool's GPU indices (--gpus); None: serial")
    clock: Literal["wall", "virtual"] = Field(
        default="wall", description="wall: servers measured over HTTP; virtual: the simulator serving from this "
                                    "process on its own simulated clock, measured by the same client and rules "
                                    "(measure.simulated), figures in the hardware's units")
    not_replayed: list[str] = Field(
        default_factory=list, description="a virtual run before the tool measured every kind in simulated time: "
                                          "the matrix's workloads left out of it (`workloads[i] kind: why`); "
                                          "always empty now")

    def matrix_model(self) -> Matrix:
        return Matrix.model_validate(self.matrix.raw)

    def profile_model(self) -> LaunchProfile:
        return LaunchProfile.model_validate(self.profile.raw)


# --- variants/<variant>/launch-<k>/ -----------------------------------------------------------------------
class ServerRecord(_Record):
    """server.json: a launch that became ready, and what it became."""

    schema_version: int = _VERSION
    kind: Literal["server"] = Field(default="server", description="this file's kind")
    variant: str = Field(description="the variant launched")
    repeat: int = Field(description="its repeat, from 0")
    started_utc: str = Field(description="when it was ready, ISO 8601 UTC")
    command: list[str] = Field(description="the command line, secrets redacted")
    flags: dict[str, Any] = Field(description="every flag as launched (profile, variant and overrides merged)")
    variant_flags: dict[str, Any] = Field(description="the variant's own flags, `suggested` resolved")
    ready_s: float = Field(description="seconds from starting the process to a 200 from /health")
    facts: StartupFacts = Field(description="what the startup log (and the live server) said it became")
    warnings: list[str] = Field(description="where the log and the live server disagreed, or a fact is missing")
    suggested: dict[str, Any] | None = Field(
        default=None, description="how `gpu-memory-utilization: suggested` was resolved (suggested, margin, "
                                  "resolved); None: not used")
    launch_dir: str | None = Field(default=None, description="not stored: set when read, the launch's folder "
                                                              "relative to the run")

    def tensor_parallel_size(self) -> int:
        """The GPUs it ran on under tensor parallelism: as its log said, else as its flags asked, else 1."""
        return int(self.facts.tensor_parallel_size or value_of(self.flags, "tensor-parallel-size") or 1)


class StopRecord(_Record):
    """stop.json: how a launched server stopped."""

    schema_version: int = _VERSION
    kind: Literal["stop"] = Field(default="stop", description="this file's kind")
    stopped_utc: str | None = Field(default=None, description="when it had stopped, ISO 8601 UTC; None before "
                                                              "format 5")
    mode: Literal["sigint", "sigterm", "sigkill", "already_exited"] = Field(
        description="the signal that stopped it, or already_exited")
    exit_code: int | None = Field(description="the server process's exit code")
    stop_s: float = Field(description="seconds the stop took")
    swept: int = Field(description="stray processes that left the group and were stopped after it")
    port_free: bool = Field(description="whether the port was free afterwards")
    gpu_memory_released: bool | None = Field(description="whether GPU memory returned to where it was; None: no "
                                                          "NVML")


class GpuDevice(_Record):
    index: int = Field(description="the GPU's index on its host (as CUDA_VISIBLE_DEVICES names it)")
    uuid: str | None = Field(description="NVML's UUID; None: no NVML (the simulator's GPUs)")
    name: str | None = Field(description="NVML's model name; None: no NVML")


class PlacementRecord(_Record):
    """placement.json: where a launch ran and when, written when it ends (also after a failure or Ctrl-C)."""

    schema_version: int = _VERSION
    kind: Literal["placement"] = Field(default="placement", description="this file's kind")
    variant: str = Field(description="the variant launched")
    repeat: int = Field(description="its repeat, from 0")
    executor: Literal["serial", "pool", "ray"] = Field(description="how the run placed its launches")
    host: str = Field(description="the host the server and its client ran on")
    node: str | None = Field(default=None, description="the Ray node's id (executor ray); None otherwise")
    gpus: list[GpuDevice] | None = Field(description="the GPUs it was given; None: every GPU of the host "
                                                     "(serial, no CUDA_VISIBLE_DEVICES)")
    client_cores: list[int] | None = Field(description="the CPU cores its measuring client was pinned to; None: "
                                                       "not pinned")
    started_utc: str = Field(description="before the server process started, ISO 8601 UTC")
    ended_utc: str = Field(description="after it had stopped (or failed to start), ISO 8601 UTC")


class FailureRecord(_Record):
    """failure.json: a launch that produced no usable server (instead of server.json), or failed around it."""

    schema_version: int = _VERSION
    kind: Literal["failure"] = Field(default="failure", description="this file's kind")
    variant: str = Field(description="the variant launched")
    repeat: int = Field(description="its repeat, from 0")
    failure_kind: LaunchFailureKind = Field(description="why (errors.LaunchFailureKind)")
    message: str = Field(description="what happened, in one line")
    hint: str | None = Field(description="what to do about it")
    log_tail: str = Field(description="the server log's last lines, secrets redacted")
    launch_dir: str | None = Field(default=None, description="not stored: set when read, the launch's folder "
                                                              "relative to the run")


class WarmupRecord(_Record):
    """warmup.json: the unmeasured requests before a launch's first cell."""

    schema_version: int = _VERSION
    kind: Literal["warmup"] = Field(default="warmup", description="this file's kind")
    requests: int = Field(description="requests sent")
    seconds: float = Field(description="how long the warm-up took")
    longest_prompt_tokens: int | None = Field(description="the longest prompt sent (the cells' longest)")
    concurrencies: list[int] = Field(description="the decode concurrencies warmed")
    errors: int = Field(description="requests that failed")
    first_error: str | None = Field(description="the first failure's message")


# --- variants/<variant>/cells/<key>/ and experiments/<key>/ -----------------------------------------------
class _OnLaunch(_Record):
    """What every result measured on a launch says of where it was measured."""

    schema_version: int = _VERSION
    kind: str = Field(description="this file's kind")
    variant: str = Field(description="the variant measured")
    repeat: int = Field(description="the repeat, from 0")
    launch: str = Field(description="the launch folder it was measured on")
    written_utc: str = Field(description="when it was stored, ISO 8601 UTC")


class CellRecord(_OnLaunch):
    """cells/<key>/rep-<n>.json: one measured cell, with every raw request record."""

    kind: Literal["cell"] = Field(default="cell", description="this file's kind")
    result: CellResult = Field(description="the result (cells.CellResult), raw request records included")
    gpu_telemetry: list[Any] | None = Field(description="the raw GPU samples of its step; None: no NVML")


class GuardRecord(_OnLaunch):
    """cells/<key>/guard-<n>.json: a launch's first cell measured again at its end (the warm check)."""

    kind: Literal["guard"] = Field(default="guard", description="this file's kind")
    not_warm: str | None = Field(
        description="why the first reading was cold (then this re-measurement stands in for it); None: warm")
    result: CellResult = Field(description="the second measurement")
    gpu_telemetry: list[Any] | None = Field(default=None, description="the raw GPU samples of its step; None: no "
                                                                      "NVML (or before format 7)")


class ExperimentRecord(_OnLaunch):
    """experiments/<key>/rep-<n>.json: one of the study's experiments on one launch."""

    kind: Literal["experiment"] = Field(default="experiment", description="this file's kind")
    result: ExperimentResult = Field(description="the result (study.ExperimentResult); its key is the matrix's")


# --- the run's top level ----------------------------------------------------------------------------------
class RepeatsRecord(_Record):
    """repeats-<n>.json: `campaign run --resume RUN --repeats n` raised the run's repeats."""

    schema_version: int = _VERSION
    kind: Literal["repeats"] = Field(default="repeats", description="this file's kind")
    repeats: int = Field(description="the repeats the run has from then on")
    was: int = Field(description="the repeats before")
    written_utc: str = Field(description="when, ISO 8601 UTC")


class SettledRecord(_Record):
    """variants/<variant>/settled.json: a night run until settled retired this variant (format 11)."""

    schema_version: int = _VERSION
    kind: Literal["settled"] = Field(default="settled", description="this file's kind")
    variant: str = Field(description="the variant retired")
    rounds: int = Field(description="the rounds it was measured in when its verdict settled")
    outcome: str = Field(description="keep, revert or no difference, as the diff judged it at that look; not "
                                     "settled where more rounds cannot settle it (not comparable)")
    recommendation: str = Field(description="the diff's sentence at that look")
    written_utc: str = Field(description="when, ISO 8601 UTC")


class TunePrediction(_Record):
    """One variant of a `campaign tune` confirmation night: what phase 1 predicted and what the night measured."""

    variant: str = Field(description="the variant of the confirmation night (the baseline, or candidate-<i>)")
    flags: dict[str, Any] = Field(description="its own flags on top of the baseline's")
    predicted: float | None = Field(description="the objective's figure at its load, on the simulator (phase 1)")
    measured: float | None = Field(description="the same figure measured, the median over the night's repeats")
    status: str = Field(description="the measured cell's status (the worst over repeats), or why it was not measured")
    outcome: str | None = Field(description="keep, revert, no difference or not settled against the baseline (None: "
                                            "the baseline)")


class TuneRecord(_Record):
    """tune.json: a night `campaign tune` ran to confirm its search (format 20): what its simulator predicted
    for each variant beside what was measured, so the night's report shows the tune's evidence."""

    schema_version: int = _VERSION
    kind: Literal["tune"] = Field(default="tune", description="this file's kind")
    round: int = Field(description="the tune's round that ran this night (1: its first search)")
    objective: str = Field(description="what the tune maximised or minimised, in words")
    figure: str = Field(description="the figure predicted and measured (the objective's), with its unit")
    load: int | None = Field(description="the concurrency the objective was measured at")
    basis: str = Field(description="what the predictions rest on: the tables, a measured entry with its fit error, "
                                   "or costs fitted to the last night")
    predictions: list[TunePrediction] = Field(description="each variant's predicted and measured figure")


class CalibrationRecord(_Record):
    """calibrations/<name>-<time>.json: `campaign calibrate` fitted the simulator to this night (format 20):
    the entry it wrote and what its table said beside it, so the night's report shows the fit and its error."""

    schema_version: int = _VERSION
    kind: Literal["calibration"] = Field(default="calibration", description="this file's kind")
    written_utc: str = Field(description="when the fit was made, ISO 8601 UTC")
    path: str = Field(description="where the measured hardware entry was written")
    entry: MeasuredHardware = Field(description="the entry: fitted costs, memory, every cell fitted or held out, "
                                                "the errors")
    iterations: int = Field(description="rounds of replay and fit")
    settled: bool = Field(description="the last round moved no fitted figure by 0.2% or more")
    determined: int = Field(description="the cost terms the cells tell apart")
    unmeasured: list[str] = Field(description="cost terms no cell exercised (left at 0)")
    skipped: list[str] = Field(description="cells not used, each with why")
    kv_from: str = Field(description="where the KV cache's figures came from")
    leaned: bool = Field(description="the fit leaned on the tables' costs where the cells did not tell terms apart")


class Roofline(_Record):
    hardware: str | None = Field(description="the profile's `hardware`")
    model: str | None = Field(description="the profile's `model_shape`")
    known: bool = Field(description="whether both are in the tables (hardware.py); if not, no bound is guessed")
    note: str | None = Field(default=None, description="why there is no bound")
    gpus: int | None = Field(default=None, description="GPUs the bound counts (tensor parallel size)")
    decode_bound_tok_s: float | None = Field(default=None, description="single-stream decode bound: memory "
                                                                       "bandwidth / bytes read per token")
    prefill_bound_tok_s: float | None = Field(default=None, description="prefill bound: compute / FLOPs per token")
    decode_ratio: float | None = Field(default=None, description="measured single-stream rate / its bound")
    prefill_ratio: float | None = Field(default=None, description="measured prompt rate / its bound")


class Knee(_Record):
    concurrency: int = Field(description="the last concurrency worth its cost")
    next_concurrency: int = Field(description="the step after it")
    aggregate_gain_pct: float = Field(description="what that step adds in aggregate tokens/s, %")
    per_request_loss_pct: float = Field(description="what it costs each stream's stream tok/s, %")


class CapacityAtSlo(_Record):
    slo: str | None = Field(description="the service level, in words")
    max_rate_rps: float | None = Field(description="the highest request rate that held it, median over repeats")
    last_pass_rps: float | None = Field(description="the first search's bracket: the highest rate that held ...")
    first_fail_rps: float | None = Field(description="... and the lowest that failed (None: none did)")
    max_concurrency: float | None = Field(description="the highest number of streams at once that held it, median; "
                                                      "None: not searched")
    searches: int = Field(description="Valid searches the answer rests on")


class ShortAnswers(_Record):
    """Seed 000's first table for one variant (answers.short_answers); every rate in the simulated hardware's
    time on the simulator. None: not measured, never 0."""

    time_scale: float = Field(default=1.0, description="the simulator's speed-up the figures were converted back "
                                                       "from")
    roofline: Roofline = Field(description="measured rates against the hardware's bounds")
    single_stream_tok_s: float | None = Field(description="one request alone: generated tokens/s")
    single_stream_ttft_ms: float | None = Field(description="its first-token time, median, ms")
    aggregate_peak_tok_s: float | None = Field(description="the highest total tokens/s of the decode ladder")
    aggregate_peak_concurrency: int | None = Field(description="the concurrency it was reached at")
    prompt_tok_s: float | None = Field(description="prefill: prompt tokens/s, median of the prefill cells")
    context_window: int | None = Field(description="max_model_len as launched")
    max_num_seqs: Any = Field(description="the scheduler cap as launched; None: vLLM's card-size default")
    useful_concurrency: int | None = Field(description="requests at once that each still get the floor")
    useful_floor_tok_s: float | None = Field(description="that floor, in stream tok/s")
    capacity_at_floor: dict[str, int | None] = Field(description="per floor (tokens/s), the useful concurrency")
    naive_capacity: int | None = Field(description="aggregate peak / floor: what a naive reading would say")
    naive_capacity_warning: str | None = Field(description="said when the naive reading overstates capacity")
    knee: Knee | None = Field(description="where doubling concurrency stops paying; None: not found")
    agents_that_fit: dict[str, int | None] = Field(description="per context (tokens), agents whose KV cache fits")
    agents_beyond_window: list[int] = Field(default_factory=list,
                                            description="contexts longer than the window: none fit")
    capacity_at_slo: CapacityAtSlo | None = Field(default=None, description="capacity at the SLO, from the "
                                                  "slo-search experiments (format 6; None: none ran)")


class DriftRecord(_Record):
    checked: bool = Field(description="whether the baseline was measured more than once")
    drifted: bool = Field(description="whether its last launch moved beyond the limit from its first")
    median_change_pct: float | None = Field(description="median change of its cells, first to last, %")
    message: str = Field(description="the drift line as printed")
    sm_clock_change_pct: float | None = Field(default=None, description="median SM clock change, %; None: no NVML")
    power_change_pct: float | None = Field(default=None, description="median power change, %; None: no NVML")
    moved: list[str] = Field(default_factory=list, description="what moved: throughput, SM clock, power")


class OutcomeRecord(_Record):
    outcome: Literal["keep", "revert", "no difference", "not settled"] = Field(description="the verdict")
    provisional: bool = Field(description="rests on launch facts alone (one measurement a side)")
    tests: int = Field(description="cells and metrics tested together (Holm-adjusted)")
    family_wise_alpha: float = Field(description="the family's error rate")
    aa: bool = Field(description="an A/A comparison: the baseline's exact flags")


class SummaryRecord(_Record):
    """summary.json: written when a run ends: drift, short answers, each variant's outcome."""

    schema_version: int = _VERSION
    kind: Literal["summary"] = Field(default="summary", description="this file's kind")
    drift: DriftRecord = Field(description="the baseline's first launch against its last")
    short_answers: dict[str, ShortAnswers] = Field(default_factory=dict,
                                                   description="per variant, seed 000's first table")
    vllm_versions: list[str] = Field(default_factory=list, description="the vLLM versions the launches reported")
    recommendations: dict[str, str] = Field(default_factory=dict, description="per variant, the keep/revert line")
    outcomes: dict[str, OutcomeRecord] = Field(default_factory=dict,
                                               description="per variant, the verdict and how it was reached")


RECORDS: dict[str, type[_Record]] = {
    "manifest": Manifest, "server": ServerRecord, "stop": StopRecord, "failure": FailureRecord,
    "warmup": WarmupRecord, "cell": CellRecord, "guard": GuardRecord, "experiment": ExperimentRecord,
    "repeats": RepeatsRecord, "summary": SummaryRecord, "placement": PlacementRecord, "settled": SettledRecord,
    "tune": TuneRecord, "calibration": CalibrationRecord,
}
FILES: dict[str, str] = {
    "manifest": "manifest.json", "server": "variants/<variant>/launch-<k>/server.json",
    "stop": "variants/<variant>/launch-<k>/stop.json", "failure": "variants/<variant>/launch-<k>/failure.json",
    "warmup": "variants/<variant>/launch-<k>/warmup.json",
    "cell": "variants/<variant>/cells/<cell-key>/rep-<n>.json",
    "guard": "variants/<variant>/cells/<cell-key>/guard-<n>.json",
    "experiment": "variants/<variant>/experiments/<key>/rep-<n>.json", "repeats": "repeats-<n>.json",
    "summary": "summary.json", "placement": "variants/<variant>/launch-<k>/placement.json",
    "settled": "variants/<variant>/settled.json", "tune": "tune.json",
    "calibration": "calibrations/<name>-<time>.json",
}


# --- migrations: one step per version, each saying what it does ------------------------------------------
def _defaults_suffice(data: dict[str, Any], time_scale: float) -> dict[str, Any]:
    """Every key each version so far added has a default in its model, so an older file needs no rewriting.
    A step that must rewrite (a renamed key, a changed unit) gets its own function here."""
    return data


def _times(value: Any, factor: float) -> Any:
    return value * factor if isinstance(value, int | float) and not isinstance(value, bool) else value


def _hardware_units(data: dict[str, Any], time_scale: float) -> dict[str, Any]:
    """9 -> 10: the wall clock's figures of a time-scaled run in the hardware's units, by the run's time scale
    (its manifest's; 1 outside a run, and on vLLM: nothing to convert). Rate cells were converted already."""
    kind = data.get("kind")
    result = data.get("result")
    if time_scale == 1.0 or not isinstance(result, dict):
        return data
    if kind in {"cell", "guard"} and result.get("phase") != "rate":
        return data | {"result": hardware_units(result, time_scale)}
    if kind != "experiment":
        return data
    values, details = dict(result.get("values") or {}), dict(result.get("details") or {})
    experiment = result.get("kind")
    if experiment == "long-context":
        values["prompt_tok_s"] = _times(values.get("prompt_tok_s"), 1 / time_scale)
        values["silence_s_per_1k_prompt_tokens"] = _times(values.get("silence_s_per_1k_prompt_tokens"), time_scale)
        details["rows"] = [row | {"ttft_s": _times(row.get("ttft_s"), time_scale),
                                  "generation_tok_s": _times(row.get("generation_tok_s"), 1 / time_scale),
                                  "prompt_tok_s": _times(row.get("prompt_tok_s"), 1 / time_scale)}
                           for row in details.get("rows") or []]
    elif experiment == "overload":
        details["wall_s"] = _times(details.get("wall_s"), time_scale)
    elif experiment == "prefix-order":
        values["shared_first_wall_s"] = _times(values.get("shared_first_wall_s"), time_scale)
        details["arms"] = {arm: a | {"wall_s": _times(a.get("wall_s"), time_scale)}
                           for arm, a in (details.get("arms") or {}).items()}
    elif experiment == "repeat":
        values["mean_total_tok_s"] = _times(values.get("mean_total_tok_s"), 1 / time_scale)
        details["runs"] = [_times(v, 1 / time_scale) for v in details.get("runs") or []]
        for name in ("low", "high"):
            details[name] = _times(details.get(name), 1 / time_scale)
    else:
        return data   # context-window has no figure in time; agents and slo-search stored the hardware's
    return data | {"result": result | {"values": values, "details": details | {"time_scale": time_scale}}}


MIGRATIONS: dict[int, Callable[[dict[str, Any], float], dict[str, Any]]] = {
    # 1 -> 2: cells' notes and latency distributions. Also keys that came in 0.1.x inside a format without a
    # version of their own: the manifest's and short answers' time_scale (1.0), server.json's `suggested`
    # (None), the summary's outcomes ({}) and agents_beyond_window ([]).
    1: _defaults_suffice,
    2: _defaults_suffice,  # 2 -> 3: the sampled queue (None); `queued` stays the reason code format 2 stored
    3: _defaults_suffice,  # 3 -> 4: server_id and window (None)
    4: _defaults_suffice,  # 4 -> 5: stop.json's stopped_utc and the manifest's estimate (None: not stored)
    5: _defaults_suffice,  # 5 -> 6: rate fields (None: not a rate cell), capacity_at_slo (None: no search)
    6: _defaults_suffice,  # 6 -> 7: the manifest's executor (serial) and pool (None); placement.json is new
    7: _defaults_suffice,  # 7 -> 8: a rate cell's sessions (None: independent prompts)
    8: _defaults_suffice,  # 8 -> 9: the manifest's clock (wall) and not_replayed (none)
    9: _hardware_units,    # 9 -> 10: a time-scaled run's figures in the hardware's units
    10: _defaults_suffice,  # 10 -> 11: settled.json is new (a run of fixed repeats has none)
    11: _defaults_suffice,  # 11 -> 12: startup facts' `assumed` (None); stored stream tok/s kept as written
    12: _defaults_suffice,  # 12 -> 13: cells' client_lag_max_ms (None: not stored)
    13: _defaults_suffice,  # 13 -> 14: cell specs' trace and results' trace_implied_hits (None: not a trace)
    14: _defaults_suffice,  # 14 -> 15: cells' server view (None: not read)
    15: _defaults_suffice,  # 15 -> 16: experiments' reason codes (none) and facts' model_window (None)
    16: _defaults_suffice,  # 16 -> 17: a new reason code only
    17: _defaults_suffice,  # 17 -> 18: a new reason code only
    18: _defaults_suffice,  # 18 -> 19: new reason codes; cells' queue figures (None: not measured)
    19: _defaults_suffice,  # 19 -> 20: a new reason code only
}


def migrate(data: dict[str, Any], time_scale: float = 1.0) -> dict[str, Any]:
    """Bring a stored mapping of an older format to the current one, one explicit step at a time; `time_scale`:
    the run's (its manifest's), for the steps that change a unit."""
    version = int(data.get("schema_version", SCHEMA_VERSION))
    while version < SCHEMA_VERSION:
        data = MIGRATIONS[version](dict(data), time_scale)
        version += 1
    return {**data, "schema_version": SCHEMA_VERSION}


def parse(data: dict[str, Any], kind: str | None = None) -> _Record:
    """A stored mapping (already migrated) as its typed record; `kind` when the file is known to hold one."""
    name = kind or str(data.get("kind"))
    model = RECORDS.get(name)
    if model is None:
        raise ValueError(f"unknown record kind {name!r}")
    return model.model_validate(data)


# --- docs/results-format.md --------------------------------------------------------------------------------
def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = re.sub(r"\b[A-Za-z_][\w]*\.", "", text or str(annotation))  # typing., campaign.records., ...
    return text.replace("NoneType", "None").replace("|", "or")


def document() -> str:
    lines = [
        "# Results format",
        "",
        "Generated from `campaign/stored/records.py` by `python -m campaign.stored.records`; do not edit by hand",
        "(a test compares this file with the models). Every file is JSON, written atomically and never overwritten,",
        f"and carries `schema_version` (now {SCHEMA_VERSION}). An older file is read through the explicit steps in",
        "`records.MIGRATIONS`; a newer one is refused with a hint to upgrade.",
        "",
        "## Format history",
        "",
    ]
    doc = (sys.modules[__name__].__doc__ or "").split("\n\nLong (", 1)[0]   # the note to readers of the code
    history = doc.split("Format history:\n", 1)[1].strip().splitlines()
    lines += [f"- {line.strip()}" if line[:1].isdigit() else f"  {line.strip()}" for line in history]
    lines.append("")
    for kind, record in RECORDS.items():
        lines += [f"## `{FILES[kind]}`", "", (record.__doc__ or "").strip(), "", "| key | type | meaning |",
                  "|---|---|---|"]
        for name, field in record.model_fields.items():
            meaning = (field.description or "").replace("|", "\\|")
            lines.append(f"| `{name}` | {_type_name(field.annotation)} | {meaning} |")
        lines.append("")
    lines += ["## Nested models", ""]
    nested: tuple[type[BaseModel], ...] = (CellResult, Attempt, CacheState, Steadiness, Trend, ExperimentResult,
                                           StartupFacts)
    for model in nested:
        described = any(field.description for field in model.model_fields.values())
        lines += [f"### `{model.__name__}`", "", (model.__doc__ or "").strip().split("\n\n")[0], "",
                  "| key | type | meaning |" if described else "| key | type |",
                  "|---|---|---|" if described else "|---|---|"]
        for name, field in model.model_fields.items():
            row = f"| `{name}` | {_type_name(field.annotation)} |"
            meaning = (field.description or "").replace("|", "\\|")
            lines.append(f"{row} {meaning} |" if described else row)
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    from campaign.stored import records  # the models under their own module's name, not __main__'s

    sys.stdout.write(records.document())
