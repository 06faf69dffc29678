"""The measured path's HTTP client: HTTP/1.1 (and 1.0 replies) over asyncio protocols, SSE split as it arrives.

Why not httpx here: `make bench-client` measured plain httpx streaming at 13,300 chunks/s over 256 streams on
one core (aiohttp 73,000), and at 256 streams paced at 10 ms it received 25% of the offered tokens with a p99
added delay of 145 ms: a tool built on it would report a fraction of an H200's throughput. Each socket read
here costs one protocol callback, timestamped the moment the event loop hands the bytes over (one timestamp
per read: events that arrive together share it).

What the specs allow, and this client therefore handles (each case has a raw-socket test):
- Framing by llhttp (through `httptools`, the parser under uvicorn): chunked, Content-Length, bodies delimited
  by the server closing (HTTP/1.0, or 1.1 without either), `Connection` token lists, 1xx replies (100 Continue,
  103 Early Hints) skipped, Content-Length together with Transfer-Encoding refused as a protocol error.
- Server-sent events as the WHATWG HTML spec defines them: LF, CRLF or CR line ends (a CR ending one read and
  its LF starting the next), multi-line `data:`, comments, `event:`/`id:`/`retry:` fields.
- `Accept-Encoding: identity` is sent; gzip or deflate is decoded if a server sends it anyway; anything else is
  an error naming the encoding. A 200 that is not `text/event-stream` is an error saying what arrived.
- Limits on the header block, one SSE event and an error body; a growing buffer is never re-scanned.
- Timeouts: connect, first byte, idle between reads; each fires at its value and names itself.
- https with the endpoint's TLS context; several addresses per name raced with happy eyeballs (RFC 8305).

Connections are kept alive and reused, one request at a time each; one that cannot be reused is closed.

Long (about 550 lines): one HTTP/1.1 client, from the socket up (happy eyeballs, TLS, chunked SSE,
the three timeouts, keep-alive); its parts share one connection's state and are read together.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import zlib
from asyncio.staggered import staggered_race
from collections.abc import Callable
from functools import partial
from typing import Any, cast

import httptools

from campaign.core import clock
from campaign.http.endpoint import Endpoint, Timeouts
from campaign.http.streams import Limits, Liveness, Reply, StreamError, StreamTimeout

HAPPY_EYEBALLS_DELAY_S = 0.25  # RFC 8305's recommended connection attempt delay
# A connection idle longer than this is not reused: uvicorn (vLLM's server) closes idle connections after 5 s,
# and a request sent just as the server closes would fail through no fault of the server under test.
POOL_IDLE_S = 2.0
# A connection that has carried no request yet (open_idle's) is kept this long: uvicorn starts its keep-alive
# timer only once a response is complete. Under a CPU-starved client, a 128-request burst took over 2 s of
# wall time to send, so its last sends found their pre-opened connections "stale", closed them and made a TLS
# handshake each, inside the burst (the real CPU build's overload burst, two CPU hogs and three test workers).
UNUSED_IDLE_S = 30.0


_BOM = b"\xef\xbb\xbf"


def _kib(n: int) -> str:
    return f"{n / 1024:,.0f} KiB" if n < 1024 * 1024 else f"{n / 1024 / 1024:,.1f} MiB"


class SSEDecoder:
    """WHATWG event-stream parsing. `on_event(now, data)` gets each event's data (lines joined by LF).

    Each byte is scanned once: a line cut by a read boundary is kept in parts and joined when its end arrives."""

    __slots__ = ("on_event", "max_event_bytes", "events", "_parts", "_part_len", "_data", "_data_len", "_skip_lf",
                 "_head")

    def __init__(self, on_event: Callable[[float, bytes], None], *, max_event_bytes: int = 4 * 1024 * 1024) -> None:
        self.on_event = on_event
        self.max_event_bytes = max_event_bytes
        self.events = 0
        self._parts: list[bytes] = []   # the unfinished line
        self._part_len = 0
        self._data: list[bytes] = []    # data lines of the event being built
        self._data_len = 0
        self._skip_lf = False           # the previous read ended in CR: an LF starting this one belongs to it
        self._head: bytes | None = b""  # the stream's first bytes until a leading BOM is ruled out; then None

    def feed(self, data: bytes, now: float) -> None:
        if not data:  # (a decompressor may yield nothing yet) must not clear the pending-CR state
            return
        if self._head is not None:  # the spec strips one leading UTF-8 byte order mark
            data = self._head + data
            if len(data) < len(_BOM) and _BOM.startswith(data):
                self._head = data
                return
            self._head = None
            if data.startswith(_BOM):
                data = data[len(_BOM):]
        if self._skip_lf:
            self._skip_lf = False
            if data[:1] == b"\n":
                data = data[1:]
        if b"\r" in data:
            self._skip_lf = data.endswith(b"\r")
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        start = 0
        find = data.find
        while True:
            end = find(b"\n", start)
            if end < 0:
                break
            if self._parts:
                self._parts.append(data[start:end])
                line = b"".join(self._parts)
                self._parts.clear()
                self._part_len = 0
            else:
                line = data[start:end]
            start = end + 1
            self._line(line, now)
        if start < len(data):
            rest = data[start:]
            self._parts.append(rest)
            self._part_len += len(rest)
            self._check(self._part_len)

    def _check(self, pending: int) -> None:
        if self._data_len + pending > self.max_event_bytes:
            raise StreamError("limit", f"one server-sent event exceeds {_kib(self.max_event_bytes)} "
                                       "(Limits.event_bytes); the stream was abandoned")

    def _line(self, line: bytes, now: float) -> None:
        if not line:
            if self._data:
                data = self._data[0] if len(self._data) == 1 else b"\n".join(self._data)
                self._data = []
                self._data_len = 0
                self.events += 1
                self.on_event(now, data)
            return
        if line[0] == 0x3A:  # ":" a comment (keep-alive pings)
            return
        colon = line.find(b":")
        if colon < 0:
            name, value = line, b""
        else:
            name, value = line[:colon], line[colon + 1:]
            if value[:1] == b" ":
                value = value[1:]
        if name == b"data":
            self._data.append(value)
            self._data_len += len(value) + 1
            self._check(0)
        # event, id, retry and unknown fields carry nothing a completion stream needs: ignored, per the spec.


class _Decompressor:
    def __init__(self, encoding: str) -> None:
        self.encoding = encoding
        self._z: Any = zlib.decompressobj(16 + zlib.MAX_WBITS) if encoding in {"gzip", "x-gzip"} else None

    def feed(self, data: bytes) -> bytes:
        if self._z is None:  # deflate: zlib-wrapped as RFC 9110 says, or raw as some servers send it
            self._z = zlib.decompressobj(zlib.MAX_WBITS if data[:1] and data[0] & 0x0F == 8 else -zlib.MAX_WBITS)
        try:
            return cast(bytes, self._z.decompress(data))
        except zlib.error as exc:
            raise StreamError("encoding", f"the {self.encoding} body does not decode: {exc}") from None


class _Exchange:
    """One request and its reply on a connection (httptools calls the on_* methods)."""

    def __init__(self, conn: _Connection, on_event: Callable[[float, bytes], None], limits: Limits,
                 timeouts: Timeouts, sent_at: float, liveness: Liveness) -> None:
        self.conn = conn
        self.liveness = liveness
        self.limits = limits
        self.timeouts = timeouts
        self.loop = asyncio.get_running_loop()
        self.done: asyncio.Future[Reply] = self.loop.create_future()
        self.parser = httptools.HttpResponseParser(self)
        self.sse = SSEDecoder(on_event, max_event_bytes=limits.event_bytes)
        self.sent_at = sent_at
        self.last_read = sent_at
        self.got_bytes = 0
        self.now = sent_at
        self._new_message()
        self.final = False          # the final (non-1xx) reply has begun
        self.final_done = False
        self.keep_alive = True
        self.failed: BaseException | None = None
        self._timer: asyncio.TimerHandle | None = self.loop.call_later(timeouts.first_byte_s, self._on_timer)

    def _new_message(self) -> None:
        self.status = 0
        self.headers_done = False
        self.head_bytes = 0
        self.header_total = 0
        self.content_type: str | None = None
        self.encoding: str | None = None
        self.framed = False          # Content-Length or chunked; otherwise the body ends when the server closes
        self.streaming = False
        self.body = bytearray()
        self.decoder: _Decompressor | None = None

    # --- timers: one handle, re-armed only when it fires early, so a read costs no timer work -------------
    def _on_timer(self) -> None:
        self._timer = None
        if self.done.done():
            return
        # Before the first byte the first-byte limit runs from the send; after it, the idle one from the last read
        # of this stream or of any other of the client (Liveness: a queued request waits while the server works).
        now = clock.now()
        if self.got_bytes == 0:
            limit, waited = self.timeouts.first_byte_s, now - self.sent_at
            if waited < limit:
                self._timer = self.loop.call_later(limit - waited, self._on_timer)
            else:
                self._time_out("first_byte", waited, f"first-byte timeout: no reply {waited:.1f} s after the "
                                                     f"request was sent (limit {limit:g} s)")
            return
        due = self.liveness.idle(self.last_read, now, self.sse.events, self.timeouts.idle_s)
        if isinstance(due, StreamTimeout):
            self.fail(due)
            self.conn.close()
        else:
            self._timer = self.loop.call_later(due, self._on_timer)

    def _time_out(self, which: str, after_s: float, message: str) -> None:
        self.fail(StreamTimeout(which, after_s, message))
        self.conn.close()

    # --- bytes in ----------------------------------------------------------------------------------------
    def feed(self, data: bytes, now: float) -> None:
        if self.got_bytes == 0 and self._timer is not None:
            self._timer.cancel()
            self._timer = self.loop.call_later(self.timeouts.idle_s, self._on_timer)
        self.got_bytes += len(data)
        self.last_read = now
        self.liveness.touch(now)
        self.now = now
        if not self.headers_done:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.final_done:
                return  # bytes after the reply: the connection is not reused (keep_alive was cleared)
            error = self.failed or exc.__context__
            if not isinstance(error, StreamError):
                error = StreamError("protocol", f"malformed HTTP reply: {exc}")
            self.fail(error)
            self.conn.close()
            return
        if self.final and self.headers_done and self.status == 200 and not self.streaming:
            # Said at once, with what arrived in this read: such a body may be large, or never end.
            self.fail(self._not_an_event_stream())
            self.conn.close()
            return
        if not self.headers_done and self.head_bytes > self.limits.header_bytes:
            self.fail(StreamError("limit", f"the reply's header block exceeds {_kib(self.limits.header_bytes)} "
                                           "(Limits.header_bytes)"))
            self.conn.close()

    def eof(self, exc: BaseException | None) -> None:
        """The connection closed: the end of a close-delimited body, or a failure."""
        if self.done.done():
            return
        if self.final and self.headers_done and not self.framed and exc is None:
            self.keep_alive = False
            try:
                self.on_message_complete()
            except StreamError as error:
                self.fail(error)
            return
        where = ("before any reply" if self.got_bytes == 0 else
                 "in the middle of the reply's headers" if not self.headers_done else
                 f"in the middle of the reply's body, after {self.sse.events} event(s)")
        if isinstance(exc, ssl.SSLError):
            self.fail(StreamError("tls", f"TLS error {where}: {exc}"))
        else:
            self.fail(StreamError("closed", f"the server closed the connection {where}"
                                            + (f" ({exc})" if exc else "")))

    # --- httptools callbacks -----------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.final_done:
            self.keep_alive = False
            raise StreamError("protocol", "bytes after the end of the reply")

    def on_header(self, name: bytes, value: bytes) -> None:
        # Raw bytes are counted per read too; this catches a block that arrives whole in one read.
        self.header_total += len(name) + len(value) + 4
        if self.header_total > self.limits.header_bytes:
            raise StreamError("limit", f"the reply's header block exceeds {_kib(self.limits.header_bytes)} "
                                       "(Limits.header_bytes)")
        lname = name.lower()
        if lname == b"content-type":
            self.content_type = value.decode("latin-1").strip()
        elif lname == b"content-encoding":
            self.encoding = value.decode("latin-1").strip().lower()
        elif lname == b"content-length" or (lname == b"transfer-encoding" and b"chunked" in value.lower()):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.headers_done = True
        self.status = self.parser.get_status_code()
        if 100 <= self.status < 200:
            if self.status == 101:
                raise StreamError("protocol", "the server switched protocols (101): not an HTTP reply")
            return  # 100 Continue, 103 Early Hints: the real reply follows
        self.final = True
        if self.encoding not in (None, "", "identity"):
            if self.encoding not in {"gzip", "x-gzip", "deflate"}:
                raise StreamError("encoding", f"the server sent Content-Encoding: {self.encoding}, which this "
                                              "client does not decode (it asked for identity)")
            self.decoder = _Decompressor(self.encoding)
        media = (self.content_type or "").split(";", 1)[0].strip().lower()
        self.streaming = self.status == 200 and media == "text/event-stream"

    def on_body(self, data: bytes) -> None:
        if not self.final:
            return
        if self.decoder is not None:
            data = self.decoder.feed(data)
        if self.streaming:
            self.sse.feed(data, self.now)
            return
        if self.status == 200:  # not an event stream: keep a preview for the error, whatever its size
            self.body += data[: max(0, _PREVIEW - len(self.body))]
            return
        self.body += data
        if len(self.body) > self.limits.error_body_bytes:
            raise StreamError("limit", f"HTTP {self.status} reply body exceeds {_kib(self.limits.error_body_bytes)} "
                                       f"(Limits.error_body_bytes); it began: {_preview(bytes(self.body))}")

    def on_message_complete(self) -> None:
        if not self.final:
            self._new_message()  # a 1xx reply ended; the real one follows on the same connection
            return
        if self.status == 200 and not self.streaming:
            raise self._not_an_event_stream()
        self.final_done = True
        self.keep_alive = self.keep_alive and self.framed and bool(self.parser.should_keep_alive())
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.done.done():
            self.done.set_result(Reply(
                status=self.status, content_type=self.content_type, body=bytes(self.body), events=self.sse.events,
                http_version=self.parser.get_http_version(), keep_alive=self.keep_alive, sent_t=self.sent_at))

    def _not_an_event_stream(self) -> StreamError:
        return StreamError("not-event-stream", f"HTTP 200 with Content-Type {self.content_type or '(none)'}, not an "
                                               f"event stream; it began: {_preview(bytes(self.body))}")

    def fail(self, exc: BaseException) -> None:
        self.failed = exc
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.done.done():
            self.done.set_exception(exc)


_PREVIEW = 200


def _preview(body: bytes) -> str:
    text = body[:_PREVIEW].decode("utf-8", "replace").strip()
    return repr(text) if text else "(empty body)"


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.exchange: _Exchange | None = None
        self.closed = False
        self.closing_by_us = False
        self.idle_since = 0.0
        self.used = False      # has carried a request: the server's keep-alive timer may be running

    @property
    def idle_limit_s(self) -> float:
        return POOL_IDLE_S if self.used else UNUSED_IDLE_S

    def reusable(self, now: float) -> bool:
        """Open, and idle for less than its limit: a request sent on it will not meet the server's close."""
        return not self.closed and now - self.idle_since < self.idle_limit_s

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # asyncio's and uvloop's transports both implement the Transport interface (uvloop's are not subclasses).
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        now = clock.now()  # the arrival time of everything in this read
        exchange = self.exchange
        if exchange is None:
            self.close()  # bytes nobody asked for: this connection can no longer be trusted
            return
        exchange.feed(data, now)

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        exchange = self.exchange
        if exchange is not None and not self.closing_by_us:
            exchange.eof(exc)

    def close(self) -> None:
        self.closing_by_us = True
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _interleave(infos: list[Any]) -> list[Any]:
    """RFC 8305: alternate address families, first family first."""
    by_family: dict[int, list[Any]] = {}
    for info in infos:
        by_family.setdefault(info[0], []).append(info)
    queues = list(by_family.values())
    out: list[Any] = []
    while any(queues):
        for queue in queues:
            if queue:
                out.append(queue.pop(0))
    return out


