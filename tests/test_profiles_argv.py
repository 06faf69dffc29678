"""Launch profiles and argv building: lists never shell strings, path-qualified errors, no secrets in argv."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from campaign.core import secret, vllm_flags
from campaign.core.errors import ConfigError
from campaign.server import argv
from campaign.server.profiles import PROFILES_DIR, load_profile
from campaign.spec.matrix import night_uses


def test_flag_mapping_rules() -> None:
    args = argv.flag_args({
        "max_num_seqs": 64, "enable-prefix-caching": False, "trust-remote-code": True,
        "speculative-config": {"method": "mtp", "num_speculative_tokens": 2}, "gpu-memory-utilization": 0.883643,
        "kv-cache-dtype": None,
    })
    assert args == [
        "--max-num-seqs", "64", "--no-enable-prefix-caching", "--trust-remote-code",
        "--speculative-config", '{"method":"mtp","num_speculative_tokens":2}',
        "--gpu-memory-utilization", "0.883643",
    ]


def test_overrides_replace_whatever_the_spelling() -> None:
    merged = vllm_flags.merge({"max_num_seqs": 256, "dtype": "bfloat16"}, {"max-num-seqs": 64})
    assert merged == {"max-num-seqs": 64, "dtype": "bfloat16"}


def test_a_short_option_is_passed_under_its_long_name_and_replaced_by_it(tmp_path: Path) -> None:
    """vLLM's short options are `-tp`, `-pp`, `-dp`; it knows no `--tp`, so a profile's `tp: 2` was passed as
    `--tp 2` and ended the server, while the plan's checks, which merged aliases, had read it as a width of 2.
    One merge now: the launch passes the long name, and a variant's long name replaces a profile's short one."""
    path = tmp_path / "p.yaml"
    path.write_text("model: m\nflags: {tp: 2, pp: 2}\n")
    spec = argv.build(load_profile(str(path))[0], {"pipeline_parallel_size": 1}, port=8000)
    assert "--tensor-parallel-size" in spec.argv and spec.argv[spec.argv.index("--tensor-parallel-size") + 1] == "2"
    assert "--pipeline-parallel-size" in spec.argv and spec.argv[spec.argv.index("--pipeline-parallel-size") + 1] == "1"
    assert not {"--tp", "--pp"} & set(spec.argv)
    assert spec.flags == {"tensor-parallel-size": 2, "pipeline-parallel-size": 1}
    assert vllm_flags.value_of({"tp": 4}, "tensor-parallel-size") == 4
    assert vllm_flags.value_of({"dtype": "half"}, "tensor-parallel-size") is None


def test_parse_set_reads_yaml_values() -> None:
    assert argv.parse_set(["gpu-memory-utilization=0.95", "enforce_eager=true", "speculative-config={method: mtp}"]
                          ) == {"gpu-memory-utilization": 0.95, "enforce-eager": True,
                                "speculative-config": {"method": "mtp"}}


@pytest.mark.parametrize("name", ["cpu-tiny", "a5000-tp2", "h200"])
def test_shipped_profiles_validate(name: str) -> None:
    profile, path = load_profile(name)
    assert path == PROFILES_DIR / f"{name}.yaml"
    spec = argv.build(profile, port=8123)
    assert isinstance(spec.argv, list) and all(isinstance(a, str) for a in spec.argv)
    assert spec.argv[-4:-2] == ["--host", "127.0.0.1"] or "--host" in spec.argv


def test_h200_profile_is_seed_004s_command() -> None:
    profile, _ = load_profile("h200")
    spec = argv.build(profile, port=8000)
    assert spec.argv[:3] == ["vllm", "serve", "Qwen/Qwen3.5-27B-GPTQ-Int4"]
    joined = " ".join(spec.argv)
    for piece in ["--served-model-name qwen", "--trust-remote-code", "--tensor-parallel-size 1",
                  "--reasoning-parser qwen3", "--enable-auto-tool-choice", "--tool-call-parser qwen3_coder",
                  "--max-model-len 262144", "--gpu-memory-utilization 0.883643"]:
        assert piece in joined
    config = spec.argv[spec.argv.index("--speculative-config") + 1]
    assert json.loads(config) == {"method": "mtp", "num_speculative_tokens": 2}


def test_a5000_profile_pins_two_gpus() -> None:
    profile, _ = load_profile("a5000-tp2")
    spec = argv.build(profile, port=8000)
    assert spec.env_overrides["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert spec.argv[spec.argv.index("--tensor-parallel-size") + 1] == "2"
    assert spec.argv[spec.argv.index("--max-model-len") + 1] == "131072"


def test_cpu_profile_uses_the_api_server_shape() -> None:
    profile, _ = load_profile("cpu-tiny")
    spec = argv.build(profile, port=8000)
    assert spec.argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert spec.argv[3] == "--model"


def test_api_key_travels_in_the_environment_not_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "sk-very-secret")
    profile, _ = load_profile("h200")
    spec = argv.build(profile, port=8000)
    assert "sk-very-secret" not in " ".join(spec.argv)
    assert "--api-key" not in spec.argv
    assert spec.child_env()["VLLM_API_KEY"] == "sk-very-secret"
    assert "sk-very-secret" not in repr(spec)
    assert secret.redact("key=sk-very-secret") == "key=<redacted>"  # the key read is declared secret


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return str(path)


def test_unknown_key_is_named_with_a_suggestion(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_profile(write(tmp_path, "model: m\nstartup_timout_s: 10\n"))
    assert "p.yaml: startup_timout_s: unknown key" in str(caught.value)
    assert "did you mean startup_timeout_s?" in str(caught.value)


def test_misspelt_flag_is_named_with_a_suggestion(tmp_path: Path) -> None:
    from campaign.server import flag_list

    profile, path = load_profile(write(tmp_path, "model: m\nflags:\n  gpu-memory-utilisation: 0.9\n"))
    shipped = flag_list.FlagList(flag_list.shipped(), "the shipped list", authoritative=False)
    with pytest.raises(flag_list.FlagError) as caught:
        flag_list.check(night_uses(profile, path), shipped)
    assert "p.yaml: flags.gpu-memory-utilisation (did you mean gpu-memory-utilization?)" in str(caught.value)


def test_runner_owned_flags_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_profile(write(tmp_path, "model: m\nflags:\n  api-key: abc\n"))
    assert "flags.api-key" in str(caught.value) and "api_key_env" in str(caught.value)


def test_api_key_env_must_be_a_name_not_a_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_profile(write(tmp_path, "model: m\napi_key_env: sk-abc/123\n"))
    assert "api_key_env" in str(caught.value)


def test_missing_model_and_bad_types(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model: required key is missing"):
        load_profile(write(tmp_path, "engine: vllm\n"))
    with pytest.raises(ConfigError, match="port"):
        load_profile(write(tmp_path, "model: m\nport: somewhere\n"))


def test_unknown_profile_name_suggests() -> None:
    with pytest.raises(ConfigError, match="did you mean h200"):
        load_profile("h20")


def test_a_tls_profile_serves_https_and_the_runner_verifies_it(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(
        "model: m\ntls: {certfile: certs/s.pem, keyfile: certs/s.key, ca_bundle: ca.pem}\n")
    profile, _ = load_profile(str(tmp_path / "p.yaml"))
    spec = argv.build(profile, port=8443)
    at = spec.argv.index("--ssl-certfile")
    assert spec.argv[at:at + 4] == ["--ssl-certfile", str(tmp_path / "certs/s.pem"),
                                    "--ssl-keyfile", str(tmp_path / "certs/s.key")]
    assert spec.base_url == "https://127.0.0.1:8443"
    assert spec.endpoint().tls.ca_bundle == tmp_path / "ca.pem"


def test_ssl_flags_belong_to_the_tls_block(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text("model: m\nflags: {ssl-certfile: s.pem}\n")
    with pytest.raises(ConfigError) as caught:
        load_profile(str(tmp_path / "p.yaml"))
    assert "tls:" in (caught.value.hint or "")


def test_an_unknown_key_inside_the_tls_block_lists_its_own_keys(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text("model: m\ntls: {certfile: s.pem, keyfile: s.key, ca_bundel: ca.pem}\n")
    with pytest.raises(ConfigError) as caught:
        load_profile(str(tmp_path / "p.yaml"))
    assert "tls.ca_bundel" in str(caught.value) and caught.value.hint == "did you mean ca_bundle?"
