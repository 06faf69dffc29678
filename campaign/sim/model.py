"""The simulator's physics: memory at start-up and time per engine step, for one (hardware, model) pair.

Pure arithmetic. The memory model is vLLM's own accounting (V1's gpu_worker.determine_available_memory): the
KV cache is `gpu_memory_utilization x total` less the weights, the profiled activation peak (a forward pass of
max-num-batched-tokens and the sampler's pass over max-num-seqs rows of the vocabulary), non-torch memory
(NCCL and all-reduce buffers, workspaces), and the CUDA-graph estimate only where that vLLM version reserves it
(by default since 0.21; VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0 turns it off). A pair no measurement fitted
takes the profile's terms from the model's config, with constants fitted to public real logs (UnfittedProfile).
Step time is a roofline: a fixed cost, the weights read once per step over the tensor-parallel group's pooled
bandwidth (plus the KV cache read for the batch's context), and compute per scheduled token over the group's
peak at a calibrated efficiency. Calibrations reproduce the seeds' tables (see tests/test_sim.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from packaging.version import Version

from campaign.core.hardware import HARDWARE, MODELS, Generation, Hardware, ModelShape, resolve_hardware
from campaign.core.model_config import model_shape, require_shape

GIB = 2**30

# VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS: vLLM counts its CUDA-graph estimate against the KV cache by default
# since 0.21 ("Enabled by default as of v0.21.0", envs.py); from 0.17 to 0.20 only when it is set to 1 (their
# note: "This will become the default"); before 0.17 the variable did not exist and nothing was reserved.
CUDAGRAPH_ENV = "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"
CUDAGRAPH_OPT_IN_SINCE = Version("0.17")
CUDAGRAPH_DEFAULT_SINCE = Version("0.21")


def cudagraphs_reserved(version: Version, env_value: str | None) -> bool:
    """Whether a vLLM of `version` with the variable set to `env_value` (None: unset) subtracts its CUDA-graph
    estimate from the KV cache (as envs.py reads it: "0" turns it off, "1" on)."""
    value = None if env_value is None else env_value.strip()
    if version >= CUDAGRAPH_DEFAULT_SINCE:
        return value != "0"
    return version >= CUDAGRAPH_OPT_IN_SINCE and value == "1"


@dataclass(frozen=True)
class UnfittedProfile:
    """vLLM's memory profile for a pair no measurement fitted, per card, from the model's config. The profile
    run is a forward pass of max-num-batched-tokens, then the sampler over max-num-seqs rows of the vocabulary
    (logits in fp32, sorted for top-k/top-p); torch's peak is the larger of the two. The constants are fitted
    to 12 public startup logs of real vLLM 0.15.1 (11 H100 runs of 7 models at TP 1, 2 and 4, and an A100
    serving Llama-3.1-8B): the KV cache each printed less what the weights and the utilisation account for
    leaves the other terms; each log's KV tokens are then within 1.1% (docs/simulator.md, "Memory as vLLM
    counts it"; tests/test_kv_memory.py)."""

    non_torch_gib: float = 0.56            # one card: cuBLAS workspaces, the CUDA context's growth
    non_torch_tp_gib: float = 0.60         # tensor parallel: NCCL and custom all-reduce buffers too
    sampler_bytes_per_logit: float = 28.0  # per row of max-num-seqs per token of the vocabulary
    forward_bytes_per_width: float = 5.0   # per batched token per unit of (hidden + MLP width / TP)
    fallback_bytes_per_token: float = 8_000.0   # a hand-table shape with no config: per batched token
    # What vLLM's CUDA-graph estimate takes where it is counted: public logs show graph pools of 0.1 to 1.1 GiB
    # for dense models ("Graph capturing finished ... took 0.31 GiB"); not fitted to a KV figure.
    cuda_graph_gib: float = 0.5

    def activation_gib(self, shape: ModelShape, *, tp: int, max_num_batched_tokens: int, max_num_seqs: int) -> float:
        """The profiled activation peak (torch's peak increase) of one card."""
        if shape.hidden is None or shape.mlp_width is None or shape.vocab is None:
            return self.fallback_bytes_per_token * max_num_batched_tokens / GIB
        forward = self.forward_bytes_per_width * max_num_batched_tokens * (shape.hidden + shape.mlp_width / tp)
        return max(forward, self.sampler_bytes_per_logit * max_num_seqs * shape.vocab) / GIB

    def non_torch(self, tp: int) -> float:
        return self.non_torch_gib if tp == 1 else self.non_torch_tp_gib


