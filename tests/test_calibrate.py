"""`campaign calibrate`: the simulator's step costs fitted to measured cells, checked where a truth exists.

- Seed 004 (the H200 NVL speed-test matrix, a mission document of this project): fitted to half its table (a
  checkerboard of its decode cells and every other prefill context), the simulator predicts the other half.
- The simulator's own records: costs fitted to cells the simulator itself published with the A5000 tables'
  costs are found again (the held-out cells read as that simulator read them).
- The real CPU build: the demo's stored run (tests/fixtures/runs/cpu-demo, two repeats of three variants) with
  the 64-token-chunk prefill held out, predicted from the other cells; and the written entry, named by a profile,
  sizes a simulated server over HTTP as the real server's log said.
All in simulated time, on the engine's own clock (no wall clock, no HTTP) except the one launch.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from campaign.analysis import calibrate as cal
from campaign.analysis.arrivals import Arrivals
from campaign.cli import run_cli
from campaign.core.errors import ConfigError
from campaign.night.launcher import launched
from campaign.plan import replay
from campaign.server.profiles import load_profile
from campaign.sim import config as sim_config
from campaign.sim import measured as sim_measured
from campaign.spec.matrix import load_matrix
from campaign.stored.store import RunDir

ROOT = Path(__file__).resolve().parents[1]
CPU_RUN = ROOT / "tests" / "fixtures" / "runs" / "cpu-demo"
HELD = "small-chunk:prefill-L1536"

# Seed 004, Qwen3.5-27B-GPTQ-Int4 with MTP (2 tokens) on one H200 NVL: sustained decode total tok/s by context
# (K tokens) and concurrency (warm TTFT, 4,096-token replies, 30 s windows); "Over capacity" cells are absent.
SEED_004_TOTAL = {
    8: {1: 148.2, 2: 281.6, 4: 538.0, 8: 994.8, 16: 1674.3, 32: 2489.7, 64: 3104.6},
    16: {1: 142.5, 2: 277.2, 4: 526.9, 8: 965.0, 16: 1561.1, 32: 2206.7, 64: 2676.1},
    32: {1: 141.0, 2: 275.5, 4: 505.7, 8: 903.6, 16: 1353.2, 32: 1805.4},
    64: {1: 135.7, 2: 261.1, 4: 470.3, 8: 765.7, 16: 1063.5},
    128: {1: 130.3, 2: 232.2, 4: 397.9, 8: 572.3},
    251: {1: 116.7, 2: 194.9, 4: 295.0},
}
# Its prefill row: TTFT of one request by context (256K: the whole window, 262,143 prompt tokens).
SEED_004_TTFT_S = {8: 0.815, 16: 1.659, 32: 3.459, 64: 7.513, 128: 17.669, 251: 44.867, 256: 46.018}
CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)


def seed_004_observations() -> list[cal.Observation]:
    """Seed 004's cells as the h200-speed-matrix replays them, with the seed's figures; held out: the
    checkerboard's odd squares and every other prefill context."""
    matrix = load_matrix("h200-speed-matrix")[0]
    config = replay.config_for(matrix)
    contexts = sorted(SEED_004_TOTAL)
    out = []
    for spec in matrix.cells():
        k = 256 if spec.context_tokens == 262_143 else spec.context_tokens // 1024
        if spec.phase == "prefill":
            held = sorted(SEED_004_TTFT_S).index(k) % 2 == 1
            out.append(cal.Observation("default", spec, config, "ttft_s", (SEED_004_TTFT_S[k],), held_out=held))
        elif spec.concurrency in SEED_004_TOTAL.get(k, {}):
            held = (contexts.index(k) + CONCURRENCY.index(spec.concurrency)) % 2 == 1
            out.append(cal.Observation("default", spec, config, "total_tok_s", (SEED_004_TOTAL[k][spec.concurrency],),
                                       held_out=held))
    return out


