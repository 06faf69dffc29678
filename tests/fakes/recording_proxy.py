"""A reverse proxy that records every request a benchmark client sends, and the server's token usage for it.

    python tests/fakes/recording_proxy.py --listen 127.0.0.1:PORT --upstream http://127.0.0.1:8731 --out FILE

Every request (any method, any path, headers and body) is forwarded to the upstream, and the reply is streamed
back as it arrives, body bytes unchanged (SSE included; only the framing may become chunked). Once a reply has
ended, one JSON line is appended to FILE:

    {"method", "path", "headers", "body", "status", "usage"}

`headers` holds only content-type, accept and user-agent (never authorization); `body` is the parsed JSON when
the request body is JSON, else the text (or null when empty); `usage` is the last non-null `usage` object seen in
the reply (a JSON body, or the `data:` events of an SSE stream), else null. Prints "listening on URL" once ready;
SIGINT or SIGTERM stop it.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "host"}
RECORDED_HEADERS = ("content-type", "accept", "user-agent")


def parse_body(raw: bytes) -> Any:
    """The request body as JSON when it parses, else as text; None when empty."""
    if not raw:
        return None
    text = raw.decode("utf-8", errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        return text


def last_usage(raw: bytes) -> Any:
    """The last non-null `usage` object in a JSON body or in the `data:` events of an SSE stream."""
    text = raw.decode("utf-8", errors="replace")
    try:
        docs: list[Any] = [json.loads(text)]
    except ValueError:
        docs = []
        for line in text.splitlines():
            if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                try:
                    docs.append(json.loads(line[5:]))
                except ValueError:
                    continue
    usages = [d["usage"] for d in docs if isinstance(d, dict) and d.get("usage") is not None]
    return usages[-1] if usages else None


class Recorder(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, listen: tuple[str, int], upstream: str, out: str) -> None:
        super().__init__(listen, ProxyHandler)
        self.upstream = upstream.rstrip("/")
        self.client = httpx.Client(timeout=httpx.Timeout(None), follow_redirects=False)
        self.out = out
        self.lock = threading.Lock()

    def record(self, entry: dict[str, Any]) -> None:
        with self.lock, open(self.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry, ensure_ascii=False) + "\n")


class ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Recorder

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the JSONL file is the log
        pass

    def read_body(self) -> bytes:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                parts.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return b"".join(parts)
        return self.rfile.read(int(self.headers.get("content-length") or 0))

    def write_chunk(self, data: bytes, chunked: bool) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
        self.wfile.flush()

    def forward(self) -> None:
        body = self.read_body()
        headers = [(k, v) for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP]
        if body:
            headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
        entry: dict[str, Any] = {
            "method": self.command,
            "path": self.path,
            "headers": {k: self.headers[k] for k in RECORDED_HEADERS if self.headers.get(k) is not None},
            "body": parse_body(body),
            "status": None,
            "usage": None,
        }
        url = self.server.upstream + self.path
        request = self.server.client.build_request(self.command, url, headers=headers, content=body or None)
        received = bytearray()
        try:
            reply = self.server.client.send(request, stream=True)
            try:
                entry["status"] = reply.status_code
                self.send_response_only(reply.status_code, reply.reason_phrase)
                length = reply.headers.get("content-length")
                chunked = length is None and self.command != "HEAD" and reply.status_code not in (204, 304)
                for k, v in reply.headers.multi_items():
                    if k.lower() not in HOP_BY_HOP:
                        self.send_header(k, v)
                if chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for piece in reply.iter_raw():
                    received += piece
                    self.write_chunk(piece, chunked)
                if chunked:
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
            finally:
                reply.close()
        except (httpx.HTTPError, OSError) as exc:
            if entry["status"] is None:
                entry["status"] = 502
                self.send_error(502, f"upstream: {exc}")
            else:
                self.close_connection = True
        finally:
            entry["usage"] = last_usage(bytes(received))
            self.server.record(entry)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = forward


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Record requests while forwarding them to a server.")
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on (port 0: any free port)")
    parser.add_argument("--upstream", required=True, help="base URL of the server to forward to")
    parser.add_argument("--out", required=True, help="JSONL file to append one line per request to")
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    server = Recorder((host or "127.0.0.1", int(port)), args.upstream, args.out)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    print(f"listening on http://{host or '127.0.0.1'}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        server.client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
