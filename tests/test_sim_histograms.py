"""The simulator's vLLM request histograms (/metrics): the families vLLM 0.32's CPU build exports, and every
observation checked against the simulator's truth records by vLLM's definitions (vllm/v1/metrics/stats.py).

The real families are read from tests/fixtures/cpu_v0.32_metrics.txt, a scrape of the real vLLM 0.32 CPU build
serving the tiny model (max_model_len 2048). The truth runs are on a virtual clock: deterministic, no wall time.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from campaign.bench import crosscheck
from campaign.server import argv
from campaign.server import metrics as m
from campaign.server.profiles import load_profile
from campaign.sim import config as sim_config
from campaign.sim import truth as sim_truth
from campaign.sim.engine import Tee, Virtual, engine_for
from campaign.sim.histograms import RequestHistograms, request_tokens_buckets
from campaign.sim.truth import RequestTruth

REAL = Path(__file__).parent / "fixtures" / "cpu_v0.32_metrics.txt"
# vLLM 0.32 observes these only for parallel sampling (n > 1), which the simulator does not serve.
NOT_SERVED = {"vllm:request_params_n", "vllm:request_max_num_generation_tokens"}


def families(text: str) -> dict[str, Metric]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def histograms_of(text: str) -> dict[str, Metric]:
    return {n: f for n, f in families(text).items() if f.type == "histogram" and n.startswith("vllm:")}


def test_the_histograms_are_vllm_032s_names_help_labels_and_buckets() -> None:
    real = histograms_of(REAL.read_text())
    registry = CollectorRegistry(auto_describe=False)
    RequestHistograms(registry, model_name="tiny", max_model_len=2048)
    ours = histograms_of(generate_latest(registry).decode())
    assert set(real) - set(ours) == NOT_SERVED
    assert set(ours) <= set(real)
    for name, family in ours.items():
        mine, theirs = family.samples, real[name].samples
        assert family.documentation == real[name].documentation, name
        assert [(s.name, s.labels) for s in mine] == [(s.name, s.labels) for s in theirs], name
    assert request_tokens_buckets(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    assert request_tokens_buckets(131072)[-1] == 100_000


# --- against the truth --------------------------------------------------------------------------------------
_ids = itertools.count(10_000)
KV_BYTES = "100M"   # per card: 5,600 tokens of the 27B hybrid's KV, so long requests preempt


def unique(n: int) -> list[int]:
    return [next(_ids) % 150_000 + 1000 for _ in range(n)]


@dataclass
class Run:
    """The engine on a virtual clock, its truth recorded and its histograms kept as the server keeps them."""

    sim: Virtual
    recorder: sim_truth.Recorder
    histograms: RequestHistograms

    def scrape(self) -> dict[str, Metric]:
        return families(self.scrape_text())

    def scrape_text(self) -> str:
        """As the server's /metrics reads them: the kept text, which must be the library's own, byte for byte,
        at every scrape (a family that observed since the last one generated again)."""
        text = self.histograms.exposition()
        assert text == generate_latest(self.histograms.registry)
        return text.decode()


def virtual(profile: str, *flags: str) -> Run:
    built = argv.build(load_profile(profile)[0], engine="sim", port=8000).argv
    config = sim_config.parse([*built[built.index("campaign.sim") + 1:], *flags])
    recorder = sim_truth.Recorder()
    histograms = RequestHistograms(CollectorRegistry(auto_describe=False), model_name=config.name,
                                   max_model_len=config.max_model_len)
    return Run(Virtual(engine_for(config, Tee(recorder, histograms))), recorder, histograms)


def expected(values: list[float], bounds: list[float]) -> tuple[list[float], float]:
    """Cumulative bucket counts (le bounds, then +Inf) and the sum, as a Prometheus histogram keeps them."""
    counts = [0.0] * (len(bounds) + 1)
    for v in values:
        counts[bisect.bisect_left(bounds, v)] += 1
    return list(itertools.accumulate(counts)), sum(values)


def check(family: Metric, values: list[float]) -> None:
    buckets = [s for s in family.samples if s.name.endswith("_bucket")]
    bounds = [float(s.labels["le"]) for s in buckets[:-1]]
    counts, total = expected(values, bounds)
    assert [s.value for s in buckets] == counts, family.name
    (count,) = [s.value for s in family.samples if s.name.endswith("_count")]
    (observed_sum,) = [s.value for s in family.samples if s.name.endswith("_sum")]
    assert count == len(values), family.name
    assert observed_sum == pytest.approx(total, rel=1e-9, abs=1e-12), family.name


def check_all(found: dict[str, Metric], requests: list[RequestTruth], steps: list[sim_truth.StepTruth]) -> None:
    """Every histogram against the truth, each by vLLM 0.32's definition."""
    emitted = [r for r in requests if r.emits]
    check(found["vllm:time_to_first_token_seconds"], [r.emits[0][0] - r.arrival for r in emitted])
    # One gap per engine output after the first, however many tokens it carried.
    check(found["vllm:inter_token_latency_seconds"],
          [b[0] - a[0] for r in emitted for a, b in itertools.pairwise(r.emits)])
    done = [r for r in requests if r.finish is not None and r.reason != "abort"]
    assert all(r.admitted is not None and r.emits for r in done)

    def each(f: Callable[[RequestTruth], float]) -> list[float]:
        return [f(r) for r in done]

    check(found["vllm:e2e_request_latency_seconds"], each(lambda r: (r.finish or 0) - r.arrival))
    check(found["vllm:request_queue_time_seconds"], each(lambda r: (r.admitted or 0) - r.arrival))
    check(found["vllm:request_prefill_time_seconds"], each(lambda r: r.emits[0][0] - (r.admitted or 0)))
    check(found["vllm:request_decode_time_seconds"], each(lambda r: r.emits[-1][0] - r.emits[0][0]))
    check(found["vllm:request_inference_time_seconds"], each(lambda r: r.emits[-1][0] - (r.admitted or 0)))
    check(found["vllm:request_time_per_output_token_seconds"],
          each(lambda r: (r.emits[-1][0] - r.emits[0][0]) / (r.tokens - 1) if r.tokens > 1 else 0.0))
    check(found["vllm:request_prompt_tokens"], each(lambda r: r.prompt_tokens))
    check(found["vllm:request_generation_tokens"], each(lambda r: r.tokens))
    check(found["vllm:request_params_max_tokens"], each(lambda r: r.max_tokens))
    check(found["vllm:request_num_preemptions"], each(lambda r: r.preemptions))
    check(found["vllm:request_prefill_kv_computed_tokens"], each(lambda r: r.prompt_tokens - (r.cached or 0)))
    # Per step: the prompts whose first token it produced (whole, less what the cache held) and its tokens.
    firsts: dict[float, int] = {}
    tokens_at: dict[float, int] = {}
    for r in emitted:
        firsts[r.emits[0][0]] = firsts.get(r.emits[0][0], 0) + r.prompt_tokens - (r.cached or 0)
        for t, n in r.emits:
            tokens_at[t] = tokens_at.get(t, 0) + n
    check(found["vllm:iteration_tokens_total"], [firsts.get(s.end, 0) + tokens_at[s.end] for s in steps
                                                 if tokens_at.get(s.end)])   # steps with output only


