"""Issue 17: a GPU pool on one host. The placement rules as pure functions; the pool's process runner against
a deterministic fake worker; and a four-variant matrix on the simulator with two simulated GPUs against the
same matrix run serially."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from campaign.analysis.summary import gpu_effect
from campaign.core.errors import CampaignError
from campaign.night import pool
from campaign.server.profiles import PROJECT_ROOT, LaunchProfile, load_profile, parse_gpus
from campaign.spec.matrix import load_matrix, schedule
from campaign.stored import store

MATRIX = "tests/fixtures/matrices/pool-sim.yaml"


def two_variants(folder: Path) -> Path:
    """pool-sim with its first two variants (the Ray tests need all four, more launches than their GPUs): two
    repeats of two variants are four launches, two side by side on a pool of two, each variant's repeats on both
    GPUs; half the launches of four variants, for the same placements to check."""
    raw = yaml.safe_load((PROJECT_ROOT / MATRIX).read_text())
    raw["variants"] = raw["variants"][:2]
    path = folder / "pool-sim.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("text, gpus", [("0-3", [0, 1, 2, 3]), ("0,2,4-5", [0, 2, 4, 5]), (" 1 , 0 ", [1, 0]),
                                        ([3, 1], [3, 1])])
def test_gpu_lists_parse(text: str | list[int], gpus: list[int]) -> None:
    assert parse_gpus(text) == gpus


@pytest.mark.parametrize("text, words", [("a", "not a GPU index"), ("3-1", "empty or negative"),
                                         ("0,0-1", "named twice"), ("", "no GPUs")])
def test_bad_gpu_lists_say_what_is_wrong(text: str, words: str) -> None:
    with pytest.raises(CampaignError, match=words) as caught:
        parse_gpus(text)
    assert caught.value.hint


def test_a_launch_needs_tensor_times_pipeline_parallel_gpus() -> None:
    profile = LaunchProfile(model="m", flags={"tensor-parallel-size": 2})
    assert pool.width(profile, {}) == 2
    assert pool.width(profile, {"tensor-parallel-size": 4, "pipeline-parallel-size": 2}) == 8
    assert pool.width(LaunchProfile(model="m"), {}) == 1


def test_planned_slots_swap_each_variants_repeats_across_the_gpus() -> None:
    # The serial schedule of A, B over three repeats: A B, B A, A B.
    launches = [("A", 0, 1), ("B", 0, 1), ("B", 1, 1), ("A", 1, 1), ("A", 2, 1), ("B", 2, 1)]
    jobs = pool.plan(launches, [0, 1])
    slots = {(j.variant, j.repeat): j.slot for j in jobs}
    assert slots[("A", 0)] == (0,) and slots[("B", 0)] == (1,)      # side by side
    assert slots[("B", 1)] == (0,) and slots[("A", 1)] == (1,)      # then the reverse
    for variant in "AB":
        assert {slots[(variant, r)] for r in range(3)} == {(0,), (1,)}
    wide = pool.plan([("A", 0, 2), ("B", 0, 2)], [4, 5, 6, 7])
    assert [j.slot for j in wide] == [(4, 5), (6, 7)]
    with pytest.raises(CampaignError, match="needs 4 GPUs"):
        pool.plan([("A", 0, 4)], [0, 1])
    assert all(j.slot is None for j in pool.plan([("A", 0, 1), ("B", 0, 2)], [0, 1, 2]))  # mixed: first free


def test_core_sets_are_disjoint_and_only_where_there_are_two_a_slot() -> None:
    assert pool.core_sets(2, list(range(8))) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert pool.core_sets(2, [0, 1, 2]) is None


FAKE_WORKER = """
import json, sys, time
print(json.dumps({"event": "note", "text": f"{sys.argv[1]} on {sys.argv[2]}"}), flush=True)
time.sleep(float(sys.argv[3]))
print(json.dumps({"event": "cell", "text": sys.argv[1]}), flush=True)
"""


def test_the_pool_never_gives_a_busy_gpu_and_keeps_each_slots_order(tmp_path: Path) -> None:
    """A deterministic fake worker behind the same interface: each job logs where it ran; the pool's own
    bookkeeping is checked from the workers' records, not from timings."""
    script = tmp_path / "worker.py"
    script.write_text(FAKE_WORKER)
    log = tmp_path / "log.jsonl"
    events: list[dict[str, object]] = []

    def command(job: pool.Job, gpus: tuple[int, ...], cores: list[int] | None) -> list[str]:
        return [sys.executable, "-c", f"import runpy,sys; sys.argv=['w', {job.variant!r}, "
                f"{','.join(map(str, gpus))!r}, '0.2']; open({str(log)!r}, 'a').write("
                f"'{{\"job\": \"{job.variant}\", \"gpus\": \"{','.join(map(str, gpus))}\", \"event\": \"start\"}}\\n');"
                f" runpy.run_path({str(script)!r}); open({str(log)!r}, 'a').write("
                f"'{{\"job\": \"{job.variant}\", \"gpus\": \"{','.join(map(str, gpus))}\", \"event\": \"end\"}}\\n')"]

    jobs = pool.plan([(f"v{i}", 0, 1) for i in range(6)], [0, 1])
    runner = pool.Pool(gpus=[0, 1], command=command, relay=events.append)
    runner.run(jobs)
    assert sorted(code for _, code in runner.exit_codes) == [0] * 6
    busy: dict[str, str] = {}
    order: dict[str, list[str]] = {"0": [], "1": []}
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        if entry["event"] == "start":
            assert entry["gpus"] not in busy, f"{entry['job']} started on a GPU {busy.get(entry['gpus'])} held"
            busy[entry["gpus"]] = entry["job"]
            order[entry["gpus"]].append(entry["job"])
        else:
            assert busy.pop(entry["gpus"]) == entry["job"]
    assert order == {"0": ["v0", "v2", "v4"], "1": ["v1", "v3", "v5"]}  # slot k mod 2, in schedule order
    assert sorted(str(e["text"]) for e in events if e["event"] == "cell") == [f"v{i}" for i in range(6)]


