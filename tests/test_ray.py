"""Issue 17: many hosts through Ray, on a local cluster of two nodes with two fake GPUs each (Ray's own
cluster utilities for tests): the pool matrix runs as Ray tasks, one node is killed mid-launch, and the
campaign completes with the loss recorded and every cell stored once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from campaign.measure.runner import HOST_STALLS
from campaign.server.profiles import PROJECT_ROOT
from campaign.spec.matrix import load_matrix, schedule
from campaign.stored import store

ray = pytest.importorskip("ray")

MATRIX = "tests/fixtures/matrices/pool-sim.yaml"
# The pool matrix at one repeat (its four variants, the baseline opening and closing the night): five launches,
# more than the two nodes' four GPUs hold at once, so a lost node always takes running launches with it.
_POOL, _, _ = load_matrix(MATRIX)
CELLS_AT_ONE_REPEAT = len(schedule(_POOL.model_copy(update={"repeats": 1}))) * len(_POOL.cells())


@pytest.mark.cpu_heavy
def test_a_campaign_on_a_local_ray_cluster_survives_a_lost_node(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.cluster_utils import Cluster

    # The cluster's own environment says 5x; the controller's says 1x, and the launches must run at that.
    monkeypatch.setenv("CAMPAIGN_SIM_TIME_SCALE", "5")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 2})
    doomed = cluster.add_node(num_cpus=4, num_gpus=2)
    head_id = cluster.head_node.node_id
    try:
        env = os.environ | {"CAMPAIGN_SIM_TIME_SCALE": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "campaign", "run", "--no-report", MATRIX, "--engine", "sim", "--out",
             str(tmp_path), "--plain",
             "--executor", "ray", "--ray-address", cluster.address, "--repeats", "1"],
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
    assert len(keys) == len(set(keys)) == CELLS_AT_ONE_REPEAT
    # Measured, each of them (a cell lost with its node would be missing or Failed). Whether a cell is Valid is
    # the host's load as much as the cluster's: under a CPU hog one read Invalid for a reason of its own.
    assert all(c.result.status != "Failed" for c in run.cells()), [
        (c.result.spec.key, c.result.status, c.result.reasons) for c in run.cells() if c.result.status != "Valid"]
    # At the controller's time scale, the one its manifest records, on every node (a time-scaled cell says so).
    assert not [n for c in run.cells() for n in c.result.notes if "faster than its hardware" in n]
    # Each launch that finished says where: a Ray node, and the GPU Ray gave it; the retries ran on the head.
    placed = run.placements()
    assert placed and all(p.executor == "ray" and p.node and p.gpus for _, p in placed)
    retried = {(f.variant, f.repeat) for f in lost}
    assert all(p.node == head_id for _, p in placed if (p.variant, p.repeat) in retried)
    assert "recommendation:" in out


def _sims() -> list[object]:
    """The simulated servers of this test's cluster: the cluster's processes are this process's descendants
    (another test's servers, running beside this one under xdist, are not)."""
    import psutil

    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "campaign.sim" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            continue
    return found


@pytest.mark.cpu_heavy
def test_ctrl_c_stops_every_remote_server_and_a_resume_finishes_on_a_new_cluster(tmp_path: Path) -> None:
    """The pool matrix's first two variants at one repeat (three launches, the first two side by side on the
    node's two GPUs): Ctrl-C once a cell is back stops every server the cluster runs, each recorded as stopped by
    its own task, and a resume on a fresh cluster measures the rest, nothing twice."""
    import signal

    import psutil
    from ray.cluster_utils import Cluster

    raw = yaml.safe_load((PROJECT_ROOT / MATRIX).read_text())
    raw["variants"] = raw["variants"][:2]
    matrix = tmp_path / "pool-sim.yaml"
    matrix.write_text(yaml.safe_dump(raw))
    two, _, _ = load_matrix(str(matrix))
    cells = len(schedule(two.model_copy(update={"repeats": 1}))) * len(two.cells())
    env = os.environ | {"CAMPAIGN_SIM_TIME_SCALE": "1"}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 2})
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "campaign", "run", "--no-report", str(matrix), "--engine", "sim", "--out",
             str(tmp_path), "--plain", "--executor", "ray", "--ray-address", cluster.address, "--repeats", "1"],
            cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("pool-sim/*/variants/*/cells/*/rep-*.json")):
            assert time.monotonic() < deadline and proc.poll() is None, "no cell came back from the cluster"
            time.sleep(0.05)
        servers = _sims()
        assert servers, "no simulated server running on the cluster"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 130, err[-3000:]
        _, alive = psutil.wait_procs(servers, timeout=30)  # type: ignore[arg-type]
        assert not alive, "a server outlived Ctrl-C"
    finally:
        cluster.shutdown()
    run = store.RunDir(next((tmp_path / "pool-sim").glob("*")))
    # Each launch that became ready was stopped and recorded as stopped, by its own task.
    launches = list(run.root.glob("variants/*/launch-*/server.json"))
    assert launches and all((p.parent / "stop.json").exists() for p in launches)
    measured = len(run.cells())
    assert 0 < measured < cells
    fresh = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 2})
    try:
        again = subprocess.run([sys.executable, "-m", "campaign", "run", "--no-report", "--resume", str(run.root),
                                "--plain",
                                "--ray-address", fresh.address], cwd=PROJECT_ROOT, env=env, capture_output=True,
                               text=True, timeout=300)
    finally:
        fresh.shutdown()
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{measured} cells already stored" in again.stderr
    keys = [(c.variant, c.repeat, c.result.spec.key) for c in run.cells()]
    assert len(keys) == len(set(keys)) == cells == 6


