"""Measuring in simulated time: the same Measurer, against the simulator's engine in this process.

The client and the simulator (sim.server.in_process) share one event loop whose time is simulated (looptime,
MIT): the loop's clock stands still while anything is left to run and then moves straight to the next timer,
so an engine step costs its simulated duration and the host's own work costs nothing, whatever this machine's
speed or load. Every measured stamp reads that loop's time (core.clock). The measured requests reach the
server without a socket (InProcessStreams: the server's own checks, the events a server writes, byte for byte,
handed to the client's parser as they are emitted); a scrape of /metrics takes the server's samples without
their text (runner.scrape: the snapshot the text parses to, tests/test_in_process.py); the rest of the control
plane (/tokenize, /v1/models, /reset_prefix_cache) goes over a Unix socket, HTTP as over TCP. The records,
their parsing and every rule are the ones a real server is measured with, so a cell kind measured over HTTP is
measured here with nothing written twice.

`start` is a launch in simulated time: the command line the launcher builds, parsed by the simulator, and the
startup log it prints, read by the parser that reads any vLLM's.

What differs from HTTP at a time scale: no client stall, no scrape that perturbs the server, no sharding over
client processes (one loop holds the whole clock), and the engine is never behind its clock. Repeats differ only
by what the engine draws (its seed, the `launch-noise` fault).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import random
import tempfile
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import looptime
from prometheus_client.samples import Sample

from campaign.core import clock
from campaign.core.errors import LaunchError
from campaign.http.endpoint import Endpoint, Timeouts
from campaign.http.streams import Limits, Liveness, Reply, StreamError, Streams, StreamTimeout
from campaign.measure import prompts
from campaign.measure.runner import Target
from campaign.server import argv, startup_log
from campaign.server.gpu import StepTelemetry
from campaign.server.profiles import FlagValue, LaunchProfile
from campaign.server.startup_log import StartupFacts
from campaign.sim import config as sim_config
from campaign.sim import model as sim_model
from campaign.sim import server as sim
from campaign.sim import truth as sim_truth
from campaign.sim.config import SimConfig
from campaign.sim.engine import Request, Tee, TruthSink
from campaign.sim.model import StepPower

T = TypeVar("T")
# The simulated clock's tick: looptime keeps its time as a count of ticks (no floating-point drift); at a
# nanosecond a 0.8 s TTFT is exact to about 1e-9 of itself (at looptime's default microsecond, to 1e-6).
RESOLUTION_S = 1e-9
HOST = "simulator"   # the name in each request's Host header; the socket, not the name, reaches the server
# Loop cycles with nothing to run before the clock moves: a coroutine that schedules its timer one cycle late
# (an async context manager's exit, a callback's follow-up) still gets it in before time passes.
SETTLE_CYCLES = 4


class InProcessStreams:
    """The measured path's client for the simulator in this process (StreamClient's interface): each request
    is checked by the server as over HTTP (sim.server.Server.completion) and its events, the bytes a server
    sends in each SSE event, reach `stream_completion` the moment the engine emits them, stamped with the
    loop's (simulated) time. No socket, no HTTP framing, no task per request (the server's chunk, the socket,
    llhttp, the SSE decoder and a task wake-up were each a token's cost): a5000-tuning with every kind
    measured this way took 35 s over the Unix socket here, 23 s this way (with the histograms' kept text and
    the tokenizer's fix). The idle limit works as over HTTP (a reply's headers come at once, so it also bounds
    the wait for the first token; the client's other streams getting data keep it open, Liveness); a request
    cancelled or timed out is aborted in the engine, as a closed connection is. The control plane but
    /metrics (/tokenize, ...) still goes over the socket."""

    connections_opened = 0

    def __init__(self, server: sim.Server, endpoint: Endpoint, limits: Limits | None) -> None:
        self.server = server
        self.endpoint = endpoint
        self.limits = limits or Limits()
        self.headers = {"authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
        self._flight: dict[asyncio.Future[None], sim.Stream] = {}
        self._closed = False
        self.liveness = Liveness()

    async def __aenter__(self) -> InProcessStreams:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def open_idle(self, count: int) -> None:
        """Nothing to open: a burst's sends are not spread by connects here."""

    async def aclose(self) -> None:
        self._closed = True
        for done, stream in list(self._flight.items()):   # a request still in flight ends now, and says why
            self.server.engine.abort(stream.req)
            if not done.done():
                done.set_exception(StreamError("closed", "the client was closed with the request in flight"))

    async def post_stream(self, path: str, body: dict[str, Any],
                          on_event: Callable[[float, bytes], None]) -> Reply:
        if self._closed:
            raise StreamError("closed", "the client was closed before the request was sent")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        sent_t = clock.now()
        last = sent_t
        events = 0
        limit = self.endpoint.timeouts.idle_s

        def event(data: bytes) -> None:
            nonlocal last, events
            if done.done():
                return   # timed out or cancelled: the engine aborts it at its next step
            last = clock.now()
            self.liveness.touch(last)
            events += 1
            try:
                on_event(last, data)
            except Exception as exc:   # the client's own failure ends its request, never the engine's step
                done.set_exception(exc if isinstance(exc, StreamError) else StreamError(
                    "protocol", f"reading an event failed: {type(exc).__name__}: {exc}"))

        def ended() -> None:
            if not done.done():
                done.set_result(None)

        def end() -> None:
            # The client hears the end a loop cycle late: after the engine has planned its next step (the
            # driver yields once to the streams, then plans), as over HTTP, where the reply's end crosses a
            # socket and the next request crosses it back. Heard at once, a closed loop's next request was
            # seated in the step planned the instant the last one ended, which no client of a real server gets:
            # h200-slo's concurrency search then held 5 streams in simulated time against 3 over HTTP (now 3).
            loop.call_soon(ended)

        opened = self.server.open_stream(path, self.headers, json.dumps(body, separators=(",", ":")).encode(),
                                         event, end)
        if isinstance(opened, sim.Refusal):
            return Reply(status=opened.status, content_type="application/json",
                         body=opened.body[: self.limits.error_body_bytes], events=0, http_version="1.1",
                         keep_alive=True, sent_t=sent_t)

        timer: asyncio.TimerHandle | None = None

        def check() -> None:   # re-armed only when it fires early, as StreamClient's timer
            nonlocal timer
            if done.done():
                return
            due = self.liveness.idle(last, clock.now(), events, limit)
            if isinstance(due, StreamTimeout):
                done.set_exception(due)
            else:
                timer = loop.call_later(due, check)

        timer = loop.call_later(limit, check)
        self._flight[done] = opened
        try:
            await done
        except BaseException:
            self.server.engine.abort(opened.req)
            raise
        finally:
            if timer is not None:
                timer.cancel()
            del self._flight[done]
        return Reply(status=200, content_type="text/event-stream", body=b"", events=events, http_version="1.1",
                     keep_alive=True, sent_t=sent_t)


class _InProcess:
    """The hook an Endpoint carries to the simulator in this process (new_client asks it for the client)."""

    def __init__(self, server: sim.Server) -> None:
        self.server = server

    def streams(self, endpoint: Endpoint, limits: Limits | None) -> Streams:
        return InProcessStreams(self.server, endpoint, limits)

    def samples(self, only: frozenset[str] | None) -> Iterable[Sample]:
        return self.server.metric_samples(only)


def target(config: SimConfig, facts: StartupFacts, uds: str, timeouts: Timeouts | None = None, *,
           server: sim.Server | None = None) -> Target:
    """What a Measurer knows of the simulator in process: what its startup log said, as of a launched server.
    With `server`, the measured requests reach it without the socket (InProcessStreams)."""
    endpoint = Endpoint(scheme="http", host=HOST, port=8000, api_key=config.api_key,
                        timeouts=timeouts or Timeouts(), uds=uds,
                        in_process=None if server is None else _InProcess(server))
    return Target.launched_as(endpoint, config.name, facts, max_num_seqs=config.max_num_seqs,
                              max_num_batched_tokens=config.max_num_batched_tokens)


@dataclass
class Launch:
    """One launch of the simulator in simulated time: the command the launcher built, the startup log the
    simulator printed for it and the facts the tool read from that log (as from any vLLM's)."""

    config: SimConfig
    command: list[str]
    flags: dict[str, FlagValue]
    log: str
    facts: StartupFacts

    def serve(self, *, truth: TruthSink | None = None) -> SimulatedServer:
        """The launch serving from this process in simulated time (its engine's truth to `truth`, if given)."""
        return SimulatedServer(self.config, self.config.memory(), self.facts, truth=truth)


def start(profile: LaunchProfile, flags: Mapping[str, FlagValue], *, seed: int, launch: str = "") -> Launch:
    """The launch's command line as the launcher builds it, parsed by the simulator, and its startup log; a
    start that fails is a LaunchError as the launcher raises it (bad argument, OOM, no room for the KV cache).
    `launch`: its identity in the night (`variant/repeat`): with the profile's `--seed` (not `seed`, the
    engine's), it draws the launch's noise as the same launch over HTTP draws it."""
    spec = argv.build(profile, flags, engine="sim", port=8000)
    command = spec.argv[spec.argv.index("campaign.sim") + 1:]
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            # The profile's environment is the server's: the vLLM variables it sets act as they would on it.
            config = sim_config.parse(command, launch=launch, env=sim_config.in_process_env(spec.env_overrides))
    except SystemExit:
        raise LaunchError(errors.getvalue().strip().splitlines()[-1], kind="bad_argument",
                          log_tail=errors.getvalue(), hint="see the simulator's usage line") from None
    return boot(replace(config, seed=seed), spec.redacted_argv(), spec.flags)


def boot(config: SimConfig, command: list[str] | None = None,
         flags: Mapping[str, FlagValue] | None = None) -> Launch:
    """A start in simulated time of a configuration already parsed (`start`'s, or one of `campaign tune`'s
    candidates): the startup log the simulator prints for it and the facts read from that log, as from any
    vLLM's; a start that fails is a LaunchError. `command` and `flags` are what the launch record keeps."""
    config = replace(config, time_scale=1.0, truth=None)
    # Faults of a process or of its HTTP traffic have nothing to act on here: refused, never silently ignored.
    faults = config.faults
    unserved = [name for name, on in (("hang-startup", faults.hang_startup), ("crash-after", faults.crash_after),
                                      ("ignore-sigterm", faults.ignore_sigterm), ("grandchild", faults.grandchild),
                                      ("foreign", faults.foreign_tok_s)) if on]
    if unserved:
        raise LaunchError(f"fault {', '.join(unserved)} (CAMPAIGN_SIM_FAULTS) is not replayed in simulated time",
                          kind="bad_argument", hint="unset CAMPAIGN_SIM_FAULTS, or run over HTTP (--clock wall)")
    lines: list[str] = []
    # The controller's CUDA_VISIBLE_DEVICES is not the simulated launch's: no GPU is placed here.
    started = sim.start_up(config, sim.Log(config, lines.append), visible_devices="")
    log = "".join(lines)
    facts = startup_log.parse(log)
    if started is None or facts.failure is not None:
        failure = facts.failure
        raise LaunchError(failure.message if failure else "the simulated start failed",
                          kind=failure.kind if failure else "engine_init_failed", log_tail=log[-4000:],
                          hint=failure.hint if failure else None)
    return Launch(config, list(command or []), dict(flags or {}), log, facts)


async def _cancel_the_rest() -> None:
    """Cancel and await every task still on the loop, as asyncio.run does before it closes one: a connection's
    handler still streaming a request its client gave up on would otherwise be left pending on a closed loop,
    and fail wherever the garbage collector finds it."""
    rest = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in rest:
        task.cancel()
    await asyncio.gather(*rest, return_exceptions=True)


class PowerMeter(sim_truth.Recorder):
    """A launch's GPU monitor in simulated time: the energy the simulator's power model gives the engine's steps
    (sim.truth.energy_j) over each measured step, where NVML's counter gives a real GPU's over the real one;
    the Measurer divides it by the step's tokens as it divides NVML's. It is a sink of the engine's steps (its
    requests are not kept) and a StepMonitor for the Measurer."""

    def __init__(self, config: SimConfig, power: StepPower) -> None:
        super().__init__()
        self.config = config
        self.power = power
        self._on = False

    def arrival(self, req: Request, t: float) -> None:
        """Requests are not kept: only the steps' energy is measured here."""

    def emit(self, req: Request, t: float, tokens: int) -> None:
        """Requests are not kept."""

    def finish(self, req: Request, t: float, reason: str) -> None:
        """Requests are not kept."""

    def _keep_step(self, step: sim_truth.StepTruth) -> None:
        if self._on:
            self.steps.append(step)

    def start(self) -> None:
        self.steps, self._on = [], True

    def stop(self) -> StepTelemetry | None:
        self._on = False
        if not self.steps:
            return None
        return StepTelemetry(samples=[], energy_j=sim_truth.energy_j(self.power, self.config.costs, self.steps),
                             energy_source="the simulator's power model")


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
        # Seeded by a string: random hashes it (SHA-512), the same in every process.
        self._salts = random.Random(f"prompts/{config.seed}/{config.launch}")
        self.loop = looptime.new_event_loop(start=0.0, noop_cycles=SETTLE_CYCLES, resolution=RESOLUTION_S)
        self._stack = contextlib.AsyncExitStack()
        # The GPUs' energy, where the hardware has a power model (a measured entry's fit): a Measurer's monitor.
        self.meter = None if config.power is None else PowerMeter(config, config.power)
        sinks = [sink for sink in (truth, self.meter) if sink is not None]
        sink = Tee(*sinks) if len(sinks) > 1 else sinks[0] if sinks else None
        served = sim.in_process(config, mem, sim.Log(config, log or self.lines.append), self.uds, truth=sink)
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
        return target(self.config, self.facts, self.uds, timeouts, server=self.server)

    def alive(self) -> bool:
        """In process, it lives as long as this object: a crash of the simulator is a crash of the tool."""
        return not self.loop.is_closed()

    def call(self, work: Coroutine[Any, Any, T]) -> T:
        """`work` to its end on the simulated clock (every measured stamp inside reads it), its prompts salted
        from the launch's seed and identity: the same night in simulated time reads the same every time."""
        with clock.given(self.loop.time), prompts.salted_by(self._salts):
            return self.loop.run_until_complete(work)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        try:
            self.call(self._stack.aclose())
            self.call(_cancel_the_rest())
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
