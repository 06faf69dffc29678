"""NVML through nvidia-ml-py: GPU facts, release checks, telemetry samples and the step monitor. Absent GPU -> None,
never 0.

Every NVML call goes through the module-level `pynvml`, which `use_nvml` replaces (a fake in tests, None for
"no NVML here"): one indirection, so the monitor, `sample()` and the release check all read the same source.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

try:  # nvidia-ml-py installs the `pynvml` module
    import pynvml
except ImportError:  # pragma: no cover - it is a declared dependency
    pynvml = None

# NVML's clocks-event ("throttle") reason bits (nvml.h, nvmlClocksEventReason*): fixed by the NVML API.
REASON_GPU_IDLE = 0x01
# The reasons that hold a busy GPU back: power or heat. Idle, application-clock settings, sync boost and display
# clock settings also lower the clock, but by design, not because the GPU could not keep up: not throttling.
THROTTLE_REASONS: tuple[tuple[int, str], ...] = (
    (0x04, "SW power cap"),
    (0x08, "HW slowdown"),
    (0x40, "HW thermal slowdown"),
    (0x80, "HW power brake"),
    (0x20, "SW thermal slowdown"),
)
SAMPLE_EVERY_S = 0.5
# A step whose median SM clock (while busy) is this far below the launch's median so far was held back, whatever
# the reason bits say (they are sticky for microseconds; a clock that stays down is what the numbers feel).
CLOCK_DROP_LIMIT = 0.10
MIN_CLOCK_READINGS = 3  # fewer busy SM-clock readings than this (in the step, or before it) decide nothing


def use_nvml(module: Any) -> Any:
    """Read NVML through `module` from now on (a pynvml-shaped object; None: no NVML). Returns the one replaced."""
    global pynvml
    previous = pynvml
    pynvml = module
    return previous


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


def pids_on_gpus() -> set[int] | None:
    """The processes NVML sees holding GPU memory; None without NVML. (In a container without the host's PID
    namespace NVML reports host PIDs, which match nothing here.)"""
    with _nvml() as ok:
        return _pids_on_gpus() if ok else None


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


def devices(indices: list[int]) -> list[dict[str, Any]]:
    """Each index with NVML's UUID and name (both None without NVML, or for an index NVML does not have: the
    simulator's GPUs on a machine without them)."""
    out: list[dict[str, Any]] = [{"index": i, "uuid": None, "name": None} for i in indices]
    with _nvml() as ok:
        if not ok:
            return out
        count = pynvml.nvmlDeviceGetCount()
        for row in out:
            if row["index"] < count:
                handle = pynvml.nvmlDeviceGetHandleByIndex(row["index"])
                uuid, name = pynvml.nvmlDeviceGetUUID(handle), pynvml.nvmlDeviceGetName(handle)
                row["uuid"] = uuid.decode() if isinstance(uuid, bytes) else uuid
                row["name"] = name.decode() if isinstance(name, bytes) else name
    return out


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


def _clocks_event_reasons(handle: Any) -> Any:
    try:
        return pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle)
    except AttributeError:  # nvidia-ml-py before 12.535: the same bits under their old name
        return pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)


