"""A matrix's prefill and decode cells predicted on the engine alone, on its own clock (sim_engine.Virtual): no
client, no server, no event loop, so `campaign tune`'s phase 1 (hundreds of cells) and `campaign calibrate`'s fit
(each cell again with trial costs) run in seconds.

It is not a second method: a night in simulated time measures every cell with the Measurer against the
simulator in this process (measure.simulated), and this predicts what that measures, to the simulated clock's
nanosecond (tests/test_sim_night.py holds the two together cell for cell). It follows the method's rules:
- Over capacity and over the window are decided as the tool decides them (cells.over_capacity on the engine's
  KV cache; prompt + reply against max-model-len), and such cells are not run.
- prefill: one request of a fresh prompt with a one-token reply; prompt tok/s is prompt tokens / TTFT.
- sustained decode: C streams, each sending its next request as the last ends; it reaches the engine after
  the engine planned its next step, as over HTTP and as the Measurer's does in process (sim_engine.Virtual).
  `ttft: warm` (seed 004's method) first caches every stream's prompt with a one-token request, all C at once, and the
  stream then sends that prompt every time; `ttft: cold` sends a fresh prompt each time. The window opens
  `warmup_s` after the step that gave the last stream its first token and lasts `window_s`; from its end no
  stream sends again. Its figures are what the engine emitted inside it (sim_truth.window_figures).
- fixed decode: rounds of C requests until `min_requests` and `min_seconds` are reached.
- The verdict is the tool's own (cells.verdict) on the evidence the engine holds.

Not kept: the client's records (a prediction's figures are the engine's), the queue gauges as a scrape reads
them (here: each step's counts as it ended), and random ids' rare repeats (a counter's ids, whose prompt-lookup
score is exactly 0, where the Measurer's random ids score about 2e-4: on a speculative model the acceptance
draws differ by that much). Rate cells, agents and the study's experiments are the Measurer's alone.

`campaign simulate` measures with the Measurer (night.simulate); tests/test_sim_calibration.py reproduces
seed 004's table with this predictor, which agrees with it (tests/test_sim_night.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from campaign.core import stats
from campaign.core.errors import CampaignError, ConfigError
from campaign.measure.cells import (
    CellSpec,
    Finding,
    Reason,
    Status,
    StepEvidence,
    TTFTMode,
    over_capacity,
    template_hits,
    verdict,
)
from campaign.measure.runner import MAX_ROUNDS, SAMPLE_EVERY_S
from campaign.plan.planning import PredictedServer
from campaign.server import argv
from campaign.server.profiles import FlagValue, LaunchProfile, load_profile
from campaign.server.startup_log import StartupFacts
from campaign.sim import config as sim_config
from campaign.sim import model as sim_model
from campaign.sim import truth as sim_truth
from campaign.sim.config import SimConfig
from campaign.sim.engine import Request, Virtual, engine_for
from campaign.spec.matrix import Matrix


@dataclass(frozen=True)
class VirtualCell:
    """One cell as the tool would have published it from a perfect client; figures in the hardware's units."""

    spec: CellSpec
    status: Status
    findings: list[Finding] = field(default_factory=list)
    total_tok_s: float | None = None
    per_request_tok_s: float | None = None
    prompt_tok_s: float | None = None
    ttft_s: float | None = None              # median over the step's requests (priming excluded)
    completed: int | None = None             # requests that ended (inside the window, for a sustained cell)
    avg_active: float | None = None
    # What the engine did, for tune's and calibrate's figures: the measured requests (priming excluded),
    # a sustained cell's window, the queue gauges as sampled (running, waiting, KV usage), the step's counters.
    requests: list[sim_truth.RequestTruth] = field(default_factory=list)
    window: tuple[float, float] | None = None
    samples: list[tuple[float, float, float]] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)
    # Every step of the cell, priming included (and, where it has an energy figure, a sustained step's drain).
    steps: list[sim_truth.StepTruth] = field(default_factory=list)
    # A decode cell's energy over all its steps per measured token, as the tool counts NVML's (runner: the
    # step's energy over the step's tokens, a sustained step's drain after its window included); None where the
    # hardware has no power model.
    energy_j_per_token: float | None = None
    # The tokens that energy is over: every measured request's, a sustained step's drain included (its
    # `requests` stay as the window left them).
    energy_tokens: int | None = None

    @property
    def reasons(self) -> list[str]:
        return [f"{f.code.value}: {f.message}" for f in self.findings]

    @property
    def reason_codes(self) -> list[Reason]:
        return [f.code for f in self.findings]

    @property
    def ttft_ms(self) -> float | None:
        return None if self.ttft_s is None else 1000 * self.ttft_s


