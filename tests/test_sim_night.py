"""Whole campaigns in simulated time (`campaign run MATRIX --engine sim --clock virtual`, measure/simulated.py): the
shipped matrices' verdicts in seconds, on a normal run that diff, report and export read, with every figure
checked against the engine's own records (and, in test_sim.py, the replayed experiments against the same
experiments measured over HTTP on the simulator).

The command line runs in this process (cli.run_cli: its own parsing, exit codes and one-line errors, output
captured), not in a subprocess that spends over a second importing the package for every command."""

from __future__ import annotations

import contextlib
import csv
import functools
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from campaign.analysis.recommend import diff_run
from campaign.cli import run_cli
from campaign.core.errors import LaunchError
from campaign.measure import corpus, simulated
from campaign.measure.cells import CellSpec
from campaign.measure.runner import SIMULATED_NOTE, Measurer
from campaign.night import orchestrate
from campaign.plan import replay as sim_virtual
from campaign.server.profiles import load_profile
from campaign.sim import truth as sim_truth
from campaign.spec.matrix import DecodeWorkload, Matrix, load_matrix
from campaign.stored import store

# Seed 000: aggregate tok/s of its fixed-count ladder (C x 256 tokens over the step's whole time), and its
# batch-size A/B, "every row inside noise": prompt tok/s 1,002 -> 1,019 at 6.6K, 979 -> 989 at 26.5K.
SEED_000_TOTAL = {1: 59, 2: 105, 4: 188, 8: 312, 16: 466, 32: 589, 64: 641}


# The text corpora, each made once for this file (each walks the whole stdlib; the same text every time).
_CORPORA = {"code": functools.cache(corpus.code), "prose": functools.cache(corpus.prose)}


@pytest.fixture(autouse=True)
def _texts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The corpora's text is made once for the file (each walks the whole stdlib)."""
    for kind, made_once in _CORPORA.items():
        monkeypatch.setattr(corpus, kind, made_once)


@dataclass
class Ran:
    """What a command ended with and printed."""

    returncode: int
    stdout: str
    stderr: str


def campaign(*args: str) -> Ran:
    """`campaign ARGS` as the console script runs it (run_cli), in this process, its output captured."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run_cli(list(args))
    return Ran(code, out.getvalue(), err.getvalue())


def night(matrix: Matrix, matrix_path: Path, out: Path) -> store.RunDir:
    """The matrix replayed in simulated time by the night `campaign run --clock virtual` runs (orchestrate's
    own: checks, schedule, launches, stored cells), without the closing report and charts: the verdicts are
    read from the stored run by diff_run, whose recommendation is the console's `recommendation:` line."""
    profile, profile_path = load_profile(matrix.profile)
    with orchestrate.started(matrix, matrix_path, profile, profile_path, engine="sim", out=out,
                             clock="virtual") as tonight:
        tonight.execute_pending(live=False)
    return tonight.run


@pytest.fixture(scope="module")
def a5000_tuning(tmp_path_factory: pytest.TempPathFactory) -> store.RunDir:
    """Seed 000's A/B as shipped, replayed in simulated time (its console verdict is the Markdown report's
    opening, word for word: test_a_virtual_run_is_a_normal_run_for_diff_report_and_export reads it there)."""
    return night(*load_matrix("a5000-tuning")[:2], tmp_path_factory.mktemp("virtual"))


def _mean(cells: list[store.StoredCell], variant: str, key: str, metric: str) -> float:
    values = [getattr(c.result, metric) for c in cells if c.variant == variant and c.result.spec.key == key]
    assert len(values) >= 3 and None not in values, (variant, key, metric, values)  # the baseline: 4 (drift)
    return float(sum(values) / len(values))


