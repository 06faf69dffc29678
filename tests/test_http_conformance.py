"""The measured path's HTTP client against what the specs allow a server to send (RFC 9112, the WHATWG
event-stream format, TLS), each case replayed byte for byte by a raw-socket server (tests/fakes/raw_http.py).

Every socket case runs on asyncio's loop and on uvloop. A case asserts the exact tokens, the chunk times (events
in one socket write share one timestamp, writes apart arrive apart) or the exact error kind and message.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import json
import logging
import math
import random
import re
import select
import socket
import ssl
import time
import zlib
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from fakes.raw_http import (
    DONE,
    EOL,
    LAST_CHUNK,
    SSE_CHUNKED,
    RawHTTPServer,
    Script,
    chunk,
    chunked,
    head,
    json_script,
    sse,
    sse_event,
    sse_script,
    token_event,
    usage_event,
    vllm_events,
)

from campaign.http.client import RequestRecord, new_client, stream_completion
from campaign.http.endpoint import TLS, Endpoint, Timeouts
from campaign.http.streamclient import Limits, Reply, SSEDecoder, StreamClient, StreamError, StreamTimeout
from campaign.night.launcher import launched
from campaign.server.profiles import load_profile

pytestmark = pytest.mark.timeout(60)

T = TypeVar("T")
Runner = Callable[[Coroutine[Any, Any, T]], T]
BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "stream": True}
# What asyncio (and uvloop, through the same logger) says when a callback, a future or a task went wrong unseen.
LOOP_TROUBLE = ("Fatal error", "Future exception was never retrieved", "Task exception was never retrieved",
                "Exception in callback", "exception was never retrieved")


# -- the event loops, and a check that nothing went wrong unseen on them ----------------------------------


@pytest.fixture(params=["asyncio", "uvloop"])
def arun(request: pytest.FixtureRequest) -> Runner[Any]:
    """Runs a coroutine to its end on a fresh loop of the parametrised kind, then collects garbage (so a future
    whose exception nobody retrieved is reported now, inside this test)."""
    factory = None
    if request.param == "uvloop":
        factory = pytest.importorskip("uvloop").new_event_loop

    def run(coro: Coroutine[Any, Any, T]) -> T:
        try:
            with asyncio.Runner(loop_factory=factory) as runner:
                return runner.run(coro)
        finally:
            gc.collect()

    return run


@pytest.fixture(scope="module", autouse=True)
def _older_objects_frozen() -> Iterator[None]:
    """What the worker held before this module (imports, earlier modules' objects) set aside from the
    collector, so that each test's collections below scan what the test made: a full collection of a worker's
    heap took 50-250 ms, 350 times in this module (20 s of its 32 s alone, measured with gc.collect timed)."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def quiet_loop(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    caplog.set_level(logging.DEBUG)
    yield
    gc.collect()
    records = caplog.get_records("setup") + caplog.get_records("call") + caplog.get_records("teardown")
    trouble = [r.getMessage() for r in records if any(t in r.getMessage() for t in LOOP_TROUBLE)]
    assert not trouble, f"the event loop reported problems nobody handled: {trouble}"


# -- helpers -----------------------------------------------------------------------------------------------


def ep(url: str, **kwargs: Any) -> Endpoint:
    return Endpoint.parse(url, **kwargs)


async def complete(endpoint: Endpoint, count: int = 1, *, max_tokens: int = 8,
                   limits: Limits | None = None) -> tuple[list[RequestRecord], int]:
    """`count` requests one after another on one client: their records and how many connections it opened."""
    async with new_client(endpoint, limits=limits) as client:
        records = [await stream_completion(client, model="m", prompt=[1, 2, 3], max_tokens=max_tokens,
                                           request_id=f"r{i}") for i in range(count)]
        return records, client.connections_opened


async def post(endpoint: Endpoint, *, limits: Limits | None = None, path: str = "/v1/completions",
               events: list[tuple[float, bytes]] | None = None) -> tuple[Reply, list[tuple[float, bytes]]]:
    seen: list[tuple[float, bytes]] = [] if events is None else events
    async with StreamClient(endpoint, limits=limits) as client:
        reply = await client.post_stream(path, BODY, lambda now, data: seen.append((now, data)))
    return reply, seen


def one(arun: Runner[Any], script: Script | list[Script],
        **endpoint_kwargs: Any) -> tuple[RequestRecord, RawHTTPServer]:
    """One request through `complete` against a server playing `script`: its record, and the server."""
    scripts = script if isinstance(script, list) else [script]
    with RawHTTPServer(scripts) as server:
        (record,), _ = arun(complete(ep(server.url, **endpoint_kwargs)))
    assert not server.errors
    return record, server


def stamped_as_read(play: Callable[[], tuple[list[float], RawHTTPServer]], script: Script,
                    writes: list[int]) -> list[float]:
    """Stamps (`writes[k]`: the index in `script.writes` of the write that carried stamp k) of a play in which
    every stamp lies between the server's turn to its write and its turn to the next write that waits: the client
    stamps an event when its bytes are read, not later. The fake server is a thread of this process on the same
    clock (perf_counter), so "never before its write" is asserted on every play. A stamp after the next write is
    a client that stamps late (buffering, or stamping at the end), or a host that stalled the client past the
    script's gap (under two CPU hogs one read 80 ms apart writes 1.07 s apart): the exchange is played again, at
    most three times. A client that stamps late fails every time; a stall seldom thrice."""
    late: list[list[float]] = []
    for _ in range(3):
        stamps, server = play()
        turns = [at for connection, at in server.turns if connection == 0]
        assert len(turns) == len(script.writes), server.turns
        bounds = []
        for k, (stamp, write) in enumerate(zip(stamps, writes, strict=True)):
            assert stamp >= turns[write], f"stamp {k} ({stamp}) before the server turned to its write ({turns[write]})"
            after = [i for i in range(write + 1, len(script.writes)) if script.writes[i][0] > 0]
            bounds.append(turns[after[0]] if after else math.inf)
        if all(stamp < bound for stamp, bound in zip(stamps, bounds, strict=True)):
            return stamps
        late.append([round(stamp - bound, 3) for stamp, bound in zip(stamps, bounds, strict=True)])
    pytest.fail(f"in every play a stamp came after the server's next write (seconds past it): {late}")


def stream_error(arun: Runner[Any], script: Script, *, limits: Limits | None = None,
                 **endpoint_kwargs: Any) -> StreamError:
    """The StreamError `post_stream` raises against a server playing `script`."""
    with RawHTTPServer([script]) as server:
        with pytest.raises(StreamError) as info:
            arun(post(ep(server.url, **endpoint_kwargs), limits=limits))
    assert not server.errors
    return info.value


def assert_tokens(record: RequestRecord, tokens: int, *, count: str = "usage") -> None:
    assert record.error is None and record.ok, record.error
    assert record.tokens == tokens
    assert record.token_count == count
    assert len(record.chunk_t) == len(record.chunk_tokens)
    assert record.chunk_t == sorted(record.chunk_t)


def words(text: str) -> str:
    """Lower case, '_' and '-' as spaces: "first_byte", "first-byte" and "First byte" all read "first byte"."""
    return re.sub(r"[_\-]", " ", text.lower())


# -- SSE line endings and fields, on the wire ----------------------------------------------------------------


@pytest.mark.parametrize("eol", ["lf", "crlf", "cr"])
def test_sse_line_endings(arun: Runner[Any], eol: str) -> None:
    record, _ = one(arun, sse_script(vllm_events(5), eol=EOL[eol]))
    assert_tokens(record, 5)
    assert record.chunk_tokens == [1] * 5 and record.usage_completion_tokens == 5


@pytest.mark.parametrize("eol", ["lf", "crlf", "cr"])
def test_sse_line_endings_content_length_and_close_delimited(arun: Runner[Any], eol: str) -> None:
    for framing in ("length", "close"):
        record, _ = one(arun, sse_script(vllm_events(4, per_chunk=2), eol=EOL[eol], framing=framing))
        assert_tokens(record, 4)
        assert record.chunk_tokens == [2, 2]


def test_cr_ending_one_read_and_its_lf_starting_the_next(arun: Runner[Any]) -> None:
    # CRLF line ends; the first event's blank line is cut between its CR and its LF. The event is complete at
    # the CR: it must be delivered with the first read, and the LF of the next read must not make an extra line.
    first, second = token_event(1), token_event(2)
    script = Script([
        (0.0, head(200, SSE_CHUNKED)),
        (0.0, chunk(b"data: " + first + b"\r\n\r")),
        (0.1, chunk(b"\ndata: " + second + b"\r\n\r\n")),
        (0.0, chunk(sse([usage_event(2), DONE], b"\r\n")) + LAST_CHUNK),
    ])
    events: list[tuple[float, bytes]] = []

    def posted() -> tuple[list[float], RawHTTPServer]:
        events.clear()
        with RawHTTPServer([script]) as server:
            reply, _ = arun(post(ep(server.url), events=events))
        assert reply.status == 200 and reply.events == 4
        return [at for at, _ in events[:2]], server

    # The first event came with the first read, the second with the next.
    stamped_as_read(posted, script, [1, 2])
    assert [data for _, data in events] == [first, second, usage_event(2), DONE]
    records: list[RequestRecord] = []

    def completed() -> tuple[list[float], RawHTTPServer]:
        record, server = one(arun, script)
        records[:] = [record]
        return record.chunk_t, server

    stamped_as_read(completed, script, [1, 2])
    assert_tokens(records[0], 2)


def test_multiline_data_comments_fields_and_no_space(arun: Runner[Any]) -> None:
    # One token event whose JSON spans three data: lines, and events wrapped in everything the format allows.
    split = token_event(1).replace(b',"choices"', b',\n"choices"').replace(b',"usage"', b',\n"usage"')
    assert split.count(b"\n") == 2
    body = (b": ping\n\n"
            + b"retry: 3000\n"
            + sse_event(split, fields=[b"event: message", b"id: 1"])
            + b": keep-alive\n"
            + sse_event(token_event(2), space=False)
            + b"id\n" + b"foo: bar\n" + sse_event(token_event(3), fields=[b"event:completion"])
            + b":\n\n"
            + sse([usage_event(3), DONE]))
    script = Script.of(head(200, SSE_CHUNKED), *chunked(body, [40, 7, 300]), LAST_CHUNK)
    events: list[tuple[float, bytes]] = []
    with RawHTTPServer([script, script]) as server:
        arun(post(ep(server.url), events=events))
        (record,), _ = arun(complete(ep(server.url)))
    assert [data for _, data in events] == [split, token_event(2), token_event(3), usage_event(3), DONE]
    assert_tokens(record, 3)


@pytest.mark.parametrize("sizes", [[1], [7, 13, 1, 31], [5000]])
def test_chunk_and_read_boundaries_anywhere(arun: Runner[Any], sizes: list[int]) -> None:
    # Chunk frames cut inside events and inside "data:"; the writes cut inside chunk-size lines and CRLFs.
    wire = b"".join(chunked(sse(vllm_events(6)), [3, 50, 11])) + LAST_CHUNK
    writes, pos, i = [head(200, SSE_CHUNKED)], 0, 0
    while pos < len(wire):
        writes.append(wire[pos: pos + sizes[i % len(sizes)]])
        pos += sizes[i % len(sizes)]
        i += 1
    record, _ = one(arun, Script.of(*writes))
    assert_tokens(record, 6)


# -- chunk times --------------------------------------------------------------------------------------------


def test_events_in_one_write_share_a_time_and_writes_apart_do_not(arun: Runner[Any]) -> None:
    events = vllm_events(6)
    script = Script([
        (0.0, head(200, SSE_CHUNKED)),
        (0.0, chunk(sse(events[0:2]))),        # tokens 1 and 2: one write
        (0.05, chunk(sse(events[2:3]))),       # token 3: 50 ms later
        (0.05, chunk(sse(events[3:6]))),       # tokens 4-6: 50 ms later, one write
        (0.0, chunk(sse(events[6:])) + LAST_CHUNK),
    ])
    records: list[RequestRecord] = []

    def played() -> tuple[list[float], RawHTTPServer]:
        record, server = one(arun, script)
        records[:] = [record]
        assert_tokens(record, 6)
        return record.chunk_t, server

    t = stamped_as_read(played, script, [1, 1, 2, 3, 3, 3])
    assert t[0] == t[1] and t[3] == t[4] == t[5] and t[1] < t[2] < t[3]
    assert records[0].ttft_s == pytest.approx(t[0] - records[0].send_t)


# -- framing and connection reuse ----------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["HTTP/1.0", "HTTP/1.1"])
def test_close_delimited_reply_and_no_reuse_of_the_dead_connection(arun: Runner[Any], version: str) -> None:
    # No Content-Length, no chunked: the body is everything until the server closes.
    scripts = [sse_script(vllm_events(3), framing="close", version=version, gap_s=0.01),
               sse_script(vllm_events(4), framing="close", version=version)]
    with RawHTTPServer(scripts) as server:
        (first, second), opened = arun(complete(ep(server.url), 2))
        assert server.connections == 2
    assert_tokens(first, 3)
    assert_tokens(second, 4)
    assert opened == 2


def test_http10_reply_reports_its_version_and_no_keep_alive(arun: Runner[Any]) -> None:
    with RawHTTPServer([sse_script(vllm_events(2), framing="close", version="HTTP/1.0")]) as server:
        reply, events = arun(post(ep(server.url)))
    assert reply.status == 200 and reply.events == 4 and len(events) == 4
    assert "1.0" in reply.http_version and reply.keep_alive is False


def test_connection_token_list_with_close_is_not_reused(arun: Runner[Any]) -> None:
    headers = [("Connection", "keep-alive, close")]
    scripts = [sse_script(vllm_events(2), headers=headers), sse_script(vllm_events(3), headers=headers)]
    with RawHTTPServer(scripts) as server:
        (first, second), opened = arun(complete(ep(server.url), 2))
        assert server.connections == 2
    assert_tokens(first, 2)
    assert_tokens(second, 3)
    assert opened == 2


def test_keep_alive_is_reused(arun: Runner[Any]) -> None:
    scripts = [sse_script(vllm_events(n)) for n in (2, 3, 4)]
    with RawHTTPServer(scripts) as server:
        records, opened = arun(complete(ep(server.url), 3))
        assert server.connections == 1
        assert [r.connection for r in server.requests] == [0, 0, 0]
    for record, n in zip(records, (2, 3, 4), strict=True):
        assert_tokens(record, n)
    assert opened == 1


@pytest.mark.parametrize("together", [False, True], ids=["separate-writes", "one-write"])
def test_informational_replies_before_the_real_one(arun: Runner[Any], together: bool) -> None:
    informational = [head(100), head(103, [("Link", "</style.css>; rel=preload; as=style"),
                                           ("Link", "</app.js>; rel=preload; as=script")])]
    first = sse_script(vllm_events(3))
    if together:
        first.writes[0] = (0.0, b"".join(informational) + first.writes[0][1])
    else:
        first.writes[:0] = [(0.0, part) for part in informational]
    with RawHTTPServer([first, sse_script(vllm_events(5))]) as server:
        (a, b), opened = arun(complete(ep(server.url), 2))
    assert_tokens(a, 3)
    assert_tokens(b, 5)
    assert opened == 1


def test_trailers_and_chunk_extensions_then_reuse(arun: Runner[Any]) -> None:
    body = sse(vllm_events(3))
    frames = [f"{len(body[:40]):x};name=value\r\n".encode() + body[:40] + b"\r\n", chunk(body[40:])]
    first = Script.of(head(200, [*SSE_CHUNKED, ("Trailer", "X-Done")]), *frames, b"0\r\nX-Done: yes\r\n\r\n")
    with RawHTTPServer([first, sse_script(vllm_events(4))]) as server:
        (a, b), opened = arun(complete(ep(server.url), 2))
    assert_tokens(a, 3)
    assert_tokens(b, 4)
    assert opened == 1


def test_header_names_and_media_type_in_any_case(arun: Runner[Any]) -> None:
    script = sse_script(vllm_events(2))
    script.writes[0] = (0.0, head(200, [("CONTENT-TYPE", "Text/Event-Stream; charset=utf-8"),
                                        ("transfer-encoding", "Chunked")]))
    record, _ = one(arun, script)
    assert_tokens(record, 2)


def test_a_pooled_connection_the_server_closed_is_not_reused(arun: Runner[Any]) -> None:
    # A keep-alive reply, then the server drops the idle connection (as uvicorn does after its keep-alive timeout).
    async def twice(endpoint: Endpoint) -> tuple[list[RequestRecord], int]:
        async with new_client(endpoint) as client:
            a = await stream_completion(client, model="m", prompt=[1], max_tokens=2, request_id="a")
            await asyncio.sleep(0.2)
            b = await stream_completion(client, model="m", prompt=[1], max_tokens=3, request_id="b")
            return [a, b], client.connections_opened

    first = sse_script(vllm_events(2))
    first.close = True
    with RawHTTPServer([first, sse_script(vllm_events(3))]) as server:
        (a, b), opened = arun(twice(ep(server.url)))
    assert_tokens(a, 2)
    assert_tokens(b, 3)
    assert opened == 2


def test_localhost_name_reaches_an_ipv4_only_server(arun: Runner[Any]) -> None:
    # "localhost" may resolve to ::1 first; nothing listens there: the next address is tried.
    with RawHTTPServer([sse_script(vllm_events(2))]) as server:
        (record,), _ = arun(complete(ep(f"http://localhost:{server.port}")))
    assert_tokens(record, 2)
    assert server.requests[0].header("Host") == f"localhost:{server.port}"


def test_an_error_event_mid_stream(arun: Runner[Any]) -> None:
    error = json.dumps({"error": {"object": "error", "message": "engine died", "type": "InternalServerError",
                                  "code": 500}}).encode()
    record, _ = one(arun, sse_script([token_event(1), token_event(2), error, DONE]))
    assert not record.ok and "engine died" in (record.error or "") and record.tokens == 2


def test_content_length_with_transfer_encoding_is_a_protocol_error(arun: Runner[Any]) -> None:
    body = b"".join(chunked(sse(vllm_events(2)), 64)) + LAST_CHUNK
    script = Script.of(head(200, [*SSE_CHUNKED, ("Content-Length", str(len(body)))]) + body)
    error = stream_error(arun, script)
    assert error.kind == "protocol", (error.kind, str(error))


@pytest.mark.parametrize("garbage", [
    b"HTTP/1.1 2x0 OK\r\nContent-Type: text/event-stream\r\n\r\n",
    b"FOO 200 OK\r\n\r\n",
    head(200, SSE_CHUNKED) + b"zz\r\ndata: x\n\n\r\n",
], ids=["status-code", "protocol-name", "chunk-size"])
def test_malformed_reply_is_a_protocol_error_and_nothing_leaks(arun: Runner[Any], garbage: bytes,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    error = stream_error(arun, Script.of(garbage, hang=True))
    assert error.kind == "protocol", (error.kind, str(error))
    with RawHTTPServer([Script.of(garbage, hang=True)]) as server:
        (record,), _ = arun(complete(ep(server.url)))
    assert not record.ok and record.error
    gc.collect()
    assert not [r for r in caplog.records if any(t in r.getMessage() for t in LOOP_TROUBLE)]


def test_server_closing_mid_stream_is_closed_not_ok(arun: Runner[Any]) -> None:
    events = vllm_events(5)
    script = Script.of(head(200, SSE_CHUNKED), chunk(sse(events[:2])), close=True)
    error = stream_error(arun, script)
    assert error.kind == "closed", (error.kind, str(error))
    record, _ = one(arun, script)
    assert not record.ok and record.tokens == 2


def test_connection_refused_is_connect(arun: Runner[Any]) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    with pytest.raises(StreamError) as info:
        arun(post(ep(f"http://127.0.0.1:{port}")))
    assert info.value.kind == "connect", (info.value.kind, str(info.value))


# -- content encodings and content types ---------------------------------------------------------------------


@pytest.mark.parametrize("encoding, wbits", [("gzip", 31), ("deflate", 15)])
def test_compressed_event_stream_is_decoded(arun: Runner[Any], encoding: str, wbits: int) -> None:
    # Compressed as a streaming server would: one sync flush per event, so each write decodes on arrival.
    compressor = zlib.compressobj(wbits=wbits)
    parts = [compressor.compress(sse_event(e)) + compressor.flush(zlib.Z_SYNC_FLUSH) for e in vllm_events(6)]
    parts[-1] += compressor.flush()
    script = Script.of(head(200, [*SSE_CHUNKED, ("Content-Encoding", encoding)]), *map(chunk, parts), LAST_CHUNK,
                       gap_s=0.005)
    record, server = one(arun, script)
    assert_tokens(record, 6)
    assert server.requests[0].header("Accept-Encoding") == "identity"


def test_unknown_content_encoding_names_it(arun: Runner[Any]) -> None:
    script = Script.of(head(200, [*SSE_CHUNKED, ("Content-Encoding", "br")]) + chunk(b"\x1b\x00\x00\xff") + LAST_CHUNK)
    record, server = one(arun, script)
    assert not record.ok
    assert re.search(r"\bbr\b", record.error or ""), record.error
    assert server.requests[0].header("Accept-Encoding") == "identity"
    error = stream_error(arun, script)
    assert error.kind == "encoding" and re.search(r"\bbr\b", str(error)), (error.kind, str(error))


def test_corrupt_gzip_is_an_encoding_error(arun: Runner[Any]) -> None:
    script = Script.of(head(200, [*SSE_CHUNKED, ("Content-Encoding", "gzip")]) + chunk(b"this is not gzip")
                       + LAST_CHUNK)
    error = stream_error(arun, script)
    assert error.kind == "encoding" and "gzip" in str(error), (error.kind, str(error))


def test_a_json_200_is_not_an_event_stream(arun: Runner[Any]) -> None:
    completion = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": " tok tok"}],
                  "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    record, _ = one(arun, json_script(200, completion))
    assert not record.ok and record.tokens == 0
    assert "not an event stream" in (record.error or "") or "application/json" in (record.error or ""), record.error
    error = stream_error(arun, json_script(200, completion))
    assert error.kind == "not-event-stream", (error.kind, str(error))
    assert "application/json" in str(error)


def test_a_large_200_that_is_not_an_event_stream_is_named_as_such(arun: Runner[Any]) -> None:
    # A gateway's HTML page, or a non-streamed completion, bigger than Limits.error_body_bytes: still "not an
    # event stream" (what went wrong), not a limit on error bodies.
    page = b"<html>" + b"x" * 100_000 + b"</html>"
    error = stream_error(arun, json_script(200, page, content_type="text/html"))
    assert error.kind == "not-event-stream" and "text/html" in str(error), (error.kind, str(error))


def test_a_200_that_is_not_an_event_stream_is_named_even_if_its_body_never_ends(arun: Runner[Any]) -> None:
    script = Script.of(head(200, [("Content-Type", "application/json")]) + b'{"id":"c","choices":[', hang=True)
    error = stream_error(arun, script, timeouts=Timeouts(idle_s=0.5))
    assert error.kind == "not-event-stream" and "application/json" in str(error), (error.kind, str(error))


def test_a_stream_of_only_done_is_not_ok(arun: Runner[Any]) -> None:
    record, _ = one(arun, sse_script([DONE]))
    assert not record.ok and record.tokens == 0 and record.error


def test_an_error_reply_keeps_its_message(arun: Runner[Any]) -> None:
    message = "min_tokens must be less than or equal to max_tokens=7, got 8."
    record, _ = one(arun, json_script(400, {"error": {"message": message, "type": "BadRequestError", "code": 400}}))
    assert not record.ok and record.status == 400 and message in (record.error or "")
    assert record.clamped_to == 7


def test_without_continuous_usage_one_token_per_text_chunk(arun: Runner[Any]) -> None:
    # Speculative decoding behind a gateway: 4 text chunks, 7 tokens in the final usage.
    chunks = [token_event(None) for _ in range(4)]
    script = Script([
        (0.0, head(200, SSE_CHUNKED)),
        (0.0, chunk(sse(chunks[:1]))),
        (0.08, chunk(sse(chunks[1:3]))),
        (0.08, chunk(sse(chunks[3:]))),
        (0.08, chunk(sse([usage_event(7), DONE])) + LAST_CHUNK),
    ])
    records: list[RequestRecord] = []

    def played() -> tuple[list[float], RawHTTPServer]:
        record, server = one(arun, script)
        records[:] = [record]
        assert_tokens(record, 4, count="chunks")
        assert record.chunk_tokens == [1, 1, 1, 1] and record.usage_completion_tokens == 7
        return record.chunk_t, server

    # Each text chunk stamped as it was read: the first before the second was written (TTFT is the first
    # chunk's, not the end's), the second and third together.
    t = stamped_as_read(played, script, [1, 2, 2, 3])
    assert t[1] == t[2]
    assert records[0].ttft_s == pytest.approx(t[0] - records[0].send_t)


def test_openai_style_null_usage_counts_chunks(arun: Runner[Any]) -> None:
    # include_usage without continuous stats, as OpenAI writes it: "usage": null in every chunk but the last.
    chunks = [json.dumps({"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": f" t{i}"}],
                          "usage": None}).encode() for i in range(3)]
    record, _ = one(arun, sse_script([*chunks, usage_event(3), DONE]))
    assert_tokens(record, 3, count="chunks")
    assert record.usage_completion_tokens == 3


