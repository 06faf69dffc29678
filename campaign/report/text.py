"""Presentation only: cell results and facts -> labelled tables (campaign.report.tables), rendered as text here and
as Markdown and HTML by html_report. No measurement, no I/O: every function takes what was read for it.

Long (about 935 lines): one function per table the tool prints (cells, plan, diff, verdict, experiments,
virtual replays, export rows); each is short and they share the column vocabulary defined here, the figures'
names and definitions taken from campaign.report.names."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any, Protocol

from campaign.analysis.compare import CAVEAT, Comparison
from campaign.core.progress import fmt_duration
from campaign.measure.cells import CAVEATS, CellResult, CellSpec, Reason
from campaign.measure.judged import FAMILY_ALPHA
from campaign.plan.planning import Plan, Power, VariantPlan, cell_s, kv_unknown
from campaign.report import names
from campaign.report.names import TOTAL_OVER_STREAMS, header
from campaign.report.tables import Cell, Item, Table, to_text
from campaign.report.tables import cell as as_cell
from campaign.stored.records import ExperimentRecord, FailureRecord, ServerRecord, TuneRecord

DASH = "—"


def fmt_num(value: float | int | None, digits: int = 1) -> str:
    if value is None:
        return DASH
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}f}"


def fmt_ms(value: float | None) -> str:
    return DASH if value is None else f"{value:,.0f} ms"


def fmt_context(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens >= 1024 and tokens % 1024 == 0 else f"{tokens:,}"


def fmt_itl(ms: float | None) -> str:
    return DASH if ms is None else f"{ms:.1f} ms"


def text(tables: Iterable[Table | None]) -> str:
    """Tables as the command line prints them: one blank line between."""
    return "\n\n".join(to_text(t) for t in tables if t is not None)


def _why(cell: CellResult) -> str | None:
    return "; ".join(cell.reasons) or None


def _concurrency_header(concurrency: int) -> str:
    return f"{concurrency} (single-stream)" if concurrency == 1 else f"{concurrency} (aggregate)"


def _matrix_cell(cell: CellResult | None, top: float) -> Cell:
    if cell is None:
        return Cell(DASH)
    if cell.status == "Over capacity":
        return Cell("Over capacity", title=_why(cell), cls="cell over")
    if cell.status != "Valid":
        return Cell(cell.status, title=_why(cell), cls="cell bad")
    shown = f"{fmt_num(cell.total_tok_s)} tok/s · {fmt_ms(cell.ttft_ms)} TTFT"
    share = (cell.total_tok_s or 0.0) / top if top > 0 else 0.0
    return Cell(shown, title=f"{cell.label}: {shown}", cls="cell", heat=share)


def decode_matrix_table(cells: Sequence[CellResult]) -> Table | None:
    """Seed 004's speed-test matrix: rows context, columns concurrency, total tok/s and TTFT per cell, shaded in
    HTML by share of the best Valid cell."""
    decode = [c for c in cells if c.phase == "decode"]
    if not decode:
        return None
    contexts = sorted({c.context_tokens for c in decode})
    concurrencies = sorted({c.concurrency for c in decode})
    by_key = {(c.context_tokens, c.concurrency): c for c in decode}
    top = max((c.total_tok_s or 0.0 for c in decode if c.status == "Valid"), default=0.0)
    rows: list[list[Item]] = [[fmt_context(ctx), *(_matrix_cell(by_key.get((ctx, conc)), top) for conc in
                                                   concurrencies)] for ctx in contexts]
    return Table(title="Decode: total tok/s across all simultaneous requests · rows context, columns requests at once",
                 headers=["Context", *map(_concurrency_header, concurrencies)], rows=rows, cls="heat")


def decode_matrix(cells: Sequence[CellResult]) -> str | None:
    table = decode_matrix_table(cells)
    return None if table is None else to_text(table)


def prefill_table(cells: Sequence[CellResult]) -> Table | None:
    prefill = sorted((c for c in cells if c.phase == "prefill"), key=lambda c: c.context_tokens)
    if not prefill:
        return None
    rows: list[list[Item]] = [
        [fmt_context(c.context_tokens),
         Cell(f"{fmt_num(c.prompt_tok_s)} prompt tok/s") if c.status == "Valid" else Cell(c.status, title=_why(c),
                                                                                          cls="bad"),
         fmt_ms(c.ttft_ms)] for c in prefill]
    return Table(title="Prefill (single-stream, one request, max_tokens 1)",
                 headers=["Context", header("prompt_tok_s"), header("ttft_ms")], rows=rows,
                 header_titles=[None, names.definition("prompt_tok_s"), names.definition("ttft_ms")])


def prefill_row(cells: Sequence[CellResult]) -> str | None:
    table = prefill_table(cells)
    return None if table is None else to_text(table)


# The figures among the columns, by the stored field (or the figure derived when shown) each one shows: their
# headers are the figures' names, and in HTML their hover text what each is (campaign.report.names).
ALL_FIGURES = ("total_tok_s", TOTAL_OVER_STREAMS, "per_request_tok_s", "ttft_ms", "itl_ms", "ttft_p99_ms",
               "itl_p99_ms", "tpot_ms", "e2e_p99_ms")
# Two tables, not one of twenty columns (which ran off a 1280-px screen): what each cell measured, then how.
_ALL_COLUMNS: list[tuple[str, str | None]] = [
    *((h, None) for h in ("Phase", "Context", "Requests at once", "Status")),
    *((header(k), k) for k in ALL_FIGURES)]
ALL_HEADERS = [h for h, _ in _ALL_COLUMNS]
ALL_TITLES = [None if k is None else names.definition(k) for _, k in _ALL_COLUMNS]
HOW_HEADERS = ["Phase", "Context", "Requests at once", "Label", "Average active", "Completed", "Output tokens",
               "Measured for", "Discarded steps", "Prefix-cache hits"]


def tail_columns(c: CellResult) -> list[str]:
    """TTFT p99, ITL p99 (per token), TPOT (median), E2E p99: the figures service levels are set on."""
    return [fmt_ms(c.ttft_p99_ms), fmt_itl(c.itl_p99_ms), fmt_itl(c.tpot_ms), fmt_ms(c.e2e_p99_ms)]


def _phase_name(c: CellResult) -> str:
    return {"prefill": "Prefill", "rate": "Rate (open loop)"}.get(c.phase, f"Decode ({c.spec.mode})")


def _measurement_row(c: CellResult) -> list[Item]:
    return [
        _phase_name(c),
        fmt_context(c.context_tokens), str(c.concurrency),
        Cell(c.status, title=_why(c), cls=None if c.status == "Valid" else "bad"),
        fmt_num(c.prompt_tok_s if c.phase == "prefill" else c.total_tok_s),
        fmt_num(names.total_over_streams(c.phase, c.total_tok_s, c.concurrency)),
        fmt_num(c.per_request_tok_s), fmt_ms(c.ttft_ms),
        fmt_itl(c.itl_ms), *tail_columns(c),
    ]


def _how_row(c: CellResult) -> list[Item]:
    return [
        _phase_name(c), fmt_context(c.context_tokens), str(c.concurrency), c.label, fmt_num(c.avg_active),
        fmt_num(c.completed), fmt_num(c.output_tokens), DASH if c.measured_s is None else f"{c.measured_s:.1f} s",
        f"{c.discarded_steps} ({c.discarded_tokens} tok)" if c.discarded_steps else "0",
        DASH if c.prefix_cache_hits is None else f"{c.prefix_cache_hits:.0f}",
    ]


def all_measurements_tables(cells: Sequence[CellResult]) -> list[Table]:
    """Every cell's figures, then how each was measured, the speculative-decoding figures, why cells are not
    Valid, and their notes."""
    out = [Table(title="All measurements (latencies are medians unless a column says p99; prefill rows show prompt "
                       "tok/s under total tok/s)", headers=ALL_HEADERS, rows=[_measurement_row(c) for c in cells],
                 align="lrrl", header_titles=ALL_TITLES),
           Table(title="How each was measured", headers=HOW_HEADERS, rows=[_how_row(c) for c in cells],
                 align="lrrl")]
    speculative = [c for c in cells if c.spec_acceptance_rate is not None]
    if speculative:
        out.append(Table(
            title="Speculative decoding (from vllm:spec_decode_* counters over each step)",
            headers=["Context", "Requests at once", "Prompts", header("total_tok_s"), "Acceptance rate",
                     "Mean accepted per draft", "Mean acceptance length"],
            rows=[[fmt_context(c.context_tokens), str(c.concurrency), _prompts_label(c.spec),
                   fmt_num(c.total_tok_s), f"{100 * (c.spec_acceptance_rate or 0):.1f}%",
                   fmt_num(c.spec_mean_accepted, 2), fmt_num(c.spec_mean_acceptance_length, 2)]
                  for c in speculative]))
    energy = [c for c in cells if c.energy_j_per_token is not None]
    if energy:
        out.append(Table(
            title="Energy (NVML, all GPUs over each step)",
            headers=["Phase", "Context", "Requests at once", header("total_tok_s"), header("energy_j_per_token")],
            rows=[["Decode", fmt_context(c.context_tokens), str(c.concurrency), fmt_num(c.total_tok_s),
                   f"{c.energy_j_per_token:,.3f} J/token"] for c in energy]))
    # A caveat is said beside a Valid cell; a cell that is not Valid says all its reasons under why.
    why = [f"{fmt_context(c.context_tokens)} x {c.concurrency} {c.phase}: {c.status}: {r}" for c in cells
           for i, r in enumerate(c.reasons)
           if c.status != "Valid" or i >= len(c.reason_codes) or c.reason_codes[i] not in CAVEATS]
    if why:
        out.append(Table(title="Why cells are not Valid", notes=why))
    caveats = [f"{fmt_context(c.context_tokens)} x {c.concurrency} {c.phase}: {r}" for c in cells
               for r, code in zip(c.reasons, c.reason_codes, strict=False) if code in CAVEATS and c.status == "Valid"]
    if caveats:
        out.append(Table(title="Valid, with a caveat", notes=caveats))
    remarks = [f"{fmt_context(c.context_tokens)} x {c.concurrency} {c.phase}: {n}" for c in cells for n in c.notes]
    if remarks:
        out.append(Table(title="Notes", notes=remarks))
    return out


def _prompts_label(spec: CellSpec) -> str:
    return spec.prompts if spec.endpoint == "completions" else f"{spec.prompts} (chat)"


def all_measurements(cells: Sequence[CellResult]) -> str:
    return text(all_measurements_tables(cells))


RATE_HEADERS = ["Context", "Reply", "Rate asked", "Rate sent", "Status", "SLO held", header("goodput_rps"),
                header("slo_met_fraction"), header("ttft_p99_ms"), header("tpot_p99_ms"), header("e2e_p99_ms"),
                "In flight (mean / peak)", "Requests", header("total_tok_s")]


def _rate_text(rate: float | None) -> str:
    return "inf" if rate is None else f"{rate:.3g} req/s"


def rate_table(cells: Sequence[CellResult]) -> Table | None:
    """Open-loop cells: the rate asked and sent, whether the SLO held, goodput and the latencies a service
    level is set on (in the hardware's time on a time-scaled simulator)."""
    rates = sorted((c for c in cells if c.phase == "rate"),
                   key=lambda c: (c.context_tokens, c.request_rate is None, c.request_rate or 0.0))
    if not rates:
        return None
    slos = sorted({c.spec.slo.text for c in rates if c.spec.slo is not None})
    rows: list[list[Item]] = []
    for c in rates:
        held = DASH if c.slo_passed is None else ("yes" if c.slo_passed else "no")
        rows.append([
            fmt_context(c.context_tokens), str(c.max_tokens or c.spec.max_tokens), _rate_text(c.request_rate),
            DASH if c.achieved_rate_rps is None else f"{c.achieved_rate_rps:.3g} req/s",
            Cell(c.status, title=_why(c), cls=None if c.status == "Valid" else "bad"),
            Cell(held, cls=None if c.slo_passed is None else ("better" if c.slo_passed else "bad")),
            DASH if c.goodput_rps is None else f"{c.goodput_rps:.3g} req/s",
            DASH if c.slo_met_fraction is None else f"{100 * c.slo_met_fraction:.0f}%",
            fmt_ms(c.ttft_p99_ms), fmt_itl(c.tpot_p99_ms), fmt_ms(c.e2e_p99_ms),
            f"{fmt_num(c.avg_in_flight)} / {DASH if c.max_in_flight is None else c.max_in_flight}",
            str(len(c.requests)), fmt_num(c.total_tok_s)])
    return Table(title="Open-loop rates" + (f" (SLO: {'; '.join(slos)})" if slos else " (no SLO given)"),
                 headers=RATE_HEADERS, rows=rows, align="rrrrllrrrrrrrr")


def cells_tables(cells: Sequence[CellResult]) -> list[Table]:
    """The decode matrix, the prefill row, the open-loop rates (with their steadiness and cache), the server's
    view beside the client's, and all measurements of one server's cells."""
    return [t for t in (decode_matrix_table(cells), prefill_table(cells), rate_table(cells),
                        open_loop_state_table(cells), server_view_table(cells)) if t] + all_measurements_tables(cells)


def tune_table(record: TuneRecord) -> Table:
    """A `campaign tune` night's evidence (tune.json): each variant's predicted and measured figure at the
    objective's load, the prediction's error, the cell's status and its verdict against the baseline; what the
    predictions rest on said first."""
    rows: list[list[Item]] = []
    for p in record.predictions:
        error = DASH if p.predicted is None or not p.measured else f"{p.predicted / p.measured - 1:+.1%}"
        rows.append([p.variant, ", ".join(f"{k} {v}" for k, v in p.flags.items()) or "(the baseline's)",
                     fmt_num(p.predicted), fmt_num(p.measured), error, p.status, p.outcome or DASH])
    load = f" at {record.load} at once" if record.load else ""
    return Table(title=f"What campaign tune predicted for this night (round {record.round}), and what it measured",
                 lead=[f"objective: {record.objective}; figure: {record.figure}{load}",
                       f"the predictions rest on: {record.basis}"],
                 headers=["Variant", "Flags", "Predicted", "Measured", "Prediction's error", "Status",
                          "Verdict against the baseline"], rows=rows, align="llrrrll")


def server_view_table(cells: Sequence[CellResult]) -> Table | None:
    """The server's own view of each cell beside the client's (format 15): vLLM's mean TTFT and mean gap
    between a request's outputs from its histograms between the cell's scrapes, the client's mean TTFT over the
    same requests, and the gap between the two TTFTs (what the client's path added); None where no cell has it."""
    seen = [c for c in cells if c.server_ttft_mean_ms is not None]
    if not seen:
        return None

    def gap(c: CellResult) -> Item:
        if c.client_ttft_mean_ms is None or c.server_ttft_mean_ms is None:
            return DASH
        over = Reason.CLIENT_TTFT_OVER_SERVER in c.reason_codes
        difference = round(c.client_ttft_mean_ms - c.server_ttft_mean_ms, 1) + 0.0   # no "-0.0"
        return Cell(f"{difference:+,.1f} ms", cls="warn" if over else None)

    rows: list[list[Item]] = [[c.spec.key, fmt_ms(c.client_ttft_mean_ms), fmt_ms(c.server_ttft_mean_ms), gap(c),
                               fmt_itl(c.server_itl_mean_ms), fmt_num(c.server_first_tokens)] for c in seen]
    return Table(title="The server's own view beside the client's (vLLM's request histograms over each cell)",
                 headers=["Cell", "Client mean TTFT", "Server mean TTFT", "Client - server", "Server mean gap between "
                          "outputs", "First tokens it counted"], rows=rows, align="lrrrrr",
                 notes=[Cell("the difference is what the client's side adds to the server's first token (the socket, "
                             "the stream's framing, the client's loop; a proxy's buffering): past 200 ms of the "
                             "client's clock and 10% the cell carries the caveat client_ttft_over_server",
                             cls="note")])


def open_loop_state_table(cells: Sequence[CellResult]) -> Table | None:
    """Each open-loop cell's steadiness over its schedule (steady.Steadiness: throughput and TPOT by interval,
    their trend) and the prefix cache's state before its step (cachestate.CacheState); None without either."""
    seen = [c for c in cells if c.phase == "rate" and (c.steadiness is not None or c.cache_state is not None)]
    if not seen:
        return None
    rows: list[list[Item]] = [[c.spec.key,
                               DASH if c.steadiness is None else Cell(c.steadiness.describe(),
                                                                      cls="warn" if c.steadiness.drifting else None),
                               DASH if c.cache_state is None else c.cache_state.note()] for c in seen]
    return Table(title="Open-loop cells: the steady state over the schedule, and the cache before the step",
                 headers=["Cell", "Steady state", "Prefix cache before the step"], rows=rows, align="lll")


def cells_report(cells: Sequence[CellResult]) -> str:
    return text(cells_tables(cells))


def cell_json(cell: CellResult, *, with_requests: bool = True) -> dict[str, object]:
    data = cell.model_dump(mode="json")
    data.pop("spec")
    if not with_requests:
        data.pop("requests")
    return data


def _fmt_fact(value: object) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return DASH if value is None else str(value)


DIFF_HEADERS = ["Cell", "Label", "Metric", "Baseline", "Variant", "Change", "95% CI", "n", "Verdict"]
VERDICT_CLASS = {"better": "better", "worse": "worse", "no difference": "noise", "not settled": "warn",
                 "not judged": "noise"}
NOTHING_TO_COMPARE = "nothing to compare: the run has only the baseline"


def _verdict_rows(d: Any) -> list[list[Item]]:
    rows: list[list[Item]] = []
    for cell in d.cells:
        for m in cell.metrics:
            ci = DASH if m.ci95_pct is None else f"[{m.ci95_pct[0]:+.1f}%, {m.ci95_pct[1]:+.1f}%]"
            rows.append([
                cell.key, cell.label, Cell(names.name(m.metric), title=names.definition(m.metric)),
                fmt_num(m.baseline), fmt_num(m.variant),
                DASH if m.change_pct is None else f"{m.change_pct:+.1f}%", ci, f"{m.n_baseline}/{m.n_variant}",
                Cell(m.verdict + (f" ({names.named(m.note)})" if m.note else ""), cls=VERDICT_CLASS.get(m.verdict)),
            ])
        if cell.status_note:
            rows.append([cell.key, cell.label, "status", "", "", "", "", "", Cell(cell.status_note, cls="bad")])
    return rows


def diff_table(d: Any) -> Table:
    """One variant against its baseline: flag and fact changes, per-cell verdicts with 95% intervals, and the
    recommendation; every figure by its name (campaign.report.names), the stored sentence's fields too."""
    lead: list[Item] = []
    if not d.comparable:
        lead.append(Cell(f"NOT COMPARABLE: {d.not_comparable_reason} (use --force to compare anyway)", cls="warn"))
    lead += [f"flag  {key}: {_fmt_fact(a)} -> {_fmt_fact(b)}" for key, a, b in d.flag_changes]
    if d.suggested:
        s = d.suggested
        lead.append(f"      ({s['flag']} {s['resolved']:g} = the {s['suggested']:g} vLLM's log suggested, "
                    f"less a {s['margin']:g} safety margin)")
    lead += [f"fact  {key}: {_fmt_fact(a)} -> {_fmt_fact(b)}{'' if pct is None else f' ({pct:+.1f}%)'}"
             for key, a, b, pct in d.fact_changes]
    return Table(title=f"{d.variant} vs {d.baseline}", lead=lead, headers=DIFF_HEADERS, rows=_verdict_rows(d),
                 align="lllrrrrrl", cls="stack", notes=[Cell(f"tests: {d.family_line}", cls="note"),
                                           Cell(f"recommendation: {names.named(d.recommendation)}",
                                                cls="recommendation")])


JUDGED_SPEEDS = names.judged_speeds()  # said once under the diff tables, and in the report's legend


def diff_text(diffs: Sequence[Any]) -> str:
    """Flag and facts diffs, per-cell verdicts with 95% intervals, and the closing recommendations."""
    tables = [diff_table(d) for d in diffs]
    if not tables:
        return NOTHING_TO_COMPARE
    return text(replace(t, title=f"== {t.title} ==") for t in tables) + f"\n\n{JUDGED_SPEEDS}"


def compare_text(c: Comparison) -> str:
    """`campaign compare`: night B's variants against night A's of the same names, with the caveat first, what
    differs between the nights, each night's drift, the diff tables, and a verdict line a variant (withheld,
    with why, where the nights cannot be read as one machine)."""
    lines = [f"night B ({c.second.root}) against night A ({c.first.root}): each variant against its namesake",
             f"caveat: {CAVEAT}",
             "between the nights: " + "; ".join(c.differences),
             f"drift: A: {c.drifts[0].message}; B: {c.drifts[1].message}"]
    if c.unmatched:
        lines.append("not compared (no variant of that name in the other night): " + ", ".join(c.unmatched))
    if not c.diffs:
        return "\n".join([*lines, "", "nothing to compare: the nights share no variant name"])
    tables = []
    for d in c.diffs:
        table = diff_table(d)
        if c.withheld:
            table = replace(table, notes=[*table.notes[:-1], Cell(
                f"no verdict across the nights ({c.withheld}); read alone, the figures say: "
                f"{names.named(d.recommendation)}", cls="recommendation")])
        tables.append(replace(table, title=f"== {table.title} =="))
    verdicts = ["== Across the nights =="]
    for d in c.diffs:
        name = d.variant.removesuffix("@B")
        word = f"no verdict ({c.withheld})" if c.withheld else d.outcome + (", provisionally" if d.provisional
                                                                             else "")
        verdicts.append(f"{name}: {word}: {names.named(d.headline)}")
    return "\n".join(lines) + "\n\n" + text(tables) + f"\n\n{JUDGED_SPEEDS}\n\n" + "\n".join(verdicts)


OUTCOME_CLASS = {"keep": "better", "revert": "worse", "no difference": "noise", "not settled": "warn"}


def floor_capacity(base: dict[str, Any] | None, other: dict[str, Any] | None) -> str:
    """`4 -> 8 at 40 stream tok/s`: the streams that each hold the speed floor (short answers), baseline -> variant;
    a figure beside the verdict, which the diff's cells (not this count) decide."""
    a, b = (base or {}).get("useful_concurrency"), (other or {}).get("useful_concurrency")
    floor = (other or {}).get("useful_floor_tok_s") or (base or {}).get("useful_floor_tok_s")
    if a is None or b is None or not floor:
        return DASH
    return f"{fmt_num(a, 0)} -> {fmt_num(b, 0)} at {floor:g} {names.name('per_request_tok_s')}"


def verdict_table(diffs: Sequence[Any], *, drift: str, latest: dict[str, dict[str, CellResult]],
                  servers: Sequence[ServerRecord | FailureRecord],
                  short: dict[str, dict[str, Any]] | None = None) -> Table:
    """The answer first (issue 18): per variant keep, revert, no difference or not settled, with the sentence
    that says why (the flags changed, the figures beyond noise, the KV cache, capacity, cells not measured)
    and the streams that hold the speed floor on each side; then the run's health: drift, cells not Valid and
    why, launches that failed. The same table opens the HTML and Markdown reports and ends `campaign run`'s
    console output."""
    rows: list[list[Item]] = []
    answers = short or {}
    for d in diffs:
        outcome = d.outcome + (", provisionally" if d.provisional else "")
        said = Cell(names.named(d.headline), more=names.named(d.recommendation)) if d.headline else Cell(
            names.named(d.recommendation))
        rows.append([d.variant, Cell(outcome, cls=OUTCOME_CLASS.get(d.outcome)), said,
                     floor_capacity(answers.get(d.baseline), answers.get(d.variant))])
    health: list[Item] = [Cell(f"drift: {drift}", cls="note")]
    not_valid = [(variant, c) for variant, cells in latest.items() for c in cells.values() if c.status != "Valid"]
    total = sum(len(cells) for cells in latest.values())
    if not_valid:
        by_status: dict[str, int] = {}
        for _, c in not_valid:
            why = ", ".join(sorted({code.value for code in c.reason_codes}))
            label = c.status + (f" ({why})" if why else "")
            by_status[label] = by_status.get(label, 0) + 1
        listed = "; ".join(f"{n} {label}" for label, n in sorted(by_status.items()))
        health.append(Cell(f"cells not Valid: {len(not_valid)} of {total} ({listed}); where: "
                           + ", ".join(f"{v} {c.spec.key}" for v, c in not_valid[:6])
                           + (", ..." if len(not_valid) > 6 else ""), cls="warn"))
    else:
        health.append(Cell(f"cells not Valid: none of {total}", cls="note"))
    failed = [s for s in servers if s.kind == "failure"]
    health += [Cell(f"launch failed: {s.variant}: {failure_line(s)}", cls="warn") for s in failed] or [
        Cell("launches failed: none", cls="note")]
    if not rows:
        health.insert(0, Cell(NOTHING_TO_COMPARE, cls="note"))
    return Table(title="Verdict", headers=["Variant", "Verdict", "In one sentence", "Streams at the floor"] if rows
                 else (),
                 rows=rows, align="llll", notes=health, cls="verdict")


WHY = "  why: "   # the verdict line's reasoning, on a line of its own under it


def verdict_lines(table: Table) -> list[str]:
    """The verdict as lines ("variant: outcome: headline [streams at the floor]", with the whole reasoning on
    an indented line under it, then the health lines): the end of the console output and the opening of the
    Markdown report, word for word."""
    out = []
    for row in table.rows:
        variant, outcome, why, floor = (as_cell(item) for item in row)
        out.append(f"{variant.text}: {outcome.text}: {why.text}"
                   + ("" if floor.text == DASH else f" [streams at the floor: {floor.text}]"))
        if why.more:
            out.append(WHY + why.more)
    return out + [as_cell(n).text for n in table.notes]


EXPORT_FIELDS = ["variant", "phase", "context_tokens", "concurrency", "label", "status", "total_tok_s",
                 "per_request_tok_s", "prompt_tok_s", "ttft_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_ms",
                 "itl_p90_ms", "itl_p99_ms", "tpot_ms", "tpot_p90_ms", "tpot_p99_ms", "e2e_ms", "e2e_p90_ms",
                 "e2e_p99_ms", "latency_requests", "itl_samples",
                 # the server's own view beside the client's (format 15)
                 "server_first_tokens", "server_ttft_mean_ms", "server_itl_mean_ms", "client_ttft_mean_ms",
                 # the server's queue, the client's stall bound, the simulator's lag behind its clock (format 19)
                 "server_queue_mean_ms", "waiting_max", "fell_behind_s", "waiting_at_end", "client_stall_bound",
                 "sim_behind_share",
                 "energy_j_per_token", "avg_active", "completed",
                 "output_tokens", "measured_s", "time_scale", "discarded_steps", "discarded_tokens",
                 # rate cells (format 6)
                 "request_rate", "achieved_rate_rps", "goodput_rps", "slo_met_fraction", "slo_passed",
                 "send_lag_p99_ms", "avg_in_flight", "max_in_flight", "repeat", "reasons", "notes"]


def export_rows(cells: Sequence[Any]) -> list[dict[str, Any]]:
    rows = []
    for stored in cells:
        data = stored.result.model_dump(mode="json")
        row = {k: data.get(k) for k in EXPORT_FIELDS}
        row["variant"] = stored.variant
        row["repeat"] = stored.repeat
        row["reasons"] = "; ".join(data.get("reasons") or [])
        row["notes"] = "; ".join(data.get("notes") or [])
        rows.append(row)
    return rows


def rows_json(rows: list[dict[str, Any]]) -> str:
    import json

    return json.dumps({"rows": rows}, indent=1) + "\n"


def rows_csv(rows: list[dict[str, Any]]) -> str:
    import csv
    import io

    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=EXPORT_FIELDS)
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return buffer.getvalue()


