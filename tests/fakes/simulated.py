"""A simulated launch that writes the simulator's truth records, for the tests that check figures against them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from campaign.bench import truth
from campaign.night.launcher import LaunchedServer, launched
from campaign.server.profiles import FlagValue, load_profile


@contextmanager
def with_truth(folder: Path, profile: str, flags: dict[str, FlagValue], time_scale: float
               ) -> Iterator[tuple[LaunchedServer, Path]]:
    """`profile` launched on the simulator at `time_scale`, its log and truth records (truth.jsonl) in `folder`."""
    truth_path = folder / "truth.jsonl"
    loaded, _ = load_profile(profile)
    with truth.environment(CAMPAIGN_SIM_TIME_SCALE=f"{time_scale:g}", CAMPAIGN_SIM_TRUTH=str(truth_path)), \
            launched(loaded, folder / "server.log", flags, engine="sim") as server:
        yield server, truth_path
