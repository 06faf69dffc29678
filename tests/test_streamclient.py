"""The streaming client's HTTP/1.1 parsing: chunked framing and SSE events split at any byte boundary."""

from __future__ import annotations

import asyncio
import random

import pytest

from campaign.streamclient import _Exchange


def chunked_response(events: list[bytes], *, split: int = 3) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    body = b""
    payload = b"".join(b"data: " + e + b"\n\n" for e in events)
    # Chunk boundaries deliberately fall inside events.
    for i in range(0, len(payload), split * 7 + 1):
        part = payload[i: i + split * 7 + 1]
        body += f"{len(part):x}\r\n".encode() + part + b"\r\n"
    return head + body + b"0\r\n\r\n"


@pytest.mark.parametrize("seed", range(20))
def test_events_survive_any_read_boundaries(seed: int) -> None:
    events = [b'{"usage":{"completion_tokens":%d}}' % i for i in range(1, 40)] + [b"[DONE]"]
    wire = chunked_response(events, split=seed % 5 + 1)
    rng = random.Random(seed)

    async def run() -> list[bytes]:
        seen: list[bytes] = []
        exchange = _Exchange(lambda now, event: seen.append(event))
        pos = 0
        while pos < len(wire):
            step = rng.randint(1, 40)
            exchange.feed(wire[pos: pos + step], float(pos))
            pos += step
        assert exchange.done.done() and exchange.status == 200
        return seen

    assert asyncio.run(run()) == [b"data: " + e for e in events]


def test_error_body_with_content_length() -> None:
    body = b'{"error":{"message":"This model\'s maximum context length is 2048 tokens."}}'
    wire = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)

    async def run() -> _Exchange:
        exchange = _Exchange(lambda now, event: None)
        exchange.feed(wire[:10], 0.0)
        exchange.feed(wire[10:], 0.0)
        return exchange

    exchange = asyncio.run(run())
    assert exchange.status == 400 and bytes(exchange.body) == body and exchange.done.done()
