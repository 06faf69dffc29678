"""`campaign calibrate` from the runs a user already has (issue 52, item 5): loads that arrived at their own
times (a stored run's rate cells, a peer's per-request export) replayed on the engine and fitted, checked where
a truth exists.

- The replay's rows: a load's mean TTFT, mean TPOT and output tok/s are linear in the step costs on the schedule
  a replay ran (analysis.arrivals); the rows give back the replay's own figures exactly, idle gaps and queues
  included.
- The simulator's own records: loads the simulated A5000 pair served with its tables' costs, fitted from a start
  that knows nothing of them, are read again, and a load at another rate and length, held out, is predicted
  within 5% (the issue's bound for a held-out run of the same card).
- A run's rate cells: the stored CPU-build demo run has none, so a run the simulator measured over the tool's
  own Measurer in simulated time, on a machine its tables do not describe, is calibrated from one rate cell.
- vLLM's own export format (`bench serve --save-detailed`, written by vLLM's code in tests/test_peer_clients.py
  against the simulator; here its shape by hand for the refusals): each refusal is one line naming the file.
All on the engine's own clock, except where said.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace
from pathlib import Path

import pytest
from fakes import simulated

from campaign.analysis import arrivals
from campaign.analysis import calibrate as cal
from campaign.analysis.arrivals import Arrivals, Sent, Timed
from campaign.analysis.exports import read_vllm_bench
from campaign.bench import fidelity
from campaign.cli import run_cli
from campaign.core.errors import CampaignError
from campaign.measure.study import ExperimentResult
from campaign.plan import replay
from campaign.sim.config import SimConfig
from campaign.sim.model import StepCosts
from campaign.spec.matrix import load_matrix
from campaign.stored.store import RunDir


def _config() -> SimConfig:
    return replay.config_for(load_matrix("a5000-tuning")[0], "memory")


def _poisson(rate: float, count: int, prompt: tuple[int, int], output: tuple[int, int], seed: int) -> list[Sent]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(Sent(t, rng.randint(*prompt), rng.randint(*output)))
    return out


def _served(config: SimConfig, load: list[Sent]) -> list[Timed]:
    """The load as the simulator with its own costs served it: each request's first and last token times."""
    requests, _ = arrivals.run_load(config, load, config.costs)
    out = []
    for sent, r in zip(load, requests, strict=True):
        assert r is not None and r.emits
        out.append(Timed(sent, r.emits[0][0] - r.arrival, r.emits[-1][0] - r.arrival))
    return out


