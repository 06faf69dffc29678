"""Peers' per-request exports read as measured loads (analysis.arrivals.Timed), for `campaign calibrate --export`.

vLLM's `bench serve --save-result --save-detailed` (vllm/benchmarks/serve.py, as 0.19 and 0.32 write it; the
JSON its `save_to_pytorch_benchmark_format` writes beside it is not this): per request, in the same order, `start_times`
(time.perf_counter() when the request was sent), `ttfts` (seconds to its first chunk, 0 for a failure),
`itls` (seconds between chunks, a list per request), `input_lens` (its prompt tokens, the server's usage where
it sent one) and `output_lens` (its reply tokens), and `errors` ("" for a success). A request's last token is
its first plus the sum of its gaps. Files without `start_times` (older releases' benchmark_serving.py) say
nothing of when a request arrived, so they cannot be replayed: refused with a one-line error. Its
`max_concurrency` at an unlimited `request_rate` (vLLM's `--max-concurrency C` without a rate) makes it a closed
loop, replayed as one.

GuideLLM's report (`benchmarks.json`, 0.8's format: `benchmarks[].requests.successful`, each with
`request_start_time` and `info.timings.first_token_iteration` / `last_token_iteration`, epoch seconds, and
`prompt_tokens` / `output_tokens`; `errored` and `incomplete` are failures): one load per benchmark of the file
(a sweep has several). Its `config.strategy` says the loop: `concurrent` (its `streams`) and `synchronous` (one)
are closed loops; a rate (`constant`, `poisson`) stands as sent.

AIPerf's `profile_export.jsonl` (0.13's: a line a request, `metadata.request_start_ns` in epoch nanoseconds,
`metrics.time_to_first_token` and `request_latency` as {value, unit}, the server's `usage_prompt_tokens` and
`usage_completion_tokens` where it sent usage, else AIPerf's own counts; a line with an `error` failed; only
the `profiling` phase is measured, warm-up lines are left out). Its load settings are in the
`profile_export_aiperf.json` AIPerf writes beside it (`input_config.phases`, type `concurrency`: a closed loop);
without that file the sends stand as sent.

Every format's requests are sorted by send time (the peers list them as they finished). The fixtures these
readers are tested on are the peers' own files, written by GuideLLM 0.8.1 and AIPerf 0.13.0 against the
simulator (tests/fixtures/peers/exports/, each with its command and licence).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from campaign.analysis.arrivals import Sent, Timed
from campaign.core.errors import CampaignError

VLLM_KEYS = ("start_times", "ttfts", "itls", "input_lens", "output_lens")


@dataclass(frozen=True)
class Export:
    """A peer's export as a measured load."""

    timed: list[Timed]          # its successful requests, in send order
    failed: int                 # never replayed: a failure says nothing of the server's speed
    # A closed loop's requests in flight (vLLM's `max_concurrency` at an unlimited `request_rate`); None: an
    # open loop, each request replayed at its own send time.
    max_concurrency: int | None
    tool: str = "vLLM bench serve"   # who wrote it
    notes: tuple[str, ...] = ()      # what the reader could not know from the file


def read(path: Path) -> list[Export]:
    """The loads in a peer's export, told by its content: vLLM bench serve's JSON (one), GuideLLM's report (one
    a benchmark) or AIPerf's profile_export.jsonl (one)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CampaignError(f"{path}: cannot read it ({exc})", hint=HINT) from None
    try:
        data: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":   # one JSON value after another: JSON lines
            return [read_aiperf(path)]
        raise CampaignError(f"{path}: cannot read it as JSON ({exc})", hint=HINT) from None
    if isinstance(data, dict) and isinstance(data.get("benchmarks"), list):
        return read_guidellm(path, data)
    if isinstance(data, dict) and isinstance(data.get("metadata"), dict) and isinstance(data.get("metrics"), dict):
        return [read_aiperf(path)]   # a run of one request: one line
    return [read_vllm_bench(path)]


HINT = ("name the file `vllm bench serve --save-result --save-detailed` wrote, GuideLLM's benchmarks.json, or "
        "AIPerf's profile_export.jsonl")


def _sorted(timed: list[Timed]) -> list[Timed]:
    return sorted(timed, key=lambda t: t.sent.at_s)


def _checked(path: Path, where: str, sent: Any, ttft: Any, last: Any, prompt: Any, output: Any) -> Timed:
    """One successful request's figures as numbers, or a one-line error naming the file and the request."""
    try:
        values = float(sent), float(ttft), float(last)
        tokens = int(prompt), int(output)
    except (TypeError, ValueError):
        raise CampaignError(f"{path}: {where}: a time or length that is missing or not a number",
                            hint=HINT) from None
    if not all(math.isfinite(v) for v in values) or values[1] < 0 or values[2] < values[1] or min(tokens) < 0:
        raise CampaignError(f"{path}: {where}: a negative or infinite time, or a last token before the first",
                            hint=HINT)
    return Timed(Sent(values[0], tokens[0], tokens[1]), values[1], values[2])