UNFITTED_PROFILE = UnfittedProfile()


@dataclass(frozen=True)
class UnfittedSteps:
    """A pair no measurement fitted: the roofline's overheads and efficiencies and the API server's time per
    request, fitted by `python -m campaign.bench.fidelity --fit` (a pattern search on mean |log error| of mean
    TPOT and TTFT) to ten public runs of real vLLM 0.15.1 on H100s: Llama-2-7B at TP 1 and CodeLlama-34B at
    TP 2 (campaign/bench/fidelity.py FITTED_ON), replayed as that vLLM schedules (asynchronously: sim.config
    async_scheduling_on); then Ampere's and Ada's share of their bandwidth, alone, on Llama-3.1-8B's runs on an
    A100 and an L40S. `make fidelity` gives the error on the runs held out (other models, TP sizes and workloads
    on H100s, A100s and an L40S; GPUStack's Qwen3-8B on vLLM 0.11). The step's terms add up, so a decode batch's
    arithmetic, which hides under its weights' read on a real GPU, is charged at a "decode MFU" far above 1, and
    a prefill chunk's too (3.86): the additive form's stand-in for that overlap and for what the runs' short
    prompts (575-790 tokens) do not show, not an efficiency a GPU reaches. A long prompt's prefill is then
    several times too fast on a card no run fitted (the seeds' fitted pairs read 0.25 and 0.70); replaying the
    runs' prompts as their client cycled them (a prefix cache serving the repeats) brought the search to 0.75
    but the held-out runs further off (docs/simulator.md). A roofline's max of the two terms was tried in the
    sum's place and fitted these runs worse (objective 0.103 against 0.092, both before async scheduling), its
    efficiencies above 1 too; calibrate's fit is linear in the terms, which a max is not."""

    fixed_step_s: float = 0.00303
    bandwidth_efficiency: float = 1.0   # Hopper's, and the generations no public run measured (Blackwell, CDNA3)
    ampere_bandwidth_efficiency: float = 0.786   # fitted on an A100 80 GB's runs
    ada_bandwidth_efficiency: float = 0.832      # fitted on an L40S's runs
    decode_mfu: float = 79.6
    prefill_mfu: float = 3.86
    request_s: float = 0.0027   # StepCosts.request_s: each request's time with the API server
    # Calibration.kv_read_factor: the attention kernels read the KV cache at 1 / this of the share the weights'
    # read reaches (paged decode attention gathers blocks; a GEMM streams one matrix)
    kv_read_factor: float = 1.445


# The generations with a bandwidth share of their own (UnfittedSteps' field); any other takes Hopper's.
GENERATION_BANDWIDTH: dict[Generation, str] = {"ampere": "ampere_bandwidth_efficiency",
                                               "ada": "ada_bandwidth_efficiency"}


def bandwidth_efficiency(steps: UnfittedSteps, generation: Generation) -> float:
    """The share of the datasheet's memory bandwidth a step's reads reach on a chip of `generation`."""
    share: float = getattr(steps, GENERATION_BANDWIDTH.get(generation, "bandwidth_efficiency"))
    return share


UNFITTED_STEPS = UnfittedSteps()


NO_WEIGHT_METHODS = {"ngram", "suffix", "ngram_gpu"}   # drafters that need no extra weights


