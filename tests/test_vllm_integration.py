"""Against the real CPU build of vLLM with the tiny model: one shared server for the whole session, and one
campaign of its own whose server runs the n-gram drafter and whose controller is then SIGKILLed (two tests,
one launch). What the real build adds to the simulator's tests: vLLM's own scheduler, counters, tokenizer,
chat template, process tree and TLS. Cells are as short as what each test proves allows (fixed-count cells
where a window is not the point), and the text corpora are built once for the module."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from campaign.core.errors import MetricMissingError
from campaign.core.hardware import LONG_MODEL_LEN_ENV
from campaign.http.client import new_client, stream_completion
from campaign.measure import corpus, slo, traces
from campaign.measure.cells import CellSpec
from campaign.measure.prompts import PromptSource
from campaign.measure.runner import CLIENT_STALLS, Measurer, Target
from campaign.night.launcher import LaunchedServer, launched
from campaign.server import metrics, startup_log
from campaign.server.argv import port_is_free
from campaign.server.profiles import PROJECT_ROOT, load_profile
from campaign.stored import store

pytestmark = [pytest.mark.vllm, pytest.mark.cpu_heavy]


# The first 300,000 characters of each corpus (about 75,000 tokens): windows for any prompt up to the tiny
# model's 2,048-token window at many offsets.
CORPUS_CHARS = 300_000


@pytest.fixture(autouse=True, scope="module")
def _corpora_built_once() -> Iterator[None]:
    """The `code` and `prose` corpora are pure functions of the standard library, and every prompt source
    builds its own in full (prose: about 3 s of CPU, parsing the standard library, then 1.2 M characters for
    the server to tokenize); here each is built once for the module, its first CORPUS_CHARS characters. The
    same text, cut where the tests' prompts no longer need it; the server's /tokenize still makes the tokens."""
    build = {"code": corpus.code, "prose": corpus.prose}
    texts: dict[str, str] = {}

    def text_of(kind: str) -> str:
        if kind not in texts:
            texts[kind] = build[kind](CORPUS_CHARS)
        return texts[kind]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(corpus, "code", lambda chars=CORPUS_CHARS: text_of("code"))
        patch.setattr(corpus, "prose", lambda chars=CORPUS_CHARS: text_of("prose"))
        yield


class RecordingPrompts(PromptSource):
    """A prompt source that remembers every prompt it handed out."""

    def __init__(self) -> None:
        super().__init__()
        self.handed_out: list[list[int]] = []

    def unique(self, length: int) -> list[int]:
        prompt = super().unique(length)
        self.handed_out.append(prompt)
        return prompt


def test_launch_parses_the_cpu_kv_line_and_reads_block_size_from_metrics(vllm_server: LaunchedServer) -> None:
    """The CPU build's startup log gives the KV cache in tokens but no block size; the launch reads the block
    size from vllm:cache_config_info instead, and what the server became carries no warning."""
    log_facts = startup_log.parse(vllm_server.process.log_path.read_text())
    # "CPU KV cache size: 32,768 tokens, Maximum concurrency for 2,048 tokens per request: 16.00x"
    assert log_facts.device == "CPU"
    assert log_facts.kv_cache_tokens == 32_768
    assert log_facts.max_concurrency_tokens_per_request == 2048
    assert log_facts.block_size is None  # the CPU build never logs it ...
    assert vllm_server.facts.block_size == 128  # ... so the cross-check reads vllm:cache_config_info
    assert vllm_server.facts.vllm_version == "0.32.0"
    assert vllm_server.facts.max_model_len == 2048
    assert vllm_server.warnings == []


def test_decode_matrix_and_prefill_row(target: Target) -> None:
    """A prefill row and a sustained decode row on the real scheduler: every cell Valid, bracketed with no
    foreign traffic and nothing served from the prefix cache, labelled single-stream or aggregate, measured over
    at least its window, and every reply drained to its full length (never cut at the window's end). An
    attempt may be discarded only because this loaded machine stalled the client (a CI run once left the
    two streams busy 1.7 of 2 on average); it is then measured again."""
    measurer = Measurer(target)
    specs = [CellSpec(phase="prefill", context_tokens=256), CellSpec(phase="prefill", context_tokens=1024)]
    specs += [CellSpec(phase="decode", context_tokens=256, concurrency=c, max_tokens=64, window_s=1.0, warmup_s=0.2)
              for c in (1, 2)]

    async def run() -> list[Any]:
        return [await measurer.run_cell(s) for s in specs]

    results = asyncio.run(run())
    for cell in results:
        assert cell.status == "Valid", (cell.spec.key, cell.reasons)
        assert all(a.code in CLIENT_STALLS for a in cell.attempts if not a.accepted), cell.attempts
        assert cell.prefix_cache_hits == 0
        # The server's own view from vLLM's histograms: a first token for each of the step's requests, and a
        # mean TTFT inside the client's (vLLM's clock starts once it has the request and stops before the
        # token is written; the client's spans both ends).
        assert cell.server_first_tokens == len(cell.records), cell.spec.key
        assert cell.server_ttft_mean_ms is not None and cell.client_ttft_mean_ms is not None
        assert 0 < cell.server_ttft_mean_ms <= cell.client_ttft_mean_ms + 1.0, (
            cell.spec.key, cell.server_ttft_mean_ms, cell.client_ttft_mean_ms)
    prefill = results[:2]
    assert [c.label for c in prefill] == ["single-stream", "single-stream"]
    assert all(c.prompt_tok_s is not None and c.prompt_tok_s > 0 for c in prefill)
    assert prefill[1].records[0].usage_prompt_tokens == 1024
    decode = results[2:]
    assert [c.label for c in decode] == ["single-stream", "aggregate"]
    for cell in decode:
        assert cell.total_tok_s is not None and cell.total_tok_s > 0
        assert cell.output_tokens is not None and cell.output_tokens > 0
        assert cell.measured_s is not None and cell.measured_s >= 1.0
        assert all(r.tokens == 64 for r in cell.records)  # drained, never cut: every reply complete


def test_the_mooncake_excerpt_replays_on_the_real_cpu_build(target: Target) -> None:
    """Issue 34 on the real scheduler: 30 s of the shipped Mooncake excerpt (from 120 s: 110 requests), sped up
    three times and its lengths scaled to fit the tiny model's 2,048-token window (a hash id stands for 8 tokens):
    every request served with exactly its prompt and reply, at its trace time; the server's prefix cache
    served no more than the trace's shared blocks imply (in its own KV blocks), and no step was discarded for
    foreign tokens. Before the step vLLM's own POST /reset_prefix_cache (the profile runs it in dev mode) emptied
    the cache, and a canary of two 128-token blocks sent before it found nothing after it."""
    mooncake = PROJECT_ROOT / "matrices" / "traces" / "mooncake-conversation-1k.jsonl"
    sliced, planned = traces.plan(mooncake, start_s=120, duration_s=30, length_scale=0.015, speed=3)
    spec = CellSpec.from_trace(sliced, planned, slo=slo.parse("ttft_p99_ms=60000"))
    cell = asyncio.run(Measurer(target).run_cell(spec))
    assert cell.status == "Valid", cell.reasons
    assert all(a.code in CLIENT_STALLS for a in cell.attempts if not a.accepted), cell.attempts
    assert len(cell.records) == 110 and all(r.ok for r in cell.records)
    state = cell.cache_state
    assert state is not None and state.method == "reset" and state.reset_answer, state
    assert state.checked and state.canary_tokens == 257 and state.canary_cached == 256 and state.canary_hits == 0
    assert sorted((r.usage_prompt_tokens, r.tokens) for r in cell.records) == sorted(
        (p.input_tokens, p.output_tokens) for p in planned)
    assert cell.trace_implied_hits == sum(traces.implied_hits(planned, 8, target.block_size or 1))
    assert cell.prefix_cache_hits is not None and 0 <= cell.prefix_cache_hits <= cell.trace_implied_hits


def test_fixed_count_mode_emits_exactly_n_tokens_per_request(target: Target) -> None:
    """Fixed-count mode: every request emits exactly max_tokens, by the server's usage and its own counter."""
    cell = asyncio.run(Measurer(target).run_cell(
        CellSpec(phase="decode", context_tokens=128, concurrency=3, mode="fixed", max_tokens=48)))
    assert cell.status == "Valid", cell.reasons
    assert cell.output_tokens == 3 * 48
    assert [r.usage_completion_tokens for r in cell.records] == [48, 48, 48]
    assert cell.attempts[0].counted_generation_tokens == 3 * 48


class Intruder:
    """Another client's request inside a step, at a moment the test owns: wraps a Measurer's step so that its
    first step sends one 5-token completion beside the cell's own requests, then returns only once vLLM's
    counters (polled, never a sleep) show the step's tokens and the intruder's. Its tokens are then certainly
    between the bracket's two scrapes, whatever the host's load: the step's opening scrape was taken before the
    step began, its closing one is taken after it returns. (A free-running intruder in a thread, as this test
    had, once left a step clean on a loaded host: its one request in flight was answered only after the step's
    closing scrape, 0.56 s after it was sent, and it sends the next only then.)"""

    PROMPT = [7, 8, 9, 10]
    REPLY_TOKENS = 5
    COUNTED_WITHIN_S = 60.0

    def __init__(self, measurer: Measurer) -> None:
        self.measurer = measurer
        self.step = measurer._run_step
        self.usage: dict[str, int] | None = None   # what vLLM said of the intruder's request
        self.steps = 0

    async def __call__(self, spec: CellSpec, max_tokens: int, client: Any, control: httpx.AsyncClient,
                       source: Any = None) -> Any:
        self.steps += 1
        if self.steps > 1:
            return await self.step(spec, max_tokens, client, control, source)
        opened = await self.measurer.scrape(control)
        step, usage = await asyncio.gather(self.step(spec, max_tokens, client, control, source),
                                           self.request(control))
        self.usage = usage
        generation = sum(r.completion_tokens for r in step.records) + usage["completion_tokens"]
        prompt = sum(r.counted_prompt_tokens for r in step.records) + usage["prompt_tokens"]
        deadline = time.monotonic() + self.COUNTED_WITHIN_S
        while True:
            delta = metrics.Delta(opened, await self.measurer.scrape(control))
            if delta(metrics.GENERATION_TOKENS) >= generation and delta(metrics.PROMPT_TOKENS) >= prompt:
                return step
            assert time.monotonic() < deadline, f"vLLM's counters never showed the step and the intruder: {delta}"
            await asyncio.sleep(0.05)

    async def request(self, control: httpx.AsyncClient) -> dict[str, int]:
        target = self.measurer.target
        response = await control.post("/v1/completions", json={
            "model": target.model, "prompt": self.PROMPT, "max_tokens": self.REPLY_TOKENS,
            "min_tokens": self.REPLY_TOKENS, "ignore_eos": True}, timeout=60)
        assert response.status_code == 200, response.text
        usage: dict[str, int] = response.json()["usage"]
        assert usage["completion_tokens"] == self.REPLY_TOKENS
        return usage


def test_foreign_traffic_is_discarded_counted_and_rerun_with_fresh_prompts(
        target: Target, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another client's request during a step shows in vLLM's own token counters: the step is discarded, its
    excess tokens (exactly the intruder's) counted, and rerun with prompts never sent before, which the prefix
    cache cannot serve. The intruder is sent from inside the first step and counted before it ends (Intruder)."""
    events: list[str] = []
    prompts = RecordingPrompts()
    measurer = Measurer(target, prompts=prompts, on_event=events.append)
    intruder = Intruder(measurer)
    monkeypatch.setattr(measurer, "_run_step", intruder)
    cell = asyncio.run(measurer.run_cell(
        CellSpec(phase="decode", context_tokens=256, concurrency=2, mode="fixed", max_tokens=128)))

    assert cell.status == "Valid", cell.reasons
    assert intruder.usage is not None and intruder.steps == 2
    assert cell.discarded_steps == 1 and len(cell.attempts) == 2 and len(events) == 1, events
    first, rerun = cell.attempts
    assert not first.accepted and "foreign" in (first.reason or "")
    assert first.excess_tokens == cell.discarded_tokens == \
        intruder.usage["prompt_tokens"] + intruder.usage["completion_tokens"]
    assert rerun.accepted and rerun.excess_tokens == 0
    # The rerun used prompts never sent before, and the prefix cache served none of them.
    accepted_prompts = prompts.handed_out[-2:]
    earlier_prompts = prompts.handed_out[:-2]
    assert len(earlier_prompts) >= 2
    assert all(p[:6] != q[:6] for p in accepted_prompts for q in earlier_prompts)
    assert cell.prefix_cache_hits == 0


def test_silently_clamped_reply_is_flagged(target: Target) -> None:
    """vLLM 0.32 cuts a reply that would overflow the window and still answers 200; the tool asks for
    min_tokens = max_tokens, which turns the clamp into a 400 naming the clamped length, and a cell whose
    window was unknown comes out Invalid with the reason."""
    prompt = PromptSource().unique(2000)
    # vLLM 0.32 answers 200 with fewer tokens than asked when prompt + reply exceed the window ...
    with target.endpoint.control(timeout_s=60) as control:
        raw = control.post("/v1/completions", json={
            "model": target.model, "prompt": prompt, "max_tokens": 100, "ignore_eos": True}).json()
    assert raw["usage"]["completion_tokens"] == 48

    async def one() -> None:
        async with new_client(target.endpoint) as client:
            record = await stream_completion(client, model=target.model, prompt=PromptSource().unique(2000),
                                             max_tokens=100, request_id="clamp")
        # ... and with min_tokens = max_tokens the clamp surfaces as a 400 naming the clamped length.
        assert record.status == 400
        assert record.clamped_to == 48

    asyncio.run(one())
    # Where the window is unknown (probing), the cell runs and comes out Invalid with the reason.
    unknown_window = Target(endpoint=target.endpoint, model=target.model, kv_cache_tokens=target.kv_cache_tokens)
    cell = asyncio.run(Measurer(unknown_window).run_cell(
        CellSpec(phase="decode", context_tokens=2000, concurrency=1, mode="fixed", max_tokens=100)))
    assert cell.status == "Invalid"
    assert any("max_tokens 100 clamped to 48" in r for r in cell.reasons), cell.reasons


def test_misspelt_metric_name_is_an_error_not_a_zero(target: Target) -> None:
    """A metric name the real server does not export is an error naming it and the version (and a renamed
    one names its new name), never read as zero."""
    with target.endpoint.control() as control:
        snapshot = metrics.parse(control.get("/metrics").text, server_version="0.32.0")
    assert snapshot.value(metrics.GENERATION_TOKENS) >= 0
    with pytest.raises(MetricMissingError) as caught:
        snapshot.value("vllm:generation_token_total")
    assert "vllm:generation_token_total" in str(caught.value) and "0.32.0" in str(caught.value)
    with pytest.raises(MetricMissingError, match="renamed to vllm:prefix_cache_hits_total"):
        snapshot.require(["vllm:gpu_prefix_cache_hits_total"])


def test_over_capacity_cell_is_skipped_when_the_kv_cache_is_small(target: Target) -> None:
    """A cell whose streams cannot all fit in the server's KV cache (32 x 1,152 tokens > 32,768) is not sent:
    Over capacity, with the cache size in the reason."""
    assert target.kv_cache_tokens == 32_768
    cell = asyncio.run(Measurer(target).run_cell(
        CellSpec(phase="decode", context_tokens=1024, concurrency=32, max_tokens=128, window_s=1.0)))
    assert cell.status == "Over capacity"
    assert cell.requests == [] and cell.total_tok_s is None
    assert "32,768" in cell.reasons[0]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`campaign ARGS` through the command line's own entry point (`run_cli`, what `python -m campaign` runs), in
    this process: the same options, output and errors, without starting an interpreter for each."""
    from campaign.cli import run_cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run_cli(list(args))
    return subprocess.CompletedProcess(["campaign", *args], code, out.getvalue(), err.getvalue())


def ca_bundle(server: LaunchedServer) -> Path:
    assert server.spec.tls is not None and server.spec.tls.ca_bundle is not None
    return server.spec.tls.ca_bundle


def test_real_vllm_over_https_verified_by_both_paths(vllm_server: LaunchedServer, target: Target) -> None:
    """vLLM's own https server, its certificate verified by the measured path and the control plane; `campaign
    probe` without the CA stops at one error line naming the certificate, and with --insecure measures."""
    assert vllm_server.spec.base_url.startswith("https://127.0.0.1:")
    cell = asyncio.run(Measurer(target).run_cell(
        CellSpec(phase="decode", context_tokens=128, concurrency=2, mode="fixed", max_tokens=32)))
    assert cell.status == "Valid", cell.reasons
    stood = cell.stood_on
    assert cell.output_tokens == 64 and stood is not None and stood.counted_generation_tokens == 64
    probe = ["probe", vllm_server.spec.base_url + "/v1", "--contexts", "128", "--max-tokens", "8", "--mode", "fixed",
             "--json"]
    # Without the CA: one clear error line naming the certificate problem, no traceback.
    refused = cli(*probe)
    assert refused.returncode != 0
    assert "Error:" in refused.stderr and "certificate" in refused.stderr.lower(), refused.stderr
    assert "Traceback" not in refused.stderr
    insecure = cli(*probe, "--insecure")
    assert insecure.returncode == 0, insecure.stderr
    assert json.loads(insecure.stdout)["cells"][0]["status"] == "Valid"


def test_probe_cli_json(vllm_server: LaunchedServer) -> None:
    """`campaign probe --json` on the real server (its CA given): a prefill cell and a decode row, every cell
    with the documented fields, Valid, and labelled single-stream or aggregate. Fixed-count decode cells: the
    sustained window's plumbing is test_decode_matrix_and_prefill_row's (and the probe's own, over HTTP, on the
    simulator in test_probe_proxy)."""
    out = cli("probe", vllm_server.spec.base_url, "--ca-bundle", str(ca_bundle(vllm_server)), "--contexts", "256",
              "--concurrency", "1,2", "--mode", "fixed", "--max-tokens", "16", "--prefill", "--json")
    assert out.returncode == 0, out.stderr
    cells = json.loads(out.stdout)["cells"]
    assert [c["phase"] for c in cells] == ["prefill", "decode", "decode"]
    for cell in cells:
        for key in ["phase", "context_tokens", "concurrency", "status", "reasons", "total_tok_s",
                    "per_request_tok_s", "ttft_ms", "itl_ms", "avg_active", "completed", "output_tokens",
                    "measured_s", "discarded_steps", "discarded_tokens", "requests"]:
            assert key in cell, key
        assert cell["status"] == "Valid", cell["reasons"]
    assert cells[1]["label"] == "single-stream" and cells[2]["label"] == "aggregate"


@pytest.fixture()
def a5000(tmp_path: Path) -> Iterator[LaunchedServer]:
    """A simulated A5000 pair (test_sim.py measures on one): the contract's other side."""
    profile, _ = load_profile("a5000-tp2")
    with launched(profile, tmp_path / "server.log", engine="sim") as server:
        yield server


def test_contract_with_the_real_cpu_build(vllm_server: LaunchedServer, a5000: LaunchedServer) -> None:
    """Where both have them, the simulator's metric names and log facts match the real server's. Here, in the
    shared server's file, so that one worker of `make test` starts it."""
    with vllm_server.target().endpoint.control() as control:
        real = metrics.parse(control.get("/metrics").text)
    sim = metrics.parse(httpx.get(f"{a5000.spec.base_url}/metrics").text)
    for name in (*metrics.MEASUREMENT_METRICS, "vllm:kv_cache_usage_perc", "vllm:cache_config_info"):
        assert real.has(name) and sim.has(name), name
    for label in ("block_size", "kv_cache_size_tokens", "num_gpu_blocks", "gpu_memory_utilization"):
        assert label in (real.info(metrics.CACHE_CONFIG_INFO) or {}) and label in (sim.info(metrics.CACHE_CONFIG_INFO)
                                                                                    or {})
    # prometheus_client's `?name[]=` restriction is not served: the instrumentator's /metrics route answers
    # ahead of the library's own app, in full. The simulator answers so too; a sampler reads its few gauges
    # out of the whole text (metrics.parse's `only`).
    asked = {"name[]": ["vllm:num_requests_running"]}
    with vllm_server.target().endpoint.control() as control:
        real_few = metrics.parse(control.get("/metrics", params=asked).text)
    sim_few = metrics.parse(httpx.get(f"{a5000.spec.base_url}/metrics", params=asked).text)
    assert real_few.has(metrics.GENERATION_TOKENS) and sim_few.has(metrics.GENERATION_TOKENS)
    real_facts = startup_log.parse(vllm_server.process.log_path.read_text())
    sim_facts = startup_log.parse(a5000.process.log_path.read_text())
    for key in ("vllm_version", "kv_cache_tokens", "max_concurrency", "max_model_len", "max_num_batched_tokens",
                "engine_init_s", "tensor_parallel_size"):
        assert getattr(real_facts, key) is not None and getattr(sim_facts, key) is not None, key


@pytest.mark.stops_shared_server
def test_stop_leaves_no_process_and_a_free_port(vllm_server: LaunchedServer) -> None:
    """Stopping the real server (SIGINT first) ends every process of its tree and frees its port."""
    tree = {vllm_server.process.pid} | set(vllm_server.process._seen)
    assert len(tree) >= 2  # API server, EngineCore, worker: vLLM spawns several processes
    stop = vllm_server.process.stop()
    assert stop.mode in {"sigint", "sigterm"}
    assert stop.port_free and port_is_free(vllm_server.spec.host, vllm_server.spec.port)
    alive = [p for p in tree if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == []


def test_log_of_the_shared_server_is_kept(vllm_server: LaunchedServer) -> None:
    """The server's log is written where the launch said, and kept."""
    assert Path(vllm_server.process.log_path).stat().st_size > 0


def test_context_window_experiment_reports_the_silent_clamp(target: Target) -> None:
    """The context-window experiment finds vLLM 0.32's silent clamp of an over-long reply and its 400 for an
    over-long prompt, and says both."""
    from campaign.measure import study

    result = asyncio.run(study.context_window(target))
    assert result.status == "Valid"
    assert result.details["over_total"]["behaviour"] == "clamps silently"
    assert result.details["over_prompt"]["status"] == 400
    assert "silently clamps" in result.verdict and "refused with 400" in result.verdict


def test_long_context_experiment(target: Target) -> None:
    """The long-context experiment measures each context in turn and states the silence per prompt tokens."""
    from campaign.measure import study

    result = asyncio.run(study.long_context(target, [256, 1024, 1792], reply_tokens=32))
    assert result.status == "Valid", result.reasons
    assert [r["context_tokens"] for r in result.details["rows"]] == [256, 1024, 1792]
    assert result.values["prompt_tok_s"] and result.values["silence_s_per_1k_prompt_tokens"]
    assert "seconds of silence" in result.verdict or "s of silence per 1,000 prompt tokens" in result.verdict


def test_overload_experiment_shows_the_queue(target: Target) -> None:
    """Twice max-num-seqs at once: every request completes, at most the cap ran together, the rest queued. A
    burst the client could not deliver or read as meant (its sends spread by a busy host: 4.2 s under two CPU
    hogs; its first tokens past the cap before the first request's last, read through a stall: once, unloaded,
    66 of 128) is measured again, up to three times, and then stands Invalid with the typed reason, its
    reading never published as what ran."""
    from campaign.measure import study
    from campaign.measure.cells import Reason

    # Twice the cap: the second half waits for a whole generation.
    result = asyncio.run(study.overload(target, max_num_seqs=64, factor=2.0, reply_tokens=128))
    assert target.max_num_seqs == 64 and result.details["requests"] == 128
    assert result.values["completed"] == 128 and result.values["errored"] == 0
    if result.status == "Invalid":   # the client's host, not the server: said, and measured three times
        assert set(result.reason_codes) <= {Reason.SENDS_SPREAD, Reason.READS_UNORDERED}, result.reasons
        assert len(result.attempts) == 3 and result.verdict.startswith("not measured: ")
        return
    assert result.status == "Valid", result.reasons
    # Counted on the client's clock: at most 64 started before the first finished, the rest waited.
    assert result.values["ran_concurrently"] is not None and result.values["ran_concurrently"] <= 64
    assert result.values["queued"] is not None and result.values["queued"] >= 64
    assert "ran concurrently" in result.verdict and "hiding a queue" in result.verdict


def test_prefix_order_experiment_sizes_the_block_from_the_server(target: Target) -> None:
    """Prefix order with the block size read from the server: only the shared-first arm hits the cache."""
    from campaign.measure import study

    result = asyncio.run(study.prefix_order(target, block_size=target.block_size, agents=4, shared_tokens=1000,
                                            task_tokens=128, reply_tokens=32))
    assert result.status == "Valid", result.reasons
    assert result.details["shared_tokens"] == 1024  # 1,000 rounded up to whole 128-token blocks
    arms = result.details["arms"]
    assert arms["shared-first"]["hit_rate"] > 0
    assert arms["task-first"]["hit_rate"] == 0 and arms["unrelated"]["hit_rate"] == 0


def test_repeat_experiment_keeps_every_run(target: Target) -> None:
    """The repeat experiment keeps every one of its runs."""
    from campaign.measure import study

    spec = CellSpec(phase="decode", context_tokens=128, concurrency=2, mode="fixed", max_tokens=32)
    result = asyncio.run(study.repeat_cell(target, spec, times=4))
    assert result.status == "Valid"
    assert len(result.details["runs"]) == 4


def test_replacements_queueing_for_a_full_chunk_leave_the_cell_valid(target: Target) -> None:
    """Issue 19 on the real scheduler: 1,920-token prompts against the profile's 2,048-token chunk, so one step
    prefills at most one fresh prompt and replacements that finish together wait for it. That is how vLLM
    works at this shape: the cell is Valid and reports its queue; it used to read Invalid ("fewer than C
    running") whenever a gauge sample caught a replacement waiting."""
    assert target.max_num_batched_tokens == 2048
    spec = CellSpec(phase="decode", context_tokens=1920, concurrency=8, max_tokens=8, window_s=2.0, warmup_s=0.5)
    cell = asyncio.run(Measurer(target).run_cell(spec))
    print(f"queue: running {cell.avg_running} waiting {cell.avg_waiting} (max {cell.waiting_max}), "
          f"kv {cell.kv_usage_max}, active {cell.avg_active}, notes {cell.notes}")
    assert cell.status == "Valid", cell.reasons
    assert cell.avg_running is not None and cell.avg_waiting is not None and cell.kv_usage_max is not None
    assert cell.kv_usage_max < 0.95
    if cell.avg_waiting:  # two gauge samples in any window (at a quarter and three quarters): mean = median
        assert any("queued for the prefill chunk" in n or "just arrived" in n for n in cell.notes), cell.notes


@pytest.mark.parametrize(("prompts", "endpoint"), [("code", "completions"), ("prose", "chat")])
def test_text_prompts_are_exactly_l_tokens_by_the_servers_own_count(target: Target, prompts: str,
                                                                    endpoint: str) -> None:
    """Issue 15 on the real CPU build: the corpus tokenized by vLLM's /tokenize, sent as token ids or (chat)
    as a message through the tiny model's ChatML template; the server's usage counts every prompt at exactly
    L tokens, the bracket's prompt counter agrees, and the cell is Valid with fixed-length replies."""
    spec = CellSpec(phase="decode", context_tokens=300, concurrency=2, mode="fixed", max_tokens=24,
                    prompts=prompts, endpoint=endpoint)
    cell = asyncio.run(Measurer(target).run_cell(spec))
    assert cell.status == "Valid", cell.reasons
    counted = [r.usage_prompt_tokens or 0 for r in cell.records]
    if endpoint == "completions":
        assert counted == [300, 300]
    else:  # the tiny tokenizer may split a tag's letter in two: off by a token at most, and the cell says so
        assert all(abs(n - 300) <= 1 for n in counted), counted
        assert all(n == 300 for n in counted) or any("other than 300 tokens" in n for n in cell.notes)
    assert [r.usage_completion_tokens for r in cell.records] == [24, 24]
    stood = cell.stood_on
    assert stood is not None and stood.counted_prompt_tokens == sum(counted)  # the bracket agrees with the server
    if endpoint == "chat":
        assert all(r.reasoning_tokens == 0 for r in cell.records)  # no reasoning parser: none labelled
        assert all(r.server_id and r.server_id.startswith("chatcmpl") for r in cell.records)


def test_agent_like_turns_on_the_chat_endpoint_hit_the_prefix_cache(target: Target) -> None:
    """The chat endpoint through the real prefix cache: a second turn that repeats the first turn's messages
    and adds one finds the first turn's blocks cached (vllm:prefix_cache_hits grows by at least one block)."""
    from campaign.http.tokenizer import ServerTokenizer
    from campaign.measure.prompts import Prompts
    from campaign.server import metrics as m

    async def scenario() -> tuple[float, float]:
        async with target.endpoint.async_control() as control, new_client(target.endpoint) as client:
            source = Prompts("prose", "chat", tokenizer=ServerTokenizer(control, target.model))
            first = await source.next(400)
            assert first.messages is not None
            before = m.parse((await control.get("/metrics")).text)
            one = await stream_completion(client, model=target.model, prompt=[], messages=first.messages,
                                          prompt_tokens=first.tokens, max_tokens=8, request_id="turn-1")
            history = [*first.messages, {"role": "assistant", "content": "ok"},
                       {"role": "user", "content": "And the next step?"}]
            two = await stream_completion(client, model=target.model, prompt=[], messages=history,
                                          max_tokens=8, request_id="turn-2")
            after = m.parse((await control.get("/metrics")).text)
            assert one.ok and two.ok, (one.error, two.error)
            delta = m.Delta(before, after)
            return delta(m.PREFIX_HITS), float(two.usage_prompt_tokens or 0)

    hits, second_prompt = asyncio.run(scenario())
    assert second_prompt > 400 and hits >= 128  # at least one whole 128-token block of the first turn


def test_agent_sessions_on_the_real_build_hit_the_prefix_cache_from_the_second_turn(target: Target) -> None:
    """Issue 15's agent sessions on the real scheduler and prefix cache: two turns of 1 and 3 sessions on a
    shared system prompt; the second turn repeats each session's history, and vLLM's own counters show it
    served from cache; every N tried has its slowest agent, and each floor its largest N.

    An agent's speed is its replies' own (tokens after the first chunk over the time from first to last
    chunk). vLLM's API server starved of CPU (a loaded machine) sends a whole reply at once, which has no
    speed: so the lone agent's figure is checked against its own records, never assumed to exist."""
    from campaign.http.client import RequestRecord
    from campaign.measure import study

    result = asyncio.run(study.agents(target, sessions=[1, 3], turns=2, system_tokens=400, user_tokens=60,
                                      reply_tokens=48, prompts="prose", floors=(1.0,)))
    assert result.status == "Valid", result.reasons
    three = result.details["sessions"]["3"]
    print(result.verdict, result.details["sessions"])
    first, second = (turn["hit_rate"] for turn in three["cache_by_turn"])
    assert second is not None and second > 0.5 and (first is None or second > first), (first, second)
    # The floor's answer is the reduction of the agents' own speeds: the largest N whose every agent, and every
    # smaller N's, held it (an agent whose reply came in one chunk has no speed and holds nothing).
    slowest = {n: result.details["sessions"][str(n)]["slowest_tok_s"] for n in (1, 3)}
    holds = [n for n in (1, 3) if all(slowest[k] is not None and slowest[k] >= 1.0 for k in (1, 3) if k <= n)]
    assert result.values[study.agents_value(1.0)] == float(max(holds, default=0)), slowest
    lone = [RequestRecord.from_dict(r) for r in result.requests if r["id"].startswith("a1-")]
    assert len(lone) == 2  # its two turns
    streamed = [r.decode_tok_s for r in lone if r.decode_tok_s is not None]
    if streamed:  # one agent alone on the tiny model: far above 1 tok/s
        assert slowest[1] == pytest.approx(sum(streamed) / len(streamed)) and slowest[1] > 1.0, (slowest, streamed)
    else:  # every reply arrived in one burst: no speed, and no floor held (checked above)
        assert slowest[1] is None
    assert len(three["agent_tok_s"]) == 3


def test_two_open_loop_rates_and_a_short_capacity_search_on_the_real_build(target: Target) -> None:
    """Issue 16 on vLLM's own scheduler: two rates arrive on schedule (the real server says no time scale, so
    the schedule is wall seconds), every reply exactly its length, goodput and the SLO judged; then a short
    capacity search, every probe bracketed by vLLM's counters and holding at least the requests its SLO's
    percentile needs, ends with the highest rate that held.

    Low rates on purpose: a probe's send lag is judged against one arrival gap, so a rate the client cannot
    keep on a loaded 2-core machine reads Invalid (the client fell behind), which says nothing about vLLM. A
    p50 SLO needs 2 requests a probe (a p90 needs 10), so the search takes seconds."""
    from campaign.measure import capacity, slo

    service = slo.parse("ttft_p50_ms=5000,tpot_p50_ms=500")
    assert service.min_requests == 2
    shape = CellSpec(phase="rate", context_tokens=256, max_tokens=16, request_rate=2.0, duration_s=2.0, slo=service)

    async def measure() -> tuple[list[Any], Any]:
        measurer = Measurer(target)
        cells = [await measurer.run_cell(shape.model_copy(update={"request_rate": r})) for r in (2.0, 3.0)]
        found = await capacity.slo_search(measurer, shape.model_copy(update={"duration_s": 1.0}), start_rps=1.0,
                                          max_probes=2, resolution=0.5, concurrency=False)
        return cells, found

    cells, found = asyncio.run(measure())
    for cell in cells:
        assert cell.status == "Valid", cell.reasons
        assert target.time_scale == 1.0 and cell.time_scale == 1.0
        assert cell.achieved_rate_rps == pytest.approx(cell.request_rate, rel=0.15)
        assert len(cell.requests) == round(2.0 * (cell.request_rate or 0))
        assert {r.usage_completion_tokens for r in cell.records} == {16}
        assert cell.goodput_rps is not None and cell.slo_met_fraction is not None and cell.slo_passed is not None
        assert cell.stood_on is not None  # bracketed by vLLM's own counters
    assert found.status == "Valid", found.reasons
    search = found.details["slo_search"]
    assert 1 <= len(search["probes"]) <= 2
    assert all(p["requests"] >= service.min_requests for p in search["probes"])
    assert search["requests"] >= service.min_requests * len(search["probes"])
    assert all(p["attempts"] and p["attempts"][-1]["accepted"] for p in found.details["probes"])
    assert search["last_pass_rps"] is not None or search["first_fail_rps"] is not None
    assert found.values["max_rate_rps"] == search["last_pass_rps"]


# One real launch for three tests: a campaign whose server runs vLLM's n-gram drafter measures a code cell and a
# random-id cell, then, while it measures a third cell, its controller is killed outright. Its profile is
# cpu-tiny with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 and a max-model-len past the tiny model's window (40,960 over
# its max_position_embeddings of 32,768): vLLM 0.32 warns of it in its error's words, and serves.
LONG_WINDOW = 40_960
NGRAM_NIGHT = """\
schema_version: 1
name: ngram
profile: PROFILE
baseline: only
variants:
  - name: only
    flags:
      enforce-eager: true   # no torch.compile at start (about 10 s here): the same process tree
      kv-cache-memory-bytes: 32M   # 65,536 tokens: one request of the whole window fits
      max-model-len: 40960
      speculative-config: {method: ngram, num_speculative_tokens: 2, prompt_lookup_max: 3, prompt_lookup_min: 1}
workloads:
  - kind: decode
    mode: fixed
    contexts: [512]
    concurrency: [1]
    max_tokens: 64
    prompts: code
  - kind: decode
    mode: fixed
    contexts: [512]
    concurrency: [1]
    max_tokens: 64
  # Rounds of short replies for ten minutes: still being measured whenever the kill comes, however loaded
  # the machine.
  - kind: decode
    mode: fixed
    contexts: [128]
    concurrency: [1]
    max_tokens: 32
    min_seconds: 600
repeats: 1
warmup: false
"""


@dataclass(frozen=True)
class KilledNight:
    run: Path
    tree: list[psutil.Process]       # every process under the controller when it was killed
    survivors: list[psutil.Process]  # those still running 5 s after


@pytest.fixture(scope="module")
def ngram_night_killed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilledNight]:
    """`campaign run` of NGRAM_NIGHT in a subprocess (the cpu-tiny profile as shipped: API server, engine core
    and its worker), SIGKILLed once its two n-gram cells are stored and the third is being measured."""
    folder = tmp_path_factory.mktemp("ngram")
    profile = yaml.safe_load((PROJECT_ROOT / "launch_profiles" / "cpu-tiny.yaml").read_text())
    profile["env"][LONG_MODEL_LEN_ENV] = "1"
    profile["hardware"] = str(PROJECT_ROOT / "launch_profiles" / profile["hardware"])
    (folder / "long.yaml").write_text(yaml.safe_dump(profile))
    (folder / "m.yaml").write_text(NGRAM_NIGHT.replace("PROFILE", str(folder / "long.yaml")))
    out = folder / "runs"
    with (folder / "err.log").open("wb") as err:
        controller = subprocess.Popen([sys.executable, "-m", "campaign", "run", str(folder / "m.yaml"), "--out",
                                       str(out), "--plain"], cwd=PROJECT_ROOT, stdout=subprocess.DEVNULL, stderr=err)
    tree: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 600
        while len(list(out.glob("ngram/*/variants/only/cells/*/rep-0.json"))) < 2:
            assert controller.poll() is None, (folder / "err.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the n-gram cells were not measured in 10 minutes"
            time.sleep(0.05)
        # SIGKILL: no handler runs, no teardown. Frozen first, so the tree read is the tree killed.
        controller.send_signal(signal.SIGSTOP)
        tree = psutil.Process(controller.pid).children(recursive=True)
        controller.kill()
        controller.wait(timeout=10)
        _, survivors = psutil.wait_procs(tree, timeout=5)
        yield KilledNight(run=next(out.glob("ngram/*")), tree=tree, survivors=survivors)
    finally:
        if controller.poll() is None:
            controller.kill()
            controller.wait(timeout=30)
        for proc in tree:  # a survivor (the test then fails) is not left running for the rest of the session
            with contextlib.suppress(psutil.Error):
                proc.kill()


def test_an_ngram_drafter_on_the_real_cpu_build_is_measured_from_vllms_counters(
        ngram_night_killed: KilledNight) -> None:
    """Issue 15: the CPU build (0.32) runs n-gram speculative decoding (prompt lookup, no extra weights),
    launched by a campaign: the startup log names the method and its draft tokens; a code cell's acceptance
    comes from vllm:spec_decode_* over the bracketed step, and a random-id cell on the same server is Valid
    with the reason that its acceptance is not what text gets. (With dummy weights the tiny model's greedy
    reply repeats itself, which prompt lookup predicts well whatever the prompt: the figures are the
    counters', the comparison between prompts means nothing on this model, so it is not asserted.) One
    fixed-count request a cell is a bracketed step like a window's."""
    from campaign.measure.cells import Reason
    from campaign.stored import store

    run = store.RunDir(ngram_night_killed.run)
    (server,) = run.ready_servers()
    assert server.facts.speculative_method == "ngram" and server.facts.num_speculative_tokens == 2
    cells = {c.result.spec.prompts: c.result for c in run.cells()}
    assert set(cells) == {"code", "random"}  # the third cell was cut by the kill: not stored
    code, noise = cells["code"], cells["random"]
    for cell in (code, noise):
        assert cell.status == "Valid", cell.reasons
        assert cell.output_tokens == 64 and cell.stood_on is not None  # one whole reply, bracketed
        assert cell.spec_acceptance_rate is not None and 0 < cell.spec_acceptance_rate <= 1
        assert cell.spec_mean_accepted is not None and 0 < cell.spec_mean_accepted <= 2
        assert cell.spec_mean_acceptance_length == pytest.approx(1 + cell.spec_mean_accepted)
    # The busy host's wait before the API server counts a request in (94 ms once, beside the suite's two
    # workers) is under the client_ttft_over_server caveat's 200 ms; a host stalled past it would be said so,
    # and is allowed: the caveat is the truth about that request's path, not about speculative decoding.
    path = {Reason.CLIENT_TTFT_OVER_SERVER}
    assert set(code.reason_codes) <= path and set(noise.reason_codes) - path == {Reason.SPEC_RANDOM_PROMPTS}


def test_the_real_build_serves_a_window_past_the_models_when_told_to_allow_it(
        ngram_night_killed: KilledNight) -> None:
    """Issue 50: vLLM's warning that max-model-len is past the model's window, set with
    VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, is no failure: the night's launch became ready with the longer window
    (its cells are measured above) and the warning stands in its log."""
    run = store.RunDir(ngram_night_killed.run)
    (server,) = run.ready_servers()
    assert server.facts.max_model_len == LONG_WINDOW and server.facts.failure is None
    logs = "".join(p.read_text() for p in ngram_night_killed.run.rglob("*.log"))
    assert "WARNING" in logs and f"User-specified max_model_len ({LONG_WINDOW}) is greater" in logs


def test_sigkill_of_the_controller_takes_the_real_vllm_tree_with_it(ngram_night_killed: KilledNight) -> None:
    """vLLM's own processes (API server, engine core, the core's worker), not only the simulator's one, die
    within 5 s with a campaign controller killed outright (SIGKILL: no handler, no teardown) while it measures
    a cell: the parent-death signal reaches the API server, which takes its tree down. What a resume does
    after a SIGKILL is tests/test_faults.py's simulator test."""
    assert len(ngram_night_killed.tree) >= 3, ngram_night_killed.tree
    assert not ngram_night_killed.survivors, f"server processes outlived the controller: {ngram_night_killed.survivors}"
