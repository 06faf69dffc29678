"""A whole campaign in simulated time: `campaign run MATRIX --engine sim --clock virtual`.

Every launch of the schedule starts the simulator's engine in this process instead of a server
(measure.simulated.start): its startup log is printed as the HTTP simulator prints it (sim.start_up), stored as
the launch's server.log and read by the same parser as any vLLM's, so the facts, a start that fails and the KV
cache a flag costs are the launcher's. Each cell is then replayed on the engine's own clock (sim_virtual: the
tool's method rule for rule, no HTTP, no wall clock), and its requests, as RequestRecords, go through the
tool's own figures (figures.fixed_metrics, window_metrics, prefill_metrics). The run is a normal run: `diff`,
`report` and `export` read it, and its figures are the hardware's (time scale 1), whatever speed this machine
has.

What is replayed: prefill and decode cells, with any prompts on either endpoint (text and chat prompts are
made by the tool's own prompts.Prompts, talking to the simulator's tokenizer and chat template in this
process instead of over /tokenize), and seed 000's experiments (context window, long context, overload,
prefix order, repeat), each step as study.py sends it and judged by study.py's own functions. Every
other kind (open-loop rate and trace cells, agent sessions, capacity searches) is not replayed here: the
Measurer itself measures it against the simulator serving from this process on its own clock
(measure.simulated), so the night runs every kind in simulated time and `not_replayed` stays empty. Repeats
differ only by the engine's seed (speculative acceptance, seed 000's bimodal cell) and, with the `launch-noise`
fault, by the speed each launch draws; everything else an engine does is deterministic, so a virtual A/A reads
no difference.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from campaign.core import stats
from campaign.http.client import RequestRecord
from campaign.measure import prompts, simulated, study
from campaign.measure.cells import (
    TTFT_MODE_TEXT,
    CellResult,
    CellSpec,
    findings_fields,
    result_base,
    spec_random_prompts,
)
from campaign.measure.figures import fixed_metrics, prefill_metrics, window_metrics
from campaign.plan import replay as sim_virtual
from campaign.server import metrics
from campaign.server.profiles import FlagValue, LaunchProfile
from campaign.sim import server as sim
from campaign.sim import text as sim_text
from campaign.sim import truth as sim_truth
from campaign.sim.config import SimConfig
from campaign.sim.engine import Virtual, engine_for
from campaign.sim.truth import RequestTruth
from campaign.spec.matrix import (
    ContextWindowExperiment,
    Experiment,
    LongContextExperiment,
    OverloadExperiment,
    PrefixOrderExperiment,
    RepeatExperiment,
)

NOTE = "replayed in simulated time (campaign run --clock virtual): the engine's own records, no HTTP client"


# Seed 000's experiments (study.py's own functions judge them); prefill and decode cells of any prompts too.
REPLAYED = (ContextWindowExperiment, LongContextExperiment, OverloadExperiment, PrefixOrderExperiment,
            RepeatExperiment)
SAMPLE_EVERY_S = 0.25   # study.overload's sampler: the gauges every quarter second of the burst


def replays(work: CellSpec | Experiment) -> bool:
    """Whether the engine's own replay measures this (prefill and decode cells, seed 000's experiments); the
    rest is measured by the Measurer against the simulator in process (measure.simulated)."""
    if isinstance(work, CellSpec):
        return work.phase in ("prefill", "decode")
    return isinstance(work, REPLAYED)


@dataclass
class VirtualLaunch(simulated.Launch):
    """One launch in simulated time (measure.simulated.start) whose cells and experiments are replayed here."""

    def measure(self, spec: CellSpec, ids: sim_virtual.Prompts) -> CellResult:
        """The cell replayed; random ids on /v1/completions from `ids`, other prompts as the tool makes them."""
        maker: sim_virtual.PromptMaker = ids
        if spec.prompts != "random" or spec.endpoint != "completions":
            key = (spec.prompts, spec.endpoint, self.config.tokenizer)
            # One source a process (and tokenizer): its corpus, tokenized once (7 s for the prose corpus), serves
            # every launch, and its salted tags keep every prompt unique across them.
            maker = _TEXTS[key] = _TEXTS.get(key) or TextPrompts(spec.prompts, spec.endpoint, self.config.tokenizer)
        return cell_result(self.config, spec, sim_virtual.run_cell(self.config, spec, maker))

    def experiment(self, experiment: Experiment, prompts: sim_virtual.Prompts, *,
                   window_s: float) -> study.ExperimentResult:
        """Seed 000's experiment as study.py sends it, on a fresh engine, judged by study.py's functions."""
        config = self.config
        if isinstance(experiment, ContextWindowExperiment):
            return context_window(config, experiment.reply_tokens)
        if isinstance(experiment, LongContextExperiment):
            return long_context(config, experiment.contexts, experiment.reply_tokens, prompts)
        if isinstance(experiment, OverloadExperiment):
            return overload(config, experiment.max_num_seqs or config.max_num_seqs, experiment.factor,
                            experiment.prompt_tokens, experiment.reply_tokens, prompts)
        if isinstance(experiment, PrefixOrderExperiment):
            return prefix_order(config, experiment.agents, experiment.shared_tokens, experiment.task_tokens,
                                experiment.reply_tokens, prompts)
        if isinstance(experiment, RepeatExperiment):
            # One server runs the runs one after another, its random state going on (seed 000's bimodal cell
            # draws its mode per run): here each run gets a seed of its own.
            spec = experiment.spec(window_s)
            runs = [replace(self, config=replace(config, seed=config.seed * 1000 + i + 1)).measure(spec, prompts)
                    for i in range(experiment.times)]
            return study.repeat_result(spec, runs)
        raise ValueError(f"{experiment.kind}: not replayed in simulated time")  # replayable() kept it out


def start(profile: LaunchProfile, flags: Mapping[str, FlagValue], *, seed: int, launch: str = "") -> VirtualLaunch:
    """measure.simulated.start's launch (its startup log, its facts, a start that fails as the launcher's
    LaunchError), to replay cells and experiments on."""
    return VirtualLaunch(**vars(simulated.start(profile, flags, seed=seed, launch=launch)))


class LocalTokenizer:
    """The simulator's tokenizer and chat template (what its /tokenize answers), called in this process:
    the model's own with `path` (--tokenizer), else the built-in approximation."""

    def __init__(self, path: str | None = None) -> None:
        self.tokenizer = sim_text.tokenizer_for(path)

    async def tokenize(self, *, prompt: str | None = None,
                       messages: list[dict[str, Any]] | None = None) -> list[int]:
        return self.encode(prompt=prompt, messages=messages)

    def encode(self, *, prompt: str | None = None, messages: list[dict[str, Any]] | None = None) -> list[int]:
        if messages is not None:
            return self.tokenizer.encode(self.tokenizer.chat(messages), add_special_tokens=False)
        return self.tokenizer.encode(prompt or "")

    async def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


