"""Every figure the tool publishes, against what the simulated server really did (its truth records): the
whole check as `make truth` runs it, the simulator at 20x (it keeps up, or says it did not), and the truth's
own arithmetic and tolerances on constructed records."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import pytest

from campaign.bench import truth
from campaign.measure.cells import CellSpec
from campaign.measure.runner import Measurer
from campaign.night.launcher import launched
from campaign.server.profiles import load_profile
from campaign.sim import config as sim_config
from campaign.sim import engine as sim_engine
from campaign.sim import server as sim
from campaign.sim import truth as sim_truth
from campaign.sim.truth import RequestTruth


def test_every_published_figure_matches_the_simulators_truth(capsys: pytest.CaptureFixture[str]) -> None:
    report = truth.run(truth.DEFAULT_SCALE)
    lines = truth.lines(report)
    with capsys.disabled():
        print("\n" + "\n".join(lines))  # the figures stay in the test log, as `make truth` prints them
    out = [f"{f.where} {f.name}: tool {f.tool} truth {f.truth}" for f in report.figures if not f.ok]
    assert not out, out
    assert re.fullmatch(r"max_error_pct=[\d.]+ max_latency_error_ms=[\d.]+ figures=\d+", lines[-1])
    assert len(report.figures) >= 40
    assert report.latencies_judged
    assert {f.kind for f in report.figures} == {"rate", "count", "latency"}
    # Every kind of figure is there: window rates, per-token latency tails, prompt rates, experiments.
    names = {f"{f.where.split()[1]} {f.name}" for f in report.figures}
    for expected in ("decode-sustained-L2048-C16-N256-W10 itl_p99", "prefill-L8192 prompt_tok_s",
                     "decode-sustained-L1024-C1-N512-W10 spec_acceptance_rate", "overload queued",
                     "prefix-order hit_rate", "long-context generation_tok_s"):
        assert any(name.startswith(expected.split()[0]) and name.endswith(expected.split()[1]) for name in names), \
            expected


def test_at_twenty_times_throughput_holds_or_the_cell_says_the_simulator_fell_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seed 004's 64-wide 8K cell, the one that read 1,731 tok/s at 20x against the seed's 3,104."""
    scale = 20.0
    path = tmp_path / "truth.jsonl"
    monkeypatch.setenv("CAMPAIGN_SIM_TIME_SCALE", f"{scale:g}")
    monkeypatch.setenv("CAMPAIGN_SIM_TRUTH", str(path))
    profile, _ = load_profile("h200")
    spec = CellSpec(phase="decode", context_tokens=8192, concurrency=64, max_tokens=4096, window_s=20.0,
                    warmup_s=1.0)  # the hardware's seconds: 1 s and 0.05 s of wall time at 20x
    with launched(profile, tmp_path / "server.log", engine="sim") as server:
        cell = asyncio.run(Measurer(server.target()).run_cell(spec))
    assert cell.status == "Valid", cell.reasons
    figures, _ = truth.cell_figures(cell, truth.Matched(sim_truth.read(path)))
    rates = {f.name: f for f in figures if f.kind != "latency"}
    for name in ("total_tok_s", "per_request_tok_s", "output_tokens", "completed"):
        assert rates[name].ok, rates[name]
    behind = any("fell behind its clock" in note for note in cell.notes)
    assert cell.total_tok_s is not None
    assert behind or cell.total_tok_s == pytest.approx(3_104.6, rel=0.10)


# --- the truth's arithmetic, on records written by hand ------------------------------------------------------
def request(arrival: float, emits: list[tuple[float, int]], *, finish: float | None = None) -> RequestTruth:
    return RequestTruth(id="x", arrival=arrival, prompt_tokens=100, max_tokens=sum(n for _, n in emits),
                        emits=emits, finish=finish if finish is not None else emits[-1][0], reason="length")


def test_window_counts_what_was_emitted_inside_it() -> None:
    a = request(0.0, [(1.0, 1), (2.0, 3), (3.0, 1), (4.0, 1)])
    b = request(0.5, [(2.5, 1), (3.5, 2)], finish=3.5)
    figures = sim_truth.window_figures([a, b], 2.0, 3.5)
    assert figures["output_tokens"] == 3 + 1 + 1 + 2
    assert figures["avg_active"] == pytest.approx((1.5 + 1.5) / 1.5)        # both held all through the window
    assert figures["avg_before_first_token"] == pytest.approx(0.5 / 1.5)    # b waited from 2.0 to 2.5
    assert figures["total_tok_s"] == pytest.approx(7 / 1.5)
    # a: tokens after its first in-window emission over the span, (1) / (3.0 - 2.0); b: 2 / 1.0.
    assert figures["per_request_tok_s"] == pytest.approx(1.5)
    assert figures["completed"] == 1


def test_itl_counts_a_multi_token_emission_as_that_many_gaps() -> None:
    latency = sim_truth.latency_figures([request(0.0, [(1.0, 1), (1.3, 3), (1.4, 1)])], 0.0, 2.0)
    # 0.3 s carrying 3 tokens: three gaps of 0.1 s; then one of 0.1 s.
    assert latency["itl_p50"] == pytest.approx(0.1) and latency["itl_p99"] == pytest.approx(0.1)
    assert latency["ttft_p50"] == pytest.approx(1.0)
    assert latency["tpot_p50"] == pytest.approx(0.4 / 4)


