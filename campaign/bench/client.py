"""Is the load generator the bottleneck? A benchmark (not a test): `make bench-client`.

A minimal streaming server of our own (raw asyncio on uvloop, vLLM-shaped SSE with continuous usage) runs in
its own process on its own core; the project's real client path (`client.stream_completion` over
`new_client(Endpoint)`, on `campaign.core.aio`'s loop) runs on the other cores. The server writes one line per
request to a stats file: the request's prompt head, how many events it actually wrote, and (paced) the
monotonic time of each write, so every figure is taken against what the server really sent (same machine,
same clock: `time.perf_counter()` is CLOCK_MONOTONIC for every process). Measurements:

- fast: 256-token streams as fast as the server can (16 events per socket write), 64 and 256 streams, over
  http and (256) over https (a CA and a server certificate made at start with trustme; the client is given the
  CA as its bundle): the client's sustained chunks/s and its CPU use;
- paced: one token every 10 ms per stream, each event its own socket write and its own HTTP chunk (as
  uvicorn, vLLM's server, writes them), 64 and 256 streams, run as a sustained cell through
  `shard.sustained_sharded` on 1 client process and on N: the client-added delay (receive time minus the
  server's send time, p50/p99), the share of what the server sent inside the window that arrived inside it
  ("delivered"), and each client process's CPU use;
- a plain aiohttp loop (`bench_peer.py`), where an environment with aiohttp exists (.venv-vllm, or
  --peer-python), runs side by side as the peer.

Targets (PASS/FAIL at the end; the exit status is 0 either way): at least 40,000 chunks/s at 256 fast streams
and not below the peer in the same run; p99 added delay under 1 ms at 64 paced streams; at 256 paced streams at
least 95% of what the server sent delivered (1 client process). The last line is machine-readable.

Long (about 590 lines): a benchmark with its own stand-in server, the peer's runner and the report of
both, side by side in one run; it is not imported by the tool.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from campaign.core import aio, stats
from campaign.http.client import RequestRecord, new_client, stream_completion
from campaign.http.endpoint import TLS, Endpoint
from campaign.measure.prompts import PromptSource
from campaign.measure.shard import sustained_sharded, usable_cores
from campaign.server.argv import free_port
from campaign.server.profiles import PROJECT_ROOT

TOKENS_PER_STREAM = 256
HEAD = 6  # prompt tokens that identify a request (PromptSource's unique head)
PACE_MS = 10.0
FAST_EVENTS_PER_WRITE = 16
WARMUP_S = 0.5

TARGET_CHUNKS_PER_S = 40_000
TARGET_P99_MS_64 = 1.0
TARGET_DELIVERED_256 = 0.95
NOISY_OTHERS = 0.10  # other processes on the client's cores above this: a failed target may not be the client's


# --- the server ----------------------------------------------------------------------------------------
def _event(i: int) -> bytes:
    return (b'data: {"id":"b","object":"text_completion","choices":[{"index":0,"text":" x",'
            b'"finish_reason":null}],"usage":{"prompt_tokens":6,"completion_tokens":'
            + str(i).encode() + b',"total_tokens":0}}\n\n')


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _serve(port: int, mode: str, pace_s: float, events_per_write: int, stats_path: Path | None,
                 cert: Path | None) -> None:
    """fast: `events_per_write` events per socket write; paced: one event per write and per HTTP chunk, every
    `pace_s` per stream. Each request's line in `stats_path`: its prompt head, the events written, and (paced)
    the time of each write."""
    out = stats_path.open("a") if stats_path else None
    ssl_ctx = None
    if cert is not None:
        ssl_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ssl_ctx.load_cert_chain(cert)
    paced = mode == "paced"
    per_write = 1 if paced else events_per_write

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
                written = 0
                sent: list[float] = []
                try:
                    start = time.perf_counter()
                    batch: list[bytes] = []
                    for i in range(1, total + 1):
                        if paced:
                            delay = start + i * pace_s - time.perf_counter()
                            if delay > 0:
                                await asyncio.sleep(delay)
                        batch.append(_event(i))
                        if len(batch) >= per_write or i == total:
                            writer.write(_chunk(b"".join(batch)))
                            written += len(batch)
                            batch = []
                            if paced:
                                sent.append(time.perf_counter())
                            await writer.drain()
                    writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
                    await writer.drain()
                finally:
                    if out is not None:
                        item: dict[str, Any] = {"key": key, "events": written}
                        if paced:
                            item["sent"] = sent
                        out.write(json.dumps(item) + "\n")
                        out.flush()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=2048, ssl=ssl_ctx)
    async with server:
        await server.serve_forever()


def _pin(cores: set[int]) -> None:
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {c % (os.cpu_count() or 1) for c in cores})


def _client_cores() -> set[int]:
    """Every core but the server's (core 1), or the one core there is."""
    count = os.cpu_count() or 1
    return {c for c in range(count) if c != 1} if count > 1 else {0}