def _none_served(path: Path, failed: int) -> CampaignError:
    return CampaignError(f"{path}: none of its {failed} requests succeeded; nothing was measured to fit",
                         hint="calibrate from a run whose requests were served")


def read_guidellm(path: Path, data: dict[str, Any]) -> list[Export]:
    """GuideLLM's report: a load a benchmark (module docstring)."""
    loads: list[Export] = []
    for b, bench in enumerate(data["benchmarks"]):
        requests = bench.get("requests") if isinstance(bench, dict) else None
        if not isinstance(requests, dict) or not isinstance(requests.get("successful"), list):
            raise CampaignError(f"{path}: benchmark {b} has no requests.successful list (GuideLLM's per-request "
                                "records)", hint="use the benchmarks.json GuideLLM 0.8 or later wrote")
        failed = sum(len(requests.get(k) or []) for k in ("errored", "incomplete"))
        timed = []
        for i, rec in enumerate(requests["successful"]):
            timings = (rec.get("info") or {}).get("timings") or {} if isinstance(rec, dict) else {}
            start = rec.get("request_start_time") if isinstance(rec, dict) else None
            first, last = timings.get("first_token_iteration"), timings.get("last_token_iteration")
            ttft = last_s = None
            if isinstance(start, int | float) and isinstance(first, int | float) and isinstance(last, int | float):
                ttft, last_s = first - start, last - start
            timed.append(_checked(path, f"benchmark {b}, successful request {i}", start, ttft, last_s,
                                  rec.get("prompt_tokens"), rec.get("output_tokens")))
        if not timed:
            raise _none_served(path, failed)
        strategy = (bench.get("config") or {}).get("strategy") or {}
        kind = strategy.get("type_")
        streams = 1 if kind == "synchronous" else strategy.get("streams") if kind == "concurrent" else None
        if streams is not None and (not isinstance(streams, int) or isinstance(streams, bool) or streams < 1):
            raise CampaignError(f"{path}: benchmark {b}: streams {streams!r} is not a positive whole number",
                                hint="use the benchmarks.json GuideLLM wrote")
        loads.append(Export(_sorted(timed), failed, streams, tool="GuideLLM"))
    if not loads:
        raise CampaignError(f"{path}: a GuideLLM report with no benchmarks", hint="use a finished run's report")
    return loads


AIPERF_UNITS = {"ms": 1e-3, "s": 1.0, "us": 1e-6, "ns": 1e-9}
AIPERF_SUMMARY = "profile_export_aiperf.json"


def _aiperf_value(path: Path, where: str, metrics: dict[str, Any], *names: str) -> float | None:
    """The first of `names` the line's metrics carry, in seconds for a time (by its unit), else as is."""
    for name in names:
        entry = metrics.get(name)
        if isinstance(entry, dict) and isinstance(entry.get("value"), int | float):
            unit = entry.get("unit")
            if unit == "tokens":
                return float(entry["value"])
            if unit not in AIPERF_UNITS:
                raise CampaignError(f"{path}: {where}: {name} in unit {unit!r}, not one of "
                                    f"{', '.join(AIPERF_UNITS)}", hint="use the file AIPerf 0.13 or later wrote")
            return float(entry["value"]) * AIPERF_UNITS[unit]
    return None


