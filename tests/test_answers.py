"""The study's arithmetic, with the seed's own numbers as cases."""

from __future__ import annotations

import pytest

from campaign.core import hardware
from campaign.measure import answers
from campaign.measure.answers import LadderStep

# Seed 000: 256-token replies, fresh prompts, 2x RTX A5000 TP=2.
SEED_000 = [LadderStep(1, 59, 59.4), LadderStep(2, 105, 52.3), LadderStep(4, 188, 47.1), LadderStep(8, 312, 39.0),
            LadderStep(16, 466, 29.2), LadderStep(32, 589, 18.4), LadderStep(64, 641, 10.0)]


@pytest.mark.parametrize("floor, agents", [(40, 8), (30, 16), (20, 32), (60, 1), (100, None)])
def test_capacity_at_a_speed_floor(floor: float, agents: int | None) -> None:
    assert answers.capacity_at_floor(SEED_000, floor) == agents


def test_naive_capacity_overstates() -> None:
    assert answers.naive_capacity(SEED_000, 40) == 16  # 641 / 40, twice the honest 8


def test_the_knee_is_seed_000s_32_to_64_row() -> None:
    knee = answers.knee(SEED_000)
    assert knee is not None and (knee.concurrency, knee.next_concurrency) == (32, 64)
    assert knee.aggregate_gain_pct == pytest.approx(8.8, abs=0.1)     # "buys 9% more total throughput"
    assert knee.per_request_loss_pct == pytest.approx(45.7, abs=0.1)  # "costs 46% of every request's speed"
    assert answers.knee(SEED_000[:5]) is None


@pytest.mark.parametrize("kv, context, agents", [
    (567_464, 4_000, 141), (567_464, 8_000, 70), (567_464, 16_000, 35), (567_464, 32_000, 17),
    (567_464, 131_072, 4), (493_447, 8_000, 61),    # seed 000's table, and the 61 before tuning
    (1_000, 100, 7), (None, 8_000, None),
])
def test_agents_that_fit_count_whole_blocks(kv: int | None, context: int, agents: int | None) -> None:
    assert answers.agents_that_fit(kv, context, 800 if context > 1000 else 128) == agents


def test_block_granularity_matters() -> None:
    # 1,000 tokens of KV, 100-token agents: 10 with 16-token blocks (112 each -> 8), 7 with 128-token blocks.
    assert answers.agents_that_fit(1_000, 100, 1) == 10
    assert answers.agents_that_fit(1_000, 100, 16) == 8


@pytest.mark.parametrize("values, bimodal", [
    ([86, 183, 86, 183], True),            # seed 000's four-wide runs
    ([183, 86, 85, 184, 86], True),
    ([100, 102, 98, 101], False),
    ([86, 183], False),                    # too few runs to say
    ([50, 80, 120, 183], False),           # spread out, not two tight modes
])
def test_bimodality(values: list[float], bimodal: bool) -> None:
    modes = answers.bimodality(values)
    assert modes.bimodal is bimodal
    if bimodal:
        assert modes.low == pytest.approx(85.7, abs=0.5) and modes.high == pytest.approx(183.3, abs=0.5)
        assert modes.ratio is not None and modes.ratio > 2


def test_roofline_pools_tensor_parallel_bandwidth() -> None:
    one = answers.roofline("a5000", "qwen-27b-hybrid")
    two = answers.roofline("a5000x2", "qwen-27b-hybrid")
    assert one is not None and two is not None
    assert two.gpus == 2 and two.decode_tok_s_bound == pytest.approx(2 * one.decode_tok_s_bound)
    # 4-bit 27B: 15.1 GB per token over 2 x 768 GB/s -> about 101 tok/s; the seed measured 60 (59%).
    assert two.decode_tok_s_bound == pytest.approx(101.5, rel=0.01)
    assert two.prefill_tok_s_bound == pytest.approx(2 * 111.1e12 / (2 * 26.9e9), rel=1e-6)


def test_roofline_unknown_hardware_or_model_is_none() -> None:
    assert answers.roofline("tpu-v9", "qwen-27b-hybrid") is None
    assert answers.roofline("h200", "some-model") is None
    assert hardware.resolve_hardware("h200-nvl") == (hardware.HARDWARE["h200-nvl"], 1)


