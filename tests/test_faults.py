"""The fault matrix (docs/faults.md): every mistake a new user makes and every fault a night
meets ends in one `Error:` line with a hint and a documented exit code, or is survived with nothing measured
lost. Through the real command line: a subprocess (`python -m campaign`) wherever a signal or a second process
is the point, else the same entry point in this process (`run_cli`, without an interpreter's start-up for
each command); on the simulator (at 20x) where it suffices."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import json
import os
import signal
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from campaign.cli import run_cli
from campaign.core.errors import EXIT_INTERNAL, EXIT_SOME_FAILED, EXIT_USAGE, LaunchError, ResultFormatError
from campaign.night import launch, orchestrate
from campaign.server import flag_list
from campaign.server.profiles import PROJECT_ROOT, load_profile
from campaign.stored import records, store

SIM_SCALE = "20"   # the simulator 20x faster than its hardware: it keeps up on 2 cores (docs/simulator.md)
SIM_ENV = os.environ | {"CAMPAIGN_SIM_TIME_SCALE": SIM_SCALE}

# A short campaign on the simulator: one variant, one cell, and a sustained `repeat` experiment measured over
# a 5 s window of the hardware's time (a quarter second of wall time at 20x), whose key once differed between
# the plan and the stored result.
REPEAT_MATRIX = """\
schema_version: 1
name: faults
profile: a5000-tp2
baseline: only
variants:
  - name: only
workloads:
  - kind: decode
    mode: fixed
    contexts: [64]
    concurrency: [1]
    max_tokens: 8
  - kind: repeat
    mode: sustained
    context: 64
    concurrency: 2
    max_tokens: 16
    times: 2
repeats: 1
window_s: 5
warmup: false
"""


# The same campaign without its experiment: one launch is one cell.
ONE_CELL = REPEAT_MATRIX.split("  - kind: repeat\n")[0] + "repeats: 1\nwindow_s: 5\nwarmup: false\n"


def campaign(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "campaign", *args], cwd=PROJECT_ROOT, env=env or SIM_ENV,
                          capture_output=True, text=True, timeout=timeout)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The same command line in this process: `run_cli`, what `python -m campaign` runs after it has set up its
    streams and signal handlers (with SIM_ENV's time scale, as `campaign` runs it); for everything but a
    signal or a second process (those are `campaign`'s)."""
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        patch.setenv("CAMPAIGN_SIM_TIME_SCALE", SIM_SCALE)
        code = run_cli(list(args))
    return subprocess.CompletedProcess(["campaign", *args], code, out.getvalue(), err.getvalue())


def one_error(result: subprocess.CompletedProcess[str]) -> str:
    """The stderr of a failed command: its last lines are `Error: ...` and at most a hint; no traceback."""
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in lines if line.startswith("Error: ")]
    assert len(errors) == 1, result.stderr
    assert lines.index(errors[0]) >= len(lines) - 2, result.stderr
    return errors[0]


# --- mistakes: one line, fast --------------------------------------------------------------------------
def test_probe_of_a_closed_port_is_one_line_in_seconds() -> None:
    """`campaign probe` where nothing listens: one error line, exit 1, within seconds."""
    began = time.monotonic()
    result = cli("probe", "http://127.0.0.1:9")
    assert time.monotonic() - began < 15
    assert result.returncode == 1
    assert "cannot reach http://127.0.0.1:9" in one_error(result)


@pytest.mark.parametrize("args, says", [
    (["plan", "demo", "--repeats", "0"], "Invalid value for '--repeats'"),
    (["plan", "demo", "--window", "0"], "Invalid value for '--window': 0: must be more than 0"),
    (["plan", "demo", "--bogus"], "No such option: --bogus"),
    (["run", "demo", "--engine", "gpu"], "Invalid value for '--engine': 'gpu': expected vllm or sim"),
    (["nosuch"], "No such command 'nosuch'"),
    (["plan", "no-such-matrix"], "no matrix named 'no-such-matrix'"),
    (["run", "--resume", "/nonexistent/run"], "not a run directory"),
    (["probe", "http://127.0.0.1:9", "--concurrency", "1,x"], "Invalid value for '--concurrency': 'x' is not a whole"),
])
def test_usage_mistakes_are_one_error_line(args: list[str], says: str) -> None:
    """A bad option, value, command, matrix or run directory: one `Error:` line naming it, a usage exit code."""
    result = cli(*args)
    assert result.returncode in {1, EXIT_USAGE}
    assert says in one_error(result)


