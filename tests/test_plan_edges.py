"""What a real night still tripped on at plan time (issue 50): an estimate that counted a cell the plan itself
skips, an over-wide launch blamed on the variant when `--set` made it wide, and a window stretched past the
model's with VLLM_ALLOW_LONG_MAX_MODEL_LEN let through without a word. Then its review: each launch at its own
variant's estimate (the last run's table, the correction, the ETA), what a launch will not run as the runner's
typed findings, one rule for where a value was written and for a window past the model's, and an estimate that
rests on a KV cache unknown before a launch said as such.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from fakes import builders

from campaign.cli import run_cli
from campaign.core import vllm_flags
from campaign.core.errors import ConfigError
from campaign.measure.cells import Finding, Reason
from campaign.night import orchestrate
from campaign.night.launch import LaunchWork, Options
from campaign.plan import limits, planning, replay
from campaign.report import text as report
from campaign.server.profiles import PROJECT_ROOT, load_profile
from campaign.sim import server as sim
from campaign.spec.matrix import Matrix, load_matrix
from campaign.stored import records, store
from campaign.stored.records import StopRecord

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
    over = {"code": "over_capacity", "message": "over capacity at its KV cache of 50,000 tokens"}
    assert est.to_json()["not_run"] == {
        "a": {billion: {**over, "message": "over capacity at its KV cache of 500,000 tokens"}},
        "b": {sixty_four: over, billion: over}}


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


# --- each launch at its own variant's estimate (the review of the above) -----------------------------------
ESTIMATED = {"per_launch_s": 70.0, "variant_launch_s": {"a": 100.0, "b": 40.0}}
BEGAN = datetime.fromisoformat("2026-12-01T00:00:00+00:00")   # builders.server's started_utc


def _edit_manifest(run: store.RunDir, **fields: Any) -> None:
    """The run's manifest with these fields replaced (its `estimate`, its `matrix` definition)."""
    data = json.loads(run.manifest_path.read_text())
    run.manifest_path.unlink()
    run.manifest_path.write_text(json.dumps({**data, **fields}))


def _launched(run: store.RunDir, variant: str, repeat: int, kv: int | None = None) -> Path:
    launch = run.new_launch_dir(variant)
    builders.server(launch, variant=variant, repeat=repeat, ready_s=60.0,
                    facts={} if kv is None else {"kv_cache_tokens": kv, "block_size": 16})
    return launch


def _stopped(launch: Path, actual_s: float) -> None:
    """A stop.json that makes the launch `actual_s` long, start to stopped (ready_s 60 of it)."""
    store.write_new(launch / "stop.json", StopRecord(
        stopped_utc=(BEGAN + timedelta(seconds=actual_s - 60.0)).isoformat(), mode="sigint", exit_code=0,
        stop_s=1.0, swept=0, port_free=True, gpu_memory_released=None))


def test_each_last_launch_stands_beside_its_own_variants_estimate(tmp_path: Path) -> None:
    """A launch of b (estimated at 40 s) beside b's figure, a's (100 s) beside a's, not both beside the
    schedule's mean (70 s); a variant the stored estimate does not name, and a run stored before variant
    estimates, beside the mean."""
    run = store.RunDir.create(tmp_path, "t")
    builders.manifest(run, baseline="a", variants=["a", "b", "c"])
    for variant in ("a", "b", "c"):
        _stopped(_launched(run, variant, 0), 90.0)
    _edit_manifest(run, estimate=ESTIMATED)
    assert {t.variant: t.estimated_s for t in planning.launch_times(run)} == {"a": 100.0, "b": 40.0, "c": 70.0}
    _edit_manifest(run, estimate={"per_launch_s": 70.0})
    assert {t.variant: t.estimated_s for t in planning.launch_times(run)} == {"a": 70.0, "b": 70.0, "c": 70.0}


def test_the_correction_is_the_median_of_each_launchs_actual_over_its_own_estimate(tmp_path: Path) -> None:
    """The last run launched a three times and b once, each taking twice its own variant's estimate (b's leaves
    out the 64 streams its cache cannot hold): the correction is x2. The median of the actual times over the
    schedule's mean estimate said 4A / (A + B), as if b's launches were as long as a's."""
    run = store.RunDir.create(tmp_path / "runs", "t")
    builders.manifest(run, baseline="a", variants=["a", "b"])
    raw = yaml.safe_load(BILLION.replace("CONCURRENCY", "[1, 64]"))
    _edit_manifest(run, matrix={"path": "t.yaml", "raw": raw, "hash": "0"})
    launches = [("a", _launched(run, "a", r, 500_000)) for r in range(3)] + [("b", _launched(run, "b", 0, 50_000))]
    manifest = run.manifest()
    again = planning.estimate(manifest.matrix_model(), manifest.profile_model(), 1, planning.rates_from(run))
    assert again.rates.correction == 1.0   # no launch stopped yet: nothing to correct by
    own = {v: again.variant_launch_s(v) for v in ("a", "b")}
    assert own["a"] > own["b"] + 60
    for variant, launch in launches:
        _stopped(launch, 2 * own[variant])
    assert planning.rates_from(run).correction == pytest.approx(2.0)


