"""Recommendations from the family of a variant's tests (issue 19) and from one measurement a side (issue 20),
on constructed runs: no server."""

from __future__ import annotations

import random
import statistics as stats_lib
from pathlib import Path

import pytest
from fakes import builders

from campaign.analysis.recommend import diff_run, recommend
from campaign.analysis.statistics import MetricVerdict, holm, sample_variance, verdict_for
from campaign.analysis.verdicts import CellDiff, VariantDiff, family_wise
from campaign.measure.cells import CellResult, CellSpec, Reason
from campaign.report import text as report
from campaign.report.tables import to_html, to_markdown, to_text
from campaign.stored import store

CONTEXTS = (128, 2048)
CONCURRENCY = (1, 4, 16)


def spec(context: int, concurrency: int) -> CellSpec:
    return CellSpec(phase="decode", context_tokens=context, concurrency=concurrency, max_tokens=128, window_s=4)


def result(s: CellSpec, total: float, status: str = "Valid", codes: tuple[Reason, ...] = (),
           ttft: float | None = None) -> CellResult:
    return CellResult(spec=s, phase=s.phase, context_tokens=s.context_tokens, concurrency=s.concurrency,
                      label=s.label, status=status, reasons=[c.value for c in codes],  # type: ignore[arg-type]
                      reason_codes=list(codes), total_tok_s=None if status != "Valid" else total,
                      per_request_tok_s=None if status != "Valid" else total / s.concurrency,
                      ttft_ms=ttft if status == "Valid" else None)


def build(tmp_path: Path, cells: dict[str, list[list[CellResult]]], kv: dict[str, int],
          flags: dict[str, dict[str, object]]) -> store.RunDir:
    """cells[variant][launch] = the cells that launch measured."""
    run = store.RunDir.create(tmp_path, "t")
    builders.manifest(run, baseline="baseline", variants=[*cells, "huge"])
    for variant, launches in cells.items():
        for repeat, measured in enumerate(launches):
            launch = run.new_launch_dir(variant)
            builders.server(launch, variant=variant, repeat=repeat, flags=flags[variant], facts={
                "kv_cache_tokens": kv[variant], "block_size": 16, "vllm_version": "0.32.0", "device": "GPU",
                "max_model_len": 131072})
            for c in measured:
                run.write_cell(variant, repeat, c, launch=launch.name, telemetry=None)
    return run


def noisy_launches(rng: random.Random, repeats: int, noise: float = 0.04) -> list[list[CellResult]]:
    """One launch's cells per repeat, every figure the same truth times independent noise."""
    return [[result(spec(ctx, conc), 100.0 * conc * (1 + rng.gauss(0, noise)),
                     ttft=50.0 * (1 + rng.gauss(0, noise)))
             for ctx in CONTEXTS for conc in CONCURRENCY] for _ in range(repeats)]


def test_holm_adjusts_step_down_and_keeps_the_input_order() -> None:
    adjusted = holm([0.01, 0.04, 0.03, 0.005])
    # sorted: 0.005*4=0.02, 0.01*3=0.03, 0.03*2=0.06, 0.04*1=0.04 -> monotone 0.06
    assert adjusted == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([]) == []


def test_aa_campaigns_never_come_out_keep_or_revert_however_many_tests(tmp_path: Path) -> None:
    """An A/A gives no better/worse verdict, seed after seed: with 18 tests a variant at 95% each, a
    recommendation hanging on any single one would flip on noise. At 4% noise and three launches a side it
    cannot show every figure within 3% either, so it reads "not settled", never "no difference"."""
    flips = 0
    for seed in range(40):
        rng = random.Random(seed)
        run = build(tmp_path / f"aa-{seed}",
                    {"baseline": noisy_launches(rng, 3), "copy": noisy_launches(rng, 3)},
                    kv={"baseline": 100_000, "copy": 100_000},
                    flags={"baseline": {"gpu-memory-utilization": 0.9}, "copy": {"gpu-memory-utilization": 0.9}})
        diff = diff_run(run)[0]
        assert diff.aa and diff.tests == 18
        assert "A/A" in diff.family_line and f"of {diff.tests} beyond noise after Holm" in diff.family_line
        verdicts = [m.verdict for c in diff.cells for m in c.metrics]
        flips += any(v in {"better", "worse"} for v in verdicts)
        if any(v in {"better", "worse"} for v in verdicts):
            assert diff.outcome == "not settled" and "an A/A cannot differ" in diff.recommendation
        else:
            assert diff.outcome == "not settled" and "neither shown different nor within +-3%" in \
                diff.recommendation, diff.recommendation
    # Holm keeps the family-wise error at 5%: at most a few of 40 A/A runs may show any verdict at all.
    assert flips <= 6


