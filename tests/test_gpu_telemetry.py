"""GPU telemetry that counts: the NVML step monitor on a fake NVML (tests/fakes/fake_nvml.py) driven by recorded
samples and a clock the test owns; energy per token and GPU_THROTTLED through a real Measurer on the simulator;
the per-launch monitor in the campaign loop; and `make gpu-check`'s no-GPU and full paths."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from fakes import builders
from fakes.fake_nvml import (
    FakeClock,
    FakeNvml,
    nvmlClocksEventReasonApplicationsClocksSetting,
    nvmlClocksEventReasonGpuIdle,
    nvmlClocksEventReasonHwPowerBrakeSlowdown,
    nvmlClocksEventReasonHwSlowdown,
    nvmlClocksEventReasonHwThermalSlowdown,
    nvmlClocksEventReasonSwPowerCap,
    nvmlClocksEventReasonSwThermalSlowdown,
    nvmlClocksEventReasonSyncBoost,
)

from campaign.bench import gpu_check
from campaign.core.progress import Progress
from campaign.measure.cells import CellSpec, Reason
from campaign.measure.runner import Measurer
from campaign.night.launch import Campaign, Options
from campaign.night.launcher import LaunchedServer, launched
from campaign.server import gpu
from campaign.server.gpu import NvmlMonitor, StepTelemetry
from campaign.server.profiles import PROJECT_ROOT, load_profile
from campaign.spec.matrix import Matrix
from campaign.stored import store

T0 = 1000.0
# The no-GPU paths against the real nvidia-ml-py only where this machine has no GPU (as here, and on CI).
no_real_gpu = pytest.mark.skipif(gpu.available(), reason="this machine has an NVIDIA GPU")


@pytest.fixture()
def clock() -> FakeClock:
    return FakeClock(T0)


@pytest.fixture()
def install() -> Iterator[Callable[[FakeNvml | None], FakeNvml | None]]:
    """Put a fake (or None: no NVML) behind campaign.server.gpu; every NVML session must be closed at the end."""
    previous = gpu.use_nvml(None)
    installed: list[FakeNvml] = []

    def use(fake: FakeNvml | None) -> FakeNvml | None:
        gpu.use_nvml(fake)
        if fake is not None:
            installed.append(fake)
        return fake

    yield use
    gpu.use_nvml(previous)
    assert all(f.inits == 0 for f in installed), "an NVML session was left open"


def nvml(install: Callable[[FakeNvml | None], FakeNvml | None], clock: Callable[[], float], gpus: int = 1,
         **kwargs: bool) -> FakeNvml:
    fake = install(FakeNvml(gpus, clock=clock, **kwargs))
    assert fake is not None
    return fake


def run_step(monitor: NvmlMonitor, clock: FakeClock, seconds: float, every_s: float = 1.0) -> StepTelemetry:
    """One step of `seconds` on the test's clock: a sample at start, every `every_s`, and at stop."""
    monitor.start()
    elapsed = 0.0
    while elapsed + every_s < seconds:
        clock.advance(every_s)
        elapsed += every_s
        monitor.sample_now()
    clock.advance(seconds - elapsed)
    telemetry = monitor.stop()
    assert telemetry is not None
    return telemetry


# --- energy ------------------------------------------------------------------------------------------------
def test_energy_from_the_counter_over_all_gpus(install: Callable[..., FakeNvml], clock: FakeClock) -> None:
    fake = nvml(install, clock, gpus=2)
    fake.record(T0, {"power_w": 100.0, "energy_mj": 7_000_000}, {"power_w": 200.0, "energy_mj": 9_000_000})
    fake.record(T0 + 4, {"power_w": 100.0, "energy_mj": 7_450_000}, {"power_w": 200.0, "energy_mj": 9_800_000})
    telemetry = run_step(NvmlMonitor(every_s=None, clock=clock), clock, 4.0)
    # The counter, not the power samples (which would integrate to 4 x 300 = 1,200 J): 450 + 800 J.
    assert telemetry.energy_source == "counter"
    assert telemetry.energy_j == pytest.approx(1250.0)
    assert telemetry.power_w_median == pytest.approx(300.0)  # all GPUs together
    assert len(telemetry.samples) == 5 and all(len(rows) == 2 for rows in telemetry.samples)
    assert telemetry.samples[0][1]["energy_mj"] == 9_000_000  # the raw counter is kept with every sample