def _busy_s(cores: set[int]) -> float:
    """CPU seconds the machine has spent busy on these cores (every process, the kernel, steal)."""
    per_cpu = psutil.cpu_times(percpu=True)
    total = 0.0
    for core in cores:
        if core < len(per_cpu):
            t = per_cpu[core]
            total += t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0) \
                + getattr(t, "steal", 0.0)
    return total


class ServerProcess:
    """The benchmark server in its own process: `ServerProcess("paced")`, `.url`, `.stop()`."""

    def __init__(self, mode: str, stats_file: Path | None = None, core: int = 1, *, cert: Path | None = None,
                 pace_ms: float = PACE_MS, events_per_write: int = FAST_EVENTS_PER_WRITE) -> None:
        self.port = free_port()
        self.tls = cert is not None
        argv = [sys.executable, "-m", "campaign.bench.client", "serve", "--port", str(self.port), "--mode", mode,
                "--core", str(core), "--pace-ms", str(pace_ms), "--events-per-write", str(events_per_write)]
        if stats_file is not None:
            argv += ["--stats", str(stats_file)]
        if cert is not None:
            argv += ["--cert", str(cert)]
        self.proc = subprocess.Popen(argv, cwd=PROJECT_ROOT)  # noqa: S603
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    self._ps = psutil.Process(self.proc.pid)
                    return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("benchmark server did not start")

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def cpu_s(self) -> float:
        times = self._ps.cpu_times()
        return float(times.user + times.system)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(10)


def read_stats(path: Path, keys: set[tuple[int, ...]], wait_s: float = 5.0) -> dict[tuple[int, ...], Any]:
    """The server's line for each request (by prompt head); waits for lines still being written."""
    deadline = time.monotonic() + wait_s
    found: dict[tuple[int, ...], Any] = {}
    while True:
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    item = json.loads(line)
                    found[tuple(item["key"])] = item
        if keys <= found.keys() or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


# --- the client side ------------------------------------------------------------------------------------
@dataclass
class Run:
    """One measurement of our client."""

    label: str
    streams: int
    processes: int = 1
    chunks_per_s: float = 0.0
    tokens_per_s: float = 0.0
    cpu: list[float] = field(default_factory=list)  # per client process
    server_cpu: float | None = None
    others: float | None = None        # CPU of everything else on the client's cores (share of one core)
    p50: float | None = None
    p99: float | None = None
    delivered: float | None = None
    server_pace: float | None = None   # events the server sent in the window / events offered (paced)
    requests: int = 0
    errors: int = 0
    unmatched: int = 0                 # requests without a server line
    client_tokens: int = 0             # over the matched requests, whole replies
    server_events: int = 0

    @property
    def cpu_sum(self) -> float:
        return sum(self.cpu)

    @property
    def cpu_max(self) -> float:
        return max(self.cpu, default=0.0)


async def _drive(endpoint: Endpoint, streams: int, duration_s: float) -> tuple[list[Any], dict[str, list[int]],
                                                                                 float, float]:
    """The real client path in this process: `streams` closed-loop streams for `duration_s`. Returns the
    records, each request's prompt head, the wall time and this process's CPU share."""

    prompts = PromptSource()
    heads: dict[str, list[int]] = {}
    records: list[RequestRecord] = []
    stop = time.perf_counter() + duration_s
    me = psutil.Process()
    cpu0, wall0 = sum(me.cpu_times()[:2]), time.perf_counter()
    async with new_client(endpoint) as client:
        async def worker(index: int) -> None:
            n = 0
            while time.perf_counter() < stop:
                n += 1
                prompt = prompts.unique(HEAD)
                rid = f"{index}-{n}"
                heads[rid] = prompt[:HEAD]
                records.append(await stream_completion(client, model="bench", prompt=prompt,
                                                       max_tokens=TOKENS_PER_STREAM, request_id=rid))

        await asyncio.gather(*(worker(i) for i in range(streams)))
    wall = time.perf_counter() - wall0
    return records, heads, wall, (sum(me.cpu_times()[:2]) - cpu0) / wall