class Prompts:
    """Random ids (the tool's `prompts: random`) that share no prefix: consecutive ids from a counter that
    wraps every 140,000 tokens, so two prompts begin alike only when a multiple of 140,000 tokens lies
    between their starts (for 8K prompts, 4,375 prompts apart: no cell sends that many); consecutive ids
    repeat no two-token sequence within 140,000 tokens, so prompt lookup (over a prompt's last 16,384) finds
    nothing, as in the tool's random ids.
    Not prompts.PromptSource, the tool's own: its random ids, drawn one at a time (before it drew them with
    numpy), made `campaign simulate h200-speed-matrix` take 24 s instead of 11 s, for figures within 0.2% of
    these. Every prompt opens with nothing alike (no chat template's opening for the prefix cache to serve)."""

    template_prefix = 0

    def __init__(self) -> None:
        self._next = 1_000

    def fresh(self, tokens: int) -> list[int]:
        start, self._next = self._next, self._next + tokens
        ids: list[int] = (np.arange(start, start + tokens) % 140_000 + 1_000).tolist()
        return ids


def profile_config(profile_name: str, flags: Mapping[str, FlagValue] | None = None) -> SimConfig:
    """The simulator's configuration for a launch profile with `flags` on top, parsed from the same command
    line the launcher builds."""
    profile, path = load_profile(profile_name)
    return loaded_profile_config(profile, path, flags)


def loaded_profile_config(profile: LaunchProfile, path: Path,
                          flags: Mapping[str, FlagValue] | None = None) -> SimConfig:
    """profile_config for a profile already loaded (a search builds hundreds of configurations of one)."""
    if not profile.simulatable:
        raise ConfigError(str(path), "hardware", "the profile names no simulated hardware",
                          hint="give it hardware: and model_shape: (as launch_profiles/h200.yaml does), or a model "
                               "whose config.json the simulator reads (a local folder, or one it ships the config of)")
    spec = argv.build(profile, flags, engine="sim", port=8000)
    command = spec.argv
    try:
        return sim_config.parse_checked(command[command.index("campaign.sim") + 1:],
                                        env=sim_config.in_process_env(spec.env_overrides))
    except ValueError as exc:   # the simulator would refuse to start: a measured file, a flag out of bounds
        raise ConfigError(str(path), "hardware" if "--hardware" in str(exc) else "flags", str(exc),
                          hint="the simulator's own words; fix the profile, the matrix's flags or the measured file") \
            from None


def refused(config: SimConfig) -> str | None:
    """Why vLLM would not start with this configuration (the simulator's start-up rule), or None."""
    mem = config.memory()
    why = sim_model.start_refusal(mem, utilization=config.gpu_memory_utilization, max_model_len=config.max_model_len)
    if why is None:
        return None
    return {"weights": "start-up: the weights do not fit (out of memory)",
            "no-cache": "start-up: no memory for the KV cache",
            "window": f"start-up: a KV cache of {mem.kv_tokens:,} tokens cannot hold max-model-len "
                      f"{config.max_model_len:,}"}[why]