_READERS: tuple[tuple[str, Callable[[Any], Any]], ...] = (
    ("memory_used_mib", lambda h: pynvml.nvmlDeviceGetMemoryInfo(h).used // 2**20),
    ("util_gpu_pct", lambda h: pynvml.nvmlDeviceGetUtilizationRates(h).gpu),
    ("sm_clock_mhz", lambda h: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
    ("mem_clock_mhz", lambda h: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM)),
    ("power_w", lambda h: pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0),
    ("throttle_reasons", _clocks_event_reasons),
    # Total energy since the driver loaded, in mJ (Volta and newer; NVMLError_NotSupported before).
    ("energy_mj", lambda h: pynvml.nvmlDeviceGetTotalEnergyConsumption(h)),
)


def _read_rows(clock: Callable[[], float], indices: list[int] | None = None) -> list[dict[str, Any]]:
    """One row per GPU (`indices`: only those, by NVML index); a reading the GPU does not support is None.
    NVML must be initialised."""
    rows = []
    count = pynvml.nvmlDeviceGetCount()
    for index in range(count) if indices is None else [i for i in indices if i < count]:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        row: dict[str, Any] = {"index": index, "t": clock()}
        for key, call in _READERS:
            try:
                row[key] = call(handle)
            except (pynvml.NVMLError, AttributeError):
                row[key] = None
        rows.append(row)
    return rows


def sample() -> list[dict[str, Any]] | None:
    """One telemetry sample per GPU: memory used, utilisation, SM/memory clocks, power, throttle reasons, energy."""
    with _nvml() as ok:
        return _read_rows(time.monotonic) if ok else None


@dataclass(frozen=True, kw_only=True)
class StepTelemetry:
    """What the GPUs did during one measured step; None where not measured, never 0."""

    samples: list[list[dict[str, Any]]]       # raw NVML samples, one list of per-GPU rows per sample
    throttled: str | None = None              # why the step's GPUs were held back (a reason for Invalid)
    energy_j: float | None = None             # over the step, all GPUs: NVML's energy counter, else sampled power
    energy_source: str | None = None          # "counter", "sampled power", or "counter and sampled power"
    sm_clock_mhz_median: float | None = None
    power_w_median: float | None = None


class StepMonitor(Protocol):
    """Samples the GPUs around one measured step (Measurer calls start() before it and stop() after it)."""

    def start(self) -> None: ...

    def stop(self) -> StepTelemetry | None: ...


# --- pure summaries of raw samples (also read back from stored cells by summary.drift) -----------------------
def _by_gpu(samples: list[list[dict[str, Any]]]) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for rows in samples:
        for row in rows:
            out.setdefault(int(row["index"]), []).append(row)
    return out


def _busy(row: dict[str, Any]) -> bool:
    reasons = row.get("throttle_reasons")
    return not (isinstance(reasons, int) and reasons & REASON_GPU_IDLE)


def busy_sm_clocks(samples: list[list[dict[str, Any]]]) -> list[float]:
    """Every GPU's SM clock readings while it was not idle (an idle GPU clocks down by design)."""
    return [float(r["sm_clock_mhz"]) for rows in samples for r in rows
            if r.get("sm_clock_mhz") is not None and _busy(r)]


def sm_clock_median(samples: list[list[dict[str, Any]]]) -> float | None:
    """Median SM clock over every GPU's busy readings (all readings when it was idle throughout)."""
    clocks = busy_sm_clocks(samples) or [float(r["sm_clock_mhz"]) for rows in samples for r in rows
                                         if r.get("sm_clock_mhz") is not None]
    return statistics.median(clocks) if clocks else None


def power_median(samples: list[list[dict[str, Any]]]) -> float | None:
    """Median over samples of the power of all GPUs together (samples where every GPU reported it)."""
    totals = [sum(float(r["power_w"]) for r in rows) for rows in samples
              if rows and all(r.get("power_w") is not None for r in rows)]
    return statistics.median(totals) if totals else None


def sampled_energy_j(rows: list[dict[str, Any]]) -> float | None:
    """The time integral (trapezoid) of one GPU's sampled power; None with fewer than two readings."""
    points = [(float(r["t"]), float(r["power_w"])) for r in rows if r.get("power_w") is not None]
    if len(points) < 2:
        return None
    return sum((t1 - t0) * (p0 + p1) / 2 for (t0, p0), (t1, p1) in zip(points, points[1:], strict=False))


def step_energy(samples: list[list[dict[str, Any]]]) -> tuple[float | None, str | None]:
    """Energy over the samples, all GPUs: each GPU's energy counter (first to last sample) where it has one,
    else its sampled power; None when any GPU has neither (a part would read as a whole)."""
    total, sources = 0.0, set()
    per_gpu = _by_gpu(samples)
    if not per_gpu:
        return None, None
    for rows in per_gpu.values():
        first, last = rows[0].get("energy_mj"), rows[-1].get("energy_mj")
        if len(rows) >= 2 and first is not None and last is not None and last >= first:
            total += (last - first) / 1000.0
            sources.add("counter")
            continue
        energy = sampled_energy_j(rows)
        if energy is None:
            return None, None
        total += energy
        sources.add("sampled power")
    source = sources.pop() if len(sources) == 1 else "counter and sampled power"
    return total, source


def throttle_reasons(samples: list[list[dict[str, Any]]]) -> list[str]:
    """The power and thermal reasons any sample shows, named, per GPU: "SW power cap on GPU 0 in 3 of 10 samples"."""
    out = []
    for index, rows in sorted(_by_gpu(samples).items()):
        known = [r["throttle_reasons"] for r in rows if isinstance(r.get("throttle_reasons"), int)]
        for bit, name in THROTTLE_REASONS:
            hits = sum(1 for reasons in known if reasons & bit)
            if hits:
                out.append(f"{name} on GPU {index} in {hits} of {len(known)} samples")
    return out


# --- the step monitor -------------------------------------------------------------------------------------
class NvmlMonitor:
    """A StepMonitor on NVML: samples every GPU on a thread during each step (and once at its start and end), and
    on stop() says what the step cost (energy) and whether the GPUs were held back (throttle reasons, or an SM
    clock well below this launch's so far). One monitor per launch: the launch's clock history lives here.

    `every_s=None` takes no thread: only start(), sample_now() and stop() sample (tests drive it with their own
    clock). Without NVML, start() does nothing and stop() returns None.
    """

    def __init__(self, *, every_s: float | None = SAMPLE_EVERY_S, clock: Callable[[], float] = time.monotonic,
                 clock_drop: float = CLOCK_DROP_LIMIT, indices: list[int] | None = None) -> None:
        # On a GPU pool, the launch's own GPUs only: another slot's energy, clocks and throttling are not its.
        self.indices = indices
        self.every_s = every_s
        self.clock = clock
        self.clock_drop = clock_drop
        self.launch_sm_clocks: list[float] = []   # busy SM-clock readings of this launch's unthrottled steps
        self.last: StepTelemetry | None = None   # the last step's telemetry, until take()
        self._samples: list[list[dict[str, Any]]] = []
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self._open = False

    # --- sampling ---------------------------------------------------------------------------------------
    def start(self) -> None:
        self._finish_thread()
        if self._open:  # a step that never stopped: its NVML session ends here
            pynvml.nvmlShutdown()
            self._open = False
        with self._lock:
            self._samples = []
        if pynvml is None:
            return
        try:
            pynvml.nvmlInit()  # reference-counted by NVML: the monitor's session is its own
        except Exception:  # no driver, no library: nothing to sample
            return
        self._open = True
        self.sample_now()
        if self.every_s is not None:
            self._halt.clear()
            self._thread = threading.Thread(target=self._loop, name="gpu-monitor", daemon=True)
            self._thread.start()

    def sample_now(self) -> None:
        """One sample of every GPU (the thread calls this); a failed read is a missing sample, never zeros."""
        if not self._open:
            return
        try:
            rows = _read_rows(self.clock, self.indices)
        except pynvml.NVMLError:
            return
        if rows:
            with self._lock:
                self._samples.append(rows)

    def _loop(self) -> None:
        assert self.every_s is not None
        while not self._halt.wait(self.every_s):
            self.sample_now()

    def _finish_thread(self) -> None:
        if self._thread is not None:
            self._halt.set()
            self._thread.join(10)
            self._thread = None

    def stop(self) -> StepTelemetry | None:
        self._finish_thread()
        if not self._open:
            return None
        try:
            self.sample_now()
        finally:
            pynvml.nvmlShutdown()
            self._open = False
        with self._lock:
            samples, self._samples = self._samples, []
        if not samples:
            return None
        self.last = self.summarize(samples)
        return self.last

    def take(self) -> StepTelemetry | None:
        """The last step's telemetry, once (orchestrate stores its samples with the cell)."""
        last, self.last = self.last, None
        return last

    # --- what a step's samples say ---------------------------------------------------------------------
    def summarize(self, samples: list[list[dict[str, Any]]]) -> StepTelemetry:
        """Energy, medians and throttling of one step; adds an unthrottled step's clocks to the launch history."""
        energy, source = step_energy(samples)
        reasons = throttle_reasons(samples)
        busy = busy_sm_clocks(samples)
        if len(busy) >= MIN_CLOCK_READINGS and len(self.launch_sm_clocks) >= MIN_CLOCK_READINGS:
            step_clock = statistics.median(busy)
            launch_clock = statistics.median(self.launch_sm_clocks)
            if launch_clock > 0 and step_clock < (1 - self.clock_drop) * launch_clock:
                reasons.append(f"median SM clock {step_clock:,.0f} MHz, {1 - step_clock / launch_clock:.0%} below "
                               f"the launch's {launch_clock:,.0f} MHz")
        if not reasons:
            self.launch_sm_clocks.extend(busy)
        return StepTelemetry(samples=samples, throttled="; ".join(reasons) or None, energy_j=energy,
                             energy_source=source, sm_clock_mhz_median=sm_clock_median(samples),
                             power_w_median=power_median(samples))


def monitor(*, every_s: float | None = SAMPLE_EVERY_S, clock: Callable[[], float] = time.monotonic,
            indices: list[int] | None = None) -> NvmlMonitor | None:
    """A step monitor for one launch (`indices`: its GPUs, by NVML index; None: every GPU); None where NVML is
    absent (no GPU: nothing to sample)."""
    return NvmlMonitor(every_s=every_s, clock=clock, indices=indices) if available() else None
