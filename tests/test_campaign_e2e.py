"""A whole campaign against the real CPU build: a variant that cannot start, Ctrl-C mid-campaign, resume,
the diff at the end, and no API key or token (passed through by reference) in any file, log line or console
output. The campaign's verdicts (an Invalid cell above max-num-seqs, the recommendation, the drift line) are
also checked in simulated time, on the same campaign with a third variant, in seconds."""

from __future__ import annotations

import contextlib
import io
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil
import pytest

from campaign.server.profiles import PROJECT_ROOT

SECRET = "sk-e2e-" + secrets.token_hex(12)
# Issue 37: a Hugging Face token passed through the profile's env and vLLM's --hf-token, both by reference.
HF_TOKENS = {"CAMPAIGN_E2E_HF_TOKEN": "hf_e2eEnv" + secrets.token_hex(12),
             "CAMPAIGN_E2E_HF_FLAG": "hf_e2eFlag" + secrets.token_hex(12)}
MARKERS = [SECRET, *HF_TOKENS.values()]
FIXTURES = Path(__file__).parent / "fixtures" / "matrices"
MATRIX = FIXTURES / "vllmtest-e2e.yaml"
SIM_MATRIX = FIXTURES / "vllmtest-e2e-sim.yaml"

T = TypeVar("T")


def wait_for(predicate: Callable[[], T | None], timeout_s: float, what: str, every_s: float = 0.5,
             alive: subprocess.Popen[str] | None = None) -> T:
    """Poll until `predicate` gives something true (a deadline, never a fixed sleep); fail at once if the
    process `alive` names has ended meanwhile."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if alive is not None and alive.poll() is not None:
            raise AssertionError(f"the campaign ended (exit {alive.returncode}) before {what}")
        time.sleep(every_s)
    raise AssertionError(f"timed out waiting for {what}")


def port_of(server_json: Path) -> int:
    command = json.loads(server_json.read_text())["command"]
    return int(command[command.index("--port") + 1])


def campaign(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "campaign", *args], cwd=PROJECT_ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`campaign ARGS` through the command line's own entry point (`run_cli`), in this process."""
    from campaign.cli import run_cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run_cli(list(args))
    return subprocess.CompletedProcess(["campaign", *args], code, out.getvalue(), err.getvalue())


