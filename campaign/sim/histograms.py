"""vLLM's request histograms in the simulator's /metrics, kept as vLLM 0.32's Prometheus logger keeps them.

Clients that read server-side latency (AIPerf's server metrics, Grafana dashboards) read these families. Each is
a prometheus_client Histogram, as vLLM's are, with vLLM 0.32's names, help texts, labels (model_name, engine)
and default buckets (vllm/v1/metrics/buckets.py), in simulated seconds: the hardware's seconds at any time
scale. The definitions are vLLM's (vllm/v1/metrics/stats.py), on the engine's own events:

- time_to_first_token_seconds: a request's first token leaving - its arrival, as the token leaves;
- inter_token_latency_seconds: each later emission - the one before it: one observation per engine output,
  however many tokens it carried (a speculative step's 1 + accepted tokens are one gap);
- iteration_tokens_total: per engine step that produced output, the prompt tokens vLLM counts in it plus the
  tokens it generated (vLLM counts a prompt whole, in the step its first token comes out; see Engine.complete;
  a step of prompt chunks alone is not observed);
- per finished request (not an abort: vLLM's abort path records no finished stats):
  e2e_request_latency_seconds (finish - arrival), request_queue_time_seconds (first scheduled - arrival),
  request_prefill_time_seconds (first token - first scheduled), request_decode_time_seconds (last token -
  first token), request_inference_time_seconds (last token - first scheduled),
  request_time_per_output_token_seconds (decode time / (tokens - 1), 0 for a one-token reply),
  request_prompt_tokens, request_generation_tokens, request_params_max_tokens, request_num_preemptions and
  request_prefill_kv_computed_tokens (prompt - the tokens the prefix cache held at first scheduling).

Not exported: request_params_n and request_max_num_generation_tokens (vLLM observes them only for parallel
sampling, n > 1, which the simulator does not serve) and the KV-block residency histograms (off by default).

Events are queued as the engine emits them and observed by `fold()`, which the server calls once a step's
tokens are on the wire and before each scrape: an observation costs about 0.6 us, and 128 of them must not
delay the tokens they describe. Measured on this machine (the H200 profile, 64 streams of 2K prompts on a
virtual clock, 60 simulated seconds, 50,345 tokens): the engine alone 1.4 ms of wall time per simulated second,
with the histograms 2.0 ms, about 0.7 us per token; seed 004's 3,150 tok/s at 20x would spend about 4.5% of a
core on them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.samples import Sample

from campaign.sim.engine import Request, Step

# vLLM 0.32's default buckets (vllm/v1/metrics/buckets.py).
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)


def request_tokens_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    out: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


@dataclass
class _Live:
    """What a request's finished-request observations need, kept from its events."""

    arrival: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0


class RequestHistograms:
    """A TruthSink that keeps vLLM's request histograms (registered in `registry`) from the engine's events."""

    def __init__(self, registry: CollectorRegistry, *, model_name: str, max_model_len: int) -> None:
        self.registry = registry
        tokens = request_tokens_buckets(max_model_len)

        # Each family is also in a registry of its own, whose exposition is kept until the family observes
        # again (see exposition).
        self._alone: dict[int, CollectorRegistry] = {}
        self._text: dict[int, bytes] = {}
        self._samples: dict[int, list[Sample]] = {}

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            family = Histogram(name, doc, ["model_name", "engine"], buckets=buckets, registry=registry)
            alone = self._alone[id(family.labels(model_name, "0"))] = CollectorRegistry(auto_describe=False)
            alone.register(family)
            return family.labels(model_name, "0")

        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.generation_tokens = histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                           tokens)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS)
        self.max_tokens = histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                    tokens)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TIME_TO_FIRST_TOKEN_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             INTER_TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", INTER_TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.preemptions = histogram("vllm:request_num_preemptions",
                                     "Histogram of the number of times a request was preempted.",
                                     REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self.kv_computed = histogram("vllm:request_prefill_kv_computed_tokens",
                                     "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
                                     tokens)
        self._live: dict[int, _Live] = {}
        self._pending: list[tuple[Histogram, float]] = []
        self._step_prompt = 0      # prompt tokens counted by the step being completed (whole prompts)
        self._step_generated = 0

    # --- TruthSink ------------------------------------------------------------------------------------------
    def arrival(self, req: Request, t: float) -> None:
        self._live[id(req)] = _Live(arrival=t)

    def emit(self, req: Request, t: float, tokens: int) -> None:
        live = self._live.get(id(req))
        if live is None:
            return
        if live.first is None:
            live.first = t
            self._pending.append((self.ttft, t - live.arrival))
            self._step_prompt += len(req.prompt) - (req.cached or 0)
        else:
            assert live.last is not None
            self._pending.append((self.itl, t - live.last))
        live.last = t
        live.tokens += tokens
        self._step_generated += tokens

    def finish(self, req: Request, t: float, reason: str) -> None:
        live = self._live.pop(id(req), None)
        if live is None or reason == "abort":
            return
        first = live.first if live.first is not None else t
        last = live.last if live.last is not None else t
        scheduled = req.admitted if req.admitted is not None else live.arrival
        decode = last - first
        self._pending += [
            (self.e2e, t - live.arrival), (self.queue, scheduled - live.arrival), (self.prefill, first - scheduled),
            (self.decode, decode), (self.inference, last - scheduled),
            (self.tpot, decode / (live.tokens - 1) if live.tokens > 1 else 0.0),
            (self.prompt_tokens, len(req.prompt)), (self.generation_tokens, live.tokens),
            (self.max_tokens, req.max_tokens), (self.preemptions, req.preemptions),
            (self.kv_computed, len(req.prompt) - (req.cached or 0)),
        ]

    def step(self, step: Step, start: float, end: float, *, running: int, waiting: int, kv_used: int) -> None:
        # vLLM records an iteration's stats only when the step had outputs (async_llm: IterationStats() only
        # if num_outputs): a step of prompt chunks alone is not observed.
        if self._step_generated:
            self._pending.append((self.iteration_tokens, self._step_prompt + self._step_generated))
        self._step_prompt = self._step_generated = 0

    # --- observing ------------------------------------------------------------------------------------------
    def fold(self) -> None:
        """Observe the events queued since the last fold."""
        pending, self._pending = self._pending, []
        for histogram, value in pending:
            histogram.observe(value)
            self._text.pop(id(histogram), None)
            self._samples.pop(id(histogram), None)

    def exposition(self) -> bytes:
        """The families' text exposition after a fold, byte for byte prometheus_client's `generate_latest` of
        `registry` (tests/test_sim_histograms.py), each family generated again only once it has observed
        something: a scrape of the 14 families (about 320 samples) took the library 3 ms, and the samplers
        scrape every quarter of a simulated second, which in simulated time was half of an overload burst's
        run time; between two scrapes mostly the inter-token and iteration families change."""
        self.fold()
        out = []
        for key, alone in self._alone.items():
            text = self._text.get(key)
            if text is None:
                text = self._text[key] = generate_latest(alone)
            out.append(text)
        return b"".join(out)

    def samples(self) -> Iterator[Sample]:
        """The samples `exposition` writes, without the text (a client in this process reads them: see
        Server.metric_samples), each family's kept as its text is until it observes again."""
        self.fold()
        for key, alone in self._alone.items():
            kept = self._samples.get(key)
            if kept is None:
                kept = self._samples[key] = [sample for family in alone.collect() for sample in family.samples]
            yield from kept
