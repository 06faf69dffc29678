"""The simulator's configuration, built once from its command line into a frozen record.

`python -m campaign.sim` takes vLLM's flags that matter and rejects unknown ones the way vLLM's argparse does
(exit 2, a usage line). Flags vLLM accepts but the simulation ignores are accepted. The faults that tests inject
(`--fault`, or CAMPAIGN_SIM_FAULTS=a,b) are parsed here too, once, into a typed record the engine and the server
read; an unknown fault is an argparse error, never silently ignored. A launch's identity (CAMPAIGN_SIM_LAUNCH,
which the launcher sets to `variant/repeat`) seeds the one speed factor `launch-noise` draws for it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from campaign.core.hardware import MODELS, ModelShape, drafter_shape, is_measured, resolve_hardware
from campaign.core.model_config import model_shape, require_shape
from campaign.core.vllm_flags import human_int, out_of_bounds
from campaign.sim import measured as sim_measured
from campaign.sim import model as sim_model

VERSION = "0.33.0"
FAULTS = ("start-oom", "hang-startup", "crash-after:N", "ignore-sigterm", "grandchild", "foreign:TOK_PER_S",
          "bimodal4", "launch-noise:SIGMA", "prefill-speed:FACTOR", "decode-speed:FACTOR", "reset-keeps-cache",
          "throttle:PER_MIN")
LAUNCH_ENV = "CAMPAIGN_SIM_LAUNCH"   # a launch's identity in its night (`variant/repeat`), set by the launcher
# The simulator's own flags: a vLLM has none of them, so a night that passes one to vLLM is refused by name.
SIM_ONLY_FLAGS = frozenset({"hardware", "model-shape", "time-scale", "version-style", "fault", "truth"})


@dataclass(frozen=True)
class Faults:
    """What goes wrong on purpose, each fault a field the code that acts on it reads."""

    start_oom: bool = False              # the weights do not fit: vLLM's load failure, exit 1
    hang_startup: bool = False           # never becomes ready
    crash_after: int | None = None       # the engine core dies after N finished requests
    ignore_sigterm: bool = False         # SIGTERM and SIGINT are ignored: the runner must escalate
    grandchild: bool = False             # leaves a process in its own session behind
    foreign_tok_s: float = 0.0           # someone else's traffic: generation tokens per simulated second
    bimodal4: bool = False               # seed 000's two speeds, 2.1x apart, at exactly four streams
    launch_noise: float = 0.0            # sigma of the lognormal speed factor each launch draws (a rig's spread)
    prefill_speed: float = 1.0           # a known true effect: prefill compute time divided by this
    decode_speed: float = 1.0            # the same for decode
    reset_keeps_cache: bool = False      # /reset_prefix_cache answers success and forgets nothing
    throttle: float = 0.0                # a card heating up: every step this much longer per simulated minute

    @classmethod
    def parse(cls, specs: list[str]) -> Faults:
        """`NAME[:VALUE]` specs; one spec may hold several, comma-separated (a matrix variant's `fault:` value)."""
        values: dict[str, Any] = {}
        for spec in (part for item in specs for part in item.split(",") if part):
            name, _, value = spec.partition(":")
            if name in {"launch-noise", "prefill-speed", "decode-speed", "throttle"}:
                values[name.replace("-", "_")] = _fault_number(name, value)  # its own error names the fault
                continue
            try:
                if name == "crash-after":
                    values["crash_after"] = int(value)
                elif name == "foreign":
                    values["foreign_tok_s"] = float(value)
                elif name in {"start-oom", "hang-startup", "ignore-sigterm", "grandchild", "bimodal4",
                              "reset-keeps-cache"} and not value:
                    values[name.replace("-", "_")] = True
                else:
                    raise ValueError
            except ValueError:
                raise ValueError(f"unknown fault {spec!r}; known: {', '.join(FAULTS)}") from None
        return cls(**values)


def _fault_number(name: str, value: str) -> float:
    """A speed factor above 0, or a sigma (or a throttle per minute) of 0 or more; finite either way."""
    sigma = name in {"launch-noise", "throttle"}
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number) or number < 0 or (number == 0 and not sigma):
        raise ValueError(f"fault {name}:{value}: expected {name}:" + (
            ("SIGMA, a number of 0 or more (e.g. launch-noise:0.05)" if name == "launch-noise"
             else "PER_MIN, a number of 0 or more (e.g. throttle:0.05, each minute 5% slower)") if sigma
            else f"FACTOR, a number above 0 (e.g. {name}:0.8, 20% slower)"))
    return number


