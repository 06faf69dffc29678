"""Flag values vLLM refuses are one-line errors before the night: JSON-valued flags parsed, numeric flags held to
vLLM's own bounds, the launch's width to the GPUs the profile names; and the simulator refuses what vLLM refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from campaign.cli import app
from campaign.core import vllm_flags
from campaign.core.errors import CampaignError, ConfigError, LaunchError
from campaign.core.vllm_flags import JSON_FLAGS, JSON_OR_TEXT_FLAGS, KNOWN_FLAGS
from campaign.measure.cells import CellSpec
from campaign.plan import limits
from campaign.server import flag_list, startup_log
from campaign.server.profiles import load_profile
from campaign.sim import config as sim_config
from campaign.sim import model as sim_model
from campaign.sim import server as sim_server
from campaign.spec.matrix import load_matrix, night_uses

BASE = """
name: t
profile: cpu-tiny
baseline: a
variants:
  - name: a
  - name: b
    flags: {FLAGS}
workloads:
  - kind: decode
    contexts: [512]
    concurrency: [1, 2]
"""


def matrix_with(tmp_path: Path, flags: str, extra: str = "") -> str:
    path = tmp_path / "m.yaml"
    path.write_text(BASE.replace("{FLAGS}", flags) + extra)
    return str(path)


def error_of(tmp_path: Path, flags: str, extra: str = "") -> str:
    with pytest.raises(ConfigError) as caught:
        load_matrix(matrix_with(tmp_path, flags, extra))
    message = str(caught.value)
    assert message.count("\n") <= 1   # one line, and at most one hint
    return message


def test_cut_json_in_a_json_valued_flag_names_the_key_and_where_it_broke(tmp_path: Path) -> None:
    """The issue's case: a speculative config cut short passes no plan; the error says where the JSON broke."""
    message = error_of(tmp_path, """{speculative-config: '{"method": "ngram", "num_speculative_tokens"'}""")
    assert message.startswith(f"{tmp_path / 'm.yaml'}: variants[1].flags.speculative-config: not valid JSON: ")
    assert "expecting ':' delimiter at its end (cut short?), after '\"num_speculative_tokens\"'" in message
    assert "hint: write it as a YAML mapping" in message
    # YAML's flow style inside a string is not JSON either: vLLM's json.loads refuses it.
    assert "not valid JSON" in error_of(tmp_path, "{compilation-config: '{level: 3}'}")
    assert "expects a JSON object, not 3" in error_of(tmp_path, "{compilation-config: 3}")


@pytest.mark.parametrize("flags", [
    "{speculative-config: {method: ngram, num_speculative_tokens: 3}}",           # a YAML mapping
    """{speculative-config: '{"method": "ngram", "num_speculative_tokens": 3}'}""",  # JSON text
    "{hf-overrides: some-text}",                 # an object-or-text flag takes text
    "{kv-transfer-config: '${KV_CONFIG}'}",       # a reference: left to vLLM (it names a secret)
    "{gpu-memory-utilization: 'suggested-0.02'}",
    "{max-num-batched-tokens: 8k}", "{max-model-len: auto}", "{max-model-len: 32K}",
])
def test_what_vllm_accepts_passes(tmp_path: Path, flags: str) -> None:
    load_matrix(matrix_with(tmp_path, flags))


def test_an_object_or_text_flag_written_as_an_object_must_be_json(tmp_path: Path) -> None:
    """vLLM reads such a value as JSON only when the whole of it is an object (`{...}`); anything else is text."""
    assert "variants[1].flags.hf-overrides: not valid JSON" in error_of(tmp_path, "{hf-overrides: '{rope: 2}'}")
    load_matrix(matrix_with(tmp_path, "{hf-overrides: '{rope'}"))   # not a whole object: passed on as text


