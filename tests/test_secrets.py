"""Issue 37: no secret in anything the tool writes or prints. The rule (campaign/core/secret.py), the inputs that
are refused before any launch (each one `Error:` line that does not repeat the value), and a canary campaign:
a distinct marker through every way a secret comes in, a simulated night on a local Ray cluster with a launch
that fails, then diff, report and export; every file, console line and Ray log is searched for every marker.
The real CPU build's launch with a token passed through is test_campaign_e2e's."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

# At collection, not inside the test: importing ray sets RAY_CLIENT_MODE in this process's environment.
from ray.cluster_utils import Cluster

from campaign.cli import run_cli
from campaign.core import secret
from campaign.core.vllm_flags import KNOWN_FLAGS
from campaign.server import argv
from campaign.server.profiles import PROJECT_ROOT, LaunchProfile
from campaign.stored import store


def marker(what: str) -> str:
    return f"canary{what}{secrets.token_hex(8)}"


# --- the rule ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "says_secret"), [
    ("hf-token", True), ("api-key", True), ("HF_TOKEN", True), ("VLLM_API_KEY", True),
    ("AWS_SECRET_ACCESS_KEY", True), ("s3_secret_access_key", True), ("authToken", True), ("APIKey", True),
    ("client_secret", True), ("DB_PASSWORD", True), ("hftoken", True),
    # Counts, paths and switches whose names carry the same words are not secrets by name.
    ("long-prefill-token-threshold", False), ("max-num-batched-tokens", False), ("tokenizer", False),
    ("ssl-keyfile", False), ("return-tokens-as-token-ids", False), ("kv-cache-dtype", False),
    ("VLLM_CPU_KVCACHE_SPACE", False),
])
def test_a_name_says_whether_its_value_is_secret(name: str, says_secret: bool) -> None:
    assert secret.is_secret_name(name) is says_secret


def test_inline_secrets_are_found_where_they_are_written_and_references_are_not() -> None:
    assert list(secret.inline("flags.hf-token", "hf_abcdef")) == ["flags.hf-token"]
    assert list(secret.inline("flags.hf-token", "${HF_TOKEN}")) == []
    assert list(secret.inline("flags.hf-token", True)) == []           # use the token of `huggingface-cli login`
    assert list(secret.inline("flags.allow-credentials", True)) == []  # a CORS switch, not a credential
    assert list(secret.inline("env.HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")) == []
    nested = {"extra": {"auth_token": "abc"}, "urls": [1, "http://u:pw@host:9"], "ok": "http://u:${PW}@h"}
    assert list(secret.inline("flags.x", nested)) == ["flags.x.extra.auth_token", "flags.x.urls[1]"]
    # A JSON object written as a string is read as one.
    assert list(secret.inline("flags.x", '{"s3_secret_access_key": "zz"}')) == ["flags.x.s3_secret_access_key"]
    assert list(secret.inline("env.HTTPS_PROXY", "http://me:hunter22@proxy:3128")) == ["env.HTTPS_PROXY"]


def test_a_reference_is_expanded_and_declared_and_an_unset_one_is_named() -> None:
    value = marker("Expand")
    expanded = secret.expand({"s3": "${CANARY_X}", "n": 3, "l": ["Bearer ${CANARY_X}"]}, {"CANARY_X": value})
    assert expanded == {"s3": value, "n": 3, "l": [f"Bearer {value}"]}
    assert secret.redact(f"got {value}.") == "got <redacted>."
    with pytest.raises(secret.UnsetReferenceError) as caught:
        secret.expand("${CANARY_NOT_SET}", {})
    assert caught.value.names == ["CANARY_NOT_SET"]
    # A setting brought in by reference (a number) is not worth garbling every line that holds it.
    secret.expand("${CANARY_N}", {"CANARY_N": "2"})
    assert secret.redact("max-num-seqs 2") == "max-num-seqs 2"


def test_references_stay_in_the_argv_and_are_expanded_only_for_the_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    value = 'q"' + marker("Spawn")   # a quote: expanded inside a JSON flag, it must stay JSON
    monkeypatch.setenv("CANARY_Q", value)
    profile = LaunchProfile(model="m", engine="sim", hardware="h200-nvl", model_shape="qwen3.5-27b-gptq-int4",
                            env={"HF_TOKEN": "${CANARY_Q}"},
                            flags={"model-loader-extra-config": {"s3_secret_access_key": "${CANARY_Q}"}})
    spec = argv.build(profile, port=8000)
    assert value not in " ".join(spec.argv) + " ".join(spec.redacted_argv())
    spawned = spec.spawn_argv()
    extra = spawned[spawned.index("--model-loader-extra-config") + 1]
    assert json.loads(extra) == {"s3_secret_access_key": value}
    assert spec.child_env()["HF_TOKEN"] == value
    assert value.strip() not in secret.redact(" ".join(spawned))


def test_redaction_covers_the_forms_a_value_is_written_in(tmp_path: Path) -> None:
    value = 'ab"c<d>' + secrets.token_hex(4)
    secret.declare(value)
    assert secret.REDACTED in secret.redact(json.dumps({"x": value}))
    assert secret.redact(f"<td>{__import__('html').escape(value)}</td>") == "<td><redacted></td>"
    assert secret.redact("GET http://user:pw1234@host/x failed") == "GET http://user:<redacted>@host/x failed"
    # A short secret that collides with JSON's own characters still leaves a valid record.
    secret.declare("1")
    path = store.write_new(tmp_path / "r.json", {"count": 1, "note": "took 1 s", "why": value})
    assert json.loads(path.read_text())["note"] == "took <redacted> s"
    assert json.loads(path.read_text())["count"] == 1


def test_the_environments_own_credentials_are_redacted_but_placeholders_are_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    token = marker("Ambient")
    monkeypatch.setenv("SOME_SERVICE_TOKEN", token)
    monkeypatch.setenv("OPENAI_API_KEY", "EMPTY")   # the OpenAI client's placeholder for a server without a key
    assert secret.redact(f"{token} EMPTY") == "<redacted> EMPTY"


# --- refused before any launch, without repeating the value ----------------------------------------------------
PROFILE = """\
schema_version: 1
engine: sim
model: Qwen/Qwen3.5-27B-GPTQ-Int4
served_model_name: qwen
hardware: h200-nvl
model_shape: qwen3.5-27b-gptq-int4
api_key_env: CANARY_KEY
flags:
  max-model-len: 8192