def test_a_pool_launch_reads_its_own_gpus_only(install: Callable[..., FakeNvml], clock: FakeClock) -> None:
    """Issue 17: beside another launch on GPU 0, this launch's energy is GPU 1's, never both."""
    fake = nvml(install, clock, gpus=2)
    fake.record(T0, {"power_w": 100.0, "energy_mj": 7_000_000}, {"power_w": 200.0, "energy_mj": 9_000_000})
    fake.record(T0 + 4, {"power_w": 100.0, "energy_mj": 7_450_000}, {"power_w": 200.0, "energy_mj": 9_800_000})
    telemetry = run_step(NvmlMonitor(every_s=None, clock=clock, indices=[1]), clock, 4.0)
    assert telemetry.energy_j == pytest.approx(800.0)
    assert telemetry.power_w_median == pytest.approx(200.0)
    assert all([row["index"] for row in rows] == [1] for rows in telemetry.samples)


def test_energy_from_sampled_power_where_the_counter_is_not_supported(install: Callable[..., FakeNvml],
                                                                      clock: FakeClock) -> None:
    fake = nvml(install, clock, energy_counter=False)
    fake.record(T0, {"power_w": 100.0})
    fake.record(T0 + 1, {"power_w": 300.0})
    telemetry = run_step(NvmlMonitor(every_s=None, clock=clock), clock, 3.0)
    # Trapezoid over samples at 0, 1, 2, 3 s reading 100, 300, 300, 300 W: 200 + 300 + 300 J.
    assert telemetry.energy_source == "sampled power"
    assert telemetry.energy_j == pytest.approx(800.0)
    assert all(rows[0]["energy_mj"] is None for rows in telemetry.samples)


def test_a_gpu_without_a_counter_beside_one_with_it(install: Callable[..., FakeNvml], clock: FakeClock) -> None:
    fake = nvml(install, clock, gpus=2)
    fake.record(T0, {"power_w": 100.0, "energy_mj": 1_000_000}, {"power_w": 50.0})
    fake.record(T0 + 2, {"power_w": 100.0, "energy_mj": 1_200_000}, {"power_w": 50.0})
    monitor = NvmlMonitor(every_s=None, clock=clock)
    samples = [[{"index": 0, "t": 0.0, "power_w": 100.0, "energy_mj": 1_000_000},
                {"index": 1, "t": 0.0, "power_w": 50.0, "energy_mj": None}],
               [{"index": 0, "t": 2.0, "power_w": 100.0, "energy_mj": 1_200_000},
                {"index": 1, "t": 2.0, "power_w": 50.0, "energy_mj": None}]]
    telemetry = monitor.summarize(samples)
    assert telemetry.energy_j == pytest.approx(300.0)
    assert telemetry.energy_source == "counter and sampled power"
    # A GPU with neither a counter nor two power readings: no energy at all, never a part of it.
    assert gpu.step_energy([[{"index": 0, "t": 0.0, "power_w": None, "energy_mj": None}]]) == (None, None)


