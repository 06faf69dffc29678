"""Issue 50: an experiment whose premise the client did not deliver (a burst whose sends did not leave together)
is measured again, then stands Invalid with a typed reason, and the diff never judges it; a client reading that
the server's own gauges contradict says so instead of standing beside them."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from campaign.analysis.verdicts import _experiment_diffs
from campaign.http import streamclient
from campaign.http.client import RequestRecord, new_client
from campaign.measure import study
from campaign.measure.cells import Reason
from campaign.measure.figures import max_in_flight
from campaign.measure.runner import Target
from campaign.night.launcher import LaunchedServer, launched
from campaign.server.profiles import load_profile

TIME_SCALE = 5.0


def burst(n: int, *, spread_s: float, life_s: float, reply: int = 8) -> list[RequestRecord]:
    """n requests whose sends are spread evenly over `spread_s`, each living `life_s` from its send."""
    records = []
    for i in range(n):
        send = i * spread_s / max(1, n - 1)
        chunks = [send + life_s * (k + 1) / reply for k in range(reply)]
        records.append(RequestRecord(id=f"burst{i}", prompt_tokens=64, max_tokens=reply, send_t=send, status=200,
                                     usage_prompt_tokens=64, usage_completion_tokens=reply, chunk_t=chunks,
                                     chunk_tokens=[1] * reply, end_t=chunks[-1]))
    return records


def test_the_demos_burst_that_was_not_one_is_invalid_and_says_why() -> None:
    """The demo's small-cache launch 2 (issue 50): 80 sends over 3.6 s, the first request done before the
    second left, read "1 ran concurrently, 79 queued" as Valid beside gauges that saw up to 30 running and none
    waiting. Both are now findings of an Invalid experiment, its figures kept for the reader."""
    records = burst(80, spread_s=3.6, life_s=0.04)
    gauges = [(0.5 + 0.25 * i, 30.0 if i < 4 else 10.0, 0.0) for i in range(12)]
    result = study.overload_result(records, max_num_seqs=64, factor=1.25, wall_s=3.7, gauges=gauges, attempts=[])
    assert result.status == "Invalid"
    assert result.reason_codes == [Reason.SENDS_SPREAD, Reason.GAUGES_DISAGREE]
    assert "80 sends left over 3,600.0 ms" in result.reasons[0]
    assert ("saw 30 requests running at once where the client never had more than 1 in flight"
            in result.reasons[1])
    assert result.verdict.startswith("not measured: ") and "server gauges" not in result.verdict
    assert result.details["send_spread_s"] == pytest.approx(3.6) and result.details["first_life_s"] == 0.04
    assert result.values["ran_concurrently"] == 1.0   # kept as measured, never judged (status)


def test_a_burst_that_left_together_stands() -> None:
    """The baseline's burst of the same demo left within 1 ms: Valid, its spread stored (on a time-scaled
    server, in the hardware's seconds), and gauges that saw no more running than the client had in flight
    agree, though they saw more than the client counted as having run together (a chunked prefill)."""
    records = burst(80, spread_s=0.001, life_s=2.0)
    gauges = [(0.25 * i, 64.0, 16.0) for i in range(8)]
    records = [*records[:60], *(replace(r, chunk_t=[t + 2.5 for t in r.chunk_t], end_t=(r.end_t or 0) + 2.5)
                                for r in records[60:])]   # 20 of them start after the first request ended
    result = study.overload_result(records, max_num_seqs=64, factor=1.25, wall_s=2.0, gauges=gauges, attempts=[],
                                   time_scale=TIME_SCALE)
    assert result.status == "Valid" and result.reason_codes == [] and result.reasons == []
    assert result.values["ran_concurrently"] == 60 and result.values["peak_running"] == 64
    assert "the gauge counts requests still in their prefill as running, this reading as queued" in result.verdict
    assert max_in_flight(records) == 80

    assert result.details["send_spread_s"] == pytest.approx(0.001 * TIME_SCALE)
    assert result.details["first_life_s"] == pytest.approx(2.0 * TIME_SCALE)
    # Exactly at the limit still stands; just past it does not.
    at = study.spread_finding(0.1, 1.0, sends=2, what="the burst")
    past = study.spread_finding(0.1001, 1.0, sends=2, what="the burst")
    assert at is None and past is not None and past.code == Reason.SENDS_SPREAD


@pytest.fixture(scope="module")
def a5000(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedServer]:
    profile, _ = load_profile("a5000-tp2")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CAMPAIGN_SIM_TIME_SCALE", str(TIME_SCALE))
        with launched(profile, tmp_path_factory.mktemp("a5000") / "server.log", engine="sim") as server:
            yield server


def test_a_burst_read_through_a_stall_that_lost_the_servers_step_order_is_invalid() -> None:
    """Seen unloaded, on the real CPU build (max-num-seqs 64, 128 sent at once): "66 ran concurrently". The
    first 64 ended in one step and the next step seated the queued ones; the client, stalled, read both steps
    in one go and stamped two queued first tokens before the first request's last. No server runs more than
    its max-num-seqs at once: a reading above the launch's cap is Invalid with a typed reason (the burst is
    measured again, up to three times, as for a spread of its sends), never published as what ran."""
    records = burst(128, spread_s=0.001, life_s=2.0)
    queued = [replace(r, chunk_t=[t + 2.0 for t in r.chunk_t], end_t=(r.end_t or 0) + 2.0) for r in records[64:]]
    first_end = min(r.chunk_t[-1] for r in records[:64])
    stalled = [replace(r, chunk_t=[first_end - 1e-6, *r.chunk_t[1:]]) for r in queued[:2]]
    read = [*records[:64], *stalled, *queued[2:]]
    gauges = [(0.25 * i, 64.0, 64.0) for i in range(8)]

    def result(cap: int | None) -> study.ExperimentResult:
        return study.overload_result(read, max_num_seqs=64, factor=2.0, wall_s=4.0, gauges=gauges, attempts=[],
                                     server_cap=cap)

    assert result(None).status == "Valid" and result(None).values["ran_concurrently"] == 66   # the rule alone
    over = result(64)
    assert over.status == "Invalid" and over.reason_codes == [Reason.READS_UNORDERED]
    assert "read 66 first tokens before the first request's last, more than max-num-seqs (64)" in over.reasons[0]
    assert over.verdict.startswith("not measured: ")
    assert study.over_cap_finding(read, 64) is not None and study.over_cap_finding(records[:64] + queued, 64) is None



def late_sends(monkeypatch: pytest.MonkeyPatch, delay_s: float) -> list[str]:
    """Every request but each step's first leaves `delay_s` late: the client's host, stalled on purpose."""
    real: Callable[..., Awaitable[RequestRecord]] = study.stream_completion
    sent: list[str] = []

    async def delayed(*args: Any, request_id: str, **kwargs: Any) -> RequestRecord:
        if not request_id.endswith("0"):
            await asyncio.sleep(delay_s)
        sent.append(request_id)
        return await real(*args, request_id=request_id, **kwargs)

    monkeypatch.setattr(study, "stream_completion", delayed)
    return sent


def test_a_burst_the_client_delays_is_measured_again_then_invalid(
        a5000: LaunchedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over HTTP on the simulated A5000 pair: the burst's first request leaves at once, the others 0.5 s later,
    when the first has long finished (16 tokens). Each attempt is discarded for it and the burst sent again,
    three times; the experiment then stands Invalid with the typed reason and the last burst's spread."""
    target: Target = a5000.target()
    sent = late_sends(monkeypatch, 0.5)
    result = asyncio.run(study.overload(target, max_num_seqs=2, prompt_tokens=32, reply_tokens=16))
    assert len(sent) == 3 * 3   # three attempts of three requests each
    assert [a.code for a in result.attempts] == [Reason.SENDS_SPREAD] * 3
    assert not any(a.accepted for a in result.attempts) and result.discarded_steps == 3
    # The gauges may also have seen the two late requests run together where the client counted one.
    assert result.status == "Invalid" and result.reason_codes[0] == Reason.SENDS_SPREAD
    assert set(result.reason_codes) <= {Reason.SENDS_SPREAD, Reason.GAUGES_DISAGREE}
    assert result.details["send_spread_s"] >= 0.5 * TIME_SCALE
    assert len(result.requests) == 3   # the last burst, stored as measured