def launch_speed(sigma: float, seed: int, launch: str) -> float:
    """The speed factor one launch runs at: lognormal with median 1 and `sigma`, drawn from the seed and the
    launch's identity, so that every launch of a night differs and the same night run again draws the same.
    Exactly 1 without noise. Seeded by a string: random hashes it (SHA-512), the same in every process."""
    if not sigma:
        return 1.0
    return random.Random(f"launch-noise/{seed}/{launch}").lognormvariate(0.0, sigma)


@dataclass(frozen=True)
class SimConfig:
    """Everything the simulator's start-up, engine and HTTP server read, resolved (defaults applied)."""

    model: str
    served_model_name: str | None
    hardware: str                        # a row of the tables (a5000x2), or a measured file's path
    model_shape: str                     # "" with a measured file (it carries its own model)
    host: str
    port: int
    api_key: str | None
    ssl_certfile: str | None
    ssl_keyfile: str | None
    gpu_memory_utilization: float
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    tensor_parallel_size: int
    block_size: int | None               # as passed; None: the hardware/model pair's own
    enable_prefix_caching: bool
    speculative_method: str | None
    num_speculative_tokens: int
    acceptance_rate: float | None        # per draft position, as set in the config; None: from each prompt
    kv_cache_dtype: str
    time_scale: float                    # simulated seconds per wall second
    seed: int
    version_style: Version               # the vLLM version whose log and API behaviour are imitated
    faults: Faults
    truth: Path | None                   # where to write the truth records (JSON lines), if anywhere
    non_default: dict[str, Any] = field(default_factory=dict)  # for the "non-default args" log line
    reasoning_parser: str | None = None  # chat replies open with reasoning (half of each reply)
    # vLLM's --enable-prompt-tokens-details: a reply's usage says how many prompt tokens the prefix cache held.
    prompt_tokens_details: bool = False
    drafter: ModelShape | None = None    # a separate drafter model (speculative_config "model"), if any
    launch: str = ""                     # the launch's identity in its night (LAUNCH_ENV); "" outside a night
    speed_factor: float = 1.0            # every engine step's time is multiplied by it (fault launch-noise)
    measured: sim_measured.MeasuredHardware | None = None  # `campaign calibrate`'s fit, when hardware names one
    kv_cache_memory_bytes: int | None = None  # per card, as passed: the cache's size outright (vLLM's flag)
    # Step costs a fit is trying (campaign calibrate): they replace the tables' or the measured file's.
    costs_override: sim_model.StepCosts | None = None
    aliases: tuple[str, ...] = ()        # every --served-model-name given (the first is served_model_name)
    tokenizer: str | None = None         # --tokenizer: the model's own; None: the built-in approximation
    power_override: sim_model.StepPower | None = None   # likewise, the power a fit is trying
    # Whether this vLLM counts its CUDA-graph estimate against the KV cache (sim_model.cudagraphs_reserved: the
    # version imitated and VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS in the server's environment).
    cuda_graphs: bool = True
    # vLLM's async scheduling (async_scheduling_on: the version imitated, --async-scheduling, the drafter): a step
    # is planned while the one before it runs, so a request arriving is seated a step later than without.
    async_scheduling: bool = False

    @property
    def name(self) -> str:
        """The model name the API serves."""
        return self.served_model_name or self.model

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a request may give (vLLM: each --served-model-name, else the model)."""
        return self.aliases or (self.name,)

    @property
    def clamps_max_tokens(self) -> bool:
        """vLLM >= 0.32 silently clamps max_tokens to what the window leaves (a max_tokens over the window itself
        it refuses); older versions refuse any that does not fit."""
        return self.version_style >= Version("0.32")

    def block(self) -> int:
        """The KV page size: as passed, else the pair's own (hybrid models: at least the mamba state's page;
        a measured entry: the page its log reported)."""
        if self.block_size:
            return self.block_size
        if self.measured is not None:
            return self.measured.memory.block_size
        return sim_model.block_size(self.hardware, self.model_shape, self.kv_cache_dtype)

    @property
    def window(self) -> int | None:
        """The model's own window (max_position_embeddings), from the table's shape; None where it is not known
        (a measured entry: the log does not print it, so no max-model-len is refused for it)."""
        if self.measured is not None:
            return None
        return require_shape(self.model_shape).window

    @cached_property
    def costs(self) -> sim_model.StepCosts:
        """Every engine step's cost terms: fitted (a measured entry) or the tables' roofline."""
        if self.costs_override is not None:
            return self.costs_override
        if self.measured is not None:
            return self.measured.step.costs()
        return sim_model.step_costs(hardware=self.hardware, model=self.model_shape, tp=self.tensor_parallel_size,
                                    drafter=self.drafter)

    @property
    def power(self) -> sim_model.StepPower | None:
        """What the GPUs draw (energy per token): a measured entry's fit where its run measured energy; None
        for the tables (they know speeds, not power) and for an entry fitted without energy."""
        if self.power_override is not None:
            return self.power_override
        if self.measured is not None and self.measured.power is not None:
            return self.measured.power.power()
        return None

    def memory(self) -> sim_model.Memory:
        if self.measured is not None:
            return self.measured.memory.memory(kv_cache_memory_bytes=self.kv_cache_memory_bytes, block=self.block())
        mem = sim_model.memory(hardware=self.hardware, model=self.model_shape, tp=self.tensor_parallel_size,
                                utilization=self.gpu_memory_utilization,
                                max_num_batched_tokens=self.max_num_batched_tokens,
                                kv_cache_dtype=self.kv_cache_dtype, num_speculative_tokens=self.num_speculative_tokens,
                                speculative_method=self.speculative_method, drafter=self.drafter,
                                kv_cache_memory_bytes=self.kv_cache_memory_bytes, max_num_seqs=self.max_num_seqs,
                                cuda_graphs=self.cuda_graphs)
        # The pages the engine uses: a --block-size given holds the same tokens in more, smaller blocks.
        return replace(mem, num_blocks=mem.kv_tokens // self.block()) if self.block_size else mem

    @property
    def process_prefixes(self) -> bool:
        """vLLM >= 0.29 prefixes log lines with `(Process pid=N)`."""
        return self.version_style >= Version("0.29")


DEFAULT_MODEL_LEN = 32768
# vLLM 0.32's --kv-cache-dtype choices (its --help=all): another value ends the server at its argument parser.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_ds_mla", "fp8_e4m3", "fp8_e5m2", "fp8_inc",
                   "fp8_per_token_head", "int4_per_token_head", "int8_per_token_head", "nvfp4", "nvfp4_4over6",
                   "nvfp4_ds_mla", "turboquant_3bit_nc", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                   "turboquant_k8v4", "ultraquant_4bit")


def _human_int(text: str) -> int:
    """vLLM's human_readable_int: 8192, 8k (8,000) or 8K (8,192)."""
    value = human_int(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number (8k is 8,000; 8K is 8,192)")
    return value


def _model_len(text: str) -> int | None:
    """None: vLLM's auto (or -1), the model's own window."""
    return None if text.strip().lower() in {"auto", "-1"} else _human_int(text)


def _parser(environ: Mapping[str, str] = os.environ) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm serve", description="vllm-campaign's vLLM simulator")
    p.add_argument("model_tag", nargs="?")
    p.add_argument("--model")
    p.add_argument("--hardware", required=True, help="e.g. a5000x2, h200-nvl, or a measured file (campaign "
                   "calibrate's .yaml)")
    p.add_argument("--model-shape", help="e.g. qwen-27b-hybrid, qwen3.5-27b-gptq-int4 (required with a hardware "
                   "of the tables; a measured file carries its own)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key")
    p.add_argument("--ssl-certfile")
    p.add_argument("--ssl-keyfile")
    # vLLM's: one name or several (aliases); responses and metrics carry the first.
    p.add_argument("--served-model-name", nargs="+")
    # The model's own tokenizer (a Hugging Face folder or tokenizer.json); none: the built-in approximation.
    p.add_argument("--tokenizer")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    p.add_argument("--max-num-batched-tokens", type=_human_int)
    p.add_argument("--max-num-seqs", type=int)
    # vLLM's auto (or -1), and no flag, is the model's own window (its shape's; 32K where a shape states none).
    p.add_argument("--max-model-len", type=_model_len)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--block-size", type=int)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--speculative-config", type=json.loads)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--kv-cache-memory-bytes", type=_human_int)   # per card; overrides the utilisation's share
    # Accepted and without effect on the simulation.
    p.add_argument("--reasoning-parser")   # a chat reply then opens with reasoning, sent as reasoning_content
    p.add_argument("--enable-prompt-tokens-details", action="store_true")  # usage's prompt_tokens_details
    for flag in ("--dtype", "--load-format", "--tool-call-parser", "--quantization", "--hf-token"):
        p.add_argument(flag)
    p.add_argument("--model-loader-extra-config", type=json.loads)  # how weights load (e.g. S3 credentials)
    for flag in ("--trust-remote-code", "--enable-auto-tool-choice", "--disable-uvicorn-access-log",
                 "--enforce-eager"):
        p.add_argument(flag, action="store_true")
    p.add_argument("--time-scale", type=float, default=float(environ.get("CAMPAIGN_SIM_TIME_SCALE", "1")))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--version-style", default=environ.get("CAMPAIGN_SIM_VERSION_STYLE", VERSION))
    p.add_argument("--fault", action="append", default=[
        f for f in environ.get("CAMPAIGN_SIM_FAULTS", "").split(",") if f])
    p.add_argument("--truth", type=Path, default=environ.get("CAMPAIGN_SIM_TRUTH") or None,
                   help="write what the simulated server really did, as JSON lines, to this new file (or a file per "
                        "launch in this directory)")
    return p


