"""A model's shape from its own config.json: what the simulator and the roofline need of a model that the hand
table (hardware.MODELS) does not name.

A profile's `model:` is a Hugging Face id or a local folder. Its shape (hardware.ModelShape) comes from, in order:
`model_shape:` (a row of the hand table, an override); a local folder's config.json; the shipped copy of the
config of a common open model (campaign/core/model_configs.json: each with its source and licence). Anything
else is a one-line error saying how to give a config. Pure arithmetic on the config's keys, as vLLM reads them:

- **Parameters.** The language model's: embeddings, the LM head (unless tied), per layer the attention (GQA, or
  DeepSeek's MLA with its low-rank projections), the MLP (dense, or MoE: routed experts, shared experts and the
  router), biases where the config says so. A vision tower is not counted (a note says so). `active` is what a
  token reads: the experts it is routed to, not the others, and one row of the input embedding (as gpt-oss's
  model card counts active parameters), the LM head whole.
- **Weight bytes.** From `torch_dtype` (vLLM serves a float32 checkpoint in half precision) and
  `quantization_config`: fp8 (one byte a weight of the linear layers), GPTQ/AWQ (bits/8, plus a 16-bit scale
  and a packed zero per group), MXFP4 (4 bits plus an 8-bit scale per 32: gpt-oss's experts); embeddings, the LM
  head and whatever `modules_to_not_convert` lists stay in 16 bits. Another method is an error, not a guess.
- **KV bytes per token**, as vLLM's KV cache spec sizes a page (vllm/v1/kv_cache_interface.py):
  2 x KV heads x head size x 2 bytes per attention layer (K and V); MLA stores one latent of kv_lora_rank +
  qk_rope_head_dim per layer, shared by K and V, and the same latent on every tensor-parallel rank. Sliding-window
  and full-attention layers (Gemma 3, gpt-oss) are counted as vLLM's hybrid allocator lays them out: layers of
  each kind in groups of the smaller count, padded to whole groups, every group a page per block, so the "GPU KV
  cache size" vLLM prints is memory over all of them (a request's sliding layers hold only its window, so long
  requests fit more than that figure says: not modelled yet).
- **The window**, as vLLM derives max_model_len (vllm/config/model.py `_get_and_verify_max_len`): the smallest of
  the length keys present; a rope_scaling other than llama3/longrope multiplies it by its factor (YaRN: the
  original length times the factor); Gemma 3's is already scaled.
"""

from __future__ import annotations

import json
import math
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from campaign.core.errors import CampaignError
from campaign.core.hardware import MODELS, ModelShape

# vLLM's keys for a model's length (the smallest present is its derived max_model_len).
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_sequence_length", "max_seq_length", "seq_len")
# Gemma3TextConfig's defaults (transformers' configuration_gemma3.py): the official Gemma 3 config.json files
# name only what differs from them.
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072,
    "tie_word_embeddings": True, "sliding_window": 4096, "sliding_window_pattern": 6, "rope_scaling": None}
_HALF = 2.0   # bytes of a bf16/fp16 weight or KV element
_SHIPPED = "model_configs.json"


class ModelConfigError(CampaignError, ValueError):
    """A model whose shape cannot be read: no config, or a config this reader does not understand (a ValueError
    too, as the simulator's command line reports a bad value)."""

    exit_code = 2


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a multimodal config (text_config), with its class's defaults applied."""
    text = dict(config.get("text_config") or config)
    if text.get("model_type", config.get("model_type", "")).startswith("gemma3"):
        text = {**_GEMMA3_TEXT_DEFAULTS, **{k: v for k, v in text.items() if v is not None or k == "rope_scaling"}}
    for key in ("torch_dtype", "quantization_config", "tie_word_embeddings"):
        if key not in text and key in config:
            text[key] = config[key]
    return text


def _int(text: dict[str, Any], key: str, name: str) -> int:
    value = text.get(key)
    if not isinstance(value, int) or value <= 0:
        raise ModelConfigError(f"{name}: config.json has no usable {key} ({value!r})",
                               hint="give the profile a model_shape: from the simulator's table instead")
    return value


def window_of(text: dict[str, Any]) -> int | None:
    """vLLM's derived max_model_len for this config, or None where no length key is present."""
    lengths = [text[k] for k in _LENGTH_KEYS if isinstance(text.get(k), int | float) and text[k] > 0]
    if not lengths:
        return None
    derived = float(min(lengths))
    rope = text.get("rope_scaling")
    if isinstance(rope, dict) and not str(text.get("model_type", "")).startswith("gemma3"):
        kind = rope.get("rope_type", rope.get("type"))
        if kind not in ("su", "longrope", "llama3"):
            factor = rope.get("factor") or 1.0
            if kind == "yarn" and rope.get("original_max_position_embeddings"):
                derived = float(rope["original_max_position_embeddings"])
            derived *= float(factor)
    return int(derived)


