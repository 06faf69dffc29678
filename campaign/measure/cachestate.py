"""The prefix cache's state before an open-loop step, brought about and checked rather than assumed.

A trace's replay (and any rate cell) is judged on the hits the server's prefix cache served beside the hits the
trace implies, so what the cache held when the step began must be known. vLLM empties its prefix cache on
`POST /reset_prefix_cache`, served only when the server runs with VLLM_SERVER_DEV_MODE=1. Its answer varies by
version: 200 with an empty body (older), `{"success": false}` while a request holds blocks (0.32 here), or 409
("Prefix cache reset failed") in some builds; a refusal is tried again, and 200 is never taken on its word.

The check: a canary prompt of whole KV blocks is sent twice before the reset. The second send must be served
from the cache (the counter moves): the canary is cacheable and the counter works, or nothing can be checked
(prefix caching off, or KV blocks larger than the canary), and the state says so. After the reset the canary is
sent again: a reset that held leaves nothing for it to find. One that answered success and served it anyway is
tried again, then a finding of the step (CACHE_NOT_RESET), never a silently warm cache.

Only a server this tool launched is reset: `campaign probe` measures servers others use, whose cache is theirs.
Where the cache is not reset, the step's prompts still start with blocks no earlier request sent (each cell's
salt is fresh), so nothing an earlier step cached can be served to them; the state says so.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field

RESET_PATH = "/reset_prefix_cache"
RESET_TRIES = 3          # a refused reset, or one the canary saw fail, is tried again (vLLM's own advice)
RESET_WAIT_S = 0.5       # between tries: a drained step's last blocks are released within an engine step or two
CANARY_BLOCKS = 2        # whole KV blocks in the canary prompt (and one token more, which is always computed)
ABSENT = frozenset({401, 403, 404, 405})   # not served here (no dev mode; a proxy or key that keeps it out)

Method = Literal["reset", "unique-prompts"]
NOT_SERVED = "the server does not serve POST /reset_prefix_cache: vLLM does with VLLM_SERVER_DEV_MODE=1"
NOT_LAUNCHED = "a server this tool did not launch: its cache is its users'"


class CacheState(BaseModel):
    """What the prefix cache held when a step began, and how that was known (format 14)."""

    model_config = ConfigDict(extra="forbid")
    method: Method = Field(
        description="reset: emptied through POST /reset_prefix_cache; unique-prompts: not reset (the server does "
                    "not expose it, or this tool did not launch it), the step's prompts sharing no block with "
                    "anything sent before")
    why_not_reset: str | None = Field(
        default=None, description="for unique-prompts: why there was no reset (absent, unreachable, not launched)")
    reset_answer: bool | None = Field(
        default=None, description="whether the server's last answer to the reset was a success (200, and not "
                                  "success false); None: not asked")
    reset_tries: int = Field(default=0, description="reset requests sent (a refused or failed one is tried again)")
    endpoint_status: int | None = Field(
        default=None, description="the HTTP status of the reset's last answer, where it was not 200")
    canary_tokens: int | None = Field(
        default=None, description="prompt tokens of the canary, sent twice before the reset and again after it")
    canary_cached: float | None = Field(
        default=None, description="prompt tokens of the canary's second send served from the cache (the server's "
                                  "hit counter): above 0, the check can tell; None: a send failed")
    canary_hits: float | None = Field(
        default=None, description="prompt tokens of the canary served from the cache after the (last) reset: 0 "
                                  "when it held; None: not checked")

    @property
    def checked(self) -> bool:
        return self.method == "reset" and bool(self.canary_cached) and self.canary_hits is not None

    @property
    def problem(self) -> str | None:
        """Why the cache was not left empty, where a reset was asked for; None when it was (or not asked)."""
        if self.method != "reset":
            return None
        if not self.reset_answer:
            said = f"HTTP {self.endpoint_status}" if self.endpoint_status else "success false"
            return (f"the server refused to reset its prefix cache {self.reset_tries} time(s) ({said}; vLLM refuses "
                    "while any request holds blocks): the step began with whatever the cache held")
        if self.checked and self.canary_hits:
            return (f"the server said it reset its prefix cache ({self.reset_tries} time(s)), but then served "
                    f"{self.canary_hits:.0f} of {self.canary_tokens} prompt tokens of a prompt sent before the reset "
                    "from it")
        return None

    def note(self) -> str:
        if self.method == "unique-prompts":
            return (f"prefix cache not reset ({self.why_not_reset}): every prompt of the step begins with blocks no "
                    "earlier request sent, so nothing cached before could be served to it")
        if self.problem is not None:
            return f"prefix cache: {self.problem}"
        if self.checked:
            return (f"prefix cache emptied before the step (POST /reset_prefix_cache) and checked: a prompt the cache "
                    f"served {self.canary_cached:.0f} tokens of before the reset found nothing after it")
        if self.canary_cached is None:
            why = "a canary request before the reset failed"
        elif not self.canary_cached:
            why = ("the canary was not served from the cache even before the reset (prefix caching off, or KV "
                   f"blocks longer than its {self.canary_tokens} tokens)")
        else:
            why = "the canary request after the reset failed"
        return f"prefix cache emptied before the step (POST /reset_prefix_cache), not checked: {why}"


async def bring_to_empty(control: httpx.AsyncClient, canary: Callable[[], Awaitable[float | None]], *,
                         tokens: int, available: bool | None,
                         sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> CacheState:
    """Empty the server's prefix cache and check it. `canary()` sends the canary prompt (the same `tokens`
    tokens each call) and returns the prefix-cache hits the server's counter moved by (None: the request
    failed). `available`: what an earlier call learnt of the endpoint (False: absent, so not asked again)."""
    if available is False:
        return CacheState(method="unique-prompts", why_not_reset=NOT_SERVED)
    first = await canary()   # cached now ...
    cached = await canary() if first is not None else None   # ... and served from the cache: checkable
    state = CacheState(method="reset", canary_tokens=tokens, canary_cached=cached)
    for tries in range(1, RESET_TRIES + 1):
        if tries > 1:
            await sleep(RESET_WAIT_S)
        state.reset_tries = tries
        try:
            response = await control.post(RESET_PATH)
        except httpx.HTTPError as exc:   # a proxy that drops the path, or a server gone: no reset to be had
            return CacheState(method="unique-prompts", why_not_reset=f"POST /reset_prefix_cache failed: {exc!r}")
        if response.status_code in ABSENT:
            return CacheState(method="unique-prompts", endpoint_status=response.status_code,
                              why_not_reset=f"POST /reset_prefix_cache answered HTTP {response.status_code}: vLLM "
                                            "serves it with VLLM_SERVER_DEV_MODE=1")
        if response.status_code != 200:   # 409 or a 5xx: refused this time
            state.reset_answer, state.endpoint_status = False, response.status_code
            continue
        state.endpoint_status = None
        try:
            body = response.json() if response.content else {}
        except ValueError:
            body = {}
        state.reset_answer = bool(body.get("success", True)) if isinstance(body, dict) else True
        if not state.reset_answer:
            continue
        state.canary_hits = await canary() if cached else None
        if not state.canary_hits:   # held (0), or nothing to check it with (None)
            break
    return state
