"""Each request's time with the API server before the engine can seat it (StepCosts.request_s, issue 52 item 4):
a delay, not a step's time. On every driver of the engine (the replay's Virtual clock, a load replayed at its own
arrival times, the server a client measures in this process), a request alone gets its first token exactly
that much later, and a busy engine keeps stepping for the others meanwhile."""

from __future__ import annotations

from dataclasses import replace

import pytest

from campaign.analysis import arrivals
from campaign.analysis.arrivals import Sent
from campaign.measure import simulated
from campaign.measure.cells import CellSpec
from campaign.measure.runner import Measurer
from campaign.plan import replay
from campaign.server.profiles import load_profile
from campaign.sim import truth as sim_truth
from campaign.sim.config import SimConfig

REQUEST_S = 0.05


def _configs() -> tuple[SimConfig, SimConfig]:
    profile, path = load_profile("h200")
    config = replay.loaded_profile_config(profile, path)
    return config, replace(config, costs_override=replace(config.costs, request_s=REQUEST_S))


def test_a_request_alone_waits_out_its_api_server_time_on_every_driver() -> None:
    without, with_api = _configs()
    prefill = CellSpec(phase="prefill", context_tokens=2048)
    plain = replay.run_cell(without, prefill).ttft_s
    delayed = replay.run_cell(with_api, prefill).ttft_s
    assert plain is not None and delayed == pytest.approx(plain + REQUEST_S, abs=1e-12)
    # A load replayed at its own times: the same, request by request, when each finds the engine idle.
    load = [Sent(10.0 * i, 1024 + 512 * i, 16) for i in range(3)]
    (a, b) = (arrivals.run_load(config, load, config.costs)[0] for config in (without, with_api))
    for x, y in zip(a, b, strict=True):
        assert x is not None and y is not None and x.ttft is not None and y.ttft is not None
        assert y.ttft == pytest.approx(x.ttft + REQUEST_S, abs=1e-12)
    # The server a client measures in this process (the engine's Driver, on the loop's simulated clock).
    launch = simulated.start(load_profile("h200")[0], {}, seed=0)
    with simulated.SimulatedServer(with_api, with_api.memory(), launch.facts) as server:
        measured = server.call(Measurer(server.target()).run_cell(prefill))
    assert measured.ttft_ms == pytest.approx(1000 * (plain + REQUEST_S), rel=1e-6)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_busy_engine_steps_on_while_a_new_request_is_with_the_api_server(asynchronous: bool) -> None:
    """One request decoding, another arriving mid-stream: the first's tokens keep their pace (its steps do not
    wait for the second), and the second is seated in the first step planned after its time with the API
    server is over: the first that begins after it, or with async scheduling (planned as the step before it
    began), the one after that."""
    without, with_api = (replace(c, async_scheduling=asynchronous) for c in _configs())
    load = [Sent(0.0, 512, 64), Sent(0.2, 512, 8)]
    (first_plain, _), (first, second) = (arrivals.run_load(c, load, c.costs)[0] for c in (without, with_api))
    assert first_plain is not None and first is not None and second is not None and second.admitted is not None
    gaps = [b[0] - a[0] for a, b in zip(first.emits, first.emits[1:], strict=False)]
    plain_gaps = [b[0] - a[0] for a, b in zip(first_plain.emits, first_plain.emits[1:], strict=False)]
    assert max(gaps[:5]) == pytest.approx(max(plain_gaps[:5]), rel=1e-9)   # before the second is seated
    assert second.admitted >= 0.2 + REQUEST_S
    emitted = [t for t, _ in first.emits]
    assert any(0.2 < t < 0.2 + REQUEST_S for t in emitted)   # the first streamed on meanwhile
    after = sorted(t for t in emitted if t >= 0.2 + REQUEST_S)
    assert second.admitted == after[1 if asynchronous else 0]   # seated in the next step planned


def test_the_truth_counts_no_wait_for_the_api_server_as_the_simulator_falling_behind() -> None:
    """A request arriving as the only other one ends: the engine's last step leaves it waiting, not yet ready,
    and the next step begins when its time with the API server is over. The replay's clock never falls behind,
    so the truth's behind_s is 0 with the truth file's request_s; without it, that wait would read as lag."""
    _, with_api = _configs()
    load = [Sent(0.0, 512, 4), Sent(0.14, 512, 8)]   # the first ends at about 0.156 s
    requests, steps = arrivals.run_load(with_api, load, with_api.costs)
    first, second = requests
    assert first is not None and second is not None and first.finish is not None and second.admitted is not None
    assert 0.14 < first.finish < second.admitted == pytest.approx(0.14 + REQUEST_S)   # the engine idled between
    assert any(not s.running and s.waiting for s in steps)
    done = [r for r in requests if r is not None]
    assert sim_truth.Truth({"request_s": REQUEST_S}, done, steps).behind_s() == 0.0
    assert sim_truth.Truth({}, done, steps).behind_s() == pytest.approx(second.admitted - first.finish)


def test_a_rate_cell_on_the_in_process_server_waits_out_each_api_server_time_and_ends() -> None:
    """An open loop of 20 requests on the server a client measures in this process, on its virtual clock: each
    request that finds the engine idle is seated its request_s after it arrived, and the cell ends. (The driver
    once slept until that instant, woke a rounding error before it, and waited again with the virtual clock
    standing still: `make fidelity` hung on its first run.)"""
    _, with_api = _configs()
    launch = simulated.start(load_profile("h200")[0], {}, seed=0)
    spec = CellSpec(phase="rate", context_tokens=512, max_tokens=8, request_rate=5.0, duration_s=4.0,
                    arrival="constant")
    with simulated.SimulatedServer(with_api, with_api.memory(), launch.facts) as server:
        cell = server.call(Measurer(server.target()).run_cell(spec))
    assert cell.status == "Valid" and len(cell.records) == 20, cell.reasons
    plain = replay.run_cell(with_api, CellSpec(phase="prefill", context_tokens=512)).ttft_s
    assert plain is not None
    # 0.2 s apart, each alone on the engine: every first token the lone request's, request_s included.
    assert all(r.ttft_s == pytest.approx(plain, rel=1e-6) for r in cell.records), [r.ttft_s for r in cell.records]
