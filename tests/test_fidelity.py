"""Issue 52, item 6: `make fidelity`'s harness. Its inputs are public measurements of real vLLM (each cited, with
its licence); its figures come from the cell's raw request records as the source defines them; a run replays
through the tool's own launch and Measurer in simulated time. The simulator's error itself is the benchmark's
output (docs/simulator.md carries the table), not asserted here."""

from __future__ import annotations

from dataclasses import replace

import pytest

from campaign.bench import fidelity
from campaign.http.client import RequestRecord
from campaign.sim import model as sim_model


def test_every_public_run_is_cited_and_its_model_and_card_are_known() -> None:
    runs = fidelity.load_runs()
    assert len(runs) >= 20 and len({r.id for r in runs}) == len(runs)
    for run in runs:
        assert run.source and run.licence and run.vllm_version
        profile = fidelity.profile_for(run)
        assert profile.simulatable, run.id
        fidelity.cell_for(run)   # a valid cell


def test_a_run_file_with_a_key_it_does_not_know_is_refused() -> None:
    with pytest.raises(ValueError, match="extra"):
        fidelity.load_runs("schema_version: 1\nruns:\n  - {id: x, sauce: y}\n")


def test_the_figures_are_the_sources_definitions_over_the_raw_records() -> None:
    """Two requests of 11 tokens: TTFT 0.1 and 0.3 s, 10 gaps of 10 and 20 ms; the span from the first send
    to the last end is 0.5 s."""
    def rec(send: float, first: float, gap: float) -> RequestRecord:
        times = [first + gap * i for i in range(11)]
        return RequestRecord(id="r", prompt_tokens=10, max_tokens=11, send_t=send, chunk_t=times,
                             chunk_tokens=[1] * 11, end_t=times[-1], status=200, usage_completion_tokens=11)
    got = fidelity.figures([rec(0.0, 0.1, 0.01), rec(0.0, 0.3, 0.02)])
    assert got["ttft_mean_ms"] == pytest.approx(200.0)
    assert got["tpot_mean_ms"] == pytest.approx(15.0)
    assert got["output_tok_s"] == pytest.approx(22 / 0.5)
    assert fidelity.error(110.0, 100.0) == pytest.approx(0.10) and fidelity.error(None, 100.0) is None


def test_a_closed_loop_run_replays_on_the_simulator_and_is_scored() -> None:
    """GPUStack's single-stream run (100 ShareGPT-length requests one at a time, Qwen3-8B on an H100, vLLM
    0.11): replayed in simulated time, every figure has a simulated value, and the report scores it."""
    run = next(r for r in fidelity.load_runs() if r.id == "gpustack-G2")
    done = fidelity.replay(run)
    assert done.status == "Valid"
    assert all(done.simulated[f] is not None and done.simulated[f] > 0 for f in fidelity.FIGURES)
    text, summary = fidelity.report([done], [])
    assert "gpustack-G2" in text and summary["held out"]["tpot_mean_ms"]["runs"] == 1
    assert summary["fitted on"]["tpot_mean_ms"]["runs"] == 0 and "gpustack-G2" not in fidelity.FITTED_ON
    assert fidelity.FITTED_ON <= {r.id for r in fidelity.load_runs()}


def test_the_calibrated_split_groups_a_card_and_models_runs_and_fits_every_other() -> None:
    """`make fidelity --calibrated`'s split: BLIS's four card-and-model groups of five open-loop runs (the
    saturated and closed-loop runs left out) and the sim-to-real runs' one group of four (Qwen3-14B on one
    H100, two workloads' two stages; a source's runs are not grouped with another's), each in rate order; a
    run's load is its rate for 30 s at its mean lengths. The fit itself is the calibrate tests'
    (tests/test_calibrate_loads.py); its error on these runs is the benchmark's output (docs/simulator.md)."""
    found = fidelity.groups(fidelity.load_runs())
    assert sorted(len(g) for g in found) == [4, 5, 5, 5, 5]
    assert {r.id for g in found if len(g) == 4 for r in g} == {"s2r-59-0", "s2r-59-1", "s2r-13-0", "s2r-13-1"}
    for members in found:
        assert all(m.saturated is None and m.workload.kind == "rate" for m in members)
        rates = [m.workload.rate_rps or 0.0 for m in members]
        assert rates == sorted(rates) and len({(m.hardware, m.model) for m in members}) == 1
    t1 = next(r for r in fidelity.load_runs() if r.id == "blis-T1")   # 5 requests a second, constant
    load = fidelity._load(t1)
    assert len(load) == 150 and load[1].at_s == pytest.approx(0.2) and load[0].prompt_tokens == 592
    text, summary = fidelity.calibrated_report([fidelity.Calibrated(t1, "tpot_mean_ms", 9.26 * 1.04, True)])
    assert "blis-T1" in text and "+4.0%" in text
    assert summary["tpot_mean_ms"]["within_target"] == 1 and summary["ttft_mean_ms"]["runs"] == 0


