"""`campaign calibrate`'s output as one table: every cell measured, its repeats' spread, the calibrated
simulator's replay of it and the error, fitted or held out; then the error summaries, the fitted costs and the
power model (or that the run measured no energy)."""

from __future__ import annotations

from collections.abc import Sequence

from campaign.analysis.arrivals import FIGURES as LOAD_FIGURES
from campaign.analysis.arrivals import TERMS
from campaign.analysis.calibrate import PRIOR_WEIGHT
from campaign.report.names import name
from campaign.report.tables import Table
from campaign.report.text import DASH, fmt_num
from campaign.sim.measured import ErrorSummary, FitCell, MeasuredHardware


def _figure(cell: FitCell, value: float | None) -> str:
    if value is None:
        return DASH
    if cell.figure == "energy_j_per_token":
        return f"{value:.3g} J/token"
    if cell.figure in ("ttft_s", "mean_ttft_s"):
        return f"{value * 1000:,.1f} ms"
    return f"{value * 1000:,.2f} ms" if cell.figure == "mean_tpot_s" else f"{fmt_num(value)} tok/s"


# A fitted figure by its name (campaign.report.names): the fit's TTFT is in seconds, the cells' in ms. A load's
# figures (a rate cell or a peer's export replayed at its own times) are vLLM bench's, means over its requests.
FIGURE_NAMES = {"ttft_s": name("ttft_ms"), "total_tok_s": name("total_tok_s"),
                "energy_j_per_token": name("energy_j_per_token"), "mean_ttft_s": "mean TTFT",
                "mean_tpot_s": "mean TPOT", "output_tok_s": "output tok/s"}
LOAD_NOTE = ("a load's figures (a rate cell's or an export's requests replayed at their own send times, with their "
             "own lengths), as vLLM's bench defines them: mean TTFT and mean TPOT ((last - first) / (tokens - 1)) "
             "over its requests; output tok/s, its output tokens over the span from its first send to its last token")


def power_note(entry: MeasuredHardware) -> str:
    """What the entry knows of the GPUs' power: the fit, or that the run measured no energy."""
    power = entry.power
    if power is None:
        return ("power: the run measured no energy (no NVML: a CPU or a GPU without its counter), so joules per "
                "token cannot be predicted on this entry")
    told = "" if power.determined == 2 else ("; these cells do not tell the two apart (measure both a prefill-heavy "
                                             "and a decode-heavy cell: many streams and one)")
    return (f"power (all GPUs): {power.compute_w:,.0f} W while computing, {power.memory_w:,.0f} W while reading "
            f"memory, fitted to {power.cells} decode cell(s)' energy per token: median |error| "
            f"{_pct(power.median_abs_error, False)}, worst {_pct(power.max_abs_error, False)}" + told)


def _pct(value: float | None, signed: bool = True) -> str:
    return DASH if value is None else f"{value:+.1%}" if signed else f"{value:.1%}"


def _summary(what: str, summary: ErrorSummary) -> str:
    if not summary.cells:
        return f"{what}: none"
    return (f"{what}: median |error| {_pct(summary.median_abs, False)}, worst {_pct(summary.max_abs, False)} "
            f"over {summary.cells} cell{'s' if summary.cells != 1 else ''}")


def table(entry: MeasuredHardware, *, iterations: int, unmeasured: Sequence[str], skipped: Sequence[str],
          settled: bool = True, determined: int = len(TERMS), kv_from: str = "as its log said",
          leaned: bool = False) -> Table:
    step = entry.step
    rows = [[c.variant, c.key, FIGURE_NAMES[c.figure], _figure(c, c.measured),
             _pct(c.spread, False) if c.spread is not None else DASH, _figure(c, c.predicted), _pct(c.error),
             "held out: predicted" if c.held_out else "fitted"] for c in entry.fit]
    notes = [
        _summary("fitted", entry.fitted_error),
        _summary("held out (predicted, not fitted)", entry.held_out_error),
        "spread: the repeats' (max - min) / median, the machine's own noise on the cell: an error inside it is the "
        "machine's as much as the model's",
        f"step costs ({iterations} rounds of replay and fit): {step.fixed_s * 1000:.3f} ms a step, "
        f"{step.decode_s_per_token * 1e6:.2f} us a decode position, {step.prefill_s_per_token * 1e6:.3f} us a prompt "
        f"token, {step.attention_s_per_token_ctx * 1e9:.4f} us per 1,000 prompt tokens x context, "
        f"{step.kv_read_s_per_token * 1e9:.3f} ns a token of KV read, {step.request_s * 1000:.2f} ms a request "
        "with the API server",
        f"KV cache {kv_from}: {entry.memory.kv_cache_tokens:,} tokens in {entry.memory.block_size}-token "
        f"blocks; max-model-len {entry.window:,} by default",
        power_note(entry),
    ]
    if any(c.figure in LOAD_FIGURES for c in entry.fit):
        notes.append(LOAD_NOTE)
    if leaned:
        notes.append("prior: the hardware tables' costs for the profile's card and model (or the measured entry it "
                     f"names), which the fit started from and leans on, as one figure's {PRIOR_WEIGHT:.0%} error, "
                     "only where the evidence does not tell the terms apart")
    if not settled:
        notes.append(f"the fit did not settle in {iterations} rounds: the last moved a cell's figure by over 0.2%")
    if determined < len(TERMS):
        notes.append(f"these cells tell apart {determined} of the {len(TERMS)} cost terms (one context, one load, "
                     "one chunk each tell one direction): figures at other contexts, loads or chunks rest on an "
                     "arbitrary split; measure more shapes to pin them")
    if unmeasured:
        notes.append(f"not exercised by these cells, left at 0: {', '.join(unmeasured)}")
    notes += [f"skipped {line}" for line in skipped]
    return Table(title=f"calibration {entry.name}", align="llllrrrl",
                 headers=["Variant", "Cell", "Figure", "Measured", "Spread", "Simulated", "Error", ""],
                 rows=rows, notes=notes)
