"""What a reader sees each figure called, and what it is: the one place a figure's display name and its one-line
definition are written. The tables' headers (and their hover text in HTML), the diff's metric column, the
verdict's and the diff's sentences, the charts' axes and legends, the report's legend ("The figures") and the
docs' list of the export's figures (docs/results.md, which a test compares with `markdown()`) all take them
from here, so one word never means two figures.

Issue 50: one cell's "per request" speed could be read three ways a third apart (the simulated H200's 8K,
8-stream cell with MTP: `per_request_tok_s` 53.2, 1000 / TPOT 70.3, total tok/s / 8 45.2), each right by its
own definition and shown beside the others under one word. Each now has a name the others cannot be taken
for: stream tok/s, TPOT (a time, never shown as a rate), total ÷ streams. Names only: no stored field is
renamed (records, summary.json and the export keep their keys), and the one figure derived here (total ÷
streams) is computed from stored fields when it is shown.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, replace

from campaign.measure.judged import PHASE_METRICS, TAIL_METRICS, TAIL_MIN_REPEATS, TAIL_MIN_SAMPLES, TELEMETRY_METRICS
from campaign.report.tables import Item, Table, to_markdown


@dataclass(frozen=True)
class Figure:
    name: str          # word for word wherever the figure is shown; a column header capitalises its first letter
    definition: str    # one line: what it is, in terms a reader can check against the raw records
    speed: bool = False  # tokens a second: the legend says which of these the verdict judges


# A decode cell's total tok/s over its requests at once: shown, never stored (the key names no field).
TOTAL_OVER_STREAMS = "total_tok_s / concurrency"

FIGURES: dict[str, Figure] = {
    "total_tok_s": Figure(
        "total tok/s", "all streams' output tokens together per second: a sustained window's tokens over its "
        "length, otherwise the step's tokens over its whole wall time (prefill included)", speed=True),
    TOTAL_OVER_STREAMS: Figure(
        "total ÷ streams", "a decode cell's total tok/s divided by its requests at once: what each stream gets of "
        "the server's output, its wait for a first token included (seed 000's \"per request\"); derived from "
        "total_tok_s and concurrency where shown, not stored", speed=True),
    "per_request_tok_s": Figure(
        "stream tok/s", "the median request's output tokens per second while it streamed: the tokens after its "
        "first chunk over the time from that chunk to its last (in a sustained window, its tokens inside it, timed "
        "from or to an edge it streams across); its wait for a first token left out", speed=True),
    "prompt_tok_s": Figure(
        "prompt tok/s", "a request's prompt tokens over its TTFT (a prefill cell's one request with one reply "
        "token; the long-context experiment's median over its prompts)", speed=True),
    "ttft_ms": Figure(
        "TTFT", "time to first token, median over requests: from sending the request to reading its first token "
        "(its queueing and prefill included; a warm cell's prompt is cached first), ms"),
    "itl_ms": Figure(
        "ITL", "inter-token latency, median over tokens (a sustained cell's inside its window): a read carrying k "
        "tokens after a gap g counts k gaps of g/k, ms"),
    "tpot_ms": Figure(
        "TPOT", "time per output token, median over requests of (last token - first token) / (tokens - 1) over "
        "each whole reply, ms; 1000 / TPOT is not stream tok/s, and no table shows or judges it as a speed"),
    "e2e_ms": Figure(
        "E2E", "end to end, median over requests: from sending the request to reading its last token, ms"),
    "energy_j_per_token": Figure(
        "energy per token", "the GPUs' energy over the step (NVML, all GPUs) per output token, J"),
    "goodput_rps": Figure("goodput", "requests a second that met the SLO (open-loop rate cells)"),
    "slo_met_fraction": Figure("met SLO", "the share of an open-loop rate cell's requests that met the SLO"),
}

_PERCENTILE = re.compile(r"^(?P<base>[a-z0-9]+)_p(?P<p>90|99)_ms$")


def figure(key: str) -> Figure | None:
    """A figure's name and definition by its stored field (or TOTAL_OVER_STREAMS); a latency's p90 and p99
    (`ttft_p99_ms`) are named after its median's figure. None for a key this table does not name."""
    if key in FIGURES:
        return FIGURES[key]
    match = _PERCENTILE.match(key)
    base = FIGURES.get(f"{match['base']}_ms") if match else None
    if match is None or base is None:
        return None
    return Figure(f"{base.name} p{match['p']}", f"the {match['p']}th percentile of the samples {base.name} is "
                                                f"the median of, ms")


def name(key: str) -> str:
    """What the reader sees: the figure's name, or the key itself where no figure is named (an experiment's)."""
    found = figure(key)
    return key if found is None else found.name


def header(key: str) -> str:
    """The figure's name as a column header: its first letter capitalised ("Stream tok/s", "TTFT p99")."""
    shown = name(key)
    return shown[:1].upper() + shown[1:]


