"""A whole campaign against the real CPU build: a variant that cannot start, Ctrl-C mid-campaign, resume,
the diff at the end, and no API key or token (passed through by reference) in any file, log line or console
output."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from campaign.server.profiles import PROJECT_ROOT

pytestmark = pytest.mark.vllm

SECRET = "sk-e2e-" + secrets.token_hex(12)
# Issue 37: a Hugging Face token passed through the profile's env and vLLM's --hf-token, both by reference.
HF_TOKENS = {"CAMPAIGN_E2E_HF_TOKEN": "hf_e2eEnv" + secrets.token_hex(12),
             "CAMPAIGN_E2E_HF_FLAG": "hf_e2eFlag" + secrets.token_hex(12)}
MARKERS = [SECRET, *HF_TOKENS.values()]
MATRIX = "tests/fixtures/matrices/e2e.yaml"


def wait_for(predicate, timeout_s: float, what: str, every_s: float = 0.5):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out waiting for {what}")


def port_of(server_json: Path) -> int:
    command = json.loads(server_json.read_text())["command"]
    return int(command[command.index("--port") + 1])


def test_campaign_survives_a_broken_variant_ctrl_c_and_resume(tmp_path: Path) -> None:
    env = os.environ | {"CAMPAIGN_E2E_KEY": SECRET, "PYTHONUNBUFFERED": "1", **HF_TOKENS}
    out = tmp_path / "runs"
    first = subprocess.Popen(
        [sys.executable, "-m", "campaign", "run", MATRIX, "--out", str(out), "--plain"], cwd=PROJECT_ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run_dir = wait_for(lambda: next(iter((out / "e2e").glob("*")), None), 60, "the run directory")
        server_json = run_dir / "variants/two-seqs/launch-1/server.json"
        wait_for(server_json.exists, 600, "the third variant's server to be ready", every_s=0.02)
        # Its cells take about 3 s: freeze the controller (not the server) so that the checks below cannot
        # outlast them on a loaded machine, and Ctrl-C lands while the variant is being measured.
        first.send_signal(signal.SIGSTOP)
        port = port_of(server_json)
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
    assert first.returncode == 130, stderr1
    assert "campaign run --resume" in stderr1
    # Ctrl-C stopped the server cleanly: nothing listens on its port, nothing of it runs.
    assert not any(c.laddr and c.laddr.port == port for c in psutil.net_connections("tcp") if c.status == "LISTEN")
    assert (run_dir / "variants/two-seqs/launch-1/stop.json").exists()

    stored = {p: p.stat().st_ino for p in run_dir.glob("variants/*/cells/*/rep-*.json")}
    assert len([p for p in stored if "/baseline/" in str(p)]) == 2
    failure = json.loads((run_dir / "variants/broken/launch-1/failure.json").read_text())
    assert failure["failure_kind"] == "bad_argument"
    assert "no-such-dtype" in failure["message"] + failure["log_tail"]

    second = subprocess.run(
        [sys.executable, "-m", "campaign", "run", "--resume", str(run_dir), "--plain"], cwd=PROJECT_ROOT, env=env,
        capture_output=True, text=True, timeout=900)
    assert second.returncode == 6, second.stderr  # finished, but a launch failed: the exit code says so
    assert "finished, but not everything: broken r1 (bad_argument)" in second.stderr
    after = {p: p.stat().st_ino for p in run_dir.glob("variants/*/cells/*/rep-*.json")}
    assert all(after[p] == inode for p, inode in stored.items())  # nothing measured was redone or rewritten
    # Only servers with unfinished cells were launched again: not the baseline's first round.
    assert sorted(p.name for p in (run_dir / "variants/baseline").glob("launch-*")) == ["launch-1", "launch-2"]
    assert json.loads((run_dir / "variants/baseline/launch-2/server.json").read_text())["repeat"] == 1  # sentinel
    assert len(list(run_dir.glob("variants/two-seqs/launch-*"))) == 2

    two_seqs = [json.loads(p.read_text())["result"]
                for p in run_dir.glob("variants/two-seqs/cells/decode-*/rep-0.json")]
    assert two_seqs[0]["status"] == "Invalid"
    assert any("exceed max-num-seqs 2" in r for r in two_seqs[0]["reasons"])
    # Every launch that measured was warmed up first (recorded with the launch, never as a cell), and its
    # first cell was measured again at its end (the warm check).
    warmups = [json.loads(p.read_text()) for p in run_dir.glob("variants/*/launch-*/warmup.json")]
    assert len(warmups) >= 3 and all(w["requests"] >= 2 and w["seconds"] > 0 for w in warmups)
    guards = [json.loads(p.read_text()) for p in run_dir.glob("variants/baseline/cells/*/guard-*.json")]
    assert {g["repeat"] for g in guards} == {0, 1}
    assert (run_dir / "summary.json").exists()
    assert "recommendation: max-num-seqs 64 -> 2" in second.stdout
    assert "FAILED TO START (bad_argument)" in second.stdout
    assert "drift:" in second.stdout

    export = subprocess.run([sys.executable, "-m", "campaign", "export", str(run_dir), "--format", "csv"],
                            cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, check=True)
    assert len(export.stdout.splitlines()) == 1 + 2 * 3  # header + 2 cells x (baseline x2, two-seqs)
    diff = subprocess.run([sys.executable, "-m", "campaign", "diff", str(run_dir)], cwd=PROJECT_ROOT, env=env,
                          capture_output=True, text=True, check=True)

    # The tokens went in (vLLM's own line names its flag, value hidden) and are stored as references.
    assert "'hf_token': '***'" in (run_dir / "variants/baseline/launch-1/server.log").read_text()
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
