"""What `probe` and `launch` measure on one server, from their options: the cells (decode at each context and
concurrency, prefill, open-loop rates), the capacity search's shape, and the measuring of them in order. The
command line only parses the options and prints what comes back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from campaign.core.errors import CampaignError, OptionError
from campaign.measure import capacity, slo
from campaign.measure.cells import CellResult, CellSpec
from campaign.measure.openloop import ARRIVALS, rate_value
from campaign.measure.prompts import ENDPOINTS, prompt_source
from campaign.measure.runner import Measurer, Target
from campaign.measure.slo import Slo
from campaign.measure.study import ExperimentResult


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

    @property
    def any(self) -> bool:
        return bool(self.rates) or self.find_max_rate


def rate_ask(rate: str | None, duration: float, slo_text: str | None, arrival: str, burstiness: float,
              max_concurrency: int | None, find_max_rate: bool) -> RateAsk:

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
    return RateAsk(rates, duration, service, arrival, burstiness, max_concurrency, find_max_rate)


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
