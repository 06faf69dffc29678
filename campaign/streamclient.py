"""The measured path's HTTP client: HTTP/1.1 over asyncio protocols, parsing the stream as it arrives.

Why not httpx here: `make bench-client` measured plain httpx streaming at 13,300 chunks/s over 256 streams on
one core (aiohttp 73,000), and at 256 streams paced at 10 ms it received 25% of the offered tokens with a p99
added delay of 145 ms: a tool built on it would report a fraction of an H200's throughput. Each read of a
protocol here costs one callback: the bytes are timestamped the moment the event loop hands them over, the
chunked framing and the SSE events are split in place, and the only JSON work per event is finding the
cumulative `completion_tokens`. httpx stays for the control plane (health, /metrics, /v1/models).

Connections are kept alive and reused, one request at a time each, like a pool without limits.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit


class StreamError(Exception):
    """A transport failure of one request (connection refused or lost, timeout)."""


class _Exchange:
    """One request/response on a connection: feeds events to `on_event(now, payload)` as they arrive."""

    def __init__(self, on_event: Callable[[float, bytes], None]) -> None:
        self.on_event = on_event
        self.status: int | None = None
        self.body = bytearray()          # a non-streamed body (errors): kept whole
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.keep_alive = True
        self._head = bytearray()
        self._chunked = False
        self._remaining = -1             # bytes left of a content-length body or of the current chunk
        self._pending = b""              # unparsed chunked framing
        self._sse = b""                  # unparsed SSE text
        self._streaming = False

    def feed(self, data: bytes, now: float) -> None:
        if self.status is None:
            self._head += data
            cut = self._head.find(b"\r\n\r\n")
            if cut < 0:
                return
            head, data = bytes(self._head[:cut]), bytes(self._head[cut + 4:])
            lines = head.split(b"\r\n")
            self.status = int(lines[0].split(b" ", 2)[1])
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name, value = name.strip().lower(), value.strip().lower()
                if name == b"transfer-encoding" and b"chunked" in value:
                    self._chunked = True
                elif name == b"content-length":
                    self._remaining = int(value)
                elif name == b"connection" and value == b"close":
                    self.keep_alive = False
                elif name == b"content-type" and value.startswith(b"text/event-stream"):
                    self._streaming = True
            if not self._chunked and self._remaining <= 0:
                self._finish()
                return
        if self._chunked:
            self._feed_chunked(data, now)
        else:
            take = data[: self._remaining]
            self._payload(take, now)
            self._remaining -= len(take)
            if self._remaining <= 0:
                self._finish()

    def _feed_chunked(self, data: bytes, now: float) -> None:
        buf = self._pending + data if self._pending else data
        pos = 0
        while pos < len(buf):
            if self._remaining > 0:
                take = buf[pos: pos + self._remaining]
                self._payload(take, now)
                self._remaining -= len(take)
                pos += len(take)
                if self._remaining == 0:
                    self._remaining = -2  # the CRLF after the chunk's data
                continue
            if self._remaining == -2:
                if len(buf) - pos < 2:
                    break
                pos += 2
                self._remaining = -1
                continue
            line_end = buf.find(b"\r\n", pos)
            if line_end < 0:
                break
            if self._remaining == -3:
                # After the last chunk: optional trailer lines, then an empty line. The response is over only
                # when that is read, or its CRLF would reach the next response on this kept-alive connection.
                empty = line_end == pos
                pos = line_end + 2
                if empty:
                    self._pending = b""
                    self._finish()
                    return
                continue
            size = int(buf[pos:line_end].split(b";", 1)[0], 16)
            pos = line_end + 2
            if size == 0:
                self._remaining = -3
                continue
            self._remaining = size
        self._pending = buf[pos:]

    def _payload(self, data: bytes, now: float) -> None:
        if not self._streaming or self.status != 200:
            self.body += data
            return
        buf = self._sse + data if self._sse else data
        start = 0
        while True:
            cut = buf.find(b"\n\n", start)
            if cut < 0:
                break
            self.on_event(now, buf[start:cut])
            start = cut + 2
        self._sse = buf[start:]

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def fail(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc)


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.exchange: _Exchange | None = None
        self.closed = False
        self.last_activity = time.monotonic()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()  # the arrival time of everything in this read
        self.last_activity = time.monotonic()
        if self.exchange is not None:
            self.exchange.feed(data, now)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.exchange is not None:
            self.exchange.fail(StreamError(f"connection lost: {exc or 'closed by the server'}"))

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class StreamClient:
    """`async with StreamClient(base_url) as client: await client.post_stream(path, body, on_event)`."""

    def __init__(self, base_url: str, *, api_key: str | None = None, connect_timeout_s: float = 10.0,
                 read_timeout_s: float = 600.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http":
            raise ValueError(f"{base_url}: the streaming client speaks plain http (the servers it measures do)")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.api_key = api_key
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._idle: list[_Connection] = []
        self._all: set[_Connection] = set()

    async def __aenter__(self) -> StreamClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for conn in list(self._all):
            conn.close()
        self._all.clear()
        self._idle.clear()

    async def _connection(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(_Connection, self.host, self.port), self.connect_timeout_s)
        except (OSError, TimeoutError) as exc:
            raise StreamError(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        self._all.add(conn)
        return conn

    async def post_stream(self, path: str, body: dict[str, Any],
                          on_event: Callable[[float, bytes], None]) -> tuple[int, bytes]:
        """Send one POST; events of a 200 SSE response go to `on_event`; returns (status, non-SSE body)."""
        payload = json.dumps(body, separators=(",", ":")).encode()
        auth = f"Authorization: Bearer {self.api_key}\r\n" if self.api_key else ""
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\n{auth}Content-Length: {len(payload)}\r\n\r\n").encode()
        conn = await self._connection()
        exchange = _Exchange(on_event)
        conn.exchange = exchange
        assert conn.transport is not None
        conn.transport.write(head + payload)
        conn.last_activity = time.monotonic()
        try:
            while True:
                try:
                    await asyncio.wait_for(asyncio.shield(exchange.done), self.read_timeout_s)
                    break
                except TimeoutError:
                    # An idle timeout, not a total one: a long reply that keeps streaming is fine.
                    if time.monotonic() - conn.last_activity >= self.read_timeout_s:
                        raise StreamError(f"no data for {self.read_timeout_s:.0f} s") from None
        except BaseException:
            conn.close()  # cancelled or failed: the server sees the disconnect and aborts the request
            self._all.discard(conn)
            raise
        conn.exchange = None
        if exchange.keep_alive and not conn.closed:
            self._idle.append(conn)
        else:
            conn.close()
            self._all.discard(conn)
        assert exchange.status is not None
        return exchange.status, bytes(exchange.body)
