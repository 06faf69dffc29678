"""A raw-socket HTTP server for client conformance tests: it replays scripted bytes, write by write.

Each accepted request is read whole (head, then a Content-Length or chunked body) and recorded; the server then
replays a `Script`: a list of (delay_s, bytes) writes, each its own `sendall` on a socket with TCP_NODELAY (so
bytes written apart arrive apart), optionally closing the connection afterwards or keeping it open and silent.
Without `close` the server reads the next request on the same connection (keep-alive).

The server runs on threads (one to accept, one per connection), so a test can drive the client on its own
event loop (`asyncio.run`, uvloop) in the main thread. It binds 127.0.0.1 by default, or ::1, and speaks TLS
when given a server-side `ssl.SSLContext`. Use it as a context manager: leaving it closes every socket.

The builders below make replies: a status line and headers, chunked framing with chosen chunk boundaries,
SSE events with a chosen line ending, and vLLM-shaped /v1/completions token events.
"""

from __future__ import annotations

import itertools
import json
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

EOL = {"lf": b"\n", "crlf": b"\r\n", "cr": b"\r"}
REASONS = {100: "Continue", 103: "Early Hints", 200: "OK", 400: "Bad Request", 404: "Not Found", 500: "Error"}


@dataclass
class Script:
    """What the server does for one request: writes, then close, hang (stay open, say nothing) or keep-alive."""

    writes: list[tuple[float, bytes]] = field(default_factory=list)
    close: bool = False   # close the connection after the last write (an HTTP/1.0 reply's end, a dropped stream)
    hang: bool = False    # after the writes, stay silent until the client disconnects or the server stops
    close_notify: bool = True  # over TLS, `close` sends TLS close_notify first (False: a bare TCP close)

    @classmethod
    def of(cls, *parts: bytes, gap_s: float = 0.0, close: bool = False, hang: bool = False) -> Script:
        """Each part one write, `gap_s` after the previous one (the first at once)."""
        return cls([(gap_s if i else 0.0, p) for i, p in enumerate(parts)], close=close, hang=hang)


@dataclass
class Request:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]
    body: bytes
    connection: int     # 0-based index of the connection it arrived on
    received_t: float   # time.perf_counter() when it was read whole

    def header(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k.lower() == name.lower()]
        return ", ".join(values) if values else None

    def json(self) -> object:
        return json.loads(self.body)


