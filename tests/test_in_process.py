"""The measured path's client in simulated time (measure.simulated.InProcessStreams): the simulator in this
process hands each event straight to `stream_completion`, with no socket. The same request over the Unix socket
(StreamClient, HTTP byte for byte) to the same server is the truth: the same events, the same refusals. Off the
expected path it fails as StreamClient does: the idle limit names itself, a cancelled or timed-out request is
aborted in the engine (as a closed connection is), and closing the client ends a request in flight."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from campaign.http.client import RequestRecord, new_client, stream_completion
from campaign.http.endpoint import Timeouts
from campaign.http.streamclient import StreamClient
from campaign.http.streams import StreamError, Streams
from campaign.measure import runner
from campaign.measure.cells import CellSpec
from campaign.measure.prompts import PromptSource
from campaign.measure.runner import Measurer
from campaign.measure.simulated import InProcessStreams, SimulatedServer, start
from campaign.plan import replay
from campaign.server import metrics as m
from campaign.server.profiles import load_profile
from campaign.sim import truth as sim_truth
from campaign.sim.server import Completion, Stream


@pytest.fixture()
def server() -> Iterator[SimulatedServer]:
    launch = start(load_profile("a5000-tp2")[0], {}, seed=0)
    with launch.serve() as served:
        yield served


def events(server: SimulatedServer, client: Streams, body: dict[str, object]) -> tuple[int, list[bytes]]:
    """One request's status and the data of every event it got."""
    got: list[bytes] = []

    async def send() -> int:
        async with client:
            reply = await client.post_stream("/v1/completions", body, lambda _t, data: got.append(data))
        return reply.status

    return server.call(send()), got


