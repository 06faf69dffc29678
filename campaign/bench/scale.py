"""Does a campaign finish sooner on more GPUs? A benchmark, not a test: `make bench-scale`.

The same simulator matrix (tests/fixtures/matrices/pool-sim.yaml: four flag sets, two repeats, eight
launches of one simulated H200 each, 3 s windows) run serially, on a pool of 2 and of 4 simulated GPUs, and, where Ray
is installed, as Ray tasks on a local cluster of two nodes with two fake GPUs each. Printed side by side
from one run: wall time and speedup against serial, and per launch what the estimate for a cluster needs:
start (process to ready), measure, stop, the launch's files (what a Ray task streams back) and, on Ray, what
the task's dispatch and streaming cost beyond the launch itself.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from campaign.server.profiles import PROJECT_ROOT
from campaign.stored import store

MATRIX = "tests/fixtures/matrices/pool-sim.yaml"
WINDOW_S = "3"  # longer than the suite's 1 s: a launch is mostly measuring, as on real hardware


def _campaign(out: Path, *extra: str) -> float:
    env = os.environ | {"CAMPAIGN_SIM_TIME_SCALE": os.environ.get("CAMPAIGN_SIM_TIME_SCALE", "1")}
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "campaign", "run", MATRIX, "--engine", "sim", "--out", str(out),
                           "--plain", "--window", WINDOW_S, *extra],
                          cwd=PROJECT_ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"campaign run {' '.join(extra)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return wall


def _per_launch(out: Path) -> dict[str, float]:
    run = store.RunDir(next((out / "pool-sim").glob("*")))
    ready = [s.ready_s for s in run.ready_servers()]
    stops, spans, sizes = [], [], []
    for launch in run.launches():
        stop = run.stop(str(launch.relative_to(run.root)))
        if stop is not None:
            stops.append(stop.stop_s)
        sizes.append(sum(p.stat().st_size for p in launch.rglob("*") if p.is_file()))
    for _, placed in run.placements():
        spans.append((datetime.fromisoformat(placed.ended_utc) - datetime.fromisoformat(placed.started_utc))
                     .total_seconds())
    cells = sum(p.stat().st_size for p in run.root.glob("variants/*/cells/*/*.json"))
    launches = max(1, len(list(run.launches())))
    return {"ready_s": statistics.median(ready), "stop_s": statistics.median(stops) if stops else 0.0,
            "span_s": statistics.median(spans) if spans else 0.0,
            "kib": (statistics.median(sizes) + cells / launches) / 1024}


def main() -> None:
    rows: list[tuple[str, float, dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as folder:
        base = Path(folder)
        for name, extra in (("serial", ()), ("pool of 2", ("--gpus", "0,1")), ("pool of 4", ("--gpus", "0-3"))):
            out = base / name.replace(" ", "-")
            rows.append((name, _campaign(out, *extra), _per_launch(out)))
        try:
            from ray.cluster_utils import Cluster
        except ImportError:
            print("ray: not installed (pip install 'vllm-campaign[ray]'): skipped")  # noqa: T201
        else:
            cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 2})
            cluster.add_node(num_cpus=4, num_gpus=2)
            try:
                out = base / "ray"
                rows.append(("ray, 2 nodes x 2", _campaign(out, "--executor", "ray", "--ray-address",
                                                           cluster.address), _per_launch(out)))
            finally:
                cluster.shutdown()  # type: ignore[no-untyped-call]
    serial = rows[0][1]
    print(f"{'executor':<18} {'wall s':>7} {'speedup':>8} {'start s':>8} {'launch s':>9} {'stop s':>7} "  # noqa: T201
          f"{'files KiB':>10}")
    for name, wall, launch in rows:
        print(f"{name:<18} {wall:7.1f} {serial / wall:7.2f}x {launch['ready_s']:8.2f} {launch['span_s']:9.2f} "  # noqa: T201
              f"{launch['stop_s']:7.2f} {launch['kib']:10.0f}")
    print("launch s: one launch from before its server starts to after it stopped (placement.json); files KiB: "  # noqa: T201
          "what one launch stores (a Ray task streams this back)")


if __name__ == "__main__":
    main()