"""


def matrix_text(profile: Path, variant_flags: str = "{}", extra: str = "") -> str:
    return f"""\
schema_version: 1
name: canary
profile: {profile}
baseline: base
variants:
  - name: base
  - name: other
    flags: {variant_flags}
workloads:
  - kind: decode
    mode: fixed
    contexts: [256]
    concurrency: [2]
    max_tokens: 8
repeats: 1
warmup: false
{extra}"""


def refused(capsys: pytest.CaptureFixture[str], args: list[str], value: str) -> str:
    """The command ends in exit 2 with one `Error:` line and a hint on how to pass a secret, and the value is
    nowhere in what it printed. Returns the error line."""
    code = run_cli(args)
    out, err = capsys.readouterr()
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, err
    assert err.splitlines()[-1].startswith("hint: ") and "environment variable" in err.splitlines()[-1]
    assert value not in out + err
    return errors[0]


def secret_flags() -> list[str]:
    """The flags of vLLM 0.32 whose names say they carry a secret (a switch such as allow-credentials aside)."""
    return sorted(f for f in KNOWN_FLAGS if secret.is_secret_name(f) and f != "allow-credentials")


def test_vllms_secret_flags_are_the_ones_the_rule_names() -> None:
    assert secret_flags() == ["api-key", "hf-token"]


@pytest.mark.parametrize("flag", secret_flags())
def test_a_secret_flag_written_inline_in_a_matrix_is_one_line_that_does_not_show_it(
        flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    value = marker("Inline")
    profile = tmp_path / "p.yaml"
    profile.write_text(PROFILE)
    matrix = tmp_path / "m.yaml"
    matrix.write_text(matrix_text(profile, f"{{{flag}: {value}}}"))
    line = refused(capsys, ["plan", str(matrix)], value)
    assert f"{matrix}: variants[1].flags.{flag}:" in line


def test_inline_secrets_in_a_profile_its_env_and_a_json_flag_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    token, s3, proxy, auth = marker("Env"), marker("Json"), marker("Proxy"), marker("JsonToken")
    profile = tmp_path / "p.yaml"
    profile.write_text(PROFILE + f"env:\n  HF_TOKEN: {token}\n")
    matrix = tmp_path / "m.yaml"
    matrix.write_text(matrix_text(profile))
    line = refused(capsys, ["plan", str(matrix)], token)
    assert f"{profile}: env.HF_TOKEN: a secret written inline" in line
    profile.write_text(PROFILE.replace("flags:\n", f"flags:\n  model-loader-extra-config: "
                                                   f"{{s3_secret_access_key: {s3}, token: {auth}}}\n")
                       + f"env:\n  HTTPS_PROXY: http://me:{proxy}@proxy:3128\n")
    line = refused(capsys, ["plan", str(matrix)], s3)
    assert "3 problems" in line and "env.HTTPS_PROXY: a secret written inline" in line
    assert "flags.model-loader-extra-config.s3_secret_access_key" in line
    assert "flags.model-loader-extra-config.token" in line
    assert proxy not in line and auth not in line


def test_a_secret_in_set_and_in_a_probe_url_are_refused_without_showing_them(
        capsys: pytest.CaptureFixture[str]) -> None:
    value = marker("Set")
    line = refused(capsys, ["launch", "h200", "--engine", "sim", "--set", f"hf-token={value}"], value)
    assert "--set.hf-token: a secret written inline" in line
    password = marker("Url")
    code = run_cli(["probe", f"http://user:{password}@127.0.0.1:9/"])
    out, err = capsys.readouterr()
    assert code == 1 and password not in out + err
    assert "Error: http://user:***@127.0.0.1:9/: credentials in the URL would reach logs" in err


def test_an_unset_reference_is_an_error_before_the_night(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CANARY_UNSET", raising=False)
    profile = tmp_path / "p.yaml"
    profile.write_text(PROFILE + "env:\n  HF_TOKEN: ${CANARY_UNSET}\n")
    matrix = tmp_path / "m.yaml"
    matrix.write_text(matrix_text(profile))
    assert run_cli(["run", str(matrix), "--out", str(tmp_path / "runs"), "--plain"]) == 2
    assert "env.HF_TOKEN: refers to ${CANARY_UNSET}, which is not set" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


# --- the canary night ------------------------------------------------------------------------------------------
@pytest.mark.cpu_heavy
def test_canary_night_on_ray_with_a_failed_launch_leaves_no_marker_anywhere(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    values = {"CANARY_KEY": marker("Key") + "\n",    # a key file read with $(cat ...): its line end too
              "CANARY_HF": marker("HfEnv"), "CANARY_HF_FLAG": marker("HfFlag"), "CANARY_S3": marker("S3"),
              "CANARY_URL_PW": marker("UrlPw")}
    for name, value in values.items():
        monkeypatch.setenv(name, value)   # before the cluster starts: its workers launch the servers
    markers = [v.strip() for v in values.values()]
    profile = tmp_path / "p.yaml"
    profile.write_text(PROFILE.replace("flags:\n", """flags:
  hf-token: ${CANARY_HF_FLAG}
  model-loader-extra-config:
    s3_secret_access_key: ${CANARY_S3}
    s3_endpoint: http://canary:${CANARY_URL_PW}@127.0.0.1:9