@dataclass(frozen=True)
class Calibration:
    """Efficiencies and overheads fitted to measurements of one hardware and model pair."""

    reported_memory_gib: float          # what the driver reports per card (less than the datasheet)
    kv_bytes_per_token: float           # effective, all layers, before TP (hybrid pages make it differ)
    block_size: int                     # 800 for the hybrid GDN models (attention page >= mamba page)
    cuda_graph_gib: float               # per card, the reservation the memory note talks about
    other_gib: float                    # per card: non-torch memory, buffers, encoders, sampler
    activation_bytes_per_batched_token: float  # per card: the profiled forward pass grows with the chunk
    fixed_step_s: float                 # scheduler, launches, all-reduces: per step, whatever the batch
    bandwidth_efficiency: float
    decode_mfu: float                   # compute efficiency for decode tokens (small GEMMs)
    prefill_mfu: float                  # compute efficiency for prefill chunks
    attention_flops_per_token_per_ctx: float  # 4 x heads x head_dim x attention layers (x kernel advantage)
    kv_read_factor: float = 1.0         # attention kernels read the KV cache at a different efficiency
    request_s: float = 0.0              # StepCosts.request_s (the seeds' fits hold it in their steps' costs)
    # Under tensor parallelism, each token's hidden states cross the cards' link (tp_link); False: the fitted
    # steps hold the all-reduces (the seeds' pairs were fitted on their own TP).
    link_term: bool = False
    # A pair no measurement fitted: the activation and non-torch terms come from the model's config
    # (UNFITTED_PROFILE) instead of activation_bytes_per_batched_token and other_gib.
    profiled: UnfittedProfile | None = None


CALIBRATIONS: dict[tuple[str, str], Calibration] = {
    # Seed 000: 2x RTX A5000, 27B hybrid, 4-bit weights. 0.90 -> 493,447 tokens, 0.95 -> 567,464,
    # 0.95 with an 8,192-token chunk -> 562,838; 60 tok/s single stream, 641 at 64; ~1,000 prompt tok/s.
    # decode_mfu is fitted to the seed's fixed-count ladder as the seed measured it: C x 256 tokens over the
    # step's whole time, short prompts' prefill included (a5000-tuning's 32-token prompts); read as pure
    # decode (0.185 before), it left the 32- and 64-stream rungs 26% under the seed once prompts were sent.
    ("rtx-a5000", "qwen-27b-hybrid"): Calibration(
        reported_memory_gib=23.99, kv_bytes_per_token=34_801.0, block_size=800, cuda_graph_gib=2.11,
        other_gib=4.4134, activation_bytes_per_batched_token=13_100.0, fixed_step_s=0.0037,
        bandwidth_efficiency=0.80, decode_mfu=0.205, prefill_mfu=0.245,
        attention_flops_per_token_per_ctx=4 * 24 * 256 * 16 / 2),
    # Seed 004: one H200 NVL, Qwen3.5-27B GPTQ-Int4 with MTP (2 tokens): 148 tok/s single stream at 8K,
    # 3,104 at 64; 10.1K prompt tok/s at 8K down to 5.6K at 256K; KV between 1.31M and 1.57M tokens.
    ("h200-nvl", "qwen3.5-27b-gptq-int4"): Calibration(
        reported_memory_gib=140.4, kv_bytes_per_token=65_536.0, block_size=784, cuda_graph_gib=3.60,
        other_gib=18.8, activation_bytes_per_batched_token=60_000.0, fixed_step_s=0.0104,
        bandwidth_efficiency=0.80, decode_mfu=0.56, prefill_mfu=0.70,
        attention_flops_per_token_per_ctx=4 * 24 * 256 * 16, kv_read_factor=0.8),
}


def fitted(hardware: str, model: str) -> bool:
    """Whether the pair has a calibration fitted to a measurement (the seeds'), not the tables' defaults."""
    resolved, shape = resolve_hardware(hardware), model_shape(model)
    return resolved is not None and shape is not None and (resolved[0].name, shape.name) in CALIBRATIONS