def _layer_kinds(text: dict[str, Any], layers: int, name: str) -> list[str]:
    """Each layer's attention: "full" or "sliding" (from layer_types, or Gemma 3's pattern, or a config-wide
    sliding window). A layer of another kind (linear attention, a state-space layer) is an error: its state is
    not paged per token, and counting it as attention would be wrong without a word."""
    types = text.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        other = sorted({str(t) for t in types} - {"full_attention", "sliding_attention"})
        if other:
            raise ModelConfigError(f"{name}: config.json has layers of type {', '.join(other)}, which the simulator "
                                   "does not page yet (only full and sliding-window attention)",
                                   hint="give the profile a model_shape: from the simulator's table instead")
        return ["sliding" if t == "sliding_attention" else "full" for t in types]
    pattern = text.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 0 and text.get("sliding_window"):
        return ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(layers)]
    if text.get("sliding_window") and text.get("use_sliding_window", True):   # Qwen's configs say false
        return ["sliding"] * layers
    return ["full"] * layers


def _kv_layer_slots(kinds: list[str]) -> int:
    """How many layers' pages a block costs, as vLLM's hybrid allocator groups them: every kind in groups of the
    smallest kind's count (the largest's where that is under 1.5x the smallest), padded to whole groups."""
    counts = [kinds.count(k) for k in ("full", "sliding") if k in kinds]
    if len(counts) == 1:
        return counts[0]
    group = max(counts) if max(counts) < 1.5 * min(counts) else min(counts)
    return sum(math.ceil(c / group) for c in counts) * group


class _Bytes:
    """Weight bytes per parameter by what the parameter is, from the config's dtype and quantisation."""

    def __init__(self, text: dict[str, Any], name: str) -> None:
        quant = text.get("quantization_config") or {}
        method = str(quant.get("quant_method", "")).lower()
        self.linear = _HALF
        self.experts: float | None = None   # None: as the linear layers
        if not method:
            return
        if method == "fp8":
            self.linear = 1.0
        elif method in ("gptq", "awq"):
            bits = int(quant.get("bits", quant.get("w_bit", 4)))
            group = int(quant.get("group_size", quant.get("q_group_size", 128)))
            self.linear = bits / 8 + (_HALF + bits / 8) / (group if group > 0 else 4096)
        elif method == "mxfp4":
            skipped = " ".join(quant.get("modules_to_not_convert", []))
            self.experts = 4.25 / 8   # 4-bit values and an 8-bit scale per 32
            self.linear = _HALF if "self_attn" in skipped else self.experts
        else:
            raise ModelConfigError(f"{name}: quantization {method!r} in config.json is not one the simulator sizes "
                                   "(it knows fp8, gptq, awq, mxfp4)",
                                   hint="give the profile a model_shape: from the simulator's table instead")