""") + "env:\n  HF_TOKEN: ${CANARY_HF}\n")
    matrix = tmp_path / "m.yaml"
    # `other` cannot start (the simulator's out-of-memory fault): its failure record carries the log's tail.
    matrix.write_text(matrix_text(profile, "{fault: start-oom}"))
    out = tmp_path / "runs"
    env = os.environ | {"CAMPAIGN_SIM_TIME_SCALE": "5"}
    console: list[str] = []

    def campaign(*args: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([sys.executable, "-m", "campaign", *args], cwd=PROJECT_ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
        console.extend([done.stdout, done.stderr])
        return done

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 1})
    try:
        night = campaign("run", str(matrix), "--out", str(out), "--plain", "--executor", "ray",
                         "--ray-address", cluster.address)
        ray_logs = Path(cluster.head_node.get_session_dir_path()) / "logs"
    finally:
        cluster.shutdown()
    assert night.returncode == 6, night.stderr[-3000:]   # finished, but a launch failed
    run_dir = next((out / "canary").glob("*"))
    run = store.RunDir(run_dir)
    assert [f.failure_kind for f in run.failures()] == ["out_of_memory"]
    assert run.cells() and all(c.result.status == "Valid" for c in run.cells() if c.variant == "base")
    for args in (["diff", str(run_dir)], ["report", str(run_dir)], ["export", str(run_dir), "--format", "csv"],
                 ["export", str(run_dir), "--format", "json", "--out", str(run_dir / "export.json")]):
        assert campaign(*args).returncode == 0, console[-1]
    # The values went in (the server's own line quoted them, and the log was scrubbed) ...
    logs = [p.read_text() for p in run_dir.rglob("server.log")]
    assert any("'s3_secret_access_key': '<redacted>'" in text for text in logs), logs[0][:3000]
    # ... and what is stored is the references.
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["profile"]["raw"]["env"] == {"HF_TOKEN": "${CANARY_HF}"}
    assert manifest["profile"]["raw"]["flags"]["hf-token"] == "${CANARY_HF_FLAG}"
    ray_files = [p for p in ray_logs.rglob("*") if p.is_file()]
    assert any(p.name.startswith("worker-") for p in ray_files), ray_logs   # the tasks' own logs are searched
    files = [p for p in [*run_dir.rglob("*"), *ray_files] if p.is_file()]
    for path in files:
        text = path.read_bytes().decode(errors="replace")
        assert not [m for m in markers if m in text], path
    for text in console:
        assert not [m for m in markers if m in text], text[-2000:]