def test_the_eta_sums_each_launch_left_at_its_own_variants_estimate(tmp_path: Path) -> None:
    """A resume whose launches left are mostly b's (40 s each, a's 100 s): b, b, a is 180 s, not three times the
    schedule's mean of 70 s; on a pool of two GPUs, two waves of their mean. A run stored before estimates is
    estimated again at the profile's rates, each launch at its variant's."""
    run = store.RunDir.create(tmp_path, "t")
    builders.manifest(run, baseline="a", variants=["a", "b"])
    path = tmp_path / "t.yaml"
    path.write_text(BILLION.replace("CONCURRENCY", "[1, 64]"))
    matrix, _, _ = load_matrix(str(path))
    profile, _ = load_profile("h200")
    left = [LaunchWork("b", 0, [], []), LaunchWork("b", 1, [], []), LaunchWork("a", 1, [], [])]
    night = orchestrate.Night(run, matrix, profile, Options(), resumed=True, notices=[])
    guessed = planning.estimate(matrix, profile, 1, planning.rates_from(None, profile))
    assert night.estimate_s(left) == pytest.approx(guessed.schedule_s(["b", "b", "a"]), abs=0.2)   # as stored
    _edit_manifest(run, estimate=ESTIMATED)
    assert night.estimate_s(left) == pytest.approx(180.0)
    assert replace(night, pool=[0, 1]).estimate_s(left) == pytest.approx(2 * 180.0 / 3)


# --- what a launch will not run: the runner's typed findings ------------------------------------------------
def test_what_a_launch_will_not_run_is_the_runners_finding_decided_by_its_code(tmp_path: Path) -> None:
    """b's window of 1,000 tokens leaves out the single stream (1,088 tokens: over the window, not sent) and
    its KV cache the 64 and the billion streams (over capacity, skipped): each is the finding the runner gives
    that cell, and only the over-capacity ones are listed as skipped. The stored estimate keeps both the code
    and the message."""
    _last_run(tmp_path / "runs")
    path = tmp_path / "w.yaml"
    path.write_text(BILLION.replace("CONCURRENCY", "[1, 64, 1000000000]")
                    .replace("{gpu-memory-utilization: 0.8}", "{max-model-len: 1000}"))
    matrix, _, _ = load_matrix(str(path))
    plan = planning.make_plan(matrix, load_profile("h200")[0], store.latest_run(tmp_path / "runs", "t"))
    one, sixty_four, billion = (c.key for c in plan.cells)
    b = plan.variants[1]
    assert {key: why.code for key, why in b.not_run.items()} == {
        one: Reason.OVER_WINDOW, sixty_four: Reason.OVER_CAPACITY, billion: Reason.OVER_CAPACITY}
    assert all(isinstance(why, Finding) for why in b.not_run.values())
    assert b.skipped == [sixty_four, billion]
    assert plan.estimate.to_json()["not_run"]["b"][one] == {
        "code": "over_window", "message": "over the window: 1,088 tokens past its max-model-len of 1,000"}


# --- the format history ---------------------------------------------------------------------------------------
def test_the_format_history_says_what_the_stored_estimate_became() -> None:
    entry = (records.__doc__ or "").split("\n16 - ")[1].split("\n\n")[0]
    for name in ("variant_launch_s", "not_run", "cells_s"):
        assert f"`{name}`" in entry, name


# --- one rule for where a value was written, one for a window past the model's --------------------------------
def test_the_parallel_sizes_are_the_flag_homes_own() -> None:
    assert limits.PARALLEL_SIZES is vllm_flags.PARALLEL_SIZES
    assert vllm_flags.parallel_width(dict.fromkeys(vllm_flags.PARALLEL_SIZES, 2)) == 8


