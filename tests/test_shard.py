"""A sustained cell's streams over several client processes (campaign.measure.shard), against the benchmark's server."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from campaign.bench.client import ServerProcess
from campaign.core import aio
from campaign.http.client import RequestRecord
from campaign.http.endpoint import Endpoint
from campaign.measure.figures import window_metrics
from campaign.measure.shard import (
    STREAMS_PER_PROCESS,
    ShardedStep,
    ShardError,
    client_processes,
    split_streams,
    sustained_sharded,
)
from campaign.server.argv import free_port

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(("concurrency", "requested", "cores", "expected"), [
    (1, None, 8, 1),
    (64, None, 8, 1),
    (STREAMS_PER_PROCESS, None, 8, 1),        # one process takes up to 256 streams
    (STREAMS_PER_PROCESS + 1, None, 8, 2),    # then one more per 256, rounded up
    (512, None, 8, 2),
    (1024, None, 8, 4),
    (4096, None, 8, 7),                       # capped at the usable cores minus one
    (1024, None, 3, 2),
    (512, None, 2, 1),                        # a 2-core box keeps one core for the rest
    (512, None, 1, 1),                        # never below one
    (64, 4, 2, 4),                            # asked for: wins over the rule and the cores
    (512, 1, 16, 1),
    (3, 8, 16, 3),                            # clamped to one stream per process
    (100, 0, 16, 1),                          # and to at least one process
    (100, -2, 16, 1),
])
def test_client_processes(concurrency: int, requested: int | None, cores: int, expected: int) -> None:
    assert client_processes(concurrency, requested, cores=cores) == expected


def test_client_processes_default_cores_are_the_usable_ones() -> None:
    usable = len(os.sched_getaffinity(0))
    assert client_processes(100 * STREAMS_PER_PROCESS) == max(1, min(100, usable - 1))
    with pytest.raises(ValueError, match="at least 1"):
        client_processes(0)


@pytest.mark.parametrize(("concurrency", "processes", "expected"), [
    (10, 3, [4, 3, 3]), (12, 2, [6, 6]), (5, 1, [5]), (3, 3, [1, 1, 1]),
])
def test_split_streams(concurrency: int, processes: int, expected: list[int]) -> None:
    assert split_streams(concurrency, processes) == expected


# --- real runs ---------------------------------------------------------------------------------------------
PACE_TOKENS = 30  # 0.3 s per request at the server's 10 ms pace


@pytest.fixture(scope="module")
def paced_server() -> Iterator[ServerProcess]:
    server = ServerProcess("paced")
    try:
        yield server
    finally:
        server.stop()


def _children() -> set[int]:
    """Our child processes, less multiprocessing's resource tracker (one per parent, it ends with the parent)."""
    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(child.cmdline()):
                pids.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


def _max_in_flight(records: list[RequestRecord]) -> int:
    points = sorted([(r.send_t, 1) for r in records] + [(r.end_t or r.send_t, -1) for r in records],
                    key=lambda p: (p[0], p[1]))  # an end before a start at the same instant
    level = peak = 0
    for _, step in points:
        level += step
        peak = max(peak, level)
    return peak


async def _run_watching(endpoint: Endpoint, concurrency: int, *, cancel_after_s: float | None = None,
                        window_s: float = 1.2) -> tuple[ShardedStep | None, set[int]]:
    """sustained_sharded with 2 processes; the child pids seen once the window is open; optionally cancelled."""
    window_open = asyncio.Event()
    task = asyncio.create_task(sustained_sharded(
        endpoint, model="bench", context_tokens=8, max_tokens=PACE_TOKENS, concurrency=concurrency, processes=2,
        warmup_s=0.3, window_s=window_s, window_open=window_open, id_prefix="t"))
    await asyncio.wait([task, asyncio.create_task(window_open.wait())], return_when=asyncio.FIRST_COMPLETED)
    seen = _children()
    if cancel_after_s is None:
        return await task, seen
    await asyncio.sleep(cancel_after_s)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return None, seen


