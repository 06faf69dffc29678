"""A GPU pool on one host: launches side by side, each on its own GPUs, port, log and client process.

The schedule is the serial one (rounds A B C, C B A, ...), so launches next to each other in it, the ones
that run side by side, are the variants a round compares. Each launch gets a slot: `width` GPUs, the variant's
tensor x pipeline parallel size. Where every launch has the same width, slots are planned in advance by the
launch's place in the schedule (slot k mod n), so a variant's repeats move across the GPUs the way a round's
order turns: A on GPU 0 and B on GPU 1, then the reverse, and the difference between two physical GPUs
cancels in the diff as time drift does (summary.gpu_effect reports what it measured). Mixed widths take the
first free GPUs that fit.

Each launch runs in a worker process (`python -m campaign.night.worker`), which owns its server's process tree and
measures it from its own event loop, pinned to its own CPU cores where the host has two or more per slot:
one client never measures two servers, and two clients never share an interpreter lock. Workers write into
the run directory (every file is written once, under a name no other launch uses) and report progress as
JSON lines that this controller relays.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from campaign.core.errors import CampaignError, check_stop
from campaign.core.vllm_flags import merge, parallel_width
from campaign.server.profiles import FlagValue, LaunchProfile

# A worker asked to stop (Ctrl-C) stops its server first; past this it is killed (its server's group too,
# by the server's own die-with-parent signal).
STOP_GRACE_S = 90.0


def width(profile: LaunchProfile, variant_flags: dict[str, FlagValue]) -> int:
    """GPUs one launch of the variant needs: tensor x pipeline x data parallel size (the variant's over the
    profile's, whatever the spelling); 1 where a size is not a number yet (the plan refuses a bad one)."""
    return parallel_width(merge(profile.flags, variant_flags)) or 1


@dataclass(frozen=True)
class Job:
    variant: str
    repeat: int
    width: int
    slot: tuple[int, ...] | None = None  # planned GPUs; None: the first free ones that fit


def plan(launches: Sequence[tuple[str, int, int]], gpus: Sequence[int], variants: Sequence[str] = ()) -> list[Job]:
    """Jobs for (variant, repeat, width) in schedule order. One width for all: the slots are planned, variant
    i's repeat r on slot (i + r) mod n (`variants`: the matrix's order; default: first seen), so the variants
    side by side in a round are on different slots and each variant moves one slot along per repeat. A launch
    wider than the pool is an error before the night, not a launch that waits forever."""
    widest = max((w for _, _, w in launches), default=1)
    if widest > len(gpus):
        name = next(v for v, _, w in launches if w == widest)
        raise CampaignError(f"{name} needs {widest} GPUs (tensor x pipeline x data parallel size); the pool has "
                            f"{len(gpus)}", hint="give --gpus more GPUs, or lower the variant's parallel size")
    widths = {w for _, _, w in launches}
    if len(widths) != 1:
        return [Job(v, r, w) for v, r, w in launches]
    (w,) = widths
    slots = [tuple(gpus[i * w:(i + 1) * w]) for i in range(len(gpus) // w)]
    order = list(dict.fromkeys([*variants, *(v for v, _, _ in launches)]))
    return [Job(v, r, w, slots[(order.index(v) + r) % len(slots)]) for v, r, w in launches]


@dataclass
class _Running:
    job: Job
    gpus: tuple[int, ...]
    process: subprocess.Popen[str]
    reader: threading.Thread
    cores: list[int] | None


def core_sets(slots: int, cpus: Sequence[int]) -> list[list[int]] | None:
    """Disjoint CPU cores per slot, where the host has at least two per slot; None: no pinning."""
    per = len(cpus) // max(1, slots)
    if per < 2:
        return None
    return [list(cpus[i * per:(i + 1) * per]) for i in range(slots)]


@dataclass
class Pool:
    """Runs jobs on `gpus`; `command(job, gpus, cores)` is the worker's argv. `relay(event)` gets each JSON
    line a worker prints. `blocked(job)` holds a job back (a `suggested` flag waits for the baseline's log)."""

    gpus: list[int]
    command: Callable[[Job, tuple[int, ...], list[int] | None], list[str]]
    relay: Callable[[dict[str, object]], None]
    blocked: Callable[[Job], bool] = lambda job: False
    env: dict[str, str] = field(default_factory=dict)
    poll_s: float = 0.05
    exit_codes: list[tuple[Job, int]] = field(default_factory=list)

    def run(self, jobs: list[Job]) -> None:
        waiting = list(jobs)
        running: list[_Running] = []
        busy: set[int] = set()
        # As many core sets as launches can run at once (the narrowest fill the pool), so each is pinned.
        narrowest = min((j.width for j in jobs), default=1)
        cores = core_sets(max(1, len(self.gpus) // narrowest), sorted(os.sched_getaffinity(0)))
        free_cores = list(range(len(cores))) if cores else []
        try:
            while waiting or running:
                check_stop()
                for r in [r for r in running if r.process.poll() is not None]:
                    r.reader.join()
                    running.remove(r)
                    busy.difference_update(r.gpus)
                    if cores and r.cores is not None:
                        free_cores.append(cores.index(r.cores))
                    self.exit_codes.append((r.job, r.process.returncode))
                claimed: set[int] = set()
                for job in list(waiting):
                    if self.blocked(job):
                        continue  # it waits for the baseline, and holds no GPUs back from the baseline
                    gpus = self._fit(job, busy)
                    # Planned slots keep their order: a job never overtakes an earlier one on its GPUs.
                    if job.slot is not None and claimed & set(job.slot):
                        continue
                    if gpus is None:
                        claimed.update(job.slot or ())
                        continue
                    pinned = cores[free_cores.pop(0)] if cores and free_cores else None
                    running.append(self._start(job, gpus, pinned))
                    busy.update(gpus)
                    waiting.remove(job)
                if waiting and not running:
                    # Nothing runs and nothing could start: waiting longer changes nothing.
                    first = waiting[0]
                    why = "it waits for a baseline launch that will not come" if self.blocked(first) else \
                        "no GPUs of the pool fit it"
                    raise CampaignError(f"{first.variant} r{first.repeat + 1} cannot start: {why}",
                                        hint="a `suggested` flag needs the baseline launched first; "
                                             "CAMPAIGN_DEBUG=1 and a report, if not that")
                time.sleep(self.poll_s)
        except BaseException:
            self._stop_all(running)
            raise

    def _fit(self, job: Job, busy: set[int]) -> tuple[int, ...] | None:
        if job.slot is not None:
            return job.slot if not busy & set(job.slot) else None
        free = [g for g in self.gpus if g not in busy]
        return tuple(free[:job.width]) if len(free) >= job.width else None

    def _start(self, job: Job, gpus: tuple[int, ...], cores: list[int] | None) -> _Running:
        process = subprocess.Popen(  # noqa: S603 - our own interpreter and module, never a shell
            self.command(job, gpus, cores), stdout=subprocess.PIPE, text=True, bufsize=1,
            env=os.environ | self.env)
        reader = threading.Thread(target=self._read, args=(process,), daemon=True)
        reader.start()
        return _Running(job, gpus, process, reader, cores)

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                event = {"event": "note", "text": line.rstrip("\n")}
            if isinstance(event, dict):
                self.relay(event)

    @staticmethod
    def _stop_all(running: list[_Running]) -> None:
        """Ctrl-C (or a failure here): every worker stops its server and writes what it has; then it is gone."""
        for r in running:
            if r.process.poll() is None:
                r.process.send_signal(signal.SIGINT)
        deadline = time.monotonic() + STOP_GRACE_S
        for r in running:
            try:
                r.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                r.process.kill()
                r.process.wait()
            r.reader.join(timeout=5)


def worker_command(root: Path, job: Job, gpus: tuple[int, ...], cores: list[int] | None,
                   engine: str | None) -> list[str]:
    argv = [sys.executable, "-m", "campaign.night.worker", str(root), job.variant, str(job.repeat),
            "--gpus", ",".join(map(str, gpus)), "--parent", str(os.getpid())]
    if cores:
        argv += ["--cores", ",".join(map(str, cores))]
    if engine:
        argv += ["--engine", engine]
    return argv
