"""A measured hardware entry: the simulator's physics for one machine and model, fitted by `campaign calibrate`
to a stored run's cells instead of read from the hardware and model tables.

A profile names one as `hardware: measured/<name>.yaml` (relative to launch_profiles/, or an absolute path);
the simulator then takes its step costs (campaign.sim.model.StepCosts, fitted) and its memory (the KV cache the
run's startup log reported, moved by the flags that move it) from the file, and needs no `model_shape`. A card
the tables do not know (an L40S with a new model, the CPU build here) becomes simulatable after one real run.

The file is a typed, versioned record like a run's files. Format history:
1 - first format: step costs, memory at the measured launch, the fit's cells (measured, predicted, error; the
    held-out ones predicted, not fitted) and its error summary.
2 - `power`: what the GPUs draw while computing and while reading memory (watts), fitted to the cells' energy
    per token where the run measured it (NVML); null otherwise. A format-1 file reads as one without it. A fit
    cell's `figure` may be `energy_j_per_token`.
3 - a fit cell's `figure` may be `mean_ttft_s`, `mean_tpot_s` or `output_tok_s`: a load replayed at its own
    arrival times (a run's rate cell, or a peer's per-request export: `campaign calibrate --export`), as vLLM's
    bench defines them. For an entry fitted to exports, `source` lists the files and `memory` is the launch
    profile's as the simulator sizes it (an export carries no startup log). Formats 1 and 2 read unchanged.
4 - the step costs carry `request_s`: each request's time with the API server before the engine can seat it
    (parsing, tokenising, handing it over), part of every TTFT and no step's. Older files read with 0.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from campaign.sim.model import GIB, Memory, StepCosts, StepPower

MEASURED_SCHEMA_VERSION = 4
READABLE = (1, 2, 3, 4)   # format 1 lacks only `power`; 3 adds figures only; 4 `request_s` (0 before)


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StepCostsRecord(_Record):
    """The fitted step costs (campaign.sim.model.StepCosts), in seconds."""

    fixed_s: float = Field(ge=0, description="per engine step, whatever the batch (scheduler, launches, the "
                                             "weights' read)")
    decode_s_per_token: float = Field(ge=0, description="per scheduled decode position")
    prefill_s_per_token: float = Field(ge=0, description="per prompt token prefilled")
    attention_s_per_token_ctx: float = Field(ge=0, description="per prompt token per token of context it "
                                                               "attends to")
    kv_read_s_per_token: float = Field(ge=0, description="per token of decoding context read from the KV cache")
    request_s: float = Field(default=0.0, ge=0, description="per request, before the engine can seat it: the API "
                                                            "server's time (format 4; 0 in older files)")

    def costs(self) -> StepCosts:
        return StepCosts(**self.model_dump())

    @classmethod
    def of(cls, costs: StepCosts) -> StepCostsRecord:
        return cls(fixed_s=costs.fixed_s, decode_s_per_token=costs.decode_s_per_token,
                   prefill_s_per_token=costs.prefill_s_per_token,
                   attention_s_per_token_ctx=costs.attention_s_per_token_ctx,
                   kv_read_s_per_token=costs.kv_read_s_per_token, request_s=costs.request_s)


class PowerRecord(_Record):
    """The fitted power model (campaign.sim.model.StepPower), in watts, all the launch's GPUs together."""

    compute_w: float = Field(ge=0, description="while a step's arithmetic runs (decode positions, prompt tokens, "
                                               "attention)")
    memory_w: float = Field(ge=0, description="while a step's reads run (the fixed cost with the weights' read, "
                                              "the KV read)")
    cells: int = Field(ge=0, description="decode cells whose measured energy per token it was fitted to")
    determined: int = Field(ge=0, le=2, description="how many of the two terms those cells tell apart")
    median_abs_error: float | None = Field(description="median |predicted / measured - 1| of energy per token "
                                                       "over those cells")
    max_abs_error: float | None = Field(description="the largest such error")

    def power(self) -> StepPower:
        return StepPower(compute_w=self.compute_w, memory_w=self.memory_w)


