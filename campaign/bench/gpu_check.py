"""`make gpu-check`: does the GPU side work on this machine, end to end, without vLLM? (Under 5 minutes.)

It launches a stand-in server through the real lifecycle (`ServerProcess` and a `LaunchSpec`, as vLLM is
launched): this same file run under GPU_PYTHON (a python with CUDA torch), which allocates a few GiB of GPU memory,
serves /health and, on GET /load?s=N, runs a matmul loop for N seconds to draw power. The check samples the GPUs
with the step monitor while idle and during the load, reads the energy counter, stops the server through the
real stop path and verifies the GPU memory is released. One PASS/FAIL line per check; the last line is
machine-readable. Exit 0: every check passed; 1: one failed; 2: no NVIDIA GPU here (nothing to check).

The stand-in (`campaign/bench/gpu_standin.py`) imports only the standard library and torch, so GPU_PYTHON needs
nothing of this project.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from campaign.bench.gpu_standin import MATMUL_N
from campaign.core.errors import LaunchError
from campaign.server import gpu
from campaign.server.argv import LaunchSpec, free_port
from campaign.server.lifecycle import ServerProcess, log_tail

NO_GPU = "no NVIDIA GPU: nothing to check"


def _say(text: str) -> None:
    print(text, flush=True)  # noqa: T201 - a command-line check: its output is the point


# --- the check (runs in the project's environment) -----------------------------------------------------------
class _Checks:
    def __init__(self) -> None:
        self.results: list[tuple[str, bool]] = []

    def report(self, name: str, ok: bool, detail: str) -> bool:
        _say(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
        self.results.append((name, ok))
        return ok

    @property
    def failed(self) -> int:
        return sum(1 for _, ok in self.results if not ok)


def _memory_used_mib(rows: list[dict[str, Any]] | None) -> float | None:
    if not rows or any(r.get("memory_used_mib") is None for r in rows):
        return None
    return float(sum(r["memory_used_mib"] for r in rows))


def _drive_load(base_url: str, seconds: float) -> dict[str, Any]:
    """The stand-in's matmul loop for `seconds` (blocks until it is done)."""
    import httpx

    response = httpx.get(f"{base_url}/load", params={"s": seconds}, timeout=seconds + 120, trust_env=False)
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


