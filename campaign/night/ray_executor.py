"""Many hosts through Ray: each launch (its server and its measuring client) runs as a Ray task on a node
with the GPUs it needs, and its files stream back into the controller's run directory.

Ray does the placement (`num_gpus`: the variant's tensor x pipeline parallel size; Ray sets the task's
CUDA_VISIBLE_DEVICES), the resources and the transport; nothing here schedules across machines. No shared
filesystem is assumed: a task writes its launch into a scratch run directory on its node and, every half
second, puts each finished file on a Ray queue (records are written atomically, so a file that is there is
whole; a server log goes once its launch has ended). The controller writes them into the run under names of
its own (a task's launch-1 becomes the controller's next free launch folder of that variant, and the records
that name it are rewritten to match), so the store, resume and diff are the serial ones.

A trace cell's file is read on the controller: its bytes travel with each task (put in Ray's object store
once), and the node replays them from a scratch copy, its records naming the controller's path as a serial run's
do; nothing of the trace need exist on the node.

A node lost mid-launch: what it streamed before stays; the loss is recorded as that launch's failure
(`node_lost`), and the job is sent again with what is still not stored, up to MAX_NODE_LOSSES times. Ctrl-C
cancels every task; each stops its server (the task's KeyboardInterrupt runs the launch's clean-up), sends
what it has, and ends. `--resume` works across a restarted cluster: what is stored is the controller's.

Ray is an optional dependency (`pip install 'vllm-campaign[ray]'`); every node needs vllm-campaign and the
server (vLLM) installed, as for any Ray job.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from campaign.core import secret
from campaign.core.errors import CampaignError, ConfigError, stop_held
from campaign.core.progress import Progress
from campaign.measure import traces
from campaign.night.launch import Campaign, LaunchWork, Options
from campaign.plan import limits
from campaign.stored import store
from campaign.stored.records import FailureRecord

MAX_NODE_LOSSES = 2        # per launch of the schedule: then it is left unfinished, as a failed launch is
STREAM_EVERY_S = 0.5
CANCEL_GRACE_S = 90.0


def require_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise CampaignError("--executor ray needs Ray, which is not installed",
                            hint="pip install 'vllm-campaign[ray]' (on the controller and every node)") from None
    return ray


def connect(address: str | None, widest: int, *, simulated_gpus: int | None = None) -> None:
    """Join the cluster (or start a local Ray) before the night, and check that the widest launch fits on
    it: Ray would otherwise hold an infeasible task waiting for GPUs that never come. `simulated_gpus`: a
    local Ray for the simulator declares that many GPUs (the simulated cards), so a what-if runs on a machine
    without any; Ray then hands each task CUDA_VISIBLE_DEVICES as it would real ones."""
    ray = require_ray()
    # "local": a new instance of its own even where one runs already (joining one, Ray refuses num_gpus).
    local = {"address": "local", "num_gpus": simulated_gpus} if address is None and simulated_gpus is not None \
        else {"address": address}
    try:
        ray.init(log_to_driver=False, ignore_reinit_error=True, include_dashboard=False, configure_logging=False,
                 **local)
    except Exception as exc:  # noqa: BLE001 - Ray raises ConnectionError, TimeoutError, RuntimeError, ...
        raise CampaignError(f"cannot join the Ray cluster at {address or 'a local Ray'}: {exc}",
                            hint="check --ray-address (or RAY_ADDRESS); `ray status` on the head node") from None
    # A launch runs on one node: the node with the most GPUs is what it can get, not the cluster's sum.
    most = max((int(n.get("Resources", {}).get("GPU", 0)) for n in ray.nodes() if n.get("Alive")), default=0)
    if widest > most:
        raise CampaignError(f"the largest node of the Ray cluster has {most} GPUs; a launch needs {widest}",
                            hint="add a node with that many GPUs, or lower the variant's parallel size")


# --- on the node ---------------------------------------------------------------------------------------
class _QueueProgress(Progress):
    def __init__(self, send: Callable[[dict[str, Any]], None], prefix: str) -> None:
        super().__init__(total_cells=0, estimate_s=0.0, live=False)
        self.send = send
        self.prefix = prefix

    def status(self, message: str) -> None:
        self.send({"event": "status", "text": f"{self.prefix}{message}"})

    def note(self, message: str) -> None:
        self.send({"event": "note", "text": f"{self.prefix}{message}"})

    def cell_done(self, message: str) -> None:
        self.send({"event": "cell", "text": f"{self.prefix}{message}"})


class _Streamer:
    """Sends each finished file of the scratch run once (server logs when their launch has ended), a record's
    paths of shipped files (`paths`: scratch copy -> the controller's path) put back as the controller's."""

    def __init__(self, root: Path, send: Callable[[dict[str, Any]], None], paths: dict[str, str] | None = None
                 ) -> None:
        self.root = root
        self.send = send
        self.paths = paths or {}
        self.sent: set[Path] = set()
        self.lock = threading.Lock()

    def flush(self) -> None:
        with self.lock:
            files = []
            for path in sorted((self.root / "variants").rglob("*")):
                if not path.is_file() or path.name.startswith(".") or path in self.sent:
                    continue
                if path.suffix != ".json" and not (path.parent / "placement.json").exists():
                    continue  # a log still being written
                text = path.read_bytes().decode(errors="replace")
                if self.paths and path.suffix == ".json":
                    try:
                        text = json.dumps(_swapped(json.loads(text), self.paths), indent=1) + "\n"
                    except ValueError:
                        pass   # not JSON after all: sent as it is, the controller warns of it
                files.append((str(path.relative_to(self.root)), text))
                self.sent.add(path)
            if files:
                self.send({"event": "files", "files": files})


def _swapped(value: Any, paths: dict[str, str]) -> Any:
    """`value` (parsed JSON) with every string that is a key of `paths` replaced by its value."""
    if isinstance(value, str):
        return paths.get(value, value)
    if isinstance(value, list):
        return [_swapped(v, paths) for v in value]
    if isinstance(value, dict):
        return {k: _swapped(v, paths) for k, v in value.items()}
    return value


def trace_files(run: store.RunDir) -> dict[str, bytes]:
    """The trace files the night's cells replay (the matrix's `file`s, as resolved on the controller), read here
    to travel with each task: a node has no share of this machine's files. One edited since the run began is
    refused, as a resume refuses it."""
    manifest = run.manifest()
    traces.check_unchanged(manifest.cells)
    files = {str(w["file"]) for w in manifest.matrix.raw.get("workloads") or []
             if isinstance(w, dict) and w.get("kind") == "trace" and isinstance(w.get("file"), str)}
    out = {}
    for file in sorted(files):
        try:
            out[file] = Path(file).read_bytes()
        except OSError as exc:
            raise ConfigError(file, "", f"cannot read the trace: {exc.strerror or exc}",
                              hint="restore the file, or start a new run") from None
    return out


def localized(root: Path, manifest_text: str, files: dict[str, bytes]) -> tuple[str, dict[str, str]]:
    """On the node: each shipped trace written under the scratch run (keeping its name, which its cells' keys
    carry), the manifest pointed at those copies, and the copies checked against the digests the run began
    with. Returns the manifest's text and the map back (scratch copy -> the controller's path)."""
    if not files:
        return manifest_text, {}
    there: dict[str, str] = {}
    back: dict[str, str] = {}
    for index, (file, content) in enumerate(sorted(files.items())):
        copy = root / "traces" / str(index) / Path(file).name
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_bytes(content)
        # A cell's trace path is str(Path(file)): the same file, maybe spelled more tidily.
        there |= {file: str(copy), str(Path(file)): str(copy)}
        back[str(copy)] = str(Path(file))
    data = _swapped(json.loads(manifest_text), there)
    traces.check_unchanged(data.get("cells") or [])
    return json.dumps(data), back


def run_launch(task: str, manifest_text: str, baseline_servers: list[str], variant: str, repeat: int,
               cell_keys: list[str], experiment_keys: list[str], engine: str | None, queue: Any,
               files: dict[str, bytes] | None = None) -> dict[str, Any]:
    """The Ray task: one launch of the schedule on this node's GPUs (Ray chose them), streamed back. `files`:
    the trace files its cells replay (trace_files), by the controller's path."""
    import ray

    def send(event: dict[str, Any]) -> None:
        # Lines and files leave the node redacted of what this task knows (the `${NAME}`s it expanded).
        queue.put(secret.redact_value({"task": task, **event}))

    # A worker has its raylet's soft limit on open files (often 1,024), not the controller's: raised to the
    # node's hard limit as the command raises its own, and the launch checks its cells against that.
    limits.raise_open_files()
    root = Path(tempfile.mkdtemp(prefix="campaign-ray-"))
    manifest_text, paths = localized(root, manifest_text, files or {})
    (root / "manifest.json").write_text(manifest_text)
    for index, text in enumerate(baseline_servers):  # a `suggested` flag reads the baseline's startup facts
        launch = root / "variants" / "_baseline" / f"launch-{index + 1}"
        launch.mkdir(parents=True)
        (launch / "server.json").write_text(text)
    streamer = _Streamer(root, send, paths)
    stop = threading.Event()

    def stream() -> None:
        while not stop.wait(STREAM_EVERY_S):
            streamer.flush()

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    gpus = [int(g) for g in ray.get_gpu_ids()]
    node = ray.get_runtime_context().get_node_id()
    try:
        run = store.RunDir(root)
        stored = run.manifest()
        matrix = stored.matrix_model()
        work = LaunchWork(variant, repeat, [c for c in matrix.cells() if c.key in cell_keys],
                          [e for e in matrix.experiments() if e.key in experiment_keys])
        options = Options(engine=engine or stored.engine, max_attempts=matrix.max_attempts, gpus=gpus or None,
                          executor="ray", node=node)
        progress = _QueueProgress(send, f"[{socket.gethostname()} GPU {','.join(map(str, gpus)) or '-'}] ")
        Campaign(run, matrix, stored.profile_model(), options=options, progress=progress).serve(work)
    except KeyboardInterrupt:
        send({"event": "note", "text": f"{variant} r{repeat + 1}: stopped (cancelled)"})
    finally:
        stop.set()
        thread.join()
        streamer.flush()
        shutil.rmtree(root, ignore_errors=True)
    return {"node": node, "host": socket.gethostname()}


