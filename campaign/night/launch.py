"""One launch of the night: start the variant's server, record what it became, measure its unfinished cells,
stop it. Failures are data: a launch that never becomes ready is recorded and the campaign goes on; a server
that dies mid-cell is relaunched and the cell retried once, then marked Failed. Every cell is written the
moment it finishes, so Ctrl-C or a crash loses at most the cell in flight, and `--resume` picks up there.

The controller runs it in-process (serially), a pool's worker process runs it (`campaign.night.worker`) and
a Ray task runs it (`campaign.night.ray_executor`); the night that schedules launches is `orchestrate`.

Long (about 520 lines): a launch's whole life (flags, start, cells, warm check, guard, experiments, and the
records of its start, stop, failure and placement) is one class, so that its clean-up sees every path out.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, Literal

import httpx

from campaign.core.errors import (
    CampaignError,
    LaunchError,
    MetricMissingError,
    PromptError,
    ResultFormatError,
    check_stop,
)
from campaign.core.progress import Progress
from campaign.core.vllm_flags import canonical_name, out_of_bounds
from campaign.http.endpoint import Timeouts
from campaign.measure import capacity, simulated, study
from campaign.measure.cells import CellResult, CellSpec, Finding, Reason, findings_fields, not_warm, past_model_window
from campaign.measure.runner import Measurer
from campaign.night.launcher import LaunchedServer, Served, launched
from campaign.plan import limits
from campaign.server import gpu
from campaign.server.lifecycle import log_tail
from campaign.server.profiles import FlagValue, LaunchProfile
from campaign.spec.matrix import (
    AgentsExperiment,
    ContextWindowExperiment,
    Experiment,
    LongContextExperiment,
    Matrix,
    OverloadExperiment,
    PrefixOrderExperiment,
    SloSearchExperiment,
    Variant,
    schedule,
    suggested_margin,
)
from campaign.stored import store
from campaign.stored.records import (
    FailureRecord,
    GpuDevice,
    PlacementRecord,
    ServerRecord,
    StopRecord,
    WarmupRecord,
)


def launch_identity(variant: str, repeat: int) -> str:
    """A launch's identity in its night, the same on every run of it (and its relaunches): what the simulator's
    launch noise is drawn from, over HTTP and in simulated time alike."""
    return f"{variant}/{repeat}"


@dataclass(frozen=True)
class LaunchWork:
    variant: str
    repeat: int
    cells: list[CellSpec]
    experiments: list[Experiment]


def retired_rounds(run: store.RunDir, matrix: Matrix) -> dict[str, int]:
    """The variants a night run until settled retired, with the rounds they ran (schedule leaves them out of
    later rounds); one that an open variant is compared to (`compare_to`) runs on while that one is open."""
    settled = {name: record.rounds for name, record in run.settled().items()}
    needed = {v.compare_to for v in matrix.all_variants() if v.compare_to and v.name not in settled}
    return {name: rounds for name, rounds in settled.items() if name not in needed}


def pending_launches(run: store.RunDir, matrix: Matrix) -> list[LaunchWork]:
    """The launches of the schedule that still have something to measure. Each key (cell or experiment) is
    the matrix's, the one it is stored under, so a resumed run skips exactly what is stored."""
    out = []
    for variant, repeat in schedule(matrix, retired_rounds(run, matrix)):
        cells = [c for c in matrix.cells() if not run.done(variant, c.key, repeat)]
        experiments = [e for e in matrix.experiments() if not run.experiment_path(variant, e.key, repeat).exists()]
        if cells or experiments:
            out.append(LaunchWork(variant, repeat, cells, experiments))
    return out


@dataclass(kw_only=True)
class Options:
    engine: str | None = None
    max_attempts: int = 3
    gpus: list[int] | None = None           # this launch's GPUs (CUDA_VISIBLE_DEVICES); None: the host's
    executor: Literal["serial", "pool", "ray"] = "serial"
    client_cores: list[int] | None = None   # pin the measuring client here once the server is up
    node: str | None = None                 # the Ray node it runs on (executor ray)
    clock: Literal["wall", "virtual"] = "wall"  # virtual: the simulator in this process, in simulated time


