"""Pure pieces: cell arithmetic from raw records, the over-capacity rule, /metrics parsing."""

from __future__ import annotations

from pathlib import Path

import pytest

from campaign.core import stats
from campaign.core.errors import MetricMissingError
from campaign.http.client import RequestRecord
from campaign.measure.cells import over_capacity
from campaign.measure.figures import (
    fixed_metrics,
    itl_per_token,
    latency_distributions,
    prefill_metrics,
    tpot_per_request,
    window_metrics,
)
from campaign.measure.prompts import PromptSource
from campaign.server import metrics


def rec(send: float, chunks: list[tuple[float, int]], *, max_tokens: int = 4, prompt: int = 100,
        end: float | None = None) -> RequestRecord:
    return RequestRecord(id="x", prompt_tokens=prompt, max_tokens=max_tokens, send_t=send,
                         chunk_t=[t for t, _ in chunks], chunk_tokens=[n for _, n in chunks],
                         end_t=end if end is not None else (chunks[-1][0] if chunks else send), status=200,
                         usage_completion_tokens=sum(n for _, n in chunks))


def test_chunk_is_not_a_token() -> None:
    # Speculative decoding: three tokens arrive in one chunk.
    r = rec(0.0, [(0.1, 1), (0.2, 3), (0.3, 3)], max_tokens=7)
    assert r.tokens == 7
    assert r.ttft_s == pytest.approx(0.1)
    assert r.decode_tok_s == pytest.approx(6 / 0.2)
    assert not r.short


def test_derived_values_are_none_when_undefined() -> None:
    r = rec(0.0, [], max_tokens=4)
    assert r.ttft_s is None and r.decode_tok_s is None
    assert rec(0.0, [(0.1, 1)]).decode_tok_s is None


def test_window_counts_only_tokens_inside_it() -> None:
    records = [
        rec(0.0, [(0.5, 1), (1.5, 1), (2.5, 1), (3.5, 1)]),   # two tokens inside [1, 3]
        rec(1.2, [(1.4, 1), (2.0, 1), (2.8, 1), (3.2, 1)]),   # three inside
    ]
    values = window_metrics(records, 1.0, 3.0)
    assert values["output_tokens"] == 5
    assert values["total_tok_s"] == pytest.approx(2.5)
    assert values["measured_s"] == pytest.approx(2.0)
    assert values["completed"] == 0
    assert values["avg_active"] == pytest.approx((2.0 + 1.8) / 2.0)
    # The second stream was sent at 1.2 and had its first token at 1.4: 0.2 s without a token in 2 s.
    assert values["avg_before_first_token"] == pytest.approx(0.2 / 2.0)
    assert values["itl_ms"] == pytest.approx(1000 * 0.8)  # gaps 1.0, 0.6, 0.8 -> median 0.8 s


def test_a_request_streaming_across_an_edge_is_timed_from_or_to_that_edge() -> None:
    """Per-request rates by hand: a request already streaming when the window opens is timed from its start
    (all its tokens inside count), one still streaming at its end up to the end; one that starts inside is
    timed from its first token there, whose tokens were made before it and do not count."""
    across = [(0.5, 1), (1.5, 1), (2.5, 2), (3.5, 1)]          # before, inside (1 + 2), after [1, 3]
    assert stats.streaming_rate(across, 1.0, 3.0) == pytest.approx(3 / 2.0)
    starts = [(1.5, 5), (2.0, 1), (2.5, 1), (3.5, 1)]         # first inside at 1.5 (its 5 uncounted), runs on
    assert stats.streaming_rate(starts, 1.0, 3.0) == pytest.approx(2 / 1.5)
    ends = [(0.5, 1), (1.5, 1), (2.0, 1)]                      # streams across the start, ends inside at 2.0
    assert stats.streaming_rate(ends, 1.0, 3.0) == pytest.approx(2 / 1.0)
    assert stats.streaming_rate([(1.5, 3)], 1.0, 3.0) is None  # one chunk, no time between its ends
    assert stats.streaming_rate([(0.5, 1), (3.5, 1)], 1.0, 3.0) is None   # nothing inside
    records = [rec(0.0, across), rec(1.2, starts), rec(0.0, ends)]
    assert window_metrics(records, 1.0, 3.0)["per_request_tok_s"] == pytest.approx(3 / 2.0)   # the median


