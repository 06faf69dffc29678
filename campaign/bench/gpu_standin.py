"""The GPU check's stand-in server: a process launched the way vLLM is, under GPU_PYTHON (a python with CUDA
torch). It holds a few GiB of GPU memory, answers /health and, on GET /load?s=N, runs a matmul loop for N
seconds to draw power. It imports only the standard library and torch, so GPU_PYTHON needs nothing of this
project; it is run as a script (`python campaign/bench/gpu_standin.py --port N`), never imported by it.
"""

from __future__ import annotations

import argparse
import http.server
import importlib
import json
import os
import sys
import threading
import time
from typing import Any
from urllib.parse import parse_qs, urlsplit

MATMUL_N = 8192


def _say(text: str) -> None:
    print(text, flush=True)  # noqa: T201 - its log is read by the lifecycle, as vLLM's is


def serve(port: int, host: str, gib: float, device: str) -> None:
    """Hold `gib` GiB of GPU memory, answer /health, and run matmuls on /load?s=N. `device cpu` (the checker's own
    tests): no torch, nothing allocated, the load is a wait."""
    _say(f"gpu stand-in pid={os.getpid()} device={device}")
    load = _cpu_load
    if device == "cuda":
        load = _cuda_setup(gib)
    busy = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            url = urlsplit(self.path)
            if url.path == "/health":
                self._reply(200, {"status": "ok"})
            elif url.path == "/load":
                seconds = float(parse_qs(url.query).get("s", ["10"])[0])
                with busy:
                    self._reply(200, load(seconds))
            else:
                self._reply(404, {"error": "not found"})

        def _reply(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    _say(f"serving on {host}:{port}")
    try:
        server.serve_forever()
    except KeyboardInterrupt:  # SIGINT: the first stage of the real stop path
        _say("SIGINT: stopping")
    finally:
        server.server_close()


def _cpu_load(seconds: float) -> dict[str, Any]:
    time.sleep(seconds)
    return {"seconds": seconds, "matmuls": 0}


def _cuda_setup(gib: float) -> Any:
    torch = importlib.import_module("torch")  # GPU_PYTHON's CUDA torch (not in the project's environment)

    if not torch.cuda.is_available():
        _say(f"ERROR: torch {torch.__version__} sees no CUDA device (CUDA build: {torch.version.cuda})")
        sys.exit(3)
    held = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    held.fill_(1)
    a = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.float16)
    b = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.float16)
    c = torch.empty_like(a)
    torch.cuda.synchronize()
    _say(f"holding {gib:g} GiB on {torch.cuda.get_device_name(0)} (torch {torch.__version__})")

    def load(seconds: float) -> dict[str, Any]:
        began = time.monotonic()
        count = 0
        while time.monotonic() - began < seconds:
            for _ in range(10):
                torch.matmul(a, b, out=c)
            torch.cuda.synchronize()
            count += 10
        elapsed = time.monotonic() - began
        _ = held  # kept alive with the server
        return {"seconds": elapsed, "matmuls": count, "tflops": 2 * MATMUL_N**3 * count / elapsed / 1e12}

    return load


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the GPU check's stand-in server (under GPU_PYTHON)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    serve(args.port, args.host, args.gib, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
