"""A stand-in server process for lifecycle tests: `python child_server.py MODE --port N`.

Modes: ready, never-ready, exit-early, ignore-signals, grandchild, fatal-line.
"""

from __future__ import annotations

import argparse
import http.server
import os
import signal
import subprocess
import sys
import time


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def serve(port: int) -> None:
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
    server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--pidfile", default=None)
    args = parser.parse_args()
    print(f"child server pid={os.getpid()} mode={args.mode}", flush=True)
    if args.mode == "never-ready":
        while True:
            time.sleep(1)
    if args.mode == "exit-early":
        print("ValueError: something went wrong during start-up", flush=True)
        sys.exit(3)
    if args.mode == "fatal-line":
        print("ERROR 11-29 18:42:21 [core.py:1120] ValueError: No available memory for the cache blocks. "
              "Try increasing `gpu_memory_utilization` when initializing the engine.", flush=True)
        while True:
            time.sleep(1)
    if args.mode == "ignore-signals":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.mode == "grandchild":
        # A grandchild in a session of its own: it leaves the server's process group and outlives its parent.
        child = subprocess.Popen(  # noqa: S603
            [sys.executable, "-c", "import time\nwhile True: time.sleep(1)"], start_new_session=True
        )
        if args.pidfile:
            with open(args.pidfile, "w") as handle:
                handle.write(str(child.pid))
    serve(args.port)


if __name__ == "__main__":
    main()
