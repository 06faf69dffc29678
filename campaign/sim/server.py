"""A vLLM stand-in that behaves like a GPU server: `python -m campaign.sim --model M --hardware H ...`.

It takes vLLM's flags that matter (sim_config), prints a startup log in vLLM's formats with the values its
memory model computes (sim_model), and serves /health, /version, /v1/models, /v1/completions (streaming,
continuous usage stats, ignore_eos, min_tokens, token-id or text prompts), /v1/chat/completions (ChatML, and
reasoning_content when started with a reasoning parser), /tokenize, /detokenize (sim_text's tokenizer),
/reset_prefix_cache (with VLLM_SERVER_DEV_MODE=1, as vLLM) and /metrics with vLLM's metric names and its
request histograms (sim_histograms). Speculative acceptance follows how predictable each prompt is (sim_text). The
engine (sim_engine) batches continuously over a paged KV cache (sim_blocks); here it is driven against the wall
clock: simulated time is (perf_counter - anchor) x time scale, so `--time-scale 10` runs the same behaviour ten
times faster; served from the caller's process (`in_process`, measure.simulated) it runs on that event loop's
own clock instead (LoopClock). `--truth FILE` records what the engine really did (sim_truth). Faults: see
sim_config.FAULTS.

Long (about 900 lines): the OpenAI-compatible front (completions, chat, tokenize, models, metrics) and the
startup log it prints, on one event loop with the engine; a request's path is read in one place, whether it
came over HTTP or from a client in this process (open_stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import traceback
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

from packaging.version import Version
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from campaign.core.hardware import LONG_MODEL_LEN_ENV, long_model_len_allowed, resolve_hardware
from campaign.sim import config as sim_config
from campaign.sim import model as sim_model
from campaign.sim import text as sim_text
from campaign.sim import truth as sim_truth
from campaign.sim.config import SimConfig
from campaign.sim.engine import Engine, Request, Tee, TruthSink, engine_for
from campaign.sim.histograms import RequestHistograms

PROMPT_RE_HINT = "Please reduce the length of the input prompt."
# The paths vLLM's API key guards (its AuthenticationMiddleware's GUARDED_PREFIX); every other answers without it.
GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")
# The request being answered is a HEAD: its reply is the GET's status and headers, no body (RFC 9110; uvicorn
# drops the body vLLM's app writes). One per connection's task, so concurrent connections do not share it.
_HEAD: contextvars.ContextVar[bool] = contextvars.ContextVar("head", default=False)
# The reply being written is a stream that has begun: an error then cannot become a reply of its own.
_STREAMING: contextvars.ContextVar[bool] = contextvars.ContextVar("streaming", default=False)


class BadRequest(ValueError):
    """A request body the server cannot read (not JSON, not an object): vLLM's validation answers it with a 400."""


def json_body(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body or b"{}")
    except ValueError as exc:
        raise BadRequest(f"the body is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object")
    return data
BEHIND_WARN = 0.01       # warn when the engine fell behind its clock for over 1% of a stretch ...
BEHIND_EVERY_S = 10.0    # ... of this many simulated seconds


# --- log lines in vLLM's formats ---------------------------------------------------------------------
def _stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


class Log:
    """vLLM's log lines, to stdout (the server's log, as the launcher captures it) or to `write`."""

    def __init__(self, config: SimConfig, write: Callable[[str], None] = _stdout) -> None:
        self.prefixes = config.process_prefixes
        self.pids = {"APIServer": os.getpid(), "EngineCore": os.getpid() + 1, "Worker_TP0": os.getpid() + 2}
        self.write = write

    def line(self, process: str, level: str, where: str, message: str) -> None:
        stamp = time.strftime("%m-%d %H:%M:%S")
        prefix = f"({process} pid={self.pids.get(process, os.getpid())}) " if self.prefixes else ""
        self.write(f"{prefix}{level} {stamp} [{where}] {message}\n")


# --- the engine against the wall clock ---------------------------------------------------------------
class WallClock:
    """Simulated seconds since `anchor` (a perf_counter reading), `scale` of them per wall second."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.anchor = time.perf_counter()

    def now(self) -> float:
        return (time.perf_counter() - self.anchor) * self.scale

    async def sleep_until(self, t: float) -> None:
        await asyncio.sleep(max(0.0, self.anchor + t / self.scale - time.perf_counter()))


class LoopClock:
    """The running event loop's own time, one simulated second per loop second. In process, on a loop whose time
    is simulated (measure.simulated), a step costs its simulated time and nothing of the host's: the engine is
    never behind, and the client beside it reads the same clock."""

    scale = 1.0

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.anchor = self.loop.time()

    def now(self) -> float:
        return self.loop.time() - self.anchor

    async def sleep_until(self, t: float) -> None:
        await asyncio.sleep(max(0.0, self.anchor + t - self.loop.time()))


Clock = WallClock | LoopClock


class Driver:
    """Runs engine steps back to back on the wall clock. A step planned to end at `end` emits then; the
    interpreter's own work is absorbed into the sleep. When the work of a step outlasts it by more than the
    step itself, the step is moved (it starts later than the one before ended): that gap is time the
    simulated server spent doing nothing it should have, counted in `behind_s` and said in the log."""

    def __init__(self, engine: Engine, clock: Clock, log: Log,
                 after_send: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.clock = clock
        self.log = log
        self.after_send = after_send  # bookkeeping that waits until a step's tokens are on the wire
        self.wake = asyncio.Event()
        self.behind_s = 0.0
        self.busy_s = 0.0
        self._stretch = (0.0, 0.0)   # (busy, behind) at the last warning check

    def submit(self, req: Request, arrived: float) -> None:
        self.engine.submit(req, arrived)
        self.wake.set()

    async def run(self) -> None:
        end = self.clock.now()
        while True:
            if not self.engine.busy:
                self.wake.clear()
                await self.wake.wait()
                end = self.clock.now()
            # Never before the last step's end or a wait's: a loop's timer may fire within its clock's resolution
            # early (asyncio's does), and a virtual clock would then stand still while the engine waited again.
            now = max(self.clock.now(), end)
            ready = self.engine.waits_until(now)
            if ready is not None:   # idle while the next request is with the API server (StepCosts.request_s)
                await self.clock.sleep_until(ready)
                end = max(end, ready)
                continue
            step = self.engine.schedule(now)
            start = max(end, now - step.duration)
            self.behind_s += start - end
            end = start + step.duration
            self.busy_s += step.duration
            await self.clock.sleep_until(end)
            self.engine.complete(step, start, end, emitted=self.clock.now())
            # The streams write this step's tokens before the driver does anything else (their wake-ups are
            # queued ahead of it): tokens stamped as leaving now must not wait for the next step's planning
            # or the truth's file writes, which cost about 2.5 ms per finished request.
            await asyncio.sleep(0)
            if self.after_send is not None:
                self.after_send()
            self._check_behind()

    def _check_behind(self) -> None:
        busy, behind = self.busy_s - self._stretch[0], self.behind_s - self._stretch[1]
        if busy + behind < BEHIND_EVERY_S:
            return
        self._stretch = (self.busy_s, self.behind_s)
        share = behind / (busy + behind)
        if share > BEHIND_WARN:
            self.log.line("EngineCore", "WARNING", "sim.py:1", f"the simulator fell behind its clock for "
                          f"{100 * share:.1f}% of the last {busy + behind:.0f} simulated seconds at time scale "
                          f"{self.clock.scale:g}: rates measured then read up to that much low; lower the time "
                          "scale (CAMPAIGN_SIM_TIME_SCALE)")


COMPLETION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


@dataclass(frozen=True)
class Refusal:
    """An error reply: its HTTP status and vLLM's error body."""

    status: int
    body: bytes


