"""vLLM's /metrics, read with prometheus_client's own parser. A family that is absent is an error, never 0.

Counters are summed over label sets (one per engine), and a step is measured as the delta of two snapshots.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from campaign.core import clock
from campaign.core.errors import MetricMissingError

GENERATION_TOKENS = "vllm:generation_tokens_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PREEMPTIONS = "vllm:num_preemptions_total"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"   # 0-1; optional: a queue with a full cache waits for blocks
CACHE_CONFIG_INFO = "vllm:cache_config_info"
SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
# vLLM's request histograms (V1): read as their _sum and _count samples; optional (a server may not export them).
TTFT_HISTOGRAM = "vllm:time_to_first_token_seconds"
ITL_HISTOGRAM = "vllm:inter_token_latency_seconds"
QUEUE_HISTOGRAM = "vllm:request_queue_time_seconds"   # arrival to first scheduled, observed as a request ends
# Only the simulator's: simulated seconds it ran steps, and those it had work but fell behind its clock.
SIM_BUSY = "campaign_sim:busy_seconds_total"
SIM_BEHIND = "campaign_sim:behind_seconds_total"
SIM_TIME_SCALE = "campaign_sim:time_scale"  # simulated seconds per wall second (the simulator only)
# The simulator's own info gauge of its scheduler (labels max_num_batched_tokens, max_num_seqs, named as vLLM's
# SchedulerConfig fields): vLLM exports no scheduler config in /metrics, only vllm:cache_config_info.
SIM_SCHEDULER_INFO = "campaign_sim:scheduler_config_info"
# What a sampler reads during a step: the queue's gauges (and a simulator's clock), nothing it brackets.
GAUGES = frozenset({RUNNING, WAITING, KV_USAGE, SIM_BUSY, SIM_BEHIND})

# What every measured step relies on (the bracket, the prefix-cache check, preemptions, concurrency).
MEASUREMENT_METRICS = (GENERATION_TOKENS, PROMPT_TOKENS, PREFIX_QUERIES, PREFIX_HITS, PREEMPTIONS, RUNNING,
                       WAITING)

# Names older vLLM versions used (renamed in V1: the gpu_ prefix dropped, TPOT became inter-token latency),
# for a better error than "missing".
RENAMED = {
    "vllm:gpu_cache_usage_perc": KV_USAGE,
    "vllm:gpu_prefix_cache_queries_total": PREFIX_QUERIES,
    "vllm:gpu_prefix_cache_hits_total": PREFIX_HITS,
    "vllm:time_per_output_token_seconds": "vllm:inter_token_latency_seconds",
}


@dataclass(frozen=True)
class MetricsSnapshot:
    """One scrape: sample name -> value summed over label sets, and the label sets of info gauges."""

    t: float
    values: dict[str, float]
    labels: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    server_version: str | None = None

    def has(self, name: str) -> bool:
        return name in self.values

    def value(self, name: str) -> float:
        if name not in self.values:
            raise missing_error([name], self)
        return self.values[name]

    def require(self, names: Iterable[str]) -> None:
        missing = [n for n in names if n not in self.values]
        if missing:
            raise missing_error(missing, self)

    def info(self, name: str) -> dict[str, str] | None:
        """Labels of an info gauge such as vllm:cache_config_info (first engine), or None if absent."""
        rows = self.labels.get(name)
        return rows[0] if rows else None


@dataclass(frozen=True)
class Told:
    """A configuration value a server told about itself, and where it said it (a metric, an endpoint)."""

    value: int
    source: str


# Info gauge -> (label, the Target field it fills), first source first.
CONFIG_LABELS = {
    SIM_SCHEDULER_INFO: (("max_num_batched_tokens", "max_num_batched_tokens"), ("max_num_seqs", "max_num_seqs")),
    CACHE_CONFIG_INFO: (("block_size", "block_size"), ("kv_cache_size_tokens", "kv_cache_tokens")),
}


def config_told(snapshot: MetricsSnapshot) -> dict[str, Told]:
    """What the info gauges of one scrape tell of the server's configuration: Target field -> value. A label
    that is absent, "None" or not a positive number (vLLM writes "None" for a value not resolved) is not told."""
    told: dict[str, Told] = {}
    for name, labels in CONFIG_LABELS.items():
        info = snapshot.info(name)
        for label, field_name in labels:
            value = positive_int((info or {}).get(label))
            if value is not None and field_name not in told:
                told[field_name] = Told(value, f"{name}{{{label}}}")
    return told


def positive_int(text: object) -> int | None:
    """`"8192"`, `"8192.0"` or 8192 -> 8192; anything else (None, "None", 0, a bool, a fraction) -> None."""
    if isinstance(text, bool) or text is None:
        return None
    try:
        number = float(str(text))
    except ValueError:
        return None
    return int(number) if number.is_integer() and number > 0 else None


def missing_error(names: list[str], snapshot: MetricsSnapshot) -> MetricMissingError:
    version = snapshot.server_version or "unknown version"
    hints = [f"{n} was renamed to {RENAMED[n]}" for n in names if n in RENAMED]
    if any(n.startswith("vllm:") for n in names) and not any(k.startswith("vllm:") for k in snapshot.values):
        hints.append("no vllm:* metric at all: was the server started with --disable-log-stats?")
    return MetricMissingError(
        f"metric {', '.join(names)} is not exported by this server (vLLM {version}); "
        "refusing to read it as 0",
        hint="; ".join(hints) or "check the metric name against the server's /metrics",
    )


def _only(text: str, names: frozenset[str]) -> str:
    """The sample lines of `text` whose metric name is one of `names` (comments dropped: a sample's name is the
    same with or without its family's TYPE line)."""
    kept = [line for line in text.splitlines()
            if line and line[0] != "#" and line.split("{", 1)[0].split(" ", 1)[0] in names]
    return "\n".join(kept) + "\n"


def parse(text: str, *, t: float | None = None, server_version: str | None = None,
          only: frozenset[str] | None = None) -> MetricsSnapshot:
    """A scrape's text, parsed by prometheus_client (see `snapshot`).
    `only`: parse just these sample names, for a sampler that reads a few gauges many times (a simulator's
    /metrics of 400 lines took the library's parser 24 ms, the five gauges a sampler reads well under 1 ms)."""
    families = text_string_to_metric_families(text if only is None else _only(text, only))
    return snapshot((sample for family in families for sample in family.samples), t=t,
                    server_version=server_version)


def snapshot(samples: Iterable[Sample], *, t: float | None = None,
             server_version: str | None = None) -> MetricsSnapshot:
    """Samples by name (a name's label sets summed; `_info` samples also keep their labels; `_created` left
    out): from a scrape's text (`parse`), or from a server in this process that hands its collectors' samples
    over without the text (measure.simulated: the same samples, each float exactly as the text round-trips
    it, since prometheus_client writes a float's repr)."""
    values: dict[str, float] = {}
    labels: dict[str, list[dict[str, str]]] = {}
    for sample in samples:
        if sample.name.endswith("_created"):
            continue
        values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
        if sample.name.endswith("_info"):
            labels.setdefault(sample.name, []).append(dict(sample.labels))
    return MetricsSnapshot(t=clock.now() if t is None else t, values=values, labels=labels,
                           server_version=server_version)


@dataclass(frozen=True)
class Delta:
    """Counter deltas between two snapshots, for the names both have."""

    before: MetricsSnapshot
    after: MetricsSnapshot

    def __call__(self, name: str) -> float:
        return self.after.value(name) - self.before.value(name)

    def optional(self, name: str) -> float | None:
        if self.before.has(name) and self.after.has(name):
            return self.after.values[name] - self.before.values[name]
        return None


def histogram_mean(delta: Delta, name: str) -> tuple[int, float | None] | None:
    """(observations, their mean) of a histogram between two scrapes, from its _count and _sum samples; the
    mean is None when nothing was observed; None when the server does not export the histogram."""
    count, total = delta.optional(f"{name}_count"), delta.optional(f"{name}_sum")
    if count is None or total is None:
        return None
    return int(round(count)), total / count if count else None


def speculative(delta: Delta) -> bool:
    """Did the server run speculative decoding over this step (its draft counters exist)?"""
    return delta.optional(SPEC_DRAFTS) is not None


def spec_figures(drafts: float | None, draft_tokens: float | None,
                 accepted: float | None) -> tuple[float | None, float | None, float | None]:
    """(acceptance rate, mean acceptance length, mean accepted) from a step's counts of drafts, drafted tokens
    and accepted tokens (vLLM's own definitions): accepted / drafted tokens, 1 + accepted / drafts, accepted /
    drafts; None without speculative decoding or without a draft."""
    rate = accepted / draft_tokens if accepted is not None and draft_tokens else None
    per_draft = accepted / drafts if accepted is not None and drafts else None
    return rate, None if per_draft is None else 1 + per_draft, per_draft


def spec_mean_accepted(delta: Delta) -> float | None:
    """Draft tokens accepted per draft, over a step (the acceptance length less vLLM's bonus token)."""
    return spec_figures(delta.optional(SPEC_DRAFTS), None, delta.optional(SPEC_ACCEPTED))[2]


def spec_decode(delta: Delta) -> tuple[float | None, float | None]:
    """(acceptance rate, mean acceptance length) over a step; None without speculative decoding."""
    rate, length, _ = spec_figures(delta.optional(SPEC_DRAFTS), delta.optional(SPEC_DRAFT_TOKENS),
                                   delta.optional(SPEC_ACCEPTED))
    return rate, length