@pytest.mark.parametrize("request_s", [0.0, 0.04])
def test_a_loads_figures_are_linear_in_the_costs_on_its_schedule(request_s: float) -> None:
    """Bursts with idle gaps between them (the engine waits for an arrival: a constant in the row) and a queue
    inside each burst: the rows, dotted with the costs the replay ran, are the replay's own figures (to 1e-12),
    and with costs twice as large they say how the same schedule would read, which the replay confirms where
    the schedule holds (every request alone). Also with 40 ms a request with the API server (StepCosts.request_s):
    a busy period then begins that long after the arrival that began it, one of the rows' terms."""
    config = _config()
    config = replay_config(config, replace(config.costs, request_s=request_s))
    load = [Sent(10.0 * burst + 0.001 * i, 600 + 50 * i, 40 + 10 * i) for burst in range(3) for i in range(4)]
    measured = arrivals.measured_figures(_served(config, load))
    replayed = Arrivals("v", "bursts", config, tuple(load), measured).replay(config.costs)
    assert replayed.problem is None and {r.figure for r in replayed.rows} == set(arrivals.FIGURES)
    for figure, value in measured.items():
        assert replayed.predicted[figure] == pytest.approx(value, rel=1e-12), figure
    # A closed loop of two streams (vLLM's bench at --max-concurrency 2): each later request is sent as one
    # ends, so its arrival is on the engine's timeline too; the rows still give back the replay's figures.
    closed = [Sent(0.001 * i, 500 + 100 * i, 30 + 5 * i) for i in range(6)]
    for streams in (1, 2):   # one stream: the engine idles as each request ends, until the next arrives
        requests, _ = arrivals.run_load(config, closed, config.costs, max_concurrency=streams)
        sent = [(s, r) for s, r in zip(closed, requests, strict=True) if r is not None]
        assert len(sent) == 6 and sorted(r.arrival for _, r in sent)[:streams] == [0.0, 0.001][:streams]
        looped = arrivals.measured_figures([Timed(Sent(r.arrival, s.prompt_tokens, s.output_tokens),
                                                  r.emits[0][0] - r.arrival, r.emits[-1][0] - r.arrival)
                                            for s, r in sent])
        again = Arrivals("v", "closed", config, tuple(closed), looped, max_concurrency=streams).replay(config.costs)
        for figure, value in looped.items():
            assert again.predicted[figure] == pytest.approx(value, rel=1e-12), (streams, figure)
    # A request no launch of this profile could take (past its window and its cache) is never sent, as vLLM
    # refuses it, and the load says so instead of a figure (calibrate lists it as not predicted).
    refused = Arrivals("v", "too-long", config, (Sent(0.0, 1000, 10), Sent(1.0, 600_000, 10)), {"mean_ttft_s": 1.0})
    assert refused.replay(config.costs).problem == "1 of 2 requests got no token on the replay"
    lone = [Sent(30.0 * i, 800, 60) for i in range(3)]
    twice = cal._costs(2 * arrivals.vector(config.costs))
    (ttft,) = [r for r in Arrivals("v", "lone", config, tuple(lone), {"mean_ttft_s": 1.0}).replay(config.costs).rows]
    doubled = arrivals.measured_figures(_served(replay_config(config, twice), lone))
    assert float(ttft.features @ arrivals.vector(twice)) + ttft.offset == pytest.approx(doubled["mean_ttft_s"],
                                                                                       rel=1e-12)


def test_a_mixtures_rows_carry_the_routed_experts_read_its_steps_took() -> None:
    """A mixture of experts' step reads the experts its tokens touch, which grows with the step's tokens as
    no fitted term does (Mixtral-8x7B at TP 2 on H100s, the public run blis-T14's load: 10 requests a second
    for 30 s): the rows at the replay's costs still give back its own figures, that read held in their
    constant. Before, it was left out and summed over a busy period: the mean TTFT read -10 s, which the
    search of the unfitted constants (bench.fidelity --fit) would have scored had an MoE run been fitted on."""
    runs = {r.id: r for r in fidelity.load_runs()}
    obs = fidelity.observation(runs["blis-T14"])
    assert obs.config.costs.expert_read_s > 0
    measured = arrivals.measured_figures(_served(obs.config, list(obs.load)))
    replayed = replace(obs, measured=measured).replay(obs.config.costs)
    assert replayed.problem is None and set(measured) == set(arrivals.FIGURES)
    for figure, value in measured.items():
        assert replayed.predicted[figure] == pytest.approx(value, rel=1e-9), figure