def calibration_for(hardware: str, model: str, unfitted: UnfittedSteps = UNFITTED_STEPS) -> Calibration:
    """The fitted calibration, or one derived from the tables with `unfitted`'s constants (the fidelity bench's
    fit tries others)."""
    resolved = resolve_hardware(hardware)
    if resolved is None:
        raise ValueError(f"unknown hardware {hardware!r}; known: {', '.join(sorted(HARDWARE))}")
    hw, _ = resolved
    shape = model_shape(model)
    if shape is None:
        raise ValueError(f"unknown model shape {model!r}: not one of {', '.join(sorted(MODELS))}, nor a folder with "
                         "a config.json, nor a model whose config the simulator ships")
    fitted = CALIBRATIONS.get((hw.name, shape.name))
    if fitted is not None:
        return fitted
    return Calibration(
        reported_memory_gib=hw.reported_gib(), kv_bytes_per_token=float(shape.kv_bytes_per_token),
        block_size=16, cuda_graph_gib=UNFITTED_PROFILE.cuda_graph_gib, other_gib=UNFITTED_PROFILE.non_torch_gib,
        activation_bytes_per_batched_token=UNFITTED_PROFILE.fallback_bytes_per_token,
        fixed_step_s=unfitted.fixed_step_s, bandwidth_efficiency=bandwidth_efficiency(unfitted, hw.generation),
        decode_mfu=unfitted.decode_mfu, prefill_mfu=unfitted.prefill_mfu, request_s=unfitted.request_s,
        link_term=True, attention_flops_per_token_per_ctx=shape.attention_flops_per_token_per_ctx,
        kv_read_factor=unfitted.kv_read_factor, profiled=UNFITTED_PROFILE)


@dataclass(frozen=True)
class Memory:
    total_gib: float                 # per card
    weights_gib: float               # per card
    cuda_graph_gib: float            # the CUDA-graph estimate (counted against the cache only where reserved)
    activation_gib: float
    kv_gib: float                    # per card; negative means the cache does not fit at all
    kv_tokens: int
    num_blocks: int
    equivalent_utilization: float
    suggested_utilization: float
    non_torch_gib: float = 0.0       # per card (a fitted pair's "other" memory)
    cuda_graphs_reserved: bool = True   # whether this vLLM counted the estimate against the cache


# Why vLLM exits at start-up for want of memory, in the order it finds out (sim.server.start_up prints each
# as vLLM does; plan.replay names it for a search).
StartRefusal = Literal["weights", "no-cache", "window"]


def start_refusal(mem: Memory, *, utilization: float, max_model_len: int) -> StartRefusal | None:
    """The weights do not fit in the share of the card given, no memory is left for the KV cache, or the cache
    cannot hold one request of max-model-len; None: the server starts."""
    if mem.weights_gib > mem.total_gib * utilization:
        return "weights"
    if mem.num_blocks <= 0:
        return "no-cache"
    if mem.kv_tokens < max_model_len:
        return "window"
    return None


