"""The peer client of `make bench-client`: a plain aiohttp line loop, as most benchmark tools read SSE.

Run with the server environment's Python, which has aiohttp: `python bench_peer.py URL STREAMS SECONDS`.
It runs on uvloop where that Python has it (as our client does: the comparison is of the clients, not of the
loops), else on asyncio's loop. Prints one JSON line: chunks/s, tokens/s, CPU share, the loop, and per request
(prompt head, receive times).
"""

import asyncio
import json
import os
import random
import sys
import time
from typing import Any

import aiohttp
import psutil


async def main(url: str, streams: int, duration_s: float) -> dict[str, Any]:
    rng = random.Random()
    arrivals = []
    chunks = tokens = 0
    stop = time.perf_counter() + duration_s
    me = psutil.Process()
    cpu0, wall0 = sum(me.cpu_times()[:2]), time.perf_counter()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def worker() -> None:
            nonlocal chunks, tokens
            while time.perf_counter() < stop:
                key = [rng.randrange(16, 2000) for _ in range(6)]
                body = {"model": "bench", "prompt": key, "max_tokens": 256, "stream": True,
                        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
                times = []
                async with session.post(url + "/v1/completions", json=body) as response:
                    async for line in response.content:
                        if line.startswith(b"data: {"):
                            times.append(time.perf_counter())
                            data = json.loads(line[6:])
                            tokens = tokens + 1 if data.get("choices") else tokens
                chunks += len(times)
                arrivals.append([key, times])

        await asyncio.gather(*(worker() for _ in range(streams)))
    wall = time.perf_counter() - wall0
    return {"chunks_per_s": chunks / wall, "tokens_per_s": tokens / wall,
            "cpu": (sum(me.cpu_times()[:2]) - cpu0) / wall, "arrivals": arrivals}


if __name__ == "__main__":
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {0})
    try:
        import uvloop
        factory: Any = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        result = runner.run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
    result["loop"] = "uvloop" if factory is not None else "asyncio"
    print(json.dumps(result))  # noqa: T201