def test_a_stream_without_done_is_not_ok(arun: Runner[Any]) -> None:
    record, _ = one(arun, sse_script(vllm_events(3)[:-1]))
    assert not record.ok and record.tokens == 3 and "[DONE]" in (record.error or ""), record.error


# -- timeouts ----------------------------------------------------------------------------------------------


def test_first_byte_timeout(arun: Runner[Any]) -> None:
    with RawHTTPServer([Script(hang=True)]) as server:
        began = time.perf_counter()
        with pytest.raises(StreamTimeout) as info:
            arun(post(ep(server.url, timeouts=Timeouts(first_byte_s=0.3, idle_s=5))))
        waited = time.perf_counter() - began
    error = info.value
    assert error.kind == "timeout" and error.which == "first_byte"
    # It fires at its value, never before; how much later depends on the host's load, so the bound above is
    # the other timeout (5 s), the one that must not be the one that fired.
    assert 0.3 <= error.after_s <= waited < 5
    assert "first byte" in words(str(error)) and "0.3" in str(error), str(error)


def test_idle_timeout(arun: Runner[Any]) -> None:
    script = Script.of(head(200, SSE_CHUNKED), chunk(sse([token_event(1)])), hang=True)
    events: list[tuple[float, bytes]] = []
    with RawHTTPServer([script]) as server:
        with pytest.raises(StreamTimeout) as info:
            arun(post(ep(server.url, timeouts=Timeouts(first_byte_s=5, idle_s=0.3)), events=events))
        failed = time.perf_counter()
    error = info.value
    assert error.kind == "timeout" and error.which == "idle"
    # It fires at its value, never before; how much later depends on the host's load, so the bound above is
    # the other timeout (5 s), the one that must not be the one that fired.
    assert len(events) == 1 and 0.3 <= error.after_s < 5 and 0.3 <= failed - events[0][0] < 5
    assert "idle" in words(str(error)) and "0.3" in str(error), str(error)