class StreamClient:
    """`async with StreamClient(endpoint) as client: await client.post_stream(path, body, on_event)`."""

    def __init__(self, endpoint: Endpoint, *, limits: Limits | None = None) -> None:
        self.endpoint = endpoint
        self.limits = limits or Limits()
        self.connections_opened = 0
        self.liveness = Liveness()   # when any of its streams last got data (the idle limit reads it)
        self._ssl = endpoint.ssl_context()
        self._idle: list[_Connection] = []
        self._all: set[_Connection] = set()
        # Set by aclose: a request still connecting then (its connection not yet in _all) must not go out after.
        self._closed = False
        auth = f"Authorization: Bearer {endpoint.api_key}\r\n" if endpoint.api_key else ""
        self._head_template = (
            "POST {target} HTTP/1.1\r\nHost: " + endpoint.host_header + "\r\nContent-Type: application/json\r\n"
            "Accept: text/event-stream\r\nAccept-Encoding: identity\r\nUser-Agent: vllm-campaign\r\n" + auth
            + "Content-Length: {length}\r\n\r\n")

    async def __aenter__(self) -> StreamClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._closed = True
        for conn in list(self._all):
            if conn.exchange is not None:  # a request still in flight ends now, and says why
                conn.exchange.fail(StreamError("closed", "the client was closed with the request in flight"))
            conn.close()
        self._all.clear()
        self._idle.clear()

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        ep = self.endpoint
        if ep.uds is not None:
            uds = ep.uds

            async def connect() -> _Connection:
                _, conn = await loop.create_unix_connection(
                    _Connection, uds, ssl=self._ssl, server_hostname=ep.host if self._ssl else None)
                return conn
        else:
            try:
                infos = await loop.getaddrinfo(ep.host, ep.port, type=socket.SOCK_STREAM)
            except OSError as exc:
                raise StreamError("connect", f"cannot resolve {ep.host}: {exc}") from None
            addresses = _interleave(infos)
            errors: list[BaseException] = []

            async def attempt(info: Any) -> socket.socket:
                family, type_, proto, _, address = info
                sock = socket.socket(family, type_, proto)
                try:
                    sock.setblocking(False)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    await loop.sock_connect(sock, address)
                    return sock
                except BaseException as exc:
                    sock.close()
                    errors.append(exc)
                    raise

            async def connect() -> _Connection:
                racers = [partial(attempt, info) for info in addresses]
                sock, _, _ = await staggered_race(racers, HAPPY_EYEBALLS_DELAY_S)
                if sock is None:
                    raise errors[-1] if errors else OSError("no address")
                _, conn = await loop.create_connection(
                    _Connection, sock=sock, ssl=self._ssl, server_hostname=ep.host if self._ssl else None)
                return conn

        started = clock.now()
        try:
            conn = await asyncio.wait_for(connect(), ep.timeouts.connect_s)
        except TimeoutError:
            # uvloop's millisecond timer can fire a fraction of a millisecond early against perf_counter.
            waited = max(clock.now() - started, ep.timeouts.connect_s)
            raise StreamTimeout("connect", waited, f"connect timeout: no connection to {ep.host_header} after "
                                                   f"{waited:.1f} s (limit {ep.timeouts.connect_s:g} s)") from None
        except ssl.SSLError as exc:
            raise StreamError("tls", f"TLS handshake with {ep.host_header} failed: {exc}") from None
        except OSError as exc:
            raise StreamError("connect", f"cannot connect to {ep.host_header}: {exc.strerror or exc}") from None
        self.connections_opened += 1
        if self._closed:
            # Closed while this connection was being made (a loaded host took over 0.3 s to connect): the
            # request ends now, as one in flight does, instead of going out on a closed client.
            conn.close()
            raise StreamError("closed", "the client was closed with the request in flight")
        self._all.add(conn)
        return conn

    async def open_idle(self, count: int) -> None:
        """Open connections until `count` stand idle and fresh, so that as many requests sent next only write:
        a burst meant to arrive at once (study.py) is not spread by its own connects (a TLS handshake each, on
        a client host short of CPU, spread 128 sends over 2.4 s against the real CPU build). Idle connections
        that have carried a request are closed first, never counted: they live POOL_IDLE_S, so one that was
        fresh here could expire before the burst's first send, and `_connection` would then drop every such
        one and connect anew for each send after it (a repeated burst on a loaded host counted its 128
        returned connections fresh, found them 2 s old a moment later, and sent 127 requests over 2.9 s with a
        handshake each)."""
        now = clock.now()
        keep: list[_Connection] = []
        for conn in self._idle:
            if conn.used or not conn.reusable(now):
                conn.close()
                self._all.discard(conn)
            else:
                keep.append(conn)
        self._idle[:] = keep
        opened = await asyncio.gather(*(self._connect() for _ in range(count - len(keep))))
        now = clock.now()
        for conn in opened:
            conn.idle_since = now
            self._idle.append(conn)

    async def _connection(self) -> _Connection:
        if self._closed:
            raise StreamError("closed", "the client was closed before the request was sent")
        while self._idle:
            conn = self._idle.pop()
            if conn.reusable(clock.now()):
                return conn
            conn.close()
            self._all.discard(conn)
        return await self._connect()

    async def post_stream(self, path: str, body: dict[str, Any],
                          on_event: Callable[[float, bytes], None]) -> Reply:
        """Send one POST; events of a 200 SSE reply go to `on_event`; returns the Reply (non-SSE body kept)."""
        payload = json.dumps(body, separators=(",", ":")).encode()
        head = self._head_template.format(target=self.endpoint.target(path), length=len(payload)).encode("latin-1")
        conn = await self._connection()
        exchange = _Exchange(conn, on_event, self.limits, self.endpoint.timeouts, clock.now(), self.liveness)
        conn.exchange = exchange
        conn.used = True
        assert conn.transport is not None
        conn.transport.write(head + payload)
        try:
            reply = await exchange.done
        except BaseException as exc:
            # Cancelled or failed: closing tells the server to abort the request; nothing else awaits `done`.
            exchange.fail(exc if isinstance(exc, StreamError) else StreamError("closed", "cancelled by the client"))
            if exchange.done.done() and not exchange.done.cancelled():
                exchange.done.exception()  # mark retrieved
            conn.exchange = None
            conn.close()
            self._all.discard(conn)
            raise
        conn.exchange = None
        # exchange.keep_alive, not only reply.keep_alive: bytes after the reply may arrive before we resume here.
        if reply.keep_alive and exchange.keep_alive and not conn.closed:
            conn.idle_since = clock.now()
            self._idle.append(conn)
        else:
            conn.close()
            self._all.discard(conn)
        return reply