_NOT_VLLM = {"hardware", "model_shape", "time_scale", "seed", "version_style", "fault", "model_tag", "truth"}


def option_names() -> frozenset[str]:
    """The long flags the simulator accepts (without `--`), as vLLM's `--help=all` would list its own."""
    names = {s[2:] for action in _parser()._actions for s in action.option_strings if s.startswith("--")}
    return frozenset(names)


# A served process's variables on the wall clock: its time scale and its truth file. In this process (a launch
# in simulated time, a plan) the clock is the engine's and the truth goes to the caller's sink, so they have
# nothing to act on; read there, a truth file another launch had written refused the start ("exists").
WALL_ONLY_ENV = frozenset({"CAMPAIGN_SIM_TIME_SCALE", "CAMPAIGN_SIM_TRUTH"})


def in_process_env(overrides: Mapping[str, str]) -> dict[str, str]:
    """The environment a launch in this process is parsed with: this process's, with the profile's overrides,
    less WALL_ONLY_ENV."""
    return {k: v for k, v in {**os.environ, **overrides}.items() if k not in WALL_ONLY_ENV}


def parse(argv: list[str], *, launch: str | None = None,
          measured: sim_measured.MeasuredHardware | None = None, env: Mapping[str, str] | None = None) -> SimConfig:
    """The command line as a SimConfig; mistakes end in argparse's usage error (exit 2), as vLLM's do. `launch`:
    the launch's identity in its night (default: LAUNCH_ENV), which with `--seed` draws its launch noise.
    `measured`: an entry in hand (campaign calibrate's, being fitted) instead of the file --hardware names.
    `env`: the server's environment where it is not this process's (a launch in simulated time, a plan): the
    vLLM variables that change what it does at start-up are read from it."""
    environ = os.environ if env is None else env
    p = _parser(environ)
    args = p.parse_args(argv)
    model = args.model or args.model_tag
    if not model:
        p.error("the following arguments are required: model_tag")
    if args.tokenizer and not Path(args.tokenizer).exists():
        p.error(f"argument --tokenizer: {args.tokenizer} does not exist (give a Hugging Face tokenizer folder, or "
                "its tokenizer.json)")
    big = False
    if is_measured(args.hardware):
        if args.model_shape:
            p.error("argument --model-shape: a measured hardware file carries its own model: drop --model-shape")
        try:
            measured = measured or sim_measured.load(Path(args.hardware))
        except ValueError as exc:
            p.error(f"argument --hardware: {exc}")
        if args.tensor_parallel_size != measured.memory.tensor_parallel_size:
            p.error(f"argument --tensor-parallel-size: {args.hardware} was measured at tensor parallelism "
                    f"{measured.memory.tensor_parallel_size}; another size needs a run of its own to calibrate from")
        if args.kv_cache_dtype != measured.memory.kv_cache_dtype:
            p.error(f"argument --kv-cache-dtype: {args.hardware} was measured with {measured.memory.kv_cache_dtype}; "
                    "another cache type needs a run of its own to calibrate from")
        at = measured.memory.gpu_memory_utilization
        if at is not None and args.gpu_memory_utilization != at:
            p.error(f"argument --gpu-memory-utilization: {args.hardware} was measured at {at:g} and does not know "
                    "the card's memory; another share needs a run of its own to calibrate from")
        spec_given = args.speculative_config or {}
        said = (f"{spec_given.get('method') or 'draft_model'}:{spec_given.get('num_speculative_tokens', 0)}"
                if spec_given.get("num_speculative_tokens") else None)
        if said != measured.memory.speculative:
            p.error(f"argument --speculative-config: {args.hardware} was measured with speculative decoding "
                    f"{measured.memory.speculative or 'off'}, not {said or 'off'}; its costs hold for that only")
        if args.kv_cache_memory_bytes is not None and not measured.memory.kv_bytes_per_token:
            p.error(f"argument --kv-cache-memory-bytes: {args.hardware} has no KV bytes per token (its log gave no "
                    "cache size in GiB), so it cannot size another cache")
    else:
        measured = None   # a row of the tables; the model's shape is --model-shape, else read from the model's config
        args.model_shape = args.model_shape or model
        try:
            resolve_hardware(args.hardware)
        except ValueError as exc:   # a card stated inline that does not read
            p.error(f"argument --hardware: {exc}")
        try:
            big = sim_model.calibration_for(args.hardware, args.model_shape).reported_memory_gib >= 70
        except ValueError as exc:
            p.error(f"argument --hardware/--model-shape: {exc} (give --model-shape, e.g. qwen3-32b, or a model "
                    "folder holding its config.json)")
    try:
        faults = Faults.parse(args.fault)
    except ValueError as exc:
        p.error(f"argument --fault: {exc}")
    try:
        version = Version(args.version_style)
    except InvalidVersion:
        p.error(f"argument --version-style: not a version: {args.version_style!r}")
    if args.time_scale <= 0:
        p.error("argument --time-scale: must be above 0")
    # vLLM's own bounds (its config's pydantic fields): a value it refuses ends the server before it serves.
    for flag in ("gpu-memory-utilization", "max-num-seqs", "max-num-batched-tokens", "block-size",
                 "tensor-parallel-size"):
        value = getattr(args, flag.replace("-", "_"))
        refused = None if value is None else out_of_bounds(flag, value)
        if refused is not None:
            p.error(f"argument --{flag}: {refused[0]}")
    truth: Path | None = args.truth
    if truth is not None and truth.is_dir():
        truth = truth / f"truth-{os.getpid()}.jsonl"  # a directory: one file per launch
    if truth is not None and truth.exists():
        p.error(f"argument --truth: {truth} exists; a truth file is never overwritten: remove it or name a "
                "directory (one file per launch)")
    identity = os.environ.get(LAUNCH_ENV, "") if launch is None else launch
    measured_chunk = measured.memory.max_num_batched_tokens if measured is not None else None
    measured_seats = measured.memory.max_num_seqs if measured is not None else None
    args.max_num_batched_tokens = args.max_num_batched_tokens or measured_chunk or (8192 if big else 2048)
    args.max_num_seqs = args.max_num_seqs or measured_seats or (1024 if big else 256)
    spec = args.speculative_config or {}
    # Like vLLM's line, but the scheduler limits are always shown (resolved), so the tool learns them.
    non_default = {k: v for k, v in vars(args).items() if v not in (None, False, [], 1.0) and k not in _NOT_VLLM}
    # Redacted as vLLM 0.32 redacts its own line (api_key, hf_token, watermark_config); the rest as given.
    non_default = {k: "***" if k in {"api_key", "hf_token", "watermark_config"} else v for k, v in non_default.items()}
    k = int(spec.get("num_speculative_tokens", 0)) if spec else 0
    drafter = None
    if k and spec.get("model") and spec.get("method") in (None, "draft_model", "draft"):
        drafter = drafter_shape(str(spec["model"])) or model_shape(str(spec["model"]))
        if measured is not None:
            p.error("argument --speculative-config: a measured hardware entry has no costs of its own for a "
                    "drafter model's passes (MTP, EAGLE heads and n-gram are costed with the step)")
        if drafter is None:
            p.error(f"argument --speculative-config: drafter model {spec['model']!r} is not one the simulator "
                    f"knows; known: {', '.join(n for n, m in MODELS.items() if m.params_b < 5)}")
    return SimConfig(
        model=model, served_model_name=args.served_model_name[0] if args.served_model_name else None,
        aliases=tuple(args.served_model_name or ()), tokenizer=args.tokenizer, hardware=args.hardware,
        model_shape=args.model_shape or "", host=args.host, port=args.port,
        api_key=args.api_key or os.environ.get("VLLM_API_KEY"), ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile, gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len or (measured.window if measured is not None
                                             else require_shape(args.model_shape).window) or DEFAULT_MODEL_LEN,
        tensor_parallel_size=args.tensor_parallel_size, block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        speculative_method=spec.get("method") if spec else None, num_speculative_tokens=k,
        acceptance_rate=float(spec["acceptance_rate"]) if k and "acceptance_rate" in spec else None,
        reasoning_parser=args.reasoning_parser, drafter=drafter,
        prompt_tokens_details=args.enable_prompt_tokens_details,
        kv_cache_dtype=args.kv_cache_dtype, time_scale=args.time_scale, seed=args.seed, version_style=version,
        faults=faults, truth=truth, non_default=non_default, launch=identity,
        speed_factor=launch_speed(faults.launch_noise, args.seed, identity), measured=measured,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        cuda_graphs=sim_model.cudagraphs_reserved(version, environ.get(sim_model.CUDAGRAPH_ENV)),
        async_scheduling=async_scheduling_on(version, args.async_scheduling,
                                             (spec.get("method") or "draft_model") if k else None,
                                             cpu=measured is not None and measured.on_cpu),
    )