# --- throttling --------------------------------------------------------------------------------------------
def test_throttle_reasons_are_named(install: Callable[..., FakeNvml], clock: FakeClock) -> None:
    fake = nvml(install, clock, gpus=2)
    fake.record(T0, {}, {})
    fake.record(T0 + 1, {}, {"reasons": nvmlClocksEventReasonSwPowerCap | nvmlClocksEventReasonHwThermalSlowdown})
    fake.record(T0 + 3, {"reasons": nvmlClocksEventReasonHwPowerBrakeSlowdown | nvmlClocksEventReasonHwSlowdown},
                {"reasons": nvmlClocksEventReasonSwThermalSlowdown})
    telemetry = run_step(NvmlMonitor(every_s=None, clock=clock), clock, 3.0)
    assert telemetry.throttled == (
        "HW slowdown on GPU 0 in 1 of 4 samples; HW power brake on GPU 0 in 1 of 4 samples; "
        "SW power cap on GPU 1 in 2 of 4 samples; HW thermal slowdown on GPU 1 in 2 of 4 samples; "
        "SW thermal slowdown on GPU 1 in 1 of 4 samples")
    assert "0x" not in telemetry.throttled


def test_idle_application_clocks_and_sync_boost_are_not_throttling(install: Callable[..., FakeNvml],
                                                                   clock: FakeClock) -> None:
    fake = nvml(install, clock)
    monitor = NvmlMonitor(every_s=None, clock=clock)
    fake.record(T0, {"sm_clock_mhz": 1980})
    assert run_step(monitor, clock, 4.0).throttled is None  # the launch's clock: 1,980 MHz
    # Idle between requests: the clock falls to 345 MHz by design, with the idle reason set.
    fake.record(clock.now, {"sm_clock_mhz": 345, "reasons": nvmlClocksEventReasonGpuIdle
                            | nvmlClocksEventReasonApplicationsClocksSetting | nvmlClocksEventReasonSyncBoost})
    idle = run_step(monitor, clock, 4.0)
    assert idle.throttled is None
    assert idle.sm_clock_mhz_median == 345  # idle throughout: the idle clock is still reported


def test_a_step_whose_clock_fell_well_below_the_launchs_is_throttled(install: Callable[..., FakeNvml],
                                                                     clock: FakeClock) -> None:
    fake = nvml(install, clock)
    monitor = NvmlMonitor(every_s=None, clock=clock)
    fake.record(T0, {"sm_clock_mhz": 1980})
    assert run_step(monitor, clock, 4.0).throttled is None
    assert run_step(monitor, clock, 4.0).throttled is None
    fake.record(clock.now, {"sm_clock_mhz": 1650})   # no reason bit set, but the clock stays down
    slow = run_step(monitor, clock, 4.0)
    assert slow.throttled == "median SM clock 1,650 MHz, 17% below the launch's 1,980 MHz"
    assert slow.sm_clock_mhz_median == 1650
    fake.record(clock.now, {"sm_clock_mhz": 1900})   # 4% below: boost varies that much with temperature
    assert run_step(monitor, clock, 4.0).throttled is None
    # A throttled step does not lower the launch's reference; a new launch (a new monitor) has none yet.
    assert min(monitor.launch_sm_clocks) == 1900
    fresh = NvmlMonitor(every_s=None, clock=clock)
    fake.record(clock.now, {"sm_clock_mhz": 1650})
    assert run_step(fresh, clock, 4.0).throttled is None


def test_the_clock_rule_ignores_idle_readings(install: Callable[..., FakeNvml], clock: FakeClock) -> None:
    fake = nvml(install, clock)
    monitor = NvmlMonitor(every_s=None, clock=clock)
    fake.record(T0, {"sm_clock_mhz": 1980})
    run_step(monitor, clock, 4.0)
    # A short prefill: busy at 1,980 MHz for 3 samples, idle at 345 MHz for 2.
    fake.record(clock.now + 3, {"sm_clock_mhz": 345, "reasons": nvmlClocksEventReasonGpuIdle})
    telemetry = run_step(monitor, clock, 4.0)
    assert telemetry.throttled is None and telemetry.sm_clock_mhz_median == 1980