def test_a_value_set_gave_is_named_in_one_spelling_for_widths_and_windows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--set of `tensor_parallel_size` and of `max_model_len` are both named as vLLM's command line spells
    them (a short name such as `dp` as given): one rule names where a value was written, for the width and
    for the window alike."""
    a5000, a5000_path = load_profile("a5000-tp2")
    with pytest.raises(ConfigError) as caught:
        limits.check_widths(a5000, a5000_path, None, None, {"tensor_parallel_size": 4})
    assert (caught.value.path, caught.value.key) == ("launch --set", "tensor-parallel-size")
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    profile, profile_path = load_profile("h200")
    with pytest.raises(ConfigError) as caught:
        limits.check_window(profile, profile_path, None, None, {"max_model_len": 300000})
    assert (caught.value.path, caught.value.key) == ("launch --set", "max-model-len")


def test_the_window_refused_without_the_variable_is_the_one_warned_of_with_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """For each launch past the model's window (a variant's, the profile's, --set's, and not one an
    hf-overrides leaves to the launch), check_window without VLLM_ALLOW_LONG_MAX_MODEL_LEN refuses it where
    stretched_window with it warns of it: the same place, key and window."""
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    allowed_file, matrix_file = _stretched(tmp_path, "1")
    matrix, matrix_path, _ = load_matrix(str(matrix_file))
    allowed, profile_path = load_profile(str(allowed_file))
    plain = allowed.model_copy(update={"env": {}})
    long_profile = {"flags": {**plain.flags, "max-model-len": 280000}}
    yarn = {"hf-overrides": {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "max-model-len": 300000}
    cases: list[tuple[dict[str, Any], Matrix | None, dict[str, Any] | None]] = [
        ({}, matrix, None), (long_profile, None, None), ({}, None, {"max-model-len": 290000}), ({}, None, yarn)]
    refusals = 0
    for update, m, overrides in cases:
        where = None if m is None else matrix_path
        warned = limits.stretched_window(allowed.model_copy(update=update), profile_path, m, where, overrides)
        try:
            limits.check_window(plain.model_copy(update=update), profile_path, m, where, overrides)
        except ConfigError as refused:
            refusals += 1
            assert [n.message.split(" is past")[0] for n in warned] == [
                str(refused).split(" is longer")[0]], (update, overrides)
        else:
            assert warned == [], (update, overrides)
    assert refusals == 3   # the yarn launch is the launch's to judge


# --- an estimate that rests on a KV cache unknown before a launch ---------------------------------------------
def test_an_unknown_kv_cache_is_said_beside_the_estimate_it_decides(tmp_path: Path) -> None:
    """No last run: nothing says whether a billion streams fit the KV cache, and estimated they are millions of
    seconds, more than the rest of the launch together. The plan says so beside the estimate; an ordinary
    matrix says nothing, nor a last run that found each variant's cache (the cell is left out), and a variant
    the last run never launched is named."""
    plan, _ = _plan(tmp_path, "[1, 64, 1000000000]")
    billion = plan.cells[2].key
    assert [v.unsure for v in plan.variants] == [[billion], [billion]]
    line = (f"not known before a launch: whether 1 cell fits the KV cache (the largest, {billion}, needs "
            "1,088,000,000,000 tokens); the estimate includes it")
    assert planning.kv_unknown(plan) == line
    said = report.text(report.plan_tables(plan, repeats=2)).splitlines()
    estimated = next(i for i, text in enumerate(said) if text.startswith("estimated duration: "))
    assert said[estimated + 1] == line
    assert planning.kv_unknown(_plan(tmp_path, "[1, 64]")[0]) is None
    # The last run launched a alone: b's cache is still unknown.
    run = store.RunDir.create(tmp_path / "runs", "t")
    builders.manifest(run, baseline="a", variants=["a", "b"])
    _launched(run, "a", 0, 500_000)
    assert planning.kv_unknown(_plan(tmp_path, "[1, 64, 1000000000]")[0]) == line.replace(
        "the KV cache (", "the KV cache of b (")
    _last_run(tmp_path / "runs")
    assert planning.kv_unknown(_plan(tmp_path, "[1, 64, 1000000000]")[0]) is None


@pytest.mark.parametrize(("utilization", "refusal", "log_says"), [
    (0.25, "the weights do not fit", "Failed to load model - not enough GPU memory"),
    (0.5, "no memory for the KV cache", "No available memory for the cache blocks"),
    (0.6, "cannot hold max-model-len 131,072", "To serve at least one request with the model's max seq len"),
    (0.7, None, "GPU KV cache size: 197,376 tokens"),
], ids=["weights", "no-cache", "window", "starts"])
def test_the_plan_refuses_what_the_simulated_start_up_refuses(utilization: float, refusal: str | None,
                                                             log_says: str) -> None:
    """A plan's or a tune's refusal and the simulator's start-up log are one rule (sim.model.start_refusal):
    the seed 000 pair at each share of the card, refused for the same reason in both, or started by both."""
    config = replay.profile_config("a5000-tp2", {"gpu-memory-utilization": utilization})
    lines: list[str] = []
    started = sim.start_up(config, sim.Log(config, lines.append), visible_devices="")
    said = replay.refused(config)
    assert (started is None) == (said is not None), (said, lines[-1:])
    assert said is None if refusal is None else refusal in str(said)
    assert log_says in "".join(lines)