def memory(*, hardware: str, model: str, tp: int, utilization: float, max_num_batched_tokens: int,
           kv_cache_dtype: str = "auto", num_speculative_tokens: int = 0, speculative_method: str | None = "mtp",
           drafter: ModelShape | None = None, kv_cache_memory_bytes: int | None = None, max_num_seqs: int = 256,
           cuda_graphs: bool = True) -> Memory:
    """vLLM's accounting, per card: utilisation x total, less the weights, the profiled activation peak and
    non-torch memory, less the CUDA-graph estimate where `cuda_graphs` (cudagraphs_reserved: this version and its
    environment count it). `kv_cache_memory_bytes` (vLLM's flag, per card) sets the cache outright, whatever the
    utilisation (vLLM skips the profile's subtraction). A drafter model costs twice, as on the real card: its
    weights, and its own KV for every token of every sequence (vLLM pages the drafter's layers from the same
    budget), which is what cut seed 000's usable cache "by nearly 5x" on 24 GB cards. An MTP head costs one more
    layer's weights; n-gram costs nothing."""
    if not 0 < utilization <= 1:   # vLLM refuses it; a share above 1 would hand out memory the card lacks
        raise ValueError(f"gpu-memory-utilization {utilization:g} is outside (0, 1]")
    cal = calibration_for(hardware, model)
    shape = require_shape(model)
    total = cal.reported_memory_gib
    weights = shape.held_params_b * 1e9 * shape.weight_bytes_per_param / tp / GIB
    drafter_kv = 0.0
    if num_speculative_tokens and drafter is not None:
        weights += drafter.held_params_b * 1e9 * drafter.weight_bytes_per_param / tp / GIB
        drafter_kv = drafter.kv_bytes_per_token
    elif num_speculative_tokens and (speculative_method or "mtp") not in NO_WEIGHT_METHODS:
        weights *= 1.03  # an MTP or EAGLE head: about one more layer's weights
    if cal.profiled is not None:
        activation = cal.profiled.activation_gib(shape, tp=tp, max_num_batched_tokens=max_num_batched_tokens,
                                                 max_num_seqs=max_num_seqs)
        non_torch = cal.profiled.non_torch(tp)
    else:
        activation = cal.activation_bytes_per_batched_token * max_num_batched_tokens / GIB
        non_torch = cal.other_gib
    graphs = cal.cuda_graph_gib if cuda_graphs else 0.0
    kv = utilization * total - weights - activation - non_torch - graphs
    if kv_cache_memory_bytes is not None:
        # Whatever the utilisation, but not past the card: a cache bigger than what is left runs out of memory
        # (no blocks: the start-up fails as vLLM's would).
        room = total - weights - activation - non_torch - graphs
        kv = kv_cache_memory_bytes / GIB if kv_cache_memory_bytes / GIB <= room else -1.0
    # Per card: split over the ranks, but a KV head is kept whole (past its KV heads, ranks hold copies; MLA's
    # latent is on every rank).
    per_token = ((cal.kv_bytes_per_token + drafter_kv) * (0.5 if kv_cache_dtype.startswith("fp8") else 1.0)
                 / min(tp, shape.kv_shards or tp))
    block = cal.block_size * (2 if kv_cache_dtype.startswith("fp8") and cal.block_size > 16 else 1)
    tokens = max(0, int(kv * GIB / per_token))
    if cal.profiled is not None:
        # vLLM allocates whole pages and prints their tokens (blocks x block size); a fitted hybrid pair's log
        # reports capacity as an effective token count instead, kept as fitted.
        tokens = tokens // block * block
    return Memory(
        total_gib=total, weights_gib=weights, cuda_graph_gib=cal.cuda_graph_gib, activation_gib=activation,
        kv_gib=kv, kv_tokens=tokens, num_blocks=tokens // block,
        equivalent_utilization=utilization - cal.cuda_graph_gib / total,
        suggested_utilization=min(1.0, utilization + cal.cuda_graph_gib / total),
        non_torch_gib=non_torch, cuda_graphs_reserved=cuda_graphs,
    )


def block_size(hardware: str, model: str, kv_cache_dtype: str = "auto") -> int:
    cal = calibration_for(hardware, model)
    return cal.block_size * (2 if kv_cache_dtype.startswith("fp8") and cal.block_size > 16 else 1)