@pytest.mark.vllm
@pytest.mark.vllm
@pytest.mark.cpu_heavy
def test_campaign_survives_a_broken_variant_ctrl_c_and_resume(tmp_path: Path) -> None:
    """`campaign run` on the real build (plain http, behind an API key): Ctrl-C while the baseline's server is
    measuring (its warm check) stops that server cleanly, keeps every finished cell and drops the measurement
    in flight; the resume launches only what is unfinished: the variant vLLM refuses, which is recorded as a
    bad_argument failure while the night goes on, and the drift sentinel. The exit code, the console, the
    export and the diff read the run, and no key or token reaches a file or the console. Three launches (two
    of them served) where the demo matrix has six: tests/fixtures/matrices/vllmtest-e2e.yaml."""
    env = os.environ | {"CAMPAIGN_E2E_KEY": SECRET, "PYTHONUNBUFFERED": "1", **HF_TOKENS}
    out = tmp_path / "runs"
    first = subprocess.Popen(
        [sys.executable, "-m", "campaign", "run", str(MATRIX), "--out", str(out), "--plain"], cwd=PROJECT_ROOT,
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run_dir = wait_for(lambda: next(iter((out / "vllmtest-e2e").glob("*")), None), 60, "the run directory",
                           alive=first)
        launch = run_dir / "variants/baseline/launch-1"
        cells = run_dir / "variants/baseline/cells"
        # Both cells stored: the launch is now measuring its first cell again (the warm check: at least 2 s
        # of replies). Freeze the controller (not the server) so that the checks below cannot outlast it on a
        # loaded machine, and Ctrl-C lands while the server is being measured.
        wait_for(lambda: len(list(cells.glob("*/rep-0.json"))) == 2, 600, "the baseline's two cells",
                 every_s=0.02, alive=first)
        first.send_signal(signal.SIGSTOP)
        assert not (launch / "stop.json").exists(), "the launch ended before Ctrl-C could land in it"
        port = port_of(launch / "server.json")
        # The server runs behind the key: /v1 refuses without it, /metrics stays open.
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code == 401
        assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).status_code == 200
        first.send_signal(signal.SIGINT)  # Ctrl-C, delivered as the controller resumes
        first.send_signal(signal.SIGCONT)
        stdout1, stderr1 = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGCONT)
            first.kill()
            first.communicate(timeout=30)
    assert first.returncode == 130, stderr1
    assert "campaign run --resume" in stderr1
    # Ctrl-C stopped the server cleanly, and recorded it: nothing listens on its port, nothing of it runs.
    assert not any(c.laddr and c.laddr.port == port for c in psutil.net_connections("tcp") if c.status == "LISTEN")
    stop = json.loads((launch / "stop.json").read_text())
    assert stop["port_free"] and stop["mode"] in {"sigint", "sigterm"}, stop
    # Every finished cell is kept; the warm check in flight at Ctrl-C is not stored; nothing later started.
    stored = {p: p.stat().st_ino for p in run_dir.glob("variants/*/cells/*/rep-*.json")}
    # (Where the Ctrl-C's raise is swallowed inside the client's event loop, the stop flag still ends the
    # check unstored: test_a_ctrl_c_that_uvloop_swallows_in_the_warm_check_stores_no_guard below. The
    # controller's stderr says where the interrupt landed: "Fatal error on transport" is uvloop's swallowing.)
    assert len(stored) == 2 and all("/baseline/" in str(p) for p in stored), stderr1[-3000:]
    assert not list(cells.glob("*/guard-*.json")), stderr1[-3000:]
    assert not (run_dir / "variants/broken").exists()

    second = campaign("run", "--resume", str(run_dir), "--plain", env=env, timeout=900)
    assert second.returncode == 6, second.stderr  # finished, but a launch failed: the exit code says so
    assert "finished, but not everything: broken r1 (bad_argument)" in second.stderr
    failure = json.loads((run_dir / "variants/broken/launch-1/failure.json").read_text())
    assert failure["failure_kind"] == "bad_argument"
    assert "no-such-dtype" in failure["message"] + failure["log_tail"]
    after = {p: p.stat().st_ino for p in run_dir.glob("variants/*/cells/*/rep-*.json")}
    assert all(after[p] == inode for p, inode in stored.items())  # nothing measured was redone or rewritten
    # Only servers with unfinished cells were launched again: not the baseline's first round, whose cells
    # were all stored; its second launch is the drift sentinel, after the failed variant (the night went on).
    assert sorted(p.name for p in (run_dir / "variants/baseline").glob("launch-*")) == ["launch-1", "launch-2"]
    assert json.loads((run_dir / "variants/baseline/launch-2/server.json").read_text())["repeat"] == 1  # sentinel
    assert len(after) == 4  # 2 cells x 2 baseline launches

    # Every launch that measured was warmed up first (recorded with the launch, never as a cell), and its
    # first cell was measured again at its end (the warm check): the sentinel's, since the first one's was cut.
    warmups = [json.loads(p.read_text()) for p in run_dir.glob("variants/*/launch-*/warmup.json")]
    assert len(warmups) == 2 and all(w["requests"] >= 2 and w["seconds"] > 0 for w in warmups)
    guards = [json.loads(p.read_text()) for p in run_dir.glob("variants/baseline/cells/*/guard-*.json")]
    assert {g["repeat"] for g in guards} == {1}
    assert (run_dir / "summary.json").exists()
    assert "FAILED TO START (bad_argument)" in second.stdout
    assert "drift:" in second.stdout

    export = campaign("export", str(run_dir), "--format", "csv", env=env)
    assert export.returncode == 0, export.stderr
    assert len(export.stdout.splitlines()) == 1 + 2 * 2  # header + 2 cells x 2 baseline launches
    diff = campaign("diff", str(run_dir), env=env)
    assert diff.returncode == 0, diff.stderr

    # The tokens went in (vLLM's own line names its flag, value hidden) and are stored as references.
    assert "'hf_token': '***'" in (launch / "server.log").read_text()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["profile"]["raw"]["env"]["HF_TOKEN"] == "${CAMPAIGN_E2E_HF_TOKEN}"
    # The key and the tokens never reached a file, a log or the console.
    for path in run_dir.rglob("*"):
        if path.is_file():
            text = path.read_text(errors="replace")
            assert not [m for m in MARKERS if m in text], path
    for text in (stdout1, stderr1, second.stdout, second.stderr, export.stdout, export.stderr, diff.stdout,
                 diff.stderr):
        assert not [m for m in MARKERS if m in text]


