"""Is the load generator the bottleneck? A benchmark (not a test): `make bench-client`.

A minimal streaming server of our own (raw asyncio, vLLM-shaped SSE with continuous usage) runs in its own
process on its own core; the project's real client path (client.stream_completion, the code the decode cells
use) runs on another. Two measurements at 64 and 256 concurrent streams:

- fast: the server emits 256-token streams as fast as it can (up to 16 events per socket write); the client's
  sustained chunks/s and its CPU use;
- paced: the server sends one token every 10 ms per stream and stamps each with its monotonic send time (same
  machine, same clock); the client-added delay is receive time minus send time (p50, p99), and the share of the
  offered tokens that arrived.

A plain aiohttp loop, where the server environment (.venv-vllm) has aiohttp, runs side by side in the same run
as the peer. The last line is machine-readable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from campaign import stats
from campaign.profiles import PROJECT_ROOT

TOKENS_PER_STREAM = 256
HEAD = 6  # prompt tokens that identify a stream (PromptSource's unique head)


# --- the server ----------------------------------------------------------------------------------------
async def _serve(port: int, mode: str, pace_s: float, coalesce: int, stamps_path: Path | None) -> None:
    stamps = stamps_path.open("a") if stamps_path else None

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = json.loads(await reader.readexactly(length))
                key = body.get("prompt", [])[:HEAD]
                total = int(body.get("max_tokens", TOKENS_PER_STREAM))
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                sent: list[float] = []
                start = time.monotonic()
                batch: list[bytes] = []
                for i in range(1, total + 1):
                    if mode == "paced":
                        delay = start + i * pace_s - time.monotonic()
                        if delay > 0:
                            await asyncio.sleep(delay)
                    event = (b'data: {"id":"b","object":"text_completion","choices":[{"index":0,"text":" x",'
                             b'"finish_reason":null}],"usage":{"prompt_tokens":6,"completion_tokens":'
                             + str(i).encode() + b',"total_tokens":0}}\n\n')
                    batch.append(event)
                    if mode == "paced" or len(batch) >= coalesce or i == total:
                        data = b"".join(batch)
                        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                        batch = []
                        if mode == "paced":
                            sent.append(time.monotonic())
                        await writer.drain()
                final = b"data: [DONE]\n\n"
                writer.write(f"{len(final):x}\r\n".encode() + final + b"\r\n0\r\n\r\n")
                await writer.drain()
                if stamps is not None and sent:
                    stamps.write(json.dumps({"key": key, "sent": sent}) + "\n")
                    stamps.flush()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=2048)
    async with server:
        await server.serve_forever()


def _pin(core: int) -> None:
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {core % (os.cpu_count() or 1)})


# --- the client side ------------------------------------------------------------------------------------
async def _drive(base_url: str, streams: int, duration_s: float) -> dict[str, Any]:
    """Our real client path: `streams` closed-loop streams for `duration_s`; each request's prompt head is
    kept so that paced runs can match receive times to the server's send stamps."""
    from campaign.client import new_client, stream_completion
    from campaign.prompts import PromptSource

    prompts = PromptSource()
    by_id: dict[str, list[int]] = {}
    records = []
    stop = time.perf_counter() + duration_s
    me = psutil.Process()
    cpu0, wall0 = sum(me.cpu_times()[:2]), time.perf_counter()
    async with new_client(max_streams=streams, base_url=base_url) as client:
        async def worker(index: int) -> None:
            n = 0
            while time.perf_counter() < stop:
                n += 1
                prompt = prompts.unique(HEAD)
                rid = f"{index}-{n}"
                by_id[rid] = prompt[:HEAD]
                records.append(await stream_completion(client, model="bench", prompt=prompt,
                                                       max_tokens=TOKENS_PER_STREAM, request_id=rid))

        await asyncio.gather(*(worker(i) for i in range(streams)))
    wall = time.perf_counter() - wall0
    tokens = sum(r.tokens for r in records)
    return {"records": records, "by_id": by_id, "wall_s": wall, "cpu": (sum(me.cpu_times()[:2]) - cpu0) / wall,
            "chunks_per_s": sum(len(r.chunk_t) for r in records) / wall, "tokens": tokens,
            "tokens_per_s": tokens / wall, "errors": sum(1 for r in records if not r.ok)}


def _delays(records: list[Any], prompts_by_id: dict[str, list[int]], stamps: Path) -> list[float]:
    sent = {}
    for line in stamps.read_text().splitlines():  # every stream has its own head: no need to cut the file
        item = json.loads(line)
        sent[tuple(item["key"])] = item["sent"]
    delays = []
    for rec in records:
        stamps_for = sent.get(tuple(prompts_by_id.get(rec.id, [])))
        if not stamps_for:
            continue
        for received, stamp in zip(rec.chunk_t, stamps_for, strict=False):
            delays.append((received - stamp) * 1000.0)
    return delays