@dataclass(frozen=True)
class StepCosts:
    """One engine step's time as a sum of terms linear in what the step does: the form every calibration
    reduces to, and what `campaign calibrate` fits to a machine's measured cells (a measured hardware file
    states these directly). From the tables: fixed = the fixed cost plus the weights read over the group's
    bandwidth; per decode or prefill token = 2 x parameters over the group's peak at that efficiency;
    attention = its FLOPs per token per token of context over the prefill peak; KV read = the cache's bytes per
    token over the bandwidth."""

    fixed_s: float                    # per step, whatever the batch: scheduler, launches, the weights' read
    decode_s_per_token: float         # per scheduled decode position (speculative ones included)
    prefill_s_per_token: float        # per prompt token prefilled
    attention_s_per_token_ctx: float  # per prompt token per token of context it attends to
    kv_read_s_per_token: float        # per token of decoding context read from the KV cache
    # A separate drafter model (speculative_config "model"): per sequential pass, and per drafting sequence in it.
    draft_pass_s: float = 0.0
    draft_s_per_seq: float = 0.0
    draft_kv_read_s_per_token: float = 0.0
    # A mixture of experts: reading every routed expert once, and the share of them a token is routed to. A
    # step reads the experts its tokens touch, 1 - (1 - share)^tokens of them in expectation (uniform routing):
    # at one token the active ones, at a batch of a dozen nearly all (fixed_s holds the rest of the weights).
    expert_read_s: float = 0.0
    expert_share: float = 0.0
    # Per request, before the engine can seat it: the API server's work on it (parsing, tokenising, handing it
    # to the engine core). A delay, not a step's time: requests pay it side by side, and the steps run on
    # meanwhile. Part of every TTFT the client sees; 0 for the seeds' pairs, UnfittedSteps' for any other,
    # fitted by `campaign calibrate`.
    request_s: float = 0.0

    def experts_s(self, tokens: float) -> float:
        """The routed experts' read in a step of `tokens` tokens."""
        if not self.expert_read_s or tokens <= 0:
            return 0.0
        untouched: float = (1.0 - self.expert_share) ** tokens
        return self.expert_read_s * (1.0 - untouched)

    def seconds(self, *, decode_tokens: int, prefill_tokens: int, prefill_context: int, context_tokens_read: int,
                draft_passes: int = 0, drafting_seqs: int = 0, prefill_speed: float = 1.0,
                decode_speed: float = 1.0) -> float:
        """Time of one engine step: `decode_tokens` (all sequences, speculative positions included),
        `prefill_tokens` scheduled from prompts whose attention spans `prefill_context` on average, and the KV
        cache read for `context_tokens_read` tokens of decoding context; with a drafter model, its
        `draft_passes` sequential forward passes over `drafting_seqs` sequences. `prefill_speed` /
        `decode_speed` (the faults of a known true effect) divide the prefill tokens' time and the decode
        tokens' (drafting included); the fixed cost and the KV read are shared between the two by scheduled
        tokens, so a step of prefill alone, or of decode alone, takes exactly 1/speed as long."""
        if decode_tokens == 0 and prefill_tokens == 0:
            return 0.0
        t_mem = (self.fixed_s + self.kv_read_s_per_token * context_tokens_read
                 + self.experts_s(decode_tokens + prefill_tokens))
        t_decode = decode_tokens * self.decode_s_per_token
        t_prefill = prefill_tokens * (self.prefill_s_per_token + self.attention_s_per_token_ctx * prefill_context)
        t_draft = 0.0
        if draft_passes and drafting_seqs:
            t_draft = draft_passes * (self.draft_pass_s + drafting_seqs * self.draft_s_per_seq
                                      + self.draft_kv_read_s_per_token * context_tokens_read)
        if prefill_speed == 1.0 and decode_speed == 1.0:
            return t_mem + t_decode + t_prefill + t_draft
        prefill_share = prefill_tokens / (prefill_tokens + decode_tokens)
        return ((t_prefill + prefill_share * t_mem) / prefill_speed
                + (t_decode + t_draft + (1 - prefill_share) * t_mem) / decode_speed)


    def split(self, features: tuple[float, float, float, float, float]) -> tuple[float, float]:
        """A step's time by what bounds it, from its features (StepTruth.features: 1, decode positions, prompt
        tokens, prompt x context, KV context read): (compute: the decode positions', prompt tokens' and
        attention's arithmetic; memory: the fixed cost with the weights' read, and the KV read). A drafter's
        time is in neither (the features do not carry it)."""
        _, decode, prefill, weight, read = features
        compute = (self.decode_s_per_token * decode + self.prefill_s_per_token * prefill
                   + self.attention_s_per_token_ctx * weight)
        return compute, self.fixed_s + self.kv_read_s_per_token * read + self.experts_s(decode + prefill)


@dataclass(frozen=True)
class StepPower:
    """What the launch's GPUs draw, all together, while a step runs: `compute_w` while its compute terms run
    and `memory_w` while its memory terms run (StepCosts.split). Arithmetic near the power limit (prefill) and
    reads from memory (decode at a small batch) draw different power on a GPU, so the two are apart; the energy
    of a span of steps is then linear in the two, which is how `campaign calibrate` fits them to measured energy
    per token (NVML's counter). Idle time between steps is not modelled: the tool's closed-loop cells keep the
    engine busy from their first step to their last (a replay has no gap), and the few idle moments NVML counts
    in a measured step land in the two fitted powers. The tables carry no power model: a datasheet TDP says what
    a card may draw, not what a step does."""

    compute_w: float
    memory_w: float

    def terms(self) -> tuple[float, float]:
        return self.compute_w, self.memory_w


ACTIVATION_BYTES = 2   # a token's hidden state between the layers, in BF16 whatever the weights' type