def test_a5000_tuning_keeps_the_memory_and_reverts_the_batch_size_as_seed_000_did(
        a5000_tuning: store.RunDir) -> None:
    """Seed 000's A/B replayed in simulated time reads as the seed did: memory keep (KV cache +15.0%), batch
    revert (a cost with no benefit), with the seed's numbers (prefill and every rung of the ladder), and every
    one of seed 000's experiments replayed and judged by study.py's own functions."""
    run = a5000_tuning
    diffs = diff_run(run)
    assert {d.variant: d.outcome for d in diffs} == {"memory": "keep", "batch": "revert"}
    why = {d.variant: d.recommendation for d in diffs}   # the console's `recommendation:` lines
    assert why["memory"].startswith("gpu-memory-utilization 0.9 -> 0.95: KV cache +15.0%"), why
    assert why["batch"] == ("max-num-batched-tokens 2,048 -> 8,192: KV cache -0.8%: revert (a cost with no benefit: "
                            "every deciding figure is shown within +-3%)")
    # ... with the seed's numbers: the chunk moves prefill under 2% and no rung of the ladder by 2% ...
    cells = run.cells()   # read once: every cell of the run is a file
    keys = {c.result.spec.key: c.result.spec for c in cells}
    for key, spec in keys.items():
        metric = "prompt_tok_s" if spec.phase == "prefill" else "total_tok_s"
        before, after = _mean(cells, "memory", key, metric), _mean(cells, "batch", key, metric)
        assert 0 <= after / before - 1 < 0.02 if spec.phase == "prefill" else after == pytest.approx(before, rel=0.02)
        if spec.phase == "decode":
            # ... and the baseline's ladder within 10% of the seed's at every rung, 32 and 64 streams included.
            assert _mean(cells, "baseline", key, "total_tok_s") == pytest.approx(SEED_000_TOTAL[spec.concurrency],
                                                                               rel=0.10), key
    # The whole matrix, seed 000's experiments included, each judged by study.py's own functions.
    manifest = run.manifest()
    assert manifest.clock == "virtual" and manifest.time_scale == 1.0 and manifest.not_replayed == []
    experiments = {(e.variant, e.result.kind): e.result for e in run.experiments() if e.repeat == 0}
    assert {kind for _, kind in experiments} == {"context-window", "long-context", "overload", "prefix-order",
                                                 "repeat"}
    assert all(e.status == "Valid" for e in experiments.values()), {k: e.reasons for k, e in experiments.items()}
    overload = experiments[("baseline", "overload")].values
    assert overload["ran_concurrently"] == 256 and overload["queued"] == 64 and overload["errored"] == 0
    assert experiments[("baseline", "prefix-order")].values["shared_first_hit_rate"] == pytest.approx(0.63, abs=0.08)
    assert "silently clamps" in experiments[("baseline", "context-window")].verdict   # vLLM >= 0.32's clamp


def test_a_virtual_run_is_a_normal_run_for_diff_report_and_export(
        a5000_tuning: store.RunDir, tmp_path: Path) -> None:
    """`campaign diff`, `export` and `report` read a run replayed in simulated time as any other, its figures
    the hardware's (seed 000's 64-stream rung in every exported row), its verdict seed 000's (the report opens
    with the console's verdict lines, word for word); its startup logs are the simulator's, stored, and read by
    the parser as any vLLM's."""
    run = a5000_tuning
    diff = campaign("diff", str(run.root))
    assert diff.returncode == 0, diff.stderr
    assert "recommendation: gpu-memory-utilization 0.9 -> 0.95: KV cache +15.0%" in diff.stdout, diff.stdout
    exported = campaign("export", str(run.root), "--format", "csv")
    assert exported.returncode == 0, exported.stderr
    rows = list(csv.DictReader(io.StringIO(exported.stdout)))
    c64 = [r for r in rows if r.get("variant") == "baseline" and r.get("concurrency") == "64"]
    assert len(c64) >= 3 and all(float(r["total_tok_s"]) == pytest.approx(641, rel=0.10) for r in c64)
    report = campaign("report", str(run.root), "--format", "md", "--out", str(tmp_path / "r.md"))
    assert report.returncode == 0, report.stderr
    verdict = (tmp_path / "r.md").read_text().split("## Verdict", 1)[1].split("\n## ", 1)[0]
    # A line a variant in one sentence (issue 53), its whole reasoning on the line under it.
    assert "- memory: keep: KV cache +15.0%" in verdict
    assert "  - why: gpu-memory-utilization 0.9 -> 0.95: KV cache +15.0%" in verdict
    assert "- batch: revert: it costs 0.8% KV cache, and every deciding figure is shown within +-3%" in verdict
    assert ("  - why: max-num-batched-tokens 2,048 -> 8,192: KV cache -0.8%: revert (a cost with no benefit: "
            "every deciding figure is shown within +-3%)") in verdict
    # The launch's startup log is the simulator's, read as any vLLM's: the facts are the parser's.
    server = next(s for s in run.ready_servers() if s.variant == "batch")
    assert server.facts.kv_cache_tokens == pytest.approx(562_838, rel=1e-4)
    assert server.facts.max_num_batched_tokens == 8192
    assert server.launch_dir is not None and (run.root / server.launch_dir / "server.log").exists()