def test_seed_004_half_predicts_the_other_half() -> None:
    """Fitted to 19 of seed 004's 39 figures, from a start that knows nothing of the H200 (the tables' costs are
    not used), the simulator predicts the other 20 with a median error of 2.4% and at most 6.4% (measured):
    stated here as at most 4% and 8%. The fitted cells themselves read within 6%."""
    observations = seed_004_observations()
    assert sum(o.held_out for o in observations) == 20 and len(observations) == 39
    fitted = cal.fit(observations)
    held, fit = fitted.summary(held_out=True), fitted.summary(held_out=False)
    assert held.cells == 20 and fit.cells == 19   # a replayed cell always has its figure: none over capacity
    assert held.median_abs is not None and held.max_abs is not None
    assert held.median_abs <= 0.04 and held.max_abs <= 0.08, [(c.key, c.error) for c in fitted.cells if c.held_out]
    assert fit.max_abs is not None and fit.max_abs <= 0.06
    # Every step term; the API server's time only a load tells apart (calibrate.fit), so it stays at 0.
    assert fitted.unmeasured == ["request_s"] and fitted.costs.request_s == 0.0


def test_the_simulators_own_costs_are_found_again() -> None:
    """Truth: cells the simulator published on the A5000 pair with the tables' costs, fitted from a start that
    is not those costs, are read again within 1%, and the cells held out (other contexts, other concurrency) too."""
    matrix = load_matrix("a5000-tuning")[0]
    config = replay.config_for(matrix, "memory")
    truth = config.costs
    specs = [s for s in matrix.cells() if s.phase == "prefill" or s.phase == "decode" and s.mode == "fixed"]
    observations = []
    for index, spec in enumerate(specs):
        cell = replay.run_cell(config, spec)
        value = cell.ttft_s if spec.phase == "prefill" else cell.total_tok_s
        assert value is not None and cell.status == "Valid", spec.key
        observations.append(cal.Observation("memory", spec, config, "ttft_s" if spec.phase == "prefill"
                                            else "total_tok_s", (value,), held_out=index % 3 == 2))
    fitted = cal.fit(observations)
    assert fitted.costs != truth
    for summary in (fitted.summary(held_out=False), fitted.summary(held_out=True)):
        assert summary.cells > 1 and summary.max_abs is not None and summary.max_abs <= 0.01, fitted.cells