@pytest.mark.timeout(60)  # the bug this guards against spun forever
def test_a_job_waiting_for_the_baseline_holds_no_gpus_back_from_it(tmp_path: Path) -> None:
    """B's `suggested` flag waits for a baseline launch; B's planned slots must not keep the baseline's
    second launch (A1, after A0 failed) from starting: the night goes on instead of spinning."""
    script = tmp_path / "worker.py"
    script.write_text(FAKE_WORKER)
    jobs = pool.plan([("A", 0, 1), ("B", 0, 1), ("B", 1, 1), ("A", 1, 1)], [0, 1], ["A", "B"])
    started: list[str] = []

    def command(job: pool.Job, gpus: tuple[int, ...], cores: list[int] | None) -> list[str]:
        started.append(f"{job.variant}{job.repeat}")
        return [sys.executable, str(script), f"{job.variant}{job.repeat}", "0", "0.05"]

    runner = pool.Pool(gpus=[0, 1], command=command, relay=lambda event: None)
    # B is held back while a baseline launch is still to come (as if A0's server had never become ready).
    runner.blocked = lambda job: job.variant == "B" and any(
        j.variant == "A" and (j.variant, j.repeat) not in {(d.variant, d.repeat) for d, _ in runner.exit_codes}
        for j in jobs)
    runner.run(jobs)
    assert started[:2] == ["A0", "A1"] and sorted(started[2:]) == ["B0", "B1"]


def test_gpu_effect_is_read_per_launch_folder(tmp_path: Path) -> None:
    """A relaunch (or a resume on another pool) has its own placement: cells are matched to the launch
    folder they were measured on, never to the last placement of their repeat."""
    from fakes import builders

    from campaign.measure.cells import CellResult, CellSpec
    from campaign.stored.records import GpuDevice, PlacementRecord

    run = store.RunDir.create(tmp_path, "t")
    builders.manifest(run, baseline="A", variants=["A", "B"])
    spec = CellSpec(phase="decode", context_tokens=512, concurrency=4)

    def launch(variant: str, repeat: int, on: int, value: float | None) -> None:
        folder = run.new_launch_dir(variant)
        store.write_new(folder / "placement.json", PlacementRecord(
            variant=variant, repeat=repeat, executor="pool", host="h", gpus=[GpuDevice(index=on, uuid=None, name=None)],
            client_cores=None, started_utc="2026-12-02T00:00:00+00:00", ended_utc="2026-12-02T00:01:00+00:00"))
        if value is not None:
            run.write_cell(variant, repeat, CellResult(spec=spec, phase="decode", context_tokens=512, concurrency=4,
                                                       label=spec.label, status="Valid", total_tok_s=value),
                           launch=folder.name, telemetry=None)

    launch("A", 0, 0, 100.0)
    launch("B", 0, 1, 110.0)
    launch("B", 1, 0, 100.0)
    launch("A", 1, 1, 110.0)
    launch("A", 1, 0, None)  # a later launch of A's repeat 1 on GPU 0 that measured nothing (say it failed)
    effect = gpu_effect(run)
    assert effect.checked and effect.changes_pct == {"1": pytest.approx(10.0)}
    assert not effect.balanced  # A had two launches on GPU 0, one on GPU 1