def test_every_observation_is_the_truths_by_vllms_definition_with_multi_token_steps_and_aborts() -> None:
    """The H200 with MTP: steps emit 1-3 tokens, so the ITL count is the emissions', not the tokens'. One request
    is aborted mid-reply: its TTFT and gaps are observed as they happened, and it is in no finished histogram."""
    run = virtual("h200")
    sim = run.sim
    reqs = [sim.submit(unique(600 + 300 * i), 40 + 7 * i) for i in range(6)]
    while reqs[2].generated < 5:
        sim.run(until=sim.now + 0.01)
    sim.engine.abort(reqs[2])
    sim.run()
    found = run.scrape()
    requests = run.recorder.requests
    assert [r.reason for r in requests].count("abort") == 1
    assert sum(len(r.emits) - 1 for r in requests) < sum(r.tokens - 1 for r in requests)  # multi-token steps
    check_all(found, requests, run.recorder.steps)
    (finished,) = [s.value for s in found["vllm:e2e_request_latency_seconds"].samples if s.name.endswith("_count")]
    assert finished == 5


def test_preempted_requests_count_their_prompt_once_as_vllm_does() -> None:
    """A KV cache of 5,600 tokens and eight requests growing to 2,000: some are preempted and recompute. vLLM
    counts a prompt once, at its first token, in vllm:prompt_tokens and in the per-step histogram; the prefix
    cache counters stop at a request's first preemption. Each request's preemptions are in the histogram."""
    run = virtual("a5000-tp2", "--max-model-len", "4096", "--kv-cache-memory-bytes", KV_BYTES)
    for _ in range(8):
        run.sim.submit(unique(500), 1500)
    run.sim.run()
    found = run.scrape()
    requests = run.recorder.requests
    assert sum(r.preemptions for r in requests) > 0
    check_all(found, requests, run.recorder.steps)
    counters = run.sim.engine.counters
    assert counters["prompt"] == sum(r.prompt_tokens for r in requests)
    assert counters["preemptions"] == sum(r.preemptions for r in requests)
    assert counters["queries"] == sum(r.queried for r in requests) == 8 * 500