def _match(run: Run, records: list[Any], heads: dict[str, list[int]], sent: dict[tuple[int, ...], Any]) -> None:
    """Whole replies: what the client counted against what the server wrote, request by request."""
    run.requests = len(records)
    run.errors = sum(1 for r in records if not r.ok)
    for rec in records:
        item = sent.get(tuple(heads.get(rec.id, ())))
        if item is None:
            run.unmatched += 1
            continue
        run.client_tokens += rec.tokens
        run.server_events += int(item["events"])


def _fast(streams: int, duration_s: float, label: str, cert: Path | None = None, ca: Path | None = None) -> Run:
    with tempfile.TemporaryDirectory(prefix="bench-client-") as tmp:
        stats_file = Path(tmp) / "stats.jsonl"
        server = ServerProcess("fast", stats_file, cert=cert)
        try:
            endpoint = Endpoint.parse(server.url, tls=TLS(ca_bundle=ca) if ca is not None else None)
            server_cpu0, busy0 = server.cpu_s(), _busy_s(_client_cores())
            records, heads, wall, cpu = aio.run(_drive(endpoint, streams, duration_s))
            server_cpu = (server.cpu_s() - server_cpu0) / wall
            others = max(0.0, (_busy_s(_client_cores()) - busy0) / wall - cpu)
            sent = read_stats(stats_file, {tuple(h) for h in heads.values()})
        finally:
            server.stop()
    run = Run(label=label, streams=streams, cpu=[cpu], server_cpu=server_cpu, others=others,
              chunks_per_s=sum(len(r.chunk_t) for r in records) / wall,
              tokens_per_s=sum(r.tokens for r in records) / wall)
    _match(run, records, heads, sent)
    return run


async def _sharded_watching(endpoint: Endpoint, streams: int, processes: int,
                            duration_s: float) -> tuple[Any, float | None]:
    """A sustained paced cell through shard.sustained_sharded; also how busy the client cores were (share of
    one core, every process) over the window."""

    window_open = asyncio.Event()
    step_task = asyncio.create_task(sustained_sharded(
        endpoint, model="bench", context_tokens=HEAD, max_tokens=TOKENS_PER_STREAM, concurrency=streams,
        processes=processes, warmup_s=WARMUP_S, window_s=duration_s, window_open=window_open, id_prefix="b",
        keep_heads=True))

    async def watch() -> float | None:
        await window_open.wait()
        busy0, wall0 = _busy_s(_client_cores()), time.perf_counter()
        await asyncio.sleep(duration_s * 0.95)
        return (_busy_s(_client_cores()) - busy0) / (time.perf_counter() - wall0)

    watcher = asyncio.create_task(watch())
    try:
        step = await step_task
    finally:
        if not watcher.done():
            watcher.cancel()
    busy = None if watcher.cancelled() else await watcher
    return step, busy


