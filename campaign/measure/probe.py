"""What `probe` and `launch` measure on one server, from their options: the cells (decode at each context and
concurrency, prefill, open-loop rates), the capacity search's shape, and the measuring of them in order. The
command line only parses the options and prints what comes back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from campaign.core.errors import CampaignError, OptionError
from campaign.measure import capacity, slo, traces
from campaign.measure.cells import CellResult, CellSpec
from campaign.measure.openloop import ARRIVALS, rate_value
from campaign.measure.prompts import ENDPOINTS, prompt_source
from campaign.measure.runner import Measurer, Target
from campaign.measure.slo import Slo
from campaign.measure.study import ExperimentResult
from campaign.server.control import ControlClient
from campaign.server.metrics import Told, config_told, positive_int


def parse_tokens(text: str) -> int:
    """`8k` -> 8192, `6616` -> 6616, `1.5k` -> 1536."""
    value = text.strip().lower()
    scale = 1
    if value.endswith("k"):
        scale, value = 1024, value[:-1]
    elif value.endswith("m"):
        scale, value = 1024 * 1024, value[:-1]
    try:
        return int(float(value) * scale)
    except ValueError:
        raise OptionError("--contexts", f"{text!r} is not a token count (e.g. 8k, 6616)") from None


def parse_list(text: str | None, *, tokens: bool = False) -> list[int]:
    if not text:
        return []
    out = []
    for part in text.split(","):
        if part.strip():
            try:
                out.append(parse_tokens(part) if tokens else int(part))
            except ValueError:
                raise OptionError("--concurrency", f"{part.strip()!r} is not a whole number (e.g. 1,4,16)") from None
    return out


@dataclass(frozen=True)
class RateAsk:
    """What --rate, --slo and --find-max-rate asked for."""

    rates: list[float | None]
    duration: float
    service: Slo | None
    arrival: str
    burstiness: float
    max_concurrency: int | None
    find_max_rate: bool
    trace: CellSpec | None = None   # --trace FILE: the whole trace replayed, at --trace-speed

    @property
    def any(self) -> bool:
        return bool(self.rates) or self.find_max_rate or self.trace is not None


def rate_ask(rate: str | None, duration: float, slo_text: str | None, arrival: str, burstiness: float,
              max_concurrency: int | None, find_max_rate: bool, trace: Path | None = None,
              trace_speed: float = 1.0) -> RateAsk:

    try:
        rates = [rate_value(part.strip()) for part in (rate or "").split(",") if part.strip()]
    except ValueError as exc:
        raise OptionError("--rate", str(exc)) from None
    if None in rates and max_concurrency is None:
        raise OptionError("--rate", "inf needs --max-concurrency N (the requests in flight at once)")
    if arrival not in ARRIVALS:
        raise OptionError("--arrival", f"{arrival!r}: expected {', '.join(ARRIVALS)}")
    try:
        service = slo.parse(slo_text) if slo_text else None
    except ValueError as exc:
        raise OptionError("--slo", str(exc)) from None
    if find_max_rate and service is None:
        raise OptionError("--find-max-rate", "needs --slo: the service level to find the highest rate for")
    replay = None
    if trace is None and trace_speed != 1:
        raise OptionError("--trace-speed", "needs --trace FILE: the trace to replay faster")
    if trace is not None:
        try:
            sliced, requests = traces.plan(trace, speed=trace_speed)
        except traces.EmptySlice as exc:
            raise OptionError("--trace", str(exc)) from None
        replay = CellSpec.from_trace(sliced, requests, slo=service, max_concurrency=max_concurrency)
    return RateAsk(rates, duration, service, arrival, burstiness, max_concurrency, find_max_rate, replay)


def rate_specs(contexts: list[int], ask: RateAsk, *, max_tokens: int, prompts: str, endpoint: str) -> list[CellSpec]:

    return [CellSpec(phase="rate", context_tokens=ctx, max_tokens=max_tokens, request_rate=rate,
                     duration_s=ask.duration, arrival=ask.arrival, burstiness=ask.burstiness,
                     max_concurrency=ask.max_concurrency, slo=ask.service, prompts=prompts, endpoint=endpoint)
            for ctx in contexts for rate in ask.rates]


def search_spec(contexts: list[int], ask: RateAsk, *, max_tokens: int, prompts: str, endpoint: str) -> CellSpec:

    if len(contexts) != 1:
        raise OptionError("--contexts", "give one context with --find-max-rate (e.g. --contexts 8k)")
    # Its max_concurrency is the concurrency search's ceiling (the rate probes run uncapped).
    return CellSpec(phase="rate", context_tokens=contexts[0], max_tokens=max_tokens, request_rate=1.0,
                    duration_s=ask.duration, arrival=ask.arrival, burstiness=ask.burstiness, slo=ask.service,
                    max_concurrency=ask.max_concurrency, prompts=prompts, endpoint=endpoint)


def cell_specs(contexts: list[int], concurrency: list[int], *, window: float, prefill: bool, max_tokens: int,
                mode: str, prompts: str = "random", endpoint: str = "completions") -> list[CellSpec]:

    if mode not in {"sustained", "fixed"}:
        raise CampaignError(f"--mode {mode!r}: expected sustained or fixed")
    if endpoint not in ENDPOINTS:
        raise CampaignError(f"--endpoint {endpoint!r}: expected {' or '.join(ENDPOINTS)}")
    try:
        prompt_source(prompts)
    except ValueError as exc:
        raise CampaignError(f"--prompts: {exc}") from None
    text = {"prompts": prompts, "endpoint": endpoint}
    specs = []
    if prefill:
        specs += [CellSpec(phase="prefill", context_tokens=c, **text) for c in contexts]
    for ctx in contexts:
        for conc in concurrency or [1]:
            specs.append(CellSpec(phase="decode", context_tokens=ctx, concurrency=conc, mode=mode,
                                  max_tokens=max_tokens, window_s=window, **text))
    return specs


def what_to_measure(contexts: str | None, concurrency: str | None, ask: RateAsk, *, window: float, prefill: bool,
                     max_tokens: int, mode: str, prompts: str, endpoint: str) -> tuple[list[CellSpec], CellSpec | None]:
    """The cells asked for, and the capacity search's shape: decode cells at --concurrency (1 unless only
    rates were asked for), prefill with --prefill, rate cells at --rate, a search with --find-max-rate."""
    lengths = parse_list(contexts or "1k", tokens=True)
    decode = concurrency is not None or not ask.any
    specs = cell_specs(lengths, parse_list(concurrency or "1"), window=window, prefill=prefill,
                        max_tokens=max_tokens, mode=mode, prompts=prompts, endpoint=endpoint)
    if not decode:
        specs = [s for s in specs if s.phase == "prefill"]
    specs += rate_specs(lengths, ask, max_tokens=max_tokens, prompts=prompts, endpoint=endpoint)
    specs += [ask.trace] if ask.trace is not None else []
    search = search_spec(lengths, ask, max_tokens=max_tokens, prompts=prompts, endpoint=endpoint) if (
        ask.find_max_rate) else None
    return specs, search


async def measure(target: Target, specs: list[CellSpec], search: CellSpec | None,
                  say: Callable[[str], None]) -> tuple[list[CellResult], ExperimentResult | None]:
    """Measure the cells in order, then (`search`: a rate cell's shape with its SLO) the capacity at that SLO."""
    measurer = Measurer(target, on_event=say)
    results = []
    for i, spec in enumerate(specs, 1):
        say(f"cell {i}/{len(specs)}: {spec.key} ({spec.label})")
        results.append(await measurer.run_cell(spec))
    found = None
    if search is not None and search.slo is not None:
        say(f"capacity at SLO ({search.slo.text}): searching")
        found = await capacity.slo_search(measurer, search, on_probe=say)
    return results, found


# --- what a server it did not launch tells of its configuration -------------------------------------------
# A launch learns the chunk from its startup log; a probe asks the server. Where each Target field is told:
#   /metrics vllm:cache_config_info{block_size, kv_cache_size_tokens}: every vLLM V1 (and the simulator);
#   /metrics campaign_sim:scheduler_config_info{max_num_batched_tokens, max_num_seqs}: the simulator only;
#   GET /inference/v1/config {scheduler: {...}}: vLLM main after 0.32, not 0.32 itself (vllm/entrypoints/serve/
#     config/api_router.py; its path and shape still moving, so it is read where it answers, never required);
#   GET /server_info?config_format=json {vllm_config: {scheduler_config, cache_config}}: vLLM with
#     VLLM_SERVER_DEV_MODE=1 only (vllm/entrypoints/serve/dev/server_info/api_router.py).
# vLLM 0.32 without dev mode tells neither the chunk nor the scheduler cap: --max-num-batched-tokens and
# --max-num-seqs say them.
SCHEDULER_FIELDS = ("max_num_batched_tokens", "max_num_seqs")
CONFIG_ENDPOINTS: tuple[tuple[str, dict[str, tuple[str, ...]]], ...] = (
    ("/inference/v1/config", {"max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
                              "max_num_seqs": ("scheduler", "max_num_seqs")}),
    ("/server_info?config_format=json", {
        "max_num_batched_tokens": ("vllm_config", "scheduler_config", "max_num_batched_tokens"),
        "max_num_seqs": ("vllm_config", "scheduler_config", "max_num_seqs"),
        "block_size": ("vllm_config", "cache_config", "block_size")}),
)
# The option that says each field where the server does not.
CONFIG_OPTIONS = {"max_num_batched_tokens": "--max-num-batched-tokens", "max_num_seqs": "--max-num-seqs"}
CONFIG_WORDS = {"max_num_batched_tokens": "chunk (max-num-batched-tokens)", "max_num_seqs": "max-num-seqs",
                "block_size": "block size", "kv_cache_tokens": "KV cache tokens"}
# What an untold scheduler field costs the verdicts, for the line that asks for its option.
UNTOLD = {"max_num_batched_tokens": "a sustained cell whose requests queue is Invalid, its cause not told",
          "max_num_seqs": "a queue cannot be put down to the scheduler cap"}


def config_from_json(body: Any, paths: dict[str, tuple[str, ...]], source: str) -> dict[str, Told]:
    """The fields a config endpoint's JSON body holds at `paths`; one missing or not a positive whole number is
    not told (a proxy's HTML page, another server's JSON)."""
    told: dict[str, Told] = {}
    for field_name, path in paths.items():
        value: Any = body
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        number = positive_int(value) if isinstance(value, int) else None   # JSON numbers only, not "8192"
        if number is not None:
            told[field_name] = Told(number, source)
    return told


def _get_json(client: httpx.Client, path: str) -> Any:
    """One GET, never retried (a 404 is the common answer: the endpoint is newer, or dev mode is off); None on
    any failure."""
    try:
        response = client.get(path)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def server_config(control: ControlClient) -> dict[str, Told]:
    """What the server tells of its configuration (Target field -> value and where): its /metrics first, then
    the config endpoints, asked only while a scheduler field is still untold."""
    try:
        told = config_told(control.metrics())
    except httpx.HTTPStatusError:
        told = {}   # no /metrics: the first cell says so, where a missing family is an error (never 0)
    with control.endpoint.control() as client:
        for path, paths in CONFIG_ENDPOINTS:
            if all(f in told for f in SCHEDULER_FIELDS):
                break
            body = _get_json(client, path)
            if body is not None:
                told = config_from_json(body, paths, f"GET {path}") | told   # an earlier source wins
    return told


def configured(target: Target, told: dict[str, Told], *, max_num_batched_tokens: int | None,
               max_num_seqs: int | None) -> tuple[Target, list[str]]:
    """The target with what the server told and the options said, and a line on each for the user.

    An option the server contradicts is an error, not a warning: the verdicts would be judged on a chunk or a
    cap the server does not have (a queue called the chunk's, or a cap that seats nobody), and the fix costs
    nothing (drop the option, the server's word is used)."""
    given = {"max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs}
    values: dict[str, Any] = {}   # Target fields (replace() takes them as keywords)
    lines: list[str] = []
    for field_name, said in told.items():
        option, mine = CONFIG_OPTIONS.get(field_name), given.get(field_name)
        if option is not None and mine is not None and mine != said.value:
            raise OptionError(option, f"{mine}, but the server says {said.value} ({said.source}); drop "
                                      f"{option} (the server's value is used) or give {said.value}")
        values[field_name] = said.value
        lines.append(f"{CONFIG_WORDS[field_name]}: {said.value:,} (from {said.source})")
    for field_name, option in CONFIG_OPTIONS.items():
        mine = given[field_name]
        if field_name in told:
            continue
        if mine is not None:
            values[field_name] = mine
            lines.append(f"{CONFIG_WORDS[field_name]}: {mine:,} (from {option}; the server does not tell it)")
        else:
            lines.append(f"{CONFIG_WORDS[field_name]}: not known, the server does not tell it ({UNTOLD[field_name]}); "
                         f"give {option} N")
    return replace(target, **values), lines
