"""A sustained-decode cell's streams over several client processes, each with its own event loop.

One event loop on one core takes a few hundred concurrent streams (`make bench-client`); a small model on an
H200 at 512 streams is beyond it, and a cell whose client saturates a core is marked Invalid. So beyond
`STREAMS_PER_PROCESS` streams a cell's streams are split over worker processes (`client_processes`), each
running the measured path (`client.stream_completion` on `aio`) for its share, with exactly the semantics of
`Measurer._sustained`:

- exactly `concurrency` streams in total, split as evenly as possible; each stream loops on requests with a
  fresh unique prompt (every process has its own `PromptSource`, whose random salt keeps heads unique);
- the window opens once every stream of every process has its first token (or any request failed), plus the
  warm-up; it closes after `window_s` or at the first failed request, in any process;
- then no new request starts and the running ones are drained, not aborted; every process's records come back,
  with unique ids (`{id_prefix}p{process}-{n}`) and times on the machine's one monotonic clock
  (`time.perf_counter()` is CLOCK_MONOTONIC on Linux, shared by all processes), so they merge as they are.

Coordination: two one-way pipes per worker. The worker reports `started` (all its streams have a token, or one
failed), `failed` (a request failed), then `done` with its records and its CPU share; the parent sends `stop`
(the window closed: start nothing new, drain) or `abort` (cancel everything now). The parent's event loop never
blocks on a pipe: its reads run on a small thread pool. Workers never outlive the parent: they are daemon
processes, a worker whose command pipe reaches EOF (the parent died) aborts at once, and a cancelled or failed
parent aborts, joins and if need be terminates them before it returns.

The stop message costs the pipe's latency (well under a millisecond): a request that a worker starts in that
gap, after the window closed, is drained like the others and lies outside the window.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_any
from multiprocessing.process import BaseProcess
from typing import Any

from campaign.core import aio
from campaign.http.client import RequestRecord, new_client, stream_completion
from campaign.http.endpoint import Endpoint
from campaign.measure.prompts import PromptSource

STREAMS_PER_PROCESS = 256
HEAD_TOKENS = 6        # the tokens that make a PromptSource prompt unique (kept per id when asked)
ABORT_GRACE_S = 5.0    # how long aborted workers get to exit before they are terminated
_POLL_S = 0.1          # a pipe reader thread checks this often whether the parent is closing


class ShardError(RuntimeError):
    """A client process crashed or vanished: a defect or a killed process, never a property of the server."""


@dataclass
class ShardedStep:
    records: list[RequestRecord]
    window: tuple[float, float] | None
    cpu: list[float]                   # per process: its loop thread's CPU time over wall time, as a share of one core
    streams: list[int] = field(default_factory=list)         # streams per process
    heads: dict[str, list[int]] = field(default_factory=dict)  # request id -> prompt head (keep_heads=True)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def client_processes(concurrency: int, requested: int | None = None, *, cores: int | None = None) -> int:
    """How many client processes a cell of `concurrency` streams runs on.

    `requested` wins, clamped to [1, concurrency]. Otherwise one process up to STREAMS_PER_PROCESS streams, else
    one per STREAMS_PER_PROCESS streams (rounded up), capped at the usable cores minus one (the parent and
    whatever else runs here keep one), at least 1."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1 (got {concurrency})")
    if requested is not None:
        return max(1, min(requested, concurrency))
    if concurrency <= STREAMS_PER_PROCESS:
        return 1
    wanted = math.ceil(concurrency / STREAMS_PER_PROCESS)
    available = usable_cores() if cores is None else cores
    return max(1, min(wanted, available - 1))


def split_streams(concurrency: int, processes: int) -> list[int]:
    """`concurrency` streams over `processes` as evenly as possible (the first ones take the remainder)."""
    base, extra = divmod(concurrency, processes)
    return [base + (1 if i < extra else 0) for i in range(processes)]


# --- the worker process -------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class _Job:
    proc: int
    streams: int
    endpoint: Endpoint
    model: str
    context_tokens: int
    max_tokens: int
    id_prefix: str
    keep_heads: bool


def _worker_main(job: _Job, commands: Connection, results: Connection) -> None:
    """A worker process's entry point (spawned: it must be importable and its arguments picklable)."""
    # Ctrl-C reaches the whole process group: the parent decides (it sends abort), the worker does not die noisily.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        aio.run(_worker(job, commands, results))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        try:
            results.send(("error", f"client process {job.proc} failed:\n{traceback.format_exc()}"))
        except OSError:
            pass  # the parent is gone
    finally:
        results.close()
        commands.close()


