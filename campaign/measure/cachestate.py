"""The prefix cache's state before an open-loop step, brought about and checked rather than assumed.

A trace's replay (and any rate cell) is judged on the hits the server's prefix cache served beside the hits the
trace implies, so what the cache held when the step began must be known. vLLM empties its prefix cache on
`POST /reset_prefix_cache` (served only when the server runs with VLLM_SERVER_DEV_MODE=1); it answers
`{"success": false}` while any block is still held by a running request, and callers may retry. The check: a
canary prompt of whole KV blocks is sent before the reset and again after it. A reset that held leaves nothing
for the second send to find (the server's hit counter does not move); one that answered success but served the
canary from its cache is a finding of the step (CACHE_NOT_RESET), never a silently warm cache.

Where the server does not expose the reset, the step's prompts still start with blocks no earlier request sent
(each cell's salt is fresh), so nothing an earlier step cached can be served to them; the state says so.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field

RESET_PATH = "/reset_prefix_cache"
RESET_TRIES = 3          # a reset refused while blocks are held is tried again (vLLM's own advice)
RESET_WAIT_S = 0.5       # between tries: a drained step's last blocks are released within an engine step or two
CANARY_BLOCKS = 2        # whole KV blocks in the canary prompt (and one token more, which is always computed)


class CacheState(BaseModel):
    """What the prefix cache held when a step began, and how that was known (format 14)."""

    model_config = ConfigDict(extra="forbid")
    method: Literal["reset", "unique-prompts"] = Field(
        description="reset: emptied through POST /reset_prefix_cache and checked with a canary; unique-prompts: "
                    "not reset (the server does not expose it), the step's prompts sharing no block with "
                    "anything sent before")
    reset_answer: bool | None = Field(
        default=None, description="the server's last `success` answer to the reset; None: not reset")
    endpoint_status: int | None = Field(
        default=None, description="what the server (or a proxy before it) answered a reset it does not serve: "
                                  "its HTTP status; None where it answered 200, or the connection failed")
    reset_tries: int = Field(default=0, description="reset requests sent (a refused one is tried again)")
    canary_tokens: int | None = Field(
        default=None, description="prompt tokens of the canary sent before the reset and again after it")
    canary_hits: float | None = Field(
        default=None, description="prompt tokens of the canary's second send that the server's prefix cache "
                                  "served (its hit counter); 0 when the reset held; None: not checked (no "
                                  "reset, or the canary request failed)")

    @property
    def problem(self) -> str | None:
        """Why the cache was not left empty, where a reset was asked for; None when it was (or not asked)."""
        if self.method != "reset":
            return None
        if not self.reset_answer:
            return (f"the server refused to reset its prefix cache {self.reset_tries} time(s) (vLLM refuses while "
                    "any request holds blocks): the step began with whatever the cache held")
        if self.canary_hits:
            return (f"the server said it reset its prefix cache, but then served {self.canary_hits:.0f} of "
                    f"{self.canary_tokens} prompt tokens of a prompt sent before the reset from it")
        return None

    def note(self) -> str:
        if self.method == "unique-prompts":
            answered = f", it answered HTTP {self.endpoint_status}" if self.endpoint_status else ""
            return (f"prefix cache not reset (the server does not expose POST /reset_prefix_cache{answered}; vLLM "
                    "serves it with VLLM_SERVER_DEV_MODE=1): every prompt of the step begins with blocks no earlier "
                    "request sent, so nothing cached before could be served to it")
        if self.problem is None and self.canary_hits is None:
            return ("prefix cache emptied before the step (POST /reset_prefix_cache), not checked: the canary "
                    "request failed")
        if self.problem is None:
            return ("prefix cache emptied before the step (POST /reset_prefix_cache) and checked: a prompt sent "
                    "before the reset found nothing cached after it")
        return f"prefix cache: {self.problem}"


async def bring_to_empty(control: httpx.AsyncClient, canary: Callable[[], Awaitable[float | None]], *,
                         tokens: int, available: bool | None,
                         sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> CacheState:
    """Empty the server's prefix cache and check it. `canary()` sends the canary prompt (the same `tokens`
    tokens each call) and returns the prefix-cache hits the server's counter moved by (None: no counter).
    `available`: what an earlier call learnt of the endpoint (False: not exposed, so not asked again)."""
    if available is False:
        return CacheState(method="unique-prompts")
    await canary()  # cached now, so that a reset that does nothing shows
    answer: bool | None = None
    tries = 0
    while tries < RESET_TRIES:
        tries += 1
        try:
            response = await control.post(RESET_PATH)
        except httpx.HTTPError:  # a proxy that drops the path: no reset to be had, as with a 404
            return CacheState(method="unique-prompts")
        if response.status_code != 200:  # 404 without dev mode; a proxy's 403 or 502: not served either way
            return CacheState(method="unique-prompts", endpoint_status=response.status_code)
        try:
            body = response.json() if response.content else {}
        except ValueError:
            body = {}
        # vLLM before the `success` field answered 200 with an empty body: a success, checked below all the same.
        answer = bool(body.get("success", True)) if isinstance(body, dict) else True
        if answer:
            break
        await sleep(RESET_WAIT_S)
    hits = await canary() if answer else None
    return CacheState(method="reset", reset_answer=answer, reset_tries=tries, canary_tokens=tokens,
                      canary_hits=hits)