@dataclass(frozen=True)
class Completion:
    """A completion or chat request as checked: the prompt's tokens and the reply it asks for."""

    prompt: list[int]
    max_tokens: int
    chat: bool
    stream: bool
    include_usage: bool
    continuous: bool   # usage on every chunk (include_usage and continuous_usage_stats)
    thinks: bool       # a chat reply that reasons first (a reasoning parser, thinking not turned off)


_ID_TYPES = frozenset({int, bool})   # what a JSON list of token ids may hold
_TEXT = "\ue000reply\ue000"   # a stand-in for a reply's text while an event's frame is made (a private-use mark)


class Stream:
    """One streamed reply's events as vLLM 0.32 writes them (each event's data, without `data: `)."""

    def __init__(self, server: Server, checked: Completion, req: Request) -> None:
        self.server = server
        self.checked = checked
        self.req = req
        self.kind = "chat.completion.chunk" if checked.chat else "text_completion"
        self.thinking = req.max_tokens // 2 if checked.thinks else 0
        self._frames: dict[str, tuple[bytes, bytes]] = {}

    def opening(self) -> bytes | None:
        """vLLM's first chat chunk names the role and carries no token; a completion has none."""
        if not self.checked.chat:
            return None
        return json.dumps({"id": self.req.id, "object": self.kind, "model": self.server.config.name, "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}).encode()

    def event(self, produced: int) -> bytes:
        """json.dumps of the event vLLM writes, byte for byte, from a frame made once per stream and part: the
        reply's text and the usage's counts are the only things that change from token to token (dumping the
        whole dict per token was 7 of a 60 s profile of seed 004's matrix in simulated time)."""
        req = self.req
        text = self.server.reply_json(produced)
        part = "reasoning_content" if req.generated <= self.thinking else "content"
        head, tail = self._frames.get(part) or self._frame(part)
        if not self.checked.continuous:
            return b"".join((head, text, tail, b"}"))
        prompt = len(self.checked.prompt)
        usage = (f', "usage": {{"prompt_tokens": {prompt}, "completion_tokens": {req.generated}, '
                 f'"total_tokens": {prompt + req.generated}}}}}')
        return b"".join((head, text, tail, usage.encode()))

    def _frame(self, part: str) -> tuple[bytes, bytes]:
        """The event's bytes before and after its text, the closing brace left off (the usage goes before it)."""
        chat = self.checked.chat
        event: dict[str, Any] = {"id": self.req.id, "object": self.kind, "model": self.server.config.name,
                                 "choices": [{"index": 0, "delta": {part: _TEXT}, "finish_reason": None} if chat
                                             else {"index": 0, "text": _TEXT, "finish_reason": None}]}
        head, tail = json.dumps(event).encode().split(json.dumps(_TEXT).encode())
        self._frames[part] = (head, tail[:-1])
        return self._frames[part]

    def closing(self) -> list[bytes]:
        """The final usage (with include_usage) and [DONE]."""
        out = []
        if self.checked.include_usage:
            out.append(json.dumps({"id": self.req.id, "object": self.kind, "model": self.server.config.name,
                                   "choices": [], "usage": self.server.usage(self.req, len(self.checked.prompt))}
                                  ).encode())
        out.append(b"[DONE]")
        return out


# --- HTTP --------------------------------------------------------------------------------------------
class Server:
    def __init__(self, config: SimConfig, driver: Driver, memory: sim_model.Memory, *,
                 histograms: RequestHistograms | None = None) -> None:
        self.config = config
        self.driver = driver
        self.engine = driver.engine
        self.memory = memory
        self.ids = 0
        self.tokenizer = sim_text.tokenizer_for(config.tokenizer)
        self._replies: dict[int, bytes] = {}   # a reply's text of n tokens, JSON-encoded (each event carries one)
        self.api_key = config.api_key
        # vLLM serves its dev endpoints (/reset_prefix_cache among them) only with VLLM_SERVER_DEV_MODE=1.
        self.dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE", "0").strip() not in {"", "0"}
        self.histograms = histograms
        # The engine's gauges and counters; the request histograms come before them in /metrics, as in one
        # registry where they were registered first (RequestHistograms.exposition keeps their text).
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Metrics(self))

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                arrived = self.driver.clock.now()  # the server has the request from here: parsing is its time
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
                _HEAD.set(method == "HEAD")
                _STREAMING.set(False)
                try:
                    keep = await self.route(method, path.split("?")[0], headers, body, writer, arrived)
                except BadRequest as exc:
                    keep = await self.respond(writer, 400, self.error(str(exc)))
                except Exception as exc:
                    if _STREAMING.get():
                        raise   # mid-stream: the connection ends, as a server's would
                    # A simulator bug answers as vLLM's would answer its own: a 500 naming it, never a connection
                    # dropped with no reply.
                    traceback.print_exc()
                    keep = await self.respond(writer, 500, self.error(
                        f"the simulator failed on this request: {type(exc).__name__}: {exc}",
                        kind="InternalServerError", code=500))
                if not keep or headers.get("connection", "").lower() == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def respond(self, writer: asyncio.StreamWriter, status: int, body: bytes,
                      content_type: str = "application/json") -> bool:
        reason = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
                  500: "Internal Server Error"}[status]
        writer.write(f"HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
                     f"\r\n".encode() + (b"" if _HEAD.get() else body))
        await writer.drain()
        return True

    async def route(self, method: str, path: str, headers: dict[str, str], body: bytes,
                    writer: asyncio.StreamWriter, arrived: float) -> bool:
        if path == "/health":
            return await self.respond(writer, 200, b"")
        if path == "/version":
            return await self.respond(writer, 200, json.dumps({"version": str(self.config.version_style)}).encode())
        if path == "/metrics":
            return await self.respond(writer, 200, self.metrics_text(),
                                      "text/plain; version=0.0.4")
        # vLLM 0.32 asks for the key only under GUARDED_PREFIX (entrypoints/serve/middleware/authenticate.py):
        # /tokenize, /detokenize, /reset_prefix_cache, /health and /metrics answer without it.
        if path.startswith(GUARDED_PREFIX) and self.api_key and (
                headers.get("authorization") != f"Bearer {self.api_key}"):
            return await self.respond(writer, 401, json.dumps({"error": "Unauthorized"}).encode())
        if path == "/v1/models":
            return await self.respond(writer, 200, json.dumps(self.models()).encode())
        if path == "/tokenize" and method == "POST":
            return await self.tokenize(json_body(body), writer)
        if path == "/reset_prefix_cache" and method == "POST" and self.dev_mode:
            done = self.config.faults.reset_keeps_cache or self.engine.blocks.reset()
            return await self.respond(writer, 200, json.dumps({"success": done}).encode())
        if path == "/detokenize" and method == "POST":
            data = json_body(body)
            text = self.tokenizer.decode([int(t) for t in data.get("tokens") or []])
            return await self.respond(writer, 200, json.dumps({"prompt": text}).encode())
        if path in COMPLETION_PATHS and method == "POST":
            checked = self.completion(path, json_body(body))
            if isinstance(checked, Refusal):
                return await self.respond(writer, checked.status, checked.body)
            return await self.completions(checked, writer, arrived)
        return await self.respond(writer, 404, json.dumps({"detail": "Not Found"}).encode())

    def error(self, message: str, param: str | None = None, *, kind: str = "BadRequestError",
              code: int = 400) -> bytes:
        """vLLM's error body: {"error": {message, type, param, code}}, code the HTTP status."""
        return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()

    def models(self) -> dict[str, Any]:
        """/v1/models as vLLM 0.32 answers it: a card per served name (the same root), with max_model_len;
        plus, not vLLM's, which tokenizer the simulator counts with (a client can tell the approximation)."""
        now = int(time.time())
        cards = [{"id": name, "object": "model", "created": now, "owned_by": "vllm", "root": self.config.model,
                  "parent": None, "max_model_len": self.config.max_model_len,
                  "permission": [{"id": f"modelperm-sim{i:013x}", "object": "model_permission", "created": now,
                                  "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                                  "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                                  "organization": "*", "group": None, "is_blocking": False}],
                  "campaign_sim_tokenizer": self.tokenizer.description}
                 for i, name in enumerate(self.config.names)]
        return {"object": "list", "data": cards}

    async def tokenize(self, data: dict[str, Any], writer: asyncio.StreamWriter) -> bool:
        """vLLM's /tokenize: a `prompt`, or chat `messages` through the chat template."""
        if isinstance(data.get("messages"), list):
            try:
                text = self.tokenizer.chat(data["messages"],
                                           add_generation_prompt=bool(data.get("add_generation_prompt", True)))
            except ValueError as exc:
                return await self.respond(writer, 400, self.error(str(exc)))
            tokens = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            tokens = self.tokenizer.encode(str(data.get("prompt", "")),
                                           add_special_tokens=bool(data.get("add_special_tokens", True)))
        return await self.respond(writer, 200, json.dumps({
            "count": len(tokens), "max_model_len": self.config.max_model_len, "tokens": tokens,
            "token_strs": None}).encode())

    def completion(self, path: str, data: dict[str, Any]) -> Completion | Refusal:
        """A completion or chat request checked as vLLM 0.32 checks it, before any stream starts: the reply it
        asks for, or the error reply (the same for a request over HTTP and one in process)."""
        model = data.get("model")
        if model and model not in self.config.names:   # vLLM's check, before any stream starts
            return Refusal(404, self.error(
                f"The model `{model}` does not exist. Valid aliases: {', '.join(self.config.names)}.", "model",
                kind="NotFoundError", code=404))
        if data.get("stream_options") and not data.get("stream"):   # vLLM: a non-empty one only
            return Refusal(400, self.error("Stream options can only be defined when `stream=True`.",
                                           "stream_options"))
        chat = path == "/v1/chat/completions"
        prompt: list[int] | None = None
        if chat:
            messages = data.get("messages")
            if not isinstance(messages, list) or not messages:
                return Refusal(400, self.error("messages: a non-empty list is required", "messages"))
            kwargs = data.get("chat_template_kwargs") or {}
            if not isinstance(kwargs, dict):
                return Refusal(400, self.error("chat_template_kwargs: Input should be a valid dictionary",
                                               "chat_template_kwargs"))
            try:
                text = self.tokenizer.chat(messages, **kwargs)
            except ValueError as exc:
                return Refusal(400, self.error(str(exc)))
            # The rendered template carries its own special tokens: encoded without adding more, as vLLM does.
            prompt = self.tokenizer.encode(text, add_special_tokens=False)
        given: object = None
        if prompt is None:
            given = data.get("prompt")
            if given is None or given == "" or given == []:
                return Refusal(400, self.error("prompt: a prompt is required", "prompt"))
            if isinstance(given, list) and len(given) == 1 and isinstance(given[0], str | list):
                given = given[0]   # a batch of one
            if isinstance(given, list) and given and all(isinstance(t, list | str) for t in given):
                return Refusal(400, self.error(
                    "the simulator serves one prompt per request; send the batch's prompts as requests", "prompt"))
            # Token ids are taken as they are, whatever the tokenizer (the OpenAI API allows them).
            # By the set of the ids' types (a JSON list of ids holds ints, a bool being one too): isinstance per
            # id was 4 of a 60 s profile of seed 004's matrix in simulated time, for 256K-token prompts.
            if isinstance(given, list) and set(map(type, given)) <= _ID_TYPES:
                prompt = cast(list[int], given)
            else:
                prompt = self.tokenizer.encode(str(given)) or [1]
        min_tokens = data.get("min_tokens") or 0
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int):
            return Refusal(400, self.error(f"min_tokens: Input should be a valid integer, got {min_tokens!r}",
                                           "min_tokens"))
        # vLLM 0.32: chat takes max_completion_tokens over max_tokens, and without either the rest of the
        # window; completions default to 16, absent or null (its normalize_null_max_tokens).
        param = "max_completion_tokens" if chat and data.get("max_completion_tokens") is not None else "max_tokens"
        asked = data.get(param) if chat else (16 if data.get("max_tokens") is None else data["max_tokens"])
        if isinstance(asked, float) and asked.is_integer():
            asked = int(asked)   # pydantic's lax int, as vLLM parses it
        limit = limit_answer(self.config, param, asked)
        if limit is not None:
            return Refusal(400, self.error(*limit))
        assert asked is None or isinstance(asked, int)
        rest = self.config.max_model_len - len(prompt)
        refused, max_tokens = window_answer(self.config, len(prompt), asked if asked is not None else rest,
                                            text=chat or isinstance(given, str))
        if refused is not None:
            return Refusal(400, self.error(*refused))
        if min_tokens > max_tokens:
            return Refusal(400, self.error(
                f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}."))
        options = data.get("stream_options") or {}
        # A reasoning model thinks first: with a reasoning parser, the first half of a chat reply is reasoning.
        kwargs = data.get("chat_template_kwargs") or {}
        thinks = bool(chat and self.config.reasoning_parser and kwargs.get("enable_thinking") is not False)
        return Completion(prompt=prompt, max_tokens=max(1, max_tokens), chat=chat, stream=bool(data.get("stream")),
                          include_usage=bool(options.get("include_usage")),
                          # vLLM: usage on every chunk only with include_usage as well.
                          continuous=bool(options.get("include_usage") and options.get("continuous_usage_stats")),
                          thinks=thinks)

    def submit(self, checked: Completion, arrived: float, sink: Callable[[int | None], None]) -> Stream:
        """The checked request to the engine; `sink` gets its tokens step by step (None at its end)."""
        self.ids += 1
        req = Request(id=f"{'chatcmpl' if checked.chat else 'cmpl'}-sim-{self.ids}", prompt=checked.prompt,
                      max_tokens=checked.max_tokens, sink=sink)
        self.driver.submit(req, arrived)
        return Stream(self, checked, req)

    async def completions(self, checked: Completion, writer: asyncio.StreamWriter, arrived: float) -> bool:
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        stream = self.submit(checked, arrived, queue.put_nowait)
        req = stream.req
        if not checked.stream:
            while await queue.get() is not None:
                pass
            usage = self.usage(req, len(checked.prompt))
            reply = self.tokenizer.reply(req.generated)
            choice: dict[str, Any] = (
                {"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "length"}
                if checked.chat else {"index": 0, "text": reply, "finish_reason": "length"})
            return await self.respond(writer, 200, json.dumps({
                "id": req.id, "object": "chat.completion" if checked.chat else "text_completion",
                "model": self.config.name, "choices": [choice], "usage": usage}).encode())
        _STREAMING.set(True)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        try:
            opening = stream.opening()
            if opening is not None:
                self._chunk(writer, b"data: " + opening + b"\n\n")
            while True:
                produced = await queue.get()
                if produced is None:
                    break
                self._chunk(writer, b"data: " + stream.event(produced) + b"\n\n")
                await writer.drain()
            for data in stream.closing():
                self._chunk(writer, b"data: " + data + b"\n\n")
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        except ConnectionError:
            self.engine.abort(req)
            return False
        return True

    def open_stream(self, path: str, headers: dict[str, str], body: bytes,
                    on_event: Callable[[bytes], None], on_end: Callable[[], None]) -> Stream | Refusal:
        """A streamed completion from a client in this process (measure.simulated): checked as over HTTP, its
        events (each SSE event's data, as over HTTP) handed to `on_event` the moment the engine emits them,
        `on_end` after the last; no socket, no framing, no task per request. The error reply otherwise."""
        arrived = self.driver.clock.now()
        if self.api_key and headers.get("authorization") != f"Bearer {self.api_key}":
            return Refusal(401, json.dumps({"error": "Unauthorized"}).encode())
        if path not in COMPLETION_PATHS:
            return Refusal(404, json.dumps({"detail": "Not Found"}).encode())
        try:
            checked = self.completion(path, json_body(body))
        except BadRequest as exc:
            return Refusal(400, self.error(str(exc)))
        if isinstance(checked, Refusal):
            return checked
        if not checked.stream:
            raise ValueError("in process the simulator answers streamed requests only (the measured path)")
        stream: Stream | None = None

        def sink(produced: int | None) -> None:
            assert stream is not None
            if produced is not None:
                on_event(stream.event(produced))
                return
            for data in stream.closing():
                on_event(data)
            on_end()

        stream = self.submit(checked, arrived, sink)
        opening = stream.opening()
        if opening is not None:
            on_event(opening)
        return stream

    def metrics_text(self) -> bytes:
        """/metrics: what the engine did up to now, as vLLM's logger has recorded it (the histograms fold first).
        A query (`?name[]=...`) is ignored, as vLLM 0.32's /metrics ignores it (the instrumentator's route, ahead
        of prometheus_client's own app, answers in full; checked on the real CPU build)."""
        exposition = b"" if self.histograms is None else self.histograms.exposition()
        return exposition + generate_latest(self.registry)

    def metric_samples(self, only: frozenset[str] | None = None) -> Iterator[Sample]:
        """/metrics' samples without its text, for a client in this process (measure.simulated): the collectors
        `metrics_text` writes, read at the same moment, in its order; with `only`, the samples of those names.
        The samplers scrape every quarter of a simulated second: writing, sending and parsing the text made
        a third of a night in simulated time (a5000-tuning, one repeat: 20.7 s with the text, 13.7 s without,
        run one after the other here)."""
        histograms = iter(()) if self.histograms is None else self.histograms.samples()
        gauges = (sample for family in self.registry.collect() for sample in family.samples)
        for sample in itertools.chain(histograms, gauges):
            if only is None or sample.name in only:
                yield sample

    def reply_json(self, tokens: int) -> bytes:
        """The text of a reply's `tokens` tokens as an event carries it (JSON-encoded), made once per count."""
        made = self._replies.get(tokens)
        if made is None:
            made = self._replies[tokens] = json.dumps(self.tokenizer.reply(tokens)).encode()
        return made

    def usage(self, req: Request, prompt_tokens: int) -> dict[str, Any]:
        """A finished reply's usage; with --enable-prompt-tokens-details, as vLLM 0.32, the prompt tokens the
        prefix cache held when the request was first scheduled (its num_cached_tokens)."""
        usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": req.generated,
                                 "total_tokens": prompt_tokens + req.generated}
        if self.config.prompt_tokens_details and req.cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": req.cached}
        return usage

    @staticmethod
    def _chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")


class _Metrics(Collector):
    """/metrics with vLLM's names, generated by prometheus_client as vLLM's own are."""

    def __init__(self, server: Server) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        s, e = self.server, self.server.engine
        labels, values = ["engine", "model_name"], ["0", s.config.name]

        def gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, help_text, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, help_text, labels=labels)
            family.add_metric(values, value)
            return family

        now = s.driver.clock.now()
        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", len(e.running))
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", len(e.waiting))
        blocks = e.blocks
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage.", blocks.used / blocks.total if blocks.total else 0.0)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", e.counters["queries"])
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", e.counters["hits"])
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions.", e.counters["preemptions"])
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", e.counters["prompt"])
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", e.generation_tokens(now))
        # vLLM labels it by finished_reason, every reason present from the start; the simulator's replies all
        # end at their length (no EOS is drawn), and a client's abort is not a success in vLLM either.
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*labels, "finished_reason"])
        for reason in ("stop", "length", "abort", "error", "repetition"):
            success.add_metric([*values, reason], float(e.success) if reason == "length" else 0.0)
        yield success
        if s.config.num_speculative_tokens:
            yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", e.counters["drafts"])
            yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", e.counters["draft_tokens"])
            yield counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                          e.counters["accepted"])
        # Not vLLM's: simulated seconds of steps, and those the engine had work but ran no step (the
        # interpreter fell behind its clock); a client reads the share of a window that was lost.
        yield counter("campaign_sim:busy_seconds", "Simulated seconds spent in engine steps.", s.driver.busy_s)
        yield counter("campaign_sim:behind_seconds", "Simulated seconds the simulator fell behind its clock.",
                      s.driver.behind_s)
        # How many simulated seconds pass per wall second: a client timing a schedule or a service level in the
        # hardware's seconds (open-loop rates, SLO bounds) converts with it.
        yield gauge("campaign_sim:time_scale", "Simulated seconds per wall second.", s.driver.clock.scale)
        info = {"block_size": str(blocks.block_size), "gpu_memory_utilization": str(s.config.gpu_memory_utilization),
                "num_gpu_blocks": str(blocks.total), "enable_prefix_caching": str(s.config.enable_prefix_caching),
                "kv_cache_size_tokens": str(s.memory.kv_tokens), "cache_dtype": s.config.kv_cache_dtype}
        family = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                   labels=[*labels, *info])
        family.add_metric([*values, *info.values()], 1.0)
        yield family
        # Not vLLM's: vLLM exports no scheduler config in /metrics (only vllm:cache_config_info; the chunk is in
        # its startup log and, in dev mode, /server_info). The simulator's own info gauge, its labels named as
        # vLLM's SchedulerConfig fields, so a client that did not launch it (campaign probe) learns the chunk.
        scheduler = {"max_num_batched_tokens": str(s.config.max_num_batched_tokens),
                     "max_num_seqs": str(s.config.max_num_seqs)}
        family = GaugeMetricFamily("campaign_sim:scheduler_config_info", "The simulator's SchedulerConfig",
                                   labels=[*labels, *scheduler])
        family.add_metric([*values, *scheduler.values()], 1.0)
        yield family


