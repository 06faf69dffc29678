"""Hardware and model tables: what a card can move and compute, what a model reads and stores per token.

Shared by the short answers (roofline bounds) and the simulator (its step-time physics). Pure data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

Generation = Literal["ampere", "ada", "hopper", "blackwell", "cdna3"]
GENERATIONS: tuple[Generation, ...] = ("ampere", "ada", "hopper", "blackwell", "cdna3")


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_gb: float
    bandwidth_gb_s: float
    bf16_tflops: float          # dense
    fp8_tflops: float | None    # dense; None where the chip has no FP8
    int8_tops: float            # dense
    source: str = ""            # the vendor's datasheet or whitepaper the figures are from
    # What the driver reports per card (vLLM's total_gpu_memory, GiB), where a real log printed it; None: the
    # vendor's figure less 1% (reported_gib()).
    reported: float | None = None
    reported_source: str = ""
    # What one card sends another per second for tensor parallelism's all-reduces, one way (GB/s): NVLink's
    # where the form factor joins the cards by it (SXM boards; the NVL cards' bridges), else the PCIe slot's
    # x16 (4.0: 32, 5.0: 64), the vendor's figure halved where it prints both directions together.
    link_gb_s: float = 32.0
    # The chip's generation (NVIDIA's architecture, AMD's CDNA): the unfitted roofline's bandwidth efficiency is
    # fitted by generation (sim.model.UnfittedSteps), its memory and kernels reaching a different share of the
    # datasheet's figure on each.
    generation: Generation = "hopper"

    def reported_gib(self) -> float:
        """The card's memory as vLLM counts it (torch's total, GiB). Vendors state GDDR and HBM cards in binary
        gigabytes (24 GB is 24 GiB: an RTX 4090 reports 23.99); a card with ECC that takes memory (L40S, L4)
        reports less, and needs its row's logged figure."""
        return self.reported if self.reported is not None else self.memory_gb * 0.99