ASYNC_DEFAULT_SINCE = Version("0.14")


def async_scheduling_on(version: Version, flag: bool | None, speculative_method: str | None, *,
                        cpu: bool = False) -> bool:
    """Whether a vLLM of `version` schedules asynchronously: as --async-scheduling says (True, False), else
    by default from 0.14 (its release notes: on by default, except with speculative decoding other than MTP and
    EAGLE, with pipeline parallelism, which the simulator does not run, and on the CPU backend: `cpu`, a
    measured entry whose log said CPU), never before."""
    if flag is not None:
        return flag
    if version < ASYNC_DEFAULT_SINCE or cpu:
        return False
    method = (speculative_method or "").lower()
    return not method or "mtp" in method or "eagle" in method


def parse_checked(argv: list[str], *, launch: str | None = None,
                  measured: sim_measured.MeasuredHardware | None = None,
                  env: Mapping[str, str] | None = None) -> SimConfig:
    """parse() for a caller in this process (replay, calibrate, tune): what the simulator's command line
    would refuse (its usage error and exit 2) is a ValueError with argparse's message instead."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return parse(argv, launch=launch, measured=measured, env=env)
    except SystemExit:
        lines = errors.getvalue().strip().splitlines()
        raise ValueError(lines[-1].removeprefix("vllm serve: error: ") if lines else "refused") from None
