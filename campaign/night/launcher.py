"""Launch a profile, learn what the server became (log + live cross-check), always stop it."""

from __future__ import annotations

from collections.abc import Coroutine, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, TypeVar

from campaign.core import aio
from campaign.http.endpoint import Timeouts
from campaign.measure.runner import Target
from campaign.server import argv, startup_log
from campaign.server.control import ControlClient, cross_check
from campaign.server.gpu import StepMonitor
from campaign.server.lifecycle import ReadyInfo, ServerProcess
from campaign.server.profiles import FlagValue, LaunchProfile

T = TypeVar("T")


class Served(Protocol):
    """A server a launch measures, on its clock: a launched one over HTTP on the wall clock (LaunchedServer) or
    the simulator in this process on its own (measure.simulated.SimulatedServer). The launch's cells, warm-up,
    warm check and experiments are the same code on either; `call` runs one of them on the server's clock."""

    @property
    def facts(self) -> startup_log.StartupFacts: ...

    @property
    def max_num_seqs(self) -> int | None: ...

    @property
    def meter(self) -> StepMonitor | None:
        """The server's own meter of its GPUs' energy, where it brings one (the simulator's power model, in
        simulated time); None: the launch's NVML monitor, if any, meters the real GPUs."""
        ...

    def target(self, timeouts: Timeouts | None = None) -> Target: ...

    def alive(self) -> bool: ...

    def call(self, work: Coroutine[Any, Any, T]) -> T: ...


@dataclass(kw_only=True)
class LaunchedServer:
    spec: argv.LaunchSpec
    process: ServerProcess
    ready: ReadyInfo
    facts: startup_log.StartupFacts
    ready_utc: str                 # when it answered /health and its facts were read, ISO 8601 UTC
    warnings: list[str] = field(default_factory=list)

    def control(self) -> ControlClient:
        return ControlClient(self.spec.endpoint())

    def alive(self) -> bool:
        return self.process.alive()

    def call(self, work: Coroutine[Any, Any, T]) -> T:
        """`work` on a fresh event loop, on the wall clock."""
        return aio.run(work)

    @property
    def meter(self) -> StepMonitor | None:
        """A real server brings no meter of its own: NVML's counters are the launch's."""
        return None

    @property
    def max_num_seqs(self) -> int | None:
        """The scheduler cap as launched; None when the flags left it to vLLM's card-dependent default."""
        return self._flag_int("max-num-seqs")

    def _flag_int(self, name: str) -> int | None:
        value = self.spec.flags.get(name)
        try:
            return int(str(value)) if value is not None else None
        except ValueError:
            return None

    def target(self, timeouts: Timeouts | None = None) -> Target:
        """What a Measurer needs to know of this server: where it is and what it became."""
        return Target.launched_as(self.spec.endpoint(timeouts), self.spec.served_model_name, self.facts,
                                  max_num_seqs=self.max_num_seqs,
                                  max_num_batched_tokens=self._flag_int("max-num-batched-tokens"))


@contextmanager
def launched(
    profile: LaunchProfile,
    log_path: Path,
    overrides: Mapping[str, FlagValue] | None = None,
    *,
    engine: str | None = None,
    startup_timeout_s: float | None = None,
    launch: str | None = None,
) -> Iterator[LaunchedServer]:
    """`launch`: the launch's identity in its night (`variant/repeat`), for the simulator (argv.build)."""
    spec = argv.build(profile, overrides, engine=engine, launch=launch)
    process = ServerProcess(spec, log_path, startup_timeout_s=startup_timeout_s or profile.startup_timeout_s)
    with process:
        ready = process.wait_ready()
        facts = startup_log.parse(log_path.read_text(errors="replace"))
        with ControlClient(spec.endpoint()) as control:
            facts, warnings = cross_check(facts, control)
        yield LaunchedServer(spec=spec, process=process, ready=ready, facts=facts, warnings=warnings,
                             ready_utc=datetime.now(UTC).isoformat())