def test_a_profile_with_a_bad_gpu_list_is_refused_naming_the_file_and_key(tmp_path: Path) -> None:
    from campaign.core.errors import ConfigError

    path = tmp_path / "p.yaml"
    path.write_text("schema_version: 1\nmodel: m\ngpus: '0,x'\n")
    with pytest.raises(ConfigError) as caught:
        load_profile(str(path))
    assert "gpus" in str(caught.value) and str(path) in str(caught.value)


def _run(out: Path, *extra: str, matrix: Path | str = MATRIX) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"CAMPAIGN_SIM_TIME_SCALE": "1"}
    return subprocess.run([sys.executable, "-m", "campaign", "run", "--no-report", str(matrix), "--engine", "sim",
                           "--out", str(out),
                           "--plain", *extra], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def _rows(run: store.RunDir) -> list[tuple[str, int, str, int, int]]:
    """`export`'s rows as identity: which cell, variant and repeat (figures and statuses are measurements)."""
    from campaign.report import text as report

    return sorted((r["variant"], r["repeat"], r["phase"], r["context_tokens"], r["concurrency"])
                  for r in report.export_rows(run.cells()))


def test_two_variants_on_a_pool_of_two_simulated_gpus_match_a_serial_run(tmp_path: Path) -> None:
    """The pool runs exactly the serial schedule's launches and cells (each stored once), two side by side on
    different GPUs and never two on one GPU, each variant's repeats on both GPUs so the GPU effect cancels."""
    matrix_path = two_variants(tmp_path)
    done = _run(tmp_path / "pool", "--gpus", "0,1", matrix=matrix_path)
    assert done.returncode == 0, done.stderr[-3000:]
    run = store.RunDir(next((tmp_path / "pool" / "pool-sim").glob("*")))
    assert run.manifest().executor == "pool" and run.manifest().pool == [0, 1]
    # Every cell stored once, and the rows of the serial schedule (what a serial run measures, launch by
    # launch; the figures differ as repeats do).
    keys = [(c.variant, c.repeat, c.result.spec.key) for c in run.cells()]
    assert len(keys) == len(set(keys)) == 2 * 2 * 2
    matrix, _, _ = load_matrix(str(matrix_path))
    serial = sorted((variant, repeat, c.phase, c.context_tokens, c.concurrency)
                    for variant, repeat in schedule(matrix) for c in matrix.cells())
    assert _rows(run) == serial
    # No GPU held by two launches at once; and launches did run side by side (on different GPUs).
    spans = []
    for launch_dir, placed in run.placements():
        assert placed.executor == "pool" and placed.gpus is not None and len(placed.gpus) == 1
        index = placed.gpus[0].index
        spans.append((index, datetime.fromisoformat(placed.started_utc), datetime.fromisoformat(placed.ended_utc)))
        # The truth of where it ran: the simulated server declares the GPU it was given.
        log = (run.root / launch_dir / "server.log").read_text()
        assert f"rank 0 on CUDA_VISIBLE_DEVICES index {index}" in log
    assert len(spans) == 4
    overlapped = False
    for i, (gpu_a, start_a, end_a) in enumerate(spans):
        for gpu_b, start_b, end_b in spans[i + 1:]:
            if start_a < end_b and start_b < end_a:
                assert gpu_a != gpu_b, "two launches held one GPU at the same time"
                overlapped = True
    assert overlapped
    # Each variant's two repeats ran one on each GPU: the GPU effect is measured and cancels.
    effect = gpu_effect(run)
    assert effect.checked and effect.balanced and set(effect.changes_pct) == {"1"}
    assert "GPU effect: GPUs 1 read" in done.stdout
    assert "GPU pool: 0, 1" in done.stderr
    # A resume of the finished pool run has nothing left, and keeps its pool.
    again = subprocess.run([sys.executable, "-m", "campaign", "run", "--no-report", "--resume", str(run.root),
                            "--plain"],
                           cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300,
                           env=os.environ | {"CAMPAIGN_SIM_TIME_SCALE": "1"})
    assert again.returncode == 0 and "nothing left to measure" in again.stderr


def test_a_launch_wider_than_the_pool_is_refused_before_the_night(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "campaign", "run", "tests/fixtures/matrices/crash-sim.yaml",
                          "--engine", "sim", "--out", str(tmp_path), "--plain", "--gpus", "0"],
                         cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "Error: only needs 2 GPUs (tensor x pipeline x data parallel size); the pool has 1" in out.stderr
    assert not list(tmp_path.glob("*/*/manifest.json"))  # refused before a run directory was begun


def test_the_simulator_given_fewer_gpus_than_its_parallel_size_fails_as_vllm_does(tmp_path: Path) -> None:
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "3"}
    out = subprocess.run([sys.executable, "-m", "campaign.sim", "--model", "m", "--hardware", "a5000x2",
                          "--model-shape", "qwen-27b-hybrid", "--tensor-parallel-size", "2", "--port", "9"],
                         cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "World size (2) is larger than the number of available GPUs (1)" in out.stdout


def test_ctrl_c_on_a_pool_stops_every_server_and_a_resume_finishes(tmp_path: Path) -> None:
    """SIGINT to the controller alone (not its process group): it stops each worker, each worker its server;
    nothing is left running, and `--resume` (which keeps the pool) measures the rest."""
    import signal
    import time

    import psutil

    env = os.environ | {"CAMPAIGN_SIM_TIME_SCALE": "1"}
    # Two variants, one repeat: two launches side by side when the signal lands, each with cells left for the
    # resume to finish.
    matrix = two_variants(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "campaign", "run", "--no-report", str(matrix), "--engine", "sim",
                             "--out",
                             str(tmp_path), "--plain", "--gpus", "0,1", "--repeats", "1"], cwd=PROJECT_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    def servers() -> list[psutil.Process]:
        found = []
        for p in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "campaign.sim" in " ".join(p.cmdline()):
                    found.append(p)
        return found

    # Ctrl-C lands once a cell is stored and two launches run side by side. (Waiting for the first cell alone
    # once found one server: unloaded, the baseline's 0.1 s prefill cell was stored before the second launch's
    # server had started.)
    deadline = time.monotonic() + 120
    while not (list(tmp_path.glob("pool-sim/*/variants/*/cells/*/rep-*.json")) and len(servers()) == 2):
        assert time.monotonic() < deadline and proc.poll() is None, "no cell measured beside a second launch"
        time.sleep(0.05)
    tree = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, err[-3000:]
    assert "continue with" in err
    gone, alive = psutil.wait_procs(tree, timeout=10)
    assert not alive, [p.cmdline() for p in alive]
    run = store.RunDir(next((tmp_path / "pool-sim").glob("*")))
    stops = [p for p in run.root.glob("variants/*/launch-*/stop.json")]
    assert len(stops) == len(list(run.root.glob("variants/*/launch-*/server.json")))  # each stopped, recorded
    again = subprocess.run([sys.executable, "-m", "campaign", "run", "--no-report", "--resume", str(run.root),
                            "--plain"],
                           cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    loaded, _, _ = load_matrix(str(matrix))
    launches = schedule(loaded.model_copy(update={"repeats": 1}))   # the baseline opens and closes the night
    assert len(run.cells()) == len(launches) * len(loaded.cells()) and run.manifest().pool == [0, 1]
    assert {p.executor for _, p in run.placements()} == {"pool"}


def test_a_pool_controller_killed_outright_takes_its_workers_and_servers_along(tmp_path: Path) -> None:
    """SIGKILL leaves no handler to run: each worker's parent-death signal stops it, and it stops its server
    and records the stop, so no orphan measures into a run that a resume writes again."""
    import signal
    import time

    import psutil

    env = os.environ | {"CAMPAIGN_SIM_TIME_SCALE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "campaign", "run", "--no-report", MATRIX, "--engine", "sim", "--out",
                             str(tmp_path), "--plain", "--gpus", "0,1"], cwd=PROJECT_ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("pool-sim/*/variants/*/cells/*/rep-*.json")):
        assert time.monotonic() < deadline and proc.poll() is None, "no cell was measured"
        time.sleep(0.05)
    tree = psutil.Process(proc.pid).children(recursive=True)
    assert sum("campaign.night.worker" in " ".join(p.cmdline()) for p in tree) == 2
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    run = store.RunDir(next((tmp_path / "pool-sim").glob("*")))
    ready = list(run.root.glob("variants/*/launch-*/server.json"))
    assert ready and all((p.parent / "stop.json").exists() for p in ready)