def predict_servers(matrix: Matrix, profile: LaunchProfile, path: Path) -> dict[str, PredictedServer]:
    """Each variant's server as the simulator's memory model sizes it on the profile's card and model (vLLM's
    own accounting, by the version the profile names): the KV cache, block size and window a plan can skip
    cells by before anything is launched. Empty for a profile the simulator cannot size (no hardware, or a
    model whose shape it cannot read); a variant whose flags it refuses is left out (the launch will say)."""
    if not profile.simulatable:
        return {}
    out: dict[str, PredictedServer] = {}
    for variant in matrix.ordered_variants():
        try:
            config = loaded_profile_config(profile, path, variant.flags)
        except CampaignError:
            continue
        mem = config.memory()
        why = refused(config)
        facts = StartupFacts(kv_cache_tokens=None if why else mem.kv_tokens, block_size=config.block(),
                             max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
                             tensor_parallel_size=config.tensor_parallel_size)
        out[variant.name] = PredictedServer(facts, why)
    return out


def config_for(matrix: Matrix, variant: str | None = None) -> SimConfig:
    """The simulator's configuration for a variant of the matrix (the baseline by default)."""
    name = variant or matrix.baseline
    chosen = next((v for v in matrix.variants if v.name == name), None)
    if chosen is None:
        raise CampaignError(f"{matrix.name}: no variant {name!r}",
                            hint=f"variants: {', '.join(v.name for v in matrix.variants)}")
    return profile_config(matrix.profile, chosen.flags)


def run_cell(config: SimConfig, spec: CellSpec, prompts: Prompts | None = None) -> VirtualCell:
    """One cell on a fresh engine (a server of `config` with nothing cached)."""
    prompts = prompts or Prompts()
    mem = config.memory()
    max_tokens = 1 if spec.phase == "prefill" else spec.max_tokens
    if spec.phase == "rate":
        raise CampaignError(f"{spec.key}: a rate cell is open-loop and is not replayed",
                            hint="measure it on the simulator over HTTP: campaign run MATRIX --engine sim")
    if spec.phase == "decode" and over_capacity(context_tokens=spec.context_tokens, output_tokens=max_tokens,
                                                concurrency=spec.concurrency, kv_cache_tokens=mem.kv_tokens,
                                                block_size=config.block()):
        return VirtualCell(spec, "Over capacity", [Finding(Reason.OVER_CAPACITY, (
            f"not run: {spec.concurrency} x ({spec.context_tokens:,} + {max_tokens:,}) tokens exceed the KV cache "
            f"of {mem.kv_tokens:,} tokens"))])
    if spec.context_tokens + max_tokens > config.max_model_len:
        return VirtualCell(spec, "Invalid", [Finding(Reason.OVER_WINDOW, (
            f"not run: prompt {spec.context_tokens:,} + reply {max_tokens:,} tokens exceed max_model_len "
            f"{config.max_model_len:,}"))])
    truth = sim_truth.Recorder()
    sim = Virtual(engine_for(config, truth))
    if spec.phase == "prefill":
        sim.submit(prompts.fresh(spec.context_tokens), 1)
        sim.run()
        (request,) = truth.requests
        ttft = request.ttft
        if not ttft:
            return VirtualCell(spec, "Failed", [Finding(Reason.REQUEST_ERRORS, f"the request ended {request.reason} "
                                                        "without a token")])
        return VirtualCell(spec, "Valid", ttft_s=ttft, prompt_tok_s=spec.context_tokens / ttft,
                           requests=[request], counters=dict(sim.engine.counters), steps=truth.steps)
    cell = (_fixed if spec.mode == "fixed" else _sustained)(sim, truth, config, spec, prompts)
    if not cell.requests:
        return cell
    # The runner's energy is the whole step's over all the step's tokens, and a sustained step waits for every
    # reply after its window closes: the drain is run here for the energy alone, the cell's own records and
    # steps kept as the window left them (the records the recorder holds go on growing).
    live = cell.requests
    cell = replace(cell, requests=[replace(r, emits=list(r.emits)) for r in live])
    sim.run()
    generated = sum(r.tokens for r in live)
    if not generated or not truth.steps:
        return cell
    # The steps grow by the drain's (a speed figure reads only its window's); the energy's tokens are kept, for
    # the energy figure and for calibrate's fit of the power to it (whose trial configurations have no power).
    cell = replace(cell, steps=truth.steps, energy_tokens=generated)
    if config.power is None:
        return cell
    return replace(cell, energy_j_per_token=sim_truth.energy_j(config.power, config.costs, truth.steps) / generated)


