"""Matrix files: validation with file/key/suggestion, grid expansion, interleaved schedule, shipped matrices."""

from __future__ import annotations

from pathlib import Path

import pytest

from campaign.core.errors import ConfigError
from campaign.server import flag_list
from campaign.server.profiles import load_profile
from campaign.spec.matrix import load_matrix, night_uses, schedule

BASE = """
name: t
profile: cpu-tiny
baseline: a
variants:
  - name: a
  - name: b
    flags: {max-num-seqs: 8}
workloads:
  - kind: decode
    contexts: [512]
    concurrency: [1, 2]
"""


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "m.yaml"
    path.write_text(text)
    return str(path)


def test_misspelt_flag_in_a_variant(tmp_path: Path) -> None:
    text = BASE.replace("    flags: {max-num-seqs: 8}", "    flags: {max-num-seqs: 8}\n  - name: c\n    flags: {}\n"
                        "  - name: d\n    flags: {gpu-memory-utilisation: 0.95}")
    matrix, path, _ = load_matrix(write(tmp_path, text))  # loads: the launched server's list judges flags
    profile, profile_path = load_profile("cpu-tiny")
    shipped = flag_list.FlagList(flag_list.shipped(), "the shipped list", authoritative=False)
    with pytest.raises(flag_list.FlagError) as caught:
        flag_list.check(night_uses(profile, profile_path, matrix, path), shipped)
    assert str(caught.value) == (f"1 unknown flag: {tmp_path / 'm.yaml'}: variants[3].flags.gpu-memory-utilisation "
                                 "(did you mean gpu-memory-utilization?)\nhint: checked against the shipped list")


def test_unknown_top_level_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"m.yaml: repeat: unknown key\nhint: did you mean repeats\?"):
        load_matrix(write(tmp_path, BASE + "repeat: 3\n"))


def test_unknown_workload_key_and_kind(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"workloads\[0\].concurency: unknown key\nhint: did you mean concurrency"):
        load_matrix(write(tmp_path, BASE.replace("concurrency: [1, 2]", "concurency: [1, 2]")))
    with pytest.raises(ConfigError, match=r"workloads\[0\].kind: unknown workload kind 'decod'"):
        load_matrix(write(tmp_path, BASE.replace("kind: decode", "kind: decod")))


def test_baseline_must_be_a_variant(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="baseline 'aa' is not a variant; did you mean a"):
        load_matrix(write(tmp_path, BASE.replace("baseline: a", "baseline: aa")))


def test_suggested_only_for_memory_utilisation(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="only gpu-memory-utilization can be `suggested`"):
        load_matrix(write(tmp_path, BASE.replace("{max-num-seqs: 8}", "{max-num-seqs: suggested}")))
    text = BASE.replace("{max-num-seqs: 8}", "{gpu-memory-utilization: suggested}")
    matrix, _, _ = load_matrix(write(tmp_path, text))
    assert matrix.variants[1].flags["gpu-memory-utilization"] == "suggested"


def test_grid_expands_into_named_variants(tmp_path: Path) -> None:
    text = BASE + "grid:\n  max-num-batched-tokens: [512, 2048]\n  enable-prefix-caching: [true, false]\n"
    matrix, _, _ = load_matrix(write(tmp_path, text))
    names = [v.name for v in matrix.all_variants()]
    assert names[:2] == ["a", "b"]
    assert "max-num-batched-tokens=512,enable-prefix-caching=True" in names
    assert len(names) == 6


def test_token_counts_accept_k_suffix(tmp_path: Path) -> None:
    matrix, _, _ = load_matrix(write(tmp_path, BASE.replace("contexts: [512]", "contexts: [8k, 6616]")))
    assert [c.context_tokens for c in matrix.cells()][:1] == [8192]
    assert {c.context_tokens for c in matrix.cells()} == {8192, 6616}


def test_schedule_interleaves_and_ends_on_the_baseline() -> None:
    matrix, _, _ = load_matrix("a5000-tuning")
    order = schedule(matrix)
    assert order[:6] == [("baseline", 0), ("memory", 0), ("batch", 0), ("batch", 1), ("memory", 1), ("baseline", 1)]
    assert order[-1] == ("baseline", 3)  # three repeats end on "batch": a drift sentinel is added
    demo, _, _ = load_matrix("demo")
    assert schedule(demo)[-1] == ("baseline", 1)  # two repeats already end on the baseline