async def slo_search(measurer: Measurer, experiment: SloSearchExperiment, matrix: Matrix, *,
                     ceiling: int | None, on_probe: Callable[[str], None] | None = None) -> study.ExperimentResult:
    """A matrix's capacity search as a night runs it: its SLO, probes and bracket; the concurrency search up to
    the experiment's ceiling, else `ceiling` (the server's max-num-seqs)."""
    return await capacity.slo_search(
        measurer, experiment.spec(matrix.window_s, matrix.slo), start_rps=experiment.start_rps,
        resolution=experiment.resolution, max_probes=experiment.max_probes, concurrency=experiment.concurrency,
        concurrency_ceiling=experiment.max_concurrency or ceiling, on_probe=on_probe)


class Campaign:
    def __init__(self, run: store.RunDir, matrix: Matrix, profile: LaunchProfile, *, options: Options,
                 progress: Progress) -> None:
        self.run = run
        self.matrix = matrix
        self.profile = profile
        self.options = options
        self.progress = progress
        self.cells = matrix.cells()
        self.variants = {v.name: v for v in matrix.all_variants()}
        self._baseline_facts: dict[str, Any] | None = None

    # --- the loop ----------------------------------------------------------------------------------------
    def execute(self) -> None:
        for work in pending_launches(self.run, self.matrix):
            check_stop()
            self.serve(work)

    def serve(self, work: LaunchWork) -> None:
        """One launch of the schedule (and its relaunches), start to stop: the serial loop's step, and what a
        pool's worker process does."""
        self._serve(self.variants[work.variant], work.repeat, work.cells, work.experiments)

    def _placed_profile(self) -> LaunchProfile:
        """The profile as this launch runs it: on a pool, its GPUs only, and a port of its own."""
        if self.options.gpus is None:
            return self.profile
        # CUDA counts GPUs fastest first unless told otherwise; NVML (and nvidia-smi) in PCI bus order: in bus
        # order, the indices the placement records with their NVML UUIDs are the GPUs the server gets.
        return self.profile.model_copy(update={
            "env": {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", **self.profile.env,
                    "CUDA_VISIBLE_DEVICES": ",".join(map(str, self.options.gpus))},
            "port": "auto"})

    @contextmanager
    def _client_pinned(self) -> Iterator[None]:
        """The measuring client on its own cores while it measures; the server, started before, is not pinned
        (a child inherits its parent's affinity), and a relaunch starts from the unpinned thread again."""
        cores = self.options.client_cores
        if not cores or not hasattr(os, "sched_setaffinity"):
            yield
            return
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, cores)
        try:
            yield
        finally:
            os.sched_setaffinity(0, before)

    def _resolve_flags(self, variant: Variant) -> tuple[dict[str, FlagValue], dict[str, Any] | None]:
        """The flags to launch with, and how a `suggested` value was resolved (stored with the launch)."""
        flags: dict[str, FlagValue] = {}
        resolution: dict[str, Any] | None = None
        for key, value in variant.flags.items():
            margin = suggested_margin(value)
            if margin is not None:
                suggested = self._baseline_suggestion()
                if suggested is None:
                    raise LaunchError(
                        f"{key}: suggested, but the baseline's startup log carries no memory-utilisation advice",
                        kind="unresolved_flag",
                        hint="vLLM prints the advice on CUDA GPUs from 0.21 on; set a number instead")
                value = round(suggested - margin, 4)
                refused = out_of_bounds("gpu-memory-utilization", value)
                if refused is not None:   # vLLM's advice less the margin must still be a share vLLM takes
                    raise LaunchError(f"{key}: suggested {suggested:g} less the margin {margin:g} is {refused[0]}",
                                      kind="unresolved_flag", hint="set a number, or a margin that keeps it in (0, 1]")
                resolution = {"flag": canonical_name(key), "suggested": suggested, "margin": margin,
                              "resolved": value}
            flags[canonical_name(key)] = value
        return flags, resolution

    def _baseline_suggestion(self) -> float | None:
        for server in self.run.ready_servers():
            if server.variant == self.matrix.baseline:
                return server.facts.gpu_memory_utilization_suggested
        return None

    def _serve(self, variant: Variant, repeat: int, pending: list[CellSpec], experiments: list[Experiment]) -> None:
        if self.options.clock == "virtual":
            self._serve_virtual(variant, repeat, pending, experiments)
            return
        queue = list(pending)
        retried: set[str] = set()
        profile = self._placed_profile()
        while True:
            launch_dir = self.run.new_launch_dir(variant.name)
            label = f"{variant.name} (repeat {repeat + 1})"
            self.progress.status(f"launching {label}")
            server: LaunchedServer | None = None
            flags: dict[str, FlagValue] = {}
            resolution: dict[str, Any] | None = None
            began = datetime.now(UTC).isoformat()
            try:
                flags, resolution = self._resolve_flags(variant)
                limits.check_on_host(profile, flags, self.options.engine)
                limits.check_open_files_on_host(queue, socket.gethostname())
                with launched(profile, launch_dir / "server.log", flags, engine=self.options.engine,
                              launch=launch_identity(variant.name, repeat)) as server, self._client_pinned():
                    self._record_server(launch_dir, variant, repeat, flags, server, resolution)
                    died = self._measure(server, variant, repeat, queue, retried, launch_dir)
                    if not died:
                        self._experiments(server, variant, repeat, experiments, launch_dir)
                if not died or (not queue and not experiments):
                    return
                self.progress.note(f"{label}: the server died during a cell; relaunching for the cells left")
            except LaunchError as exc:
                self._record_failure(launch_dir, variant, repeat, exc)
                self.progress.note(f"{label}: FAILED TO START ({exc.kind}): {exc.message}; "
                                   "the campaign goes on")
                return
            except MetricMissingError as exc:
                self.progress.note(f"{label}: {exc}; skipping this variant's cells")
                self._record_failure(launch_dir, variant, repeat,
                                     LaunchError(exc.message, kind="metric_missing", hint=exc.hint))
                return
            except ResultFormatError:
                raise  # the store itself failed (disk full, a file in the way): no later launch can be kept
            except Exception as exc:  # noqa: BLE001 - one launch's surprise must not end the night
                if os.environ.get("CAMPAIGN_DEBUG") == "1":
                    raise
                # Recorded as this variant's failure, with what the server logged; the exit code says so.
                known = exc if isinstance(exc, CampaignError) else None
                self._record_failure(launch_dir, variant, repeat, LaunchError(
                    known.message if known else f"{type(exc).__name__}: {exc}",
                    kind="error" if known else "internal_error",
                    log_tail=log_tail(launch_dir / "server.log"),
                    hint=known.hint if known else "CAMPAIGN_DEBUG=1 shows the traceback; please report it"))
                self.progress.note(f"{label}: FAILED ({type(exc).__name__}: {exc}); "
                                   "the campaign goes on")
                return
            finally:
                # Also on Ctrl-C: the server has been stopped by now, and how it stopped is part of the record;
                # so is what it became, where the interrupt came between its readiness and its record.
                self._clean_up(launch_dir, server, variant.name, repeat, began, record=partial(
                    self._record_server, launch_dir, variant, repeat, flags, resolution=resolution))

    def _serve_virtual(self, variant: Variant, repeat: int, pending: list[CellSpec],
                       experiments: list[Experiment]) -> None:
        """One launch in simulated time: its startup log and facts read as a real one's (measure.simulated), then
        every cell and experiment measured by the very code a launch over HTTP runs, warm-up and warm check
        included, against the simulator serving from this process on its own clock (measure.simulated). A start
        that fails is recorded as a real one's is. Repeats differ by the engine's seed."""
        launch_dir = self.run.new_launch_dir(variant.name)
        self.progress.status(f"{variant.name} (repeat {repeat + 1}): in simulated time")
        try:
            flags, resolution = self._resolve_flags(variant)
            launch = simulated.start(self.profile, flags, seed=repeat, launch=launch_identity(variant.name, repeat))
        except LaunchError as exc:
            self._record_failure(launch_dir, variant, repeat, exc)
            self.progress.note(f"{variant.name} (repeat {repeat + 1}): FAILED TO START ({exc.kind}): {exc.message}")
            return
        store.write_text_new(launch_dir / "server.log", launch.log)
        store.write_new(launch_dir / "server.json", ServerRecord(
            variant=variant.name, repeat=repeat, started_utc=datetime.now(UTC).isoformat(), command=launch.command,
            flags=launch.flags, variant_flags=dict(flags), ready_s=launch.facts.engine_init_s or 0.0,
            facts=launch.facts, warnings=[], suggested=resolution))
        if pending or experiments:
            with launch.serve() as server:
                self._measure(server, variant, repeat, list(pending), set(), launch_dir)
                self._experiments(server, variant, repeat, experiments, launch_dir)

    def _clean_up(self, launch_dir: Path, server: LaunchedServer | None, variant: str, repeat: int,
                  began: str, record: Callable[[LaunchedServer], None]) -> None:
        """Record the server where a Ctrl-C came after it was ready and before its record (`record`), its stop
        and the placement (the log was scrubbed as the server stopped), each on its own: a failure here (a full
        disk) never hides the exception already on its way (Ctrl-C stays Ctrl-C, with its resume hint); with
        none, it is raised. A stop is never stored without the server it stopped."""
        in_flight = sys.exc_info()[1] is not None
        steps: list[Callable[[], None]] = [lambda: self._record_placement(launch_dir, variant, repeat, began)]
        if server is not None:
            steps.insert(0, lambda: self._record_stop(launch_dir, server))
            if not (launch_dir / "server.json").exists():
                steps.insert(0, lambda: record(server))
        for step in steps:
            try:
                step()
            except (CampaignError, OSError) as exc:
                if not in_flight:
                    raise
                self.progress.note(f"warning: after the launch, {exc}")

    def _timeouts(self) -> Timeouts:
        return self.matrix.timeouts.timeouts()

    def _measure(self, server: Served, variant: Variant, repeat: int, queue: list[CellSpec],
                 retried: set[str], launch_dir: Path) -> bool:
        """Measure queued cells in order; True if the server died and the queue needs a fresh launch."""
        # One GPU monitor per launch (its clock history is the launch's): the server's own meter where it brings
        # one (in simulated time, the simulator's power model); else NVML's, whose raw samples are stored with
        # each cell, but none on the simulator over HTTP, which would measure an idle GPU, nor where NVML is
        # absent.
        meter = server.meter
        monitor = None if meter is not None or (self.options.engine or self.profile.engine) == "sim" else (
            gpu.monitor(indices=self._gpu_indices()))
        measurer = Measurer(
            server.target(self._timeouts()),
            max_attempts=self.options.max_attempts,
            on_event=lambda msg: self.progress.note(f"{variant.name}: {msg}"),
            gpu_monitor=meter if meter is not None else monitor,
        )
        self._warm_up(server, measurer, queue, variant, repeat, launch_dir)
        first: CellResult | None = None  # the launch's first cell, measured again at its end
        while queue:
            check_stop()
            spec = queue[0]
            self.progress.status(f"{variant.name} (repeat {repeat + 1}): {spec.key} ({spec.label})")
            try:
                result = server.call(measurer.run_cell(spec))
            except httpx.HTTPError as exc:
                if server.alive():
                    raise CampaignError(f"{variant.name}: {spec.key}: control-plane error {exc}") from exc
                result = None
            except PromptError as exc:  # this cell's prompts cannot be made here: it fails, the launch goes on
                result = CellResult(spec=spec, phase=spec.phase, context_tokens=spec.context_tokens,
                                    concurrency=spec.concurrency, label=spec.label, status="Failed",
                                    **findings_fields([Finding(Reason.PROMPTS_UNAVAILABLE, exc.message)]))
            # A stop asked for during the cell whose KeyboardInterrupt got lost on the way (a pool worker's
            # once was, inside the client's event loop, leaving one connect to time out 10 s later): the cell
            # ran while the tool was stopping, so it is not stored, and a resume measures it again.
            check_stop()
            dead = not server.alive()
            if dead and spec.key not in retried:
                retried.add(spec.key)
                return True  # relaunch and retry this cell once
            if dead:
                result = CellResult(spec=spec, phase=spec.phase, context_tokens=spec.context_tokens,
                                    concurrency=spec.concurrency, label=spec.label, status="Failed",
                                    **findings_fields([Finding(Reason.SERVER_DIED, "the server died during this "
                                                               "cell, and again when it was retried"
                                                               + past_model_window(spec, server.facts.model_window))]))
            assert result is not None
            # The raw GPU samples of the step the result describes (its last attempt); None: no GPU, or no step.
            step = monitor.take() if monitor is not None else None
            self.run.write_cell(variant.name, repeat, result, launch=launch_dir.name,
                                telemetry=step.samples if step is not None else None)
            first = first or result
            queue.pop(0)
            self.progress.cell_done(_cell_line(variant.name, repeat, result))
            if dead:
                return True  # the cells after it (and the experiments) need a live server
        if first is not None:
            check_stop()
            self._guard(server, measurer, first, variant, repeat, launch_dir, monitor)
        return False

    def _warm_up(self, server: Served, measurer: Measurer, queue: list[CellSpec], variant: Variant, repeat: int,
                 launch_dir: Path) -> None:
        if not self.matrix.warmup or not queue:
            return
        self.progress.status(f"{variant.name} (repeat {repeat + 1}): warming up")
        record = WarmupRecord.model_validate(server.call(measurer.warm_up(queue)))
        store.write_new(launch_dir / "warmup.json", record)
        self.progress.note(f"  {variant.name} r{repeat + 1}: warm-up {record.requests} requests in "
                           f"{record.seconds:.1f} s" + (f", {record.errors} failed" if record.errors else ""))

    def _guard(self, server: Served, measurer: Measurer, first: CellResult, variant: Variant, repeat: int,
               launch_dir: Path, monitor: gpu.NvmlMonitor | None = None) -> None:
        """The launch's first cell again at its end: if the first reading was slower beyond noise, the server
        was not warm then, and this warm reading stands in for it in every verdict (the store applies the guard)."""
        if first.status != "Valid" or self.run.guard_path(variant.name, first.spec.key, repeat).exists():
            return
        self.progress.status(f"{variant.name} (repeat {repeat + 1}): {first.spec.key} again (warm check)")
        try:
            again = server.call(measurer.run_cell(first.spec))
        except httpx.HTTPError as exc:  # the server went away: no check, and the first reading stands as it is
            self.progress.note(f"  {variant.name} r{repeat + 1}: warm check not possible ({exc})")
            return
        # As after a cell: a stop asked for during the check whose KeyboardInterrupt got lost (uvloop swallows
        # one raised inside a transport's data_received as a "Fatal error on transport" and closes that
        # connection) ran while the tool was stopping; it is not stored.
        check_stop()
        why = not_warm(first, again)
        step = monitor.take() if monitor is not None else None
        self.run.write_guard(variant.name, repeat, again, launch=launch_dir.name, not_warm=why,
                             telemetry=step.samples if step is not None else None)
        if why:
            self.progress.note(f"  {variant.name} r{repeat + 1} {first.spec.key}: server not warm: {why}; "
                               "the warm reading stands in")

    def _experiments(self, server: Served, variant: Variant, repeat: int, experiments: list[Experiment],
                     launch_dir: Path) -> None:
        for experiment in experiments:
            check_stop()
            self.progress.status(f"{variant.name} (repeat {repeat + 1}): experiment {experiment.key}")
            try:
                result = server.call(self._experiment(server, experiment))
            except httpx.HTTPError as exc:
                result = study.ExperimentResult(kind=experiment.kind, key=experiment.key, status="Failed",
                                                reasons=[f"{type(exc).__name__}: {exc}"])
            except PromptError as exc:
                result = study.ExperimentResult(kind=experiment.kind, key=experiment.key, status="Failed",
                                                reasons=[f"{exc.message} ({exc.hint})"])
            self.run.write_experiment(variant.name, repeat, experiment.key, result, launch=launch_dir.name)
            self.progress.note(_experiment_line(variant.name, repeat, experiment.key, result))

    async def _experiment(self, server: Served, experiment: Experiment) -> study.ExperimentResult:
        target = server.target(self._timeouts())
        async with target.endpoint.async_control() as control:
            # The server's time scale (a simulator's) first: the experiments store the hardware's figures.
            await Measurer(target).check_metrics(control)
        if isinstance(experiment, ContextWindowExperiment):
            return await study.context_window(target, reply_tokens=experiment.reply_tokens)
        if isinstance(experiment, LongContextExperiment):
            return await study.long_context(target, experiment.contexts, reply_tokens=experiment.reply_tokens)
        if isinstance(experiment, OverloadExperiment):
            seqs = experiment.max_num_seqs or server.max_num_seqs
            if seqs is None:
                return study.ExperimentResult(
                    kind="overload", key=experiment.key, status="Invalid",
                    reasons=["max-num-seqs unknown (vLLM logs it only when passed): set it in the profile, "
                             "the variant, or the experiment's max_num_seqs"])
            return await study.overload(target, max_num_seqs=seqs, factor=experiment.factor,
                                        prompt_tokens=experiment.prompt_tokens, reply_tokens=experiment.reply_tokens)
        if isinstance(experiment, PrefixOrderExperiment):
            return await study.prefix_order(target, block_size=server.facts.block_size, agents=experiment.agents,
                                            shared_tokens=experiment.shared_tokens, task_tokens=experiment.task_tokens,
                                            reply_tokens=experiment.reply_tokens)
        if isinstance(experiment, AgentsExperiment):
            return await study.agents(target, sessions=experiment.sessions, turns=experiment.turns,
                                      system_tokens=experiment.system_tokens, user_tokens=experiment.user_tokens,
                                      reply_tokens=experiment.reply_tokens, prompts=experiment.prompts,
                                      floors=tuple(experiment.floors), time_scale=self.run.manifest().time_scale)
        if isinstance(experiment, SloSearchExperiment):

            measurer = Measurer(target, max_attempts=self.options.max_attempts,
                                on_event=lambda msg: self.progress.note(f"  {msg}"))
            return await slo_search(measurer, experiment, self.matrix, ceiling=server.max_num_seqs,
                                    on_probe=lambda line: self.progress.note(f"  {line}"))
        return await study.repeat_cell(target, experiment.spec(self.matrix.window_s), times=experiment.times)

    # --- records -----------------------------------------------------------------------------------------
    def _record_server(self, launch_dir: Path, variant: Variant, repeat: int, flags: dict[str, FlagValue],
                       server: LaunchedServer, resolution: dict[str, Any] | None = None) -> None:
        store.write_new(launch_dir / "server.json", ServerRecord(
            variant=variant.name, repeat=repeat, started_utc=server.ready_utc, command=server.spec.redacted_argv(),
            flags=dict(server.spec.flags), variant_flags=dict(flags),
            ready_s=server.ready.ready_s, facts=server.facts, warnings=server.warnings, suggested=resolution))

    def _record_stop(self, launch_dir: Path, server: LaunchedServer) -> None:
        stop = server.process.stop_info
        if stop is not None:
            store.write_new(launch_dir / "stop.json", StopRecord(
                stopped_utc=datetime.now(UTC).isoformat(), mode=stop.mode, exit_code=stop.exit_code,
                stop_s=stop.stop_s, swept=stop.swept, port_free=stop.port_free,
                gpu_memory_released=stop.gpu_memory_released))

    def _gpu_indices(self) -> list[int] | None:
        """This launch's GPUs: the pool's (or Ray's) for it, else those CUDA_VISIBLE_DEVICES names in the
        profile or the environment; None: every GPU of the host."""
        if self.options.gpus is not None:
            return self.options.gpus
        visible = self.profile.env.get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", ""))
        return [int(g) for g in visible.split(",")] if visible.replace(",", "").isdigit() else None

    def _record_placement(self, launch_dir: Path, variant: str, repeat: int, began: str) -> None:
        gpus = self._gpu_indices()
        store.write_new(launch_dir / "placement.json", PlacementRecord(
            variant=variant, repeat=repeat, executor=self.options.executor, host=socket.gethostname(),
            node=self.options.node,
            gpus=None if gpus is None else [GpuDevice(**d) for d in gpu.devices(gpus)],
            client_cores=self.options.client_cores, started_utc=began, ended_utc=datetime.now(UTC).isoformat()))

    def _record_failure(self, launch_dir: Path, variant: Variant, repeat: int, exc: LaunchError) -> None:
        # The message can quote anything an exception carried (a header, a URL): the store redacts it.
        store.write_new(launch_dir / "failure.json", FailureRecord(
            variant=variant.name, repeat=repeat, failure_kind=exc.kind, message=exc.message, hint=exc.hint,
            log_tail=exc.log_tail))


def _cell_line(variant: str, repeat: int, result: CellResult) -> str:
    if result.phase == "prefill" and result.prompt_tok_s is not None:
        value = f"{result.prompt_tok_s:,.0f} prompt tok/s"
    elif result.total_tok_s is not None:
        value = f"{result.total_tok_s:,.1f} tok/s total ({result.label})"
    else:
        value = "—"
    why = f" — {result.reasons[0]}" if result.reasons else ""
    return f"  {variant} r{repeat + 1} {result.spec.key}: {result.status}, {value}{why}"


def _experiment_line(variant: str, repeat: int, key: str, result: study.ExperimentResult) -> str:
    return f"  {variant} r{repeat + 1} {key}: {result.status}: {result.verdict or '; '.join(result.reasons)}"