def _primed(sim: Virtual, truth: sim_truth.Recorder, spec: CellSpec,
            prompts: Prompts) -> tuple[list[list[int]], int]:
    """Each stream's prompt; with `ttft: warm` (seed 004's method) cached first by a one-token request, all
    at once, and then reused by every request of the stream. Returns the prompts and the priming count."""
    streams = [prompts.fresh(spec.context_tokens) for _ in range(spec.concurrency)]
    if spec.ttft != "warm":
        return streams, 0
    for prompt in streams:
        sim.submit(prompt, 1)
    sim.run()
    return streams, len(truth.requests)


def _fixed(sim: Virtual, truth: sim_truth.Recorder, config: SimConfig, spec: CellSpec,
           prompts: Prompts) -> VirtualCell:
    """Rounds of C requests, each round once the last has ended, until the minimums (measure's rule)."""
    streams, primed = _primed(sim, truth, spec, prompts)
    began, sent = sim.now, 0
    for round_ in range(MAX_ROUNDS):
        for index in range(spec.concurrency):
            warm_or_first = spec.ttft == "warm" or round_ == 0
            sim.submit(streams[index] if warm_or_first else prompts.fresh(spec.context_tokens), spec.max_tokens)
        sent += spec.concurrency
        sim.run()
        if sent >= spec.min_requests and sim.now - began >= spec.min_seconds:
            break
    measured = sorted(truth.requests, key=lambda r: r.arrival)[primed:]
    figures = sim_truth.fixed_figures(measured)
    status, findings = verdict(_evidence(sim, config, spec, avg_active=None, samples=[],
                                         template_hits=template_hits(len(truth.all_requests()), prompts.template_prefix,
                                                                     config.block())))
    return VirtualCell(spec, status, findings, total_tok_s=figures["total_tok_s"],
                       per_request_tok_s=figures["per_request_tok_s"],
                       ttft_s=stats.median([r.ttft for r in measured if r.ttft is not None]),
                       completed=_count(figures["completed"]), requests=measured, counters=dict(sim.engine.counters),
                       steps=truth.steps)


def _sustained(sim: Virtual, truth: sim_truth.Recorder, config: SimConfig, spec: CellSpec,
               prompts: Prompts) -> VirtualCell:
    """C streams from the moment priming ends, each sending its next request as the last ends; the window
    opens `warmup_s` after every stream's first token (measure's rule) and lasts `window_s`."""
    streams, primed = _primed(sim, truth, spec, prompts)
    end = math.inf   # no request is sent from the window's end on (the tool's stop), and the rest drain

    def stream(index: int) -> Callable[[float], None]:
        def again(t: float) -> None:
            if t < end:
                prompt = streams[index] if spec.ttft == "warm" else prompts.fresh(spec.context_tokens)
                sim.submit(prompt, spec.max_tokens, on_finish=again)
        return again

    first: list[Request] = [sim.submit(streams[i], spec.max_tokens, on_finish=stream(i))
                            for i in range(spec.concurrency)]
    # The window opens warmup_s after the step that gave the last stream its first token (or ended one before
    # any), as the tool's watch on every stream's first token opens it.
    sim.run(done=lambda: all(r.generated or r.aborted for r in first))
    start = sim.now + spec.warmup_s
    end = start + spec.window_s
    interval = min(SAMPLE_EVERY_S, spec.window_s / 2)
    sample_at = list(times(start + interval / 2, end, interval))
    sim.run(until=end)
    measured = sorted(truth.all_requests(), key=lambda r: r.arrival)[primed:]
    figures = sim_truth.window_figures(measured, start, end)
    samples = [g for g in (gauges(truth.steps, t, sim.engine.blocks.total) for t in sample_at) if g is not None]
    evidence = _evidence(sim, config, spec, avg_active=figures["avg_active"],
                         template_hits=template_hits(len(truth.all_requests()), prompts.template_prefix,
                                                     config.block()),
                         avg_before_first_token=figures["avg_before_first_token"], samples=samples,
                         window_tokens=figures["output_tokens"], window_s=spec.window_s)
    status, findings = verdict(evidence)
    return VirtualCell(spec, status, findings, total_tok_s=figures["total_tok_s"],
                       per_request_tok_s=figures["per_request_tok_s"],
                       ttft_s=stats.median([r.ttft for r in measured if r.ttft is not None]),
                       completed=_count(figures["completed"]), avg_active=figures["avg_active"],
                       requests=measured, window=(start, end), samples=samples, counters=dict(sim.engine.counters),
                       steps=truth.steps)