def limit_answer(config: SimConfig, param: str, asked: object) -> tuple[str, str] | None:
    """vLLM 0.32's answer to the reply limit a request asked for, before its prompt is looked at: (the 400's
    message, its param), or None. Not a whole number: pydantic's refusal; over the window: the request
    parameters' check (renderers/params.py); below 1: SamplingParams' (it names max_tokens, whichever field
    was sent)."""
    if asked is None:
        return None
    if isinstance(asked, bool) or not isinstance(asked, int):
        return f"{param}: Input should be a valid integer, got {asked!r}", param
    if config.clamps_max_tokens and asked > config.max_model_len:
        return (f"{param}={asked} cannot be greater than max_model_len={config.max_model_len}. Please request "
                f"fewer output tokens. (parameter={param}, value={asked})", param)
    if asked < 1:
        return f"max_tokens must be at least 1, got {asked}. (parameter=max_tokens, value={asked})", "max_tokens"
    return None


def window_answer(config: SimConfig, prompt_tokens: int, max_tokens: int, *,
                  text: bool = False) -> tuple[tuple[str, str | None] | None, int]:
    """How the server answers a prompt and reply against its window: ((the 400's message, its param), or None)
    and the reply length it runs with (vLLM >= 0.32 clamps silently where older versions refuse). vLLM 0.32
    tokenizes a text prompt only to one token past the window, so it says "at least" that many; a prompt of
    token ids is counted exactly. A prompt that fills the window leaves no room for one token."""
    window = config.max_model_len
    if prompt_tokens > window:
        shown = min(prompt_tokens, window + 1) if text else prompt_tokens
        qualifier = "at least " if shown == window + 1 else ""
        return (f"This model's maximum context length is {window} tokens. However, your prompt contains "
                f"{qualifier}{shown} input tokens, which exceeds this limit even without any output tokens. "
                f"{PROMPT_RE_HINT} (parameter=input_tokens, value={shown})", "input_tokens"), max_tokens
    if config.clamps_max_tokens:
        if prompt_tokens == window:
            return ("max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)", "max_tokens"), 0
        return None, min(max_tokens, window - prompt_tokens)  # the silent clamp of vLLM >= 0.32
    if prompt_tokens + max_tokens > window:
        return (f"This model's maximum context length is {window} tokens. However, you requested {max_tokens} "
                f"output tokens and your prompt contains {prompt_tokens} input tokens, for a total of "
                f"{prompt_tokens + max_tokens} tokens. Please reduce the length of the input prompt or the number "
                "of requested output tokens.", None), max_tokens
    return None, max_tokens


