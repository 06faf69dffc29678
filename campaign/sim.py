"""A vLLM stand-in that behaves like a GPU server: `python -m campaign.sim --model M --hardware H ...`.

It takes vLLM's flags that matter (and rejects unknown ones the way argparse does), prints a startup log in
vLLM's formats with the values its memory model computes, and serves /health, /version, /v1/models,
/v1/completions (streaming, continuous usage stats, ignore_eos, min_tokens, token-id prompts) and /metrics
with vLLM's metric names. Inside: continuous batching step by step, chunked prefill within the batched-token
budget, a paged KV cache with prefix caching and preemption, speculative decoding with an acceptance rate,
and step times from sim_model's roofline. `--time-scale 10` runs the same behaviour ten times faster.
Faults (`--fault`): start-oom, hang-startup, crash-after:N, ignore-sigterm, grandchild, foreign:TOK_PER_S,
bimodal4.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import signal
import ssl
import subprocess
import sys
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from campaign import sim_model

VERSION = "0.33.0"
PROMPT_RE_HINT = "Please reduce the length of the input prompt."


# --- log lines in vLLM's formats ---------------------------------------------------------------------
class Log:
    def __init__(self, style: str) -> None:
        self.style = style
        self.pids = {"APIServer": os.getpid(), "EngineCore": os.getpid() + 1, "Worker_TP0": os.getpid() + 2}

    def line(self, process: str, level: str, where: str, message: str) -> None:
        stamp = time.strftime("%m-%d %H:%M:%S")
        prefix = f"({process} pid={self.pids.get(process, os.getpid())}) " if self.style >= "0.29" else ""
        sys.stdout.write(f"{prefix}{level} {stamp} [{where}] {message}\n")
        sys.stdout.flush()


# --- engine --------------------------------------------------------------------------------------------
@dataclass
class Request:
    id: str
    prompt: list[int]
    max_tokens: int
    queue: asyncio.Queue[int | None]
    arrived: float
    computed: int = 0            # prompt tokens with KV computed (cache hits included)
    generated: int = 0
    blocks: list[int] = field(default_factory=list)
    hits: int = 0
    slow: bool = False           # bimodal fault: this batch runs at half speed
    aborted: bool = False

    @property
    def in_prefill(self) -> bool:
        return self.computed < len(self.prompt)

    @property
    def context(self) -> int:
        return self.computed + self.generated


class Engine:
    def __init__(self, args: argparse.Namespace, memory: sim_model.Memory, block: int) -> None:
        self.args = args
        self.block = block
        self.total_blocks = memory.num_blocks
        self.free: deque[int] = deque(range(memory.num_blocks))
        self.cached: OrderedDict[str, int] = OrderedDict()  # block hash -> block id (LRU: evict from the left)
        self.block_hash: dict[int, str] = {}
        self.refs: dict[int, int] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.rng = random.Random(args.seed)
        self.counters = {k: 0.0 for k in (
            "prompt", "generation", "queries", "hits", "preemptions", "drafts", "draft_tokens", "accepted")}
        self.success = 0
        self.wake = asyncio.Event()
        self.finished_requests = 0
        spec = args.speculative_config or {}
        self.spec_k = int(spec.get("num_speculative_tokens", 0)) if spec else 0
        self.acceptance = float(spec.get("acceptance_rate", sim_model.calibration_for(
            args.hardware, args.model_shape).default_acceptance)) if spec else 0.0
        self.crash_after = None
        self.foreign_rate = 0.0
        self.bimodal = False
        self._four: frozenset[str] = frozenset()
        for fault in args.fault:
            name, _, value = fault.partition(":")
            if name == "crash-after":
                self.crash_after = int(value)
            elif name == "foreign":
                self.foreign_rate = float(value)
            elif name == "bimodal4":
                self.bimodal = True
        self.dead = False

    # block bookkeeping ------------------------------------------------------------------------------
    def _hashes(self, prompt: list[int]) -> list[str]:
        out, parent = [], ""
        for start in range(0, len(prompt) - len(prompt) % self.block, self.block):
            parent = hashlib.blake2b((parent + repr(prompt[start:start + self.block])).encode(),
                                     digest_size=12).hexdigest()
            out.append(parent)
        return out

    def _take_block(self) -> int | None:
        if self.free:
            block = self.free.popleft()
        else:
            victim = next((b for h, b in self.cached.items() if self.refs.get(b, 0) == 0), None)
            if victim is None:
                return None
            del self.cached[self.block_hash.pop(victim)]
            block = victim
        self.refs[block] = 1
        return block

    def _release(self, req: Request) -> None:
        for block in req.blocks:
            self.refs[block] = self.refs.get(block, 1) - 1
            if self.refs[block] <= 0 and block not in self.block_hash:
                self.free.append(block)
        req.blocks = []

    def _admit(self, req: Request) -> bool:
        """Allocate the prompt's first blocks, reusing cached ones (hash of full blocks from position zero)."""
        hashes = self._hashes(req.prompt) if self.args.enable_prefix_caching else []
        reused: list[int] = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            reused.append(block)
        self.counters["queries"] += len(req.prompt)
        # At least the last prompt token is always computed, as vLLM does.
        hit_tokens = min(len(reused) * self.block, len(req.prompt) - 1)
        reused = reused[: hit_tokens // self.block]
        hit_tokens = len(reused) * self.block
        for block in reused:
            self.refs[block] = self.refs.get(block, 0) + 1
            self.cached.move_to_end(self.block_hash[block])
        req.blocks = reused
        req.computed = hit_tokens
        req.hits = hit_tokens
        self.counters["hits"] += hit_tokens
        return True

    def _ensure_blocks(self, req: Request, tokens: int) -> bool:
        need = sim_model.blocks_for(tokens, self.block) - len(req.blocks)
        # Hybrid models hold one more page per sequence for the recurrent state.
        need += 1 if self.block > 16 and not req.blocks else 0
        for _ in range(max(0, need)):
            block = self._take_block()
            if block is None:
                return False
            req.blocks.append(block)
        return True

    def _register(self, req: Request) -> None:
        if not self.args.enable_prefix_caching:
            return
        for i, h in enumerate(self._hashes(req.prompt[: req.computed])):
            if i < len(req.blocks) and h not in self.cached:
                block = req.blocks[i]
                self.cached[h] = block
                self.block_hash[block] = h

    # the loop ---------------------------------------------------------------------------------------
    async def run(self) -> None:
        last_foreign = time.monotonic()
        # Simulated time advances by whole steps; the real work of a step (Python, the HTTP streams) is
        # absorbed into its sleep, so a fast time scale does not inflate step times with interpreter overhead.
        deadline = time.monotonic()
        while True:
            if not self.running and not self.waiting:
                self.wake.clear()
                await self.wake.wait()
                deadline = time.monotonic()
            now = time.monotonic()
            if self.foreign_rate:
                self.counters["generation"] += self.foreign_rate * (now - last_foreign) * self.args.time_scale
                last_foreign = now
            budget = self.args.max_num_batched_tokens
            decoding = [r for r in self.running if not r.in_prefill]
            decode_tokens = len(decoding) * (1 + self.spec_k)
            budget -= len(decoding)
            prefill_tokens, prefill_ctx = 0, 0
            # Running prefills first, then admit waiting requests while seats and budget remain.
            for req in [r for r in self.running if r.in_prefill]:
                if budget <= 0:
                    break
                took = self._prefill_chunk(req, budget)
                if took is None:
                    self._preempt()
                    break
                budget -= took[0]
                prefill_tokens += took[0]
                prefill_ctx += took[1]
            while self.waiting and budget > 0 and len(self.running) < self.args.max_num_seqs:
                req = self.waiting[0]
                if req.aborted:
                    self.waiting.popleft()
                    continue
                self._admit(req)
                self.counters["prompt"] += req.computed
                took = self._prefill_chunk(req, budget)
                if took is None:
                    self._release(req)
                    break
                self.waiting.popleft()
                self.running.append(req)
                budget -= took[0]
                prefill_tokens += took[0]
                prefill_ctx += took[1]
            if self.bimodal and len(self.running) == 4:
                # Seed 000's unexplained 4-wide bimodality: each new group of exactly four runs at one of two
                # speeds, 2.1x apart, about half the time each.
                group = frozenset(r.id for r in self.running)
                if group != self._four:
                    self._four = group
                    slow = self.rng.random() < 0.5
                    for req in self.running:
                        req.slow = slow
            step = sim_model.step_seconds(
                hardware=self.args.hardware, model=self.args.model_shape, tp=self.args.tensor_parallel_size,
                decode_tokens=decode_tokens, prefill_tokens=prefill_tokens,
                prefill_context=prefill_ctx // max(1, prefill_tokens),
                context_tokens_read=sum(r.context for r in decoding))
            if len(self.running) == 4 and any(r.slow for r in self.running):
                step *= 2.1
            deadline = max(deadline, time.monotonic() - step / self.args.time_scale) + step / self.args.time_scale
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))
            # Emit: decoding sequences get 1 + accepted draft tokens; finished prefills emit their first token.
            for req in list(self.running):
                if req.aborted:
                    self._finish(req)
                    continue
                if req in decoding:
                    produced = 1
                    if self.spec_k:
                        accepted = 0
                        while accepted < self.spec_k and self.rng.random() < self.acceptance:
                            accepted += 1
                        self.counters["drafts"] += 1
                        self.counters["draft_tokens"] += self.spec_k
                        self.counters["accepted"] += accepted
                        produced += accepted
                elif not req.in_prefill:
                    produced = 1
                else:
                    continue
                produced = min(produced, req.max_tokens - req.generated)
                if not self._ensure_blocks(req, req.context + produced):
                    self._preempt(req)
                    continue
                req.generated += produced
                self.counters["generation"] += produced
                req.queue.put_nowait(produced)
                if req.generated >= req.max_tokens:
                    self._finish(req)
                    self.success += 1
                    self.finished_requests += 1
                    if self.crash_after is not None and self.finished_requests >= self.crash_after:
                        self.dead = True
                        sys.stdout.write("(EngineCore pid=0) ERROR [core.py:1120] EngineCore encountered an "
                                         "issue. See stack trace (above) for the root cause.\n")
                        sys.stdout.flush()
                        os._exit(1)

    def _prefill_chunk(self, req: Request, budget: int) -> tuple[int, int] | None:
        """Schedule the request's next prompt chunk within `budget`: (tokens, tokens x mean attention span),
        or None when the KV cache has no blocks for it."""
        chunk = min(budget, len(req.prompt) - req.computed)
        if not self._ensure_blocks(req, req.computed + chunk):
            return None
        weight = chunk * (req.computed + chunk // 2)
        req.computed += chunk
        self.counters["prompt"] += chunk
        # Like vLLM V1, full blocks are hashed when they are allocated for this step, so a request scheduled
        # right after this one already finds them.
        self._register(req)
        return chunk, weight

    def _finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        self._release(req)
        req.queue.put_nowait(None)

    def _preempt(self, keep: Request | None = None) -> None:
        """Out of blocks: the newest running request goes back to waiting and will recompute."""
        candidates = [r for r in self.running if r is not keep]
        if not candidates:
            return
        victim = candidates[-1]
        self.running.remove(victim)
        self._release(victim)
        victim.computed = 0
        self.counters["preemptions"] += 1
        self.waiting.appendleft(victim)

    def submit(self, req: Request) -> None:
        self.waiting.append(req)
        self.wake.set()


# --- HTTP --------------------------------------------------------------------------------------------
class Server:
    def __init__(self, args: argparse.Namespace, engine: Engine, memory: sim_model.Memory) -> None:
        self.args = args
        self.engine = engine
        self.memory = memory
        self.ids = 0
        self.api_key = args.api_key or os.environ.get("VLLM_API_KEY")
        self.started = time.time()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
                keep = await self.route(method, path.split("?")[0], headers, body, writer)
                if not keep or headers.get("connection", "").lower() == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def respond(self, writer: asyncio.StreamWriter, status: int, body: bytes,
                      content_type: str = "application/json") -> bool:
        reason = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 500: "Error"}[status]
        writer.write(f"HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
                     f"\r\n".encode() + body)
        await writer.drain()
        return True

    async def route(self, method: str, path: str, headers: dict[str, str], body: bytes,
                    writer: asyncio.StreamWriter) -> bool:
        if path == "/health":
            return await self.respond(writer, 200, b"")
        if path == "/version":
            return await self.respond(writer, 200, json.dumps({"version": VERSION}).encode())
        if path == "/metrics":
            return await self.respond(writer, 200, self.metrics().encode(), "text/plain; version=0.0.4")
        if path.startswith("/v1") and self.api_key and headers.get("authorization") != f"Bearer {self.api_key}":
            return await self.respond(writer, 401, json.dumps({"error": "Unauthorized"}).encode())
        if path == "/v1/models":
            card = {"id": self.args.served_model_name or self.args.model, "object": "model", "owned_by": "vllm",
                    "root": self.args.model, "max_model_len": self.args.max_model_len}
            return await self.respond(writer, 200, json.dumps({"object": "list", "data": [card]}).encode())
        if path == "/v1/completions" and method == "POST":
            return await self.completions(json.loads(body or b"{}"), writer)
        return await self.respond(writer, 404, json.dumps({"detail": "Not Found"}).encode())

    def error(self, message: str, param: str | None = None) -> bytes:
        return json.dumps({"error": {"message": message, "type": "BadRequestError", "param": param,
                                     "code": 400}}).encode()

    async def completions(self, data: dict[str, Any], writer: asyncio.StreamWriter) -> bool:
        prompt = data.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            # Text prompts: about four characters a token, as a tokenizer would roughly do.
            prompt = [1000 + (ord(c) % 900) for c in str(prompt)][:: 4] or [1]
        window = self.args.max_model_len
        max_tokens = int(data.get("max_tokens") or 16)
        min_tokens = int(data.get("min_tokens") or 0)
        if len(prompt) > window:
            return await self.respond(writer, 400, self.error(
                f"This model's maximum context length is {window} tokens. However, your prompt contains "
                f"{len(prompt)} input tokens, which exceeds this limit even without any output tokens. "
                f"{PROMPT_RE_HINT}", "input_tokens"))
        if self.args.version_style >= "0.32":
            max_tokens = min(max_tokens, window - len(prompt))  # the silent clamp of vLLM >= 0.32
        elif len(prompt) + max_tokens > window:
            return await self.respond(writer, 400, self.error(
                f"This model's maximum context length is {window} tokens. However, you requested {max_tokens} "
                f"output tokens and your prompt contains {len(prompt)} input tokens, for a total of "
                f"{len(prompt) + max_tokens} tokens. Please reduce the length of the input prompt or the number "
                "of requested output tokens."))
        if min_tokens > max_tokens:
            return await self.respond(writer, 400, self.error(
                f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}."))
        self.ids += 1
        req = Request(id=f"cmpl-sim-{self.ids}", prompt=prompt, max_tokens=max(1, max_tokens),
                      queue=asyncio.Queue(), arrived=time.monotonic())
        self.engine.submit(req)
        model = self.args.served_model_name or self.args.model
        stream = bool(data.get("stream"))
        options = data.get("stream_options") or {}
        if not stream:
            while await req.queue.get() is not None:
                pass
            usage: dict[str, Any] = {"prompt_tokens": len(prompt), "completion_tokens": req.generated,
                                     "total_tokens": len(prompt) + req.generated}
            return await self.respond(writer, 200, json.dumps({
                "id": req.id, "object": "text_completion", "model": model,
                "choices": [{"index": 0, "text": " tok" * req.generated, "finish_reason": "length"}],
                "usage": usage}).encode())
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        try:
            while True:
                produced = await req.queue.get()
                if produced is None:
                    break
                event: dict[str, Any] = {"id": req.id, "object": "text_completion", "model": model,
                                         "choices": [{"index": 0, "text": " tok" * produced, "finish_reason": None}]}
                if options.get("continuous_usage_stats"):
                    event["usage"] = {"prompt_tokens": len(prompt), "completion_tokens": req.generated,
                                      "total_tokens": len(prompt) + req.generated}
                self._chunk(writer, b"data: " + json.dumps(event).encode() + b"\n\n")
                await writer.drain()
            if options.get("include_usage"):
                final: dict[str, Any] = {"id": req.id, "object": "text_completion", "model": model, "choices": [],
                         "usage": {"prompt_tokens": len(prompt), "completion_tokens": req.generated,
                                   "total_tokens": len(prompt) + req.generated}}
                self._chunk(writer, b"data: " + json.dumps(final).encode() + b"\n\n")
            self._chunk(writer, b"data: [DONE]\n\n")
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        except ConnectionError:
            req.aborted = True
            return False
        return True

    @staticmethod
    def _chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    def metrics(self) -> str:
        e = self.engine
        name = self.args.served_model_name or self.args.model
        labels = f'engine="0",model_name="{name}"'
        out: list[str] = []

        def counter(metric: str, value: float, help_text: str) -> None:
            out.extend([f"# HELP {metric}_total {help_text}", f"# TYPE {metric}_total counter",
                        f"{metric}_total{{{labels}}} {value}"])

        def gauge(metric: str, value: float, help_text: str, extra: str = "") -> None:
            out.extend([f"# HELP {metric} {help_text}", f"# TYPE {metric} gauge",
                        f"{metric}{{{labels}{extra}}} {value}"])

        gauge("vllm:num_requests_running", len(e.running), "Number of requests in model execution batches.")
        gauge("vllm:num_requests_waiting", len(e.waiting), "Number of requests waiting to be processed.")
        used = e.total_blocks - len(e.free)
        gauge("vllm:kv_cache_usage_perc", used / e.total_blocks if e.total_blocks else 0.0, "KV-cache usage.")
        counter("vllm:prefix_cache_queries", e.counters["queries"], "Prefix cache queries, in tokens.")
        counter("vllm:prefix_cache_hits", e.counters["hits"], "Prefix cache hits, in tokens.")
        counter("vllm:num_preemptions", e.counters["preemptions"], "Cumulative number of preemptions.")
        counter("vllm:prompt_tokens", e.counters["prompt"], "Number of prefill tokens processed.")
        counter("vllm:generation_tokens", e.counters["generation"], "Number of generation tokens processed.")
        counter("vllm:request_success", float(e.success), "Count of successfully processed requests.")
        if e.spec_k:
            counter("vllm:spec_decode_num_drafts", e.counters["drafts"], "Number of spec decoding drafts.")
            counter("vllm:spec_decode_num_draft_tokens", e.counters["draft_tokens"], "Number of draft tokens.")
            counter("vllm:spec_decode_num_accepted_tokens", e.counters["accepted"], "Number of accepted tokens.")
        info = {"block_size": str(e.block), "gpu_memory_utilization": str(self.args.gpu_memory_utilization),
                "num_gpu_blocks": str(e.total_blocks), "enable_prefix_caching": str(self.args.enable_prefix_caching),
                "kv_cache_size_tokens": str(self.memory.kv_tokens), "cache_dtype": self.args.kv_cache_dtype}
        extra = "," + ",".join(f'{k}="{v}"' for k, v in info.items())
        gauge("vllm:cache_config_info", 1.0, "Information of the LLMEngine CacheConfig", extra)
        return "\n".join(out) + "\n"


# --- start-up ------------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vllm serve", description="vllm-campaign's vLLM simulator")
    p.add_argument("model_tag", nargs="?")
    p.add_argument("--model")
    p.add_argument("--hardware", required=True, help="e.g. a5000x2, h200-nvl")
    p.add_argument("--model-shape", required=True, help="e.g. qwen-27b-hybrid, qwen3.5-27b-gptq-int4")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key")
    p.add_argument("--ssl-certfile")
    p.add_argument("--ssl-keyfile")
    p.add_argument("--served-model-name")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--block-size", type=int)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--speculative-config", type=json.loads)
    p.add_argument("--kv-cache-dtype", default="auto")
    # Accepted and without effect on the simulation.
    for flag in ("--dtype", "--load-format", "--reasoning-parser", "--tool-call-parser", "--quantization"):
        p.add_argument(flag)
    for flag in ("--trust-remote-code", "--enable-auto-tool-choice", "--disable-uvicorn-access-log",
                 "--enforce-eager"):
        p.add_argument(flag, action="store_true")
    p.add_argument("--time-scale", type=float, default=float(os.environ.get("CAMPAIGN_SIM_TIME_SCALE", "1")))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--version-style", default=os.environ.get("CAMPAIGN_SIM_VERSION_STYLE", VERSION))
    p.add_argument("--fault", action="append", default=[
        f for f in os.environ.get("CAMPAIGN_SIM_FAULTS", "").split(",") if f])
    args = p.parse_args(argv)
    args.model = args.model or args.model_tag
    if not args.model:
        p.error("the following arguments are required: model_tag")
    try:
        sim_model.calibration_for(args.hardware, args.model_shape)
    except ValueError as exc:
        p.error(f"argument --hardware/--model-shape: {exc}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    log = Log(args.version_style)
    began = time.monotonic()
    if "ignore-sigterm" in args.fault:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if "grandchild" in args.fault:
        subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(1)"],  # noqa: S603
                         start_new_session=True)
    tp = args.tensor_parallel_size
    big = sim_model.calibration_for(args.hardware, args.model_shape).reported_memory_gib >= 70
    args.max_num_batched_tokens = args.max_num_batched_tokens or (8192 if big else 2048)
    args.max_num_seqs = args.max_num_seqs or (1024 if big else 256)
    spec = args.speculative_config or {}
    non_default = {k: v for k, v in vars(args).items() if v not in (None, False, [], 1.0) and k not in {
        "hardware", "model_shape", "time_scale", "seed", "version_style", "fault", "model_tag"}}
    if "api_key" in non_default:
        non_default["api_key"] = "***"
    log.line("APIServer", "INFO", "utils.py:253", f"non-default args: {non_default}")
    log.line("APIServer", "INFO", "startup.py:38", f"vLLM server version {VERSION}, serving model {args.model}")
    log.line("APIServer", "INFO", "model.py:2170", f"Using max model len {args.max_model_len}")
    log.line("APIServer", "INFO", "scheduler.py:310",
             f"Chunked prefill is enabled with max_num_batched_tokens={args.max_num_batched_tokens}.")
    block = args.block_size or sim_model.block_size(args.hardware, args.model_shape, args.kv_cache_dtype)
    if block > 16:
        block = max(block, args.block_size or 0)
        log.line("APIServer", "INFO", "interface.py:1106", f"Setting attention block size to {block} tokens to "
                 "ensure that attention page size is >= mamba page size.")
    spec_text = "None" if not spec else (f"SpeculativeConfig(method='{spec.get('method')}', model='{args.model}', "
                                         f"num_spec_tokens={spec.get('num_speculative_tokens', 0)})")
    log.line("EngineCore", "INFO", "core.py:139", f"Initializing a V1 LLM engine (v{VERSION}) with config: "
             f"model='{args.model}', speculative_config={spec_text}, max_seq_len={args.max_model_len}, "
             f"tensor_parallel_size={tp}, pipeline_parallel_size=1, device_config=cuda, "
             f"enable_prefix_caching={args.enable_prefix_caching}, enable_chunked_prefill=True")
    if "hang-startup" in args.fault:
        while True:
            time.sleep(1)
    mem = sim_model.memory(hardware=args.hardware, model=args.model_shape, tp=tp,
                           utilization=args.gpu_memory_utilization, max_num_batched_tokens=args.max_num_batched_tokens,
                           kv_cache_dtype=args.kv_cache_dtype,
                           num_speculative_tokens=int(spec.get("num_speculative_tokens", 0)))
    if "start-oom" in args.fault or mem.weights_gib > mem.total_gib * args.gpu_memory_utilization:
        log.line("Worker_TP0", "ERROR", "gpu_model_runner.py:5079", "Failed to load model - not enough GPU memory. "
                 "Try lowering --gpu-memory-utilization to free memory for weights, increasing "
                 "--tensor-parallel-size, or using --quantization.")
        log.line("APIServer", "ERROR", "core.py:1120", "RuntimeError: Engine core initialization failed. See root "
                 "cause above. Failed core proc(s): {'EngineCore': 1}")
        sys.exit(1)
    for rank in range(tp):
        log.line(f"Worker_TP{rank}", "INFO", "gpu_model_runner.py:5089",
                 f"Model loading took {mem.weights_gib:.2f} GiB memory and {20 + mem.weights_gib:.6f} seconds")
    log.line("Worker_TP0", "INFO", "gpu_worker.py:787", "CUDA graph memory profiling is enabled (default since "
             f"v0.21.0). The current --gpu-memory-utilization={args.gpu_memory_utilization:.4f} is equivalent to "
             f"--gpu-memory-utilization={mem.equivalent_utilization:.4f} without CUDA graph memory profiling. To "
             "maintain the same effective KV cache size as before, increase --gpu-memory-utilization to "
             f"{mem.suggested_utilization:.4f}. To disable, set VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0.")
    if mem.num_blocks <= 0:
        log.line("EngineCore", "ERROR", "core.py:1120", "ValueError: No available memory for the cache blocks. Try "
                 "increasing `gpu_memory_utilization` when initializing the engine.")
        sys.exit(1)
    per_token_gib = mem.kv_gib / max(1, mem.kv_tokens)
    if mem.kv_tokens < args.max_model_len:
        estimated = mem.kv_tokens // block * block
        log.line("EngineCore", "ERROR", "core.py:1120", "ValueError: To serve at least one request with the model's "
                 f"max seq len ({args.max_model_len}), ({args.max_model_len * per_token_gib:.2f} GiB KV cache is "
                 f"needed, which is larger than the available KV cache memory ({mem.kv_gib:.2f} GiB). Based on the "
                 f"available memory, the estimated maximum model length is {estimated}. Try increasing "
                 "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.")
        sys.exit(1)
    for rank in range(tp):
        log.line(f"Worker_TP{rank}", "INFO", "gpu_worker.py:772", f"Available KV cache memory: {mem.kv_gib:.2f} GiB")
    log.line("EngineCore", "INFO", "kv_cache_utils.py:1148", f"GPU KV cache size: {mem.kv_tokens:,} tokens, Maximum "
             f"concurrency for {args.max_model_len:,} tokens per request: {mem.kv_tokens / args.max_model_len:.2f}x")
    log.line("EngineCore", "INFO", "core.py:396", "init engine (profile, create kv cache, warmup model) took "
             f"{time.monotonic() - began + 30 / args.time_scale:.2f} s")
    asyncio.run(serve(args, mem, block, log))


async def serve(args: argparse.Namespace, mem: sim_model.Memory, block: int, log: Log) -> None:
    engine = Engine(args, mem, block)
    server = Server(args, engine, mem)
    tls = None
    if args.ssl_certfile:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    listener = await asyncio.start_server(server.handle, args.host, args.port, limit=2**20, backlog=1024, ssl=tls)
    scheme = "https" if tls else "http"
    log.line("APIServer", "INFO", "launcher.py:188", f"Starting vLLM server on {scheme}://{args.host}:{args.port}")
    sys.stdout.write(f"INFO:     Started server process [{os.getpid()}]\nINFO:     Waiting for application "
                     "startup.\nINFO:     Application startup complete.\n")
    sys.stdout.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if "ignore-sigterm" not in args.fault:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    engine_task = asyncio.create_task(engine.run())
    async with listener:
        await stop.wait()
    log.line("APIServer", "INFO", "launcher.py:254", "[shutdown] API server: shutdown triggered")
    engine_task.cancel()


if __name__ == "__main__":
    main()