def test_version_and_help_without_type_labels() -> None:
    """--version prints the version; every command's --help is plain usage, without typer's type labels."""
    version = cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("vllm-campaign ")
    for command in ("plan", "run", "launch", "probe", "parse-log", "diff", "report", "export"):
        text = cli(command, "--help").stdout
        assert "Usage: campaign" in text and "<bool>" not in text and "<list" not in text, command


@pytest.fixture()
def no_vllm_profile(tmp_path: Path) -> Path:
    text = (PROJECT_ROOT / "launch_profiles" / "cpu-tiny.yaml").read_text()
    path = tmp_path / "novllm.yaml"
    path.write_text(text.replace("executable: .venv-vllm/bin/python", "executable: no-such-vllm-binary"))
    return path


def test_a_missing_vllm_executable_is_a_launch_error_before_the_night(no_vllm_profile: Path,
                                                                      tmp_path: Path) -> None:
    """No vLLM on the PATH: `launch` and `run` stop before starting anything (no run directory), and `plan`
    still works against the shipped flag list."""
    launch = cli("launch", str(no_vllm_profile), "--once")
    assert launch.returncode == LaunchError.exit_code
    assert "'no-such-vllm-binary' is not on the PATH [executable_not_found]" in one_error(launch)
    matrix = tmp_path / "m.yaml"
    matrix.write_text(REPEAT_MATRIX.replace("profile: a5000-tp2", f"profile: {no_vllm_profile.name}"))
    run = cli("run", "--no-report", str(matrix), "--out", str(tmp_path / "runs"), "--plain")
    assert run.returncode == LaunchError.exit_code
    assert "executable_not_found" in one_error(run)
    assert not (tmp_path / "runs").exists()  # refused before a run directory was made
    # Planning the night elsewhere (a laptop without vLLM) is allowed, against the shipped flag list.
    plan = cli("plan", str(matrix))
    assert plan.returncode == 0, plan.stderr
    assert "on profile novllm" in plan.stdout and "the list shipped with vllm-campaign" in plan.stdout


def test_an_unexpected_error_in_one_launch_is_recorded_and_the_night_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Any other exception inside one launch is recorded as its failure (internal_error) and the night goes on
    to the next; a resume once the cause is gone measures everything, and nothing is said to have failed."""
    from campaign.core.progress import Progress
    from campaign.spec.matrix import load_matrix

    path = tmp_path / "m.yaml"
    path.write_text(ONE_CELL.replace("  - name: only\n", "  - name: only\n  - name: other\n"))
    matrix, _, _ = load_matrix(str(path))
    profile, _ = load_profile("a5000-tp2")
    run = store.RunDir.create(tmp_path, "faults")
    store.write_new(run.manifest_path, orchestrate.manifest(matrix, path, profile, Path("a5000-tp2.yaml"),
                                                            launch.Options(engine="sim")))

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug in one launch")

    monkeypatch.setattr(launch, "launched", boom)
    with Progress(total_cells=1, estimate_s=1.0, live=False) as progress:
        launch.Campaign(run, matrix, profile, options=launch.Options(engine="sim"),
                             progress=progress).execute()
    failures = run.failures()
    assert {f.variant for f in failures} == {"only", "other"}  # every launch was tried: the night went on
    assert all(f.failure_kind == "internal_error" and "RuntimeError: a bug in one launch" in f.message
               for f in failures)
    # Resumed once the cause is gone: everything is measured, and nothing is said to have failed any more.
    monkeypatch.undo()
    monkeypatch.setenv("CAMPAIGN_SIM_TIME_SCALE", SIM_SCALE)
    with orchestrate.resumed(run.root, engine=None, more_repeats=None) as night:
        assert night.unfinished() == ["only r1 (internal_error)", "other r1 (internal_error)",
                                      "only r2 (internal_error)"]  # the last is the drift sentinel
        with Progress(total_cells=2, estimate_s=1.0, live=False) as progress:
            night.execute(progress)
        assert night.unfinished() == []


def test_a_cell_that_finished_after_a_lost_interrupt_is_not_stored(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool worker's Ctrl-C once raised inside its client's event loop and got lost there; the cell went on
    and stored a connect timeout as a failure, which a resume then kept. A stop asked for during a cell now
    drops the cell and stops the launch, and the server is stopped and recorded."""
    from campaign.core import errors
    from campaign.core.progress import Progress
    from campaign.measure.runner import Measurer
    from campaign.spec.matrix import load_matrix

    path = tmp_path / "m.yaml"
    path.write_text(REPEAT_MATRIX)
    matrix, _, _ = load_matrix(str(path))
    profile, _ = load_profile("a5000-tp2")
    run = store.RunDir.create(tmp_path, "faults")
    store.write_new(run.manifest_path, orchestrate.manifest(matrix, path, profile, Path("a5000-tp2.yaml"),
                                                            launch.Options(engine="sim")))
    monkeypatch.setenv("CAMPAIGN_SIM_TIME_SCALE", SIM_SCALE)
    measure = Measurer.run_cell

    async def interrupted(self: Measurer, spec: object) -> object:
        result = await measure(self, spec)  # type: ignore[arg-type]
        monkeypatch.setattr(errors, "_stop_requested", True)  # the handler ran; its raise never arrived
        return result

    monkeypatch.setattr(Measurer, "run_cell", interrupted)
    with Progress(total_cells=1, estimate_s=1.0, live=False) as progress, pytest.raises(KeyboardInterrupt):
        launch.Campaign(run, matrix, profile, options=launch.Options(engine="sim"),
                             progress=progress).execute()
    assert run.cells() == []
    assert len(list(run.root.glob("variants/*/launch-*/stop.json"))) == 1