def test_prefix_cache_hits_are_not_computed_prefill() -> None:
    """Prompts that share a long prefix: what the cache held at first scheduling is out of the computed
    prefill (request_prefill_kv_computed_tokens) and out of the step's token count."""
    run = virtual("a5000-tp2", "--enable-prefix-caching")
    shared = unique(4000)   # five of its 800-token blocks
    run.sim.submit(shared + unique(100), 16)
    run.sim.run()
    for _ in range(3):
        run.sim.submit(shared + unique(100), 16)
    run.sim.run()
    found = run.scrape()
    requests = run.recorder.requests
    assert [r.cached for r in requests][1:] == [4000] * 3
    check_all(found, requests, run.recorder.steps)


def test_the_tools_reader_reads_the_histograms_samples() -> None:
    """The tool's own reader (campaign.server.metrics) keeps a histogram's count and sum like any sample."""
    run = virtual("h200")
    run.sim.submit(unique(300), 20)
    run.sim.run()
    run.histograms.fold()
    snapshot = m.parse(generate_latest(run.histograms.registry).decode())
    assert snapshot.value("vllm:time_to_first_token_seconds_count") == 1
    assert snapshot.value("vllm:e2e_request_latency_seconds_count") == 1


def test_crosschecks_server_view_is_the_truths_means_over_a_clients_run() -> None:
    """`make crosscheck` reads the histograms' delta over one client's run: its mean TTFT and mean ITL are the
    truth's of that run's requests (the requests before it are out of the delta)."""
    run = virtual("h200")
    run.sim.submit(unique(900), 30)
    run.sim.run()
    before = m.parse(run.scrape_text())
    for i in range(4):
        run.sim.submit(unique(300 + 100 * i), 25)
    run.sim.run()
    delta = m.Delta(before, m.parse(run.scrape_text()))
    mine = run.recorder.requests[1:]
    ttft = sum((r.ttft or 0) for r in mine) / 4 * 1000
    gaps = [(b[0] - a[0]) * 1000 for r in mine for a, b in itertools.pairwise(r.emits)]
    itl = sum(gaps) / len(gaps)
    line = crosscheck.server_view("client", delta, mine)
    assert line == (f"client: the server's /metrics over its run: 4 requests finished, mean TTFT {ttft:,.2f} ms "
                    f"(truth {ttft:,.2f}), mean ITL {itl:,.2f} ms (truth {itl:,.2f})")


def test_a_step_of_prompt_chunks_alone_is_no_iteration() -> None:
    """By hand (review): one 7,000-token prompt and a 4-token reply on the A5000 pair (2,048-token chunks). vLLM
    records an iteration only for a step with output: the step of the prompt's last chunk and first token
    (7,000 + 1), then three decode steps (1 each); the three steps of earlier chunks are not observed."""
    run = virtual("a5000-tp2", "--no-enable-prefix-caching")
    run.sim.submit(unique(7000), 4)
    run.sim.run()
    family = run.scrape()["vllm:iteration_tokens_total"]
    values = {s.name.rsplit("_", 1)[-1]: s.value for s in family.samples if not s.name.endswith("_bucket")}
    assert len(run.recorder.steps) == 7
    assert (values["count"], values["sum"]) == (4, 7000 + 4)