def test_idle_timeout_in_the_record(arun: Runner[Any]) -> None:
    script = Script.of(head(200, SSE_CHUNKED), chunk(sse([token_event(1)])), hang=True)
    record, _ = one(arun, script, timeouts=Timeouts(idle_s=0.3))
    assert not record.ok and record.tokens == 1 and "idle" in words(record.error or "")


def test_idle_timeout_is_between_reads_not_total(arun: Runner[Any]) -> None:
    # 1 s of events 0.1 s apart under a 0.3 s idle timeout, after a first byte 0.45 s late (first-byte limit 1 s).
    events = vllm_events(10)
    script = Script([(0.45, head(200, SSE_CHUNKED))] + [(0.1, chunk(sse([e]))) for e in events[:-2]]
                    + [(0.0, chunk(sse(events[-2:])) + LAST_CHUNK)])
    timeouts = Timeouts(first_byte_s=1.0, idle_s=0.3)
    # The premise is the server's: no silence past a limit. A host that stalls the server's thread past one (CI
    # did: 0.5 s between two writes asked 0.1 s apart) makes the client's timeout right, and proves nothing, so
    # the exchange is played again; the client is judged only on one whose premise held.
    broken: list[list[float]] = []
    for _ in range(3):
        record, server = one(arun, script, timeouts=timeouts)
        first, *between = server.silences()
        if first < timeouts.first_byte_s and max(between) < timeouts.idle_s:
            break
        broken.append([round(s, 3) for s in (first, *between)])
    else:
        pytest.fail(f"the host stalled the test server past a limit in every try: silences {broken}")
    assert_tokens(record, 10)
    assert record.ttft_s is not None and record.ttft_s >= 0.5


