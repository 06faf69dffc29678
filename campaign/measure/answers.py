"""The study's answers as pure functions: capacity at a speed floor, the knee, agents that fit, bimodality,
and the roofline over the tables in `hardware`. No I/O; undefined -> None.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from campaign.core import model_config
from campaign.core.hardware import resolve_hardware

DEFAULT_FLOORS = (40.0, 30.0, 20.0)
# A request within 10% of the floor meets it: the seed reads 39.0 tok/s as "40" (8 agents at 40 tok/s).
FLOOR_TOLERANCE = 0.10
KNEE_GAIN = 0.10   # doubling concurrency buys under 10% more aggregate ...
KNEE_LOSS = 0.30   # ... and costs over 30% of each request's speed
AGENT_CONTEXTS = (4000, 8000, 16000, 32000)


@dataclass(frozen=True)
class LadderStep:
    """One rung of the decode ladder: C requests at once, aggregate and stream tok/s."""

    concurrency: int
    total_tok_s: float
    per_request_tok_s: float


def capacity_at_floor(ladder: Sequence[LadderStep], floor: float, *, tolerance: float = FLOOR_TOLERANCE) -> int | None:
    """The highest concurrency at which every request still meets the floor (None: not even one does)."""
    ok = [s.concurrency for s in ladder if s.per_request_tok_s >= floor * (1 - tolerance)]
    return max(ok) if ok else None


def naive_capacity(ladder: Sequence[LadderStep], floor: float) -> int | None:
    """Peak aggregate divided by the floor: the usual arithmetic, which always overstates capacity."""
    if not ladder:
        return None
    return int(max(s.total_tok_s for s in ladder) // floor)


@dataclass(frozen=True)
class Knee:
    concurrency: int
    next_concurrency: int
    aggregate_gain_pct: float
    per_request_loss_pct: float


def knee(ladder: Sequence[LadderStep], *, gain: float = KNEE_GAIN, loss: float = KNEE_LOSS) -> Knee | None:
    """Where doubling stops paying: the first step buying < `gain` aggregate for > `loss` of stream tok/s."""
    steps = sorted(ladder, key=lambda s: s.concurrency)
    for a, b in zip(steps, steps[1:], strict=False):
        if a.total_tok_s <= 0 or a.per_request_tok_s <= 0:
            continue
        g = (b.total_tok_s - a.total_tok_s) / a.total_tok_s
        lost = (a.per_request_tok_s - b.per_request_tok_s) / a.per_request_tok_s
        if g < gain and lost > loss:
            return Knee(a.concurrency, b.concurrency, 100 * g, 100 * lost)
    return None


def agents_that_fit(kv_cache_tokens: int | None, context: int, block_size: int | None,
                    max_model_len: int | None = None) -> int | None:
    """How many sequences of `context` tokens the KV cache holds at once, each in whole blocks; None where
    undefined, including a context longer than the server's window (no agent there can have it)."""
    if kv_cache_tokens is None or context <= 0:
        return None
    if max_model_len is not None and context > max_model_len:
        return None
    block = block_size or 1
    return kv_cache_tokens // (math.ceil(context / block) * block)


@dataclass(frozen=True)
class Modes:
    bimodal: bool
    low: float | None = None
    high: float | None = None
    low_count: int = 0
    high_count: int = 0
    ratio: float | None = None


def bimodality(values: Sequence[float], *, min_ratio: float = 1.5, max_spread: float = 0.10) -> Modes:
    """Two tight groups far apart (seed 000: 86, 183, 86, 183 tok/s)? Split at the widest gap; bimodal when
    the groups' means differ by at least `min_ratio` and each group spreads less than `max_spread`."""
    ordered = sorted(values)
    if len(ordered) < 4 or ordered[0] <= 0:
        return Modes(False)
    gaps = [(ordered[i + 1] / ordered[i], i) for i in range(len(ordered) - 1)]
    _, cut = max(gaps)
    low, high = ordered[: cut + 1], ordered[cut + 1:]
    if len(low) < 2 or len(high) < 2:
        return Modes(False)

    def tight(group: list[float]) -> bool:
        return (max(group) - min(group)) / statistics.fmean(group) <= max_spread

    ratio = statistics.fmean(high) / statistics.fmean(low)
    if ratio >= min_ratio and tight(low) and tight(high):
        return Modes(True, statistics.fmean(low), statistics.fmean(high), len(low), len(high), ratio)
    return Modes(False)


