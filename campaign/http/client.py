"""One streamed /v1/completions or /v1/chat/completions request -> one raw RequestRecord. Never retried.

Events arrive from streamclient already split; a chunk is not a token (speculative decoding puts several in
one), so tokens come from vLLM's continuous usage stats: the cumulative `completion_tokens` in every chunk, found
without parsing the JSON. A server that sends no per-chunk usage (a gateway, an older vLLM, another
OpenAI-compatible server) is detected on its first chunk: then one token is counted per chunk that carries text
(or the chunk's `token_ids` where given), the record says so (`token_count="chunks"`), and the final usage, when
sent, still gives the exact total. Every chunk carries the monotonic time its bytes arrived.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from campaign.core import clock
from campaign.http.endpoint import Endpoint
from campaign.http.streamclient import StreamClient
from campaign.http.streams import Limits, StreamError, Streams

_COMPLETION_KEY = b'"completion_tokens":'
_UINT = re.compile(rb" *(\d+)")
_PROMPT_KEY = b'"prompt_tokens":'
_DONE = b"[DONE]"
# vLLM >= 0.32 lowers max_tokens to fit the context window; with min_tokens = max_tokens that surfaces as
# a 400 naming the clamped value instead of a silently short reply.
_CLAMP_ERROR = re.compile(r"min_tokens must be less than or equal to max_tokens=(\d+)")
# A chat chunk of reasoning (vLLM's reasoning parsers: `reasoning_content`, `reasoning` in newer versions),
# found without parsing the JSON: the key with a string value (inside a string a quote would be escaped).
_REASONING = re.compile(rb'"reasoning(?:_content)?":\s*"')

TokenCount = Literal["usage", "chunks"]


@dataclass(slots=True, kw_only=True)
class RequestRecord:
    """The truth about one request. Times are `clock.now()` seconds; derived values are None if undefined.
    `send_t` is when the request's bytes went to the socket (a request that failed before: when it began)."""

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
    # "usage": from continuous usage stats (exact per chunk); "chunks": one per text chunk (the server sent no
    # per-chunk usage; speculative decoding would be undercounted between chunks).
    token_count: TokenCount = "usage"
    error_kind: str | None = None   # StreamError.kind for transport failures, "http" for a non-200, "stream" else
    server_id: str | None = None    # the reply's `id` as the server named it (its logs, the simulator's truth)
    # Chat requests: tokens that arrived as reasoning (counted in `tokens` too); None for /v1/completions.
    reasoning_tokens: int | None = None
    # Open-loop requests (format 6): when the arrival schedule meant it to go, and when a cap on requests in
    # flight let it (the same without a cap); None for closed-loop requests.
    scheduled_t: float | None = None
    released_t: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and not self.cancelled

    @property
    def tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def completion_tokens(self) -> int:
        """What the server generated for this request: its final usage where sent, else the counted tokens."""
        return self.usage_completion_tokens if self.usage_completion_tokens is not None else self.tokens

    @property
    def counted_prompt_tokens(self) -> int:
        """Its prompt as the server counted it where its usage said (a chat template included), else as sent."""
        return self.usage_prompt_tokens if self.usage_prompt_tokens is not None else self.prompt_tokens

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
        # A shallow copy with the two lists copied: what asdict gives for these fields, without its deep copy
        # of every float (a fifth of a simulated-time night's run time went to asdict).
        return {name: list(value) if isinstance(value, list) else value
                for name, value in ((f, getattr(self, f)) for f in _RECORD_FIELDS)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(**data)  # records stored before token_count/error_kind existed take the defaults


_RECORD_FIELDS = tuple(f.name for f in fields(RequestRecord))


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


def chat_body(model: str, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    """The same request through the chat template (and the server's reasoning and tool-call parsers):
    vLLM takes ignore_eos and min_tokens on the chat endpoint too, so the reply is exactly max_tokens long."""
    body = completion_body(model, [], max_tokens)
    del body["prompt"]
    body["messages"] = messages
    return body


def _int_after(event: bytes, key: bytes) -> int | None:
    """The unsigned integer after the last `key` in `event` (spaces between skipped), or None. One regex match
    at the spot: the byte-by-byte loop it replaces was 2.8 of an 80 s profile of a5000-tuning in simulated
    time, where every token is an event."""
    at = event.rfind(key)
    if at < 0:
        return None
    digits = _UINT.match(event, at + len(key))
    return int(digits[1]) if digits else None


def _chunk_tokens(event: dict[str, Any]) -> int:
    """Tokens a chunk without usage carries: its token_ids where the server lists them, else 1 if it has text."""
    count = 0
    for choice in event.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            count += len(ids)
            continue
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            delta = {}
        if choice.get("text") or delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
            count += 1
    return count


def _reply_text(event: dict[str, Any]) -> str:
    """The answer text a chunk carries (chat `delta.content`, or a completion's `text`), reasoning left out:
    what a client puts back into the conversation."""
    out = []
    for choice in event.get("choices") or []:
        if isinstance(choice, dict):
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            text = delta.get("content") if delta else choice.get("text")
            if isinstance(text, str):
                out.append(text)
    return "".join(out)


def new_client(endpoint: Endpoint, *, limits: Limits | None = None) -> Streams:
    """The one shared client of a measurement: connections opened as streams need them and kept alive; for a
    server in this process (`endpoint.in_process`), its own client, which needs no socket."""
    if endpoint.in_process is not None:
        return endpoint.in_process.streams(endpoint, limits)
    return StreamClient(endpoint, limits=limits)


async def stream_completion(
    client: Streams, *, model: str, prompt: list[int], max_tokens: int, request_id: str,
    path: str = "/v1/completions", first_token: asyncio.Event | None = None,
    messages: list[dict[str, Any]] | None = None, prompt_tokens: int | None = None,
    answer: list[str] | None = None,
) -> RequestRecord:
    """Stream one request to its end. `first_token` (if given) is set when the first token arrives. With
    `messages` the request goes to the chat endpoint (`path` defaults to it) and `prompt_tokens` says how long
    the templated prompt is (the server's usage says it again). `answer`, if given, collects the reply's text
    (every event parsed: for conversations, not for the throughput path)."""
    chat = messages is not None
    if chat and path == "/v1/completions":
        path = "/v1/chat/completions"
    record = RequestRecord(id=request_id, prompt_tokens=prompt_tokens if prompt_tokens is not None else len(prompt),
                           max_tokens=max_tokens, send_t=clock.now(), reasoning_tokens=0 if chat else None)
    seen = 0
    mode: TokenCount | None = None
    done = False
    data = b""

    def add(now: float, tokens: int) -> None:
        if first_token is not None and not record.chunk_t:
            first_token.set()
        record.chunk_t.append(now)
        record.chunk_tokens.append(tokens)
        if chat and _REASONING.search(data):
            record.reasoning_tokens = (record.reasoning_tokens or 0) + tokens

    def on_event(now: float, event_data: bytes) -> None:
        nonlocal seen, mode, done, data
        data = event_data
        if data == _DONE:
            done = True
            return
        total = _int_after(data, _COMPLETION_KEY) if mode != "chunks" and answer is None else None
        if mode == "usage" and total is not None:  # the fast path: one rfind per event
            record.usage_completion_tokens = total
            if total > seen:
                add(now, total - seen)
                seen = total
            return
        try:
            event = json.loads(data)
        except ValueError:
            record.error, record.error_kind = f"a stream event is not JSON: {data[:200]!r}", "stream"
            return
        if not isinstance(event, dict):
            return
        if record.server_id is None and isinstance(event.get("id"), str):
            record.server_id = event["id"]
        if "error" in event and not event.get("choices"):
            record.error, record.error_kind = _error_message(data) or "stream error", "stream"
            return
        usage = event.get("usage") if isinstance(event.get("usage"), dict) else None
        if answer is not None:
            answer.append(_reply_text(event))
        carried = _chunk_tokens(event)
        if mode is None and (carried or usage is not None):
            # Decided on the first chunk with anything in it: per-chunk usage means continuous usage stats.
            mode = "usage" if usage is not None and usage.get("completion_tokens") is not None else "chunks"
        if usage is not None:
            if record.usage_prompt_tokens is None and isinstance(usage.get("prompt_tokens"), int):
                record.usage_prompt_tokens = usage["prompt_tokens"]
            if isinstance(usage.get("completion_tokens"), int):
                record.usage_completion_tokens = usage["completion_tokens"]
        if mode == "usage":
            total = record.usage_completion_tokens or 0
            if total > seen:
                add(now, total - seen)
                seen = total
        elif carried:
            add(now, carried)

    try:
        body = chat_body(model, messages, max_tokens) if messages is not None else (
            completion_body(model, prompt, max_tokens))
        reply = await client.post_stream(path, body, on_event)
        # TTFT counts from the moment the request left, not from before connecting and encoding it (an
        # 8K-token prompt takes about a millisecond to encode): the client's own time is not the server's.
        record.send_t = reply.sent_t
        record.status = reply.status
        if reply.status != 200:
            record.error, record.error_kind = _error_message(reply.body) or f"HTTP {reply.status}", "http"
        elif record.error is None:
            record.error = _incomplete(record, reply.events, done)
            record.error_kind = "stream" if record.error else None
    except asyncio.CancelledError:
        record.cancelled = True
        record.end_t = clock.now()
        raise
    except StreamError as exc:
        record.error, record.error_kind = str(exc)[:500], exc.kind
    record.token_count = mode or "usage"
    record.end_t = clock.now()
    return record


def _incomplete(record: RequestRecord, events: int, done: bool) -> str | None:
    """A 200 stream that says nothing countable, or stops before its end, is an error, never "ok with 0"."""
    if not record.chunk_t:
        return (f"the event stream ended after {events} event(s) without any token (no usage stats, no text): "
                "nothing to count")
    if not done:
        return (f"the event stream ended without [DONE] after {events} event(s) and {record.tokens} token(s): "
                "the reply may be cut short")
    return None


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
