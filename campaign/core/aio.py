"""The event loop the measured path runs on: uvloop where the platform has it, asyncio's own otherwise.

Why: with a server that sends one event per socket write (as uvicorn does), 256 streams paced at 10 ms
(25,600 events/s) took 99% of one core on asyncio's loop (inter-token p99 30.8 ms against the server's own
3.4 ms) and 56% on uvloop (p99 14.3 ms); at 64 streams 39% against 15%. uvloop is the loop uvicorn and vLLM
run on. `CAMPAIGN_EVENT_LOOP=asyncio` forces the standard loop (to compare, or to rule uvloop out).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop factory, or None for asyncio's default."""
    if os.environ.get("CAMPAIGN_EVENT_LOOP", "").lower() == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def loop_name() -> str:
    return "uvloop" if loop_factory() is not None else "asyncio"


def run(coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run`, on uvloop where available."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(coro)