def tp_link(cal: Calibration, hw: Hardware, shape: ModelShape, tp: int) -> float:
    """Tensor parallelism's all-reduces, per token scheduled: each layer sums its attention's and its MLP's
    partial outputs over the `tp` cards, two all-reduces a layer, each sending, by a ring, 2 (tp - 1) / tp of
    the tokens' hidden states over the link (Hardware.link_gb_s, one way). Nothing at one card, for a pair whose
    fitted steps hold them (the seeds'), or for a shape whose layers or hidden size are not known. An
    all-reduce's start-up is not a term of its own: fitted with the other constants on the TP 1 and TP 2 runs
    (`--fit`), it came out at 1 us, less than those runs tell apart, and the fixed cost holds it."""
    if tp <= 1 or not cal.link_term or not shape.layers or not shape.hidden:
        return 0.0
    return 2 * shape.layers * shape.hidden * ACTIVATION_BYTES * (2 * (tp - 1) / tp) / (hw.link_gb_s * 1e9)


def step_costs(*, hardware: str, model: str, tp: int, drafter: ModelShape | None = None,
               unfitted: UnfittedSteps = UNFITTED_STEPS) -> StepCosts:
    """The roofline of a (hardware, model) pair of the tables at tensor parallelism `tp`, as step costs (a pair
    no seed fitted: with `unfitted`'s constants)."""
    cal = calibration_for(hardware, model, unfitted)
    resolved = resolve_hardware(hardware)
    assert resolved is not None
    hw, _ = resolved
    shape = require_shape(model)
    bandwidth = tp * hw.bandwidth_gb_s * 1e9 * cal.bandwidth_efficiency
    peak = tp * hw.bf16_tflops * 1e12
    flops_per_token = 2 * shape.params_b * 1e9
    weights = shape.params_b * 1e9 * shape.weight_bytes_per_param
    experts: dict[str, float] = {}
    if shape.expert_params_b and shape.expert_share:
        # The routed experts leave the fixed read (its active share of them), read as a step's tokens touch them.
        expert_bytes = shape.expert_params_b * 1e9 * shape.weight_bytes_per_param
        weights -= shape.expert_share * expert_bytes
        experts = {"expert_read_s": expert_bytes / bandwidth, "expert_share": shape.expert_share}
    draft = {}
    if drafter is not None:
        draft = {"draft_pass_s": drafter.params_b * 1e9 * drafter.weight_bytes_per_param / bandwidth
                 + cal.fixed_step_s / 2,
                 "draft_s_per_seq": 2 * drafter.params_b * 1e9 / (peak * cal.decode_mfu),
                 "draft_kv_read_s_per_token": drafter.kv_bytes_per_token / bandwidth}
    link_s_per_token = tp_link(cal, hw, shape, tp)
    return StepCosts(
        fixed_s=cal.fixed_step_s + weights / bandwidth,
        decode_s_per_token=flops_per_token / (peak * cal.decode_mfu) + link_s_per_token,
        prefill_s_per_token=flops_per_token / (peak * cal.prefill_mfu) + link_s_per_token,
        attention_s_per_token_ctx=cal.attention_flops_per_token_per_ctx / (peak * cal.prefill_mfu),
        kv_read_s_per_token=cal.kv_read_factor * cal.kv_bytes_per_token / bandwidth, request_s=cal.request_s,
        **draft, **experts)


def step_seconds(*, hardware: str, model: str, tp: int, decode_tokens: int, prefill_tokens: int,
                 prefill_context: int, context_tokens_read: int, drafter: ModelShape | None = None,
                 draft_passes: int = 0, drafting_seqs: int = 0, prefill_speed: float = 1.0,
                 decode_speed: float = 1.0) -> float:
    """StepCosts.seconds for a pair of the tables."""
    return step_costs(hardware=hardware, model=model, tp=tp, drafter=drafter).seconds(
        decode_tokens=decode_tokens, prefill_tokens=prefill_tokens, prefill_context=prefill_context,
        context_tokens_read=context_tokens_read, draft_passes=draft_passes, drafting_seqs=drafting_seqs,
        prefill_speed=prefill_speed, decode_speed=decode_speed)


def blocks_for(tokens: int, block: int) -> int:
    return math.ceil(tokens / block)
