"""The clock every measured time is read from: one method, two clocks.

Over HTTP against any server it is `time.perf_counter` (the wall clock, nanosecond resolution; uvloop's own
`loop.time()` is cached to the millisecond, too coarse for a token's arrival). In simulated time
(measure.simulated) the client and the simulator's engine share one event loop whose time is simulated, and
every stamp reads that loop's time instead: the same Measurer, the same requests and parsing, another clock.

The clock is given by the caller that runs the loop (`given`) and read with `now()`; tasks and callbacks
inherit it with their context, so a stamp deep in the HTTP client needs no clock passed down to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_CLOCK: ContextVar[Callable[[], float]] = ContextVar("campaign_clock", default=time.perf_counter)


def now() -> float:
    """Seconds on the measuring clock (an arbitrary origin: only differences mean anything)."""
    return _CLOCK.get()()


def simulated() -> bool:
    """Whether the measuring clock is not the wall clock (a host stall then costs no measured time)."""
    return _CLOCK.get() is not time.perf_counter


@contextmanager
def given(clock: Callable[[], float]) -> Iterator[None]:
    """Read `clock` for every measured time inside the block (and in the tasks started there)."""
    token = _CLOCK.set(clock)
    try:
        yield
    finally:
        _CLOCK.reset(token)