def test_connect_timeout(arun: Runner[Any]) -> None:
    # Deterministic on Linux loopback: a listener with backlog 0 that never accepts holds one connection in
    # its queue; the kernel drops the SYNs of the next ones, so their connect() hangs until the timeout.
    listener = socket.socket()
    fillers: list[socket.socket] = []
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        for _ in range(8):
            filler = socket.socket()
            filler.setblocking(False)
            fillers.append(filler)
            if filler.connect_ex(("127.0.0.1", port)) not in (0, errno.EINPROGRESS):
                pytest.skip("cannot fill a loopback accept queue here")
            _, writable, _ = select.select([], [filler], [], 0.2)
            if not writable:
                break  # this one hangs: the queue is full
        else:
            pytest.skip("the loopback accept queue never filled: no deterministic connect timeout here")
        began = time.perf_counter()
        with pytest.raises(StreamTimeout) as info:
            arun(post(ep(f"http://127.0.0.1:{port}", timeouts=Timeouts(connect_s=0.3))))
        waited = time.perf_counter() - began
    finally:
        for filler in fillers:
            filler.close()
        listener.close()
    error = info.value
    # It fires at its value, never before; how much later depends on the host's load (no other timeout is
    # set here: a connect that hung would have gone on for the default 10 s).
    assert error.which == "connect" and 0.3 <= error.after_s <= waited < 5
    assert "connect" in words(str(error)) and "0.3" in str(error), str(error)