class TextPrompts:
    """The tool's own text or chat prompts (prompts.Prompts) as the engine receives them: token ids, a chat
    message through the server's template. A prompt the tool cannot make is a PromptError, as over HTTP."""

    def __init__(self, kind: str, endpoint: str, tokenizer: str | None = None) -> None:
        self.tokenizer = LocalTokenizer(tokenizer)
        # Seeded: a virtual night draws the same corpus windows every time it is run (repeats differ).
        self.source = prompts.Prompts(kind, endpoint, tokenizer=self.tokenizer, seed=0)
        self.template_prefix = 0

    def fresh(self, tokens: int) -> list[int]:
        made = asyncio.run(self._next(tokens))
        self.template_prefix = self.source.template_prefix
        if made.ids is not None:
            return made.ids
        return self.tokenizer.encode(messages=made.messages)

    async def _next(self, tokens: int) -> prompts.Prompt:
        await self.source.prepare(tokens)
        return await self.source.next(tokens)


_TEXTS: dict[tuple[str, str, str | None], TextPrompts] = {}


def record(truth: RequestTruth) -> RequestRecord:
    """An engine's request as the client would have recorded it from a perfect connection."""
    return RequestRecord(
        id=truth.id, prompt_tokens=truth.prompt_tokens, max_tokens=truth.max_tokens, send_t=truth.arrival,
        chunk_t=[t for t, _ in truth.emits], chunk_tokens=[n for _, n in truth.emits], end_t=truth.finish,
        status=200, usage_prompt_tokens=truth.prompt_tokens,
        usage_completion_tokens=truth.tokens if truth.finish is not None else None, server_id=truth.id)


def cell_result(config: SimConfig, spec: CellSpec, cell: sim_virtual.VirtualCell) -> CellResult:
    """A replayed cell as the tool stores a measured one: the tool's own figures from the engine's requests,
    the verdict the tool's rules gave on the engine's evidence."""
    base = result_base(spec)
    findings = list(cell.findings)
    if not cell.requests:
        return CellResult(**base, status=cell.status, **findings_fields(findings))
    records = [record(r) for r in cell.requests]
    values: dict[str, Any]
    if spec.phase == "prefill":
        values = prefill_metrics(records)
    elif cell.window is not None:
        values = window_metrics(records, *cell.window) | {"window": cell.window}
    else:
        values = fixed_metrics(records)
    notes = [NOTE]
    if spec.phase == "decode" and spec.ttft == "warm":
        notes.append(f"{TTFT_MODE_TEXT['warm']}; {spec.concurrency} priming request(s) not counted")
    counters = cell.counters
    if spec.phase == "decode" and spec.prompts == "random" and config.num_speculative_tokens:
        findings.append(spec_random_prompts())
    acceptance_rate, acceptance_length, mean_accepted = metrics.spec_figures(
        counters.get("drafts"), counters.get("draft_tokens"), counters.get("accepted"))
    running, waiting, kv = ([s[i] for s in cell.samples] for i in range(3))
    return CellResult(
        **base, status=cell.status, **findings_fields(findings), notes=notes, **values,
        running_median=stats.median(running), waiting_max=max(waiting) if waiting else None,
        avg_running=stats.mean(running), avg_waiting=stats.mean(waiting), kv_usage_max=max(kv) if kv else None,
        preemptions=counters.get("preemptions"), prefix_cache_queries=counters.get("queries"),
        prefix_cache_hits=counters.get("hits"),
        spec_acceptance_rate=acceptance_rate, spec_mean_acceptance_length=acceptance_length,
        spec_mean_accepted=mean_accepted,
        # As the runner counts NVML's energy; on hardware with a power model only (a measured entry's fit).
        energy_j_per_token=cell.energy_j_per_token if spec.phase == "decode" else None,
        requests=[r.to_dict() for r in records])


