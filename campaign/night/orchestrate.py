"""The night: check everything knowable before it (flags, executables, secrets), write the manifest, then
hand the schedule's launches to an executor (in-process, a pool of worker processes, or Ray) and say what is
left. One launch's work is `campaign.night.launch`.
"""

from __future__ import annotations

import math
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from campaign.analysis import recommend
from campaign.analysis.recommend import Judged
from campaign.core import secret
from campaign.core.errors import CampaignError, ConfigError
from campaign.core.hardware import resolve_hardware
from campaign.core.progress import Progress, fmt_duration
from campaign.measure import traces
from campaign.night import pool, ray_executor
from campaign.night.launch import Campaign, LaunchWork, Options, pending_launches, retired_rounds
from campaign.plan import limits, planning
from campaign.server import flag_list, gpu
from campaign.server.argv import api_key_from, resolve_path
from campaign.server.envinfo import machine_info, tool_info
from campaign.server.lifecycle import executable_missing
from campaign.server.profiles import (
    FlagValue,
    LaunchProfile,
    flag_problems,
    load_profile,
    parse_gpus,
    raise_flag_problems,
)
from campaign.spec.matrix import (
    AUTO_FIRST_ROUNDS,
    AUTO_MAX_REPEATS,
    Matrix,
    definition_hash,
    load_matrix,
    night_uses,
    schedule,
    suggested_margin,
)
from campaign.stored import store
from campaign.stored.records import (
    Definition,
    FailureRecord,
    MachineInfo,
    Manifest,
    ScheduleEntry,
    ServerRecord,
    ToolInfo,
)


@dataclass(frozen=True)
class Checked:
    source: str                 # where the flag list came from
    warnings: list[limits.Notice]


def preflight(profile: LaunchProfile, profile_path: Path, engine: str | None, matrix: Matrix | None = None,
              matrix_path: Path | None = None, overrides: dict[str, FlagValue] | None = None, *,
              will_launch: bool = True, placed: bool = False) -> Checked:
    """What can be known before the night, checked before it: the server's executable is here (when this
    machine is to launch it; a plan may be made elsewhere), every flag is one it accepts (all unknown ones
    in one error) with a value it takes, no launch is wider than the profile's GPUs nor its window longer than
    the model's, and no cell than the client can open. Returns where the flag list came from, and what is let
    through but said."""

    raise_flag_problems("launch --set", flag_problems("--set", dict(overrides or {})))
    limits.check_widths(profile, profile_path, matrix, matrix_path, overrides, placed=placed)
    limits.check_window(profile, profile_path, matrix, matrix_path, overrides)
    declare_secrets(profile, matrix, overrides)
    if will_launch:
        check_references(profile, profile_path, matrix, matrix_path, overrides)
    found = shutil.which(resolve_path(profile.executable), path=profile.env.get("PATH"))  # as Popen will look
    if will_launch and (engine or profile.engine) == "vllm" and found is None:
        raise executable_missing(profile.executable, where=f"{profile_path}: executable: ")
    flags = flag_list.for_profile(profile, engine)
    unlisted = flag_list.check(night_uses(profile, profile_path, matrix, matrix_path, list(overrides or {})), flags)
    seats = [] if matrix is None else limits.check_concurrency(matrix, matrix_path, profile, overrides,
                                                               here=will_launch)
    exposed = limits.dev_mode_exposed(profile, profile_path)
    stretched = limits.stretched_window(profile, profile_path, matrix, matrix_path, overrides)
    return Checked(flags.source, [*limits.unlisted_flags(unlisted, flags.source), *seats, *exposed, *stretched])


def declare_secrets(profile: LaunchProfile, matrix: Matrix | None = None,
                    overrides: dict[str, FlagValue] | None = None) -> None:
    """Make this process know the night's secrets (the API key, every `${NAME}` a flag or the environment refers
    to) before anything is written or printed: a pool's worker or a Ray task expands them, and its lines and
    files reach this process's console and store."""
    api_key_from(profile.api_key_env)
    secret.declare_references([profile.model_dump(mode="json"), dict(overrides or {}),
                               *([matrix.model_dump(mode="json")] if matrix is not None else [])])