# -- limits -------------------------------------------------------------------------------------------------


def test_header_block_over_the_limit(arun: Runner[Any]) -> None:
    big = [(f"X-Filler-{i}", "v" * 1000) for i in range(70)]  # ~72 KiB of headers in 16 KiB writes
    wire = head(200, [*SSE_CHUNKED, *big])
    script = Script.of(*[wire[i: i + 16384] for i in range(0, len(wire), 16384)], hang=True)
    error = stream_error(arun, script)
    assert error.kind == "limit" and "header" in str(error).lower(), (error.kind, str(error))
    # The same block whole in one write.
    error = stream_error(arun, Script.of(wire, hang=True))
    assert error.kind == "limit" and "header" in str(error).lower(), (error.kind, str(error))


def test_header_block_under_a_raised_limit(arun: Runner[Any]) -> None:
    big = [(f"X-Filler-{i}", "v" * 1000) for i in range(70)]
    script = sse_script(vllm_events(2), headers=big)
    with RawHTTPServer([script]) as server:
        (record,), _ = arun(complete(ep(server.url), limits=Limits(header_bytes=256 * 1024)))
    assert_tokens(record, 2)


def test_one_event_over_the_limit(arun: Runner[Any]) -> None:
    huge = token_event(1, text="x" * 10_000)
    script = Script.of(head(200, SSE_CHUNKED), *chunked(sse([huge, DONE]), 1000), LAST_CHUNK)
    error = stream_error(arun, script, limits=Limits(event_bytes=4096))
    assert error.kind == "limit" and "event" in str(error).lower(), (error.kind, str(error))
    # Many events that are each under the limit are fine, however long the stream.
    with RawHTTPServer([sse_script(vllm_events(200), per_write=50)]) as server:
        (record,), _ = arun(complete(ep(server.url), limits=Limits(event_bytes=4096)))
    assert_tokens(record, 200)


