"""Issue 17: many hosts through Ray, on a local cluster of two nodes with two fake GPUs each (Ray's own
cluster utilities for tests): the pool matrix runs as Ray tasks, one node is killed mid-launch, and the
campaign completes with the loss recorded and every cell stored once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from campaign import store
from campaign.profiles import PROJECT_ROOT

ray = pytest.importorskip("ray")

MATRIX = "tests/fixtures/matrices/pool-sim.yaml"


def test_a_campaign_on_a_local_ray_cluster_survives_a_lost_node(tmp_path: Path) -> None:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 2})
    doomed = cluster.add_node(num_cpus=4, num_gpus=2)
    head_id = cluster.head_node.node_id
    try:
        env = os.environ | {"CAMPAIGN_SIM_TIME_SCALE": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "campaign", "run", MATRIX, "--engine", "sim", "--out", str(tmp_path), "--plain",
             "--executor", "ray", "--ray-address", cluster.address],
            cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # Mid-launch: once the first cell has streamed back, the second node goes, with the launches on it.
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("pool-sim/*/variants/*/cells/*/rep-*.json")) and proc.poll() is None:
            assert time.monotonic() < deadline, "no cell came back from the cluster"
            time.sleep(0.05)
        cluster.remove_node(doomed, allow_graceful=False)
        out, err = proc.communicate(timeout=300)
    finally:
        cluster.shutdown()
    assert proc.returncode == 0, err[-3000:]
    run = store.RunDir(next((tmp_path / "pool-sim").glob("*")))
    assert run.manifest().executor == "ray"
    lost = [f for f in run.failures() if f.failure_kind == "node_lost"]
    assert lost, err[-3000:]
    assert "its Ray task was lost" in err and "sending it again" in err
    # Every cell of the matrix stored once, whatever node measured it, and none lost with the node.
    keys = [(c.variant, c.repeat, c.result.spec.key) for c in run.cells()]
    assert len(keys) == len(set(keys)) == 4 * 2 * 2
    assert all(c.result.status == "Valid" for c in run.cells()), [c.result.reasons for c in run.cells()]
    # Each launch that finished says where: a Ray node, and the GPU Ray gave it; the retries ran on the head.
    placed = run.placements()
    assert placed and all(p.executor == "ray" and p.node and p.gpus for _, p in placed)
    retried = {(f.variant, f.repeat) for f in lost}
    assert all(p.node == head_id for _, p in placed if (p.variant, p.repeat) in retried)
    assert "recommendation:" in out
