"""`campaign probe` learns the chunk (max-num-batched-tokens), max-num-seqs and the block size from the server it
did not launch, as a campaign learns them from its launch's startup log, so a queue of replacements waiting for
the chunk is told from the rest: what real vLLM tells (its /metrics, read from a real 0.32 scrape, and its
dev-mode /server_info), what the simulator tells, the options for what is not told, and the simulated H200's
8K x 8 cell Valid with the queue in its note."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from campaign.cli import run_cli
from campaign.core import clock
from campaign.core.errors import EXIT_USAGE, OptionError
from campaign.http.endpoint import Endpoint
from campaign.measure import probe as measuring
from campaign.measure.cells import CellResult, CellSpec, Reason
from campaign.measure.runner import Measurer, Target
from campaign.measure.simulated import start
from campaign.night.launcher import LaunchedServer, launched
from campaign.server import metrics
from campaign.server.control import ControlClient
from campaign.server.metrics import Told
from campaign.server.profiles import load_profile

FIXTURES = Path(__file__).parent / "fixtures"
REAL_METRICS = (FIXTURES / "cpu_v0.32_metrics.txt").read_text()
TIME_SCALE = 20

# What vLLM 0.32's GET /server_info?config_format=json holds where the probe reads (with VLLM_SERVER_DEV_MODE=1
# only): pydantic's JSON dump of VllmConfig, its scheduler_config and cache_config as nested objects (checked
# against .venv-vllm's SchedulerConfig and CacheConfig); the rest of the body trimmed.
DEV_SERVER_INFO = {"vllm_config": {"scheduler_config": {"max_num_batched_tokens": 2048, "max_num_seqs": 256,
                                                        "policy": "fcfs"},
                                   "cache_config": {"block_size": 128, "gpu_memory_utilization": 0.92}},
                   "vllm_env": {}, "system_env": {}}


# --- (a) what a scrape tells ----------------------------------------------------------------------------
def test_real_vllm_metrics_tell_the_block_size_and_kv_cache_but_no_scheduler_config() -> None:
    """vLLM 0.32's only config info gauge is vllm:cache_config_info: the block size and the KV cache, never the
    chunk nor max-num-seqs (its "None" labels are not read as numbers)."""
    told = metrics.config_told(metrics.parse(REAL_METRICS))
    assert told == {"block_size": Told(128, "vllm:cache_config_info{block_size}"),
                    "kv_cache_tokens": Told(2097152, "vllm:cache_config_info{kv_cache_size_tokens}")}


def test_the_simulators_gauge_and_a_missing_one() -> None:
    text = REAL_METRICS + (
        "# HELP campaign_sim:scheduler_config_info The simulator's SchedulerConfig\n"
        "# TYPE campaign_sim:scheduler_config_info gauge\n"
        'campaign_sim:scheduler_config_info{engine="0",max_num_batched_tokens="8192",max_num_seqs="None",'
        'model_name="tiny"} 1.0\n')
    told = metrics.config_told(metrics.parse(text))
    assert told["max_num_batched_tokens"] == Told(8192, "campaign_sim:scheduler_config_info{max_num_batched_tokens}")
    assert "max_num_seqs" not in told  # "None": not told, never 0
    assert metrics.config_told(metrics.parse("")) == {}


@pytest.mark.parametrize(("text", "value"), [("8192", 8192), ("128.0", 128), (64, 64), ("None", None), ("0", None),
                                             ("-4", None), ("1.5", None), ("inf", None), (True, None), (None, None)])
def test_positive_int(text: object, value: int | None) -> None:
    assert metrics.positive_int(text) == value


def test_a_config_endpoints_json() -> None:
    paths = dict(measuring.CONFIG_ENDPOINTS)["/server_info?config_format=json"]
    told = measuring.config_from_json(DEV_SERVER_INFO, paths, "GET /server_info")
    assert {k: t.value for k, t in told.items()} == {"max_num_batched_tokens": 2048, "max_num_seqs": 256,
                                                     "block_size": 128}
    # Another server's JSON, a string where a number belongs, an HTML page: nothing told.
    assert measuring.config_from_json({"vllm_config": {"scheduler_config": {"max_num_batched_tokens": "2048"}}},
                                      paths, "x") == {}
    assert measuring.config_from_json("<html>", paths, "x") == {}


class _FakeVllm(BaseHTTPRequestHandler):
    """vLLM 0.32 as the probe's control plane sees it: its real /metrics scrape, /inference/v1/config absent
    (newer vLLM), /server_info only in dev mode."""

    dev_mode = False
    asked: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        type(self).asked.append(self.path)
        if self.path == "/metrics":
            self._send(200, REAL_METRICS, "text/plain")
        elif self.path == "/server_info?config_format=json" and self.dev_mode:
            self._send(200, json.dumps(DEV_SERVER_INFO), "application/json")
        else:
            self._send(404, json.dumps({"detail": "Not Found"}), "application/json")

    def _send(self, status: int, body: str, kind: str) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def fake_vllm() -> Iterator[tuple[str, type[_FakeVllm]]]:
    handler = type("Handler", (_FakeVllm,), {"asked": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_real_vllm_tells_the_chunk_only_in_dev_mode(fake_vllm: tuple[str, type[_FakeVllm]]) -> None:
    url, handler = fake_vllm
    with ControlClient(Endpoint.parse(url), retry_s=0.5) as control:
        told = measuring.server_config(control)
    assert set(told) == {"block_size", "kv_cache_tokens"}
    # Each config endpoint asked once, never retried (a 404 is their common answer); /version is the scrape's.
    assert [p for p in handler.asked if p != "/version"] == ["/metrics", "/inference/v1/config",
                                                             "/server_info?config_format=json"]
    target, lines = measuring.configured(Target(endpoint=Endpoint.parse(url), model="tiny"), told,
                                         max_num_batched_tokens=None, max_num_seqs=None)
    assert (target.max_num_batched_tokens, target.max_num_seqs, target.block_size) == (None, None, 128)
    assert any("not known" in line and "--max-num-batched-tokens N" in line for line in lines), lines

    handler.dev_mode = True
    with ControlClient(Endpoint.parse(url), retry_s=0.5) as control:
        told = measuring.server_config(control)
    assert told["max_num_batched_tokens"] == Told(2048, "GET /server_info?config_format=json")
    assert told["max_num_seqs"].value == 256
    assert told["block_size"].source == "vllm:cache_config_info{block_size}"  # /metrics first


def test_options_fill_what_the_server_does_not_tell_and_may_not_contradict_it() -> None:
    target = Target(endpoint=Endpoint.parse("http://127.0.0.1:9"), model="m")
    told = {"block_size": Told(16, "vllm:cache_config_info{block_size}")}
    filled, lines = measuring.configured(target, told, max_num_batched_tokens=4096, max_num_seqs=64)
    assert (filled.max_num_batched_tokens, filled.max_num_seqs, filled.block_size) == (4096, 64, 16)
    assert any("4,096 (from --max-num-batched-tokens" in line for line in lines), lines
    said = told | {"max_num_batched_tokens": Told(8192, "campaign_sim:scheduler_config_info{max_num_batched_tokens}")}
    agreed, _ = measuring.configured(target, said, max_num_batched_tokens=8192, max_num_seqs=None)
    assert agreed.max_num_batched_tokens == 8192
    with pytest.raises(OptionError, match=r"'--max-num-batched-tokens': 4096, but the server says 8192 "
                                          r"\(campaign_sim:scheduler_config_info\{max_num_batched_tokens\}\)"):
        measuring.configured(target, said, max_num_batched_tokens=4096, max_num_seqs=None)


# Reply tokens of the 8K x 8 cell below: short enough that replacements keep the queue non-empty most of the time.
QUEUED_REPLY = 16


@pytest.mark.parametrize(("reply", "most"), [(QUEUED_REPLY, True), (128, False)])
def test_the_8k_x_8_cells_queue_is_there_most_of_the_window_only_with_short_replies(reply: int, most: bool) -> None:
    """The premise of the cell below, from the simulator's own engine in simulated time (no client stall, the
    waiting queue read every 10 ms of the window): with 16-token replies requests wait 92% of the window, so a
    sampler's median reads them and the cell carries the queue's note; with 128-token replies they wait 45% of
    it, and the median of a few hundred samples is 0 or not by chance. (The simulated H200 schedules as vLLM
    0.33 does, asynchronously, so a replacement waits a step longer than before: 64-token replies, 46% before,
    now wait 66%.)"""
    launch = start(load_profile("h200")[0], {}, seed=0)
    spec = CellSpec(phase="decode", context_tokens=8192, concurrency=8, max_tokens=reply, window_s=60.0,
                    warmup_s=2.0)
    with launch.serve() as server:
        samples: list[tuple[float, int]] = []

        async def measured() -> CellResult:
            done = asyncio.Event()

            async def sample() -> None:
                while not done.is_set():
                    samples.append((clock.now(), len(server.server.engine.waiting)))
                    await asyncio.sleep(0.01)

            task = asyncio.create_task(sample())
            try:
                return await Measurer(server.target()).run_cell(spec)
            finally:
                done.set()
                await task

        cell = server.call(measured())
    assert cell.status == "Valid" and cell.window is not None
    inside = [waiting for t, waiting in samples if cell.window[0] <= t <= cell.window[1]]
    share = sum(1 for waiting in inside if waiting) / len(inside)
    assert (share > 0.65) if most else (share < 0.5), share
    noted = any("replacement requests queued for the prefill chunk" in n for n in cell.notes)
    assert noted == most, cell.notes


# --- (b), (c) against the simulated H200 ----------------------------------------------------------------
@pytest.fixture(scope="module")
def h200(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedServer]:
    with pytest.MonkeyPatch.context() as patch:  # not left set for later tests
        patch.setenv("CAMPAIGN_SIM_TIME_SCALE", str(TIME_SCALE))
        profile, _ = load_profile("h200")
        with launched(profile, tmp_path_factory.mktemp("h200") / "server.log", engine="sim") as server:
            yield server


def _probe(server: LaunchedServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
           *args: str) -> tuple[int, str, str]:
    """`campaign probe URL --contexts 8k --concurrency 8 ...` as the console script runs it, in this process."""
    monkeypatch.setenv("H200_KEY", server.spec.api_key or "")
    capsys.readouterr()
    code = run_cli(["probe", server.spec.base_url, "--api-key-env", "H200_KEY", "--contexts", "8k",
                    "--concurrency", "8", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.wall_timed
def test_the_simulators_metrics_tell_what_its_startup_log_says(h200: LaunchedServer) -> None:
    with ControlClient(h200.spec.endpoint()) as control:
        told = metrics.config_told(control.metrics())
    assert told["max_num_batched_tokens"].value == h200.facts.max_num_batched_tokens == 8192
    assert told["block_size"].value == h200.facts.block_size
    assert told["kv_cache_tokens"].value == h200.facts.kv_cache_tokens
    assert told["max_num_seqs"].value == 1024  # the simulated H200's default: the launch did not set it


@pytest.mark.wall_timed
@pytest.mark.timeout(300)
def test_the_8k_x_8_cell_is_valid_and_its_note_reports_the_queue(
        h200: LaunchedServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue: without the chunk this cell was Invalid ("the cause cannot be told"). With it told, eight 8K
    prompts never fit one 8,192-token chunk beside the decodes, so finished requests' replacements queue for it:
    how the server works at this shape, Valid, the note saying so. Short replies (16 tokens) replace requests
    so often that the queue is there in nine tenths of the window (the premise test below; at 64 tokens, before
    async scheduling, it was there 46% of the time, so the samples' median, which the note needs, was 0 about
    half the time: a suite run failed here); a 60 s window is 3 s of wall time at 20x."""
    code, out, err = _probe(h200, monkeypatch, capsys, "--window", "60", "--max-tokens", str(QUEUED_REPLY),
                            "--json")
    assert code == 0, err[-3000:]
    assert "chunk (max-num-batched-tokens): 8,192 (from campaign_sim:scheduler_config_info" in err, err[-3000:]
    (cell,) = json.loads(out)["cells"]
    assert cell["status"] == "Valid", cell["reasons"]
    assert Reason.QUEUED not in cell["reason_codes"]
    assert any("replacement requests queued for the prefill chunk (8,192 tokens" in n for n in cell["notes"]), \
        cell["notes"]


@pytest.mark.wall_timed
def test_an_option_the_server_contradicts_is_an_error(
        h200: LaunchedServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A chunk the server does not have would judge the queue on a false premise: one error line naming both
    numbers, before anything is measured."""
    code, out, err = _probe(h200, monkeypatch, capsys, "--max-num-batched-tokens", "4096")
    assert code == EXIT_USAGE
    errors = [line for line in err.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "--max-num-batched-tokens" in errors[0], err
    assert "4096" in errors[0] and "8192" in errors[0], errors
    assert "cell 1/1" not in err and out == ""