# --- start-up ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    args = sim_config.parse(sys.argv[1:] if argv is None else argv)
    log = Log(args)
    if args.faults.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if args.faults.grandchild:
        subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(1)"],  # noqa: S603
                         start_new_session=True)
    started = start_up(args, log)
    if started is None:
        sys.exit(1)
    mem, block = started
    asyncio.run(serve(args, mem, block, log))


# vLLM prints the KV cache's size and the concurrency it allows on one line from 0.28 (two lines in 0.22 and
# before; the versions between were not read).
ONE_LINE_KV_SINCE = Version("0.28")


def start_up(args: SimConfig, log: Log, visible_devices: str | None = None) -> tuple[sim_model.Memory, int] | None:
    """The startup log, line by line as vLLM prints it, with the values the memory model computes; the memory
    and the KV page size, or None where vLLM would exit 1 (what went wrong is the log's last line). A launch in
    simulated time (measure.simulated) reads the same lines as the launcher reads a real one's.
    `visible_devices`: the GPUs it was given (default: CUDA_VISIBLE_DEVICES, as the launcher sets it for a
    pool's launch)."""
    began = time.monotonic()
    tp = args.tensor_parallel_size
    log.line("APIServer", "INFO", "utils.py:253", f"non-default args: {args.non_default}")
    log.line("APIServer", "INFO", "startup.py:38",
             f"vLLM server version {args.version_style}, serving model {args.model}")
    window = args.window
    if window is not None and args.max_model_len > window:
        # vLLM 0.32's words (vllm/config/model.py, _get_and_verify_max_len), raised or only warned of.
        said = (f"User-specified max_model_len ({args.max_model_len}) is greater than the derived max_model_len "
                f"(max_position_embeddings={window} or model_max_length=None in model's config.json).")
        caution = ("VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with extreme caution. If the model uses relative "
                   "position encoding (RoPE), positions exceeding derived_max_model_len lead to nan. If the model "
                   "uses absolute position encoding, positions exceeding derived_max_model_len will cause a CUDA "
                   "array out-of-bounds error.")
        if not long_model_len_allowed(os.environ.get(LONG_MODEL_LEN_ENV, "")):
            log.line("APIServer", "ERROR", "model.py:2664", f"ValueError: {said} To allow overriding this maximum, "
                     f"set the env var {LONG_MODEL_LEN_ENV}=1. {caution}")
            return None
        log.line("APIServer", "WARNING", "model.py:2660", f"{said} {caution}")
    log.line("APIServer", "INFO", "model.py:2170", f"Using max model len {args.max_model_len}")
    # Which tokenizer counts the prompts (not a vLLM line: vLLM always has the model's own). Without one, a
    # client that sized its prompts with the model's tokenizer gets them counted differently, so it is said.
    try:
        tokenizer = sim_text.tokenizer_for(args.tokenizer)
    except ValueError as exc:
        log.line("APIServer", "ERROR", "sim.py:1", f"ValueError: {exc}")
        return None
    if args.tokenizer is None:
        log.line("APIServer", "WARNING", "sim.py:1", f"tokenizer: {tokenizer.description}; prompts are counted "
                 "in its tokens, not the model's: pass --tokenizer PATH (the model's tokenizer folder) to count as "
                 "the model does")
    else:
        log.line("APIServer", "INFO", "sim.py:1", f"tokenizer: {tokenizer.description}")
    log.line("APIServer", "INFO", "scheduler.py:310",
             f"Chunked prefill is enabled with max_num_batched_tokens={args.max_num_batched_tokens}.")
    block = args.block()
    if block > 16:
        log.line("APIServer", "INFO", "interface.py:1106", f"Setting attention block size to {block} tokens to "
                 "ensure that attention page size is >= mamba page size.")
    spec_text = "None" if not args.num_speculative_tokens else (
        f"SpeculativeConfig(method='{args.speculative_method or 'draft_model'}', "
        f"model='{args.drafter.name if args.drafter else args.model}', "
        f"num_spec_tokens={args.num_speculative_tokens})")
    log.line("EngineCore", "INFO", "core.py:139", f"Initializing a V1 LLM engine (v{args.version_style}) with config: "
             f"model='{args.model}', speculative_config={spec_text}, tokenizer='{args.tokenizer or args.model}', "
             f"max_seq_len={args.max_model_len}, "
             f"tensor_parallel_size={tp}, pipeline_parallel_size=1, device_config=cuda, "
             f"enable_prefix_caching={args.enable_prefix_caching}, enable_chunked_prefill=True")
    if args.faults.launch_noise:  # the speed this launch drew, for a person reading its log (vLLM has no such line)
        log.line("EngineCore", "INFO", "sim.py:1", f"launch noise: speed factor {args.speed_factor:.4f} (sigma "
                 f"{args.faults.launch_noise:g}, launch {args.launch or '-'})")
    if (args.faults.prefill_speed, args.faults.decode_speed) != (1.0, 1.0):  # a known true effect, said as such
        log.line("EngineCore", "INFO", "sim.py:1", f"speed faults: prefill at {args.faults.prefill_speed:g}x, "
                 f"decode at {args.faults.decode_speed:g}x the calibrated speed")
    if args.faults.throttle:
        log.line("EngineCore", "INFO", "sim.py:1", f"throttle fault: every step {args.faults.throttle:.0%} slower "
                 "per simulated minute since the first")
    # The GPUs it was given, declared as its own line (vLLM prints no such line): a GPU pool's launches are
    # checked against it. Too few for the parallel size fails as vLLM does, before any weights load.
    devices = os.environ.get("CUDA_VISIBLE_DEVICES", "") if visible_devices is None else visible_devices
    visible = [g for g in devices.split(",") if g.strip()]
    # Without a device list the node has the cards the hardware names (a5000x2: two): no more to spread over.
    cards = resolve_hardware(args.hardware)
    available = len(visible) if visible else cards[1] if cards is not None else tp
    if available < tp:
        log.line("EngineCore", "ERROR", "core.py:1120", f"ValueError: World size ({tp}) is larger than the "
                 f"number of available GPUs ({available}) in this node.")
        return None
    if visible:
        for rank in range(tp):
            log.line(f"Worker_TP{rank}", "INFO", "sim.py:1", f"simulated GPU: rank {rank} on CUDA_VISIBLE_DEVICES "
                     f"index {visible[rank]}")
    if args.faults.hang_startup:
        while True:
            time.sleep(1)
    mem = args.memory()
    refusal = sim_model.start_refusal(mem, utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len)
    if args.faults.start_oom or refusal == "weights":
        log.line("Worker_TP0", "ERROR", "gpu_model_runner.py:5079", "Failed to load model - not enough GPU memory. "
                 "Try lowering --gpu-memory-utilization to free memory for weights, increasing "
                 "--tensor-parallel-size, or using --quantization.")
        log.line("APIServer", "ERROR", "core.py:1120", "RuntimeError: Engine core initialization failed. See root "
                 "cause above. Failed core proc(s): {'EngineCore': 1}")
        return None
    for rank in range(tp):
        log.line(f"Worker_TP{rank}", "INFO", "gpu_model_runner.py:5089",
                 f"Model loading took {mem.weights_gib:.2f} GiB memory and {20 + mem.weights_gib:.6f} seconds")
    if mem.cuda_graphs_reserved:
        log.line("Worker_TP0", "INFO", "gpu_worker.py:787", "CUDA graph memory profiling is enabled (default since "
                 f"v0.21.0). The current --gpu-memory-utilization={args.gpu_memory_utilization:.4f} is equivalent to "
                 f"--gpu-memory-utilization={mem.equivalent_utilization:.4f} without CUDA graph memory profiling. To "
                 "maintain the same effective KV cache size as before, increase --gpu-memory-utilization to "
                 f"{mem.suggested_utilization:.4f}. To disable, set VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0.")
    elif args.version_style >= sim_model.CUDAGRAPH_DEFAULT_SINCE:   # turned off where it is the default
        log.line("Worker_TP0", "WARNING", "gpu_worker.py:804", "CUDA graph memory profiling is disabled "
                 "(VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0). Without it, CUDA graph memory is not accounted for "
                 "during KV cache allocation, which may require lowering --gpu-memory-utilization to avoid OOM. "
                 "Consider re-enabling it (the default as of v0.21.0) and increasing --gpu-memory-utilization from "
                 f"{args.gpu_memory_utilization:.4f} to {mem.suggested_utilization:.4f}.")
    if refusal == "no-cache":
        log.line("EngineCore", "ERROR", "core.py:1120", "ValueError: No available memory for the cache blocks. Try "
                 "increasing `gpu_memory_utilization` when initializing the engine.")
        return None
    per_token_gib = mem.kv_gib / max(1, mem.kv_tokens)
    if refusal == "window":
        estimated = mem.kv_tokens // block * block
        log.line("EngineCore", "ERROR", "core.py:1120", "ValueError: To serve at least one request with the model's "
                 f"max seq len ({args.max_model_len}), ({args.max_model_len * per_token_gib:.2f} GiB KV cache is "
                 f"needed, which is larger than the available KV cache memory ({mem.kv_gib:.2f} GiB). Based on the "
                 f"available memory, the estimated maximum model length is {estimated}. Try increasing "
                 "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.")
        return None
    for rank in range(tp):
        log.line(f"Worker_TP{rank}", "INFO", "gpu_worker.py:772", f"Available KV cache memory: {mem.kv_gib:.2f} GiB")
    concurrency = (f"Maximum concurrency for {args.max_model_len:,} tokens per request: "
                   f"{mem.kv_tokens / args.max_model_len:.2f}x")
    # The device as the measured entry's log said it (the CPU build prints "CPU KV cache size"): what a run of
    # this server then records, and what calibrate replays it as (CPU: no async scheduling).
    device = "CPU" if args.measured is not None and args.measured.on_cpu else "GPU"
    if args.version_style >= ONE_LINE_KV_SINCE:
        log.line("EngineCore", "INFO", "kv_cache_utils.py:1148", f"{device} KV cache size: {mem.kv_tokens:,} tokens, "
                 + concurrency)
    else:   # two lines up to 0.22 (0.28 has one)
        log.line("EngineCore", "INFO", "kv_cache_utils.py:1307", f"{device} KV cache size: {mem.kv_tokens:,} tokens")
        log.line("EngineCore", "INFO", "kv_cache_utils.py:1311", concurrency)
    log.line("EngineCore", "INFO", "core.py:396", "init engine (profile, create kv cache, warmup model) took "
             f"{time.monotonic() - began + 30 / args.time_scale:.2f} s")
    return mem, block