# A one-node cluster started with a low soft limit on open files (as a raylet often has: 1,024), the hard one
# kept: it prints its address, and shuts down when its stdin closes.
_LOW_LIMIT_CLUSTER = """
import resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
from ray.cluster_utils import Cluster
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 1})
print(cluster.address, flush=True)
sys.stdin.read()
cluster.shutdown()
"""


@pytest.fixture(scope="module")
def one_gpu_node() -> Iterator[str]:
    """The address of a one-node cluster of one GPU started with a low soft limit on open files
    (_LOW_LIMIT_CLUSTER), shared by the tests that need no more (a cluster takes seconds to start)."""
    cluster = subprocess.Popen([sys.executable, "-c", _LOW_LIMIT_CLUSTER], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        assert cluster.stdout is not None
        yield cluster.stdout.readline().strip()
    finally:
        cluster.communicate(input="", timeout=120)


@pytest.mark.cpu_heavy
def test_a_launch_wider_than_the_largest_node_is_refused_before_the_night(tmp_path: Path, one_gpu_node: str
                                                                          ) -> None:
    out = subprocess.run([sys.executable, "-m", "campaign", "run", "tests/fixtures/matrices/crash-sim.yaml",
                          "--engine", "sim", "--out", str(tmp_path), "--plain", "--executor", "ray",
                          "--ray-address", one_gpu_node], cwd=PROJECT_ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    assert out.stderr.startswith("Error: the largest node of the Ray cluster has 1 GPUs; a launch needs 2\nhint: ")
    assert not list(tmp_path.glob("*/*/manifest.json"))


@pytest.mark.cpu_heavy
def test_a_ray_task_raises_its_open_files_limit_to_the_nodes_hard_one(tmp_path: Path, one_gpu_node: str) -> None:
    """The plan checks the controller's limit, but a Ray task's client runs under its raylet's soft limit:
    300 streams on a node started at 256 open files failed their connections. The task raises its soft limit
    to the node's hard one, as the command does, and the cell's 300 requests all succeed."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip("this machine's hard limit on open files is below 1,024")
    matrix = tmp_path / "wide.yaml"
    matrix.write_text("name: wide\nprofile: h200\nbaseline: base\nvariants:\n  - name: base\nrepeats: 1\n"
                      "warmup: false\nworkloads:\n  - {kind: decode, mode: fixed, contexts: [64], "
                      "concurrency: [300], max_tokens: 4}\n")
    env = os.environ | {"CAMPAIGN_SIM_TIME_SCALE": "5"}
    out = subprocess.run([sys.executable, "-m", "campaign", "run", "--no-report", str(matrix), "--engine", "sim",
                          "--out",
                          str(tmp_path), "--plain", "--executor", "ray", "--ray-address", one_gpu_node],
                         cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    run = store.RunDir(next((tmp_path / "wide").glob("*")))
    (cell,) = run.cells()
    assert len(cell.result.records) >= 300 and all(r.ok for r in cell.result.records), [
        r.error for r in cell.result.records if not r.ok][:3]


def test_streamed_records_name_the_controllers_launch_folder_even_in_one_batch(tmp_path: Path) -> None:
    """The files of a task arrive sorted, a cell record (cells/...) before its launch's first file
    (launch-1/...): its `launch` must still be the controller's folder, not the task's own name."""
    import json as _json

    from fakes import builders

    from campaign.core.progress import Progress
    from campaign.night.ray_executor import RayExecutor, _Task

    run = store.RunDir.create(tmp_path, "t")
    builders.manifest(run, baseline="A", variants=["A"])
    run.new_launch_dir("A")  # the controller already has launch-1 of A
    executor = RayExecutor(run, Progress(total_cells=0, estimate_s=0, live=False), engine="sim")
    task = _Task(job=None, ref=None)
    cell = {"schema_version": 7, "kind": "cell", "variant": "A", "repeat": 0, "launch": "launch-1",
            "written_utc": "x", "result": {}, "gpu_telemetry": None}
    executor._write(task, [("variants/A/cells/prefill-L8/rep-0.json", _json.dumps(cell)),
                           ("variants/A/launch-1/warmup.json", "{}"),
                           ("variants/A/cells/prefill-L8/bad.json", "{not json")], "t1")
    stored = _json.loads((run.root / "variants/A/cells/prefill-L8/rep-0.json").read_text())
    assert task.launches == {"launch-1": "launch-2"} and stored["launch"] == "launch-2"
    assert (run.root / "variants/A/launch-2/warmup.json").exists()
    assert not (run.root / "variants/A/cells/prefill-L8/bad.json").exists()  # warned, never fatal


def test_a_ctrl_c_while_a_batch_is_written_keeps_the_whole_batch(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch taken off the queue exists nowhere else: a Ctrl-C that lands while its first file is written
    stops the night after the last one (test_ctrl_c_stops_every_remote_server_and_a_resume_finishes_on_a_new_
    cluster once found a launch's server.json lost, the cell record beside it in one batch kept)."""
    import json as _json

    from fakes import builders

    from campaign.core import errors
    from campaign.core.progress import Progress
    from campaign.night.ray_executor import RayExecutor, _Task

    monkeypatch.setattr(errors, "_stop_requested", False)   # put back after the test, whatever the handler set
    run = store.RunDir.create(tmp_path, "t")
    builders.manifest(run, baseline="A", variants=["A"])
    cell = {"schema_version": 7, "kind": "cell", "variant": "A", "repeat": 0, "launch": "launch-1",
            "written_utc": "x", "result": {}, "gpu_telemetry": None}
    batch = [{"task": "t1", "event": "files", "files": [("variants/A/cells/prefill-L8/rep-0.json",
                                                        _json.dumps(cell))]},
             {"task": "t1", "event": "files", "files": [("variants/A/launch-1/server.json", "{}")]}]

    class Queue:
        def qsize(self) -> int:
            return len(batch)

        def get_nowait_batch(self, n: int) -> list[dict[str, Any]]:
            taken = batch[:n]
            del batch[:n]
            return taken

    executor = RayExecutor(run, Progress(total_cells=0, estimate_s=0, live=False), engine="sim")
    monkeypatch.setattr(executor, "queue", Queue(), raising=False)   # the Ray queue actor, faked
    write = executor._write

    def signalled(*args: Any) -> None:
        write(*args)
        if not (run.root / "variants/A/launch-1").exists():
            errors.request_stop()   # the SIGINT handler, run where the main thread is: after the cell's file

    monkeypatch.setattr(executor, "_write", signalled)
    with pytest.raises(KeyboardInterrupt):
        executor._drain({"t1": _Task(job=None, ref=None)})
    assert (run.root / "variants/A/cells/prefill-L8/rep-0.json").exists()
    assert (run.root / "variants/A/launch-1/server.json").exists()


# --- a trace cell on Ray (issue 50): its file travels with the task ----------------------------------------
AZURE_CONV = PROJECT_ROOT / "matrices" / "traces" / "azure-conv-2023-1k.csv"


def _trace_night(tmp_path: Path) -> tuple[Path, Path]:
    """A trace matrix whose file is on the controller only (controller/conv.csv): its path and the matrix's."""
    trace = tmp_path / "controller" / "conv.csv"
    trace.parent.mkdir()
    trace.write_bytes(AZURE_CONV.read_bytes())
    matrix = tmp_path / "t.yaml"
    matrix.write_text("name: t\nprofile: h200\nbaseline: a\nvariants:\n  - name: a\nrepeats: 1\nwarmup: false\n"
                      "workloads:\n  - {kind: trace, file: controller/conv.csv, duration_s: 30}\n")
    return trace, matrix


def test_a_trace_matrix_is_let_through_to_the_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A trace workload used to be refused before the night on --executor ray; every check before the cluster
    now lets it through (the cluster stands in here: reached, it says so)."""
    from campaign.cli import run_cli
    from campaign.core.errors import CampaignError
    from campaign.night import ray_executor

    def reached(address: str | None, widest: int, *, simulated_gpus: int | None = None) -> None:
        raise CampaignError("reached the cluster")

    monkeypatch.setattr(ray_executor, "connect", reached)
    _, matrix = _trace_night(tmp_path)
    capsys.readouterr()
    code = run_cli(["run", "--no-report", str(matrix), "--engine", "sim", "--executor", "ray", "--out",
                    str(tmp_path / "runs")])
    assert (code, capsys.readouterr().err) == (1, "Error: reached the cluster\n")


def test_a_trace_travels_with_its_ray_task_and_its_records_name_the_controllers_file(tmp_path: Path) -> None:
    """The controller reads the night's traces once; the node, which has no such file, writes its copy into
    its scratch run and rebuilds the very cells the controller planned (same keys), replaying the copy's
    requests; the records it streams back name the controller's file. A trace edited since the run began is
    refused on the controller, and a copy that is not what the run began with on the node."""
    import json as _json

    from campaign.core.errors import ConfigError
    from campaign.core.progress import Progress
    from campaign.night import orchestrate, ray_executor
    from campaign.night.launch import Options
    from campaign.server.profiles import load_profile

    trace, matrix_file = _trace_night(tmp_path)
    matrix, matrix_path, _ = load_matrix(str(matrix_file))
    profile, profile_path = load_profile("h200")
    run = store.RunDir.create(tmp_path / "runs", "t")
    store.write_new(run.manifest_path, orchestrate.manifest(matrix, matrix_path, profile, profile_path,
                                                            Options(engine="sim")))
    shipped = ray_executor.trace_files(run)
    assert shipped == {str(trace): AZURE_CONV.read_bytes()}
    (planned,) = matrix.cells()
    trace.rename(tmp_path / "elsewhere.csv")   # the node's view: no such file

    node = tmp_path / "node"
    node.mkdir()
    text, back = ray_executor.localized(node, run.manifest_path.read_text(), shipped)
    (node / "manifest.json").write_text(text)
    (cell,) = store.RunDir(node).manifest().matrix_model().cells()
    assert cell.key == planned.key and cell.trace is not None and planned.trace is not None
    assert cell.trace.path != planned.trace.path == str(trace)
    assert len(cell.trace.load()) == planned.trace.requests   # replayed from the node's copy

    record = node / "variants" / "a" / "cells" / cell.key / "rep-0.json"
    record.parent.mkdir(parents=True)
    record.write_text(_json.dumps({"variant": "a", "result": {"spec": cell.model_dump(mode="json")}}))
    sent: list[dict[str, object]] = []
    ray_executor._Streamer(node, sent.append, back).flush()
    (event,) = sent
    ((_, streamed),) = event["files"]  # type: ignore[misc]
    assert _json.loads(streamed)["result"]["spec"]["trace"]["path"] == str(trace)

    # Edited since the run began: refused on the controller before any cluster, and on a node.
    (tmp_path / "elsewhere.csv").rename(trace)
    trace.write_bytes(AZURE_CONV.read_bytes() + b"\n")
    with pytest.raises(ConfigError, match="the trace changed since the run began"):
        ray_executor.RayExecutor(run, Progress(total_cells=0, estimate_s=0, live=False), engine="sim").execute([])
    with pytest.raises(ConfigError, match="the trace changed since the run began"):
        ray_executor.localized(tmp_path / "node2", run.manifest_path.read_text(), {str(trace): trace.read_bytes()})


@pytest.mark.cpu_heavy
def test_a_trace_night_runs_on_ray_while_the_nodes_cannot_read_the_file(tmp_path: Path) -> None:
    """End to end on a local Ray (the simulated H200's one card: the launches run one after another). Once the
    first cell is back the trace file is moved away (a node without the controller's files), and back once the
    second is (the controller's diff reads it at the end): the second launch still replays the trace, from the
    bytes its task carries, and every record names the controller's file. Also issue 33's case: without an
    address Ray starts a local instance, which declared no GPUs, and the night stopped at once ("the largest
    node of the Ray cluster has 0 GPUs"); for the simulator the local Ray declares the simulated cards, so a
    what-if on Ray runs on one machine (this test once had its own night: one local Ray start is enough)."""
    trace, matrix = _trace_night(tmp_path)
    matrix.write_text(matrix.read_text().replace("  - name: a\n", "  - name: a\n  - name: b\n"
                                                                   "    flags: {max-num-seqs: 64}\n"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"CAMPAIGN_SIM_TIME_SCALE": "20"}
    proc = subprocess.Popen([sys.executable, "-m", "campaign", "run", "--no-report", str(matrix), "--engine", "sim",
                             "--out",
                             str(tmp_path / "runs"), "--plain", "--executor", "ray"], cwd=PROJECT_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    away = tmp_path / "elsewhere.csv"
    try:
        for count, (source, target) in enumerate([(trace, away), (away, trace)], 1):
            deadline = time.monotonic() + 120
            while len(list(tmp_path.glob("runs/t/*/variants/*/cells/*/rep-*.json"))) < count:
                assert time.monotonic() < deadline and proc.poll() is None, f"cell {count} never came back"
                time.sleep(0.05)
            source.rename(target)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    run = store.RunDir(next((tmp_path / "runs" / "t").glob("*")))
    cells = run.cells()
    # Each launch replayed the whole trace, from the bytes its task carried. A loaded host may leave a cell
    # Invalid for its own client's stall at 20x (schedule_behind: the runner measured it again and says so),
    # which is the client's finding, not the trace's; any other finding is a failure here.
    assert len(cells) == 3, [(c.variant, c.result.status, c.result.reasons) for c in cells]
    for c in cells:
        assert c.result.status == "Valid" or set(c.result.reason_codes) <= set(HOST_STALLS), (
            c.variant, c.result.status, c.result.reasons)
        assert c.result.spec.trace is not None and len(c.result.requests) == c.result.spec.trace.requests
    assert {c.result.spec.trace.path for c in cells if c.result.spec.trace} == {str(trace)}
    assert len(list(run.root.glob("variants/*/launch-*/placement.json"))) == 3   # every launch placed by Ray