class ServerProcess:
    def __init__(self, mode: str, stamps: Path | None = None, core: int = 1) -> None:
        from campaign.argv import free_port

        self.port = free_port()
        argv = [sys.executable, "-m", "campaign.bench_client", "serve", "--port", str(self.port), "--mode", mode,
                "--core", str(core)]
        if stamps is not None:
            argv += ["--stamps", str(stamps)]
        self.proc = subprocess.Popen(argv, cwd=PROJECT_ROOT)  # noqa: S603
        deadline = time.monotonic() + 20
        import socket

        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError("benchmark server did not start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def _peer(url: str, streams: int, duration_s: float) -> dict[str, Any] | None:
    """The aiohttp loop, run with the server environment's Python (it has aiohttp); None where absent."""
    python = PROJECT_ROOT / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        return None
    script = Path(__file__).with_name("bench_peer.py")
    out = subprocess.run([str(python), str(script), url, str(streams), str(duration_s)],  # noqa: S603
                         capture_output=True, text=True, timeout=duration_s + 120)
    if out.returncode != 0:
        return None
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _peer_delays(peer: dict[str, Any], stamps: Path) -> dict[str, Any]:
    """The peer's receive times against the server's send stamps, matched by prompt head."""
    sent = {}
    for line in stamps.read_text().splitlines():
        item = json.loads(line)
        sent[tuple(item["key"])] = item["sent"]
    delays = [(received - stamp) * 1000.0 for key, times in peer.pop("arrivals", [])
              for received, stamp in zip(times, sent.get(tuple(key), []), strict=False)]
    peer["p50"], peer["p99"] = stats.percentile(delays, 50), stats.percentile(delays, 99)
    return peer


def run(duration_s: float) -> int:
    _pin(0)
    results: dict[str, Any] = {}
    print(f"client benchmark: one core for the client, one for the server; {duration_s:g} s per measurement")  # noqa: T201
    print(f"{'measurement':<34}{'chunks/s':>12}{'tokens/s':>12}{'client CPU':>12}{'p50 ms':>9}{'p99 ms':>9}"  # noqa: T201
          f"{'delivered':>11}")
    for streams in (64, 256):
        server = ServerProcess("fast")
        try:
            fast = asyncio.run(_drive(server.url, streams, duration_s))
            peer = _peer(server.url, streams, duration_s)
            if peer is not None:
                peer.pop("arrivals", None)
        finally:
            server.stop()
        results[f"fast_{streams}"] = fast
        results[f"peer_fast_{streams}"] = peer
        print(f"{f'fast, {streams} streams (ours)':<34}{fast['chunks_per_s']:>12,.0f}{fast['tokens_per_s']:>12,.0f}"  # noqa: T201
              f"{fast['cpu']:>11.0%}")
        if peer:
            print(f"{f'fast, {streams} streams (aiohttp)':<34}{peer['chunks_per_s']:>12,.0f}"  # noqa: T201
                  f"{peer['tokens_per_s']:>12,.0f}{peer['cpu']:>11.0%}")
    for streams in (64, 256):
        stamps = Path(f"/tmp/bench-stamps-{os.getpid()}-{streams}.jsonl")
        stamps.unlink(missing_ok=True)
        server = ServerProcess("paced", stamps)
        try:
            paced = asyncio.run(_drive(server.url, streams, duration_s))
            time.sleep(0.5)
            delays = _delays(paced["records"], paced["by_id"], stamps)
            # Offered: one token every 10 ms for as long as each request was open; a client that falls behind
            # holds requests open longer (the server blocks on full socket buffers) and receives a smaller share.
            offered = sum((r.end_t - r.send_t) / 0.010 for r in paced["records"] if r.end_t is not None)
            delivered = paced["tokens"] / offered if offered else 0.0
            peer = None
            if streams == 256:
                peer = _peer(server.url, streams, duration_s)
                time.sleep(0.5)
                if peer is not None:
                    peer = _peer_delays(peer, stamps)
            stamps.unlink(missing_ok=True)
        finally:
            server.stop()
        p50, p99 = stats.percentile(delays, 50), stats.percentile(delays, 99)
        results[f"paced_{streams}"] = {"p50": p50, "p99": p99, "delivered": delivered, "cpu": paced["cpu"]}
        results[f"peer_paced_{streams}"] = peer
        print(f"{f'paced 10 ms, {streams} streams (ours)':<34}{'':>12}{paced['tokens'] / paced['wall_s']:>12,.0f}"  # noqa: T201
              f"{paced['cpu']:>11.0%}{p50 or 0:>9.2f}{p99 or 0:>9.2f}{delivered:>10.1%}")
        if peer:
            print(f"{f'paced 10 ms, {streams} streams (aiohttp)':<34}{'':>12}{peer['tokens_per_s']:>12,.0f}"  # noqa: T201
                  f"{peer['cpu']:>11.0%}{peer['p50']:>9.2f}{peer['p99']:>9.2f}")
    ours = results["fast_256"]["chunks_per_s"]
    peer_fast = results.get("peer_fast_256")
    ratio = f"{ours / peer_fast['chunks_per_s']:.2f}" if peer_fast else "n/a"
    peer_paced = results.get("peer_paced_256")
    peer_p99 = f"{peer_paced['p99']:.2f}" if peer_paced else "n/a"
    print(  # noqa: T201
        f"chunks_per_s_256={ours:.0f} ratio_vs_peer={ratio} p99_delay_ms_64={results['paced_64']['p99']:.2f} "
        f"p99_delay_ms_256={results['paced_256']['p99']:.2f} peer_p99_delay_ms_256={peer_p99} "
        f"delivered_256={results['paced_256']['delivered']:.3f}")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m campaign.bench_client")
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve")
    serve.add_argument("--port", type=int, required=True)
    serve.add_argument("--mode", choices=["fast", "paced"], default="fast")
    serve.add_argument("--pace-ms", type=float, default=10.0)
    serve.add_argument("--coalesce", type=int, default=16)
    serve.add_argument("--stamps", type=Path)
    serve.add_argument("--core", type=int, default=1)
    bench = sub.add_parser("run")
    bench.add_argument("--duration", type=float, default=10.0)
    args = parser.parse_args()
    if args.command == "serve":
        _pin(args.core)
        asyncio.run(_serve(args.port, args.mode, args.pace_ms / 1000.0, args.coalesce, args.stamps))
    else:
        sys.exit(run(getattr(args, "duration", 10.0)))


if __name__ == "__main__":
    main()