def _cuda_torch(gpu_python: str) -> tuple[bool, str]:
    import subprocess

    code = ("import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), "
            "torch.cuda.device_count())")
    try:
        out = subprocess.run([gpu_python, "-c", code], capture_output=True, text=True, timeout=180,  # noqa: S603
                             check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{gpu_python}: {exc}"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return False, f"{gpu_python} cannot import torch ({last}); set GPU_PYTHON to a python with CUDA torch"
    version, cuda, ok, count = (out.stdout.split() + ["?"] * 4)[:4]
    if ok != "True":
        return False, f"torch {version} in {gpu_python} sees no CUDA device (CUDA build: {cuda})"
    return True, f"torch {version} (CUDA {cuda}) in {gpu_python} sees {count} device(s)"


def check(*, gpu_python: str, gib: float, load_s: float, idle_s: float, device: str = "cuda",
          workdir: Path | None = None) -> int:
    checks = _Checks()
    facts = gpu.machine_facts() if gpu.available() else None
    if facts is None:
        _say(f"FAIL  nvml: {NO_GPU} (NVML found no driver or no device)")
        _say("gpu_check=FAIL checks=1 failed=1 reason=no_gpu")
        return 2
    names = ", ".join(str(g["name"]) for g in facts["gpus"])
    checks.report("nvml", True, f"{len(facts['gpus'])} GPU(s): {names}; driver {facts['driver']}, CUDA {facts['cuda']}")
    figures: dict[str, Any] = {"gpus": len(facts["gpus"])}
    if device == "cuda":
        ok, detail = _cuda_torch(gpu_python)
        if not checks.report("cuda torch", ok, detail):
            return _finish(checks, figures)

    import tempfile

    folder = workdir or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    log = folder / "standin.log"
    port = free_port()
    spec = LaunchSpec(argv=[gpu_python, str(Path(__file__).resolve().with_name("gpu_standin.py")), "--port", str(port),
                            "--gib", f"{gib:g}", "--device", device],
                      env_overrides={"PYTHONUNBUFFERED": "1"}, host="127.0.0.1", port=port,
                      served_model_name="gpu-stand-in", flags={})
    before = _memory_used_mib(gpu.sample())
    server = ServerProcess(spec, log, startup_timeout_s=180.0, grace_sigint_s=20.0, grace_sigterm_s=10.0)
    pid_seen = False
    try:
        with server:
            ready = server.wait_ready()
            checks.report("stand-in ready", True, f"pid {ready.pid} answered /health after {ready.ready_s:.1f} s "
                                                  "(ServerProcess, as vLLM is launched)")
            pid_seen = _held(checks, server.pid, before, gib if device == "cuda" else 0.0)
            _telemetry(checks, spec.base_url, load_s, idle_s, figures)
    except LaunchError as exc:
        checks.report("stand-in ready", False, f"{exc.message}; log {log}: {exc.log_tail.strip()[-600:]}")
    except Exception as exc:  # the check reports every failure; the with-block has stopped the server by now
        checks.report("check", False, f"{type(exc).__name__}: {exc}; log {log}: {log_tail(log, 10)[-600:]}")
    _stopped(checks, server, before, pid_seen, figures)
    return _finish(checks, figures)


def _held(checks: _Checks, pid: int, before: float | None, gib: float) -> bool:
    """The stand-in holds its GPU memory: NVML's used memory rose, and NVML lists its process."""

    pids = gpu.pids_on_gpus() or set()
    seen = pid in pids
    after = _memory_used_mib(gpu.sample())
    rise = None if before is None or after is None else after - before
    ok = rise is not None and rise >= 0.8 * gib * 1024
    checks.report("memory held", ok, (f"GPU memory used +{rise:,.0f} MiB (asked for {gib:g} GiB)" if rise is not None
                                      else "NVML reports no memory use") + (
        "; NVML lists the stand-in's pid" if seen else
        "; NVML does not list the stand-in's pid (a container without the host's PID namespace?)"))
    return seen


def _telemetry(checks: _Checks, base_url: str, load_s: float, idle_s: float, figures: dict[str, Any]) -> None:
    monitor = gpu.NvmlMonitor(every_s=0.5)
    monitor.start()
    time.sleep(idle_s)
    idle = monitor.stop()
    monitor.start()
    began = time.monotonic()
    try:
        work = _drive_load(base_url, load_s)
    finally:
        loaded = monitor.stop()
    elapsed = time.monotonic() - began
    if loaded is None or idle is None:
        checks.report("telemetry", False, "the monitor returned nothing (NVML went away?)")
        return
    expected = int(elapsed / 0.5 * 0.6)
    sm, power, idle_power = loaded.sm_clock_mhz_median, loaded.power_w_median, idle.power_w_median
    figures.update(samples=len(loaded.samples), load_s=round(elapsed, 1), sm_clock_mhz_load=sm, power_w_load=power,
                   power_w_idle=idle_power, tflops=round(work.get("tflops") or 0.0, 1))
    checks.report("telemetry", len(loaded.samples) >= expected and sm is not None and power is not None,
                  f"{len(loaded.samples)} samples over {elapsed:.1f} s of load (at least {expected} expected): "
                  f"median SM clock {sm or 0:,.0f} MHz, median power {power or 0:,.0f} W")
    if work.get("tflops"):
        _say(f"INFO  load: {work['matmuls']:,} fp16 {MATMUL_N}x{MATMUL_N} matmuls, {work['tflops']:,.0f} TFLOP/s")
    draws = power is not None and idle_power is not None and power > idle_power + max(20.0, 0.2 * idle_power)
    checks.report("load draws power", draws, f"median {power or 0:,.0f} W under load against {idle_power or 0:,.0f} W "
                                             "idle (needs +20% and +20 W)")
    sampled = [gpu.sampled_energy_j(rows) for rows in _rows_by_gpu(loaded.samples)]
    sampled_total = sum(e for e in sampled if e is not None) if sampled and None not in sampled else None
    figures.update(energy_j=None if loaded.energy_j is None else round(loaded.energy_j, 1),
                   energy_source=loaded.energy_source,
                   sampled_energy_j=None if sampled_total is None else round(sampled_total, 1))
    if loaded.energy_source != "counter" or loaded.energy_j is None:
        checks.report("energy counter", False, f"no energy counter on every GPU (source: {loaded.energy_source}; "
                                               "before Volta?): energy per token falls back to sampled power")
    else:
        agree = sampled_total is not None and abs(loaded.energy_j - sampled_total) <= 0.25 * loaded.energy_j
        checks.report("energy counter", loaded.energy_j > 0 and agree,
                      f"{loaded.energy_j:,.0f} J over the load from the counter; sampled power integrates to "
                      f"{sampled_total or 0:,.0f} J (must agree within 25%)")
    _say(f"INFO  throttled during the load: {loaded.throttled or 'no'}")
    figures["throttled"] = loaded.throttled is not None


def _rows_by_gpu(samples: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for rows in samples:
        for row in rows:
            out.setdefault(int(row["index"]), []).append(row)
    return list(out.values())


def _stopped(checks: _Checks, server: ServerProcess, before: float | None, pid_seen: bool,
             figures: dict[str, Any]) -> None:
    stop = server.stop_info
    if stop is None:
        return
    figures.update(stop_mode=stop.mode, released=stop.gpu_memory_released)
    checks.report("stop", stop.mode == "sigint" and stop.port_free and stop.swept == 0,
                  f"{stop.mode} in {stop.stop_s:.1f} s, exit code {stop.exit_code}, {stop.swept} swept, "
                  f"port {'free' if stop.port_free else 'still taken'}")
    if not pid_seen:
        checks.report("released", False, "NVML never listed the stand-in's process, so gpu.wait_released cannot "
                                         "tell whether it let go (the memory check below still can)")
    else:
        checks.report("released", stop.gpu_memory_released is True,
                      f"gpu.wait_released: {stop.gpu_memory_released} (no process of the stand-in's tree on a GPU)")
    deadline = time.monotonic() + 30
    after = _memory_used_mib(gpu.sample())
    while before is not None and after is not None and after > before + 256 and time.monotonic() < deadline:
        time.sleep(0.5)
        after = _memory_used_mib(gpu.sample())
    back = before is not None and after is not None and after <= before + 256
    figures["memory_back"] = back
    checks.report("memory back", back, f"GPU memory used {after or 0:,.0f} MiB after the stop, "
                                       f"{before or 0:,.0f} MiB before the launch (within 256 MiB)")


def _finish(checks: _Checks, figures: dict[str, Any]) -> int:
    verdict = "PASS" if not checks.failed else "FAIL"
    pairs = {"gpu_check": verdict, "checks": len(checks.results), "failed": checks.failed, **figures}
    _say(" ".join(f"{k}={_plain(v)}" for k, v in pairs.items()))
    return 0 if not checks.failed else 1


def _plain(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="the check (the default)")
    for p in (parser, run):
        p.add_argument("--gpu-python", default=os.environ.get("GPU_PYTHON", "python3"),
                       help="a python with CUDA torch, for the stand-in")
        p.add_argument("--gib", type=float, default=4.0, help="GPU memory the stand-in holds")
        p.add_argument("--load-s", type=float, default=15.0, help="seconds of matmul load")
        p.add_argument("--idle-s", type=float, default=3.0, help="seconds sampled idle, for comparison")
        p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    return check(gpu_python=args.gpu_python, gib=args.gib, load_s=args.load_s, idle_s=args.idle_s,
                 device=args.device)


if __name__ == "__main__":
    sys.exit(main())
