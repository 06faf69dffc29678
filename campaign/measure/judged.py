"""Which of a cell's figures a diff judges, per phase, and in which direction; when a latency tail can be
judged at all. Data only: the verdicts (analysis/verdicts.py) judge by it, and the plan (plan/planning.py)
counts the tests a night's verdicts will rest on from it.
"""

from __future__ import annotations

MIN_EFFECT = 0.03        # the default minimum effect: a change under 3% is no difference worth acting on
FAMILY_ALPHA = 0.05      # the family-wise error rate of one variant's verdicts
# (metric, +1 when higher is better, -1 when lower is better)
# energy_j_per_token (NVIDIA GPUs only): a flag that saves energy at equal speed is a result too.
# A decode cell's speed is judged by total_tok_s and per_request_tok_s (shown as "stream tok/s"), never by
# total_tok_s / concurrency (shown as "total ÷ streams", seed 000's "per request": it moves with total_tok_s)
# nor by 1000 / tpot_ms; the reports say so from these tables (campaign/report/names.py names every figure).
DECODE_METRICS = (("total_tok_s", 1), ("per_request_tok_s", 1), ("ttft_ms", -1), ("energy_j_per_token", -1),
                  ("ttft_p99_ms", -1), ("itl_p99_ms", -1))
# Tail latencies are judged only where every measurement's p99 rests on enough samples: below that a p99 is
# little more than the largest value seen, and its interval over repeats would flatter it.
TAIL_METRICS = {"ttft_p99_ms": "latency_requests", "itl_p99_ms": "itl_samples", "tpot_p99_ms": "latency_requests",
                "e2e_p99_ms": "latency_requests"}
TAIL_MIN_SAMPLES = 100
# ... and only on three measurements a side: a p99 moves between launches far more than a mean (on the
# simulated A5000 pair, one cell's ITL p99 read 5.9-8.7 ms over six launches of identical servers), and two
# values a side can come out close by chance and make Welch's test call a difference that is not there (a
# CI run read a Holm-significant "better" ITL p99 between two identical flag sets this way).
TAIL_MIN_REPEATS = 3
# ... and only where the client's own timing noise (its event loop's p99 lateness, which every token time it
# stamps carries) is under MIN_EFFECT of the tail itself: a 6 ms ITL p99 stamped by a loop that runs 0.5 ms
# late one time in a hundred moves by more than a 3% change on the host's whim, not the server's.
# Measured only where NVML is, or replayed on an entry with a power model (a virtual run): no row at all for a
# cell where neither side has the value (a CPU run, the simulator on the wall clock).
TELEMETRY_METRICS = {"energy_j_per_token"}
PREFILL_METRICS = (("prompt_tok_s", 1), ("ttft_ms", -1))
# An open-loop rate cell: what a service gets at that load. The achieved rate is what was offered, not judged.
RATE_METRICS = (("goodput_rps", 1), ("slo_met_fraction", 1), ("total_tok_s", 1), ("ttft_ms", -1), ("tpot_ms", -1),
                ("ttft_p99_ms", -1), ("tpot_p99_ms", -1), ("e2e_p99_ms", -1))
PHASE_METRICS = {"decode": DECODE_METRICS, "prefill": PREFILL_METRICS, "rate": RATE_METRICS}