def test_aa_recommendation_says_no_difference_where_it_is_shown_and_reports_the_false_positive_rate(
        tmp_path: Path) -> None:
    """A quiet rig (0.2% between launches, three a side) shows every figure of an A/A within +-3%."""
    rng = random.Random(1)
    run = build(tmp_path, {"baseline": noisy_launches(rng, 3, 0.002), "copy": noisy_launches(rng, 3, 0.002)},
                kv={"baseline": 100_000, "copy": 100_000}, flags={"baseline": {}, "copy": {}})
    diff = diff_run(run)[0]
    assert diff.outcome == "no difference" and not diff.provisional
    assert diff.recommendation == ("no flag change (A/A): no difference: every deciding figure shown within +-3% "
                                   "(18 tests at family-wise 5%)")
    assert all(m.verdict == "no difference" and "shown within +-3%" in m.note for c in diff.cells for m in c.metrics)
    table = report.diff_table(diff)
    for render in (to_text, to_markdown, to_html):
        rendered = render(table)
        assert "18 tests (cells x metrics) at family-wise 5%" in rendered and "within +-3%" in rendered


def test_a_real_change_survives_the_family_correction(tmp_path: Path) -> None:
    rng = random.Random(3)
    faster = [[result(c.spec, (c.total_tok_s or 0) * 1.2, ttft=c.ttft_ms) for c in launch]
              for launch in noisy_launches(rng, 3, noise=0.01)]
    run = build(tmp_path, {"baseline": noisy_launches(rng, 3, noise=0.01), "fast": faster},
                kv={"baseline": 100_000, "fast": 100_000},
                flags={"baseline": {}, "fast": {"max-num-batched-tokens": 8192}})
    diff = diff_run(run)[0]
    better = [m for c in diff.cells for m in c.metrics if m.verdict == "better"]
    assert len(better) >= 10 and all(m.p_holm is not None and m.p_holm < 0.05 for m in better)
    assert diff.outcome == "keep" and diff.recommendation.endswith(": keep")


def test_a_clear_win_survives_a_small_family(tmp_path: Path) -> None:
    base = [[result(spec(128, 1), v)] for v in (100.0, 101.0, 99.0)]
    other = [[result(spec(128, 1), v)] for v in (103.5, 104.5, 102.5)]
    alone = verdict_for([100.0, 101.0, 99.0], [103.5, 104.5, 102.5], 1, "total_tok_s")
    assert alone.verdict == "better" and alone.p_value is not None and 0.005 < alone.p_value < 0.05
    # The same figures among a family of two tests per cell: Holm doubles the smallest p.
    run = build(tmp_path, {"baseline": base, "v": other}, kv={"baseline": 1000, "v": 1000},
                flags={"baseline": {}, "v": {"x": 1}})
    diff = diff_run(run)[0]
    total = next(m for c in diff.cells for m in c.metrics if m.metric == "total_tok_s")
    assert diff.tests == 2 and total.p_holm == pytest.approx(2 * (total.p_value or 0), rel=1e-6)
    assert total.p_holm < 0.05 and total.verdict == "better"  # two tests: Holm doubles it and it still stands


