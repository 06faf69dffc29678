"""A simulated launch that keeps the simulator's truth records, for the tests that check figures against them:
over HTTP at a time scale (its truth.jsonl), or in this process in simulated time (in memory)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from campaign.bench import truth
from campaign.cli import run_cli
from campaign.http.endpoint import Timeouts
from campaign.measure.cells import CellResult, CellSpec
from campaign.measure.runner import Measurer
from campaign.measure.simulated import SimulatedServer, start
from campaign.night.launcher import LaunchedServer, launched
from campaign.server.profiles import FlagValue, load_profile
from campaign.sim import truth as sim_truth


@contextmanager
def with_truth(folder: Path, profile: str, flags: dict[str, FlagValue], time_scale: float
               ) -> Iterator[tuple[LaunchedServer, Path]]:
    """`profile` launched on the simulator at `time_scale`, its log and truth records (truth.jsonl) in `folder`."""
    truth_path = folder / "truth.jsonl"
    loaded, _ = load_profile(profile)
    with truth.environment(CAMPAIGN_SIM_TIME_SCALE=f"{time_scale:g}", CAMPAIGN_SIM_TRUTH=str(truth_path)), \
            launched(loaded, folder / "server.log", flags, engine="sim") as server:
        yield server, truth_path


@dataclass
class InSimulatedTime:
    """A launch serving from this process in simulated time (no socket, no sleep: the engine's clock), with
    every request and step the engine recorded: the truth a figure is checked against, delivered with no delay."""

    server: SimulatedServer
    recorded: sim_truth.Recorder

    def measure(self, spec: CellSpec, timeouts: Timeouts | None = None) -> CellResult:
        """One cell measured by the Measurer, as a night measures it."""
        return self.server.call(Measurer(self.server.target(timeouts)).run_cell(spec))

    def truth(self) -> truth.Matched:
        """The engine's records of the requests finished so far, matched to the client's by their ids."""
        return truth.Matched(sim_truth.Truth(header={"time_scale": 1.0, "anchor": self.server.anchor},
                                             requests=self.recorded.requests, steps=self.recorded.steps))


@contextmanager
def in_simulated_time(profile: str, flags: dict[str, FlagValue], *, seed: int = 0) -> Iterator[InSimulatedTime]:
    """`profile` launched as a night launches it in simulated time (measure.simulated.start), serving until the
    block ends."""
    launch = start(load_profile(profile)[0], flags, seed=seed)
    recorded = sim_truth.Recorder()
    with launch.serve(truth=recorded) as server:
        yield InSimulatedTime(server, recorded)


def night_in_simulated_time(folder: Path, matrix: dict[str, Any]) -> Path:
    """`campaign run` of `matrix` (a mapping, written as `folder`/NAME.yaml) on the simulator in simulated time,
    without the report; the run's folder."""
    path = folder / f"{matrix['name']}.yaml"
    path.write_text(yaml.safe_dump(matrix))
    runs = folder / "runs"
    code = run_cli(["run", "--no-report", str(path), "--engine", "sim", "--clock", "virtual", "--out", str(runs),
                    "--plain"])
    assert code == 0, f"campaign run {path} exited {code}"
    (run,) = [p for p in (runs / matrix["name"]).iterdir() if p.is_dir()]
    return run