def test_calibrate_the_real_cpu_run_and_predict_a_held_out_cell(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Done when (issue 35): calibrated from the demo's stored run of the real CPU build, the 64-token-chunk
    prefill (24 chunks for 1,536 tokens; held out) is predicted at 78 ms against 92 and 114 ms measured: -25%
    of the median, stated as within 30%. The machine's own noise is as large: that cell's two repeats spread by
    21%, and two variants of the same speed (baseline, small-cache) measured 33 and 43 ms for one chunk."""
    capsys.readouterr()
    run = tmp_path / "run"   # a copy: calibrate keeps its fit in the run it read (calibrations/)
    shutil.copytree(CPU_RUN, run)
    code = run_cli(["calibrate", str(run), "--hold-out", HELD, "--dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    line = next(x for x in out.splitlines() if "prefill-L1536" in x and x.startswith("small-chunk"))
    assert "103.1 ms" in line and "held out: predicted" in line
    assert "held out (predicted, not fitted): median |error|" in out and "skipped" not in out
    path = tmp_path / "cpu-tiny.yaml"
    assert f"wrote {path}" in err
    entry = sim_measured.load(path)
    (held,) = [c for c in entry.fit if c.held_out]
    assert held.key == "prefill-L1536" and held.error is not None and abs(held.error) <= 0.30
    print(f"held-out {HELD}: predicted {held.predicted * 1000:.1f} ms, measured {held.measured * 1000:.1f} ms "
          f"(spread {held.spread:.0%}), error {held.error:+.1%}")
    assert entry.memory.kv_cache_tokens == 2_097_152 and entry.memory.block_size == 128 and entry.window == 2048
    assert entry.device == "CPU" and len(entry.fit) == 9 and entry.fitted_error.cells == 8


def test_the_real_cpu_runs_experiments_are_taken_where_their_replies_streamed() -> None:
    """With --fit-experiments, the demo's real CPU run: a long-context or overload load some of whose replies
    arrived whole (every token in one chunk: the build's busy API server) shows no decode time, and its TPOT of
    0 is no step's; it is listed as skipped with why, never taken as 0 (which divided the fit's relative error
    by zero: "array must not contain infs or NaNs"), and the loads whose replies streamed are taken, every
    figure above 0. By default the experiments are not taken at all."""
    cells = cal.run_cells(RunDir(CPU_RUN), fit_experiments=True)
    assert ("baseline:long-context: 2 of 2 replies arrived whole (every token at once): the server's decode time "
            "was not seen") in cells.skipped
    assert any(s.endswith("prefix-order-K4: its arms share a prompt prefix by design, in blocks the replay does "
                          "not rebuild") for s in cells.skipped)
    taken = [o for o in cells.observations if isinstance(o, Arrivals) and o.key in {"long-context", "overload-x1.25"}]
    assert taken and all(value > 0 for o in taken for value in o.measured.values()), [o.measured for o in taken]
    assert not [o for o in cal.run_cells(RunDir(CPU_RUN)).observations
                if isinstance(o, Arrivals) and o.key in {"long-context", "overload-x1.25"}]


def test_a_profile_naming_the_entry_is_simulated_with_its_costs(tmp_path: Path) -> None:
    """The written entry is what the printed figures came from (replayed from the file, a cell reads exactly
    as the fit said), and a profile naming it launches a simulated server sized as the real one's log said."""
    entry, fitted, _ = cal.calibrate(RunDir(CPU_RUN), "cpu-tiny", [HELD])
    path = cal.write(entry, tmp_path)
    profile_path = tmp_path / "cpu-measured.yaml"
    data = yaml.safe_load((ROOT / "launch_profiles" / "cpu-tiny.yaml").read_text())
    data.update(hardware=str(path), engine="sim")
    profile_path.write_text(yaml.safe_dump(data))
    config = replay.profile_config(str(profile_path))
    assert config.measured == entry and config.memory().kv_tokens == 2_097_152 and config.block() == 128
    stored = {c.result.spec.key: c for c in RunDir(CPU_RUN).cells() if c.variant == "baseline"}
    for cell in entry.fit:
        if cell.variant == "baseline":
            spec = stored[cell.key].result.spec
            again = replay.run_cell(config, spec)
            assert (again.ttft_s if cell.figure == "ttft_s" else again.total_tok_s) == cell.predicted, cell.key
    profile, _ = load_profile(str(profile_path))
    with launched(profile, tmp_path / "server.log", engine="sim") as server:
        assert server.facts.kv_cache_tokens == 2_097_152 and server.facts.block_size == 128
        assert server.facts.max_model_len == 2048


def test_bad_inputs_fail_with_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert run_cli(["calibrate", str(CPU_RUN), "--hold-out", "prefill-L9", "--dir", str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert "Error: --hold-out prefill-L9: no such cell of this run to hold out" in err and HELD in err
    assert run_cli(["calibrate", str(tmp_path), "--dir", str(tmp_path)]) != 0
    assert "not a run directory" in capsys.readouterr().err
    # Everything held out: nothing left to fit.
    every = ["--hold-out", "prefill-L1536", "--hold-out", "decode-sustained-L512-C1-N64-W4"]
    assert run_cli(["calibrate", str(CPU_RUN), *every, "--dir", str(tmp_path)]) != 0
    assert "calibrate needs a figure of prefill and one of decode" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.yaml"))


def test_a_measured_file_is_checked_where_it_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    entry, _, _ = cal.calibrate(RunDir(CPU_RUN), "cpu-tiny")
    path = cal.write(entry, tmp_path)
    base = ["--model", "m", "--hardware", str(path)]
    assert sim_config.parse(base).costs == entry.step.costs()
    for argv, said in ((["--model-shape", "qwen3-32b"], "drop --model-shape"),
                       (["--tensor-parallel-size", "2"], "measured at tensor parallelism 1"),
                       (["--kv-cache-dtype", "fp8"], "measured with auto")):
        with pytest.raises(SystemExit):
            sim_config.parse(base + argv)
        assert said in capsys.readouterr().err
    old = tmp_path / "old.yaml"
    old.write_text(path.read_text().replace("schema_version: 4", "schema_version: 0"))
    with pytest.raises(ValueError, match="schema_version 0; this tool reads 1, 2, 3, 4: calibrate again"):
        sim_measured.load(old)
    # Format 1 (before `power`) still reads, as an entry without a power model.
    first = tmp_path / "first.yaml"
    first.write_text(path.read_text().replace("schema_version: 4", "schema_version: 1").replace("power: null\n", ""))
    assert sim_measured.load(first).power is None
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump({"model": "m", "hardware": str(path), "model_shape": "qwen3-32b"}))
    with pytest.raises(ConfigError, match="drop model_shape"):
        load_profile(str(profile))


def test_kv_cache_memory_bytes_sizes_the_cache() -> None:
    """vLLM's --kv-cache-memory-bytes sets the cache outright (per card): the simulator took it as an unknown
    flag before; now both a table's hardware and a measured entry size their cache by it."""
    table = sim_config.parse(["--model", "m", "--hardware", "a5000x2", "--model-shape", "qwen-27b-hybrid",
                              "-tp", "2", "--kv-cache-memory-bytes", "4G"])
    assert table.memory().kv_gib == 4.0
    entry, _, _ = cal.calibrate(RunDir(CPU_RUN), "cpu-tiny")
    small = sim_config.parse(["--model", "m", "--hardware", "x.yaml", "--kv-cache-memory-bytes", "64M"],
                             measured=entry)
    assert small.memory().kv_tokens == 2_097_152 // 16


def test_what_a_measured_entry_cannot_know_is_refused_and_what_it_can_is_kept(tmp_path: Path) -> None:
    """Review findings, each a wrong figure before: the run's max-model-len is no model window (a longer one
    starts, as the real server would); a page size given sizes pages, not the cache; speculative decoding, a
    utilisation or a cache type the entry was not measured with are refused by name; a cache past a table
    card's memory fails the start instead of serving memory the card lacks."""
    entry, _, _ = cal.calibrate(RunDir(CPU_RUN), "cpu-tiny")
    path = cal.write(entry, tmp_path)
    base = ["--model", "m", "--hardware", str(path)]
    longer = sim_config.parse_checked(base + ["--max-model-len", "4096"])
    assert longer.window is None and longer.max_model_len == 4096
    paged = sim_config.parse_checked(base + ["--block-size", "16"])
    assert paged.memory().kv_tokens == 2_097_152 and paged.memory().num_blocks == 2_097_152 // 16
    table = ["--model", "m", "--hardware", "a5000x2", "--model-shape", "qwen-27b-hybrid", "-tp", "2"]
    own, small = (sim_config.parse_checked(table + extra).memory() for extra in ([], ["--block-size", "16"]))
    assert small.kv_tokens == own.kv_tokens and small.num_blocks == own.kv_tokens // 16
    with pytest.raises(ValueError, match="measured with speculative decoding off, not mtp:2"):
        sim_config.parse_checked(base + ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}'])
    gpu = entry.model_copy(update={"memory": entry.memory.model_copy(update={"gpu_memory_utilization": 0.9})})
    with pytest.raises(ValueError, match="was measured at 0.9 and does not know the card's memory"):
        sim_config.parse_checked(base + ["--gpu-memory-utilization", "0.95"], measured=gpu)
    assert sim_config.parse_checked(base + ["--gpu-memory-utilization", "0.9"], measured=gpu).memory().kv_tokens > 0
    assert sim_config.parse_checked(table + ["--kv-cache-memory-bytes", "100G"]).memory().num_blocks <= 0


def test_a_profile_naming_a_missing_entry_is_one_clear_error(tmp_path: Path) -> None:
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump({"model": "m", "engine": "sim", "hardware": "measured/no-such-machine.yaml"}))
    with pytest.raises(ConfigError, match="no-such-machine.yaml: cannot read a measured hardware file"):
        replay.profile_config(str(profile))