def read_aiperf(path: Path) -> Export:
    """AIPerf's profile_export.jsonl, with the load settings of the summary beside it (module docstring)."""
    timed, failed = [], 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"line {number}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CampaignError(f"{path}: {where}: not JSON ({exc})", hint=HINT) from None
        meta, metrics = (rec.get("metadata"), rec.get("metrics")) if isinstance(rec, dict) else (None, None)
        if not isinstance(meta, dict) or not isinstance(metrics, dict):
            raise CampaignError(f"{path}: {where}: no metadata and metrics (AIPerf's record)", hint=HINT)
        if meta.get("benchmark_phase", "profiling") != "profiling":
            continue   # warm-up: sent to be thrown away
        if rec.get("error") or meta.get("was_cancelled"):
            failed += 1
            continue
        start_ns = meta.get("request_start_ns")
        timed.append(_checked(
            path, where, start_ns / 1e9 if isinstance(start_ns, int | float) else None,
            _aiperf_value(path, where, metrics, "time_to_first_token"),
            _aiperf_value(path, where, metrics, "request_latency"),
            _aiperf_value(path, where, metrics, "usage_prompt_tokens", "input_sequence_length"),
            _aiperf_value(path, where, metrics, "usage_completion_tokens", "output_sequence_length")))
    if not timed:
        raise _none_served(path, failed)
    summary = path.with_name(AIPERF_SUMMARY)
    if not summary.is_file():
        return Export(_sorted(timed), failed, None, tool="AIPerf",
                      notes=(f"{path.name}: no {AIPERF_SUMMARY} beside it to say how the load was run: its "
                             "requests are replayed at their own send times (a concurrency run's sends followed "
                             "the real server)",))
    try:
        phases = json.loads(summary.read_text(encoding="utf-8"))["input_config"]["phases"]
        profiling = [p for p in phases if p.get("kind", p.get("name")) == "profiling"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise CampaignError(f"{summary}: no input_config.phases (the load AIPerf ran)",
                            hint="use the summary AIPerf 0.13 or later wrote beside the export") from None
    cap = profiling[0].get("concurrency") if profiling and profiling[0].get("type") == "concurrency" else None
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
        raise CampaignError(f"{summary}: concurrency {cap!r} is not a positive whole number",
                            hint="use the summary AIPerf wrote")
    return Export(_sorted(timed), failed, cap, tool="AIPerf")


def read_vllm_bench(path: Path) -> Export:
    """The export's successful requests as measured ones, how many failed, and whether it ran a closed loop."""
    try:
        data: Any = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CampaignError(f"{path}: cannot read it as JSON ({exc})",
                            hint="name the file `vllm bench serve --save-result --save-detailed` wrote") from None
    if not isinstance(data, dict):
        raise CampaignError(f"{path}: not a vLLM bench serve result (a JSON object is expected)")
    missing = [key for key in VLLM_KEYS if not isinstance(data.get(key), list)]
    if missing:
        why = ("has no per-request lists" if len(missing) == len(VLLM_KEYS) else
               "has no start_times (older vLLM benchmarks kept no send times)" if missing == ["start_times"]
               else f"lacks {', '.join(missing)}")
        raise CampaignError(f"{path}: {why}, so its requests cannot be replayed at their own times",
                            hint="run a recent vllm bench serve with --save-result --save-detailed")
    lists = [data[key] for key in VLLM_KEYS]
    stated = data.get("errors")
    errors: list[Any] = stated if isinstance(stated, list) else [""] * len(lists[0])
    if len({len(x) for x in [*lists, errors]}) != 1:
        sizes = ", ".join(f"{key} {len(x)}" for key, x in zip((*VLLM_KEYS, "errors"), [*lists, errors],
                                                               strict=True))
        raise CampaignError(f"{path}: its per-request lists differ in length ({sizes})",
                            hint="the file is damaged or was edited; use the one vllm bench serve wrote")
    timed: list[Timed] = []
    failed = 0
    for i, (sent, ttft, gaps, prompt, output, error) in enumerate(zip(*lists, errors, strict=True)):
        if error or not ttft or not output:
            failed += 1
            continue
        try:
            steps = [float(g) for g in gaps]
        except (TypeError, ValueError):
            steps = [math.nan]
        if not all(g >= 0 for g in steps):   # a negative gap (NaN fails too)
            raise CampaignError(f"{path}: request {i}: a negative, infinite or non-numeric gap between tokens",
                                hint="use the file vllm bench serve wrote")
        last = ttft + sum(steps) if isinstance(ttft, int | float) else None
        timed.append(_checked(path, f"request {i}", sent, ttft, last, prompt, output))
    if not timed:
        raise _none_served(path, failed)
    cap, rate = data.get("max_concurrency"), data.get("request_rate")
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
        raise CampaignError(f"{path}: max_concurrency {cap!r} is not a positive whole number",
                            hint="use the file vllm bench serve wrote")
    # A cap at a finite rate binds only while the server is behind: its sends are kept as they were.
    closed = cap is not None and rate in (None, "inf", math.inf)
    return Export(timed, failed, cap if closed else None)
