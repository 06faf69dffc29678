"""`campaign calibrate`'s output as one table: every cell measured, its repeats' spread, the calibrated
simulator's replay of it and the error, fitted or held out; then the error summaries and the fitted costs."""

from __future__ import annotations

from collections.abc import Sequence

from campaign.report.tables import Table
from campaign.report.text import DASH, fmt_num
from campaign.sim.measured import ErrorSummary, FitCell, MeasuredHardware


def _figure(cell: FitCell, value: float | None) -> str:
    if value is None:
        return DASH
    return f"{value * 1000:,.1f} ms" if cell.figure == "ttft_s" else f"{fmt_num(value)} tok/s"


def _pct(value: float | None, signed: bool = True) -> str:
    return DASH if value is None else f"{value:+.1%}" if signed else f"{value:.1%}"


def _summary(what: str, summary: ErrorSummary) -> str:
    if not summary.cells:
        return f"{what}: none"
    return (f"{what}: median |error| {_pct(summary.median_abs, False)}, worst {_pct(summary.max_abs, False)} "
            f"over {summary.cells} cell{'s' if summary.cells != 1 else ''}")


def table(entry: MeasuredHardware, *, iterations: int, unmeasured: Sequence[str], skipped: Sequence[str],
          settled: bool = True, determined: int = 5) -> Table:
    step = entry.step
    rows = [[c.variant, c.key, "TTFT" if c.figure == "ttft_s" else "total tok/s", _figure(c, c.measured),
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
        f"{step.kv_read_s_per_token * 1e9:.3f} ns a token of KV read",
        f"KV cache as its log said: {entry.memory.kv_cache_tokens:,} tokens in {entry.memory.block_size}-token "
        f"blocks; max-model-len {entry.window:,} by default",
    ]
    if not settled:
        notes.append(f"the fit did not settle in {iterations} rounds: the last moved a cell's figure by over 0.2%")
    if determined < 5:
        notes.append(f"these cells tell apart {determined} of the 5 cost terms (one context, one load, one chunk "
                     "each tell one direction): figures at other contexts, loads or chunks rest on an arbitrary "
                     "split; measure more shapes to pin them")
    if unmeasured:
        notes.append(f"not exercised by these cells, left at 0: {', '.join(unmeasured)}")
    notes += [f"skipped {line}" for line in skipped]
    return Table(title=f"calibration {entry.name}", align="llllrrrl",
                 headers=["Variant", "Cell", "Figure", "Measured", "Spread", "Simulated", "Error", ""],
                 rows=rows, notes=notes)