def body(**update: object) -> dict[str, object]:
    out: dict[str, object] = {"model": "Qwen/Qwen3.5-27B-GPTQ-Int4", "prompt": list(range(1000, 1300)),
                              "max_tokens": 5, "min_tokens": 5, "ignore_eos": True, "stream": True,
                              "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    out.update(update)
    return out


def test_the_in_process_client_gets_the_events_the_socket_carries(server: SimulatedServer) -> None:
    """A streamed completion in process and over the socket: the same events, byte for byte but the reply's id."""
    endpoint = server.target().endpoint
    assert isinstance(new_client(endpoint), InProcessStreams)
    request = body(model=server.config.name)
    status_in, in_process = events(server, new_client(endpoint), request)
    status_http, over_http = events(server, StreamClient(replace(endpoint, in_process=None)), request)
    assert status_in == status_http == 200
    assert len(in_process) == 7 and in_process[-1] == b"[DONE]"   # 5 tokens, the final usage, [DONE]
    assert [e.replace(b"cmpl-sim-1", b"ID") for e in in_process] == \
        [e.replace(b"cmpl-sim-2", b"ID") for e in over_http]


def test_a_refusal_is_the_servers_reply_as_over_http(server: SimulatedServer) -> None:
    """A model the server does not serve: 404 with vLLM's error body, in process as over the socket; the
    record says so as an HTTP error."""
    endpoint = server.target().endpoint
    replies = []
    for client in (new_client(endpoint), StreamClient(replace(endpoint, in_process=None))):
        async def send(client: Streams = client) -> RequestRecord:
            async with client:
                return await stream_completion(client, model="no-such-model", prompt=[1000] * 10, max_tokens=4,
                                               request_id="r")
        replies.append(server.call(send()))
    assert [(r.status, r.error_kind) for r in replies] == [(404, "http"), (404, "http")]
    assert replies[0].error == replies[1].error and "The model `no-such-model` does not exist" in str(replies[0].error)


def test_the_idle_limit_names_itself_and_the_engine_drops_the_request(server: SimulatedServer) -> None:
    """An 8K-token prompt takes the simulated pair seconds to prefill: with an idle limit of half a simulated
    second the request ends as StreamClient's would, and the engine aborts it at its next step."""
    endpoint = replace(server.target().endpoint, timeouts=Timeouts(idle_s=0.5))

    async def send() -> RequestRecord:
        async with new_client(endpoint) as client:
            record = await stream_completion(client, model=server.config.name, prompt=list(range(1000, 9192)),
                                             max_tokens=4, request_id="r")
        await asyncio.sleep(30)   # simulated: the engine's next steps
        return record

    record = server.call(send())
    assert record.error_kind == "timeout"
    assert record.error == "idle timeout: no data for 0.5 s after 0 event(s) (limit 0.5 s)"
    assert not server.server.engine.running and not server.server.engine.waiting


def test_a_cancelled_request_is_aborted_and_a_closed_client_ends_one_in_flight(server: SimulatedServer) -> None:
    """Cancelled mid-stream: the engine aborts it. Closed with a request in flight: the request fails with
    StreamError("closed"), never hangs, and the engine aborts it too."""

    async def cancelled() -> None:
        async with new_client(server.target().endpoint) as client:
            task = asyncio.create_task(client.post_stream("/v1/completions", body(model=server.config.name,
                                                                                  max_tokens=500, min_tokens=500),
                                                          lambda _t, _d: None))
            await asyncio.sleep(2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await asyncio.sleep(1)

    server.call(cancelled())
    assert not server.server.engine.running

    async def closed() -> StreamError:
        client = new_client(server.target().endpoint)
        task = asyncio.create_task(client.post_stream("/v1/completions", body(model=server.config.name,
                                                                              max_tokens=500, min_tokens=500),
                                                      lambda _t, _d: None))
        await asyncio.sleep(2)
        await client.aclose()
        with pytest.raises(StreamError) as raised:
            await task
        await asyncio.sleep(1)
        return raised.value

    error = server.call(closed())
    assert error.kind == "closed" and str(error) == "the client was closed with the request in flight"
    assert not server.server.engine.running


@pytest.fixture()
def one_seat() -> Iterator[SimulatedServer]:
    """The simulated pair seating one request at a time: a second one waits in the queue."""
    launch = start(load_profile("a5000-tp2")[0], {"max-num-seqs": 1}, seed=0)
    with launch.serve() as served:
        yield served


@pytest.mark.parametrize("socket", [False, True], ids=["in-process", "over-the-socket"])
def test_a_queued_request_waits_while_the_server_works_on_the_clients_other_streams(
        one_seat: SimulatedServer, socket: bool) -> None:
    """Issue 52, item 7: a request queued behind another (max-num-seqs 1) gets no byte for seconds, ten times
    the idle limit, while the first streams its 300 tokens; it is not timed out (the server is visibly
    working: http.streams.Liveness), and both complete. Then one waiting behind an 8K-token prefill, with no
    stream of the client getting anything, is timed out: a server silent past the limit."""
    endpoint = replace(one_seat.target().endpoint, timeouts=Timeouts(idle_s=0.5))
    if socket:
        endpoint = replace(endpoint, in_process=None)

    async def send(prompts: list[list[int]], tokens: list[int]) -> list[RequestRecord]:
        async with new_client(endpoint) as client:
            return list(await asyncio.gather(*(
                stream_completion(client, model=one_seat.config.name, prompt=p, max_tokens=n, request_id=f"r{i}")
                for i, (p, n) in enumerate(zip(prompts, tokens, strict=True)))))

    first, queued = one_seat.call(send([list(range(1000, 1100)), list(range(2000, 2100))], [300, 20]))
    assert first.ok and queued.ok, (first.error, queued.error)
    assert queued.ttft_s is not None and queued.ttft_s > 10 * 0.5   # it waited seconds for its seat
    short, long = one_seat.call(send([list(range(3000, 3010)), list(range(4000, 12192))], [2, 4]))
    assert short.ok and long.error_kind == "timeout", (short.error, long.error)
    assert long.error is not None and "(limit 0.5 s)" in long.error and long.error.startswith(
        "idle timeout: no data for ")


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("continuous", [False, True])
def test_an_event_is_the_whole_dict_dumped(chat: bool, continuous: bool) -> None:
    """sim.server.Stream.event writes its events from a frame made once: byte for byte json.dumps of the event
    vLLM writes (the dict built whole), whatever the text (quotes, escapes, non-ASCII) and on either side of a
    reasoning reply's switch to content."""
    texts = iter(['plain', 'a "quoted" \\ back\nslash', 'caf\u00e9 \u2603 \U0001f600', '', '\ue000', 'end'])
    server = SimpleNamespace(reply_json=lambda _n: json.dumps(next(texts)).encode(),
                             config=SimpleNamespace(name="org/model-7B"))
    checked = Completion(prompt=list(range(300)), max_tokens=6, chat=chat, stream=True, include_usage=True,
                         continuous=continuous, thinks=chat)
    req = SimpleNamespace(id="cmpl-sim-9", max_tokens=6, generated=0)
    stream = Stream(server, checked, req)  # type: ignore[arg-type]
    for generated in range(1, 7):
        req.generated = generated
        made = stream.event(1)
        text = json.loads(made)["choices"][0]["delta" if chat else "text"]
        text = next(iter(text.values())) if chat else text
        part = "reasoning_content" if generated <= 3 else "content"
        event: dict[str, object] = {"id": "cmpl-sim-9", "object": stream.kind, "model": "org/model-7B", "choices": [
            {"index": 0, "delta": {part: text}, "finish_reason": None} if chat else
            {"index": 0, "text": text, "finish_reason": None}]}
        if continuous:
            event["usage"] = {"prompt_tokens": 300, "completion_tokens": generated, "total_tokens": 300 + generated}
        assert made == json.dumps(event).encode()


def test_a_closed_loops_next_request_misses_the_step_planned_as_the_last_one_ended() -> None:
    """Over HTTP a stream's next request cannot reach the engine before it plans the step after the one its
    predecessor ended in (the reply's end and the request each cross a socket); in process the client hears
    the end a loop cycle late, so neither does it there. Every replacement of a sustained cell is seated
    after a step boundary past its arrival, never in the step that began as it arrived. (The two streams are
    a prefill apart, 2,048-token prompts on a 2,048-token chunk, so each ends while the other decodes: an idle
    engine would seat a request at once.)"""
    launch = start(load_profile("a5000-tp2")[0], {}, seed=0)
    recorder = sim_truth.Recorder()
    spec = CellSpec(phase="decode", mode="sustained", context_tokens=2048, concurrency=2, max_tokens=16,
                    window_s=20.0, warmup_s=0.0)
    with launch.serve(truth=recorder) as served:
        result = served.call(Measurer(served.target()).run_cell(spec))
    assert result.status == "Valid", result.reasons
    starts = {round(s.start, 9) for s in recorder.steps}
    replacements = [r for r in recorder.all_requests() if r.max_tokens == 16 and r.arrival > 0]
    assert len(replacements) >= 4
    for request in replacements:
        assert request.admitted is not None and request.admitted > request.arrival, request
        assert round(request.arrival, 9) in starts   # it arrived as a step began, and was not seated in it


def test_a_launchs_prompts_in_simulated_time_are_its_own_and_the_same_every_time() -> None:
    """A night in simulated time reads the same every time it runs (h200-mtp's acceptance, drawn from the
    prompts' text, once moved a verdict between runs): each launch salts its prompts from its seed and identity.
    Over HTTP every source draws its salt from the system's entropy, so no night meets another's prompts."""
    async def ids() -> list[int]:
        return PromptSource().unique(16)

    def drawn(launch: str) -> list[list[int]]:
        started = start(load_profile("a5000-tp2")[0], {}, seed=0, launch=launch)
        with started.serve() as server:
            lazy = Measurer(server.target())   # its source is made in the loop, at the first cell
            return [server.call(ids()), server.call(ids()), server.call(_unique(lazy))]

    first = drawn("baseline/0")
    assert first == drawn("baseline/0") and len({tuple(i) for i in first}) == 3
    assert not {tuple(i) for i in first} & {tuple(i) for i in drawn("baseline/1")}
    assert PromptSource().unique(16) != PromptSource().unique(16)


async def _unique(measurer: Measurer) -> list[int]:
    return measurer.prompts.unique(16)


def test_a_scrape_in_process_is_the_socket_scrapes_snapshot(server: SimulatedServer) -> None:
    """/metrics in process is the collectors' samples without the text: after a cell (histograms observed, a
    speculative-free engine's counters moved), the snapshot a Measurer takes in process equals, value for value
    and label for label, the one it takes from the same server's /metrics over the socket; with `only`, those
    names alone."""
    target = server.target()
    socket_only = replace(target, endpoint=replace(target.endpoint, in_process=None))
    server.call(Measurer(target).run_cell(CellSpec(phase="decode", context_tokens=512, concurrency=4, max_tokens=32,
                                                   window_s=2.0, warmup_s=0.5)))

    async def both(only: frozenset[str] | None) -> tuple[m.MetricsSnapshot, m.MetricsSnapshot]:
        async with socket_only.endpoint.async_control() as control:
            return (await runner.scrape(target, control, only=only),
                    await runner.scrape(socket_only, control, only=only))

    for only in (None, m.GAUGES):
        direct, over_socket = server.call(both(only))
        assert direct.values == over_socket.values and direct.labels == over_socket.labels
        assert set(direct.values) == (set(over_socket.values) if only is None else only & set(over_socket.values))
    full, _ = server.call(both(None))
    assert full.value(m.GENERATION_TOKENS) > 0 and full.value(f"{m.TTFT_HISTOGRAM}_count") > 0


def test_a_launch_in_simulated_time_reads_no_wall_clock_variables(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A served simulator's time scale and truth file (CAMPAIGN_SIM_TIME_SCALE, CAMPAIGN_SIM_TRUTH, as an HTTP
    launch beside it in the same process sets them) have nothing to act on in process: a launch in simulated
    time and a plan's configuration start at the hardware's speed without a truth file. Read, a truth file an
    HTTP launch had written refused the start ("exists"): a test of both clocks in one module failed so in
    the suite, where its HTTP fixture had started first."""
    written = tmp_path / "truth.jsonl"
    written.write_text("{}\n")
    monkeypatch.setenv("CAMPAIGN_SIM_TRUTH", str(written))
    monkeypatch.setenv("CAMPAIGN_SIM_TIME_SCALE", "5")
    monkeypatch.setenv("CAMPAIGN_SIM_FAULTS", "launch-noise:0.02")   # the server's variables are still read
    profile, path = load_profile("h200")
    launch = start(profile, {}, seed=0)
    assert launch.config.time_scale == 1.0 and launch.config.truth is None
    assert launch.config.faults.launch_noise == 0.02
    planned = replay.loaded_profile_config(profile, path)
    assert planned.time_scale == 1.0 and planned.truth is None and planned.faults.launch_noise == 0.02