def test_json_values_are_read_as_vllm_reads_them(tmp_path: Path) -> None:
    """vLLM expands bare 1k / 80m / 8K in a config flag's JSON before parsing it (outside strings only)."""
    load_matrix(matrix_with(tmp_path, """{compilation-config: '{"max_cudagraph_capture_size": 1k}'}"""))
    load_matrix(matrix_with(tmp_path, """{kv-transfer-config: '{"cpu_bytes_to_use": 80m, "name": "8K"}'}"""))


@pytest.mark.parametrize(("flags", "expected"), [
    ("{gpu-memory-utilization: 1.7}", "1.7 is out of range: vLLM requires above 0 and at most 1"),
    ("{gpu-memory-utilization: 0}", "0 is out of range: vLLM requires above 0 and at most 1"),
    ("{gpu-memory-utilization: lots}", "'lots' is not a number"),
    ("{max-num-seqs: 0}", "0 is out of range: vLLM requires at least 1"),
    ("{max-num-seqs: 2.5}", "2.5 is not a whole number"),
    ("{max-num-batched-tokens: 8q}", "'8q' is not a whole number"),
    ("{tensor-parallel-size: -2}", "-2 is out of range: vLLM requires at least 1"),
    ("{tp: 0}", "0 is out of range"),
    ("{block-size: 0}", "0 is out of range: vLLM requires at least 1"),
    ("{max-model-len: -5}", "-5 is out of range: vLLM requires at least -1"),
    ("{tensor-parallel-size: 2.0}", "2.0 is not a whole number"),          # argv writes 2.0; vLLM's int() refuses
    ("{max-num-batched-tokens: 1.5K}", "'1.5K' is not a whole number"),    # no decimals with binary suffixes
])
def test_numbers_vllm_range_checks_are_refused_with_its_bounds(tmp_path: Path, flags: str, expected: str) -> None:
    message = error_of(tmp_path, flags)
    key = flags.strip("{}").split(":")[0]
    assert f"variants[1].flags.{key}: {expected}" in message, message


def test_a_grid_names_the_value_that_is_out_of_range(tmp_path: Path) -> None:
    message = error_of(tmp_path, "{}", "grid: {gpu-memory-utilization: [0.9, 1.2]}\n")
    assert "grid.gpu-memory-utilization[1]: 1.2 is out of range" in message


