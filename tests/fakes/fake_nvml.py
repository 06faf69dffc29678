"""A pynvml-shaped module object for tests: `gpu.use_nvml(FakeNvml(...))`.

It plays back recorded samples on a clock the test owns: `record(t, gpu0, gpu1, ...)` says what each GPU reads
from time t on (a step function), and every NVML getter answers with the state at `clock()`. A reading may be a
callable (evaluated when read), for tests that run against live processes. Where a recording gives no
`energy_mj`, the energy counter is the exact integral of the recorded power (what a real counter would count);
`energy_counter=False` makes it raise NVMLError_NotSupported, as on GPUs before Volta.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Names and values as in nvidia-ml-py.
NVML_CLOCK_GRAPHICS = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
nvmlClocksEventReasonGpuIdle = 0x01
nvmlClocksEventReasonApplicationsClocksSetting = 0x02
nvmlClocksEventReasonSwPowerCap = 0x04
nvmlClocksEventReasonHwSlowdown = 0x08
nvmlClocksEventReasonSyncBoost = 0x10
nvmlClocksEventReasonSwThermalSlowdown = 0x20
nvmlClocksEventReasonHwThermalSlowdown = 0x40
nvmlClocksEventReasonHwPowerBrakeSlowdown = 0x80


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's name
    pass


class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801
    pass


class NVMLError_Uninitialized(NVMLError):  # noqa: N801
    pass


DEFAULTS: dict[str, Any] = {"sm_clock_mhz": 1980, "mem_clock_mhz": 2619, "power_w": 100.0, "reasons": 0,
                            "util_gpu_pct": 0, "memory_used_mib": 500, "memory_total_mib": 143_771, "pids": ()}


class FakeClock:
    """Time the test owns: it moves only when told."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class _Handle:
    index: int


@dataclass
class _Memory:
    total: int
    used: int
    free: int


@dataclass
class _Util:
    gpu: int
    memory: int


@dataclass
class _Process:
    pid: int
    usedGpuMemory: int  # noqa: N815 - pynvml's name


class FakeNvml:
    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVML_CLOCK_GRAPHICS = NVML_CLOCK_GRAPHICS
    NVML_CLOCK_SM = NVML_CLOCK_SM
    NVML_CLOCK_MEM = NVML_CLOCK_MEM

    def __init__(self, gpus: int = 1, *, clock: Callable[[], float] | None = None, energy_counter: bool = True,
                 present: bool = True, energy_start_mj: int = 5_000_000) -> None:
        self.gpus = gpus
        self.clock = clock or FakeClock()
        self.energy_counter = energy_counter
        self.present = present
        self.energy_start_mj = energy_start_mj
        self.timeline: list[tuple[float, list[dict[str, Any]]]] = []
        self.inits = 0       # nvmlInit minus nvmlShutdown: 0 again when every session was closed
        self.calls: list[str] = []

    # --- the recording ------------------------------------------------------------------------------------
    def record(self, t: float, *gpus: dict[str, Any]) -> None:
        """From time t on, GPU i reads gpus[i] (keys of DEFAULTS, and energy_mj); one dict is used for all GPUs."""
        states = list(gpus) if len(gpus) == self.gpus else [gpus[0]] * self.gpus
        self.timeline.append((t, [DEFAULTS | s for s in states]))
        self.timeline.sort(key=lambda item: item[0])

    def _state(self, index: int) -> dict[str, Any]:
        now = self.clock()
        current = DEFAULTS
        for t, states in self.timeline:
            if t <= now:
                current = states[index]
        return current

    def _read(self, handle: _Handle, key: str) -> Any:
        self._require_init()
        value = self._state(handle.index)[key]
        return value() if callable(value) else value

    def _require_init(self) -> None:
        if self.inits <= 0:
            raise NVMLError_Uninitialized("Uninitialized")

    def _energy_mj(self, index: int) -> int:
        """The recorded counter, else the integral of the recorded (step-function) power up to now."""
        now = self.clock()
        explicit = [(t, s[index]["energy_mj"]) for t, s in self.timeline if t <= now and "energy_mj" in s[index]]
        if explicit:
            value = explicit[-1][1]
            return int(value() if callable(value) else value)
        joules = 0.0
        points = [(t, s[index]) for t, s in self.timeline if t <= now]
        if not points:
            return self.energy_start_mj
        for (t0, state), (t1, _) in zip(points, [*points[1:], (now, {})], strict=True):
            power = state["power_w"]
            joules += (t1 - t0) * (power() if callable(power) else power)
        return self.energy_start_mj + int(round(joules * 1000))

    # --- pynvml's functions -------------------------------------------------------------------------------
    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names from here on
        if not self.present:
            raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")
        self.inits += 1

    def nvmlShutdown(self) -> None:  # noqa: N802
        self._require_init()
        self.inits -= 1

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        self._require_init()
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:  # noqa: N802
        self._require_init()
        if not 0 <= index < self.gpus:
            raise NVMLError("Invalid Argument")
        return _Handle(index)

    def nvmlDeviceGetName(self, handle: _Handle) -> str:  # noqa: N802
        self._require_init()
        return "NVIDIA H200 (fake)"

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:  # noqa: N802
        self._require_init()
        return f"GPU-00000000-0000-0000-0000-{handle.index:012d}"

    def nvmlSystemGetDriverVersion(self) -> str:  # noqa: N802
        return "570.00"

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:  # noqa: N802
        return 12080

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle) -> _Memory:  # noqa: N802
        total = int(self._read(handle, "memory_total_mib")) * 2**20
        used = int(self._read(handle, "memory_used_mib")) * 2**20
        return _Memory(total=total, used=used, free=total - used)

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> _Util:  # noqa: N802
        return _Util(gpu=int(self._read(handle, "util_gpu_pct")), memory=0)

    def nvmlDeviceGetClockInfo(self, handle: _Handle, kind: int) -> int:  # noqa: N802
        return int(self._read(handle, "sm_clock_mhz" if kind in (NVML_CLOCK_SM, NVML_CLOCK_GRAPHICS)
                              else "mem_clock_mhz"))

    def nvmlDeviceGetPowerUsage(self, handle: _Handle) -> int:  # noqa: N802
        return int(round(float(self._read(handle, "power_w")) * 1000))  # mW, as NVML reports it

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: _Handle) -> int:  # noqa: N802
        return int(self._read(handle, "reasons"))

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: _Handle) -> int:  # noqa: N802
        self._require_init()
        self.calls.append("energy")
        if not self.energy_counter:
            raise NVMLError_NotSupported("Not Supported")
        return self._energy_mj(handle.index)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: _Handle) -> list[_Process]:  # noqa: N802
        return [_Process(pid=p, usedGpuMemory=2**30) for p in self._read(handle, "pids")]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: _Handle) -> list[_Process]:  # noqa: N802
        self._require_init()
        return []