class RawHTTPServer:
    """`with RawHTTPServer([script, ...]) as srv:` answers the n-th request with the n-th script (or with
    `scripts(request)` when given a callable). `srv.url` is its base URL; `srv.requests` what it received."""

    def __init__(self, scripts: Sequence[Script] | Callable[[Request], Script], *, host: str = "127.0.0.1",
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self._scripts = scripts if callable(scripts) else list(scripts)
        self._next = 0
        self.host = host
        self.ssl_context = ssl_context
        self.requests: list[Request] = []
        self.errors: list[str] = []               # scripting errors and unexpected server-side failures
        self.tls_failures: list[str] = []         # handshakes the client refused
        self.disconnects: list[tuple[int, float]] = []  # (connection, perf_counter) when a client went away
        # (connection, perf_counter) when the server turned to a scripted write, its delay over (or cut short by
        # stop): the moment it wrote, or would have; a loaded host stretches the delay, and this shows by how much
        self.turns: list[tuple[int, float]] = []
        self.connections = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, 0))
        self._listener.listen(64)
        self._listener.settimeout(0.05)
        self.port: int = self._listener.getsockname()[1]

    # -- lifecycle -----------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.ssl_context else 'http'}://{host}:{self.port}"

    def __enter__(self) -> RawHTTPServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        thread = threading.Thread(target=self._accept_loop, name=f"raw-http-{self.port}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            socks = list(self._socks)
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in list(self._threads):
            thread.join(timeout=5)
        for sock in socks:
            sock.close()
        self._listener.close()

    def wait_disconnect(self, timeout_s: float = 2.0) -> bool:
        """True once some client connection has gone away (EOF, reset or a failed write)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.disconnects:
                return True
            time.sleep(0.01)
        return bool(self.disconnects)

    # -- the server ------------------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except (TimeoutError, BlockingIOError):
                continue
            except OSError:
                return
            with self._lock:
                index = self.connections
                self.connections += 1
                self._socks.append(sock)
            thread = threading.Thread(target=self._serve, args=(sock, index), daemon=True,
                                      name=f"raw-http-{self.port}-{index}")
            self._threads.append(thread)
            thread.start()

    def _serve(self, sock: socket.socket, index: int) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn: socket.socket = sock
        try:
            if self.ssl_context is not None:
                sock.settimeout(5)
                try:
                    conn = self.ssl_context.wrap_socket(sock, server_side=True)
                except (ssl.SSLError, OSError) as exc:
                    self.tls_failures.append(str(exc))
                    return
                with self._lock:
                    self._socks.append(conn)
            conn.settimeout(0.05)
            buf = b""
            while not self._stop.is_set():
                got = self._read_request(conn, buf, index)
                if got is None:
                    return
                request, buf = got
                with self._lock:
                    self.requests.append(request)
                script = self._script_for(request)
                if script is None:
                    return
                if not self._play(conn, script, index):
                    return
                if script.close:
                    if isinstance(conn, ssl.SSLSocket) and script.close_notify:
                        conn.settimeout(1.0)
                        try:
                            conn = conn.unwrap()
                        except (ssl.SSLError, OSError):
                            pass
                    return
                if script.hang:
                    self._linger(conn, index)
                    return
        except Exception as exc:  # noqa: BLE001 - a test server: report, never crash the thread silently
            self.errors.append(f"connection {index}: {type(exc).__name__}: {exc}")
        finally:
            try:
                conn.close()
            except OSError:
                pass

    def _script_for(self, request: Request) -> Script | None:
        if callable(self._scripts):
            return self._scripts(request)
        with self._lock:
            if self._next >= len(self._scripts):
                self.errors.append(f"no script left for request {len(self.requests)} ({request.target})")
                return None
            script = self._scripts[self._next]
            self._next += 1
        return script

    def _recv(self, conn: socket.socket, index: int) -> bytes | None:
        """Some bytes, b"" on a timeout tick, None when the peer went away or the server stops."""
        while not self._stop.is_set():
            try:
                data = conn.recv(65536)
            except (TimeoutError, BlockingIOError, ssl.SSLWantReadError):
                return b""
            except OSError:
                self.disconnects.append((index, time.perf_counter()))
                return None
            if not data:
                self.disconnects.append((index, time.perf_counter()))
                return None
            return data
        return None

    def _fill(self, conn: socket.socket, buf: bytes, index: int, enough: Callable[[bytes], bool]) -> bytes | None:
        """Read into `buf` until `enough(buf)`; None if the client went away first."""
        while not enough(buf):
            data = self._recv(conn, index)
            if data is None:
                return None
            buf += data
        return buf

    def _read_request(self, conn: socket.socket, buf: bytes, index: int) -> tuple[Request, bytes] | None:
        filled = self._fill(conn, buf, index, lambda b: b"\r\n\r\n" in b)
        if filled is None:
            return None
        head, _, buf = filled.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ", 2)
        headers = [(k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)]
        lowered = {k.lower(): v for k, v in headers}
        if "chunked" in lowered.get("transfer-encoding", "").lower():
            body = b""
            while True:
                filled = self._fill(conn, buf, index, lambda b: b"\r\n" in b)
                if filled is None:
                    return None
                size_line, _, buf = filled.partition(b"\r\n")
                size = int(size_line.split(b";")[0], 16)
                filled = self._fill(conn, buf, index, lambda b, n=size + 2: len(b) >= n)
                if filled is None:
                    return None
                body, buf = body + filled[:size], filled[size + 2:]
                if size == 0:
                    break
        else:
            length = int(lowered.get("content-length", "0") or 0)
            filled = self._fill(conn, buf, index, lambda b: len(b) >= length)
            if filled is None:
                return None
            body, buf = filled[:length], filled[length:]
        return Request(method, target, version, headers, body, index, time.perf_counter()), buf

    def _play(self, conn: socket.socket, script: Script, index: int) -> bool:
        for delay, data in script.writes:
            stopped = delay > 0 and self._stop.wait(delay)
            self.turns.append((index, time.perf_counter()))
            if stopped:
                return False
            try:
                conn.sendall(data)
            except OSError:
                self.disconnects.append((index, time.perf_counter()))
                return False
        return True

    def silences(self, connection: int = 0) -> list[float]:
        """The seconds the server actually stayed silent on a connection: from its first request read whole to
        its first write, then between writes (see `turns`). A script's delays are what was asked; a loaded host
        may stretch them, and a client judged on its timeouts must be judged against these."""
        starts = [r.received_t for r in self.requests if r.connection == connection][:1]
        stamps = starts + [t for c, t in self.turns if c == connection]
        return [b - a for a, b in itertools.pairwise(stamps)]

    def _linger(self, conn: socket.socket, index: int) -> None:
        """Stay silent; note when the client goes away (it reads EOF or a reset)."""
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([conn], [], [], 0.05)
            except (OSError, ValueError):
                return
            if ready and self._recv(conn, index) is None:
                return


# -- reply builders ----------------------------------------------------------------------------------------


def head(status: int = 200, headers: Iterable[tuple[str, str]] = (), *, version: str = "HTTP/1.1",
         reason: str | None = None) -> bytes:
    """A status line and header block, ending in the empty line."""
    lines = [f"{version} {status} {reason if reason is not None else REASONS.get(status, 'Status')}"]
    lines += [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


SSE_CHUNKED = (("Content-Type", "text/event-stream"), ("Transfer-Encoding", "chunked"))


def chunk(data: bytes) -> bytes:
    """One chunk of chunked transfer coding (never the last one: `data` must not be empty)."""
    assert data, "an empty chunk is the last chunk: use LAST_CHUNK"
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


LAST_CHUNK = b"0\r\n\r\n"


def chunked(body: bytes, sizes: int | Sequence[int]) -> list[bytes]:
    """`body` as chunk frames of the given sizes (an int: all that size; a list: cycled), without the last chunk."""
    pattern = [sizes] if isinstance(sizes, int) else list(sizes)
    frames, pos, i = [], 0, 0
    while pos < len(body):
        size = pattern[i % len(pattern)]
        frames.append(chunk(body[pos: pos + size]))
        pos += size
        i += 1
    return frames


def sse_event(data: bytes, eol: bytes = b"\n", *, fields: Sequence[bytes] = (), space: bool = True) -> bytes:
    """One event: `fields` lines first (e.g. b"event: x", b": comment"), then one data line per line of `data`,
    then the empty line. `space=False` writes `data:x`."""
    sep = b"data: " if space else b"data:"
    lines = list(fields) + [sep + line for line in data.split(b"\n")]
    return eol.join(lines) + eol + eol


def sse(events: Iterable[bytes], eol: bytes = b"\n") -> bytes:
    return b"".join(sse_event(e, eol) for e in events)


def token_event(completion_tokens: int | None, *, text: str = " tok", prompt_tokens: int = 6,
                request_id: str = "cmpl-test") -> bytes:
    """A vLLM /v1/completions stream chunk; with continuous usage stats when `completion_tokens` is given."""
    event: dict[str, object] = {"id": request_id, "object": "text_completion", "created": 1, "model": "m",
                                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]}
    if completion_tokens is not None:
        event["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}
    return json.dumps(event, separators=(",", ":")).encode()


def usage_event(completion_tokens: int, *, prompt_tokens: int = 6, request_id: str = "cmpl-test") -> bytes:
    """The final chunk of `include_usage`: no choices, the whole request's usage."""
    return json.dumps({"id": request_id, "object": "text_completion", "created": 1, "model": "m", "choices": [],
                       "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                 "total_tokens": prompt_tokens + completion_tokens}},
                      separators=(",", ":")).encode()


DONE = b"[DONE]"


def vllm_events(tokens: int, *, continuous_usage: bool = True, per_chunk: int = 1) -> list[bytes]:
    """The data fields of a streamed completion of `tokens` tokens, `per_chunk` to a chunk (speculative decoding
    puts several in one): token chunks, the final usage chunk, [DONE]."""
    events, done = [], 0
    while done < tokens:
        step = min(per_chunk, tokens - done)
        done += step
        events.append(token_event(done if continuous_usage else None, text=" tok" * step))
    return events + [usage_event(tokens), DONE]


def sse_script(events: Sequence[bytes], *, eol: bytes = b"\n", per_write: int = 1, gap_s: float = 0.0,
               framing: str = "chunked", headers: Iterable[tuple[str, str]] = (), status: int = 200,
               version: str = "HTTP/1.1") -> Script:
    """A streamed reply: the head as one write, then `per_write` events per write, `gap_s` apart.

    framing: "chunked" (one chunk per write, then the last chunk), "length" (Content-Length: the whole body), or
    "close" (no length, no chunking: the body ends when the server closes the connection, as in HTTP/1.0)."""
    bodies = [sse(events[i: i + per_write], eol) for i in range(0, len(events), per_write)]
    base = [("Content-Type", "text/event-stream")]
    if framing == "chunked":
        base.append(("Transfer-Encoding", "chunked"))
        parts = [chunk(b) for b in bodies]
        parts[-1] += LAST_CHUNK
    elif framing == "length":
        base.append(("Content-Length", str(sum(map(len, bodies)))))
        parts = bodies
    elif framing == "close":
        parts = bodies
    else:
        raise ValueError(framing)
    writes = [(0.0, head(status, [*base, *headers], version=version))]
    writes += [(gap_s if i else 0.0, p) for i, p in enumerate(parts)]
    return Script(writes, close=framing == "close")


def json_script(status: int, body: bytes | Mapping[str, object], *, content_type: str = "application/json",
                headers: Iterable[tuple[str, str]] = ()) -> Script:
    """A whole reply with Content-Length, in one write."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return Script([(0.0, head(status, [("Content-Type", content_type), ("Content-Length", str(len(raw))),
                                       *headers]) + raw)])