def _paced(streams: int, processes: int, duration_s: float, label: str) -> Run:
    with tempfile.TemporaryDirectory(prefix="bench-client-") as tmp:
        stats_file = Path(tmp) / "stats.jsonl"
        server = ServerProcess("paced", stats_file)
        try:
            endpoint = Endpoint.parse(server.url)
            server_cpu0, wall0 = server.cpu_s(), time.perf_counter()
            step, busy = aio.run(_sharded_watching(endpoint, streams, processes, duration_s))
            server_cpu = (server.cpu_s() - server_cpu0) / (time.perf_counter() - wall0)
            sent = read_stats(stats_file, {tuple(h) for h in step.heads.values()})
        finally:
            server.stop()
    assert step.window is not None
    start, end = step.window
    span = end - start
    # The workers' CPU shares cover their whole run, the busy time the window: steady state, close enough.
    others = None if busy is None else max(0.0, busy - sum(step.cpu))
    run = Run(label=label, streams=streams, processes=len(step.cpu), cpu=step.cpu, server_cpu=server_cpu,
              others=others)
    _match(run, step.records, step.heads, sent)
    delays: list[float] = []
    sent_in = received_in = chunks_in = 0
    for rec in step.records:
        item = sent.get(tuple(step.heads.get(rec.id, ())))
        if item is None:
            continue
        for i, stamp in enumerate(item["sent"]):
            if start <= stamp <= end:
                sent_in += 1
                if i < len(rec.chunk_t):  # one event per write, one token per event: chunk i is event i
                    delays.append((rec.chunk_t[i] - stamp) * 1000.0)
        for t, n in zip(rec.chunk_t, rec.chunk_tokens, strict=True):
            if start <= t <= end:
                received_in += n
                chunks_in += 1
    run.p50, run.p99 = stats.percentile(delays, 50), stats.percentile(delays, 99)
    run.delivered = received_in / sent_in if sent_in else None
    run.server_pace = sent_in / (streams * span / (PACE_MS / 1000.0)) if span > 0 else None
    run.chunks_per_s = chunks_in / span if span > 0 else 0.0
    run.tokens_per_s = received_in / span if span > 0 else 0.0
    return run


# --- the peer -------------------------------------------------------------------------------------------
def _peer_python(explicit: str | None) -> tuple[Path | None, str]:
    """The Python that runs bench_peer.py (it needs aiohttp and psutil), or None and why not."""
    python = Path(explicit) if explicit else PROJECT_ROOT / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        return None, f"{python} absent"
    check = subprocess.run([str(python), "-c", "import aiohttp, psutil"],  # noqa: S603
                           capture_output=True, text=True, timeout=60)
    if check.returncode != 0:
        return None, f"{python} has no aiohttp/psutil"
    return python, str(python)


def _peer(python: Path, url: str, streams: int, duration_s: float) -> dict[str, Any] | None:
    script = Path(__file__).with_name("peer.py")
    out = subprocess.run([str(python), str(script), url, str(streams), str(duration_s)],  # noqa: S603
                         capture_output=True, text=True, timeout=duration_s + 120)
    if out.returncode != 0:
        print(f"  peer failed: {out.stderr.strip().splitlines()[-1:] or out.returncode}")  # noqa: T201
        return None
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _peer_fast(python: Path, streams: int, duration_s: float) -> dict[str, Any] | None:
    server = ServerProcess("fast")
    try:
        server_cpu0, wall0 = server.cpu_s(), time.perf_counter()
        peer = _peer(python, server.url, streams, duration_s)
        if peer is not None:
            peer.pop("arrivals", None)
            peer["server_cpu"] = (server.cpu_s() - server_cpu0) / (time.perf_counter() - wall0)
        return peer
    finally:
        server.stop()


def _peer_paced(python: Path, streams: int, duration_s: float) -> dict[str, Any] | None:
    """The peer's receive times against the server's send stamps, matched by prompt head."""
    with tempfile.TemporaryDirectory(prefix="bench-client-") as tmp:
        stats_file = Path(tmp) / "stats.jsonl"
        server = ServerProcess("paced", stats_file)
        try:
            server_cpu0, wall0 = server.cpu_s(), time.perf_counter()
            peer = _peer(python, server.url, streams, duration_s)
            if peer is None:
                return None
            peer["server_cpu"] = (server.cpu_s() - server_cpu0) / (time.perf_counter() - wall0)
            arrivals = peer.pop("arrivals", [])
            sent = read_stats(stats_file, {tuple(key) for key, _ in arrivals})
        finally:
            server.stop()
    delays = [(received - stamp) * 1000.0 for key, times in arrivals
              for received, stamp in zip(times, sent.get(tuple(key), {}).get("sent", []), strict=False)]
    peer["p50"], peer["p99"] = stats.percentile(delays, 50), stats.percentile(delays, 99)
    return peer


