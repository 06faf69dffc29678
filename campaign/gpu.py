"""NVML through nvidia-ml-py: GPU facts, release checks and telemetry samples. Absent GPU -> None, never 0."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

try:  # nvidia-ml-py installs the `pynvml` module
    import pynvml
except ImportError:  # pragma: no cover - it is a declared dependency
    pynvml = None


@contextmanager
def _nvml() -> Iterator[bool]:
    """Yields whether NVML works here (driver present, at least one device)."""
    if pynvml is None:
        yield False
        return
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...: no GPU on this machine
        yield False
        return
    try:
        yield pynvml.nvmlDeviceGetCount() > 0
    finally:
        pynvml.nvmlShutdown()


def available() -> bool:
    with _nvml() as ok:
        return ok


def _pids_on_gpus() -> set[int]:
    pids: set[int] = set()
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        for getter in (pynvml.nvmlDeviceGetComputeRunningProcesses,
                       pynvml.nvmlDeviceGetGraphicsRunningProcesses):
            try:
                pids.update(p.pid for p in getter(handle))
            except pynvml.NVMLError:
                continue
    return pids


def wait_released(pids: set[int], *, timeout_s: float) -> bool | None:
    """Wait until none of `pids` holds GPU memory. None where NVML is absent (nothing to check)."""
    with _nvml() as ok:
        if not ok:
            return None
        deadline = time.monotonic() + timeout_s
        while True:
            if not (_pids_on_gpus() & pids):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)


def machine_facts() -> dict[str, Any] | None:
    """GPU names, memory, driver and CUDA version; None without NVML."""
    with _nvml() as ok:
        if not ok:
            return None
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append({"index": index, "name": name.decode() if isinstance(name, bytes) else name,
                         "memory_total_mib": memory.total // 2**20})
        driver = pynvml.nvmlSystemGetDriverVersion()
        cuda = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        return {
            "gpus": gpus,
            "driver": driver.decode() if isinstance(driver, bytes) else driver,
            "cuda": f"{cuda // 1000}.{(cuda % 1000) // 10}",
        }


def sample() -> list[dict[str, Any]] | None:
    """One telemetry sample per GPU: memory used, utilisation, SM/memory clocks, power, throttle reasons."""
    with _nvml() as ok:
        if not ok:
            return None
        rows = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            row: dict[str, Any] = {"index": index, "t": time.monotonic()}
            readers: tuple[tuple[str, Callable[[Any], Any]], ...] = (
                ("memory_used_mib", lambda h: pynvml.nvmlDeviceGetMemoryInfo(h).used // 2**20),
                ("util_gpu_pct", lambda h: pynvml.nvmlDeviceGetUtilizationRates(h).gpu),
                ("sm_clock_mhz", lambda h: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
                ("mem_clock_mhz", lambda h: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM)),
                ("power_w", lambda h: pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0),
                ("throttle_reasons", lambda h: pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)),
            )
            for key, call in readers:
                try:
                    row[key] = call(handle)
                except (pynvml.NVMLError, AttributeError):
                    row[key] = None
            rows.append(row)
        return rows


@dataclass(frozen=True, kw_only=True)
class StepTelemetry:
    """What the GPUs did during one measured step; None where not measured, never 0."""

    samples: list[list[dict[str, Any]]]       # raw NVML samples, one list of per-GPU rows per sample
    throttled: str | None = None              # why the step's GPUs were held back (a reason for Invalid)
    energy_j: float | None = None             # over the step, all GPUs: NVML's energy counter, else sampled power
    energy_source: str | None = None          # "counter" or "sampled power"
    sm_clock_mhz_median: float | None = None
    power_w_median: float | None = None


class StepMonitor(Protocol):
    """Samples the GPUs around one measured step (Measurer calls start() before it and stop() after it)."""

    def start(self) -> None: ...

    def stop(self) -> StepTelemetry | None: ...