def definition(key: str) -> str | None:
    found = figure(key)
    return None if found is None else found.definition


def total_over_streams(phase: str, total_tok_s: float | None, concurrency: int) -> float | None:
    """Total ÷ streams: a decode cell's total tok/s over its requests at once; None where that is undefined (no
    total, or not a decode cell: a prefill has one request, a rate cell no fixed count)."""
    if phase != "decode" or total_tok_s is None or concurrency <= 0:
        return None
    return total_tok_s / concurrency


def _stored_keys() -> list[str]:
    """Every stored field a sentence may name, longest first: the figures and their latencies' percentiles."""
    keys = [k for k in FIGURES if k != TOTAL_OVER_STREAMS]
    keys += [k.removesuffix("_ms") + f"_p{p}_ms" for k in FIGURES if k.endswith("_ms") for p in (90, 99)]
    return sorted(keys, key=len, reverse=True)


_FIELD = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, _stored_keys())) + r")(?![\w-])")


def named(sentence: str) -> str:
    """A stored sentence (a recommendation, a verdict's note) with the fields it names shown by their names:
    `worse: per_request_tok_s at decode-...` reads `worse: stream tok/s at decode-...`. The stored sentence
    keeps the fields (summary.json is read by machines); every rendering shows the names."""
    return _FIELD.sub(lambda m: name(m.group(1)), sentence)


def judged_in(key: str) -> list[str]:
    """The phases whose cells the verdict judges this figure in (judged.PHASE_METRICS), in its order."""
    return [phase for phase, metrics in PHASE_METRICS.items() if key in {m for m, _ in metrics}]


def _and(items: list[str]) -> str:
    """`a`, `a and b`, `a, b and c`."""
    return ", ".join(items[:-1]) + f" and {items[-1]}" if len(items) > 1 else "".join(items)


def _judged_text(key: str) -> str:
    phases = judged_in(key)
    if not phases:
        return "no: shown only"
    where = _and(phases) + " cells"
    if key in TELEMETRY_METRICS:
        where += ", where measured"
    elif key in TAIL_METRICS:
        where += ", on enough samples"
    return where


def judged_speeds() -> str:
    """Which speed the verdict judges, from judged.PHASE_METRICS: per phase the tok/s figures it tests, then
    the ones it never does."""
    speeds = [k for k, f in FIGURES.items() if f.speed]
    per_phase = []
    for phase, metrics in PHASE_METRICS.items():
        judged = [name(m) for m, _ in metrics if m in speeds]
        if judged:
            per_phase.append(f"{_and(judged)} in {phase} cells")
    tpot = name("tpot_ms")
    never = [name(k) for k in speeds if not judged_in(k)] + [f"1000 / {tpot}"]
    timed = _and(judged_in("tpot_ms"))
    as_latency = f": {timed} cells judge it as a latency" if timed else ""
    return (f"speed, as the verdict judges it: {'; '.join(per_phase)}; never {' or '.join(never)} ({tpot} is a "
            f"time{as_latency})")


LEGEND_KEYS = ("total_tok_s", TOTAL_OVER_STREAMS, "per_request_tok_s", "prompt_tok_s", "ttft_ms", "itl_ms",
               "tpot_ms", "e2e_ms", "ttft_p99_ms", "itl_p99_ms", "tpot_p99_ms", "e2e_p99_ms", "energy_j_per_token",
               "goodput_rps", "slo_met_fraction")


def legend(keys: Iterable[str] = LEGEND_KEYS, title: str = "The figures") -> Table:
    """The figures as a table: the name every table, chart and sentence uses, the stored field (the export's
    column) it names, what it is, and where the verdict judges it; then which speed the verdict judges."""
    rows: list[list[Item]] = []
    for key in keys:
        found = figure(key)
        if found is None:
            continue
        stored = "— (derived: total_tok_s / concurrency)" if key == TOTAL_OVER_STREAMS else key
        rows.append([found.name, stored, found.definition, _judged_text(key)])
    notes: list[Item] = [
        judged_speeds()[:1].upper() + judged_speeds()[1:] + ".",
        f"A p99 is judged only on enough samples: {TAIL_MIN_SAMPLES} or more in every measurement, "
        f"{TAIL_MIN_REPEATS} launches a side, and the client's own timing noise under the minimum effect of it; "
        f"{name('energy_j_per_token')} only where the GPUs' energy was measured.",
        "These are names: the stored records, summary.json (the verdicts' sentences too) and campaign export keep "
        "the fields, which every table, chart and sentence shows by these names.",
    ]
    return Table(title=title, headers=["Figure", "Stored as", "What it is", "Judged by the verdict"], rows=rows,
                 align="llll", notes=notes)


def markdown() -> str:
    """The legend as docs/results.md holds it (a test compares): `python -m campaign.report.names`."""
    return to_markdown(replace(legend(), title=""))


if __name__ == "__main__":
    sys.stdout.write(markdown() + "\n")