def latest_cells(stored: Iterable[Any]) -> dict[str, dict[str, CellResult]]:
    """Variant -> cell key -> the latest repeat's result, from stored cells (store.StoredCell)."""
    latest: dict[str, dict[str, CellResult]] = {}
    for s in sorted(stored, key=lambda s: int(s.repeat)):
        latest.setdefault(s.variant, {})[s.result.spec.key] = s.result
    return latest


def failure_line(failure: FailureRecord) -> str:
    return f"FAILED TO START ({failure.failure_kind}): {failure.message}"


def cells_by_variant_text(stored: Iterable[Any], servers: Sequence[ServerRecord | FailureRecord]) -> str:
    """Per variant, the speed-test matrix and all measurements (the latest repeat of each cell), then the launches
    that never became ready; from a run's stored cells and servers (RunDir.cells(), RunDir.servers())."""
    parts = [f"### {variant}\n{cells_report(list(cells.values()))}"
             for variant, cells in latest_cells(stored).items()]
    parts += [f"### {s.variant}: {failure_line(s)}" for s in servers if s.kind == "failure"]
    return "\n\n".join(parts)


def _shown_facts(server: ServerRecord) -> dict[str, Any]:
    """The facts a launch established (None: not known; the failure field belongs to failed launches)."""
    return {k: v for k, v in server.facts.model_dump().items() if v is not None and k != "failure"}