@pytest.mark.parametrize("spec", [
    CellSpec(phase="decode", mode="fixed", context_tokens=32, concurrency=16, max_tokens=256, min_requests=32),
    CellSpec(phase="decode", mode="sustained", context_tokens=4096, concurrency=8, max_tokens=512, window_s=20,
             warmup_s=2),
    CellSpec(phase="decode", mode="sustained", context_tokens=8192, concurrency=4, max_tokens=256, window_s=10,
             ttft="warm"),
], ids=["fixed", "sustained", "warm"])
def test_the_replay_predicts_the_measurer_to_the_engines_last_digit(spec: CellSpec) -> None:
    """What tune, calibrate and `campaign simulate` predict with (plan.replay, the engine alone) is what the
    night measures (the Measurer against the simulator in this process, every figure from its records): the
    same figures, to the simulated clock's nanosecond; and the night's figures are the engine's own by their
    definitions (sim_truth's, over what the engine emitted)."""
    launch = simulated.start(load_profile("a5000-tp2")[0], {}, seed=0)
    predicted = sim_virtual.run_cell(launch.config, spec)
    recorder = sim_truth.Recorder()
    with launch.serve(truth=recorder) as server:
        stored = server.call(Measurer(server.target()).run_cell(spec))
        anchor = server.anchor
    assert stored.status == predicted.status == "Valid", stored.reasons
    for figure in ("total_tok_s", "per_request_tok_s"):
        assert getattr(stored, figure) == pytest.approx(getattr(predicted, figure), rel=1e-8), figure
    assert stored.completed == predicted.completed
    measured = [r for r in recorder.all_requests() if r.max_tokens == spec.max_tokens]
    if stored.window is None:
        truth = sim_truth.fixed_figures(measured)
    else:
        truth = sim_truth.window_figures(measured, stored.window[0] - anchor, stored.window[1] - anchor)
    for figure in ("total_tok_s", "per_request_tok_s"):
        assert getattr(stored, figure) == pytest.approx(truth[figure], rel=1e-8), figure
    assert json.dumps(stored.model_dump(mode="json"))  # storable as it is


def test_an_aa_in_simulated_time_gets_no_verdict(tmp_path: Path) -> None:
    """Repeats differ only by the engine's seed, so the shipped A/A replayed in simulated time shows every
    throughput figure within 3%; a TTFT median whose launches land in either of two modes (streams in lockstep
    are prefilled in one wave or two, by seed) cannot be shown within 3% in three launches, and says so; nor
    can stream tok/s where each launch's median rests on a few requests of a 4 s window (its own error: the
    5 requests of L2048-C4 read 0-48 tok/s, the 3 of L128-C1 57.9-59.6). Never better, worse, keep or
    revert."""
    run = night(*load_matrix("a5000-aa")[:2], tmp_path)
    (diff,) = diff_run(run)
    assert diff.aa and diff.outcome in {"no difference", "not settled"}, diff.recommendation
    verdicts = [(c.key, m.metric, m.verdict, m.note) for c in diff.cells for m in c.metrics]
    assert not [v for v in verdicts if v[2] in {"better", "worse"}]
    throughput = [v for v in verdicts if v[1] in {"total_tok_s", "prompt_tok_s"}]
    assert throughput and all(v[2] == "no difference" for v in throughput), verdicts
    unsettled = {key: note for key, metric, verdict, note in verdicts
                 if metric == "per_request_tok_s" and verdict != "no difference"}
    assert unsettled.keys() == {"decode-sustained-L2048-C4-N128-W4", "decode-sustained-L128-C1-N128-W4"}, verdicts
    assert "not reachable at this noise" in unsettled["decode-sustained-L2048-C4-N128-W4"]