def replay_config(config: SimConfig, costs: StepCosts) -> SimConfig:
    return replace(config, costs_override=costs)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_the_simulators_own_loads_are_fitted_and_another_load_is_predicted_within_5_percent(
        asynchronous: bool) -> None:
    """Truth (the simulator's own records): three Poisson loads the simulated A5000 pair served with its tables'
    costs (20 requests at 0.1 a second, each mostly alone, and 30 each at 0.4 and 0.8, which queue; prompts of
    200-2,000 tokens, replies of 16-256), fitted from a start that knows nothing of those costs (calibrate's
    START): each of their figures reads within 1% (measured: 0.03% at most), and all six terms are told apart.
    Held out, a fourth load at another rate with longer prompts and shorter replies is predicted within 5%
    (measured: 0.06%) on mean TTFT, mean TPOT and output tok/s. The machine spends 40 ms a request with the
    API server (StepCosts.request_s, which START leaves at 0): the fit finds it within 2 ms (measured: 41.2
    ms), from the light load, whose first tokens it is a large share of (in a queue it is a few percent of a
    TTFT, and other terms can stand in for it: fitted on the two queueing loads alone, it stayed at 0 and the
    held-out load read 16% off). With no such time (0 ms), the same fit reads 1.6 ms and 0.25% held out.
    All of that without async scheduling. With it (vLLM's default from 0.14: a request arriving while a step
    runs waits a step more), the figures read within 0.4% and the held-out load within 2.1%, but the fit from
    START settles where the API server's time reads 29 ms and the fixed cost holds the rest: the true costs
    are a fixed point of the fit too (every figure exact), which its rounds do not reach from START. Not
    asserted: a known limit of the fit (docs/simulator.md)."""
    request_s = 0.04
    config = replace(_config(), async_scheduling=asynchronous)
    config = replay_config(config, replace(config.costs, request_s=request_s))
    fitted_loads = [_poisson(0.1, 20, (200, 2000), (16, 256), seed=4), _poisson(0.4, 30, (200, 2000), (16, 256), 1),
                    _poisson(0.8, 30, (200, 2000), (16, 256), 2)]
    held = _poisson(0.6, 30, (1500, 4000), (8, 64), seed=3)
    observations = [Arrivals("memory", f"load-{i}", config, tuple(load),
                             arrivals.measured_figures(_served(config, load))) for i, load in enumerate(fitted_loads)]
    observations.append(Arrivals("memory", "held", config, tuple(held),
                                 arrivals.measured_figures(_served(config, held)), held_out=True))
    fitted = cal.fit(observations)
    assert fitted.costs != config.costs and fitted.determined == len(arrivals.TERMS)
    fit, predicted = fitted.summary(held_out=False), fitted.summary(held_out=True)
    assert fit.cells == 9 and predicted.cells == 3
    assert fit.max_abs is not None and fit.max_abs <= 0.01, fitted.cells
    assert predicted.max_abs is not None and predicted.max_abs <= 0.05, fitted.cells
    if not asynchronous:
        assert fitted.costs.request_s == pytest.approx(request_s, abs=0.002), fitted.costs


def _export(path: Path, timed: list[Timed], **extra: object) -> Path:
    """A load in vLLM bench serve's --save-detailed shape (vllm/benchmarks/serve.py's result keys)."""
    data = {"start_times": [1000.0 + t.sent.at_s for t in timed], "ttfts": [t.ttft_s for t in timed],
            "itls": [[(t.last_s - t.ttft_s) / max(1, t.sent.output_tokens - 1)] * (t.sent.output_tokens - 1)
                     for t in timed],
            "input_lens": [t.sent.prompt_tokens for t in timed], "output_lens": [t.sent.output_tokens for t in timed],
            "errors": [""] * len(timed), **extra}
    path.write_text(json.dumps(data))
    return path


