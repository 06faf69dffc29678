"""The campaign loop: the only module that wires launch, measurement, telemetry and storage together.

Per launch in the schedule: start the variant's server, record what it became, measure its unfinished cells,
stop it. Failures are data: a launch that never becomes ready is recorded and the campaign goes on; a server
that dies mid-cell is relaunched and the cell retried once, then marked Failed. Every cell is written the
moment it finishes, so Ctrl-C or a crash loses at most the cell in flight, and `--resume` picks up there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from campaign import aio, gpu, store, study
from campaign.argv import redact
from campaign.cells import CellResult, CellSpec, Finding, Reason, findings_fields, not_warm
from campaign.endpoint import Timeouts
from campaign.envinfo import machine_info, tool_info
from campaign.errors import CampaignError, LaunchError, MetricMissingError
from campaign.launcher import LaunchedServer, launched
from campaign.matrix import (
    ContextWindowExperiment,
    Experiment,
    LongContextExperiment,
    Matrix,
    OverloadExperiment,
    PrefixOrderExperiment,
    RepeatExperiment,
    Variant,
    definition_hash,
    schedule,
    suggested_margin,
)
from campaign.measure import Measurer
from campaign.profiles import FlagValue, LaunchProfile, normalize_flag
from campaign.progress import Progress

LAUNCH_ESTIMATE_S = 90.0


def estimate_cell_s(spec: CellSpec) -> float:
    if spec.phase == "prefill":
        return 3.0 + spec.context_tokens / 1000.0
    if spec.mode == "sustained":
        return spec.warmup_s + spec.window_s + 5.0
    return 10.0


def estimate_experiment_s(experiment: Experiment, window_s: float) -> float:
    """A rough guess, assuming about 1,000 prompt tokens/s (the A5000 pair's rate) for long prompts."""
    if isinstance(experiment, LongContextExperiment):
        return sum(5.0 + c / 1000.0 for c in experiment.contexts)
    if isinstance(experiment, RepeatExperiment):
        return experiment.times * estimate_cell_s(experiment.spec(window_s))
    return 10.0


def estimate_s(matrix: Matrix, launches: int, launch_s: float = LAUNCH_ESTIMATE_S) -> float:
    per_launch = sum(estimate_cell_s(c) for c in matrix.cells())
    per_launch += sum(estimate_experiment_s(e, matrix.window_s) for e in matrix.experiments())
    return launches * (launch_s + per_launch)


@dataclass(kw_only=True)
class Options:
    engine: str | None = None
    max_attempts: int = 3


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
        for variant_name, repeat in schedule(self.matrix):
            pending = [c for c in self.cells if not self.run.done(variant_name, c.key, repeat)]
            experiments = [e for e in self.matrix.experiments()
                           if not self.run.experiment_path(variant_name, e.key, repeat).exists()]
            if not pending and not experiments:
                continue  # resumed: this launch's work is all stored
            self._serve(self.variants[variant_name], repeat, pending, experiments)

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
                resolution = {"flag": normalize_flag(key), "suggested": suggested, "margin": margin,
                              "resolved": value}
            flags[normalize_flag(key)] = value
        return flags, resolution

    def _baseline_suggestion(self) -> float | None:
        for server in self.run.servers():
            if server.get("kind") == "server" and server["variant"] == self.matrix.baseline:
                value = server["facts"].get("gpu_memory_utilization_suggested")
                return float(value) if value is not None else None
        return None

    def _serve(self, variant: Variant, repeat: int, pending: list[CellSpec], experiments: list[Experiment]) -> None:
        queue = list(pending)
        retried: set[str] = set()
        while True:
            launch_dir = self.run.new_launch_dir(variant.name)
            label = f"{variant.name} (repeat {repeat + 1})"
            self.progress.status(f"launching {label}")
            server: LaunchedServer | None = None
            try:
                flags, resolution = self._resolve_flags(variant)
                with launched(self.profile, launch_dir / "server.log", flags, engine=self.options.engine) as server:
                    self._record_server(launch_dir, variant, repeat, flags, server, resolution)
                    died = self._measure(server, variant, repeat, queue, retried, launch_dir)
                    if not died:
                        self._experiments(server, variant, repeat, experiments, launch_dir)
                if not died or (not queue and not experiments):
                    return
                self.progress.note(f"{label}: the server died during a cell; relaunching for the cells left")
            except LaunchError as exc:
                self._record_failure(launch_dir, variant, repeat, exc)
                self.progress.note(f"{label}: FAILED TO START ({exc.kind}): {exc.message}; the campaign goes on")
                return
            except MetricMissingError as exc:
                self.progress.note(f"{label}: {exc}; skipping this variant's cells")
                self._record_failure(launch_dir, variant, repeat,
                                     LaunchError(exc.message, kind="metric_missing", hint=exc.hint))
                return
            finally:
                # Also on Ctrl-C: the server has been stopped by now, and how it stopped is part of the record.
                if server is not None:
                    self._record_stop(launch_dir, server)
                self._scrub_log(launch_dir / "server.log")

    def _timeouts(self) -> Timeouts:
        return self.matrix.timeouts.timeouts()

    def _measure(self, server: LaunchedServer, variant: Variant, repeat: int, queue: list[CellSpec],
                 retried: set[str], launch_dir: Path) -> bool:
        """Measure queued cells in order; True if the server died and the queue needs a fresh launch."""
        # One GPU monitor per launch (its clock history is the launch's); none on the simulator, which would
        # measure an idle GPU, nor where NVML is absent.
        monitor = None if (self.options.engine or self.profile.engine) == "sim" else gpu.monitor()
        measurer = Measurer(
            server.target(self._timeouts()),
            max_attempts=self.options.max_attempts,
            on_event=lambda msg: self.progress.note(f"{variant.name}: {msg}"),
            gpu_monitor=monitor,
        )
        self._warm_up(measurer, queue, variant, repeat, launch_dir)
        first: CellResult | None = None  # the launch's first cell, measured again at its end
        while queue:
            spec = queue[0]
            self.progress.status(f"{variant.name} (repeat {repeat + 1}): {spec.key} ({spec.label})")
            try:
                result = aio.run(measurer.run_cell(spec))
            except httpx.HTTPError as exc:
                if server.process.alive():
                    raise CampaignError(f"{variant.name}: {spec.key}: control-plane error {exc}") from exc
                result = None
            dead = not server.process.alive()
            if dead and spec.key not in retried:
                retried.add(spec.key)
                return True  # relaunch and retry this cell once
            if dead:
                result = CellResult(spec=spec, phase=spec.phase, context_tokens=spec.context_tokens,
                                    concurrency=spec.concurrency, label=spec.label, status="Failed",
                                    **findings_fields([Finding(Reason.SERVER_DIED, "the server died during this "
                                                               "cell, and again when it was retried")]))
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
            self._guard(measurer, first, variant, repeat, launch_dir)
        return False

    def _warm_up(self, measurer: Measurer, queue: list[CellSpec], variant: Variant, repeat: int,
                 launch_dir: Path) -> None:
        if not self.matrix.warmup or not queue:
            return
        self.progress.status(f"{variant.name} (repeat {repeat + 1}): warming up")
        record = aio.run(measurer.warm_up(queue))
        store.write_new(launch_dir / "warmup.json", record)
        self.progress.note(f"  {variant.name} r{repeat + 1}: warm-up {record['requests']} requests in "
                           f"{record['seconds']:.1f} s" + (f", {record['errors']} failed" if record["errors"] else ""))

    def _guard(self, measurer: Measurer, first: CellResult, variant: Variant, repeat: int, launch_dir: Path) -> None:
        """The launch's first cell again at its end: if the first reading was slower beyond noise, the server
        was not warm then, and that reading never reaches a verdict (the store applies the guard)."""
        if first.status != "Valid" or self.run.guard_path(variant.name, first.spec.key, repeat).exists():
            return
        self.progress.status(f"{variant.name} (repeat {repeat + 1}): {first.spec.key} again (warm check)")
        try:
            again = aio.run(measurer.run_cell(first.spec))
        except httpx.HTTPError as exc:  # the server went away: no check, and the first reading stands as it is
            self.progress.note(f"  {variant.name} r{repeat + 1}: warm check not possible ({exc})")
            return
        why = not_warm(first, again)
        self.run.write_guard(variant.name, repeat, again, launch=launch_dir.name, not_warm=why)
        if why:
            self.progress.note(f"  {variant.name} r{repeat + 1} {first.spec.key}: server not warm: {why}")

    def _experiments(self, server: LaunchedServer, variant: Variant, repeat: int, experiments: list[Experiment],
                     launch_dir: Path) -> None:
        for experiment in experiments:
            self.progress.status(f"{variant.name} (repeat {repeat + 1}): experiment {experiment.key}")
            try:
                result = aio.run(self._experiment(server, experiment))
            except httpx.HTTPError as exc:
                result = study.ExperimentResult(kind=experiment.kind, key=experiment.key, status="Failed",
                                                reasons=[f"{type(exc).__name__}: {exc}"])
            self.run.write_experiment(variant.name, repeat, result, launch=launch_dir.name)
            self.progress.note(f"  {variant.name} r{repeat + 1} {experiment.key}: {result.status}: "
                               f"{result.verdict or '; '.join(result.reasons)}")

    async def _experiment(self, server: LaunchedServer, experiment: Experiment) -> study.ExperimentResult:
        target = server.target(self._timeouts())
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
        return await study.repeat_cell(target, experiment.spec(self.matrix.window_s), times=experiment.times)

    # --- records -----------------------------------------------------------------------------------------
    def _record_server(self, launch_dir: Path, variant: Variant, repeat: int, flags: dict[str, FlagValue],
                       server: LaunchedServer, resolution: dict[str, Any] | None = None) -> None:
        store.write_new(launch_dir / "server.json", {
            "kind": "server", "variant": variant.name, "repeat": repeat,
            "started_utc": datetime.now(UTC).isoformat(),
            "command": server.spec.redacted_argv(), "flags": server.spec.flags, "variant_flags": flags,
            "ready_s": server.ready.ready_s, "facts": server.facts.model_dump(mode="json"),
            "warnings": server.warnings, "suggested": resolution,
        })

    def _record_stop(self, launch_dir: Path, server: LaunchedServer) -> None:
        stop = server.process.stop_info
        if stop is not None:
            store.write_new(launch_dir / "stop.json", {
                "kind": "stop", "mode": stop.mode, "exit_code": stop.exit_code, "stop_s": stop.stop_s,
                "swept": stop.swept, "port_free": stop.port_free, "gpu_memory_released": stop.gpu_memory_released,
            })

    def _record_failure(self, launch_dir: Path, variant: Variant, repeat: int, exc: LaunchError) -> None:
        store.write_new(launch_dir / "failure.json", {
            "kind": "failure", "variant": variant.name, "repeat": repeat,
            "failure_kind": exc.kind, "message": exc.message, "hint": exc.hint,
            "log_tail": redact(exc.log_tail, self._api_key()),
        })

    def _api_key(self) -> str | None:
        return os.environ.get(self.profile.api_key_env) if self.profile.api_key_env else None

    def _scrub_log(self, log: Path) -> None:
        """vLLM redacts --api-key in its own args line, and the key travels in the environment; this is the
        last guard that no secret stays in a stored log."""
        key = self._api_key()
        if key and log.exists():
            text = log.read_text(errors="replace")
            if key in text:
                store.replace_text(log, text.replace(key, "<redacted>"))


def _cell_line(variant: str, repeat: int, result: CellResult) -> str:
    if result.phase == "prefill" and result.prompt_tok_s is not None:
        value = f"{result.prompt_tok_s:,.0f} prompt tok/s"
    elif result.total_tok_s is not None:
        value = f"{result.total_tok_s:,.1f} tok/s total ({result.label})"
    else:
        value = "—"
    why = f" — {result.reasons[0]}" if result.reasons else ""
    return f"  {variant} r{repeat + 1} {result.spec.key}: {result.status}, {value}{why}"


def manifest(matrix: Matrix, matrix_path: Path, profile: LaunchProfile, profile_path: Path,
             options: Options) -> dict[str, Any]:
    raw_matrix = matrix.model_dump(mode="json")
    raw_profile = profile.model_dump(mode="json")
    return {
        "kind": "manifest",
        "campaign": matrix.name,
        "created_utc": datetime.now(UTC).isoformat(),
        "tool": tool_info(),
        "matrix": {"path": str(matrix_path), "raw": raw_matrix, "hash": definition_hash(raw_matrix)},
        "profile": {"path": str(profile_path), "raw": raw_profile, "hash": definition_hash(raw_profile)},
        "engine": options.engine or profile.engine,
        # The simulator can run faster than the hardware it imitates; its rates then read this many times higher.
        "time_scale": float(os.environ.get("CAMPAIGN_SIM_TIME_SCALE", "1"))
        if (options.engine or profile.engine) == "sim" else 1.0,
        "machine": machine_info(),
        "schedule": [{"variant": v, "repeat": r} for v, r in schedule(matrix)],
        "cells": [c.model_dump(mode="json") | {"key": c.key} for c in matrix.cells()],
    }