def test_error_body_over_the_limit(arun: Runner[Any]) -> None:
    body = json.dumps({"error": {"message": "x" * 5000}}).encode()
    script = Script.of(head(400, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]),
                       *[body[i: i + 1000] for i in range(0, len(body), 1000)])
    error = stream_error(arun, script, limits=Limits(error_body_bytes=2048))
    assert error.kind == "limit" and "body" in str(error).lower() and "400" in str(error), (error.kind, str(error))


def test_an_8_mib_event_in_64_kib_reads() -> None:
    payload = b'{"text":"' + b"y" * (8 * 1024 * 1024) + b'"}'
    wire = sse_event(payload, b"\r\n") + sse_event(b"[DONE]", b"\r\n")
    got: list[tuple[float, bytes]] = []
    decoder = SSEDecoder(lambda now, data: got.append((now, data)), max_event_bytes=16 * 1024 * 1024)
    began = time.perf_counter()
    for i in range(0, len(wire), 64 * 1024):
        decoder.feed(wire[i: i + 64 * 1024], float(i))
    assert time.perf_counter() - began < 10  # a buffer re-scanned on every read would take minutes
    assert [data for _, data in got] == [payload, b"[DONE]"]
    assert got[0][0] == float((len(payload) + 8) // (64 * 1024) * 64 * 1024)  # the read that completed it


def test_decoder_limit_on_a_line_that_never_ends() -> None:
    decoder = SSEDecoder(lambda now, data: None, max_event_bytes=1024)
    with pytest.raises(StreamError) as info:
        for _ in range(100):
            decoder.feed(b"data: " + b"z" * 94, 0.0)
    assert info.value.kind == "limit"


# -- cancellation -------------------------------------------------------------------------------------------


def test_client_cancel_mid_stream(arun: Runner[Any], caplog: pytest.LogCaptureFixture) -> None:
    events = [token_event(i) for i in range(1, 200)]
    script = Script([(0.0, head(200, SSE_CHUNKED))] + [(0.02, chunk(sse([e]))) for e in events], hang=True)

    async def cancel_after_first_token(endpoint: Endpoint) -> tuple[bool, int]:
        async with new_client(endpoint) as client:
            first = asyncio.Event()
            task = asyncio.create_task(stream_completion(client, model="m", prompt=[1], max_tokens=200,
                                                         request_id="r", first_token=first))
            await asyncio.wait_for(first.wait(), 5)
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.1)  # let the transport's close run
            return task.cancelled(), client.connections_opened

    with RawHTTPServer([script]) as server:
        cancelled, opened = arun(cancel_after_first_token(ep(server.url)))
        assert server.wait_disconnect(3.0), "the server never saw the client go away"
    assert cancelled and opened == 1
    gc.collect()
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "closed by the server" in m or any(t in m for t in LOOP_TROUBLE)], said