def facts_table(variant: str, servers: Sequence[ServerRecord | FailureRecord]) -> Table:
    """What each of the variant's launches became (startup log, cross-checked with /metrics): a row a fact, a
    column a launch (a few launches, a dozen facts: it fits a screen, where a line of key=value did not); a
    launch that failed says why under it."""
    ready = [s for s in servers if s.variant == variant and isinstance(s, ServerRecord)]
    failed = [s for s in servers if s.variant == variant and not isinstance(s, ServerRecord)]
    shown = [_shown_facts(s) for s in ready]
    keys = list(dict.fromkeys(k for facts in shown for k in facts))
    rows: list[list[Item]] = [[k, *(_fmt_fact(facts[k]) if k in facts else DASH for facts in shown)] for k in keys]
    notes = [Cell(f"{s.launch_dir or DASH}: {failure_line(s)}", cls="bad") for s in failed]
    return Table(title="What the server became (startup log, cross-checked with /metrics)",
                 headers=["Fact", *((s.launch_dir or DASH).rsplit("/", 1)[-1] for s in ready)] if ready else (),
                 rows=rows,
                 align="l" + "r" * len(ready), notes=notes)


def short_answers_rows(a: dict[str, Any]) -> list[list[str]]:
    """Seed 000's first table, generated: every number says whether it is one stream or the whole card."""
    def num(value: Any, unit: str = "") -> str:
        return DASH if value is None else f"{fmt_num(value)}{unit}"

    floor = a.get("useful_floor_tok_s")
    stream = names.name("per_request_tok_s")
    return [
        ["One request, nothing else running (single-stream)",
         f"{num(a.get('single_stream_tok_s'), f' {stream}')}, first token in {fmt_ms(a.get('single_stream_ttft_ms'))}"],
        ["The whole server, batched (aggregate peak)",
         f"{num(a.get('aggregate_peak_tok_s'), ' tok/s')}"
         + (f" at {a['aggregate_peak_concurrency']} concurrent" if a.get("aggregate_peak_concurrency") else "")],
        ["Prompt processing", num(a.get("prompt_tok_s"), " tok/s")],
        ["Context window", f"{num(a.get('context_window'))} tokens, prompt and completion share it"],
        ["Concurrent requests accepted (max-num-seqs)", num(a.get("max_num_seqs"))],
        [f"Concurrent requests that are useful (at {floor:g} {stream} each)" if floor else "Useful concurrency",
         num(a.get("useful_concurrency"))],
        *([[f"Capacity at the SLO ({slo['slo']})", capacity_text(slo)]] if (slo := a.get("capacity_at_slo")) else []),
    ]


