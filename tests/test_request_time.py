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


def test_a_busy_engine_steps_on_while_a_new_request_is_with_the_api_server() -> None:
    """One request decoding, another arriving mid-stream: the first's tokens keep their pace (its steps do not
    wait for the second), and the second is seated in the first step that begins after its time with the API
    server is over."""
    without, with_api = _configs()
    load = [Sent(0.0, 512, 64), Sent(0.2, 512, 8)]
    (first_plain, _), (first, second) = (arrivals.run_load(c, load, c.costs)[0] for c in (without, with_api))
    assert first_plain is not None and first is not None and second is not None and second.admitted is not None
    gaps = [b[0] - a[0] for a, b in zip(first.emits, first.emits[1:], strict=False)]
    plain_gaps = [b[0] - a[0] for a, b in zip(first_plain.emits, first_plain.emits[1:], strict=False)]
    assert max(gaps[:5]) == pytest.approx(max(plain_gaps[:5]), rel=1e-9)   # before the second is seated
    assert second.admitted >= 0.2 + REQUEST_S
    emitted = [t for t, _ in first.emits]
    assert any(0.2 < t < 0.2 + REQUEST_S for t in emitted)   # the first streamed on meanwhile
    assert second.admitted == min(t for t in emitted if t >= 0.2 + REQUEST_S)   # seated in the next step
