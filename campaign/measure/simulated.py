"""Measuring in simulated time: the same Measurer, against the simulator's engine in this process.

The client and the simulator (sim.server.in_process) share one event loop whose time is simulated (looptime,
MIT): the loop's clock stands still while anything is left to run and then moves straight to the next timer,
so an engine step costs its simulated duration and the host's own work costs nothing, whatever this machine's
speed or load. Every measured stamp reads that loop's time (core.clock). Requests go over a Unix socket, HTTP
byte for byte as over TCP: the records, their parsing and every rule are the ones a real server is measured
with, so a cell kind measured over HTTP is measured here with nothing written twice.

What differs from HTTP at a time scale: no client stall, no scrape that perturbs the server, no sharding over
client processes (one loop holds the whole clock), and the engine is never behind its clock. Repeats differ only
by what the engine draws (its seed, the `launch-noise` fault).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import looptime

from campaign.core import clock
from campaign.http.endpoint import Endpoint, Timeouts
from campaign.measure.runner import Target
from campaign.server.startup_log import StartupFacts
from campaign.sim import model as sim_model
from campaign.sim import server as sim
from campaign.sim.config import SimConfig
from campaign.sim.engine import TruthSink

T = TypeVar("T")
HOST = "simulator"   # the name in each request's Host header; the socket, not the name, reaches the server
# Loop cycles with nothing to run before the clock moves: a coroutine that schedules its timer one cycle late
# (an async context manager's exit, a callback's follow-up) still gets it in before time passes.
SETTLE_CYCLES = 4


def target(config: SimConfig, facts: StartupFacts, uds: str, timeouts: Timeouts | None = None) -> Target:
    """What a Measurer knows of the simulator in process: what its startup log said, as of a launched server."""
    endpoint = Endpoint(scheme="http", host=HOST, port=8000, api_key=config.api_key,
                        timeouts=timeouts or Timeouts(), uds=uds)
    return Target.launched_as(endpoint, config.name, facts, max_num_seqs=config.max_num_seqs,
                              max_num_batched_tokens=config.max_num_batched_tokens)


class SimulatedServer:
    """The simulator serving from this process on a loop of its own whose time is simulated, for as long as the
    object lives: each `call` runs a coroutine (a cell, an experiment) on that loop, so the engine's state (its
    prefix cache, its clock) carries from one to the next as a launched server's does. Use it as a context
    manager (leaving it stops the engine and closes the loop)."""

    def __init__(self, config: SimConfig, mem: sim_model.Memory, facts: StartupFacts, *,
                 truth: TruthSink | None = None, log: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.facts = facts
        self.max_num_seqs: int | None = config.max_num_seqs
        self.lines: list[str] = []   # the simulator's log lines while it serves (where no `log` takes them)
        self._folder = tempfile.TemporaryDirectory(prefix="campaign-sim-")
        self.uds = str(Path(self._folder.name) / "sim.sock")
        self.loop = looptime.new_event_loop(start=0.0, noop_cycles=SETTLE_CYCLES)
        self._stack = contextlib.AsyncExitStack()
        served = sim.in_process(config, mem, sim.Log(config, log or self.lines.append), self.uds, truth=truth)
        try:
            self.server: sim.Server = self.call(self._stack.enter_async_context(served))
        except BaseException:
            self.loop.close()
            self._folder.cleanup()
            raise

    @property
    def anchor(self) -> float:
        """The loop time at which the engine's clock read 0: a stamp `t` of the client is `t - anchor` there."""
        return float(self.server.driver.clock.anchor)

    def target(self, timeouts: Timeouts | None = None) -> Target:
        return target(self.config, self.facts, self.uds, timeouts)

    def alive(self) -> bool:
        """In process, it lives as long as this object: a crash of the simulator is a crash of the tool."""
        return not self.loop.is_closed()

    def call(self, work: Coroutine[Any, Any, T]) -> T:
        """`work` to its end on the simulated clock (every measured stamp inside reads it)."""
        with clock.given(self.loop.time):
            return self.loop.run_until_complete(work)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        try:
            self.call(self._stack.aclose())
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        finally:
            self.loop.close()
            self._folder.cleanup()

    def __enter__(self) -> SimulatedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run(config: SimConfig, mem: sim_model.Memory, facts: StartupFacts,
        work: Callable[[Target], Coroutine[Any, Any, T]], *, timeouts: Timeouts | None = None,
        truth: TruthSink | None = None) -> T:
    """`work(target)` in simulated time, with the simulator serving `target` from this process until it returns."""
    with SimulatedServer(config, mem, facts, truth=truth) as server:
        return server.call(work(server.target(timeouts)))