def test_a_vllm_bench_export_reads_back_as_its_load_and_bad_ones_fail_in_one_line(tmp_path: Path) -> None:
    """A request's last token is its first plus its gaps; a failed request ("" errors aside, or no first
    token) is counted and left out; files vLLM's bench could not have written, or that lack what a replay
    needs, are refused in one line naming the file and what is missing."""
    load = [Timed(Sent(0.5 * i, 100 + i, 10 + i), 0.05, 0.05 + 0.01 * (9 + i)) for i in range(5)]
    path = _export(tmp_path / "ok.json", load)
    data = json.loads(path.read_text())
    data["errors"][2], data["ttfts"][4] = "Bad Gateway", 0.0
    path.write_text(json.dumps(data))
    export = read_vllm_bench(path)
    timed = export.timed
    assert export.failed == 2 and [t.sent.prompt_tokens for t in timed] == [100, 101, 103]
    assert export.max_concurrency is None   # no cap: an open loop, each request at its own time
    for got, want in zip(timed, [load[0], load[1], load[3]], strict=True):
        assert got.sent == Sent(1000.0 + want.sent.at_s, want.sent.prompt_tokens, want.sent.output_tokens)
        assert got.ttft_s == want.ttft_s and got.last_s == pytest.approx(want.last_s, rel=1e-12)
    cases = {
        "old.json": ({k: v for k, v in data.items() if k != "start_times"}, "has no start_times"),
        "summary.json": ({"mean_ttft_ms": 12.0}, "has no per-request lists"),
        "short.json": ({**data, "ttfts": data["ttfts"][:3]}, "lists differ in length (start_times 5, ttfts 3"),
        "text.json": ("not json", "cannot read it as JSON"),
        "none.json": ({**data, "errors": ["x"] * 5}, "none of its 5 requests succeeded"),
        "cap.json": ({**data, "max_concurrency": 0}, "max_concurrency 0 is not a positive whole number"),
    }
    # vLLM's --max-concurrency at an unlimited rate is a closed loop; at a finite rate the sends stand as sent.
    closed = tmp_path / "closed.json"
    closed.write_text(json.dumps({**data, "max_concurrency": 4, "request_rate": "inf"}))
    assert read_vllm_bench(closed).max_concurrency == 4
    closed.write_text(json.dumps({**data, "max_concurrency": 4, "request_rate": 2.0}))
    assert read_vllm_bench(closed).max_concurrency is None
    for name, (content, said) in cases.items():
        bad = tmp_path / name
        bad.write_text(content if isinstance(content, str) else json.dumps(content))
        with pytest.raises(CampaignError, match=re.escape(said)) as caught:
            read_vllm_bench(bad)
        assert str(bad) in caught.value.args[0] and "\n" not in caught.value.args[0]


