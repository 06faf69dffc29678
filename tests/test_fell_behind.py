"""Issue 52 item 7: a load that overloads the server is reported as the server's queue (where it fell behind the
arrivals, how long requests waited), not as the client's timeouts. In simulated time (the Measurer against the
simulator in this process), beside the engine's own records: its steps' queue and each request's wait."""

from __future__ import annotations

from pathlib import Path

import pytest

from campaign.core import stats
from campaign.measure import simulated, slo, traces
from campaign.measure.cells import CAVEATS, CellResult, CellSpec, Reason
from campaign.measure.figures import fell_behind
from campaign.measure.runner import SAMPLE_EVERY_S, Measurer
from campaign.server.profiles import load_profile
from campaign.sim import truth as sim_truth

SPAN_S = 40.0
MOONCAKE = Path(__file__).parent.parent / "matrices" / "traces" / "mooncake-conversation-1k.jsonl"


def _measured(rate: float) -> tuple[CellResult, sim_truth.Recorder, float]:
    """A 40 s Poisson load of 1,024 + 128-token requests at `rate` on the simulated A5000 pair with 4 seats
    (about 0.6 requests a second served), with the engine's records and the loop time its clock began at."""
    profile, _ = load_profile("a5000-tp2")
    launch = simulated.start(profile, {"max-num-seqs": 4}, seed=0)
    recorder = sim_truth.Recorder()
    spec = CellSpec(phase="rate", context_tokens=1024, max_tokens=128, request_rate=rate, duration_s=SPAN_S)
    with launch.serve(truth=recorder) as server:
        cell = server.call(Measurer(server.target()).run_cell(spec))
        anchor = server.anchor
    return cell, recorder, anchor


def _mean_wait(cell: CellResult, recorder: sim_truth.Recorder) -> float:
    """The engine's mean wait for a seat over the cell's own requests (not the cache check before them)."""
    mine = {r.server_id for r in cell.records}
    waits = [(r.admitted or r.arrival) - r.arrival for r in recorder.requests if r.id in mine]
    assert len(waits) == len(cell.records)
    return stats.mean(waits) or 0.0


def test_an_overloaded_rate_is_the_servers_queue_with_the_engines_own_numbers() -> None:
    """Three requests a second against a server that serves about 0.6: every request is served (none timed
    out: the queue moves), the cell is Valid with the caveat `server_fell_behind`, and its figures are the
    engine's: when the queue began to grow for good (the same rule on the engine's steps, within one of the
    gauge's samples), the queue at the schedule's end, and the mean wait for a seat (vLLM's queue-time
    histogram against each request's own wait)."""
    cell, recorder, anchor = _measured(3.0)
    assert cell.status == "Valid" and cell.reason_codes == [Reason.SERVER_FELL_BEHIND], cell.reasons
    assert Reason.SERVER_FELL_BEHIND in CAVEATS
    assert cell.records and all(r.ok for r in cell.records) and cell.completed == len(cell.records)
    assert cell.window is not None
    start = cell.window[0] - anchor
    steps = [(s.start, float(s.waiting)) for s in recorder.steps]
    truth = fell_behind(steps, start, start + SPAN_S)
    assert truth is not None and cell.fell_behind_s is not None
    assert abs(cell.fell_behind_s - (truth[0] - start)) <= SAMPLE_EVERY_S + 0.5, (cell.fell_behind_s, truth)
    # The gauge's last sample inside the schedule, up to one interval before its end.
    last = [w for t, w in steps if start + SPAN_S - SAMPLE_EVERY_S - 0.5 <= t <= start + SPAN_S]
    assert cell.waiting_at_end is not None and min(last) <= cell.waiting_at_end <= max(last), (cell.waiting_at_end,
                                                                                                 last)
    assert cell.waiting_max is not None and cell.waiting_max <= max(w for _, w in steps)
    waited = cell.server_queue_mean_ms
    assert waited is not None and waited == pytest.approx(1000 * _mean_wait(cell, recorder), rel=1e-6)
    assert waited > 10_000   # seconds in the queue: the finding, not a timeout
    message = cell.reasons[0]
    assert message.startswith(f"the server fell behind the arrivals {cell.fell_behind_s:.1f} s into the 40 s "
                              "schedule: its queue grew from then on, to "), message
    assert f"{waited / 1000:.1f} s on average for a seat" in message


def test_a_rate_the_server_holds_carries_no_such_caveat() -> None:
    """A third of a request a second the same server holds: its queue empties between arrivals, so nothing
    says it fell behind, and its mean wait is the engine's (near zero)."""
    cell, recorder, _ = _measured(0.3)
    assert cell.status == "Valid" and Reason.SERVER_FELL_BEHIND not in cell.reason_codes, cell.reasons
    assert cell.fell_behind_s is None and cell.waiting_at_end is None
    assert cell.server_queue_mean_ms == pytest.approx(1000 * _mean_wait(cell, recorder), rel=1e-6, abs=1e-6)



def test_the_mooncake_slice_that_timed_out_is_served_and_read_as_the_servers_queue() -> None:
    """Issue 52's case: `a5000-trace`'s first 60 s of the shipped Mooncake excerpt on the simulated A5000 pair
    (its baseline flags) ended as "144 of 162 requests failed: idle timeout: no data for 60 s". With the
    client's default timeouts, every request is now served (the queue moves, so nobody is idle), and the cell
    says the server fell behind the arrivals, early, with a queue of over a hundred requests at the end and
    waits for a seat of many minutes: the engine's own, as above."""
    sliced, requests = traces.plan(MOONCAKE, duration_s=60)
    spec = CellSpec.from_trace(sliced, requests, slo=slo.parse("ttft_p90_ms=30000,tpot_p90_ms=100"))
    profile, _ = load_profile("a5000-tp2")
    launch = simulated.start(profile, {"gpu-memory-utilization": 0.90, "max-num-batched-tokens": 2048}, seed=0)
    recorder = sim_truth.Recorder()
    with launch.serve(truth=recorder) as server:
        cell = server.call(Measurer(server.target()).run_cell(spec))
    assert len(cell.records) == 162 and all(r.ok for r in cell.records)
    assert cell.status == "Valid" and cell.reason_codes == [Reason.SERVER_FELL_BEHIND], cell.reasons
    assert cell.fell_behind_s is not None and cell.fell_behind_s < 10
    assert cell.waiting_at_end is not None and cell.waiting_at_end > 100
    waited = cell.server_queue_mean_ms
    assert waited is not None and waited == pytest.approx(1000 * _mean_wait(cell, recorder), rel=1e-6)
    assert waited > 60_000
