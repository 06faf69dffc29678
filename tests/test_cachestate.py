"""The prefix cache's state before an open-loop step, against a fake server whose answers the test sets: the
reset endpoint absent (404), refused while blocks are held, or answering success; the canary's hits after it."""

from __future__ import annotations

import asyncio

import httpx

from campaign.measure import cachestate
from campaign.measure.cachestate import CacheState
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


def test_a_reset_that_holds_is_checked_by_a_canary_sent_before_and_after_it() -> None:
    state, calls, _ = _run([httpx.Response(200, json={"success": True})], [0.0, 0.0])
    assert calls == ["canary", "POST /reset_prefix_cache", "canary"]
    assert state == CacheState(method="reset", reset_answer=True, reset_tries=1, canary_tokens=33, canary_hits=0.0)
    assert state.problem is None and state.note().startswith("prefix cache emptied before the step")


def test_a_server_without_the_endpoint_is_asked_once_and_its_prompts_stand_on_their_fresh_salt() -> None:
    state, calls, _ = _run([httpx.Response(404, json={"detail": "Not Found"})], [0.0])
    assert state.method == "unique-prompts" and state.problem is None
    assert "VLLM_SERVER_DEV_MODE=1" in state.note()
    # What the first cell learnt is passed on: the next cell asks nothing and sends no canary.
    again, calls, _ = _run([], [], available=False)
    assert again.method == "unique-prompts" and calls == []


def test_a_proxy_that_refuses_or_drops_the_path_leaves_the_fresh_salt_and_says_what_it_answered() -> None:
    state, calls, _ = _run([httpx.Response(403, text="forbidden")], [0.0])
    assert state == CacheState(method="unique-prompts", endpoint_status=403)
    assert "it answered HTTP 403" in state.note()
    dropped = httpx.ConnectError("the proxy closed the connection")

    def handle(request: httpx.Request) -> httpx.Response:
        raise dropped

    async def canary() -> float | None:
        return 0.0

    async def go() -> CacheState:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle), base_url="http://server") as control:
            return await cachestate.bring_to_empty(control, canary, tokens=33, available=None)

    assert asyncio.run(go()) == CacheState(method="unique-prompts")


def test_a_canary_that_failed_leaves_the_reset_unchecked_and_says_so() -> None:
    state, _, _ = _run([httpx.Response(200, json={"success": True})], [0.0, None])
    assert state.problem is None and state.canary_hits is None
    assert state.note().endswith("not checked: the canary request failed")


def test_a_reset_refused_while_blocks_are_held_is_tried_again_then_stands_as_a_problem() -> None:
    refused = httpx.Response(200, json={"success": False})
    state, calls, slept = _run([refused, refused, refused], [0.0])
    assert calls == ["canary"] + ["POST /reset_prefix_cache"] * cachestate.RESET_TRIES
    assert slept == [cachestate.RESET_WAIT_S] * cachestate.RESET_TRIES
    assert state.reset_answer is False and state.canary_hits is None
    assert state.problem is not None and state.problem.startswith("the server refused to reset its prefix cache 3")
    # Refused once, then done: the cache is checked as usual.
    state, _, slept = _run([refused, httpx.Response(200, json={"success": True})], [0.0, 0.0])
    assert state.reset_tries == 2 and state.problem is None and slept == [cachestate.RESET_WAIT_S]


def test_a_reset_that_answers_success_but_serves_the_canary_is_a_problem_naming_the_tokens() -> None:
    state, _, _ = _run([httpx.Response(200, json={"success": True})], [0.0, 32.0])
    assert state.problem == ("the server said it reset its prefix cache, but then served 32 of 33 prompt tokens "
                             "of a prompt sent before the reset from it")
    assert state.note() == f"prefix cache: {state.problem}"


def test_an_older_vllm_that_answers_200_with_no_body_is_checked_all_the_same() -> None:
    state, _, _ = _run([httpx.Response(200)], [0.0, 16.0])
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