# --- no NVML -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("missing", ["module", "library"])
def test_without_nvml_everything_is_none(missing: str, install: Callable[..., FakeNvml | None],
                                         clock: FakeClock) -> None:
    if missing == "library":
        install(FakeNvml(clock=clock, present=False))  # nvmlInit raises NVMLError_LibraryNotFound
    assert gpu.available() is False
    assert gpu.sample() is None and gpu.machine_facts() is None and gpu.pids_on_gpus() is None
    assert gpu.wait_released({1234}, timeout_s=0.1) is None
    assert gpu.monitor() is None
    monitor = NvmlMonitor(every_s=0.01, clock=clock)
    monitor.start()
    assert monitor.stop() is None and monitor.take() is None


@no_real_gpu
def test_the_real_module_here_has_no_gpu() -> None:
    # This machine has nvidia-ml-py but no driver: None, not zeros, and no monitor.
    assert gpu.available() is False and gpu.sample() is None and gpu.monitor() is None


# --- the rest of the interface -----------------------------------------------------------------------------
def test_sample_and_facts_read_through_the_injected_module(install: Callable[..., FakeNvml],
                                                           clock: FakeClock) -> None:
    fake = nvml(install, clock, gpus=2)
    fake.record(T0, {"memory_used_mib": 4596, "pids": (4242,)}, {"pids": ()})
    rows = gpu.sample()
    assert rows is not None and [r["index"] for r in rows] == [0, 1]
    assert rows[0]["memory_used_mib"] == 4596 and rows[0]["sm_clock_mhz"] == 1980 and rows[0]["power_w"] == 100.0
    facts = gpu.machine_facts()
    assert facts is not None and facts["cuda"] == "12.8" and len(facts["gpus"]) == 2
    assert gpu.pids_on_gpus() == {4242}
    assert gpu.wait_released({1}, timeout_s=0.1) is True
    assert gpu.wait_released({4242}, timeout_s=0.1) is False


def test_the_sampling_thread_samples_during_the_step(install: Callable[..., FakeNvml]) -> None:
    """The thread samples between start and stop. The test waits for its samples, not for a time: sleeping
    0.2 s for ten 20 ms samples, a run of the suite under two CPU hogs slept a whole second and the thread woke
    once (3 samples, not 4)."""
    nvml(install, time.monotonic)
    monitor = gpu.monitor(every_s=0.02)
    assert monitor is not None
    sampled, count = threading.Event(), [0]
    real = monitor.sample_now

    def counted() -> None:
        real()
        count[0] += 1
        if count[0] >= 3:   # start's, and two of the thread's
            sampled.set()

    monitor.sample_now = counted  # type: ignore[method-assign]
    monitor.start()
    assert sampled.wait(60), "the thread took no samples"
    telemetry = monitor.stop()
    assert telemetry is not None and len(telemetry.samples) >= 4  # start, stop and the thread's
    assert monitor.take() is telemetry and monitor.take() is None


# --- through a real Measurer, on the simulator -------------------------------------------------------------
@pytest.fixture(scope="module")
def sim() -> Iterator[LaunchedServer]:
    with pytest.MonkeyPatch.context() as patch:  # not left set for later tests (a Ray cluster inherits it)
        patch.setenv("CAMPAIGN_SIM_TIME_SCALE", "5")
        profile, _ = load_profile("a5000-tp2")
        with launched(profile, Path("/tmp") / f"sim-gpu-{os.getpid()}.log", engine="sim") as server:
            yield server