def test_a_profile_flag_is_checked_as_a_matrix_flag_is(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("model: m\nflags: {gpu-memory-utilization: 1.5}\n")
    with pytest.raises(ConfigError, match=r"p.yaml: flags.gpu-memory-utilization: 1.5 is out of range"):
        load_profile(str(path))


def test_the_json_flag_lists_are_flags_vllm_knows() -> None:
    assert JSON_FLAGS <= KNOWN_FLAGS and JSON_OR_TEXT_FLAGS <= KNOWN_FLAGS
    assert set(vllm_flags.BOUNDS) <= KNOWN_FLAGS


def test_human_readable_integers_read_as_vllm_reads_them() -> None:
    assert vllm_flags.human_int("8k") == 8000 and vllm_flags.human_int("8K") == 8192
    assert vllm_flags.human_int("25.6k") == 25_600 and vllm_flags.human_int("2048") == 2048
    assert vllm_flags.human_int("8 tokens") is None and vllm_flags.human_int("1.5K") is None
    assert vllm_flags.human_int("1.5k") == 1500


def test_parallel_width_multiplies_the_three_sizes() -> None:
    assert vllm_flags.parallel_width(vllm_flags.merge({"tensor-parallel-size": 2, "pp": "2"})) == 4
    assert vllm_flags.parallel_width({}) == 1
    assert vllm_flags.parallel_width(vllm_flags.merge({"tp": "${TP}"})) is None
    # Later layers win whatever the spelling: the profile's 2, the variant's 4.
    assert vllm_flags.merge({"tensor-parallel-size": 2}, {"tensor_parallel_size": 4}) == {
        "tensor-parallel-size": 4}


# --- the simulator refuses what vLLM refuses ----------------------------------------------------------------
SIM = ["m", "--hardware", "h200-nvl", "--model-shape", "qwen3.5-27b-gptq-int4"]


@pytest.mark.parametrize(("extra", "expected"), [
    (["--gpu-memory-utilization", "1.7"], "argument --gpu-memory-utilization: 1.7 is out of range"),
    (["--gpu-memory-utilization", "0"], "argument --gpu-memory-utilization: 0.0 is out of range"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: 0 is out of range"),
    (["--block-size", "0"], "argument --block-size: 0 is out of range"),
    (["--tensor-parallel-size", "0"], "argument --tensor-parallel-size: 0 is out of range"),
    (["--kv-cache-dtype", "no-such-dtype"], "argument --kv-cache-dtype: invalid choice: 'no-such-dtype'"),
    (["--max-num-batched-tokens", "8q"], "argument --max-num-batched-tokens: '8q' is not a whole number"),
])
def test_the_simulator_refuses_what_vllm_refuses(extra: list[str], expected: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        sim_config.parse([*SIM, *extra])
    assert stopped.value.code == 2
    assert expected in capsys.readouterr().err


def test_the_simulator_reads_numbers_as_vllm_reads_them() -> None:
    """8K is 8,192 and 16k 16,000; auto (or -1, or no flag) is the model's own window, its shape's."""
    config = sim_config.parse([*SIM, "--max-num-batched-tokens", "8K", "--max-model-len", "auto"])
    assert config.max_num_batched_tokens == 8192 and config.max_model_len == 262_144
    assert sim_config.parse([*SIM, "--max-model-len", "16k"]).max_model_len == 16_000
    assert sim_config.parse(SIM).max_model_len == sim_config.parse([*SIM, "--max-model-len", "-1"]).max_model_len \
        == 262_144


def test_a_window_longer_than_the_models_is_refused_as_vllm_refuses_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's case: max-model-len against the model's window where the profile states it (its model_shape:
    Qwen3.5-27B's max_position_embeddings, 262,144). The plan refuses a longer one, naming the file, the key and
    the window; the simulator ends as vLLM 0.32 does, in its words, which the startup-log parser reads as a bad
    argument; VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (in the profile's env, in the simulator's) lets it through with
    vLLM's warning."""
    profile, profile_path = load_profile("h200")
    path = tmp_path / "m.yaml"
    path.write_text(BASE.replace("cpu-tiny", "h200").replace("{FLAGS}", "{max-model-len: 300k}"))
    matrix, matrix_path, _ = load_matrix(str(path))
    with pytest.raises(ConfigError, match=r"variants\[1\]\.flags: b: max-model-len 300,000 is longer than the "
                                          r"model's window, 262,144 tokens \(max_position_embeddings of "
                                          r"qwen3.5-27b-gptq-int4"):
        limits.check_window(profile, profile_path, matrix, matrix_path)
    # Named where it was written: --set (any spelling), else the variant, else the profile.
    with pytest.raises(ConfigError, match="launch --set: max-model-len: the profile: max-model-len 262,145"):
        limits.check_window(profile, profile_path, overrides={"max_model_len": "262145"})
    longer = profile.model_copy(update={"flags": {**profile.flags, "max-model-len": "300k"}})
    with pytest.raises(ConfigError, match=r"h200\.yaml: flags: a: max-model-len 300,000"):
        limits.check_window(longer, profile_path, matrix.model_copy(update={"variants": matrix.variants[:1]}))
    limits.check_window(profile, profile_path, overrides={"max-model-len": "256K"})     # 262,144: the window
    # Allowed by the server's environment (the profile's, or this shell's, which the launch passes on), or
    # left to the launch where a config override (YaRN) changes the window vLLM derives.
    allowed = profile.model_copy(update={"env": {**profile.env, "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}})
    limits.check_window(allowed, profile_path, matrix, matrix_path)
    limits.check_window(profile, profile_path, overrides={"max-model-len": "300k", "hf-overrides": {
        "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 262144}}})
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "true")
    limits.check_window(profile, profile_path, matrix, matrix_path)
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN")

    lines: list[str] = []

    class Log:
        def line(self, who: str, level: str, where: str, text: str) -> None:
            lines.append(f"{level} [{where}] {text}")

    longer = sim_config.parse([*SIM, "--max-model-len", "300000"])
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    assert sim_server.start_up(longer, Log(), visible_devices="") is None  # type: ignore[arg-type]
    refused = lines[-1]
    assert refused.startswith("ERROR [model.py:2664] ValueError: User-specified max_model_len (300000) is greater "
                              "than the derived max_model_len (max_position_embeddings=262144 or "
                              "model_max_length=None in model's config.json). To allow overriding this maximum, "
                              "set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1.")
    failure = startup_log.parse("\n".join(lines)).failure
    assert failure is not None and failure.kind == "bad_argument" and "max_position_embeddings" in failure.hint
    lines.clear()
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert sim_server.start_up(longer, Log(), visible_devices="") is not None  # type: ignore[arg-type]
    assert any(line.startswith("WARNING [model.py:2660] User-specified max_model_len (300000)") for line in lines)


def test_the_simulator_refuses_more_parallel_ranks_than_its_hardware_has_cards() -> None:
    """Without a device list, the simulated node has the cards its hardware names: tensor parallel 4 on the
    A5000 pair fails as vLLM does when the world is larger than the node."""
    args = sim_config.parse(["m", "--hardware", "a5000x2", "--model-shape", "qwen-27b-hybrid", "-tp", "4"])
    lines: list[str] = []

    class Log:
        def line(self, who: str, level: str, where: str, text: str) -> None:
            lines.append(text)

    assert sim_server.start_up(args, Log(), visible_devices="") is None  # type: ignore[arg-type]
    assert "ValueError: World size (4) is larger than the number of available GPUs (2) in this node." in lines


def test_the_simulators_memory_never_hands_out_more_than_the_card_has() -> None:
    """The issue's case: utilisation 1.7 read 201 GiB of KV cache on a 141 GB card. The memory model refuses a
    utilisation outside (0, 1], and inside it the cache plus everything else fits the card."""
    with pytest.raises(ValueError, match="gpu-memory-utilization 1.7"):
        sim_model.memory(hardware="h200-nvl", model="qwen3.5-27b-gptq-int4", tp=1, utilization=1.7,
                         max_num_batched_tokens=8192)
    for utilization in (0.5, 0.9, 1.0):
        mem = sim_model.memory(hardware="h200-nvl", model="qwen3.5-27b-gptq-int4", tp=1, utilization=utilization,
                               max_num_batched_tokens=8192)
        used = mem.kv_gib + mem.weights_gib + mem.activation_gib + mem.cuda_graph_gib
        assert used <= mem.total_gib * utilization + 1e-9


def test_a_launch_wider_than_the_profiles_hardware_is_refused_before_the_night(tmp_path: Path) -> None:
    """The simulated A5000 pair has two cards: tensor parallel 4 is refused at plan time, naming both numbers."""
    path = tmp_path / "m.yaml"
    path.write_text(BASE.replace("cpu-tiny", "a5000-tp2").replace("{FLAGS}", "{tensor-parallel-size: 4}"))
    matrix, matrix_path, _ = load_matrix(str(path))
    profile, profile_path = load_profile("a5000-tp2")
    with pytest.raises(CampaignError, match=r"variants\[1\].flags: b needs 4 GPUs \(tensor x pipeline x data "
                                            r"parallel size\); the profile's hardware a5000x2 has 2"):
        limits.check_widths(profile, profile_path, matrix, matrix_path)
    limits.check_widths(profile, profile_path, matrix, matrix_path, placed=True)   # a --gpus pool or Ray decides
    # Whatever the spelling, the variant's value wins over the profile's (tensor-parallel-size: 2).
    path.write_text(BASE.replace("cpu-tiny", "a5000-tp2").replace("{FLAGS}", "{tensor_parallel_size: 4}"))
    matrix, matrix_path, _ = load_matrix(str(path))
    with pytest.raises(CampaignError, match="b needs 4 GPUs"):
        limits.check_widths(profile, profile_path, matrix, matrix_path)


# --- what the machines can hold, and flags let through said by name ----------------------------------------
def test_a_concurrency_the_client_cannot_open_is_an_error_naming_the_limit(tmp_path: Path) -> None:
    """The issue's case: a billion streams passed the plan. One socket a stream, a sustained cell's split over
    its client processes: beyond what this machine lets a process open, an error naming that number."""
    written = Path(matrix_with(tmp_path, "{}"))
    written.write_text(written.read_text().replace("concurrency: [1, 2]", "concurrency: [1, 1000000000]"))
    matrix, path, _ = load_matrix(str(written))
    profile, _ = load_profile("cpu-tiny")
    with pytest.raises(ConfigError) as caught:
        limits.check_concurrency(matrix, path, profile, open_files=1024)
    message = str(caught.value)
    assert message.startswith(f"{path}: workloads[0].concurrency[1]: 1,000,000,000 streams need ")
    assert "a process here may open 1,024 (ulimit -Hn)" in message
    assert limits.check_concurrency(matrix.model_copy(update={"workloads": []}), path, profile,
                                    open_files=1024) == []
    # A plan may be made on another machine than the one that measures: there it is a warning naming the limit.
    planned = limits.check_concurrency(matrix, path, profile, open_files=1024, here=False)
    assert [n.code for n in planned if n.code == limits.PlanWarning.OPEN_FILES] == [limits.PlanWarning.OPEN_FILES]
    assert "a process here may open 1,024" in planned[0].line()


def test_the_host_that_measures_checks_its_own_limit_before_a_launch_is_spent(tmp_path: Path) -> None:
    """A Ray node's client runs under the node's limit, not the controller's that the plan checked: the launch
    checks its cells there and fails naming the cell, the host and its limit. A sustained cell's streams are
    split over client processes (as many as this machine's cores allow); a fixed cell's share one; a rate
    cell's are its cap, or its sessions."""
    written = Path(matrix_with(tmp_path, "{}"))
    written.write_text(written.read_text().replace("concurrency: [1, 2]", "concurrency: [1, 1000]"))
    matrix, _, _ = load_matrix(str(written))
    cells = matrix.cells()
    with pytest.raises(CampaignError) as caught:
        limits.check_open_files_on_host(cells, "node-7", open_files=512)
    wide = next(c for c in cells if c.phase == "decode" and c.concurrency == 1000)
    assert str(caught.value).startswith(f"{wide.key}: 1,000 streams need ")
    assert "a process on node-7 may open 512 (ulimit -Hn)" in str(caught.value)
    assert "raise the hard limit (ulimit -Hn)" in str(caught.value)
    limits.check_open_files_on_host(cells, "node-7", open_files=1 << 20)
    fixed = wide.model_copy(update={"mode": "fixed"})
    with pytest.raises(CampaignError, match="1,000 sockets"):
        limits.check_open_files_on_host([fixed], "n", open_files=1000)
    rate = CellSpec(phase="rate", context_tokens=64, max_tokens=8, max_concurrency=600)
    with pytest.raises(CampaignError, match="600 streams"):
        limits.check_open_files_on_host([rate], "n", open_files=600)
    limits.check_open_files_on_host([rate.model_copy(update={"request_rate": 1.0, "max_concurrency": None})], "n",
                                    open_files=100)


def test_decode_cells_beyond_the_servers_seats_are_a_stated_warning(tmp_path: Path) -> None:
    """Above max-num-seqs a decode cell is Invalid (above_max_num_seqs): the plan says so per variant, with the
    number it is measured against, set or vLLM's default for the profile's card (256 on the A5000)."""
    path = tmp_path / "m.yaml"
    path.write_text(BASE.replace("cpu-tiny", "a5000-tp2").replace("{FLAGS}", "{max-num-seqs: 8}")
                    .replace("concurrency: [1, 2]", "concurrency: [4, 300]"))
    matrix, matrix_path, _ = load_matrix(str(path))
    profile, _ = load_profile("a5000-tp2")
    unset = {k: v for k, v in profile.flags.items() if k != "max-num-seqs"}   # the shipped profile sets 256
    notices = limits.check_concurrency(matrix, matrix_path, profile.model_copy(update={"flags": unset}),
                                       open_files=1 << 20)
    lines = [n.line() for n in notices]
    assert [n.code for n in notices] == [limits.PlanWarning.ABOVE_SEATS] * 2
    assert any("workloads[0].concurrency[1]: 300 streams, and variant a seats 256 (vLLM's default max-num-seqs "
               "on a 22 GiB card)" in line for line in lines), lines
    assert any("workloads[0].concurrency[0]: 4 streams" in line for line in lines) is False
    assert any("300 streams, and variant b seats 8 (its max-num-seqs)" in line for line in lines)
    assert all("raise max-num-seqs, or measure fewer streams" in line for line in lines)


def test_a_flag_far_from_every_listed_name_is_let_through_and_said_by_name(tmp_path: Path) -> None:
    """Without vLLM here, SGLang's `mem-fraction` passes (a newer vLLM may have it), but the plan says so."""
    matrix, path, _ = load_matrix(matrix_with(tmp_path, "{mem-fraction: 0.8}"))
    profile, profile_path = load_profile("cpu-tiny")
    shipped = flag_list.FlagList(flag_list.shipped(), "the shipped list", authoritative=False)
    let_through = flag_list.check(night_uses(profile, profile_path, matrix, path), shipped)
    notices = limits.unlisted_flags(let_through, shipped.source)
    hint = limits.HINTS[limits.PlanWarning.UNLISTED_FLAG]
    assert [n.line() for n in notices] == [
        f"warning: {path}: variants[1].flags.mem-fraction is not in the shipped list ({hint})"]


def test_the_launch_host_refuses_a_flag_its_own_vllm_does_not_know(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The flag the plan let through is checked against the launch host's list before a launch is spent."""
    profile, _ = load_profile("cpu-tiny")
    asked: list[str] = []

    def host_list(p: object, engine: str | None) -> flag_list.FlagList:
        asked.append("asked")
        return flag_list.FlagList(frozenset({"max-num-seqs", "enforce-eager"}), "vLLM 9.9 at vllm (its --help=all)",
                                  authoritative=True)

    monkeypatch.setattr(flag_list, "for_profile", host_list)
    limits.check_on_host(profile, {"max-num-seqs": 8}, "vllm")
    assert asked == []   # every flag is on the shipped list: nothing to ask
    with pytest.raises(LaunchError) as caught:
        limits.check_on_host(profile, {"mem-fraction": 0.8}, "vllm")
    assert caught.value.kind == "bad_argument"
    assert caught.value.message == "mem-fraction: not a flag of vLLM 9.9 at vllm (its --help=all)"


def test_every_option_says_what_it_takes_in_words_or_choices() -> None:
    """Help text: an option taking text shows its choices or a word (`--engine vllm|sim`, `--format json|csv`,
    `--profile NAME|FILE`), never the bare type `<str>`."""
    runner = CliRunner()
    commands = [c.name or (c.callback.__name__ if c.callback else "") for c in app.registered_commands]
    assert {"run", "plan", "probe", "launch", "export"} <= set(commands)
    for command in commands:
        shown = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output
        bare = [line.strip() for line in shown.splitlines() if line.lstrip().startswith("-") and "<str>" in line]
        assert not bare, (command, bare)
    launch = runner.invoke(app, ["launch", "--help"], env={"COLUMNS": "200"}).output
    assert "--engine vllm|sim" in launch and "--mode sustained|fixed" in launch