async def _first_of(*awaitables: Any) -> None:
    """Wait until the first of these completes; cancel the others."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _worker(job: _Job, commands: Connection, results: Connection) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    abort = asyncio.Event()

    def on_command() -> None:
        try:
            command = commands.recv()
        except (EOFError, OSError):
            command = "abort"  # the parent is gone: nobody will collect anything
        if command == "abort":
            loop.remove_reader(commands.fileno())
            abort.set()
        stop.set()

    loop.add_reader(commands.fileno(), on_command)
    prompts = PromptSource()
    numbers = itertools.count(1)
    records: list[RequestRecord] = []
    heads: dict[str, list[int]] = {}
    first_round = [asyncio.Event() for _ in range(job.streams)]
    failed = asyncio.Event()
    cpu0, wall0 = time.thread_time(), time.perf_counter()  # the loop's thread, as measure does

    async with new_client(job.endpoint) as client:
        async def stream(index: int) -> None:
            first: asyncio.Event | None = first_round[index]
            while not stop.is_set():
                prompt = prompts.unique(job.context_tokens)
                request_id = f"{job.id_prefix}p{job.proc}-{next(numbers)}"
                if job.keep_heads:
                    heads[request_id] = prompt[:HEAD_TOKENS]
                rec = await stream_completion(client, model=job.model, prompt=prompt, max_tokens=job.max_tokens,
                                              request_id=request_id, first_token=first)
                first = None
                records.append(rec)
                first_round[index].set()  # also when the request failed before any token
                if not rec.ok:
                    if not failed.is_set():
                        failed.set()
                        results.send(("failed", rec.error))
                    return

        async def announce() -> None:
            await _first_of(asyncio.gather(*(e.wait() for e in first_round)), failed.wait())
            results.send(("started",))

        tasks = [asyncio.create_task(stream(i)) for i in range(job.streams)]
        announcer = asyncio.create_task(announce())
        try:
            # Every stream drained after `stop` (or failed), a stream crashed (a defect), or abort.
            await _first_of(asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION), abort.wait())
        finally:
            for task in [*tasks, announcer]:
                task.cancel()  # no-op for the finished ones
            await asyncio.gather(*tasks, announcer, return_exceptions=True)
    loop.remove_reader(commands.fileno())
    if abort.is_set():
        return
    for task in tasks:
        error = None if task.cancelled() else task.exception()
        if error is not None:
            raise error
    cpu = (time.thread_time() - cpu0) / max(1e-9, time.perf_counter() - wall0)
    results.send(("done", [r.to_dict() for r in records], cpu, heads))


# --- the parent ---------------------------------------------------------------------------------------------
def _receive(conn: Connection, closing: threading.Event) -> Any:
    """One message from a worker, on a reader thread; None at EOF or when the parent is closing."""
    while not closing.is_set():
        try:
            if conn.poll(_POLL_S):
                return conn.recv()
        except (EOFError, OSError):
            return None
    return None


class _Workers:
    """The spawned workers of one step, their pipes, and what they have said."""

    def __init__(self, jobs: Sequence[_Job]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.jobs = list(jobs)
        self.procs: list[BaseProcess] = []
        self.commands: list[Connection] = []
        self.results: list[Connection] = []
        self.closing = threading.Event()
        # One reader thread per worker, and one to wait for their exits.
        self.pool = ThreadPoolExecutor(max_workers=len(jobs) + 1, thread_name_prefix="shard-pipe")
        self.readers: list[asyncio.Task[None]] = []
        self.started: set[int] = set()
        self.all_started = asyncio.Event()
        self.failed = asyncio.Event()
        self.broken = asyncio.Event()
        self.error: str | None = None
        self.outcome: dict[int, tuple[list[dict[str, Any]], float, dict[str, list[int]]]] = {}
        self.all_done = asyncio.Event()
        try:
            for job in self.jobs:
                command_read, command_write = ctx.Pipe(duplex=False)
                result_read, result_write = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_worker_main, args=(job, command_read, result_write),
                                   name=f"campaign-client-{job.proc}", daemon=True)
                self.procs.append(proc)
                self.commands.append(command_write)
                self.results.append(result_read)
                try:
                    proc.start()
                finally:
                    # The child has its own copies; ours would keep EOF from ever arriving on either side.
                    command_read.close()
                    result_write.close()
        except BaseException:
            self.close()
            raise
        loop = asyncio.get_running_loop()
        self.readers = [loop.create_task(self._read(i)) for i in range(len(self.jobs))]

    async def _read(self, index: int) -> None:
        loop = asyncio.get_running_loop()
        while True:
            message = await loop.run_in_executor(self.pool, _receive, self.results[index], self.closing)
            if message is None:
                if index not in self.outcome and not self.closing.is_set():
                    proc = self.procs[index]
                    for _ in range(20):
                        if proc.exitcode is not None:
                            break
                        await asyncio.sleep(0.05)
                    self._break(f"client process {index} ended without its records (exit code {proc.exitcode})")
                return
            kind = message[0]
            if kind == "started":
                self.started.add(index)
                if len(self.started) == len(self.jobs):
                    self.all_started.set()
            elif kind == "failed":
                self.failed.set()
                self.all_started.set()  # as in Measurer._sustained: a failure opens (and so closes) the window
            elif kind == "done":
                self.outcome[index] = (message[1], message[2], message[3])
                if len(self.outcome) == len(self.jobs):
                    self.all_done.set()
                return
            elif kind == "error":
                self._break(message[1])
                return

    def _break(self, error: str) -> None:
        if self.error is None:
            self.error = error
        self.broken.set()

    def check(self) -> None:
        if self.error is not None:
            raise ShardError(self.error)

    async def wait(self, event: asyncio.Event, within_s: float | None = None) -> None:
        """Until `event`, a broken worker, or `within_s`; raises ShardError for a broken worker."""
        waiters = [event.wait(), self.broken.wait()]
        if within_s is None:
            await _first_of(*waiters)
        else:
            await _first_of(*waiters, asyncio.sleep(within_s))
        self.check()

    def send(self, command: str) -> None:
        for index, conn in enumerate(self.commands):
            if index in self.outcome and command == "stop":
                continue
            try:
                conn.send(command)
            except OSError:
                pass  # that worker has already exited

    async def abort(self) -> None:
        """Tell every worker to cancel its streams, and give them a moment to exit."""
        self.send("abort")
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + ABORT_GRACE_S
        running = [p.sentinel for p in self.procs if p.pid is not None and p.is_alive()]
        while running and (left := deadline - time.monotonic()) > 0:
            ready: list[Any] = await loop.run_in_executor(self.pool, wait_for_any, running, left)
            running = [s for s in running if s not in ready]

    def close(self) -> None:
        """Synchronous last resort: terminate what still runs, stop the reader threads, close the pipes."""
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            if proc.pid is not None:  # started
                proc.join(2.0)
                if proc.is_alive():
                    proc.kill()
                    proc.join(2.0)
        self.closing.set()
        for reader in self.readers:
            reader.cancel()
        self.pool.shutdown(wait=True)  # the threads notice `closing` within _POLL_S
        for conn in [*self.commands, *self.results]:
            conn.close()
        for proc in self.procs:
            if proc.pid is not None and not proc.is_alive():
                proc.close()


async def sustained_sharded(endpoint: Endpoint, *, model: str, context_tokens: int, max_tokens: int,
                            concurrency: int, processes: int, warmup_s: float, window_s: float,
                            window_open: asyncio.Event, id_prefix: str = "r",
                            keep_heads: bool = False) -> ShardedStep:
    """`Measurer._sustained` over `processes` worker processes (see the module's docstring).

    `keep_heads` also returns each request's prompt head (its first HEAD_TOKENS tokens), by request id."""
    processes = max(1, min(processes, concurrency))
    counts = split_streams(concurrency, processes)
    jobs = [_Job(proc=i, streams=n, endpoint=endpoint, model=model, context_tokens=context_tokens,
                 max_tokens=max_tokens, id_prefix=id_prefix, keep_heads=keep_heads) for i, n in enumerate(counts)]
    workers = _Workers(jobs)
    try:
        try:
            await workers.wait(workers.all_started)
            await asyncio.sleep(warmup_s)
            workers.check()
            start = time.perf_counter()
            window_open.set()
            await workers.wait(workers.failed, within_s=window_s)
            end = time.perf_counter()
            workers.send("stop")
            await workers.wait(workers.all_done)
        except BaseException:
            await workers.abort()
            raise
    finally:
        workers.close()
    records: list[RequestRecord] = []
    heads: dict[str, list[int]] = {}
    cpu: list[float] = []
    for index in range(processes):
        dicts, share, process_heads = workers.outcome[index]
        records.extend(RequestRecord.from_dict(d) for d in dicts)
        cpu.append(share)
        heads.update(process_heads)
    records.sort(key=lambda r: r.send_t)
    return ShardedStep(records=records, window=(start, end), cpu=cpu, streams=counts, heads=heads)