class TenSecondSteps(NvmlMonitor):
    """Each measured step lasts ten seconds on the fake's clock, whatever it took on the wall clock."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(every_s=None, clock=clock)
        self.fake_clock = clock

    def stop(self) -> StepTelemetry | None:
        self.fake_clock.advance(10.0)
        return super().stop()


FIXED = CellSpec(phase="decode", context_tokens=64, concurrency=2, mode="fixed", max_tokens=16)


def test_energy_per_token_and_throttling_through_the_measurer(sim: LaunchedServer, install: Callable[..., FakeNvml],
                                                              clock: FakeClock) -> None:
    fake = nvml(install, clock, gpus=2)
    fake.record(T0, {"power_w": 250.0})  # two GPUs at 250 W for a 10 s step: the counters count 5,000 J
    monitor = TenSecondSteps(clock)
    measurer = Measurer(sim.target(), gpu_monitor=monitor)
    cell = asyncio.run(measurer.run_cell(FIXED))
    assert cell.status == "Valid", cell.reasons
    step = monitor.take()
    assert step is not None and step.energy_source == "counter" and step.energy_j == pytest.approx(5000.0)
    assert cell.output_tokens == 2 * 16
    assert cell.energy_j_per_token == pytest.approx(5000.0 / 32)

    fake.record(clock.now + 5, {"power_w": 250.0, "reasons": nvmlClocksEventReasonHwPowerBrakeSlowdown})
    throttled = asyncio.run(measurer.run_cell(FIXED))
    assert throttled.status == "Invalid"
    assert throttled.reason_codes == [Reason.GPU_THROTTLED]
    assert "HW power brake on GPU 0 in 1 of 2 samples" in throttled.reasons[0]


def test_the_campaign_loop_keeps_one_monitor_per_launch_and_stores_its_samples(
        sim: LaunchedServer, install: Callable[..., FakeNvml], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    nvml(install, time.monotonic)
    made: list[NvmlMonitor | None] = []
    real_monitor = gpu.monitor

    def counted(**kwargs: float) -> NvmlMonitor | None:
        made.append(real_monitor(every_s=0.05))
        return made[-1]

    monkeypatch.setattr(gpu, "monitor", counted)
    profile, _ = load_profile("a5000-tp2")  # engine: vllm, although the server here is the simulator
    matrix = Matrix.model_validate({
        "name": "telemetry", "profile": "a5000-tp2", "baseline": "only", "variants": [{"name": "only"}],
        "workloads": [{"kind": "decode", "mode": "fixed", "contexts": [64], "concurrency": [1, 2], "max_tokens": 8}]})
    run = store.RunDir.create(tmp_path, "telemetry")
    progress = Progress(total_cells=2, estimate_s=10.0, live=False)
    campaign = Campaign(run, matrix, profile, options=Options(), progress=progress)
    variant = matrix.all_variants()[0]
    died = campaign._measure(sim, variant, 0, list(matrix.cells()), set(), run.new_launch_dir("only"))
    assert not died and len(made) == 1
    stored = [store.read(c.path) for c in run.cells()]
    assert len(stored) == 2
    for data in stored:
        samples = data["gpu_telemetry"]
        assert isinstance(samples, list) and len(samples) >= 2 and samples[0][0]["index"] == 0
        assert data["result"]["energy_j_per_token"] is not None
    # On the simulator (engine sim) the GPU sits idle: no monitor, no telemetry.
    sim_campaign = Campaign(store.RunDir.create(tmp_path, "sim"), matrix, profile, options=Options(engine="sim"),
                            progress=progress)
    sim_campaign._measure(sim, variant, 0, list(matrix.cells())[:1], set(), sim_campaign.run.new_launch_dir("only"))
    assert len(made) == 1
    assert store.read(sim_campaign.run.cells()[0].path)["gpu_telemetry"] is None


# --- make gpu-check ----------------------------------------------------------------------------------------
@no_real_gpu
def test_gpu_check_without_a_gpu_fails_fast_and_says_why() -> None:
    began = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "campaign.bench.gpu_check"], capture_output=True, text=True,
                         cwd=PROJECT_ROOT, timeout=60, check=False)
    assert time.monotonic() - began < 30
    assert out.returncode == 2
    lines = out.stdout.strip().splitlines()
    assert "no NVIDIA GPU: nothing to check" in lines[0]
    assert lines[-1].startswith("gpu_check=FAIL ") and "reason=no_gpu" in lines[-1]


def test_make_gpu_check_passes_gpu_python() -> None:
    out = subprocess.run(["make", "-n", "gpu-check", "GPU_PYTHON=/opt/cuda-py/bin/python"], capture_output=True,
                         text=True, cwd=PROJECT_ROOT, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert "-m campaign.bench.gpu_check --gpu-python /opt/cuda-py/bin/python" in out.stdout


class Load:
    """What the fake GPU draws: 80 W idle, 400 W while the stand-in's load runs; the counter integrates it."""

    def __init__(self) -> None:
        self.on = False
        self.mj = 5_000_000.0
        self.t = time.monotonic()

    def power(self) -> float:
        return 400.0 if self.on else 80.0

    def energy(self) -> int:
        now = time.monotonic()
        self.mj += (now - self.t) * self.power() * 1000
        self.t = now
        return int(self.mj)

    def switch(self, on: bool) -> None:
        self.energy()
        self.on = on