def test_fixed_metrics_use_the_whole_step() -> None:
    records = [rec(0.0, [(1.0, 1), (2.0, 1), (3.0, 1), (4.0, 1)]), rec(0.0, [(1.0, 1), (2.0, 3)])]
    values = fixed_metrics(records)
    assert values["output_tokens"] == 8
    assert values["total_tok_s"] == pytest.approx(2.0)
    assert values["per_request_tok_s"] == pytest.approx((1.0 + 3.0) / 2)
    assert values["ttft_ms"] == pytest.approx(1000.0)


def test_prefill_rate_is_context_over_ttft() -> None:
    values = prefill_metrics([rec(0.0, [(0.815, 1)], max_tokens=1, prompt=8192)])
    assert values["prompt_tok_s"] == pytest.approx(8192 / 0.815)  # seed 004: 10.1K tok/s at 8K


# Seed 004's H200 (the startup-log fixture h200_v0.26_mtp_logo.log): 1,811 blocks of 784 tokens, 4,096-token replies.
SEED_004_KV, SEED_004_BLOCK = 1_419_824, 784


@pytest.mark.parametrize("context_k, concurrency, expected", [
    (8, 64, False), (8, 128, True),     # the seed ran 8K x 64; 8K x 128 was "Over capacity"
    (32, 32, False), (32, 64, True),
    (64, 16, False), (64, 32, True),
    (128, 8, False), (128, 16, True),
    (251, 4, False), (251, 8, True),
])
def test_over_capacity_rule_reproduces_seed_004(context_k: int, concurrency: int, expected: bool) -> None:
    assert over_capacity(context_tokens=context_k * 1024, output_tokens=4096, concurrency=concurrency,
                         kv_cache_tokens=SEED_004_KV, block_size=SEED_004_BLOCK) is expected


@pytest.mark.parametrize("concurrency, expected", [(4, False), (5, True)])
def test_over_capacity_rule_seed_000(concurrency: int, expected: bool) -> None:
    # Seed 000 after tuning (567,464 tokens): 4 agents at the full 131K window fit, 5 do not.
    assert over_capacity(context_tokens=131072 - 256, output_tokens=256, concurrency=concurrency,
                         kv_cache_tokens=567_464, block_size=800) is expected


def test_over_capacity_respects_block_granularity() -> None:
    # 2 x (100 + 1) tokens = 202 fit in 256 tokens, but at 128-token blocks each sequence takes 128.
    assert not over_capacity(context_tokens=100, output_tokens=1, concurrency=2, kv_cache_tokens=256, block_size=128)
    assert over_capacity(context_tokens=128, output_tokens=1, concurrency=2, kv_cache_tokens=256, block_size=128)
    assert not over_capacity(context_tokens=10**6, output_tokens=1, concurrency=9, kv_cache_tokens=None,
                             block_size=None)


def test_prompts_are_exact_and_unique() -> None:
    source = PromptSource(seed=1)
    prompts = [source.unique(300) for _ in range(500)]
    assert all(len(p) == 300 for p in prompts)
    assert len({tuple(p[:6]) for p in prompts}) == 500
    assert len({p[0] for p in prompts[:100]}) > 1  # the very first token varies too
    other_run = PromptSource()
    assert other_run.unique(300)[:6] not in [p[:6] for p in prompts]


def test_metrics_fixture_sums_and_info_labels(fixtures_dir: Path) -> None:
    snapshot = metrics.parse((fixtures_dir / "cpu_v0.32_metrics.txt").read_text())
    snapshot.require(metrics.MEASUREMENT_METRICS)
    info = snapshot.info(metrics.CACHE_CONFIG_INFO)
    assert info is not None and info["block_size"] == "128" and info["kv_cache_size_tokens"] == "2097152"
    assert not snapshot.has("vllm:generation_tokens_created")