# --- flags: checked before the night, every occurrence --------------------------------------------------
def test_unknown_flags_are_all_reported_before_the_night(tmp_path: Path) -> None:
    """Every unknown flag of a matrix, with its place and a did-you-mean, in one line, before anything starts."""
    matrix = tmp_path / "m.yaml"
    matrix.write_text(REPEAT_MATRIX.replace("  - name: only\n", (
        "  - name: only\n    flags: {mem-fraction: 0.95}\n"
        "  - name: two\n    flags: {mem-fraction: 0.9, max-num-seq: 8}\n")))
    for args in (["plan", str(matrix), "--engine", "sim"],
                 ["run", str(matrix), "--engine", "sim", "--out", str(tmp_path / "runs")]):
        result = cli(*args)
        assert result.returncode == EXIT_USAGE
        line = one_error(result)
        assert line.startswith("Error: 3 unknown flags: "), line
        assert "variants[0].flags.mem-fraction" in line and "variants[1].flags.mem-fraction" in line
        assert "variants[1].flags.max-num-seq (did you mean max-num-seqs?)" in line
        assert "hint: checked against the simulator's own parser" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_launch_set_is_checked_against_the_server_before_it_starts() -> None:
    """`launch --set` is checked against the server's flags (with a did-you-mean), and a flag the runner owns
    is refused, both before the server starts."""
    result = cli("launch", "a5000-tp2", "--engine", "sim", "--once", "--set", "gpu-memory-utilisation=0.95")
    assert result.returncode == EXIT_USAGE
    assert "--set.gpu-memory-utilisation (did you mean gpu-memory-utilization?)" in one_error(result)
    owned = cli("launch", "a5000-tp2", "--engine", "sim", "--once", "--set", "port=9000")
    assert "this flag is owned by the runner" in one_error(owned)


HELP = """usage: vllm serve [-h] [--gpu-memory-utilization GPU_MEMORY_UTILIZATION]
options:
  -h, --help            show this help message and exit
  --gpu-memory-utilization GPU_MEMORY_UTILIZATION, --device-memory-utilization GPU_MEMORY_UTILIZATION
                        The fraction of GPU memory to be used. See also
                        --max-num-seqs, which is named here in prose only.
  --enable-prefix-caching, --no-enable-prefix-caching
""" + "".join(f"  --flag-{i} FLAG_{i}\n" for i in range(30))