def capacity_text(c: dict[str, Any]) -> str:
    """`7.3 req/s (held at 7.34, failed at 7.66); 30 streams at once`: the answer with its bracket."""
    rate = c.get("max_rate_rps")
    text = "none held it" if rate is None else f"{rate:.3g} req/s"
    if c.get("first_fail_rps") is not None:
        text += f" (held at {DASH if c.get('last_pass_rps') is None else format(c['last_pass_rps'], '.3g')}, " \
                f"failed at {c['first_fail_rps']:.3g})"
    if c.get("max_concurrency") is not None:
        text += f"; {c['max_concurrency']:g} streams at once"
    return text


def _changed(value: str, base: str | None) -> Cell:
    """A side-by-side value, highlighted where it differs from the baseline's."""
    return Cell(value, cls="changed" if base is not None and value != base else None)


def _side_by_side(title: str, first: str, by_variant: dict[str, dict[str, str]], baseline: str | None
                  ) -> Table | None:
    """Rows of named values, a column per variant in the order given, values that differ from the baseline's
    highlighted (baseline None: none are, as for measured values, which always differ by noise)."""
    if not by_variant:
        return None
    keys: list[str] = []
    for values in by_variant.values():
        keys += [n for n in values if n not in keys]
    base = by_variant.get(baseline or "", {})
    rows: list[list[Item]] = [[key, *(_changed(v.get(key, DASH), base.get(key) if variant != baseline else None)
                                     for variant, v in by_variant.items())] for key in keys]
    return Table(title=title, headers=[first, *by_variant], rows=rows, align="l" * (1 + len(by_variant)))