# --- on the controller ---------------------------------------------------------------------------------
def forwarded_env(engine: str | None) -> dict[str, str]:
    """The simulator's settings from the controller's environment, for a task on any node: a Ray worker has
    its raylet's environment, not the controller's, and the run's manifest records the controller's time
    scale (a cluster started from a shell with another scale ran every launch at that one). Real vLLM reads
    none of them."""
    if engine != "sim":
        return {}
    env = {k: v for k, v in os.environ.items() if k.startswith("CAMPAIGN_SIM_")}
    env.setdefault("CAMPAIGN_SIM_TIME_SCALE", "1")
    return env


@dataclass
class _Task:
    job: Any            # pool.Job
    ref: Any            # the Ray ObjectRef
    losses: int = 0
    launches: dict[str, str] = field(default_factory=dict)   # the task's launch folder -> the controller's


@dataclass
class RayExecutor:
    """Runs the night's launches as Ray tasks and keeps the controller's run directory the one truth."""

    run: store.RunDir
    progress: Progress
    engine: str | None
    address: str | None = None
    pending_work: Callable[[str, int], tuple[list[str], list[str]] | None] = lambda v, r: None
    blocked: Callable[[Any, set[tuple[str, int]]], bool] = lambda job, done: False
    losses: list[str] = field(default_factory=list)
    _orphans: dict[str, dict[str, str]] = field(default_factory=dict)  # files of a task no longer tracked
    _files: Any = None   # the night's trace files (trace_files), in Ray's object store once; None: none

    def execute(self, jobs: list[Any]) -> None:
        ray = require_ray()
        from ray.util.queue import Queue

        shipped = trace_files(self.run)   # before the cluster is joined: a changed trace is refused first
        connect(self.address, max((j.width for j in jobs), default=1))
        self._files = ray.put(shipped) if shipped else None
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # The queue's actor on the controller's own node: a lost worker node must not take the results with it.
        here = ray.get_runtime_context().get_node_id()
        self.queue = Queue(actor_options={"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(
            node_id=here, soft=False)})
        remote = ray.remote(run_launch)
        self._remote = remote
        tasks: dict[str, _Task] = {}
        waiting = list(jobs)
        done: set[tuple[str, int]] = set()
        counter = 0
        try:
            while waiting or tasks:
                for job in [j for j in waiting if not self.blocked(j, done)]:
                    counter += 1
                    name = f"t{counter}"
                    ref = self._submit(name, job)
                    if ref is None:
                        done.add((job.variant, job.repeat))
                    else:
                        tasks[name] = _Task(job, ref)
                    waiting.remove(job)
                self._drain(tasks)
                if not tasks:
                    if waiting and all(self.blocked(j, done) for j in waiting):
                        raise CampaignError(f"{waiting[0].variant} waits for a launch that will not come",
                                            hint="a `suggested` flag needs the baseline launched first")
                    continue
                ready, _ = ray.wait([t.ref for t in tasks.values()], num_returns=1, timeout=0.2)
                for ref in ready:
                    name = next(n for n, t in tasks.items() if t.ref == ref)
                    task = tasks.pop(name)
                    try:
                        ray.get(ref)
                        self._drain({name: task, **tasks})
                        done.add((task.job.variant, task.job.repeat))
                    except ray.exceptions.RayTaskError as exc:  # our code raised on the node: not a loss
                        self._drain({name: task, **tasks})
                        self._failed(task, exc)
                        done.add((task.job.variant, task.job.repeat))
                    except ray.exceptions.RayError as exc:  # the node or its worker died under the task
                        self._drain({name: task, **tasks})
                        again = self._lost(name, task, exc)
                        if again is None:
                            done.add((task.job.variant, task.job.repeat))
                        else:
                            tasks[again[0]] = again[1]
        except BaseException:
            self._cancel(ray, tasks)
            raise
        finally:
            ray.shutdown()

    def _submit(self, name: str, job: Any) -> Any:
        """Send the job with what of it is not stored yet; None: nothing left."""
        left = self.pending_work(job.variant, job.repeat)
        if left is None:
            return None
        cells, experiments = left
        manifest = self.run.manifest_path.read_text()
        baseline = self.run.manifest().matrix_model().baseline
        servers = [s.model_dump_json() for s in self.run.ready_servers() if s.variant == baseline][:1]
        env = forwarded_env(self.engine)
        options: dict[str, Any] = {"runtime_env": {"env_vars": env}} if env else {}
        return self._remote.options(num_gpus=job.width, num_cpus=1, max_retries=0, **options).remote(
            name, manifest, servers, job.variant, job.repeat, cells, experiments, self.engine, self.queue,
            self._files or {})

    def _launch_dir(self, task: _Task) -> Path:
        """The task's last launch folder in the run, where its failure goes; a new one where it sent none, or
        where that one already records a failure (a relaunch's)."""
        last = sorted(task.launches.values(), key=lambda n: int(n.split("-")[1]))
        if last:
            folder = self.run.root / "variants" / store.safe_name(task.job.variant) / last[-1]
            if not (folder / "failure.json").exists():
                return folder
        return self.run.new_launch_dir(task.job.variant)

    def _failed(self, task: _Task, exc: Exception) -> None:
        launch = self._launch_dir(task)
        store.write_new(launch / "failure.json", FailureRecord(
            variant=task.job.variant, repeat=task.job.repeat, failure_kind="internal_error",
            message=f"the Ray task failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}",
            hint="CAMPAIGN_DEBUG=1 on the nodes shows the traceback; please report it", log_tail=""))
        self.progress.note(f"{task.job.variant} r{task.job.repeat + 1}: its Ray task failed; the campaign goes on")

    def _lost(self, name: str, task: _Task, exc: Exception) -> tuple[str, _Task] | None:
        """A task that died with its node (or its worker): recorded, then sent again with what is left."""
        job = task.job
        what = type(exc).__name__
        launch = self._launch_dir(task)
        store.write_new(launch / "failure.json", FailureRecord(
            variant=job.variant, repeat=job.repeat, failure_kind="node_lost",
            message=f"the Ray task of this launch was lost ({what}): its node or worker died mid-launch",
            hint="what it sent before is kept; the launch was sent again with what is left", log_tail=""))
        losses = task.losses + 1
        self.losses.append(f"{job.variant} r{job.repeat + 1}: {what}")
        self.progress.note(f"{job.variant} r{job.repeat + 1}: its Ray task was lost ({what})" + (
            "; sending it again" if losses <= MAX_NODE_LOSSES else "; not sent again (too many losses)"))
        if losses > MAX_NODE_LOSSES:
            return None
        again = f"{name}-again{losses}"
        ref = self._submit(again, job)
        return None if ref is None else (again, _Task(job, ref, losses=losses))

    def _drain(self, tasks: dict[str, _Task]) -> None:
        """Every event the tasks have put on the queue so far: progress lines, and files for the run. A Ctrl-C
        waits until the batch taken off the queue is written: its files are nowhere else (a test that stopped
        the night as a cell's record appeared once found that launch's server.json, from the same batch, lost)."""
        while True:
            with stop_held():
                if not self._drain_batch(tasks):
                    return

    def _drain_batch(self, tasks: dict[str, _Task]) -> bool:
        """One batch of events off the queue, handled; False when there was none."""
        try:
            events = self.queue.get_nowait_batch(self.queue.qsize())
        except Exception:  # noqa: BLE001 - ray.util.queue.Empty, or the queue actor gone with Ctrl-C
            return False
        if not events:
            return False
        for event in events:
            kind = event.get("event")
            if kind == "files":
                task = tasks.get(str(event.get("task")))
                self._write(task, event["files"], str(event.get("task")))
            elif kind == "cell":
                self.progress.cell_done(str(event.get("text")))
            elif kind == "status":
                self.progress.status(str(event.get("text")))
            else:
                self.progress.note(str(event.get("text")))
        return True

    def _write(self, task: _Task | None, files: list[tuple[str, str]], name: str) -> None:
        launches = task.launches if task is not None else self._orphans.setdefault(name, {})
        wanted = [(Path(rel).parts, rel, text) for rel, text in files]  # variants/<variant>/<launch-k|cells|...>
        wanted = [(p, rel, text) for p, rel, text in wanted if len(p) >= 4 and p[0] == "variants"
                  and p[1] != "_baseline"]
        # Every launch folder of the batch is named first: a cell record can arrive beside its launch's first
        # file (sorted, cells/ before launch-k/), and its `launch` must name the controller's folder.
        for parts, _, _ in wanted:
            if parts[2].startswith("launch-") and parts[2] not in launches:
                launches[parts[2]] = self.run.new_launch_dir(parts[1]).name
        for parts, rel, text in wanted:
            if parts[2].startswith("launch-"):
                target = self.run.root.joinpath(parts[0], parts[1], launches[parts[2]], *parts[3:])
            else:
                target = self.run.root.joinpath(*parts)
            try:
                if target.suffix == ".json":
                    data = json.loads(text)
                    if isinstance(data, dict) and isinstance(data.get("launch"), str):
                        data["launch"] = launches.get(data["launch"], data["launch"])
                    text = json.dumps(data, indent=1, sort_keys=False) + "\n"
                store.write_text_new(target, text)
            except (CampaignError, OSError, ValueError) as exc:  # one bad file never ends the night
                self.progress.note(f"warning: {rel} from a Ray task not kept: {exc}")

    def _cancel(self, ray: Any, tasks: dict[str, _Task]) -> None:
        """Ctrl-C: each task stops its server and sends what it has; then they are gone."""
        for task in tasks.values():
            ray.cancel(task.ref, force=False)
        deadline = time.monotonic() + CANCEL_GRACE_S
        refs = [t.ref for t in tasks.values()]
        while refs and time.monotonic() < deadline:
            ready, refs = ray.wait(refs, num_returns=len(refs), timeout=0.5)
            self._drain(tasks)
        self._drain(tasks)