def test_cells_that_could_not_be_judged_leave_it_not_settled_never_revert(tmp_path: Path) -> None:
    """Issue 19: "not valid in ...: revert" for an A/A. A cell not Valid is a reason for not settled."""
    rng = random.Random(11)
    launches = noisy_launches(rng, 3)
    broken = [[result(c.spec, 0.0, "Invalid", (Reason.QUEUED_KV_CACHE,)) if c.spec.concurrency == 16 else c
               for c in launch] for launch in noisy_launches(rng, 3)]
    run = build(tmp_path, {"baseline": launches, "copy": broken}, kv={"baseline": 1000, "copy": 1000},
                flags={"baseline": {}, "copy": {}})
    diff = diff_run(run)[0]
    assert diff.outcome == "not settled" and "revert" not in diff.recommendation
    assert "2 cell(s) not valid" in diff.recommendation and "queued_kv_cache: fewer streams" in diff.recommendation
    assert diff.recommendation.endswith("not settled until those cells are measured")


def one_measurement_run(tmp_path: Path, kv_variant: int, ttft_factor: float, total_factor: float = 1.0,
                        baseline_invalid: bool = False) -> store.RunDir:
    """Issue 20's shape: every variant launched once, the baseline twice (the drift sentinel)."""
    rng = random.Random(5)
    baseline = noisy_launches(rng, 2, noise=0.02)
    if baseline_invalid:
        baseline[1][0] = result(baseline[1][0].spec, 0.0, "Invalid", (Reason.QUEUED,))
    variant = [[result(c.spec, (c.total_tok_s or 0) * total_factor, ttft=(c.ttft_ms or 0) * ttft_factor)
                for c in noisy_launches(rng, 1, noise=0.02)[0]]]
    return build(tmp_path, {"baseline": baseline, "v": variant}, kv={"baseline": 1_300_000, "v": kv_variant},
                 flags={"baseline": {"gpu-memory-utilization": 0.883643}, "v": {"gpu-memory-utilization": 0.94}})


def test_one_measurement_with_a_kv_gain_and_a_ttft_change_keeps_provisionally(tmp_path: Path) -> None:
    diff = diff_run(one_measurement_run(tmp_path, kv_variant=1_418_300, ttft_factor=1.204,
                                        baseline_invalid=True))[0]
    verdicts = {m.verdict for c in diff.cells for m in c.metrics}
    assert verdicts == {"not judged"} and diff.tests == 0
    assert diff.outcome == "keep" and diff.provisional
    assert "KV cache +9.1%" in diff.recommendation and "keep, provisionally (one measurement:" in diff.recommendation
    assert ("run 7 repeats (campaign run --resume RUN --repeats 7, or `repeats: auto`; at this noise 7 a side "
            "settle the typical figure)") in diff.recommendation
    assert "no test: no cell and metric has two or more Valid measurements" in diff.family_line


def test_one_measurement_with_a_kv_loss_reverts_provisionally(tmp_path: Path) -> None:
    diff = diff_run(one_measurement_run(tmp_path, kv_variant=1_200_000, ttft_factor=0.8))[0]
    assert diff.outcome == "revert" and diff.provisional
    assert "revert, provisionally (one measurement:" in diff.recommendation


def test_one_measurement_with_only_throughput_changes_is_not_settled(tmp_path: Path) -> None:
    diff = diff_run(one_measurement_run(tmp_path, kv_variant=1_300_000, ttft_factor=1.0,
                                        total_factor=1.15))[0]
    assert diff.outcome == "not settled" and not diff.provisional
    assert "better" not in diff.recommendation and "not settled (one measurement a side:" in diff.recommendation


def test_over_capacity_is_exact_without_repeats(tmp_path: Path) -> None:
    rng = random.Random(9)
    baseline = noisy_launches(rng, 1)
    variant = [[result(c.spec, 0.0, "Over capacity", (Reason.OVER_CAPACITY,))
                if c.spec.concurrency == 16 and c.spec.context_tokens == 2048 else c
                for c in noisy_launches(rng, 1)[0]]]
    run = build(tmp_path, {"baseline": baseline, "v": variant}, kv={"baseline": 40_000, "v": 40_000},
                flags={"baseline": {}, "v": {"max-num-seqs": 8}})
    diff = diff_run(run)[0]
    assert diff.outcome == "revert" and diff.provisional
    assert "over capacity now in decode-sustained-L2048-C16-N128-W4" in diff.recommendation


