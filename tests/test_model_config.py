"""Issue 52, item 1: a model's shape from its own config.json, so a profile naming a Hugging Face model (or a
local model folder) is simulated without `model_shape:`.

The truths are published figures, each from its model card or release notes (facts, cited; no file of theirs is
kept): parameter counts, total and active, in each publisher's own way of counting; and a KV cache size a real
vLLM printed. The configs themselves are the shipped copies (campaign/core/model_configs.json, each with its
source and licence; collected in docs/research/model-configs.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from campaign.core import model_config
from campaign.core.hardware import MODELS
from campaign.core.model_config import ModelConfigError, require_shape, shape_from_config, shipped_configs
from campaign.plan import replay
from campaign.server import tiny_model
from campaign.sim import config as sim_config

# (model, total parameters in billions, as published; the figure's last digit sets its rounding).
TOTALS = [
    ("meta-llama/Llama-3.1-8B", "8.03"),       # HF model page: 8.03B params
    ("meta-llama/Llama-3.1-70B", "70.6"),      # HF model page: 70.6B params
    ("meta-llama/Llama-3.2-1B", "1.24"),       # Llama 3.2 model card: 1.23B (HF page 1.24B)
    ("meta-llama/Llama-3.2-3B-Instruct", "3.21"),  # HF model page: 3.21B params
    ("Qwen/Qwen3-0.6B", "0.6"),                # Qwen3 model cards: "Number of Parameters"
    ("Qwen/Qwen3-1.7B", "1.7"),
    ("Qwen/Qwen3-4B", "4.0"),
    ("Qwen/Qwen3-8B", "8.2"),
    ("Qwen/Qwen3-14B", "14.8"),
    ("Qwen/Qwen3-32B", "32.8"),
    ("Qwen/Qwen3-30B-A3B", "30.5"),
    ("Qwen/Qwen3-235B-A22B", "235"),
    ("openai/gpt-oss-20b", "20.91"),           # gpt-oss model card, table of parameters
    ("openai/gpt-oss-120b", "116.83"),
    ("deepseek-ai/DeepSeek-V3", "671"),        # DeepSeek-V3 README: 671B, the MTP module's 14B not included
    ("meta-llama/Llama-2-7b-hf", "6.74"),      # HF model page: 6.74B params
    ("codellama/CodeLlama-34b-Instruct-hf", "33.7"),  # HF model page: 33.7B params
]


def _within_rounding(ours: float, published: str) -> bool:
    """The published figure, rounded or cut at its last digit (Qwen's 3.3B activated is 3.35B cut), or within
    0.5% of it."""
    unit = 10.0 ** -(len(published.split(".")[1]) if "." in published else 0)
    value = float(published)
    return value - max(unit / 2, 0.005 * value) <= ours < value + max(unit, 0.005 * value)


@pytest.mark.parametrize("model, published", TOTALS, ids=[m for m, _ in TOTALS])
def test_parameters_from_the_config_are_the_publishers_count(model: str, published: str) -> None:
    shape = require_shape(model)
    assert _within_rounding(shape.held_params_b, published), (shape.held_params_b, published)


def test_active_parameters_as_each_publisher_counts_them() -> None:
    """A token reads its routed experts, the LM head and one row of the input embedding: gpt-oss's card counts
    active parameters so (3.61B and 5.13B). Qwen and DeepSeek count the embedding table in (3.3B, 22B, 37B)."""
    assert _within_rounding(require_shape("openai/gpt-oss-20b").params_b, "3.61")
    assert _within_rounding(require_shape("openai/gpt-oss-120b").params_b, "5.13")
    for model, published in (("Qwen/Qwen3-30B-A3B", "3.3"), ("Qwen/Qwen3-235B-A22B", "22"),
                             ("deepseek-ai/DeepSeek-V3", "37")):
        config = shipped_configs()[model.lower()]
        embedding = config["vocab_size"] * config["hidden_size"] / 1e9
        assert _within_rounding(require_shape(model).params_b + embedding, published), model
    # Dense: every parameter but the input embedding's other rows.
    llama = require_shape("meta-llama/Llama-3.1-8B")
    assert llama.params_b == pytest.approx(8.03 - 128_256 * 4096 / 1e9, abs=0.01)


def test_weight_bytes_follow_the_dtype_and_the_quantisation() -> None:
    """bf16 everywhere; DeepSeek-V3's fp8 linear layers (1 byte, embeddings and head in bf16); gpt-oss's MXFP4
    experts (4.25 bits) beside bf16 attention: 13.8 GB for the 20b, 65 GB for the 120b, the checkpoints' sizes
    as OpenAI states them (fits 16 GB; fits one 80 GB GPU)."""
    assert require_shape("Qwen/Qwen3-8B").weight_bytes_per_param == 2.0
    deepseek = require_shape("deepseek-ai/DeepSeek-V3")
    assert 1.0 < deepseek.weight_bytes_per_param < 1.01
    small, big = require_shape("openai/gpt-oss-20b"), require_shape("openai/gpt-oss-120b")
    assert small.held_params_b * small.weight_bytes_per_param == pytest.approx(13.8, rel=0.02)
    assert big.held_params_b * big.weight_bytes_per_param == pytest.approx(65.0, rel=0.02)
    gptq = {**shipped_configs()["qwen/qwen3-8b"], "quantization_config": {"quant_method": "gptq", "bits": 4,
                                                                          "group_size": 128}}
    shape = shape_from_config("qwen3-8b-gptq", gptq)
    # 4 bits, a 16-bit scale and a 4-bit zero per 128 weights in the linear layers; embeddings and head 16-bit.
    embeddings = 2 * 151_936 * 4096
    linear = shape.held_params_b * 1e9 - embeddings
    assert shape.held_params_b * 1e9 * shape.weight_bytes_per_param == pytest.approx(
        2 * embeddings + (0.5 + 2.5 / 128) * linear, rel=0.001)
    with pytest.raises(ModelConfigError, match="quantization 'bitsandbytes'.*not one the simulator sizes"):
        shape_from_config("x", {**gptq, "quantization_config": {"quant_method": "bitsandbytes"}})


def test_kv_bytes_per_token_as_vllm_pages_them() -> None:
    """vLLM's page: 2 (K and V) x KV heads x head size x 2 bytes per layer; MLA one latent of 512 + 64 per layer
    on every rank; Gemma 3's five sliding layers to one full, grouped and padded as the hybrid allocator does."""
    assert require_shape("meta-llama/Llama-3.1-8B").kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert require_shape("meta-llama/Llama-2-7b-hf").kv_bytes_per_token == 2 * 32 * 32 * 128 * 2
    deepseek = require_shape("deepseek-ai/DeepSeek-V3")
    assert deepseek.kv_bytes_per_token == 61 * (512 + 64) * 2
    assert deepseek.kv_bytes_per_token_per_card(8) == deepseek.kv_bytes_per_token   # the latent is not split
    qwen = require_shape("Qwen/Qwen3-235B-A22B")   # four KV heads: at TP 8 each is on two ranks
    assert qwen.kv_bytes_per_token_per_card(8) == qwen.kv_bytes_per_token_per_card(4) == qwen.kv_bytes_per_token / 4
    gemma = require_shape("google/gemma-3-27b-it")   # 10 full + 52 sliding: groups of 10, 1 + 6 of them
    assert gemma.kv_bytes_per_token == 70 * 2 * 16 * 128 * 2
    assert any("window" in note for note in gemma.notes) and any("vision" in note for note in gemma.notes)
    oss = require_shape("openai/gpt-oss-20b")   # 12 and 12: two groups of 12
    assert oss.kv_bytes_per_token == 24 * 2 * 8 * 64 * 2


def test_a_real_vllm_cache_size_is_what_the_shape_pages() -> None:
    """vLLM issue #21348 (vllm-project/vllm): Qwen3-235B-A22B-FP8 on four H100s at TP 4 logged `Available KV
    cache memory: 8.11 GiB` and `GPU KV cache size: 178,880 tokens`: the shape's bytes per token on a card
    (bf16 KV: the checkpoint's fp8 is its weights') read that memory as the same tokens within 2% (1.1% here;
    the 8.11 is rounded and the cache is whole blocks)."""
    per_card = require_shape("Qwen/Qwen3-235B-A22B").kv_bytes_per_token_per_card(4)
    assert 8.11 * 2**30 / per_card == pytest.approx(178_880, rel=0.02)


@pytest.mark.parametrize("model, window", [
    ("meta-llama/Llama-3.1-8B", 131_072),   # llama3 rope: max_position_embeddings as it is
    ("Qwen/Qwen3-32B", 40_960),
    ("openai/gpt-oss-20b", 131_072),        # YaRN: the original 4,096 x 32
    ("deepseek-ai/DeepSeek-V3", 163_840),   # YaRN: 4,096 x 40
    ("google/gemma-3-4b-it", 131_072),      # Gemma 3's length is already scaled (vLLM skips its factor)
    ("meta-llama/Llama-2-7b-hf", 4_096),
])
def test_the_window_is_what_vllm_derives(model: str, window: int) -> None:
    assert require_shape(model).window == window


def test_a_dynamic_rope_factor_stretches_the_window() -> None:
    config = {**shipped_configs()["qwen/qwen3-8b"], "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    assert model_config.window_of(config) == 81_920


def test_a_local_model_folder_gives_its_shape(tmp_path: Path) -> None:
    """The tiny model the suite serves on the CPU build: its folder's config.json, read as vLLM reads it."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    config = {**shipped_configs()["qwen/qwen3-0.6b"], "num_hidden_layers": 2, "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    (folder / "config.json").write_text(json.dumps(config))
    shape = require_shape(str(folder))
    assert shape.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2 and shape.window == 40_960
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="not a readable config.json"):
        require_shape(str(folder))


def test_an_unknown_model_says_how_to_give_its_shape() -> None:
    with pytest.raises(ModelConfigError) as caught:
        require_shape("someone/unknown-model-7b")
    assert "no shape for model 'someone/unknown-model-7b'" in caught.value.message
    assert caught.value.hint is not None and "config.json" in caught.value.hint and "qwen3-32b" in caught.value.hint
    assert "\n" not in caught.value.message


def test_the_hand_table_still_wins_where_it_names_the_model() -> None:
    assert model_config.model_shape("qwen3-32b") is MODELS["qwen3-32b"]


def test_a_profile_naming_a_hugging_face_model_is_simulated_without_model_shape(tmp_path: Path) -> None:
    """The simulator takes the shape from the model's config: Llama 3.1's window (131,072, not Llama 3's 8,192)
    and its 128 KiB a token; a window the card's memory cannot hold (its whole 131,072 on a 24 GB card) is the
    start-up's refusal, as vLLM's, and `campaign simulate` says so instead of replaying a cell that could never
    be admitted."""
    config = sim_config.parse_checked(["--model", "meta-llama/Llama-3.1-8B", "--hardware", "rtx-4090",
                                       "--max-model-len", "16384"])
    assert config.window == 131_072 and config.max_model_len == 16_384
    assert replay.refused(config) is None
    # The cache's bytes at 128 KiB a token, in whole blocks of 16 (what vLLM prints).
    assert 0 <= config.memory().kv_gib * 2**30 - config.memory().kv_tokens * 131_072 < 16 * 131_072
    wide = sim_config.parse_checked(["--model", "meta-llama/Llama-3.1-8B", "--hardware", "rtx-4090"])
    assert wide.max_model_len == 131_072   # no --max-model-len: the model's own window, as vLLM takes it
    assert replay.refused(wide) is not None and "cannot hold max-model-len 131,072" in (replay.refused(wide) or "")
    with pytest.raises(ValueError, match="unknown model shape 'someone/x'.*give --model-shape"):
        sim_config.parse_checked(["--model", "someone/x", "--hardware", "rtx-4090"])


def test_the_real_cpu_builds_cache_is_what_the_tiny_models_config_pages() -> None:
    """The real vLLM (the CPU build, 0.32) serving the suite's tiny model: given 1 GiB of KV cache it logged
    2,097,152 tokens (tests/fixtures/logs/cpu_v0.32_tiny_real.log); the shape read from the config the model is
    generated from pages exactly that."""
    log = (Path(__file__).parent / "fixtures/logs/cpu_v0.32_tiny_real.log").read_text()
    assert "Explicitly set (1.0/" in log and "CPU KV cache size: 2,097,152 tokens" in log
    shape = shape_from_config("tiny", tiny_model.CONFIG)
    assert shape.kv_bytes_per_token * 2_097_152 == 2**30


def test_a_layer_the_simulator_does_not_page_is_refused_not_counted_as_attention() -> None:
    """Qwen3-Next and Qwen3.5 mix linear-attention layers (a fixed state, not a page per token) with full ones."""
    config = {**shipped_configs()["qwen/qwen3-8b"], "layer_types": ["linear_attention"] * 27 + ["full_attention"] * 9}
    with pytest.raises(ModelConfigError, match="layers of type linear_attention"):
        shape_from_config("hybrid", config)