def test_calibrate_from_exports_writes_an_entry_that_predicts_the_held_out_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command a user with last week's `vllm bench serve` results runs: two exports of the simulated pair
    (the a5000-tp2 profile, served with its tables' costs; 60 requests each), one held out. Fitted to the one
    from the profile's tables (the prior: here the truth, so this checks the command, not the fit; the fit's
    own truth tests are above), the other reads within 5%; the entry is written and the table shows every
    figure fitted or predicted. Bad invocations are one line."""
    config = replay.profile_config("a5000-tp2")
    first = _export(tmp_path / "rate-0.5.json", _served(config, _poisson(0.5, 60, (200, 2000), (16, 256), 4)))
    second = _export(tmp_path / "rate-0.8.json", _served(config, _poisson(0.8, 60, (300, 1800), (16, 200), 5)))
    out = tmp_path / "measured"
    code = run_cli(["calibrate", "--export", str(first), "--export", str(second), "--hold-out", str(second),
                    "--profile", "a5000-tp2", "--name", "pair-from-bench", "--dir", str(out)])
    shown = capsys.readouterr()
    assert code == 0, shown.err
    assert "rate-0.8.json" in shown.out and "held out: predicted" in shown.out and "mean TPOT" in shown.out
    assert "as the simulator sizes the profile" in shown.out and "prior: the hardware tables' costs" in shown.out
    entry = cal.sim_measured.load(out / "pair-from-bench.yaml")
    assert entry.schema_version == 4 and {c.figure for c in entry.fit} == set(arrivals.FIGURES)
    assert entry.held_out_error.cells == 3 and entry.held_out_error.max_abs is not None
    assert entry.held_out_error.max_abs <= 0.05, entry.fit
    for argv, said in ((["--export", str(first)], "--export needs --profile PROFILE"),
                       ([str(tmp_path), "--export", str(first), "--profile", "a5000-tp2"], "not both"),
                       (["--export", str(first), "--profile", "a5000-tp2", "--hold-out", "x.json"],
                        "not one of the --export files"),
                       ([], "calibrate needs a RUN_DIR, or --export")):
        assert run_cli(["calibrate", *argv, "--dir", str(out)]) != 0
        err = capsys.readouterr().err
        assert said in err and err.count("Error:") == 1, err


def test_a_runs_rate_cells_calibrate_the_machine_and_predict_the_other_rate_and_the_agents(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A night the user already ran with rate cells only, on a machine the tables do not describe (the
    simulated A5000 pair decoding 25% slower and prefilling 25% faster than its tables say; Poisson arrivals at
    0.3 and 0.6 requests a second for 60 s, prompts of 1,024 tokens +-50%, and agent sessions at 0.5 a second,
    in simulated time): `campaign calibrate RUN` fits it from the 0.3 cell's requests alone, leaning on the
    tables only where one load cannot tell the terms apart, and predicts the 0.6 cell and the agents, both held
    out, within 5% (measured: 2.2% at most on the 0.6 cell, 1.8% on the agents) on mean TTFT, mean TPOT and
    output tok/s. The agents' replay rebuilds each turn's prompt as the Measurer did (the shared system prompt,
    then the session's history), so its prefix cache serves what the server's counter says the measured
    server's served (measured: 23,200 tokens on both)."""
    sessions = {"count": 4, "turns": 3, "system_tokens": 1024, "user_tokens": 100}
    matrix = {"schema_version": 1, "name": "rate-cal", "profile": "a5000-tp2", "baseline": "baseline",
              "variants": [{"name": "baseline", "flags": {"fault": "decode-speed:0.75,prefill-speed:1.25"}}],
              "workloads": [{"kind": "rate", "contexts": [1024], "rates": [0.3, 0.6], "max_tokens": 128,
                             "range_ratio": 0.5, "duration_s": 60},
                            {"kind": "rate", "sessions": sessions, "rates": [0.5], "max_tokens": 32,
                             "duration_s": 60}],
              "repeats": 1}
    run = simulated.night_in_simulated_time(tmp_path, matrix)
    stored = RunDir(run)
    (agents,) = [c for c in stored.cells() if c.result.spec.sessions is not None]
    # The premise: the replay's prompts share what the Measurer's shared, block for block (the largest block
    # that divides the system prompt, a user message and a reply: 4 tokens), and its prefix cache serves them
    # what the measured server's counter says it served.
    (observed,) = [o for o in cal.run_cells(stored).observations
                   if isinstance(o, Arrivals) and o.key == agents.result.spec.key]
    assert observed.block == 4 and len(observed.load) == len(agents.result.requests or []) >= 25
    replayed, _ = arrivals.run_load(observed.config, observed.load, observed.config.costs, None, observed.block)
    served = sum(r.cached or 0 for r in replayed if r is not None)
    assert agents.result.prefix_cache_hits and served == pytest.approx(agents.result.prefix_cache_hits, rel=0.02), (
        served, agents.result.prefix_cache_hits)
    capsys.readouterr()
    held = "rate-L1024-N128-Q0.6-poisson-D60-V0.5"
    code = run_cli(["calibrate", str(run), "--hold-out", held, "--hold-out", agents.result.spec.key,
                    "--name", "from-rates", "--dir", str(tmp_path / "m")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "agent sessions" not in out and "prior: the hardware tables' costs" in out
    entry = cal.sim_measured.load(tmp_path / "m" / "from-rates.yaml")
    assert entry.fitted_error.cells == 3 and entry.held_out_error.cells == 6
    assert entry.held_out_error.max_abs is not None and entry.held_out_error.max_abs <= 0.05, entry.fit


def test_a_runs_experiments_and_capacity_search_probes_are_evidence_the_fit_uses(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The study's long-context prompts (each alone) and overload burst (past max-num-seqs, all at once) are
    loads like a rate cell's, and so is every probe of a capacity search (an open loop at a rate, a closed loop
    at a concurrency): with --fit-experiments their requests replayed at their own send times are evidence.
    On the simulated A5000 pair decoding 25% slower and prefilling 25% faster than its tables say (in simulated
    time), a fit on two decode cells, a prefill cell and the two experiments matches every one of them within
    2% (measured: 1.0%) and predicts the held-out 8K prefill and the search's every probe, by rate and by
    concurrency, within 2% (measured: 1.2%); without the experiments the same cells were fitted no better than
    12.4% (the burst is what tells a batch's decode cost apart). The study's other experiments are listed as
    skipped, each with why."""
    matrix = {"schema_version": 1, "name": "exp-cal", "profile": "a5000-tp2", "baseline": "baseline",
              "variants": [{"name": "baseline", "flags": {"fault": "decode-speed:0.75,prefill-speed:1.25",
                                                          "max-num-seqs": 16}}],
              "workloads": [{"kind": "prefill", "contexts": [2048, 8192]},
                            {"kind": "decode", "mode": "sustained", "contexts": [1024], "concurrency": [1, 8],
                             "max_tokens": 128},
                            {"kind": "long-context", "contexts": [4096, 12288], "reply_tokens": 64},
                            {"kind": "overload", "factor": 1.5, "prompt_tokens": 256, "reply_tokens": 64},
                            {"kind": "slo-search", "context": 1024, "max_tokens": 64, "duration_s": 20,
                             "start_rps": 0.5, "resolution": 0.5, "max_probes": 4, "max_concurrency": 8},
                            {"kind": "context-window", "reply_tokens": 8}],
              "slo": {"ttft_p99_ms": 5000, "tpot_p99_ms": 100}, "repeats": 1, "window_s": 10}
    run = simulated.night_in_simulated_time(tmp_path, matrix)
    (search,) = [e.result.key for e in RunDir(run).experiments() if e.result.kind == "slo-search"]
    capsys.readouterr()
    code = run_cli(["calibrate", str(run), "--fit-experiments", "--hold-out", "prefill-L8192", "--hold-out", search,
                    "--name", "exp", "--dir", str(tmp_path / "m")])
    out, err = capsys.readouterr()
    assert code == 0, err
    entry = cal.sim_measured.load(tmp_path / "m" / "exp.yaml")
    used = {(c.key, c.figure) for c in entry.fit if not c.held_out}
    for key in ("long-context", "overload-x1.5"):
        assert {(key, f) for f in ("mean_ttft_s", "mean_tpot_s", "output_tok_s")} <= used
    probes = {c.key for c in entry.fit if c.held_out and c.key.startswith(search)}
    assert any(k.endswith(" req/s") for k in probes) and any(k.endswith(" streams") for k in probes), probes
    assert entry.fitted_error.max_abs is not None and entry.fitted_error.max_abs <= 0.02, entry.fit
    assert entry.held_out_error.cells == 1 + 3 * len(probes) and entry.held_out_error.max_abs is not None
    assert entry.held_out_error.max_abs <= 0.02, entry.fit
    assert "context-window: it measures how the server treats an oversized prompt, not a speed" in out
    # By default a fit is the cells' alone: the experiments are asked for.
    assert run_cli(["calibrate", str(run), "--name", "cells", "--dir", str(tmp_path / "m")]) == 0
    assert not {c.key for c in cal.sim_measured.load(tmp_path / "m" / "cells.yaml").fit} & {
        "long-context", "overload-x1.5"}


def test_a_capacity_search_whose_probes_do_not_read_as_cells_is_skipped_with_why() -> None:
    """A search stored in another format than this tool's cells is listed as skipped, never a crash."""
    search = ExperimentResult(kind="slo-search", key="slo-search-x", status="Valid",
                              details={"probes": [{"request_rate": 1.0}]})
    assert cal._experiment_loads(search, 1.0) == ("its probes are stored in a format this version does not read "
                                                  "as cells")
    assert cal._experiment_loads(search.model_copy(update={"details": {}}), 1.0) == "no probe stored"
