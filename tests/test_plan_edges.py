"""What a real night still tripped on at plan time (issue 50): an estimate that counted a cell the plan itself
skips, an over-wide launch blamed on the variant when `--set` made it wide, and a window stretched past the
model's with VLLM_ALLOW_LONG_MAX_MODEL_LEN let through without a word.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fakes import builders

from campaign.cli import run_cli
from campaign.core.errors import ConfigError
from campaign.night import limits, planning, store
from campaign.night.matrix import load_matrix
from campaign.server.profiles import PROJECT_ROOT, load_profile

WIDTHS = """
name: widths
profile: a5000-tp2
baseline: a
variants:
  - name: a
  - name: b
    flags: {max-num-seqs: 8}
workloads:
  - kind: decode
    contexts: [512]
    concurrency: [1]
"""


# --- E: a width --set gave is named as --set's ---------------------------------------------------------------
@pytest.mark.parametrize("overrides, key", [({"tensor-parallel-size": 4}, "tensor-parallel-size"),
                                           ({"dp": 2}, "dp")])
def test_a_width_that_set_gave_names_launch_set_and_its_key(tmp_path: Path, overrides: dict[str, int],
                                                             key: str) -> None:
    """The simulated A5000 pair has two cards and the profile's tensor parallel size is 2: `--set` of a wider
    tensor size, or of a data parallel size that doubles it, is refused naming `launch --set` and the key as it
    was written, not the profile or a variant that never set it."""
    path = tmp_path / "m.yaml"
    path.write_text(WIDTHS)
    matrix, matrix_path, _ = load_matrix(str(path))
    profile, profile_path = load_profile("a5000-tp2")
    with pytest.raises(ConfigError) as caught:
        limits.check_widths(profile, profile_path, matrix, matrix_path, overrides)
    assert (caught.value.path, caught.value.key) == ("launch --set", key)
    assert str(caught.value).startswith(f"launch --set: {key}: a needs 4 GPUs (tensor x pipeline x data parallel "
                                        "size); the profile's hardware a5000x2 has 2")
    # Without a matrix (campaign launch --set), the same.
    with pytest.raises(ConfigError, match=rf"^launch --set: {key}: the profile needs 4 GPUs"):
        limits.check_widths(profile, profile_path, None, None, overrides)


def test_a_width_a_variant_or_the_profile_gave_is_named_where_it_was_written(tmp_path: Path) -> None:
    """A --set of a size that does not widen (pipeline 1) leaves the blame where the width was written: the
    variant that set it, or the profile for a variant that inherits it."""
    path = tmp_path / "m.yaml"
    path.write_text(WIDTHS.replace("{max-num-seqs: 8}", "{tensor-parallel-size: 4}"))
    matrix, matrix_path, _ = load_matrix(str(path))
    profile, profile_path = load_profile("a5000-tp2")
    with pytest.raises(ConfigError) as caught:
        limits.check_widths(profile, profile_path, matrix, matrix_path, {"pipeline-parallel-size": 1})
    assert (caught.value.path, caught.value.key) == (str(matrix_path), "variants[1].flags")
    wide = profile.model_copy(update={"flags": {**profile.flags, "tensor-parallel-size": 4}})
    path.write_text(WIDTHS)
    matrix, matrix_path, _ = load_matrix(str(path))
    with pytest.raises(ConfigError) as caught:
        limits.check_widths(wide, profile_path, matrix, matrix_path)
    assert (caught.value.path, caught.value.key) == (str(profile_path), "flags")


# --- A: the estimate leaves out what the plan says will be skipped ------------------------------------------
BILLION = """
name: t
profile: h200
baseline: a
variants:
  - name: a
  - name: b
    flags: {gpu-memory-utilization: 0.8}
repeats: 2
warmup: false
workloads:
  - {kind: decode, mode: fixed, contexts: [1024], concurrency: CONCURRENCY, max_tokens: 64}