def _standins() -> list[int]:
    """The gpu-check stand-ins running under this test (what NVML would list on a GPU)."""
    pids = []
    for proc in psutil.Process().children(recursive=True):
        try:
            argv = proc.cmdline()
            if proc.status() != psutil.STATUS_ZOMBIE and any(a.endswith("gpu_standin.py") for a in argv):
                pids.append(proc.pid)
        except psutil.Error:
            continue
    return pids


def test_gpu_check_end_to_end_on_a_fake_gpu(install: Callable[..., FakeNvml], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The whole check with NVML faked and the stand-in on the CPU (`--device cpu`: no torch): the real launch and
    stop path, the monitor's thread, the counter against sampled power, the release."""
    load = Load()
    fake = nvml(install, time.monotonic)
    fake.record(0.0, {"power_w": load.power, "energy_mj": load.energy, "pids": _standins,
                      "memory_used_mib": lambda: 500 + 4096 * len(_standins()), "sm_clock_mhz": 1980})
    real_drive = gpu_check._drive_load

    def drive(base_url: str, seconds: float) -> dict[str, object]:
        load.switch(True)
        try:
            return real_drive(base_url, seconds)
        finally:
            load.switch(False)

    monkeypatch.setattr(gpu_check, "_drive_load", drive)
    # Four seconds of load: the monitor samples every 0.5 s, and its first and last samples fall just outside
    # the load (80 W). Over two seconds a monitor thread slowed by a busy host took one sample inside it in a
    # loaded run, so the median read 80 W; over four it takes several, as a real check's longer load does.
    code = gpu_check.check(gpu_python=sys.executable, gib=4.0, load_s=4.0, idle_s=1.0, device="cpu",
                           workdir=tmp_path)
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.strip().splitlines()
    for name in ("nvml", "stand-in ready", "memory held", "telemetry", "load draws power", "energy counter", "stop",
                 "released", "memory back"):
        assert any(line.startswith(f"PASS  {name}:") for line in lines), (name, out)
    last = dict(pair.split("=", 1) for pair in lines[-1].split())
    assert last["gpu_check"] == "PASS" and last["failed"] == "0" and last["energy_source"] == "counter"
    assert float(last["energy_j"]) == pytest.approx(1600.0, rel=0.15)  # 400 W for about 4 s
    assert last["stop_mode"] == "sigint" and last["released"] == "true"
    assert _standins() == []


# --- compare: energy per token is a result, and the drift sentinel watches the GPU too ----------------------
DECODE = CellSpec(phase="decode", context_tokens=1024, concurrency=8, mode="fixed", max_tokens=256)


def _samples(sm_clock: float, power: float) -> list[list[dict[str, object]]]:
    return [[{"index": 0, "t": float(t), "sm_clock_mhz": sm_clock, "power_w": power, "throttle_reasons": 0}]
            for t in range(5)]


def telemetry_run(tmp_path: Path, series: dict[str, list[tuple[float, float | None, float, float]]]) -> store.RunDir:
    """Per variant and repeat: (total tok/s, J per token, SM clock, power)."""
    from campaign.measure.cells import CellResult

    run = store.RunDir.create(tmp_path, "t")
    builders.manifest(run, baseline="baseline", variants=list(series))
    for variant, rows in series.items():
        launch = run.new_launch_dir(variant)
        builders.server(launch, variant=variant, ready_s=1.0,
                        flags={"max-num-seqs": 8 if variant == "baseline" else 16},
                        facts={"kv_cache_tokens": 1000, "vllm_version": "0.33.0", "device": "GPU"})
        for repeat, (tok_s, joules, sm_clock, power) in enumerate(rows):
            result = CellResult(spec=DECODE, phase="decode", context_tokens=DECODE.context_tokens,
                                concurrency=DECODE.concurrency, label=DECODE.label, status="Valid",
                                total_tok_s=tok_s, energy_j_per_token=joules)
            run.write_cell(variant, repeat, result, launch=launch.name, telemetry=_samples(sm_clock, power))
    return run


def test_a_flag_that_saves_energy_at_equal_speed_is_kept(tmp_path: Path) -> None:
    from campaign.analysis.recommend import diff_run

    run = telemetry_run(tmp_path, {
        "baseline": [(100.0, 2.00, 1980, 600), (101.0, 2.02, 1980, 600), (99.0, 1.98, 1980, 600)],
        "frugal": [(100.5, 1.60, 1980, 480), (99.5, 1.62, 1980, 480), (100.0, 1.58, 1980, 480)]})
    diff = diff_run(run)[0]
    energy = next(m for c in diff.cells for m in c.metrics if m.metric == "energy_j_per_token")
    assert energy.verdict == "better" and energy.change_pct == pytest.approx(-20.0, abs=0.5)
    speed = next(m for c in diff.cells for m in c.metrics if m.metric == "total_tok_s")
    assert speed.verdict == "no difference"
    assert "better: energy_j_per_token" in diff.recommendation and diff.recommendation.endswith(": keep")


def test_no_energy_row_where_neither_side_has_a_gpu(tmp_path: Path) -> None:
    from campaign.analysis.recommend import diff_run

    run = telemetry_run(tmp_path, {"baseline": [(100.0, None, 0, 0)] * 2, "other": [(101.0, None, 0, 0)] * 2})
    metrics = {m.metric for c in diff_run(run)[0].cells for m in c.metrics}
    assert "energy_j_per_token" not in metrics and "total_tok_s" in metrics


def test_drift_says_when_the_gpu_clock_moved_at_steady_throughput(tmp_path: Path) -> None:
    from campaign.analysis.summary import drift

    steady = drift(telemetry_run(tmp_path / "a", {
        "baseline": [(100.0, None, 1980, 600), (100.5, None, 1965, 610), (99.8, None, 1980, 590)]}))
    assert steady.checked and not steady.drifted and steady.moved == ()
    assert "SM clock +0.0%, power -1.7% (GPU telemetry of 1 cells)" in steady.message
    assert steady.sm_clock_change_pct == pytest.approx(0.0) and "within the drift limits" in steady.message
    warm = drift(telemetry_run(tmp_path / "b", {
        "baseline": [(100.0, None, 1980, 600), (99.0, None, 1900, 600), (98.0, None, 1780, 600)]}))
    assert warm.drifted and warm.moved == ("SM clock",)
    assert warm.median_change_pct == pytest.approx(-2.0) and warm.sm_clock_change_pct == pytest.approx(-10.1, abs=0.1)
    assert "DRIFTED (SM clock moved)" in warm.message
    capped = drift(telemetry_run(tmp_path / "c", {
        "baseline": [(100.0, None, 1980, 600), (90.0, None, 1980, 450)]}))
    assert capped.moved == ("throughput", "power") and "DRIFTED (throughput and power moved)" in capped.message