def check_references(profile: LaunchProfile, profile_path: Path, matrix: Matrix | None = None,
                     matrix_path: Path | None = None, overrides: dict[str, FlagValue] | None = None) -> None:
    """Every `${NAME}` the night's servers need is set here, before the night (a launch would fail on it)."""
    places: list[tuple[str, str, Any]] = [(str(profile_path), "env", profile.env),
                                          (str(profile_path), "flags", profile.flags),
                                          ("launch", "--set", dict(overrides or {}))]
    if matrix is not None:
        places += [(str(matrix_path or matrix.name), f"variants[{i}].flags", v.flags)
                   for i, v in enumerate(matrix.variants)]
        places.append((str(matrix_path or matrix.name), "grid", matrix.grid))
    for where, key, value in places:
        for name, item in (value.items() if isinstance(value, dict) else []):
            missing = secret.unset(item)
            if missing:
                raise ConfigError(where, f"{key}.{name}", f"refers to ${{{missing[0]}}}, which is not set in this "
                                  "environment", hint=f"export {missing[0]}=... before the run (on Ray: on every node)")


def manifest(matrix: Matrix, matrix_path: Path, profile: LaunchProfile, profile_path: Path,
             options: Options, estimate: dict[str, Any] | None = None, pool: list[int] | None = None,
             ray: bool = False) -> Manifest:
    raw_matrix = matrix.model_dump(mode="json")
    raw_profile = profile.model_dump(mode="json")
    engine = options.engine or profile.engine
    return Manifest(
        campaign=matrix.name, created_utc=datetime.now(UTC).isoformat(), tool=ToolInfo(**tool_info()),
        matrix=Definition(path=str(matrix_path), raw=raw_matrix, hash=definition_hash(raw_matrix)),
        profile=Definition(path=str(profile_path), raw=raw_profile, hash=definition_hash(raw_profile)),
        engine=engine,
        # The simulator can run faster than the hardware it imitates; its rates then read this many times higher.
        # In simulated time (clock virtual) every figure is the hardware's.
        time_scale=float(os.environ.get("CAMPAIGN_SIM_TIME_SCALE", "1"))
        if engine == "sim" and options.clock == "wall" else 1.0,
        machine=MachineInfo(**machine_info()),
        schedule=[ScheduleEntry(variant=v, repeat=r) for v, r in schedule(matrix)],
        cells=[c.model_dump(mode="json") | {"key": c.key} for c in matrix.cells()],
        estimate=estimate, executor="ray" if ray else ("serial" if pool is None else "pool"), pool=pool,
        clock=options.clock, not_replayed=[])   # every kind runs in simulated time (format 9-17 could leave some)


# --- a night: one run directory, written by this process alone ---------------------------------------------
Judge = Callable[[store.RunDir], dict[str, Judged]]


def _short(text: str) -> str:
    """A reason short enough for a progress line."""
    return text if len(text) <= 220 else text[:217] + "..."


