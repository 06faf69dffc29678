"""One streamed /v1/completions request -> one raw RequestRecord. Never retried.

Events arrive from streamclient already split; the only JSON work per event is finding the cumulative
`completion_tokens` of vLLM's continuous usage stats, because a chunk is not a token (speculative decoding
puts several in one). Every chunk carries the monotonic time its bytes arrived.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from campaign.streamclient import StreamClient, StreamError

_COMPLETION_KEY = b'"completion_tokens":'
_PROMPT_KEY = b'"prompt_tokens":'
_DONE = b"data: [DONE]"
# vLLM >= 0.32 lowers max_tokens to fit the context window; with min_tokens = max_tokens that surfaces as
# a 400 naming the clamped value instead of a silently short reply.
_CLAMP_ERROR = re.compile(r"min_tokens must be less than or equal to max_tokens=(\d+)")


@dataclass(slots=True, kw_only=True)
class RequestRecord:
    """The truth about one request. Times are `time.perf_counter()` seconds; derived values are None if undefined."""

    id: str
    prompt_tokens: int
    max_tokens: int
    send_t: float
    chunk_t: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    end_t: float | None = None
    status: int | None = None
    error: str | None = None
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    cancelled: bool = False

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and not self.cancelled

    @property
    def tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_t[0] - self.send_t if self.chunk_t else None

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first chunk over the time from first to last chunk: the speed a reader sees."""
        if len(self.chunk_t) < 2:
            return None
        span = self.chunk_t[-1] - self.chunk_t[0]
        return (self.tokens - self.chunk_tokens[0]) / span if span > 0 else None

    @property
    def short(self) -> bool:
        """Fewer completion tokens than asked for: vLLM >= 0.32 silently clamps at the context window."""
        done = self.usage_completion_tokens if self.usage_completion_tokens is not None else self.tokens
        return self.ok and done < self.max_tokens

    @property
    def clamped_to(self) -> int | None:
        """The reply length the server cut this request to, when it did (silently or through min_tokens)."""
        if self.short:
            return self.usage_completion_tokens if self.usage_completion_tokens is not None else self.tokens
        match = _CLAMP_ERROR.search(self.error or "")
        return int(match.group(1)) if match else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(**data)


def completion_body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


def _int_after(event: bytes, key: bytes) -> int | None:
    at = event.rfind(key)
    if at < 0:
        return None
    start = at + len(key)
    while start < len(event) and event[start] == 0x20:
        start += 1
    end = start
    while end < len(event) and 0x30 <= event[end] <= 0x39:
        end += 1
    return int(event[start:end]) if end > start else None


def new_client(*, max_streams: int, api_key: str | None = None, read_timeout_s: float = 600.0,
               base_url: str = "") -> StreamClient:
    """The one shared client of a measurement. Connections are opened as streams need them (no pool limit:
    `max_streams` is documentation of intent) and kept alive; timeouts are explicit."""
    return StreamClient(base_url, api_key=api_key, read_timeout_s=read_timeout_s)


async def stream_completion(
    client: StreamClient, *, model: str, prompt: list[int], max_tokens: int, request_id: str,
    path: str = "/v1/completions", first_token: asyncio.Event | None = None,
) -> RequestRecord:
    """Stream one request to its end. `first_token` (if given) is set when the first token arrives."""
    record = RequestRecord(id=request_id, prompt_tokens=len(prompt), max_tokens=max_tokens,
                           send_t=time.perf_counter())
    seen = 0

    def on_event(now: float, event: bytes) -> None:
        nonlocal seen
        if event.startswith(_DONE):
            return
        total = _int_after(event, _COMPLETION_KEY)
        if total is None:
            if b'"error"' in event:
                record.error = _error_message(event.removeprefix(b"data: ")) or "stream error"
            return
        if record.usage_prompt_tokens is None:
            record.usage_prompt_tokens = _int_after(event, _PROMPT_KEY)
        record.usage_completion_tokens = total
        if total > seen:
            if first_token is not None and not record.chunk_t:
                first_token.set()
            record.chunk_t.append(now)
            record.chunk_tokens.append(total - seen)
            seen = total

    try:
        status, body = await client.post_stream(path, completion_body(model, prompt, max_tokens), on_event)
        record.status = status
        if status != 200:
            record.error = _error_message(body) or f"HTTP {status}"
    except asyncio.CancelledError:
        record.cancelled = True
        record.end_t = time.perf_counter()
        raise
    except StreamError as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    record.end_t = time.perf_counter()
    return record


def _error_message(raw: bytes) -> str | None:
    try:
        data = json.loads(raw)
    except ValueError:
        return raw[:300].decode("utf-8", "replace") or None
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))[:500]
    if isinstance(error, str):
        return error[:500]
    return str(data)[:500]