def test_the_e2e_campaigns_verdicts_in_simulated_time(tmp_path: Path) -> None:
    """The end-to-end campaign with a third variant, replayed in simulated time (no server, seconds): the
    variant that cannot start is recorded and the night goes on (exit 6, FAILED TO START); a variant whose
    max-num-seqs (2) is below the cell's concurrency (4) has that cell Invalid, saying so, and the
    recommendation names its flag change; the drift sentinel gives the drift line; export and diff read it.
    In this process, through the command line's own entry point (no server, no signal to handle)."""
    result = cli("run", str(SIM_MATRIX), "--engine", "sim", "--clock", "virtual", "--out", str(tmp_path), "--plain")
    assert result.returncode == 6, result.stderr[-3000:]
    assert "finished, but not everything: broken r1 (bad_argument)" in result.stderr
    run_dir = next((tmp_path / "vllmtest-e2e-sim").iterdir())
    failure = json.loads((run_dir / "variants/broken/launch-1/failure.json").read_text())
    assert failure["failure_kind"] == "bad_argument" and "no-such-dtype" in failure["message"]
    two_seqs = [json.loads(p.read_text())["result"]
                for p in run_dir.glob("variants/two-seqs/cells/decode-*/rep-0.json")]
    assert len(two_seqs) == 1 and two_seqs[0]["status"] == "Invalid"
    assert any("exceed max-num-seqs 2" in r for r in two_seqs[0]["reasons"])
    assert "recommendation: max-num-seqs 256 -> 2" in result.stdout
    assert "FAILED TO START (bad_argument)" in result.stdout
    assert "drift:" in result.stdout
    assert sorted(p.name for p in (run_dir / "variants/baseline").glob("launch-*")) == ["launch-1", "launch-2"]
    export = cli("export", str(run_dir), "--format", "csv")
    assert export.returncode == 0, export.stderr
    assert len(export.stdout.splitlines()) == 1 + 2 * 3  # header + 2 cells x (baseline x2, two-seqs)
    diff = cli("diff", str(run_dir))
    assert diff.returncode == 0, diff.stderr
    assert "max-num-seqs: 256 -> 2" in diff.stdout


# The real-build test's campaign on the simulator (20x), for its Ctrl-C: a fixed decode cell (the one the warm
# check measures again) and a prefill cell, one launch.
WARM_CHECK_MATRIX = """\
schema_version: 1
name: warm-check
profile: a5000-tp2
baseline: baseline
variants:
  - name: baseline
workloads:
  - kind: decode
    mode: fixed
    contexts: [64]
    concurrency: [1]
    max_tokens: 8
  - kind: prefill
    contexts: [128]
repeats: 1
warmup: false
"""


def warm_check_run(tmp_path: Path, name: str) -> tuple[Any, Any, Any]:
    """WARM_CHECK_MATRIX on the simulated A5000 pair: its matrix, its profile and a new run directory with
    its manifest, for a test that drives one launch itself."""
    from campaign.night import launch, orchestrate
    from campaign.server.profiles import load_profile
    from campaign.spec.matrix import load_matrix
    from campaign.stored import store

    path = tmp_path / "m.yaml"
    path.write_text(WARM_CHECK_MATRIX)
    matrix, _, _ = load_matrix(str(path))
    profile, _ = load_profile("a5000-tp2")
    run = store.RunDir.create(tmp_path, name)
    store.write_new(run.manifest_path, orchestrate.manifest(matrix, path, profile, Path("a5000-tp2.yaml"),
                                                            launch.Options(engine="sim")))
    return matrix, profile, run