# --- roofline -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Roofline:
    hardware: str
    gpus: int
    decode_tok_s_bound: float    # single stream, bytes read per token over the group's combined bandwidth
    prefill_tok_s_bound: float   # FLOPs per prompt token over the group's peak


def roofline(hardware: str | None, model: str | None, *, tensor_parallel: int | None = None,
             context_tokens: int = 0) -> Roofline | None:
    """Upper bounds for one stream: decode reads weights/TP on each card (the group's bandwidth adds up)
    plus the KV cache; prefill costs 2 FLOPs per parameter per token at the BF16 peak."""
    resolved = resolve_hardware(hardware)
    shape = model_config.model_shape(model) if model else None
    if resolved is None or shape is None:
        return None
    hw, cards = resolved
    gpus = tensor_parallel or cards
    bytes_per_token = shape.params_b * 1e9 * shape.weight_bytes_per_param + shape.kv_bytes_per_token * context_tokens
    decode = gpus * hw.bandwidth_gb_s * 1e9 / bytes_per_token
    prefill = gpus * hw.bf16_tflops * 1e12 / (2 * shape.params_b * 1e9)
    return Roofline(hw.name, gpus, decode, prefill)


def ladder_from_cells(cells: Sequence[object]) -> list[LadderStep]:
    """The decode ladder from Valid decode cells (CellResult-like): the smallest context measured at two or
    more concurrencies, fixed-count mode preferred; repeats averaged."""
    decode = [c for c in cells if getattr(c, "phase", None) == "decode" and getattr(c, "status", None) == "Valid"
              and getattr(c, "total_tok_s", None) is not None and getattr(c, "per_request_tok_s", None) is not None]
    if not decode:
        return []
    groups: dict[tuple[str, int], dict[int, list[tuple[float, float]]]] = {}
    for c in decode:
        key = (c.spec.mode, c.context_tokens)  # type: ignore[attr-defined]
        groups.setdefault(key, {}).setdefault(c.concurrency, []).append(  # type: ignore[attr-defined]
            (c.total_tok_s, c.per_request_tok_s))  # type: ignore[attr-defined]
    candidates = [k for k, v in groups.items() if len(v) >= 2] or list(groups)
    mode, context = min(candidates, key=lambda k: (k[0] != "fixed", k[1]))
    rungs = groups[(mode, context)]
    return [LadderStep(conc, statistics.fmean(t for t, _ in vals), statistics.fmean(p for _, p in vals))
            for conc, vals in sorted(rungs.items())]


def capacity_at_slo(searches: Sequence[dict[str, Any]]) -> dict[str, object] | None:
    """The capacity searches of one variant (stored `slo-search` results, Valid ones) as one answer: the median
    over repeats of the highest rate and concurrency that held the SLO, with the first repeat's bracket.
    Already in the hardware's seconds (the search converts)."""
    valid = [s for s in searches if s.get("status") == "Valid"]
    if not valid:
        return None
    rates = [float(s["values"]["max_rate_rps"]) for s in valid if s["values"].get("max_rate_rps") is not None]
    streams = [float(s["values"]["max_concurrency"]) for s in valid if s["values"].get("max_concurrency") is not None]
    first = valid[0]["details"]
    return {"slo": first.get("slo_text"), "max_rate_rps": statistics.median(rates) if rates else None,
            "last_pass_rps": first["slo_search"].get("last_pass_rps"),
            "first_fail_rps": first["slo_search"].get("first_fail_rps"),
            "max_concurrency": statistics.median(streams) if streams else None, "searches": len(valid)}