def short_answers_side_by_side(variants: Sequence[str], short: dict[str, dict[str, Any]]) -> Table | None:
    """Seed 000's first table with a column per variant: the questions down, the answers across (the diff,
    not a highlight, says which differences are beyond noise)."""
    return _side_by_side("Short answers, side by side", "Question",
                         {v: dict((q, a) for q, a in short_answers_rows(short[v])) for v in variants if v in short},
                         None)


def facts_side_by_side(variants: Sequence[str], servers: Sequence[ServerRecord | FailureRecord],
                       baseline: str | None) -> Table | None:
    """What each variant's server became, a column per variant (launches that disagree show every value)."""
    by_variant: dict[str, dict[str, str]] = {}
    for variant in variants:
        seen: dict[str, list[str]] = {}
        for server in servers:
            if server.variant != variant:
                continue
            if server.kind == "failure":
                seen.setdefault("launch", []).append(failure_line(server))
                continue
            for key, value in _shown_facts(server).items():
                values = seen.setdefault(key, [])
                if _fmt_fact(value) not in values:
                    values.append(_fmt_fact(value))
        by_variant[variant] = {k: " / ".join(v) for k, v in seen.items()}
    return _side_by_side("What the server became, side by side", "Fact", by_variant, baseline)


def decode_matrices_side_by_side(variants: Sequence[str], latest: dict[str, dict[str, CellResult]]) -> Table | None:
    """Every variant's decode matrix in one heat map: rows context, a column group per variant (its requests at
    once), shaded by share of the best Valid cell of any variant."""
    decode = {v: [c for c in latest.get(v, {}).values() if c.phase == "decode"] for v in variants}
    decode = {v: cells for v, cells in decode.items() if cells}
    if len(decode) < 2:
        return None
    contexts = sorted({c.context_tokens for cells in decode.values() for c in cells})
    groups = [(v, sorted({c.concurrency for c in cells})) for v, cells in decode.items()]
    by_key = {(v, c.context_tokens, c.concurrency): c for v, cells in decode.items() for c in cells}
    top = max((c.total_tok_s or 0.0 for cells in decode.values() for c in cells if c.status == "Valid"), default=0.0)
    rows: list[list[Item]] = [[fmt_context(ctx), *(_matrix_cell(by_key.get((v, ctx, conc)), top)
                                                   for v, concs in groups for conc in concs)] for ctx in contexts]
    return Table(title="Decode, every variant: total tok/s · rows context, columns variant and requests at once",
                 headers=["Context", *(f"{v} · {_concurrency_header(conc)}" for v, concs in groups for conc in concs)],
                 rows=rows, cls="heat")