"""


def _last_run(out: Path) -> None:
    """A last run of campaign t: variant a's server had 500,000 tokens of KV cache, b's 50,000 (16-token blocks):
    a 1,088-token sequence a stream, so b seats 45 streams at once and a 459."""
    run = store.RunDir.create(out, "t")
    builders.manifest(run, baseline="a", variants=["a", "b"])
    for variant, kv in (("a", 500_000), ("b", 50_000)):
        builders.server(run.new_launch_dir(variant), variant=variant,
                        facts={"kv_cache_tokens": kv, "block_size": 16})


def _plan(tmp_path: Path, concurrency: str) -> tuple[planning.Plan, Path]:
    path = tmp_path / f"t{len(concurrency)}.yaml"
    path.write_text(BILLION.replace("CONCURRENCY", concurrency))
    matrix, _, _ = load_matrix(str(path))
    profile, _ = load_profile("h200")
    return planning.make_plan(matrix, profile, store.latest_run(tmp_path / "runs", "t")), path


def test_the_estimate_leaves_out_the_cells_each_variant_will_skip(tmp_path: Path) -> None:
    """The issue's case: a billion streams, listed as over capacity, were estimated at about 9.1 million seconds
    a launch. Left out, the estimate is the one of the same matrix without that cell; and each variant's launches
    leave out their own skipped cells (b's smaller cache skips 64 streams as well)."""
    _last_run(tmp_path / "runs")
    plan, _ = _plan(tmp_path, "[1, 64, 1000000000]")
    without, _ = _plan(tmp_path, "[1, 64]")
    one, sixty_four, billion = (c.key for c in plan.cells)
    assert {v.name: v.skipped for v in plan.variants} == {"a": [billion], "b": [sixty_four, billion]}
    assert plan.estimate.total_s == pytest.approx(without.estimate.total_s)
    assert plan.estimate.total_s < 24 * 3600
    est = plan.estimate
    assert est.variant_launch_s("a") - est.variant_launch_s("b") == pytest.approx(
        planning.cell_s(plan.cells[1], est.rates))
    # The schedule's four launches (a b b a), each at its variant's figure.
    assert [name for name, _ in plan.launches] == ["a", "b", "b", "a"]
    assert est.total_s == pytest.approx(2 * est.variant_launch_s("a") + 2 * est.variant_launch_s("b"))
    assert est.to_json()["not_run"] == {"a": {billion: "over capacity at its KV cache of 500,000 tokens"},
                                        "b": {sixty_four: "over capacity at its KV cache of 50,000 tokens",
                                              billion: "over capacity at its KV cache of 50,000 tokens"}}


def test_the_estimate_leaves_out_a_cell_past_the_window() -> None:
    """A cell whose prompt and reply pass the launch's max-model-len is not sent (the runner's over-window
    check): the estimate leaves it out too, by the flag's window, else the last run's."""
    matrix, _, _ = load_matrix(str(PROJECT_ROOT / "matrices" / "demo.yaml"))
    profile, _ = load_profile(matrix.profile)
    cells = matrix.cells()
    longest = max(cells, key=limits.reach)
    facts = planning.StartupFacts(max_model_len=limits.reach(longest) - 1)
    assert planning.not_run(cells, facts, None) == {}
    assert list(planning.not_run(cells, facts, facts.max_model_len)) == [
        c.key for c in cells if limits.reach(c) == limits.reach(longest)]
    assert planning.window_of(profile, {"max-model-len": 4096}, facts) == 4096
    assert planning.window_of(profile.model_copy(update={"flags": {}}), {}, facts) == facts.max_model_len


def test_the_plan_says_what_its_estimate_leaves_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`campaign plan` lists the billion streams as skipped, estimates without them, and says so."""
    _last_run(tmp_path / "runs")
    plan, path = _plan(tmp_path, "[1, 64, 1000000000]")
    capsys.readouterr()
    assert run_cli(["plan", str(path), "--out", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    billion = plan.cells[2].key
    said = [line for line in out.splitlines() if line.startswith("not in the estimate: ")]
    assert len(said) == 2 and said[0].startswith("not in the estimate: a's launches (2, ")
    assert said[0].endswith(f"each) will not run {billion} (over capacity at its KV cache of 500,000 tokens)")
    assert "9,124" not in out and "estimated duration: " in out


# --- F: a window stretched past the model's is said --------------------------------------------------------
STRETCHED = """
name: s
profile: PROFILE
baseline: a
variants:
  - name: a
  - name: long
    flags: {max-model-len: 300000}
warmup: false
workloads:
  - {kind: prefill, contexts: [8192, 270000, 299999, 400000]}
"""


def _stretched(tmp_path: Path, allow: str | None) -> tuple[Path, Path]:
    profile = tmp_path / "h200-long.yaml"
    text = (PROJECT_ROOT / "launch_profiles" / "h200.yaml").read_text()
    if allow is not None:
        text = text.replace("env:\n", f"env:\n  VLLM_ALLOW_LONG_MAX_MODEL_LEN: \"{allow}\"\n")
    profile.write_text(text)
    matrix = tmp_path / "s.yaml"
    matrix.write_text(STRETCHED.replace("PROFILE", str(profile)))
    return profile, matrix


def test_a_window_stretched_past_the_models_is_a_warning_naming_the_cells_past_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 and max-model-len 300,000 on a model of 262,144: the plan warns (vLLM
    serves it, and may crash at the first request past the model's window), naming the launch, both windows and
    the cells past the model's but within the launch's (400,000 is not sent at all). The baseline, at the
    model's window, is not named; without the variable it is refused as before."""
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    profile_file, matrix_file = _stretched(tmp_path, "1")
    matrix, matrix_path, _ = load_matrix(str(matrix_file))
    profile, profile_path = load_profile(str(profile_file))
    limits.check_window(profile, profile_path, matrix, matrix_path)   # let through, as vLLM lets it
    (notice,) = limits.stretched_window(profile, profile_path, matrix, matrix_path)
    assert notice.code == limits.PlanWarning.STRETCHED_WINDOW
    past = [c.key for c in matrix.cells() if c.context_tokens in (270000, 299999)]
    assert notice.message == (
        f"{matrix_path}: variants[1].flags: long: max-model-len 300,000 is past the model's window, 262,144 tokens "
        "(max_position_embeddings of qwen3.5-27b-gptq-int4), stretched by VLLM_ALLOW_LONG_MAX_MODEL_LEN; past "
        f"262,144 tokens: {past[0]} (270,001 tokens), {past[1]} (300,000 tokens)")
    assert "CUDA device-side assert" in notice.line()
    # From --set, named as --set's.
    (given,) = limits.stretched_window(profile, profile_path, None, None, {"max-model-len": 280000})
    assert given.message.startswith("launch --set: max-model-len: the profile: max-model-len 280,000 is past")
    # Without the variable: no warning, the refusal stands.
    plain, _ = load_profile(str(_stretched(tmp_path, None)[0]))
    assert limits.stretched_window(plain, profile_path, matrix, matrix_path) == []
    with pytest.raises(ConfigError, match="longer than the model's window"):
        limits.check_window(plain, profile_path, matrix, matrix_path)


def test_the_plan_prints_the_stretched_window_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    _, matrix = _stretched(tmp_path, "1")
    capsys.readouterr()
    assert run_cli(["plan", str(matrix), "--out", str(tmp_path / "runs")]) == 0
    warned = [line for line in capsys.readouterr().out.splitlines() if "stretched by" in line]
    assert len(warned) == 1 and warned[0].startswith(f"warning: {matrix}: variants[1].flags: long: max-model-len "
                                                     "300,000 is past the model's window")