def _assembled(config: SimConfig, mem: sim_model.Memory, clock: Clock, log: Log, *, truth: TruthSink | None = None,
               on_crash: Callable[[], None] | None = None, after_send: Callable[[], None] | None = None) -> Server:
    """The engine (recording into `truth` too), its driver on `clock` and the HTTP front, as `serve` and
    `in_process` both run them: once a step's tokens are on the wire the request histograms fold, then
    `after_send` runs."""
    histograms = RequestHistograms(CollectorRegistry(auto_describe=False), model_name=config.name,
                                   max_model_len=config.max_model_len)

    def sent() -> None:
        histograms.fold()
        if after_send is not None:
            after_send()

    engine = engine_for(config, histograms if truth is None else Tee(truth, histograms), on_crash=on_crash)
    return Server(config, Driver(engine, clock, log, after_send=sent), mem, histograms=histograms)


async def serve(config: SimConfig, mem: sim_model.Memory, block: int, log: Log) -> None:
    clock = WallClock(config.time_scale)
    truth = None if config.truth is None else sim_truth.Writer(config.truth, {
        "time_scale": config.time_scale, "anchor": clock.anchor, "hardware": config.hardware,
        "model_shape": config.model_shape, "block_size": block, "num_blocks": mem.num_blocks,
        "num_speculative_tokens": config.num_speculative_tokens, "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens, "request_s": config.costs.request_s,
        **({"speed_factor": config.speed_factor} if config.faults.launch_noise else {})})

    def close_truth() -> None:
        if truth is not None:
            truth.close(list(server.engine.waiting) + server.engine.running)

    def crash() -> None:
        close_truth()  # what it did until the crash is part of the truth
        sys.stdout.write("(EngineCore pid=0) ERROR [core.py:1120] EngineCore encountered an issue. See stack trace "
                         "(above) for the root cause.\n")
        sys.stdout.flush()
        os._exit(1)

    server = _assembled(config, mem, clock, log, truth=truth, on_crash=crash,
                        after_send=None if truth is None else truth.flush)
    tls = None
    if config.ssl_certfile:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
    listener = await asyncio.start_server(server.handle, config.host, config.port, limit=2**20, backlog=1024,
                                          ssl=tls)
    scheme = "https" if tls else "http"
    log.line("APIServer", "INFO", "launcher.py:188", f"Starting vLLM server on {scheme}://{config.host}:{config.port}")
    sys.stdout.write(f"INFO:     Started server process [{os.getpid()}]\nINFO:     Waiting for application "
                     "startup.\nINFO:     Application startup complete.\n")
    sys.stdout.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if not config.faults.ignore_sigterm:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    engine_task = asyncio.create_task(server.driver.run())
    try:
        await stop.wait()
        log.line("APIServer", "INFO", "launcher.py:254", "[shutdown] API server: shutdown triggered")
    finally:
        # Before the listener closes: from Python 3.12 closing it waits for clients' open connections.
        engine_task.cancel()
        close_truth()
        listener.close()


@contextlib.asynccontextmanager
async def in_process(config: SimConfig, mem: sim_model.Memory, log: Log, path: str, *,
                     truth: TruthSink | None = None) -> AsyncIterator[Server]:
    """The simulator serving HTTP on a Unix socket at `path`, in this process, on the running loop's clock
    (LoopClock): `serve`'s server without a process, signals or the wall clock, for a client on the same loop
    (measure.simulated). A Unix socket hands each write to the reader at once, so on a loop whose time is
    simulated no byte is in flight while the clock moves. `truth` also records what the engine did."""
    server = _assembled(config, mem, LoopClock(), log, truth=truth)
    listener = await asyncio.start_unix_server(server.handle, path, limit=2**20, backlog=1024)
    engine_task = asyncio.create_task(server.driver.run())
    try:
        yield server
    finally:
        engine_task.cancel()
        listener.close()
        with contextlib.suppress(asyncio.CancelledError):
            await engine_task
