"""The prefix cache's state before an open-loop step, against a fake server whose answers the test sets: the
reset endpoint absent (404, a proxy's 403, a dropped connection), refused while blocks are held (success false,
409), or answering success; the canary's hits before and after it. And the plan's word on dev mode."""

from __future__ import annotations

import asyncio

import httpx

from campaign.measure import cachestate
from campaign.measure.cachestate import CacheState
from campaign.night.orchestrate import preflight
from campaign.plan import limits
from campaign.server.profiles import load_profile
from campaign.sim.blocks import BlockManager


def _run(answers: list[httpx.Response], canary_hits: list[float | None], *,
         available: bool | None = None) -> tuple[CacheState, list[str], list[float]]:
    calls: list[str] = []
    slept: list[float] = []
    replies = iter(answers)

    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(f"{request.method} {request.url.path}")
        return next(replies)

    hits = iter(canary_hits)

    async def canary() -> float | None:
        calls.append("canary")
        return next(hits)

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    async def go() -> CacheState:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle), base_url="http://server") as control:
            return await cachestate.bring_to_empty(control, canary, tokens=33, available=available, sleep=sleep)

    return asyncio.run(go()), calls, slept


OK = httpx.Response(200, json={"success": True})


def test_a_reset_that_holds_is_checked_by_a_canary_served_from_the_cache_before_it_and_not_after() -> None:
    state, calls, _ = _run([OK], [0.0, 32.0, 0.0])
    assert calls == ["canary", "canary", "POST /reset_prefix_cache", "canary"]
    assert state == CacheState(method="reset", reset_answer=True, reset_tries=1, canary_tokens=33,
                               canary_cached=32.0, canary_hits=0.0)
    assert state.checked and state.problem is None
    assert state.note().startswith("prefix cache emptied before the step (POST /reset_prefix_cache) and checked: a "
                                   "prompt the cache served 32 tokens of before the reset found nothing after it")


def test_a_server_without_the_endpoint_is_asked_once_and_its_prompts_stand_on_their_fresh_salt() -> None:
    state, calls, _ = _run([httpx.Response(404, json={"detail": "Not Found"})], [0.0, 32.0])
    assert state.method == "unique-prompts" and state.problem is None and state.endpoint_status == 404
    assert "VLLM_SERVER_DEV_MODE=1" in state.note()
    # What the first cell learnt is passed on: the next cell asks nothing and sends no canary.
    again, calls, _ = _run([], [], available=False)
    assert again.method == "unique-prompts" and calls == [] and "VLLM_SERVER_DEV_MODE=1" in again.note()


def test_a_proxy_that_refuses_or_drops_the_path_leaves_the_fresh_salt_and_says_what_it_answered() -> None:
    state, _, _ = _run([httpx.Response(403, text="forbidden")], [0.0, 32.0])
    assert state.method == "unique-prompts" and state.endpoint_status == 403
    assert "answered HTTP 403" in state.note()

    def handle(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("the proxy closed the connection")

    async def canary() -> float | None:
        return 0.0

    async def go() -> CacheState:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle), base_url="http://server") as control:
            return await cachestate.bring_to_empty(control, canary, tokens=33, available=None)

    dropped = asyncio.run(go())
    assert dropped.method == "unique-prompts" and "the proxy closed the connection" in dropped.note()


def test_a_canary_the_cache_never_served_or_that_failed_leaves_the_reset_unchecked_and_says_why() -> None:
    uncacheable, calls, _ = _run([OK], [0.0, 0.0])
    assert calls == ["canary", "canary", "POST /reset_prefix_cache"]   # nothing to check with: no third send
    assert not uncacheable.checked and uncacheable.problem is None
    assert "not served from the cache even before the reset" in uncacheable.note()
    failed_first, calls, _ = _run([OK], [None])
    assert calls == ["canary", "POST /reset_prefix_cache"] and failed_first.canary_cached is None
    assert failed_first.note().endswith("not checked: a canary request before the reset failed")
    failed_after, _, _ = _run([OK], [0.0, 32.0, None])
    assert failed_after.problem is None and failed_after.note().endswith("the canary request after the reset failed")