def test_a_ctrl_c_that_uvloop_swallows_in_the_warm_check_stores_no_guard(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 50: the real-build test above once failed. Its Ctrl-C lands while the warm check streams, and where
    the handler's KeyboardInterrupt is raised inside a transport's data_received (the controller was frozen
    mid-read, or the read was the first Python code to run after SIGCONT), uvloop catches it, logs "Fatal error
    on transport" and closes that connection: the raise never arrives (4 of 12 such Ctrl-Cs on the simulator
    here). The check then ended with a failed request and was stored as guard-0.json, which that test forbids,
    before the stop flag stopped the night at the next launch. Here the interrupt is raised exactly there, by
    the handler itself, on the first bytes the warm check reads: the stop still takes effect at the check's
    end, nothing of the check is stored, and the server's stop is recorded."""
    from campaign.core import aio, errors
    from campaign.core.progress import Progress
    from campaign.http import streamclient
    from campaign.measure.runner import Measurer
    from campaign.night import launch

    matrix, profile, run = warm_check_run(tmp_path, "warm-check")
    monkeypatch.setenv("CAMPAIGN_SIM_TIME_SCALE", "20")
    monkeypatch.setattr(errors, "_stop_requested", False)   # put back after the test, whatever the handler set
    measured: list[str] = []   # each run_cell: "returned" or "raised"
    armed: list[bool] = []
    run_cell, data_received = Measurer.run_cell, streamclient._Connection.data_received

    async def counted(self: Measurer, spec: object) -> object:
        if len(measured) == 2:     # the two cells are stored: this is the warm check
            armed.append(True)
        try:
            result = await run_cell(self, spec)  # type: ignore[arg-type]
        except KeyboardInterrupt:
            measured.append("raised")
            raise
        measured.append("returned")
        return result

    def ctrl_c_mid_read(self: streamclient._Connection, data: bytes) -> None:
        if armed and armed.pop():
            errors.request_stop()   # the SIGINT handler, run where the main thread is: inside this callback
        data_received(self, data)

    monkeypatch.setattr(Measurer, "run_cell", counted)
    monkeypatch.setattr(streamclient._Connection, "data_received", ctrl_c_mid_read)
    with Progress(total_cells=2, estimate_s=1.0, live=False) as progress, pytest.raises(KeyboardInterrupt):
        launch.Campaign(run, matrix, profile, options=launch.Options(engine="sim"), progress=progress).execute()
    assert len(measured) == 3 and not armed
    if aio.loop_name() == "uvloop":
        assert measured[2] == "returned"   # the raise was swallowed: the check ran to its end all the same
    assert len(run.cells()) == 2
    assert not list(run.root.glob("variants/*/cells/*/guard-*.json"))
    stops = list(run.root.glob("variants/*/launch-*/stop.json"))
    assert len(stops) == 1 and json.loads(stops[0].read_text())["port_free"]


def test_a_ctrl_c_between_a_servers_readiness_and_its_record_stores_both(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 50, under two CPU hogs: `test_ctrl_c_on_a_pool_stops_every_server_and_a_resume_finishes` found a
    launch with a stop record and no server record. The Ctrl-C had come after the server was ready and before
    its record was written, so what the server became (its startup facts, a measurement) was lost while its
    stop was kept. Here the interrupt lands exactly there: the server is still recorded, with the time it was
    ready, before its stop; no cell is."""
    from campaign.core.progress import Progress
    from campaign.night import launch

    matrix, profile, run = warm_check_run(tmp_path, "ready-then-ctrl-c")
    monkeypatch.setenv("CAMPAIGN_SIM_TIME_SCALE", "20")

    @contextlib.contextmanager
    def ctrl_c_once_ready(self: launch.Campaign) -> object:
        raise KeyboardInterrupt
        yield

    monkeypatch.setattr(launch.Campaign, "_client_pinned", ctrl_c_once_ready)
    with Progress(total_cells=2, estimate_s=1.0, live=False) as progress, pytest.raises(KeyboardInterrupt):
        launch.Campaign(run, matrix, profile, options=launch.Options(engine="sim"), progress=progress).execute()
    (launch_dir,) = run.root.glob("variants/baseline/launch-*")
    server, stop = (json.loads((launch_dir / name).read_text()) for name in ("server.json", "stop.json"))
    assert server["facts"]["kv_cache_tokens"] and server["ready_s"] > 0
    assert server["started_utc"] <= stop["stopped_utc"] and stop["port_free"]
    assert run.cells() == []