def _naive_warning(a: dict[str, Any]) -> str:
    """The naive capacity's warning in the figures' names (the short answers' own sentence where its numbers
    are missing)."""
    naive, useful, floor = a.get("naive_capacity"), a.get("useful_concurrency"), a.get("useful_floor_tok_s")
    if naive is None or useful is None or not floor:
        return str(a["naive_capacity_warning"])
    stream = names.name("per_request_tok_s")
    return (f"peak {names.name('total_tok_s')} / floor = {naive} overstates capacity: {stream} falls as "
            f"concurrency rises, so the honest count at {floor:g} {stream} is {useful}")


def short_answers_notes(a: dict[str, Any]) -> list[str]:
    """The lines under the table: floors, the knee, the naive-capacity warning, the roofline, agents that fit."""
    lines: list[str] = []
    scale = a.get("time_scale") or 1.0
    if scale != 1.0:
        lines.append(f"note: simulated at a {scale:g}x time scale: these answers, like the cell tables, are in the "
                     "simulated hardware's time")
    capacity = a.get("capacity_at_floor") or {}
    if capacity:
        lines.append(f"Agents at a speed floor of {names.name('per_request_tok_s')}: " + ", ".join(
            f"{f} -> {DASH if c is None else c}" for f, c in capacity.items()))
    knee = a.get("knee")
    if knee:
        lines.append(f"Knee: {knee['concurrency']} -> {knee['next_concurrency']} concurrent buys "
                     f"{knee['aggregate_gain_pct']:+.0f}% {names.name('total_tok_s')} and costs "
                     f"{knee['per_request_loss_pct']:.0f}% of {names.name('per_request_tok_s')}: past it the server "
                     "only queues")
    if a.get("naive_capacity_warning"):
        lines.append(f"warning: {_naive_warning(a)}")
    roof = a.get("roofline") or {}
    if roof.get("known"):
        parts = [f"Roofline ({roof['gpus']} x {roof['hardware']}, {roof['model']}): single-stream decode bound "
                 f"{fmt_num(roof['decode_bound_tok_s'])} tok/s (weights/TP read per token, the group's bandwidth "
                 f"pooled), prefill bound {fmt_num(roof['prefill_bound_tok_s'])} tok/s (dense BF16 peak)"]
        if roof.get("decode_ratio") is not None:
            parts.append(f"decode runs at {100 * roof['decode_ratio']:.0f}% of its bandwidth bound")
        if roof.get("prefill_ratio") is not None:
            parts.append(f"prompt processing runs at {100 * roof['prefill_ratio']:.0f}% of the cards' compute")
        lines.append("; ".join(parts))
    elif roof.get("note"):
        lines.append(str(roof["note"]))
    fit = a.get("agents_that_fit") or {}
    beyond = set(a.get("agents_beyond_window") or [])
    if any(v is not None for v in fit.values()):
        lines.append("Agents that fit in the KV cache: " + ", ".join(
            f"{int(c):,} tokens -> {'beyond the window' if int(c) in beyond else DASH if n is None else n}"
            for c, n in fit.items()))
    return lines


def short_answers_table(variant: str, a: dict[str, Any]) -> Table:
    return Table(title=f"Short answers: {variant}", headers=["Question", "Answer"], rows=short_answers_rows(a),
                 align="ll", notes=[Cell(line, cls="warn" if line.startswith("warning") else None)
                                    for line in short_answers_notes(a)])


def short_answers_text(variant: str, a: dict[str, Any]) -> str:
    return to_text(short_answers_table(variant, a))


