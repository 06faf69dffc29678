"""Hardware and model tables: what a card can move and compute, what a model reads and stores per token.

Shared by the short answers (roofline bounds) and the simulator (its step-time physics). Pure data.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_gb: float
    bandwidth_gb_s: float
    bf16_tflops: float          # dense
    fp8_tflops: float | None    # dense; None where the chip has no FP8
    int8_tops: float            # dense


# Dense figures (datasheets print Hopper/Ada/Ampere tensor figures with 2:4 sparsity; these are half).
HARDWARE: dict[str, Hardware] = {h.name: h for h in (
    Hardware("rtx-a5000", 24, 768, 111.1, None, 222.2),
    Hardware("rtx-4090", 24, 1008, 165.2, 330.3, 660.6),
    Hardware("l40s", 48, 864, 362.05, 733, 733),
    Hardware("a100-80gb-sxm", 80, 2039, 312, None, 624),
    Hardware("a100-80gb-pcie", 80, 1935, 312, None, 624),
    Hardware("h100-sxm", 80, 3350, 989.5, 1979, 1979),
    Hardware("h100-pcie", 80, 2000, 756, 1513, 1513),
    Hardware("h200-sxm", 141, 4800, 989.5, 1979, 1979),
    Hardware("h200-nvl", 141, 4800, 835.5, 1670.5, 1670.5),
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
    ModelShape("llama-3-8b", 8.03, 2.0, 131_072, 8_192),
    ModelShape("qwen2.5-7b", 7.62, 2.0, 57_344, 32_768),
    ModelShape("qwen3-32b", 32.8, 2.0, 262_144, 40_960),
    # Seed 000's 27B hybrid (16 attention + 48 Gated DeltaNet layers), 4-bit GPTQ weights on the A5000 pair;
    # Qwen3.5-27B's native window is 262,144 tokens (seed 004 measures contexts up to 256K on it).
    ModelShape("qwen-27b-hybrid", 26.9, 0.5625, 65_536, 262_144),
    ModelShape("qwen3.5-27b-gptq-int4", 26.9, 0.5625, 65_536, 262_144),
    ModelShape("qwen3.5-27b", 26.9, 2.0, 65_536, 262_144),
    # Small dense models used as speculative drafters: 28 layers x 8 KV heads x 128 x (K, V) x 2 bytes each.
    ModelShape("qwen3-0.6b", 0.75, 2.0, 114_688, 40_960),
    ModelShape("qwen3-1.7b", 2.03, 2.0, 114_688, 40_960),
)}


def drafter_shape(model: str) -> ModelShape | None:
    """The shape of a speculative drafter named by its Hugging Face id (e.g. Qwen/Qwen3-1.7B), if known."""
    name = model.rsplit("/", 1)[-1].lower()
    return next((shape for key, shape in MODELS.items() if name.startswith(key)), None)

# A profile's `hardware:` may name a group of cards: "a5000x2" is two RTX A5000s.
_HARDWARE_ALIASES = {"a5000": "rtx-a5000", "4090": "rtx-4090", "h200": "h200-nvl"}


def is_measured(hardware: str) -> bool:
    """A `hardware:` value that names a measured file (`campaign calibrate`'s) rather than a row of these tables."""
    return hardware.endswith((".yaml", ".yml"))


def resolve_hardware(name: str | None) -> tuple[Hardware, int] | None:
    """`a5000x2` -> (RTX A5000, 2); unknown -> None (say so, never guess)."""
    if not name:
        return None
    base, _, count = name.lower().partition("x")
    if count and not count.isdigit():
        base, count = name.lower(), ""
    base = _HARDWARE_ALIASES.get(base, base)
    hw = HARDWARE.get(base)
    return (hw, int(count or 1)) if hw else None