def short_answers(*, cells: Sequence[object], facts: dict[str, object] | None, flags: dict[str, object],
                  floors: Sequence[float] = DEFAULT_FLOORS, floor: float | None = None,
                  hardware: str | None = None, model_shape: str | None = None,
                  time_scale: float = 1.0, searches: Sequence[dict[str, Any]] = ()) -> dict[str, object]:
    """Seed 000's first table for one variant, every number labelled. The cells' figures are the hardware's at
    any `time_scale` (format 10; the store converts older ones), so floors and the roofline compare like with
    like; the scale is a label here. `searches`: the variant's stored capacity searches (capacity at an SLO)."""
    ladder = [LadderStep(s.concurrency, s.total_tok_s, s.per_request_tok_s) for s in ladder_from_cells(cells)]
    single = next((s for s in ladder if s.concurrency == 1), None)
    single_cells = [c for c in cells if getattr(c, "phase", None) == "decode" and getattr(c, "concurrency", 0) == 1
                    and getattr(c, "status", None) == "Valid"]
    ttfts = [c.ttft_ms for c in single_cells if c.ttft_ms is not None]  # type: ignore[attr-defined]
    peak = max(ladder, key=lambda s: s.total_tok_s) if ladder else None
    prefill = [c.prompt_tok_s for c in cells  # type: ignore[attr-defined]
               if getattr(c, "phase", None) == "prefill"
               and getattr(c, "status", None) == "Valid" and getattr(c, "prompt_tok_s", None) is not None]
    chosen = floor if floor is not None else (floors[0] if floors else None)
    capacities = {f"{f:g}": capacity_at_floor(ladder, f) for f in floors}
    found_knee = knee(ladder)
    facts = facts or {}
    kv = facts.get("kv_cache_tokens")
    block = facts.get("block_size")
    window = facts.get("max_model_len")
    contexts = [*AGENT_CONTEXTS, *([window] if isinstance(window, int) else [])]
    naive = naive_capacity(ladder, chosen) if chosen else None
    useful = capacities.get(f"{chosen:g}") if chosen else None
    warning = None
    if naive is not None and useful is not None and naive > useful:
        warning = (f"peak / floor = {naive} overstates capacity: stream tok/s falls as concurrency rises, so "
                   f"the honest count at {chosen:g} tok/s is {useful}")
    tp = facts.get("tensor_parallel_size")
    bound = roofline(hardware, model_shape, tensor_parallel=tp if isinstance(tp, int) else None)
    single_rate = single.per_request_tok_s if single else None
    prompt_rate = statistics.median(prefill) if prefill else None
    efficiency: dict[str, object] = {"hardware": hardware, "model": model_shape, "known": bound is not None}
    if bound is None:
        efficiency["note"] = (f"no roofline: {'hardware' if resolve_hardware(hardware) is None else 'model'} "
                              f"{hardware if resolve_hardware(hardware) is None else model_shape!r} is not in the "
                              "tables; not guessing")
    else:
        efficiency.update({
            "gpus": bound.gpus, "decode_bound_tok_s": bound.decode_tok_s_bound,
            "prefill_bound_tok_s": bound.prefill_tok_s_bound,
            "decode_ratio": single_rate / bound.decode_tok_s_bound if single_rate else None,
            "prefill_ratio": prompt_rate / bound.prefill_tok_s_bound if prompt_rate else None,
        })
    return {
        "time_scale": time_scale,
        "roofline": efficiency,
        "single_stream_tok_s": single.per_request_tok_s if single else None,
        "single_stream_ttft_ms": statistics.median(ttfts) if ttfts else None,
        "aggregate_peak_tok_s": peak.total_tok_s if peak else None,
        "aggregate_peak_concurrency": peak.concurrency if peak else None,
        "prompt_tok_s": statistics.median(prefill) if prefill else None,
        "context_window": window,
        "max_num_seqs": flags.get("max-num-seqs"),
        "useful_concurrency": useful,
        "useful_floor_tok_s": chosen,
        "capacity_at_floor": capacities,
        "naive_capacity": naive,
        "naive_capacity_warning": warning,
        "knee": None if found_knee is None else found_knee.__dict__,
        "agents_that_fit": {str(c): agents_that_fit(kv if isinstance(kv, int) else None, c,
                                                     block if isinstance(block, int) else None,
                                                     window if isinstance(window, int) else None)
                            for c in contexts},
        # Contexts the server cannot hold at all: said, not computed.
        "agents_beyond_window": [c for c in contexts if isinstance(window, int) and c > window],
        "capacity_at_slo": capacity_at_slo(searches),
    }