def experiments_table(stored: Sequence[ExperimentRecord]) -> Table | None:
    """The study's experiments, one row per variant and repeat (RunDir.experiments())."""
    rows: list[list[Item]] = [
        [item.variant, str(item.repeat + 1), item.result.key,
         Cell(item.result.status, cls=None if item.result.status == "Valid" else "bad"),
         item.result.verdict or "; ".join(item.result.reasons)] for item in stored]
    if not rows:
        return None
    return Table(title="Experiments", headers=["Variant", "Repeat", "Experiment", "Status", "Result"], rows=rows,
                 align="lrlll")


def experiments_text(stored: Sequence[ExperimentRecord]) -> str:
    return text([experiments_table(stored)])


ONE_REPEAT_WARNING = (
    "warning: repeats: 1 with more than one variant. The diff will show every change but judge none better or "
    "worse: one measurement a side has no interval, and a fixed noise floor is not one. It can conclude only "
    "from what is exact without repeats (KV cache, over-capacity cells, start-up failures), as keep or revert "
    "provisionally; anything else stays not settled. Use repeats: 2 or more (3 to 5 for a few percent) to judge "
    "speed and latency.")


def _pct(fraction: float) -> str:
    """13% and 35%, but 2.4% and 3% (a figure near the minimum effect needs its tenths, where it has any)."""
    if fraction >= 0.095:
        return f"{100 * fraction:.0f}%"
    return f"{100 * fraction:.1f}".removesuffix(".0") + "%"


MOST_LAUNCHES = 50  # a plan looks this far for the launches a side that would tell the minimum effect


def _at_most(plan: Plan) -> list[str]:
    """`repeats: auto`: what the night takes if no variant settles early."""
    if plan.at_most is None:
        return []
    rounds, launches, seconds = plan.at_most
    line = (f"repeats: auto: that is the first rounds; while a variant is open the night runs more, up to {rounds} "
            f"rounds: {launches} launches, {fmt_duration(seconds)} if none settles early")
    if plan.budget_s is not None:
        line += f" (the budget, {fmt_duration(plan.budget_s)}, stops it sooner)"
    return [line]


def power_notes(power: Sequence[Power], cells: list[CellSpec]) -> list[Cell]:
    """Per variant judged, the smallest change its launches can tell at this rig's noise (variants with the same
    figures share a line), a warning where that is above the minimum effect, and what would tell it. Nothing
    for one launch a side: ONE_REPEAT_WARNING says what that judges."""
    groups: dict[tuple[int, bool, int, float | None, str | None, float], list[str]] = {}
    for p in power:
        # Without a cell there is nothing counted to tell (experiments' values are judged, not counted here).
        if p.launches_a_side >= 2 and p.tests:
            key = (p.launches_a_side, p.until_settled, p.tests, p.noise.cv, p.noise.source, p.min_effect)
            groups.setdefault(key, []).append(p.variant)
    out = []
    for variants in groups.values():
        p = next(q for q in power if q.variant == variants[0])
        who = ", ".join(variants)
        launches = (f"up to {p.launches_a_side} launches a side (`repeats: auto`)" if p.until_settled
                    else f"{p.launches_a_side} launches a side")
        change = p.detectable_change
        if p.noise.cv is None or change is None:
            out.append(Cell(f"{who}: the smallest change {launches} can tell is unknown: this rig's noise between "
                            "launches is unknown (no earlier run of this campaign measured a cell on two launches, "
                            "and the profile's `rates:` state no `launch_noise`); 2 launches a side are needed to "
                            "learn it, and this night's will measure it"))
            continue
        noise = (f"its noise: {_pct(p.noise.cv)} between launches, {p.noise.source}; {p.tests} tests at "
                 f"family-wise {100 * FAMILY_ALPHA:g}%")
        if change <= p.min_effect:
            out.append(Cell(f"{who}: with {launches} this rig tells changes beyond ±{_pct(change)} ({noise}), "
                            f"within the minimum effect of {_pct(p.min_effect)}"))
            continue
        needed = p.launches_needed(cells, MOST_LAUNCHES)
        if needed is None:
            advice = (f"no number of launches up to {MOST_LAUNCHES} a side would tell it: the rig's noise is the "
                      "limit (a quieter machine, or a larger minimum effect)")
        elif p.until_settled:
            advice = f"max_repeats: {needed} would tell it"
        else:
            advice = f"more repeats ({needed} a side would tell it), or `repeats: auto`"
        out.append(Cell(f"warning: {who}: with {launches} this rig tells only changes beyond ±{_pct(change)} "
                        f"({noise}); the minimum effect is {_pct(p.min_effect)}: {advice}", cls="warn"))
    return out


def _planned_kv(v: VariantPlan, known_from: str | None) -> str:
    """A variant's KV cache in the plan: as the last run found it, as the simulator's memory model predicts it
    (said as a prediction: the launch's own log decides), or unknown until launched."""
    if v.refused:
        return f"none: {v.refused} (predicted by the simulator's memory model)"
    if v.kv_cache_tokens and v.predicted:
        return (f"about {v.kv_cache_tokens:,} tokens (predicted by the simulator's memory model; the launch's log "
                "decides)")
    if v.kv_cache_tokens and known_from:
        return f"{v.kv_cache_tokens:,} tokens (from {known_from})"
    return "unknown until launched"