def test_holm_turns_a_lone_marginal_win_into_not_settled_and_says_why() -> None:
    """Four tests: one at p=0.02 with a 5% change stands alone at 95%, not across the family (Holm: 0.08)."""
    cells = [CellDiff(key=f"k{i}", phase="decode", context_tokens=128, concurrency=1, label="single-stream",
                      metrics=[MetricVerdict("total_tok_s", 100.0, 105.0 if i == 0 else 100.5, 5.0,
                                             (1.0, 9.0) if i == 0 else (-2.0, 3.0), 3, 3,
                                             "better" if i == 0 else "not settled",
                                             p_value=0.02 if i == 0 else 0.6)])
             for i in range(4)]
    assert family_wise(cells) == 4
    first = cells[0].metrics[0]
    assert first.p_holm == pytest.approx(0.08) and first.verdict == "not settled"
    assert "better on its own (p=0.020), not across the variant's 4 tests (Holm p=0.08)" in first.note
    assert first.beyond_noise_alone  # still counted as a per-test false positive in an A/A
    assert all(c.metrics[0].p_holm == pytest.approx(1.0) for c in cells[1:])


def test_an_aa_with_a_launch_fact_difference_is_not_a_keep(tmp_path: Path) -> None:
    rng = random.Random(1)
    run = build(tmp_path, {"baseline": noisy_launches(rng, 3), "copy": noisy_launches(rng, 3)},
                kv={"baseline": 100_000, "copy": 101_200}, flags={"baseline": {}, "copy": {}})
    diff = diff_run(run)[0]
    assert diff.outcome == "not settled" and "KV cache +1.2%" in diff.recommendation
    assert "an A/A cannot differ" in diff.recommendation


def test_the_same_flags_in_another_run_are_not_an_aa(tmp_path: Path) -> None:
    rng = random.Random(1)
    flags = {"baseline": {"gpu-memory-utilization": 0.9}}
    tonight = build(tmp_path / "a", {"baseline": noisy_launches(rng, 3)}, kv={"baseline": 100_000}, flags=flags)
    last_week = build(tmp_path / "b", {"baseline": noisy_launches(rng, 3)}, kv={"baseline": 100_000}, flags=flags)
    (diff,) = diff_run(tonight, other=last_week)
    assert diff.variant == "baseline@B" and not diff.aa and "A/A" not in diff.family_line


def test_a_kv_loss_with_no_cell_measured_on_both_sides_reverts_only_provisionally(tmp_path: Path) -> None:
    rng = random.Random(2)
    broken = [[result(c.spec, 0.0, "Invalid", (Reason.CLIENT_SATURATED,)) for c in launch]
              for launch in noisy_launches(rng, 3)]
    run = build(tmp_path, {"baseline": noisy_launches(rng, 3), "v": broken}, kv={"baseline": 100_000, "v": 98_000},
                flags={"baseline": {}, "v": {"max-num-batched-tokens": 8192}})
    diff = diff_run(run)[0]
    assert diff.tests == 0 and diff.outcome == "revert" and diff.provisional
    assert "revert, provisionally (no cell measured on both sides:" in diff.recommendation
    assert "6 cell(s) not valid" in diff.recommendation and "client_saturated" in diff.recommendation


def test_a_variant_that_never_started_is_reverted(tmp_path: Path) -> None:
    rng = random.Random(4)
    run = build(tmp_path, {"baseline": noisy_launches(rng, 2)}, kv={"baseline": 100_000}, flags={"baseline": {}})
    launch = run.new_launch_dir("huge")
    builders.failure(launch, variant="huge", kind="out_of_memory", message="CUDA out of memory")
    (diff,) = diff_run(run)
    assert diff.variant == "huge" and diff.outcome == "revert" and not diff.provisional
    assert diff.recommendation.endswith("the server never became ready with these flags: revert")