def test_hardware_table_uses_dense_figures() -> None:
    assert hardware.HARDWARE["h100-sxm"].bf16_tflops == 989.5   # not the 1,979 sparse datasheet figure
    assert hardware.HARDWARE["rtx-a5000"].fp8_tflops is None
    assert hardware.HARDWARE["h200-nvl"].bandwidth_gb_s == 4800


def test_short_answers_from_stored_cells() -> None:
    from campaign.measure.cells import CellResult, CellSpec

    cells = []
    for step in SEED_000:
        spec = CellSpec(phase="decode", context_tokens=1024, concurrency=step.concurrency, mode="fixed", max_tokens=256)
        cells.append(CellResult(spec=spec, phase="decode", context_tokens=1024, concurrency=step.concurrency,
                                label=spec.label, status="Valid", total_tok_s=step.total_tok_s,
                                per_request_tok_s=step.per_request_tok_s, ttft_ms=75.0))
    prefill = CellSpec(phase="prefill", context_tokens=6616)
    cells.append(CellResult(spec=prefill, phase="prefill", context_tokens=6616, concurrency=1, label="single-stream",
                            status="Valid", prompt_tok_s=1002.0))
    result = answers.short_answers(cells=cells, facts={"kv_cache_tokens": 567_464, "block_size": 800,
                                                       "max_model_len": 131_072}, flags={"max-num-seqs": 256})
    assert result["single_stream_tok_s"] == 59.4 and result["single_stream_ttft_ms"] == 75.0
    assert (result["aggregate_peak_tok_s"], result["aggregate_peak_concurrency"]) == (641, 64)
    assert result["prompt_tok_s"] == 1002.0
    assert result["context_window"] == 131_072 and result["max_num_seqs"] == 256
    assert result["useful_concurrency"] == 8
    assert result["capacity_at_floor"] == {"40": 8, "30": 16, "20": 32}
    assert "peak / floor = 16 overstates capacity" in str(result["naive_capacity_warning"])
    assert result["agents_that_fit"] == {"4000": 141, "8000": 70, "16000": 35, "32000": 17, "131072": 4}
    assert result["knee"]["concurrency"] == 32


def test_a_time_scaled_simulations_answers_are_its_cells_hardware_figures() -> None:
    """Cells store the hardware's figures at any time scale (format 10; the store converts older ones): the
    answers take them as they are, and the scale is only a label (dividing again read 20x too slow)."""
    from campaign.measure.cells import CellResult, CellSpec

    cells = []
    for step in SEED_000:
        spec = CellSpec(phase="decode", context_tokens=128, concurrency=step.concurrency, mode="fixed")
        cells.append(CellResult(spec=spec, phase="decode", context_tokens=128, concurrency=step.concurrency,
                                label=spec.label, status="Valid", total_tok_s=step.total_tok_s,
                                per_request_tok_s=step.per_request_tok_s, ttft_ms=75.0, time_scale=20.0))
    result = answers.short_answers(cells=cells, facts={}, flags={}, time_scale=20.0)
    assert result["single_stream_tok_s"] == pytest.approx(59.4) and result["single_stream_ttft_ms"] == 75.0
    assert result["useful_concurrency"] == 8  # floors compare with the simulated hardware's speeds
    from campaign.report import text as report

    assert "simulated at a 20x time scale" in report.short_answers_text("sim", result)


def test_no_agent_count_at_a_context_beyond_the_window() -> None:
    # The CPU demo's server has a 2,048-token window: "agents at 8K context" has no answer there.
    assert answers.agents_that_fit(1_000_000, 8000, 16, max_model_len=2048) is None
    assert answers.agents_that_fit(1_000_000, 2048, 16, max_model_len=2048) == 488
    result = answers.short_answers(cells=[], facts={"kv_cache_tokens": 1_000_000, "block_size": 16,
                                                    "max_model_len": 2048}, flags={})
    assert result["agents_that_fit"]["8000"] is None and result["agents_that_fit"]["2048"] == 488
    assert result["agents_beyond_window"] == [4000, 8000, 16000, 32000]
    from campaign.report import text as report

    notes = "\n".join(report.short_answers_notes(result))
    assert "8,000 tokens -> beyond the window" in notes and "2,048 tokens -> 488" in notes
