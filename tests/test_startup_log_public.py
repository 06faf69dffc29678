"""The startup-log parser on logs other people wrote: excerpts pasted in public issue threads (vLLM 0.3 to 0.27,
V0 and V1, TP, PP and DP, ROCm, docker-compose and CI prefixes, every failure kind). Each file's source
(thread, version and how it is known, what was cut) is in fixtures/logs/public/SOURCES.md; the facts each
states are in expected.yaml, which lists only values the log prints: every fact it does not list must come
out as None, never a default."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from campaign.cli import run_cli
from campaign.server import startup_log

PUBLIC = Path(__file__).parent / "fixtures" / "logs" / "public"
EXPECTED: dict[str, dict[str, Any]] = yaml.safe_load((PUBLIC / "expected.yaml").read_text())
FACTS = [f for f in startup_log.StartupFacts.model_fields if f not in {"failure", "max_num_seqs_set"}]


def test_every_fixture_has_expectations_and_a_source() -> None:
    logs = sorted(p.name for p in PUBLIC.glob("*.log"))
    assert logs == sorted(EXPECTED), "every public log needs an expected.yaml entry, and only those"
    sources = (PUBLIC / "SOURCES.md").read_text()
    assert all(f"`{name}`" in sources for name in logs)
    assert len(logs) >= 20


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_public_log(name: str) -> None:
    expected = EXPECTED[name]
    facts = startup_log.parse((PUBLIC / name).read_text(errors="replace"))
    if expected.get("not_vllm"):
        assert not startup_log.is_vllm_log(facts)
        assert facts.failure is None
        return
    assert startup_log.is_vllm_log(facts)
    for field in FACTS:
        want = expected.get(field)
        got = getattr(facts, field)
        if isinstance(want, float):
            assert got == pytest.approx(want), field
        else:
            assert got == (str(want) if field == "vllm_version" and want is not None else want), field
    assert (facts.failure.kind if facts.failure else None) == expected["failure"]


@pytest.mark.parametrize("name, code", [
    ("v0.24.0_v1_non_default_args_true_false_nested.log", 0),  # a clean start
    ("v0.15.0rc1_v1_pp8_models_s_kv_insufficient.log", 3),  # the log shows a failure
    ("not_vllm_compose_unrecognized_arguments.log", 2),  # not a vLLM log
])
def test_parse_log_exit_code_says_what_the_log_shows(name: str, code: int,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["parse-log", str(PUBLIC / name)]) == code
    err = capsys.readouterr().err
    assert ("Error: " in err) == (code == 2) and ("not a vLLM log" in err) == (code == 2)


def test_parse_log_shows_where_the_scheduler_cap_came_from() -> None:
    lines = "\n".join(startup_log.summary(startup_log.parse(
        (PUBLIC / "v0.24.0_v1_non_default_args_true_false_nested.log").read_text())))
    assert "max-num-seqs (scheduler cap)          1 (set by you)" in lines