def test_a_better_latency_tail_in_a_slower_cell_is_no_benefit(tmp_path: Path) -> None:
    """A drafter model (issue 15): its cell runs 20% fewer tokens a second yet a better ITL p99 (tokens come in
    bursts of accepted drafts); with a smaller KV cache that is harm and no benefit, so revert, not a
    trade-off. The same better tail in a cell whose throughput held is a benefit."""
    s = spec(2048, 4)

    def cells(total: float, itl: float) -> list[list[CellResult]]:
        return [[result(s, total * (1 + d)).model_copy(update={"itl_p99_ms": itl * (1 - d), "itl_samples": 5000})]
                for d in (-0.01, 0.0, 0.01)]

    flags: dict[str, dict[str, object]] = {"baseline": {}, "drafter": {"speculative-config": {"model": "d"}}}
    slower = build(tmp_path / "slower", {"baseline": cells(400.0, 30.0), "drafter": cells(320.0, 20.0)},
                   {"baseline": 567_000, "drafter": 122_000}, flags)
    (diff,) = diff_run(slower)
    outcome, _, sentence, headline = recommend(diff, {"kv_cache_tokens": 567_000}, {"kv_cache_tokens": 122_000})
    assert outcome == "revert" and "better" not in sentence and "worse: total_tok_s" in sentence, sentence
    # The headline: what decided it, the largest change first, then the exact launch fact.
    assert headline.startswith("total_tok_s at decode-"), headline
    assert headline.endswith("; KV cache -78.5%, agents at 8K context 70 -> 15"), headline
    held = build(tmp_path / "held", {"baseline": cells(400.0, 30.0), "drafter": cells(400.0, 20.0)},
                 {"baseline": 567_000, "drafter": 567_000}, flags)
    (diff,) = diff_run(held)
    outcome, _, sentence, headline = recommend(diff, {"kv_cache_tokens": 567_000}, {"kv_cache_tokens": 567_000})
    assert outcome == "keep" and "better: itl_p99_ms" in sentence, sentence
    assert headline.startswith("itl_p99_ms at decode-") and headline.endswith("-33.3%"), headline


def test_no_difference_names_the_diagnostic_values_that_moved() -> None:
    """Seen on the demo: a 64-token chunk queued 250% more of the overload burst (a diagnostic value, which
    does not decide), and the sentence read "nothing beyond noise". It now names what moved."""
    def metric(name: str, verdict: str, change: float) -> MetricVerdict:
        return MetricVerdict(metric=name, baseline=1.0, variant=1.0 + change / 100, change_pct=change,
                             ci95_pct=(change - 1, change + 1), n_baseline=2, n_variant=2,
                             verdict=verdict, p_value=0.001 if verdict != "no difference" else 0.5)  # type: ignore[arg-type]

    decode = CellDiff(key="decode-x", phase="decode", context_tokens=512, concurrency=1,
                      label="single-stream", metrics=[metric("total_tok_s", "no difference", 0.5)])
    burst = CellDiff(key="overload-x1.25", phase="experiment", context_tokens=0, concurrency=0,
                     label="experiment", metrics=[metric("queued", "worse", 250.0)])
    diff = VariantDiff(variant="chunk", baseline="base", flag_changes=[("max-num-batched-tokens", 2048, 64)],
                       fact_changes=[], cells=[decode, burst], comparable=True, tests=2)
    facts = {"kv_cache_tokens": 1000}
    outcome, provisional, sentence, headline = recommend(diff, facts, facts)
    assert outcome == "no difference" and not provisional
    assert headline == "every deciding figure shown within +-3% (2 tests)"
    assert sentence.endswith("no difference: every deciding figure shown within +-3% (2 tests at family-wise 5%); "
                             "moved, but describing the server rather than deciding: queued at overload-x1.25 worse")
    quiet = VariantDiff(variant="chunk", baseline="base", flag_changes=diff.flag_changes, fact_changes=[],
                        cells=[decode], comparable=True, tests=1)
    assert recommend(quiet, facts, facts)[2].endswith("every deciding figure shown within +-3% (1 tests at "
                                                      "family-wise 5%)")