def test_the_flag_list_is_read_from_the_servers_own_help_once_per_version(tmp_path: Path) -> None:
    """The flag list is parsed from the server's own `--help=all` (aliases and --no- forms included, names in
    prose not), and asked once per executable and version (cached)."""
    exe = tmp_path / "vllm"
    exe.write_text("#!/usr/bin/python3\n")
    exe.chmod(0o755)
    calls: list[list[str]] = []

    def fake(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        out = "0.99.0\n" if argv[1] == "-c" else HELP
        return subprocess.CompletedProcess(argv, 0, out, "")

    profile = load_profile("a5000-tp2")[0].model_copy(update={"executable": str(exe)})
    first = flag_list.for_profile(profile, cache=tmp_path / "cache", run=fake)
    assert first.authoritative and "vLLM 0.99.0" in first.source
    assert {"gpu-memory-utilization", "device-memory-utilization", "no-enable-prefix-caching"} <= first.names
    assert "max-num-seqs" not in first.names  # named in prose, not an option of this (fake) server
    asked = [c for c in calls if c[-1] == "--help=all"]
    assert asked == [[str(exe), "serve", "--help=all"]]
    again = flag_list.for_profile(profile, cache=tmp_path / "cache", run=fake)
    assert again.names == first.names and "cached" in again.source
    assert len([c for c in calls if c[-1] == "--help=all"]) == 1  # the same version is not asked twice


@pytest.mark.vllm
@pytest.mark.one_process   # `vllm serve --help=all`: one busy process, no server
def test_the_real_cpu_builds_flag_list(tmp_path: Path) -> None:
    """The real CPU build's own flag list, read fresh from its --help=all: authoritative, naming its version,
    with what the shipped list lacks (an alias) and everything the shipped list has."""
    profile, _ = load_profile("cpu-tiny")
    flags = flag_list.for_profile(profile, cache=tmp_path)
    assert flags.authoritative and "vLLM 0.32.0" in flags.source
    # Its own list has what the shipped one lacks (an alias), and everything the shipped one has.
    assert "device-memory-utilization" in flags.names
    assert flag_list.shipped() <= {n.removeprefix("no-") for n in flags.names} | flags.names


# --- resume: never refuses a run it wrote ----------------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("faults")
    (folder / "m.yaml").write_text(REPEAT_MATRIX)
    result = cli("run", "--no-report", str(folder / "m.yaml"), "--engine", "sim", "--out", str(folder / "runs"),
                 "--plain")
    assert result.returncode == 0, result.stderr[-3000:]
    return next((folder / "runs" / "faults").glob("*"))


def _copy(run: Path, tmp_path: Path) -> Path:
    import shutil

    target = tmp_path / "runs" / "faults" / run.name
    shutil.copytree(run, target)
    return target


def test_resuming_a_finished_run_is_a_no_op(finished_run: Path, tmp_path: Path) -> None:
    """Resuming a finished run says it is complete and launches and rewrites nothing (the sustained repeat
    experiment is found under the key it was planned with)."""
    run = _copy(finished_run, tmp_path)
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*.json"))
    assert "variants/only/experiments/repeat-decode-sustained-L64-C2-N16-W5/rep-0.json" in before
    result = cli("run", "--no-report", "--resume", str(run), "--engine", "sim", "--plain")
    assert result.returncode == 0, result.stderr
    assert "is complete: nothing left to measure" in result.stderr
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*.json")) == before
    assert len(list(run.glob("variants/only/launch-*"))) == 1


def test_a_damaged_result_is_kept_aside_and_measured_again(finished_run: Path, tmp_path: Path) -> None:
    """A truncated result file: reading commands skip it with a warning; a resume keeps it aside, renamed, and
    measures the cell again."""
    run = _copy(finished_run, tmp_path)
    cell = next(run.glob("variants/only/cells/*/rep-0.json"))
    cell.write_text(cell.read_text()[:200])  # truncated, as by a crash or a full disk
    export = cli("export", str(run), "--format", "csv")
    assert export.returncode == 0, export.stderr
    assert f"warning: skipped {cell}: damaged, not valid JSON" in export.stderr
    result = cli("run", "--no-report", "--resume", str(run), "--engine", "sim", "--plain")
    assert result.returncode == 0, result.stderr
    assert f"{cell} was damaged (not valid JSON): kept as rep-0.json.damaged" in result.stderr
    assert json.loads(cell.read_text())["result"]["status"] == "Valid"  # measured again
    assert cell.with_name("rep-0.json.damaged").read_text().startswith("{")  # and the damaged one kept
    assert len(list(run.glob("variants/only/launch-*"))) == 2


def test_a_newer_format_is_refused_with_a_hint(finished_run: Path, tmp_path: Path) -> None:
    """A result file from a newer vllm-campaign is refused with one error line and a hint to upgrade."""
    run = _copy(finished_run, tmp_path)
    cell = next(run.glob("variants/only/cells/*/rep-0.json"))
    data = json.loads(cell.read_text())
    cell.write_text(json.dumps(data | {"schema_version": records.SCHEMA_VERSION + 1}))
    result = cli("export", str(run))
    assert result.returncode == ResultFormatError.exit_code
    assert "newer than this vllm-campaign understands" in one_error(result)
    assert "hint: upgrade vllm-campaign" in result.stderr


def test_two_writers_of_one_run_are_refused(finished_run: Path, tmp_path: Path) -> None:
    """A second writer of a run directory is refused, naming the holder's pid; the lock goes with its holder."""
    run = _copy(finished_run, tmp_path)
    with store.RunDir(run).writer():
        result = campaign("run", "--no-report", "--resume", str(run), "--engine", "sim", "--plain")
    assert result.returncode == 1
    assert f"{run} is being written by another campaign process (pid {os.getpid()})" in one_error(result)
    # The lock is gone with its holder: the next resume runs.
    assert cli("run", "--no-report", "--resume", str(run), "--engine", "sim", "--plain").returncode == 0


def test_a_full_disk_is_a_clear_error_and_leaves_nothing_half_written(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk while writing: a clear error with the resume hint, and no partial or temporary file."""
    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(ResultFormatError) as caught:
        store.write_new(tmp_path / "cell.json", {"kind": "cell"})
    assert str(caught.value.message) == f"cannot write {tmp_path / 'cell.json'}: No space left on device"
    assert "campaign run --resume" in str(caught.value.hint)
    assert list(tmp_path.iterdir()) == []  # no partial file, no temporary file


# --- plan ----------------------------------------------------------------------------------------------
def test_plan_names_the_profile_and_what_every_experiment_costs(finished_run: Path) -> None:
    """`plan` names the profile and estimates every experiment (the context-window probe: minutes)."""
    result = cli("plan", "a5000-tuning")
    assert result.returncode == 0, result.stderr
    assert "on profile a5000-tp2 (vllm, serving qwen)" in result.stdout
    # The context-window probe sends two prompts of the 131,072-token window: at a guessed 1,000 tok/s, minutes.
    row = next(line for line in result.stdout.splitlines() if line.startswith("context-window"))
    assert int(row.split()[-2].replace(",", "")) > 260


def test_plan_after_a_run_sets_each_launch_beside_its_estimate(finished_run: Path) -> None:
    """`plan` after a run takes its rates from that run and sets each launch's estimate beside its actual time."""
    result = cli("plan", str(finished_run.parent.parent.parent / "m.yaml"), "--engine", "sim",
                 "--out", str(finished_run.parent.parent))
    assert result.returncode == 0, result.stderr
    assert "rates: " in result.stdout and f"measured in {finished_run}" in result.stdout
    assert f"The last run ({finished_run.name}): each launch, estimated and actual" in result.stdout


def test_exit_codes_are_distinct() -> None:
    """Every documented exit code is distinct."""
    assert len({1, EXIT_USAGE, LaunchError.exit_code, ResultFormatError.exit_code, EXIT_SOME_FAILED,
                EXIT_INTERNAL}) == 6


@contextmanager
def controller_until(matrix: Path, out: Path, log: Path, until: Callable[[], object], *args: str,
                     env: dict[str, str] | None = None, within_s: float = 120, what: str = "a stored cell"
                     ) -> Iterator[subprocess.Popen[bytes]]:
    """`campaign run MATRIX` in the background, handed over once `until()` holds (polled, with a deadline);
    never left running. Its stderr goes to `log` (a pipe nobody reads could stall it)."""
    with log.open("wb") as err:
        controller = subprocess.Popen([sys.executable, "-m", "campaign", "run", "--no-report", str(matrix), *args,
                                       "--out", str(out),
                                       "--plain"], cwd=PROJECT_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + within_s
        while not until():
            assert controller.poll() is None, f"the campaign ended before {what}: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"no {what} within {within_s:g} s"
            time.sleep(0.02)
        yield controller
    finally:
        if controller.poll() is None:
            controller.kill()
            controller.wait(timeout=30)


def a_stored_cell(out: Path) -> Callable[[], bool]:
    return lambda: bool(list(out.glob("*/*/variants/only/cells/*/rep-0.json")))


def sigkill_takes_the_tree(controller: subprocess.Popen[bytes], *, at_least: int) -> None:
    """SIGKILL: no handler runs, no teardown; every process under the controller must still be gone in 5 s.
    The controller is frozen first (SIGSTOP), so the tree read is the tree killed, mid-campaign."""
    import psutil

    controller.send_signal(signal.SIGSTOP)
    tree = psutil.Process(controller.pid).children(recursive=True)
    assert len(tree) >= at_least, tree
    controller.kill()
    controller.wait(timeout=10)
    _, alive = psutil.wait_procs(tree, timeout=5)
    assert not alive, f"server processes outlived the controller: {alive}"


# Four cells and the experiment: a campaign still running when its first cell is stored.
LONGER = REPEAT_MATRIX.replace("concurrency: [1]\n    max_tokens: 8", "concurrency: [1, 2, 4, 8]\n    max_tokens: 128")


def test_sigkill_of_the_controller_takes_the_server_with_it_and_resume_loses_nothing(tmp_path: Path) -> None:
    """The controller killed outright (SIGKILL, no handler) mid-campaign: the simulated server, its child,
    dies with it (the parent-death signal); `--resume` measures the rest without redoing a stored result."""
    matrix = tmp_path / "m.yaml"
    matrix.write_text(LONGER)
    out = tmp_path / "runs"
    with controller_until(matrix, out, tmp_path / "err.log", a_stored_cell(out), "--engine", "sim",
                          env=SIM_ENV) as controller:
        sigkill_takes_the_tree(controller, at_least=1)  # the simulated server is the controller's child
    run = next(out.glob("faults/*"))
    stored = {p: p.stat().st_ino for p in run.glob("variants/*/cells/*/rep-*.json")}
    assert stored
    result = cli("run", "--no-report", "--resume", str(run), "--engine", "sim", "--plain")
    assert result.returncode == 0, result.stderr[-3000:]
    assert all(p.stat().st_ino == inode for p, inode in stored.items())  # nothing finished was redone
    assert len(list(run.glob("variants/*/cells/*/rep-0.json"))) == 4
    assert len(list(run.glob("variants/*/experiments/*/rep-0.json"))) == 1


def test_sigterm_to_the_controller_stops_the_server_cleanly_and_keeps_every_cell(tmp_path: Path) -> None:
    """SIGTERM (a job scheduler's stop) mid-campaign unwinds like Ctrl-C: exit 130 with the resume hint, the
    server stopped and its stop recorded, every finished cell kept."""
    import psutil

    matrix = tmp_path / "m.yaml"
    matrix.write_text(LONGER)
    out = tmp_path / "runs"
    log = tmp_path / "err.log"
    with controller_until(matrix, out, log, a_stored_cell(out), "--engine", "sim", env=SIM_ENV) as controller:
        servers = psutil.Process(controller.pid).children(recursive=True)
        controller.send_signal(signal.SIGTERM)  # a job scheduler's stop: unwinds like Ctrl-C
        controller.wait(timeout=60)
    stderr = log.read_text()
    assert controller.returncode == 130, stderr
    assert "campaign run --resume" in stderr
    assert not [p for p in servers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    run = next(out.glob("faults/*"))
    stop = store.RunDir(run).stop("variants/only/launch-1")
    assert stop is not None and stop.mode in {"sigint", "sigterm", "already_exited"}  # stopped, and recorded
    assert list(run.glob("variants/only/cells/*/rep-0.json"))


def test_a_long_answer_reaches_a_pipe_read_late_whole_even_unbuffered(tmp_path: Path) -> None:
    """Seen in CI: with PYTHONUNBUFFERED=1 (CI's and many containers' setting) stdout's text layer sits on
    the file descriptor and drops the rest of a short write, and after uvloop had run the kernel returned
    one: `probe --json` to a pipe read late arrived cut at exactly 64 KiB, exit 0. The entry point gives
    stdout a buffered layer, which writes on after a short write."""
    script = ("import asyncio, sys\nfrom campaign.core import aio, console\nconsole.buffered_stdio()\n"
              "aio.run(asyncio.sleep(0.05))\nsys.stdout.write('x' * 300_000 + '\\n')\n")
    child = subprocess.Popen([sys.executable, "-c", script], cwd=PROJECT_ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    # The reader is late: nothing is read until the pipe is full and the writer waits on it, as under a loaded
    # CI box (the pipe's own count says when, rather than a guessed sleep).
    assert child.stdout is not None
    capacity = fcntl.fcntl(child.stdout.fileno(), 1032)   # F_GETPIPE_SZ: 64 KiB unless the system says otherwise
    deadline = time.monotonic() + 60
    while unread(child.stdout.fileno()) < capacity:
        assert child.poll() is None and time.monotonic() < deadline, "the writer never filled the pipe"
        time.sleep(0.01)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert len(out) == 300_001


def unread(fd: int) -> int:
    """Bytes waiting in a pipe (FIONREAD)."""
    count = bytearray(4)
    fcntl.ioctl(fd, termios.FIONREAD, count)
    return int.from_bytes(count, sys.byteorder)