def test_a_reset_refused_while_blocks_are_held_is_tried_again_then_stands_as_a_problem() -> None:
    refused = httpx.Response(200, json={"success": False})
    conflict = httpx.Response(409, json={"error": "Prefix cache reset failed."})
    state, calls, slept = _run([refused, conflict, refused], [0.0, 32.0])
    assert calls == ["canary", "canary"] + ["POST /reset_prefix_cache"] * cachestate.RESET_TRIES
    assert slept == [cachestate.RESET_WAIT_S] * (cachestate.RESET_TRIES - 1)   # none after the last
    assert state.reset_answer is False and state.canary_hits is None
    assert state.problem is not None and state.problem.startswith(
        "the server refused to reset its prefix cache 3 time(s) (success false; vLLM refuses")
    # A 409 last: said as such.
    state, _, _ = _run([refused, refused, conflict], [0.0, 32.0])
    assert state.problem is not None and "(HTTP 409;" in state.problem
    # Refused once, then done: the cache is checked as usual.
    state, _, slept = _run([conflict, OK], [0.0, 32.0, 0.0])
    assert state.reset_tries == 2 and state.checked and state.problem is None and slept == [cachestate.RESET_WAIT_S]


def test_a_reset_that_answers_success_but_serves_the_canary_is_tried_again_then_a_problem_naming_the_tokens() -> None:
    state, calls, _ = _run([OK, OK, OK], [0.0, 32.0, 32.0, 32.0, 32.0])
    assert calls.count("POST /reset_prefix_cache") == 3 and calls.count("canary") == 5
    assert state.problem == ("the server said it reset its prefix cache (3 time(s)), but then served 32 of 33 "
                             "prompt tokens of a prompt sent before the reset from it")
    assert state.note() == f"prefix cache: {state.problem}"
    # Once more and it held: the cell stands on the reset that did.
    state, _, _ = _run([OK, OK], [0.0, 32.0, 32.0, 0.0])
    assert state.reset_tries == 2 and state.checked and state.problem is None


def test_an_older_vllm_that_answers_200_with_no_body_is_checked_all_the_same() -> None:
    state, _, _ = _run([httpx.Response(200)] * 3, [0.0, 16.0, 16.0, 16.0, 16.0])
    assert state.reset_answer is True and state.problem is not None


def test_the_simulators_reset_forgets_every_cached_block_and_is_refused_while_one_is_held() -> None:
    """vLLM's rule, in the simulator's block manager: a held block refuses the reset; after it, nothing cached
    is found and every block is free."""
    blocks = BlockManager(8, 4, prefix_caching=True)
    prompt = list(range(100, 109))          # two full blocks and a token
    held: list[int] = []
    assert blocks.grow(held, len(prompt))
    blocks.register(blocks.hashes(prompt), held)
    assert not blocks.reset()               # a running request holds its blocks
    blocks.release(held)
    assert blocks.reset()
    assert blocks.cached_prefix(prompt) == [] and blocks.used == 0
    taken: list[int] = []
    assert blocks.grow(taken, 8 * 4)        # all eight blocks free again


def test_dev_mode_on_a_server_that_listens_beyond_this_machine_is_a_plan_warning() -> None:
    """The shipped profiles set VLLM_SERVER_DEV_MODE (so a cell can reset the prefix cache) on 127.0.0.1. Set to
    serve the network, the plan says that dev endpoints answer anyone, API key or not; on loopback, or without
    dev mode, nothing."""
    profile, path = load_profile("h200")
    assert profile.env.get("VLLM_SERVER_DEV_MODE") == "1" and profile.host == "127.0.0.1"
    assert limits.dev_mode_exposed(profile, path) == []
    exposed = profile.model_copy(update={"host": "0.0.0.0"})
    (notice,) = limits.dev_mode_exposed(exposed, path)
    assert notice.code == limits.PlanWarning.DEV_MODE_EXPOSED
    assert notice.line() == (f"warning: {path}: env: VLLM_SERVER_DEV_MODE with host 0.0.0.0: vLLM's dev endpoints "
                             "(/reset_prefix_cache, /sleep, /collective_rpc) answer anyone who reaches the port, API "
                             f"key or not ({limits.HINTS[limits.PlanWarning.DEV_MODE_EXPOSED]})")
    assert notice in preflight(exposed, path, "sim").warnings
    quiet = exposed.model_copy(update={"env": {k: v for k, v in exposed.env.items() if k != "VLLM_SERVER_DEV_MODE"}})
    assert limits.dev_mode_exposed(quiet, path) == []
