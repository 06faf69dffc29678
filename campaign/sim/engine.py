"""The simulator's engine: continuous batching step by step, on a clock someone else owns.

Each step the scheduler decodes every running sequence (1 + k positions with speculative decoding), continues
running prefills in chunks and admits waiting requests while seats (max-num-seqs) and the batched-token budget
(max-num-batched-tokens) remain; KV blocks come from the block manager, and a sequence that finds none preempts
the newest one, which recomputes later. With async scheduling (vLLM's default from 0.14: SimConfig
async_scheduling) a step is planned while the one before it runs, so a request that arrives during a step is
seated in the one after the next. A step lasts what sim_model's roofline says. The engine never reads a
clock: `schedule()` plans a step, `complete(step, start, end)` emits its tokens at the simulated time `end`.
The HTTP server drives it against the wall clock (sim.py); `Virtual` drives it on a clock the caller owns, with
no wall clock at all, which is what the calibration tests use. Everything it does goes to a `TruthSink`.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from campaign.sim import text as sim_text
from campaign.sim.blocks import BlockManager
from campaign.sim.config import SimConfig

BIMODAL_FACTOR = 2.1   # seed 000's two speeds at four streams


@dataclass(eq=False)
class Request:
    id: str
    prompt: list[int]
    max_tokens: int
    sink: Callable[[int | None], None]   # tokens produced this step; None when the request ends
    admitted: float | None = None        # when its first step was scheduled (a seat and KV blocks found)
    computed: int = 0                    # prompt tokens with KV computed (cache hits included)
    generated: int = 0
    blocks: list[int] = field(default_factory=list)
    queried: int = 0                     # prompt tokens looked up in the prefix cache (until a preemption)
    hits: int = 0                        # of those, found cached
    cached: int | None = None            # prompt tokens the prefix cache held when it was first scheduled
    preemptions: int = 0
    slow: bool = False                   # bimodal fault: this group of four runs at the slow speed
    aborted: bool = False
    # Speculative decoding: per draft position, the chance a draft token is accepted, and the chance a draft
    # is proposed at all in a step; both from how predictable the prompt is (sim_text), set on submission.
    accept_p: float = 0.0
    propose_p: float = 1.0
    proposing: bool = False              # drafts in the step being planned (set by the scheduler)
    hashes: list[int] | None = None      # the prompt's full-block hashes, made once at its first admission
    ready: float = 0.0                   # when the engine may seat it: its arrival plus the costs' request_s
    plans: int = 0                       # steps the engine had planned when it arrived (async scheduling's order)

    @property
    def in_prefill(self) -> bool:
        return self.computed < len(self.prompt)

    @property
    def context(self) -> int:
        return self.computed + self.generated


class TruthSink(Protocol):
    """What the engine really did, as it happens, in simulated seconds."""

    def arrival(self, req: Request, t: float) -> None: ...
    def emit(self, req: Request, t: float, tokens: int) -> None: ...
    def finish(self, req: Request, t: float, reason: str) -> None: ...
    def step(self, step: Step, start: float, end: float, *, running: int, waiting: int, kv_used: int) -> None: ...


class NoTruth:
    def arrival(self, req: Request, t: float) -> None:
        pass

    def emit(self, req: Request, t: float, tokens: int) -> None:
        pass

    def finish(self, req: Request, t: float, reason: str) -> None:
        pass

    def step(self, step: Step, start: float, end: float, *, running: int, waiting: int, kv_used: int) -> None:
        pass


class Tee:
    """Several sinks fed the same events, in order (the truth file and the server's histograms)."""

    def __init__(self, *sinks: TruthSink) -> None:
        self.sinks = sinks

    def arrival(self, req: Request, t: float) -> None:
        for sink in self.sinks:
            sink.arrival(req, t)

    def emit(self, req: Request, t: float, tokens: int) -> None:
        for sink in self.sinks:
            sink.emit(req, t, tokens)

    def finish(self, req: Request, t: float, reason: str) -> None:
        for sink in self.sinks:
            sink.finish(req, t, reason)

    def step(self, step: Step, start: float, end: float, *, running: int, waiting: int, kv_used: int) -> None:
        for sink in self.sinks:
            sink.step(step, start, end, running=running, waiting=waiting, kv_used=kv_used)


@dataclass
class Step:
    """One engine step as planned: who decodes, how many prompt tokens are prefilled, how long it takes."""

    decoding: list[Request]
    decode_tokens: int               # scheduled positions, speculative ones included
    prefill_tokens: int
    prefill_seqs: int
    duration: float                  # simulated seconds, from the roofline (and the speed and bimodal faults)
    prefill_weight: int = 0          # prefill tokens x the context each attends to (the attention term's)
    context_read: int = 0            # decoding context read from the KV cache (the KV read term's)
    # Speculative decoding, counted as the step completes (the server's counters add the same numbers).
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0


class Engine:
    def __init__(self, config: SimConfig, blocks: BlockManager, *, truth: TruthSink | None = None,
                 on_crash: Callable[[], None] | None = None) -> None:
        self.config = config
        self.blocks = blocks
        self.truth: TruthSink = truth or NoTruth()
        self.on_crash = on_crash
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.rng = random.Random(config.seed)
        self.counters = {k: 0.0 for k in (
            "prompt", "generation", "queries", "hits", "preemptions", "drafts", "draft_tokens", "accepted")}
        self.success = 0
        self._four: frozenset[str] = frozenset()
        self._first_step: float | None = None
        # With async scheduling, when the step now being planned was really planned: the start of the step that
        # just ran, where the engine still had sequences running when it ended; None: it was planned now.
        self._planned_at: float | None = None
        self._plans = 0   # steps planned so far

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def submit(self, req: Request, now: float) -> None:
        if self.config.num_speculative_tokens:
            method = sim_text.acceptance_for(self.config.speculative_method)
            score = sim_text.predictability(req.prompt)
            override = self.config.acceptance_rate
            req.accept_p = method.rate(score) if override is None else override
            req.propose_p = method.proposal_chance(score) if override is None else 1.0
        req.ready = now + self.config.costs.request_s
        req.plans = self._plans
        self.waiting.append(req)
        self.truth.arrival(req, now)

    def waits_until(self, now: float) -> float | None:
        """When the engine next has a request to seat, where it has nothing to run at `now` until then: every
        request waits out its API server's time (StepCosts.request_s) first, in arrival order. None: it has
        work now, or none at all."""
        if self.running or not self.waiting or self.waiting[0].ready <= now:
            return None
        return self.waiting[0].ready

    def generation_tokens(self, now: float) -> float:
        """The server's generation counter: this engine's tokens plus any foreign traffic's (a fault)."""
        return self.counters["generation"] + self.config.faults.foreign_tok_s * now

    # --- one step ------------------------------------------------------------------------------------------
    def schedule(self, at: float) -> Step:
        """Plan the next step; `at` is when the scheduler runs (requests it seats are admitted then)."""
        cfg = self.config
        # vLLM's async scheduling plans a step while the one before it runs: a request seated in it must have
        # reached the engine before that one was planned, as it began (a step later than without; an idle
        # engine plans at once). Told by order, not by comparing times: a client's answer to the step before
        # arrives as that one begins, after its planning (vLLM sends a step's tokens out before it plans the
        # next), and two clocks round that instant differently.
        self._plans += 1
        planned = None if self._planned_at is None or not cfg.async_scheduling else self._planned_at
        budget = cfg.max_num_batched_tokens
        decoding = [r for r in self.running if r.computed >= len(r.prompt)]   # not in prefill
        k = cfg.num_speculative_tokens
        decode_tokens = len(decoding)
        if k:
            for req in decoding:
                # Whether it drafts this step, decided now: a request with nothing to propose (an n-gram drafter
                # without a match) is scheduled one position, as vLLM schedules it, not 1 + k.
                req.proposing = req.propose_p >= 1.0 or self.rng.random() < req.propose_p
                decode_tokens += k if req.proposing else 0
        budget -= len(decoding)
        prefill_tokens, prefill_weight, prefill_seqs = 0, 0, 0
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
            prefill_weight += took[1]
            prefill_seqs += 1
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            if req.aborted:
                self.waiting.popleft()
                self._finish(req, at, "abort")
                continue
            if req.ready > at or (planned is not None and (req.plans >= self._plans - 1 or req.ready > planned)):
                break   # still with the API server, or not there when the step was planned; those behind it
                # arrived later
            hit = self._admit(req)
            took = self._prefill_chunk(req, budget)
            if took is None:
                self.blocks.release(req.blocks)
                break
            self.waiting.popleft()
            self.running.append(req)
            req.admitted = at if req.admitted is None else req.admitted
            req.cached = hit if req.cached is None else req.cached
            self._count_lookup(req, hit)
            budget -= took[0]
            prefill_tokens += took[0]
            prefill_weight += took[1]
            prefill_seqs += 1
        context_read = sum(r.computed + r.generated for r in decoding)
        duration = cfg.costs.seconds(
            decode_tokens=decode_tokens, prefill_tokens=prefill_tokens,
            prefill_context=prefill_weight // max(1, prefill_tokens), context_tokens_read=context_read,
            draft_passes=cfg.num_speculative_tokens if cfg.drafter is not None else 0, drafting_seqs=len(decoding),
            prefill_speed=cfg.faults.prefill_speed, decode_speed=cfg.faults.decode_speed)
        # This launch's speed (launch-noise): the engine's physics, so the truth records it as what happened.
        duration *= cfg.speed_factor
        if cfg.faults.throttle:
            # A card heating up: slower by the same share every simulated minute since the engine's first step.
            self._first_step = at if self._first_step is None else self._first_step
            duration *= 1 + cfg.faults.throttle * (at - self._first_step) / 60
        if cfg.faults.bimodal4 and self._slow_four():
            duration *= BIMODAL_FACTOR
        return Step(decoding=decoding, decode_tokens=decode_tokens, prefill_tokens=prefill_tokens,
                    prefill_seqs=prefill_seqs, duration=duration,
                    prefill_weight=prefill_tokens * (prefill_weight // max(1, prefill_tokens)),
                    context_read=context_read)

    def complete(self, step: Step, start: float, end: float, *, emitted: float | None = None) -> None:
        """The step ran from `start` to `end`: decoding sequences get 1 + accepted draft tokens, finished
        prefills their first token; requests that reach max_tokens finish. The tokens leave at `emitted`
        (default `end`): a driver on the wall clock wakes a little after the step's end, and the truth says
        when the tokens really went out."""
        out = end if emitted is None else emitted
        decoding = set(map(id, step.decoding))
        for req in list(self.running):
            if req.aborted:
                self._finish(req, out, "abort")
                continue
            if id(req) in decoding:
                produced = 1 + self._accepted_drafts(step, req) if req.proposing else 1
            elif not req.in_prefill:
                produced = 1
            else:
                continue
            produced = min(produced, req.max_tokens - req.generated)
            if not self.blocks.grow(req.blocks, req.context + produced):
                self._preempt(keep=req)
                continue
            if req.generated == 0:
                # vLLM counts a prompt once, whole (cached tokens included), when its first token comes out
                # (the request's PrefillStats, taken once): not per chunk, and not again after a preemption.
                self.counters["prompt"] += len(req.prompt)
            req.generated += produced
            self.counters["generation"] += produced
            req.sink(produced)
            self.truth.emit(req, out, produced)
            if req.generated >= req.max_tokens:
                self._finish(req, out, "length")
                self.success += 1
                if self.config.faults.crash_after is not None and self.success >= self.config.faults.crash_after:
                    if self.on_crash is not None:
                        self.on_crash()
        self._planned_at = start if self.running else None
        self.truth.step(step, start, end, running=len(self.running), waiting=len(self.waiting),
                        kv_used=self.blocks.used)

    def abort(self, req: Request) -> None:
        """The client went away: the request ends at the next step (or is dropped from the queue)."""
        req.aborted = True

    # --- internals -----------------------------------------------------------------------------------------
    def _accepted_drafts(self, step: Step, req: Request) -> int:
        k = self.config.num_speculative_tokens
        if not k or not req.proposing:
            return 0  # an n-gram drafter with no match in the context proposes nothing (and counts no draft)
        accepted = 0
        while accepted < k and self.rng.random() < req.accept_p:
            accepted += 1
        step.drafts += 1
        step.draft_tokens += k
        step.accepted += accepted
        self.counters["drafts"] += 1
        self.counters["draft_tokens"] += k
        self.counters["accepted"] += accepted
        return accepted

    def _slow_four(self) -> bool:
        """Seed 000's unexplained 4-wide bimodality: each new group of exactly four runs at one of two speeds,
        about half the time each."""
        if len(self.running) != 4:
            return False
        group = frozenset(r.id for r in self.running)
        if group != self._four:
            self._four = group
            slow = self.rng.random() < 0.5
            for req in self.running:
                req.slow = slow
        return any(r.slow for r in self.running)

    def _admit(self, req: Request) -> int:
        """Claim the prompt's cached prefix blocks; their tokens count as computed (hits), which it returns."""
        if req.hashes is None:
            req.hashes = self.blocks.hashes(req.prompt) if self.blocks.prefix_caching else []
        req.blocks = self.blocks.cached_prefix(req.prompt, req.hashes)
        hit_tokens = len(req.blocks) * self.blocks.block_size
        req.computed = hit_tokens
        return hit_tokens

    def _count_lookup(self, req: Request, hit_tokens: int) -> None:
        """The prefix-cache counters, as vLLM 0.32 counts them: at admission (a lookup for a request that then
        found no blocks is not counted), only with prefix caching on, and only until the request's first
        preemption (a preempted request's lookups go to figures vLLM does not export)."""
        if not self.blocks.prefix_caching or req.preemptions:
            return
        req.hits += hit_tokens
        req.queried += len(req.prompt)
        self.counters["queries"] += len(req.prompt)
        self.counters["hits"] += hit_tokens

    def _prefill_chunk(self, req: Request, budget: int) -> tuple[int, int] | None:
        """Schedule the request's next prompt chunk within `budget`: (tokens, tokens x mean attention span),
        or None when the KV cache has no blocks for it."""
        chunk = min(budget, len(req.prompt) - req.computed)
        if not self.blocks.grow(req.blocks, req.computed + chunk):
            return None
        weight = chunk * (req.computed + chunk // 2)
        req.computed += chunk
        # Like vLLM V1, full blocks are hashed when they are allocated for this step, so a request scheduled
        # right after this one already finds them.
        self.blocks.register((req.hashes or [])[: req.computed // self.blocks.block_size], req.blocks)
        return chunk, weight

    def _finish(self, req: Request, t: float, reason: str) -> None:
        if req in self.running:
            self.running.remove(req)
        self.blocks.release(req.blocks)
        req.sink(None)
        self.truth.finish(req, t, reason)

    def _preempt(self, keep: Request | None = None) -> None:
        """Out of blocks: the newest running request goes back to waiting and will recompute."""
        candidates = [r for r in self.running if r is not keep]
        if not candidates:
            return
        victim = candidates[-1]
        self.running.remove(victim)
        self.blocks.release(victim.blocks)
        victim.computed = 0
        victim.preemptions += 1
        self.counters["preemptions"] += 1
        self.waiting.appendleft(victim)


def engine_for(config: SimConfig, truth: TruthSink | None = None, *,
               on_crash: Callable[[], None] | None = None) -> Engine:
    """The engine a server with `config` runs: its KV cache sized by the memory model."""
    blocks = BlockManager(config.memory().num_blocks, config.block(), prefix_caching=config.enable_prefix_caching)
    return Engine(config, blocks, truth=truth, on_crash=on_crash)


class Virtual:
    """The engine on a clock the caller owns: requests go in at the current simulated time, steps run back to
    back with no wall clock, and the truth records say what happened. Deterministic for a given seed.

    A request's end reaches its client as a server's does: `on_finish(t)` runs once the engine has planned the
    step after the one the request ended in (vLLM plans it the moment the last ends, before the tokens reach the
    client; so does the simulator's HTTP server), or at once where the engine then has nothing to plan. A next
    request it sends arrives at `t` and is seated from the step after that one (with async scheduling, from the
    one after that), as a closed loop's request over HTTP is: the Measurer in simulated time and this agree to
    the simulated clock's nanosecond (tests/test_sim_night.py)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.now = 0.0
        self._ids = 0
        self._heard: list[Callable[[], None]] = []   # ends whose clients act once the next step is planned

    def submit(self, prompt: list[int], max_tokens: int, *, at: float | None = None,
               on_finish: Callable[[float], None] | None = None) -> Request:
        """A request arriving now, or at `at` (not after now: one that arrived while the last step ran, which
        the next step may seat); `on_finish(t)` is called when its end reaches the client (class docstring)."""
        if at is not None and at > self.now:
            raise ValueError(f"a request arriving at {at} cannot be submitted at {self.now}, before it arrives")
        self._ids += 1

        def sink(tokens: int | None) -> None:
            if tokens is None and on_finish is not None:
                ended = self.now
                self._heard.append(lambda: on_finish(ended))

        req = Request(id=f"v{self._ids}", prompt=prompt, max_tokens=max_tokens, sink=sink)
        self.engine.submit(req, self.now if at is None else at)
        return req

    def _tell(self) -> None:
        """The clients of the requests that ended act (at the time they ended: the clock has not moved)."""
        while self._heard:
            heard, self._heard = self._heard, []
            for act in heard:
                act()

    def wait_ready(self, until: float | None = None) -> bool:
        """Where the engine has nothing to run until its next request is through the API server (request_s):
        the clock moved to then, or to `until` if that comes first (the time passes all the same); True if it
        moved, so the caller's loop looks again."""
        ready = self.engine.waits_until(self.now)
        if ready is None:
            return False
        self.now = ready if until is None else min(ready, until)
        return True

    def run(self, until: float | None = None, *, done: Callable[[], bool] | None = None) -> None:
        """Step until nothing is left to do, until simulated time `until`, or until `done()` holds after a step."""
        while True:
            if self._heard and (not self.engine.busy or self.engine.waits_until(self.now) is not None):
                self._tell()   # nothing to plan now: what the clients send reaches the engine first
            if not self.engine.busy or (until is not None and self.now >= until):
                return
            if self.wait_ready(until):
                continue
            step = self.engine.schedule(self.now)
            self._tell()       # planned without what the clients send now: they are seated from the next step
            if step.duration <= 0:
                return         # nothing the engine can seat (a prompt its cache cannot hold): left unserved
            start, self.now = self.now, self.now + step.duration
            self.engine.complete(step, start, self.now)
            if done is not None and done():
                return