class MemoryRecord(_Record):
    """The KV cache and scheduler of the launch the costs were fitted on. What the entry cannot know is refused
    by name where a flag asks for it (campaign.sim.config.parse): another tensor-parallel size, KV cache type,
    utilisation (it does not know the card's memory) or speculative method."""

    kv_cache_tokens: int = Field(gt=0, description="the startup log's KV cache size at that launch")
    kv_cache_gib: float | None = Field(description="per card, the log's available KV cache memory (two decimals)")
    kv_bytes_per_token: float | None = Field(
        description="per card: exact from the launch's --kv-cache-memory-bytes where it set one, else from the "
                    "log's rounded GiB; sizes a cache --kv-cache-memory-bytes asks for; None: it cannot be resized")
    block_size: int = Field(gt=0, description="the KV page size the log reported, in tokens")
    tensor_parallel_size: int = Field(gt=0, description="the launch's")
    kv_cache_dtype: str = Field(description="the launch's --kv-cache-dtype (auto: the model's own)")
    gpu_memory_utilization: float | None = Field(description="the launch's; None where it does not apply (CPU)")
    max_num_batched_tokens: int = Field(gt=0, description="the launch's chunk, the default; another keeps the "
                                                          "measured cache (the activations' share is not known)")
    max_num_seqs: int = Field(gt=0, description="the launch's seats, the default")
    speculative: str | None = Field(description="the launch's speculative method and tokens (`mtp:2`); None: none")
    model_weights_gib: float | None = Field(description="per card, the log's model loading figure")

    def memory(self, *, kv_cache_memory_bytes: int | None, block: int) -> Memory:
        """The cache a launch gets: `kv_cache_memory_bytes` (per card) sizes it by the measured bytes per token;
        otherwise it is the measured one. `block`: the page size the launch uses."""
        tokens = self.kv_cache_tokens
        if kv_cache_memory_bytes is not None and self.kv_bytes_per_token:
            tokens = int(kv_cache_memory_bytes / self.kv_bytes_per_token)
        kv_gib = (tokens * self.kv_bytes_per_token / GIB if self.kv_bytes_per_token
                  else self.kv_cache_gib if self.kv_cache_gib is not None else 0.0)
        utilization = self.gpu_memory_utilization or 0.0
        return Memory(total_gib=math.inf, weights_gib=self.model_weights_gib or 0.0, cuda_graph_gib=0.0,
                      activation_gib=0.0, kv_gib=kv_gib, kv_tokens=tokens, num_blocks=tokens // block,
                      equivalent_utilization=utilization, suggested_utilization=utilization)


FitFigure = Literal["ttft_s", "total_tok_s", "energy_j_per_token", "mean_ttft_s", "mean_tpot_s", "output_tok_s"]


class FitCell(_Record):
    """One measured cell against the calibrated simulator's replay of it."""

    variant: str = Field(description="the run's variant")
    key: str = Field(description="the cell's key (a peer's export: its file name)")
    figure: FitFigure = Field(
        description="what was compared: a prefill cell's TTFT, a decode cell's total tok/s, or its energy per "
                    "token (the power model's fit; format 2); a load's mean TTFT, mean TPOT or output tok/s "
                    "(a rate cell or a peer's export replayed at its own arrival times; format 3)")
    measured: float = Field(description="the median over the run's repeats, in the hardware's units")
    spread: float | None = Field(description="the repeats' (max - min) / median: the machine's own noise on it; "
                                             "None with one repeat")
    predicted: float | None = Field(description="the calibrated simulator's replay of the cell; None where it "
                                                "published none (over capacity, invalid)")
    error: float | None = Field(description="predicted / measured - 1")
    held_out: bool = Field(description="true: left out of the fit, so this is a prediction, not a fit")


class ErrorSummary(_Record):
    cells: int = Field(description="cells compared")
    median_abs: float | None = Field(description="median of |error|; None without cells")
    max_abs: float | None = Field(description="largest |error|; None without cells")


class MeasuredHardware(_Record):
    """`launch_profiles/measured/<name>.yaml`, written by `campaign calibrate`."""

    schema_version: int = MEASURED_SCHEMA_VERSION
    kind: Literal["measured-hardware"] = "measured-hardware"
    name: str = Field(description="the entry's name (the file's stem)")
    description: str = Field(description="what was measured: the run, its server, its device")
    source: str = Field(description="the run directory the cells came from (or the peers' export files)")
    fitted_utc: str = Field(description="when the fit was made")
    vllm_version: str | None = Field(description="the measured server's version, as its log said")
    device: str | None = Field(description="GPU or CPU, as the log said")
    window: int = Field(gt=0, description="the largest max-model-len the run used: the simulator's default "
                                          "max-model-len (not a limit: the model's own window is not in the log)")
    step: StepCostsRecord = Field(description="the fitted step costs")
    memory: MemoryRecord = Field(description="the KV cache at the measured launch")
    fit: list[FitCell] = Field(description="every cell compared, fitted and held out")
    fitted_error: ErrorSummary = Field(description="over the fitted cells")
    held_out_error: ErrorSummary = Field(description="over the held-out cells: the prediction's error")
    power: PowerRecord | None = Field(default=None, description="what the GPUs draw, fitted to measured energy "
                                                                "per token; None: the run measured no energy")

    @property
    def on_cpu(self) -> bool:
        """Whether the measured server was vLLM's CPU backend (its log said CPU)."""
        return (self.device or "").upper() == "CPU"


def load(path: Path) -> MeasuredHardware:
    """The file, or ValueError naming it and what is wrong (the simulator's argument error shows it)."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: cannot read a measured hardware file ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a measured hardware file (a mapping is expected)")
    version = data.get("schema_version")
    if version not in READABLE:
        raise ValueError(f"{path}: schema_version {version!r}; this tool reads {', '.join(map(str, READABLE))}: "
                         "calibrate again (campaign calibrate RUN)")
    try:
        return MeasuredHardware.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ValueError(f"{path}: {'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None


def dump(entry: MeasuredHardware) -> str:
    head = ("# Written by `campaign calibrate`: the simulator's step costs and memory fitted to a measured run.\n"
            "# Name it in a launch profile as `hardware: measured/<name>.yaml`; calibrate again to refresh it.\n")
    return head + yaml.safe_dump(entry.model_dump(mode="json"), sort_keys=False)