# --- the report -----------------------------------------------------------------------------------------
def _tls_material(directory: Path) -> tuple[Path, Path]:
    """A throwaway CA and a certificate for 127.0.0.1 signed by it: (server key+chain PEM, CA PEM)."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    server_pem, ca_pem = directory / "server.pem", directory / "ca.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(server_pem))
    ca.cert_pem.write_to_path(str(ca_pem))
    return server_pem, ca_pem


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _row(run: Run) -> str:
    cpu = f"{run.cpu_sum:.0%}" if run.processes == 1 else f"{run.cpu_sum:.0%} ({run.cpu_max:.0%} max)"
    server = "-" if run.server_cpu is None else f"{run.server_cpu:.0%}"
    others = "-" if run.others is None else f"{run.others:.0%}"
    return (f"{run.label:<36}{run.chunks_per_s:>11,.0f}{cpu:>17}{others:>8}{server:>8}{_ms(run.p50):>8}"
            f"{_ms(run.p99):>8}"
            f"{_pct(run.delivered):>10}{_pct(run.server_pace):>8}{run.client_tokens - run.server_events:>+7}"
            f"{run.errors:>5}")


def _peer_row(label: str, peer: dict[str, Any]) -> str:
    server = f"{peer['server_cpu']:.0%}" if peer.get("server_cpu") is not None else "-"
    return (f"{label:<36}{peer['chunks_per_s']:>11,.0f}{peer['cpu']:>17.0%}{'-':>8}{server:>8}"
            f"{_ms(peer.get('p50')):>8}{_ms(peer.get('p99')):>8}")


def run(duration_s: float, procs: int | None = None, peer_python: str | None = None) -> int:
    client_cores = _client_cores()
    _pin(client_cores)  # the server pins itself to core 1; worker processes inherit this affinity
    n = procs or max(2, usable_cores() - 1)
    print(f"client benchmark on {aio.loop_name()}: server on core 1, client on core(s) "  # noqa: T201
          f"{','.join(map(str, sorted(client_cores)))}; {duration_s:g} s per measurement; "
          f"paced runs on 1 and {n} client processes")
    python, peer_note = _peer_python(peer_python)
    print(f"peer (aiohttp): {peer_note}")  # noqa: T201
    print(f"{'measurement':<36}{'chunks/s':>11}{'client CPU':>17}{'others':>8}{'server':>8}{'p50 ms':>8}"  # noqa: T201
          f"{'p99 ms':>8}"
          f"{'deliv.':>10}{'pace':>8}{'lost':>7}{'err':>5}")
    runs: dict[str, Run] = {}
    peers: dict[str, dict[str, Any] | None] = {}

    def show(key: str, item: Run) -> None:
        runs[key] = item
        print(_row(item), flush=True)  # noqa: T201

    for streams in (64, 256):
        show(f"fast_{streams}", _fast(streams, duration_s, f"fast, {streams} streams"))
        if python is not None:
            peers[f"fast_{streams}"] = peer = _peer_fast(python, streams, duration_s)
            if peer:
                print(_peer_row(f"fast, {streams} streams (aiohttp, {peer.get('loop', '?')})", peer),  # noqa: T201
                      flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-client-tls-") as tmp:
        cert, ca = _tls_material(Path(tmp))
        show("fast_256_tls", _fast(256, duration_s, "fast, 256 streams, https", cert, ca))
    for streams in (64, 256):
        for processes in (1, n):
            label = f"paced, {streams} streams, {processes} proc"
            show(f"paced_{streams}_{'1' if processes == 1 else 'N'}", _paced(streams, processes, duration_s, label))
        if streams == 256 and python is not None:
            peers["paced_256"] = peer = _peer_paced(python, streams, duration_s)
            if peer:
                print(_peer_row(f"paced, {streams} streams (aiohttp, {peer.get('loop', '?')})", peer),  # noqa: T201
                      flush=True)
    print("client CPU: share of one core (sum over processes); others: what every other process used of the "  # noqa: T201
          "client's cores meanwhile; server: the server process's share of its core; deliv.: tokens received in "
          "the window / tokens the server sent in it; pace: what the server sent / what 10 ms pacing offers; "
          "lost: client tokens - server events over whole replies")

    ours = runs["fast_256"].chunks_per_s
    peer_fast = peers.get("fast_256")
    peer_chunks = peer_fast["chunks_per_s"] if peer_fast else None
    peer_paced = peers.get("paced_256")
    p99_64 = runs["paced_64_1"].p99
    delivered = runs["paced_256_1"].delivered
    targets = [
        (f"chunks/s at 256 fast streams >= {TARGET_CHUNKS_PER_S:,} and >= the aiohttp peer",
         ours >= TARGET_CHUNKS_PER_S and (peer_chunks is None or ours >= peer_chunks),
         f"{ours:,.0f}" + (f" vs peer {peer_chunks:,.0f}" if peer_chunks is not None else " (no peer in this run)")),
        (f"p99 added delay at 64 paced streams < {TARGET_P99_MS_64:g} ms",
         p99_64 is not None and p99_64 < TARGET_P99_MS_64, f"{_ms(p99_64)} ms"),
        (f"delivered at 256 paced streams >= {TARGET_DELIVERED_256:.0%} of what the server sent",
         delivered is not None and delivered >= TARGET_DELIVERED_256, _pct(delivered)),
    ]
    for (name, ok, value), key in zip(targets, ("fast_256", "paced_64_1", "paced_256_1"), strict=True):
        others = runs[key].others
        noisy = not ok and others is not None and others > NOISY_OTHERS
        note = (f" (other processes used {others:.0%} of a client core meanwhile: rerun on a quiet machine)"
                if noisy else "")
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {value}{note}")  # noqa: T201
    lost = sum(r.server_events - r.client_tokens for r in runs.values())
    if lost:
        print(f"WARNING: the client counted {lost:+,} fewer tokens than the servers wrote over whole replies")  # noqa: T201

    def num(value: float | None, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    pairs = {
        "chunks_per_s_256": num(ours, ".0f"),
        "chunks_per_s_256_tls": num(runs["fast_256_tls"].chunks_per_s, ".0f"),
        "ratio_vs_peer": num(ours / peer_chunks if peer_chunks else None, ".2f"),
        "p99_delay_ms_64": num(p99_64, ".2f"),
        "p99_delay_ms_256": num(runs["paced_256_1"].p99, ".2f"),
        "peer_p99_delay_ms_256": num(peer_paced["p99"] if peer_paced else None, ".2f"),
        "delivered_256": num(delivered, ".3f"),
        "client_cpu_paced_64_1proc": num(runs["paced_64_1"].cpu_sum, ".2f"),
        "client_cpu_paced_256_1proc": num(runs["paced_256_1"].cpu_sum, ".2f"),
        "client_procs_N": str(n),
        "client_cpu_paced_256_Nproc": num(runs["paced_256_N"].cpu_sum, ".2f"),
        "client_cpu_paced_256_Nproc_max": num(runs["paced_256_N"].cpu_max, ".2f"),
        "p99_delay_ms_64_Nproc": num(runs["paced_64_N"].p99, ".2f"),
        "p99_delay_ms_256_Nproc": num(runs["paced_256_N"].p99, ".2f"),
        "delivered_256_Nproc": num(runs["paced_256_N"].delivered, ".3f"),
        "lost_tokens": str(lost),
        "others_cpu_paced_64": num(runs["paced_64_1"].others, ".2f"),
        "targets_passed": f"{sum(ok for _, ok, _ in targets)}/{len(targets)}",
    }
    print(" ".join(f"{k}={v}" for k, v in pairs.items()))  # noqa: T201
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m campaign.bench.client")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve")
    serve.add_argument("--port", type=int, required=True)
    serve.add_argument("--mode", choices=["fast", "paced"], default="fast")
    serve.add_argument("--pace-ms", type=float, default=PACE_MS)
    serve.add_argument("--events-per-write", type=int, default=FAST_EVENTS_PER_WRITE,
                       help="fast mode only: paced mode writes every event on its own")
    serve.add_argument("--stats", type=Path)
    serve.add_argument("--cert", type=Path, help="serve https with this PEM (key and certificate chain)")
    serve.add_argument("--core", type=int, default=1)
    bench = sub.add_parser("run")
    bench.add_argument("--duration", type=float, default=10.0)
    bench.add_argument("--procs", type=int, help="client processes for the N-process paced runs")
    bench.add_argument("--peer-python", help="a Python with aiohttp for the peer (default: .venv-vllm's)")
    args = parser.parse_args()
    if args.command == "serve":
        _pin({args.core})
        aio.run(_serve(args.port, args.mode, args.pace_ms / 1000.0, args.events_per_write, args.stats, args.cert))
    else:
        sys.exit(run(args.duration, args.procs, args.peer_python))


if __name__ == "__main__":
    main()