def test_a_finished_requests_truth_is_written_after_its_last_tokens_went_out(tmp_path: Path) -> None:
    """Writing a finished request's truth takes milliseconds; done before the streams wrote that step's tokens,
    it delayed the very tokens it says had left (the A5000 cell's ITL p99 read 1.6 ms long in CI)."""
    config = sim_config.parse(["m", "--hardware", "h200", "--model-shape", "qwen3.5-27b-gptq-int4",
                               "--time-scale", "50"])
    path = tmp_path / "truth.jsonl"
    writer = sim_truth.Writer(path, {"time_scale": 50.0, "anchor": 0.0})
    events: list[str] = []

    def flushed() -> None:
        writer.flush()
        if '"kind":"request"' in path.read_text(encoding="utf-8"):
            events.append("truth written")

    engine = sim_engine.engine_for(config, writer)
    driver = sim.Driver(engine, sim.WallClock(50.0), sim.Log(config), after_send=flushed)

    async def stream() -> None:
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        driver.submit(sim_engine.Request(id="cmpl-1", prompt=[1] * 64, max_tokens=3, sink=queue.put_nowait), 0.0)
        running = asyncio.create_task(driver.run())
        while (produced := await queue.get()) is not None:
            events.append(f"sent {produced}")  # where the server writes the chunk
        events.append("ended")
        await asyncio.sleep(0.05)
        running.cancel()

    asyncio.run(stream())
    assert events[:4] == ["sent 1", "sent 1", "sent 1", "ended"] and "truth written" in events[4:], events
    assert [r.tokens for r in sim_truth.read(path).requests] == [3]


def test_a_time_averaged_wait_may_be_off_by_each_waits_tolerance() -> None:
    # Waits of 0.5 s (inside) and 0.2 s (half inside) over a 10 s window: 2% of each, the 1 ms floor below that.
    waits = [request(1.0, [(1.5, 1)]), request(9.9, [(10.1, 1)]), request(12.0, [(12.1, 1)])]
    assert truth._waiting_slack(waits, 0.0, 10.0) == pytest.approx((0.010 + 0.004) / 10.0)
    assert truth._waiting_slack(waits, 5.0, 5.0) is None


def test_tolerances() -> None:
    assert truth.Figure("c", "total_tok_s", "rate", 100.9, 100.0).ok
    assert not truth.Figure("c", "total_tok_s", "rate", 101.1, 100.0).ok
    assert truth.Figure("c", "ttft", "latency", 0.0109, 0.010).ok          # 0.9 ms: within 1 ms
    assert not truth.Figure("c", "ttft", "latency", 0.0111, 0.010).ok
    assert truth.Figure("c", "e2e", "latency", 2.039, 2.0).ok              # 39 ms of 2 s: within 2%
    assert not truth.Figure("c", "e2e", "latency", 2.041, 2.0).ok
    assert truth.Figure("c", "per_request_tok_s", "rate", None, None).ok   # undefined on both sides agrees
    assert not truth.Figure("c", "per_request_tok_s", "rate", None, 5.0).ok
    assert not truth.Figure("c", "completed", "count", 1.0, 0.0).ok


def test_above_twice_real_time_latencies_are_reported_not_judged() -> None:
    late = truth.Figure("c", "ttft", "latency", 0.020, 0.010)
    rate = truth.Figure("c", "total_tok_s", "rate", 100.0, 100.0)
    fast = truth.Report(figures=[late, rate], delivery_ms=[2.0], time_scale=5.0, behind_s=0.0)
    assert fast.ok and "latencies not judged above time scale 2" in "\n".join(truth.lines(fast))
    assert not truth.Report(figures=[late, rate], delivery_ms=[0.2], time_scale=1.0, behind_s=0.0).ok


def test_simulator_config_faults_and_versions() -> None:
    base = ["m", "--hardware", "h200", "--model-shape", "qwen3.5-27b-gptq-int4"]
    config = sim_config.parse([*base, "--fault", "crash-after:3", "--fault", "foreign:50", "--version-style", "0.9"])
    assert config.faults.crash_after == 3 and config.faults.foreign_tok_s == 50
    # As strings, "0.9" >= "0.32" and "0.9" >= "0.29": the clamp and the log prefixes came with 0.32 and 0.29.
    assert not config.clamps_max_tokens and not config.process_prefixes
    assert sim_config.parse([*base, "--version-style", "0.33.0"]).clamps_max_tokens
    with pytest.raises(SystemExit) as exc:
        sim_config.parse([*base, "--fault", "crash-after"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        sim_config.parse([*base, "--fault", "melt"])


def test_a_truth_file_is_never_overwritten(tmp_path: Path) -> None:
    base = ["m", "--hardware", "a5000x2", "--model-shape", "qwen-27b-hybrid", "--truth"]
    assert sim_config.parse([*base, str(tmp_path)]).truth == tmp_path / f"truth-{os.getpid()}.jsonl"
    (tmp_path / "old.jsonl").write_text("")
    with pytest.raises(SystemExit) as exc:
        sim_config.parse([*base, str(tmp_path / "old.jsonl")])
    assert exc.value.code == 2