def test_cancelled_connection_is_not_reused(arun: Runner[Any]) -> None:
    slow = Script([(0.0, head(200, SSE_CHUNKED))] + [(0.02, chunk(sse([token_event(i)]))) for i in range(1, 100)],
                  hang=True)

    async def cancel_then_again(endpoint: Endpoint) -> tuple[RequestRecord, int]:
        async with new_client(endpoint) as client:
            first = asyncio.Event()
            task = asyncio.create_task(stream_completion(client, model="m", prompt=[1], max_tokens=100,
                                                         request_id="a", first_token=first))
            await asyncio.wait_for(first.wait(), 5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            record = await stream_completion(client, model="m", prompt=[1], max_tokens=3, request_id="b")
            return record, client.connections_opened

    with RawHTTPServer([slow, sse_script(vllm_events(3))]) as server:
        record, opened = arun(cancel_then_again(ep(server.url)))
    assert_tokens(record, 3)
    assert opened == 2


# -- where requests go --------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/"])
def test_no_prefix(arun: Runner[Any], suffix: str) -> None:
    with RawHTTPServer([sse_script(vllm_events(2))]) as server:
        (record,), _ = arun(complete(ep(server.url + suffix)))
    assert_tokens(record, 2)
    assert server.requests[0].target == "/v1/completions"
    assert server.requests[0].header("Authorization") is None


@pytest.mark.parametrize("suffix", ["/prefix", "/prefix/", "/prefix/v1", "/prefix/v1/"])
def test_path_prefix(arun: Runner[Any], suffix: str) -> None:
    with RawHTTPServer([sse_script(vllm_events(2))]) as server:
        (record,), _ = arun(complete(ep(server.url + suffix, api_key="sk-test")))
    assert_tokens(record, 2)
    request = server.requests[0]
    assert request.method == "POST" and request.target == "/prefix/v1/completions"
    assert request.header("Host") == f"127.0.0.1:{server.port}"
    assert request.header("Authorization") == "Bearer sk-test"
    sent = request.json()
    assert isinstance(sent, dict) and sent["stream"] is True and sent["prompt"] == [1, 2, 3]


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_ipv6_host_header(arun: Runner[Any]) -> None:
    with RawHTTPServer([sse_script(vllm_events(3))], host="::1") as server:
        assert server.url.startswith("http://[::1]:")
        (record,), _ = arun(complete(ep(server.url)))
    assert_tokens(record, 3)
    assert server.requests[0].header("Host") == f"[::1]:{server.port}"


# -- TLS ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[ssl.SSLContext, Path]:
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(server_ctx)
    bundle = tmp_path_factory.mktemp("pki") / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    return server_ctx, bundle


def test_tls_with_a_ca_bundle(arun: Runner[Any], pki: tuple[ssl.SSLContext, Path]) -> None:
    server_ctx, bundle = pki
    with RawHTTPServer([sse_script(vllm_events(3))], ssl_context=server_ctx) as server:
        assert server.url.startswith("https://")
        (record,), _ = arun(complete(ep(server.url, tls=TLS(ca_bundle=bundle))))
    assert_tokens(record, 3)
    assert server.requests[0].target == "/v1/completions"


def test_tls_unknown_ca_fails_verification(arun: Runner[Any], pki: tuple[ssl.SSLContext, Path],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    server_ctx, _ = pki
    with RawHTTPServer([sse_script(vllm_events(3))], ssl_context=server_ctx) as server:
        with pytest.raises(StreamError) as info:
            arun(post(ep(server.url)))
        (record,), _ = arun(complete(ep(server.url)))
        assert server.requests == []
    assert info.value.kind == "tls", (info.value.kind, str(info.value))
    assert "certificate verif" in str(info.value).lower(), str(info.value)
    assert not record.ok and "certificate verif" in (record.error or "").lower()


def test_tls_insecure_skips_verification(arun: Runner[Any], pki: tuple[ssl.SSLContext, Path]) -> None:
    server_ctx, _ = pki
    with RawHTTPServer([sse_script(vllm_events(3))], ssl_context=server_ctx) as server:
        (record,), _ = arun(complete(ep(server.url, tls=TLS(insecure=True))))
    assert_tokens(record, 3)


def test_tls_ssl_cert_file_is_honoured(arun: Runner[Any], pki: tuple[ssl.SSLContext, Path],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    server_ctx, bundle = pki
    monkeypatch.setenv("SSL_CERT_FILE", str(bundle))
    with RawHTTPServer([sse_script(vllm_events(3))], ssl_context=server_ctx) as server:
        (record,), _ = arun(complete(ep(server.url)))
    assert_tokens(record, 3)


@pytest.mark.parametrize("close_notify", [True, False], ids=["close-notify", "bare-close"])
def test_tls_close_delimited_reply(arun: Runner[Any], pki: tuple[ssl.SSLContext, Path], close_notify: bool) -> None:
    server_ctx, bundle = pki
    script = sse_script(vllm_events(3), framing="close", version="HTTP/1.0")
    script.close_notify = close_notify
    with RawHTTPServer([script], ssl_context=server_ctx) as server:
        (record,), _ = arun(complete(ep(server.url, tls=TLS(ca_bundle=bundle))))
    assert_tokens(record, 3)


def test_tls_hostname_mismatch(arun: Runner[Any], tmp_path: Path) -> None:
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("server.example").configure_cert(server_ctx)
    bundle = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    with RawHTTPServer([sse_script(vllm_events(1))], ssl_context=server_ctx) as server:
        with pytest.raises(StreamError) as info:
            arun(post(ep(server.url, tls=TLS(ca_bundle=bundle))))
    assert info.value.kind == "tls", (info.value.kind, str(info.value))


# -- SSEDecoder alone: every split point gives the same events at the right reads ---------------------------


def reference_events(stream: bytes) -> list[tuple[bytes, int]]:
    """The WHATWG algorithm over a whole stream: (data, index of the byte that completes the event)."""
    events: list[tuple[bytes, int]] = []
    data: list[bytes] = []
    pos = 0
    line_end = re.compile(rb"\r\n|\r|\n")
    while (m := line_end.search(stream, pos)) is not None:
        line, at, pos = stream[pos: m.start()], m.start(), m.end()
        if not line:
            if data:
                events.append((b"\n".join(data), at))
            data = []
            continue
        if line.startswith(b":"):
            continue
        name, colon, value = line.partition(b":")
        if colon and value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            data.append(value)
    return events


DECODER_STREAM = (
    b": hello\n\n"
    + sse_event(b"one", b"\n")
    + sse_event(b"two\nlines", b"\r\n", fields=[b"event: message", b"id: 7"])
    + sse_event(b"three", b"\r", fields=[b"retry: 100"])
    + b"data:four\r\n\r\n"
    + b"data:  five (one space kept)\n\n"
    + b"id\nfoo: bar\ndata: six\r: comment inside\r\n\r"
    + b"\n\n"            # the LF of a CRLF, then an empty line with no data: no event
    + sse_event(token_event(1), b"\r\n")
    + b"data: [DONE]\r\r"
)
EXPECTED_DATA = [b"one", b"two\nlines", b"three", b"four", b" five (one space kept)", b"six", token_event(1),
                 b"[DONE]"]


def test_reference_reads_the_stream_as_intended() -> None:
    assert [d for d, _ in reference_events(DECODER_STREAM)] == EXPECTED_DATA


def decode(pieces: list[bytes]) -> list[tuple[float, bytes]]:
    got: list[tuple[float, bytes]] = []
    decoder = SSEDecoder(lambda now, data: got.append((now, data)))
    for i, piece in enumerate(pieces):
        decoder.feed(piece, float(i))
    return got


def expected_times(cuts: list[int]) -> list[tuple[float, bytes]]:
    """Each event at the index of the read holding the byte that completes it."""
    return [(float(sum(1 for c in cuts if c <= at)), data) for data, at in reference_events(DECODER_STREAM)]


def test_decoder_whole() -> None:
    assert decode([DECODER_STREAM]) == [(0.0, d) for d in EXPECTED_DATA]


def test_decoder_at_every_split_point() -> None:
    for cut in range(len(DECODER_STREAM) + 1):
        pieces = [DECODER_STREAM[:cut], DECODER_STREAM[cut:]]
        assert decode(pieces) == expected_times([cut]), cut


def test_decoder_byte_by_byte() -> None:
    pieces = [DECODER_STREAM[i: i + 1] for i in range(len(DECODER_STREAM))]
    assert decode(pieces) == expected_times(list(range(1, len(DECODER_STREAM))))


@pytest.mark.parametrize("seed", range(10))
def test_decoder_at_random_splits(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(DECODER_STREAM)), rng.randint(1, 12)))
        bounds = [0, *cuts, len(DECODER_STREAM)]
        pieces = [DECODER_STREAM[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        assert decode(pieces) == expected_times(cuts), cuts


def test_decoder_strips_a_leading_bom() -> None:
    # WHATWG: the stream is UTF-8 with one leading byte order mark stripped.
    assert decode([b"\xef\xbb\xbf" + sse_event(b"first") + sse_event(b"second")]) == [(0.0, b"first"),
                                                                                          (0.0, b"second")]
    assert decode([b"\xef\xbb", b"\xbf" + sse_event(b"first")]) == [(1.0, b"first")]


def test_decoder_many_events_under_the_limit() -> None:
    got = decode([b"".join(sse_event(b"x" * 100) for _ in range(100))])
    assert len(got) == 100
    decoder = SSEDecoder(lambda now, data: None, max_event_bytes=1024)
    decoder.feed(b"".join(sse_event(b"x" * 100) for _ in range(100)), 0.0)


# -- the pool never reuses a connection that carried more than its reply --------------------------------------


def test_bytes_after_a_reply_keep_that_connection_out_of_the_pool(arun: Runner[Any]) -> None:
    # A second, unrequested reply right behind the first one: reusing that connection would hand it to the
    # next request as its own.
    first = b"".join(data for _, data in sse_script(vllm_events(2)).writes)
    stray = b"".join(data for _, data in sse_script(vllm_events(7)).writes)
    with RawHTTPServer([Script.of(first + stray), sse_script(vllm_events(3))]) as server:
        records, opened = arun(complete(ep(server.url), 2))
    assert [r.tokens for r in records] == [2, 3]
    assert opened == 2


def test_closing_the_client_ends_a_request_in_flight_at_once(arun: Runner[Any]) -> None:
    script = Script.of(head(200, SSE_CHUNKED), chunk(sse([token_event(1)])), hang=True)

    async def run(url: str) -> tuple[RequestRecord, float]:
        async with new_client(ep(url, timeouts=Timeouts(idle_s=30))) as client:
            task = asyncio.create_task(stream_completion(client, model="m", prompt=[1], max_tokens=8,
                                                         request_id="r"))
            await asyncio.sleep(0.3)
            closed = time.perf_counter()
            await client.aclose()
            record = await task
            return record, time.perf_counter() - closed

    with RawHTTPServer([script]) as server:
        record, took = arun(run(server.url))
    assert not record.ok and record.error_kind == "closed" and "client was closed" in (record.error or "")
    assert took < 1.0


@pytest.mark.parametrize("steps", [0, 1])
def test_a_request_still_connecting_when_the_client_closes_is_never_sent(arun: Runner[Any], steps: int) -> None:
    """The test above once read a timeout after 30 s in a full suite: its request was still connecting when the
    client closed (a loaded host took over 0.3 s to connect), so no connection of it was there to close, and
    it went out afterwards on the closed client. Closed before the request ran (0 steps) or while it connects
    (1 step: it waits on the address lookup), it ends "closed" and reaches no server."""
    script = Script.of(head(200, SSE_CHUNKED), chunk(sse([token_event(1)])), hang=True)

    async def run(url: str) -> tuple[RequestRecord, int]:
        async with new_client(ep(url, timeouts=Timeouts(idle_s=5))) as client:
            task = asyncio.create_task(stream_completion(client, model="m", prompt=[1], max_tokens=8,
                                                         request_id="r"))
            for _ in range(steps):
                await asyncio.sleep(0)
            await client.aclose()
            return await task, len(client._all)

    with RawHTTPServer([script]) as server:
        record, left = arun(run(server.url))
        requests = len(server.requests)
    assert not record.ok and record.error_kind == "closed" and "client was closed" in (record.error or "")
    assert left == 0 and requests == 0


# -- the API key guards what vLLM's guards, no more -------------------------------------------------------------


def test_the_simulators_api_key_guards_only_the_paths_vllms_guards(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.32's AuthenticationMiddleware asks for the key only under /v1 (and /v2, /inference, /cohere): a
    simulator behind a key answers /tokenize, /detokenize and the dev mode's /reset_prefix_cache without it, and
    refuses /v1/completions."""
    monkeypatch.setenv("CAMPAIGN_SIM_TIME_SCALE", "20")
    monkeypatch.setenv("SIM_KEY", "sk-sim-test")
    profile, _ = load_profile("a5000-tp2")
    profile = profile.model_copy(update={"api_key_env": "SIM_KEY",
                                         "env": {**profile.env, "VLLM_SERVER_DEV_MODE": "1"}})
    with launched(profile, tmp_path / "server.log", engine="sim") as server:
        base = server.spec.base_url
        model = server.spec.served_model_name
        tokens = httpx.post(f"{base}/tokenize", json={"model": model, "prompt": "hello world"}, timeout=30)
        assert tokens.status_code == 200, tokens.text
        ids = tokens.json()["tokens"]
        text = httpx.post(f"{base}/detokenize", json={"model": model, "tokens": ids}, timeout=30)
        assert text.status_code == 200, text.text
        reset = httpx.post(f"{base}/reset_prefix_cache", timeout=30)
        assert reset.status_code == 200, reset.text
        body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 1}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=30).status_code == 401
        keyed = httpx.post(f"{base}/v1/completions", json=body, timeout=30,
                           headers={"Authorization": "Bearer sk-sim-test"})
        assert keyed.status_code == 200, keyed.text