def test_the_unfitted_constants_fit_finds_known_ones_from_the_simulators_own_figures() -> None:
    """`--fit`'s search (the unfitted roofline's constants, sim.model.UnfittedSteps) on two runs' loads whose
    "published" means are the simulator's own under known constants (an API server's 15 ms; slower compute, a
    longer fixed step): from other constants (the ones shipped before the search existed) it finds constants
    that read the means within 2% on average, the API server's time among them."""
    runs = {r.id: r for r in fidelity.load_runs()}
    start = sim_model.UnfittedSteps(fixed_step_s=0.003, bandwidth_efficiency=0.95, decode_mfu=1.2, prefill_mfu=0.9,
                                    request_s=0.0)
    truth = replace(start, fixed_step_s=0.0035, request_s=0.015, prefill_mfu=0.75, decode_mfu=1.0)
    observations = []
    for run_id in ("blis-T1", "blis-T21"):   # Llama-2-7B on one H100, CodeLlama-34B on two; 5 requests a second
        obs = fidelity.observation(runs[run_id])
        config = obs.config
        costs = sim_model.step_costs(hardware=config.hardware, model=config.model_shape,
                                     tp=config.tensor_parallel_size, unfitted=truth)
        predicted = obs.replay(costs).predicted
        observations.append(replace(obs, measured={f: v for f, v in predicted.items() if f in obs.measured
                                                   and v is not None}))
    assert all(len(o.measured) == 2 for o in observations)
    assert fidelity.objective(observations, start) > 0.1
    fitted, score = fidelity.fit_unfitted(observations, start, only=fidelity.SHARED_FIELDS)   # H100 runs
    # Within 2% on average: the search's reach on an objective a queue makes piecewise (its docstring).
    assert score < 0.02 and fidelity.objective(observations, fitted) == score, (score, fitted)
    assert abs(fitted.request_s - truth.request_s) < 0.005, fitted


def test_a_generations_bandwidth_share_is_fitted_on_its_own_cards_runs() -> None:
    """`--fit`'s second stage: one generation's bandwidth share alone, the shared constants held, on a run of a
    card of it whose "published" means are the simulator's own at a known share (Ampere's at 0.7, Llama-3.1-8B
    on one A100 at 2.5 requests a second): the search finds the share within 2%, and moves nothing else."""
    runs = {r.id: r for r in fidelity.load_runs()}
    truth = replace(sim_model.UNFITTED_STEPS, ampere_bandwidth_efficiency=0.7)
    obs = fidelity.observation(runs["s2r-38-0"])
    config = obs.config
    costs = sim_model.step_costs(hardware=config.hardware, model=config.model_shape, tp=config.tensor_parallel_size,
                                 unfitted=truth)
    predicted = obs.replay(costs).predicted
    obs = replace(obs, measured={f: v for f, v in predicted.items() if f in obs.measured and v is not None})
    assert len(obs.measured) == 2
    start = replace(sim_model.UNFITTED_STEPS, ampere_bandwidth_efficiency=1.0)
    fitted, _ = fidelity.fit_unfitted([obs], start, only=frozenset({sim_model.GENERATION_BANDWIDTH["ampere"]}))
    assert fitted.ampere_bandwidth_efficiency == pytest.approx(0.7, rel=0.02), fitted
    assert {f: getattr(fitted, f) for f in fidelity.SHARED_FIELDS} == {
        f: getattr(start, f) for f in fidelity.SHARED_FIELDS}


def test_a_saturated_run_is_scored_only_where_its_client_gave_up_on_almost_nothing() -> None:
    """BLIS's four reasoning runs at 4 requests a second outran their servers. T24's client gave up on 4 of its
    4,800 requests: its means are of nearly all of them, so it is replayed over the source's whole span (4,800
    requests at 4 a second: 1,200 s, the queue growing all along) and scored beyond saturation; the other three
    (1,600-4,068 given up) are listed, not scored."""
    runs = {r.id: r for r in fidelity.load_runs()}
    assert [rid for rid in ("blis-T4", "blis-T11", "blis-T17", "blis-T24") if fidelity.scored(runs[rid])] == [
        "blis-T24"]
    assert fidelity.cell_for(runs["blis-T24"]).duration_s == pytest.approx(1200.0)
    assert fidelity.cell_for(runs["blis-T1"]).duration_s == fidelity.SPAN_S
    assert all(fidelity.scored(r) for r in runs.values() if r.saturated is None)