def test_shipped_matrices_reproduce_the_seeds() -> None:
    a5000, _, _ = load_matrix("a5000-tuning")
    flags = {v.name: v.flags for v in a5000.all_variants()}
    assert flags == {
        "baseline": {"gpu-memory-utilization": 0.90, "max-num-batched-tokens": 2048},
        "memory": {"gpu-memory-utilization": 0.95, "max-num-batched-tokens": 2048},
        "batch": {"gpu-memory-utilization": 0.95, "max-num-batched-tokens": 8192},
    }
    decode = [c for c in a5000.cells() if c.phase == "decode"]
    assert [c.concurrency for c in decode] == [1, 2, 4, 8, 16, 32, 64]
    assert {c.max_tokens for c in decode} == {256}
    h200, _, _ = load_matrix("h200-speed-matrix")
    assert len([c for c in h200.cells() if c.phase == "decode"]) == 6 * 8
    assert a5000.profile == "a5000-tp2" and h200.profile == "h200"


def test_speed_floors_are_configurable(tmp_path: Path) -> None:
    matrix, _, _ = load_matrix(write(tmp_path, BASE + "floors: [25, 12.5]\n"))
    assert matrix.floors == [25.0, 12.5]
    default, _, _ = load_matrix(write(tmp_path, BASE))
    assert default.floors == [40.0, 30.0, 20.0]


def test_timeouts_of_the_measured_path_are_set_in_the_matrix(tmp_path: Path) -> None:
    matrix, _, _ = load_matrix(write(tmp_path, BASE + "timeouts: {connect_s: 3, idle_s: 45}\n"))
    assert (matrix.timeouts.connect_s, matrix.timeouts.first_byte_s, matrix.timeouts.idle_s) == (3, 300, 45)
    with pytest.raises(ConfigError) as caught:
        load_matrix(write(tmp_path, BASE + "timeouts: {idle: 45}\n"))
    assert "timeouts.idle" in str(caught.value) and "idle_s" in (caught.value.hint or "")


@pytest.mark.parametrize("value, margin", [("suggested", 0.01), ("suggested-0.02", 0.02), ("suggested-0", 0.0),
                                           (0.95, None), ("suggest", None)])
def test_suggested_takes_a_margin(value: object, margin: float | None) -> None:
    from campaign.spec.matrix import suggested_margin

    assert suggested_margin(value) == margin


def test_a_malformed_suggested_value_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not understood"):
        load_matrix(write(tmp_path, BASE.replace("{max-num-seqs: 8}", "{gpu-memory-utilization: suggested-two}")))


def test_h200_speed_matrix_measures_ttft_warm_like_seed_004() -> None:
    matrix, _, _ = load_matrix("h200-speed-matrix")
    decode = [c for c in matrix.cells() if c.phase == "decode"]
    assert decode and all(c.ttft == "warm" and c.key.endswith("-Twarm") for c in decode)
    default, _, _ = load_matrix("a5000-tuning")
    assert all(c.ttft == "cold" for c in default.cells())


def test_aa_adds_an_exact_copy_of_the_baseline_interleaved_like_any_variant(tmp_path: Path) -> None:
    text = BASE.replace("  - name: a\n", "  - name: a\n    flags: {gpu-memory-utilization: 0.9}\n")
    text += "aa: true\nrepeats: 2\n"
    matrix, _, _ = load_matrix(write(tmp_path, text))
    copy = next(v for v in matrix.all_variants() if v.name == "a-aa")
    assert copy.flags == {"gpu-memory-utilization": 0.9} and "A/A" in copy.description
    assert schedule(matrix) == [("a", 0), ("b", 0), ("a-aa", 0), ("a-aa", 1), ("b", 1), ("a", 1)]
    off, _, _ = load_matrix(write(tmp_path, BASE))
    assert "a-aa" not in [v.name for v in off.all_variants()]
    clash = text.replace("  - name: b\n", "  - name: a-aa\n  - name: b\n")
    with pytest.raises(ConfigError, match="variant name 'a-aa' appears twice"):
        load_matrix(write(tmp_path, clash))
