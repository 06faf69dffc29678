"""A streaming reverse proxy that changes one thing about how replies look on the wire, for end-to-end tests.

    python tests/fakes/sse_proxy.py --upstream http://127.0.0.1:8000 --port 0 \
        [--prefix /p] [--line-ending lf|crlf|cr] [--http10] [--tls-cert F --tls-key F]

Every request (any method, any path) is forwarded to the upstream over HTTP/1.1 (one upstream connection per
client connection, kept alive while the upstream allows), and the reply is streamed back as it arrives: each
piece the upstream sends is written on at once, never buffered, or the proxy would distort what it is used to
measure. What changes, one option at a time:

- `--line-ending crlf|cr`: the line ends of text/event-stream bodies are rewritten (statefully, read by read:
  a CR ending one read and its LF starting the next stay one line end);
- `--http10`: replies are re-framed as HTTP/1.0, the body delimited by closing the connection (no
  Content-Length, no chunking);
- `--prefix /p`: served under a path prefix (/p/v1/completions reaches the upstream's /v1/completions; other
  paths get 404);
- `--tls-cert/--tls-key`: served over https;
- `--hold-first-ms MS`: each event stream's first piece is held that long before it is written on, as a proxy
  that buffers the stream holds the first token (what the client's TTFT then carries and the server's does not).

Prints "listening on URL" once ready; SIGINT or SIGTERM stop it, and it prints how many requests and event
streams it proxied.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import ssl
import sys
from urllib.parse import urlsplit

HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"}
EOLS = {"lf": b"\n", "crlf": b"\r\n", "cr": b"\r"}
_LINE_END = re.compile(rb"\r\n|\r|\n")


class LineEndings:
    """Rewrites every line end (LF, CRLF, CR) to `eol`, one read at a time, holding nothing back."""

    def __init__(self, eol: bytes) -> None:
        self.eol = eol
        self.skip_lf = False  # the last read ended in CR: an LF starting the next one is the rest of that CRLF

    def __call__(self, data: bytes) -> bytes:
        if self.skip_lf and data[:1] == b"\n":
            data = data[1:]
        if data:
            self.skip_lf = data[-1:] == b"\r"
        return _LINE_END.sub(self.eol, data)


class Head:
    def __init__(self, raw: bytes) -> None:
        lines = raw.decode("latin-1").split("\r\n")
        self.first = lines[0]
        self.headers = [(k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)]

    def get(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k.lower() == name]
        return ", ".join(values) if values else None

    def tokens(self, name: str) -> set[str]:
        return {t.strip().lower() for t in (self.get(name) or "").split(",") if t.strip()}

    def forwardable(self) -> list[tuple[str, str]]:
        drop = HOP_BY_HOP | self.tokens("connection") | {"content-length", "host"}
        return [(k, v) for k, v in self.headers if k.lower() not in drop]


async def read_head(reader: asyncio.StreamReader) -> Head | None:
    try:
        return Head((await reader.readuntil(b"\r\n\r\n"))[:-4])
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


async def read_request_body(reader: asyncio.StreamReader, head: Head) -> bytes:
    if "chunked" in head.tokens("transfer-encoding"):
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            body += await reader.readexactly(size + 2)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
                    pass
                return body[:-2]
            body = body[:-2]
    return await reader.readexactly(int(head.get("content-length") or 0))


class Proxy:
    def __init__(self, args: argparse.Namespace) -> None:
        up = urlsplit(args.upstream)
        self.up_host = up.hostname or "127.0.0.1"
        self.up_port = up.port or 80
        self.up_prefix: str = up.path.rstrip("/")
        self.prefix: str = (args.prefix or "").rstrip("/")
        self.rewrite = EOLS[args.line_ending] if args.line_ending else None
        self.http10 = args.http10
        self.hold_s = args.hold_first_ms / 1000
        self.requests = 0
        self.event_streams = 0

    def route(self, target: str) -> str | None:
        """The upstream request-target, or None for a path outside the prefix."""
        if self.prefix:
            if target != self.prefix and not target.startswith((self.prefix + "/", self.prefix + "?")):
                return None
            target = target[len(self.prefix):] or "/"
            if target.startswith("?"):
                target = "/" + target
        return self.up_prefix + target

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                request = await read_head(reader)
                if request is None:
                    return
                body = await read_request_body(reader, request)
                method, target, version = request.first.split(" ", 2)
                client_keep = (version == "HTTP/1.1" and "close" not in request.tokens("connection")) or (
                    version == "HTTP/1.0" and "keep-alive" in request.tokens("connection"))
                path = self.route(target)
                if path is None:
                    message = b'{"detail":"Not Found (outside the proxy\'s prefix)"}'
                    writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: "
                                 + str(len(message)).encode() + b"\r\n\r\n" + message)
                    await writer.drain()
                    if not client_keep:
                        return
                    continue
                if upstream is None or upstream[0].at_eof():
                    if upstream is not None:
                        upstream[1].close()
                    upstream = await asyncio.open_connection(self.up_host, self.up_port, limit=2**20)
                up_reader, up_writer = upstream
                lines = [f"{method} {path} HTTP/1.1", f"Host: {self.up_host}:{self.up_port}",
                         *(f"{k}: {v}" for k, v in request.forwardable())]
                if body or method in {"POST", "PUT", "PATCH"}:
                    lines.append(f"Content-Length: {len(body)}")
                self.requests += 1
                up_writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
                await up_writer.drain()
                up_keep, client_keep = await self.relay(method, up_reader, writer, client_keep)
                if not up_keep:
                    up_writer.close()
                    upstream = None
                if not client_keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ssl.SSLError):
            return  # the client went away (or the upstream did): closing both ends aborts the request upstream
        finally:
            if upstream is not None:
                upstream[1].close()
            writer.close()

    async def relay(self, method: str, up: asyncio.StreamReader, down: asyncio.StreamWriter,
                    client_keep: bool) -> tuple[bool, bool]:
        """Streams one reply down; returns (upstream reusable, client connection reusable)."""
        while True:
            head = await read_head(up)
            if head is None:
                raise ConnectionError("the upstream closed before replying")
            _, status_text, *rest = head.first.split(" ", 2)
            status = int(status_text)
            if status >= 200 or status == 101:
                break
            if not self.http10:  # 1xx: passed on to HTTP/1.1 clients only
                down.write(head.first.encode("latin-1") + b"\r\n" + b"".join(
                    f"{k}: {v}\r\n".encode("latin-1") for k, v in head.headers) + b"\r\n")
        reason = rest[0] if rest else ""
        no_body = method == "HEAD" or status in (204, 304)
        chunked = "chunked" in head.tokens("transfer-encoding")
        length = head.get("content-length")
        up_keep = "close" not in head.tokens("connection") and (no_body or chunked or length is not None)
        media = (head.get("content-type") or "").split(";")[0].strip().lower()
        rewrite = LineEndings(self.rewrite) if self.rewrite and media == "text/event-stream" else None
        self.event_streams += media == "text/event-stream"

        headers = head.forwardable()
        if self.http10:
            client_keep = False
            out_head = [f"HTTP/1.0 {status} {reason}", *(f"{k}: {v}" for k, v in headers), "Connection: close"]
            frame_chunked = False
        elif length is not None and rewrite is None and not chunked:
            out_head = [f"HTTP/1.1 {status} {reason}", *(f"{k}: {v}" for k, v in headers), f"Content-Length: {length}"]
            frame_chunked = False
        elif no_body:
            out_head = [f"HTTP/1.1 {status} {reason}", *(f"{k}: {v}" for k, v in headers)]
            frame_chunked = False
        else:
            out_head = [f"HTTP/1.1 {status} {reason}", *(f"{k}: {v}" for k, v in headers),
                        "Transfer-Encoding: chunked"]
            frame_chunked = True
        if not client_keep and not self.http10:
            out_head.append("Connection: close")
        down.write(("\r\n".join(out_head) + "\r\n\r\n").encode("latin-1"))
        await down.drain()

        held = [self.hold_s if media == "text/event-stream" else 0.0]

        async def send(data: bytes) -> None:
            if rewrite is not None:
                data = rewrite(data)
            if not data:
                return
            if held[0]:
                await asyncio.sleep(held[0])
                held[0] = 0.0
            down.write(f"{len(data):x}\r\n".encode() + data + b"\r\n" if frame_chunked else data)
            await down.drain()

        async def relay(left: int, inside: str) -> None:
            """Pass exactly `left` body bytes on; the upstream closing first is an error."""
            while left:
                data = await up.read(min(left, 65536))
                if not data:
                    raise ConnectionError(f"the upstream closed inside {inside}")
                left -= len(data)
                await send(data)

        if no_body:
            pass
        elif chunked:
            while True:
                size = int((await up.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    while await up.readuntil(b"\r\n") != b"\r\n":  # trailers: dropped
                        pass
                    break
                await relay(size, "a chunk")
                await up.readexactly(2)
        elif length is not None:
            await relay(int(length), "a body")
        else:
            while data := await up.read(65536):
                await send(data)
        if frame_chunked:
            down.write(b"0\r\n\r\n")
        await down.drain()
        return up_keep, client_keep


async def serve(args: argparse.Namespace) -> None:
    proxy = Proxy(args)
    context = None
    if args.tls_cert:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(args.tls_cert, args.tls_key)
    server = await asyncio.start_server(proxy.handle, args.host, args.port, ssl=context, limit=2**20)
    port = server.sockets[0].getsockname()[1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"listening on {'https' if context else 'http'}://{host}:{port}{proxy.prefix}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()
    print(f"proxied {proxy.requests} request(s), {proxy.event_streams} event stream(s)", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--upstream", required=True, help="http://host:port of the server behind the proxy")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0: any free port)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--prefix", default="", help="serve under this path prefix, e.g. /gateway")
    parser.add_argument("--line-ending", choices=sorted(EOLS), default=None,
                        help="rewrite the line ends of event streams")
    parser.add_argument("--http10", action="store_true", help="reply as HTTP/1.0, bodies delimited by closing")
    parser.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve https")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--hold-first-ms", type=float, default=0.0,
                        help="hold each event stream's first piece this long (a buffering proxy)")
    args = parser.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