@dataclass
class Night:
    """A run directory being written, what it runs, and what to tell the user before it starts."""

    run: store.RunDir
    matrix: Matrix
    profile: LaunchProfile
    options: Options
    resumed: bool
    notices: list[str]
    pool: list[int] | None = None   # launches side by side on these GPUs; None: one at a time
    ray: bool = False               # launches as Ray tasks (ray_executor.py) instead
    ray_address: str | None = None

    def pending(self) -> list[LaunchWork]:
        return pending_launches(self.run, self.matrix)

    def estimate_s(self, work: list[LaunchWork]) -> float:
        """What the launches left will take, in wall seconds, at the per-launch estimate stored when the run
        began (the hardware's seconds: a simulator at a time scale lives them that many times faster; in
        simulated time, none to speak of: the pace of the cells done decides)."""
        if self.options.clock == "virtual":
            return 0.0
        return self._hardware_estimate_s(work) / self.run.manifest().time_scale

    def _hardware_estimate_s(self, work: list[LaunchWork]) -> float:
        """Each launch left at its own variant's stored estimate (a resume's are often mostly one variant)."""
        stored = self.run.manifest().estimate
        if stored is None:   # stored before estimates were (format < 5): as the plan would have stored it
            stored = planning.estimate(self.matrix, self.profile, 1, planning.rates_from(None, self.profile)).to_json()
        total = sum(planning.stored_launch_s(stored, w.variant) or 0.0 for w in work)
        if self.pool is not None and work:
            # Side by side: waves as wide as the pool has slots for the widest launch, each about their mean.
            jobs = pool_jobs(self.matrix, self.profile, [(w.variant, w.repeat) for w in work], self.pool)
            slots = max(1, len(self.pool) // int(max(j.width for j in jobs)))
            return total / len(work) * math.ceil(len(work) / slots)
        return total

    def execute_pending(self, live: bool | None) -> None:
        """What the schedule still holds, with a progress display sized from it (`execute`; the command line's
        own night also reports a resume with nothing left and a Ctrl-C, so it builds its display itself)."""
        work = self.pending()
        with Progress(total_cells=sum(len(w.cells) for w in work), estimate_s=self.estimate_s(work),
                      live=live) as progress:
            self.execute(progress)

    def execute(self, progress: Progress, judge: Judge = recommend.judged,
                clock: Callable[[], float] = time.monotonic) -> None:
        """Measure what the schedule still holds. A night run until settled (`repeats: auto`) then judges its
        variants after every round (`judge`: the diff's outcomes, recommend.judged), retires each once settled, and
        runs another round of the baseline and the variants still open, until none is open, `max_repeats`
        rounds are run, or the next round would overrun the `budget` (this invocation's wall clock)."""
        began = clock()
        self._execute_round(progress)
        if not self.matrix.until_settled:
            return
        round_s = clock() - began
        cap = max(self.matrix.max_repeats or AUTO_MAX_REPEATS, self.matrix.repeats)
        while True:
            rounds = self.matrix.repeats
            try:
                judged = judge(self.run)
            except CampaignError as exc:   # e.g. a baseline that never started: nothing to judge against
                progress.note(f"round {rounds}: the variants cannot be judged ({exc}); no more rounds")
                return
            still = "; ".join(f"{name} ({why})" for name, why in self._retire(judged, rounds, progress))
            if not still:
                progress.note(f"every variant settled after {rounds} round(s)")
                return
            if rounds >= cap:
                progress.note(f"max_repeats ({cap}) reached, still not settled: {still}")
                return
            spent = clock() - began
            if self.matrix.budget_s is not None and spent + round_s > self.matrix.budget_s:
                progress.note(f"budget spent ({fmt_duration(spent)} of {fmt_duration(self.matrix.budget_s)}; a round "
                              f"takes about {fmt_duration(round_s)}), still not settled: {still}")
                return
            progress.note(f"round {rounds + 1} of at most {cap}: still open: {still}")
            self.matrix = self.matrix.model_copy(update={"repeats": self.run.repeats(rounds, more=rounds + 1)})
            work = self.pending()
            progress.total += sum(len(w.cells) for w in work)
            started = clock()
            self._execute_round(progress)
            round_s = clock() - started

    def _retire(self, judged: dict[str, Judged], rounds: int, progress: Progress) -> list[tuple[str, str]]:
        """Store every newly settled variant as retired; the ones still open, each with why."""
        retired = self.run.settled()
        still = []
        for variant in self.matrix.ordered_variants():
            name = variant.name
            if name == self.matrix.baseline or name in retired:
                continue
            verdict = judged.get(name)
            if verdict is None:
                still.append((name, "nothing measured on both sides yet"))
            elif verdict.outcome != "not settled" or not verdict.settleable:
                self.run.write_settled(name, rounds, verdict.outcome, verdict.sentence)
                progress.note(f"{name}: settled after {rounds} round(s): {verdict.outcome}"
                              + ("" if verdict.settleable else f" ({_short(verdict.why)}; more rounds "
                                                                 "cannot settle it)"))
            else:
                still.append((name, _short(verdict.why)))
        return still

    def _execute_round(self, progress: Progress) -> None:
        if self.ray:
            self._execute_ray(progress)
        elif self.pool is None:
            Campaign(self.run, self.matrix, self.profile, options=self.options, progress=progress).execute()
        else:
            self._execute_pool(self.pool, progress)

    def _needs_baseline(self, variant: str) -> bool:
        """A `suggested` flag is resolved from the baseline's startup log: such a launch waits for one."""
        flags = next(v.flags for v in self.matrix.all_variants() if v.name == variant)
        return (any(suggested_margin(value) is not None for value in flags.values())
                and not any(s.variant == self.matrix.baseline for s in self.run.ready_servers()))

    def _execute_ray(self, progress: Progress) -> None:
        variants = {v.name: v for v in self.matrix.all_variants()}
        jobs = [pool.Job(w.variant, w.repeat, pool.width(self.profile, dict(variants[w.variant].flags)))
                for w in self.pending()]
        baseline = self.matrix.baseline

        def left(variant: str, repeat: int) -> tuple[list[str], list[str]] | None:
            work = next((w for w in self.pending() if w.variant == variant and w.repeat == repeat), None)
            return None if work is None else ([c.key for c in work.cells], [e.key for e in work.experiments])

        def blocked(job: pool.Job, done: set[tuple[str, int]]) -> bool:
            return self._needs_baseline(job.variant) and any(
                j.variant == baseline and (j.variant, j.repeat) not in done for j in jobs)

        executor = ray_executor.RayExecutor(self.run, progress, self.options.engine, _ray_address(self.ray_address),
                                            pending_work=left, blocked=blocked)
        executor.execute(jobs)

    def _execute_pool(self, gpus: list[int], progress: Progress) -> None:
        """The schedule's launches on a GPU pool, each in a worker process (pool.py says how they are placed)."""

        jobs = pool_jobs(self.matrix, self.profile, [(w.variant, w.repeat) for w in self.pending()], gpus)
        baseline = self.matrix.baseline
        runner: pool.Pool

        def blocked(job: pool.Job) -> bool:
            if not self._needs_baseline(job.variant):
                return False
            done = {(j.variant, j.repeat) for j, _ in runner.exit_codes}
            return any(j.variant == baseline and (j.variant, j.repeat) not in done for j in jobs)

        lock = threading.Lock()  # one reader thread per worker: their lines reach the display one at a time

        def relay(event: dict[str, object]) -> None:
            text = str(event.get("text", ""))
            with lock:
                {"cell": progress.cell_done, "status": progress.status}.get(str(event.get("event")),
                                                                            progress.note)(text)

        runner = pool.Pool(gpus=gpus, relay=relay, blocked=blocked, command=lambda job, on, cores: pool.worker_command(
            self.run.root, job, on, cores, self.options.engine))
        runner.run(jobs)
        for job, code in runner.exit_codes:
            if code != 0:
                progress.note(f"{job.variant} r{job.repeat + 1}: its worker exited with code {code}")

    def unfinished(self) -> list[str]:
        """What the night could not do: launches whose work is still not stored, or whose last record is a
        failure (one after its cells, in the warm check), with why; cells and experiments that Failed.
        Empty: everything the matrix asks for is measured."""
        last: dict[tuple[str, int], ServerRecord | FailureRecord] = {}
        for record in self.run.servers():  # in launch order: the last record of a launch wins
            last[(record.variant, record.repeat)] = record
        pending = {(w.variant, w.repeat) for w in self.pending()}
        out = []
        for variant, repeat in schedule(self.matrix, retired_rounds(self.run, self.matrix)):
            latest = last.get((variant, repeat))
            failed = latest.failure_kind if isinstance(latest, FailureRecord) else None
            if (variant, repeat) in pending or failed:
                out.append(f"{variant} r{repeat + 1} ({failed or 'not measured'})")
        out += [f"{c.variant} r{c.repeat + 1} {c.result.spec.key}" for c in self.run.cells()
                if c.result.status == "Failed"]
        out += [f"{e.variant} r{e.repeat + 1} {e.result.key}" for e in self.run.experiments()
                if e.result.status == "Failed"]
        return out


@contextmanager
def started(matrix: Matrix, matrix_path: Path, profile: LaunchProfile, profile_path: Path, *, engine: str | None,
            out: Path, gpus: list[int] | None = None, mixed_gpus: bool = False, ray: bool = False,
            ray_address: str | None = None, clock: Literal["wall", "virtual"] = "wall") -> Iterator[Night]:
    """A new run: checked before anything is made (executable, every flag), estimated, its manifest written.
    In simulated time (clock virtual) every cell kind and experiment is measured, on the simulator's clock."""

    if clock == "virtual":
        _check_virtual(profile, profile_path, engine, gpus=gpus, ray=ray)
    checked = preflight(profile, profile_path, engine, matrix, matrix_path, placed=gpus is not None or ray)
    gpus = gpus if gpus is not None or ray or clock == "virtual" else _profile_pool(profile, profile_path)
    _check_ray_options(ray, gpus, ray_address)
    if ray:
        widest = max(pool.width(profile, dict(v.flags)) for v in matrix.all_variants())
        # The simulator on a local Ray: the simulated cards (the profile's hardware), at least the widest launch.
        cards = resolve_hardware(profile.hardware)
        simulated = max(widest, cards[1] if cards else 1) if (engine or profile.engine) == "sim" else None
        ray_executor.connect(_ray_address(ray_address), widest, simulated_gpus=simulated)
    if gpus is not None:
        check_pool(gpus, engine or profile.engine, mixed_gpus=mixed_gpus)
        pool_jobs(matrix, profile, [(v, r) for v, r in schedule(matrix)], gpus)  # each launch fits the pool
    estimated = planning.estimate(matrix, profile, len(schedule(matrix)),
                                  planning.rates_from(store.latest_run(out, matrix.name), profile))
    run = store.RunDir.create(out, matrix.name)
    options = Options(engine=engine, max_attempts=matrix.max_attempts, clock=clock)
    with run.writer() as locked:
        store.write_new(run.manifest_path, manifest(matrix, matrix_path, profile, profile_path, options,
                                                    estimated.to_json(), gpus, ray=ray))
        notices = [f"flags checked against {checked.source}", *(w.line() for w in checked.warnings),
                   f"run directory: {run.root}", *_unlocked(locked)]
        if clock == "virtual":
            notices.append("in simulated time: the simulator serves each launch in this process on its own clock, "
                           "figures in the hardware's units")
        if gpus is not None:
            notices.append(f"GPU pool: {', '.join(map(str, gpus))} (launches side by side, each on its own GPUs)")
        yield Night(run, matrix, profile, options, resumed=False, notices=notices, pool=gpus, ray=ray,
                    ray_address=ray_address)


@contextmanager
def resumed(root: Path, *, engine: str | None, more_repeats: int | None, gpus: list[int] | None = None,
            mixed_gpus: bool = False, ray: bool | None = None, ray_address: str | None = None) -> Iterator[Night]:
    """A run continued: rebuilt from its manifest under its lock; damaged files set aside (kept, renamed) so
    that what they held is measured again; the repeats raised if asked."""
    run = store.RunDir(root)
    if not run.manifest_path.exists():
        raise CampaignError(f"{root}: not a run directory (no manifest.json)",
                            hint="give the folder `campaign run` printed, e.g. runs/demo/20261201T000000Z")
    with run.writer() as locked:
        stored = run.manifest()
        traces.check_unchanged(stored.cells)  # a resume replays the traces it began with
        matrix = stored.matrix_model()
        declare_secrets(stored.profile_model(), matrix)
        matrix = matrix.model_copy(update={"repeats": run.repeats(matrix.repeats, more=more_repeats)})
        engine = engine or stored.engine
        notices = [f"{damaged} was damaged (not valid JSON): kept as {kept.name}; what it held is measured again"
                   for damaged, kept in run.set_aside_damaged()]
        notices += [f"resuming {run.root}: {len(run.cells())} cells already stored", *_unlocked(locked)]
        # A resume keeps its executor and pool unless given others.
        on_ray = stored.executor == "ray" if ray is None else ray
        _check_ray_options(on_ray, gpus, ray_address)
        gpus = None if on_ray else (gpus if gpus is not None else stored.pool)
        if gpus is not None:
            check_pool(gpus, engine, mixed_gpus=mixed_gpus)
        options = Options(engine=engine, max_attempts=matrix.max_attempts, clock=stored.clock)
        if stored.clock == "virtual":
            _check_virtual(stored.profile_model(), Path(stored.profile.path), engine, gpus=gpus, ray=on_ray)
        yield Night(run, matrix, stored.profile_model(), options, resumed=True, notices=notices, pool=gpus,
                    ray=on_ray, ray_address=ray_address)


def pool_jobs(matrix: Matrix, profile: LaunchProfile, launches: list[tuple[str, int]], gpus: list[int]) -> list[Any]:
    """The launches as a pool's jobs, each as wide as its variant's parallel size (pool.plan places them)."""

    variants = {v.name: v for v in matrix.all_variants()}
    return pool.plan([(v, r, pool.width(profile, dict(variants[v].flags))) for v, r in launches], gpus,
                     [v.name for v in matrix.ordered_variants()])


def _check_virtual(profile: LaunchProfile, profile_path: Path, engine: str | None, *, gpus: list[int] | None,
                   ray: bool) -> None:
    """Simulated time replays the simulator's engine, of a profile that names its hardware, in this process."""
    if (engine or profile.engine) != "sim":
        raise CampaignError("--clock virtual replays the simulator's engine in simulated time: it needs the "
                            "simulator", hint="add --engine sim (or run real servers on the wall clock)")
    if not profile.simulatable:
        raise ConfigError(str(profile_path), "hardware", "the profile names no simulated hardware",
                          hint="give it hardware: and model_shape: (as launch_profiles/h200.yaml does), or a model "
                               "whose config.json the simulator reads (a local folder, or one it ships the config of)")
    if gpus is not None or ray:
        raise CampaignError("--clock virtual runs every launch in this process: it takes no GPU pool or Ray",
                            hint="drop --gpus/--executor ray (or the profile's gpus:)")


def _ray_address(given: str | None) -> str | None:
    """--ray-address, else RAY_ADDRESS, else None (Ray starts a local instance)."""
    return given or os.environ.get("RAY_ADDRESS") or None


def _check_ray_options(ray: bool, gpus: list[int] | None, address: str | None) -> None:
    if ray and gpus is not None:
        raise CampaignError("--gpus and --executor ray: Ray places launches on its nodes' GPUs itself",
                            hint="drop --gpus (Ray's num_gpus per node says what each node has)")
    if not ray and address is not None:
        raise CampaignError("--ray-address without --executor ray: this run does not use Ray",
                            hint="add --executor ray, or drop --ray-address")


def _profile_pool(profile: LaunchProfile, path: Path) -> list[int] | None:
    return None if profile.gpus is None else parse_gpus(profile.gpus, where=f"{path}: gpus")


def check_pool(gpus: list[int], engine: str, *, mixed_gpus: bool) -> None:
    """Before the night: on real GPUs, every pool index exists and the pool is one GPU model (launches on two
    models are not comparable, unless the user says they are). The simulator's GPUs are only names."""
    if engine == "sim":
        return
    devices = gpu.devices(gpus)
    missing = [d["index"] for d in devices if d["uuid"] is None]
    if gpu.available() and missing:
        raise CampaignError(f"--gpus: no GPU {', '.join(map(str, missing))} on this host",
                            hint="nvidia-smi -L lists the GPUs here")
    models = sorted({str(d["name"]) for d in devices if d["name"]})
    if len(models) > 1 and not mixed_gpus:
        raise CampaignError(f"--gpus: the pool mixes GPU models ({', '.join(models)}): their launches are not "
                            "comparable", hint="give GPUs of one model, or --mixed-gpus to compare them anyway")


def _unlocked(locked: bool) -> list[str]:
    return [] if locked else ["warning: this filesystem has no file locks: nothing stops a second writer of this run"]


def load_night(matrix_name: str, profile_name: str | None, window: float | None,
               repeats: int | None, *, until_settled: bool = False) -> tuple[Matrix, Path, LaunchProfile, Path]:
    """The matrix and its profile for a night, with the command line's --window, --repeats and --until-settled
    applied (--until-settled is `repeats: auto`: from --repeats, else 2, up to the matrix's max_repeats)."""
    matrix, matrix_path, _ = load_matrix(matrix_name)
    updates: dict[str, Any] = {}
    if window is not None:
        updates["window_s"] = window
        updates["workloads"] = [w.model_copy(update={"window_s": None}) if w.kind == "decode" else w
                                for w in matrix.workloads]
    if repeats is not None:
        updates["repeats"] = repeats
    if until_settled and not matrix.until_settled:
        first = repeats if repeats is not None else AUTO_FIRST_ROUNDS
        updates |= {"until_settled": True, "repeats": first, "max_repeats": max(AUTO_MAX_REPEATS, first)}
    if updates:
        matrix = matrix.model_copy(update=updates)
    profile, profile_path = load_profile(profile_name or matrix.profile)
    return matrix, matrix_path, profile, profile_path