# Dense figures (datasheets print Hopper/Ada/Ampere tensor figures with 2:4 sparsity; these are half). BF16 and
# FP8 are the rates with FP32 accumulate (on GeForce cards half the FP16-accumulate rate). Memory as the vendor
# states it, per card. The rows from rtx-3090 on were added on 2026-12-06 from the vendor documents named in
# `source`, which could not be opened that day (no network): their figures were checked against a second
# reading of those documents only. The RTX PRO 6000 Blackwell and the A10G are not rows: NVIDIA publishes no
# dense BF16 figure for the first, and no datasheet for the second (the A10's figures are not the A10G's).
_AMPERE = "https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf"
_ADA = "https://images.nvidia.com/aem-dam/Solutions/Data-Center/l4/nvidia-ada-gpu-architecture-whitepaper-v2.1.pdf"
_A100 = ("https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
         "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
_H100 = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_H200 = "https://www.nvidia.com/en-us/data-center/h200/"
HARDWARE: dict[str, Hardware] = {h.name: h for h in (
    Hardware("rtx-a5000", 24, 768, 111.1, None, 222.2,
             "https://www.nvidia.com/content/dam/en-zz/Solutions/design-visualization/rtx/nvidia-rtx-a5000-"
             "datasheet.pdf (INT8: twice the dense FP16 figure, the GA102 ratio; the datasheet prints none)",
             23.99, "seed 000's startup log", generation="ampere"),
    Hardware("rtx-4090", 24, 1008, 165.2, 330.3, 660.6, _ADA + " (appendix, GeForce RTX 4090; v2.02's FP8 figure)",
             23.99, "torch on an RTX 4090 prints total_memory=24563MB; nvidia-smi 24564MiB (vllm-project/vllm#7553)",
             generation="ada"),
    Hardware("l40s", 48, 864, 362.05, 733, 733, "https://www.nvidia.com/en-us/data-center/l40s/", 44.42,
             "vLLM 0.7.1 log, 2x L40S (vllm-project/vllm#15815): ECC takes its share", generation="ada"),
    Hardware("a100-80gb-sxm", 80, 2039, 312, None, 624, _A100, link_gb_s=300, generation="ampere"),
    Hardware("a100-80gb-pcie", 80, 1935, 312, None, 624, _A100, generation="ampere"),
    Hardware("h100-sxm", 80, 3350, 989.5, 1979, 1979, _H100, 79.22,
             "vLLM's memory-profiling log on an 80 GB H100 (vllm-project/vllm#10511, total_gpu_memory 79.22GiB)",
             link_gb_s=450, generation="hopper"),
    Hardware("h100-pcie", 80, 2000, 756.5, 1513, 1513, _H100, link_gb_s=64, generation="hopper"),
    Hardware("h200-sxm", 141, 4800, 989.5, 1979, 1979, _H200, link_gb_s=450, generation="hopper"),
    Hardware("h200-nvl", 141, 4800, 835.5, 1670.5, 1670.5, _H200, 140.4, "seed 004's startup log", link_gb_s=450,
             generation="hopper"),
    Hardware("rtx-3090", 24, 936, 71, None, 284, _AMPERE + " (appendix A, GeForce RTX 3090)", 23.69,
             "vLLM 0.6.4-era log on an RTX 3090 (vllm-project/vllm#10517, total_gpu_memory=23.69GiB)",
             generation="ampere"),
    Hardware("rtx-5090", 32, 1792, 209.5, 419, 838,
             "https://images.nvidia.com/aem-dam/Solutions/geforce/blackwell/nvidia-rtx-blackwell-gpu-architecture.pdf"
             " (appendix, GeForce RTX 5090)", link_gb_s=64, generation="blackwell"),
    Hardware("rtx-a6000", 48, 768, 154.8, None, 309.7, _AMPERE + " (appendix, NVIDIA RTX A6000)", generation="ampere"),
    Hardware("rtx-6000-ada", 48, 960, 364.2, 728.5, 728.5, _ADA + " (appendix, RTX 6000 Ada Generation)",
             generation="ada"),
    Hardware("l4", 24, 300, 121, 242.5, 242.5,
             "https://www.nvidia.com/en-us/data-center/l4/ (sparse figures only, halved)", generation="ada"),
    Hardware("a100-40gb-sxm", 40, 1555, 312, None, 624, _A100, link_gb_s=300, generation="ampere"),
    Hardware("h100-nvl", 94, 3900, 835.5, 1670.5, 1670.5, _H100 + " (per GPU, not the pair)", link_gb_s=300,
             generation="hopper"),
    Hardware("b200", 180, 8000, 2250, 4500, 4500,
             "https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200, eight GPUs' figures divided by eight)",
             link_gb_s=900, generation="blackwell"),
    Hardware("mi300x", 192, 5300, 1307.4, 2614.9, 2614.9,
             "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html (dense figures as printed; "
             "the link: seven Infinity Fabric links of 64 GB/s each way to the board's seven other GPUs)",
             link_gb_s=448, generation="cdna3"),
)}


@dataclass(frozen=True)
class ModelShape:
    name: str
    params_b: float              # parameters read per token (active parameters for MoE), billions
    weight_bytes_per_param: float
    kv_bytes_per_token: int      # BF16 KV, all attention layers
    # The model's window, max_position_embeddings in its config.json: vLLM refuses a longer --max-model-len
    # ("User-specified max_model_len ... is greater than the derived max_model_len") unless
    # VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, and takes it for --max-model-len auto and when the flag is not given.
    window: int | None = None
    # From a config.json (model_config.shape_from_config); the hand table's rows leave them at their defaults.
    total_params_b: float | None = None   # every parameter held in memory (MoE: all experts); None: params_b
    kv_shards: int | None = None   # ways tensor parallelism splits the KV cache (its KV heads; MLA: 1); None: any
    attention_flops_per_token_per_ctx: float = 0.0   # a prompt token's attention per token of context it attends
    notes: tuple[str, ...] = ()   # what the shape leaves out
    # For vLLM's memory profile (sim.model.profile_activation): the vocabulary (the sampler's rows), the hidden
    # size and the MLP width a token passes through (the experts it is routed to, for MoE); None: not known
    # (the hand table's rows), and the profile falls back to a per-token guess.
    vocab: int | None = None
    hidden: int | None = None
    mlp_width: int | None = None
    # A mixture of experts: every routed expert's parameters (billions) and the share a token is routed to
    # (experts per token / experts); None: dense, or not known.
    expert_params_b: float | None = None
    expert_share: float | None = None
    # Its decoder layers (num_hidden_layers): tensor parallelism all-reduces twice in each (sim.model's link
    # term); None: not known, and no link term is charged.
    layers: int | None = None

    @property
    def held_params_b(self) -> float:
        return self.total_params_b if self.total_params_b is not None else self.params_b

    def kv_bytes_per_token_per_card(self, tp: int) -> float:
        """KV bytes a token costs on each card at tensor parallelism `tp` (vLLM keeps a KV head whole: past
        its KV heads, ranks hold copies)."""
        return self.kv_bytes_per_token / min(tp, self.kv_shards or tp)


LONG_MODEL_LEN_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"   # "1" or "true": vLLM warns of a longer max-model-len


def long_model_len_allowed(value: str) -> bool:
    """Whether VLLM_ALLOW_LONG_MAX_MODEL_LEN set to `value` lets a window past the model's through, as vLLM's
    envs.py reads it ("1" or "true", any case, spaces around)."""
    return value.strip().lower() in {"1", "true"}


MODELS: dict[str, ModelShape] = {m.name: m for m in (
    ModelShape("llama-3-8b", 8.03, 2.0, 131_072, 8_192, layers=32),
    ModelShape("qwen2.5-7b", 7.62, 2.0, 57_344, 32_768, layers=28),
    ModelShape("qwen3-32b", 32.8, 2.0, 262_144, 40_960, layers=64),
    # Seed 000's 27B hybrid (16 attention + 48 Gated DeltaNet layers), 4-bit GPTQ weights on the A5000 pair;
    # Qwen3.5-27B's native window is 262,144 tokens (seed 004 measures contexts up to 256K on it).
    ModelShape("qwen-27b-hybrid", 26.9, 0.5625, 65_536, 262_144, layers=64),
    ModelShape("qwen3.5-27b-gptq-int4", 26.9, 0.5625, 65_536, 262_144, layers=64),
    ModelShape("qwen3.5-27b", 26.9, 2.0, 65_536, 262_144, layers=64),
    # Small dense models used as speculative drafters: 28 layers x 8 KV heads x 128 x (K, V) x 2 bytes each.
    ModelShape("qwen3-0.6b", 0.75, 2.0, 114_688, 40_960, layers=28),
    ModelShape("qwen3-1.7b", 2.03, 2.0, 114_688, 40_960, layers=28),
)}


def drafter_shape(model: str) -> ModelShape | None:
    """The shape of a speculative drafter named by its Hugging Face id (e.g. Qwen/Qwen3-1.7B), if known."""
    name = model.rsplit("/", 1)[-1].lower()
    return next((shape for key, shape in MODELS.items() if name.startswith(key)), None)

# A profile's `hardware:` may name a group of cards: "a5000x2" is two RTX A5000s.
_HARDWARE_ALIASES = {"a5000": "rtx-a5000", "4090": "rtx-4090", "h200": "h200-nvl", "3090": "rtx-3090",
                     "5090": "rtx-5090", "a6000": "rtx-a6000"}


def is_measured(hardware: str) -> bool:
    """A `hardware:` value that names a measured file (`campaign calibrate`'s) rather than a row of these tables."""
    return hardware.endswith((".yaml", ".yml"))


# A card stated inline (a profile's `hardware:` mapping, passed to the simulator as JSON): its keys.
INLINE_REQUIRED = ("memory_gb", "bandwidth_gb_s", "bf16_tflops")
INLINE_OPTIONAL = ("name", "fp8_tflops", "int8_tops", "count", "reported_gib", "link_gb_s", "generation")


def inline_card(card: dict[str, object]) -> tuple[Hardware, int]:
    """A card stated by its figures rather than named from the tables: memory (GB, as the vendor states it),
    bandwidth (GB/s), dense BF16 TFLOPS, optionally dense FP8 TFLOPS (none: no FP8), dense INT8 TOPS (default
    twice the BF16 figure, as on Ampere, Ada and Hopper), what the driver reports (`reported_gib`: vLLM's
    total_gpu_memory or torch's total_memory, GiB; default the vendor's figure less 1%), what one card sends
    another for tensor parallelism (`link_gb_s`, GB/s one way; default PCIe 4.0 x16's 32), the chip's
    `generation` (one of GENERATIONS; default hopper, the one the roofline's constants were first fitted on) and
    how many (`count`, default 1). Raises ValueError naming the key and what it expects."""
    unknown = sorted(set(card) - set(INLINE_REQUIRED) - set(INLINE_OPTIONAL))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)}: a card inline takes "
                         f"{', '.join(INLINE_REQUIRED + INLINE_OPTIONAL)}")
    missing = [key for key in INLINE_REQUIRED if card.get(key) is None]
    if missing:
        raise ValueError(f"a card inline needs {', '.join(missing)} (its datasheet's figures: memory in GB, "
                         "bandwidth in GB/s, dense BF16 tensor TFLOPS)")

    def positive(key: str) -> float | None:
        value = card.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"{key}: a number above 0 is expected, got {value!r}")
        return float(value)

    count = card.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count: a whole number of cards, at least 1, is expected, got {count!r}")
    bf16 = positive("bf16_tflops")
    assert bf16 is not None
    generation = card.get("generation", "hopper")
    if generation not in GENERATIONS:
        raise ValueError(f"generation: one of {', '.join(GENERATIONS)} is expected, got {generation!r}")
    hw = Hardware(name=f"inline:{card.get('name') or 'card'}", memory_gb=positive("memory_gb") or 0.0,
                  bandwidth_gb_s=positive("bandwidth_gb_s") or 0.0, bf16_tflops=bf16,
                  fp8_tflops=positive("fp8_tflops"), int8_tops=positive("int8_tops") or 2 * bf16,
                  reported=positive("reported_gib"), reported_source="stated inline" if "reported_gib" in card else "",
                  link_gb_s=positive("link_gb_s") or Hardware.link_gb_s,
                  generation=next(g for g in GENERATIONS if g == generation))
    return hw, count