def plan_tables(plan: Plan, *, repeats: int) -> list[Table]:
    """What `campaign plan` says a campaign will run: launches in order (a repeat past `repeats` is the drift
    sentinel), each variant's flags, KV cache (as the last run found it) and the cells it will skip as over
    capacity, the cells and experiments of every launch with what each is estimated to take, the total, and
    how the last run's launches compared with its own estimate."""

    est = plan.estimate
    known_from = plan.previous.root.name if plan.previous is not None else None
    order = Table(title=f"{len(plan.launches)} server launches, in this order (A B ... B A, so drift cannot read as "
                        "a difference)", headers=["#", "Variant", "Repeat", "Note"], align="rlrl",
                  rows=[[str(i), variant, str(rep + 1), "drift sentinel" if rep >= repeats else ""]
                        for i, (variant, rep) in enumerate(plan.launches, 1)])
    per_variant = Table(title="Variants", headers=["Variant", "Flags", "KV cache", "Over capacity: will be skipped"],
                        align="llll", rows=[
                            [v.name, ", ".join(f"{k}={x}" for k, x in v.flags.items()) or DASH,
                             _planned_kv(v, known_from), ", ".join(v.skipped) or DASH] for v in plan.variants],
                        notes=power_notes(est.power, plan.cells))
    if repeats == 1 and len(plan.variants) > 1:
        order = replace(order, notes=[Cell(ONE_REPEAT_WARNING, cls="warn")])
    rows = [[c.key, c.label, f"{cell_s(c, est.rates):,.0f} s"] for c in plan.cells]
    rows += [[key, "experiment", f"{seconds:,.0f} s"] for key, seconds in est.experiments_s.items()]
    correction = (f", x{est.rates.correction:.2f} for how far the last run's estimate was off"
                  if est.rates.correction != 1.0 else "")
    unknown = kv_unknown(plan)   # said beside the estimate it qualifies
    per_launch = Table(
        title=f"Every launch: {len(plan.cells)} cells, {len(est.experiments_s)} experiments",
        headers=["Cell or experiment", "Label", "Estimated"], align="llr", rows=rows,
        notes=[f"estimated duration: {fmt_duration(est.total_s)} = {len(plan.launches)} launch"
               f"{'es' if len(plan.launches) != 1 else ''} x "
               f"{fmt_duration(est.per_launch_s)} (start {est.launch_s:,.0f} s, cells with warm-up and warm check "
               f"{est.cells_s:,.0f} s, experiments {sum(est.experiments_s.values()):,.0f} s{correction})",
               *([unknown] if unknown else []),
               f"rates: {est.rates.prefill_tok_s:,.0f} {names.name('prompt_tok_s')}, {est.rates.decode_tok_s:,.1f} "
               f"{names.name('per_request_tok_s')} (single-stream), {est.rates.launch_s:,.0f} s to start: "
               f"{est.rates.source}"] + _at_most(plan))
    tables = [order, per_variant, per_launch]
    if plan.previous_times:
        tables.append(Table(
            title=f"The last run ({known_from}): each launch, estimated and actual",
            headers=["Launch", "Variant", "Repeat", "Estimated", "Actual"], align="llrrr",
            rows=[[t.launch_dir, t.variant, str(t.repeat + 1),
                   fmt_duration(t.estimated_s) if t.estimated_s is not None else DASH, fmt_duration(t.actual_s)]
                  for t in plan.previous_times]))
    return tables


# --- a matrix replayed on the simulator in simulated time (campaign simulate) ---------------------------------
class SimulatedCell(Protocol):
    """A cell as `campaign simulate`'s tables show it: a stored CellResult, or plan.replay's prediction."""

    @property
    def spec(self) -> CellSpec: ...
    @property
    def status(self) -> str: ...
    @property
    def reasons(self) -> list[str]: ...
    @property
    def reason_codes(self) -> list[Reason]: ...
    @property
    def total_tok_s(self) -> float | None: ...
    @property
    def per_request_tok_s(self) -> float | None: ...
    @property
    def prompt_tok_s(self) -> float | None: ...
    @property
    def ttft_ms(self) -> float | None: ...


def _virtual_cell(cell: SimulatedCell | None, other: SimulatedCell | None) -> Cell:
    if cell is None:
        return Cell(DASH)
    if cell.status == "Over capacity":
        return Cell("Over capacity", cls="cell over")
    if cell.status != "Valid":
        codes = ", ".join(dict.fromkeys(code.value for code in cell.reason_codes))
        # A window with no token has no decode figure to show, only the reason.
        value = DASH if Reason.NO_TOKENS_IN_WINDOW in cell.reason_codes else fmt_num(cell.total_tok_s)
        return Cell(f"{value} ({cell.status}{': ' + codes if codes else ''})", title="; ".join(cell.reasons),
                    cls="cell bad")
    shown = fmt_num(cell.total_tok_s)
    if other is not None and other.total_tok_s is not None and cell.total_tok_s:
        change = round(100 * (other.total_tok_s / cell.total_tok_s - 1))
        shown += f" ({change:+d}%)" if change else " (±0%)"
    return Cell(shown)


def virtual_tables(cells: Sequence[SimulatedCell], other: Sequence[SimulatedCell] = (),
                   other_mode: str | None = None) -> list[Table]:
    """The decode matrix (total tok/s in the hardware's units; with `other`, its change against each cell in
    brackets) and the prefill row of a matrix run in simulated time."""
    def sustained(of: Sequence[SimulatedCell]) -> list[SimulatedCell]:
        return [c for c in of if c.spec.phase == "decode" and c.spec.mode == "sustained"]

    decode = sustained(cells)
    by = {(c.spec.context_tokens, c.spec.concurrency): c for c in decode}
    against = {(c.spec.context_tokens, c.spec.concurrency): c for c in sustained(other)}
    contexts = sorted({c.spec.context_tokens for c in decode})
    streams = sorted({c.spec.concurrency for c in decode})
    modes = "/".join(sorted({c.spec.ttft for c in decode}))
    out = []
    if decode:
        rows: list[list[Item]] = [[fmt_context(ctx), *(_virtual_cell(by.get((ctx, s)), against.get((ctx, s)))
                                                       for s in streams)] for ctx in contexts]
        title = f"Sustained decode, total tok/s (TTFT {modes})"
        out.append(Table(title=title + (f"; in brackets: with TTFT {other_mode}" if other_mode else ""),
                         headers=["Context", *map(str, streams)], rows=rows))
    fixed = [c for c in cells if c.spec.phase == "decode" and c.spec.mode == "fixed"]
    if fixed:
        # Seed 000's fixed-count table: C requests at once, C x N tokens over the step's whole time.
        at = {(c.spec.context_tokens, c.spec.concurrency): c for c in fixed}
        columns = sorted({c.spec.concurrency for c in fixed})

        def ladder(c: SimulatedCell | None) -> Item:
            if c is None:
                return DASH
            if c.status != "Valid" or c.total_tok_s is None:
                return c.status
            return f"{fmt_num(c.total_tok_s)} ({fmt_num(c.per_request_tok_s)})"

        out.append(Table(title="Fixed-count decode, total tok/s (each request's own tok/s, TTFT excluded)",
                         headers=["Context", *map(str, columns)],
                         rows=[[fmt_context(ctx), *(ladder(at.get((ctx, s))) for s in columns)]
                               for ctx in sorted({c.spec.context_tokens for c in fixed})],
                         notes=[f"each rung: {names.name('total_tok_s')} ({names.name('per_request_tok_s')}); "
                                f"{names.name(TOTAL_OVER_STREAMS)} would be the total over the column's count"]))
    prefill = sorted((c for c in cells if c.spec.phase == "prefill"), key=lambda c: c.spec.context_tokens)
    if prefill:
        out.append(Table(title="Prefill (one request, max_tokens 1)", headers=["Context", "Prompt tok/s", "TTFT"],
                         rows=[[fmt_context(c.spec.context_tokens), fmt_num(c.prompt_tok_s, 0),
                                fmt_ms(c.ttft_ms)] for c in prefill]))
    return out