def test_counters_are_summed_over_engines() -> None:
    text = (
        "# TYPE vllm:generation_tokens counter\n"
        'vllm:generation_tokens_total{engine="0",model_name="m"} 10.0\n'
        'vllm:generation_tokens_total{engine="1",model_name="m"} 5.0\n'
    )
    assert metrics.parse(text).value(metrics.GENERATION_TOKENS) == 15.0


def test_missing_family_is_an_error_naming_it_and_the_version() -> None:
    snapshot = metrics.parse("# TYPE python_info gauge\npython_info{version=\"3\"} 1.0\n", server_version="0.33.0")
    with pytest.raises(MetricMissingError) as caught:
        snapshot.require(metrics.MEASUREMENT_METRICS)
    text = str(caught.value)
    assert "vllm:generation_tokens_total" in text and "0.33.0" in text and "--disable-log-stats" in text


def test_speculative_counters_give_acceptance_rate_and_length() -> None:
    def snap(drafts: float, draft_tokens: float, accepted: float) -> metrics.MetricsSnapshot:
        return metrics.parse(
            "# TYPE vllm:spec_decode_num_drafts counter\n"
            f'vllm:spec_decode_num_drafts_total{{engine="0"}} {drafts}\n'
            "# TYPE vllm:spec_decode_num_draft_tokens counter\n"
            f'vllm:spec_decode_num_draft_tokens_total{{engine="0"}} {draft_tokens}\n'
            "# TYPE vllm:spec_decode_num_accepted_tokens counter\n"
            f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {accepted}\n')

    # MTP with 2 speculative tokens: 1,000 drafts of 2 tokens, 1,400 accepted.
    rate, length = metrics.spec_decode(metrics.Delta(snap(500, 1000, 600), snap(1500, 3000, 2000)))
    assert rate == pytest.approx(0.70) and length == pytest.approx(2.4)
    plain = metrics.parse("# TYPE vllm:generation_tokens counter\nvllm:generation_tokens_total 1.0\n")
    assert metrics.spec_decode(metrics.Delta(plain, plain)) == (None, None)


def test_speculative_numbers_are_shown_next_to_throughput() -> None:
    from campaign.measure.cells import CellResult, CellSpec
    from campaign.report import text as report

    spec = CellSpec(phase="decode", context_tokens=8192, concurrency=1)
    cell = CellResult(spec=spec, phase="decode", context_tokens=8192, concurrency=1, label="single-stream",
                      status="Valid", total_tok_s=148.2, spec_acceptance_rate=0.595, spec_mean_acceptance_length=2.19)
    text = report.all_measurements([cell])
    assert "Speculative decoding" in text and "59.5%" in text and "2.19" in text


def test_inter_token_latency_is_per_token_and_never_zero_for_events_sharing_a_read() -> None:
    # Two events arrived in one socket read at 0.10: one gap of 0.10 s spread over their 2 tokens.
    r = rec(0.0, [(0.0, 1), (0.1, 1), (0.1, 1), (0.2, 1)], max_tokens=4)
    assert sorted(itl_per_token([r], 0.0, 1.0)) == pytest.approx([0.05, 0.05, 0.1])
    values = fixed_metrics([r])
    assert values["itl_ms"] == pytest.approx(50.0) and values["itl_samples"] == 3
    assert min(itl_per_token([r], 0.0, 1.0)) > 0


def test_a_chunk_of_k_speculative_tokens_counts_k_gaps() -> None:
    r = rec(0.0, [(0.01, 1), (0.04, 3), (0.07, 3)], max_tokens=7)
    assert itl_per_token([r], 0.0, 1.0) == pytest.approx([0.01] * 6)
    assert tpot_per_request([r]) == pytest.approx([0.06 / 6])


def test_latency_tails_rest_on_their_samples_and_sit_at_or_above_the_median() -> None:
    records = [rec(float(i), [(i + 0.1 + 0.01 * i, 1), (i + 0.2 + 0.01 * i, 1), (i + 0.35, 1)], max_tokens=3,
                   end=i + 0.4 + 0.01 * i) for i in range(20)]
    values = latency_distributions(records, 0.0, 100.0)
    assert values["latency_requests"] == 20 and values["itl_samples"] == 40
    for name in ("ttft", "itl", "tpot", "e2e"):
        median, p90, p99 = values[f"{name}_ms"], values[f"{name}_p90_ms"], values[f"{name}_p99_ms"]
        assert median is not None and median <= p90 <= p99, name
    assert values["ttft_ms"] == pytest.approx(100 + 10 * 9.5)  # ttfts 100..290 ms, median of 20 values
    assert values["e2e_p99_ms"] == pytest.approx(400 + 10 * (18 + 0.81), rel=1e-6)


def test_latency_distributions_are_none_without_samples() -> None:
    values = latency_distributions([rec(0.0, [], max_tokens=4)], 0.0, 1.0)
    assert all(values[f"{n}{s}_ms"] is None for n in ("ttft", "itl", "tpot") for s in ("", "_p90", "_p99"))
    assert values["latency_requests"] == 0 and values["itl_samples"] == 0


def test_loop_lag_sees_a_client_that_blocks_its_own_event_loop() -> None:
    """The probe's truth: a loop blocked for 30 ms runs its due timer at least ~30 ms late (a lower bound,
    whatever else the host does), and the probe stops when told."""
    import asyncio
    import time

    from campaign.measure.runner import loop_lag

    async def scenario() -> list[tuple[float, float]]:
        samples: list[tuple[float, float]] = []
        stop = asyncio.Event()
        probe = asyncio.create_task(loop_lag(samples, stop, interval_s=0.002))
        await asyncio.sleep(0.01)
        time.sleep(0.03)  # noqa: ASYNC251 - the point: the client busy elsewhere, no timer can run
        await asyncio.sleep(0.01)
        stop.set()
        await probe
        return samples

    samples = asyncio.run(scenario())
    assert max(lag for _, lag in samples) >= 0.025
    assert all(lag >= 0 for _, lag in samples) and len(samples) >= 3


def test_a_medians_own_error_matches_theory_and_spans_two_modes() -> None:
    """The order-statistic error of a median: for a normal sample about sqrt(pi/2) sigma / sqrt(n) (the
    asymptotic standard error), for a sample half in each of two modes about the distance between the modes
    over 2 x 1.96 (its interval reaches both), and none below three values."""
    import random

    from campaign.core import stats

    rng = random.Random(7)
    normal = [rng.gauss(100.0, 10.0) for _ in range(10_000)]
    assert stats.median_standard_error(normal) == pytest.approx(1.2533 * 10.0 / 100.0, rel=0.1)
    bimodal = [107.0] * 12 + [208.0] * 12
    assert stats.median_standard_error(bimodal) == pytest.approx((208.0 - 107.0) / (2 * 1.959964))
    assert stats.median_standard_error([208.0 + 0.05 * i for i in range(24)]) < 0.2
    assert stats.median_standard_error([1.0, 2.0]) is None


def test_a_client_ttft_past_the_servers_own_is_a_typed_caveat_past_its_stated_slack() -> None:
    """Issue 53: the client's mean TTFT over a step's requests against the server's own (vLLM's histogram, the
    same requests): within 200 ms of the client's clock (the real CPU build's busy API server put up to 94 ms
    there) or 10% of the server's it is what a client's path adds; past both, the caveat
    `client_ttft_over_server` (a Valid cell, said), naming the gap. A time-scaled simulator's hardware ms are
    the time scale's multiple of the client's."""
    from campaign.measure.cells import CAVEATS, Reason, client_ttft_finding

    assert client_ttft_finding(None, 900.0) is None and client_ttft_finding(800.0, None) is None
    assert client_ttft_finding(800.0, 999.0) is None            # 199 ms: a client's path
    assert client_ttft_finding(3_000.0, 3_290.0) is None        # 290 ms, under 10% of 3 s
    over = client_ttft_finding(800.0, 1_100.0)
    assert over is not None and over.code is Reason.CLIENT_TTFT_OVER_SERVER and over.code in CAVEATS
    assert over.message.startswith("the client's mean TTFT, 1,100 ms, is 300 ms over the server's own 800 ms")
    assert client_ttft_finding(800.0, 1_790.0, time_scale=5.0) is None   # 198 ms of the client's clock at 5x
    assert client_ttft_finding(800.0, 1_900.0, time_scale=5.0) is not None