def test_the_demos_small_chunk_on_its_stored_run_is_not_settled_with_what_would_settle_it() -> None:
    """Done when (issue 32): the demo's stored run (tests/fixtures/runs/cpu-demo: the real CPU build, two
    launches a side) read small-chunk as "no difference" with its prefill 67.5% slower on [-91%, -44%] at 95%;
    it is not settled, naming the widest interval and the noisy side, and one more launch a side would confirm
    the prefill change; small-cache still reverts on its KV cache."""
    diffs = {d.variant: d for d in diff_run(store.RunDir(Path(__file__).parent / "fixtures" / "runs" / "cpu-demo"))}
    chunk = diffs["small-chunk"]
    assert chunk.outcome == "not settled" and ": no difference" not in chunk.recommendation
    assert "the widest, " in chunk.recommendation and "the variant is the noisy side" in chunk.recommendation
    assert ("prompt_tok_s at prefill-L1536 -67.5%: if the -67.5% is real, 1 more launch(es) a side would confirm "
            "it") in chunk.recommendation
    assert "find its cause" not in chunk.recommendation
    assert diffs["small-cache"].outcome == "revert"
    # Issue 53: the headline is the change nearest to settling and what would settle it, not the widest
    # interval (TTFT at the 4-stream cell, +694% in [-66,155%, +67,543%]); small-cache's is its KV cache.
    assert chunk.headline == ("ttft_ms at prefill-L1536 +210.8% seen, not yet shown: 1 more launch a side would "
                              "confirm it")
    assert diffs["small-cache"].headline == ("KV cache -93.8% (agents at 8K context: none, beyond the 2,048-token "
                                             "window)")


def test_the_sample_variance_is_the_standard_librarys_exact_one_to_rounding() -> None:
    """The verdicts' variance sums floats (fsum, two passes), not Fractions: on launch-like data (a few to 40
    repeats, 5% spread, values near 150) it is the standard library's exact answer to within 1e-14."""
    rng = random.Random(7)
    for _ in range(2000):
        values = [rng.lognormvariate(5.0, 0.05) for _ in range(rng.randint(2, 40))]
        assert sample_variance(values) == pytest.approx(stats_lib.variance(values), rel=1e-14)
    for value in (0.1, 0.7, 1 / 3, 123.456):   # equal values vary by exactly nothing, at any count
        assert all(sample_variance([value] * n) == 0.0 for n in range(2, 12))


def test_a_cell_whose_client_ttft_is_past_the_servers_is_said_in_the_diff() -> None:
    """Issue 53: the caveat `client_ttft_over_server` (a buffering proxy, a busy client host) is judged like any
    Valid cell (the same path on both sides) but said in the variant's sentence, with what to do."""
    decode = CellDiff(key="decode-x", phase="decode", context_tokens=512, concurrency=1, label="single-stream",
                      metrics=[MetricVerdict(metric="total_tok_s", baseline=1.0, variant=1.0, change_pct=0.5,
                                             ci95_pct=(-0.5, 1.5), n_baseline=2, n_variant=2,
                                             verdict="no difference", p_value=0.5)],
                      variant_reasons=[Reason.CLIENT_TTFT_OVER_SERVER])
    diff = VariantDiff(variant="v", baseline="b", flag_changes=[("max-num-seqs", 256, 128)], fact_changes=[],
                       cells=[decode], comparable=True, tests=1)
    facts = {"kv_cache_tokens": 1000}
    outcome, _, sentence, _ = recommend(diff, facts, facts)
    assert outcome == "no difference"
    assert "the client's TTFT past the server's own in decode-x (the TTFT is what a user sees through this path" \
        in sentence, sentence
