"""`campaign tune`'s report: per round, phase 1's predictions (labelled as such, with what they rest on), the
Pareto front, the exhaustive grid where asked, and phase 2's predicted and measured figures side by side with
each candidate's verdict; then the last word. Tables only (one model, the text and Markdown renderers)."""

from __future__ import annotations

from collections.abc import Mapping

from campaign.plan.search import Evaluation, SearchResult
from campaign.report.names import header
from campaign.report.tables import Table
from campaign.report.text import DASH, fmt_num
from campaign.server.profiles import FlagValue
from campaign.stored.records import Manifest

RANKED = 10   # phase 1's best configurations shown


def flags_text(flags: Mapping[str, FlagValue]) -> str:
    return ", ".join(f"{k} {v}" for k, v in flags.items()) or "(the baseline's)"


def amount(value: float, unit: str) -> str:
    """A count of agents whole, tok/s to a tenth, good req/s to three figures."""
    if unit == "agents":
        return f"{value:.0f} {unit}"
    return f"{fmt_num(value)} {unit}" if unit == "tok/s" else f"{value:.3g} {unit}"


def _value(e: Evaluation, unit: str) -> str:
    return amount(e.value, unit) if e.feasible else f"0 ({e.infeasible})"


def _row(e: Evaluation, unit: str) -> list[str]:
    return [flags_text(e.flags), _value(e, unit), fmt_num(e.kv_cache_tokens),
            DASH if e.per_request_tok_s is None else f"{e.per_request_tok_s:.1f} at {e.concurrency}",
            DASH if e.ttft_p99_s is None else f"{e.ttft_p99_s * 1000:,.0f} ms"]


HEADERS = ["Flags", "Predicted", "KV cache", f"{header('per_request_tok_s')} (at agents)", "TTFT p99"]


def search_table(number: int, basis: str, found: SearchResult, baseline: Evaluation, grid: int | None) -> Table:
    unit = found.objective.unit
    rows = [_row(baseline, unit) + ["baseline"]] + [_row(e, unit) + [""] for e in found.ranked()[:RANKED]]
    share = "" if grid is None else f" ({len(found.evaluations) / grid:.0%} of the grid's {grid})"
    notes = [f"predicted on the simulator, in simulated time: {basis}",
             f"{len(found.evaluations)} configurations evaluated{share}; the optimiser asked {found.asked} times "
             "(a configuration asked again is answered from its first evaluation)"]
    front = found.pareto()
    if front:
        better = "less" if found.objective.lower_is_better else "more"
        notes.append(f"Pareto front ({better} {unit}, or more KV cache): " + "; ".join(
            f"{amount(e.value, unit)} with {fmt_num(e.kv_cache_tokens)} tokens ({flags_text(e.flags)})"
            for e in front))
    return Table(title=f"Round {number}, phase 1: the search, predicted", headers=[*HEADERS, ""], rows=rows,
                 align="lrrrrl", notes=notes)


def exhaustive_table(found: SearchResult, every: SearchResult) -> Table:
    unit = found.objective.unit
    best, pick = every.best(), found.best()
    notes = [f"every configuration of the grid: {len(every.evaluations)}, predicted"]
    if best is not None and pick is not None:
        gap = 0.0 if not best.value else pick.value / best.value - 1
        notes.append(f"the grid's best: {amount(best.value, unit)} ({flags_text(best.flags)}); the search's pick: "
                     f"{amount(pick.value, unit)} ({gap:+.1%}) after {len(found.evaluations)} evaluations "
                     f"({len(found.evaluations) / len(every.evaluations):.0%} of the grid)")
    return Table(title="The exhaustive grid (the yardstick for the search)", notes=notes)


def measured_where(manifest: Manifest) -> str:
    """Where a confirmation night measured, from its manifest: a real server, or the simulator."""
    if manifest.engine != "sim":
        return "on the real server"
    return "on the simulator in simulated time" if manifest.clock == "virtual" else "on the simulator over HTTP"


def confirmation_table(number: int, load: int, figure: str, run: str,
                       rows: list[tuple[str, str, float | None, float | None, float | None, str, str]],
                       missed: list[str], where: str = "on the real server") -> Table:
    # Three significant figures where the figure is small (joules per token, good requests a second: 0.107 and
    # 0.168 good req/s both read 0.1 and 0.2 at one decimal).
    shown = "{:.3g}" if figure in ("J/token", "good req/s") else "{:.1f}"
    grid = [[variant, flags, DASH if p is None else shown.format(p), DASH if m is None else shown.format(m),
             DASH if e is None else f"{e:+.1%}", status, outcome] for variant, flags, p, m, e, status, outcome in rows]
    notes = [f"measured {where}: {run}", "error: predicted / measured - 1"]
    notes += [f"the model missed: {line}" for line in missed]
    at = f" at {load} agents" if figure == "tok/s per agent" else ""
    return Table(title=f"Round {number}, phase 2: against the baseline{at}",
                 headers=["Variant", "Flags", f"Predicted {figure}", "Measured", "Error", "Status", "Verdict"],
                 rows=grid, align="llrrrll", notes=notes)