def hardware_label(hardware: str) -> str:
    """How a `hardware:` value reads in a sentence: a card stated inline by its name, said to be so."""
    if is_inline(hardware):
        resolved = resolve_hardware(hardware)
        assert resolved is not None
        card, count = resolved
        return f"{card.name.removeprefix('inline:')}{f' x{count}' if count > 1 else ''} (a card stated inline)"
    return hardware


def is_inline(hardware: str) -> bool:
    """A `hardware:` value that states a card by its figures (JSON, as a profile's mapping is passed on)."""
    return hardware.lstrip().startswith("{")


def resolve_hardware(name: str | None) -> tuple[Hardware, int] | None:
    """`a5000x2` -> (RTX A5000, 2); a card stated inline (JSON) -> its figures; unknown -> None (say so, never
    guess). An inline card that does not read is a ValueError naming the key."""
    if not name:
        return None
    if is_inline(name):
        try:
            card = json.loads(name)
        except ValueError as exc:
            raise ValueError(f"a card inline is a JSON object of its figures ({exc})") from None
        if not isinstance(card, dict):
            raise ValueError("a card inline is a mapping of its figures")
        return inline_card(card)
    # The count is the digits after the last "x" (mi300x is one card, mi300xx2 two of them).
    base, sep, count = name.lower().rpartition("x")
    if not sep or not count.isdigit():
        base, count = name.lower(), ""
    base = _HARDWARE_ALIASES.get(base, base)
    hw = HARDWARE.get(base)
    return (hw, int(count or 1)) if hw else None