def _count(value: float | None) -> int | None:
    return None if value is None else int(value)


def times(start: float, end: float, every: float) -> Iterator[float]:
    """start, start + every, ... up to end: when a sampler reads."""
    t = start
    while t <= end:
        yield t
        t += every


def gauges(steps: Sequence[sim_truth.StepTruth], t: float,
            total_blocks: int) -> tuple[float, float, float] | None:
    """(running, waiting, KV usage) as a scrape at simulated time `t` would read them: the last step begun;
    None before any step (a sample missed, never a zero)."""
    step = next((s for s in reversed(steps) if s.start <= t), None)
    if step is None:
        return None
    return float(step.running), float(step.waiting), step.kv_used_blocks / total_blocks if total_blocks else 0.0


def _evidence(sim: Virtual, config: SimConfig, spec: CellSpec, *, avg_active: float | None,
              samples: list[tuple[float, float, float]], avg_before_first_token: float | None = None,
              template_hits: float = 0.0, window_tokens: float | None = None,
              window_s: float | None = None) -> StepEvidence:
    counters = sim.engine.counters
    return StepEvidence(
        phase=spec.phase, mode=spec.mode, concurrency=spec.concurrency, records=[],
        prefix_cache_hits=counters["hits"], preemptions=counters["preemptions"],
        running=tuple(s[0] for s in samples), waiting=tuple(s[1] for s in samples),
        kv_usage=tuple(s[2] for s in samples), avg_active=avg_active,
        avg_before_first_token=avg_before_first_token, max_num_seqs=config.max_num_seqs,
        shares_prefixes=spec.phase == "decode" and spec.ttft == "warm", context_tokens=spec.context_tokens,
        max_num_batched_tokens=config.max_num_batched_tokens, template_hits=template_hits,
        decode_tokens_per_seq=1 + config.num_speculative_tokens, window_tokens=window_tokens, window_s=window_s)


def run_matrix(matrix: Matrix, *, variant: str | None = None, ttft: TTFTMode | None = None) -> list[VirtualCell]:
    """Every prefill and decode cell of the matrix, in its order; `ttft` overrides every decode cell's mode."""
    config = config_for(matrix, variant)
    why = refused(config)
    if why is not None:   # a server that would not start serves no cell (its engine would wait for room forever)
        raise CampaignError(f"{matrix.name}: the simulated server would not start: {why}",
                            hint="lower max-model-len or raise gpu-memory-utilization, as vLLM's own error says "
                                 "(campaign launch PROFILE --engine sim --once prints it)")
    prompts = Prompts()
    out = []
    for spec in matrix.cells():
        if spec.phase == "rate":
            continue
        if ttft is not None and spec.phase == "decode":
            spec = spec.model_copy(update={"ttft": ttft})
        out.append(run_cell(config, spec, prompts))
    return out
