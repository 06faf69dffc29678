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

Not read yet: GuideLLM's and AIPerf's exports (their per-request timings are in their own report formats).
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

    timed: list[Timed]          # its successful requests
    failed: int                 # never replayed: a failure says nothing of the server's speed
    # A closed loop's requests in flight (vLLM's `max_concurrency` at an unlimited `request_rate`); None: an
    # open loop, each request replayed at its own send time.
    max_concurrency: int | None


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
            values = [float(sent), float(ttft), *(float(g) for g in gaps)]
            tokens = int(prompt), int(output)
        except (TypeError, ValueError):
            raise CampaignError(f"{path}: request {i}: a time or length that is not a number",
                                hint="use the file vllm bench serve wrote") from None
        if not all(math.isfinite(v) for v in values) or min(values[1:]) < 0 or min(tokens) < 0:
            raise CampaignError(f"{path}: request {i}: a negative or infinite time",
                                hint="use the file vllm bench serve wrote")
        timed.append(Timed(Sent(values[0], tokens[0], tokens[1]), values[1], values[1] + sum(values[2:])))
    if not timed:
        raise CampaignError(f"{path}: none of its {failed} requests succeeded; nothing was measured to fit",
                            hint="calibrate from a run whose requests were served")
    cap, rate = data.get("max_concurrency"), data.get("request_rate")
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
        raise CampaignError(f"{path}: max_concurrency {cap!r} is not a positive whole number",
                            hint="use the file vllm bench serve wrote")
    # A cap at a finite rate binds only while the server is behind: its sends are kept as they were.
    closed = cap is not None and rate in (None, "inf", math.inf)
    return Export(timed, failed, cap if closed else None)