def test_a_prefix_order_arm_carries_the_spread_of_its_sends(
        a5000: LaunchedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefix order's arms carry how far apart their sends left, for the reader; unlike the overload burst's,
    its reading (hits and wall time per arm) does not rest on the sends leaving together, so it is not
    measured again for it."""
    target: Target = a5000.target()
    late_sends(monkeypatch, 0.5)
    result = asyncio.run(study.prefix_order(target, block_size=800, agents=2, shared_tokens=800, task_tokens=32,
                                            reply_tokens=8))
    assert result.status == "Valid" and result.reason_codes == [] and len(result.attempts) == 3
    for arm in result.details["arms"].values():
        assert arm["sends"] == 2 and arm["send_spread_s"] >= 0.5 * TIME_SCALE and arm["first_life_s"] > 0


def test_an_undelayed_burst_over_http_stands_with_its_spread(a5000: LaunchedServer) -> None:
    """The control: the same burst and arms, sent as the client sends them, are Valid, each with its spread.
    Replies of 64 tokens: a first request's life of about 0.3 s of wall time at 5x, so a tenth of it is ten
    times what a stall of a loaded host costs a send of three (each burst has three tries as well)."""
    target: Target = a5000.target()
    over = asyncio.run(study.overload(target, max_num_seqs=2, prompt_tokens=32, reply_tokens=64))
    assert over.status == "Valid", over.reasons
    assert over.details["send_spread_s"] <= study.SEND_SPREAD_SHARE * over.details["first_life_s"]
    order = asyncio.run(study.prefix_order(target, block_size=800, agents=2, shared_tokens=800, task_tokens=32,
                                           reply_tokens=64))
    assert order.status == "Valid", order.reasons
    assert all(arm["send_spread_s"] is not None for arm in order.details["arms"].values())


def test_the_diff_never_judges_a_burst_that_was_not_one(tmp_path: Path) -> None:
    """Three Valid bursts a side against three whose sends spread: nothing is judged from the Invalid side, and
    the diff says which side was not Valid and why."""
    good = study.overload_result(burst(80, spread_s=0.001, life_s=2.0), max_num_seqs=64, factor=1.25, wall_s=2.0,
                                 gauges=[], attempts=[])
    spread = study.overload_result(burst(80, spread_s=3.6, life_s=0.04), max_num_seqs=64, factor=1.25, wall_s=3.7,
                                   gauges=[], attempts=[])
    base = [good.model_dump(mode="json") for _ in range(3)]
    other = [spread.model_dump(mode="json") for _ in range(3)]
    (diff,) = _experiment_diffs(base, other, comparable=True)
    assert diff.variant_statuses == ["Invalid"] and diff.variant_reasons == [Reason.SENDS_SPREAD]
    assert diff.status_note == "variant: Invalid"
    for metric in diff.metrics:
        assert metric.n_variant == 0 and metric.verdict not in {"better", "worse", "no difference"}, metric


def test_a_burst_is_sent_over_connections_opened_before_it(a5000: LaunchedServer) -> None:
    """The burst's connections are opened before its sends are stamped, so the sends only write: against the
    real CPU build over TLS, a client host short of CPU once spread 128 sends over 2.4 s with a handshake each."""
    target: Target = a5000.target()

    async def burst() -> tuple[int, int, list[RequestRecord]]:
        async with new_client(target.endpoint) as client:
            await client.open_idle(3)
            opened = client.connections_opened
            records = await asyncio.gather(*(
                study.stream_completion(client, model=target.model, prompt=[11, 12, 13, 14], max_tokens=4,
                                        request_id=f"warm{i}") for i in range(3)))
            return opened, client.connections_opened, list(records)

    opened, after, records = asyncio.run(burst())
    assert opened == 3 and after == 3 and all(r.ok for r in records)


def test_a_repeated_burst_opens_fresh_connections_instead_of_counting_the_last_ones(a5000: LaunchedServer) -> None:
    """A burst measured again (its premise missed, or a second arm) finds the last burst's connections idle in
    the pool: they have carried a request, so they live 2 s. Counted as fresh, they expired before the sends on
    a loaded host (the real build, four CPU hogs), and 127 of 128 sends connected anew. open_idle replaces them:
    the sends only write, however long the host takes to reach them."""
    target: Target = a5000.target()

    async def bursts() -> tuple[int, int, list[RequestRecord]]:
        async with new_client(target.endpoint) as client:
            async def burst(name: str) -> list[RequestRecord]:
                return list(await asyncio.gather(*(
                    study.stream_completion(client, model=target.model, prompt=[11, 12, 13], max_tokens=2,
                                            request_id=f"{name}{i}") for i in range(3))))
            await client.open_idle(3)
            first = await burst("first")
            assert len(client._idle) == 3 and all(conn.used for conn in client._idle)
            await client.open_idle(3)
            opened = client.connections_opened
            for conn in client._idle:   # the loaded host's pause between open_idle and the sends
                conn.idle_since -= streamclient.POOL_IDLE_S + 0.5
            second = await burst("second")
            return opened, client.connections_opened, first + second

    opened, after, records = asyncio.run(bursts())
    assert opened == 6 and after == 6   # three for each burst, none inside the second
    assert all(r.ok for r in records)


def test_a_connection_opened_for_a_burst_is_not_stale_when_the_burst_is_slow_to_send(a5000: LaunchedServer) -> None:
    """A client short of CPU took over 2 s to send a 128-request burst: its last sends found their pre-opened
    connections older than the pool's 2 s, closed them and made a TLS handshake each inside the burst. A
    connection that has carried no request is kept (uvicorn times a connection out only after a response);
    one that has carried a request is still replaced after 2 s idle (the server's keep-alive may be running)."""
    target: Target = a5000.target()

    async def sends() -> tuple[int, int, int]:
        async with new_client(target.endpoint) as client:
            await client.open_idle(2)
            for conn in client._idle:   # the burst's 2.5 s of sending, as the client's clock sees it
                conn.idle_since -= 2.5
            first = await study.stream_completion(client, model=target.model, prompt=[11, 12, 13], max_tokens=2,
                                                  request_id="late")
            reused = client.connections_opened
            for conn in client._idle:
                conn.idle_since -= streamclient.POOL_IDLE_S + 0.5
            second = await study.stream_completion(client, model=target.model, prompt=[11, 12, 13],
                                                   max_tokens=2, request_id="after")
            assert first.ok and second.ok
            return reused, client.connections_opened, len(client._idle)

    reused, after, idle = asyncio.run(sends())
    assert reused == 2          # the late send went out on a pre-opened connection: no handshake
    # The used one, idle past 2 s, was closed; the other pre-opened one, unused, served the next send.
    assert after == 2 and idle == 1