def test_sustained_over_two_processes(paced_server: ServerProcess) -> None:
    before = _children()
    concurrency = 12
    step, seen = aio.run(_run_watching(Endpoint.parse(paced_server.url), concurrency))
    assert step is not None and step.window is not None
    assert len(seen - before) >= 2, "two worker processes while the window was open"
    assert _children() <= before, "no worker process outlives the step"

    records = step.records
    start, end = step.window
    assert step.streams == [6, 6] and sum(step.streams) == concurrency
    assert len(step.cpu) == 2 and all(0.0 < c < 1.5 for c in step.cpu)
    ids = [r.id for r in records]
    assert len(set(ids)) == len(ids), "request ids are unique across processes"
    assert all(re.fullmatch(r"tp[01]-\d+", i) for i in ids) and {i[:3] for i in ids} == {"tp0", "tp1"}
    # Drained, not aborted: every request ran to its end.
    assert all(r.ok and r.tokens == PACE_TOKENS for r in records), [r.error for r in records if not r.ok][:3]
    # The window lies inside the records' times (one clock for every process).
    assert min(r.send_t for r in records) < start < end <= max(r.end_t or 0.0 for r in records)
    assert 1.1 <= end - start < 2.0
    # Exactly `concurrency` streams: never more requests in flight at once, and all of them across the window.
    assert _max_in_flight(records) == concurrency
    overlapping = [r for r in records if r.send_t < end and (r.end_t or 0.0) > start]
    assert len(overlapping) >= concurrency
    assert window_metrics(records, start, end)["avg_active"] >= 0.97 * concurrency
    # Nothing new after the window closed (the stop message's latency aside).
    assert max(r.send_t for r in records) < end + 0.25


def test_cancelled_mid_window_leaves_no_worker(paced_server: ServerProcess) -> None:
    before = _children()
    started = time.monotonic()
    step, seen = aio.run(_run_watching(Endpoint.parse(paced_server.url), 8, cancel_after_s=0.3, window_s=30.0))
    assert step is None
    assert len(seen - before) >= 2
    assert time.monotonic() - started < 15, "cancellation does not wait for the 30 s window"
    assert _children() <= before


def test_failed_requests_close_the_window_at_once() -> None:
    endpoint = Endpoint.parse(f"http://127.0.0.1:{free_port()}")  # nothing listens: every request fails
    before = _children()
    step = aio.run(sustained_sharded(
        endpoint, model="bench", context_tokens=8, max_tokens=4, concurrency=6, processes=2, warmup_s=0.0,
        window_s=30.0, window_open=asyncio.Event()))
    assert step.window is not None and step.window[1] - step.window[0] < 1.0
    # At most one failed request per stream (a process that starts after another's failure closed the window
    # starts nothing), none ok.
    assert 1 <= len(step.records) <= 6 and not any(r.ok for r in step.records)
    assert all("connect" in (r.error or "") for r in step.records)
    assert _children() <= before


def test_a_killed_worker_fails_the_step_and_stops_the_others(paced_server: ServerProcess) -> None:
    before = _children()

    async def run() -> None:
        window_open = asyncio.Event()
        task = asyncio.create_task(sustained_sharded(
            Endpoint.parse(paced_server.url), model="bench", context_tokens=8, max_tokens=PACE_TOKENS,
            concurrency=4, processes=2, warmup_s=0.1, window_s=30.0, window_open=window_open))
        await asyncio.wait([task, asyncio.create_task(window_open.wait())], return_when=asyncio.FIRST_COMPLETED)
        psutil.Process(min(_children() - before)).kill()
        with pytest.raises(ShardError, match="ended without its records"):
            await asyncio.wait_for(task, 10)

    aio.run(run())
    assert _children() <= before


_ORPHAN_PARENT = """
import asyncio, sys
from campaign.core import aio
from campaign.http.endpoint import Endpoint
from campaign.measure.shard import sustained_sharded

async def main():
    window_open = asyncio.Event()
    task = asyncio.create_task(sustained_sharded(
        Endpoint.parse(sys.argv[1]), model="bench", context_tokens=8, max_tokens=30, concurrency=4, processes=2,
        warmup_s=0.1, window_s=60.0, window_open=window_open))
    await window_open.wait()
    print("open", flush=True)
    await task

aio.run(main())
"""


def test_workers_do_not_outlive_a_killed_parent(paced_server: ServerProcess) -> None:
    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN_PARENT, paced_server.url],  # noqa: S603
                              stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "open"
        workers = [p for p in psutil.Process(parent.pid).children() if "resource_tracker" not in " ".join(p.cmdline())]
        assert len(workers) == 2
    finally:
        parent.kill()
        parent.wait()
    _, alive = psutil.wait_procs(workers, timeout=5)
    assert not alive, "workers exit when their parent dies (EOF on their command pipe)"