def shape_from_config(name: str, config: dict[str, Any]) -> ModelShape:
    """The shape of the model whose config.json is `config` (see the module's notes for what is counted)."""
    text = _text_config(config)
    hidden = _int(text, "hidden_size", name)
    layers = _int(text, "num_hidden_layers", name)
    heads = _int(text, "num_attention_heads", name)
    vocab = _int(text, "vocab_size", name)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head = int(text.get("head_dim") or hidden // heads)
    weights = _Bytes(text, name)

    # Attention, per layer: its parameters, and its KV bytes per token.
    if text.get("kv_lora_rank"):   # DeepSeek's MLA
        q_lora, kv_lora = int(text.get("q_lora_rank") or 0), int(text["kv_lora_rank"])
        nope, rope, v_head = int(text["qk_nope_head_dim"]), int(text["qk_rope_head_dim"]), int(text["v_head_dim"])
        q = hidden * q_lora + q_lora + q_lora * heads * (nope + rope) if q_lora else hidden * heads * (nope + rope)
        kv = hidden * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v_head)   # down, norm, up
        attention = q + kv + heads * v_head * hidden
        kv_per_layer, kv_shards = (kv_lora + rope) * _HALF, 1
        attention_flops = 2.0 * heads * (nope + rope + v_head)
    else:
        attention = hidden * heads * head + 2 * hidden * kv_heads * head + heads * head * hidden
        if text.get("attention_bias"):
            attention += heads * head + 2 * kv_heads * head + hidden
        kv_per_layer, kv_shards = 2 * kv_heads * head * _HALF, kv_heads
        attention_flops = 4.0 * heads * head

    # The MLP, per layer: dense, or routed experts (+ shared ones and the router).
    experts = int(text.get("num_experts") or text.get("n_routed_experts") or text.get("num_local_experts") or 0)
    per_token = int(text.get("num_experts_per_tok") or text.get("experts_per_token") or 0)
    dense_mlp = 3 * hidden * int(text.get("intermediate_size") or 0)
    moe_layers = 0
    expert_size = shared = 0
    if experts:
        size = int(text.get("moe_intermediate_size") or text.get("intermediate_size") or 0)
        expert_size = 3 * hidden * size + (2 * size + hidden if text.get("model_type") == "gpt_oss" else 0)
        shared = int(text.get("n_shared_experts") or 0) * 3 * hidden * size
        first_dense = int(text.get("first_k_dense_replace") or 0)
        sparse_every = int(text.get("decoder_sparse_step") or 1)
        dense_only = set(text.get("mlp_only_layers") or [])
        moe_layers = sum(1 for i in range(first_dense, layers)
                         if i not in dense_only and (i + 1) % sparse_every == 0)
    dense_layers = layers - moe_layers
    router = hidden * experts + (experts if text.get("model_type") == "gpt_oss" else 0)
    norms = 2 * hidden * layers + hidden

    embed = vocab * hidden
    head_out = 0 if text.get("tie_word_embeddings") else vocab * hidden
    moe_total = moe_layers * (experts * expert_size + shared + router)
    moe_active = moe_layers * (per_token * expert_size + shared + router)
    common = layers * attention + dense_layers * dense_mlp + norms
    total = embed + head_out + common + moe_total
    # What a token reads: one row of the input embedding, the LM head (tied: the same matrix) whole.
    active = (head_out or embed) + common + moe_active
    expert_bytes = weights.experts if weights.experts is not None else weights.linear
    weight_bytes = (_HALF * (embed + head_out + norms) + weights.linear * (layers * attention
                    + dense_layers * dense_mlp + moe_layers * (shared + router))
                    + expert_bytes * moe_layers * experts * expert_size)
    kinds = _layer_kinds(text, layers, name)
    notes = []
    if "vision_config" in config or config.get("text_config"):
        notes.append("the language model only: a vision tower's weights are not counted")
    if "sliding" in kinds:
        notes.append(f"{kinds.count('sliding')} of {layers} layers attend to a {text.get('sliding_window')}-token "
                     "window: counted as vLLM's log counts the cache, not what a long request really holds")
    return ModelShape(
        name=name, params_b=active / 1e9, weight_bytes_per_param=weight_bytes / total,
        kv_bytes_per_token=int(_kv_layer_slots(kinds) * kv_per_layer), window=window_of(text),
        total_params_b=total / 1e9, kv_shards=kv_shards,
        attention_flops_per_token_per_ctx=attention_flops * kinds.count("full"), notes=tuple(notes),
        vocab=vocab, hidden=hidden, layers=layers,
        expert_params_b=moe_layers * experts * expert_size / 1e9 if moe_layers and experts else None,
        expert_share=per_token / experts if moe_layers and experts and per_token else None,
        mlp_width=per_token * int(text.get("moe_intermediate_size") or text.get("intermediate_size") or 0)
        if experts else int(text.get("intermediate_size") or 0))


@cache
def shipped_configs() -> dict[str, dict[str, Any]]:
    """The shipped copies of common open models' config.json, by Hugging Face id in lower case (each entry
    keeps its `source` and `licence`)."""
    entries = json.loads(resources.files("campaign.core").joinpath(_SHIPPED).read_text())
    return {str(e["model"]).lower(): e for e in entries}


def config_of(model: str) -> dict[str, Any] | None:
    """`model`'s config.json: a local folder's (or the file itself), else the shipped copy for a Hugging Face id;
    None where neither has it."""
    path = Path(model).expanduser()
    file = path / "config.json" if path.is_dir() else path if path.name == "config.json" else None
    if file is not None and file.is_file():
        try:
            loaded: dict[str, Any] = json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            raise ModelConfigError(f"{file}: not a readable config.json ({exc})") from None
        return loaded
    return shipped_configs().get(model.lower())


def model_shape(name: str) -> ModelShape | None:
    """A shape by name: a row of the hand table, else from the config of the model `name` names (a local folder
    or a shipped Hugging Face id); None where neither knows it."""
    shape = MODELS.get(name.lower())
    if shape is not None:
        return shape
    config = config_of(name)
    return None if config is None else shape_from_config(name, config)


def require_shape(name: str) -> ModelShape:
    """model_shape, or the one-line error that says how to give one."""
    shape = model_shape(name)
    if shape is None:
        known = ", ".join(sorted(e["model"] for e in shipped_configs().values()))
        raise ModelConfigError(
            f"the simulator knows no shape for model {name!r}: not a row of its table, not a folder with a "
            "config.json, not a model whose config it ships",
            hint=f"point model: at a local folder holding the model's config.json, or give model_shape: (one of "
                 f"{', '.join(sorted(MODELS))}); configs shipped for: {known}")
    return shape