def test_a_fault_with_nothing_to_act_on_in_simulated_time_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hung start or foreign traffic needs a process or HTTP: refused by name, never ignored (a hung start
    would have hung the night); the CUDA_VISIBLE_DEVICES of the controller places no simulated launch."""
    monkeypatch.setenv("CAMPAIGN_SIM_FAULTS", "hang-startup,foreign:50")
    with pytest.raises(LaunchError) as refused:
        simulated.start(load_profile("a5000-tp2")[0], {}, seed=0)
    assert refused.value.kind == "bad_argument"
    assert refused.value.message == \
        "fault hang-startup, foreign (CAMPAIGN_SIM_FAULTS) is not replayed in simulated time"
    monkeypatch.setenv("CAMPAIGN_SIM_FAULTS", "bimodal4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")   # one GPU here; the simulated pair still starts
    assert simulated.start(load_profile("a5000-tp2")[0], {}, seed=0).config.faults.bimodal4


def test_a_start_that_fails_in_simulated_time_is_recorded_as_a_real_one(tmp_path: Path) -> None:
    """A simulated start that runs out of memory or gets an unknown flag is the launcher's LaunchError of that
    kind, and in a night it is a recorded launch failure (exit 6: finished, but a launch failed)."""
    with pytest.raises(LaunchError) as raised:
        simulated.start(load_profile("a5000-tp2")[0], {"gpu-memory-utilization": 0.25}, seed=0)
    assert raised.value.kind == "out_of_memory", raised.value.message
    with pytest.raises(LaunchError) as bad:
        simulated.start(load_profile("a5000-tp2")[0], {"no-such-flag": 1}, seed=0)
    assert bad.value.kind == "bad_argument" and "no-such-flag" in bad.value.message
    matrix = tmp_path / "m.yaml"
    matrix.write_text("name: m\nprofile: a5000-tp2\nbaseline: a\nrepeats: 1\nvariants:\n  - {name: a}\n"
                      "  - {name: small, flags: {gpu-memory-utilization: 0.6}}\n"
                      "workloads:\n  - {kind: prefill, contexts: [2048]}\n")
    result = campaign("run", "--no-report", str(matrix), "--engine", "sim", "--clock", "virtual", "--out",
                      str(tmp_path / "o"),
                      "--plain")
    assert result.returncode == 6, result.stderr   # finished, but a launch failed
    run = store.RunDir(next((tmp_path / "o" / "m").iterdir()))
    (failure,) = run.failures()
    assert failure.variant == "small" and failure.failure_kind in {"out_of_memory", "kv_cache_insufficient"}


def test_every_kind_runs_in_simulated_time_and_nothing_is_left_out(tmp_path: Path) -> None:
    """Open-loop rate cells and agent sessions, which the engine's replay lacks, are measured in simulated time
    by the Measurer itself against the simulator in process (measure.simulated): nothing is left out of a
    virtual run, every cell is stored, and each says how it was measured."""
    matrix = tmp_path / "m.yaml"
    matrix.write_text("name: m\nprofile: h200\nbaseline: a\nrepeats: 1\nvariants: [{name: a}]\nwindow_s: 5\n"
                      "workloads:\n  - {kind: prefill, contexts: [8k]}\n"
                      "  - {kind: rate, contexts: [1024], rates: [2], duration_s: 10}\n"
                      "  - {kind: decode, contexts: [1024], concurrency: [1], prompts: code}\n"
                      "  - {kind: agents, sessions: [1], turns: 2, system_tokens: 200, user_tokens: 50}\n")
    result = campaign("run", "--no-report", str(matrix), "--engine", "sim", "--clock", "virtual", "--out",
                      str(tmp_path / "o"),
                      "--plain")
    assert result.returncode == 0, result.stderr[-2000:]
    run = store.RunDir(next((tmp_path / "o" / "m").iterdir()))
    assert run.manifest().not_replayed == [] and "not replayed" not in result.stderr
    assert [w["kind"] for w in run.manifest().matrix.raw["workloads"]] == ["prefill", "rate", "decode", "agents"]
    cells = {c.result.spec.key: c.result for c in run.cells()}
    assert sorted(cells) == ["decode-sustained-L1024-C1-N256-W5-Pcode", "prefill-L8192",
                             "rate-L1024-N256-Q2-poisson-D10"]
    assert all(c.status == "Valid" for c in cells.values()), {k: c.reasons for k, c in cells.items()}
    assert all(SIMULATED_NOTE in c.notes for c in cells.values())
    rate = cells["rate-L1024-N256-Q2-poisson-D10"]
    assert SIMULATED_NOTE in rate.notes and rate.time_scale == 1.0 and rate.client_cpu is None
    assert rate.scheduled_requests is not None and rate.scheduled_requests >= 10
    (agents,) = run.experiments()
    assert agents.result.kind == "agents" and agents.result.status == "Valid", agents.result.reasons


def test_what_simulated_time_cannot_run_is_refused_in_one_line(tmp_path: Path) -> None:
    """A profile that is not the simulator's and an unknown --clock are each one `Error:` line before anything
    starts."""
    demo = campaign("run", "demo", "--clock", "virtual", "--out", str(tmp_path))
    assert demo.returncode == 1 and "--clock virtual replays the simulator's engine" in demo.stderr
    clock = campaign("run", "demo", "--clock", "later", "--out", str(tmp_path))
    assert clock.returncode == 1 and "--clock 'later': expected wall or virtual" in clock.stderr
    assert not any(tmp_path.iterdir())   # nothing was started


def test_a_resumed_virtual_run_stays_in_simulated_time(tmp_path: Path) -> None:
    """`campaign run --resume RUN --repeats 2` on a virtual run replays the new repeats in simulated time too
    (the manifest's clock, not a flag given again), and leaves the shipped matrix as it was."""
    run = night(*load_matrix("h200-memory-quick")[:2], tmp_path)
    cells = len(run.cells())
    more = campaign("run", "--no-report", "--resume", str(run.root), "--repeats", "2", "--plain")
    assert more.returncode == 0, more.stderr[-2000:]
    assert "SIMULATED in simulated time" in more.stdout and "\n== Verdict ==\n" in more.stdout, more.stdout[-2000:]
    repeats: dict[tuple[str, str], set[int]] = {}
    for c in run.cells():
        repeats.setdefault((c.variant, c.result.spec.key), set()).add(c.repeat)
    assert len(run.cells()) > cells and run.manifest().clock == "virtual"
    assert all(r >= {0, 1} for r in repeats.values()), repeats
    assert all(SIMULATED_NOTE in c.result.notes for c in run.cells())
    matrix = load_matrix("h200-memory-quick")[0]
    assert matrix.repeats == 1


def test_speculative_decoding_on_text_in_simulated_time_reads_as_seed_000_and_004_found(tmp_path: Path) -> None:
    """Text and chat prompts are the tool's own (prompts.Prompts, on the simulator's tokenizer in-process):
    a5000-spec's drafter model cuts the cache about 5x (-78%) and no longer serves 64 streams, so it is reverted
    (seed 000 reverted it), while the n-gram drafter's KV cache is the baseline's (no extra weights);
    h200-mtp's MTP heads (two tokens against none, at 8K), judged on code and prose, are kept (seed 004 serves
    with two), every chat cell Valid with a plausible acceptance rate; a5000-spec's agent sessions are measured in
    simulated time too. (The same a5000-spec campaign over HTTP on the simulator took 5 minutes and read the
    same; test_text_prompts keeps speculative decoding over HTTP in `campaign probe`.)"""
    # Both nights draw their text from one tokenized corpus per source (_texts), in this order.
    # Two repeats (`--repeats 2`): the drafter is reverted for what its launches state (its KV cache, a cell
    # it can no longer serve), and the n-gram drafter judged, on six launches instead of ten.
    spec_matrix, spec_path, _, _ = orchestrate.load_night("a5000-spec", None, None, 2)
    spec_run = night(spec_matrix, spec_path, tmp_path)
    assert spec_run.manifest().not_replayed == []   # its agents are measured in simulated time too
    outcomes = {d.variant: d for d in diff_run(spec_run)}
    drafter = outcomes["drafter"].recommendation
    assert outcomes["drafter"].outcome == "revert", drafter
    assert "it can no longer serve what the baseline served" in drafter
    assert "KV cache -78." in drafter and "over capacity now in decode-fixed-L2048-C64" in drafter, drafter
    assert re.search(r": revert( \([^)]*\))?$", drafter), drafter
    assert "KV cache" not in outcomes["ngram"].recommendation, outcomes["ngram"].recommendation
    cells = [c.result for c in spec_run.cells() if c.variant == "ngram" and c.result.spec.prompts == "code"]
    assert cells and all("spec_random_prompts" not in [r.value for r in c.reason_codes] for c in cells)
    assert all(c.spec_acceptance_rate is not None for c in cells)
    # h200-mtp as shipped, but only what is judged here: MTP with two tokens against none (each variant is
    # judged against the baseline alone, and a launch's engine seed is its repeat, whatever else runs), on
    # prose through chat and on code, at its first context, 8K (the 32K cells would double the night: each of
    # their chat prompts is tokenized whole, 32K tokens, to hand the engine its ids).
    mtp_matrix, mtp_path, _ = load_matrix("h200-mtp")
    mtp_matrix = mtp_matrix.model_copy(update={
        "variants": [v for v in mtp_matrix.variants if v.name in {"none", "mtp2"}],
        "workloads": [w.model_copy(update={"contexts": w.contexts[:1]}) if isinstance(w, DecodeWorkload) else w
                      for w in mtp_matrix.workloads]})
    assert {c.context_tokens for c in mtp_matrix.cells()} == {8192}
    mtp_run = night(mtp_matrix, mtp_path, tmp_path)
    mtp = {d.variant: d for d in diff_run(mtp_run)}
    assert mtp["mtp2"].outcome == "keep", mtp["mtp2"].recommendation
    chat = [c.result for c in mtp_run.cells() if c.variant == "mtp2" and c.result.spec.endpoint == "chat"]
    assert chat and all(c.status == "Valid" for c in chat), [c.reasons for c in chat]
    rates = [c.spec_acceptance_rate for c in chat]
    assert all(r is not None and 0.3 < r < 0.95 for r in rates), rates