# --- seed 000's experiments on the engine ------------------------------------------------------------
def _engine(config: SimConfig) -> tuple[Virtual, sim_truth.Recorder]:
    truth = sim_truth.Recorder()
    return Virtual(engine_for(config, truth)), truth


def context_window(config: SimConfig, reply_tokens: int) -> study.ExperimentResult:
    """study.context_window's two requests, answered by the server's own rule (sim.window_answer): the first
    runs to its (clamped) length, as the engine would run it with end-of-sequence ignored."""
    window = config.max_model_len
    refused, runs_to = sim.window_answer(config, window - reply_tokens // 2, reply_tokens)
    over_prompt, _ = sim.window_answer(config, window + 16, 1)
    return study.context_window_result(
        window, reply_tokens, over_total=(400, None) if refused else (200, runs_to),
        over_prompt=(400, over_prompt[0][:300]) if over_prompt else (200, None), attempts=[])


def long_context(config: SimConfig, contexts: list[int], reply_tokens: int,
                 prompts: sim_virtual.Prompts) -> study.ExperimentResult:
    """One request at a time, shortest prompt first, on one server."""
    sim, truth = _engine(config)
    rows: list[dict[str, Any]] = []
    records: list[RequestRecord] = []
    for context in sorted(contexts):
        if context + reply_tokens > config.max_model_len:
            rows.append({"context_tokens": context, "skipped": "over max_model_len"})
            continue
        sim.submit(prompts.fresh(context), reply_tokens)
        sim.run()
        rec = record(truth.requests[-1])
        records.append(rec)
        rows.append(study.long_context_row(context, rec))
    return study.long_context_result(rows, records, [])


def overload(config: SimConfig, max_num_seqs: int, factor: float, prompt_tokens: int, reply_tokens: int,
             prompts: sim_virtual.Prompts) -> study.ExperimentResult:
    """factor x max-num-seqs requests at once; the gauges sampled every quarter second, as a scrape reads
    them (the last step begun)."""
    sim, truth = _engine(config)
    for _ in range(study.burst_size(max_num_seqs, factor)):
        sim.submit(prompts.fresh(prompt_tokens), reply_tokens)
    sim.run()
    read = ((t, sim_virtual.gauges(truth.steps, t, sim.engine.blocks.total))
            for t in sim_virtual.times(0.0, sim.now, SAMPLE_EVERY_S))
    gauges = [(t, g[0], g[1]) for t, g in read if g is not None]
    records = [record(r) for r in sorted(truth.requests, key=lambda r: r.arrival)]
    return study.overload_result(records, max_num_seqs=max_num_seqs, factor=factor, wall_s=sim.now, gauges=gauges,
                                 attempts=[])


def prefix_order(config: SimConfig, agents: int, shared_tokens: int, task_tokens: int, reply_tokens: int,
                 prompts: sim_virtual.Prompts) -> study.ExperimentResult:
    """The three arms in turn on one server, each with a shared block of its own (whole KV blocks)."""
    block = config.block()
    shared_len = study.shared_block_tokens(shared_tokens, block)
    sim, truth = _engine(config)
    counters = sim.engine.counters
    arms: dict[str, dict[str, Any]] = {}
    for arm in ("shared-first", "task-first", "unrelated"):
        shared = prompts.fresh(shared_len)
        tasks = [prompts.fresh(task_tokens) for _ in range(agents)]
        batch = {"shared-first": [shared + t for t in tasks], "task-first": [t + shared for t in tasks],
                 "unrelated": [prompts.fresh(shared_len + task_tokens) for _ in range(agents)]}[arm]
        began, seen, queries, hits = sim.now, len(truth.requests), counters["queries"], counters["hits"]
        for prompt in batch:
            sim.submit(prompt, reply_tokens)
        sim.run()
        records = [record(r) for r in truth.requests[seen:]]
        arms[arm] = study.prefix_arm(records, sim.now - began, queries=counters["queries"] - queries,
                                     hits=counters["hits"] - hits)
    return study.prefix_order_result(arms, agents=agents, block=block, shared_len=shared_len,
                                     task_tokens=task_tokens, attempts=[])
